"""Monitors of the learning signal (I2): are groups informative, do tokens carry gradient?

All functions are jittable array math (``num_groups`` static). Groups use the
uniform ``[P, G]`` or ragged ``[B]`` + ``group_B`` layout of
``agentic_rl.invariants.segments``.

A group is *zero-variance* when its binary outcomes are all equal (all success
or all failure, or a single rollout): a group-relative advantage is then zero
and the group yields no gradient (DAPO, arXiv 2503.14476; Knapsack RL, arXiv 2509.25849).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentic_rl.invariants.segments import flatten_groups, group_sum


def group_outcome_counts(success: jax.Array, group_B: jax.Array | None = None,
                         num_groups: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Rollouts and successes per group.

  Args:
    success: bool ``[P, G]``, or ``[B]`` with ``group_B``.
    group_B, num_groups: the ragged layout (see ``groups.flatten_groups``).

  Returns:
    ``(count_G, successes_G)``, int32 ``[num_groups]`` each.
  """
  success_B, group_B, num_groups = flatten_groups(success, group_B, num_groups, "success")
  count = group_sum(jnp.ones_like(group_B), group_B, num_groups)
  successes = group_sum(success_B.astype(jnp.int32), group_B, num_groups)
  return count, successes


def _frac(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
  return numerator.astype(jnp.float32) / jnp.maximum(denominator, 1).astype(jnp.float32)


def zero_variance_frac(success: jax.Array, group_B: jax.Array | None = None,
                       num_groups: int | None = None) -> jax.Array:
  """Fraction of (non-empty) groups whose binary outcomes are all equal.

  ``mean_g 1[s_g = 0 or s_g = n_g]`` over groups with ``n_g > 0`` rollouts,
  ``s_g`` successes. float32 scalar; 0 when every group is empty.
  """
  count, successes = group_outcome_counts(success, group_B, num_groups)
  present = count > 0
  degenerate = present & ((successes == 0) | (successes == count))
  return _frac(jnp.sum(degenerate), jnp.sum(present))


def _token_layout(advantages: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """Broadcasts per-sequence advantages ``[B]`` to ``[B, T]``; checks shapes."""
  if advantages.ndim == 1 and advantages.shape[0] == mask_BxT.shape[0]:
    return jnp.broadcast_to(advantages[:, None], mask_BxT.shape)
  if advantages.shape != mask_BxT.shape:
    raise ValueError(f"advantages must be [B] or [B, T] = {mask_BxT.shape}, got {advantages.shape}")
  return advantages


def signal_metrics(success: jax.Array, advantages: jax.Array, mask_BxT: jax.Array,
                   loss_weight_BxT: jax.Array | None = None, group_B: jax.Array | None = None,
                   num_groups: int | None = None, adv_eps: float = 1e-6) -> dict[str, jax.Array]:
  """The ``signal/*`` metrics of one training batch.

  Args:
    success: bool binary outcomes, ``[P, G]`` (rows of the batch in prompt-major
      order) or ``[B]`` with ``group_B``.
    advantages: float ``[B]`` (one per rollout) or ``[B, T]`` (per token).
    mask_BxT: 1 on policy tokens.
    loss_weight_BxT: optional per-token loss weights after masking/corrections
      (for example the ``shift`` weights); a token with weight 0 carries no
      gradient. Defaults to ``mask_BxT``.
    group_B, num_groups: the ragged layout.
    adv_eps: an advantage with ``|A| <= adv_eps`` counts as zero.

  Returns:
    ``signal/zero_variance_frac``, ``signal/all_correct_frac``,
    ``signal/all_wrong_frac`` (over non-empty groups), ``signal/success_mean``
    (over rollouts), ``signal/adv_std`` (standard deviation of the advantage
    over policy tokens), ``signal/effective_token_frac`` (fraction of policy
    tokens with a non-zero advantage and a non-zero loss weight: the
    effective-gradient ratio of Knapsack RL), ``signal/nonzero_grad_rollouts``
    (the number of rollouts with at least one such token: the samples that
    carry a gradient).
  """
  count, successes = group_outcome_counts(success, group_B, num_groups)
  present = count > 0
  n_groups = jnp.sum(present)
  all_correct = present & (successes == count)
  all_wrong = present & (successes == 0)

  mask = jnp.asarray(mask_BxT).astype(jnp.float32)
  if mask.ndim != 2 or mask.shape[0] != jnp.size(success):
    raise ValueError(f"mask must be [B, T] with B = {jnp.size(success)} rows (one per rollout), "
                     f"got shape {mask.shape}")
  adv = _token_layout(jnp.asarray(advantages), mask).astype(jnp.float32)
  weight = mask if loss_weight_BxT is None else jnp.asarray(loss_weight_BxT, jnp.float32)
  if weight.shape != mask.shape:
    raise ValueError(f"loss_weight must have the mask's shape {mask.shape}, got {weight.shape}")
  n_tokens = jnp.sum(mask)
  adv_mean = jnp.sum(adv * mask) / jnp.maximum(n_tokens, 1.0)
  adv_var = jnp.sum(jnp.square(adv - adv_mean) * mask) / jnp.maximum(n_tokens, 1.0)
  effective = mask * (jnp.abs(adv) > adv_eps) * (weight != 0)
  return {
      "signal/zero_variance_frac": _frac(jnp.sum(all_correct | all_wrong), n_groups),
      "signal/all_correct_frac": _frac(jnp.sum(all_correct), n_groups),
      "signal/all_wrong_frac": _frac(jnp.sum(all_wrong), n_groups),
      "signal/success_mean": _frac(jnp.sum(successes), jnp.sum(count)),
      "signal/adv_std": jnp.sqrt(adv_var),
      "signal/effective_token_frac": jnp.sum(effective) / jnp.maximum(n_tokens, 1.0),
      "signal/nonzero_grad_rollouts": jnp.sum(jnp.any(effective > 0, axis=1)).astype(jnp.float32),
  }
