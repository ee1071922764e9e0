"""Flash attention as Triton kernels (GPU): forward, dQ and dK/dV.

Pallas' Triton backend; on a GPU these compile, anywhere else they run
interpreted. :func:`agentic_rl.kernels.flash.flash_attention` is the entry
point and holds the ``custom_vjp``; this module supplies :func:`forward` and
:func:`backward` on ``[B, T, H, D]`` operands and the GPU tile sizes
(:class:`AttentionBlockSizes`, which also selects the Hopper kernels of
:mod:`agentic_rl.kernels.hopper.flash` for either side).

Algorithm: FlashAttention-2 (Dao, 2023, arXiv:2307.08691). For each block of
queries the kernel streams key/value blocks, keeping the running row max
``m``, the running softmax denominator ``l`` and the unnormalised output in
fp32 (the "online softmax"); it stores ``lse = m + log l`` for the backward
pass, which recomputes ``P = exp(S - lse)`` block by block. The kernels work
in base 2 (logits times ``log2 e``, ``exp2``, and a base-2 ``lse``): the same
softmax with a cheaper exponential on GPU (see
:func:`agentic_rl.kernels._common.online_softmax_step`).

    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  delta = rowsum(O * dO)
    dQ = scale * dS K,   dK = scale * dS^T Q

(with a soft-cap ``S = c * tanh(S_raw / c)`` the chain rule adds a factor
``1 - tanh^2``). Masking follows :func:`agentic_rl.kernels.reference.attention`
exactly: query ``t`` sees key ``s`` iff (not causal or ``s <= t``), ``t - s <
window`` and the segment ids agree; positions are ``arange``. Rows that see no
key return zeros and get zero gradients.

The backward runs as a dQ kernel (per query block, streaming keys) and a
dK/dV kernel (per key block, streaming queries): 7 tile matmuls per block
pair, each kernel recomputing ``P`` and ``dP``, so no cross-program atomics
are needed (FlashAttention-2's 5-matmul schedule adds dQ from the dK/dV
kernel with fp32 atomic adds).

Layout is ``[batch, time, heads, head_dim]`` like
``jax.nn.dot_product_attention``; key/value may have fewer heads (GQA/MQA):
query head ``h`` reads key/value head ``h // (H // K)``. Lengths that are not
block multiples are zero-padded (padded keys are masked, padded query rows
are sliced off), and the head dim is padded to a power of two, as Triton
tiles must be powers of two. The masking and block-skipping rules live in
:mod:`agentic_rl.kernels.attention_rules`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from agentic_rl.kernels import _common
from agentic_rl.kernels import attention_rules as rules

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

  The defaults are the tile search's choice (``python -m
  experiments.bench_kernels --tune`` and ``--ab``) at T = 4096, head_dim
  128, bf16; the measurements are in BENCHMARKS.md.

  ``fwd`` and ``bwd``: the forward's and the backward's kernels, ``"triton"``
  (every case) or ``"mosaic_gpu"`` (:mod:`agentic_rl.kernels.hopper.flash`:
  Hopper warpgroup matmuls and a warp-specialised TMA pipeline; 16-bit inputs,
  self-attention, lengths that are multiples of its tiles, head_dim a multiple
  of 64 up to 256, no segment ids or soft-cap, static windows; other cases
  raise). Either side runs with either other side (they share the residuals).
  ``*_mgpu`` (backward) and ``*_fwd_mgpu`` (forward): their query and key tiles
  (multiples of 64), pipeline depth and compute warpgroups per program (each
  owns one query or key tile; they share the streamed tiles).
  ``longest_first_mgpu``: the forward and dQ kernels start with the last query
  tiles, which see the most keys under a causal mask (an ordering to time; off
  by default). ``pingpong_fwd_mgpu``: the forward's two compute warpgroups take
  turns at the tensor cores, one's softmax running while the other's matmuls do
  (FlashAttention-3's schedule; to time, off by default).
  ``register_operands_mgpu``: the kernels keep ``P`` and ``dS`` in registers as
  the left operand of their matmuls, and the forward accumulates ``P V`` in
  place (as FlashAttention-3 and jax's Mosaic GPU attention do); False stages
  them through shared memory, as the interpreter always does (it models wgmma
  on shared-memory operands only). ``fused_dq_mgpu``: the backward is one
  kernel, FlashAttention-3's: the dK/dV kernel also adds each step's dQ terms
  into an fp32 buffer by TMA reduce-adds (5 tile matmuls per block pair instead
  of 7; dQ's summation order then varies from run to run; head_dim a multiple
  of 64 x ``warpgroups_mgpu``; to time, off by default). The Hopper kernels are
  tested in Pallas' GPU interpreter and compiled for an H200 on CPU
  (``experiments/aot_kernels.py``); they have not run on a GPU.
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
class Config:
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
  # The Hopper kernels' configs (hopper.flash.Config) for a side that runs
  # them (AttentionBlockSizes.fwd/bwd == "mosaic_gpu"), else None.
  mosaic_fwd: Any = None
  mosaic_bwd: Any = None


def make_config(q_shape, k_shape, *, causal, softcap, has_segments,
                 has_window, blocks: AttentionBlockSizes, interpret) -> Config:
  _, T, H, D = q_shape
  S, K = k_shape[1], k_shape[2]
  name = "AttentionBlockSizes."
  bq = _common.block_size(blocks.block_q, T, name + "block_q")
  bk = _common.block_size(blocks.block_k, S, name + "block_k")
  bq_dq = _common.block_size(blocks.block_q_dq, T, name + "block_q_dq")
  bk_dq = _common.block_size(blocks.block_k_dq, S, name + "block_k_dq")
  bq_dkv = _common.block_size(blocks.block_q_dkv, T, name + "block_q_dkv")
  bk_dkv = _common.block_size(blocks.block_k_dkv, S, name + "block_k_dkv")
  return Config(
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


def _tile_mask(cfg: Config, q_pos, k_pos, q_seg, k_seg, window):
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


def _split_refs(cfg: Config, refs, n_main: int):
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


def _fwd_kernel(*refs, cfg: Config):
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


def _dq_kernel(*refs, cfg: Config):
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


def _dkdv_kernel(*refs, cfg: Config):
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

  # P^T and dS^T are transposed register tiles here (S = Q K^T as in the
  # forward), not tiles computed transposed (S^T = K Q^T).
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


def _extra_operands(cfg: Config, q_seg, k_seg, window, q_block, k_block):
  """Specs/operands for segment ids and window; blocks are (shape, index)."""
  specs, args = [], []
  if cfg.has_segments:
    specs += [pl.BlockSpec(*q_block), pl.BlockSpec(*k_block)]
    args += [q_seg, k_seg]
  if cfg.has_window:
    specs.append(pl.BlockSpec((), lambda *_: ()))
    args.append(window)
  return specs, args


def _forward(cfg: Config, q, k, v, q_seg, k_seg, window):
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


def _backward(cfg: Config, q, k, v, do, lse, delta, q_seg, k_seg, window):
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


def _dq_call(cfg: Config, q, k, v, do, lse, delta, q_seg, k_seg, window,
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
# Forward and backward on [B, T, H, D] operands (padded on the way in, sliced
# on the way out).


def _pad_qkv(cfg: Config, q, k, v):
  pad = _common.pad_axis
  q = pad(pad(q, 1, cfg.Tp), 3, cfg.Dp)
  k = pad(pad(k, 1, cfg.Sp), 3, cfg.Dp)
  v = pad(pad(v, 1, cfg.Sp), 3, cfg.Dp)
  return q, k, v


def _pad_segments(cfg: Config, segment_ids):
  if segment_ids is None:
    return None, None
  return (_common.pad_axis(segment_ids, 1, cfg.Tp),
          _common.pad_axis(segment_ids, 1, cfg.Sp))


def forward(cfg: Config, q, k, v, segment_ids, window):
  """``(out [B, T, H, D], lse [B, H, Tp])``; ``lse`` is base 2, padded."""
  T, D = q.shape[1], q.shape[3]
  qp, kp, vp = _pad_qkv(cfg, q, k, v)
  q_seg, k_seg = _pad_segments(cfg, segment_ids)
  out, lse = _forward(cfg, qp, kp, vp, q_seg, k_seg, window)
  return out[:, :T, :, :D], lse


def backward(cfg: Config, q, k, v, d_out, lse, delta_BxHxT, segment_ids,
             window):
  """``(dq, dk, dv)`` from the forward's ``lse`` and ``delta``."""
  T, S, D = q.shape[1], k.shape[1], q.shape[3]
  delta = _common.pad_axis(delta_BxHxT, 2, cfg.Tp)
  qp, kp, vp = _pad_qkv(cfg, q, k, v)
  dop = _common.pad_axis(_common.pad_axis(d_out, 1, cfg.Tp), 3, cfg.Dp)
  q_seg, k_seg = _pad_segments(cfg, segment_ids)
  dq, dk, dv = _backward(cfg, qp, kp, vp, dop, lse, delta, q_seg, k_seg, window)
  return dq[:, :T, :, :D], dk[:, :S, :, :D], dv[:, :S, :, :D]
