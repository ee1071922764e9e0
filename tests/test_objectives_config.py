"""Objective/optimiser configs: clear errors before anything compiles; builders."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.objectives import (
    ObjectiveConfig,
    OptimizerConfig,
    get_advantage_fn,
    get_policy_loss,
    make_advantage_fn,
    make_policy_loss,
    validate_objective_config,
    validate_optimizer_config,
)

_EVENTS = []
jax.monitoring.register_event_duration_secs_listener(lambda name, *a, **kw: _EVENTS.append(name))


def _validate_without_compiling(config, group_size):
  """Validate, and check that XLA compiled nothing while doing so."""
  _EVENTS.clear()
  try:
    validate_objective_config(config, group_size=group_size)
  finally:
    compiled = [e for e in _EVENTS if "backend_compile" in e]
    assert not compiled, compiled


@pytest.mark.parametrize("config", [
    ObjectiveConfig(),
    ObjectiveConfig(advantage="dr_grpo", loss="ppo", loss_kwargs={"eps_high": 0.28},
                    agg="seq_mean_token_sum_norm", horizon=512),
    ObjectiveConfig(advantage="kimi", loss="kimi", loss_kwargs={"tau": 0.2},
                    agg="seq_mean_token_sum"),
    ObjectiveConfig(advantage="grpo", loss="cispo", correction=("tis", "opsm"),
                    correction_kwargs={"tis": {"level": "sequence", "cap": 4.0}}),
    ObjectiveConfig(advantage="pass_at_k", advantage_kwargs={"k": 4}, loss="ppo",
                    correction="decoupled", entropy_coef=0.001, kl_coef=0.01, kl_estimator="k2"),
    ObjectiveConfig(advantage="rebn", advantage_kwargs={"gamma": 0.9}, loss="reinforce"),
])
def test_valid_configs_pass(config):
  _validate_without_compiling(config, group_size=8)


@pytest.mark.parametrize("config, match", [
    (ObjectiveConfig(advantage="gae"), "unknown advantage estimator 'gae'; valid estimators: grpo"),
    (ObjectiveConfig(loss="dapo"), "unknown policy loss 'dapo'; valid losses: reinforce, ppo"),
    (ObjectiveConfig(agg="token_sum"), "unknown aggregation mode 'token_sum'; valid modes"),
    (ObjectiveConfig(correction="is"), "unknown correction 'is'; valid corrections: tis"),
    (ObjectiveConfig(kl_estimator="k4", kl_coef=0.1), "unknown KL estimator 'k4'"),
    (ObjectiveConfig(loss_kwargs={"clip": 0.2}), r"unknown hyper-parameter\(s\) \['clip'\]"),
    (ObjectiveConfig(advantage_kwargs={"std": 1}), r"unknown hyper-parameter\(s\) \['std'\]"),
    (ObjectiveConfig(correction="tis", correction_kwargs={"tis": {"c": 2}}),
     r"correction 'tis' got unknown hyper-parameter\(s\) \['c'\]"),
    (ObjectiveConfig(loss_kwargs={"eps_low": -0.2}), "eps_low must be >= 0"),
    (ObjectiveConfig(advantage="pass_at_k", advantage_kwargs={"k": 16}), r"k must be an integer"),
    (ObjectiveConfig(loss="reinforce", correction="decoupled"), "decoupled correction needs"),
    (ObjectiveConfig(loss="kimi_token_mask", loss_kwargs={"alpha": 0.5}), "alpha <= 0 <= beta"),
    (ObjectiveConfig(agg="seq_mean_token_sum_norm", horizon=0), "horizon must be a positive"),
])
def test_bad_configs_fail_clearly_before_compiling(config, match):
  with pytest.raises(ValueError, match=match):
    _validate_without_compiling(config, group_size=8)


@pytest.mark.parametrize("advantage, kwargs", [
    ("grpo", {}), ("dr_grpo", {}), ("rloo", {}), ("kimi", {}), ("pass_at_k", {"k": 1}),
    ("reinforce_pp", {"group_baseline": True}),
])
def test_group_estimator_with_group_size_one(advantage, kwargs):
  config = ObjectiveConfig(advantage=advantage, advantage_kwargs=kwargs)
  with pytest.raises(ValueError, match=f"{advantage} needs a group of at least 2 samples"):
    _validate_without_compiling(config, group_size=1)


@pytest.mark.parametrize("advantage", ["remax", "reinforce_pp", "rebn"])
def test_non_group_estimators_accept_group_size_one(advantage):
  _validate_without_compiling(ObjectiveConfig(advantage=advantage), group_size=1)


def test_bad_group_size():
  with pytest.raises(ValueError, match="group_size must be a positive integer"):
    validate_objective_config(ObjectiveConfig(), group_size=0)


def test_builders_bind_the_config():
  config = ObjectiveConfig(advantage="grpo", advantage_kwargs={"ddof": 0}, loss="ppo",
                           loss_kwargs={"eps_high": 0.28}, agg="seq_mean_token_mean",
                           kl_coef=0.1, kl_estimator="k1")
  validate_objective_config(config, group_size=4)
  rewards = jnp.array([[1.0, 0.0, 0.0, 0.0]])
  np.testing.assert_array_equal(make_advantage_fn(config)(rewards),
                                get_advantage_fn("grpo")(rewards, ddof=0))
  logp = jnp.array([[-1.0, -0.4], [-0.3, -2.0]])
  old, ref = logp - 0.25, logp + 0.1
  args = (logp, old, jnp.array([1.0, -1.0]), jnp.ones((2, 2)))
  built, _ = make_policy_loss(config)(*args, ref_logp_BxT=ref)
  direct, _ = get_policy_loss("ppo")(*args, ref_logp_BxT=ref, eps_high=0.28,
                                     agg="seq_mean_token_mean", kl_coef=0.1, kl_estimator="k1")
  np.testing.assert_array_equal(built, direct)


@pytest.mark.parametrize("kwargs, match", [
    ({"schedule": "linear"}, "unknown schedule 'linear'"),
    ({"learning_rate": 0.0}, "learning_rate must be a positive"),
    ({"schedule": "warmup_cosine", "warmup_steps": 10}, "needs total_steps > warmup_steps"),
    ({"schedule": "warmup_cosine", "warmup_steps": 10, "total_steps": 10}, "total_steps"),
    ({"warmup_steps": -1}, "warmup_steps must be >= 0"),
    ({"b2": 1.0}, r"b2 must be in \[0, 1\)"),
    ({"grad_clip_norm": 0.0}, "grad_clip_norm must be > 0 or None"),
    ({"final_lr_fraction": 2.0}, "final_lr_fraction"),
])
def test_bad_optimizer_configs(kwargs, match):
  with pytest.raises(ValueError, match=match):
    validate_optimizer_config(OptimizerConfig(**kwargs))
