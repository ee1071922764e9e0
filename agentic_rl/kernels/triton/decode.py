"""Decode attention as a Triton kernel (GPU): split-K flash decoding.

Pallas' Triton backend; on a GPU it compiles, anywhere else it runs
interpreted. :func:`agentic_rl.kernels.decode.decode_attention` is the entry
point (the rule of which cache slots are visible is in its docstring).

Split-K "flash decoding" (Dao et al., 2023): the grid is ``(batch, kv_head,
split)``; each program streams its share of the cache in ``block_k`` tiles
for all ``H // K`` query heads of one key/value head (GQA reads each cache
tile once), keeping an fp32 online softmax, and writes partial ``(acc, max,
denominator)``; a small XLA epilogue merges the splits. Only blocks below
``lengths[b]`` (and inside the window) are read. The cache is never copied:
the last tile is shifted back to end at ``S`` and its already-seen slots are
masked, so ``S`` need not be a multiple of ``block_k`` (a cache shorter than
16 slots or a head dim that is not a power of two >= 16 is padded, which
copies it). The cache may be sequence-major ``[B, S, K, D]`` or head-major
``[B, K, S, D]``: each program reads one head's ``[S, D]`` slab either way.
Forward only (no VJP).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from agentic_rl.kernels import _common

_SQ = _common.SQUEEZED

# Programs to aim for when choosing the number of splits (about 2 waves on a
# 132-SM H100/H200).
_TARGET_PROGRAMS = 264


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
  """Cache tile (power of two >= 16), splits (None: heuristic), launch."""
  block_k: int = 128
  num_splits: int | None = None
  num_warps: int = 4
  num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class Config:
  softcap: float | None
  scale: float
  has_window: bool
  S: int  # cache slots (after any padding)
  Gp: int  # query heads per kv head, padded to a power of two >= 16
  Dp: int
  bk: int
  blocks_per_split: int
  num_splits: int
  num_warps: int
  num_stages: int
  interpret: bool


def make_config(q_shape, S, K, *, softcap, has_window,
                 blocks: DecodeBlockSizes, interpret) -> Config:
  B, H, D = q_shape
  S = max(S, _common.MIN_BLOCK)
  bk = _common.block_size(blocks.block_k, S, "DecodeBlockSizes.block_k")
  if bk > S:  # the tile must fit in the cache: largest power of two <= S
    bk = 1 << (S.bit_length() - 1)
  n_blocks = pl.cdiv(S, bk)
  splits = blocks.num_splits
  if splits is None:
    splits = pl.cdiv(_TARGET_PROGRAMS, B * K)
  if splits < 1:
    raise ValueError(f"DecodeBlockSizes.num_splits must be >= 1, got {splits}")
  per_split = pl.cdiv(n_blocks, min(splits, n_blocks))
  return Config(
      softcap=softcap, scale=float(D) ** -0.5, has_window=has_window, S=S,
      Gp=max(_common.MIN_BLOCK, _common.next_pow2(H // K)),
      Dp=max(_common.MIN_BLOCK, _common.next_pow2(D)), bk=bk,
      blocks_per_split=per_split, num_splits=pl.cdiv(n_blocks, per_split),
      num_warps=blocks.num_warps, num_stages=blocks.num_stages,
      interpret=interpret)


def _kernel(*refs, cfg: Config):
  if cfg.has_window:
    q_ref, k_ref, v_ref, len_ref, w_ref, o_ref, m_ref, l_ref = refs
    window = w_ref[()]
  else:
    q_ref, k_ref, v_ref, len_ref, o_ref, m_ref, l_ref = refs
    window = None
  bk = cfg.bk
  split = pl.program_id(2)
  length = len_ref[()]
  q = q_ref[...]  # [Gp, Dp]
  first = jnp.int32(0) if window is None else jnp.maximum(length - window, 0)
  lo = jnp.maximum(split * cfg.blocks_per_split, lax.div(first, bk))
  hi = jnp.minimum((split + 1) * cfg.blocks_per_split,
                   lax.div(jnp.minimum(length, cfg.S) + bk - 1, bk))

  def body(j, carry):
    start = j * bk
    load = jnp.minimum(start, cfg.S - bk)  # last tile ends at S
    k = k_ref[pl.ds(load, bk), :]
    v = v_ref[pl.ds(load, bk), :]
    s = _common.dot_nt(q, k) * cfg.scale
    if cfg.softcap is not None:
      s = cfg.softcap * jnp.tanh(s / cfg.softcap)
    pos = load + lax.iota(jnp.int32, bk)
    mask = (pos >= jnp.maximum(start, first)) & (pos < length)
    return _common.online_softmax_step(
        carry, s, jnp.broadcast_to(mask[None, :], s.shape), v)

  acc, m, l = lax.fori_loop(lo, hi, body,
                            _common.online_softmax_init(cfg.Gp, cfg.Dp))
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def _pallas(cfg: Config, q_BxKxGxD, k, v, lengths, window, head_major):
  B, K = q_BxKxGxD.shape[:2]
  NS, Gp, Dp, S = cfg.num_splits, cfg.Gp, cfg.Dp, cfg.S
  if head_major:
    kv = pl.BlockSpec((_SQ, _SQ, S, Dp), lambda b, h, s: (b, h, 0, 0))
  else:
    kv = pl.BlockSpec((_SQ, S, _SQ, Dp), lambda b, h, s: (b, 0, h, 0))
  in_specs = [pl.BlockSpec((_SQ, _SQ, Gp, Dp), lambda b, h, s: (b, h, 0, 0)),
              kv, kv, pl.BlockSpec((_SQ,), lambda b, h, s: (b,))]
  args = [q_BxKxGxD, k, v, lengths]
  if cfg.has_window:
    in_specs.append(pl.BlockSpec((), lambda *_: ()))
    args.append(window)
  stat = pl.BlockSpec((_SQ, _SQ, _SQ, Gp), lambda b, h, s: (b, h, s, 0))
  return pl.pallas_call(
      functools.partial(_kernel, cfg=cfg),
      grid=(B, K, NS),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((_SQ, _SQ, _SQ, Gp, Dp),
                              lambda b, h, s: (b, h, s, 0, 0)), stat, stat],
      out_shape=[jax.ShapeDtypeStruct((B, K, NS, Gp, Dp), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, NS, Gp), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, NS, Gp), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=cfg.interpret,
      name="decode_attention",
  )(*args)


def _merge_splits(acc, m, l):
  """Merges per-split softmax partials along axis 2; empty rows give 0."""
  m_max = jnp.max(m, axis=2, keepdims=True)
  w = jnp.where(l > 0, jnp.exp(m - m_max), 0.0)
  denom = jnp.sum(w * l, axis=2)
  out = jnp.sum(w[..., None] * acc, axis=2)
  return out / jnp.where(denom > 0, denom, 1.0)[..., None]


def attention(cfg: Config, q_BxKxGxD, k, v, lengths_B, window, head_major):
  """``[B, K, G, D]`` in q's dtype; ``k``, ``v`` ``[B, S, K, D]`` or, with
  ``head_major``, ``[B, K, S, D]``; ``lengths_B`` already clipped to ``S``."""
  B, K, G, D = q_BxKxGxD.shape
  s_axis = 2 if head_major else 1
  pad = _common.pad_axis
  q4 = pad(pad(q_BxKxGxD, 2, cfg.Gp), 3, cfg.Dp)
  k = pad(pad(k, s_axis, cfg.S), 3, cfg.Dp)
  v = pad(pad(v, s_axis, cfg.S), 3, cfg.Dp)
  acc, m, l = _pallas(cfg, q4, k, v, lengths_B, window, head_major)
  out = _merge_splits(acc, m, l)  # [B, K, Gp, Dp]
  return out[:, :, :G, :D].astype(q_BxKxGxD.dtype)
