"""Random-shape properties of the kernels (few, derandomized examples: each
example compiles an interpreted Pallas kernel, which costs seconds on CPU)."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from agentic_rl import kernels
from agentic_rl.kernels import reference

TINY = kernels.AttentionBlockSizes(16, 16, 16, 16, 16, 16)
SETTINGS = settings(max_examples=6, deadline=None, derandomize=True)


def _assert_close(x, ref, rel):
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  assert np.all(np.isfinite(x))
  scale = max(float(np.max(np.abs(ref))), 1e-6)
  assert float(np.max(np.abs(x - ref))) <= rel * scale


@pytest.mark.slow
@SETTINGS
@given(B=st.integers(1, 2), T=st.integers(1, 50), K=st.integers(1, 2),
       G=st.sampled_from([1, 4, 8]), D=st.sampled_from([8, 16, 40]),
       causal=st.booleans(), window=st.none() | st.integers(1, 20),
       softcap=st.none() | st.floats(1.0, 20.0), seed=st.integers(0, 99))
def test_flash_forward_matches_reference_on_random_shapes(
    B, T, K, G, D, causal, window, softcap, seed):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (B, T, K * G, D))
  k = jax.random.normal(kk, (B, T, K, D))
  v = jax.random.normal(kv, (B, T, K, D))
  opts = dict(causal=causal, sliding_window=window, softcap=softcap)
  out = jax.jit(lambda q, k, v: kernels.flash_attention(
      q, k, v, block_sizes=TINY, **opts))(q, k, v)
  _assert_close(out, reference.attention(q, k, v, **opts), 1e-5)


@SETTINGS
@given(N=st.integers(1, 40), V=st.integers(2, 400),
       chunk=st.integers(1, 400), temperature=st.floats(0.3, 3.0),
       seed=st.integers(0, 99))
def test_xla_chunked_logprobs_do_not_depend_on_the_chunking(
    N, V, chunk, temperature, seed):
  kh, kw, kt = jax.random.split(jax.random.key(seed), 3)
  h = jax.random.normal(kh, (N, 16))
  w = jax.random.normal(kw, (16, V))
  targets = jax.random.randint(kt, (N,), 0, V)
  got = kernels.token_logprobs(
      h, w, targets, temperature=temperature, impl="xla_chunked",
      block_sizes=kernels.LogprobBlockSizes(chunk_v=chunk))
  want = reference.token_logprobs(h, w, targets, temperature=temperature)
  for g, r in zip(got, want):
    _assert_close(g, r, 1e-5)
  assert np.all(np.asarray(got[0]) <= 1e-6)  # log-probs
  assert np.all(np.asarray(got[1]) >= -1e-5)  # entropies
  assert np.all(np.asarray(got[1]) <= np.log(V) + 1e-4)
