r"""Where a KV-cache decode step spends its time, part by part, side by side.

  python -m experiments.bench_decode_parts --out FILE [--steps 64]

On ``TransformerConfig.llama_10m`` shapes (batch 32, a 272-slot cache, 8
layers, 5 heads of 64), each part runs ``--steps`` times in a jitted
``fori_loop``; the best of 3 runs is reported in ms per decode step:

* ``layers_no_attention``: the 8 decoder layers with attention replaced by
  the identity (projections, MLP, norms);
* ``attention_BSKD`` / ``attention_BKSD``: 8 single-token cache attentions
  (``kernels.reference.attention``) over a ``[B, S, K, D]`` cache and over a
  head-major ``[B, K, S, D]`` one (the model's layout);
* ``cache_scatters``: 8 per-row writes of one token's keys into the cache.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from absl import app, flags

from agentic_rl import model as model_lib
from agentic_rl.kernels import reference
from agentic_rl.model import transformer
from experiments import common

_OUT = flags.DEFINE_string("out", "runs/bench_decode_parts.json", "JSON output path.")
_STEPS = flags.DEFINE_integer("steps", 64, "Decode steps per timed run.")

B, S = 32, 272


def _ms_per_step(fn, *args, steps: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1000 * min(times) / steps


def main(argv):
  del argv
  n = _STEPS.value
  cfg = model_lib.TransformerConfig.llama_10m()
  params = model_lib.init_params(cfg, jax.random.key(0))
  L, K, D = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
  x_Bx1xD = jax.random.normal(jax.random.key(1), (B, 1, cfg.d_model))
  q_Bx1xHxD = jax.random.normal(jax.random.key(2), (B, 1, cfg.n_heads, D))
  cache_LxBxSxKxD = jax.random.normal(jax.random.key(3), (L, B, S, K, D))
  rows = jnp.arange(B)

  @jax.jit
  def layers(params, x):
    def layer(x, p):
      return transformer.decoder_layer(x, p, jnp.zeros((B, 1), jnp.int32), cfg,
                                       lambda q, k, v: (q, None))[0], None
    return jax.lax.fori_loop(0, n, lambda i, x: jax.lax.scan(layer, x, params["layers"])[0], x)

  def attention(layout):
    @jax.jit
    def run(cache, q):
      kv_positions = jnp.broadcast_to(jnp.arange(S), (B, S))
      def body(i, q):
        for l in range(L):
          q = reference.attention(q, cache[l], cache[l], q_positions=jnp.full((B, 1), 100 + i),
                                  kv_positions=kv_positions, kv_layout=layout)
        return q
      return jax.lax.fori_loop(0, n, body, q)
    # The head-major cache is laid out once, outside the timed loop.
    cache = cache_LxBxSxKxD if layout == "BSKD" else jnp.swapaxes(cache_LxBxSxKxD, 2, 3)
    return lambda: run(cache, q_Bx1xHxD)

  @jax.jit
  def scatters(cache, new_BxKxD):
    def body(i, cache):
      for l in range(L):
        cache = cache.at[l, rows, jnp.full((B,), 16 + i)].set(new_BxKxD + i)
      return cache
    return jax.lax.fori_loop(0, n, body, cache)

  result = {
      "layers_no_attention": _ms_per_step(layers, params, x_Bx1xD, steps=n),
      "attention_BSKD": _ms_per_step(attention("BSKD"), steps=n),
      "attention_BKSD": _ms_per_step(attention("BKSD"), steps=n),
      "cache_scatters": _ms_per_step(scatters, cache_LxBxSxKxD, cache_LxBxSxKxD[0, :, 0], steps=n),
  }
  for name, ms in result.items():
    print(f"{name:<22}{ms:8.2f} ms / step")
  common.write_json(_OUT.value, {"ms_per_step": result, "steps": n, "batch": B, "cache_slots": S,
                                 "device": str(jax.devices()[0]), "jax": jax.__version__})
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
