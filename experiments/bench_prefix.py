r"""Benchmark: group prefix sharing in the rollout engine and in the learner.

  python -m experiments.bench_prefix --out runs/bench_prefix.json \
      [--prompt_len 512] [--new_tokens 64] [--groups 8,16] [--prompts 2] \
      [--d_model 128] [--n_layers 2] [--n_heads 4] [--n_kv_heads 4] \
      [--mlp_dim 512] [--vocab 1024] [--repeats 3] [--warmup 1] [--cpu_devices 1]

RL samples G completions of each prompt. For each G in ``--groups``, a batch
of ``--prompts`` random prompts of ``--prompt_len`` tokens, G rows each
(``B = prompts * G``), on one randomly initialised Llama-style model (by
default bench_learner's: 0.79M parameters, hidden 128, 2 layers, 4 heads
(MHA), SwiGLU 512, vocab 1024, untied), and the contenders:

* rollout (prefill, then ``--new_tokens`` sampled tokens per row at
  temperature 1, no stop token, no environment; one jitted
  ``RolloutEngine.rollout`` call): ``shared``, an engine of group size G
  with ``decode_shared_prefix``: each prompt prefilled once, its G rows
  decoding from one cache of it (read once per group per step);
  ``shared_prefill``, the engine's default: each prompt prefilled once and
  its cache copied to its G rows; ``plain``, an engine of group size 1
  given every prompt G times, which prefills every row. Same key: the same
  tokens (checked: ``shared_prefill`` must match ``plain``; ``shared``'s
  log-probs agree to rounding, which can move a draw at a token boundary,
  so the rows whose tokens differ are counted);
* learner (one PPO update, token-mean, AdamW, on the shared rollout's batch;
  ``learner.shard_train_step``): ``shared``, ``rl_loss(group_size=G)`` with
  the step finding the shared prefix (``--prompt_len`` rounded down to a
  bucket, 512 stays 512) and running it once per group; ``plain``, the
  unshared forward over all ``B x (prompt_len + new_tokens)`` tokens. The
  log-probs and the gradient norm agree to float rounding (checked).

Compilation and ``--warmup`` calls are excluded; then ``--repeats``
interleaved rounds, each timing ``--calls`` calls in a row of every
contender of every G (in reverse order every other round), so a shared
machine's changing speed affects all alike; a round's time is the mean of
its calls, and each contender's best round is reported. Writes JSON with ``rollout_speedup`` and ``learner_speedup``
(plain's best time over shared's, keyed by G as a string),
``rollout_prefill_only_speedup`` (plain over shared_prefill), the raw times
(``rollout_s``, ``learner_s``: per G, per contender, ``min`` and ``median``
seconds), the compile times, the checks (``rollout_tokens_equal`` and
``rollout_rows_differing`` per contender, ``rollout_logp_max_abs_diff`` of
``shared`` on the rows that agree, ``learner_logp_max_abs_diff``,
``learner_grad_norm_rel_diff``, ``prefix_len``) and the config measured.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time

import jax
import numpy as np
from absl import app
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec

from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl import rollout
from agentic_rl.train import learner
from agentic_rl.train import sharding
from experiments import common

CONTENDERS = {"rollout": ("shared", "shared_prefill", "plain"),
              "learner": ("shared", "plain")}

_OUT = flags.DEFINE_string("out", "runs/bench_prefix.json", "JSON output path.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 512, "Prompt tokens per row.")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Tokens sampled per row.")
_GROUPS = flags.DEFINE_list("groups", ["8", "16"], "Group sizes G to measure.")
_PROMPTS = flags.DEFINE_integer("prompts", 2, "Prompts per batch (B = prompts * G).")
_D_MODEL = flags.DEFINE_integer("d_model", 128, "Model width.")
_N_LAYERS = flags.DEFINE_integer("n_layers", 2, "Decoder layers.")
_N_HEADS = flags.DEFINE_integer("n_heads", 4, "Query heads.")
_N_KV_HEADS = flags.DEFINE_integer("n_kv_heads", 4, "Key/value heads.")
_MLP_DIM = flags.DEFINE_integer("mlp_dim", 512, "SwiGLU hidden width.")
_VOCAB = flags.DEFINE_integer("vocab", 1024, "Vocabulary size.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds (each times every contender).")
_CALLS = flags.DEFINE_integer("calls", 3, "Calls in a row per contender and round; the "
                              "round's time is their mean.")
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed calls per contender after compiling.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for weights, prompts and sampling.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 1, "XLA host devices on CPU: the rollout rows and the learner batch are "
    "split over them (each device shares the prefills of the groups it holds).")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """What one run measures (the flags)."""

  prompt_len: int = 512
  new_tokens: int = 64
  groups: tuple[int, ...] = (8, 16)
  prompts: int = 2
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 4
  mlp_dim: int = 512
  vocab: int = 1024
  repeats: int = 3
  calls: int = 3
  warmup: int = 1
  seed: int = 0

  def model_config(self) -> model_lib.TransformerConfig:
    """``d_model // n_heads`` per head, untied, RoPE base 1e6."""
    return model_lib.TransformerConfig(
        vocab_size=self.vocab, d_model=self.d_model, n_layers=self.n_layers,
        n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
        head_dim=self.d_model // self.n_heads, mlp_dim=self.mlp_dim, rope_theta=1e6)


def rollouts(cfg: BenchConfig, config, params, G: int, row_sharding):
  """``({contender: run}, compile_s, shared_prefill's rollout, checks)``."""
  P, L, N = cfg.prompts, cfg.prompt_len, cfg.new_tokens
  rng = np.random.default_rng(cfg.seed + G)
  prompts_PxL = rng.integers(1, config.vocab_size, (P, L)).astype(np.int32)
  sampling = rollout.SamplingConfig(max_new_tokens_per_turn=N, max_turns=1,
                                    max_total_tokens=L + N)
  key = jax.random.key(cfg.seed)
  rep = lambda x: np.repeat(x, G, axis=0)  # noqa: E731
  inputs = {"shared": (G, prompts_PxL, True), "shared_prefill": (G, prompts_PxL, False),
            "plain": (1, rep(prompts_PxL), False)}
  runs, compile_s, outs = {}, {}, {}
  for name, (group_size, prompts, shared_decode) in inputs.items():
    engine = rollout.RolloutEngine(config, sampling, None, batch_size=P * G,
                                   group_size=group_size, row_sharding=row_sharding,
                                   decode_shared_prefix=shared_decode)
    lens = np.full((len(prompts),), L, np.int32)

    def run(engine=engine, prompts=prompts, lens=lens):
      return jax.block_until_ready(engine.rollout(params, prompts, lens, None, key, 0))

    start = time.perf_counter()
    outs[name] = run()
    compile_s[name] = time.perf_counter() - start
    if not np.all(np.asarray(outs[name].length_B) == L + N):
      raise RuntimeError(f"{name} rows hold {np.asarray(outs[name].length_B)} tokens, "
                         f"expected {L + N}")
    runs[name] = run
  plain_tokens = np.asarray(outs["plain"].tokens_BxT)
  checks = {"tokens_equal": {}, "rows_differing": {}}
  for name in ("shared", "shared_prefill"):
    same_B = np.all(np.asarray(outs[name].tokens_BxT) == plain_tokens, axis=1)
    checks["tokens_equal"][name] = bool(same_B.all())
    checks["rows_differing"][name] = int((~same_B).sum())
  same_B = np.all(np.asarray(outs["shared"].tokens_BxT) == plain_tokens, axis=1)
  diff = np.abs(np.asarray(outs["shared"].behaviour_logp_BxT)
                - np.asarray(outs["plain"].behaviour_logp_BxT))[same_B]
  checks["logp_max_abs_diff"] = float(diff.max()) if diff.size else None
  return runs, compile_s, outs["shared_prefill"], checks


def learner_steps(cfg: BenchConfig, config, params, G: int, ro, mesh):
  """``({contender: run}, compile_s, checks, prefix_len)``: the checks compare
  the first update's log-probs and gradient norm."""
  B = ro.tokens_BxT.shape[0]
  rng = np.random.default_rng(cfg.seed)
  batch = {"tokens_BxT": np.asarray(ro.tokens_BxT),
           "loss_mask_BxT": np.asarray(ro.loss_mask_BxT),
           "behaviour_logp_BxT": np.asarray(ro.behaviour_logp_BxT),
           "advantages": rng.standard_normal(B).astype(np.float32)}
  batch = sharding.shard_batch(batch, mesh)
  optimizer = objectives.make_optimizer(objectives.OptimizerConfig())
  objective = objectives.ObjectiveConfig(loss="ppo")
  runs, compile_s, first = {}, {}, {}
  for name, group_size in (("shared", G), ("plain", 1)):
    step, state_sh = learner.shard_train_step(
        learner.make_train_step(learner.rl_loss(config, objective, group_size=group_size),
                                optimizer),
        mesh, config, optimizer, params, group_size=group_size)
    box = [jax.device_put(learner.init_train_state(params, optimizer), state_sh)]

    def run(step=step, box=box):
      out = step(box[0], batch)
      box[0] = out[0]
      return jax.block_until_ready(out)

    start = time.perf_counter()
    _, metrics, outputs = run()
    compile_s[name] = time.perf_counter() - start
    first[name] = (float(metrics["learner/grad_norm"]), np.asarray(outputs["logp_BxT"]))
    runs[name] = run
  (norm_s, logp_s), (norm_p, logp_p) = first["shared"], first["plain"]
  checks = {"logp_max_abs_diff": float(np.max(np.abs(logp_s - logp_p))),
            "grad_norm_rel_diff": abs(norm_s - norm_p) / max(abs(norm_p), 1e-30)}
  return runs, compile_s, checks, learner.shared_prefix_len(batch["tokens_BxT"], G)


def _stats(times_s) -> dict[str, float]:
  return {"min": min(times_s), "median": float(np.median(times_s))}


def run(cfg: BenchConfig) -> dict:
  """Times every contender for every G; returns the JSON record."""
  load_start = os.getloadavg()[0]
  config = cfg.model_config().validate()
  params = jax.tree.map(np.asarray, model_lib.init_params(config, jax.random.key(cfg.seed)))
  num_params = sum(x.size for x in jax.tree.leaves(params))
  devices = jax.devices()
  mesh = sharding.make_mesh(sharding.MeshConfig(data=-1))
  row_mesh = jax.make_mesh((len(devices),), ("rows",), devices=devices,
                           axis_types=(jax.sharding.AxisType.Auto,))
  row_sharding = NamedSharding(row_mesh, PartitionSpec("rows")) if len(devices) > 1 else None
  contenders, result = {}, {}
  for G in cfg.groups:
    g = str(G)
    runs, compile_s, ro, checks = rollouts(cfg, config, params, G, row_sharding)
    contenders.update({("rollout", g, k): v for k, v in runs.items()})
    result.setdefault("rollout_compile_s", {})[g] = compile_s
    for k, v in checks.items():
      result.setdefault(f"rollout_{k}", {})[g] = v
    runs, compile_s, checks, prefix_len = learner_steps(cfg, config, params, G, ro, mesh)
    contenders.update({("learner", g, k): v for k, v in runs.items()})
    result.setdefault("learner_compile_s", {})[g] = compile_s
    for k, v in checks.items():
      result.setdefault(f"learner_{k}", {})[g] = v
    result.setdefault("prefix_len", {})[g] = prefix_len
  times = common.time_interleaved(contenders, warmup=cfg.warmup, repeats=cfg.repeats,
                                  calls=cfg.calls)
  for part, names in CONTENDERS.items():
    result[f"{part}_s"] = {str(G): {k: _stats(times[part, str(G), k]) for k in names}
                           for G in cfg.groups}
    result[f"{part}_speedup"] = {
        g: t["plain"]["min"] / t["shared"]["min"] for g, t in result[f"{part}_s"].items()}
  result["rollout_prefill_only_speedup"] = {
      g: t["plain"]["min"] / t["shared_prefill"]["min"] for g, t in result["rollout_s"].items()}
  result.update(
      model_params=int(num_params), config=dataclasses.asdict(cfg) | {
          "head_dim": config.head_dim, "batch_rows": {str(G): cfg.prompts * G
                                                      for G in cfg.groups}},
      devices=len(devices), backend=jax.default_backend(), device=str(devices[0]),
      jax=jax.__version__, python=platform.python_version(), cpu_count=os.cpu_count(),
      machine=platform.machine(),
      # Other jobs on a shared CPU slow every contender (not equally).
      load_avg_1m=[load_start, os.getloadavg()[0]])
  return result


def print_table(result: dict) -> None:
  c = result["config"]
  print(f"{result['model_params'] / 1e6:.2f}M params, {c['prompts']} prompts of "
        f"{c['prompt_len']} tokens, {c['new_tokens']} new tokens, {result['devices']} "
        f"{result['backend']} device(s) (load average {result['load_avg_1m'][0]:.1f} -> "
        f"{result['load_avg_1m'][1]:.1f})")
  print(f"{'G':>4}{'contender':>24}{'best s (median)':>20}{'plain / it':>12}")
  for g in result["rollout_s"]:
    for part, names in CONTENDERS.items():
      times = result[f"{part}_s"][g]
      for name in names:
        t = times[name]
        print(f"{g:>4}{part + ' ' + name:>24}{t['min']:>12.3f} ({t['median']:.3f})"
              f"{times['plain']['min'] / t['min']:>11.2f}x")


def main(argv):
  del argv
  # Before anything starts a JAX backend.
  jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  cfg = BenchConfig(
      prompt_len=_PROMPT_LEN.value, new_tokens=_NEW.value,
      groups=tuple(int(g) for g in _GROUPS.value), prompts=_PROMPTS.value,
      d_model=_D_MODEL.value, n_layers=_N_LAYERS.value, n_heads=_N_HEADS.value,
      n_kv_heads=_N_KV_HEADS.value, mlp_dim=_MLP_DIM.value, vocab=_VOCAB.value,
      repeats=_REPEATS.value, calls=_CALLS.value, warmup=_WARMUP.value, seed=_SEED.value)
  result = run(cfg)
  result["argv"] = sys.argv[1:]
  print_table(result)
  common.write_json(_OUT.value, result)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
