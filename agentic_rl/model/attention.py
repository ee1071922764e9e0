"""The model's one attention entry point, switching between implementations.

Two modes, chosen by whether ``q_positions_BxT`` is given:

* Self-attention (``q_positions_BxT is None``): q, k, v come from the same T
  tokens. Causality is sequence order (token t sees tokens s <= t); the
  sliding window is measured in sequence order too (``t - s < window``);
  ``segment_ids_BxT`` isolate packed or padded sequences. RoPE positions do
  not affect the mask, so within a segment the positions must be contiguous
  for the window to mean what it says (they are for packed sequences).
* Cache attention (``q_positions_BxT`` given): k and v are a head-major KV
  cache ``[B, K, S, Dh]`` whose slot j holds the token at absolute position
  j. A query at position p sees slots ``j <= p`` with ``p - j < window``.
  Head-major, because XLA's CPU dot then reads each head's keys in place; in
  ``[B, S, K, Dh]`` it transposed the cache at every decode step, the largest
  cost of a step (BENCHMARKS.md).

Implementations (``impl``, the model config's ``attn_impl``; the table of
backends, their hardware and ``"auto"`` is :mod:`agentic_rl.kernels.backends`,
whose :func:`~agentic_rl.kernels.backends.resolve` picks one when the
attention is traced): ``"xla"`` is
:func:`agentic_rl.kernels.reference.attention`; ``"xla_vjp"`` is the same but
for self-attention's backward, written by hand (:func:`self_attention_xla`;
cache attention is ``"xla"``'s). The kernel backends (``"triton"``,
``"cudnn"``, ``"mosaic_gpu"``, ``"mosaic_tpu"``, ``"pallas"``) use
``agentic_rl.kernels.flash_attention`` for self-attention and
``agentic_rl.kernels.decode_attention`` for single-token cache attention
(T == 1, reading the head-major cache in place); multi-token cache attention
(chunked extend) has no kernel and uses the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from agentic_rl import kernels
from agentic_rl.kernels import backends
from agentic_rl.kernels import reference
from agentic_rl.model.remat import recompute_in_backward

IMPLS = backends.ATTN_IMPLS


def attention(
    q_BxTxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    *,
    impl: str = "xla",
    segment_ids_BxT: jax.Array | None = None,
    q_positions_BxT: jax.Array | None = None,
    sliding_window: int | jax.Array | None = None,
    softcap: float | None = None,
    recompute: bool = False,
) -> jax.Array:
  """Causal GQA attention (see the module docstring for the two modes).

  Args:
    q_BxTxHxD: queries, compute dtype.
    k_BxSxKxD, v_BxSxKxD: keys and values ``[B, S, K, D]`` for
      self-attention (``S == T``); for cache attention the head-major cache
      ``[B, K, S, D]``. ``H % K == 0``.
    impl: one of :data:`IMPLS` (``"auto"``: the platform's choice).
    segment_ids_BxT: int segment ids (self-attention only).
    q_positions_BxT: int absolute positions of the queries (cache mode).
    sliding_window: int window (may be a traced scalar), or None for global.
    softcap: attention-logit soft-cap ``c * tanh(s / c)``, or None.
    recompute: ``"xla"`` self-attention keeps only q, k and v for the
      backward and recomputes the scores and probabilities there
      (:func:`agentic_rl.model.remat.recompute_in_backward`: autodiff's
      gradients bit for bit, without four ``[B, H, T, T]`` residuals).

  Returns:
    ``[B, T, H, D]`` in q's dtype; the softmax is fp32 with scale
    ``D ** -0.5``.
  """
  impl = backends.resolve(backends.ATTENTION, impl)
  cache_mode = q_positions_BxT is not None
  if cache_mode and segment_ids_BxT is not None:
    raise ValueError("segment ids are only supported for self-attention, "
                     "not for attention to a KV cache")
  if not cache_mode and q_BxTxHxD.shape[1] != k_BxSxKxD.shape[1]:
    raise ValueError(
        f"self-attention needs as many keys as queries, got "
        f"{k_BxSxKxD.shape[1]} keys for {q_BxTxHxD.shape[1]} queries")

  if impl not in ("xla", "xla_vjp"):
    flash_kw, decode_kw = backends.attention_kwargs(impl)
    if not cache_mode:
      return kernels.flash_attention(
          q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, causal=True,
          segment_ids=segment_ids_BxT, sliding_window=sliding_window,
          softcap=softcap, **flash_kw)
    if q_BxTxHxD.shape[1] == 1:
      out_BxHxD = kernels.decode_attention(
          q_BxTxHxD[:, 0], k_BxSxKxD, v_BxSxKxD, q_positions_BxT[:, 0] + 1,
          sliding_window=sliding_window, softcap=softcap, kv_layout="BKSD",
          **decode_kw)
      return out_BxHxD[:, None]

  if not cache_mode and impl == "xla_vjp":
    return self_attention_xla(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD,
                              segment_ids_BxT=segment_ids_BxT,
                              sliding_window=sliding_window, softcap=softcap)
  if not cache_mode:
    core = functools.partial(_reference_self_attention, softcap=softcap)
    if recompute:
      return recompute_in_backward(core, q_BxTxHxD, k_BxSxKxD, v_BxSxKxD,
                                   segment_ids_BxT, sliding_window)
    return core(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxT, sliding_window)
  B, S = k_BxSxKxD.shape[0], k_BxSxKxD.shape[2]
  kv_positions_BxS = jnp.broadcast_to(
      jnp.arange(S, dtype=q_positions_BxT.dtype), (B, S))
  return reference.attention(
      q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, causal=True,
      q_positions=q_positions_BxT, kv_positions=kv_positions_BxS,
      sliding_window=sliding_window, softcap=softcap, kv_layout="BKSD")


def _reference_self_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT,
                              sliding_window, *, softcap):
  return reference.attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, causal=True,
                             segment_ids=segment_ids_BxT, sliding_window=sliding_window,
                             softcap=softcap)


def self_attention_xla(q_BxTxHxD: jax.Array, k_BxTxKxD: jax.Array,
                       v_BxTxKxD: jax.Array, *,
                       segment_ids_BxT: jax.Array | None = None,
                       sliding_window: int | jax.Array | None = None,
                       softcap: float | None = None) -> jax.Array:
  """Causal self-attention (``impl="xla_vjp"``): the forward of
  ``reference.attention`` (the same operations, so the same values) with a
  hand-written backward.

  The backward is FlashAttention's (Dao et al. 2022) on the saved
  probabilities ``P``: ``dV = P^T dO``, ``dP = dO V^T``,
  ``dS = P * (dP - rowsum(dO * O))``, ``dQ = dS K``, ``dK = dS^T Q`` (times
  the scale, and ``1 - tanh^2`` with a soft-cap). Differentiating the
  reference's masked, max-shifted softmax instead costs XLA:CPU a dozen more
  passes over ``[B, H, T, T]`` per layer (about 8% of a learner step,
  BENCHMARKS.md). The gradients agree with autodiff's to float rounding,
  not bit for bit, and a training run's outcome can move with that.

  Shapes as :func:`attention`'s self-attention mode; returns ``[B, T, H, D]``
  in q's dtype.
  """
  B, T = q_BxTxHxD.shape[:2]
  positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  mask_BxTxT = reference.attention_mask(
      positions_BxT, positions_BxT, q_segment_ids_BxT=segment_ids_BxT,
      kv_segment_ids_BxS=segment_ids_BxT, causal=True,
      sliding_window=sliding_window)
  return _self_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxTxT, softcap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _self_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxTxT, softcap):
  return _self_attention_fwd(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxTxT, softcap)[0]


def _self_attention_fwd(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxTxT, softcap):
  """The reference's forward; residuals: q head-major ``[B, K, G, T, D]``,
  k, v, fp32 ``P`` ``[B, K, G, T, S]`` and output ``[B, K, G, T, D]``, and
  the soft-cap's ``tanh`` (else None)."""
  B, T, H, D = q_BxTxHxD.shape
  K = k_BxTxKxD.shape[2]
  q_BxKxGxTxD = q_BxTxHxD.reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
  s_BxKxGxTxS = jnp.einsum("bkgtd,bskd->bkgts", q_BxKxGxTxD, k_BxTxKxD,
                           preferred_element_type=jnp.float32) * D ** -0.5
  tanh = None
  if softcap is not None:
    tanh = jnp.tanh(s_BxKxGxTxS / softcap)
    s_BxKxGxTxS = softcap * tanh
  p = reference.masked_softmax(s_BxKxGxTxS, mask_BxTxT[:, None, None])
  o_BxKxGxTxD = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v_BxTxKxD.dtype), v_BxTxKxD,
                           preferred_element_type=jnp.float32)
  out = o_BxKxGxTxD.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BxTxHxD.dtype)
  return out, (q_BxKxGxTxD, k_BxTxKxD, v_BxTxKxD, p, o_BxKxGxTxD, tanh)


def _self_attention_bwd(softcap, res, dout_BxTxHxD):
  q_BxKxGxTxD, k_BxTxKxD, v_BxTxKxD, p, o_BxKxGxTxD, tanh = res
  B, K, G, T, D = q_BxKxGxTxD.shape
  f32 = jnp.float32
  do_BxKxGxTxD = dout_BxTxHxD.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4).astype(f32)
  dv = jnp.einsum("bkgts,bkgtd->bskd", p, do_BxKxGxTxD)
  dp = jnp.einsum("bkgtd,bskd->bkgts", do_BxKxGxTxD, v_BxTxKxD.astype(f32))
  delta = jnp.sum(do_BxKxGxTxD * o_BxKxGxTxD, axis=-1, keepdims=True)
  ds = p * (dp - delta)
  if softcap is not None:
    ds = ds * (1.0 - tanh * tanh)
  ds = ds * D ** -0.5
  dq = jnp.einsum("bkgts,bskd->btkgd", ds, k_BxTxKxD.astype(f32))
  dk = jnp.einsum("bkgts,bkgtd->bskd", ds, q_BxKxGxTxD.astype(f32))
  return (dq.reshape(B, T, K * G, D).astype(q_BxKxGxTxD.dtype), dk.astype(k_BxTxKxD.dtype),
          dv.astype(v_BxTxKxD.dtype), None)


_self_attention.defvjp(_self_attention_fwd, _self_attention_bwd)
