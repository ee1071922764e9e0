"""Optimisers: schedules, AdamW + clipping from a config, the mirror-descent reset."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from agentic_rl.objectives import (
    OptimizerConfig,
    begin_iteration,
    get_advantage_fn,
    get_policy_loss,
    make_optimizer,
    make_schedule,
    reset_optimizer_state,
)


def test_schedules():
  constant = make_schedule(OptimizerConfig(learning_rate=0.1))
  np.testing.assert_allclose([constant(0), constant(1000)], [0.1, 0.1], rtol=1e-6)
  warm = make_schedule(OptimizerConfig(learning_rate=0.1, schedule="warmup_constant",
                                       warmup_steps=10))
  np.testing.assert_allclose([warm(0), warm(5), warm(10), warm(50)], [0.0, 0.05, 0.1, 0.1],
                             rtol=1e-6)
  cosine = make_schedule(OptimizerConfig(learning_rate=0.1, schedule="warmup_cosine",
                                         warmup_steps=10, total_steps=110, final_lr_fraction=0.1))
  # Half-way through the decay: 0.01 + 0.09 * (1 + cos(pi / 2)) / 2 = 0.055.
  np.testing.assert_allclose([cosine(5), cosine(10), cosine(60), cosine(110), cosine(500)],
                             [0.05, 0.1, 0.055, 0.01, 0.01], rtol=1e-5)


def test_first_adamw_step_by_hand():
  """Bias-corrected first step: -lr * (g / (|g| + eps) + wd * p)."""
  opt = make_optimizer(OptimizerConfig(learning_rate=0.1, weight_decay=0.01, grad_clip_norm=None))
  params = {"w": jnp.array([1.0, -2.0])}
  updates, _ = opt.update({"w": jnp.array([0.5, -3.0])}, opt.init(params), params)
  np.testing.assert_allclose(updates["w"], [-0.1 * (1 + 0.01), -0.1 * (-1 - 0.02)], rtol=1e-6)


def test_global_norm_clipping():
  opt = make_optimizer(OptimizerConfig(learning_rate=0.1, grad_clip_norm=1.0, b2=0.95))
  params = {"w": jnp.zeros(2)}
  _, state = opt.update({"w": jnp.array([3.0, 4.0])}, opt.init(params), params)
  # The gradient reaching Adam is (0.6, 0.8): nu = (1 - b2) g^2.
  np.testing.assert_allclose(optax.tree_utils.tree_get(state, "nu")["w"],
                             [0.05 * 0.36, 0.05 * 0.64], rtol=1e-5)


def _count(state, kind):
  """The ``count`` of the one sub-state of type ``kind``."""
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, kind))
           if isinstance(s, kind)]
  assert len(found) == 1
  return int(found[0].count)


def _run(opt, params, state, grads, steps):
  for _ in range(steps):
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def test_reset_restarts_moments_but_not_the_schedule():
  config = OptimizerConfig(learning_rate=1.0, schedule="warmup_constant", warmup_steps=10,
                           grad_clip_norm=0.5, reset_each_iteration=True)
  opt = make_optimizer(config)
  params = {"w": jnp.array([0.0, 0.0])}
  grads = {"w": jnp.array([0.2, -0.1])}
  params, state = _run(opt, params, opt.init(params), grads, steps=3)
  reset = jax.jit(lambda s, p: begin_iteration(opt, s, p, config))(state, params)
  np.testing.assert_array_equal(optax.tree_utils.tree_get(reset, "mu")["w"], 0.0)
  np.testing.assert_array_equal(optax.tree_utils.tree_get(reset, "nu")["w"], 0.0)
  assert _count(reset, optax.ScaleByAdamState) == 0        # bias correction restarts
  assert _count(reset, optax.ScaleByScheduleState) == 3    # the schedule does not
  # The next step is a first Adam step (sign of g) at the schedule's lr(3) = 0.3.
  updates, _ = opt.update(grads, reset, params)
  np.testing.assert_allclose(updates["w"], [-0.3, 0.3], rtol=1e-5)
  # Without the flag the state passes through untouched.
  keep = begin_iteration(opt, state, params, OptimizerConfig())
  assert keep is state


def test_reset_state_matches_a_fresh_init_for_a_constant_schedule():
  opt = make_optimizer(OptimizerConfig(learning_rate=0.1))
  params = {"w": jnp.ones(3)}
  _, state = _run(opt, params, opt.init(params), {"w": jnp.ones(3)}, steps=2)
  reset = reset_optimizer_state(opt, state, params)
  fresh = opt.init(params)
  for name in ("mu", "nu"):
    np.testing.assert_array_equal(optax.tree_utils.tree_get(reset, name)["w"],
                                  optax.tree_utils.tree_get(fresh, name)["w"])


def test_mirror_descent_on_a_bandit():
  """Kimi k1.5 OMD: each iteration takes the current policy as reference (old_logp),
  resets the optimiser, and takes a few steps on the kimi loss. Expected reward rises."""
  rewards = jnp.array([1.0, 0.0, 0.0, 0.5])
  config = OptimizerConfig(learning_rate=0.05, reset_each_iteration=True)
  opt = make_optimizer(config)
  kimi_loss, kimi_adv = get_policy_loss("kimi"), get_advantage_fn("kimi")

  @jax.jit
  def iteration(params, state, key):
    state = begin_iteration(opt, state, params, config)
    actions_PxG = jax.random.categorical(key, params["logits"], shape=(4, 8))
    adv_B = kimi_adv(rewards[actions_PxG]).reshape(-1)

    def logp_Bx1(p):
      return jax.nn.log_softmax(p["logits"])[actions_PxG].reshape(-1, 1)
    old_logp = logp_Bx1(params)   # the previous iterate is the reference

    def loss(p):
      return kimi_loss(logp_Bx1(p), old_logp, adv_B, jnp.ones((32, 1)), agg="seq_mean_token_sum",
                       tau=0.5)[0]
    for _ in range(4):
      updates, state = opt.update(jax.grad(loss)(params), state, params)
      params = optax.apply_updates(params, updates)
    return params, state

  params = {"logits": jnp.zeros(4)}
  state = opt.init(params)
  expected = lambda p: float(jax.nn.softmax(p["logits"]) @ rewards)
  start = expected(params)
  for key in jax.random.split(jax.random.key(0), 40):
    params, state = iteration(params, state, key)
  assert start == pytest.approx(0.375)
  assert expected(params) > 0.9
  # Reset every iteration: Adam has counted only this iteration's 4 steps.
  assert _count(state, optax.ScaleByAdamState) == 4
  assert _count(state, optax.ScaleByScheduleState) == 160
