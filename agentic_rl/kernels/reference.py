"""Pure-JAX (XLA) reference implementations of the kernels' ops.

These are the ``impl="xla"`` paths and the references the Pallas kernels are
tested against. The model's attention goes through :func:`attention`, so the
masking semantics (positions, segments, sliding window, soft-cap) have exactly
one home.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A window this large means "global attention"; it lets per-layer windows be a
# traced int array scanned over layers.
NO_WINDOW = 1 << 30


def attention_mask(
    q_positions_BxT: jax.Array,
    kv_positions_BxS: jax.Array,
    *,
    q_segment_ids_BxT: jax.Array | None = None,
    kv_segment_ids_BxS: jax.Array | None = None,
    causal: bool = True,
    sliding_window: int | jax.Array | None = None,
) -> jax.Array:
  """Boolean mask ``[B, T, S]``: may query t see key s.

  Visible iff (not causal or kv_pos <= q_pos), (no window or
  q_pos - kv_pos < window), and the segment ids agree.
  """
  q = q_positions_BxT[:, :, None]
  k = kv_positions_BxS[:, None, :]
  mask = jnp.ones(jnp.broadcast_shapes(q.shape, k.shape), bool)
  if causal:
    mask &= k <= q
  if sliding_window is not None:
    mask &= (q - k) < sliding_window
  if q_segment_ids_BxT is not None or kv_segment_ids_BxS is not None:
    if q_segment_ids_BxT is None or kv_segment_ids_BxS is None:
      raise ValueError("pass both q and kv segment ids, or neither")
    mask &= q_segment_ids_BxT[:, :, None] == kv_segment_ids_BxS[:, None, :]
  return mask


# Key/value layouts: sequence-major [B, S, K, D] or head-major [B, K, S, D].
KV_LAYOUTS = ("BSKD", "BKSD")


def attention(
    q_BxTxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    sliding_window: int | jax.Array | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    kv_layout: str = "BSKD",
) -> jax.Array:
  """Multi-head attention with GQA/MQA, in fp32 softmax.

  q: ``[B, T, H, D]``; k, v: ``[B, S, K, D]`` with ``H % K == 0`` (query head
  ``h`` reads key/value head ``h // (H // K)``), or ``[B, K, S, D]`` with
  ``kv_layout="BKSD"`` (a head-major KV cache, whose heads XLA reads without
  a transpose). Positions default to
  ``arange`` (so with ``T == S`` this is ordinary causal attention); with a KV
  cache pass the queries' absolute positions and the cache slots' positions.
  ``segment_ids`` ``[B, T]`` (and ``kv_segment_ids`` ``[B, S]``, defaulting to
  ``segment_ids``) isolate packed or padded sequences. Logits are
  ``softcap * tanh(s / softcap)`` when ``softcap`` is set (Gemma 2).

  Rows with no visible key return zeros, never NaN. Returns ``[B, T, H, D]``
  in q's dtype.
  """
  B, T, H, D = q_BxTxHxD.shape
  if kv_layout not in KV_LAYOUTS:
    raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
  kv = "bskd" if kv_layout == "BSKD" else "bksd"
  S, K = (k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]) if kv == "bskd" else \
      (k_BxSxKxD.shape[2], k_BxSxKxD.shape[1])
  if H % K:
    raise ValueError(f"query heads {H} must be a multiple of key/value heads {K}")
  G = H // K
  if q_positions is None:
    q_positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  if kv_positions is None:
    kv_positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  if segment_ids is not None and kv_segment_ids is None:
    kv_segment_ids = segment_ids
  mask_BxTxS = attention_mask(
      q_positions, kv_positions,
      q_segment_ids_BxT=segment_ids, kv_segment_ids_BxS=kv_segment_ids,
      causal=causal, sliding_window=sliding_window)
  scale = D ** -0.5 if scale is None else scale
  # Queries head-major, [B, K, G, T, D], and the output of the value product
  # likewise: with the cache head-major too, XLA:CPU's value product for a
  # decode step (T == 1, G > 1) is a [G, S] x [S, D] product per (b, k)
  # rather than a [D, S] x [S, G] one.
  q_BxKxGxTxD = q_BxTxHxD.reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)
  s_BxKxGxTxS = jnp.einsum(
      f"bkgtd,{kv}->bkgts", q_BxKxGxTxD, k_BxSxKxD,
      preferred_element_type=jnp.float32) * scale
  if softcap is not None:
    s_BxKxGxTxS = softcap * jnp.tanh(s_BxKxGxTxS / softcap)
  p = masked_softmax(s_BxKxGxTxS, mask_BxTxS[:, None, None])
  out_BxKxGxTxD = jnp.einsum(f"bkgts,{kv}->bkgtd", p.astype(v_BxSxKxD.dtype),
                             v_BxSxKxD, preferred_element_type=jnp.float32)
  return out_BxKxGxTxD.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(
      q_BxTxHxD.dtype)


def token_logprobs(
    hidden_NxD: jax.Array,
    unembed_DxV: jax.Array,
    targets_N: jax.Array,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Log-prob of each target and entropy of each row, materialising logits.

  ``z = h @ W`` (fp32 accumulation), ``z = softcap * tanh(z / softcap)`` if
  set, then ``z / temperature``; returns ``log_softmax(z)[n, targets[n]]`` and
  ``-sum_v p_v log p_v``, both fp32 ``[N]``.

  The gradient is autodiff's of exactly that; where the entropy gets no
  cotangent (it is only a metric) it is computed without the ``[N, V]``
  scatter of the target log-probs' cotangent (:func:`_logprobs_bwd`).
  """
  logits = jnp.dot(hidden_NxD, unembed_DxV, preferred_element_type=jnp.float32)
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  logits = logits / temperature
  return _logprobs(logits, targets_N)


def _logprobs_of_logits(logits_NxV, targets_N):
  logp_NxV = jax.nn.log_softmax(logits_NxV, axis=-1)
  logp_N = jnp.take_along_axis(logp_NxV, targets_N[:, None], axis=-1)[:, 0]
  entropy_N = -jnp.sum(jnp.exp(logp_NxV) * logp_NxV, axis=-1)
  return logp_N, entropy_N


@jax.custom_vjp
def _logprobs(logits_NxV, targets_N):
  return _logprobs_of_logits(logits_NxV, targets_N)


def _logprobs_fwd(logits_NxV, targets_N):
  logits_NxV, targets_N = logits_NxV.value, targets_N.value
  return _logprobs_of_logits(logits_NxV, targets_N), (logits_NxV, targets_N)


def _logprobs_bwd(res, cts):
  """Autodiff's backward of :func:`_logprobs_of_logits`, the same values.

  With only the log-probs' cotangent ``a`` (the entropy's a symbolic zero),
  autodiff scatters ``a`` into an ``[N, V]`` zero array ``g`` and sums it
  back over V for ``log_softmax``'s normaliser: ``dz = g + e * (sum_v(-g) /
  S)``, ``e = exp(z - max z)``, ``S = sum_v e``. ``sum_v(-g)`` is ``-a`` (a
  sum of one term and zeros; ``+0`` where ``a`` is zero), so neither the
  scatter, its zero fill nor the sum is needed: ``g`` is a select inside the
  fusion that computes ``dz``. With an entropy cotangent the backward is
  ``jax.vjp``'s.
  """
  logits_NxV, targets_N = res
  d_logp, d_entropy = cts
  symbolic_zero = jax.custom_derivatives.SymbolicZero
  if not isinstance(d_entropy, symbolic_zero) or isinstance(d_logp, symbolic_zero):
    d_logp, d_entropy = (jnp.zeros(c.shape, c.dtype) if isinstance(c, symbolic_zero) else c
                         for c in (d_logp, d_entropy))
    _, vjp = jax.vjp(lambda z: _logprobs_of_logits(z, targets_N), logits_NxV)
    return vjp((d_logp, d_entropy))[0], None
  # log_softmax's own max and normaliser (XLA computes them once, for both).
  x_max = jnp.max(logits_NxV, -1, initial=-jnp.inf, keepdims=True)
  e_NxV = jnp.exp(logits_NxV - x_max)
  d_lse_N1 = jnp.where(d_logp == 0, 0.0, -d_logp)[:, None]
  d_s_N1 = d_lse_N1 / jnp.sum(e_NxV, -1, keepdims=True)
  V = logits_NxV.shape[-1]
  targets_N = jnp.where(targets_N < 0, targets_N + V, targets_N)  # as take_along_axis
  hit_NxV = (jax.lax.broadcasted_iota(targets_N.dtype, logits_NxV.shape, 1)
             == targets_N[:, None])
  g_NxV = jnp.where(hit_NxV, d_logp[:, None], 0.0)
  return g_NxV + d_s_N1 * e_NxV, None


_logprobs.defvjp(_logprobs_fwd, _logprobs_bwd, symbolic_zeros=True)


def masked_softmax(s: jax.Array, mask: jax.Array) -> jax.Array:
  """fp32 softmax of scores ``s`` over the last axis where ``mask`` (broadcast
  to ``s``) is True, 0 elsewhere; a row with no True entry is all 0."""
  s = jnp.where(mask, s, -jnp.inf)
  row_max = jnp.max(s, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.where(mask, jnp.exp(s - row_max), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(denom > 0, denom, 1.0)

