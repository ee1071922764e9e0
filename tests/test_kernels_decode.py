"""Decode attention: Pallas kernel (interpret mode on CPU) vs references."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import kernels
from agentic_rl.kernels import reference


def _assert_close(x, ref, rel):
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  assert np.all(np.isfinite(x))
  scale = max(float(np.max(np.abs(ref))), 1e-6)
  err = float(np.max(np.abs(x - ref)))
  assert err <= rel * scale, f"max error {err:.3g} > {rel} * {scale:.3g}"


def _inputs(seed, B, S, H, K, D, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (B, H, D), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, S, K, D), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, S, K, D), jnp.float32).astype(dtype)
  return q, k, v


def _masked_reference(q, k, v, lengths, window=None, softcap=None):
  """Independent dense reference: explicit slot mask, fp32 softmax."""
  B, H, D = q.shape
  S, K = k.shape[1], k.shape[2]
  kk = jnp.repeat(k, H // K, axis=2).astype(jnp.float32)
  vv = jnp.repeat(v, H // K, axis=2).astype(jnp.float32)
  s = jnp.einsum("bhd,bshd->bhs", q.astype(jnp.float32), kk) / np.sqrt(D)
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  j = jnp.arange(S)[None, :]
  visible = j < lengths[:, None]
  if window is not None:
    visible &= (lengths[:, None] - 1 - j) < window
  s = jnp.where(visible[:, None, :], s, -jnp.inf)
  p = jnp.nan_to_num(jax.nn.softmax(s, axis=-1))
  return jnp.einsum("bhs,bshd->bhd", p, vv)


CASES = [
    # name, (B, S, H, K, D), lengths, options, block sizes
    ("gqa4_unaligned_splits", (4, 45, 8, 2, 24), [0, 45, 5, 17], dict(),
     kernels.DecodeBlockSizes(block_k=16, num_splits=3)),
    ("mha_window", (3, 40, 2, 2, 16), [40, 1, 23], dict(sliding_window=7),
     kernels.DecodeBlockSizes(block_k=16, num_splits=2)),
    ("mqa_softcap_traced_window_short_cache", (2, 7, 8, 1, 32), [7, 3],
     dict(softcap=2.0, sliding_window=jnp.int32(4)),
     kernels.DecodeBlockSizes(block_k=16, num_splits=1)),
    # The Mosaic (TPU) kernel in the TPU interpreter: 128-slot tiles, the
    # last one running past the cache (300 slots), blocks skipped by length
    # and window; a cache shorter than a tile.
    ("tpu_gqa4_unaligned", (4, 300, 8, 2, 24), [0, 300, 5, 170], dict(),
     kernels.TpuDecodeBlockSizes(block_k=128)),
    ("tpu_mha_window", (2, 300, 2, 2, 16), [290, 23],
     dict(sliding_window=150), kernels.TpuDecodeBlockSizes(block_k=128)),
    ("tpu_mqa_softcap_traced_window_short_cache", (2, 7, 8, 1, 32), [7, 3],
     dict(softcap=2.0, sliding_window=jnp.int32(4)),
     kernels.TpuDecodeBlockSizes()),
]


@pytest.mark.parametrize("name,shape,lengths,opts,blocks", CASES,
                         ids=[c[0] for c in CASES])
@pytest.mark.parametrize("kv_layout", ["BSKD", "BKSD"])
def test_pallas_matches_references(name, shape, lengths, opts, blocks, kv_layout):
  q, k, v = _inputs(sum(map(ord, name)), *shape)
  lengths = jnp.asarray(lengths, jnp.int32)
  # The head-major layout holds the same cache, laid out [B, K, S, D].
  lay = (lambda x: x) if kv_layout == "BSKD" else (lambda x: jnp.swapaxes(x, 1, 2))
  backend = ("mosaic_tpu" if isinstance(blocks, kernels.TpuDecodeBlockSizes)
             else "triton")
  opts = dict(opts, kv_layout=kv_layout)
  out = jax.jit(functools.partial(kernels.decode_attention, block_sizes=blocks,
                                  backend=backend, **opts))(
                                      q, lay(k), lay(v), lengths)
  chex.assert_shape(out, q.shape)
  chex.assert_type(out, q.dtype)
  xla = kernels.decode_attention(q, lay(k), lay(v), lengths, impl="xla", **opts)
  window = opts.get("sliding_window")
  dense = _masked_reference(q, k, v, lengths, window, opts.get("softcap"))
  _assert_close(out, xla, 1e-5)
  _assert_close(out, dense, 1e-5)
  np.testing.assert_array_equal(out[lengths == 0], 0.0)


def test_decode_equals_last_row_of_causal_attention():
  """Decoding token t over a cache of t+1 slots equals row t of full causal
  (GQA, windowed) attention over the sequence; bf16, default tiles, eager."""
  B, T, H, K, D = 3, 21, 4, 2, 16
  kq, kk, kv = jax.random.split(jax.random.key(4), 3)
  q_seq = jax.random.normal(kq, (B, T, H, D)).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (B, T, K, D)).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (B, T, K, D)).astype(jnp.bfloat16)
  full = reference.attention(q_seq, k, v, sliding_window=5)
  t = jnp.array([0, 9, T - 1])
  rows = jnp.arange(B)
  out = kernels.decode_attention(q_seq[rows, t], k, v, t + 1, sliding_window=5)
  chex.assert_type(out, jnp.bfloat16)
  _assert_close(out, full[rows, t], 1e-2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(impl="cudnn"), "unknown impl"),
    (dict(sliding_window=-3), "sliding_window must be >= 1"),
    (dict(softcap=0.0), "softcap must be finite and > 0"),
    (dict(block_sizes=kernels.DecodeBlockSizes(num_splits=0)), "num_splits"),
    (dict(kv_layout="SBKD"), "kv_layout must be one of"),
    (dict(backend="mosaic_tpu",
          block_sizes=kernels.TpuDecodeBlockSizes(block_k=100)),
     "block_k must be a positive multiple of 128"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
  q, k, v = _inputs(0, 2, 16, 4, 2, 16)
  with pytest.raises(ValueError, match=match):
    kernels.decode_attention(q, k, v, jnp.array([1, 2]), **kwargs)


def test_bad_shapes_raise_value_error():
  q, k, v = _inputs(0, 2, 16, 4, 2, 16)
  with pytest.raises(ValueError, match="lengths must be integers"):
    kernels.decode_attention(q, k, v, jnp.array([1.0, 2.0]))
  with pytest.raises(ValueError, match="lengths must be integers"):
    kernels.decode_attention(q, k, v, jnp.array([1, 2, 3]))
  with pytest.raises(ValueError, match="multiple of key/value heads"):
    kernels.decode_attention(q[:, :3], k, v, jnp.array([1, 2]))
  with pytest.raises(ValueError, match="disagree"):
    kernels.decode_attention(q[:1], k, v, jnp.array([1]))
  with pytest.raises(ValueError, match=r"\[batch, kv_heads, slots, head_dim\]"):
    kernels.decode_attention(q, k[0], v[0], jnp.array([1, 2]), kv_layout="BKSD")
