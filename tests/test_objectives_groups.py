"""Advantages over grouped batches (equal or ragged) and per turn."""

import numpy as np
import pytest

from agentic_rl import objectives


def test_group_layout_sizes_and_refusals():
  equal = objectives.GroupLayout.of([0, 0, 1, 1], 2)
  assert equal.size == 2 and equal.sizes.tolist() == [2, 2]
  ragged = objectives.GroupLayout.of([0, 1, 1, 1], 2)
  assert ragged.size is None
  assert objectives.GroupLayout.of([0, 0, 1, 1], 3).size is None  # group 2 is empty
  kw = equal.monitor_kwargs()
  assert kw["num_groups"] == 2 and np.asarray(kw["group_B"]).tolist() == [0, 0, 1, 1]
  for bad, num in (([1, 0], 2), ([0, 2], 2), ([-1, 0], 2)):
    with pytest.raises(ValueError, match="non-decreasing"):
      objectives.GroupLayout.of(bad, num)


def test_group_advantages_equal_and_ragged_groups():
  grpo = objectives.make_advantage_fn(objectives.ObjectiveConfig(advantage="grpo"))
  rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0], np.float32)
  equal_layout = objectives.GroupLayout.of(np.repeat([0, 1], 4), 2)
  assert equal_layout.size == 4
  equal = objectives.group_advantages(grpo, rewards, equal_layout)
  np.testing.assert_allclose(equal, np.asarray(grpo(rewards.reshape(2, 4))).reshape(-1))
  ragged_layout = objectives.GroupLayout.of(np.array([0, 0, 0, 1, 1, 1, 1, 1]), 2)
  assert ragged_layout.size is None and ragged_layout.sizes.tolist() == [3, 5]
  ragged = objectives.group_advantages(grpo, rewards, ragged_layout)
  np.testing.assert_allclose(ragged[:3], np.asarray(grpo(rewards[None, :3]))[0])
  np.testing.assert_allclose(ragged[3:], np.asarray(grpo(rewards[None, 3:]))[0])


def test_group_advantages_pass_per_group_baselines():
  # ReMax: each row's reward minus its own prompt's greedy reward.
  remax = objectives.make_advantage_fn(objectives.ObjectiveConfig(advantage="remax"))
  rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.5], np.float32)
  greedy = np.array([0.5, 1.0], np.float32)
  want = rewards - np.array([0.5, 0.5, 0.5, 1.0, 1.0, 1.0])
  equal = objectives.group_advantages(remax, rewards, objectives.GroupLayout.of(
      np.repeat([0, 1], 3), 2), greedy_rewards_P=greedy)
  np.testing.assert_allclose(equal, want)
  ragged = objectives.group_advantages(remax, rewards[1:], objectives.GroupLayout.of(
      np.array([0, 0, 1, 1, 1]), 2), greedy_rewards_P=greedy)
  np.testing.assert_allclose(ragged, want[1:])


def test_turn_advantages_are_rebn_on_each_turns_tokens():
  rebn = objectives.make_advantage_fn(objectives.ObjectiveConfig(advantage="rebn"))
  # Row 0: three turns (rewards 0, 0.5, 1); row 1: one turn, and the shaping
  # took 0.25 off its episode reward (it goes to the last turn).
  got = objectives.turn_advantages(
      rebn, np.array([[0.0, 0.5, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], np.float32),
      np.array([3, 1]), np.array([[0, 0, 1, 1, 2, 3, 3, 0], [0, 1, 1, 1, 0, 0, 0, 0]]),
      episode_bonus_B=np.array([0.0, -0.25], np.float32))
  returns = np.array([0.5 * 0.9 + 0.81, 0.5 + 0.9, 1.0, 0.75])  # gamma 0.9
  adv = (returns - returns.mean()) / (returns.std() + 1e-6)
  want = np.array([[0, 0, adv[0], adv[0], adv[1], adv[2], adv[2], 0],
                   [0, adv[3], adv[3], adv[3], 0, 0, 0, 0]])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


