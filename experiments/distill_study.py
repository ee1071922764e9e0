r"""Cross-stage distillation: does one student keep what each expert learnt?

  python -m experiments.distill_study --jobs=2          # docs/distill/results.{md,json}
  python -m experiments.distill_study --tiny --out=/tmp/ds   # seconds per run

For each seed, every run warm-started by the same SFT stage on all task
families of the default config (``tasks.families``):

- ``expert_<family>``: RL on that family only (``rl.families``);
- ``sequential``: one policy, RL family after family (the ``stagewise``
  variant: ``rl_<family>`` stages in order), no distillation;
- ``student``: the ``distill`` stage, on-policy reverse KL to the expert of
  each prompt's family (``distill.teachers.<family>``), trained after the
  experts.

Each run is ``python -m experiments.train`` in its own process under
``--workdir/seed<S>/<run>`` (a run with a ``summary.json`` is not run
again). The table gives held-out greedy success per family and, for the
sequential policy and the student, its share of the family's expert's
(retention; the goal is at least 90% for the student).
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
from experiments.configs import default

FAMILIES = tuple(default.get_config().tasks.families)
# Every run's scale: the default run's as the study was measured
# (common.STUDY_BASE: 400 SFT steps; then 40 RL iterations per RL stage or 40
# distill iterations), evaluated once at the end of each stage on the
# default 128 held-out prompts.
SCALE = {**common.STUDY_BASE, "eval.every": 1000, "checkpoint.every": 1000,
         "export.deploy_check": "off"}
TINY_SCALE = {"sft.steps": 4, "rl.iterations": 2, "distill.iterations": 2,
              "eval.every": 1000, "checkpoint.every": 1000}
EXPERTS = tuple(f"expert_{f}" for f in FAMILIES)
RUNS = (*EXPERTS, "sequential", "student")


def run_config(name: str, seed: int, root: str, tiny: bool) -> tuple[str, dict]:
  """``(variant, overrides)`` of run ``name`` of ``seed`` under ``root``."""
  scale = TINY_SCALE if tiny else SCALE
  variant, extra = "", {}
  if name in EXPERTS:
    extra = {"rl.families": (name[len("expert_"):],)}
  elif name == "sequential":
    variant = "stagewise"
    extra = {f"rl_{f}.{k[3:]}": v for f in FAMILIES for k, v in scale.items()
             if k.startswith("rl.")}
  elif name == "student":
    extra = {"stages": ("sft", "distill"), **{
        f"distill.teachers.{f}": os.path.join(root, f"seed{seed}", f"expert_{f}")
        for f in FAMILIES}}
  else:
    raise ValueError(f"unknown run {name!r}; one of {RUNS}")
  overrides = {k: v for k, v in scale.items() if variant != "stagewise" or not k.startswith("rl.")}
  variant = ",".join(v for v in (variant, "tiny" if tiny else "") if v)
  return variant, {**overrides, **extra, "seed": seed}


def _train(name: str, seed: int, root: str, tiny: bool) -> None:
  common.train_once(os.path.join(root, f"seed{seed}", name), *run_config(name, seed, root, tiny),
                    os.path.join(root, f"{name}_seed{seed}.log"))


def run(root: str, seeds: Sequence[int], *, jobs: int, tiny: bool) -> None:
  """The experts and the sequential policies, then the students (which load
  the experts)."""
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    for names in ((*EXPERTS, "sequential"), ("student",)):
      for future in [pool.submit(_train, n, s, root, tiny) for s in seeds for n in names]:
        future.result()


def success(workdir: str) -> dict[str, float]:
  """A run's held-out success per family after its last stage, after SFT
  (``sft/<family>``) and its wall time."""
  summary = metrics_lib.read_summary(workdir)
  with open(os.path.join(workdir, "config.json")) as f:
    stage = json.load(f)["stages"][-1]
  out = {f: float(summary[f"{stage}_success/{f}"]) for f in FAMILIES}
  out.update({f"sft/{f}": float(summary[f"sft_success/{f}"]) for f in FAMILIES})
  out["wall_s"] = float(summary.get("wall_s", 0.0))
  return out


def collect(root: str, seeds: Sequence[int]) -> dict:
  return {name: {str(s): success(os.path.join(root, f"seed{s}", name)) for s in seeds}
          for name in RUNS}


def table(results: dict) -> str:
  """Per run and family: held-out success and, but for the experts, the
  share of the expert's (mean ± std over seeds of the per-seed ratio)."""
  seeds = list(results[EXPERTS[0]])
  cell = lambda v, fmt: f"{fmt.format(np.mean(v))} ± {fmt.format(np.std(v))}"  # noqa: E731
  head = ["run", "after SFT"] + [f"{f}" for f in FAMILIES] + [
      f"{f} / expert" for f in FAMILIES]
  lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
  for name in RUNS:
    cells = [name, cell([np.mean([results[name][s][f"sft/{f}"] for f in FAMILIES])
                         for s in seeds], "{:.1%}")]
    cells += [cell([results[name][s][f] for s in seeds], "{:.1%}") for f in FAMILIES]
    for f in FAMILIES:
      expert = results[f"expert_{f}"]
      ratios = [results[name][s][f] / expert[s][f] for s in seeds if expert[s][f] > 0]
      cells.append("" if name in EXPERTS or not ratios else cell(ratios, "{:.0%}"))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write(results: dict, out: str, cmd: str) -> None:
  common.write_json(os.path.join(out, "results.json"), results, indent=1, sort_keys=True)
  minutes = sum(r["wall_s"] for seeds in results.values() for r in seeds.values()) / 60
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(f"# Cross-stage distillation\n\nCommand: `{cmd}` ({minutes:.0f} min of runs, "
            f"{time.strftime('%Y-%m-%d')}). Held-out greedy success per task family, "
            f"mean ± standard deviation over seeds {', '.join(results[RUNS[0]])}; "
            "`after SFT` is the shared warm start's mean over the families.\n\n"
            f"{table(results)}\n")


if __name__ == "__main__":
  common.run_study("distill_study", out="docs/distill", workdir="/tmp/agentic_rl_distill",
                   run=run, collect=collect, write=write)
