"""Per-token loss weights that bound distribution shift (I3).

``shift_weights`` multiplies

1. staleness enforcement: weight 0 for tokens older than ``max_staleness``
   versions (so they never enter an update), optionally ``decay ** lag``
   within the bound;
2. partial-rollout masking: weight 0 for segments produced by parameters
   older than the newest segment of the same sequence (``partial_rollout='mask'``),

and returns float32 ``[B, T]`` weights that already include the policy mask.
In ``drop`` mode they are 0/1: pass them as the loss mask. ``downweight`` makes
them fractional, which a loss must multiply in per token. The behaviour/learner
importance corrections are separate loss terms
(``agentic_rl.objectives.corrections``) and multiply on top.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentic_rl.invariants.shift.config import ShiftConfig
from agentic_rl.invariants.shift.monitors import check_token_shapes, staleness


def staleness_weights(config: ShiftConfig, version_BxT: jax.Array, mask_BxT: jax.Array,
                      current_version: int | jax.Array) -> jax.Array:
  """float32 ``[B, T]``: the policy mask, zeroed beyond ``max_staleness``.

  ``drop``: ``1[lag <= max_staleness]``; ``downweight``: that times
  ``stale_decay ** lag``. Without ``max_staleness``, the mask itself.
  """
  mask = jnp.asarray(mask_BxT, bool)
  if config.max_staleness is None:
    return mask.astype(jnp.float32)
  lag = staleness(version_BxT, mask, current_version)
  weight = (mask & (lag <= config.max_staleness)).astype(jnp.float32)
  if config.stale_mode == "downweight":
    weight = weight * jnp.float32(config.stale_decay) ** jnp.maximum(lag, 0).astype(jnp.float32)
  return weight


def partial_rollout_weights(config: ShiftConfig, version_BxT: jax.Array,
                            mask_BxT: jax.Array, newest_B: jax.Array | None = None
                            ) -> jax.Array:
  """float32 ``[B, T]``: with ``partial_rollout='mask'``, only each
  episode's newest-version tokens: ``newest_B`` (int, the newest version in
  the row's episode, which may span several rows: context segments), by
  default the row's own newest.

  Otherwise the policy mask.
  """
  mask = jnp.asarray(mask_BxT, bool)
  if config.partial_rollout != "mask":
    return mask.astype(jnp.float32)
  version = jnp.asarray(version_BxT, jnp.int32)
  newest = (jnp.max(jnp.where(mask, version, -1), axis=1) if newest_B is None
            else jnp.asarray(newest_B, jnp.int32))
  return (mask & (version == newest[:, None])).astype(jnp.float32)


def shift_weights(config: ShiftConfig, mask_BxT: jax.Array, version_BxT: jax.Array,
                  current_version: int | jax.Array, newest_B: jax.Array | None = None
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Staleness enforcement times partial-rollout masking.

  Args:
    config: the shift config (static).
    mask_BxT: 1 on policy tokens.
    version_BxT: int32 policy version of each token (-1 off policy tokens).
    current_version: the learner's version (int or int32 scalar).
    newest_B: the newest version of each row's episode, where an episode
      spans several rows (:func:`partial_rollout_weights`).

  Returns:
    ``(weights_BxT, stats)``: float32 loss weights including the policy mask,
    and ``shift/stale_dropped_frac``, ``shift/partial_masked_frac`` (policy
    tokens zeroed by each control), ``shift/weight_zero_frac`` (policy tokens
    with final weight 0) and ``shift/update_staleness_max`` (largest lag among
    tokens with weight > 0: never above ``max_staleness``).
  """
  check_token_shapes(mask=mask_BxT, version=version_BxT)
  mask = jnp.asarray(mask_BxT, bool)
  n = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
  stale = staleness_weights(config, version_BxT, mask, current_version)
  partial = partial_rollout_weights(config, version_BxT, mask, newest_B)
  weight = stale * partial
  lag = staleness(version_BxT, mask, current_version)
  stats = {
      "shift/stale_dropped_frac": jnp.sum(mask & (stale == 0)) / n,
      "shift/partial_masked_frac": jnp.sum(mask & (partial == 0)) / n,
      "shift/weight_zero_frac": jnp.sum(mask & (weight == 0)) / n,
      "shift/update_staleness_max": jnp.max(jnp.where(weight > 0, lag, 0), initial=0)
                                    .astype(jnp.float32),
  }
  return weight, stats
