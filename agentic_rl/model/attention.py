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

Implementations: ``"xla"`` is :func:`agentic_rl.kernels.reference.attention`.
``"pallas"`` uses ``agentic_rl.kernels.flash_attention`` for self-attention
and ``agentic_rl.kernels.decode_attention`` for single-token cache attention
(T == 1, reading the head-major cache in place); multi-token cache attention
(chunked extend) has no kernel and uses the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentic_rl.kernels import reference

IMPLS = ("xla", "pallas")


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
) -> jax.Array:
  """Causal GQA attention (see the module docstring for the two modes).

  Args:
    q_BxTxHxD: queries, compute dtype.
    k_BxSxKxD, v_BxSxKxD: keys and values ``[B, S, K, D]`` for
      self-attention (``S == T``); for cache attention the head-major cache
      ``[B, K, S, D]``. ``H % K == 0``.
    impl: "xla" or "pallas".
    segment_ids_BxT: int segment ids (self-attention only).
    q_positions_BxT: int absolute positions of the queries (cache mode).
    sliding_window: int window (may be a traced scalar), or None for global.
    softcap: attention-logit soft-cap ``c * tanh(s / c)``, or None.

  Returns:
    ``[B, T, H, D]`` in q's dtype; the softmax is fp32 with scale
    ``D ** -0.5``.
  """
  if impl not in IMPLS:
    raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
  cache_mode = q_positions_BxT is not None
  if cache_mode and segment_ids_BxT is not None:
    raise ValueError("segment ids are only supported for self-attention, "
                     "not for attention to a KV cache")
  if not cache_mode and q_BxTxHxD.shape[1] != k_BxSxKxD.shape[1]:
    raise ValueError(
        f"self-attention needs as many keys as queries, got "
        f"{k_BxSxKxD.shape[1]} keys for {q_BxTxHxD.shape[1]} queries")

  if impl == "pallas":
    from agentic_rl import kernels  # Lazy: the kernels import Pallas.
    if not cache_mode:
      return kernels.flash_attention(
          q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, causal=True,
          segment_ids=segment_ids_BxT, sliding_window=sliding_window,
          softcap=softcap, impl="pallas")
    if q_BxTxHxD.shape[1] == 1:
      out_BxHxD = kernels.decode_attention(
          q_BxTxHxD[:, 0], k_BxSxKxD, v_BxSxKxD, q_positions_BxT[:, 0] + 1,
          sliding_window=sliding_window, softcap=softcap, impl="pallas",
          kv_layout="BKSD")
      return out_BxHxD[:, None]

  if not cache_mode:
    return reference.attention(
        q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, causal=True,
        segment_ids=segment_ids_BxT, sliding_window=sliding_window,
        softcap=softcap)
  B, S = k_BxSxKxD.shape[0], k_BxSxKxD.shape[2]
  kv_positions_BxS = jnp.broadcast_to(
      jnp.arange(S, dtype=q_positions_BxT.dtype), (B, S))
  return reference.attention(
      q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, causal=True,
      q_positions=q_positions_BxT, kv_positions=kv_positions_BxS,
      sliding_window=sliding_window, softcap=softcap, kv_layout="BKSD")
