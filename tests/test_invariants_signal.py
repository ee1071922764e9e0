"""Tests of the learning-signal invariant (I2): monitors, Knapsack, allocators, prompt selection."""

import itertools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.invariants import signal
from agentic_rl.invariants.segments import uniform_group_ids
from agentic_rl.invariants.rng import host_rng
from agentic_rl.invariants.signal import SignalConfig

SETTINGS = hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
FEW = hypothesis.settings(max_examples=10, deadline=None, derandomize=True)


# ----------------------------------------------------------------------------- monitors


def test_zero_variance_frac_hand_computed():
  success = np.array([[1, 1, 1], [0, 0, 0], [1, 0, 1], [0, 1, 0]], bool)
  np.testing.assert_allclose(signal.zero_variance_frac(success), 0.5)


def test_signal_metrics_hand_computed_jit_and_no_jit():
  success = np.array([[1, 1], [0, 1]], bool)
  adv = np.array([0.0, 0.0, -1.0, 1.0], np.float32)  # per sequence
  mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], np.float32)
  weight = mask.copy()
  weight[2, 0] = 0.0  # one token with an advantage but masked by a correction
  expected_std = np.std(np.array([0, 0, 0, -1, -1, -1, 1], np.float32))
  for fn in (signal.signal_metrics, jax.jit(signal.signal_metrics)):
    m = fn(success, adv, mask, weight)
    np.testing.assert_allclose(m["signal/zero_variance_frac"], 0.5)
    np.testing.assert_allclose(m["signal/all_correct_frac"], 0.5)
    np.testing.assert_allclose(m["signal/all_wrong_frac"], 0.0)
    np.testing.assert_allclose(m["signal/success_mean"], 0.75)
    np.testing.assert_allclose(m["signal/adv_std"], expected_std, rtol=1e-6)
    np.testing.assert_allclose(m["signal/effective_token_frac"], 3 / 7, rtol=1e-6)
    for value in m.values():
      chex.assert_shape(value, ())
      chex.assert_type(value, jnp.float32)


def test_signal_metrics_per_token_advantages_match_broadcast():
  success = np.array([[1, 0], [1, 1]], bool)
  adv_b = np.array([0.5, -0.5, 0.0, 0.0], np.float32)
  mask = np.ones((4, 3), np.float32)
  a = signal.signal_metrics(success, adv_b, mask)
  b = signal.signal_metrics(success, np.repeat(adv_b[:, None], 3, axis=1), mask)
  for k in a:
    np.testing.assert_allclose(a[k], b[k])


def test_ragged_layout_matches_uniform():
  rng = np.random.default_rng(0)
  success = rng.random((5, 4)) < 0.5
  perm = rng.permutation(20)
  group = uniform_group_ids(5, 4)[perm]
  np.testing.assert_allclose(
      signal.zero_variance_frac(success),
      signal.zero_variance_frac(success.reshape(-1)[perm], group, 5))
  # Ragged: groups of 1, 2 and 3; a single rollout is always zero-variance.
  ragged = np.array([True, True, False, True, True, True])
  np.testing.assert_allclose(signal.zero_variance_frac(ragged, np.array([0, 1, 1, 2, 2, 2]), 3),
                             2 / 3)


def test_monitor_shape_errors():
  with pytest.raises(ValueError, match=r"\[P, G"):
    signal.zero_variance_frac(np.array([True, False]))
  with pytest.raises(ValueError, match="rows"):
    signal.signal_metrics(np.ones((2, 2), bool), np.zeros(4), np.ones((3, 5)))
  with pytest.raises(ValueError, match="advantages"):
    signal.signal_metrics(np.ones((2, 2), bool), np.zeros((4, 2)), np.ones((4, 5)))
  with pytest.raises(ValueError, match="num_groups"):
    signal.zero_variance_frac(np.ones(4, bool), np.zeros(4, np.int32), None)


# ----------------------------------------------------------------------------- Knapsack


def test_knapsack_value_hand_computed():
  np.testing.assert_allclose(signal.knapsack_value(2, 0.5), 0.5 * 0.5 * 0.25)
  np.testing.assert_allclose(signal.knapsack_value(1, 0.3), 0.0, atol=1e-15)
  np.testing.assert_allclose(signal.knapsack_value(5, 0.0), 0.0)
  np.testing.assert_allclose(signal.knapsack_value(5, 1.0), 0.0)
  # InfoGain p (1 - p)^2 peaks at p = 1/3.
  p = np.linspace(0.01, 0.99, 99)
  assert abs(p[np.argmax(signal.knapsack_value(1000, p))] - 1 / 3) < 0.011


def _brute_force(p, total, n_min, n_max):
  best = -np.inf
  for budgets in itertools.product(range(n_min, n_max + 1), repeat=len(p)):
    if sum(budgets) == total:
      best = max(best, float(np.sum(signal.knapsack_value(np.array(budgets), p))))
  return best


@SETTINGS
@hypothesis.given(
    p=st.lists(st.sampled_from([0.0, 0.05, 0.2, 1 / 3, 0.5, 0.7, 0.95, 1.0])
               | st.floats(0.0, 1.0), min_size=1, max_size=4),
    n_min=st.integers(1, 3), span=st.integers(0, 4), slack=st.floats(0.0, 1.0))
def test_knapsack_matches_brute_force(p, n_min, span, slack):
  p = np.array(p)
  n_max = n_min + span
  total = len(p) * n_min + round(slack * len(p) * span)
  budgets = signal.allocate_budget(p, total, n_min, n_max)
  chex.assert_shape(budgets, (len(p),))
  assert budgets.sum() == total
  assert budgets.min() >= n_min and budgets.max() <= n_max
  np.testing.assert_allclose(np.sum(signal.knapsack_value(budgets, p)),
                             _brute_force(p, total, n_min, n_max), rtol=1e-12, atol=1e-15)


def test_knapsack_favours_p_near_one_third():
  budgets = signal.allocate_budget(np.array([0.005, 1 / 3, 0.995]), 24, 2, 64)
  np.testing.assert_array_equal(budgets, [3, 19, 2])  # the brute-force optimum


@SETTINGS
@hypothesis.given(mid=st.lists(st.floats(0.25, 0.45), min_size=2, max_size=4),
                  hard=st.lists(st.floats(0.0, 0.01), min_size=1, max_size=2),
                  easy=st.lists(st.floats(0.95, 1.0), min_size=1, max_size=2),
                  group_size=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_knapsack_gives_mid_prompts_more_than_extreme_ones(mid, hard, easy, group_size, seed):
  p = np.array(mid + hard + easy)
  order = np.random.default_rng(seed).permutation(len(p))
  budgets = signal.allocate_budget(p[order], len(p) * group_size, 2, 64)[np.argsort(order)]
  assert budgets[:len(mid)].min() > budgets[len(mid):].max()


def test_knapsack_ties_are_deterministic():
  a = signal.allocate_budget(np.array([0.0, 1.0, 0.0]), 12, 2, 8)
  b = signal.allocate_budget(np.array([0.0, 1.0, 0.0]), 12, 2, 8)
  np.testing.assert_array_equal(a, b)
  assert a.sum() == 12


@pytest.mark.parametrize("args, match", [
    ((np.array([0.5, 0.5]), 3, 2, 8), "infeasible"),
    ((np.array([0.5, 0.5]), 17, 2, 8), "infeasible"),
    ((np.array([0.5, 1.5]), 8, 2, 8), r"\[0, 1\]"),
    ((np.array([0.5, np.nan]), 8, 2, 8), "finite"),
    ((np.array([]), 0, 2, 8), "non-empty"),
    ((np.array([0.5]), 4, 0, 8), "n_min"),
    ((np.array([0.5]), 4, 3, 2), "n_max"),
    ((np.array([0.5]), 4.0, 2, 8), "total"),
])
def test_knapsack_rejects_bad_input(args, match):
  with pytest.raises(ValueError, match=match):
    signal.allocate_budget(*args)


# ----------------------------------------------------------------------------- allocators


def _coin_sampler(p_true, log=None):
  """``sample_fn`` with P(success) = p_true[prompt]; records every call's
  output. Its rollouts name their prompt, call and outcome."""

  def sample_fn(prompt_ids, n, key):
    out = host_rng(key).random((len(prompt_ids), n)) < p_true[prompt_ids][:, None]
    rollouts = None
    if log is not None:
      log.append((np.asarray(prompt_ids).copy(), n, out))
      rollouts = {"prompt": np.repeat(prompt_ids, n), "outcome": out.reshape(-1),
                  "call": np.full(out.size, len(log) - 1)}
    return out, rollouts

  return sample_fn


def _draw(num_prompts):
  return lambda n, key: host_rng(key).choice(num_prompts, n, replace=False)


def _check_provenance(batch, log):
  """Every kept rollout is the recorded output it claims to be, of its group's prompt."""
  kept = batch.rollouts
  np.testing.assert_array_equal(kept["outcome"], batch.success)
  np.testing.assert_array_equal(kept["prompt"], batch.prompt_ids[batch.group])
  assert np.all(np.diff(batch.group) >= 0)
  generated = batch.generated
  assert len(generated["prompt"]) == batch.metrics["signal/rollouts"] == len(batch.generated_ids)
  np.testing.assert_array_equal(generated["prompt"], batch.generated_ids)
  np.testing.assert_array_equal(generated["call"], np.concatenate(
      [np.full(ids.size * n, c) for c, (ids, n, _) in enumerate(log)]))
  np.testing.assert_array_equal(generated["outcome"], np.concatenate(
      [out.reshape(-1) for _, _, out in log]))


@FEW
@hypothesis.given(seed=st.integers(0, 2**16), num_groups=st.integers(1, 6),
                  group_size=st.integers(2, 5))
def test_dynamic_sampling_has_no_zero_variance_group_when_cap_allows(seed, num_groups, group_size):
  p_true = np.random.default_rng(seed).uniform(0.2, 0.8, size=50)
  log = []
  batch = signal.dynamic_sampling(_coin_sampler(p_true, log), _draw(50), np.arange(num_groups),
                                  group_size, 200 * num_groups * group_size, jax.random.key(seed))
  assert batch.metrics["signal/ds_filled_degenerate"] == 0
  assert float(signal.zero_variance_frac(batch.success_PxG())) == 0.0
  chex.assert_shape(batch.success_PxG(), (num_groups, group_size))
  assert batch.metrics["signal/rollouts"] == sum(len(ids) * n for ids, n, _ in log)
  _check_provenance(batch, log)


def test_dynamic_sampling_respects_the_cap_and_fills_with_degenerate_groups():
  p_true = np.array([0.0, 1.0] * 10)  # every group is degenerate
  log = []
  batch = signal.dynamic_sampling(_coin_sampler(p_true, log), _draw(20), np.arange(4), 3, 20,
                                  jax.random.key(0))
  assert batch.metrics["signal/extra_rollouts"] <= 20
  assert batch.metrics["signal/ds_filled_degenerate"] == 4
  assert batch.metrics["signal/sampled_zero_variance_frac"] == 1.0
  assert float(signal.zero_variance_frac(batch.success_PxG())) == 1.0
  _check_provenance(batch, log)
  # Cap 0: the uniform batch, one call.
  batch = signal.dynamic_sampling(_coin_sampler(p_true), _draw(20), np.arange(4), 3, 0,
                                  jax.random.key(0))
  assert batch.num_calls == 1 and batch.metrics["signal/extra_rollouts"] == 0


def test_dynamic_sampling_is_deterministic_given_key():
  p_true = np.linspace(0.05, 0.95, 30)
  runs = [signal.dynamic_sampling(_coin_sampler(p_true, []), _draw(30), np.arange(5), 4, 80,
                                  jax.random.key(3)) for _ in range(2)]
  for field in ("prompt_ids", "group", "success", "generated_ids"):
    np.testing.assert_array_equal(getattr(runs[0], field), getattr(runs[1], field))
  chex.assert_trees_all_equal(runs[0].rollouts, runs[1].rollouts)


def test_adaptive_sampling_rounds_and_down_sampling():
  p_true = np.array([0.5, 0.0, 1.0, 0.1])
  log = []
  batch = signal.adaptive_sampling(_coin_sampler(p_true, log), np.arange(4), group_size=4,
                                   round_size=4, max_rounds=5, min_pos=1, min_neg=1,
                                   key=jax.random.key(0))
  success = batch.success_PxG()
  chex.assert_shape(success, (4, 4))
  _check_provenance(batch, log)
  # Prompts that can never be mixed use every round; others stop once mixed.
  np.testing.assert_array_equal(batch.group_attempts[1:3], [20, 20])
  assert not success[1].any() and success[2].all()
  for g in (0, 3):
    if 0 < batch.group_successes[g] < batch.group_attempts[g]:
      assert 0 < success[g].sum() < 4
  np.testing.assert_array_equal(batch.group_attempts.sum(), batch.metrics["signal/rollouts"])
  np.testing.assert_array_equal(
      batch.group_successes,
      [sum(out[list(ids).index(p)].sum() for ids, _, out in log if p in ids) for p in range(4)])


def test_adaptive_sampling_balanced_keeps_half_and_half():
  p_true = np.full(6, 0.3)
  batch = signal.adaptive_sampling(_coin_sampler(p_true), np.arange(6), group_size=4,
                                   round_size=4, max_rounds=50, min_pos=2, min_neg=2,
                                   key=jax.random.key(1))
  np.testing.assert_array_equal(batch.success_PxG().sum(axis=1), np.full(6, 2))
  assert batch.metrics["signal/ada_unresolved_frac"] == 0.0


def test_adaptive_sampling_rejects_bad_settings():
  with pytest.raises(ValueError, match="round_size"):
    signal.adaptive_sampling(_coin_sampler(np.ones(2)), np.arange(2), 4, 2, 3, 1, 1,
                             jax.random.key(0))
  with pytest.raises(ValueError, match="exceeds the group size"):
    signal.adaptive_sampling(_coin_sampler(np.ones(2)), np.arange(2), 4, 4, 3, 3, 2,
                             jax.random.key(0))


def test_sample_fn_output_is_checked():
  with pytest.raises(ValueError, match="sample_fn must return bool"):
    signal.uniform_sampling(lambda ids, n, key: (np.zeros((len(ids), n)), None), np.arange(2),
                            2, jax.random.key(0))
  with pytest.raises(ValueError, match=r"must return \(success, rollouts\)"):
    signal.uniform_sampling(lambda ids, n, key: np.zeros((len(ids), n), bool), np.arange(2),
                            2, jax.random.key(0))


def test_allocate_rollouts_dispatch():
  p_true = np.linspace(0.0, 1.0, 12)
  history = signal.update_history(signal.init_history(12), np.arange(12), p_true * 10, 10)
  key = jax.random.key(0)
  ids = np.arange(2, 10)
  logs = {a: [] for a in ("uniform", "dynamic", "ada", "knapsack")}
  batches = {a: signal.allocate_rollouts(SignalConfig(allocation=a), _coin_sampler(p_true, log),
                                         ids, 4, key, draw_prompts=_draw(12), history=history)
             for a, log in logs.items()}
  for name, batch in batches.items():
    assert batch.num_groups == 8, name
    _check_provenance(batch, logs[name])
  np.testing.assert_array_equal(batches["uniform"].group, uniform_group_ids(8, 4))
  knapsack = batches["knapsack"]
  sizes = np.bincount(knapsack.group, minlength=8)
  np.testing.assert_array_equal(
      sizes, signal.knapsack_budgets(SignalConfig(allocation="knapsack"), history, ids, 4))
  assert sizes.sum() == 32 and len(set(sizes.tolist())) > 1
  with pytest.raises(ValueError, match="ragged"):
    knapsack.success_PxG()
  with pytest.raises(ValueError, match="draw_prompts"):
    signal.allocate_rollouts(SignalConfig(allocation="dynamic"), _coin_sampler(p_true), ids, 4, key)
  with pytest.raises(ValueError, match="history"):
    signal.allocate_rollouts(SignalConfig(allocation="knapsack"), _coin_sampler(p_true), ids, 4,
                             key)


def test_allocators_lower_zero_variance_against_uniform():
  """On a mix of easy, hard and mid prompts, dynamic sampling and Knapsack beat uniform."""
  rng = np.random.default_rng(0)
  p_true = np.concatenate([rng.uniform(0.0, 0.05, 20), rng.uniform(0.95, 1.0, 20),
                           rng.uniform(0.2, 0.6, 20)])
  history = signal.update_history(signal.init_history(60), np.arange(60),
                                  np.round(p_true * 16), 16)
  zv = {a: [] for a in ("uniform", "dynamic", "knapsack")}
  for seed in range(4):
    key = jax.random.key(seed)
    ids = host_rng(key).choice(60, 16, replace=False)
    for a in zv:
      batch = signal.allocate_rollouts(SignalConfig(allocation=a), _coin_sampler(p_true), ids, 4,
                                       key, draw_prompts=_draw(60), history=history)
      zv[a].append(float(signal.zero_variance_frac(batch.success, batch.group, batch.num_groups)))
  assert np.mean(zv["dynamic"]) < np.mean(zv["uniform"])
  assert np.mean(zv["knapsack"]) < np.mean(zv["uniform"])


# ----------------------------------------------------------------------------- history and prompts


def test_history_update_and_posterior_mean():
  h = signal.init_history(4)
  h = signal.update_history(h, np.array([0, 0, 2]), np.array([1, 0, 3]), np.array([1, 1, 4]))
  np.testing.assert_allclose(h.successes, [1, 0, 3, 0])
  np.testing.assert_allclose(h.attempts, [2, 0, 4, 0])
  np.testing.assert_allclose(signal.success_rates(h, prior_successes=1, prior_failures=1),
                             [2 / 4, 1 / 2, 4 / 6, 1 / 2])
  h2 = signal.update_history(h, np.array([2]), np.array([0]), 2, decay=0.5)
  np.testing.assert_allclose(h2.successes, [1, 0, 1.5, 0])
  np.testing.assert_allclose(h2.attempts, [2, 0, 4, 0])
  np.testing.assert_allclose(h.successes, [1, 0, 3, 0])  # the old history is unchanged
  per_rollout = signal.update_history(signal.init_history(4), np.array([0, 0, 2, 2, 2]),
                                      np.array([True, False, True, True, False]))
  np.testing.assert_allclose(per_rollout.successes, [1, 0, 2, 0])
  np.testing.assert_allclose(per_rollout.attempts, [2, 0, 3, 0])
  with pytest.raises(ValueError, match=r"\[0, 4\)"):
    signal.update_history(h, np.array([4]), np.array([0]), 1)
  with pytest.raises(ValueError, match="attempts"):
    signal.update_history(h, np.array([1]), np.array([3]), 2)


def test_prioritised_and_curriculum_probabilities():
  h = signal.update_history(signal.init_history(4), np.arange(4), np.array([0, 2, 8, 4]), 8)
  cfg = SignalConfig(prompt_sampling="prioritised", prior_successes=1.0, prior_failures=1.0)
  weights = 1 - (np.array([0, 2, 8, 4]) + 1) / 10
  np.testing.assert_allclose(signal.prompt_probabilities(cfg, h), weights / weights.sum())
  np.testing.assert_allclose(signal.prompt_probabilities(SignalConfig(), h), np.full(4, 0.25))
  cur = SignalConfig(curriculum=((0, 0, 1), (10, 2, 3)))
  difficulty = np.array([0, 1, 2, 3])
  np.testing.assert_allclose(signal.prompt_probabilities(cur, h, 9, difficulty), [.5, .5, 0, 0])
  np.testing.assert_allclose(signal.prompt_probabilities(cur, h, 10, difficulty), [0, 0, .5, .5])
  ids = signal.select_prompts(cur, h, 2, jax.random.key(0), step=12, difficulty_N=difficulty)
  assert sorted(ids.tolist()) == [2, 3]
  with pytest.raises(ValueError, match="eligible"):
    signal.select_prompts(cur, h, 3, jax.random.key(0), step=12, difficulty_N=difficulty)
  with pytest.raises(ValueError, match="difficulty"):
    signal.prompt_probabilities(cur, h, 0)


def test_select_prompts_distinct_and_deterministic():
  h = signal.init_history(20)
  cfg = SignalConfig(prompt_sampling="prioritised")
  a = signal.select_prompts(cfg, h, 10, jax.random.key(5))
  b = signal.select_prompts(cfg, h, 10, jax.random.key(5))
  np.testing.assert_array_equal(a, b)
  assert len(set(a.tolist())) == 10


# ----------------------------------------------------------------------------- truncation


def test_overlong_penalty_dapo_values():
  lengths = np.array([10, 16, 18, 20, 21, 5])
  truncated = np.array([False, False, False, False, False, True])
  np.testing.assert_allclose(signal.overlong_penalty(lengths, truncated, 20, 4),
                             [0, 0, -0.5, -1, -1, -1])
  np.testing.assert_allclose(signal.overlong_penalty(lengths, truncated), [0, 0, 0, 0, 0, -1])


def test_shape_truncated_modes():
  rewards = np.array([1.0, 0.0, 1.0])
  truncated = np.array([False, True, False])
  lengths = np.array([4, 9, 7])
  r, w = signal.shape_truncated(SignalConfig(), rewards, truncated, lengths)
  np.testing.assert_allclose(r, rewards)
  np.testing.assert_allclose(w, [1, 1, 1])
  r, w = jax.jit(signal.shape_truncated, static_argnums=0)(
      SignalConfig(truncation="mask"), rewards, truncated, lengths)
  np.testing.assert_allclose(w, [1, 0, 1])
  cfg = SignalConfig(truncation="penalty", overlong_max_len=8, overlong_cache_len=2,
                     overlong_penalty_coef=0.5)
  r, w = signal.shape_truncated(cfg, rewards, truncated, lengths)
  np.testing.assert_allclose(r, [1.0, -0.5, 1.0 - 0.25])
  np.testing.assert_allclose(w, [1, 1, 1])


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs, match", [
    (dict(allocation="greedy"), "allocation"),
    (dict(knapsack_n_min=0), "knapsack_n_min"),
    (dict(knapsack_n_min=4, knapsack_n_max=3), "knapsack_n_max"),
    (dict(max_extra_rollout_frac=-1.0), "max_extra_rollout_frac"),
    (dict(history_decay=0.0), "history_decay"),
    (dict(prior_successes=0.0), "prior_successes"),
    (dict(curriculum=((5, 0, 1),)), "step 0"),
    (dict(curriculum=((0, 0, 1), (0, 1, 2))), "increase"),
    (dict(curriculum=((0, 3, 1),)), "min_difficulty"),
    (dict(truncation="clip"), "truncation"),
    (dict(overlong_max_len=4, overlong_cache_len=5), "overlong_cache_len"),
    (dict(overlong_cache_len=5), "overlong_max_len"),
    (dict(bands=(("explore/entropy", signal.config.Band(low=0.1)),)), "invariant"),
])
def test_config_rejects_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SignalConfig(**kwargs)


def test_config_group_size_checks():
  with pytest.raises(ValueError, match="ada_round_size"):
    SignalConfig(allocation="ada", ada_round_size=2).validate_group_size(4)
  with pytest.raises(ValueError, match="exceeds the group size"):
    SignalConfig(allocation="ada", ada_min_pos=3, ada_min_neg=2).validate_group_size(4)
  with pytest.raises(ValueError, match="knapsack_n_min"):
    SignalConfig(allocation="knapsack", knapsack_n_min=8).validate_group_size(4)
  SignalConfig(allocation="ada", ada_min_pos=2, ada_min_neg=2).validate_group_size(4)
