"""Monitors of distribution shift (I3): staleness and behaviour/learner mismatch.

Per-token inputs, all ``[B, T]``:

- ``mask``: 1 on policy tokens (the only tokens any statistic uses);
- ``version``: int32 policy version that produced the token, -1 elsewhere;
- ``behaviour_logp``: log-prob under the policy that sampled the token (the
  rollout engine);
- ``learner_logp``: log-prob recomputed by the learner before the update.

Staleness of a token is ``current_version - version``. The mismatch statistics
use ``delta_t = learner_logp - behaviour_logp``; the K3 estimator
``exp(delta) - delta - 1`` averages to KL(behaviour || learner) under behaviour
samples (the "vllm-kl" monitor of Liu, Li et al. 2025; see
docs/references.md#mismatch-monitor-and-alarm). Jittable; ``check_versions``
is the host-side validator for data that has arrived on the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_token_shapes(**arrays) -> None:
  """ValueError unless every named array is ``[B, T]`` with one shared shape."""
  shapes = {name: jnp.shape(a) for name, a in arrays.items()}
  first = next(iter(shapes.values()))
  if len(first) != 2 or any(s != first for s in shapes.values()):
    raise ValueError(f"per-token inputs must all be [B, T] of one shape, got {shapes}")


def check_versions(version_BxT: np.ndarray, mask_BxT: np.ndarray, current_version: int) -> None:
  """Host-side check: policy tokens have ``0 <= version <= current_version``.

  Raises:
    ValueError: naming the first offending row, so a trainer bug (a version
      from the future, an unversioned policy token) fails loudly.
  """
  version = np.asarray(version_BxT)
  mask = np.asarray(mask_BxT).astype(bool)
  check_token_shapes(version=version, mask=mask)
  bad = mask & ((version < 0) | (version > current_version))
  if bad.any():
    row = int(np.argwhere(bad)[0, 0])
    raise ValueError(f"policy tokens must have 0 <= version <= current_version={current_version}; "
                     f"row {row} has versions {np.unique(version[row][mask[row]]).tolist()}")


def staleness(version_BxT: jax.Array, mask_BxT: jax.Array, current_version: int | jax.Array) -> jax.Array:
  """int32 ``[B, T]`` policy-version lag, 0 on non-policy tokens."""
  check_token_shapes(version=version_BxT, mask=mask_BxT)
  lag = jnp.asarray(current_version, jnp.int32) - jnp.asarray(version_BxT, jnp.int32)
  return jnp.where(jnp.asarray(mask_BxT, bool), lag, 0)


def staleness_histogram(version_BxT: jax.Array, mask_BxT: jax.Array,
                        current_version: int | jax.Array, num_bins: int) -> jax.Array:
  """Policy tokens per staleness: int32 ``[num_bins]``, bin i = lag i, the last bin = lag >= num_bins - 1."""
  lag = staleness(version_BxT, mask_BxT, current_version)
  bins = jnp.clip(lag, 0, num_bins - 1)
  return jax.ops.segment_sum(jnp.asarray(mask_BxT, jnp.int32).reshape(-1), bins.reshape(-1),
                             num_segments=num_bins)


def mismatch_metrics(behaviour_logp_BxT: jax.Array, learner_logp_BxT: jax.Array,
                     mask_BxT: jax.Array) -> dict[str, jax.Array]:
  """Behaviour vs learner log-prob gap over the policy tokens (the I3
  train/inference mismatch monitor).

  With ``delta = learner_logp - behaviour_logp``: ``logprob_mismatch_mean`` and
  ``_max`` (``|delta|``), ``prob_mismatch_max`` (``|p_learner -
  p_behaviour|``), ``kl_behaviour_learner`` (mean of the K3 estimator
  ``exp(delta) - delta - 1`` of KL(behaviour || learner)), ``is_ratio_mean``
  and ``is_ratio_max`` (``exp(delta)``). float32 scalars; 0 when the mask is
  empty.
  """
  check_token_shapes(mask=mask_BxT, behaviour_logp=behaviour_logp_BxT,
                     learner_logp=learner_logp_BxT)
  mask = jnp.asarray(mask_BxT, bool)
  behaviour = jnp.asarray(behaviour_logp_BxT, jnp.float32)
  learner = jnp.asarray(learner_logp_BxT, jnp.float32)
  delta = jnp.where(mask, learner - behaviour, 0.0)
  ratio = jnp.exp(delta)
  mean, maximum = _masked_reducers(mask)
  return {
      "logprob_mismatch_max": maximum(jnp.abs(delta)),
      "logprob_mismatch_mean": mean(jnp.abs(delta)),
      "prob_mismatch_max": maximum(jnp.abs(jnp.exp(learner) - jnp.exp(behaviour))),
      "kl_behaviour_learner": mean(jnp.expm1(delta) - delta),
      "is_ratio_mean": mean(ratio),
      "is_ratio_max": maximum(ratio),
  }


def _masked_reducers(mask_BxT: jax.Array):
  """``(mean, max)`` over the masked entries; both 0 when none is."""
  n = jnp.maximum(jnp.sum(mask_BxT), 1).astype(jnp.float32)

  def mean(x):
    return jnp.sum(jnp.where(mask_BxT, x, 0.0)) / n

  def maximum(x):
    return jnp.max(jnp.where(mask_BxT, x, 0), initial=0)

  return mean, maximum


def shift_metrics(mask_BxT: jax.Array, behaviour_logp_BxT: jax.Array, learner_logp_BxT: jax.Array,
                  version_BxT: jax.Array, current_version: int | jax.Array) -> dict[str, jax.Array]:
  """The ``shift/*`` monitors of the data as collected (before any correction).

  Returns:
    ``shift/staleness_mean``, ``shift/staleness_max``, ``shift/stale_token_frac``
    (lag > 0), and :func:`mismatch_metrics` under ``shift/``. All over policy
    tokens; 0 when there are none.
  """
  check_token_shapes(mask=mask_BxT, behaviour_logp=behaviour_logp_BxT,
                     learner_logp=learner_logp_BxT, version=version_BxT)
  mask = jnp.asarray(mask_BxT, bool)
  lag = staleness(version_BxT, mask, current_version)
  mean, maximum = _masked_reducers(mask)
  metrics = {
      "shift/staleness_mean": mean(lag.astype(jnp.float32)),
      "shift/staleness_max": maximum(lag).astype(jnp.float32),
      "shift/stale_token_frac": mean((lag > 0).astype(jnp.float32)),
  }
  mismatch = mismatch_metrics(behaviour_logp_BxT, learner_logp_BxT, mask)
  metrics.update({f"shift/{k}": v for k, v in mismatch.items()})
  return metrics
