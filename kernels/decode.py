"""Decode attention: one query token per row against a KV cache.

This module holds the Triton kernel and :func:`decode_attention`, which
dispatches to it, to the Mosaic TPU kernel (:mod:`decode_tpu`) or to XLA.

For the rollout engine. Row ``b`` has ``lengths[b]`` filled cache slots and its
query sits at position ``lengths[b] - 1``, so slot ``j`` is visible iff ``j <
lengths[b]`` and, with a window ``w``, ``lengths[b] - 1 - j < w`` (the same
rule as :func:`reference.attention` with those positions). Rows with length 0
return zeros.

The Pallas kernel is split-K "flash decoding" (Dao et al., 2023): the grid is
``(batch, kv_head, split)``; each program streams its share of the cache in
``block_k`` tiles for all ``H // K`` query heads of one key/value head (GQA
reads each cache tile once), keeping an fp32 online softmax, and writes
partial ``(acc, max, denominator)``; a small XLA epilogue merges the splits.
Only blocks below ``lengths[b]`` (and inside the window) are read. The cache
is never copied: the last tile is shifted back to end at ``S`` and its
already-seen slots are masked, so ``S`` need not be a multiple of
``block_k`` (a cache shorter than 16 slots or a head dim that is not a power
of two >= 16 is padded, which copies it). The cache may be sequence-major
``[B, S, K, D]`` or head-major ``[B, K, S, D]`` (the model's KV cache): each
program reads one head's ``[S, D]`` slab either way. Forward only (no VJP).
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
from agentic_rl.kernels import decode_tpu
from agentic_rl.kernels import reference
from agentic_rl.kernels.decode_tpu import TpuDecodeBlockSizes

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
class _Config:
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


def _make_config(q_shape, S, K, *, softcap, has_window,
                 blocks: DecodeBlockSizes, interpret) -> _Config:
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
  return _Config(
      softcap=softcap, scale=float(D) ** -0.5, has_window=has_window, S=S,
      Gp=max(_common.MIN_BLOCK, _common.next_pow2(H // K)),
      Dp=max(_common.MIN_BLOCK, _common.next_pow2(D)), bk=bk,
      blocks_per_split=per_split, num_splits=pl.cdiv(n_blocks, per_split),
      num_warps=blocks.num_warps, num_stages=blocks.num_stages,
      interpret=interpret)


def _kernel(*refs, cfg: _Config):
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


def _pallas(cfg: _Config, q_BxKxGxD, k, v, lengths, window, head_major):
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


def _validate(q, k, v, lengths, kv_layout):
  op = "decode_attention"
  if kv_layout not in reference.KV_LAYOUTS:
    raise ValueError(f"{op}: kv_layout must be one of {reference.KV_LAYOUTS}, "
                     f"got {kv_layout!r}")
  if q.ndim != 3:
    raise ValueError(f"{op}: q must be [batch, heads, head_dim], got {q.shape}")
  dims = ("[batch, slots, kv_heads, head_dim]" if kv_layout == "BSKD"
          else "[batch, kv_heads, slots, head_dim]")
  if k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"{op}: caches must both be {dims}, got {k.shape} and "
                     f"{v.shape}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"{op}: q must be floating point, got {q.dtype}")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(f"{op}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, "
                     f"{v.dtype}")
  B, H, D = q.shape
  if k.shape[0] != B or k.shape[3] != D:
    raise ValueError(f"{op}: q {q.shape} and cache {k.shape} disagree on "
                     f"batch or head_dim")
  K = k.shape[2] if kv_layout == "BSKD" else k.shape[1]
  if H % K:
    raise ValueError(f"{op}: query heads {H} must be a multiple of key/value "
                     f"heads {K}")
  if min(q.shape) == 0 or min(k.shape) == 0:
    raise ValueError(f"{op}: empty input: q {q.shape}, cache {k.shape}")
  if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"{op}: lengths must be integers of shape {(B,)}, got "
                     f"{lengths.dtype} {lengths.shape}")


IMPLS = ("xla", "pallas")


def decode_attention(
    q_BxHxD: jax.Array,
    k_cache_BxSxKxD: jax.Array,
    v_cache_BxSxKxD: jax.Array,
    lengths_B: jax.Array,
    *,
    sliding_window: int | jax.Array | None = None,
    softcap: float | None = None,
    impl: str = "pallas",
    block_sizes: DecodeBlockSizes | TpuDecodeBlockSizes | None = None,
    kv_layout: str = "BSKD",
    backend: str | None = None,
) -> jax.Array:
  """Attention of one new token per row over its cache; ``[B, H, D]``.

  Args:
    q_BxHxD: queries (the token at position ``lengths - 1``).
    k_cache_BxSxKxD, v_cache_BxSxKxD: caches, ``H % K == 0``, q's dtype;
      ``[B, K, S, D]`` with ``kv_layout="BKSD"``.
    lengths_B: int, slots ``< lengths[b]`` are visible (0 gives zeros).
    sliding_window: optional int >= 1 or int32 scalar array (may be traced):
      slot ``j`` needs ``lengths - 1 - j < window``.
    softcap: optional ``c``: logits become ``c * tanh(logits / c)``.
    impl: ``"pallas"`` (the kernels of ``backend``) or ``"xla"``.
    block_sizes: Pallas tiling: :class:`DecodeBlockSizes` for Triton,
      :class:`TpuDecodeBlockSizes` for Mosaic; None for the defaults.
    kv_layout: ``"BSKD"`` (sequence-major) or ``"BKSD"`` (head-major).
    backend: ``"triton"``, ``"mosaic_tpu"`` (:mod:`decode_tpu`) or None for
      the platform's (see :func:`_common.pallas_backend`).
  """
  op = "decode_attention"
  _common.check_impl(op, impl, IMPLS)
  q, k, v = q_BxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD
  _validate(q, k, v, lengths_B, kv_layout)
  softcap = _common.static_positive_float(op, "softcap", softcap)
  window = _common.window_operand(op, sliding_window)
  lengths = lengths_B.astype(jnp.int32)
  B, H, D = q.shape
  head_major = kv_layout == "BKSD"
  s_axis = 2 if head_major else 1
  S, K = k.shape[s_axis], k.shape[3 - s_axis]
  if impl == "xla":
    out = reference.attention(
        q[:, None], k, v, causal=True, q_positions=(lengths - 1)[:, None],
        kv_positions=jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)),
        sliding_window=window, softcap=softcap, kv_layout=kv_layout)
    return out[:, 0]
  family, interpret = _common.pallas_backend(op, backend)
  G = H // K
  lengths = jnp.minimum(lengths, S)  # slots past the cache do not exist
  if family == "mosaic_tpu":
    blocks = _common.block_sizes_for(op, family, block_sizes,
                                     TpuDecodeBlockSizes)
    cfg = decode_tpu.make_config(q.shape, S, softcap=softcap,
                                 has_window=window is not None, blocks=blocks,
                                 interpret=interpret)
    if not head_major:
      k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    out = decode_tpu.attention(cfg, q.reshape(B, K, G, D), k, v, lengths,
                               window)
    return out.reshape(B, H, D)
  cfg = _make_config(q.shape, S, K, softcap=softcap,
                     has_window=window is not None,
                     blocks=_common.block_sizes_for(op, family, block_sizes,
                                                    DecodeBlockSizes),
                     interpret=interpret)
  pad = _common.pad_axis
  q4 = pad(pad(q.reshape(B, K, G, D), 2, cfg.Gp), 3, cfg.Dp)
  k = pad(pad(k, s_axis, cfg.S), 3, cfg.Dp)
  v = pad(pad(v, s_axis, cfg.S), 3, cfg.Dp)
  acc, m, l = _pallas(cfg, q4, k, v, lengths, window, head_major)
  out = _merge_splits(acc, m, l)  # [B, K, Gp, Dp]
  return out[:, :, :G, :D].reshape(B, H, D).astype(q.dtype)
