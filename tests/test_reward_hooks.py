"""Reward hooks: a judge model's rubric verdicts and a user function, added
to the environment's reward through ``loop.train``."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import model as model_lib
from agentic_rl.rollout.types import Rollout
from agentic_rl.train import config as config_lib
from agentic_rl.train import loop, reward_hooks
from agentic_rl.train import metrics as metrics_lib
from experiments.configs import default

CALLS = []


def quarter(ro: Rollout):
  """A user reward: 0.25 per episode."""
  CALLS.append(ro.tokens_BxT.shape)
  return np.full(ro.reward_B.shape, 0.25)


def test_judge_inputs_put_the_rubric_after_each_episode():
  ro = Rollout.__new__(Rollout)
  object.__setattr__(ro, "tokens_BxT", np.array([[5, 6, 7, 0], [5, 8, 0, 0]]))
  object.__setattr__(ro, "length_B", np.array([3, 2]))
  tokens, last = reward_hooks.judge_inputs(ro, np.array([9, 10]))
  np.testing.assert_array_equal(tokens, [[5, 6, 7, 9, 10, 0], [5, 8, 9, 10, 0, 0]])
  np.testing.assert_array_equal(last, [4, 3])


def test_yes_probability_is_the_two_way_softmax_at_the_rubrics_end():
  config = model_lib.TransformerConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2,
                                       n_kv_heads=1, head_dim=8, mlp_dim=32)
  params = model_lib.init_params(config, jax.random.key(0))
  tokens = jnp.array([[3, 4, 5, 6, 0, 0], [3, 4, 0, 0, 0, 0]])
  last = jnp.array([3, 1])
  p = reward_hooks.yes_probability(config, params, tokens, last, jnp.array([7, 8]))
  for b, n in enumerate([4, 2]):  # unpadded, alone
    logits = model_lib.forward(params, tokens[b:b + 1, :n], config)[0, -1]
    want = jax.nn.softmax(logits[jnp.array([7, 8])])[0]
    np.testing.assert_allclose(p[b], want, rtol=1e-5)


def test_majority_of_verdicts_follows_the_likelier_one():
  p = jnp.array([0.7] * 2000 + [0.3] * 2000)
  key = jax.random.key(0)
  one = reward_hooks.aggregate_verdicts(p, key, 1, "mean")
  mean = reward_hooks.aggregate_verdicts(p, key, 15, "mean")
  majority = reward_hooks.aggregate_verdicts(p, key, 15, "majority")
  assert set(np.unique(majority)) <= {0.0, 1.0}
  # One draw is right 70% of the time; the majority of 15 about 95%.
  assert abs(float(one[:2000].mean()) - 0.7) < 0.04
  assert float(majority[:2000].mean()) > 0.9 and float(majority[2000:].mean()) < 0.1
  np.testing.assert_allclose(float(mean[:2000].mean()), 0.7, atol=0.02)
  assert float(mean[:2000].std()) < float(one[:2000].std()) / 3


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
  """A barely trained tiny policy: a deliberately noisy judge."""
  cfg = default.get_config("all,tiny")
  cfg.stages = ("sft",)
  cfg.sft.steps = 2
  cfg.seed = 11
  workdir = str(tmp_path_factory.mktemp("judge"))
  loop.train(cfg, workdir)
  return workdir


def _rl_cfg():
  """Outcome-only rewards on the tiny policy, which fails every prompt:
  without hooks every group's rewards are equal."""
  cfg = default.get_config("all,tiny")
  cfg.stages = ("rl",)
  cfg.rl.iterations = 2
  cfg.rl.signal.allocation = "uniform"
  cfg.tasks.rewards.update(format=0.0, efficiency=0.0)
  cfg.eval.every = 100
  return cfg


def _records(workdir):
  return metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl"))


@pytest.mark.slow  # two training runs beside the judge's
def test_a_noisy_judge_moves_the_rewards_and_the_signal_metrics(judge_dir, tmp_path):
  plain = _records(loop.train(_rl_cfg(), str(tmp_path / "plain")) and str(tmp_path / "plain"))
  cfg = _rl_cfg()
  cfg.reward_hooks.judge.update(weight=1.0, run=judge_dir)
  judged = _records(loop.train(cfg, str(tmp_path / "judged")) and str(tmp_path / "judged"))
  assert all(r["signal/zero_variance_frac"] == 1.0 for r in plain)
  assert all("reward/judge" not in r for r in plain)
  for p, j in zip(plain, judged):
    assert 0.0 < j["reward/judge"] < 1.0
    np.testing.assert_allclose(j["reward/mean"], p["reward/mean"] + j["reward/judge"],
                               atol=1e-6)
  # Verdicts that differ within a group give it advantages where the
  # outcome gives none: the advantage monitors react while the outcome
  # monitor still says no group's outcomes differ (the judge's noise).
  assert all(r["signal/effective_token_frac"] == 0.0 and r["signal/adv_std"] == 0.0
             for r in plain)
  assert all(r["signal/effective_token_frac"] > 0.0 and r["signal/adv_std"] > 0.0
             for r in judged)
  assert all(r["signal/zero_variance_frac"] == 1.0 for r in judged)


def test_a_majority_of_judge_samples_scores_each_episode_zero_or_one(judge_dir, tmp_path):
  cfg = _rl_cfg()
  cfg.reward_hooks.judge.update(weight=1.0, run=judge_dir, samples=5, aggregate="majority")
  loop.train(cfg, str(tmp_path))
  B = cfg.rl.prompts_per_step * cfg.rl.group_size
  for r in _records(str(tmp_path)):  # a batch mean of 0/1 scores: a multiple of 1/B
    assert 0.0 < r["reward/judge"] < 1.0
    assert abs(r["reward/judge"] * B - round(r["reward/judge"] * B)) < 1e-5


def test_a_user_function_adds_its_weighted_component(tmp_path):
  CALLS.clear()
  cfg = _rl_cfg()
  cfg.reward_hooks.function.update(weight=2.0, fn="test_reward_hooks:quarter")
  loop.train(cfg, str(tmp_path))
  records = _records(str(tmp_path))
  assert len(CALLS) == 2 and CALLS[0][0] == cfg.rl.prompts_per_step * cfg.rl.group_size
  for r in records:
    assert r["reward/function"] == 0.25
    np.testing.assert_allclose(r["reward/mean"], r["reward/outcome"] + 0.5, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    (dict(judge=dict(weight=1.0, run="/nonexistent")), "not a run directory"),
    (dict(judge=dict(weight=1.0, samples=0)), "samples"),
    (dict(judge=dict(weight=1.0, aggregate="median")), "aggregate"),
    (dict(judge=dict(weight=1.0, rubric="")), "rubric"),
    (dict(function=dict(weight=1.0, fn="nowhere")), "MODULE:NAME"),
    (dict(function=dict(weight=1.0, fn="os:no_such_function")), "cannot be loaded"),
])
def test_bad_hooks_are_refused_before_building(change, message, judge_dir):
  cfg = default.get_config("all,tiny")
  for hook, values in change.items():
    if hook == "judge":
      cfg.reward_hooks.judge.run = judge_dir
    cfg.reward_hooks[hook].update(values)
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(cfg)
