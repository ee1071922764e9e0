"""The distillation study: every run's command line is a valid config with
its keys; the retention table from per-seed numbers."""

import json
import os

import pytest

import train_commands
from agentic_rl.train import config as config_lib
from experiments import distill_study


def _config_of(name, seed, root, tiny):
  return train_commands.config_of(*distill_study.run_config(name, seed, root, tiny))


@pytest.mark.parametrize("tiny", [False, True])
def test_every_run_is_a_valid_config(tiny, tmp_path):
  for family in distill_study.FAMILIES:  # the student's teachers exist
    (tmp_path / "seed3" / f"expert_{family}" / "checkpoints").mkdir(parents=True)
  configs = {name: _config_of(name, 3, str(tmp_path), tiny) for name in distill_study.RUNS}
  for cfg in configs.values():
    config_lib.validate(cfg)
    assert cfg.seed == 3 and cfg.stages[0] == "sft"
  for family in distill_study.FAMILIES:
    assert configs[f"expert_{family}"].rl.families == (family,)
    assert configs["student"].distill.teachers[family] == str(
        tmp_path / "seed3" / f"expert_{family}")
  sequential = configs["sequential"]
  assert sequential.stages[1:] == tuple(f"rl_{f}" for f in distill_study.FAMILIES)
  for f in distill_study.FAMILIES:  # each stage at the experts' RL scale
    expert = configs["expert_" + f].rl
    assert sequential[f"rl_{f}"].iterations == expert.iterations
    assert sequential[f"rl_{f}"].signal == expert.signal
  assert configs["student"].stages == ("sft", "distill")
  if not tiny:  # the default run's settings the study was measured with
    for cfg in configs.values():
      assert (cfg.sft.steps, cfg.eval.pass_k_prompts) == (400, 32)
    assert configs["expert_boxes"].rl.iterations == sequential.rl_boxes.iterations == 40
    assert configs["expert_boxes"].rl.signal.max_extra_rollout_frac == 2.0


def test_success_and_table(tmp_path, monkeypatch):
  a, b = "calc_chain", "multihop"  # two families, whatever the default's
  experts = (f"expert_{a}", f"expert_{b}")
  monkeypatch.setattr(distill_study, "FAMILIES", (a, b))
  monkeypatch.setattr(distill_study, "EXPERTS", experts)
  monkeypatch.setattr(distill_study, "RUNS", (*experts, "sequential", "student"))
  stages = {"expert_" + a: ("sft", "rl"), "expert_" + b: ("sft", "rl"),
            "sequential": ("sft", f"rl_{a}", f"rl_{b}"), "student": ("sft", "distill")}
  numbers = {"expert_" + a: (0.8, 0.2), "expert_" + b: (0.2, 0.5), "sequential": (0.4, 0.5),
             "student": (0.8, 0.45)}
  for name, (sa, sb) in numbers.items():
    run = tmp_path / "seed0" / name
    run.mkdir(parents=True)
    last = stages[name][-1]
    (run / "config.json").write_text(json.dumps({"stages": stages[name]}))
    (run / "summary.json").write_text(json.dumps({
        f"sft_success/{a}": 0.1, f"sft_success/{b}": 0.3, f"{last}_success/{a}": sa,
        f"{last}_success/{b}": sb, "wall_s": 60.0}))
  results = distill_study.collect(str(tmp_path), [0])
  assert results["student"]["0"] == {a: 0.8, b: 0.45, f"sft/{a}": 0.1, f"sft/{b}": 0.3,
                                     "wall_s": 60.0}
  md = distill_study.table(results)
  assert "| student | 20.0% ± 0.0% | 80.0% ± 0.0% | 45.0% ± 0.0% | 100% ± 0% | 90% ± 0% |" in md
  assert "| sequential | 20.0% ± 0.0% | 40.0% ± 0.0% | 50.0% ± 0.0% | 50% ± 0% | 100% ± 0% |" in md
  distill_study.write(results, str(tmp_path / "out"), "cmd")
  assert "(4 min of runs," in (tmp_path / "out" / "results.md").read_text()
  assert os.path.exists(tmp_path / "out" / "results.json")
