"""Flash attention: Pallas kernels (interpret mode on CPU) vs references."""

import functools
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import kernels
from agentic_rl.kernels import flash
from agentic_rl.kernels.hopper import flash as flash_mgpu
from agentic_rl.kernels.triton import flash as triton_flash
from agentic_rl.kernels import reference

# Tiny tiles so that short sequences span several blocks (online softmax,
# block skipping, masked/unmasked loops, padding of the last block).
TINY = kernels.AttentionBlockSizes(16, 16, 16, 16, 16, 16)
# The smallest Mosaic tiles (128): sequences of a few hundred span blocks.
TPU_TINY = kernels.TpuAttentionBlockSizes(128, 128, 128, 128, 128, 128)
TILES = {"triton": TINY, "mosaic_tpu": TPU_TINY}


def _assert_close(x, ref, rel):
  """max |x - ref| <= rel * max |ref| (relative to the tensor's scale)."""
  x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
  assert np.all(np.isfinite(x))
  scale = max(float(np.max(np.abs(ref))), 1e-6)
  err = float(np.max(np.abs(x - ref)))
  assert err <= rel * scale, f"max error {err:.3g} > {rel} * {scale:.3g}"


def _inputs(seed, B, T, S, H, K, D, dtype=jnp.float32):
  kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (B, T, H, D), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, S, K, D), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, S, K, D), jnp.float32).astype(dtype)
  ct = jax.random.normal(kc, (B, T, H, D), jnp.float32)
  return q, k, v, ct


def _packed_segments(B, T):
  """Row 0: three packed docs; row 1: one doc then right padding (id -1)."""
  row0 = np.repeat([0, 1, 2], [T // 3, T // 3, T - 2 * (T // 3)])
  row1 = np.where(np.arange(T) < T - 7, 5, -1)
  return jnp.asarray(np.stack([row0, row1][:B]), jnp.int32)


def _value_and_grads(fn, q, k, v, ct, *traced):
  """jitted ``fn(q, k, v, *traced)`` and (dq, dk, dv) of sum(out * ct)."""
  def loss(q, k, v, *traced):
    out = fn(q, k, v, *traced)
    return jnp.sum(out.astype(jnp.float32) * ct), out
  vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (_, out), grads = vg(q, k, v, *traced)
  return out, grads


def _nn_attention(q, k, v, *, causal=True, segment_ids=None,
                  sliding_window=None):
  mask = None
  if segment_ids is not None:
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
  local = None if sliding_window is None else (sliding_window - 1, 0)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                      local_window_size=local,
                                      implementation="xla")


CASES = [
    # name, backend, (B, T, S, H, K, D), options, also compare with jax.nn
    ("mha_unaligned", "triton", (2, 37, 37, 2, 2, 24), dict(), True),
    ("gqa4_segments_window", "triton", (2, 40, 40, 4, 1, 16),
     dict(segment_ids="packed", sliding_window=9), True),
    ("gqa8_softcap", "triton", (1, 33, 33, 8, 1, 32), dict(softcap=5.0),
     False),
    ("noncausal_window_cross_lengths", "triton", (2, 20, 45, 4, 2, 16),
     dict(causal=False, sliding_window=6), False),
    # The Mosaic (TPU) kernels in the TPU interpreter, which reads padding and
    # uninitialised memory as NaN: 128-tiles over unaligned lengths.
    ("tpu_mha_unaligned", "mosaic_tpu", (1, 300, 300, 2, 2, 24), dict(),
     True),
    ("tpu_gqa4_segments_window", "mosaic_tpu", (2, 200, 200, 4, 1, 16),
     dict(segment_ids="packed", sliding_window=90), True),
    ("tpu_gqa8_softcap", "mosaic_tpu", (1, 150, 150, 8, 1, 32),
     dict(softcap=5.0), False),
    ("tpu_noncausal_window_cross_lengths", "mosaic_tpu",
     (1, 140, 300, 4, 2, 16), dict(causal=False, sliding_window=100), False),
]


def _check_against_references(name, backend, tiles, shape, opts, vs_nn):
  """The Pallas kernels at ``tiles``: output and gradients within fp32 1e-5
  of the reference (and of ``jax.nn.dot_product_attention`` if ``vs_nn``)."""
  B, T, S, H, K, D = shape
  q, k, v, ct = _inputs(sum(map(ord, name)), *shape)
  opts = dict(opts)
  if opts.get("segment_ids") == "packed":
    opts["segment_ids"] = _packed_segments(B, T)
  out, grads = _value_and_grads(
      functools.partial(kernels.flash_attention, impl="pallas",
                        backend=backend, block_sizes=tiles, **opts),
      q, k, v, ct)
  references = [functools.partial(reference.attention, **opts)]
  if vs_nn:
    references.append(functools.partial(_nn_attention, **opts))
  chex.assert_shape(out, (B, T, H, D))
  chex.assert_type(out, jnp.float32)
  for ref_fn in references:
    ref_out, ref_grads = _value_and_grads(ref_fn, q, k, v, ct)
    _assert_close(out, ref_out, 1e-5)
    for g, rg, x in zip(grads, ref_grads, (q, k, v)):
      chex.assert_equal_shape([g, x])
      _assert_close(g, rg, 1e-5)


@pytest.mark.parametrize("name,backend,shape,opts,vs_nn", CASES,
                         ids=[c[0] for c in CASES])
def test_pallas_matches_reference_fwd_and_grads(name, backend, shape, opts,
                                                vs_nn):
  _check_against_references(name, backend, TILES[backend], shape, opts, vs_nn)


@pytest.mark.parametrize("backend,T", [("triton", 33), ("mosaic_tpu", 200)])
def test_traced_window_and_rows_without_visible_keys(backend, T):
  """One compiled program, window passed as data: 12 matches the reference;
  0 hides every key, giving zero outputs and zero (finite) gradients."""
  q, k, v, ct = _inputs(11, 1, T, T, 4, 1, 16)

  def fn(q, k, v, window):
    return kernels.flash_attention(q, k, v, sliding_window=window,
                                   backend=backend, block_sizes=TILES[backend])

  out, grads = _value_and_grads(fn, q, k, v, ct, jnp.int32(12))
  ref_out, ref_grads = _value_and_grads(
      functools.partial(reference.attention, sliding_window=12), q, k, v, ct)
  _assert_close(out, ref_out, 1e-5)
  for g, rg in zip(grads, ref_grads):
    _assert_close(g, rg, 1e-5)
  out, grads = _value_and_grads(fn, q, k, v, ct, jnp.int32(0))
  np.testing.assert_array_equal(out, 0.0)
  for g in grads:
    np.testing.assert_array_equal(g, 0.0)


def _assert_bf16_matches_fp32_reference(fn, q, k, v, ct, opts):
  """``fn``'s output and gradients on bf16 inputs are within 1e-2 of
  :func:`reference.attention` (with ``opts``) on the same values in fp32;
  returns them."""
  out, grads = _value_and_grads(fn, q, k, v, ct)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  ref_out, ref_grads = _value_and_grads(
      functools.partial(reference.attention, **opts), *f32, ct)
  _assert_close(out, ref_out, 1e-2)
  for g, rg in zip(grads, ref_grads):
    _assert_close(g, rg, 1e-2)
  return out, grads


@pytest.mark.parametrize("backend,T", [("triton", 50), ("mosaic_tpu", 180)])
def test_bf16_gqa_window_matches_fp32_reference(backend, T):
  B, H, K, D = 2, 4, 1, 32
  q, k, v, ct = _inputs(3, B, T, T, H, K, D, jnp.bfloat16)
  opts = dict(sliding_window=17, segment_ids=_packed_segments(B, T))
  out, grads = _assert_bf16_matches_fp32_reference(
      functools.partial(kernels.flash_attention, backend=backend,
                        block_sizes=TILES[backend], **opts),
      q, k, v, ct, opts)
  chex.assert_type([out, *grads], jnp.bfloat16)


# The Mosaic GPU kernels (``fwd``/``bwd="mosaic_gpu"``) in Pallas' GPU
# interpreter: 64-row tiles (128-key forward tiles), so these lengths span
# 1-4 tiles; the other side is the Triton kernel, or both are Mosaic. Test
# names avoid "mosaic": gpu_session.sh deselects those.
# One compute warpgroup here: the interpreter runs each warpgroup as a thread
# that blocks in XLA:CPU while it waits on a barrier, and three of them
# (two compute warpgroups and the memory one) starve a 2-core machine's
# XLA threads when another kernel shares their executable, unless NPROC
# enlarges XLA's pool (tests/conftest.py does). The tests after this one run
# two warpgroups in a jit of their own.
MGPU = kernels.AttentionBlockSizes(bwd="mosaic_gpu")
MGPU_SIDES = {
    "bwd": dict(bwd="mosaic_gpu"), "fwd": dict(fwd="mosaic_gpu"),
    "both": dict(fwd="mosaic_gpu", bwd="mosaic_gpu"),
    "bwd_fused_dq": dict(bwd="mosaic_gpu", fused_dq_mgpu=True)}
MGPU_CASES = [
    # (B, T, H, K, D), dtype, options
    ((2, 256, 2, 2, 64), jnp.bfloat16, dict()),
    ((1, 256, 8, 2, 64), jnp.float16, dict(sliding_window=127)),
    ((1, 128, 4, 1, 128), jnp.bfloat16, dict(causal=False)),
]
needs_gpu_interpreter = pytest.mark.skipif(
    not flash_mgpu.CAN_INTERPRET or jax.default_backend() == "gpu",
    reason="Pallas' GPU interpreter needs jax >= 0.11 (on a GPU: compiled)")


def _triton_forward(q, k, v, window):
  """``(out, lse)`` of the causal Triton forward (interpreted) in a jit of
  its own: the residuals either backward reads."""
  cfg = triton_flash.make_config(
      q.shape, k.shape, causal=True, softcap=None, has_segments=False,
      has_window=window is not None, blocks=kernels.AttentionBlockSizes(),
      interpret=True)
  w = None if window is None else jnp.int32(window)
  return jax.jit(lambda q, k, v: flash._gpu_forward(cfg, q, k, v, None, w))(
      q, k, v)


@needs_gpu_interpreter
@pytest.mark.parametrize("sides", list(MGPU_SIDES))
@pytest.mark.parametrize("shape,dtype,opts", MGPU_CASES,
                         ids=["mha", "gqa4_window_f16", "mqa_noncausal_d128"])
def test_mgpu_kernels_interpreted_match_fp32_reference(sides, shape, dtype,
                                                       opts):
  B, T, H, K, D = shape
  q, k, v, ct = _inputs(11, B, T, T, H, K, D, dtype)
  blocks = kernels.AttentionBlockSizes(
      warpgroups_mgpu=1, warpgroups_fwd_mgpu=1, **MGPU_SIDES[sides])
  out, grads = _assert_bf16_matches_fp32_reference(
      functools.partial(kernels.flash_attention, block_sizes=blocks, **opts),
      q, k, v, ct, opts)
  chex.assert_type([out, *grads], dtype)


@needs_gpu_interpreter
@pytest.mark.parametrize("order", [{}, dict(longest_first=True),
                                   dict(pingpong=True)],
                         ids=["plain", "longest_first", "pingpong"])
@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=100)],
                         ids=["causal", "window"])
def test_mgpu_forward_two_warpgroups_interpreted(opts, order):
  """Two compute warpgroups share the streamed key tiles (a tile one of
  them does not see is masked out in full), in either program order and
  taking turns or not (the interpreter runs the turn barrier, so a schedule
  that deadlocks hangs here); the output matches the fp32 reference and the
  residual ``lse`` the Triton forward's, so either forward feeds either
  backward."""
  B, T, H, K, D = 1, 256, 4, 2, 64
  q, k, v, _ = _inputs(13, B, T, T, H, K, D, jnp.bfloat16)
  window = opts.get("sliding_window")
  cfg = flash_mgpu.make_config(q.shape, k.shape, causal=True, window=window,
                               bq=64, bk=64, stages=2, warpgroups=2,
                               interpret=True, **order)
  out, lse = jax.jit(functools.partial(flash_mgpu.forward, cfg))(q, k, v)
  chex.assert_shape(lse, (B, H, T))
  _, triton_lse = _triton_forward(q, k, v, window)
  np.testing.assert_allclose(lse, triton_lse[:, :, :T], atol=1e-4)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  _assert_close(out, reference.attention(*f32, **opts), 1e-2)


def _interpreted_backward(q, k, v, ct, window, **variant):
  """``(dq, dk, dv)`` of the causal Hopper backward with two warpgroups and
  64 x 64 tiles (``variant``: more :func:`flash_mgpu.make_config` fields),
  interpreted in a jit of its own from the Triton forward's residuals."""
  out, lse = _triton_forward(q, k, v, window)
  d_out = ct.astype(q.dtype)
  cfg = flash_mgpu.make_config(q.shape, k.shape, causal=True, window=window,
                               bq=64, bk=64, stages=2, warpgroups=2,
                               interpret=True, **variant)
  return jax.jit(functools.partial(flash_mgpu.backward, cfg))(
      q, k, v, d_out, lse, flash.row_delta(out, d_out))


@needs_gpu_interpreter
@pytest.mark.parametrize("variant", [{}, dict(longest_first=True),
                                     dict(fused_dq=True)],
                         ids=["plain", "longest_first", "fused_dq"])
@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=127)],
                         ids=["causal", "window"])
def test_mgpu_backward_two_warpgroups_interpreted(opts, variant):
  """Two compute warpgroups share the streamed tiles; a tile one of them
  does not see is masked out in full. With fused dQ they meet at a barrier
  every step, share their dS tiles and each add half of dQ's columns
  (head_dim 128: 64 each). The kernels run in their own jit, from the
  Triton forward's residuals."""
  B, T, H, K = 1, 256, 4, 2
  D = 128 if variant.get("fused_dq") else 64
  q, k, v, ct = _inputs(12, B, T, T, H, K, D, jnp.bfloat16)
  grads = _interpreted_backward(q, k, v, ct, opts.get("sliding_window"),
                                **variant)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  _, ref_grads = _value_and_grads(
      functools.partial(reference.attention, **opts), *f32, ct)
  for g, rg in zip(grads, ref_grads):
    _assert_close(g, rg, 1e-2)


@needs_gpu_interpreter
def test_mgpu_fused_dq_matches_the_dq_kernel_interpreted():
  """Fused dQ changes only how dQ is summed: dK and dV are bit for bit the
  two-kernel backward's, dQ within a rounding of its bf16 output (GQA 2,
  window, two warpgroups, two key programs per head)."""
  B, T, H, K, D = 1, 256, 4, 2, 128
  q, k, v, ct = _inputs(14, B, T, T, H, K, D, jnp.bfloat16)
  dq, dk, dv = _interpreted_backward(q, k, v, ct, 100)
  fused_dq, fused_dk, fused_dv = _interpreted_backward(q, k, v, ct, 100,
                                                       fused_dq=True)
  np.testing.assert_array_equal(fused_dk, dk)
  np.testing.assert_array_equal(fused_dv, dv)
  np.testing.assert_allclose(fused_dq.astype(jnp.float32),
                             dq.astype(jnp.float32), rtol=1e-2, atol=1e-2)


@needs_gpu_interpreter
def test_mgpu_fused_dq_under_vmap_interpreted():
  """``jax.vmap`` batches the fused-dQ backward, whose launch cannot batch,
  by folding the mapped axis into the batch axis (unmapped inputs, here the
  keys and values, broadcast): the gradients of one call per element."""
  N, T, H, K, D = 2, 128, 2, 1, 128
  q, _, _, ct = _inputs(16, N, T, T, H, K, D, jnp.bfloat16)
  _, k, v, _ = _inputs(17, 1, T, T, H, K, D, jnp.bfloat16)
  q, ct = q[:, None], ct[:, None]  # [N, 1, T, H, D]: N mapped, batch 1
  cfg = flash_mgpu.make_config(q.shape[1:], k.shape, causal=True,
                               window=None, bq=64, bk=64, stages=2,
                               warpgroups=2, interpret=True, fused_dq=True)
  d_out = ct.astype(q.dtype)
  residuals = [_triton_forward(q[n], k, v, None) for n in range(N)]
  lse = jnp.stack([lse for _, lse in residuals])
  delta = jnp.stack([flash.row_delta(out, d_out[n])
                     for n, (out, _) in enumerate(residuals)])
  backward = functools.partial(flash_mgpu.backward, cfg)
  mapped = jax.jit(jax.vmap(backward, in_axes=(0, None, None, 0, 0, 0)))(
      q, k, v, d_out, lse, delta)
  for n in range(N):
    one = jax.jit(backward)(q[n], k, v, d_out[n], lse[n], delta[n])
    for got, want in zip(mapped, one):
      np.testing.assert_array_equal(got[n], want)


_FUSED_DQ_UNDER_GRAD = """
import functools, jax, jax.numpy as jnp, numpy as np
from agentic_rl import kernels
from agentic_rl.kernels import reference
keys = jax.random.split(jax.random.key(15), 4)
q = jax.random.normal(keys[0], (1, 256, 4, 128), jnp.bfloat16)
k, v = (jax.random.normal(key, (1, 256, 2, 128), jnp.bfloat16)
        for key in keys[1:3])
ct = jax.random.normal(keys[3], q.shape, jnp.float32)
blocks = kernels.AttentionBlockSizes(bwd="mosaic_gpu", fused_dq_mgpu=True)
def grads(attend, *qkv):
  return jax.grad(lambda *x: jnp.sum(attend(*x).astype(jnp.float32) * ct),
                  argnums=(0, 1, 2))(*qkv)
got = jax.jit(functools.partial(grads, functools.partial(
    kernels.flash_attention, block_sizes=blocks)))(q, k, v)
want = grads(reference.attention, *(x.astype(jnp.float32) for x in (q, k, v)))
for g, w in zip(got, want):
  err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / jnp.max(jnp.abs(w)))
  assert err < 2e-2, err
print("ok")
"""


@needs_gpu_interpreter
def test_mgpu_fused_dq_shares_an_executable_interpreted():
  """The Triton forward and the fused-dQ backward (two warpgroups) under
  ``jax.grad`` in one executable: the case whose simulated warpgroups
  starved XLA:CPU's pool on 2 cores until tests/conftest.py set ``NPROC``
  (it hung). Run in a subprocess with a time limit, so a hang fails
  instead of stalling the suite."""
  proc = subprocess.run([sys.executable, "-c", _FUSED_DQ_UNDER_GRAD],
                        capture_output=True, text=True, timeout=300,
                        env=os.environ | {"JAX_PLATFORMS": "cpu"},
                        check=False)
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# Compiled, the kernels can also stage their register operands in shared
# memory (what the interpreter always does).
GPU_MGPU_SIDES = MGPU_SIDES | {
    "both_staged": dict(fwd="mosaic_gpu", bwd="mosaic_gpu",
                        register_operands_mgpu=False),
    "both_fused_dq": dict(fwd="mosaic_gpu", bwd="mosaic_gpu",
                          fused_dq_mgpu=True)}


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("sides", list(GPU_MGPU_SIDES))
@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=100)],
                         ids=["causal", "window"])
def test_gpu_mgpu_kernels_match_fp32_reference(sides, opts):
  """Compiled for Hopper, at the default tiles, bf16 GQA."""
  B, T, H, K, D = 2, 512, 8, 2, 128
  q, k, v, ct = _inputs(9, B, T, T, H, K, D, jnp.bfloat16)
  blocks = kernels.AttentionBlockSizes(**GPU_MGPU_SIDES[sides])
  _assert_bf16_matches_fp32_reference(
      functools.partial(kernels.flash_attention, block_sizes=blocks, **opts),
      q, k, v, ct, opts)


@pytest.mark.parametrize("change,kwargs,match", [
    (dict(dtype=jnp.float32), {}, "needs float16 or bfloat16"),
    ({}, dict(segment_ids=jnp.zeros((1, 128), jnp.int32)),
     "does not support segment_ids"),
    ({}, dict(softcap=5.0), "does not support softcap"),
    (dict(S=64), {}, "needs equal query and key lengths"),
    (dict(T=192, S=192), {}, r"multiple of 2 \(warpgroups\) x the query"),
    (dict(D=32), {}, "head_dim a multiple of 64"),
    ({}, dict(sliding_window=jnp.int32(8)), "needs a static int"),
    ({}, dict(block_sizes=kernels.AttentionBlockSizes(bwd="mosaic_gpu",
                                                      stages_mgpu=0)),
     "stages_mgpu must be >= 1"),
    ({}, dict(block_sizes=kernels.AttentionBlockSizes(bwd="cuda")),
     "bwd must be 'triton' or 'mosaic_gpu'"),
    (dict(D=320), {}, "head_dim a multiple of 64 up to 256, got 320"),
    ({}, dict(block_sizes=kernels.AttentionBlockSizes(fwd="mosaic_gpu"),
              segment_ids=jnp.zeros((1, 128), jnp.int32)),
     r"fwd='mosaic_gpu'\)\) does not support segment_ids; fwd='triton'"),
    ({}, dict(block_sizes=kernels.AttentionBlockSizes(
        fwd="mosaic_gpu", warpgroups_fwd_mgpu=0)),
     "warpgroups_fwd_mgpu must be >= 1"),
    ({}, dict(block_sizes=kernels.AttentionBlockSizes(fwd="cuda")),
     "fwd must be 'triton' or 'mosaic_gpu'"),
    ({}, dict(block_sizes=kernels.AttentionBlockSizes(
        bwd="mosaic_gpu", fused_dq_mgpu=True)),
     r"with fused dQ needs head_dim a multiple of 64 x 2 \(warpgroups"),
], ids=["fp32", "segments", "softcap", "cross", "unaligned", "d32",
        "traced_window", "stages", "unknown", "d320", "fwd_segments",
        "fwd_warpgroups", "fwd_unknown", "fused_dq_d64"])
def test_mgpu_kernels_refuse_what_they_do_not_cover(change, kwargs, match):
  shape = dict(T=128, S=128, D=64, dtype=jnp.bfloat16) | change
  q, k, v, _ = _inputs(0, 1, shape["T"], shape["S"], 2, 1, shape["D"],
                       shape["dtype"])
  with pytest.raises(ValueError, match=match):
    kernels.flash_attention(q, k, v, **({"block_sizes": MGPU} | kwargs))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="runs compiled")
def test_mgpu_backward_needs_the_gpu_interpreter_off_a_gpu(monkeypatch):
  monkeypatch.setattr(flash_mgpu, "CAN_INTERPRET", False)
  q, k, v, _ = _inputs(0, 1, 128, 128, 2, 1, 64, jnp.bfloat16)
  with pytest.raises(ValueError, match="needs jax >= 0.11"):
    kernels.flash_attention(q, k, v, block_sizes=MGPU)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("impl", ["pallas", "cudnn"])
@pytest.mark.parametrize("opts", [dict(), dict(sliding_window=100),
                                  dict(segment_ids="packed")],
                         ids=["causal", "window", "segments"])
def test_gpu_default_tiles_and_cudnn_match_fp32_reference(impl, opts):
  """Compiled at the default (tuned) tiles, several blocks long, bf16 GQA."""
  # cuDNN at a tile-multiple length (the Pallas case covers ragged ones).
  B, T, H, K, D = 2, 512 if impl == "cudnn" else 520, 8, 2, 64
  q, k, v, ct = _inputs(8, B, T, T, H, K, D, jnp.bfloat16)
  opts = dict(opts)
  if opts.get("segment_ids") == "packed":
    opts["segment_ids"] = _packed_segments(B, T)
  _assert_bf16_matches_fp32_reference(
      functools.partial(kernels.flash_attention, impl=impl, **opts),
      q, k, v, ct, opts)


def test_eager_and_default_blocks_match_xla():
  """No jit, default tile sizes (clipped to the short sequence)."""
  q, k, v, _ = _inputs(5, 1, 24, 24, 2, 1, 16)
  out = kernels.flash_attention(q, k, v)
  _assert_close(out, kernels.flash_attention(q, k, v, impl="xla"), 1e-5)


def test_traced_window_under_scan_matches_per_layer_static_windows():
  """Per-layer windows scanned as a traced array, NO_WINDOW = global."""
  q, k, v, _ = _inputs(2, 1, 30, 30, 2, 2, 16)
  windows = jnp.array([4, reference.NO_WINDOW], jnp.int32)

  def layer(x, w):
    return kernels.flash_attention(x, k, v, sliding_window=w,
                                   block_sizes=TINY), None

  out, _ = jax.jit(lambda x: jax.lax.scan(layer, x, windows))(q)
  expected = reference.attention(reference.attention(q, k, v,
                                                     sliding_window=4), k, v)
  _assert_close(out, expected, 1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(impl="triton"), "unknown impl"),
    (dict(sliding_window=0), "sliding_window must be >= 1"),
    (dict(sliding_window=2.5), "sliding_window must be an int"),
    (dict(softcap=-1.0), "softcap must be finite and > 0"),
    (dict(softcap=jnp.float32(2.0)), "softcap must be a Python number"),
    (dict(segment_ids=jnp.zeros((2, 7), jnp.int32)), "segment_ids must have"),
    (dict(impl="cudnn"),  # fp32 inputs
     "needs a GPU" if jax.default_backend() != "gpu" else "bfloat16 inputs"),
    (dict(block_sizes=kernels.AttentionBlockSizes(block_q=24)),
     "power of two"),
    (dict(backend="mosaic"), "unknown Pallas backend"),
    (dict(backend="mosaic_tpu",
          block_sizes=kernels.TpuAttentionBlockSizes(block_k=192)),
     "block_k must be a positive multiple of 128"),
    (dict(backend="mosaic_tpu", block_sizes=TINY),
     "'mosaic_tpu' kernels take TpuAttentionBlockSizes"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
  q, k, v, _ = _inputs(0, 2, 8, 8, 4, 2, 16)
  with pytest.raises(ValueError, match=match):
    kernels.flash_attention(q, k, v, **kwargs)


def test_bad_shapes_raise_value_error():
  q, k, v, _ = _inputs(0, 1, 8, 8, 3, 2, 16)
  with pytest.raises(ValueError, match="multiple of key/value heads"):
    kernels.flash_attention(q, k, v)
  with pytest.raises(ValueError, match="dtypes differ"):
    kernels.flash_attention(q[:, :, :2], k.astype(jnp.bfloat16), v)
  with pytest.raises(ValueError, match=r"\[batch, time, heads, head_dim\]"):
    kernels.flash_attention(q[0], k, v)
