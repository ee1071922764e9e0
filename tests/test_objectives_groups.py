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




def test_turn_states_are_the_observations_each_turn_starts_from():
  # Turn k starts from segment k's tokens the policy did not write: the
  # prompt, then each observation. Rows 0 and 1 share the prompt and their
  # first observation (tokens 7 7); row 2 shares row 0's prompt but is in
  # another group; row 1's second turn saw a different observation.
  P, A, O = 0, 1, 2  # prompt / action / observation tokens below
  tokens = np.array([[5, 6, 9, 7, 7, 9, 0], [5, 6, 8, 7, 7, 8, 4], [5, 6, 9, 0, 0, 0, 0]])
  kind = np.array([[P, P, A, O, O, A, P], [P, P, A, O, O, A, O], [P, P, A, P, P, P, P]])
  turn = np.array([[0, 0, 1, 1, 1, 2, 0], [0, 0, 1, 1, 1, 2, 2], [0, 0, 1, 0, 0, 0, 0]])
  mask = (kind == A).astype(np.float32)
  states = objectives.turn_states(tokens, turn, mask, np.array([6, 7, 3]), np.array([2, 2, 1]),
                                  np.array([0, 0, 1]), max_turns=3)
  np.testing.assert_array_equal(states, [[0, 1, -1], [0, 1, -1], [2, -1, -1]])
  # With a third turn each, row 0's starts from nothing (position 6 is past
  # its length: padding), row 1's from the observation 4.
  states = objectives.turn_states(tokens, turn, mask, np.array([6, 7, 3]), np.array([3, 3, 1]),
                                  np.array([0, 0, 1]), max_turns=3)
  np.testing.assert_array_equal(states, [[0, 1, 2], [0, 1, 3], [4, -1, -1]])


def test_turn_advantages_pass_gigpo_its_states_and_leave_out_invalid_rows():
  gigpo = objectives.make_advantage_fn(objectives.ObjectiveConfig(
      advantage="gigpo", advantage_kwargs={"ddof": 0}))
  turn_rewards = np.array([[0.0, 1.0], [0.0, 0.0], [9.0, 9.0]], np.float32)
  turn = np.array([[0, 1, 1, 2], [0, 1, 2, 2], [0, 1, 2, 0]])
  args = (gigpo, turn_rewards, np.array([2, 2, 2]), turn)
  kw = dict(state_BxN=np.array([[0, 1], [0, 1], [0, 1]]), group_B=np.zeros(3, np.int64))
  got = objectives.turn_advantages(*args, valid_B=np.array([True, True, False]), **kw)
  # Two valid episodes, R = (1, 0): A^E = +-1; turn 0: G = (0.95, 0), A^S = +-1;
  # turn 1: G = (1, 0), A^S = +-1. The failed row gets nothing.
  np.testing.assert_allclose(got, [[0, 2, 2, 2], [0, -2, -2, -2], [0, 0, 0, 0]], atol=1e-4)
  with_failed = objectives.turn_advantages(*args, **kw)
  assert not np.allclose(with_failed[:2], got[:2])
