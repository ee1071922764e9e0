"""The default run over seeds: each seed's command is the default config with
that seed; the table and plot from per-seed summaries."""

import json
import os

import train_commands
from agentic_rl.train import config as config_lib
from experiments import common, seeds
from experiments.configs import default


def test_each_seed_runs_the_default_config(monkeypatch):
  commands = []
  monkeypatch.setattr(common, "train_once", lambda *a: commands.append(a))
  seeds.run("/tmp/root", [3, 4], jobs=1, tiny=False)
  assert [c[0] for c in commands] == ["/tmp/root/seed3", "/tmp/root/seed4"]
  cfg = train_commands.config_of(*commands[0][1:3])
  config_lib.validate(cfg)
  want = default.get_config("all")
  want.seed = 3
  assert cfg == want


def _fake_run(path, seed, sft, rl):
  """A finished run whose sampled success is half its greedy success."""
  os.makedirs(path)
  summary = {"sft_success": sft, "rl_success": rl, "sft_success_sampled": sft / 2,
             "rl_success_sampled": rl / 2, "wall_s": 100.0 + seed}
  for f in seeds.FAMILIES:
    summary.update({f"sft_success/{f}": sft, f"rl_success/{f}": rl,
                    f"sft_success_sampled/{f}": sft / 2, f"rl_success_sampled/{f}": rl / 2})
  with open(os.path.join(path, "summary.json"), "w") as f:
    json.dump(summary, f)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for step, value in ((9, sft), (19, rl)):
      f.write(json.dumps({"step": step, "eval/success": value, "eval/pass_at_1": value / 2}) + "\n")


def test_table_and_plot(tmp_path):
  _fake_run(tmp_path / "seed0", 0, 0.25, 0.75)
  _fake_run(tmp_path / "seed1", 1, 0.5, 0.75)
  results = seeds.collect(str(tmp_path), [0, 1])
  assert results["seeds"]["0"]["curve"] == [[9, 0.25, 0.125], [19, 0.75, 0.375]]
  md = seeds.table(results)
  assert "| 0 | 25.0% | 75.0% | +50.0% | 12.5% | 37.5% | +25.0% | 100 s |" in md
  assert ("| mean ± std | 37.5% ± 12.5% | 75.0% ± 0.0% | +37.5% ± 12.5% "
          "| 18.8% ± 6.2% | 37.5% ± 0.0% | +18.8% ± 6.2% | 100 ± 0 s |") in md
  assert "Smallest greedy gain: +25.0% (seed 1)." in md
  assert "Smallest sampled gain: +12.5% (seed 1)." in md
  family = " | ".join(["25% → 75% | 12% → 38%"] * len(seeds.FAMILIES))
  assert f"| 0 | {family} |" in md
  seeds.write(results, str(tmp_path / "out"), "cmd")
  assert "(3 min of runs," in (tmp_path / "out" / "results.md").read_text()
  assert os.path.exists(tmp_path / "out" / "seeds.png")
  assert json.load(open(tmp_path / "out" / "results.json"))["command"] == "cmd"
