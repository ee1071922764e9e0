"""Fused token log-probs and entropies, without materialising ``[N, V]``.

Math (per row ``n``; ``x = h W`` with fp32 accumulation): soft-cap ``y = c *
tanh(x / c)`` (if set), temperature ``z = y / T``, then

    lse = logsumexp(z),  logp = z[target] - lse,  H = lse - E_p[z],
    p = softmax(z)

Vocabulary tiles are streamed with an online log-sum-exp that also carries
``s1 = sum_v exp(z_v - m) (z_v - m)`` relative to the running max ``m``, so the
entropy ``H = log l - s1 / l`` (``l = sum_v exp(z_v - m)``) never subtracts two
large numbers. Merging two partial states (FlashAttention-style rescaling):
``l = l_a e^{m_a-M} + l_b e^{m_b-M}``, ``s1 = sum_i e^{m_i-M}(s1_i + (m_i-M)
l_i)``. Backward, with cotangents ``a`` (for logp) and ``b`` (for H):

    dL/dz_v = a (1[v = target] - p_v) - b p_v (z_v - E_p[z])

then ``/ T``, times ``1 - tanh^2(x / c)`` under a soft-cap, and
``dh = g W^T``, ``dW = h^T g``. This is the "cut cross-entropy" idea (Wijmans
et al., 2024, arXiv:2411.09009) extended with the entropy.

Implementations:

* ``"pallas"`` with the Mosaic family (on TPU, or ``backend="mosaic_tpu"``):
  :mod:`logprobs_tpu`.
* ``"pallas"`` with the Triton family: forward is one Triton kernel, grid
  ``(row blocks, vocab splits)``; each program does the ``h W`` tile matmul
  (a loop over ``D``) and the online statistics in registers; an XLA
  epilogue merges the splits.
  Backward is a ``lax.scan`` over vocab chunks: a Triton kernel recomputes
  the chunk's logits and writes its logit gradient ``g`` (``[N, chunk]`` in
  W's dtype), then two XLA matmuls apply it to ``dh`` and ``dW``. With
  ``LogprobBlockSizes(pallas_bwd=False)`` the chunk's logits are recomputed
  by an XLA dot instead (cuBLAS on GPU), as in ``"xla_chunked"``.
* ``"xla_chunked"``: the same chunked scans in pure JAX (forward and
  backward), with a ``custom_vjp`` that recomputes logits chunk by chunk.
  This is the memory-lean path on CPU, where Pallas runs interpreted.
* ``"xla"``: :func:`reference.token_logprobs` (materialises the logits).

Peak temporary memory of the chunked paths is ``O(N * chunk_v)`` instead of
``O(N * V)``. The last chunk or tile is shifted back to end at ``V`` (its
already-counted columns are masked), so ``V`` need not be a multiple of any
block and the unembedding is not padded (unless, for Pallas, ``D`` is not a
multiple of 16 or ``V < 16``).
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
from agentic_rl.kernels import logprobs_tpu
from agentic_rl.kernels import reference
from agentic_rl.kernels.logprobs_tpu import TpuLogprobBlockSizes

_SQ = _common.SQUEEZED

IMPLS = ("xla", "xla_chunked", "pallas")


@dataclasses.dataclass(frozen=True)
class LogprobBlockSizes:
  """Tiling. ``block_*`` are Pallas tile edges (powers of two >= 16);
  ``chunk_v`` is the vocabulary chunk of the backward scan, the forward's
  vocab split, and the ``xla_chunked`` chunk (rounded to ``block_v``).
  ``pallas_bwd``: the backward recomputes each chunk's logits in the Triton
  kernel (True) or with an XLA dot (False). The defaults come from
  ``python -m agentic_rl.kernels.bench --tune`` on an H200 (BENCHMARKS.md).
  """
  block_n: int = 128
  block_v: int = 256
  block_d: int = 64
  chunk_v: int = 8192
  num_warps: int = 8
  num_stages: int = 3
  pallas_bwd: bool = True


@dataclasses.dataclass(frozen=True)
class _Config:
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


def _make_config(impl, N, D, V, *, temperature, softcap,
                 blocks: LogprobBlockSizes, interpret) -> _Config:
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
    return _Config(Vp=V, Np=N, Dp=D, bn=bn, bv=bv, bd=bd,
                   chunk=min(blocks.chunk_v, V), **common)
  Vp = max(V, _common.MIN_BLOCK)
  bv = min(bv, 1 << (Vp.bit_length() - 1))  # a tile fits inside the vocab
  # The D loop needs bd | D: the largest power of two dividing D, or pad D.
  bd = min(bd, D & -D) if D & -D >= _common.MIN_BLOCK else _common.MIN_BLOCK
  chunk = min(_common.round_up(blocks.chunk_v, bv), (Vp // bv) * bv)
  return _Config(Vp=Vp, Np=_common.round_up(N, bn), Dp=_common.round_up(D, bd),
                 bn=bn, bv=bv, bd=bd, chunk=chunk, **common)


# --------------------------------------------------------------------------
# Vocabulary chunks (Pallas Triton and the pure-JAX chunked path).


def _column_mask(cfg: _Config, cols, first_new):
  """Columns to count: not already counted (< first_new) and not padding."""
  valid = cols >= first_new
  if cfg.Vp > cfg.V:
    valid &= cols < cfg.V
  return valid


def _chunk_start(cfg: _Config, c):
  """Chunk ``c`` covers columns [start, start+chunk); those < nominal were
  already counted by chunk c-1 (only the last chunk overlaps)."""
  nominal = c * cfg.chunk
  return jnp.minimum(nominal, cfg.Vp - cfg.chunk), nominal


# --------------------------------------------------------------------------
# Pallas kernels.


def _tile_logits(cfg: _Config, h_ref, w_ref, col):
  """``h_tile @ W[:, col:col+bv]`` in fp32, looping over D in bd steps."""
  def step(kd, acc):
    d0 = pl.multiple_of(kd * cfg.bd, cfg.bd)
    h = h_ref[:, pl.ds(d0, cfg.bd)]
    w = w_ref[pl.ds(d0, cfg.bd), pl.ds(col, cfg.bv)]
    return acc + _common.dot_nn(h, w)
  return lax.fori_loop(0, cfg.Dp // cfg.bd, step,
                       jnp.zeros((cfg.bn, cfg.bv), jnp.float32))


def _fwd_kernel(h_ref, w_ref, t_ref, m_ref, l_ref, s1_ref, zt_ref, *,
                cfg: _Config):
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
        cfg, x, cols, _column_mask(cfg, cols, start), targets))

  stats = lax.fori_loop(0, n_tiles, body, tiles.empty_stats((cfg.bn,)))
  m_ref[...], l_ref[...], s1_ref[...], zt_ref[...] = stats


def _pallas_stats(cfg: _Config, h, w, targets) -> tiles.Stats:
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
                 start_ref, g_ref, *, cfg: _Config):
  """Writes the logit gradient of one [bn, bv] tile of chunk at ``start``."""
  start, nominal = start_ref[0], start_ref[1]
  col = pl.multiple_of(start + pl.program_id(1) * cfg.bv, cfg.col_align)
  x = _tile_logits(cfg, h_ref, w_ref, col)
  cols = col + lax.iota(jnp.int32, cfg.bv)
  g = tiles.logit_grad(cfg, x, cols, _column_mask(cfg, cols, nominal),
                       t_ref[...], lse_ref[...], ez_ref[...], dlp_ref[...],
                       dent_ref[...])
  g_ref[...] = g.astype(g_ref.dtype)


def _pallas_grad_chunk(cfg: _Config, h, w, targets, lse, ez, d_logp, d_ent,
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


# --------------------------------------------------------------------------
# Pure-JAX chunked versions of the same two steps.


def _xla_chunk_logits(cfg: _Config, h, w, start):
  w_c = lax.dynamic_slice_in_dim(w, start, cfg.chunk, axis=1)
  x = jnp.dot(h, w_c, preferred_element_type=jnp.float32)
  return x, start + jnp.arange(cfg.chunk, dtype=jnp.int32)


def _xla_stats(cfg: _Config, h, w, targets) -> tiles.Stats:
  def body(stats, c):
    start, nominal = _chunk_start(cfg, c)
    x, cols = _xla_chunk_logits(cfg, h, w, start)
    tile = tiles.tile_stats(cfg, x, cols, _column_mask(cfg, cols, nominal),
                            targets)
    return tiles.merge(stats, tile), None
  stats, _ = lax.scan(body, tiles.empty_stats((h.shape[0],)),
                      jnp.arange(cfg.num_chunks, dtype=jnp.int32))
  return stats


def _xla_grad_chunk(cfg: _Config, h, w, targets, lse, ez, d_logp, d_ent,
                    start, nominal):
  x, cols = _xla_chunk_logits(cfg, h, w, start)
  g = tiles.logit_grad(cfg, x, cols, _column_mask(cfg, cols, nominal),
                       targets, lse, ez, d_logp, d_ent)
  return g.astype(w.dtype)


# --------------------------------------------------------------------------
# custom_vjp over padded operands.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(cfg: _Config, h, w, targets):
  return _fused_fwd(cfg, h, w, targets)[0]


def _fused_fwd(cfg: _Config, h, w, targets):
  stats_fn = _pallas_stats if cfg.impl == "pallas" else _xla_stats
  logp, ent, lse, ez = tiles.finalize(stats_fn(cfg, h, w, targets))
  return (logp, ent), (h, w, targets, lse, ez)


def _fused_bwd(cfg: _Config, res, cotangents):
  h, w, targets, lse, ez = res
  d_logp, d_ent = (c.astype(jnp.float32) for c in cotangents)
  grad_fn = (_pallas_grad_chunk if cfg.impl == "pallas" and cfg.pallas_bwd
             else _xla_grad_chunk)

  def body(carry, c):
    dh, dw = carry
    start, nominal = _chunk_start(cfg, c)
    g = grad_fn(cfg, h, w, targets, lse, ez, d_logp, d_ent, start, nominal)
    w_c = lax.dynamic_slice_in_dim(w, start, cfg.chunk, axis=1)
    dh = dh + lax.dot_general(g, w_c, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32)
    dw_c = lax.dynamic_slice_in_dim(dw, start, cfg.chunk, axis=1)
    dw_c = dw_c + lax.dot_general(h, g, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32
                                  ).astype(dw.dtype)
    return (dh, lax.dynamic_update_slice_in_dim(dw, dw_c, start, axis=1)), None

  init = (jnp.zeros(h.shape, jnp.float32), jnp.zeros_like(w))
  (dh, dw), _ = lax.scan(body, init, jnp.arange(cfg.num_chunks,
                                                dtype=jnp.int32))
  return dh.astype(h.dtype), dw, None


_fused.defvjp(_fused_fwd, _fused_bwd)


# --------------------------------------------------------------------------
# Public entry point.


def _validate(hidden, unembed, targets):
  op = "token_logprobs"
  if hidden.ndim != 2 or unembed.ndim != 2 or targets.ndim != 1:
    raise ValueError(f"{op}: expected hidden [N, D], unembed [D, V], targets "
                     f"[N]; got {hidden.shape}, {unembed.shape}, "
                     f"{targets.shape}")
  N, D = hidden.shape
  if unembed.shape[0] != D:
    raise ValueError(f"{op}: hidden dim {D} != unembed rows "
                     f"{unembed.shape[0]}")
  if targets.shape[0] != N:
    raise ValueError(f"{op}: {N} rows of hidden but {targets.shape[0]} "
                     f"targets")
  if N == 0 or D == 0 or unembed.shape[1] == 0:
    raise ValueError(f"{op}: empty input {hidden.shape}, {unembed.shape}")
  if not jnp.issubdtype(hidden.dtype, jnp.floating):
    raise ValueError(f"{op}: hidden must be floating point, got "
                     f"{hidden.dtype}")
  if unembed.dtype != hidden.dtype:
    raise ValueError(f"{op}: hidden {hidden.dtype} and unembed "
                     f"{unembed.dtype} dtypes differ")
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise ValueError(f"{op}: targets must be integers, got {targets.dtype}")


def token_logprobs(
    hidden_NxD: jax.Array,
    unembed_DxV: jax.Array,
    targets_N: jax.Array,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    impl: str = "pallas",
    block_sizes: LogprobBlockSizes | TpuLogprobBlockSizes | None = None,
    backend: str | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Log-prob of each target and entropy of each row, both fp32 ``[N]``.

  Args:
    hidden_NxD: final hidden states (floating point).
    unembed_DxV: unembedding, same dtype as hidden.
    targets_N: int token ids in ``[0, V)`` (not checked, they may be traced;
      an id outside gets ``logp = -logsumexp(z)``).
    temperature: Python float > 0; logits are divided by it (after capping).
    softcap: optional Python float ``c > 0``: ``z = c * tanh(z / c)``.
    impl: ``"pallas"``, ``"xla_chunked"`` or ``"xla"`` (see module doc).
    block_sizes: tiling: :class:`LogprobBlockSizes` (Triton and
      ``"xla_chunked"``) or :class:`TpuLogprobBlockSizes` (Mosaic); None for
      the defaults.
    backend: for ``impl="pallas"``: ``"triton"``, ``"mosaic_tpu"``
      (:mod:`logprobs_tpu`) or None for the platform's.

  Differentiable w.r.t. ``hidden_NxD`` and ``unembed_DxV`` (both outputs).
  """
  op = "token_logprobs"
  _common.check_impl(op, impl, IMPLS)
  _validate(hidden_NxD, unembed_DxV, targets_N)
  temperature = _common.static_positive_float(op, "temperature", temperature)
  softcap = _common.static_positive_float(op, "softcap", softcap)
  if impl == "xla":
    return reference.token_logprobs(hidden_NxD, unembed_DxV, targets_N,
                                    temperature=temperature, softcap=softcap)
  N, D = hidden_NxD.shape
  V = unembed_DxV.shape[1]
  pad = _common.pad_axis
  family, interpret = impl, False
  if impl == "pallas":
    family, interpret = _common.pallas_backend(op, backend)
  if family == "mosaic_tpu":
    blocks = _common.block_sizes_for(op, family, block_sizes,
                                     TpuLogprobBlockSizes)
    cfg = logprobs_tpu.make_config(N, V, temperature=temperature,
                                   softcap=softcap, blocks=blocks,
                                   interpret=interpret)
    logp, ent = logprobs_tpu.token_logprobs(
        cfg, pad(hidden_NxD, 0, cfg.Np), unembed_DxV,
        pad(targets_N, 0, cfg.Np))
    return logp[:N], ent[:N]
  cfg = _make_config(impl, N, D, V, temperature=temperature, softcap=softcap,
                     blocks=_common.block_sizes_for(op, family, block_sizes,
                                                    LogprobBlockSizes),
                     interpret=interpret)
  h = pad(pad(hidden_NxD, 0, cfg.Np), 1, cfg.Dp)
  w = pad(pad(unembed_DxV, 0, cfg.Dp), 1, cfg.Vp)
  targets = pad(targets_N.astype(jnp.int32), 0, cfg.Np)
  logp, ent = _fused(cfg, h, w, targets)
  return logp[:N], ent[:N]
