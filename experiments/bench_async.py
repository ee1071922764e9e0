r"""Benchmark: the synchronous against the asynchronous actor on a slow,
heavy-tailed Python environment, side by side.

  python -m experiments.bench_async --out runs/bench_async.json \
      [--iterations 8] [--staleness 1,2,4] [--median_ms 20] [--sft_steps 30] \
      [--actor_rows 64]

The environment (:class:`LatencyGuess`) is the built-in guessing game whose
every ``reset`` and ``step`` sleeps for a lognormal time (median
``--median_ms``, sigma 1.29: the 99th percentile is 20 times the median);
its episodes take 1 to 5 guesses. Each run trains the tiny config from the
same seed: a short SFT warm start on the game's demonstrations (so the
policy acts), then ``--iterations`` RL iterations with ``rl.actor=sync``
and with ``rl.actor=async`` at each ``--staleness``, in one process. A
batch is 8 groups of 4 (32 episodes) in every run; the synchronous actor
plays one batch at a time, the asynchronous one keeps ``--actor_rows``
episodes in flight (continuous batching: a row takes the next episode as
soon as its own ends).

Per run, over the RL iterations between the first (compilation) and the
last (the final evaluation): learner-consumed tokens per second (the
batches' valid tokens over the iterations' wall time), the learner's idle
fraction (waiting for rollouts: the whole rollout time when synchronous),
the actor's idle fraction (waiting for weights), the staleness of the
consumed tokens (mean and max) and the behaviour/learner KL. ``speedup`` holds asynchronous over synchronous
learner-consumed tokens per second, keyed by staleness ("1", "2", "4").
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time

import numpy as np
from absl import app
from absl import flags

from agentic_rl.envs import text_games
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from experiments.configs import default

_OUT = flags.DEFINE_string("out", "runs/bench_async.json", "Where to write the JSON.")
_ITERATIONS = flags.DEFINE_integer("iterations", 8, "RL iterations per run.")
_STALENESS = flags.DEFINE_list("staleness", ["1", "2", "4"], "max_staleness of the async runs.")
_MEDIAN_MS = flags.DEFINE_float("median_ms", 20.0, "Median latency of an environment call.")
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 30, "SFT warm-start steps.")
_ACTOR_ROWS = flags.DEFINE_integer(
    "actor_rows", 64, "Episodes the asynchronous actor keeps in flight (rl.actor_rows; a "
    "batch is 32; the synchronous actor plays one batch at a time).")

SIGMA = 1.288  # exp(2.326 * sigma) = 20: p99 / median of a lognormal


class LatencyGuess(text_games.GuessNumber):
  """:class:`~agentic_rl.envs.text_games.GuessNumber` whose calls sleep a
  lognormal time (``median_s``, sigma :data:`SIGMA`), drawn from the seed."""

  def __init__(self, median_s: float = 0.02, **kwargs):
    super().__init__(**kwargs)
    self.median_s = median_s
    self.rng = np.random.default_rng(0)

  def _sleep(self):
    time.sleep(self.median_s * float(np.exp(SIGMA * self.rng.standard_normal())))

  def reset(self, seed):
    self.rng = np.random.default_rng(seed)
    self._sleep()
    return super().reset(seed)

  def step(self, action):
    self._sleep()
    return super().step(action)


def config(actor: str, staleness: int, iterations: int, median_ms: float, sft_steps: int,
           actor_rows: int = 0):
  cfg = default.get_config("tiny")
  cfg.tasks.update(source="host", host_env=f"{__name__}:LatencyGuess",
                   host_kwargs=json.dumps({"median_s": median_ms / 1000}),
                   env_workers=max(32, actor_rows))
  cfg.sft.update(steps=sft_steps, num_demos=128, batch_size=16, demo_noise=0.0)
  cfg.rl.update(iterations=iterations, prompts_per_step=8, group_size=4, actor=actor,
                max_staleness=staleness, actor_rows=actor_rows)
  cfg.rl.signal.allocation = "uniform"
  cfg.eval.update(every=10_000, num_prompts=8, pass_k_prompts=4)
  cfg.checkpoint.every = 10_000
  return cfg


def summarise(records: list[dict], rows: int) -> dict[str, float]:
  """The RL iterations after the first (compilation) and before the last
  (the final evaluation): throughput, idle fractions, lag."""
  rl = [r for r in records if "reward/outcome" in r and "eval/success" not in r][1:]
  wall = sum(r["perf/step_s"] for r in rl)
  tokens = sum(r["episode/length"] * rows for r in rl)
  rollout_s = sum(r["signal/rollouts"] * r["episode/length"] / r["perf/rollout_tokens_per_s"]
                  for r in rl if r["perf/rollout_tokens_per_s"] > 0)
  waits = [r.get("perf/learner_wait_s") for r in rl]
  learner_idle = (sum(waits) if None not in waits else rollout_s) / max(wall, 1e-9)
  return {
      "learner_tokens_per_s": tokens / max(wall, 1e-9),
      "learner_idle_frac": min(learner_idle, 1.0),
      "actor_idle_frac": float(np.mean([r.get("perf/actor_idle_frac", 0.0) for r in rl])),
      "staleness_mean": float(np.mean([r["shift/staleness_mean"] for r in rl])),
      "staleness_max": float(max(r["shift/staleness_max"] for r in rl)),
      "kl_behaviour_learner": float(np.mean([r["shift/kl_behaviour_learner"] for r in rl])),
      "iterations_timed": len(rl),
      "wall_s": wall,
  }


def run_one(cfg) -> dict[str, float]:
  with tempfile.TemporaryDirectory() as workdir:
    loop.train(cfg, workdir)
    records = metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  return summarise(records, cfg.rl.prompts_per_step * cfg.rl.group_size)


def main(argv):
  del argv
  args = (_ITERATIONS.value, _MEDIAN_MS.value, _SFT_STEPS.value)
  runs = {"sync": run_one(config("sync", 0, *args))}
  for s in _STALENESS.value:
    runs[f"async_{s}"] = run_one(config("async", int(s), *args, actor_rows=_ACTOR_ROWS.value))
  base = runs["sync"]["learner_tokens_per_s"]
  result = {
      "runs": runs,
      "speedup": {s: runs[f"async_{s}"]["learner_tokens_per_s"] / base for s in _STALENESS.value},
      "config": {"iterations": _ITERATIONS.value, "median_ms": _MEDIAN_MS.value,
                 "sigma": SIGMA, "sft_steps": _SFT_STEPS.value, "rows": 32,
                 "actor_rows": _ACTOR_ROWS.value},
      "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
  }
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  metrics_lib.atomic_write(_OUT.value, json.dumps(result, indent=1))
  for name, r in runs.items():
    print(f"{name:>8}: {r['learner_tokens_per_s']:8.1f} tok/s  learner idle "
          f"{r['learner_idle_frac']:.2f}  actor idle {r['actor_idle_frac']:.2f}  staleness "
          f"{r['staleness_mean']:.2f} (max {r['staleness_max']:.0f})  KL "
          f"{r['kl_behaviour_learner']:.2e}")
  print("speedup:", {k: round(v, 2) for k, v in result["speedup"].items()})


if __name__ == "__main__":
  app.run(main)
