"""Loss aggregation over ``[B, T]`` per-token terms, with global normalisers.

A per-token loss ``l[b, t]`` (zero weight where ``mask[b, t] == 0``) becomes a
scalar in one of four ways (``len_b = sum_t mask[b, t]``):

==========================  ===================================================
mode                        scalar
==========================  ===================================================
``token_mean``              ``sum_{b,t} l / num_tokens``  (DAPO token-level)
``seq_mean_token_mean``     ``sum_b (sum_t l / len_b) / num_seqs``  (GRPO)
``seq_mean_token_sum``      ``sum_{b,t} l / num_seqs``
``seq_mean_token_sum_norm`` ``sum_{b,t} l / (num_seqs * horizon)``  (Dr. GRPO)
==========================  ===================================================

``num_tokens`` (masked tokens) and ``num_seqs`` (rows with at least one masked
token) default to the counts of the arrays at hand; ``horizon`` defaults to
``T``. Every mode is a *sum* of per-row terms divided by a normaliser, so a
learner that splits a batch into micro-batches (or over data-parallel devices)
gets the whole-batch update by passing the whole batch's
:func:`batch_normalisers` to every piece and summing the gradients. This is
verl's ``agg_loss`` with global counts; Dr. GRPO (arXiv 2503.20783) divides the
token sum by a constant generation budget instead of ``len_b``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AGG_MODES = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)


def check_agg_mode(mode: str) -> None:
  """Raise ``ValueError`` unless ``mode`` is one of :data:`AGG_MODES`."""
  if mode not in AGG_MODES:
    raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")


def batch_normalisers(mask_BxT: jax.Array) -> dict[str, jax.Array]:
  """The global normalisers of a whole batch: ``num_tokens`` and ``num_seqs``.

  Compute these once on the full batch and pass them (as keywords) to the loss
  of every micro-batch or data-parallel shard.
  """
  valid = jnp.asarray(mask_BxT) != 0
  return {
      "num_tokens": valid.sum().astype(jnp.float32),
      "num_seqs": valid.any(axis=-1).sum().astype(jnp.float32),
  }


def aggregate(
    values_BxT: jax.Array,
    mask_BxT: jax.Array,
    mode: str = "token_mean",
    *,
    num_tokens: jax.Array | float | None = None,
    num_seqs: jax.Array | float | None = None,
    horizon: int | None = None,
) -> jax.Array:
  """Reduce per-token values ``[B, T]`` to a float32 scalar (module docstring).

  Positions where ``mask_BxT == 0`` contribute nothing, whatever their value
  (even NaN). Normalisers below 1 are treated as 1, so an all-masked batch
  gives 0, never NaN.
  """
  check_agg_mode(mode)
  if values_BxT.ndim != 2 or values_BxT.shape != mask_BxT.shape:
    raise ValueError(
        f"aggregate needs values and mask of the same shape [B, T], got {values_BxT.shape} "
        f"and {mask_BxT.shape}")
  if horizon is not None and horizon <= 0:
    raise ValueError(f"horizon must be a positive number of tokens, got {horizon}")
  valid = mask_BxT != 0
  values = jnp.where(valid, values_BxT.astype(jnp.float32), 0.0)
  counts = batch_normalisers(valid)
  num_tokens = counts["num_tokens"] if num_tokens is None else num_tokens
  num_seqs = counts["num_seqs"] if num_seqs is None else num_seqs
  horizon = values_BxT.shape[1] if horizon is None else horizon
  if mode == "token_mean":
    return values.sum() / jnp.maximum(num_tokens, 1.0)
  if mode == "seq_mean_token_mean":
    lengths_B = valid.sum(axis=-1).astype(jnp.float32)
    return (values.sum(axis=-1) / jnp.maximum(lengths_B, 1.0)).sum() / jnp.maximum(num_seqs, 1.0)
  if mode == "seq_mean_token_sum":
    return values.sum() / jnp.maximum(num_seqs, 1.0)
  return values.sum() / (jnp.maximum(num_seqs, 1.0) * horizon)


def masked_mean(values_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """Mean over masked positions (0 when none), for metrics."""
  valid = mask_BxT != 0
  total = jnp.where(valid, values_BxT.astype(jnp.float32), 0.0).sum()
  return total / jnp.maximum(valid.sum(), 1).astype(jnp.float32)


def masked_max(values_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """Max over masked positions (0 when none), for metrics."""
  valid = mask_BxT != 0
  masked = jnp.where(valid, values_BxT.astype(jnp.float32), -jnp.inf)
  return jnp.where(valid.any(), masked.max(), 0.0)
