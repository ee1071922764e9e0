"""Monitors of exploration (I1): does the policy keep several distinct, feasible paths?

Token entropy alone says little about agentic exploration, so these work at the
level of *strategies*: the canonical tool-call sequence of each rollout
(``call_hashes``: one int32 hash per environment step, tool id plus normalised
arguments; ``-1`` marks padding and steps that were not tool calls and is
reserved for that). A rollout's sequence is its non-(-1) hashes in order, so
two rollouts follow the same strategy iff those sequences are equal.
No standard definition exists (docs/references.md#strategy-level-diversity);
these are the project's:

- distinct tool-call sequences per group, and the same among successful
  rollouts (the number of distinct *feasible* paths);
- the Shannon entropy (nats) of tool-call n-grams over the batch;
- the mean pairwise edit distance between a group's tool-call sequences,
  normalised by the longer sequence;
- pass@k (unbiased estimator of Chen et al. 2021, arXiv 2107.03374):
  ``1 - C(n - c, k) / C(n, k)`` for c successes in n samples; pass@k - pass@1
  measures coverage beyond the mode.

All functions are jittable (``num_groups``, ``n`` and ``k`` static).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from agentic_rl.invariants.segments import distinct_per_group, flatten_groups, group_sum

PAD_HASH = -1


def token_entropy_mean(entropy_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """Mean per-token policy entropy over policy tokens (float32 scalar; 0 if none)."""
  entropy = jnp.asarray(entropy_BxT, jnp.float32)
  mask = jnp.asarray(mask_BxT, jnp.float32)
  if entropy.shape != mask.shape or entropy.ndim != 2:
    raise ValueError(f"entropy {entropy.shape} and mask {mask.shape} must both be [B, T]")
  return jnp.sum(entropy * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def compact_calls(call_hashes: jax.Array) -> jax.Array:
  """Moves every -1 to the end of its row, keeping the calls' order: ``[..., C]``."""
  hashes = jnp.asarray(call_hashes)
  if not jnp.issubdtype(hashes.dtype, jnp.integer):
    raise ValueError(f"call_hashes must be integers, got {hashes.dtype}")
  order = jnp.argsort(hashes == PAD_HASH, axis=-1, stable=True)
  return jnp.take_along_axis(hashes, order, axis=-1)


def _hash_rows(call_hashes: jax.Array, group_B, num_groups) -> tuple[jax.Array, jax.Array, int]:
  hashes = compact_calls(call_hashes)
  hashes_BxC, group_B, num_groups = flatten_groups(hashes, group_B, num_groups, "call_hashes")
  if hashes_BxC.ndim != 2:
    raise ValueError("call_hashes must be [P, G, C] (or [B, C] with group_B), got shape "
                     f"{hashes.shape}")
  return hashes_BxC, group_B, num_groups


def distinct_sequences(call_hashes: jax.Array, success: jax.Array | None = None,
                       group_B: jax.Array | None = None,
                       num_groups: int | None = None) -> jax.Array:
  """Number of distinct tool-call sequences in each group.

  Args:
    call_hashes: int ``[P, G, C]``, or ``[B, C]`` with ``group_B``.
    success: optional bool ``[P, G]`` / ``[B]``: count successful rollouts only.
    group_B, num_groups: the ragged layout.

  Returns:
    int32 ``[num_groups]``.
  """
  hashes_BxC, group_B, num_groups = _hash_rows(call_hashes, group_B, num_groups)
  include = None
  if success is not None:
    include = jnp.asarray(success, bool).reshape(-1)
    if include.shape[0] != hashes_BxC.shape[0]:
      raise ValueError(f"success has {include.shape[0]} rollouts, call_hashes {hashes_BxC.shape[0]}")
  return distinct_per_group(hashes_BxC, group_B, num_groups, include)


def ngram_entropy(call_hashes: jax.Array, n: int = 2) -> jax.Array:
  """Shannon entropy (nats) of the tool-call n-grams of a batch.

  Every window of n consecutive calls inside a rollout's sequence is one
  n-gram. ``-sum_u q_u log q_u`` with ``q_u``
  the empirical frequency of n-gram u; 0 when there is none.

  Args:
    call_hashes: int ``[..., C]`` (any leading shape).
    n: the n-gram order, >= 1 (static).
  """
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"n must be a positive int, got {n!r}")
  hashes = compact_calls(call_hashes)
  hashes = hashes.reshape(-1, hashes.shape[-1])
  num_calls = hashes.shape[1]
  if num_calls < n or hashes.shape[0] == 0:
    return jnp.float32(0.0)
  windows = jnp.stack([hashes[:, i:num_calls - n + 1 + i] for i in range(n)], axis=-1)
  grams = windows.reshape(-1, n)  # [M, n]
  valid = jnp.all(grams != PAD_HASH, axis=1)
  order = jnp.lexsort(tuple(grams[:, i] for i in reversed(range(n))) + (~valid,))
  grams, valid = grams[order], valid[order]
  changed = jnp.any(grams[1:] != grams[:-1], axis=1) | (valid[1:] != valid[:-1])
  new_run = jnp.concatenate([jnp.ones((1,), bool), changed])
  run_id = jnp.cumsum(new_run) - 1
  counts = jax.ops.segment_sum(valid.astype(jnp.float32), run_id, num_segments=grams.shape[0])
  total = jnp.sum(counts)
  q = counts / jnp.maximum(total, 1.0)
  return -jnp.sum(jnp.where(counts > 0, q * jnp.log(jnp.where(counts > 0, q, 1.0)), 0.0))


def pairwise_edit_distance(call_hashes_PxGxC: jax.Array) -> jax.Array:
  """Mean normalised Levenshtein distance between the tool-call sequences of a group.

  For every pair g < h of a group: ``lev(a_g, a_h) / max(|a_g|, |a_h|)`` (0 for
  two empty sequences), averaged over the G(G-1)/2 pairs (0 when G = 1).
  The DP row update uses ``D[i, j] = j + cummin_k (E[k] - k)`` so each row is
  one vectorised step (no loop over j).

  Args:
    call_hashes_PxGxC: int ``[P, G, C]`` (uniform layout only).

  Returns:
    float32 ``[P]``.
  """
  hashes = compact_calls(call_hashes_PxGxC)
  if hashes.ndim != 3:
    raise ValueError(f"call_hashes must be int [P, G, C], got shape {hashes.shape}")
  num_prompts, group_size, num_calls = hashes.shape
  if group_size < 2:
    return jnp.zeros((num_prompts,), jnp.float32)
  lengths = jnp.sum(hashes != PAD_HASH, axis=-1)  # [P, G]
  a = hashes[:, :, None, :]  # [P, G, 1, C], the row sequence
  b = hashes[:, None, :, :]  # [P, 1, G, C], the column sequence
  len_a = jnp.broadcast_to(lengths[:, :, None], (num_prompts, group_size, group_size))
  len_b = jnp.broadcast_to(lengths[:, None, :], (num_prompts, group_size, group_size))
  j = jnp.arange(num_calls + 1, dtype=jnp.int32)
  row0 = jnp.broadcast_to(j, len_a.shape + (num_calls + 1,))
  dist0 = jnp.where(len_a == 0, len_b, 0)

  def step(carry, i):
    prev, dist = carry  # prev: D[i-1, :], [P, G, G, C+1]
    cost = (a[..., i][..., None] != b).astype(jnp.int32)  # [P, G, G, C]
    diag_or_up = jnp.minimum(prev[..., 1:] + 1, prev[..., :-1] + cost)
    e = jnp.concatenate([jnp.full(prev.shape[:-1] + (1,), i + 1, jnp.int32), diag_or_up], -1)
    row = j + jax.lax.cummin(e - j, axis=e.ndim - 1)
    here = jnp.take_along_axis(row, len_b[..., None], axis=-1)[..., 0]
    dist = jnp.where(len_a == i + 1, here, dist)
    return (row, dist), None

  (_, dist), _ = jax.lax.scan(step, (row0, dist0), jnp.arange(num_calls))
  longest = jnp.maximum(jnp.maximum(len_a, len_b), 1)
  normalised = dist.astype(jnp.float32) / longest.astype(jnp.float32)
  upper = jnp.triu(jnp.ones((group_size, group_size), bool), k=1)
  return jnp.sum(jnp.where(upper, normalised, 0.0), axis=(1, 2)) / jnp.sum(upper)


def pass_at_k(success_PxN: jax.Array, k: int) -> jax.Array:
  """Unbiased pass@k per prompt from n >= k samples: ``1 - C(n-c, k) / C(n, k)``.

  Computed as ``1 - prod_{i<k} (n - c - i) / (n - i)`` (factors clipped at 0),
  float32 ``[P]``.
  """
  success = jnp.asarray(success_PxN, bool)
  if success.ndim != 2:
    raise ValueError(f"success must be [P, N], got shape {success.shape}")
  n = success.shape[1]
  if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
    raise ValueError(f"k must be an int in [1, n={n}], got {k!r}")
  failures = n - jnp.sum(success, axis=1).astype(jnp.float32)  # [P]
  i = jnp.arange(k, dtype=jnp.float32)
  factors = jnp.maximum(failures[:, None] - i, 0.0) / (n - i)
  return 1.0 - jnp.prod(factors, axis=1)


def pass_at_k_metrics(success_PxN: jax.Array, k: int) -> dict[str, jax.Array]:
  """``eval/pass_at_k``, ``eval/pass_at_1`` and ``explore/pass_at_k_gap`` (their difference)."""
  at_k = jnp.mean(pass_at_k(success_PxN, k))
  at_1 = jnp.mean(pass_at_k(success_PxN, 1))
  return {"eval/pass_at_k": at_k, "eval/pass_at_1": at_1, "explore/pass_at_k_gap": at_k - at_1}


@functools.partial(jax.jit, static_argnames=("num_groups", "ngram"))
def exploration_metrics(entropy_BxT: jax.Array, mask_BxT: jax.Array, call_hashes: jax.Array,
                        success: jax.Array, group_B: jax.Array | None = None,
                        num_groups: int | None = None, ngram: int = 2) -> dict[str, jax.Array]:
  """The ``explore/*`` metrics of one batch (jitted: the group statistics
  are many small array operations).

  Args:
    entropy_BxT: float per-token policy entropy.
    mask_BxT: 1 on policy tokens.
    call_hashes: int ``[P, G, C]``, or ``[B, C]`` with ``group_B``.
    success: bool ``[P, G]`` / ``[B]``.
    group_B, num_groups: the ragged layout.
    ngram: order of the tool-call n-gram entropy.

  Returns:
    ``explore/entropy``; ``explore/distinct_tool_seqs`` (mean over groups of the
    number of distinct tool-call sequences); ``explore/distinct_success_seqs``
    (the same among successful rollouts, 0 for a group without success);
    ``explore/distinct_success_seqs_solved`` (its mean over groups with a
    success only, 0 if none); ``explore/tool_ngram_entropy``;
    ``explore/tool_calls_mean`` (calls per rollout); and, in the uniform
    layout, ``explore/tool_seq_edit_dist``.
  """
  hashes_BxC, group_B_flat, n_groups = _hash_rows(call_hashes, group_B, num_groups)
  success_B = jnp.asarray(success, bool).reshape(-1)
  if success_B.shape[0] != hashes_BxC.shape[0]:
    raise ValueError(f"success has {success_B.shape[0]} rollouts, call_hashes {hashes_BxC.shape[0]}")
  if jnp.shape(mask_BxT)[0] != hashes_BxC.shape[0]:
    raise ValueError(f"mask has {jnp.shape(mask_BxT)[0]} rows, call_hashes {hashes_BxC.shape[0]}")
  present = group_sum(jnp.ones_like(group_B_flat), group_B_flat, n_groups) > 0
  solved = group_sum(success_B.astype(jnp.int32), group_B_flat, n_groups) > 0
  distinct = distinct_per_group(hashes_BxC, group_B_flat, n_groups)
  distinct_ok = distinct_per_group(hashes_BxC, group_B_flat, n_groups, success_B)

  def mean_over(x, where):
    return jnp.sum(jnp.where(where, x, 0)).astype(jnp.float32) / jnp.maximum(jnp.sum(where), 1)

  metrics = {
      "explore/entropy": token_entropy_mean(entropy_BxT, mask_BxT),
      "explore/distinct_tool_seqs": mean_over(distinct, present),
      "explore/distinct_success_seqs": mean_over(distinct_ok, present),
      "explore/distinct_success_seqs_solved": mean_over(distinct_ok, solved),
      "explore/tool_ngram_entropy": ngram_entropy(hashes_BxC, ngram),
      "explore/tool_calls_mean": jnp.mean(jnp.sum(hashes_BxC != PAD_HASH, axis=1).astype(jnp.float32)),
  }
  if group_B is None:
    metrics["explore/tool_seq_edit_dist"] = jnp.mean(pairwise_edit_distance(call_hashes))
  return metrics
