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
  :mod:`agentic_rl.kernels.tpu.logprobs`.
* ``"pallas"`` with the Triton family (on GPU, or ``backend="triton"``):
  forward by the Triton kernel of :mod:`agentic_rl.kernels.triton.logprobs`;
  backward a ``lax.scan`` over vocab chunks here, in which a Triton kernel
  recomputes the chunk's logits and writes its logit gradient ``g``
  (``[N, chunk]`` in W's dtype), then two XLA matmuls apply it to ``dh`` and
  ``dW``. With ``LogprobBlockSizes(pallas_bwd=False)`` the chunk's logits
  are recomputed by an XLA dot instead (cuBLAS on GPU), as in
  ``"xla_chunked"``.
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

import functools

import jax
import jax.numpy as jnp
from jax import lax

from agentic_rl.kernels import _common
from agentic_rl.kernels import logprob_math as tiles
from agentic_rl.kernels import reference
from agentic_rl.kernels.tpu import logprobs as tpu_logprobs
from agentic_rl.kernels.tpu.logprobs import TpuLogprobBlockSizes
from agentic_rl.kernels.triton import logprobs as triton_logprobs
from agentic_rl.kernels.triton.logprobs import LogprobBlockSizes

__all__ = ["LogprobBlockSizes", "TpuLogprobBlockSizes", "token_logprobs"]

IMPLS = ("xla", "xla_chunked", "pallas")
# The chunk geometry and tiling of the chunked paths (Triton and pure JAX).
Config = triton_logprobs.Config

# --------------------------------------------------------------------------
# Pure-JAX chunked versions of the Triton forward and logit-gradient steps
# (impl="xla_chunked").


def _xla_chunk_logits(cfg: Config, h, w, start):
  w_c = lax.dynamic_slice_in_dim(w, start, cfg.chunk, axis=1)
  x = jnp.dot(h, w_c, preferred_element_type=jnp.float32)
  return x, start + jnp.arange(cfg.chunk, dtype=jnp.int32)


def _xla_stats(cfg: Config, h, w, targets) -> tiles.Stats:
  def body(stats, c):
    start, nominal = triton_logprobs.chunk_start(cfg, c)
    x, cols = _xla_chunk_logits(cfg, h, w, start)
    valid = triton_logprobs.column_mask(cfg, cols, nominal)
    tile = tiles.tile_stats(cfg, x, cols, valid, targets)
    return tiles.merge(stats, tile), None
  stats, _ = lax.scan(body, tiles.empty_stats((h.shape[0],)),
                      jnp.arange(cfg.num_chunks, dtype=jnp.int32))
  return stats


def _xla_grad_chunk(cfg: Config, h, w, targets, lse, ez, d_logp, d_ent,
                    start, nominal):
  x, cols = _xla_chunk_logits(cfg, h, w, start)
  valid = triton_logprobs.column_mask(cfg, cols, nominal)
  g = tiles.logit_grad(cfg, x, cols, valid, targets, lse, ez, d_logp, d_ent)
  return g.astype(w.dtype)


# --------------------------------------------------------------------------
# custom_vjp over padded operands.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(cfg: Config, h, w, targets):
  return _fused_fwd(cfg, h, w, targets)[0]


def _fused_fwd(cfg: Config, h, w, targets):
  stats_fn = triton_logprobs.stats if cfg.impl == "pallas" else _xla_stats
  logp, ent, lse, ez = tiles.finalize(stats_fn(cfg, h, w, targets))
  return (logp, ent), (h, w, targets, lse, ez)


def _fused_bwd(cfg: Config, res, cotangents):
  h, w, targets, lse, ez = res
  d_logp, d_ent = (c.astype(jnp.float32) for c in cotangents)
  grad_fn = (triton_logprobs.grad_chunk
             if cfg.impl == "pallas" and cfg.pallas_bwd else _xla_grad_chunk)

  def body(carry, c):
    dh, dw = carry
    start, nominal = triton_logprobs.chunk_start(cfg, c)
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
      (:mod:`tpu.logprobs`) or None for the platform's.

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
    cfg = tpu_logprobs.make_config(N, V, temperature=temperature,
                                   softcap=softcap, blocks=blocks,
                                   interpret=interpret)
    logp, ent = tpu_logprobs.token_logprobs(
        cfg, pad(hidden_NxD, 0, cfg.Np), unembed_DxV,
        pad(targets_N, 0, cfg.Np))
    return logp[:N], ent[:N]
  cfg = triton_logprobs.make_config(
      impl, N, D, V, temperature=temperature, softcap=softcap,
      blocks=_common.block_sizes_for(op, family, block_sizes,
                                     LogprobBlockSizes),
      interpret=interpret)
  h = pad(pad(hidden_NxD, 0, cfg.Np), 1, cfg.Dp)
  w = pad(pad(unembed_DxV, 0, cfg.Dp), 1, cfg.Vp)
  targets = pad(targets_N.astype(jnp.int32), 0, cfg.Np)
  logp, ent = _fused(cfg, h, w, targets)
  return logp[:N], ent[:N]
