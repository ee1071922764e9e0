"""Decode attention for TPU: one Pallas Mosaic kernel.

Same visibility rule as :mod:`agentic_rl.kernels.decode` (slot ``j`` of row
``b`` is visible iff
``j < lengths[b]`` and, with a window, ``lengths[b] - 1 - j < window``). The
grid is ``(batch, kv_head, cache block)`` with the cache blocks innermost and
``"arbitrary"``: the online softmax of all ``H // K`` query heads of one
key/value head lives in VMEM scratch across them, so each cache tile is read
once for the whole group (GQA). ``lengths`` and the window are scalar-prefetch
operands: blocks past a row's length or before its window are skipped, and
their index map repeats a visible block, so Mosaic does not fetch them. The
cache is read in place in the model's head-major ``[B, K, S, D]`` layout (a
sequence-major cache is transposed first, which copies it). When ``S`` is not
a multiple of the tile, the last tile's rows past ``S`` are zeroed before
the ``P V`` product (they hold padding, which the TPU interpreter fills with
NaN).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from agentic_rl.kernels import _common

_SQ = _common.SQUEEZED
LANES = _common.TPU_LANES


@dataclasses.dataclass(frozen=True)
class TpuDecodeBlockSizes:
  """Cache tile of the Mosaic kernel: a multiple of 128 (a cache of at most
  ``block_k`` slots is one tile)."""
  block_k: int = 512
  vmem_limit_bytes: int | None = None  # None: Mosaic's scoped default


@dataclasses.dataclass(frozen=True)
class _Config:
  softcap: float | None
  scale: float
  has_window: bool
  S: int
  bk: int
  vmem_limit_bytes: int | None
  interpret: bool


def make_config(q_shape, S, *, softcap, has_window,
                blocks: TpuDecodeBlockSizes, interpret) -> _Config:
  bk = _common.tpu_tile(blocks.block_k, S, "block_k",
                        owner="TpuDecodeBlockSizes")
  return _Config(softcap=softcap, scale=float(q_shape[-1]) ** -0.5,
                 has_window=has_window, S=S, bk=S if S <= bk else bk,
                 vmem_limit_bytes=blocks.vmem_limit_bytes, interpret=interpret)


def _visible_blocks(cfg: _Config, length, window):
  """(first visible slot, [lo, hi) range of cache blocks) of one row."""
  first = jnp.int32(0) if window is None else jnp.maximum(length - window, 0)
  return first, lax.div(first, cfg.bk), lax.div(length + cfg.bk - 1, cfg.bk)


def _window(cfg: _Config, win_ref):
  return win_ref[0] if cfg.has_window else None


def _kernel(len_ref, win_ref, q_ref, k_ref, v_ref, o_ref, m_scr, l_scr,
            acc_scr, *, cfg: _Config):
  b, j = pl.program_id(0), pl.program_id(2)
  bk = cfg.bk
  length = len_ref[b]
  first, lo, hi = _visible_blocks(cfg, length, _window(cfg, win_ref))

  @pl.when(j == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, _common.MASKED, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  @pl.when((j >= lo) & (j < hi))
  def _step():
    q = q_ref[...]  # [G, D]
    s = _common.dot_nt(q, k_ref[...]) * cfg.scale
    if cfg.softcap is not None:
      s = cfg.softcap * jnp.tanh(s / cfg.softcap)
    pos = j * bk + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    mask = (pos >= first) & (pos < length)
    v = v_ref[...]
    if cfg.S % bk:  # the last tile runs past the cache
      rows = j * bk + lax.broadcasted_iota(jnp.int32, v.shape, 0)
      v = jnp.where(rows < cfg.S, v, jnp.zeros_like(v))
    carry = (acc_scr[...], m_scr[...][:, :1], l_scr[...][:, :1])
    acc, m, l = _common.online_softmax_step(carry, s, mask, v, keepdims=True)
    acc_scr[...] = acc
    m_scr[...] = jnp.broadcast_to(m, m_scr.shape)
    l_scr[...] = jnp.broadcast_to(l, l_scr.shape)

  @pl.when(j == pl.num_programs(2) - 1)
  def _finish():
    l = l_scr[...][:, :1]
    o_ref[...] = (acc_scr[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def attention(cfg: _Config, q_BxKxGxD, k_BxKxSxD, v_BxKxSxD, lengths_B,
              window):
  """``[B, K, G, D]`` decode attention over a head-major cache; lengths
  already clipped to ``S``, window an int32 scalar or None."""
  B, K, G, D = q_BxKxGxD.shape
  bk = cfg.bk

  def kv_index(b, h, j, len_ref, win_ref):
    _, lo, hi = _visible_blocks(cfg, len_ref[b], _window(cfg, win_ref))
    return b, h, jnp.clip(j, lo, jnp.maximum(hi - 1, lo)), 0

  q_block = pl.BlockSpec((_SQ, _SQ, G, D), lambda b, h, j, *_: (b, h, 0, 0))
  kv_block = pl.BlockSpec((_SQ, _SQ, bk, D), kv_index)
  if window is None:
    window = jnp.zeros((), jnp.int32)  # unused
  return pl.pallas_call(
      functools.partial(_kernel, cfg=cfg),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(B, K, pl.cdiv(cfg.S, bk)),
          in_specs=[q_block, kv_block, kv_block], out_specs=q_block,
          scratch_shapes=[pltpu.VMEM((G, LANES), jnp.float32),
                          pltpu.VMEM((G, LANES), jnp.float32),
                          pltpu.VMEM((G, D), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct(q_BxKxGxD.shape, q_BxKxGxD.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=cfg.vmem_limit_bytes),
      interpret=_common.tpu_interpret(cfg.interpret),
      name="decode_attention_tpu",
  )(lengths_B, window.reshape(1), q_BxKxGxD, k_BxKxSxD, v_BxKxSxD)
