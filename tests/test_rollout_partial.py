"""Partial rollouts (Kimi k1.5): token budgets, carry-over, resume, refill."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import model as model_lib
from agentic_rl import rollout
from calc_batch import SAMPLING, calc_chain_batch

P, G = 2, 2
_learner = jax.jit(rollout.learner_logprobs, static_argnums=(2, 3))


@pytest.fixture(scope="module")
def setup():
  s = calc_chain_batch(P)
  s["engine"] = rollout.RolloutEngine(s["config"], SAMPLING, s["codec"].ids, env=s["env"],
                                      batch_size=P * G, group_size=G)
  return s


def _fresh(s, key=7):
  return s["engine"].init_state(*s["inputs"], jax.random.key(key), **s["script"])


def test_partial_rollout_resumes_exactly(setup):
  s, engine = setup, setup["engine"]
  state0 = _fresh(s)
  whole = engine.resume(s["params"], state0, 0)
  chunks, state = 0, state0
  while not bool(np.all(state.ended_B)):
    state = engine.resume(s["params"], state, 0, max_steps=9)
    chunks += 1
    if chunks == 1:
      carried = state.to_rollout()
      assert not bool(np.all(carried.finished_B))
  assert chunks >= 4
  a, b = whole.to_rollout(), state.to_rollout()
  for field in ("tokens_BxT", "loss_mask_BxT", "turn_BxT", "version_BxT",
                "length_B", "reward_B", "done_B", "truncated_B", "call_hashes_BxC"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field), field)
  np.testing.assert_allclose(a.behaviour_logp_BxT, b.behaviour_logp_BxT, atol=1e-5)
  # ... and the one-jit rollout with the same key agrees.
  c = engine.rollout(s["params"], *s["inputs"], jax.random.key(7), 0, **s["script"])
  np.testing.assert_array_equal(a.tokens_BxT, c.tokens_BxT)
  np.testing.assert_allclose(a.behaviour_logp_BxT, c.behaviour_logp_BxT, atol=1e-5)


def test_resume_under_new_parameters_keeps_versions(setup):
  s, engine = setup, setup["engine"]
  state = engine.resume(s["params"], _fresh(s), 0, max_steps=40)
  assert not bool(np.all(state.ended_B))
  cut = np.asarray(state.cur_B)
  params2 = model_lib.init_params(s["config"], jax.random.key(11))
  out = engine.resume(params2, state, 1).to_rollout()
  before = np.arange(SAMPLING.max_total_tokens)[None] <= cut[:, None]
  np.testing.assert_array_equal(np.asarray(out.tokens_BxT)[before],
                                np.asarray(state.tokens_BxT)[before])
  mask = np.asarray(out.loss_mask_BxT) > 0
  version = np.asarray(out.version_BxT)
  assert np.all(version[mask & before] == 0)
  assert np.all(version[mask & ~before] == 1) and (mask & ~before).any()
  assert np.all(version[~mask] == -1)
  # New tokens were sampled from params2 over the whole (re-prefilled) context.
  learner2 = np.asarray(_learner(params2, out.tokens_BxT, s["config"], SAMPLING))
  logp = np.asarray(out.behaviour_logp_BxT)
  new = mask & ~before
  np.testing.assert_allclose(logp[new], learner2[new], atol=1e-5)
  assert np.max(np.abs(logp - learner2)[mask & before]) > 1e-2


def test_refill_replaces_finished_groups(setup):
  s, engine = setup, setup["engine"]
  old = engine.resume(s["params"], _fresh(s), 0, max_steps=5)
  fresh = _fresh(s, key=99)
  mixed = engine.refill(old, fresh, jnp.array([True, False]))
  take = lambda t, rows: jax.tree.map(lambda x: np.asarray(x)[rows], t)
  chex.assert_trees_all_equal(take(mixed, [0, 1]), take(fresh, [0, 1]))
  chex.assert_trees_all_equal(take(mixed, [2, 3]), take(old, [2, 3]))
  with pytest.raises(ValueError, match="replace_P"):
    engine.refill(old, fresh, jnp.array([True]))
