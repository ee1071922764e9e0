"""The real-model study: every run is a valid config with its arm's keys, the
runs go in order, a run's numbers and the tables, and (slow) the whole
driver at the tiny scale."""

import json
import os

import pytest

from agentic_rl.train import config as config_lib
from experiments import real_model
from experiments.configs import real_model as runs_lib


def _value(cfg, dotted):
  node = cfg
  for part in dotted.split("."):
    node = node[part]
  return node


@pytest.mark.parametrize("tiny", [False, True])
def test_every_run_is_a_valid_config_with_its_keys(tiny):
  names = {f"{task}_sft" for task in runs_lib.TASKS}
  names |= {r for study in runs_lib.STUDIES for r in runs_lib.runs_of(study)}
  for name in sorted(names):
    cfg = runs_lib.get_config(f"{name},tiny" if tiny else name)
    if tiny or name == "gem_dapo":  # validating reads the GGUF: one real config
      config_lib.validate(cfg)
    task, arm = name.split("_", 1)
    assert cfg.eval.at_start and cfg.tasks.source == "host"
    assert _value(cfg, "tasks.host_env") == runs_lib.TASKS[task]["tasks.host_env"]
    assert cfg.stages == (("sft",) if arm == "sft" else ("sft", "rl"))
    for dotted, value in runs_lib.ARMS.get(arm, {}).items():
      if not (tiny and dotted in ("rl.rollout_budget", "rl.iterations")):
        assert _value(cfg, dotted) == value, (name, dotted)
    assert bool(cfg.model.init_from) != tiny  # the GGUF, or a tiny model from scratch
  # Arms of one task share its warm start's settings: they resume after it.
  warm, arm = runs_lib.get_config("gem_sft"), runs_lib.get_config("gem_async4_tis")
  assert warm.sft.to_dict() == arm.sft.to_dict() and warm.tasks.to_dict() == arm.tasks.to_dict()
  signal = [runs_lib.get_config(r) for r in runs_lib.runs_of("signal")]
  assert {c.rl.rollout_budget or c.rl.iterations * c.rl.prompts_per_step * c.rl.group_size
          for c in signal} == {runs_lib._BUDGET}  # equal rollout budgets
  with pytest.raises(ValueError, match="unknown run"):
    runs_lib.get_config("chess_rl")
  with pytest.raises(ValueError, match="variant"):
    runs_lib.get_config("gem_rl,big")


def test_runs_go_seed_by_seed_each_after_its_warm_start():
  order = real_model.runs_in_order(["tasks", "credit"], [0, 1])
  assert order[:4] == [(0, "calculator_sft"), (0, "calculator_rl"), (0, "gem_sft"),
                       (0, "gem_rl")]
  assert len(order) == len(set(order)) == 2 * (2 * len(runs_lib.TASKS) + 1)
  assert order.index((0, "calculator_gigpo")) < order.index((1, "calculator_sft"))


def _write_run(path, *, rl: bool, success=(0.0, 0.25, 0.5), zero_shot=True):
  path.mkdir(parents=True)
  summary = {"sft_success": success[1], "sft_success_sampled": success[1], "wall_s": 600.0}
  if zero_shot:
    summary.update(init_success=success[0], init_success_sampled=success[0])
  records = [{"step": 0, "sft/nll": 1.0}]
  if rl:
    summary.update(rl_success=success[2], rl_success_sampled=success[2])
    records += [{"step": 1 + i, "reward/outcome": 0.1 * i, "signal/zero_variance_frac": 0.5,
                 "signal/stage_rollouts": 32.0 * (i + 1), "perf/step_s": 10.0,
                 "shift/kl_behaviour_learner": 1e-3} for i in range(3)]
    records[-1]["eval/success"] = success[2]
  (path / "summary.json").write_text(json.dumps(summary))
  (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_numbers_tables_and_plots_of_the_finished_runs(tmp_path):
  _write_run(tmp_path / "seed0" / "gem_rl", rl=True)
  # Only the first seed scores the instruct model; the others share its number.
  _write_run(tmp_path / "seed1" / "gem_rl", rl=True, success=(0.0, 0.5, 0.5), zero_shot=False)
  _write_run(tmp_path / "seed0" / "calculator_rl", rl=True)
  _write_run(tmp_path / "seed0" / "calculator_sft", rl=False)  # a warm start: no RL numbers
  assert "after" not in real_model.summarise(str(tmp_path / "seed0" / "calculator_sft"))
  got = real_model.summarise(str(tmp_path / "seed0" / "gem_rl"))
  assert (got["zero_shot"], got["before"], got["after"]) == (0.0, 0.25, 0.5)
  assert got["gain"] == 0.25 and got["zero_variance_frac"] == 0.5 and got["rollouts"] == 96
  assert got["episodes_per_s"] == pytest.approx(96 / 30)
  results = real_model.collect(str(tmp_path), [0, 1], ["tasks", "credit"])
  assert set(results["tasks"]["gem"]["seeds"]) == {"0", "1"}
  assert results["tasks"]["gem"]["seeds"]["1"]["zero_shot"] == 0.0
  assert set(results["tasks"]["calculator"]["seeds"]) == {"0"}  # seed 1 not finished
  assert results["tasks"]["reasoning"]["seeds"] == {}
  assert results["studies"]["credit"]["gigpo"] == {}
  md = real_model.tables(results)
  assert ("| gem | 0.000 ± 0.000 (2) | 0.375 ± 0.125 (2) | 0.500 ± 0.000 (2) | "
          "+0.125 ± 0.125 (2) |") in md
  assert "| reasoning | — | — | — | — | — |" in md
  assert "## Tasks: held-out success, sampled at temperature 1 (pass@1)" in md
  real_model.write(results, str(tmp_path / "out"), "cmd")
  with open(tmp_path / "out" / "results.json") as f:
    written = json.load(f)
  assert written["tasks"]["gem"]["seeds"]["1"]["before"] == 0.5
  assert {"tasks.png", "credit.png", "results.md"} <= set(os.listdir(tmp_path / "out"))


@pytest.mark.slow
def test_the_driver_runs_resumes_and_writes_at_the_tiny_scale(tmp_path, monkeypatch):
  monkeypatch.setattr(runs_lib, "STUDIES", {"tasks": ("calculator_rl",), "credit": ("rl", "gigpo")})
  real_model.run(str(tmp_path), [0], ["tasks", "credit"], tiny=True)
  root = tmp_path / "seed0"
  assert sorted(os.listdir(root)) == ["calculator_gigpo", "calculator_rl", "calculator_sft"]
  results = real_model.collect(str(tmp_path), [0], ["tasks", "credit"])
  warm = results["tasks"]["calculator"]["seeds"]["0"]
  gigpo = results["studies"]["credit"]["gigpo"]["0"]
  # Every arm starts from its seed's one warm start.
  assert gigpo["before"] == warm["before"] and gigpo["zero_shot"] == warm["zero_shot"]
  mtime = os.path.getmtime(root / "calculator_rl" / "summary.json")
  real_model.run(str(tmp_path), [0], ["tasks", "credit"], tiny=True)  # finished: not rerun
  assert os.path.getmtime(root / "calculator_rl" / "summary.json") == mtime
