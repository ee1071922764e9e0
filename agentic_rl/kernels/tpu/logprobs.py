"""Fused token log-probs and entropies for TPU: Pallas Mosaic kernels.

Same math as :mod:`agentic_rl.kernels.logprobs` (the tile statistics and the
logit gradient of :mod:`logprob_math`), with the TPU's grid-and-scratch shape
instead of Triton's in-kernel loops, and no ``[N, V]`` or ``[N, chunk]`` array
in HBM:

* forward, grid ``(row blocks, vocab blocks)``: each step multiplies an
  ``[bn, D]`` hidden tile by a ``[D, bv]`` unembedding tile on the MXU and
  folds the logits into the running statistics in VMEM scratch (vocab blocks
  are the innermost, ``"arbitrary"`` dimension); the last block writes
  ``logp``, the entropy, ``lse`` and ``E_p[z]``;
* backward, two kernels that recompute the logit tile and its gradient
  ``g``: ``dh = sum_v g W_v^T`` (grid rows x vocab, vocab innermost) and
  ``dW_v = sum_n h_n^T g`` (grid vocab x rows, rows innermost). That is four
  tile matmuls against the chunked path's three, in exchange for never
  writing ``g`` out (the "cut cross-entropy" trade).

Per-row values (targets, statistics, cotangents) travel broadcast over 128
lanes (``[N, 128]``). ``V`` need not be a multiple of the vocab tile: the
grid runs ``cdiv(V, bv)`` blocks, and the last block's columns past ``V`` are
masked out of the statistics and zeroed in ``W`` before ``g W^T`` (they hold
padding, which the TPU interpreter fills with NaN). Rows are zero-padded to
the row tile.
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
from agentic_rl.kernels import logprob_math as tiles

LANES = _common.TPU_LANES


@dataclasses.dataclass(frozen=True)
class TpuLogprobBlockSizes:
  """Row and vocabulary tiles of the Mosaic kernels (multiples of 128; a
  dimension no larger than its tile is one tile). Tiles hold the whole
  hidden dim: the dW kernel keeps ``h [bn, D]``, ``W [D, bv]`` (both double
  buffered), an fp32 ``[D, bv]`` accumulator and its output tile in VMEM: at
  D = 4096 in bf16 with the defaults, 4 + 4 + 4 + 4 = 16 MiB by arithmetic
  (not measured), which may exceed the default scoped VMEM limit: raise
  ``vmem_limit_bytes`` or shrink the tiles for larger D."""
  block_n: int = 256
  block_v: int = 256
  vmem_limit_bytes: int | None = None  # None: Mosaic's scoped default


@dataclasses.dataclass(frozen=True)
class _Config:
  inv_temperature: float
  softcap: float | None
  V: int
  Np: int  # rows padded to a multiple of bn
  bn: int
  bv: int
  vmem_limit_bytes: int | None
  interpret: bool


def make_config(N, V, *, temperature, softcap, blocks: TpuLogprobBlockSizes,
                interpret) -> _Config:
  tile = functools.partial(_common.tpu_tile, owner="TpuLogprobBlockSizes")
  bn = tile(blocks.block_n, N, "block_n")
  bv = tile(blocks.block_v, V, "block_v")
  if N <= bn:  # one row block: only the sublane (8) alignment is needed
    bn = _common.round_up(N, _common.TPU_SUBLANES)
  return _Config(inv_temperature=1.0 / temperature, softcap=softcap, V=V,
                 Np=_common.round_up(N, bn), bn=bn, bv=V if V <= bv else bv,
                 vmem_limit_bytes=blocks.vmem_limit_bytes, interpret=interpret)


def _tile(cfg: _Config, h_ref, w_ref, j):
  """Logits ``[bn, bv]`` (fp32), column ids, the valid-column mask (None if
  every column is real) and the W tile, zeroed past ``V``."""
  w = w_ref[...]
  x = _common.dot_nn(h_ref[...], w)
  cols = j * cfg.bv + lax.broadcasted_iota(jnp.int32, x.shape, 1)
  if cfg.V % cfg.bv == 0:
    return x, cols, jnp.ones(x.shape, bool), w
  valid = cols < cfg.V
  w_cols = j * cfg.bv + lax.broadcasted_iota(jnp.int32, w.shape, 1)
  return x, cols, valid, jnp.where(w_cols < cfg.V, w, jnp.zeros_like(w))


def _rows(ref):
  return ref[...][:, :1]


def _fwd_kernel(h_ref, w_ref, t_ref, logp_ref, ent_ref, lse_ref, ez_ref,
                m_scr, l_scr, s1_scr, zt_scr, *, cfg: _Config):
  j = pl.program_id(1)
  scratch = (m_scr, l_scr, s1_scr, zt_scr)

  @pl.when(j == 0)
  def _init():
    for ref, value in zip(scratch, tiles.empty_stats(m_scr.shape)):
      ref[...] = value

  x, cols, valid, _ = _tile(cfg, h_ref, w_ref, j)
  stats = tiles.merge(tiles.Stats(*(_rows(r) for r in scratch)),
                      tiles.tile_stats(cfg, x, cols, valid, _rows(t_ref),
                                       keepdims=True))
  for ref, value in zip(scratch, stats):
    ref[...] = jnp.broadcast_to(value, ref.shape)

  @pl.when(j == pl.num_programs(1) - 1)
  def _finish():
    outs = (logp_ref, ent_ref, lse_ref, ez_ref)
    for ref, value in zip(outs, tiles.finalize(stats)):
      ref[...] = jnp.broadcast_to(value, ref.shape)


def _grad(cfg: _Config, refs, j):
  """``(g [bn, bv] fp32, h tile, W tile zeroed past V)`` for one tile."""
  h_ref, w_ref, t_ref, lse_ref, ez_ref, dlp_ref, dent_ref = refs
  x, cols, valid, w = _tile(cfg, h_ref, w_ref, j)
  g = tiles.logit_grad(cfg, x, cols, valid, *(_rows(r) for r in (
      t_ref, lse_ref, ez_ref, dlp_ref, dent_ref)), keepdims=True)
  return g, h_ref[...], w


def _dh_kernel(*refs, cfg: _Config):
  *ins, dh_ref, dh_scr = refs
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    dh_scr[...] = jnp.zeros(dh_scr.shape, jnp.float32)

  g, _, w = _grad(cfg, ins, j)
  dh_scr[...] += _common.dot_nt(g.astype(w.dtype), w)

  @pl.when(j == pl.num_programs(1) - 1)
  def _finish():
    dh_ref[...] = dh_scr[...].astype(dh_ref.dtype)


def _dw_kernel(*refs, cfg: _Config):
  *ins, dw_ref, dw_scr = refs
  j, i = pl.program_id(0), pl.program_id(1)

  @pl.when(i == 0)
  def _init():
    dw_scr[...] = jnp.zeros(dw_scr.shape, jnp.float32)

  g, h, _ = _grad(cfg, ins, j)
  dw_scr[...] += _common.dot_tn(h, g.astype(h.dtype))

  @pl.when(i == pl.num_programs(1) - 1)
  def _finish():
    dw_ref[...] = dw_scr[...].astype(dw_ref.dtype)


def _call(cfg: _Config, kernel, name, grid, in_specs, out_specs, out_shape,
          scratch, semantics):
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg), grid=grid, in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM(s, jnp.float32) for s in scratch],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=semantics,
          vmem_limit_bytes=cfg.vmem_limit_bytes),
      interpret=_common.tpu_interpret(cfg.interpret), name=name)


def _forward(cfg: _Config, h, w, targets):
  D = h.shape[1]
  bn, bv = cfg.bn, cfg.bv
  row = pl.BlockSpec((bn, LANES), lambda i, j: (i, 0))
  stat = jax.ShapeDtypeStruct((cfg.Np, LANES), jnp.float32)
  return _call(
      cfg, _fwd_kernel, "token_logprobs_fwd_tpu",
      (cfg.Np // bn, pl.cdiv(cfg.V, bv)),
      [pl.BlockSpec((bn, D), lambda i, j: (i, 0)),
       pl.BlockSpec((D, bv), lambda i, j: (0, j)), row],
      [row] * 4, [stat] * 4, [(bn, LANES)] * 4, ("parallel", "arbitrary"),
  )(h, w, targets)


def _backward(cfg: _Config, h, w, targets, lse, ez, d_logp, d_ent):
  D = h.shape[1]
  bn, bv = cfg.bn, cfg.bv
  n_rows, n_vocab = cfg.Np // bn, pl.cdiv(cfg.V, bv)
  args = (h, w, targets, lse, ez, d_logp, d_ent)

  def specs(grid_index):
    """Input specs for a grid whose (row block, vocab block) is
    ``grid_index(*program ids)``."""
    def at(f):
      return lambda *ids: f(*grid_index(*ids))
    row = pl.BlockSpec((bn, LANES), at(lambda i, j: (i, 0)))
    return [pl.BlockSpec((bn, D), at(lambda i, j: (i, 0))),
            pl.BlockSpec((D, bv), at(lambda i, j: (0, j)))] + [row] * 5

  dh = _call(cfg, _dh_kernel, "token_logprobs_dh_tpu", (n_rows, n_vocab),
             specs(lambda i, j: (i, j)),
             pl.BlockSpec((bn, D), lambda i, j: (i, 0)),
             jax.ShapeDtypeStruct(h.shape, h.dtype), [(bn, D)],
             ("parallel", "arbitrary"))(*args)
  dw = _call(cfg, _dw_kernel, "token_logprobs_dw_tpu", (n_vocab, n_rows),
             specs(lambda j, i: (i, j)),
             pl.BlockSpec((D, bv), lambda j, i: (0, j)),
             jax.ShapeDtypeStruct(w.shape, w.dtype), [(D, bv)],
             ("parallel", "arbitrary"))(*args)
  return dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def token_logprobs(cfg: _Config, h, w, targets):
  """(logp, entropy) ``[Np]`` fp32 from row-padded ``h [Np, D]``, ``W [D, V]``
  and targets ``[Np]``, through the Mosaic kernels (see module)."""
  return _fwd(cfg, h, w, targets)[0]


def _lane_rows(cfg: _Config, x):
  return jnp.broadcast_to(x[:, None], (cfg.Np, LANES))


def _fwd(cfg: _Config, h, w, targets):
  t = _lane_rows(cfg, targets.astype(jnp.int32))
  logp, ent, lse, ez = _forward(cfg, h, w, t)
  return (logp[:, 0], ent[:, 0]), (h, w, t, lse, ez)


def _bwd(cfg: _Config, res, cotangents):
  h, w, t, lse, ez = res
  d_logp, d_ent = (_lane_rows(cfg, c.astype(jnp.float32)) for c in cotangents)
  dh, dw = _backward(cfg, h, w, t, lse, ez, d_logp, d_ent)
  return dh, dw, None


token_logprobs.defvjp(_fwd, _bwd)
