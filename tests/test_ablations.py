"""The ablation arms: each is a valid config that differs from the default only
in its controller."""

import pytest

from agentic_rl.train import config as config_lib
from experiments.configs import ablations, default


@pytest.mark.parametrize("arm", ["sft", *ablations.ARMS])
def test_every_arm_validates(arm):
  config_lib.validate(ablations.get_config(arm))
  config_lib.validate(ablations.get_config(f"{arm},tiny"))


def test_arms_share_the_warm_start_and_differ_only_in_their_overrides():
  sft = ablations.get_config("sft")
  for arm, overrides in ablations.ARMS.items():
    cfg = ablations.get_config(arm)
    assert cfg.stages == ("sft", "rl")
    # Everything an SFT checkpoint depends on is the shared one's.
    for section in ("model", "tasks", "sft", "sampling", "seed"):
      assert cfg[section] == sft[section], (arm, section)
    base = ablations.get_config("dynamic")
    for dotted, value in overrides.items():
      node = cfg
      for part in dotted.split("."):
        node = node[part]
      assert node == value
    # Only the overridden keys of the RL stage differ from the default arm.
    changed = {k for k in cfg.rl if cfg.rl[k] != base.rl[k]}
    assert changed <= {d.split(".")[1] for d in overrides}, (arm, changed)
  # The "dynamic" arm is the default RL stage, shortened.
  base, ref = ablations.get_config("dynamic").rl, default.get_config().rl
  assert {k for k in ref if ref[k] != base[k]} == {"iterations"}


def test_unknown_arm_or_variant():
  with pytest.raises(ValueError, match="unknown ablation arm"):
    ablations.get_config("knapsak")
  with pytest.raises(ValueError, match="variant"):
    ablations.get_config("uniform,huge")
