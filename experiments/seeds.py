r"""The default run over seeds: how much of its result is the seed's?

  python -m experiments.seeds --seeds=0,1,2,3,4 --jobs=1   # docs/default_run/results.{md,json}
  python -m experiments.seeds --tiny --out=/tmp/seeds      # seconds per run

Each seed is ``python -m experiments.train --config.seed=S`` (the default
config, nothing else changed) in its own process under
``--workdir/seed<S>`` (a run with a ``summary.json`` is not run again). The
table gives held-out success after SFT and after RL, greedy and sampled at
temperature 1, overall and per task family, the gain and the wall time of
each seed, then their mean and spread; a plot draws each seed's held-out
success over the run. Wall times are only comparable with ``--jobs=1`` on
an otherwise idle machine.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Sequence

import numpy as np

from agentic_rl.train import metrics as metrics_lib
from experiments import common
from experiments.configs import default

_DEFAULT = default.get_config()
FAMILIES = tuple(_DEFAULT.tasks.families)


def _train(seed: int, root: str, tiny: bool) -> None:
  common.train_once(os.path.join(root, f"seed{seed}"), "tiny" if tiny else "", {"seed": seed},
                    os.path.join(root, f"seed{seed}.log"))


def run(root: str, seeds: Sequence[int], *, jobs: int, tiny: bool) -> None:
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    for future in [pool.submit(_train, s, root, tiny) for s in seeds]:
      future.result()


# The held-out metrics of a run's summary: greedy decoding, and the mean
# success of samples at temperature 1 (eval/pass_at_1).
METRICS = {"greedy": "success", "sampled": "success_sampled"}


def result(workdir: str) -> dict:
  """One seed's summary numbers (``<metric>/sft``, ``<metric>/rl`` and per
  family ``<metric>/sft/<family>``, for each of :data:`METRICS`) and its
  held-out success per evaluation (``curve``: ``[[global step, greedy,
  sampled], ...]``)."""
  summary = metrics_lib.read_summary(workdir)
  out = {"wall_s": float(summary["wall_s"])}
  for metric, key in METRICS.items():
    for stage in ("sft", "rl"):
      out[f"{metric}/{stage}"] = float(summary.get(f"{stage}_{key}", np.nan))
      for f in FAMILIES:
        out[f"{metric}/{stage}/{f}"] = float(summary.get(f"{stage}_{key}/{f}", np.nan))
  records = metrics_lib.read_metrics(os.path.join(workdir, metrics_lib.METRICS_FILE))
  out["curve"] = [[r["step"], round(float(r["eval/success"]), 6),
                   round(float(r.get("eval/pass_at_1", np.nan)), 6)]
                  for r in records if "eval/success" in r]
  return out


def collect(root: str, seeds: Sequence[int]) -> dict:
  return {"families": list(FAMILIES),
          "seeds": {str(s): result(os.path.join(root, f"seed{s}")) for s in seeds}}


def _ms(v: np.ndarray, fmt: str) -> str:
  return f"{fmt.format(v.mean())} ± {fmt.replace('+', '').format(v.std())}"


def table(results: dict) -> str:
  """Overall held-out success, greedy and sampled, one row per seed, then
  the mean ± standard deviation; then each family's."""
  fams, rows = results["families"], results["seeds"]
  stat = lambda key: np.array([r[key] for r in rows.values()])  # noqa: E731
  head = ["seed"] + [f"{m} {c}" for m in METRICS for c in ("after SFT", "after RL", "gain")]
  lines = ["| " + " | ".join(head + ["wall"]) + " |", "|---|" + "---:|" * len(head)]
  for seed, r in rows.items():
    cells = [seed]
    for m in METRICS:
      sft, rl = r[f"{m}/sft"], r[f"{m}/rl"]
      cells += [f"{sft:.1%}", f"{rl:.1%}", f"{rl - sft:+.1%}"]
    lines.append("| " + " | ".join(cells + [f"{r['wall_s']:.0f} s"]) + " |")
  cells = ["mean ± std"]
  for m in METRICS:
    sft, rl = stat(f"{m}/sft"), stat(f"{m}/rl")
    cells += [_ms(sft, "{:.1%}"), _ms(rl, "{:.1%}"), _ms(rl - sft, "{:+.1%}")]
  lines.append("| " + " | ".join(cells + [_ms(stat("wall_s"), "{:.0f}") + " s"]) + " |")
  lines.append("")
  for m in METRICS:
    gains = stat(f"{m}/rl") - stat(f"{m}/sft")
    lines.append(f"Smallest {m} gain: {gains.min():+.1%} (seed {list(rows)[int(gains.argmin())]}).")
  head = ["seed"] + [f"{f} {m}" for f in fams for m in METRICS]
  lines += ["", "Per family, after SFT → after RL:", "",
            "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
  per = lambda get: [f"{get(f'{m}/sft/{f}'):.0%} → {get(f'{m}/rl/{f}'):.0%}"  # noqa: E731
                     for f in fams for m in METRICS]
  for seed, r in rows.items():
    lines.append("| " + " | ".join([seed] + per(r.__getitem__)) + " |")
  lines.append("| " + " | ".join(["mean"] + per(lambda k: stat(k).mean())) + " |")
  return "\n".join(lines)


def plot(results: dict, out_dir: str) -> str:
  """Held-out success of every seed over the run (SFT, then RL); returns the path."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
  for seed, r in results["seeds"].items():
    x, *ys = zip(*r["curve"])
    for ax, y in zip(axes, ys):
      ax.plot(x, y, marker="o", ms=3, label=f"seed {seed}")
  for ax, metric in zip(axes, METRICS):
    ax.set_title(f"held-out success, {metric}", fontsize=10)
    ax.set_xlabel("step (SFT steps, then RL iterations)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "seeds.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def write(results: dict, out: str, cmd: str) -> None:
  common.write_json(os.path.join(out, "results.json"), dict(results, command=cmd),
                    indent=1, sort_keys=True)
  minutes = sum(r["wall_s"] for r in results["seeds"].values()) / 60
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(f"# The default run over seeds\n\nCommand: `{cmd}` ({minutes:.0f} min of runs, "
            f"{time.strftime('%Y-%m-%d')}). Held-out success after the SFT warm start "
            "and after RL, overall and per task family: greedy on "
            f"{_DEFAULT.eval.num_prompts} test prompts, and sampled (`eval/pass_at_1`: the "
            f"mean success of {_DEFAULT.eval.pass_k} samples at temperature 1 on each of "
            f"{_DEFAULT.eval.pass_k_prompts}; the policy RL optimises).\n\n"
            f"{table(results)}\n\n![held-out success per seed](seeds.png)\n")
  plot(results, out)


if __name__ == "__main__":
  common.run_study("seeds", out="docs/default_run", workdir="/tmp/agentic_rl_seeds",
                   run=run, collect=collect, write=write)
