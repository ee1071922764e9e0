"""Fused token log-prob + entropy: Pallas (interpret) and xla_chunked."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import kernels
from agentic_rl.kernels import reference

# V = 300 is not a multiple of the 32-wide tile nor of the 96-wide chunk, so
# the last tile and the last chunk overlap already-counted columns.
TINY = kernels.LogprobBlockSizes(block_n=16, block_v=32, block_d=16,
                                 chunk_v=96)


def _assert_close(x, ref, rel):
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  assert np.all(np.isfinite(x))
  scale = max(float(np.max(np.abs(ref))), 1e-6)
  err = float(np.max(np.abs(x - ref)))
  assert err <= rel * scale, f"max error {err:.3g} > {rel} * {scale:.3g}"


def _inputs(seed, N, D, V, dtype=jnp.float32):
  kh, kw, kt, ka, kb = jax.random.split(jax.random.key(seed), 5)
  h = jax.random.normal(kh, (N, D), jnp.float32).astype(dtype)
  w = (0.5 * jax.random.normal(kw, (D, V), jnp.float32)).astype(dtype)
  targets = jax.random.randint(kt, (N,), 0, V)
  return h, w, targets, jax.random.normal(ka, (N,)), jax.random.normal(kb, (N,))


def _float64_truth(h, w, targets, temperature, softcap):
  """log_softmax gather and exact entropy in numpy float64."""
  z = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
  if softcap is not None:
    z = softcap * np.tanh(z / softcap)
  z = z / temperature
  logp = z - z.max(1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(1, keepdims=True))
  entropy = -(np.exp(logp) * logp).sum(1)
  return logp[np.arange(len(targets)), np.asarray(targets)], entropy


def _value_and_grads(impl, h, w, targets, a, b, **opts):
  """(logp, entropy) and d/d(h, w) of sum(a * logp + b * entropy)."""
  def loss(h, w):
    logp, ent = kernels.token_logprobs(h, w, targets, impl=impl, **opts)
    return jnp.sum(a * logp + b * ent), (logp, ent)
  (_, outs), grads = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(h, w)
  return outs, grads


# The Mosaic (TPU) kernels in the TPU interpreter (padding reads as NaN):
# 128-tiles, N = 200 rows in 2 blocks (padded to 256), V = 300 in 3 blocks
# (the last one running past V).
TPU_TINY = dict(backend="mosaic_tpu",
                block_sizes=kernels.TpuLogprobBlockSizes(block_n=128,
                                                         block_v=128))
PATHS = {"pallas": (37, dict(block_sizes=TINY)),
         # Triton forward, backward recomputing logits with XLA dots.
         "pallas_xla_bwd": (37, dict(block_sizes=dataclasses.replace(
             TINY, pallas_bwd=False))),
         "xla_chunked": (37, dict(block_sizes=TINY)),
         "pallas_tpu": (200, TPU_TINY)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, 3.0)])
def test_matches_log_softmax_and_exact_entropy(path, temperature, softcap):
  N, blocks = PATHS[path]
  D, V = 48, 300
  impl = "xla_chunked" if path == "xla_chunked" else "pallas"
  h, w, targets, a, b = _inputs(1, N, D, V)
  opts = dict(temperature=temperature, softcap=softcap)
  (logp, ent), (dh, dw) = _value_and_grads(impl, h, w, targets, a, b,
                                           **blocks, **opts)
  chex.assert_shape([logp, ent], (N,))
  chex.assert_type([logp, ent], jnp.float32)
  true_logp, true_ent = _float64_truth(h, w, targets, temperature, softcap)
  _assert_close(logp, true_logp, 1e-5)
  _assert_close(ent, true_ent, 1e-5)
  # Gradients (through both outputs) against autodiff of the reference.
  (_, _), (rdh, rdw) = _value_and_grads("xla", h, w, targets, a, b, **opts)
  chex.assert_equal_shape([dh, h])
  chex.assert_equal_shape([dw, w])
  _assert_close(dh, rdh, 1e-5)
  _assert_close(dw, rdw, 1e-5)


def test_entropy_gradient_alone():
  """Cotangent only on the entropy (zero on logp) isolates its gradient."""
  h, w, targets, _, b = _inputs(2, 20, 32, 70)
  zero = jnp.zeros_like(b)
  small = kernels.LogprobBlockSizes(block_n=16, block_v=16, block_d=16,
                                    chunk_v=32)
  _, grads = _value_and_grads("pallas", h, w, targets, zero, b,
                              block_sizes=small)
  _, ref_grads = _value_and_grads("xla", h, w, targets, zero, b)
  for g, rg in zip(grads, ref_grads):
    _assert_close(g, rg, 1e-5)


@pytest.mark.parametrize("path", ["pallas", "pallas_tpu"])
def test_bf16_inputs(path):
  blocks = dict(block_sizes=TINY) if path == "pallas" else TPU_TINY
  h, w, targets, a, b = _inputs(3, 40, 32, 200, jnp.bfloat16)
  (logp, ent), (dh, dw) = _value_and_grads("pallas", h, w, targets, a, b,
                                           **blocks)
  f32 = [x.astype(jnp.float32) for x in (h, w)]
  (rlogp, rent), (rdh, rdw) = _value_and_grads("xla", *f32, targets, a, b)
  chex.assert_type([logp, ent], jnp.float32)
  chex.assert_type([dh, dw], jnp.bfloat16)
  for x, ref in ((logp, rlogp), (ent, rent), (dh, rdh), (dw, rdw)):
    _assert_close(x, ref, 1e-2)


def test_eager_default_blocks():
  h, w, targets, _, _ = _inputs(4, 5, 16, 50)
  for got, ref in zip(kernels.token_logprobs(h, w, targets),
                      reference.token_logprobs(h, w, targets)):
    _assert_close(got, ref, 1e-5)


def test_temporary_memory_is_eight_times_smaller_than_naive():
  """Where logits dominate (N*V >> (N+V)*D), fwd+bwd temporaries of both
  streaming paths are <= 1/8 of materialising ones. On CPU the Pallas
  kernels are interpreted, so this measures the interpreted program; the
  xla_chunked path is the CPU-efficient one."""
  N, D, V = 256, 32, 16384
  h = jnp.ones((N, D), jnp.float32)
  w = jnp.ones((D, V), jnp.float32)
  targets = jnp.zeros((N,), jnp.int32)
  blocks = kernels.LogprobBlockSizes(chunk_v=1024)

  def temp_bytes(impl):
    def loss(h, w):
      logp, ent = kernels.token_logprobs(h, w, targets, impl=impl,
                                         block_sizes=blocks)
      return jnp.sum(logp) + jnp.sum(ent)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  naive = temp_bytes("xla")
  assert naive >= N * V * 4  # the fp32 logits are in there
  for impl in ("xla_chunked", "pallas"):
    assert temp_bytes(impl) * 8 <= naive, impl


@pytest.mark.parametrize("kwargs,match", [
    (dict(impl="cudnn"), "unknown impl"),
    (dict(temperature=0.0), "temperature must be finite and > 0"),
    (dict(temperature=jnp.float32(1.0)), "temperature must be a Python"),
    (dict(softcap=float("inf")), "softcap must be finite"),
    (dict(block_sizes=kernels.LogprobBlockSizes(block_v=100)), "power of two"),
    (dict(block_sizes=kernels.LogprobBlockSizes(chunk_v=0)), "chunk_v"),
    (dict(backend="mosaic_tpu",
          block_sizes=kernels.TpuLogprobBlockSizes(block_v=64)),
     "block_v must be a positive multiple of 128"),
    (dict(backend="mosaic_tpu", block_sizes=TINY),
     "'mosaic_tpu' kernels take TpuLogprobBlockSizes"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
  h, w, targets, _, _ = _inputs(0, 4, 16, 20)
  with pytest.raises(ValueError, match=match):
    kernels.token_logprobs(h, w, targets, **kwargs)


def test_bad_shapes_raise_value_error():
  h, w, targets, _, _ = _inputs(0, 4, 16, 20)
  with pytest.raises(ValueError, match="hidden dim 16 != unembed rows 8"):
    kernels.token_logprobs(h, w[:8], targets)
  with pytest.raises(ValueError, match="4 rows of hidden but 3 targets"):
    kernels.token_logprobs(h, w, targets[:3])
  with pytest.raises(ValueError, match="dtypes differ"):
    kernels.token_logprobs(h, w.astype(jnp.bfloat16), targets)
  with pytest.raises(ValueError, match="targets must be integers"):
    kernels.token_logprobs(h, w, targets.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"expected hidden \[N, D\]"):
    kernels.token_logprobs(h[None], w, targets)
