"""KV cache and incremental decoding (prefill, extend, decode_step).

Slot ``j`` of the cache holds the key/value of the token at absolute position
``j``; a query at position ``p`` sees slots ``j <= p`` (and ``p - j < window``
on sliding-window layers). So the cache needs no length bookkeeping, and a
right-padded prompt batch just works: a row's pad slots are overwritten when
its later tokens are written, and until then they sit at positions after the
row's current token, where the causal mask hides them. For the same reason a
cache can be reused for a new batch without clearing it. Writes past the end
of the cache are dropped (checked in Python when the starts are concrete).

Every function is jit-friendly with the cache donated::

  step = jax.jit(decode_step, static_argnames="config", donate_argnames="cache")
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from agentic_rl.model import transformer
from agentic_rl.model.attention import attention
from agentic_rl.model.config import TransformerConfig


@struct.dataclass
class KVCache:
  """Keys and values of every layer, head-major ``[L, B, K, S, Dh]``, in
  compute dtype (see ``model.attention`` for why head-major)."""

  k: jax.Array
  v: jax.Array

  @property
  def max_len(self) -> int:
    return self.k.shape[3]


def init_cache(config: TransformerConfig, batch: int, max_len: int) -> KVCache:
  """An all-zero cache for ``batch`` rows and positions ``[0, max_len)``."""
  config.validate()
  if batch < 1 or max_len < 1:
    raise ValueError(f"batch and max_len must be >= 1, got {batch}, {max_len}")
  shape = (config.n_layers, batch, config.n_kv_heads, max_len, config.head_dim)
  # Two buffers, not one shared: the cache is donated to jitted steps.
  return KVCache(k=jnp.zeros(shape, config.compute_dtype),
                 v=jnp.zeros(shape, config.compute_dtype))


def _check_cache(cache: KVCache, config: TransformerConfig, batch: int):
  expected = (config.n_layers, batch, config.n_kv_heads, cache.max_len,
              config.head_dim)
  for name, x in (("k", cache.k), ("v", cache.v)):
    if x.shape != expected:
      raise ValueError(f"cache.{name} has shape {x.shape}, expected {expected} "
                       "([layers, batch, kv_heads, max_len, head_dim])")
    if x.dtype != config.compute_dtype:
      raise ValueError(f"cache.{name} has dtype {x.dtype}, expected the "
                       f"compute dtype {config.compute_dtype}")


def _run(params, tokens_BxT, positions_BxT, cache, config, *, from_start):
  """Write the tokens' keys/values at their positions and run the layers.

  With ``from_start`` (prefill: the tokens are positions ``0..T-1`` of every
  row) attention runs over the fresh keys only, which is the same as reading
  the cache back, since later slots are invisible to these queries.
  """
  B = tokens_BxT.shape[0]
  rows_Bx1 = jnp.arange(B)[:, None]

  def body(carry, layer):
    x_BxTxD, k_cache, v_cache = carry
    p, window, i = layer

    def attend(q, k, v):
      # Advanced indices around a slice: the update is laid out [B, T, K, Dh].
      k_all = k_cache.at[i, rows_Bx1, :, positions_BxT].set(k, mode="drop")
      v_all = v_cache.at[i, rows_Bx1, :, positions_BxT].set(v, mode="drop")
      kwargs = dict(impl=config.attn_impl, softcap=config.attn_logit_softcap,
                    sliding_window=transformer.layer_window(window, config))
      if from_start:
        out = attention(q, k, v, **kwargs)
      else:
        out = attention(q, k_all[i], v_all[i], q_positions_BxT=positions_BxT,
                        **kwargs)
      return out, (k_all, v_all)

    x_BxTxD, (k_cache, v_cache) = transformer.decoder_layer(
        x_BxTxD, p, positions_BxT, config, attend)
    return (x_BxTxD, k_cache, v_cache), None

  x_BxTxD = transformer.embed_tokens(params, tokens_BxT, config)
  layers = (params["layers"], jnp.asarray(config.layer_windows()),
            jnp.arange(config.n_layers))
  (x_BxTxD, k, v), _ = lax.scan(body, (x_BxTxD, cache.k, cache.v), layers)
  logits_BxTxV, hidden_BxTxD = transformer.output_logits(params, x_BxTxD, config)
  return logits_BxTxV, hidden_BxTxD, KVCache(k=k, v=v)


def _prepare(tokens_BxT, cache, config):
  config.validate()
  tokens_BxT = transformer.check_tokens(tokens_BxT, config.vocab_size, ndim=2)
  B, T = tokens_BxT.shape
  _check_cache(cache, config, B)
  if T > cache.max_len:
    raise ValueError(f"{T} tokens do not fit in a KV cache of {cache.max_len}")
  return tokens_BxT


def _outputs(logits, hidden, cache, return_hidden):
  return (logits, hidden, cache) if return_hidden else (logits, cache)


def extend(params, tokens_BxT: jax.Array, start_B: jax.Array, cache: KVCache,
           config: TransformerConfig, *, return_hidden: bool = False):
  """Run T new tokens per row at positions ``start_B[b] + arange(T)``.

  Writes their keys/values into those cache slots and attends to the cache
  (slots ``<=`` each query's position). Raises ``ValueError`` when
  ``T > max_len``, or, for a concrete ``start_B``, when ``start < 0`` or
  ``start + T > max_len``; under jit the caller guarantees the fit (writes
  past the end are dropped).

  Returns ``(logits_BxTxV, cache)``, or ``(logits_BxTxV, hidden_BxTxD,
  cache)`` with ``return_hidden``; logits fp32 as in ``forward``.
  """
  tokens_BxT = _prepare(tokens_BxT, cache, config)
  B, T = tokens_BxT.shape
  transformer.check_shape("start_B", start_B, (B,))
  starts = transformer.concrete_or_none(start_B)
  if starts is not None and starts.size:
    if starts.min() < 0 or starts.max() + T > cache.max_len:
      raise ValueError(
          f"chunk of {T} tokens at starts in [{starts.min()}, {starts.max()}] "
          f"runs past the KV cache of {cache.max_len} (or starts below 0)")
  positions_BxT = (jnp.asarray(start_B, jnp.int32)[:, None]
                   + jnp.arange(T, dtype=jnp.int32))
  logits, hidden, cache = _run(params, tokens_BxT, positions_BxT, cache,
                               config, from_start=False)
  return _outputs(logits, hidden, cache, return_hidden)


def prefill(params, tokens_BxT: jax.Array, cache: KVCache,
            config: TransformerConfig, *, return_hidden: bool = False):
  """:func:`extend` at start 0 (a right-padded prompt batch is fine)."""
  tokens_BxT = _prepare(tokens_BxT, cache, config)
  B, T = tokens_BxT.shape
  positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  logits, hidden, cache = _run(params, tokens_BxT, positions_BxT, cache,
                               config, from_start=True)
  return _outputs(logits, hidden, cache, return_hidden)


def decode_step(params, tokens_B: jax.Array, positions_B: jax.Array,
                cache: KVCache, config: TransformerConfig):
  """One token per row at ``positions_B``: returns ``(logits_BxV, cache)``."""
  tokens_B = jnp.asarray(tokens_B)
  if tokens_B.ndim != 1:
    raise ValueError(f"tokens_B must have 1 dim, got shape {tokens_B.shape}")
  logits_Bx1xV, cache = extend(params, tokens_B[:, None], positions_B, cache,
                               config)
  return logits_Bx1xV[:, 0], cache
