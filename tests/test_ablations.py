"""The ablation arms: each is a valid config that differs from its study's
first arm only in its controller, and shares its study's warm start."""

import json

import pytest

from agentic_rl.train import config as config_lib
from experiments import ablate
from experiments.configs import ablations, default


@pytest.mark.parametrize("arm", [*dict.fromkeys(ablations.WARM_STARTS.values()), *ablations.ARMS])
def test_every_arm_validates(arm):
  config_lib.validate(ablations.get_config(arm))
  config_lib.validate(ablations.get_config(f"{arm},tiny"))


def _leaves(cfg, prefix=""):
  out = {}
  for k, v in cfg.items():
    if hasattr(v, "items"):
      out.update(_leaves(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


@pytest.mark.parametrize("study", list(ablations.STUDIES))
def test_arms_share_the_warm_start_and_differ_only_in_their_overrides(study):
  arms = ablations.STUDIES[study]
  sft = ablations.get_config(ablations.WARM_STARTS[study])
  first = _leaves(ablations.get_config(arms[0]))
  for arm in arms:
    cfg = ablations.get_config(arm)
    assert cfg.stages == ("sft", "rl") and ablations.warm_start(arm) == ablations.WARM_STARTS[study]
    # Everything an SFT checkpoint depends on is the shared one's.
    for section in ("model", "sft", "sampling", "seed"):
      assert cfg[section] == sft[section], (arm, section)
    for key in ("families", "weights", "difficulty"):
      assert cfg.tasks[key] == sft.tasks[key], (arm, key)
    # Only the arm's overrides (and their study's first arm's) differ.
    leaves = _leaves(cfg)
    changed = {k for k in leaves if leaves[k] != first[k]}
    assert changed <= set(ablations.ARMS[arm]) | set(ablations.ARMS[arms[0]]), (arm, changed)


def test_the_studies_settings():
  # The signal study's first arm is the default RL stage on its recurring
  # pool, stopped at its episode budget.
  base, ref = ablations.get_config("uniform").rl, default.get_config("all").rl
  assert {k for k in ref if ref[k] != base[k]} == {"iterations", "rollout_budget", "signal"}
  assert base.rollout_budget == 20 * base.prompts_per_step * base.group_size
  assert ablations.get_config("uniform").tasks.train_size == 64
  # The exploration study's demonstrations are mostly linear search, which a
  # three-turn limit cuts short.
  boxes = ablations.get_config("boxes_none")
  assert boxes.tasks.families == ("boxes",) and boxes.sampling.max_turns == 3
  assert boxes.sft.strategy_weights.boxes == (0.6, 0.2, 0.2)
  # The shift study runs the asynchronous actor.
  assert all(ablations.get_config(a).rl.actor == "async" for a in ablations.STUDIES["shift"])
  assert [ablations.get_config(f"async{s}").rl.max_staleness for s in (0, 1, 2, 4, 8)] == [
      0, 1, 2, 4, 8]
  # The studies keep the default run's settings they were measured with.
  for arm in ("sft", "sft_boxes", "uniform", "boxes_none", "async8"):
    cfg = ablations.get_config(arm)
    assert (cfg.sft.steps, cfg.rl.signal.max_extra_rollout_frac, cfg.eval.pass_k_prompts) == (
        400, 2.0, 32), arm
    assert cfg.rl.iterations == (60 if arm == "uniform" else 20), arm
  # The host study plays a GEM game through the host path, warm-started on
  # its expert's noisy games, and pays RL for finding the number.
  gem = ablations.get_config("gem")
  assert (gem.tasks.source, gem.tasks.host_env) == ("host", "gem:game:GuessTheNumber-v0-easy")
  assert (gem.sft.steps, gem.sft.demo_noise, gem.tasks.host_reward, gem.rl.prompts_per_step) == (
      30, 0.35, "success", 16)
  assert ablations.get_config("sft_gem").stages == ("sft",)


def test_unknown_arm_or_variant():
  with pytest.raises(ValueError, match="unknown ablation arm"):
    ablations.get_config("knapsak")
  with pytest.raises(ValueError, match="variant"):
    ablations.get_config("uniform,huge")


def test_ablate_refuses_unknown_studies_and_the_host_study_without_gem(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match="unknown studies"):
    ablate.run(str(tmp_path), [0], ["signal", "sigal"])
  real = ablate.importlib.util.find_spec
  monkeypatch.setattr(ablate.importlib.util, "find_spec",
                      lambda name, *a: None if name == "gem" else real(name, *a))
  with pytest.raises(ValueError, match=r"pip install -e '.\[gem\]'"):
    ablate.run(str(tmp_path), [0], ["signal", "host"])
  assert not list(tmp_path.iterdir())  # refused before any run started


def test_rerunning_one_study_keeps_the_others_results(tmp_path):
  old = {"seeds": [0, 1], "studies": {"signal": ["uniform"], "host": ["gem"]},
         "runs": {"uniform": "U", "gem": "G0"}, "warm_start_wall_s": {"signal": 1.0, "host": 2.0},
         "command": "all"}
  (tmp_path / "results.json").write_text(json.dumps(old))
  new = {"seeds": [0, 1], "studies": {"host": ["gem"]}, "runs": {"gem": "G1"},
         "warm_start_wall_s": {"host": 3.0}}
  got = ablate.merged(new, str(tmp_path), "host only")
  assert list(got["studies"]) == ["signal", "host"]
  assert got["runs"] == {"uniform": "U", "gem": "G1"}
  assert got["warm_start_wall_s"] == {"signal": 1.0, "host": 3.0}
  assert got["commands"] == {"signal": "all", "host": "host only"}
  assert new["studies"] == {"host": ["gem"]}  # the argument is left as it was
  # Other seeds: nothing to keep.
  assert list(ablate.merged(dict(new, seeds=[0]), str(tmp_path), "x")["studies"]) == ["host"]
