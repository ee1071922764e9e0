"""Advantage estimators: hand-computed examples, properties and errors."""

import functools
import itertools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.objectives import ADVANTAGE_ESTIMATORS, broadcast_turn_advantages, get_advantage_fn

# Estimators that compare samples within a group, with the kwargs that make them so.
GROUP_ESTIMATORS = {
    "grpo": {}, "dr_grpo": {}, "rloo": {}, "kimi": {}, "pass_at_k": {"k": 2},
    "reinforce_pp": {"group_baseline": True},
}


def test_registry_lists_every_estimator():
  assert set(ADVANTAGE_ESTIMATORS) == {
      "grpo", "dr_grpo", "rloo", "kimi", "remax", "reinforce_pp", "rebn", "gigpo",
      "pass_at_k"}
  with pytest.raises(ValueError, match="unknown advantage estimator 'gae'.*grpo.*rloo"):
    get_advantage_fn("gae")


def test_grpo_hand_example():
  # r = (1, 0, 0, 1): mean 0.5; sample std sqrt(4 * 0.25 / 3) = 0.5773503;
  # population std 0.5.
  r = jnp.array([[1.0, 0.0, 0.0, 1.0]])
  adv = get_advantage_fn("grpo")(r)
  chex.assert_shape(adv, (1, 4))
  assert adv.dtype == jnp.float32
  a = 0.5 / (0.5773503 + 1e-6)
  np.testing.assert_allclose(adv, [[a, -a, -a, a]], rtol=1e-6)
  np.testing.assert_allclose(get_advantage_fn("grpo")(r, ddof=0),
                             [[0.999998, -0.999998, -0.999998, 0.999998]], rtol=1e-6)


def test_dr_grpo_is_r_minus_mean_exactly():
  r = jnp.asarray(np.random.default_rng(0).normal(size=(5, 6)), jnp.float32)
  np.testing.assert_array_equal(get_advantage_fn("dr_grpo")(r), r - r.mean(axis=-1, keepdims=True))
  np.testing.assert_array_equal(get_advantage_fn("kimi")(r), r - r.mean(axis=-1, keepdims=True))
  np.testing.assert_array_equal(get_advantage_fn("dr_grpo")(jnp.array([[3.0, 1.0, 2.0]])),
                                [[1.0, -1.0, 0.0]])


def test_rloo_uses_the_other_samples():
  # A_i = r_i - mean of the other two: 3 - 1.5, 1 - 2.5, 2 - 2.
  np.testing.assert_allclose(get_advantage_fn("rloo")(jnp.array([[3.0, 1.0, 2.0]])),
                             [[1.5, -1.5, 0.0]])
  r = np.random.default_rng(1).normal(size=(4, 5)).astype(np.float32)
  expected = [[r[p, i] - np.delete(r[p], i).mean() for i in range(5)] for p in range(4)]
  np.testing.assert_allclose(get_advantage_fn("rloo")(r), expected, rtol=1e-5, atol=1e-6)


def test_remax_subtracts_greedy_reward():
  adv = get_advantage_fn("remax")(jnp.array([[1.0, 0.0], [0.5, 1.0]]), jnp.array([0.5, 1.0]))
  np.testing.assert_allclose(adv, [[0.5, -0.5], [-0.5, 0.0]])
  # One sample per prompt is fine: the baseline is not the group.
  np.testing.assert_allclose(get_advantage_fn("remax")(jnp.array([[1.0]]), jnp.array([0.0])),
                             [[1.0]])
  with pytest.raises(ValueError, match="greedy rewards shaped"):
    get_advantage_fn("remax")(jnp.ones((2, 3)), jnp.ones((3,)))


def test_reinforce_pp_hand_example():
  r = jnp.array([[1.0, 0.0], [0.0, 0.0]])
  # Global: mean 0.25, sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5.
  np.testing.assert_allclose(get_advantage_fn("reinforce_pp")(r),
                             [[1.5, -0.5], [-0.5, -0.5]], rtol=1e-5)
  # Group baseline first: (0.5, -0.5, 0, 0), std sqrt(0.5 / 3) = 0.4082483.
  a = 0.5 / 0.4082483
  np.testing.assert_allclose(get_advantage_fn("reinforce_pp")(r, group_baseline=True),
                             [[a, -a], [0.0, 0.0]], rtol=1e-5)
  # Without the baseline a single sample per prompt is fine.
  np.testing.assert_allclose(get_advantage_fn("reinforce_pp")(jnp.array([[2.0], [0.0]])),
                             [[1 / (2 ** 0.5)], [-1 / (2 ** 0.5)]], rtol=1e-5)


def test_rebn_hand_example():
  # gamma 0.5. Episode 0 rewards (0, 0, 1): returns (0.25, 0.5, 1). Episode 1
  # rewards (1, 0, pad): returns (1, 0). Over the 5 transitions: mean 0.55,
  # population std 0.4.
  rewards = jnp.array([[0.0, 0.0, 1.0], [1.0, 0.0, 7.0]])
  mask = jnp.array([[1, 1, 1], [1, 1, 0]])
  adv = get_advantage_fn("rebn")(rewards, mask, gamma=0.5)
  np.testing.assert_allclose(adv, [[-0.75, -0.125, 1.125], [1.125, -1.375, 0.0]], rtol=1e-5)
  # gamma = 1: returns are reward-to-go sums.
  adv1 = get_advantage_fn("rebn")(rewards, mask, gamma=1.0, eps=0.0)
  returns = np.array([1.0, 1.0, 1.0, 1.0, 0.0])
  expected = (returns - returns.mean()) / returns.std()
  np.testing.assert_allclose(adv1[mask != 0], expected, rtol=1e-6)


def test_rebn_uniform_batch_gives_zero():
  adv = get_advantage_fn("rebn")(jnp.zeros((3, 4)), jnp.ones((3, 4)))
  np.testing.assert_array_equal(adv, jnp.zeros((3, 4)))


def test_gigpo_hand_example():
  # One group of four two-turn episodes, gamma 0.95, population std (ddof 0).
  # Returns R = (1, 0, 1, 0): A^E = (1, -1, 1, -1). Turn 0 starts from the
  # prompt (state 0) for all: G_0 = (0.95, 0, 1, 0), mean 0.4875, std
  # 0.48784, A^S_0 = (0.9481, -0.9993, 1.0506, -0.9993). Turn 1: episodes 0,
  # 2 and 3 saw observation 1, G_1 = (1, 0, 0), mean 1/3, std 0.4714,
  # A^S = (1.4142, -0.7071, -0.7071); episode 1's observation 2 is its own
  # step group: 0.
  rewards = jnp.array([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
  states = jnp.array([[0, 1], [0, 2], [0, 1], [0, 1]])
  adv = get_advantage_fn("gigpo")(rewards, jnp.ones((4, 2), bool), states, jnp.zeros(4, int),
                                  ddof=0)
  g0 = np.array([0.95, 0.0, 1.0, 0.0])
  a0 = (g0 - g0.mean()) / (g0.std() + 1e-6)
  a1 = np.array([2 / 3, -1 / 3, -1 / 3]) / (np.sqrt(2 / 9) + 1e-6)
  np.testing.assert_allclose(adv, [[1 + a0[0], 1 + a1[0]], [-1 + a0[1], -1.0],
                                   [1 + a0[2], 1 + a1[1]], [-1 + a0[3], -1 + a1[2]]], rtol=1e-5)
  # Without normalisation: plain deviations from the group means.
  raw = get_advantage_fn("gigpo")(rewards, jnp.ones((4, 2), bool), states, jnp.zeros(4, int),
                                  normalise=False, step_weight=0.5)
  np.testing.assert_allclose(raw[:, 0], np.array([0.5, -0.5, 0.5, -0.5]) + 0.5 * (g0 - g0.mean()),
                             rtol=1e-5)
  np.testing.assert_allclose(raw[1, 1], -0.5)


def test_gigpo_groups_do_not_mix_and_padding_is_left_out():
  # Two groups with the same state ids: each is normalised on its own; a
  # padded turn and an episode with no valid turn count nowhere.
  rewards = jnp.array([[1.0, 9.0], [0.0, 9.0], [1.0, 0.0], [5.0, 5.0], [1.0, 0.0]])
  mask = jnp.array([[1, 0], [1, 0], [1, 1], [0, 0], [1, 1]], bool)
  states = jnp.array([[0, 1], [0, 1], [0, 1], [0, 1], [0, 2]])
  group = jnp.array([0, 0, 1, 1, 1])
  adv = np.asarray(get_advantage_fn("gigpo")(rewards, mask, states, group))
  np.testing.assert_array_equal(adv[:, 1][[0, 1, 3]], 0.0)
  np.testing.assert_array_equal(adv[3], 0.0)
  # Group 1's two live episodes have equal returns and each turn 1 its own
  # state: all zero. Group 0: deviations +-0.5 at both levels over the
  # sample std sqrt(0.5).
  np.testing.assert_array_equal(adv[[2, 4]], 0.0)
  np.testing.assert_allclose(adv[:2, 0], np.array([1.0, -1.0]) / (np.sqrt(0.5) + 1e-6),
                             rtol=1e-5)


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), w=st.sampled_from([0.0, 0.5, 1.0]))
def test_gigpo_on_single_turn_episodes_is_a_multiple_of_grpo(seed, w):
  rewards_PxG = np.random.default_rng(seed).integers(0, 3, size=(3, 4)).astype(np.float32)
  adv = get_advantage_fn("gigpo")(rewards_PxG.reshape(12, 1), jnp.ones((12, 1), bool),
                                  jnp.zeros((12, 1), int), jnp.repeat(jnp.arange(3), 4),
                                  step_weight=w)
  np.testing.assert_allclose(np.asarray(adv).reshape(3, 4),
                             (1 + w) * np.asarray(get_advantage_fn("grpo")(rewards_PxG)),
                             rtol=1e-5, atol=1e-6)


def test_gigpo_jit_matches_eager_and_refuses_bad_input():
  rng = np.random.default_rng(0)
  args = (rng.random((6, 3)).astype(np.float32), rng.random((6, 3)) > 0.2,
          rng.integers(0, 2, (6, 3)), np.repeat(np.arange(2), 3))
  fn = functools.partial(get_advantage_fn("gigpo"), gamma=0.9)
  np.testing.assert_allclose(jax.jit(fn)(*args), fn(*args), rtol=1e-6)
  with pytest.raises(ValueError, match="one shape"):
    fn(args[0], args[1], args[2][:, :2], args[3])
  with pytest.raises(ValueError, match="step_weight"):
    fn(*args, step_weight=-1.0)


def test_broadcast_turn_advantages():
  turn_adv = jnp.array([[0.5, -1.0], [2.0, 3.0]])
  turn_index = jnp.array([[-1, 0, 0, 1, -1], [-1, -1, 1, 1, 1]])
  np.testing.assert_array_equal(broadcast_turn_advantages(turn_adv, turn_index),
                                [[0.0, 0.5, 0.5, -1.0, 0.0], [0.0, 0.0, 3.0, 3.0, 3.0]])


def test_pass_at_k_hand_example():
  # N = 4, k = 2, two failures: R_bar = 1 - C(2,2)/C(4,2) = 5/6,
  # sigma = sqrt(5/36) = 0.372678, A_pos = (1/6)/sigma = 0.4472136,
  # A_neg = (1/6 - C(1,1)/C(3,1)) / sigma = -0.4472136.
  adv = get_advantage_fn("pass_at_k")(jnp.array([[1.0, 0.0, 0.0, 1.0]]), k=2)
  np.testing.assert_allclose(adv, [[0.4472136, -0.4472136, -0.4472136, 0.4472136]], rtol=1e-6)
  # N = 4, k = 2, one failure: R_bar = 1, sigma = 0 -> no signal.
  np.testing.assert_array_equal(
      get_advantage_fn("pass_at_k")(jnp.array([[1.0, 1.0, 0.0, 1.0]]), k=2), [[0.0] * 4])


def test_pass_at_k_matches_subset_enumeration():
  """A_i * sigma = E[max r over k-subsets containing i] - E[max r over all k-subsets]."""
  rewards = (np.random.default_rng(3).random((8, 6)) < 0.5).astype(np.float32)
  for k in range(1, 7):
    subsets = list(itertools.combinations(range(6), k))
    adv = np.asarray(get_advantage_fn("pass_at_k")(rewards, k=k))
    for r, a in zip(rewards, adv):
      r_bar = np.mean([r[list(s)].max() for s in subsets])
      sigma = np.sqrt(r_bar * (1 - r_bar))
      for i in range(6):
        with_i = np.mean([r[list(s)].max() for s in subsets if i in s])
        expected = (with_i - r_bar) / sigma if sigma > 0 else 0.0
        np.testing.assert_allclose(a[i], expected, rtol=1e-5, atol=1e-6)


def test_pass_at_1_is_grpo_with_population_std():
  r = jnp.array([[1.0, 0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0, 1.0]])
  np.testing.assert_allclose(get_advantage_fn("pass_at_k")(r, k=1),
                             get_advantage_fn("grpo")(r, ddof=0, eps=0.0), rtol=1e-6)


def test_pass_at_k_bad_k():
  with pytest.raises(ValueError, match=r"k must be an integer in \[1, group size 4\]"):
    get_advantage_fn("pass_at_k")(jnp.ones((2, 4)), k=5)


@pytest.mark.parametrize("name", sorted(GROUP_ESTIMATORS))
def test_equal_rewards_give_zero_advantage(name):
  # 0.1 is not exact in binary: a naive r - mean(r) is not exactly 0.
  r = jnp.array([[0.1] * 7, [1.0] * 7, [0.0] * 7, [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]])
  adv = get_advantage_fn(name)(r, **GROUP_ESTIMATORS[name])
  np.testing.assert_array_equal(adv[:3], 0.0)
  assert np.all(np.isfinite(adv)) and np.any(adv[3] != 0)


@pytest.mark.parametrize("name", sorted(GROUP_ESTIMATORS))
def test_group_size_one_is_a_clear_error(name):
  with pytest.raises(ValueError, match="group of at least 2 samples per prompt, got group size 1"):
    get_advantage_fn(name)(jnp.ones((4, 1)), **GROUP_ESTIMATORS[name])


def test_bad_shapes_and_hyper_parameters():
  with pytest.raises(ValueError, match=r"rewards shaped \[prompts, group\]"):
    get_advantage_fn("grpo")(jnp.ones(8))
  with pytest.raises(ValueError, match="ddof"):
    get_advantage_fn("grpo")(jnp.ones((2, 4)), ddof=2)
  with pytest.raises(ValueError, match="gamma"):
    get_advantage_fn("rebn")(jnp.ones((2, 4)), jnp.ones((2, 4)), gamma=1.5)
  with pytest.raises(ValueError, match="same shape"):
    get_advantage_fn("rebn")(jnp.ones((2, 4)), jnp.ones((2, 3)))


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), group=st.sampled_from([2, 5]))
def test_group_estimators_are_centred_and_finite(seed, group):
  """Mean-baseline estimators sum to zero within each group; all are finite."""
  r = np.random.default_rng(seed).integers(0, 2, size=(3, group)).astype(np.float32)
  for name, kwargs in GROUP_ESTIMATORS.items():
    if name == "pass_at_k":
      kwargs = {"k": min(2, group)}
    adv = np.asarray(get_advantage_fn(name)(r, **kwargs))
    assert np.all(np.isfinite(adv)), name
    if name != "pass_at_k":
      np.testing.assert_allclose(adv.sum(axis=-1), 0.0, atol=1e-5, err_msg=name)


def test_jit_matches_eager():
  r = jnp.asarray(np.random.default_rng(2).integers(0, 2, size=(3, 4)), jnp.float32)
  for name, kwargs in GROUP_ESTIMATORS.items():
    fn = functools.partial(get_advantage_fn(name), **kwargs)
    np.testing.assert_allclose(jax.jit(fn)(r), fn(r), rtol=1e-6, err_msg=name)
  rebn = functools.partial(get_advantage_fn("rebn"), gamma=0.9)
  mask = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
  np.testing.assert_allclose(jax.jit(rebn)(r, mask), rebn(r, mask), rtol=1e-6)
