"""Host-side randomness for the numpy controllers, derived from a JAX PRNG key.

Host controllers (prompt selection, down-sampling) draw with numpy so that
varying sizes never trigger XLA compilations; the generator is seeded from the
key's bits, so results stay a pure function of the key.
"""

from __future__ import annotations

import jax
import numpy as np


def host_rng(key: jax.Array) -> np.random.Generator:
  """A numpy generator seeded by ``key`` (a typed key or a raw uint32 ``[2]`` key)."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  return np.random.default_rng(np.asarray(key, np.uint32).ravel())
