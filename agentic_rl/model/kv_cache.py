"""KV cache and incremental decoding (prefill, extend, decode_step).

Slot ``j`` of the cache holds the key/value of the token at absolute position
``j``; a query at position ``p`` sees slots ``j <= p`` (and ``p - j < window``
on sliding-window layers). So the cache needs no length bookkeeping, and a
right-padded prompt batch just works: a row's pad slots are overwritten when
its later tokens are written, and until then they sit at positions after the
row's current token, where the causal mask hides them. For the same reason a
cache can be reused for a new batch without clearing it, or grown
(:func:`grow_cache`) while rows get longer. Writes past the end of the cache
are dropped (checked in Python when the starts are concrete).

Rows that share a prefix (G samples of one prompt) can keep it once per
group: ``extend`` / ``decode_step`` with ``prefix=`` (a ``[P, K, Lp, Dh]``
cache of positions ``0 .. Lp-1``, row ``b`` reading group ``b // G``'s) take
a ``cache`` whose slot ``j`` holds position ``Lp + j`` (:func:`split_slots`
makes both from one prefilled cache); their attention reads the prefix once
per group (``prefix.cache_attention``).

Every function is jit-friendly with the cache donated::

  step = jax.jit(decode_step, static_argnames="config", donate_argnames="cache")
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from agentic_rl.model import prefix as prefix_lib
from agentic_rl.model import transformer
from agentic_rl.model.attention import attention
from agentic_rl.model.config import TransformerConfig


@struct.dataclass
class KVCache:
  """Keys and values, one head-major ``[B, K, S, Dh]`` array per layer
  (tuples of L arrays), in compute dtype.

  One buffer per layer rather than a stacked ``[L, B, K, S, Dh]`` one: a
  decode step updates each layer's buffer in place and its attention reads
  it in place. With a stacked cache, a layer scan slices layer ``l`` out of
  the carry, which XLA copies (the whole cache, every step; BENCHMARKS.md,
  ``decode_step_stacked_cache``). Head-major: see ``model.attention``.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @property
  def max_len(self) -> int:
    return self.k[0].shape[2]


def init_cache(config: TransformerConfig, batch: int, max_len: int) -> KVCache:
  """An all-zero cache for ``batch`` rows and positions ``[0, max_len)``."""
  config.validate()
  if batch < 1 or max_len < 1:
    raise ValueError(f"batch and max_len must be >= 1, got {batch}, {max_len}")
  shape = (batch, config.n_kv_heads, max_len, config.head_dim)
  # Separate buffers, none shared: the cache is donated to jitted steps.
  zeros = lambda: tuple(jnp.zeros(shape, config.compute_dtype)
                        for _ in range(config.n_layers))
  return KVCache(k=zeros(), v=zeros())


def grow_cache(cache: KVCache, max_len: int) -> KVCache:
  """The same cache with zero slots appended up to ``max_len`` positions.

  A decode loop can start with a short cache and grow it as rows get longer,
  so attention reads only about as many slots as the rows hold.
  """
  if max_len < cache.max_len:
    raise ValueError(f"cannot grow a KV cache of {cache.max_len} slots to "
                     f"{max_len}")
  if max_len == cache.max_len:
    return cache
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, max_len - cache.max_len),
                              (0, 0)))
  return KVCache(k=tuple(map(pad, cache.k)), v=tuple(map(pad, cache.v)))


def repeat_rows(cache: KVCache, repeats: int) -> KVCache:
  """The cache with each row repeated ``repeats`` times, consecutively: row
  ``b`` of the result is row ``b // repeats`` of ``cache`` (``[B * r, K, S,
  Dh]`` per layer). A prompt prefilled once then serves the ``repeats``
  rows that sample from it."""
  if repeats == 1:
    return cache
  rep = lambda x: jnp.repeat(x, repeats, axis=0)
  return KVCache(k=tuple(map(rep, cache.k)), v=tuple(map(rep, cache.v)))


def split_slots(cache: KVCache, length: int) -> tuple[KVCache, KVCache]:
  """``(slots [0, length), slots [length, max_len))`` of every layer: a
  shared prefix cache and the cache of the positions after it."""
  if not 0 < length < cache.max_len:
    raise ValueError(f"cannot split a KV cache of {cache.max_len} slots at {length}")
  head = lambda xs: tuple(x[:, :, :length] for x in xs)  # noqa: E731
  tail = lambda xs: tuple(x[:, :, length:] for x in xs)  # noqa: E731
  return (KVCache(k=head(cache.k), v=head(cache.v)),
          KVCache(k=tail(cache.k), v=tail(cache.v)))


def _check_cache(cache: KVCache, config: TransformerConfig, batch: int):
  expected = (batch, config.n_kv_heads, cache.max_len, config.head_dim)
  for name, layers in (("k", cache.k), ("v", cache.v)):
    if len(layers) != config.n_layers:
      raise ValueError(f"cache.{name} holds {len(layers)} layers, expected "
                       f"{config.n_layers}")
    for x in layers:
      if x.shape != expected:
        raise ValueError(f"cache.{name} has shape {x.shape}, expected "
                         f"{expected} ([batch, kv_heads, max_len, head_dim])")
      if x.dtype != config.compute_dtype:
        raise ValueError(f"cache.{name} has dtype {x.dtype}, expected the "
                         f"compute dtype {config.compute_dtype}")


def _run(params, tokens_BxT, positions_BxT, cache, config, *, from_start, prefix=None):
  """Write the tokens' keys/values at their positions and run the layers.

  The layers are unrolled (one buffer per layer, see :class:`KVCache`);
  inside a loop, pass ``transformer.unstack_layers(params)`` so the per-layer
  weights are not sliced again at every step. With ``from_start`` (prefill:
  the tokens are positions ``0..T-1`` of every row) attention runs over the
  fresh keys only, which is the same as reading the cache back, since later
  slots are invisible to these queries. With a shared ``prefix`` cache
  (``Lp`` slots), cache slot ``j`` is position ``Lp + j``; tokens at
  positions below ``Lp`` are not written (the prefix holds them).
  """
  B = tokens_BxT.shape[0]
  rows_Bx1 = jnp.arange(B)[:, None]
  k_layers, v_layers = list(cache.k), list(cache.v)
  windows = config.sliding_windows or (None,) * config.n_layers
  x_BxTxD = transformer.embed_tokens(params, tokens_BxT, config)
  offset = 0 if prefix is None else prefix.max_len
  # Slots past the end are dropped, as are positions the prefix holds.
  slots_BxT = positions_BxT if prefix is None else jnp.where(
      positions_BxT < offset, cache.max_len, positions_BxT - offset)
  # Cache positions lie in [0, offset + max_len): a table lookup, computed
  # once per decode loop rather than in every layer of every step.
  ropes = transformer.model_ropes(positions_BxT, config,
                                  table_len=offset + cache.max_len)
  for i in range(config.n_layers):

    def attend(q, k, v, i=i):
      # Advanced indices around a slice: the update is laid out [B, T, K, Dh].
      k_layers[i] = k_layers[i].at[rows_Bx1, :, slots_BxT].set(k, mode="drop")
      v_layers[i] = v_layers[i].at[rows_Bx1, :, slots_BxT].set(v, mode="drop")
      kwargs = dict(impl=config.attn_impl, softcap=config.attn_logit_softcap,
                    sliding_window=windows[i])
      if from_start:
        return attention(q, k, v, **kwargs), None
      if prefix is not None:
        return prefix_lib.cache_attention(
            q, prefix.k[i], prefix.v[i], k_layers[i], v_layers[i], positions_BxT,
            sliding_window=windows[i], softcap=config.attn_logit_softcap), None
      return attention(q, k_layers[i], v_layers[i],
                       q_positions_BxT=positions_BxT, **kwargs), None

    x_BxTxD, _ = transformer.decoder_layer(
        x_BxTxD, transformer.layer_params(params, i),
        transformer.layer_rope(ropes, windows[i]), config, attend)
  logits_BxTxV, hidden_BxTxD = transformer.output_logits(params, x_BxTxD, config)
  return logits_BxTxV, hidden_BxTxD, KVCache(k=tuple(k_layers),
                                             v=tuple(v_layers))


def _prepare(tokens_BxT, cache, config, prefix=None):
  config.validate()
  tokens_BxT = transformer.check_tokens(tokens_BxT, config.vocab_size, ndim=2)
  B, T = tokens_BxT.shape
  _check_cache(cache, config, B)
  offset = 0
  if prefix is not None:
    P = prefix.k[0].shape[0]
    if B % P:
      raise ValueError(f"a prefix cache of {P} groups does not split {B} rows")
    _check_cache(prefix, config, P)
    offset = prefix.max_len
  if T > offset + cache.max_len:
    raise ValueError(f"{T} tokens do not fit in a KV cache of {offset + cache.max_len}")
  return tokens_BxT


def _outputs(logits, hidden, cache, return_hidden):
  return (logits, hidden, cache) if return_hidden else (logits, cache)


def extend(params, tokens_BxT: jax.Array, start_B: jax.Array, cache: KVCache,
           config: TransformerConfig, *, return_hidden: bool = False,
           prefix: KVCache | None = None):
  """Run T new tokens per row at positions ``start_B[b] + arange(T)``.

  Writes their keys/values into those cache slots and attends to the cache
  (slots ``<=`` each query's position). Raises ``ValueError`` when
  ``T > max_len``, or, for a concrete ``start_B``, when ``start < 0`` or
  ``start + T > max_len``; under jit the caller guarantees the fit (writes
  past the end are dropped).

  With ``prefix`` (P groups' shared cache of ``Lp`` slots, P dividing B):
  ``cache`` slot ``j`` holds position ``Lp + j`` and row ``b`` attends to
  group ``b // (B / P)``'s prefix, then to its own slots (module docstring).

  Returns ``(logits_BxTxV, cache)``, or ``(logits_BxTxV, hidden_BxTxD,
  cache)`` with ``return_hidden``; logits fp32 as in ``forward``.
  """
  tokens_BxT = _prepare(tokens_BxT, cache, config, prefix)
  B, T = tokens_BxT.shape
  transformer.check_shape("start_B", start_B, (B,))
  end = cache.max_len + (0 if prefix is None else prefix.max_len)
  starts = transformer.concrete_or_none(start_B)
  if starts is not None and starts.size:
    if starts.min() < 0 or starts.max() + T > end:
      raise ValueError(
          f"chunk of {T} tokens at starts in [{starts.min()}, {starts.max()}] "
          f"runs past the KV cache of {end} (or starts below 0)")
  positions_BxT = (jnp.asarray(start_B, jnp.int32)[:, None]
                   + jnp.arange(T, dtype=jnp.int32))
  logits, hidden, cache = _run(params, tokens_BxT, positions_BxT, cache,
                               config, from_start=False, prefix=prefix)
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
                cache: KVCache, config: TransformerConfig, *,
                prefix: KVCache | None = None):
  """One token per row at ``positions_B``: returns ``(logits_BxV, cache)``
  (``prefix``: as :func:`extend`'s)."""
  tokens_B = jnp.asarray(tokens_B)
  if tokens_B.ndim != 1:
    raise ValueError(f"tokens_B must have 1 dim, got shape {tokens_B.shape}")
  logits_Bx1xV, cache = extend(params, tokens_B[:, None], positions_B, cache,
                               config, prefix=prefix)
  return logits_Bx1xV[:, 0], cache
