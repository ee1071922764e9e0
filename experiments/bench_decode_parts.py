r"""Where a KV-cache decode step spends its time, part by part, side by side.

  python -m experiments.bench_decode_parts --out FILE [--steps 64]

On ``TransformerConfig.llama_10m`` shapes (batch 32, 8 layers, 5 heads of
64), each part runs ``--steps`` times in a jitted ``fori_loop``; the best of 3
runs is reported in ms per decode step:

* ``decode_step_S{n}``: the whole ``model.decode_step`` (``unstack_layers``
  params, greedy next token) against a cache of n slots, for the cache
  lengths the rollout engine grows through (``--slots``);
* ``decode_step_stacked_params``: the same at the longest length, with the
  stacked params sliced inside the loop instead of ``unstack_layers`` once;
* ``decode_step_stacked_cache``: the same, with the design the per-layer
  cache replaced: one ``[L, B, K, S, Dh]`` cache carried through a
  ``lax.scan`` over the layers (written here only for the comparison);
* ``layers_no_attention``: the decoder layers with attention replaced by the
  identity (projections, MLP, norms);
* ``attention_BSKD`` / ``attention_BKSD``: 8 single-token cache attentions
  (``kernels.reference.attention``) over a ``[B, S, K, D]`` cache and over a
  head-major ``[B, K, S, D]`` one (the model's layout), longest length;
* ``cache_scatters``: 8 per-row writes of one token's keys into the cache.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from agentic_rl import model as model_lib
from agentic_rl.kernels import reference
from agentic_rl.model import transformer
from agentic_rl.model.attention import attention as model_attention
from experiments import common

_OUT = flags.DEFINE_string("out", "runs/bench_decode_parts.json", "JSON output path.")
_STEPS = flags.DEFINE_integer("steps", 64, "Decode steps per timed run.")
_SLOTS = flags.DEFINE_list("slots", ["72", "144", "216", "272"],
                           "Cache lengths for decode_step (the last is used "
                           "for the other parts).")

B = 32


def _ms_per_step(fn, *args, steps: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1000 * min(times) / steps


def _stacked_cache_step(params, tokens_B, positions_B, k_LxBxKxSxD, v_LxBxKxSxD,
                        cfg):
  """One decode step with a stacked cache in a layer scan (the old design)."""
  rows_Bx1 = jnp.arange(B)[:, None]
  pos_Bx1 = positions_B[:, None]

  def body(carry, layer):
    x, k_cache, v_cache = carry
    p, i = layer

    def attend(q, k, v):
      k_all = k_cache.at[i, rows_Bx1, :, pos_Bx1].set(k)
      v_all = v_cache.at[i, rows_Bx1, :, pos_Bx1].set(v)
      return model_attention(q, k_all[i], v_all[i], q_positions_BxT=pos_Bx1), (k_all, v_all)

    x, (k_cache, v_cache) = transformer.decoder_layer(x, p, rope, cfg, attend)
    return (x, k_cache, v_cache), None

  x = transformer.embed_tokens(params, tokens_B[:, None], cfg)
  rope = transformer.rope_tables(pos_Bx1, cfg.head_dim, cfg.rope_theta)
  (x, k, v), _ = jax.lax.scan(body, (x, k_LxBxKxSxD, v_LxBxKxSxD),
                              (params["layers"], jnp.arange(cfg.n_layers)))
  return transformer.output_logits(params, x, cfg)[0][:, 0], k, v


def main(argv):
  del argv
  n = _STEPS.value
  slots = [int(s) for s in _SLOTS.value]
  S = slots[-1]
  cfg = model_lib.TransformerConfig.llama_10m()
  params = model_lib.init_params(cfg, jax.random.key(0))
  split = model_lib.unstack_layers(params)
  L, K, D = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
  x_Bx1xD = jax.random.normal(jax.random.key(1), (B, 1, cfg.d_model))
  q_Bx1xHxD = jax.random.normal(jax.random.key(2), (B, 1, cfg.n_heads, D))
  cache_LxBxSxKxD = jax.random.normal(jax.random.key(3), (L, B, S, K, D))
  rows = jnp.arange(B)
  result = {}
  # Compiled as the rollout engine compiles the model.
  jit = functools.partial(jax.jit, compiler_options=model_lib.compiler_options())

  def decode(params, cache):
    # Positions sweep the second half of the cache: the rows' real lengths
    # while the engine runs at this cache size.
    def body(i, carry):
      tok, cache = carry
      pos = jnp.full((B,), cache.max_len // 2, jnp.int32) + i % (cache.max_len // 2)
      logits, cache = model_lib.decode_step(params, tok, pos, cache, cfg)
      return jnp.argmax(logits, -1).astype(jnp.int32), cache
    return jax.lax.fori_loop(0, n, body, (jnp.zeros((B,), jnp.int32), cache))[0]

  decode = jit(decode)
  for s in slots:
    result[f"decode_step_S{s}"] = _ms_per_step(
        decode, split, model_lib.init_cache(cfg, B, s), steps=n)
  result["decode_step_stacked_params"] = _ms_per_step(
      decode, params, model_lib.init_cache(cfg, B, S), steps=n)

  @jit
  def stacked(params, k, v):
    def body(i, carry):
      tok, k, v = carry
      pos = jnp.full((B,), S // 2, jnp.int32) + i % (S // 2)
      logits, k, v = _stacked_cache_step(params, tok, pos, k, v, cfg)
      return jnp.argmax(logits, -1).astype(jnp.int32), k, v
    return jax.lax.fori_loop(0, n, body, (jnp.zeros((B,), jnp.int32), k, v))[0]

  zeros = jnp.zeros((L, B, K, S, D))
  result["decode_step_stacked_cache"] = _ms_per_step(stacked, params, zeros, zeros + 0, steps=n)

  @jit
  def layers(params, x):
    def body(i, x):
      rope = transformer.rope_tables(jnp.full((B, 1), i), cfg.head_dim, cfg.rope_theta)
      for p in params["layers"]:
        x = transformer.decoder_layer(x, p, rope, cfg, lambda q, k, v: (q, None))[0]
      return x
    return jax.lax.fori_loop(0, n, body, x)

  result["layers_no_attention"] = _ms_per_step(layers, split, x_Bx1xD, steps=n)

  def attention(layout):
    @jit
    def run(caches, q):
      kv_positions = jnp.broadcast_to(jnp.arange(S), (B, S))
      def body(i, q):
        for c in caches:
          q = reference.attention(q, c, c, q_positions=jnp.full((B, 1), S // 2 + i),
                                  kv_positions=kv_positions, kv_layout=layout)
        return q
      return jax.lax.fori_loop(0, n, body, q)
    # One buffer per layer, laid out once outside the timed loop.
    caches = tuple(cache_LxBxSxKxD[l] if layout == "BSKD"
                   else jnp.swapaxes(cache_LxBxSxKxD[l], 1, 2) for l in range(L))
    return lambda: run(caches, q_Bx1xHxD)

  result["attention_BSKD"] = _ms_per_step(attention("BSKD"), steps=n)
  result["attention_BKSD"] = _ms_per_step(attention("BKSD"), steps=n)

  @jit
  def scatters(cache, new_BxKxD):
    def body(i, cache):
      for l in range(L):
        cache = cache.at[l, rows, jnp.full((B,), 16 + i)].set(new_BxKxD + i)
      return cache
    return jax.lax.fori_loop(0, n, body, cache)

  result["cache_scatters"] = _ms_per_step(scatters, cache_LxBxSxKxD,
                                          cache_LxBxSxKxD[0, :, 0], steps=n)
  for name, ms in result.items():
    print(f"{name:<28}{ms:8.2f} ms / step")
  common.write_json(_OUT.value, {"ms_per_step": result, "steps": n, "batch": B,
                                 "cache_slots": slots, "device": str(jax.devices()[0]),
                                 "jax": jax.__version__})
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
