r"""The default run over seeds: how much of its result is the seed's?

  python -m experiments.seeds --seeds=0,1,2,3,4 --jobs=1   # docs/default_run/results.{md,json}
  python -m experiments.seeds --tiny --out=/tmp/seeds      # seconds per run

Each seed is ``python -m experiments.train --config.seed=S`` (the default
config, nothing else changed) in its own process under
``--workdir/seed<S>`` (a run with a ``summary.json`` is not run again). The
table gives held-out greedy success after SFT and after RL, overall and per
task family, the gain and the wall time of each seed, then their mean and
spread; a plot draws each seed's held-out success over the run. Wall times
are only comparable with ``--jobs=1`` on an otherwise idle machine.
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

FAMILIES = tuple(default.get_config().tasks.families)


def _train(seed: int, root: str, tiny: bool) -> None:
  common.train_once(os.path.join(root, f"seed{seed}"), "tiny" if tiny else "", {"seed": seed},
                    os.path.join(root, f"seed{seed}.log"))


def run(root: str, seeds: Sequence[int], *, jobs: int, tiny: bool) -> None:
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    for future in [pool.submit(_train, s, root, tiny) for s in seeds]:
      future.result()


def result(workdir: str) -> dict:
  """One seed's summary numbers and its held-out success per evaluation
  (``curve``: ``[[global step, success], ...]``)."""
  summary = metrics_lib.read_summary(workdir)
  out = {"sft": float(summary["sft_success"]), "rl": float(summary["rl_success"]),
         "wall_s": float(summary["wall_s"])}
  for f in FAMILIES:
    out[f"sft/{f}"] = float(summary.get(f"sft_success/{f}", np.nan))
    out[f"rl/{f}"] = float(summary.get(f"rl_success/{f}", np.nan))
  records = metrics_lib.read_metrics(os.path.join(workdir, metrics_lib.METRICS_FILE))
  out["curve"] = [[r["step"], round(float(r["eval/success"]), 6)] for r in records
                  if "eval/success" in r]
  return out


def collect(root: str, seeds: Sequence[int]) -> dict:
  return {"families": list(FAMILIES),
          "seeds": {str(s): result(os.path.join(root, f"seed{s}")) for s in seeds}}


def table(results: dict) -> str:
  """One row per seed, then the mean ± standard deviation."""
  fams = results["families"]
  head = ["seed", "after SFT", "after RL", "gain"] + [f"{f} SFT → RL" for f in fams] + ["wall"]
  lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
  rows = results["seeds"]
  for seed, r in rows.items():
    cells = [seed, f"{r['sft']:.1%}", f"{r['rl']:.1%}", f"{r['rl'] - r['sft']:+.1%}"]
    cells += [f"{r[f'sft/{f}']:.0%} → {r[f'rl/{f}']:.0%}" for f in fams]
    lines.append("| " + " | ".join(cells + [f"{r['wall_s']:.0f} s"]) + " |")
  stat = lambda key: np.array([r[key] for r in rows.values()])  # noqa: E731
  ms = lambda v, fmt: f"{fmt.format(v.mean())} ± {fmt.replace('+', '').format(v.std())}"  # noqa: E731
  cells = ["mean ± std", ms(stat("sft"), "{:.1%}"), ms(stat("rl"), "{:.1%}"),
           ms(stat("rl") - stat("sft"), "{:+.1%}")]
  cells += [f"{stat(f'sft/{f}').mean():.0%} → {stat(f'rl/{f}').mean():.0%}" for f in fams]
  lines.append("| " + " | ".join(cells + [ms(stat("wall_s"), "{:.0f}") + " s"]) + " |")
  gains = stat("rl") - stat("sft")
  lines += ["", f"Smallest gain: {gains.min():+.1%} (seed {list(rows)[int(gains.argmin())]})."]
  return "\n".join(lines)


def plot(results: dict, out_dir: str) -> str:
  """Held-out success of every seed over the run (SFT, then RL); returns the path."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(6.5, 3.8))
  for seed, r in results["seeds"].items():
    x, y = zip(*r["curve"])
    ax.plot(x, y, marker="o", ms=3, label=f"seed {seed}")
  ax.set_xlabel("step (SFT steps, then RL iterations)")
  ax.set_ylabel("held-out greedy success")
  ax.set_ylim(0, 1)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
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
            f"{time.strftime('%Y-%m-%d')}). Held-out greedy success on 128 test prompts "
            "after the SFT warm start and after RL, overall and per task family.\n\n"
            f"{table(results)}\n\n![held-out success per seed](seeds.png)\n")
  plot(results, out)


if __name__ == "__main__":
  common.run_study("seeds", out="docs/default_run", workdir="/tmp/agentic_rl_seeds",
                   run=run, collect=collect, write=write)
