"""Flash attention for TPU: Pallas Mosaic forward, dQ and dK/dV kernels.

The algorithm is that of the Triton kernels in :mod:`..triton.flash`
(FlashAttention-2 with the online softmax), with the same masking and
block-skipping rules (:mod:`attention_rules`); the layout follows Mosaic's
rules:

* operands are head-major ``[B, H, T, D]`` (the wrapper transposes; a block's
  last two dims must be multiples of ``(8, 128)`` or whole), with the head
  dim whole and sequence tiles that are multiples of 128;
* the key blocks are the innermost grid dimension, marked ``"arbitrary"``:
  the running max, denominator and output live in VMEM scratch across it,
  initialised at the first key block and written out at the last. Blocks a
  query tile cannot see are skipped, and their index map repeats the last
  visible block, so Mosaic's pipeline does not fetch them again;
* per-row statistics (``lse``, ``delta``) travel lane-dense, ``[B, H, 1,
  T]`` (no larger than ``[B, H, T]``): the forward kernel transposes its
  lane-broadcast ``[bq, 128]`` log-sum-exp into a row, the dQ kernel turns
  the rows back into columns once per query tile, and the dK/dV kernel works
  on transposed tiles (``S^T = K Q^T``, ``[bk, bq]``), where a row is what it
  needs. Segment ids come both lane-broadcast (``[B, T, 128]``, columns) and
  sublane-broadcast (``[B, 8, T]``, rows), so no block has a minor dimension
  of 1;
* the sliding window is a scalar-prefetch operand (SMEM), so index maps can
  skip blocks outside it.

:mod:`agentic_rl.kernels.flash` wraps :func:`forward` and :func:`backward`
in its ``custom_vjp``. dK/dV runs on grid ``(B, K, key blocks, H // K, query
blocks)``: the query heads that share a key/value head and the query blocks
are both reduction dimensions, so GQA accumulates into one dK/dV tile.

On CPU these kernels run in Mosaic's TPU interpret mode
(``pltpu.InterpretParams``), which fills out-of-bounds and uninitialised
memory with NaN, so masking mistakes show up in the tests.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from agentic_rl.kernels import _common
from agentic_rl.kernels import attention_rules as rules
from agentic_rl.kernels import reference

_SQ = _common.SQUEEZED
LANES, SUBLANES = _common.TPU_LANES, _common.TPU_SUBLANES


@dataclasses.dataclass(frozen=True)
class TpuAttentionBlockSizes:
  """Sequence tiles of the Mosaic kernels (multiples of 128; clipped to the
  sequence rounded up to 128). Same roles as in :class:`AttentionBlockSizes`.
  """
  block_q: int = 512
  block_k: int = 512
  block_q_dq: int = 256
  block_k_dq: int = 512
  block_q_dkv: int = 256
  block_k_dkv: int = 512
  vmem_limit_bytes: int | None = None  # None: Mosaic's scoped default


@dataclasses.dataclass(frozen=True)
class Config:
  """What the kernels specialise on (the fields :mod:`attention_rules`
  reads have the same names as in :mod:`..triton.flash`'s config)."""
  causal: bool
  softcap: float | None
  scale: float
  has_segments: bool
  has_window: bool
  T: int
  S: int
  Tp: int
  Sp: int
  groups: int
  bq: int
  bk: int
  bq_dq: int
  bk_dq: int
  bq_dkv: int
  bk_dkv: int
  vmem_limit_bytes: int | None
  interpret: bool


def make_config(q_shape, k_shape, *, causal, softcap, has_segments,
                has_window, blocks: TpuAttentionBlockSizes,
                interpret) -> Config:
  _, T, H, D = q_shape
  S, K = k_shape[1], k_shape[2]
  tile = functools.partial(_common.tpu_tile, owner="TpuAttentionBlockSizes")
  bq, bq_dq, bq_dkv = (tile(getattr(blocks, n), T, n)
                       for n in ("block_q", "block_q_dq", "block_q_dkv"))
  bk, bk_dq, bk_dkv = (tile(getattr(blocks, n), S, n)
                       for n in ("block_k", "block_k_dq", "block_k_dkv"))
  return Config(
      causal=causal, softcap=softcap, scale=float(D) ** -0.5,
      has_segments=has_segments, has_window=has_window, T=T, S=S,
      Tp=_common.round_up(T, math.lcm(bq, bq_dq, bq_dkv)),
      Sp=_common.round_up(S, math.lcm(bk, bk_dq, bk_dkv)), groups=H // K,
      bq=bq, bk=bk, bq_dq=bq_dq, bk_dq=bk_dq, bq_dkv=bq_dkv, bk_dkv=bk_dkv,
      vmem_limit_bytes=blocks.vmem_limit_bytes, interpret=interpret)


# --------------------------------------------------------------------------
# Shared in-kernel pieces.


def _window(cfg: Config, win_ref):
  return win_ref[0] if cfg.has_window else None


def _col(ref):
  """A lane-broadcast ``[n, LANES]`` block as a column ``[n, 1]``."""
  return ref[...][:, :1]


def _row(ref):
  """A ``[SUBLANES or 1, n]`` block as a row ``[1, n]``."""
  return ref[...][:1, :]


def _lanes_to_row(x):
  """``[n, LANES]`` with equal lanes -> the row ``[1, n]`` (a transpose)."""
  return jnp.transpose(x)[:1, :]


def _row_to_lanes(x):
  """A row ``[1, n]`` -> ``[n, LANES]`` with equal lanes (a transpose)."""
  return jnp.transpose(jnp.broadcast_to(x, (LANES, x.shape[1])))


def _mask(cfg: Config, q_start, k_start, bq, bk, qs_ref, ks_ref, window, *,
          keys_by_rows=False):
  """Boolean visibility of one ``[bq, bk]`` tile, or of a transposed
  ``[bk, bq]`` one with ``keys_by_rows`` (2-D iotas, as Mosaic wants).
  Segment-id blocks: a column block for the tile's rows, a row block for its
  columns."""
  shape, q_axis = ((bk, bq), 1) if keys_by_rows else ((bq, bk), 0)
  q_pos = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
  k_pos = k_start + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
  q_seg = k_seg = None
  if qs_ref is not None:
    q_seg, k_seg = ((_row(qs_ref), _col(ks_ref)) if keys_by_rows
                    else (_col(qs_ref), _row(ks_ref)))
  return rules.visible(cfg, q_pos, k_pos, q_seg, k_seg, window, shape)


def _when_visible(cfg: Config, j, ranges, full_ranges, step):
  """Runs ``step(masked)`` if block ``j`` is in ``[lo, hi)``: unmasked when
  the block is fully visible, masked otherwise."""
  lo, hi = ranges
  run = (j >= lo) & (j < hi)
  if not rules.needs_mask(cfg):
    pl.when(run)(lambda: step(False))
    return
  full = full_ranges()
  if full is None:
    pl.when(run)(lambda: step(True))
    return
  full_lo, full_hi = full
  is_full = (j >= full_lo) & (j < full_hi)
  pl.when(run & is_full)(lambda: step(False))
  pl.when(run & jnp.logical_not(is_full))(lambda: step(True))


def _clamp(j, lo, hi):
  """Block index for the index maps: skipped blocks repeat a visible one."""
  return jnp.clip(j, lo, jnp.maximum(hi - 1, lo))


def _segment_specs(cfg, segments, q_block, k_block, *, keys_by_rows=False):
  """Block specs and operands for the segment ids, if any: ``segments`` is
  ``(columns [B, P, LANES], rows [B, SUBLANES, P])``; the queries read
  columns and the keys rows, or the reverse with ``keys_by_rows``. Blocks
  are ``(block shape, index map)``."""
  if not cfg.has_segments:
    return [], []
  cols, rows = segments
  return ([pl.BlockSpec(*q_block), pl.BlockSpec(*k_block)],
          [rows, cols] if keys_by_rows else [cols, rows])


def _split(cfg, refs, n_main):
  refs = list(refs)
  main, rest = refs[:n_main], refs[n_main:]
  qs = ks = None
  if cfg.has_segments:
    qs, ks, *rest = rest
  return main, qs, ks, rest


def _params(cfg: Config, *semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics,
                              vmem_limit_bytes=cfg.vmem_limit_bytes)


# --------------------------------------------------------------------------
# Forward.


def _fwd_kernel(win_ref, *refs, cfg: Config):
  (q_ref, k_ref, v_ref), qs_ref, ks_ref, (o_ref, lse_ref, m_scr, l_scr,
                                          acc_scr) = _split(cfg, refs, 3)
  bq, bk = cfg.bq, cfg.bk
  i, j = pl.program_id(2), pl.program_id(3)
  q_start, k_start = i * bq, j * bk
  window = _window(cfg, win_ref)

  @pl.when(j == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, _common.MASKED, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  def step(masked):
    s, _ = rules.logits(cfg, q_ref[...], k_ref[...])
    mask = (_mask(cfg, q_start, k_start, bq, bk, qs_ref, ks_ref, window)
            if masked else None)
    carry = (acc_scr[...], _col(m_scr), _col(l_scr))
    acc, m, l = _common.online_softmax_step(carry, s, mask, v_ref[...],
                                            keepdims=True)
    acc_scr[...] = acc
    m_scr[...] = jnp.broadcast_to(m, m_scr.shape)
    l_scr[...] = jnp.broadcast_to(l, l_scr.shape)

  _when_visible(
      cfg, j, rules.key_blocks(cfg, q_start, bq, bk, window),
      lambda: rules.full_key_blocks(cfg, q_start, bq, bk, window), step)

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    l = l_scr[...]
    seen = l > 0.0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = (acc_scr[...] / l_safe[:, :1]).astype(o_ref.dtype)
    lse_ref[...] = _lanes_to_row(
        jnp.where(seen, m_scr[...] + jnp.log(l_safe), 0.0))


def _kv_index(cfg, bq, bk):
  """Index map of a key/value tile on a (b, h, q block, k block) grid."""
  def index(b, h, i, j, win_ref):
    window = _window(cfg, win_ref)
    lo, hi = rules.key_blocks(cfg, i * bq, bq, bk, window)
    return b, h // cfg.groups, _clamp(j, lo, hi), 0
  return index


def _forward(cfg: Config, q, k, v, segments, window):
  """Head-major padded operands -> (out ``[B, H, Tp, D]``, lse
  ``[B, H, 1, Tp]``)."""
  B, H, _, D = q.shape
  bq, bk = cfg.bq, cfg.bk
  kv_index = _kv_index(cfg, bq, bk)

  def seg_k(b, h, i, j, win_ref):
    return b, 0, kv_index(b, h, i, j, win_ref)[2]

  extra_specs, extra = _segment_specs(
      cfg, segments, ((_SQ, bq, LANES), lambda b, h, i, j, w: (b, i, 0)),
      ((_SQ, SUBLANES, bk), seg_k))
  q_block = pl.BlockSpec((_SQ, _SQ, bq, D), lambda b, h, i, j, w: (b, h, i, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(B, H, cfg.Tp // bq, cfg.Sp // bk),
      in_specs=[q_block, pl.BlockSpec((_SQ, _SQ, bk, D), kv_index),
                pl.BlockSpec((_SQ, _SQ, bk, D), kv_index)] + extra_specs,
      out_specs=[q_block, pl.BlockSpec((_SQ, _SQ, 1, bq),
                                       lambda b, h, i, j, w: (b, h, 0, i))],
      scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),
                      pltpu.VMEM((bq, LANES), jnp.float32),
                      pltpu.VMEM((bq, D), jnp.float32)])
  return pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg),
      grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((B, H, 1, cfg.Tp), jnp.float32)],
      compiler_params=_params(cfg, "parallel", "parallel", "parallel",
                              "arbitrary"),
      interpret=_common.tpu_interpret(cfg.interpret),
      name="flash_attention_fwd_tpu",
  )(window, q, k, v, *extra)


# --------------------------------------------------------------------------
# Backward.


def _probs_and_ds(cfg, q, k, v, do, lse, delta, mask, keys_by_rows=False):
  """``P = exp(S - lse)`` and ``dS`` (before the scale) for one ``[bq, bk]``
  tile (``lse``, ``delta``: columns), or ``P^T`` and ``dS^T`` for a
  ``[bk, bq]`` one with ``keys_by_rows`` (``lse``, ``delta``: rows)."""
  if keys_by_rows:
    s, t = rules.logits(cfg, k, q)
    dp = _common.dot_nt(v, do)
  else:
    s, t = rules.logits(cfg, q, k)
    dp = _common.dot_nt(do, v)
  p = jnp.exp(s - lse)
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  ds = p * (dp - delta)
  if t is not None:
    ds = ds * (1.0 - t * t)
  return p, ds


def _dq_kernel(win_ref, *refs, cfg: Config):
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, (
      dq_ref, dq_scr, lse_scr, delta_scr) = _split(cfg, refs, 6)
  bq, bk = cfg.bq_dq, cfg.bk_dq
  i, j = pl.program_id(2), pl.program_id(3)
  q_start, k_start = i * bq, j * bk
  window = _window(cfg, win_ref)

  @pl.when(j == 0)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)
    lse_scr[...] = _row_to_lanes(lse_ref[...])  # rows -> columns, once
    delta_scr[...] = _row_to_lanes(delta_ref[...])

  def step(masked):
    mask = (_mask(cfg, q_start, k_start, bq, bk, qs_ref, ks_ref, window)
            if masked else None)
    k = k_ref[...]
    _, ds = _probs_and_ds(cfg, q_ref[...], k, v_ref[...], do_ref[...],
                          _col(lse_scr), _col(delta_scr), mask)
    dq_scr[...] += _common.dot_nn(ds.astype(k.dtype), k)

  _when_visible(
      cfg, j, rules.key_blocks(cfg, q_start, bq, bk, window),
      lambda: rules.full_key_blocks(cfg, q_start, bq, bk, window), step)

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = (dq_scr[...] * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(win_ref, *refs, cfg: Config):
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, (
      dk_ref, dv_ref, dk_scr, dv_scr) = _split(cfg, refs, 6)
  bq, bk = cfg.bq_dkv, cfg.bk_dkv
  j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
  q_start, k_start = i * bq, j * bk
  window = _window(cfg, win_ref)

  @pl.when((g == 0) & (i == 0))
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  def step(masked):
    mask = (_mask(cfg, q_start, k_start, bq, bk, qs_ref, ks_ref, window,
                  keys_by_rows=True) if masked else None)
    q, do = q_ref[...], do_ref[...]
    p_t, ds_t = _probs_and_ds(cfg, q, k_ref[...], v_ref[...], do,
                              lse_ref[...], delta_ref[...], mask,
                              keys_by_rows=True)  # [bk, bq]
    dv_scr[...] += _common.dot_nn(p_t.astype(do.dtype), do)
    dk_scr[...] += _common.dot_nn(ds_t.astype(q.dtype), q)

  _when_visible(
      cfg, i, rules.query_blocks(cfg, k_start, bk, bq, window),
      lambda: rules.full_query_blocks(cfg, k_start, bk, bq, window), step)

  @pl.when((g == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1))
  def _finish():
    dk_ref[...] = (dk_scr[...] * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _backward(cfg: Config, q, k, v, do, lse, delta, segments, window):
  B, H, _, D = q.shape
  K = k.shape[1]
  G = cfg.groups
  interpret = _common.tpu_interpret(cfg.interpret)

  # dQ: grid (b, h, query block, key block).
  bq, bk = cfg.bq_dq, cfg.bk_dq
  kv_index = _kv_index(cfg, bq, bk)
  q_tile = pl.BlockSpec((_SQ, _SQ, bq, D), lambda b, h, i, j, w: (b, h, i, 0))
  row = pl.BlockSpec((_SQ, _SQ, 1, bq), lambda b, h, i, j, w: (b, h, 0, i))
  kv = pl.BlockSpec((_SQ, _SQ, bk, D), kv_index)
  extra_specs, extra = _segment_specs(
      cfg, segments, ((_SQ, bq, LANES), lambda b, h, i, j, w: (b, i, 0)),
      ((_SQ, SUBLANES, bk),
       lambda b, h, i, j, w: (b, 0, kv_index(b, h, i, j, w)[2])))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(B, H, cfg.Tp // bq, cfg.Sp // bk),
          in_specs=[q_tile, kv, kv, q_tile, row, row] + extra_specs,
          out_specs=q_tile,
          scratch_shapes=[pltpu.VMEM((bq, D), jnp.float32),
                          pltpu.VMEM((bq, LANES), jnp.float32),
                          pltpu.VMEM((bq, LANES), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_params(cfg, "parallel", "parallel", "parallel",
                              "arbitrary"),
      interpret=interpret, name="flash_attention_dq_tpu",
  )(window, q, k, v, do, lse, delta, *extra)

  # dK/dV: grid (b, kv head, key block, query head in group, query block).
  bq, bk = cfg.bq_dkv, cfg.bk_dkv

  def q_index(b, kh, j, g, i, win_ref):
    lo, hi = rules.query_blocks(cfg, j * bk, bk, bq, _window(cfg, win_ref))
    return b, kh * G + g, _clamp(i, lo, hi), 0

  def row_index(*ids):
    b, h, i, _ = q_index(*ids)
    return b, h, 0, i

  q_tile = pl.BlockSpec((_SQ, _SQ, bq, D), q_index)
  row = pl.BlockSpec((_SQ, _SQ, 1, bq), row_index)
  kv = pl.BlockSpec((_SQ, _SQ, bk, D), lambda b, kh, j, g, i, w: (b, kh, j, 0))
  extra_specs, extra = _segment_specs(
      cfg, segments,
      ((_SQ, SUBLANES, bq),
       lambda b, kh, j, g, i, w: (b, 0, q_index(b, kh, j, g, i, w)[2])),
      ((_SQ, bk, LANES), lambda b, kh, j, g, i, w: (b, j, 0)),
      keys_by_rows=True)
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, cfg=cfg),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(B, K, cfg.Sp // bk, G, cfg.Tp // bq),
          in_specs=[q_tile, kv, kv, q_tile, row, row] + extra_specs,
          out_specs=[kv, kv],
          scratch_shapes=[pltpu.VMEM((bk, D), jnp.float32),
                          pltpu.VMEM((bk, D), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(cfg, "parallel", "parallel", "parallel",
                              "arbitrary", "arbitrary"),
      interpret=interpret, name="flash_attention_dkdv_tpu",
  )(window, q, k, v, do, lse, delta, *extra)
  return dq, dk, dv


# --------------------------------------------------------------------------
# The family's forward and backward on [B, T, H, D] operands (the custom_vjp
# around them is :func:`flash._flash`): head-major and padded on the way in.


def _heads_major(x, length):
  """``[B, T, H, D]`` -> ``[B, H, length, D]`` (zero-padded)."""
  return _common.pad_axis(jnp.swapaxes(x, 1, 2), 2, length)


def _operands(cfg: Config, q, k, v, segment_ids, window):
  segments = None
  if segment_ids is not None:  # (columns, rows), padded to either length
    ids = _common.pad_axis(segment_ids, 1, max(cfg.Tp, cfg.Sp))
    B, P = ids.shape
    segments = (jnp.broadcast_to(ids[:, :, None], (B, P, LANES)),
                jnp.broadcast_to(ids[:, None, :], (B, SUBLANES, P)))
  if window is None:
    window = jnp.asarray(reference.NO_WINDOW, jnp.int32)
  return (_heads_major(q, cfg.Tp), _heads_major(k, cfg.Sp),
          _heads_major(v, cfg.Sp), segments, window.reshape(1))


def forward(cfg: Config, q, k, v, segment_ids, window):
  """``(out [B, T, H, D], lse residual)``."""
  qh, kh, vh, segments, w = _operands(cfg, q, k, v, segment_ids, window)
  out, lse = _forward(cfg, qh, kh, vh, segments, w)
  return jnp.swapaxes(out[:, :, :cfg.T], 1, 2), lse


def backward(cfg: Config, q, k, v, d_out, lse, delta_BxHxT, segment_ids,
             window):
  """``(dq, dk, dv)`` in the operands' layout."""
  delta = _common.pad_axis(delta_BxHxT, 2, cfg.Tp)[:, :, None, :]
  qh, kh, vh, segments, w = _operands(cfg, q, k, v, segment_ids, window)
  dq, dk, dv = _backward(cfg, qh, kh, vh, _heads_major(d_out, cfg.Tp), lse,
                         delta, segments, w)
  back = lambda x, n: jnp.swapaxes(x[:, :, :n], 1, 2)
  return back(dq, cfg.T), back(dk, cfg.S), back(dv, cfg.S)
