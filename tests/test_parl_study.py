"""The PARL study: every run's command line is a valid config with its
keys; the table from per-seed numbers."""

import json
import os

import train_commands
from agentic_rl.train import config as config_lib
from experiments import common, parl_study


def _run_dir(path):
  (path / "checkpoints").mkdir(parents=True)
  (path / "config.json").write_text("{}")


def test_every_run_is_a_valid_config(tmp_path, monkeypatch):
  _run_dir(tmp_path / "sub_agent")
  commands = []
  monkeypatch.setattr(common, "train_once", lambda *a: commands.append(a))
  parl_study.run(str(tmp_path), [2], jobs=1, tiny=False)
  [sub, *orchestrators] = [train_commands.config_of(*c[1:3]) for c in commands]
  config_lib.validate(sub)
  assert sub.tasks.families == ("multihop",)
  assert [c[0] for c in commands[1:]] == [str(tmp_path / "seed2" / a) for a in parl_study.ARMS]
  for arm, cfg in zip(parl_study.ARMS, orchestrators):
    config_lib.validate(cfg)
    assert cfg.parl.charge == arm and cfg.seed == 2
    assert cfg.parl.max_critical_steps == (6 if arm == "critical" else 0) and cfg.tasks.host_env == "parallel_hops"
    assert json.loads(cfg.tasks.host_kwargs)["questions"] == 3
    assert json.loads(cfg.parl.agents) == {"hop": str(tmp_path / "sub_agent")}
    # The study's own warm start; the rest as the study was measured.
    assert cfg.sft.steps == 300 and cfg.eval.pass_k_prompts == 32
  assert sub.sft.steps == 400 and sub.rl.signal.max_extra_rollout_frac == 2.0


def test_measures_and_table(tmp_path):
  for arm, (spawns, critical) in {"critical": (4.0, 5.0), "total": (0.0, 9.0)}.items():
    run = tmp_path / "seed0" / arm
    run.mkdir(parents=True)
    evals = [{"step": 0, "eval/success": 0.5, "eval/parl/spawns": 2.0,
              "eval/parl/critical_steps": 7.0, "eval/parl/total_steps": 9.5},
             {"step": 2, "eval/success": 0.75, "eval/parl/spawns": spawns,
              "eval/parl/critical_steps": critical, "eval/parl/total_steps": 10.0}]
    train = {"step": 1, "parl/spawns": 1.0, "parl/critical_steps": 8.0, "reward/outcome": 0.5}
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in
                                                 (evals[0], train, evals[1])) + "\n")
    (run / "summary.json").write_text(json.dumps({"wall_s": 120.0}))
  results = parl_study.collect(str(tmp_path), [0])
  assert results["critical"]["0"]["rl"]["eval/parl/spawns"] == 4.0
  assert results["total"]["0"]["curve"]["parl/critical_steps"] == [8.0]
  md = parl_study.table(results)
  assert "| critical | warm start | 50.0% ± 0.0% | 2.00 ± 0.00 | 7.00 ± 0.00 | 9.50 ± 0.00 |" in md
  assert "| total | RL | 75.0% ± 0.0% | 0.00 ± 0.00 | 9.00 ± 0.00 | 10.00 ± 0.00 |" in md
  parl_study.write(results, str(tmp_path / "out"), "cmd")
  assert "(4 min of orchestrator runs," in (tmp_path / "out" / "results.md").read_text()
  assert os.path.exists(tmp_path / "out" / "results.json")
