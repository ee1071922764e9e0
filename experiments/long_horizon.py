r"""Long-horizon studies over several seeds; writes a table per study.

  python -m experiments.long_horizon                          # docs/long_horizon/
  python -m experiments.long_horizon --studies=toggle --seeds=0 --jobs=2
  python -m experiments.long_horizon --tiny --out=/tmp/lh      # seconds per arm

Studies (each arm is ``python -m experiments.train`` in its own process,
``--jobs`` at a time, under ``--workdir/<study>/seed<S>/<arm>``; a finished
run, one with a ``summary.json``, is not run again):

- ``context``: the ledger family (``default.py:ledger``, 2 to 10 entries,
  a 224-token context) without context management and with each policy of
  :mod:`agentic_rl.rollout.context`. Each arm's SFT stage plays the
  demonstrations under its own policy; without one only the short ledgers'
  demonstrations fit.
- ``toggle``: the number-guessing game with half of its demonstrations
  verbose (each guess states the interval first), RL on the outcome (no
  efficiency reward) without and with Toggle
  (``rl.toggle.phase_iterations=5``): tokens per success and success.

Outputs in ``--out``: ``results.json`` (per seed and arm) and
``results.md`` (mean +- std over seeds, with the command and wall time).
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time
from collections.abc import Sequence

import numpy as np
from absl import app, flags

from agentic_rl.train import metrics as metrics_lib
from experiments import common

# The scale of every run, small enough for 18 runs on a 2-core CPU: a
# shorter warm start and RL stage than the default run's (uniform
# allocation: the same rollouts every iteration), evaluated once at the end
# of each stage on 64 held-out prompts.
SCALE = {"sft.steps": 200, "sft.num_demos": 1024, "rl.iterations": 8,
         "rl.prompts_per_step": 8, "rl.signal.allocation": "uniform", "eval.every": 8,
         "eval.num_prompts": 64, "eval.pass_k_prompts": 8, "checkpoint.every": 8,
         "export.deploy_check": "off"}
TINY_SCALE = {"sft.steps": 6, "rl.iterations": 2, "eval.every": 2, "checkpoint.every": 2}
STUDIES: dict[str, dict] = {
    "context": {
        "variant": "ledger",
        "arms": {policy: {"context.policy": policy}
                 for policy in ("none", "drop_tool_results", "summary", "discard_all")}},
    "toggle": {
        "variant": "",
        # Outcome and format rewards only: the efficiency reward is a length
        # penalty of its own, which would leave the baseline none to lack.
        "base": {"tasks.source": "host", "tasks.host_env": "guess_number",
                 "tasks.rewards.efficiency": 0.0, "sft.demo_noise": 0.0,
                 "tasks.host_kwargs": '{"verbose": 0.5}', "sampling.max_total_tokens": 224,
                 "rl.iterations": 20, "eval.every": 20, "checkpoint.every": 20},
        "arms": {"baseline": {}, "toggle": {"rl.toggle.phase_iterations": 5}}},
}
# name -> (metric, how, iterations): the numbers per run the tables report
# (over the RL stage's last `iterations` records; 1000: all of them).
SUMMARIES = {
    "resets": ("episode/context_resets", "mean", 1000),
    "peak_context": ("episode/peak_context_tokens", "mean", 1000),
    "train_success": ("reward/outcome", "mean", 5),
    "tokens_per_success": ("reward/tokens_per_success", "mean", 10),
}
COLUMNS = {"context": ("sft_success", "rl_success", "train_success", "resets", "peak_context"),
           "toggle": ("rl_success", "train_success", "tokens_per_success")}
HEADERS = {"sft_success": "held-out success after SFT", "rl_success": "after RL",
           "train_success": "training success, last 5 iterations",
           "resets": "context rewrites / episode", "peak_context": "peak context tokens",
           "tokens_per_success": "policy tokens / success, last 10 iterations"}


def arm_config(study: str, arm: str, seed: int, tiny: bool) -> tuple[str, dict]:
  """``(variant, overrides)``: the ``default.py`` variant and the dotted
  config keys of one run."""
  spec = STUDIES[study]
  variant = ",".join(v for v in (spec["variant"], "tiny" if tiny else "") if v)
  return variant, {**(TINY_SCALE if tiny else SCALE), **spec.get("base", {}),
                   **spec["arms"][arm], "seed": seed}


def command(study: str, arm: str, seed: int, workdir: str, tiny: bool) -> list[str]:
  return common.train_command(workdir, *arm_config(study, arm, seed, tiny))


def _train(study: str, arm: str, seed: int, root: str, tiny: bool) -> None:
  common.train_once(os.path.join(root, study, f"seed{seed}", arm),
                    *arm_config(study, arm, seed, tiny),
                    os.path.join(root, f"{study}_{arm}_seed{seed}.log"))


def run(root: str, studies: Sequence[str], seeds: Sequence[int], *, jobs: int, tiny: bool):
  runs = [(s, a, seed) for s in studies for seed in seeds for a in STUDIES[s]["arms"]]
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    for future in [pool.submit(_train, *r, root, tiny) for r in runs]:
      future.result()


def summarise(workdir: str) -> dict[str, float]:
  """One run's numbers (:data:`SUMMARIES`, the held-out successes, wall time)."""
  summary = metrics_lib.read_summary(workdir)
  records = [r for r in metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl"))
             if "reward/outcome" in r]
  out = {k: float(summary[k]) for k in ("sft_success", "rl_success", "wall_s") if k in summary}
  for name, (metric, how, last) in SUMMARIES.items():
    values = [r[metric] for r in records[-last:] if metric in r]
    if values:
      out[name] = float(np.mean(values) if how == "mean" else values[-1])
  return out


def collect(root: str, studies: Sequence[str], seeds: Sequence[int]) -> dict:
  return {study: {arm: {str(seed): summarise(os.path.join(root, study, f"seed{seed}", arm))
                        for seed in seeds}
                  for arm in STUDIES[study]["arms"]}
          for study in studies}


def table(results: dict, study: str) -> str:
  columns = COLUMNS[study]
  lines = ["| arm | " + " | ".join(HEADERS[c] for c in columns) + " |",
           "|---|" + "---|" * len(columns)]
  for arm, per_seed in results[study].items():
    cells = []
    for c in columns:
      values = [r[c] for r in per_seed.values() if c in r]
      fmt = "{:.1%}" if c in ("sft_success", "rl_success", "train_success") else "{:.1f}"
      cells.append(f"{fmt.format(np.mean(values))} ± {fmt.format(np.std(values))}"
                   if values else "n/a")
    lines.append(f"| {arm} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write(results: dict, out: str, cmd: str) -> None:
  os.makedirs(out, exist_ok=True)
  common.write_json(os.path.join(out, "results.json"), results, indent=1, sort_keys=True)
  # Summed over the runs (finished runs are cached, so not this call's wall time).
  minutes = sum(r.get("wall_s", 0.0) for arms in results.values() for seeds in arms.values()
                for r in seeds.values()) / 60
  parts = [f"# Long-horizon studies\n\nCommand: `{cmd}` ({minutes:.0f} min of runs, "
           f"{time.strftime('%Y-%m-%d')}). Mean ± standard deviation over seeds "
           f"{', '.join(next(iter(next(iter(results.values())).values())))}.\n"]
  for study in results:
    parts.append(f"## {study}\n\n{table(results, study)}\n")
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write("\n".join(parts))


def main(argv):
  del argv
  studies = _STUDIES.value
  seeds = [int(s) for s in _SEEDS.value]
  run(_WORKDIR.value, studies, seeds, jobs=_JOBS.value, tiny=_TINY.value)
  results = collect(_WORKDIR.value, studies, seeds)
  write(results, _OUT.value, "python -m experiments.long_horizon " + " ".join(sys.argv[1:]))
  print(open(os.path.join(_OUT.value, "results.md")).read())


def _define_flags():
  """The command line (defined only when run as a script, so importing the
  module beside other experiments defines no flags)."""
  global _OUT, _WORKDIR, _SEEDS, _JOBS, _TINY, _STUDIES
  _OUT = flags.DEFINE_string("out", "docs/long_horizon", "Where the results go.")
  _WORKDIR = flags.DEFINE_string("workdir", "/tmp/agentic_rl_long_horizon", "Run directories.")
  _SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
  _JOBS = flags.DEFINE_integer("jobs", 2, "Runs at a time.")
  _TINY = flags.DEFINE_bool("tiny", False, "Test scale (tiny model, a few steps).")
  _STUDIES = flags.DEFINE_list("studies", ["context", "toggle"], "Studies to run.")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
