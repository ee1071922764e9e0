r"""Benchmark: rollout decode throughput against two baselines, side by side.

  python -m experiments.bench_rollout --out runs/bench_rollout.json \
      [--model llama_10m] [--batch 32] [--new_tokens 256] [--prompt_len 16] \
      [--no_cache_steps 8] [--cpu_devices N]

One randomly initialised Llama-style model (``--model``: a
``TransformerConfig`` preset, by default ``llama_10m``: 9.83M parameters,
hidden 320, 8 layers, 5 heads (MHA), vocab 1024; or ``llama_10m_gqa``: 10.2M,
6 query heads sharing 2 key/value heads) is created in Hugging Face
transformers, saved as safetensors and imported with
``model.hf.load_hf_checkpoint``, so all three contenders run the same
architecture with the same weights (checked: max |logit difference| on the
prompts). Each samples ``--new_tokens`` tokens per row at temperature 1 with no
stop token, for a batch of ``--batch`` random prompts:

* ``engine``: ``RolloutEngine.rollout`` (one jit: prefill, then
  ``lax.while_loop`` s of KV-cache ``decode_step``, the cache growing to its
  full length in ``cache_segments=4`` steps), no environment, with the rows
  split over every device (``row_sharding``; on CPU ``--cpu_devices`` XLA
  host devices, by default one per core as far as they split the batch);
* ``engine_one_device``: the same on one device;
* ``engine_full_cache``: that with ``cache_segments=1`` (every step
  attends over all ``prompt_len + new_tokens`` slots);
* ``no_cache``: the same model re-running ``forward`` over the whole
  ``[B, prompt_len + new_tokens]`` token buffer for every new token (one
  jitted ``fori_loop``); every step costs the same, so it runs
  ``--no_cache_steps`` steps and reports their rate;
* ``hf_generate``: ``LlamaForCausalLM.generate`` in PyTorch (KV cache,
  ``do_sample``, ``min_new_tokens = max_new_tokens``).

Compilation and a warm-up are excluded. The contenders are timed in
``--repeats`` interleaved rounds and each one's best round is reported, so a
shared machine's changing speed affects all alike. Prints a table and writes
JSON with ``engine_tokens_per_s``, ``engine_one_device_tokens_per_s``,
``engine_full_cache_tokens_per_s``, ``no_cache_tokens_per_s``,
``hf_generate_tokens_per_s``, the speedups, and the model size, batch and
device count measured.
"""

import functools
import os
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec

from agentic_rl import model as model_lib
from agentic_rl import rollout
from experiments import common


def _hf_model(config: model_lib.TransformerConfig, seed: int):
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.manual_seed(seed)
  hf_config = transformers.LlamaConfig(
      vocab_size=config.vocab_size, hidden_size=config.d_model,
      intermediate_size=config.mlp_dim, num_hidden_layers=config.n_layers,
      num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
      head_dim=config.head_dim, rms_norm_eps=config.norm_eps,
      rope_theta=config.rope_theta, tie_word_embeddings=config.tie_embeddings,
      max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
      pad_token_id=0)
  return transformers.LlamaForCausalLM(hf_config).eval()


def logits_max_abs_diff(hf, params, config: model_lib.TransformerConfig,
                        tokens_BxT: np.ndarray) -> float:
  """Max |logit difference| between the torch model ``hf`` and ours
  (``params``, ``config``) on ``tokens_BxT``: whether both hold the same
  weights."""
  import torch  # pylint: disable=import-outside-toplevel
  with torch.inference_mode():
    hf_logits = hf(torch.from_numpy(tokens_BxT).long()).logits.float().numpy()
  ours = np.asarray(model_lib.forward(params, tokens_BxT, config))
  return float(np.max(np.abs(hf_logits - ours)))


def engine_contender(engine: rollout.RolloutEngine, params, prompts_BxL: np.ndarray,
                     lens_B: np.ndarray, key, *, name: str = "engine"):
  """``(run, compile_s)`` for plain generation (no environment, no stop
  ids) of ``prompts_BxL`` by ``engine``: ``run()`` samples the batch and
  waits for it. The first call, compilation included, is timed as
  ``compile_s`` and checked to fill every row to ``engine.max_len``."""
  run = functools.partial(engine.rollout, params, prompts_BxL, lens_B, None, key, 0)
  start = time.perf_counter()
  out = jax.block_until_ready(run())
  compile_s = time.perf_counter() - start
  T = engine.max_len
  if not np.all(np.asarray(out.length_B) == T):
    raise RuntimeError(f"{name} rows hold {np.asarray(out.length_B)} tokens, "
                       f"expected {T}")
  return (lambda: jax.block_until_ready(run().tokens_BxT)), compile_s


def hf_generate_contender(hf, prompts_BxL: np.ndarray, new_tokens: int):
  """``run()``: ``hf.generate`` sampling exactly ``new_tokens`` tokens per
  row of ``prompts_BxL`` (KV cache, ``do_sample``, temperature 1, no top-k
  or top-p, ``min_new_tokens = max_new_tokens``), after one short warm-up
  call."""
  import torch  # pylint: disable=import-outside-toplevel
  input_ids = torch.from_numpy(prompts_BxL).long()
  expected = (prompts_BxL.shape[0], prompts_BxL.shape[1] + new_tokens)
  gen = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

  def hf_generate():
    with torch.inference_mode():
      out = hf.generate(input_ids, **gen)
    if tuple(out.shape) != expected:
      raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {expected}")

  with torch.inference_mode():
    hf.generate(input_ids, **{**gen, "max_new_tokens": 8, "min_new_tokens": 8})
  return hf_generate


def _no_cache_sampler(params, config, sampling, steps):
  """Samples ``steps`` tokens, each by a full forward over the whole buffer."""

  @functools.partial(jax.jit, compiler_options=model_lib.compiler_options())
  def run(tokens_BxT, start, key):
    B = tokens_BxT.shape[0]
    rows = jnp.arange(B)

    def body(i, tokens):
      pos = start + i
      logits = model_lib.forward(params, tokens, config)[rows, pos - 1]
      logp = rollout.sampling_log_probs(logits, sampling)
      keys = jax.random.split(jax.random.fold_in(key, i), B)
      return tokens.at[rows, pos].set(rollout.sample_tokens(keys, logp))

    return jax.lax.fori_loop(0, steps, body, tokens_BxT)

  return run


def main(argv):
  del argv
  B, N, L = _BATCH.value, _NEW.value, _PROMPT.value
  cpu_devices = _CPU_DEVICES.value or max(
      d for d in range(1, (os.cpu_count() or 1) + 1) if B % d == 0)
  # Before anything starts a JAX backend.
  jax.config.update("jax_num_cpu_devices", cpu_devices)
  import torch  # pylint: disable=import-outside-toplevel
  T = L + N
  load_start = os.getloadavg()[0]
  config = getattr(model_lib.TransformerConfig, _MODEL.value)()
  hf = _hf_model(config, _SEED.value)
  with tempfile.TemporaryDirectory() as tmp:
    hf.save_pretrained(tmp, safe_serialization=True)
    config, params = model_lib.hf.load_hf_checkpoint(tmp)
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  rng = np.random.default_rng(_SEED.value)
  prompts = rng.integers(3, config.vocab_size, (B, L)).astype(np.int32)

  # Same weights: compare logits on the prompts.
  logit_diff = logits_max_abs_diff(hf, params, config, prompts)

  sampling = rollout.SamplingConfig(max_new_tokens_per_turn=N, max_turns=1,
                                    max_total_tokens=T)
  # Plain generation: no stop ids, no environment, one prompt per row.
  lens = np.full((B,), L, np.int32)
  key = jax.random.key(_SEED.value)
  contenders, compile_s = {}, {}
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("rows",), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))
  rows = NamedSharding(mesh, PartitionSpec("rows")) if len(devices) > 1 else None
  for name, segments, row_sharding in (("engine", 4, rows),
                                       ("engine_one_device", 4, None),
                                       ("engine_full_cache", 1, None)):
    engine = rollout.RolloutEngine(config, sampling, None, batch_size=B,
                                   cache_segments=segments,
                                   row_sharding=row_sharding)
    contenders[name], compile_s[name] = engine_contender(
        engine, params, prompts, lens, key, name=name)

  steps = min(_NO_CACHE_STEPS.value, N)
  no_cache = _no_cache_sampler(params, config, sampling, steps)
  buf = np.zeros((B, T), np.int32)
  buf[:, :L] = prompts
  jax.block_until_ready(no_cache(buf, L, key))
  contenders["no_cache"] = lambda: jax.block_until_ready(no_cache(buf, L, key))

  contenders["hf_generate"] = hf_generate_contender(hf, prompts, N)

  # Interleaved rounds, so a machine that speeds up or slows down during
  # the run (shared CPUs do) affects every contender alike.
  best = {name: float("inf") for name in contenders}
  for _ in range(_REPEATS.value):
    for name, fn in contenders.items():
      start = time.perf_counter()
      fn()
      best[name] = min(best[name], time.perf_counter() - start)
  engine_s = {k: best[k] for k in ("engine", "engine_one_device", "engine_full_cache")}
  no_cache_s, hf_s = best["no_cache"], best["hf_generate"]

  result = {
      "engine_tokens_per_s": B * N / engine_s["engine"],
      "engine_devices": len(devices),
      "engine_one_device_tokens_per_s": B * N / engine_s["engine_one_device"],
      "engine_full_cache_tokens_per_s": B * N / engine_s["engine_full_cache"],
      "no_cache_tokens_per_s": B * steps / no_cache_s,
      "hf_generate_tokens_per_s": B * N / hf_s,
      "engine_s": engine_s["engine"], "engine_compile_s": compile_s["engine"],
      "engine_one_device_s": engine_s["engine_one_device"],
      "engine_full_cache_s": engine_s["engine_full_cache"],
      "engine_full_cache_compile_s": compile_s["engine_full_cache"],
      "no_cache_s": no_cache_s, "no_cache_steps": steps, "hf_generate_s": hf_s,
      "model_params": num_params, "model": _MODEL.value, "batch": B,
      "new_tokens": N, "prompt_len": L, "repeats": _REPEATS.value,
      "logits_max_abs_diff_vs_hf": logit_diff,
      "backend": jax.default_backend(), "device": str(jax.devices()[0]),
      "jax": jax.__version__, "torch": torch.__version__,
      "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
      "machine": platform.machine(),
      # Other jobs on a shared CPU slow every contender (not equally).
      "load_avg_1m": [load_start, os.getloadavg()[0]],
  }
  result["engine_vs_hf_generate"] = (result["engine_tokens_per_s"]
                                     / result["hf_generate_tokens_per_s"])
  result["engine_vs_no_cache"] = (result["engine_tokens_per_s"]
                                  / result["no_cache_tokens_per_s"])
  print(f"model {num_params / 1e6:.2f}M params, batch {B}, {N} new tokens, "
        f"prompt {L}, {jax.default_backend()} (max |logit diff| vs HF "
        f"{logit_diff:.1e}; load average {load_start:.1f} -> "
        f"{os.getloadavg()[0]:.1f})")
  print(f"{'contender':<18}{'tokens/s':>12}{'x engine':>10}  (engine on "
        f"{len(devices)} device{'s' if len(devices) > 1 else ''})")
  for name in ("engine", "engine_one_device", "engine_full_cache", "no_cache",
               "hf_generate"):
    rate = result[f"{name}_tokens_per_s"]
    print(f"{name:<18}{rate:>12.0f}{result['engine_tokens_per_s'] / rate:>10.2f}")
  common.write_json(_OUT.value, result)
  print(f"wrote {_OUT.value}")


def _define_flags():
  """The command line (defined only when run as a script: the module's
  functions are imported beside other experiments)."""
  global _OUT, _MODEL, _BATCH, _NEW, _PROMPT, _NO_CACHE_STEPS, _REPEATS, _SEED
  global _CPU_DEVICES
  _OUT = flags.DEFINE_string("out", "runs/bench_rollout.json", "JSON output path.")
  _MODEL = flags.DEFINE_enum("model", "llama_10m", ["llama_10m", "llama_10m_gqa"],
                             "The TransformerConfig preset to benchmark.")
  _BATCH = flags.DEFINE_integer("batch", 32, "Rows per batch.")
  _NEW = flags.DEFINE_integer("new_tokens", 256, "Tokens sampled per row.")
  _PROMPT = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per row.")
  _NO_CACHE_STEPS = flags.DEFINE_integer(
      "no_cache_steps", 8, "Tokens timed for the no-cache baseline (each step "
      "costs the same).")
  _REPEATS = flags.DEFINE_integer(
      "repeats", 3, "Timed rounds; each round times every contender once, and "
      "each contender's best round is reported.")
  _SEED = flags.DEFINE_integer("seed", 0, "Seed for weights and prompts.")
  _CPU_DEVICES = flags.DEFINE_integer(
      "cpu_devices", None, "XLA host devices on CPU (one per core lets each "
      "core run its own share of the rows); the engine splits its rows over "
      "all devices. Default: the most, up to one per core, that split --batch.")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
