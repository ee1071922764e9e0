"""The long-horizon studies: every arm's command line is a valid config with
the arm's keys; a run's numbers and the table."""

import json
import os

import pytest
from agentic_rl.train import config as config_lib
from experiments import long_horizon
from experiments.configs import default


def _config_of(study, arm, seed, tiny):
  """The config of a run's command line."""
  variant, overrides = long_horizon.arm_config(study, arm, seed, tiny)
  variants = ",".join(filter(None, ("all", variant)))
  cfg = default.get_config(variants)
  for dotted, value in overrides.items():
    *path, key = dotted.split(".")
    node = cfg
    for part in path:
      node = node[part]
    node[key] = value
  cmd = long_horizon.command(study, arm, seed, "/tmp/x", tiny)
  assert f"--config=experiments/configs/default.py:{variants}" in cmd
  assert all(f"--config.{k}={v}" in cmd for k, v in overrides.items())
  return cfg


@pytest.mark.parametrize("tiny", [False, True])
def test_every_arm_is_a_valid_config(tiny):
  for study, spec in long_horizon.STUDIES.items():
    for arm, overrides in spec["arms"].items():
      cfg = _config_of(study, arm, 3, tiny)
      config_lib.validate(cfg)
      assert cfg.seed == 3
      for dotted, value in overrides.items():
        node = cfg
        for part in dotted.split("."):
          node = node[part]
        assert node == value, (study, arm, dotted)
  ledger = _config_of("context", "summary", 0, False)
  assert ledger.tasks.host_env == "ledger" and ledger.context.policy == "summary"
  assert ledger.sft.steps == long_horizon.SCALE["sft.steps"]


def test_summary_and_table(tmp_path):
  run = tmp_path / "context" / "seed0" / "summary"
  run.mkdir(parents=True)
  (run / "summary.json").write_text(json.dumps(
      {"sft_success": 0.5, "rl_success": 0.75, "wall_s": 10.0}))
  records = [{"step": i, "reward/outcome": 0.5, "episode/context_resets": float(i),
              "episode/peak_context_tokens": 200.0, "reward/tokens_per_success": 30.0}
             for i in range(4)]
  (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  got = long_horizon.summarise(str(run))
  assert got["rl_success"] == 0.75 and got["resets"] == 1.5 and got["peak_context"] == 200
  results = {"context": {"summary": {"0": got}}}
  md = long_horizon.table(results, "context")
  assert "| summary | 50.0% ± 0.0% | 75.0% ± 0.0% | 50.0% ± 0.0% | 1.5 ± 0.0 | 200.0 ± 0.0 |" in md
  long_horizon.write(results, str(tmp_path / "out"), "cmd")
  assert os.path.exists(tmp_path / "out" / "results.json")
  assert "(0 min of runs," in (tmp_path / "out" / "results.md").read_text()
