r"""SmolLM2-135M-Instruct learning three agent tasks, and the invariant
controllers and turn-level credit on it; writes ``docs/real_model/``.

  python -m experiments.get_model smollm2-135m-instruct
  python -m experiments.real_model                             # every study
  python -m experiments.real_model --studies=tasks --seeds=0
  python -m experiments.real_model --tiny --out=/tmp/rm         # a tiny model, seconds

The runs are in ``experiments/configs/real_model.py``. For each seed, each
task's warm start (SFT; the first seed's also scores the instruct model
zero-shot, whose greedy success does not depend on the seed) runs once,
and each of its RL arms starts from a copy of its last checkpoint.
Every run is ``python -m experiments.train`` in its own process under
``--workdir/seed<S>/<run>``; a finished run is not run again and an
unfinished one resumes, so the command picks up where a stopped one left
off. Runs go seed by seed, the tasks first.

Outputs in ``--out``: ``results.json`` (``{"tasks": {task: {"seeds": {seed:
{"zero_shot", "before", "after", ...}}}}, "studies": {study: {arm: {seed:
{...}}}}}``: held-out greedy success of the instruct model, after the warm
start and after RL; each study's numbers per arm and seed), ``results.md``
(the tables, mean +- std over the seeds finished) and one PNG per study.
Runs not finished yet are left out (the tables say how many seeds each
number has).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

import numpy as np
from absl import app, flags

from agentic_rl.train import metrics as metrics_lib
from experiments import common
from experiments.configs import real_model as runs_lib

CONFIG_FILE = os.path.join(os.path.dirname(__file__), "configs", "real_model.py")
# name -> (RL-stage metric, how): each RL run's study numbers.
SUMMARIES = {
    "pass_at_k": ("eval/pass_at_k", "last"),
    "zero_variance_frac": ("signal/zero_variance_frac", "mean"),
    "nonzero_grad_per_rollout": ("signal/nonzero_grad_per_rollout", "mean"),
    "rollouts": ("signal/stage_rollouts", "last"),
    "kl_behaviour_learner": ("shift/kl_behaviour_learner", "mean"),
    "staleness_mean": ("shift/staleness_mean", "mean"),
    "distinct_success_seqs": ("explore/distinct_success_seqs_solved", "mean"),
    "train_success": ("reward/outcome", "mean"),
    "rl_s": ("perf/step_s", "sum"),
}
COLUMNS = {
    "signal": ("after", "gain", "zero_variance_frac", "nonzero_grad_per_rollout", "rollouts"),
    "shift": ("after", "gain", "kl_behaviour_learner", "staleness_mean", "episodes_per_s"),
    "exploration": ("after", "gain", "pass_at_k", "distinct_success_seqs"),
    "credit": ("after", "gain", "train_success"),
}
HEADERS = {
    "after": "success after RL", "gain": "gain over the warm start",
    "zero_variance_frac": "zero-variance groups", "rollouts": "episodes generated",
    "nonzero_grad_per_rollout": "episodes with gradient / episode generated",
    "kl_behaviour_learner": "KL(behaviour ‖ learner)", "staleness_mean": "mean staleness",
    "episodes_per_s": "RL episodes / s", "pass_at_k": "pass@k",
    "distinct_success_seqs": "distinct successful tool sequences / solved group",
    "train_success": "training success",
}


def _config_arg(run: str, tiny: bool) -> str:
  return f"{CONFIG_FILE}:{run}{',tiny' if tiny else ''}"


def runs_in_order(studies: Sequence[str], seeds: Sequence[int]) -> list[tuple[int, str]]:
  """``(seed, run)`` in the order they run: seed by seed, each seed's tasks
  first (a run after its warm start)."""
  runs = list(dict.fromkeys(r for s in studies for r in runs_lib.runs_of(s)))
  ordered = []
  for seed in seeds:
    for run in runs:
      ordered += [(seed, runs_lib.warm_start(run)), (seed, run)]
  return list(dict.fromkeys(ordered))


def run(workdir: str, seeds: Sequence[int], studies: Sequence[str], *, tiny: bool) -> None:
  unknown = set(studies) - set(runs_lib.STUDIES)
  if unknown:
    raise ValueError(f"unknown studies {sorted(unknown)}; valid: {list(runs_lib.STUDIES)}")
  for seed, name in runs_in_order(studies, seeds):
    root = os.path.join(workdir, f"seed{seed}")
    if not name.endswith("_sft"):
      common.start_from(os.path.join(root, runs_lib.warm_start(name)), os.path.join(root, name))
    # The instruct model's greedy success is the same for every seed: the
    # first seed's warm start measures it (ten minutes of a 2-core CPU).
    extra = ["--config.eval.at_start=False"] if seed != seeds[0] else []
    seconds = common.train_config_run(_config_arg(name, tiny), seed, os.path.join(root, name),
                                      extra)
    if seconds:
      print(f"  {name:22s} seed {seed}: {seconds:6.0f} s", flush=True)


def summarise(run_dir: str) -> dict[str, float] | None:
  """One finished run's numbers (None while it is not finished): held-out
  greedy success zero-shot, after the warm start and after RL (and the
  same sampled at temperature 1), and :data:`SUMMARIES` over its RL stage."""
  if not os.path.exists(os.path.join(run_dir, metrics_lib.SUMMARY_FILE)):
    return None
  s = metrics_lib.read_summary(run_dir)
  out = {"before": s["sft_success"], "before_sampled": s["sft_success_sampled"],
         "wall_s": s["wall_s"]}
  if "init_success" in s:  # the first seed's runs
    out.update(zero_shot=s["init_success"], zero_shot_sampled=s["init_success_sampled"])
  if "rl_success" not in s:  # a warm start
    return out
  out.update(after=s["rl_success"], after_sampled=s["rl_success_sampled"],
             gain=s["rl_success"] - s["sft_success"])
  records = metrics_lib.read_metrics(os.path.join(run_dir, metrics_lib.METRICS_FILE))
  rl = [r for r in records if "reward/outcome" in r]
  for name, (metric, how) in SUMMARIES.items():
    values = np.array([r[metric] for r in rl if metric in r], np.float64)
    if values.size:
      out[name] = float(values[-1] if how == "last" else
                        values.mean() if how == "mean" else values.sum())
  if out.get("rl_s"):
    out["episodes_per_s"] = out["rollouts"] / out["rl_s"]
  out["series"] = {m: [r[m] for r in rl if m in r] for m in ("reward/outcome", "eval/success")}
  return out


def collect(workdir: str, seeds: Sequence[int], studies: Sequence[str]) -> dict:
  """The finished runs' numbers under ``workdir``, in results.json's shape."""
  def seeds_of(name):
    got = {str(s): summarise(os.path.join(workdir, f"seed{s}", name)) for s in seeds}
    return {s: r for s, r in got.items() if r is not None}

  out = {"seeds": list(seeds), "tasks": {}, "studies": {}}
  if "tasks" in studies:
    for name in runs_lib.runs_of("tasks"):
      per_seed = seeds_of(name)
      first = next((r for r in per_seed.values() if "zero_shot" in r), None)
      for r in per_seed.values():  # measured once for every seed
        if first is not None:
          r.setdefault("zero_shot", first["zero_shot"])
          r.setdefault("zero_shot_sampled", first["zero_shot_sampled"])
      out["tasks"][name.split("_")[0]] = {"seeds": per_seed}
  for study in studies:
    if study != "tasks":
      out["studies"][study] = {name.split("_", 1)[1]: seeds_of(name)
                               for name in runs_lib.runs_of(study)}
  return out


def _cell(values: list[float], fmt: str) -> str:
  if not values:
    return "—"
  return f"{np.mean(values):{fmt}} ± {np.std(values):{fmt.lstrip('+')}} ({len(values)})"


def tables(results: dict) -> str:
  """The markdown tables: mean ± std over the finished seeds (their count)."""
  lines = []
  for title, suffix in (("greedy", ""), ("sampled at temperature 1 (pass@1)", "_sampled")):
    lines += [f"## Tasks: held-out success, {title}", "",
              "| task | zero-shot | after the warm start | after RL | gain over the warm start "
              "| minutes per seed |", "|---|---|---|---|---|---|"]
    for task, t in results["tasks"].items():
      rows = list(t["seeds"].values())
      col = lambda k, rows=rows: [r[k] for r in rows if k in r]  # noqa: E731
      gains = [r["after" + suffix] - r["before" + suffix] for r in rows if "after" in r]
      cells = [_cell(col(k + suffix), ".3f") for k in ("zero_shot", "before", "after")]
      lines.append(f"| {task} | " + " | ".join(cells) + f" | {_cell(gains, '+.3f')} | "
                   f"{_cell([w / 60 for w in col('wall_s')], '.0f')} |")
    lines.append("")
  for study, arms in results["studies"].items():
    cols = COLUMNS[study]
    lines += [f"## {study} (on {runs_lib.CONTROLLER_TASK})", "",
              "| arm | " + " | ".join(HEADERS[c] for c in cols) + " |",
              "|---" * (len(cols) + 1) + "|"]
    for arm, per_seed in arms.items():
      cells = [_cell([r[c] for r in per_seed.values() if c in r],
                     ".2e" if c == "kl_behaviour_learner" else ".3f") for c in cols]
      lines.append(f"| {runs_lib.LABELS[arm]} | " + " | ".join(cells) + " |")
    lines.append("")
  return "\n".join(lines)


def plot(results: dict, out_dir: str) -> list[str]:
  """``tasks.png`` (zero-shot, warm start, RL per task; a dot per seed) and
  one PNG per study (held-out success over RL iterations, per arm: the mean
  over seeds); returns the paths written."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  os.makedirs(out_dir, exist_ok=True)
  paths = []
  if results["tasks"]:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, (task, t) in enumerate(results["tasks"].items()):
      for j, key in enumerate(("zero_shot", "before", "after")):
        values = [r[key] for r in t["seeds"].values() if key in r]
        if values:
          ax.bar(i + (j - 1) * 0.27, np.mean(values), 0.25, color=f"C{j}",
                 label=("zero-shot", "after the warm start", "after RL")[j] if i == 0 else None)
          ax.plot([i + (j - 1) * 0.27] * len(values), values, "k.", ms=4)
    ax.set_xticks(range(len(results["tasks"])), list(results["tasks"]))
    ax.set_ylabel("held-out greedy success")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "tasks.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
  for study, arms in results["studies"].items():
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for arm, per_seed in arms.items():
      series = [r["series"]["reward/outcome"] for r in per_seed.values()]
      if series:
        n = min(map(len, series))
        ax.plot(range(1, n + 1), np.mean([s[:n] for s in series], axis=0),
                label=f"{runs_lib.LABELS[arm]} ({len(series)} seeds)")
    ax.set_xlabel("RL iteration")
    ax.set_ylabel("training success")
    ax.set_title(f"{study} on {runs_lib.CONTROLLER_TASK}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"{study}.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
  return paths


def write(results: dict, out_dir: str, command: str) -> None:
  results = dict(results, command=command, date=time.strftime("%Y-%m-%d"))
  common.write_json(os.path.join(out_dir, "results.json"), results, indent=1, sort_keys=True)
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(f"# SmolLM2-135M-Instruct on agent tasks\n\nCommand: `{command}` "
            f"({results['date']}). Mean ± std over the seeds finished (their number in "
            f"brackets).\n\n{tables(results)}")
  plot(results, out_dir)


def main(argv):
  del argv
  seeds = [int(s) for s in _SEEDS.value]
  run(_WORKDIR.value, seeds, _STUDIES.value, tiny=_TINY.value)
  write(collect(_WORKDIR.value, seeds, _STUDIES.value), _OUT.value,
        "python -m experiments.real_model " + " ".join(sys.argv[1:]))
  with open(os.path.join(_OUT.value, "results.md")) as f:
    print(f.read())


def _define_flags():
  """The command line (defined only when run as a script)."""
  global _OUT, _WORKDIR, _SEEDS, _STUDIES, _TINY
  _OUT = flags.DEFINE_string("out", "docs/real_model", "Where results and plots go.")
  _WORKDIR = flags.DEFINE_string("workdir", "/tmp/agentic_rl_real_model", "Run directories.")
  _SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
  _STUDIES = flags.DEFINE_list("studies", list(runs_lib.STUDIES), "Studies to run.")
  _TINY = flags.DEFINE_bool("tiny", False, "A tiny model from scratch (seconds per run).")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
