"""Seeded instance streams by split: the one definition of which instance is
"test example i".

Instance ``i`` of split ``s`` for a seed is ``env.generate(k, difficulty)``
with ``k = fold_in(fold_in(key(seed), SPLIT_SALT[s]), i)`` (what
:func:`instance_keys` returns). Distinct salts give the splits disjoint key
streams.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SPLITS = ("train", "validation", "test")
SPLIT_SALT = {"train": 0x7A11, "validation": 0x5A1D, "test": 0x7E57}


def split_key(seed: int, split: str) -> jax.Array:
  if split not in SPLIT_SALT:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
  return jax.random.fold_in(jax.random.key(seed), SPLIT_SALT[split])


def instance_keys(seed: int, split: str, indices) -> jax.Array:
  """PRNG keys of the instances ``indices`` (1-D, < 2**32) of a split."""
  indices = np.asarray(indices)
  if indices.ndim != 1 or (indices < 0).any() or (indices >= 2**32).any():
    raise ValueError("indices must be a 1-D array of integers in [0, 2**32)")
  base = split_key(seed, split)
  return jax.vmap(lambda i: jax.random.fold_in(base, i))(
      jnp.asarray(indices.astype(np.uint32)))
