"""Sampling distributions: exact truncated log-probs, entropies and draws."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from agentic_rl.rollout import sampling as S

Cfg = S.SamplingConfig


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_total_tokens=0), "max_total_tokens"),
    (dict(max_turns=0), "max_turns"),
    (dict(max_new_tokens_per_turn=True), "max_new_tokens_per_turn"),
    (dict(greedy=1), "greedy"),
])
def test_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Cfg(**kwargs).validate()


def test_config_is_static_data():
  assert hash(Cfg()) == hash(Cfg())
  assert not Cfg().truncated
  assert Cfg(top_k=3).truncated and Cfg(top_p=0.9).truncated and Cfg(greedy=True).truncated


def test_hand_computed_top_k_and_temperature():
  logits = jnp.array([[0.0, 1.0, 2.0, 3.0]])
  logp = S.sampling_log_probs(logits, Cfg(top_k=2))
  expected = np.array([-np.inf, -np.inf, 2 - np.logaddexp(2, 3), 3 - np.logaddexp(2, 3)])
  np.testing.assert_allclose(logp[0], expected, rtol=1e-6)
  logp = S.sampling_log_probs(logits, Cfg(temperature=2.0))
  z = np.array([0.0, 0.5, 1.0, 1.5])
  np.testing.assert_allclose(logp[0], z - np.log(np.exp(z).sum()), rtol=1e-6)


def test_hand_computed_top_p():
  probs = np.array([0.05, 0.5, 0.15, 0.3])
  logits = jnp.log(jnp.asarray(probs))[None]
  # 0.5 + 0.3 reaches 0.7: two tokens, renormalised to 0.625 / 0.375.
  p = np.exp(S.sampling_log_probs(logits, Cfg(top_p=0.7)))[0]
  np.testing.assert_allclose(p, [0, 0.625, 0, 0.375], atol=1e-6)
  # 0.81 needs the third token too.
  p = np.exp(S.sampling_log_probs(logits, Cfg(top_p=0.81)))[0]
  np.testing.assert_allclose(p, np.array([0, 0.5, 0.15, 0.3]) / 0.95, atol=1e-6)
  # Any p at or below the top probability keeps the top token alone.
  p = np.exp(S.sampling_log_probs(logits, Cfg(top_p=0.01)))[0]
  np.testing.assert_allclose(p, [0, 1, 0, 0], atol=1e-7)
  # top-k runs first, then top-p on the renormalised top-k distribution:
  # top-2 gives 0.625 / 0.375, and top_p=0.6 then keeps the first only.
  p = np.exp(S.sampling_log_probs(logits, Cfg(top_k=2, top_p=0.6)))[0]
  np.testing.assert_allclose(p, [0, 1, 0, 0], atol=1e-7)


def test_greedy_is_a_point_mass():
  logits = jnp.array([[0.3, 2.0, -1.0], [5.0, 4.0, 4.9]])
  logp = S.sampling_log_probs(logits, Cfg(greedy=True, temperature=0.1, top_p=0.5))
  np.testing.assert_array_equal(logp, [[-np.inf, 0, -np.inf], [0, -np.inf, -np.inf]])
  np.testing.assert_array_equal(S.entropy_of(logp), [0.0, 0.0])


@pytest.mark.parametrize("jit", [False, True])
def test_a_traced_temperature_of_zero_is_greedy(jit):
  logits = jnp.array([[0.3, 2.0, -1.0], [5.0, 4.0, 4.9]])
  f = jax.jit(S.sampling_log_probs, static_argnums=1) if jit else S.sampling_log_probs
  cfg = Cfg(top_k=2, top_p=0.9)
  np.testing.assert_array_equal(f(logits, cfg, jnp.float32(0.0)),
                                S.sampling_log_probs(logits, Cfg(greedy=True)))
  # A positive one is the config's distribution at that temperature.
  np.testing.assert_array_equal(f(logits, cfg, jnp.float32(0.7)),
                                S.sampling_log_probs(logits, Cfg(top_k=2, top_p=0.9,
                                                                 temperature=0.7)))


def test_entropy_hand_computed():
  logp = jnp.log(jnp.array([[0.5, 0.25, 0.25, 0.0]]))
  np.testing.assert_allclose(S.entropy_of(logp), [1.5 * math.log(2)], rtol=1e-6)
  assert not np.isnan(np.asarray(S.entropy_of(logp))).any()


_jitted_logp = jax.jit(S.sampling_log_probs, static_argnums=1)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0, 1, 3, 7]),
       st.sampled_from([1.0, 0.95, 0.5, 0.1]), st.sampled_from([0.5, 1.0, 2.0]))
def test_truncation_properties(seed, top_k, top_p, temperature):
  """Rows normalise; top-k keeps >= k; top-p keeps the shortest prefix
  reaching p; jit and no-jit agree."""
  V = 12
  logits = 3.0 * jax.random.normal(jax.random.key(seed), (4, V))
  cfg = Cfg(top_k=top_k, top_p=top_p, temperature=temperature)
  logp = _jitted_logp(logits, cfg)
  chex.assert_shape(logp, (4, V))
  chex.assert_type(logp, jnp.float32)
  np.testing.assert_allclose(S.sampling_log_probs(logits, cfg), logp, rtol=1e-6)
  p = np.exp(np.asarray(logp, np.float64))
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
  kept = p > 0
  base = np.asarray(jax.nn.softmax(logits / temperature), np.float64)
  for row in range(4):
    order = np.argsort(-base[row])
    # The kept set is a prefix of the order by probability.
    ranks = np.flatnonzero(kept[row][order])
    assert list(ranks) == list(range(len(ranks)))
    n = len(ranks)
    k = min(top_k, V) if top_k else V
    assert 1 <= n <= k
    top = base[row][order[:k]] / base[row][order[:k]].sum()
    if top_p < 1.0:
      mass = np.cumsum(top)
      assert mass[n - 1] >= top_p - 1e-6  # reaches p ...
      assert n == 1 or mass[n - 2] < top_p + 1e-6  # ... and is the shortest
    else:
      assert n == k
    # Kept tokens keep their relative probabilities.
    np.testing.assert_allclose(p[row][order[:n]], top[:n] / top[:n].sum(), rtol=1e-4)


def test_draws_follow_the_distribution_and_its_support():
  logits = jnp.log(jnp.array([0.1, 0.4, 0.2, 0.3]))
  cfg = Cfg(top_k=3)
  N = 20000
  logp = jnp.broadcast_to(S.sampling_log_probs(logits[None], cfg), (N, 4))
  draws = np.asarray(jax.jit(S.sample_tokens)(
      jax.random.split(jax.random.key(0), N), logp))
  chex.assert_shape(draws, (N,))
  freq = np.bincount(draws, minlength=4) / N
  expected = np.array([0.0, 0.4, 0.2, 0.3]) / 0.9
  assert freq[0] == 0.0  # never outside the support
  # 4 standard errors.
  np.testing.assert_allclose(freq, expected, atol=4 * np.sqrt(0.25 / N))


@pytest.mark.parametrize("V", [pytest.param(1000, marks=pytest.mark.slow), 7])
def test_draws_over_blocks_follow_the_distribution(V):
  """The two-level inverse CDF, with V not a multiple of its block width
  (1000: blocks of 32, the last one part padding) and a third of the tokens
  outside the support, agrees with the probabilities (chi-square)."""
  logits = 2.0 * jax.random.normal(jax.random.key(3), (V,))
  logits = jnp.where(jnp.arange(V) % 3 == 1, -jnp.inf, logits)
  logp = jax.nn.log_softmax(logits)
  N = 200_000
  draws = np.asarray(jax.jit(S.sample_tokens)(
      jax.random.split(jax.random.key(4), N), jnp.broadcast_to(logp, (N, V))))
  counts = np.bincount(draws, minlength=V)
  assert counts.size == V
  assert counts[1::3].sum() == 0  # never outside the support
  expected = N * np.exp(np.asarray(logp, np.float64))
  kept = expected > 0
  chi2 = float(np.sum((counts[kept] - expected[kept]) ** 2 / expected[kept]))
  dof = int(kept.sum()) - 1
  assert chi2 < dof + 6 * math.sqrt(2 * dof), (chi2, dof)


@pytest.mark.parametrize("V", [1, 2, 5, 1024])
def test_point_masses_are_always_drawn(V):
  # Rows with all their mass on one token, anywhere (the last: after the
  # last full block and in the padding's block).
  targets = jnp.array([0, V - 1, V // 2])
  logp = jnp.where(jnp.arange(V) == targets[:, None], 0.0, -jnp.inf)
  for seed in range(20):
    draws = S.sample_tokens(jax.random.split(jax.random.key(seed), 3), logp)
    np.testing.assert_array_equal(draws, targets)


def test_rounding_past_the_sum_draws_the_last_kept_token():
  cum = jnp.array([[0.5, 0.5, 1.0, 1.0]] * 3)
  positive = jnp.array([[True, False, True, False]] * 3)
  u = jnp.array([0.2, 0.5, 1.0])  # 1.0: rounding reached the total
  np.testing.assert_array_equal(S._first_above(cum, u, positive), [0, 2, 2])


def test_draw_depends_only_on_the_row_key():
  logp = jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (3, 50)))
  keys = jax.random.split(jax.random.key(2), 3)
  a = S.sample_tokens(keys, logp)
  b = S.sample_tokens(keys[::-1], logp[::-1])[::-1]
  np.testing.assert_array_equal(a, b)


def test_position_uniforms_are_the_per_position_draws():
  # The engine hashes every (row, position) draw once before its loop; a
  # draw must equal sample_tokens with the key folded with the position.
  keys = jax.random.split(jax.random.key(3), 4)
  positions = jnp.array([0, 5, 17])
  u = jax.jit(S.position_uniforms)(keys, positions)
  chex.assert_shape(u, (4, 3))
  chex.assert_type(u, jnp.float32)
  logp = jax.nn.log_softmax(jax.random.normal(jax.random.key(4), (4, 300)))
  for j, t in enumerate(positions):
    folded = jax.vmap(jax.random.fold_in, (0, None))(keys, t)
    np.testing.assert_array_equal(
        u[:, j], [jax.random.uniform(k, (), jnp.float32) for k in folded])
    np.testing.assert_array_equal(S.sample_from_uniforms(u[:, j], logp),
                                  S.sample_tokens(folded, logp))
  assert len(np.unique(np.asarray(u))) == u.size
