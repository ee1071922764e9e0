"""Tests of the distribution-shift invariant (I3): staleness, mismatch monitors, windowed FIFO."""

import math

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.invariants import shift
from agentic_rl.invariants.shift import ShiftConfig

B, T = 6, 8


def _batch(seed, current=10, max_lag=12):
  """Random per-token data: versions up to ``max_lag`` old, some non-policy tokens."""
  rng = np.random.default_rng(seed)
  mask = rng.random((B, T)) < 0.8
  version = np.where(mask, current - rng.integers(0, max_lag + 1, (B, T)), -1).astype(np.int32)
  behaviour = np.log(rng.uniform(0.05, 1.0, (B, T))).astype(np.float32)
  learner = (behaviour + rng.normal(0, 0.3, (B, T))).astype(np.float32)
  return mask, version, behaviour, learner


_weights = jax.jit(shift.shift_weights, static_argnums=0)


# ----------------------------------------------------------------------------- staleness


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True)
@hypothesis.given(seed=st.integers(0, 2**16), max_staleness=st.sampled_from([0, 2, 8]),
                  stale_mode=st.sampled_from(["drop", "downweight"]),
                  partial_rollout=st.sampled_from(["keep", "mask"]))
def test_no_token_older_than_max_staleness_enters_an_update(seed, max_staleness, stale_mode,
                                                            partial_rollout):
  cfg = ShiftConfig(max_staleness=max_staleness, stale_mode=stale_mode, stale_decay=0.5,
                    partial_rollout=partial_rollout)
  mask, version, _, _ = _batch(seed)  # versions forced up to 12 behind
  weights, stats = _weights(cfg, mask, version, jnp.int32(10))
  weights = np.asarray(weights)
  lag = 10 - version
  old = mask & (lag > max_staleness)
  assert old.any()
  assert np.all(weights[old] == 0)
  assert np.all(weights[~mask] == 0)
  assert float(stats["shift/update_staleness_max"]) <= max_staleness
  if partial_rollout == "keep":
    assert np.all(weights[mask & (lag <= max_staleness)] > 0)
  np.testing.assert_allclose(stats["shift/stale_dropped_frac"], old.sum() / mask.sum(), rtol=1e-6)


def test_staleness_weights_values():
  mask = np.array([[1, 1, 1, 1, 0]], bool)
  version = np.array([[4, 3, 2, 1, -1]], np.int32)
  drop = ShiftConfig(max_staleness=2)
  np.testing.assert_allclose(shift.staleness_weights(drop, version, mask, 4), [[1, 1, 1, 0, 0]])
  down = ShiftConfig(max_staleness=2, stale_mode="downweight", stale_decay=0.5)
  np.testing.assert_allclose(shift.staleness_weights(down, version, mask, 4),
                             [[1, 0.5, 0.25, 0, 0]])
  np.testing.assert_allclose(shift.staleness_weights(ShiftConfig(), version, mask, 4),
                             [[1, 1, 1, 1, 0]])


def test_partial_rollout_masks_older_segments():
  mask = np.array([[1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0]], bool)
  version = np.array([[3, 3, -1, 5, 5, -1], [2, 2, 2, 2, -1, -1]], np.int32)
  masked = shift.partial_rollout_weights(ShiftConfig(partial_rollout="mask"), version, mask)
  np.testing.assert_allclose(masked, [[0, 0, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
  kept = shift.partial_rollout_weights(ShiftConfig(), version, mask)
  np.testing.assert_allclose(kept, mask)


def test_shift_weights_jit_matches_no_jit_and_multiplies_controls():
  cfg = ShiftConfig(max_staleness=4, partial_rollout="mask", stale_mode="downweight",
                    stale_decay=0.7)
  mask, version, _, _ = _batch(7, max_lag=6)
  w_jit, s_jit = _weights(cfg, mask, version, 10)
  w, s = shift.shift_weights(cfg, mask, version, 10)
  np.testing.assert_allclose(w_jit, w, rtol=1e-6)
  for k in s:
    np.testing.assert_allclose(s_jit[k], s[k], rtol=1e-6)
  expected = (shift.staleness_weights(cfg, version, mask, 10)
              * shift.partial_rollout_weights(cfg, version, mask))
  np.testing.assert_allclose(w, expected, rtol=1e-6)
  np.testing.assert_allclose(s["shift/weight_zero_frac"], np.mean(expected[mask] == 0), rtol=1e-6)
  chex.assert_type(w, jnp.float32)
  chex.assert_shape(w, (B, T))


# ----------------------------------------------------------------------------- monitors


def test_shift_metrics_hand_computed():
  mask = np.array([[1, 1, 0], [1, 0, 0]], bool)
  version = np.array([[5, 3, -1], [4, -1, -1]], np.int32)
  behaviour = np.log(np.array([[0.5, 0.2, 0.9], [0.4, 0.3, 0.3]], np.float32))
  learner = np.log(np.array([[0.5, 0.4, 0.1], [0.2, 0.3, 0.3]], np.float32))
  m = jax.jit(shift.shift_metrics)(mask, behaviour, learner, version, 5)
  delta = np.array([0.0, math.log(2), math.log(0.5)])
  np.testing.assert_allclose(m["shift/staleness_mean"], 1.0)
  np.testing.assert_allclose(m["shift/staleness_max"], 2.0)
  np.testing.assert_allclose(m["shift/stale_token_frac"], 2 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["shift/logprob_mismatch_max"], math.log(2), rtol=1e-6)
  np.testing.assert_allclose(m["shift/prob_mismatch_max"], 0.2, rtol=1e-5)
  np.testing.assert_allclose(m["shift/kl_behaviour_learner"],
                             np.mean(np.exp(delta) - delta - 1), rtol=1e-5)
  np.testing.assert_allclose(m["shift/is_ratio_mean"], (1 + 2 + 0.5) / 3, rtol=1e-6)
  np.testing.assert_allclose(m["shift/is_ratio_max"], 2.0, rtol=1e-6)
  np.testing.assert_array_equal(shift.staleness_histogram(version, mask, 5, 2), [1, 2])
  np.testing.assert_array_equal(shift.staleness_histogram(version, mask, 5, 4), [1, 1, 1, 0])


def test_k3_kl_is_zero_on_policy_and_positive_off_policy():
  mask, version, behaviour, learner = _batch(3)
  m = shift.shift_metrics(mask, behaviour, behaviour, version, 10)
  np.testing.assert_allclose(m["shift/kl_behaviour_learner"], 0.0, atol=1e-7)
  np.testing.assert_allclose(m["shift/is_ratio_max"], 1.0)
  assert float(shift.shift_metrics(mask, behaviour, learner, version, 10)
               ["shift/kl_behaviour_learner"]) > 0


def test_check_versions():
  mask = np.array([[1, 1, 0]], bool)
  shift.check_versions(np.array([[2, 3, -1]]), mask, 3)
  with pytest.raises(ValueError, match="row 0"):
    shift.check_versions(np.array([[2, 4, -1]]), mask, 3)
  with pytest.raises(ValueError, match="version"):
    shift.check_versions(np.array([[-1, 3, -1]]), mask, 3)
  with pytest.raises(ValueError, match=r"\[B, T\]"):
    shift.shift_metrics(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 4)), np.ones((2, 3)), 0)


# ----------------------------------------------------------------------------- windowed FIFO


def test_fifo_queue_semantics():
  q = shift.launch(shift.init_queue(), [10, 11, 12, 13, 14])
  q = shift.finish(q, [11, 14])
  q2, got = shift.collect(q, 5, window=3)
  np.testing.assert_array_equal(got, [11])  # 14 is finished but outside the head window
  np.testing.assert_array_equal(q2.group_ids, [10, 12, 13, 14])
  q3, got = shift.collect(q, 5, window=None)
  np.testing.assert_array_equal(got, [11, 14])
  q4, got = shift.collect(shift.finish(q, [10, 12]), 2, window=3)
  np.testing.assert_array_equal(got, [10, 11])  # oldest first, at most max_groups
  np.testing.assert_array_equal(q4.group_ids, [12, 13, 14])
  with pytest.raises(ValueError, match="already queued"):
    shift.launch(q, [12])
  with pytest.raises(ValueError, match="not in the queue"):
    shift.finish(q, [99])
  reopened = shift.finish(q, [11], finished=False)  # 11's rollouts play again
  np.testing.assert_array_equal(reopened.finished, [False, False, False, False, True])
  assert shift.collect(reopened, 5, window=3)[1].size == 0
  assert shift.fifo_window(ShiftConfig(), 8) is None
  assert shift.fifo_window(ShiftConfig(fifo_window_ratio=1.5), 8) == 12


def _simulate(window, seed, batch_groups=4, in_flight=16, ticks=150):
  """Asynchronous generation: 16 groups always running, easy ones fast, hard ones slow.

  The trainer collects batches of 4 groups as they become available. Checks
  that every collected group was inside the head window, and returns the
  hard-minus-easy gap in launch-to-collection delay and the mean spread of
  launch order inside a batch.
  """
  rng = np.random.default_rng(seed)
  q = shift.init_queue()
  hard, launched_at, done_at, running = {}, {}, {}, set()
  batches, pending = [], []
  for now in range(ticks):
    while len(running) < in_flight:
      g = len(hard)
      hard[g] = rng.random() < 0.5
      launched_at[g] = now
      done_at[g] = now + (rng.integers(6, 12) if hard[g] else rng.integers(1, 3))
      q = shift.launch(q, [g])
      running.add(g)
    finished = [g for g in running if done_at[g] <= now]
    running -= set(finished)
    q = shift.finish(q, finished)
    head = set(q.group_ids[:window].tolist())
    q, got = shift.collect(q, batch_groups - len(pending), window)
    assert set(got.tolist()) <= head
    pending += [(g, now) for g in got.tolist()]
    if len(pending) == batch_groups:
      batches.append(pending)
      pending = []
  delay = {True: [], False: []}
  for batch in batches:
    for g, t in batch:
      delay[hard[g]].append(t - launched_at[g])
  spread = np.mean([max(g for g, _ in b) - min(g for g, _ in b) for b in batches])
  return np.mean(delay[True]) - np.mean(delay[False]), spread


def test_windowed_fifo_bounds_out_of_order_collection():
  greedy = np.mean([_simulate(None, s) for s in range(2)], axis=0)
  windowed = np.mean([_simulate(4, s) for s in range(2)], axis=0)
  # Greedy collection lets fast (easy) groups overtake: hard ones wait far longer
  # and batches mix groups launched far apart. The window bounds both.
  assert greedy[0] > 3.0
  assert windowed[0] < greedy[0] / 3
  assert windowed[1] < greedy[1] / 2


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_staleness=-1), "max_staleness"),
    (dict(stale_mode="decay"), "stale_mode"),
    (dict(stale_mode="downweight"), "needs max_staleness"),
    (dict(stale_decay=0.0), "stale_decay"),
    (dict(partial_rollout="correct"), "partial_rollout"),
    (dict(fifo_window_ratio=0.5), "fifo_window_ratio"),
    (dict(bands=(("explore/entropy", shift.config.Band(low=0.1)),)), "invariant"),
])
def test_config_rejects_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ShiftConfig(**kwargs)


def test_staleness_bound_tightens_out_of_band_and_loosens_back():
  from agentic_rl.invariants.alarms import Band  # pylint: disable=g-import-not-at-top
  cfg = shift.ShiftConfig(max_staleness=3, adaptive_staleness=True, staleness_patience=2,
                          bands=(("shift/kl_behaviour_learner", Band(high=0.1)),))
  state = shift.init_staleness_bound(cfg)
  bounds = []
  for kl in (0.5, 0.5, 0.01, 0.01, 0.01, 0.01, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0):
    state = shift.update_staleness_bound(cfg, state, kl)
    bounds.append(state.bound)
  assert bounds == [2, 1, 1, 2, 2, 3, 2, 2, 3, 3, 3, 3, 3]
  fixed = shift.ShiftConfig(max_staleness=3)
  assert shift.update_staleness_bound(fixed, shift.init_staleness_bound(fixed), 9.0).bound == 3
  with pytest.raises(ValueError, match="max_staleness >= 1"):
    shift.ShiftConfig(max_staleness=0, adaptive_staleness=True)
