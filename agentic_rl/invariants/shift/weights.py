"""Per-token loss weights that bound and correct distribution shift (I3).

``shift_weights`` is the one entry point a trainer needs: it multiplies

1. staleness enforcement: weight 0 for tokens older than ``max_staleness``
   versions (so they never enter an update), optionally ``decay ** lag``
   within the bound;
2. partial-rollout masking: weight 0 for segments produced by parameters
   older than the newest segment of the same sequence (``partial_rollout='mask'``);
3. the behaviour/learner correction (TIS, MIS/IcePop, token mask, OPSM),

and returns float32 ``[B, T]`` weights that already include the policy mask,
to be multiplied into the per-token loss (the objectives take them as data:
no gradient flows through them), plus ``shift/*`` statistics.

Corrections use ``log r_t = learner_logp - behaviour_logp`` (``algorithms.md``
§9.6), at token, sequence (``sum_t log r_t``) or geometric
(``mean_t log r_t``) level; every ratio is formed in log space and clipped
before ``exp`` so no weight overflows.
"""

from __future__ import annotations

import math

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
                            mask_BxT: jax.Array) -> jax.Array:
  """float32 ``[B, T]``: with ``partial_rollout='mask'``, only each sequence's newest-version tokens.

  Otherwise the policy mask.
  """
  mask = jnp.asarray(mask_BxT, bool)
  if config.partial_rollout != "mask":
    return mask.astype(jnp.float32)
  version = jnp.asarray(version_BxT, jnp.int32)
  newest = jnp.max(jnp.where(mask, version, -1), axis=1, keepdims=True)
  return (mask & (version == newest)).astype(jnp.float32)


def _log_ratio(level: str, delta: jax.Array, mask: jax.Array) -> jax.Array:
  if level == "token":
    return delta
  total = jnp.sum(delta, axis=1, keepdims=True)
  if level == "geometric":
    total = total / jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1).astype(jnp.float32)
  return jnp.broadcast_to(total, delta.shape)


def correction_weights(config: ShiftConfig, behaviour_logp_BxT: jax.Array,
                       learner_logp_BxT: jax.Array, mask_BxT: jax.Array,
                       advantages: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The behaviour/learner correction of ``config.correction``.

  Args:
    config: ``correction``, ``correction_level`` and their parameters.
    behaviour_logp_BxT, learner_logp_BxT: float log-probs of the sampled tokens.
    mask_BxT: 1 on policy tokens.
    advantages: float ``[B]`` or ``[B, T]``; needed by ``opsm`` only.

  Returns:
    ``(weights_BxT, stats)``: float32 weights, 0 off policy tokens, with
    (``rho`` the ratio at the chosen level)
    ``tis``: ``min(rho, C)``; ``mis``: ``rho * 1[low <= rho <= high]``;
    ``mask``: ``1[low <= rho <= high]``; ``opsm``: ``0`` where ``A < 0`` and
    ``mean_t log(pi_behaviour / pi_learner) > delta``, else 1; ``none``: 1.
    Stats: ``shift/correction_weight_mean``, ``shift/correction_zeroed_frac``
    (policy tokens given weight 0) and ``shift/correction_truncated_frac``
    (policy tokens whose ratio exceeded C under ``tis``; 0 otherwise).
  """
  check_token_shapes(mask=mask_BxT, behaviour_logp=behaviour_logp_BxT,
                    learner_logp=learner_logp_BxT)
  mask = jnp.asarray(mask_BxT, bool)
  maskf = mask.astype(jnp.float32)
  delta = jnp.where(mask, jnp.asarray(learner_logp_BxT, jnp.float32)
                    - jnp.asarray(behaviour_logp_BxT, jnp.float32), 0.0)
  truncated = jnp.zeros_like(mask)
  if config.correction == "none":
    weight = maskf
  elif config.correction == "opsm":
    if advantages is None:
      raise ValueError("correction='opsm' needs the advantages")
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == 1 and adv.shape[0] == mask.shape[0]:
      adv = jnp.broadcast_to(adv[:, None], mask.shape)
    if adv.shape != mask.shape:
      raise ValueError(f"advantages must be [B] or [B, T] = {mask.shape}, got {adv.shape}")
    divergence = -_log_ratio("geometric", delta, maskf)  # mean_t log(pi_b / pi_l)
    weight = jnp.where((adv < 0) & (divergence > config.opsm_delta), 0.0, maskf)
  else:
    log_rho = _log_ratio(config.correction_level, delta, maskf)
    if config.correction == "tis":
      log_c = math.log(config.tis_clip)
      weight = jnp.exp(jnp.minimum(log_rho, log_c)) * maskf
      truncated = mask & (log_rho > log_c)
    else:
      log_low = math.log(config.ratio_low) if config.ratio_low > 0 else -math.inf
      log_high = math.log(config.ratio_high)
      inside = (log_rho >= log_low) & (log_rho <= log_high)
      rho = jnp.exp(jnp.clip(log_rho, log_low, log_high))
      weight = jnp.where(inside, rho if config.correction == "mis" else 1.0, 0.0) * maskf
  n = jnp.maximum(jnp.sum(maskf), 1.0)
  stats = {
      "shift/correction_weight_mean": jnp.sum(weight) / n,
      "shift/correction_zeroed_frac": jnp.sum(mask & (weight == 0)) / n,
      "shift/correction_truncated_frac": jnp.sum(truncated) / n,
  }
  return weight, stats


def shift_weights(config: ShiftConfig, mask_BxT: jax.Array, version_BxT: jax.Array,
                  current_version: int | jax.Array, behaviour_logp_BxT: jax.Array,
                  learner_logp_BxT: jax.Array,
                  advantages: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """All shift controls at once: staleness x partial rollout x correction.

  Args:
    config: the shift config (static).
    mask_BxT: 1 on policy tokens.
    version_BxT: int32 policy version of each token (-1 off policy tokens).
    current_version: the learner's version (int or int32 scalar).
    behaviour_logp_BxT, learner_logp_BxT: float log-probs.
    advantages: ``[B]`` or ``[B, T]``; needed by ``opsm`` only.

  Returns:
    ``(weights_BxT, stats)``: float32 loss weights including the policy mask,
    and ``shift/stale_dropped_frac``, ``shift/partial_masked_frac`` (policy
    tokens zeroed by each control), the correction stats,
    ``shift/weight_zero_frac`` (policy tokens with final weight 0) and
    ``shift/update_staleness_max`` (largest lag among tokens with weight > 0:
    never above ``max_staleness``).
  """
  check_token_shapes(mask=mask_BxT, version=version_BxT, behaviour_logp=behaviour_logp_BxT,
                    learner_logp=learner_logp_BxT)
  mask = jnp.asarray(mask_BxT, bool)
  n = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
  stale = staleness_weights(config, version_BxT, mask, current_version)
  partial = partial_rollout_weights(config, version_BxT, mask)
  corrected, stats = correction_weights(config, behaviour_logp_BxT, learner_logp_BxT, mask,
                                        advantages)
  weight = stale * partial * corrected
  lag = staleness(version_BxT, mask, current_version)
  stats.update({
      "shift/stale_dropped_frac": jnp.sum(mask & (stale == 0)) / n,
      "shift/partial_masked_frac": jnp.sum(mask & (partial == 0)) / n,
      "shift/weight_zero_frac": jnp.sum(mask & (weight == 0)) / n,
      "shift/update_staleness_max": jnp.max(jnp.where(weight > 0, lag, 0), initial=0)
                                    .astype(jnp.float32),
  })
  return weight, stats
