"""Toggle (Kimi K2.5): budget phases, per-prompt budgets, the penalty, and
the trainer applying them."""

import dataclasses

import numpy as np
import pytest
from flax import struct

from agentic_rl import objectives
from agentic_rl.objectives import toggle
from agentic_rl.train import checkpoint, loop, rl
from agentic_rl.train import config as config_lib
from experiments.configs import default

_CFG = toggle.ToggleConfig(phase_iterations=2, accuracy_threshold=0.5, percentile=50.0,
                           penalty=0.5)


def test_budget_phases_alternate_every_m_iterations():
  assert [toggle.budget_phase(_CFG, t) for t in range(6)] == [1, 1, 0, 0, 1, 1]
  assert not any(toggle.budget_phase(toggle.ToggleConfig(), t) for t in range(4))  # off


def test_the_penalty_hits_over_budget_rollouts_of_solved_prompts_in_budget_phases():
  # Groups: 0 solved (2/3 > 0.5), 1 unsolved (1/3), 2 solved with no budget
  # of its own: the shared one, 21; 3 solved with no budget at all.
  success = np.array([1, 1, 0, 1, 0, 0, 1, 1, 1, 1, 1, 1], bool)
  lengths = np.array([5, 12, 20, 30, 5, 5, 50, 50, 10, 50, 50, 50])
  group = np.repeat([0, 1, 2, 3], 3)
  budget_N1 = np.array([10, 10, -1, -1, 21], np.float32)
  budget = toggle.prompt_budgets(budget_N1, np.repeat([0, 1, 2, 3], 3))
  np.testing.assert_array_equal(budget, np.repeat([10, 10, 21, 21], 3))
  rewards = success.astype(np.float32)
  got, over = toggle.budget_rewards(_CFG, rewards, lengths, success, group, 4, budget, step=1)
  np.testing.assert_array_equal(over, [0, 1, 0, 0, 0, 0, 1, 1, 0, 1, 1, 1])  # not failures
  np.testing.assert_allclose(got, [1, 0.5, 0, 1, 0, 0, 0.5, 0.5, 1, 0.5, 0.5, 0.5])
  same, none = toggle.budget_rewards(_CFG, rewards, lengths, success, group, 4, budget, step=2)
  np.testing.assert_array_equal(same, rewards)
  assert not none.any()
  # Before any budget is known nothing is penalised.
  unknown = toggle.prompt_budgets(toggle.init_budgets(4), np.repeat([0, 1, 2, 3], 3))
  _, none = toggle.budget_rewards(_CFG, rewards, lengths, success, group, 4, unknown, step=1)
  assert not none.any()


def test_a_budget_is_set_once_from_successful_lengths():
  budget = toggle.init_budgets(4)
  prompt = np.array([0, 0, 0, 1, 1, 2])
  lengths = np.array([10, 20, 90, 7, 9, 4])
  success = np.array([1, 1, 0, 0, 0, 1], bool)
  budget = toggle.update_budgets(_CFG, budget, prompt, lengths, success)
  # The median of 10 and 20, none, 4, none; the shared one the median of 10, 20, 4.
  np.testing.assert_array_equal(budget, [15, -1, 4, -1, 10])
  again = toggle.update_budgets(_CFG, budget, prompt * 0 + 3, lengths * 0 + 1, success)
  np.testing.assert_array_equal(again, [15, -1, 4, 1, 10])  # set ones stay fixed
  assert toggle.tokens_per_success(lengths, success) == pytest.approx(34 / 3)
  assert toggle.tokens_per_success(lengths, np.zeros(6, bool)) == 0.0


@pytest.mark.parametrize("bad, says", [
    (dict(phase_iterations=-1), "phase_iterations"), (dict(percentile=101.0), "percentile"),
    (dict(accuracy_threshold=1.0), "accuracy_threshold"), (dict(penalty=0.0), "penalty"),
    (dict(budget=3), "toggle")])
def test_bad_toggle_settings_are_refused_before_compiling(bad, says):
  cfg = default.get_config("all,tiny")
  for key, value in bad.items():
    cfg.rl.toggle[key] = value
  with pytest.raises(config_lib.ConfigError, match=says):
    config_lib.validate(cfg)


@struct.dataclass
class _Batch:
  reward_B: np.ndarray
  truncated_B: np.ndarray
  length_B: np.ndarray
  status_B: np.ndarray
  loss_mask_BxT: np.ndarray
  reward_components: dict


@struct.dataclass
class _Sampled:
  prompt_ids: np.ndarray


def test_the_rl_stage_shapes_with_the_budgets_and_learns_them():
  success = np.array([1, 1, 0, 0], bool)
  tokens = np.array([4, 8, 8, 2])
  mask = (np.arange(10)[None] < tokens[:, None]).astype(np.float32)
  batch = _Batch(success.astype(np.float32), np.zeros(4, bool), tokens + 3,
                 np.zeros(4, np.int32), mask, {"outcome": success.astype(np.float32)})
  layout = objectives.GroupLayout.of(np.array([0, 0, 1, 1]), 2)
  collected = rl.Collected(batch, layout, _Sampled(np.array([7, 3])), None, 0.0, step=0)
  cfg = config_lib.validate(default.get_config("all,tiny"))
  stage = rl.RLStage(2, 2, 1, sampling=None, objective=None, needs=frozenset(),
                     signal_cfg=config_lib.signal_config(cfg["rl"]),
                     shift_cfg=config_lib.shift_config(cfg["rl"]),
                     explore_cfg=config_lib.exploration_config(cfg["rl"]), step_fn=None,
                     state_sharding=None,
                     toggle_cfg=dataclasses.replace(_CFG, accuracy_threshold=0.4))
  budget = toggle.init_budgets(10)
  budget[7] = 5.0
  shaped = rl.shape_rewards(stage, collected, budget)
  np.testing.assert_allclose(shaped.rewards_B, [1, 0.5, 0, 0])  # row 1: 8 tokens > 5
  learnt = toggle.update_budgets(stage.toggle_cfg, toggle.init_budgets(10), collected.prompt_B,
                                 rl.policy_tokens(batch), success)
  assert learnt[7] == 6.0 and learnt[3] == -1  # the median of 4 and 8
  assert learnt[-1] == 6.0  # the shared budget, from the whole batch
  shared = toggle.init_budgets(10)
  shared[-1] = 5.0  # prompt 7 has no budget of its own: the shared one applies
  np.testing.assert_allclose(rl.shape_rewards(stage, collected, shared).rewards_B,
                             [1, 0.5, 0, 0])


def test_toggle_through_the_trainer_alternates_phases_and_checkpoints_budgets(tmp_path):
  cfg = default.get_config("all,tiny")
  cfg.stages = ("rl",)
  cfg.rl.toggle.phase_iterations = 1
  loop.train(cfg, str(tmp_path))
  records = [r for r in _metrics(tmp_path) if "reward/toggle_budget_phase" in r]
  assert [r["reward/toggle_budget_phase"] for r in records] == [1.0, 0.0, 1.0]
  assert all("reward/tokens_per_success" in r for r in records)
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2)
  try:
    tree, _ = ckpt.restore(ckpt.latest_step())
  finally:
    ckpt.close()
  assert np.asarray(tree["budget"]).shape == (cfg.tasks.train_size + 1,)


def _metrics(workdir):
  from agentic_rl.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  return metrics_lib.read_metrics(str(workdir / "metrics.jsonl"))
