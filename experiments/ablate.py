r"""Runs the invariant ablations over several seeds; writes a table and plots.

  python -m experiments.ablate                                   # docs/ablations/
  python -m experiments.ablate --studies=signal --seeds=0,1 --jobs=2
  python -m experiments.ablate --tiny --out=/tmp/abl             # seconds per arm

The arms and studies are in ``experiments/configs/ablations.py``. For each
seed a study's SFT warm start runs once; every arm of that study starts its
RL stage from a copy of that checkpoint, so arms differ only in the ablated
controller. Each run is ``python -m experiments.train`` in its own process
(``--jobs`` at a time), under ``--workdir/seed<S>/<arm>``; a finished run
(with a ``summary.json``) is not run again. Outputs in ``--out``:
``results.json`` (per-seed series and summaries), ``results.md`` (the table,
mean +- std over seeds) and one PNG per study.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import time
from collections.abc import Sequence

import numpy as np
from absl import app, flags

from agentic_rl.train import metrics as metrics_lib
from experiments import common
from experiments.configs import ablations


CONFIG_FILE = os.path.join(os.path.dirname(__file__), "configs", "ablations.py")
# Per-iteration series kept from each RL run.
SERIES = (
    "signal/zero_variance_frac", "signal/effective_token_frac", "signal/rollouts",
    "signal/nonzero_grad_per_rollout", "signal/all_correct_frac", "signal/stage_rollouts",
    "perf/step_s",
    "reward/outcome", "explore/entropy",
    "explore/entropy_coef", "explore/temperature", "explore/distinct_success_seqs_solved",
    "explore/distinct_tool_seqs", "shift/kl_behaviour_learner", "shift/staleness_mean",
    "shift/is_ratio_max", "shift/stale_token_frac", "eval/success", "eval/pass_at_k",
    "eval/pass_at_1",
)
# name -> (series, how): the numbers per (arm, seed) that the table reports.
SUMMARIES = {
    "success": ("eval/success", "last"),
    "success_sampled": ("eval/pass_at_1", "last"),
    "pass_at_k": ("eval/pass_at_k", "last"),
    "zero_variance_frac": ("signal/zero_variance_frac", "mean"),
    "effective_token_frac": ("signal/effective_token_frac", "mean"),
    "rollouts_per_iter": ("signal/rollouts", "mean"),
    "distinct_success_seqs": ("explore/distinct_success_seqs_solved", "mean"),
    "distinct_tool_seqs": ("explore/distinct_tool_seqs", "mean"),
    "entropy": ("explore/entropy", "mean"),
    "kl_behaviour_learner": ("shift/kl_behaviour_learner", "mean"),
    "staleness_mean": ("shift/staleness_mean", "mean"),
    "is_ratio_max": ("shift/is_ratio_max", "max"),
    "nonzero_grad_per_rollout": ("signal/nonzero_grad_per_rollout", "mean"),
    "all_correct_frac": ("signal/all_correct_frac", "mean"),
    "rollouts_total": ("signal/stage_rollouts", "last"),
    "rl_wall_s": ("perf/step_s", "sum"),
}
COLUMNS = {
    "signal": ("success", "gain", "nonzero_grad_per_rollout", "all_correct_frac",
               "zero_variance_frac", "rollouts_total", "iterations"),
    "exploration": ("success", "gain", "pass_at_k", "distinct_success_seqs",
                    "distinct_tool_seqs", "entropy"),
    "shift": ("success", "gain", "kl_behaviour_learner", "staleness_mean", "is_ratio_max",
              "episodes_per_s"),
    "host": ("sft_success", "success", "gain", "sft_success_sampled", "success_sampled",
             "gain_sampled", "pass_at_k", "episodes_per_s"),
}
HEADERS = {
    "success": "final success", "gain": "gain over SFT", "pass_at_k": "final pass@k",
    "sft_success": "success after SFT", "sft_success_sampled": "sampled after SFT",
    "success_sampled": "final sampled", "gain_sampled": "sampled gain",
    "zero_variance_frac": "mean zero-variance frac",
    "effective_token_frac": "mean tokens with non-zero advantage",
    "rollouts_per_iter": "rollouts / iter",
    "distinct_success_seqs": "distinct successful strategies / solved group",
    "distinct_tool_seqs": "distinct tool sequences / group", "entropy": "mean token entropy",
    "kl_behaviour_learner": "mean KL(behaviour ‖ learner)",
    "staleness_mean": "mean staleness", "is_ratio_max": "max IS ratio",
    "nonzero_grad_per_rollout": "episodes with gradient / episode generated",
    "all_correct_frac": "all-correct groups", "rollouts_total": "episodes generated",
    "iterations": "updates", "episodes_per_s": "RL episodes / s",
}
DIGITS = {"rollouts_per_iter": 0, "rollouts_total": 0, "iterations": 1, "is_ratio_max": 2,
          "episodes_per_s": 1}


# ------------------------------------------------------------------ running
def _config_arg(arm: str, tiny: bool) -> str:
  return f"{CONFIG_FILE}:{arm}{',tiny' if tiny else ''}"


def _train(arm: str, seed: int, workdir: str, tiny: bool) -> None:
  """One ``experiments.train`` run in its own process (skipped if finished)."""
  seconds = common.train_config_run(_config_arg(arm, tiny), seed, workdir)
  if seconds:
    print(f"  {arm:12s} seed {seed}: {seconds:6.0f} s", flush=True)


def run(workdir: str, seeds: Sequence[int], studies: Sequence[str], *, jobs: int = 1,
        tiny: bool = False) -> None:
  """Runs each study's SFT warm start per seed, then every arm of ``studies``."""
  unknown = set(studies) - set(ablations.STUDIES)
  if unknown:
    raise ValueError(f"unknown studies {sorted(unknown)}; valid: {list(ablations.STUDIES)}")
  if "host" in studies and importlib.util.find_spec("gem") is None:
    raise ValueError("the host study plays a GEM game: pip install -e '.[gem]' (or leave it "
                     "out: --studies=signal,exploration,shift)")
  arms = list(dict.fromkeys(a for s in studies for a in ablations.STUDIES[s]))
  bases = list(dict.fromkeys(ablations.warm_start(a) for a in arms))
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    # SFT runs are queued first, so an arm waiting on its seed's never blocks them.
    sft = {(base, seed): pool.submit(_train, base, seed,
                                     os.path.join(workdir, f"seed{seed}", base), tiny)
           for seed in seeds for base in bases}

    def arm_run(arm, seed):
      base = ablations.warm_start(arm)
      sft[base, seed].result()
      root = os.path.join(workdir, f"seed{seed}")
      common.start_from(os.path.join(root, base), os.path.join(root, arm))
      _train(arm, seed, os.path.join(root, arm), tiny)

    futures = [pool.submit(arm_run, arm, seed) for arm in arms for seed in seeds]
    for f in futures:
      f.result()


# ------------------------------------------------------------------ results
def _records(workdir: str) -> list[dict]:
  return metrics_lib.read_metrics(os.path.join(workdir, metrics_lib.METRICS_FILE))


def _series(rl: list[dict], name: str) -> list[list[float]]:
  """``[[iteration, value], ...]`` of one metric over the RL stage (1-based),
  values to 6 significant digits."""
  return [[i + 1, float(f"{r[name]:.6g}")] for i, r in enumerate(rl) if name in r]


def _summarise(series: dict[str, list], sft: dict[str, float]) -> dict[str, float]:
  out = {}
  for name, (metric, how) in SUMMARIES.items():
    values = np.array([v for _, v in series.get(metric, [])], np.float64)
    if values.size:
      out[name] = float({"last": values[-1], "mean": values.mean(), "max": values.max(),
                         "sum": values.sum()}[how])
  out["sft_success"] = sft["eval/success"]
  out["gain"] = out["success"] - out["sft_success"]
  out["sft_success_sampled"] = sft["eval/pass_at_1"]
  out["gain_sampled"] = out["success_sampled"] - out["sft_success_sampled"]
  out["iterations"] = float(len(series.get("perf/step_s", [])))
  if out.get("rl_wall_s"):
    out["episodes_per_s"] = out["rollouts_total"] / out["rl_wall_s"]
  return out


def collect(workdir: str, seeds: Sequence[int], studies: Sequence[str]) -> dict:
  """Series and per-seed summaries of the finished runs under ``workdir``."""
  arms = list(dict.fromkeys(a for s in studies for a in ablations.STUDIES[s]))
  runs = {}
  for arm in arms:
    runs[arm] = {}
    for seed in seeds:
      root = os.path.join(workdir, f"seed{seed}")
      sft = _records(os.path.join(root, ablations.warm_start(arm)))[-1]
      rl = [r for r in _records(os.path.join(root, arm)) if r.get("stage") == 1]
      series = {name: _series(rl, name) for name in SERIES}
      # Evaluation before RL (the SFT policy) is iteration 0.
      for name in ("eval/success", "eval/pass_at_k", "eval/pass_at_1"):
        series[name].insert(0, [0, float(sft[name])])
      series["signal/stage_rollouts"].insert(0, [0, 0.0])
      summary = _summarise(series, sft)
      # This run's process alone (its directory also counts the warm start's).
      summary["wall_s"] = metrics_lib.read_summary(os.path.join(root, arm))["wall_s_last"]
      runs[arm][str(seed)] = {"series": series, "summary": summary, "iterations": len(rl)}
  warm = {s: sum(metrics_lib.read_summary(os.path.join(workdir, f"seed{seed}", base))["wall_s"]
                 for seed in seeds for base in {ablations.WARM_STARTS[s]}) for s in studies}
  return {"seeds": list(seeds), "studies": {s: list(ablations.STUDIES[s]) for s in studies},
          "runs": runs, "warm_start_wall_s": warm}


def _mean_std(results: dict, arm: str, name: str) -> tuple[float, float]:
  values = [r["summary"][name] for r in results["runs"][arm].values() if name in r["summary"]]
  return float(np.mean(values)), float(np.std(values))


def table(results: dict) -> str:
  """The markdown table: per study, each arm's mean +- std over seeds."""
  lines = [f"Seeds: {', '.join(map(str, results['seeds']))}; mean ± std over seeds.", ""]
  for study, arms in results["studies"].items():
    cols = COLUMNS[study]
    arm_s = sum(r["summary"]["wall_s"] for a in arms for r in results["runs"][a].values())
    runs = sum(len(results["runs"][a]) for a in arms)
    ran = f" (`{results['commands'][study]}`)" if "commands" in results else ""
    lines += [f"**{study}**: {runs} RL runs, {arm_s / runs:.0f} s each on average, "
              f"{(arm_s + results['warm_start_wall_s'][study]) / 60:.0f} min of runs in all with "
              f"the warm starts (wall times of each process){ran}", "",
              "| arm | " + " | ".join(HEADERS[c] for c in cols) + " |",
              "|---" * (len(cols) + 1) + "|"]
    for arm in arms:
      cells = []
      for c in cols:
        m, s = _mean_std(results, arm, c)
        if c == "kl_behaviour_learner":
          cells.append(f"{m:.2e} ± {s:.1e}")
        else:
          digits = DIGITS.get(c, 3)
          cells.append(f"{m:.{digits}f} ± {s:.{digits}f}")
      lines.append(f"| {ablations.label(study, arm)} | " + " | ".join(cells) + " |")
    lines.append("")
  return "\n".join(lines)


def comparisons(results: dict) -> dict[str, float]:
  """The headline differences (means over seeds), as docs/ablations/results.md gives them:
  per signal arm, the relative change in episodes that carry a gradient per
  episode generated and the all-correct group fraction against uniform; per
  shift arm, its throughput and success against staleness 0."""
  out = {}
  runs = results["runs"]
  mean = lambda arm, name: _mean_std(results, arm, name)[0]  # noqa: E731
  if "uniform" in runs:
    base = mean("uniform", "nonzero_grad_per_rollout")
    for arm in ("dynamic", "ada", "knapsack"):
      if arm in runs:
        out[f"nonzero_grad_per_rollout/{arm}_vs_uniform"] = (
            mean(arm, "nonzero_grad_per_rollout") / base - 1.0 if base else float("nan"))
        out[f"all_correct_frac/{arm}_minus_uniform"] = (
            mean(arm, "all_correct_frac") - mean("uniform", "all_correct_frac"))
  if "async0" in runs:
    for arm in results["studies"].get("shift", ()):
      if arm != "async0":
        out[f"speedup/{arm}"] = mean(arm, "episodes_per_s") / mean("async0", "episodes_per_s")
        out[f"success/{arm}_minus_staleness0"] = mean(arm, "success") - mean("async0", "success")
  return out


# Per study: the panels of its figure, (series, y label, log scale); the
# signal study's x axis is episodes generated, the others' RL iterations.
PANELS = {
    "signal": (("signal/nonzero_grad_per_rollout",
                "episodes with gradient / episode generated", False),
               ("eval/success", "held-out greedy success", False)),
    "exploration": (("explore/distinct_success_seqs_solved",
                     "distinct successful strategies / solved group", False),
                    ("eval/pass_at_k", "held-out pass@k", False)),
    "shift": (("shift/kl_behaviour_learner", "KL(behaviour || learner), k3", True),
              ("eval/success", "held-out greedy success", False)),
    "host": (("reward/outcome", "training success (groups kept)", False),
             ("eval/success", "held-out greedy success", False)),
}
X_ROLLOUTS = ("signal",)


def _x_of(run: dict, points: list, by_rollouts: bool) -> np.ndarray:
  """The x values of ``points``: their iterations, or the episodes generated
  by the end of each."""
  its = [p[0] for p in points]
  if not by_rollouts:
    return np.array(its, np.float64)
  spent = dict((int(i), v) for i, v in run["series"]["signal/stage_rollouts"])
  return np.array([spent.get(int(i), np.nan) for i in its], np.float64)


def plot(results: dict, out_dir: str) -> list[str]:
  """One PNG per study (mean over seeds, band = min..max); returns the paths."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for study, arms in results["studies"].items():
    by_rollouts = study in X_ROLLOUTS
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, (name, ylabel, log) in zip(axes, PANELS[study]):
      for arm in arms:
        seeds = list(results["runs"][arm].values())
        n = min(len(r["series"][name]) for r in seeds)
        if n == 0:
          continue
        x = np.mean([_x_of(r, r["series"][name][:n], by_rollouts) for r in seeds], axis=0)
        y = np.array([[p[1] for p in r["series"][name][:n]] for r in seeds])
        if log:
          y = np.maximum(y, 1e-12)
        ax.plot(x, y.mean(0), marker="o" if n < 8 else None, ms=3,
                label=ablations.label(study, arm))
        ax.fill_between(x, y.min(0), y.max(0), alpha=0.15)
      ax.set_xlabel("episodes generated (mean over seeds)" if by_rollouts else "RL iteration")
      ax.set_ylabel(ylabel)
      if log:
        ax.set_yscale("log")
      ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{study} ablation, seeds {', '.join(map(str, results['seeds']))}")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{study}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths


def merged(results: dict, out_dir: str, command: str) -> dict:
  """``results`` with ``command`` as each of its studies' command, and the
  studies it did not run taken from ``out_dir``'s ``results.json`` where
  that holds the same seeds (with the commands that ran them): rerunning
  one study keeps the others' results."""
  results = dict(results, **{k: dict(results[k]) for k in ("studies", "runs", "warm_start_wall_s")})
  commands = {study: command for study in results["studies"]}
  path = os.path.join(out_dir, "results.json")
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if old.get("seeds") == results["seeds"]:
      for study, arms in old["studies"].items():
        if study not in results["studies"]:
          results["studies"][study] = arms
          results["runs"].update({arm: old["runs"][arm] for arm in arms})
          results["warm_start_wall_s"][study] = old["warm_start_wall_s"][study]
          commands[study] = old.get("commands", {}).get(study, old["command"])
  order = {study: i for i, study in enumerate(ablations.STUDIES)}
  studies = dict(sorted(results["studies"].items(), key=lambda kv: order.get(kv[0], len(order))))
  return dict(results, studies=studies, commands={s: commands[s] for s in studies})


def write(results: dict, out_dir: str, command: str) -> None:
  results = merged(results, out_dir, command)
  results = dict(results, command=command, comparisons=comparisons(results))
  # Compact: every per-iteration series of every run is in it.
  common.write_json(os.path.join(out_dir, "results.json"), results, indent=None,
                    separators=(",", ":"), sort_keys=True)
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    ran = set(results["commands"].values())
    f.write((f"Command: `{command}`" if ran == {command} else
             "Each study's command is beside it.") + f"\n\n{table(results)}\n")
    for k, v in results["comparisons"].items():
      f.write(f"- {k}: {v:+.3f}\n")
  plot(results, out_dir)


def main(argv):
  del argv
  seeds = [int(s) for s in _SEEDS.value]
  t0 = time.perf_counter()
  run(_WORKDIR.value, seeds, _STUDIES.value, jobs=_JOBS.value, tiny=_TINY.value)
  results = collect(_WORKDIR.value, seeds, _STUDIES.value)
  command = "python -m experiments.ablate " + " ".join(
      f"--{k}={v}" for k, v in (("seeds", ",".join(_SEEDS.value)),
                                ("studies", ",".join(_STUDIES.value)),
                                ("jobs", _JOBS.value)))
  if _TINY.value:
    command += " --tiny"
  write(results, _OUT.value, command)
  print(table(results))
  print(f"wrote {_OUT.value}/results.{{json,md}} and plots in {time.perf_counter() - t0:.0f} s")


def _define_flags():
  """The command line (defined only when run as a script, so importing the
  module beside other experiments defines no flags)."""
  global _OUT, _WORKDIR, _SEEDS, _STUDIES, _JOBS, _TINY
  _OUT = flags.DEFINE_string("out", "docs/ablations", "Where results and plots go.")
  _WORKDIR = flags.DEFINE_string("workdir", "/tmp/agentic_rl_ablations", "Run directories.")
  _SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
  _STUDIES = flags.DEFINE_list("studies", list(ablations.STUDIES), "Studies to run.")
  _JOBS = flags.DEFINE_integer("jobs", 1, "Runs at a time.")
  _TINY = flags.DEFINE_bool("tiny", False, "Test scale (tiny model, a few iterations).")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
