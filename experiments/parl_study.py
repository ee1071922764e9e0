r"""PARL: does an orchestrator learn to delegate when critical steps count?

  python -m experiments.parl_study --jobs=2           # docs/parl/results.{md,json}
  python -m experiments.parl_study --tiny --out=/tmp/ps   # seconds per run

The task is ``parallel_hops`` with three independent two-hop questions:
done alone it takes 6 lookups and an answer (7 critical steps); spawning
one frozen sub-agent per question takes 1 + 3 + 1 = 5 critical steps but
11 steps in total. The sub-agent is one run trained on ``multihop`` (SFT
then RL), shared by every seed. Each orchestrator is warm-started on
demonstrations a quarter of which spawn (the same warm start for both arms
of a seed), then trained with RL under one of two charges:

- ``critical``: the efficiency reward (weight 0.5, calls only, gated on
  success) counts critical steps, and an episode is truncated when they
  reach 6 (Kimi K2.5's latency budget: alone, the task does not fit);
- ``total``: it counts total steps, every sub-agent step too; no budget.

The budget constrains the policy's episodes (RL and evaluation), not the
scripted demonstrations.

Each run is ``python -m experiments.train`` in its own process under
``--workdir``; a run with a ``summary.json`` is not run again. The table
gives held-out greedy success, spawns, critical and total steps per
episode after the warm start and after RL (mean ± std over seeds).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections.abc import Sequence

import numpy as np

from agentic_rl.train import metrics as metrics_lib
from experiments import common

ARMS = {"critical": {"parl.charge": "critical", "parl.max_critical_steps": 6},
        "total": {"parl.charge": "total"}}
SUB_AGENT = {"tasks.families": ("multihop",), "tasks.weights": (1.0,), "rl.iterations": 20}
ORCHESTRATOR = {
    "tasks.source": "host", "tasks.host_env": "parallel_hops",
    "tasks.host_kwargs": json.dumps({"questions": 3, "level": 1, "spawn_demos": 0.25,
                                     "agent": "hop"}),
    "tasks.max_obs_tokens": 24, "sft.demo_noise": 0.0, "sampling.max_turns": 8,
    "sampling.max_new_tokens_per_turn": 24, "sampling.max_total_tokens": 224,
    "tasks.rewards.efficiency": 0.5, "tasks.rewards.efficiency_weights.calls": 1.0,
    "tasks.rewards.efficiency_weights.tokens": 0.0, "sft.steps": 300, "sft.num_demos": 512,
    "rl.iterations": 20, "eval.num_prompts": 64, "eval.batch_rows": 64}
SCALE = {"eval.every": 1000, "checkpoint.every": 1000, "export.deploy_check": "off"}
TINY_SCALE = {"sft.steps": 4, "rl.iterations": 2, "eval.every": 1000,
              "checkpoint.every": 1000, "sampling.max_total_tokens": 160}
KEYS = ("eval/success", "eval/parl/spawns", "eval/parl/critical_steps",
        "eval/parl/total_steps")


def _train(workdir: str, overrides: dict, tiny: bool, log: str) -> None:
  base = {} if tiny else common.STUDY_BASE  # the settings the study was measured with
  common.train_once(workdir, "tiny" if tiny else "",
                    {**base, **overrides, **(TINY_SCALE if tiny else SCALE)}, log)


def run(root: str, seeds: Sequence[int], *, jobs: int, tiny: bool) -> None:
  """The sub-agent, then every (arm, seed) orchestrator."""
  sub = os.path.join(root, "sub_agent")
  _train(sub, SUB_AGENT, tiny, os.path.join(root, "sub_agent.log"))
  agents = json.dumps({"hop": sub})
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    futures = [pool.submit(_train, os.path.join(root, f"seed{s}", arm),
                           {**ORCHESTRATOR, **extra, "parl.agents": agents, "seed": s}, tiny,
                           os.path.join(root, f"{arm}_seed{s}.log"))
               for s in seeds for arm, extra in ARMS.items()]
    for future in futures:
      future.result()


def measures(workdir: str) -> dict:
  """The held-out measures after the warm start and after RL, the training
  curve of spawns and critical steps, and the run's wall time."""
  records = metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  evals = [r for r in records if "eval/success" in r]
  curve = [r for r in records if "parl/spawns" in r]
  return {"sft": {k: evals[0][k] for k in KEYS}, "rl": {k: evals[-1][k] for k in KEYS},
          "curve": {k: [r[k] for r in curve] for k in ("parl/spawns", "parl/critical_steps",
                                                       "reward/outcome")},
          "wall_s": float(metrics_lib.read_summary(workdir).get("wall_s", 0.0))}


def collect(root: str, seeds: Sequence[int]) -> dict:
  return {arm: {str(s): measures(os.path.join(root, f"seed{s}", arm)) for s in seeds}
          for arm in ARMS}


def table(results: dict) -> str:
  cell = lambda v, fmt: f"{fmt.format(np.mean(v))} ± {fmt.format(np.std(v))}"  # noqa: E731
  head = ["charge", "after", "success", "spawns", "critical steps", "total steps"]
  lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * 4]
  for arm, by_seed in results.items():
    for when in ("sft", "rl"):
      rows = [r[when] for r in by_seed.values()]
      lines.append("| " + " | ".join([arm, "warm start" if when == "sft" else "RL"] + [
          cell([r[k] for r in rows], "{:.1%}" if k == "eval/success" else "{:.2f}")
          for k in KEYS]) + " |")
  return "\n".join(lines)


def write(results: dict, out: str, cmd: str) -> None:
  common.write_json(os.path.join(out, "results.json"), results, indent=1, sort_keys=True)
  minutes = sum(r["wall_s"] for seeds in results.values() for r in seeds.values()) / 60
  seeds = ", ".join(next(iter(results.values())))
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(f"# PARL: critical steps\n\nCommand: `{cmd}` ({minutes:.0f} min of orchestrator "
            f"runs, {time.strftime('%Y-%m-%d')}). Held-out greedy episodes of `parallel_hops` "
            f"(3 questions, 2 hops), mean ± standard deviation over seeds {seeds}; spawns, "
            "critical and total steps per episode.\n\n"
            f"{table(results)}\n")


if __name__ == "__main__":
  common.run_study("parl_study", out="docs/parl", workdir="/tmp/agentic_rl_parl", run=run,
                   collect=collect, write=write)
