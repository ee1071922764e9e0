"""Tests of the exploration invariant (I1): strategy monitors, entropy coefficient, temperature."""

import collections
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.invariants import exploration
from agentic_rl.invariants.alarms import Band
from agentic_rl.invariants.exploration import ExplorationConfig
from agentic_rl.invariants.segments import uniform_group_ids

# Two groups of four rollouts, up to four calls each (-1 pads).
HASHES = np.array([
    [[1, 2, 3, -1], [1, 2, 3, -1], [3, 2, 1, -1], [-1, -1, -1, -1]],
    [[5, -1, -1, -1], [5, 6, -1, -1], [5, -1, -1, -1], [7, 8, 9, 10]],
], np.int32)
SUCCESS = np.array([[1, 1, 1, 0], [0, 0, 0, 0]], bool)


def _random_hashes(rng, p, g, c, alphabet=3):
  """Random call sequences with many repeats; -1 (non-call steps, padding) anywhere."""
  hashes = rng.integers(0, alphabet, size=(p, g, c))
  return np.where(rng.random((p, g, c)) < 0.3, -1, hashes).astype(np.int32)


def _levenshtein(a, b):
  row = list(range(len(b) + 1))
  for i, x in enumerate(a, 1):
    prev, row[0] = row[0], i
    for j, y in enumerate(b, 1):
      prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
  return row[-1]


def _calls(row):
  return tuple(int(h) for h in row if h != -1)


# ----------------------------------------------------------------------------- monitors


def test_distinct_sequences_hand_computed():
  np.testing.assert_array_equal(exploration.distinct_sequences(HASHES), [3, 3])
  np.testing.assert_array_equal(exploration.distinct_sequences(HASHES, SUCCESS), [2, 0])


def test_non_call_steps_inside_a_row_are_ignored():
  interleaved = np.array([[[1, -1, 2, -1], [1, 2, -1, -1], [-1, 1, -1, 2], [2, 1, -1, -1]]],
                         np.int32)
  np.testing.assert_array_equal(exploration.compact_calls(interleaved[0, 0]), [1, 2, -1, -1])
  np.testing.assert_array_equal(exploration.distinct_sequences(interleaved), [2])
  # Three copies of [1, 2] and one [2, 1]: three of the six pairs at distance 2 / 2.
  np.testing.assert_allclose(exploration.pairwise_edit_distance(interleaved), [0.5], rtol=1e-6)
  np.testing.assert_allclose(exploration.ngram_entropy(interleaved, 2),
                             -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), rtol=1e-6)


def test_distinct_sequences_match_python_sets_jit_and_ragged():
  rng = np.random.default_rng(0)
  fn = jax.jit(exploration.distinct_sequences)
  for _ in range(10):
    hashes = _random_hashes(rng, 4, 6, 3)
    success = rng.random((4, 6)) < 0.5
    expected = [len({_calls(r) for r in hashes[p]}) for p in range(4)]
    expected_ok = [len({_calls(r) for r, s in zip(hashes[p], success[p]) if s}) for p in range(4)]
    np.testing.assert_array_equal(fn(hashes), expected)
    np.testing.assert_array_equal(fn(hashes, success), expected_ok)
    # The same batch with shuffled rows in the ragged layout.
    perm = rng.permutation(24)
    ragged = exploration.distinct_sequences(hashes.reshape(24, 3)[perm],
                                            success.reshape(-1)[perm],
                                            uniform_group_ids(4, 6)[perm], 4)
    np.testing.assert_array_equal(ragged, expected_ok)


def test_ngram_entropy_matches_counter():
  rng = np.random.default_rng(1)
  fn = jax.jit(exploration.ngram_entropy, static_argnums=1)
  for n in (1, 2, 3):
    hashes = _random_hashes(rng, 3, 5, 4)
    grams = collections.Counter(
        calls[i:i + n] for row in hashes.reshape(-1, 4) for calls in [_calls(row)]
        for i in range(len(calls) - n + 1))
    total = sum(grams.values())
    expected = -sum(c / total * math.log(c / total) for c in grams.values()) if total else 0.0
    np.testing.assert_allclose(fn(hashes, n), expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(exploration.ngram_entropy(np.full((2, 3), -1, np.int32), 2), 0.0)
  np.testing.assert_allclose(exploration.ngram_entropy(np.array([[1, 2]], np.int32), 3), 0.0)


def test_pairwise_edit_distance_matches_reference():
  np.testing.assert_allclose(exploration.pairwise_edit_distance(HASHES),
                             [(2 / 3 + 1 + 2 / 3 + 1 + 1) / 6, (1 / 2 + 1 + 1 / 2 + 1 + 1) / 6],
                             rtol=1e-6)
  rng = np.random.default_rng(2)
  fn = jax.jit(exploration.pairwise_edit_distance)
  for _ in range(5):
    hashes = _random_hashes(rng, 3, 4, 5, alphabet=4)
    expected = []
    for p in range(3):
      seqs = [_calls(r) for r in hashes[p]]
      pairs = [(a, b) for i, a in enumerate(seqs) for b in seqs[i + 1:]]
      expected.append(np.mean([_levenshtein(a, b) / max(len(a), len(b), 1) for a, b in pairs]))
    np.testing.assert_allclose(fn(hashes), expected, rtol=1e-6)
  np.testing.assert_allclose(exploration.pairwise_edit_distance(HASHES[:, :1]), [0.0, 0.0])


def test_pass_at_k_matches_combinatorics():
  rng = np.random.default_rng(3)
  success = rng.random((6, 8)) < 0.3
  for k in (1, 3, 8):
    c = success.sum(axis=1)
    expected = [1 - math.comb(8 - ci, k) / math.comb(8, k) for ci in c]
    np.testing.assert_allclose(exploration.pass_at_k(success, k), expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(exploration.pass_at_k(success, 1), success.mean(axis=1), rtol=1e-6)
  m = exploration.pass_at_k_metrics(success, 4)
  np.testing.assert_allclose(m["explore/pass_at_k_gap"], m["eval/pass_at_k"] - m["eval/pass_at_1"])
  assert m["explore/pass_at_k_gap"] >= 0
  with pytest.raises(ValueError, match="k must"):
    exploration.pass_at_k(success, 9)


def test_exploration_metrics_values_jit_and_no_jit():
  entropy = np.arange(24, dtype=np.float32).reshape(8, 3)
  mask = np.zeros((8, 3), np.float32)
  mask[:, 0] = 1
  for fn in (exploration.exploration_metrics, jax.jit(exploration.exploration_metrics)):
    m = fn(entropy, mask, HASHES, SUCCESS)
    np.testing.assert_allclose(m["explore/entropy"], np.mean(entropy[:, 0]))
    np.testing.assert_allclose(m["explore/distinct_tool_seqs"], 3.0)
    np.testing.assert_allclose(m["explore/distinct_success_seqs"], 1.0)
    np.testing.assert_allclose(m["explore/distinct_success_seqs_solved"], 2.0)
    np.testing.assert_allclose(m["explore/tool_calls_mean"], 17 / 8)
    np.testing.assert_allclose(m["explore/tool_seq_edit_dist"],
                               np.mean(exploration.pairwise_edit_distance(HASHES)), rtol=1e-6)
    for value in m.values():
      chex.assert_shape(value, ())
  ragged = exploration.exploration_metrics(entropy, mask, HASHES.reshape(8, 4),
                                           SUCCESS.reshape(-1), uniform_group_ids(2, 4), 2)
  assert "explore/tool_seq_edit_dist" not in ragged
  np.testing.assert_allclose(ragged["explore/distinct_tool_seqs"], 3.0)


def test_monitor_input_errors():
  with pytest.raises(ValueError, match="integers"):
    exploration.distinct_sequences(HASHES.astype(np.float32))
  with pytest.raises(ValueError, match="rollouts"):
    exploration.distinct_sequences(HASHES, SUCCESS[:1])
  with pytest.raises(ValueError, match=r"\[B, T\]"):
    exploration.token_entropy_mean(np.ones((2, 3)), np.ones((2, 4)))
  with pytest.raises(ValueError, match="positive int"):
    exploration.ngram_entropy(HASHES, 0)


# ----------------------------------------------------------------------------- controllers


def test_entropy_coef_moves_towards_band():
  cfg = ExplorationConfig(entropy_coef=0.01, entropy_band=Band(0.5, 1.0),
                          entropy_coef_factor=2.0, entropy_coef_min=1e-3, entropy_coef_max=0.03)
  state = exploration.init_entropy_coef(cfg)
  update = jax.jit(exploration.update_entropy_coef, static_argnums=0)
  np.testing.assert_allclose(update(cfg, state, 0.2).coef, 0.02)  # too low: raise the bonus
  np.testing.assert_allclose(update(cfg, state, 1.5).coef, 0.005)  # too high: lower it
  np.testing.assert_allclose(update(cfg, state, 0.7).coef, 0.01)  # inside: keep
  np.testing.assert_allclose(update(cfg, update(cfg, state, 0.2), 0.2).coef, 0.03)  # clipped
  np.testing.assert_allclose(update(cfg, state, jnp.nan).coef, 0.01)
  fixed = ExplorationConfig(entropy_coef=0.01)
  np.testing.assert_allclose(exploration.update_entropy_coef(fixed, state, 0.0).coef, 0.01)


def test_entropy_coef_closed_loop_reaches_band():
  """With entropy increasing in the coefficient, the controller brings it into the band."""
  cfg = ExplorationConfig(entropy_coef=1e-4, entropy_band=Band(0.8, 1.2),
                          entropy_coef_factor=1.2, entropy_coef_min=1e-5, entropy_coef_max=1.0)

  def run(state, _):
    entropy = 0.2 + 10.0 * state.coef  # a toy policy whose entropy grows with the bonus
    return exploration.update_entropy_coef(cfg, state, entropy), entropy

  _, entropies = jax.lax.scan(run, exploration.init_entropy_coef(cfg), None, length=60)
  entropies = np.asarray(entropies)
  assert entropies[0] < 0.8
  assert np.all(np.diff(entropies[:30]) > 0)  # raised while below the band
  # The band spans a coefficient ratio of 0.1 / 0.06 > 1.2: it cannot be jumped over.
  assert np.all((entropies[-20:] >= 0.8) & (entropies[-20:] <= 1.2))


def test_temperature_schedules():
  const = ExplorationConfig(temperature=0.7)
  np.testing.assert_allclose(exploration.temperature_at(const, 100), 0.7)
  lin = ExplorationConfig(temperature=1.2, temperature_final=0.8, temperature_schedule="linear",
                          temperature_steps=10)
  np.testing.assert_allclose([exploration.temperature_at(lin, s) for s in (0, 5, 10, 50)],
                             [1.2, 1.0, 0.8, 0.8], rtol=1e-6)
  cos = ExplorationConfig(temperature=1.2, temperature_final=0.8, temperature_schedule="cosine",
                          temperature_steps=10)
  np.testing.assert_allclose([exploration.temperature_at(cos, s) for s in (0, 5, 10, 50)],
                             [1.2, 1.0, 0.8, 0.8], rtol=1e-6)
  assert float(exploration.temperature_at(cos, 2)) > float(exploration.temperature_at(lin, 2))
  jitted = jax.jit(exploration.temperature_at, static_argnums=0)
  np.testing.assert_allclose(jitted(lin, jnp.int32(5)), 1.0, rtol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(entropy_coef=-0.1), "entropy_coef"),
    (dict(entropy_band=(0.1, 0.2)), "entropy_band"),
    (dict(entropy_coef=0.5, entropy_band=Band(0.1, 0.2)), "start inside"),
    (dict(entropy_coef=0.01, entropy_band=Band(0.1, 0.2), entropy_coef_factor=1.0),
     "entropy_coef_factor"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature_schedule="step"), "temperature_schedule"),
    (dict(temperature_schedule="linear"), "temperature_steps"),
    (dict(bands=(("signal/zero_variance_frac", Band(high=0.5)),)), "invariant"),
])
def test_config_rejects_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ExplorationConfig(**kwargs)
