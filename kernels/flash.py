"""Flash attention: Pallas forward and backward kernels, and the entry point.

This module holds the Triton kernels and :func:`flash_attention`, which
dispatches to them, to the Mosaic TPU kernels (:mod:`flash_tpu`), to XLA or
to cuDNN.

Algorithm: FlashAttention-2 (Dao, 2023, arXiv:2307.08691). For each block of
queries the kernel streams key/value blocks, keeping the running row max
``m``, the running softmax denominator ``l`` and the unnormalised output in
fp32 (the "online softmax"); it stores ``lse = m + log l`` for the backward
pass, which recomputes ``P = exp(S - lse)`` block by block. The Triton
kernels work in base 2 (logits times ``log2 e``, ``exp2``, and a base-2
``lse``): the same softmax with a cheaper exponential on GPU (see
:func:`_common.online_softmax_step`).

    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  delta = rowsum(O * dO)
    dQ = scale * dS K,   dK = scale * dS^T Q

(with a soft-cap ``S = c * tanh(S_raw / c)`` the chain rule adds a factor
``1 - tanh^2``). Masking follows :func:`agentic_rl.kernels.reference.attention`
exactly: query ``t`` sees key ``s`` iff (not causal or ``s <= t``), ``t - s <
window`` and the segment ids agree; positions are ``arange``. Rows that see no
key return zeros and get zero gradients.

The backward runs as a dQ kernel (per query block, streaming keys) and a
dK/dV kernel (per key block, streaming queries): 7 tile matmuls per block
pair. FlashAttention-2's own schedule, 5 matmuls with dQ added by fp32 atomic
adds from the dK/dV kernel, made fwd+bwd 2.0-2.6x slower on an H200 (jax's
Triton lowering emits only ``acq_rel`` atomics; BENCHMARKS.md, run 4), and
was removed. ``AttentionBlockSizes(fwd="mosaic_gpu", bwd="mosaic_gpu")``
runs the forward and the same two backward kernels for Hopper instead
(:mod:`flash_mgpu`), each side independently of the other.

Layout is ``[batch, time, heads, head_dim]`` like
``jax.nn.dot_product_attention``; key/value may have fewer heads (GQA/MQA):
query head ``h`` reads key/value head ``h // (H // K)``. Lengths that are not
block multiples are zero-padded in the wrapper (padded keys are masked, padded
query rows are sliced off), and the head dim is padded to a power of two, as
Triton tiles must be powers of two. The masking and block-skipping rules
live in :mod:`attention_rules`.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from agentic_rl.kernels import _common
from agentic_rl.kernels import attention_rules as rules
from agentic_rl.kernels import flash_mgpu
from agentic_rl.kernels import flash_tpu
from agentic_rl.kernels import reference
from agentic_rl.kernels.flash_tpu import TpuAttentionBlockSizes

_SQ = _common.SQUEEZED


@dataclasses.dataclass(frozen=True)
class AttentionBlockSizes:
  """Tile sizes (powers of two >= 16) and Triton launch parameters.

  ``block_q``/``block_k``: forward query tile and streamed key tile.
  ``*_dq``: the dQ kernel (query tile, streamed key tile). ``*_dkv``: the
  dK/dV kernel (key tile, streamed query tile). Tiles are clipped to the
  sequence length, so small inputs use small tiles. ``num_warps_*`` and
  ``num_stages_*`` (software-pipelining depth) are Triton launch parameters
  of the forward and of both backward kernels.

  The defaults come from ``python -m agentic_rl.kernels.bench --tune`` on an
  H200 at T = 4096, head_dim 128, bf16, checked against noise with ``--ab``
  (``num_stages_fwd`` 3: GQA forward 1.89 -> 1.68 ms; see BENCHMARKS.md).

  ``fwd`` and ``bwd``: the forward's and the backward's kernels,
  ``"triton"`` (every case) or ``"mosaic_gpu"`` (:mod:`flash_mgpu`: Hopper
  warpgroup matmuls and a warp-specialised TMA pipeline; 16-bit inputs,
  self-attention, lengths that are multiples of its tiles, head_dim a
  multiple of 64 up to 256, no segment ids or soft-cap, static windows;
  other cases raise). Either side runs with either other side (they share
  the residuals). ``*_mgpu`` (backward) and ``*_fwd_mgpu`` (forward): their
  query and key tiles (multiples of 64), pipeline depth and compute
  warpgroups per program (each owns one query or key tile; they share the
  streamed tiles). ``longest_first_mgpu``: the forward and dQ kernels
  start with the last query tiles, which see the most keys under a causal
  mask (an ordering to time; off by default). ``pingpong_fwd_mgpu``: the
  forward's two compute warpgroups take turns at the tensor cores, one's
  softmax running while the other's matmuls do (FlashAttention-3's
  schedule; to time, off by default). ``register_operands_mgpu``: the
  kernels keep ``P`` and ``dS`` in registers as the left operand of their
  matmuls, and the forward accumulates ``P V`` in place (as
  FlashAttention-3 and jax's Mosaic GPU attention do); False stages them
  through shared memory, as the interpreter always does (it models wgmma
  on shared-memory operands only). ``fused_dq_mgpu``: the backward is one
  kernel, FlashAttention-3's: the dK/dV kernel also adds each step's dQ
  terms into an fp32 buffer by TMA reduce-adds (5 tile matmuls per block
  pair instead of 7; dQ's summation order then varies from run to run;
  head_dim a multiple of 64 x ``warpgroups_mgpu``; to time, off by
  default). Tested in Pallas' GPU interpreter and compiled for an H200 on
  CPU (:mod:`aot`); not yet run or timed on a GPU.
  """
  block_q: int = 128
  block_k: int = 128
  block_q_dq: int = 128
  block_k_dq: int = 64
  block_q_dkv: int = 128
  block_k_dkv: int = 64
  num_warps_fwd: int = 8
  num_warps_bwd: int = 8
  num_stages_fwd: int = 3
  num_stages_bwd: int = 2
  bwd: str = "triton"
  block_q_mgpu: int = 64
  block_k_mgpu: int = 64
  stages_mgpu: int = 2
  warpgroups_mgpu: int = 2
  fwd: str = "triton"
  block_q_fwd_mgpu: int = 64
  block_k_fwd_mgpu: int = 128
  stages_fwd_mgpu: int = 2
  warpgroups_fwd_mgpu: int = 2
  longest_first_mgpu: bool = False
  pingpong_fwd_mgpu: bool = False
  register_operands_mgpu: bool = True
  fused_dq_mgpu: bool = False


@dataclasses.dataclass(frozen=True)
class _Config:
  """Everything the kernels specialise on (hashable: a custom_vjp static)."""
  causal: bool
  softcap: float | None
  scale: float
  has_segments: bool
  has_window: bool
  T: int  # true query length
  S: int  # true key length
  Tp: int  # padded lengths
  Sp: int
  Dp: int  # padded head dim
  groups: int  # query heads per key/value head
  bq: int
  bk: int
  bq_dq: int
  bk_dq: int
  bq_dkv: int
  bk_dkv: int
  num_warps_fwd: int
  num_warps_bwd: int
  num_stages_fwd: int
  num_stages_bwd: int
  interpret: bool
  mosaic_fwd: flash_mgpu.Config | None = None  # fwd="mosaic_gpu"
  mosaic_bwd: flash_mgpu.Config | None = None  # bwd="mosaic_gpu"


def _make_config(q_shape, k_shape, *, causal, softcap, has_segments,
                 has_window, blocks: AttentionBlockSizes, interpret) -> _Config:
  _, T, H, D = q_shape
  S, K = k_shape[1], k_shape[2]
  name = "AttentionBlockSizes."
  bq = _common.block_size(blocks.block_q, T, name + "block_q")
  bk = _common.block_size(blocks.block_k, S, name + "block_k")
  bq_dq = _common.block_size(blocks.block_q_dq, T, name + "block_q_dq")
  bk_dq = _common.block_size(blocks.block_k_dq, S, name + "block_k_dq")
  bq_dkv = _common.block_size(blocks.block_q_dkv, T, name + "block_q_dkv")
  bk_dkv = _common.block_size(blocks.block_k_dkv, S, name + "block_k_dkv")
  return _Config(
      causal=causal, softcap=softcap, scale=float(D) ** -0.5,
      has_segments=has_segments, has_window=has_window, T=T, S=S,
      Tp=_common.round_up(T, max(bq, bq_dq, bq_dkv)),
      Sp=_common.round_up(S, max(bk, bk_dq, bk_dkv)),
      Dp=max(_common.MIN_BLOCK, _common.next_pow2(D)), groups=H // K,
      bq=bq, bk=bk, bq_dq=bq_dq, bk_dq=bk_dq, bq_dkv=bq_dkv, bk_dkv=bk_dkv,
      num_warps_fwd=blocks.num_warps_fwd, num_warps_bwd=blocks.num_warps_bwd,
      num_stages_fwd=blocks.num_stages_fwd,
      num_stages_bwd=blocks.num_stages_bwd, interpret=interpret)


# --------------------------------------------------------------------------
# In-kernel helpers (shared by the forward, dQ and dK/dV kernels).


def _tile_mask(cfg: _Config, q_pos, k_pos, q_seg, k_seg, window):
  """:func:`rules.visible` for 1-D positions and segment ids (Triton tiles)."""
  return rules.visible(cfg, q_pos[:, None], k_pos[None, :],
                       None if q_seg is None else q_seg[:, None],
                       None if k_seg is None else k_seg[None, :], window,
                       (q_pos.shape[0], k_pos.shape[0]))


def _spans(lo, hi, full):
  """Splits block range [lo, hi) into (start, stop, masked) loops.

  ``full`` is None (every block needs the mask) or the range of blocks in
  which every pair is visible; those run without mask arithmetic.
  """
  if full is None:
    return [(lo, hi, True)]
  full_lo, full_hi = full
  a = jnp.clip(full_lo, lo, hi)
  b = jnp.clip(full_hi, a, hi)
  return [(lo, a, True), (a, b, False), (b, hi, True)]


def _split_refs(cfg: _Config, refs, n_main: int):
  """Splits kernel refs into (main inputs, q_seg, k_seg, window, outputs)."""
  refs = list(refs)
  main, rest = refs[:n_main], refs[n_main:]
  q_seg = k_seg = window = None
  if cfg.has_segments:
    q_seg, k_seg, *rest = rest
  if cfg.has_window:
    window, *rest = rest
  return main, q_seg, k_seg, window, rest


def _loop(spans, body, carry):
  """Runs ``body(masked, i, carry)`` over each (start, stop, masked) span."""
  for start, stop, masked in spans:
    carry = lax.fori_loop(start, stop, functools.partial(body, masked), carry)
  return carry


def _block_ranges(cfg, start, size, other, window, blocks, full_blocks):
  lo, hi = blocks(cfg, start, size, other, window)
  if not rules.needs_mask(cfg):
    return [(lo, hi, False)]
  return _spans(lo, hi, full_blocks(cfg, start, size, other, window))


# --------------------------------------------------------------------------
# Kernels.


def _fwd_kernel(*refs, cfg: _Config):
  (q_ref, k_ref, v_ref), qs_ref, ks_ref, w_ref, (o_ref, lse_ref) = (
      _split_refs(cfg, refs, 3))
  bq, bk = cfg.bq, cfg.bk
  q_start = pl.program_id(0) * bq
  q = q_ref[...]
  q_pos = q_start + lax.iota(jnp.int32, bq)
  q_seg = None if qs_ref is None else qs_ref[...]
  window = None if w_ref is None else w_ref[()]

  def body(masked, j, carry):
    k_start = pl.multiple_of(j * bk, bk)
    k = k_ref[pl.ds(k_start, bk), :]
    v = v_ref[pl.ds(k_start, bk), :]
    s, _ = rules.logits(cfg, q, k, base2=True)
    mask = None
    if masked:
      k_seg = None if ks_ref is None else ks_ref[pl.ds(k_start, bk)]
      mask = _tile_mask(cfg, q_pos, k_start + lax.iota(jnp.int32, bk),
                        q_seg, k_seg, window)
    return _common.online_softmax_step(carry, s, mask, v, base2=True)

  spans = _block_ranges(cfg, q_start, bq, bk, window, rules.key_blocks,
                        rules.full_key_blocks)
  acc, m, l = _loop(spans, body, _common.online_softmax_init(bq, cfg.Dp))
  seen = l > 0.0
  l_safe = jnp.where(seen, l, 1.0)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  # Base 2. Rows that see nothing store lse = 0: their P is masked to 0.
  lse_ref[...] = jnp.where(seen, m + jnp.log2(l_safe), 0.0)


def _dq_kernel(*refs, cfg: _Config):
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, w_ref, (
      dq_ref,) = _split_refs(cfg, refs, 6)
  bq, bk = cfg.bq_dq, cfg.bk_dq
  q_start = pl.program_id(0) * bq
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]
  q_pos = q_start + lax.iota(jnp.int32, bq)
  q_seg = None if qs_ref is None else qs_ref[...]
  window = None if w_ref is None else w_ref[()]

  def body(masked, j, dq):
    k_start = pl.multiple_of(j * bk, bk)
    k = k_ref[pl.ds(k_start, bk), :]
    v = v_ref[pl.ds(k_start, bk), :]
    s, t = rules.logits(cfg, q, k, base2=True)
    mask = None
    if masked:
      k_seg = None if ks_ref is None else ks_ref[pl.ds(k_start, bk)]
      mask = _tile_mask(cfg, q_pos, k_start + lax.iota(jnp.int32, bk),
                        q_seg, k_seg, window)
    p = jnp.exp2(s - lse[:, None])
    if mask is not None:
      p = jnp.where(mask, p, 0.0)
    ds = p * (_common.dot_nt(do, v) - delta[:, None])
    if t is not None:
      ds = ds * (1.0 - t * t)
    return dq + _common.dot_nn(ds.astype(k.dtype), k)

  spans = _block_ranges(cfg, q_start, bq, bk, window, rules.key_blocks,
                        rules.full_key_blocks)
  dq = _loop(spans, body, jnp.zeros((bq, cfg.Dp), jnp.float32))
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, cfg: _Config):
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, w_ref, (
      dk_ref, dv_ref) = _split_refs(cfg, refs, 6)
  bq, bk = cfg.bq_dkv, cfg.bk_dkv
  k_start = pl.program_id(0) * bk
  k = k_ref[...]
  v = v_ref[...]
  k_pos = k_start + lax.iota(jnp.int32, bk)
  k_seg = None if ks_ref is None else ks_ref[...]
  window = None if w_ref is None else w_ref[()]
  spans = _block_ranges(cfg, k_start, bk, bq, window, rules.query_blocks,
                        rules.full_query_blocks)

  # P^T and dS^T are transposed register tiles here. Transposed tiles
  # instead (S^T = K Q^T, transposing only loaded Q and dO) measured slower
  # on an H200 (BENCHMARKS.md, run 3).
  def group(g, carry):
    def body(masked, i, carry):
      dk, dv = carry
      q_start = pl.multiple_of(i * bq, bq)
      rows = pl.ds(q_start, bq)
      q = q_ref[rows, g, :]
      do = do_ref[rows, g, :]
      lse = lse_ref[g, rows]
      delta = delta_ref[g, rows]
      s, t = rules.logits(cfg, q, k, base2=True)
      mask = None
      if masked:
        q_seg = None if qs_ref is None else qs_ref[rows]
        mask = _tile_mask(cfg, q_start + lax.iota(jnp.int32, bq), k_pos,
                          q_seg, k_seg, window)
      p = jnp.exp2(s - lse[:, None])
      if mask is not None:
        p = jnp.where(mask, p, 0.0)
      dv = dv + _common.dot_tn(p.astype(do.dtype), do)
      ds = p * (_common.dot_nt(do, v) - delta[:, None])
      if t is not None:
        ds = ds * (1.0 - t * t)
      dk = dk + _common.dot_tn(ds.astype(q.dtype), q)
      return dk, dv
    return _loop(spans, body, carry)

  zeros = jnp.zeros((bk, cfg.Dp), jnp.float32)
  if cfg.groups == 1:
    dk, dv = group(0, (zeros, zeros))
  else:
    dk, dv = lax.fori_loop(0, cfg.groups, group, (zeros, zeros))
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# --------------------------------------------------------------------------
# pallas_call wrappers (inputs already padded).


def _extra_operands(cfg: _Config, q_seg, k_seg, window, q_block, k_block):
  """Specs/operands for segment ids and window; blocks are (shape, index)."""
  specs, args = [], []
  if cfg.has_segments:
    specs += [pl.BlockSpec(*q_block), pl.BlockSpec(*k_block)]
    args += [q_seg, k_seg]
  if cfg.has_window:
    specs.append(pl.BlockSpec((), lambda *_: ()))
    args.append(window)
  return specs, args


def _forward(cfg: _Config, q, k, v, q_seg, k_seg, window):
  B, _, H, _ = q.shape
  G, bq, Dp, Sp = cfg.groups, cfg.bq, cfg.Dp, cfg.Sp
  specs = [
      pl.BlockSpec((_SQ, bq, _SQ, Dp), lambda i, b, h: (b, i, h, 0)),
      pl.BlockSpec((_SQ, Sp, _SQ, Dp), lambda i, b, h: (b, 0, h // G, 0)),
      pl.BlockSpec((_SQ, Sp, _SQ, Dp), lambda i, b, h: (b, 0, h // G, 0)),
  ]
  extra_specs, extra = _extra_operands(
      cfg, q_seg, k_seg, window,
      ((_SQ, bq), lambda i, b, h: (b, i)),
      ((_SQ, Sp), lambda i, b, h: (b, 0)))
  return pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg),
      grid=(cfg.Tp // bq, B, H),
      in_specs=specs + extra_specs,
      out_specs=[
          pl.BlockSpec((_SQ, bq, _SQ, Dp), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((_SQ, _SQ, bq), lambda i, b, h: (b, h, i)),
      ],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((B, H, cfg.Tp), jnp.float32)],
      compiler_params=plgpu.CompilerParams(
          num_warps=cfg.num_warps_fwd, num_stages=cfg.num_stages_fwd),
      interpret=cfg.interpret,
      name="flash_attention_fwd",
  )(q, k, v, *extra)


def _backward(cfg: _Config, q, k, v, do, lse, delta, q_seg, k_seg, window):
  B, K = k.shape[0], k.shape[2]
  G, Dp, Tp, Sp = cfg.groups, cfg.Dp, cfg.Tp, cfg.Sp
  params = plgpu.CompilerParams(num_warps=cfg.num_warps_bwd,
                                num_stages=cfg.num_stages_bwd)

  dq = _dq_call(cfg, q, k, v, do, lse, delta, q_seg, k_seg, window, params)

  bk = cfg.bk_dkv
  q_all = pl.BlockSpec((_SQ, Tp, G, Dp), lambda j, b, kh: (b, 0, kh, 0))
  kv_tile = pl.BlockSpec((_SQ, bk, _SQ, Dp), lambda j, b, kh: (b, j, kh, 0))
  rows = pl.BlockSpec((_SQ, G, Tp), lambda j, b, kh: (b, kh, 0))
  extra_specs, extra = _extra_operands(
      cfg, q_seg, k_seg, window,
      ((_SQ, Tp), lambda j, b, kh: (b, 0)),
      ((_SQ, bk), lambda j, b, kh: (b, j)))
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, cfg=cfg),
      grid=(Sp // bk, B, K),
      in_specs=[q_all, kv_tile, kv_tile, q_all, rows, rows] + extra_specs,
      out_specs=[kv_tile, kv_tile],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=params, interpret=cfg.interpret,
      name="flash_attention_dkdv",
  )(q, k, v, do, lse, delta, *extra)
  return dq, dk, dv


def _dq_call(cfg: _Config, q, k, v, do, lse, delta, q_seg, k_seg, window,
             params):
  B, _, H, _ = q.shape
  G, Dp, Tp, Sp = cfg.groups, cfg.Dp, cfg.Tp, cfg.Sp
  bq = cfg.bq_dq
  q_tile = pl.BlockSpec((_SQ, bq, _SQ, Dp), lambda i, b, h: (b, i, h, 0))
  kv_all = pl.BlockSpec((_SQ, Sp, _SQ, Dp), lambda i, b, h: (b, 0, h // G, 0))
  row = pl.BlockSpec((_SQ, _SQ, bq), lambda i, b, h: (b, h, i))
  extra_specs, extra = _extra_operands(
      cfg, q_seg, k_seg, window,
      ((_SQ, bq), lambda i, b, h: (b, i)),
      ((_SQ, Sp), lambda i, b, h: (b, 0)))
  return pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg),
      grid=(Tp // bq, B, H),
      in_specs=[q_tile, kv_all, kv_all, q_tile, row, row] + extra_specs,
      out_specs=q_tile,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=params, interpret=cfg.interpret,
      name="flash_attention_dq",
  )(q, k, v, do, lse, delta, *extra)


# --------------------------------------------------------------------------
# GPU forward and backward on [B, T, H, D] operands: the Triton kernels
# (padded on the way in, sliced on the way out) or the Mosaic GPU ones.


def _pad_qkv(cfg: _Config, q, k, v):
  pad = _common.pad_axis
  q = pad(pad(q, 1, cfg.Tp), 3, cfg.Dp)
  k = pad(pad(k, 1, cfg.Sp), 3, cfg.Dp)
  v = pad(pad(v, 1, cfg.Sp), 3, cfg.Dp)
  return q, k, v


def _pad_segments(cfg: _Config, segment_ids):
  if segment_ids is None:
    return None, None
  return (_common.pad_axis(segment_ids, 1, cfg.Tp),
          _common.pad_axis(segment_ids, 1, cfg.Sp))


def _gpu_forward(cfg: _Config, q, k, v, segment_ids, window):
  if cfg.mosaic_fwd is not None:  # lse padded as the Triton backward reads it
    out, lse = flash_mgpu.forward(cfg.mosaic_fwd, q, k, v)
    return out, _common.pad_axis(lse, 2, cfg.Tp)
  T, D = q.shape[1], q.shape[3]
  qp, kp, vp = _pad_qkv(cfg, q, k, v)
  q_seg, k_seg = _pad_segments(cfg, segment_ids)
  out, lse = _forward(cfg, qp, kp, vp, q_seg, k_seg, window)
  return out[:, :T, :, :D], lse


def _gpu_backward(cfg: _Config, q, k, v, d_out, lse, delta_BxHxT,
                  segment_ids, window):
  if cfg.mosaic_bwd is not None:
    return flash_mgpu.backward(cfg.mosaic_bwd, q, k, v, d_out, lse,
                               delta_BxHxT)
  T, S, D = q.shape[1], k.shape[1], q.shape[3]
  delta = _common.pad_axis(delta_BxHxT, 2, cfg.Tp)
  qp, kp, vp = _pad_qkv(cfg, q, k, v)
  dop = _common.pad_axis(_common.pad_axis(d_out, 1, cfg.Tp), 3, cfg.Dp)
  q_seg, k_seg = _pad_segments(cfg, segment_ids)
  dq, dk, dv = _backward(cfg, qp, kp, vp, dop, lse, delta, q_seg, k_seg, window)
  return dq[:, :T, :, :D], dk[:, :S, :, :D], dv[:, :S, :, :D]


# --------------------------------------------------------------------------
# The custom_vjp, for either kernel family (chosen by the config's type).


def _family(cfg):
  """``(forward, backward)`` of the kernel family ``cfg`` configures."""
  if isinstance(cfg, flash_tpu.Config):
    return flash_tpu.forward, flash_tpu.backward
  return _gpu_forward, _gpu_backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, segment_ids, window):
  return _family(cfg)[0](cfg, q, k, v, segment_ids, window)[0]


def _flash_fwd(cfg, q, k, v, segment_ids, window):
  out, lse = _family(cfg)[0](cfg, q, k, v, segment_ids, window)
  return out, (q, k, v, segment_ids, window, out, lse)


def row_delta(out_BxTxHxD, d_out_BxTxHxD):
  """``delta = rowsum(O * dO)``, fp32 ``[B, H, T]``: the backward kernels'
  per-row term of ``dS = P * (dP - delta)``."""
  return jnp.einsum("bthd,bthd->bht", out_BxTxHxD.astype(jnp.float32),
                    d_out_BxTxHxD.astype(jnp.float32))


def _flash_bwd(cfg, res, d_out):
  """:func:`row_delta`, then the family's dQ and dK/dV kernels."""
  q, k, v, segment_ids, window, out, lse = res
  d_out = d_out.astype(q.dtype)
  delta = row_delta(out, d_out)
  grads = _family(cfg)[1](cfg, q, k, v, d_out, lse, delta, segment_ids,
                          window)
  return (*grads, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


# --------------------------------------------------------------------------
# Public entry point.

IMPLS = ("xla", "pallas", "cudnn")


def _validate(q, k, v, segment_ids):
  op = "flash_attention"
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{op}: {name} must be [batch, time, heads, head_dim], "
                       f"got shape {x.shape}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"{op}: q must be floating point, got {q.dtype}")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(f"{op}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, "
                     f"{v.dtype}")
  if k.shape != v.shape:
    raise ValueError(f"{op}: k {k.shape} and v {v.shape} shapes differ")
  B, T, H, D = q.shape
  if k.shape[0] != B or k.shape[3] != D:
    raise ValueError(f"{op}: q {q.shape} and k {k.shape} disagree on batch "
                     f"or head_dim")
  if H % k.shape[2]:
    raise ValueError(f"{op}: query heads {H} must be a multiple of key/value "
                     f"heads {k.shape[2]}")
  if min(q.shape) == 0 or min(k.shape) == 0:
    raise ValueError(f"{op}: empty input: q {q.shape}, k {k.shape}")
  if segment_ids is not None:
    if segment_ids.shape != (B, T):
      raise ValueError(f"{op}: segment_ids must have shape {(B, T)}, got "
                       f"{segment_ids.shape}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"{op}: segment_ids must be integers, got "
                       f"{segment_ids.dtype}")
    if k.shape[1] != T:
      raise ValueError(f"{op}: segment_ids need equal query and key lengths, "
                       f"got {T} and {k.shape[1]}")


def _cudnn(q, k, v, *, causal, segment_ids, window, softcap):
  op = "flash_attention(impl='cudnn')"
  if (platform := _common.target_platform()) not in ("gpu", "cuda"):
    raise ValueError(f"{op} needs a GPU; the platform is {platform!r}")
  if q.dtype not in (jnp.float16, jnp.bfloat16):
    raise ValueError(f"{op} needs float16 or bfloat16 inputs, got {q.dtype}")
  if softcap is not None:
    raise ValueError(f"{op} does not support softcap")
  local = None
  if window is not None:
    if not isinstance(window, int):
      raise ValueError(f"{op} needs a static int sliding_window")
    if not causal:
      raise ValueError(f"{op} supports sliding_window only with causal=True")
    local = (window - 1, 0)
  mask = None
  if segment_ids is not None:
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
  return jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=causal, local_window_size=local,
      implementation="cudnn")


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    sliding_window: int | jax.Array | None = None,
    softcap: float | None = None,
    impl: str = "pallas",
    block_sizes: AttentionBlockSizes | TpuAttentionBlockSizes | None = None,
    backend: str | None = None,
) -> jax.Array:
  """Multi-head attention ``softmax(q k^T / sqrt(D)) v``, differentiable.

  Args:
    q: ``[B, T, H, D]`` queries. k, v: ``[B, S, K, D]`` with ``H % K == 0``
      (GQA/MQA), same floating dtype as q.
    causal: query ``t`` sees keys ``s <= t`` (positions are ``arange``).
    segment_ids: optional int ``[B, T]`` (needs ``S == T``); tokens attend
      only within their segment (packed or padded sequences).
    sliding_window: optional window ``w``: query ``t`` sees keys with
      ``t - s < w``. A Python int >= 1 or an int32 scalar array (may be
      traced; ``reference.NO_WINDOW`` is global attention).
    softcap: optional ``c > 0``: logits become ``c * tanh(logits / c)``.
    impl: ``"pallas"`` (the kernels of ``backend``), ``"xla"``
      (:func:`reference.attention`) or ``"cudnn"`` (GPU only, through
      ``jax.nn.dot_product_attention``; no softcap, static causal window).
    block_sizes: Pallas tiles: :class:`AttentionBlockSizes` for Triton,
      :class:`TpuAttentionBlockSizes` for Mosaic; None for the defaults.
    backend: Pallas kernels, ``"triton"`` or ``"mosaic_tpu"``; None picks the
      platform's (Triton on GPU and CPU, Mosaic on TPU). On CPU both run
      interpreted.

  Returns:
    ``[B, T, H, D]`` in q's dtype; rows that see no key are zero.
  """
  _common.check_impl("flash_attention", impl, IMPLS)
  _validate(q, k, v, segment_ids)
  softcap = _common.static_positive_float("flash_attention", "softcap", softcap)
  window = _common.window_operand("flash_attention", sliding_window)
  if impl == "xla":
    return reference.attention(q, k, v, causal=causal, segment_ids=segment_ids,
                               sliding_window=sliding_window, softcap=softcap)
  if impl == "cudnn":
    return _cudnn(q, k, v, causal=causal, segment_ids=segment_ids,
                  window=sliding_window, softcap=softcap)
  family, interpret = _common.pallas_backend("flash_attention", backend)
  if segment_ids is not None:
    segment_ids = segment_ids.astype(jnp.int32)
  config = dict(causal=bool(causal), softcap=softcap,
                has_segments=segment_ids is not None,
                has_window=window is not None, interpret=interpret)
  if family == "mosaic_tpu":
    blocks = _common.block_sizes_for("flash_attention", family, block_sizes,
                                     TpuAttentionBlockSizes)
    cfg = flash_tpu.make_config(q.shape, k.shape, blocks=blocks, **config)
    return _flash(cfg, q, k, v, segment_ids, window)
  blocks = _common.block_sizes_for("flash_attention", family, block_sizes,
                                   AttentionBlockSizes)
  cfg = _make_config(q.shape, k.shape, blocks=blocks, **config)
  mosaic = functools.partial(
      _mosaic_config, q, k, blocks, causal=bool(causal),
      segment_ids=segment_ids, sliding_window=sliding_window, softcap=softcap,
      interpret=interpret)
  cfg = dataclasses.replace(cfg, mosaic_fwd=mosaic("fwd"),
                            mosaic_bwd=mosaic("bwd"))
  return _flash(cfg, q, k, v, segment_ids, window)


# AttentionBlockSizes' Mosaic GPU fields, per side.
_MGPU_FIELDS = {
    "fwd": ("block_q_fwd_mgpu", "block_k_fwd_mgpu", "stages_fwd_mgpu",
            "warpgroups_fwd_mgpu"),
    "bwd": ("block_q_mgpu", "block_k_mgpu", "stages_mgpu", "warpgroups_mgpu"),
}


def _mosaic_config(q, k, blocks: AttentionBlockSizes, side: str, *, causal,
                   segment_ids, sliding_window, softcap, interpret):
  """The :mod:`flash_mgpu` config of ``side`` ("fwd" or "bwd") when
  ``blocks`` selects ``"mosaic_gpu"`` for it (None for ``"triton"``), or a
  clear error for a case it does not cover."""
  kind = getattr(blocks, side)
  if kind == "triton":
    return None
  op = (f"flash_attention(block_sizes=AttentionBlockSizes("
        f"{side}='mosaic_gpu'))")
  if kind != "mosaic_gpu":
    raise ValueError(f"flash_attention: AttentionBlockSizes.{side} must be "
                     f"'triton' or 'mosaic_gpu', got {kind!r}")
  if sliding_window is not None:
    if not isinstance(sliding_window, numbers.Integral):
      raise ValueError(f"{op} needs a static int sliding_window, got "
                       f"{type(sliding_window).__name__}")
    sliding_window = int(sliding_window)
  bq, bk, stages, warpgroups = (getattr(blocks, f) for f in _MGPU_FIELDS[side])
  fused_dq = side == "bwd" and blocks.fused_dq_mgpu
  for name, value in zip(_MGPU_FIELDS[side][2:], (stages, warpgroups)):
    if value < 1:
      raise ValueError(f"{op}: {name} must be >= 1, got {value}")
  reason = flash_mgpu.unsupported(
      q.shape, k.shape, q.dtype, has_segments=segment_ids is not None,
      softcap=softcap, bq=bq, bk=bk, warpgroups=warpgroups, fused_dq=fused_dq)
  if reason:
    raise ValueError(f"{op} {reason}; {side}='triton' covers every case")
  if interpret and not flash_mgpu.CAN_INTERPRET:
    raise ValueError(f"{op} runs off a GPU only in Pallas' GPU interpreter, "
                     f"which needs jax >= 0.11 (this is {jax.__version__})")
  return flash_mgpu.make_config(
      q.shape, k.shape, causal=causal, window=sliding_window, bq=bq, bk=bk,
      stages=stages, warpgroups=warpgroups, interpret=interpret,
      longest_first=blocks.longest_first_mgpu,
      pingpong=side == "fwd" and blocks.pingpong_fwd_mgpu,
      register_operands=blocks.register_operands_mgpu, fused_dq=fused_dq)
