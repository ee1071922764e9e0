"""Fused token log-probs and entropies as Triton kernels (GPU).

Pallas' Triton backend; on a GPU these compile, anywhere else they run
interpreted. :func:`agentic_rl.kernels.logprobs.token_logprobs` is the entry
point (the math is in its module docstring) and holds the ``custom_vjp``;
this module supplies the tiling (:class:`LogprobBlockSizes`, whose
``chunk_v`` the pure-JAX ``"xla_chunked"`` path shares), the vocabulary
chunk geometry, and two kernels:

* :func:`stats`, the forward: one Triton kernel, grid ``(row blocks, vocab
  splits)``; each program does the ``h W`` tile matmul (a loop over ``D``)
  and folds the tiles into the online statistics of
  :mod:`agentic_rl.kernels.logprob_math` in registers; an XLA epilogue
  merges the splits.
* :func:`grad_chunk`, one step of the backward's scan over vocabulary
  chunks: it recomputes the chunk's logits and writes their gradient ``g``
  (``[N, chunk]`` in W's dtype); the caller applies it to ``dh`` and ``dW``
  with two XLA matmuls.

The last chunk or tile is shifted back to end at ``V`` (its already-counted
columns are masked), so ``V`` need not be a multiple of any block and the
unembedding is not padded (unless ``D`` is not a multiple of 16 or ``V <
16``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from agentic_rl.kernels import _common
from agentic_rl.kernels import logprob_math as tiles

_SQ = _common.SQUEEZED

@dataclasses.dataclass(frozen=True)
class LogprobBlockSizes:
  """Tiling. ``block_*`` are Pallas tile edges (powers of two >= 16);
  ``chunk_v`` is the vocabulary chunk of the backward scan, the forward's
  vocab split, and the ``xla_chunked`` chunk (rounded to ``block_v``).
  ``pallas_bwd``: the backward recomputes each chunk's logits in the Triton
  kernel (True) or with an XLA dot (False). The defaults are the tile
  search's choice (``python -m experiments.bench_kernels --tune``;
  measurements in BENCHMARKS.md).
  """
  block_n: int = 128
  block_v: int = 256
  block_d: int = 64
  chunk_v: int = 8192
  num_warps: int = 8
  num_stages: int = 3
  pallas_bwd: bool = True


@dataclasses.dataclass(frozen=True)
class Config:
  impl: str
  inv_temperature: float
  softcap: float | None
  V: int  # true vocabulary size
  Vp: int  # columns of the (rarely) padded unembedding
  Np: int  # rows padded to a multiple of bn
  Dp: int
  bn: int
  bv: int
  bd: int
  chunk: int  # multiple of bv, <= Vp
  num_warps: int
  num_stages: int
  pallas_bwd: bool
  interpret: bool

  @property
  def col_align(self) -> int:
    """A divisor of every tile's first column: tile starts are multiples of
    ``bv`` or end at ``Vp``. Told to Triton, it keeps the loads of ``W``'s
    rows vectorised when the start is a traced value."""
    return math.gcd(self.Vp, self.bv)

  @property
  def num_chunks(self) -> int:
    return pl.cdiv(self.Vp, self.chunk)


def make_config(impl, N, D, V, *, temperature, softcap,
                 blocks: LogprobBlockSizes, interpret) -> Config:
  name = "LogprobBlockSizes."
  if blocks.chunk_v < 1:
    raise ValueError(f"{name}chunk_v must be >= 1, got {blocks.chunk_v}")
  bn = _common.block_size(blocks.block_n, N, name + "block_n")
  bv = _common.block_size(blocks.block_v, V, name + "block_v")
  bd = _common.block_size(blocks.block_d, D, name + "block_d")
  common = dict(impl=impl, inv_temperature=1.0 / temperature, softcap=softcap,
                V=V, num_warps=blocks.num_warps, num_stages=blocks.num_stages,
                pallas_bwd=blocks.pallas_bwd, interpret=interpret)
  if impl != "pallas":  # plain XLA: no tiles, only vocabulary chunks
    return Config(Vp=V, Np=N, Dp=D, bn=bn, bv=bv, bd=bd,
                   chunk=min(blocks.chunk_v, V), **common)
  Vp = max(V, _common.MIN_BLOCK)
  bv = min(bv, 1 << (Vp.bit_length() - 1))  # a tile fits inside the vocab
  # The D loop needs bd | D: the largest power of two dividing D, or pad D.
  bd = min(bd, D & -D) if D & -D >= _common.MIN_BLOCK else _common.MIN_BLOCK
  chunk = min(_common.round_up(blocks.chunk_v, bv), (Vp // bv) * bv)
  return Config(Vp=Vp, Np=_common.round_up(N, bn), Dp=_common.round_up(D, bd),
                 bn=bn, bv=bv, bd=bd, chunk=chunk, **common)


# --------------------------------------------------------------------------
# Vocabulary chunks (these kernels and the pure-JAX chunked path).


def column_mask(cfg: Config, cols, first_new):
  """Columns to count: not already counted (< first_new) and not padding."""
  valid = cols >= first_new
  if cfg.Vp > cfg.V:
    valid &= cols < cfg.V
  return valid


def chunk_start(cfg: Config, c):
  """Chunk ``c`` covers columns [start, start+chunk); those < nominal were
  already counted by chunk c-1 (only the last chunk overlaps)."""
  nominal = c * cfg.chunk
  return jnp.minimum(nominal, cfg.Vp - cfg.chunk), nominal


# --------------------------------------------------------------------------
# Pallas kernels.


def _tile_logits(cfg: Config, h_ref, w_ref, col):
  """``h_tile @ W[:, col:col+bv]`` in fp32, looping over D in bd steps."""
  def step(kd, acc):
    d0 = pl.multiple_of(kd * cfg.bd, cfg.bd)
    h = h_ref[:, pl.ds(d0, cfg.bd)]
    w = w_ref[pl.ds(d0, cfg.bd), pl.ds(col, cfg.bv)]
    return acc + _common.dot_nn(h, w)
  return lax.fori_loop(0, cfg.Dp // cfg.bd, step,
                       jnp.zeros((cfg.bn, cfg.bv), jnp.float32))


def _fwd_kernel(h_ref, w_ref, t_ref, m_ref, l_ref, s1_ref, zt_ref, *,
                cfg: Config):
  bv = cfg.bv
  split_start = pl.program_id(1) * cfg.chunk
  targets = t_ref[...]
  n_tiles = jnp.minimum(cfg.chunk // bv,
                        lax.div(cfg.Vp - split_start + bv - 1, bv))

  def body(j, stats):
    start = split_start + j * bv
    # The last tile ends at Vp.
    col = pl.multiple_of(jnp.minimum(start, cfg.Vp - bv), cfg.col_align)
    x = _tile_logits(cfg, h_ref, w_ref, col)
    cols = col + lax.iota(jnp.int32, bv)
    return tiles.merge(stats, tiles.tile_stats(
        cfg, x, cols, column_mask(cfg, cols, start), targets))

  stats = lax.fori_loop(0, n_tiles, body, tiles.empty_stats((cfg.bn,)))
  m_ref[...], l_ref[...], s1_ref[...], zt_ref[...] = stats


def stats(cfg: Config, h, w, targets) -> tiles.Stats:
  n_splits = cfg.num_chunks
  row = pl.BlockSpec((cfg.bn,), lambda i, s: (i,))
  part = pl.BlockSpec((_SQ, cfg.bn), lambda i, s: (s, i))
  shape = jax.ShapeDtypeStruct((n_splits, cfg.Np), jnp.float32)
  parts = pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg),
      grid=(cfg.Np // cfg.bn, n_splits),
      in_specs=[pl.BlockSpec((cfg.bn, cfg.Dp), lambda i, s: (i, 0)),
                pl.BlockSpec((cfg.Dp, cfg.Vp), lambda i, s: (0, 0)), row],
      out_specs=[part] * 4,
      out_shape=[shape] * 4,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=cfg.interpret,
      name="token_logprobs_fwd",
  )(h, w, targets)
  parts = [tiles.Stats(*(p[s] for p in parts)) for s in range(n_splits)]
  return functools.reduce(tiles.merge, parts)


def _grad_kernel(h_ref, w_ref, t_ref, lse_ref, ez_ref, dlp_ref, dent_ref,
                 start_ref, g_ref, *, cfg: Config):
  """Writes the logit gradient of one [bn, bv] tile of chunk at ``start``."""
  start, nominal = start_ref[0], start_ref[1]
  col = pl.multiple_of(start + pl.program_id(1) * cfg.bv, cfg.col_align)
  x = _tile_logits(cfg, h_ref, w_ref, col)
  cols = col + lax.iota(jnp.int32, cfg.bv)
  g = tiles.logit_grad(cfg, x, cols, column_mask(cfg, cols, nominal),
                       t_ref[...], lse_ref[...], ez_ref[...], dlp_ref[...],
                       dent_ref[...])
  g_ref[...] = g.astype(g_ref.dtype)


def grad_chunk(cfg: Config, h, w, targets, lse, ez, d_logp, d_ent,
                       start, nominal):
  row = pl.BlockSpec((cfg.bn,), lambda i, j: (i,))
  return pl.pallas_call(
      functools.partial(_grad_kernel, cfg=cfg),
      grid=(cfg.Np // cfg.bn, cfg.chunk // cfg.bv),
      in_specs=[pl.BlockSpec((cfg.bn, cfg.Dp), lambda i, j: (i, 0)),
                pl.BlockSpec((cfg.Dp, cfg.Vp), lambda i, j: (0, 0)),
                row, row, row, row, row,
                pl.BlockSpec((2,), lambda i, j: (0,))],
      out_specs=pl.BlockSpec((cfg.bn, cfg.bv), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((cfg.Np, cfg.chunk), w.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=cfg.interpret,
      name="token_logprobs_grad",
  )(h, w, targets, lse, ez, d_logp, d_ent, jnp.stack([start, nominal]))
