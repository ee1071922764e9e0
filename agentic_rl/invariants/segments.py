"""Per-group reductions of the signal and exploration monitors (sums, distinct
rows), over a batch in either group layout.

A batch holds B rollouts; the rollouts of one prompt form a group. Two layouts
are accepted everywhere a monitor needs groups:

- uniform: arrays shaped ``[P, G, ...]``, group ``p`` is row ``p`` (the usual
  prompt-major GRPO batch, B = P * G);
- ragged: flat arrays ``[B, ...]`` plus ``group_B`` (int, in ``[0, num_groups)``),
  for batches whose prompts received different rollout budgets (Knapsack).

Counting distinct rows per group is done by sorting (``jnp.lexsort`` on the
group id then every key column) and marking the first row of each run, so it
costs O(B log B) and works in both layouts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def flatten_groups(x: jax.Array, group_B: jax.Array | None, num_groups: int | None,
                   name: str = "x") -> tuple[jax.Array, jax.Array, int]:
  """Brings ``x`` to the ragged layout.

  Args:
    x: ``[P, G, ...]`` when ``group_B`` is None, else ``[B, ...]``.
    group_B: int ``[B]`` group of each row, or None for the uniform layout.
    num_groups: the number of groups (static), required with ``group_B``.
    name: the argument's name, for error messages.

  Returns:
    ``(x_B, group_B, num_groups)`` with ``x_B`` shaped ``[B, ...]``.

  Raises:
    ValueError: on inconsistent shapes (checked before tracing).
  """
  x = jnp.asarray(x)
  if group_B is None:
    if num_groups is not None:
      raise ValueError("num_groups is only used together with group_B")
    if x.ndim < 2:
      raise ValueError(f"{name} must be [P, G, ...] when group_B is not given, got shape {x.shape}")
    p, g = x.shape[:2]
    if p == 0 or g == 0:
      raise ValueError(f"{name} has an empty group axis: shape {x.shape}")
    group_B = jnp.repeat(jnp.arange(p, dtype=jnp.int32), g)
    return x.reshape((p * g,) + x.shape[2:]), group_B, p
  group_B = jnp.asarray(group_B)
  if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
    raise ValueError(f"num_groups must be a positive int with group_B, got {num_groups!r}")
  if group_B.ndim != 1 or not jnp.issubdtype(group_B.dtype, jnp.integer):
    raise ValueError(f"group_B must be a 1-D integer array, got {group_B.dtype}{group_B.shape}")
  if x.ndim < 1 or x.shape[0] != group_B.shape[0]:
    raise ValueError(f"{name} has shape {x.shape} but group_B has {group_B.shape[0]} rows")
  return x, group_B.astype(jnp.int32), num_groups


def uniform_group_ids(num_groups: int, group_size: int) -> np.ndarray:
  """``group_B`` of the uniform layout: ``[0]*G + [1]*G + ...`` (int32 ``[P*G]``)."""
  return np.repeat(np.arange(num_groups, dtype=np.int32), group_size)


def group_sum(x_B: jax.Array, group_B: jax.Array, num_groups: int) -> jax.Array:
  """Sum of ``x_B`` over the rows of each group: ``[num_groups]``."""
  return jax.ops.segment_sum(x_B, group_B, num_segments=num_groups)


def distinct_per_group(keys_BxK: jax.Array, group_B: jax.Array, num_groups: int,
                       include_B: jax.Array | None = None) -> jax.Array:
  """Number of distinct key rows in each group.

  Args:
    keys_BxK: int ``[B, K]``; two rows are the same iff all K entries are equal.
    group_B: int32 ``[B]`` in ``[0, num_groups)``.
    num_groups: static number of groups.
    include_B: optional bool ``[B]``; rows with False are ignored.

  Returns:
    int32 ``[num_groups]``: ``|{keys_b : group_b = g, include_b}|``.
  """
  b = keys_BxK.shape[0]
  if b == 0:
    return jnp.zeros((num_groups,), jnp.int32)
  gid = group_B if include_B is None else jnp.where(include_B, group_B, num_groups)
  columns = [keys_BxK[:, k] for k in range(keys_BxK.shape[1])]
  # lexsort: the last key is the primary one.
  order = jnp.lexsort(tuple(reversed(columns)) + (gid,))
  keys_sorted = keys_BxK[order]
  gid_sorted = gid[order]
  changed = gid_sorted[1:] != gid_sorted[:-1]
  if columns:
    changed = changed | jnp.any(keys_sorted[1:] != keys_sorted[:-1], axis=1)
  first = jnp.concatenate([jnp.ones((1,), bool), changed])
  counts = jax.ops.segment_sum(first.astype(jnp.int32), gid_sorted, num_segments=num_groups + 1)
  return counts[:num_groups]
