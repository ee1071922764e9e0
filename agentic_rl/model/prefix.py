"""Group prefix sharing: a forward pass that runs a prefix common to a group
of rows once.

Rows that come in groups of G consecutive rows (``B = P * G``) whose rows
agree on their first ``Lp`` tokens (G samples of one prompt) need those
tokens' activations once per group, not once per row. :func:`forward_hidden`
runs

* the P prefixes ``tokens_BxT[p * G, :Lp]`` (``[P, Lp]``, positions
  ``0 .. Lp-1``) through the layers with causal self-attention (the model's
  ``attn_impl``), and
* the B suffixes ``tokens_BxT[:, Lp:]`` (``[B, S]``, ``S = T - Lp``,
  positions ``Lp .. T-1``) with each suffix query at position ``Lp + i``
  attending to its group's prefix keys and values (all of them, or those
  within a sliding window) and to its own suffix keys ``Lp + j``, ``j <= i``
  (:func:`suffix_attention`),

layer by layer, so the suffix of layer ``l`` reads the prefix keys and
values of layer ``l``. That is :func:`~agentic_rl.model.transformer.forward`
of the whole rows, computed in another order: the same hidden states to
float rounding (the matmuls have other shapes, and a suffix query's softmax
sums its prefix and suffix terms in another order). The projections and the
MLP then cost ``P * Lp + B * S`` token rows instead of ``B * T``, the
attention ``P * Lp^2 + B * S * T`` scores instead of ``B * T^2``.

Incremental decoding shares the prefix the same way
(:func:`cache_attention`, ``kv_cache.decode_step(..., prefix=...)``): the
groups' prefix keys and values sit in a ``[P, K, Lp, Dh]`` cache, read once
per group by its G rows' queries, and each row's own cache holds positions
``Lp ..`` only, so a decode step reads ``P * Lp + B * S`` cached positions
instead of ``B * (Lp + S)``.

:func:`shared_prefix_len` finds, on the host, the ``Lp`` a batch of token
rows allows, rounded down to few values (:func:`prefix_bucket`) so that a
jitted caller, for which ``Lp`` is static, rarely compiles again.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from agentic_rl.kernels import reference
from agentic_rl.model import transformer
from agentic_rl.model.attention import attention
from agentic_rl.model.config import TransformerConfig
from agentic_rl.model.remat import recompute_in_backward


def _check(B: int, T: int, group_size: int, prefix_len: int) -> None:
  for name, value in (("group_size", group_size), ("prefix_len", prefix_len)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
      raise ValueError(f"{name} must be a Python int (static), got {value!r}")
  if group_size < 1 or B % group_size:
    raise ValueError(f"group_size must be >= 1 and divide the {B} rows, got {group_size}")
  if not 1 <= prefix_len < T:
    raise ValueError(f"prefix_len must be in [1, {T - 1}] for rows of {T} tokens (at least "
                     f"one suffix token), got {prefix_len}")


def suffix_attention(q_BxSxHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array,
                     prefix_k_PxLxKxD: jax.Array, prefix_v_PxLxKxD: jax.Array, *,
                     sliding_window: int | jax.Array | None = None,
                     softcap: float | None = None, recompute: bool = False) -> jax.Array:
  """Causal GQA attention of B suffix rows over their group's prefix and
  themselves.

  Row ``b`` is in group ``p = b // G`` (``G = B // P``). Its query ``i``
  (position ``L + i``) sees the prefix keys ``prefix_k[p, j]`` (position
  ``j < L``) and its own keys ``k[b, j]`` (position ``L + j``, ``j <= i``),
  each only where the position difference is below ``sliding_window``.
  Scores ``s = q . k * D ** -0.5`` (fp32), ``softcap * tanh(s / softcap)``
  when set, then one fp32 softmax over the ``L + S`` keys: the same as
  ``reference.attention`` over the concatenated keys, without repeating the
  prefix keys and values G times (the prefix products take the group's G
  rows of queries as one matrix).

  With ``recompute`` the backward keeps only the inputs and recomputes the
  scores and probabilities (:func:`~agentic_rl.model.remat.recompute_in_backward`),
  as the model's self-attention does with ``backward_recompute``.

  Args:
    q_BxSxHxD: suffix queries; H a multiple of K.
    k_BxSxKxD, v_BxSxKxD: suffix keys and values.
    prefix_k_PxLxKxD, prefix_v_PxLxKxD: the groups' prefix keys and values.
    sliding_window: int (may be traced) or None.
    softcap: attention-logit soft-cap, or None.
    recompute: recompute in the backward.

  Returns:
    ``[B, S, H, D]`` in q's dtype.
  """
  core = functools.partial(_suffix_attention, softcap=softcap)
  if recompute:
    return recompute_in_backward(core, q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, prefix_k_PxLxKxD,
                                 prefix_v_PxLxKxD, sliding_window)
  return core(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, prefix_k_PxLxKxD, prefix_v_PxLxKxD,
              sliding_window)


def _suffix_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, prefix_k_PxLxKxD, prefix_v_PxLxKxD,
                      sliding_window, *, softcap):
  """:func:`cache_attention` over sequence-major keys: the suffix's query
  ``i`` is at position ``L + i``."""
  B, S = q_BxSxHxD.shape[:2]
  L = prefix_k_PxLxKxD.shape[1]
  head_major = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
  q_positions_BxS = jnp.broadcast_to(L + jnp.arange(S, dtype=jnp.int32), (B, S))
  return cache_attention(q_BxSxHxD, head_major(prefix_k_PxLxKxD), head_major(prefix_v_PxLxKxD),
                         head_major(k_BxSxKxD), head_major(v_BxSxKxD), q_positions_BxS,
                         sliding_window=sliding_window, softcap=softcap)


def forward_hidden(params, tokens_BxT: jax.Array, config: TransformerConfig, *,
                   group_size: int, prefix_len: int,
                   layer_params_constraint=None) -> tuple[jax.Array, jax.Array]:
  """Final-normed hidden states of rows whose groups share a prefix.

  Args:
    params: the model's parameters (stacked layers, as ``forward`` takes).
    tokens_BxT: int token ids; rows ``p * G .. p * G + G - 1`` must agree
      on their first ``prefix_len`` tokens (not checked: row ``p * G``'s
      prefix is the group's).
    config: the model config (static).
    group_size: G (static), dividing B.
    prefix_len: Lp (static), in ``[1, T - 1]``.
    layer_params_constraint: as ``forward``'s.

  Returns:
    ``(hidden_PxLpxD, hidden_BxSxD)`` in compute dtype: the prefix's states
    at positions ``0 .. Lp-1`` once per group and each row's at positions
    ``Lp .. T-1``; ``forward(..., return_hidden=True)[1]`` of row ``b`` is
    ``concat(hidden_PxLpxD[b // G], hidden_BxSxD[b])`` to float rounding.
  """
  config.validate()
  tokens_BxT = transformer.check_tokens(tokens_BxT, config.vocab_size, ndim=2)
  B, T = tokens_BxT.shape
  _check(B, T, group_size, prefix_len)
  G, Lp = int(group_size), int(prefix_len)
  P, S = B // G, T - Lp
  prefix_PxLp = tokens_BxT.reshape(P, G, T)[:, 0, :Lp]
  suffix_BxS = tokens_BxT[:, Lp:]
  ropes_prefix = transformer.model_ropes(
      jnp.broadcast_to(jnp.arange(Lp, dtype=jnp.int32), (P, Lp)), config)
  ropes_suffix = transformer.model_ropes(
      jnp.broadcast_to(Lp + jnp.arange(S, dtype=jnp.int32), (B, S)), config)

  def body(carry, layer):
    x_PxLpxD, x_BxSxD = carry
    p, window = layer
    if layer_params_constraint is not None:
      p = layer_params_constraint(p)
    sliding_window = transformer.layer_window(window, config)

    def attend_prefix(q, k, v):
      out = attention(q, k, v, impl=config.attn_impl, recompute=config.backward_recompute,
                      sliding_window=sliding_window, softcap=config.attn_logit_softcap)
      return out, (k, v)

    x_PxLpxD, (prefix_k, prefix_v) = transformer.decoder_layer(
        x_PxLpxD, p, transformer.layer_rope(ropes_prefix, window), config, attend_prefix)

    def attend_suffix(q, k, v):
      out = suffix_attention(q, k, v, prefix_k, prefix_v, sliding_window=sliding_window,
                             softcap=config.attn_logit_softcap,
                             recompute=config.backward_recompute)
      return out, None

    x_BxSxD, _ = transformer.decoder_layer(
        x_BxSxD, p, transformer.layer_rope(ropes_suffix, window), config, attend_suffix)
    return (x_PxLpxD, x_BxSxD), None

  if config.remat:
    body = jax.checkpoint(body)
  x = (transformer.embed_tokens(params, prefix_PxLp, config),
       transformer.embed_tokens(params, suffix_BxS, config))
  windows_L = jnp.asarray(config.layer_windows())
  (x_PxLpxD, x_BxSxD), _ = lax.scan(body, x, (params["layers"], windows_L),
                                    unroll=config.scan_unroll or config.n_layers)
  norm = functools.partial(transformer.rms_norm, w=params["final_norm"],
                           eps=config.norm_eps, plus_one=config.norm_plus_one)
  return norm(x_PxLpxD), norm(x_BxSxD)


def cache_attention(q_BxTxHxD: jax.Array, prefix_k_PxKxLxD: jax.Array,
                    prefix_v_PxKxLxD: jax.Array, k_BxKxSxD: jax.Array, v_BxKxSxD: jax.Array,
                    q_positions_BxT: jax.Array, *,
                    sliding_window: int | jax.Array | None = None,
                    softcap: float | None = None) -> jax.Array:
  """Attention of B rows' queries to a KV cache split into their group's
  shared prefix and their own positions after it (head-major caches).

  Row ``b`` is in group ``p = b // G``. Prefix slot ``j`` of
  ``prefix_k[p]`` holds position ``j < L``; slot ``j`` of ``k[b]`` holds
  position ``L + j``. A query at position ``q`` sees the positions ``<= q``
  with ``q - position < sliding_window``. Scores ``q . k * D ** -0.5``
  (fp32), soft-capped when set, one fp32 softmax over the ``L + S`` slots:
  ``reference.attention`` over the row's whole cache (positions ``0 ..
  L + S - 1``) to float rounding, reading the prefix once per group.

  Args:
    q_BxTxHxD: queries; H a multiple of K.
    prefix_k_PxKxLxD, prefix_v_PxKxLxD: the groups' prefix cache.
    k_BxKxSxD, v_BxKxSxD: the rows' caches of the positions from L on.
    q_positions_BxT: int absolute positions of the queries.
    sliding_window: int (may be traced) or None.
    softcap: attention-logit soft-cap, or None.

  Returns:
    ``[B, T, H, D]`` in q's dtype.
  """
  B, T, H, D = q_BxTxHxD.shape
  P, K, L = prefix_k_PxKxLxD.shape[:3]
  S = k_BxKxSxD.shape[2]
  if B % P or H % K:
    raise ValueError(f"{B} rows do not split into {P} groups, or {H} query heads into "
                     f"{K} key/value heads")
  G, R = B // P, H // K
  f32 = jnp.float32
  q = q_BxTxHxD.reshape(P, G, T, K, R, D)
  k = k_BxKxSxD.reshape(P, G, K, S, D)
  v = v_BxKxSxD.reshape(P, G, K, S, D)
  scale = D ** -0.5
  s_prefix = jnp.einsum("pgtkrd,pkld->pgkrtl", q, prefix_k_PxKxLxD,
                        preferred_element_type=f32) * scale
  s_own = jnp.einsum("pgtkrd,pgksd->pgkrts", q, k, preferred_element_type=f32) * scale
  s = jnp.concatenate([s_prefix, s_own], axis=-1)
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  kv_pos_BxN = jnp.broadcast_to(jnp.arange(L + S, dtype=q_positions_BxT.dtype), (B, L + S))
  mask_BxTxN = reference.attention_mask(q_positions_BxT, kv_pos_BxN, causal=True,
                                        sliding_window=sliding_window)
  mask = mask_BxTxN.reshape(P, G, 1, 1, T, L + S)
  p = reference.masked_softmax(s, mask).astype(v_BxKxSxD.dtype)
  out = (jnp.einsum("pgkrtl,pkld->pgtkrd", p[..., :L], prefix_v_PxKxLxD,
                    preferred_element_type=f32)
         + jnp.einsum("pgkrts,pgksd->pgtkrd", p[..., L:], v, preferred_element_type=f32))
  return out.reshape(B, T, H, D).astype(q_BxTxHxD.dtype)


# --- the shared length, on the host -----------------------------------------


def common_prefix_len(tokens_BxT, group_size: int) -> int:
  """The most leading tokens on which every group of ``group_size``
  consecutive rows agrees (row by row within the group), at most ``T - 1``
  (a suffix keeps one token). Host numpy; 0 when some group's rows differ
  at their first token."""
  tokens = np.asarray(tokens_BxT)
  B, T = tokens.shape
  if group_size < 1 or B % group_size:
    raise ValueError(f"group_size must be >= 1 and divide the {B} rows, got {group_size}")
  groups = tokens.reshape(B // group_size, group_size, T)
  differs_T = ~np.all(groups == groups[:, :1], axis=(0, 1))
  first = int(np.argmax(differs_T)) if differs_T.any() else T
  return min(first, T - 1)


def prefix_bucket(n: int) -> int:
  """The largest of 0, 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (``2^k`` and
  ``3 * 2^(k-1)``) that is ``<= n``: a shared length that wastes less than a
  third of ``n`` and takes about ``2 log2(T)`` values."""
  if n < 1:
    return 0
  k = 1 << (int(n).bit_length() - 1)
  return k + k // 2 if n >= k + k // 2 and k >= 2 else k


def shared_prefix_len(tokens_BxT, group_size: int) -> int:
  """``prefix_bucket(common_prefix_len(tokens_BxT, group_size))``: the static
  ``prefix_len`` for :func:`forward_hidden` (0: nothing to share)."""
  return prefix_bucket(common_prefix_len(tokens_BxT, group_size))
