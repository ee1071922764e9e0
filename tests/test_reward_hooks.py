"""Reward hooks: a judge model's rubric verdicts and a user function, added
to the environment's reward through ``loop.train``."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import model as model_lib
from agentic_rl.rollout.types import Rollout
from agentic_rl.text import Message, default_codec
from agentic_rl.train import config as config_lib
from agentic_rl.train import loop, reward_hooks
from agentic_rl.train import metrics as metrics_lib
from experiments import tiny_checkpoint
from experiments.configs import default

CALLS = []


def quarter(ro: Rollout):
  """A user reward: 0.25 per episode."""
  CALLS.append(ro.tokens_BxT.shape)
  return np.full(ro.reward_B.shape, 0.25)


@pytest.fixture(scope="module")
def foreign_judge(tmp_path_factory):
  """A random tiny Qwen2 checkpoint: a judge with its own byte-level BPE
  tokenizer and ChatML template, foreign to the tiny policy's."""
  out = str(tmp_path_factory.mktemp("qwen2_judge"))
  tiny_checkpoint.write_model("qwen2", out, tiny_checkpoint.write_tokenizer("qwen2", out))
  return out


def test_the_judge_reads_each_episode_in_its_own_chat_template(foreign_judge):
  policy = default_codec()
  hooks = reward_hooks.make_hooks(_hook_settings(foreign_judge), policy,
                                  config_lib.model_config)
  judge = hooks.judge
  episodes = [policy.encode([Message("user", "What is 2 + 3?"),
                             Message("assistant", "<answer>5</answer>")]).ids,
              policy.encode([Message("user", "Hi")]).ids]
  ro = Rollout.__new__(Rollout)
  object.__setattr__(ro, "tokens_BxT", np.stack([np.resize(e, 40) for e in episodes]))
  object.__setattr__(ro, "length_B", np.array([len(e) for e in episodes]))
  tokens, last = reward_hooks.judge_inputs(ro, judge)
  assert tokens.shape[0] == 2 and tokens.shape[1] % 64 == 0 and tokens.shape[1] - 64 <= last.max()
  for b, ids in enumerate(episodes):
    text = judge.codec.tokenizer.decode(tokens[b, :last[b] + 1])
    # The policy's transcript, then the rubric, as a ChatML user turn after
    # the template's default system turn, ending where the judge's answer
    # starts.
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\n" + policy.tokenizer.decode(ids) + judge.rubric
                         + "<|im_end|>\n<|im_start|>assistant\n")
    assert not tokens[b, last[b] + 1:].any()
  yes = {judge.codec.encode_text(w)[0] for w in ("yes", "Yes")}
  assert set(judge.yes_ids) == yes and not yes & set(judge.no_ids)


def test_yes_probability_is_the_softmax_over_the_verdict_tokens():
  config = model_lib.TransformerConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2,
                                       n_kv_heads=1, head_dim=8, mlp_dim=32)
  params = model_lib.init_params(config, jax.random.key(0))
  tokens = jnp.array([[3, 4, 5, 6, 0, 0], [3, 4, 0, 0, 0, 0]])
  last = jnp.array([3, 1])
  verdicts = jnp.array([7, 9, 8])  # yes: 7 and 9; no: 8
  p = reward_hooks.yes_probability(config, params, tokens, last, 2, verdicts)
  for b, n in enumerate([4, 2]):  # unpadded, alone
    logits = model_lib.forward(params, tokens[b:b + 1, :n], config)[0, -1]
    want = jax.nn.softmax(logits[verdicts])[:2].sum()
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


def _hook_settings(judge, **judge_settings):
  cfg = default.get_config("all,tiny")
  cfg.reward_hooks.judge.update(weight=1.0, checkpoint=judge, **judge_settings)
  return config_lib.validate(cfg)


def _records(workdir):
  return metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl"))


@pytest.mark.slow  # two training runs beside the judge's
def test_a_noisy_judge_moves_the_rewards_and_the_signal_metrics(judge_dir, tmp_path):
  plain = _records(loop.train(_rl_cfg(), str(tmp_path / "plain")) and str(tmp_path / "plain"))
  cfg = _rl_cfg()
  cfg.reward_hooks.judge.update(weight=1.0, checkpoint=judge_dir)
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


@pytest.mark.slow  # trains the judge run first
def test_a_majority_of_judge_samples_scores_each_episode_zero_or_one(judge_dir, tmp_path):
  cfg = _rl_cfg()
  cfg.reward_hooks.judge.update(weight=1.0, checkpoint=judge_dir, samples=5, aggregate="majority")
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
    (dict(judge=dict(weight=1.0, checkpoint="/nonexistent")),
     "a run directory of this project.*or a .gguf file"),
    (dict(judge=dict(weight=1.0, checkpoint="/nowhere/judge.gguf")), "no such GGUF file"),
    (dict(judge=dict(weight=1.0, samples=0)), "samples"),
    (dict(judge=dict(weight=1.0, aggregate="median")), "aggregate"),
    (dict(judge=dict(weight=1.0, rubric="")), "rubric"),
    (dict(function=dict(weight=1.0, fn="nowhere")), "MODULE:NAME"),
    (dict(function=dict(weight=1.0, fn="os:no_such_function")), "cannot be loaded"),
])
def test_bad_hooks_are_refused_before_building(change, message, foreign_judge):
  cfg = default.get_config("all,tiny")
  for hook, values in change.items():
    if hook == "judge":
      cfg.reward_hooks.judge.checkpoint = foreign_judge
    cfg.reward_hooks[hook].update(values)
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(cfg)


def test_a_judge_with_its_own_tokenizer_scores_a_tiny_policys_episodes(foreign_judge, tmp_path,
                                                                       monkeypatch):
  """Through experiments.train: the tiny policy's episodes, judged by a
  Hugging Face checkpoint whose tokenizer is not the policy's."""
  seen, original = [], reward_hooks.judge_inputs

  def spy(ro, judge, **kwargs):
    seen.append((original(ro, judge, **kwargs), judge))
    return seen[-1][0]

  monkeypatch.setattr(reward_hooks, "judge_inputs", spy)
  cfg = _rl_cfg()
  cfg.reward_hooks.judge.update(weight=0.5, checkpoint=foreign_judge)
  loop.train(cfg, str(tmp_path))
  records = _records(str(tmp_path))
  assert len(seen) == cfg.rl.iterations
  (tokens, last), judge = seen[0]
  assert judge.model_config.vocab_size == 704  # the checkpoint's, not the policy's
  assert judge.codec.tokenizer.decode(tokens[0, :last[0] + 1]).endswith("<|im_start|>assistant\n")
  for r in records:
    assert 0.0 < r["reward/judge"] < 1.0
    np.testing.assert_allclose(r["reward/mean"], r["reward/outcome"] + 0.5 * r["reward/judge"],
                               atol=1e-6)


SMOLLM = os.environ.get("AGENTIC_RL_SMOLLM_GGUF", default.SMOLLM_GGUF)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(SMOLLM), reason="python -m experiments.get_model "
                    "smollm2-135m-instruct fetches the file")
def test_smollm2_judges_a_tiny_policys_episodes(tmp_path):
  """The real judge: SmolLM2-135M-Instruct's GGUF reads the tiny policy's
  episodes in its own chat template; a right answer to one question gets a
  likelier yes than a wrong one (0.205 against 0.199: a 135M judge is a
  weak one)."""
  policy = default_codec()
  hooks = reward_hooks.make_hooks(_hook_settings(
      SMOLLM, rubric="\nIs the assistant's answer correct? Answer yes or no."), policy,
      config_lib.model_config)
  episodes = [policy.encode([Message("user", "What is 2 + 3?"),
                             Message("assistant", f"<answer>{a}</answer>")]).ids
              for a in (5, 9)]
  ro = Rollout.__new__(Rollout)
  object.__setattr__(ro, "tokens_BxT", np.stack([np.resize(e, 48) for e in episodes]))
  object.__setattr__(ro, "length_B", np.array([len(e) for e in episodes]))
  j = hooks.judge
  tokens, last = reward_hooks.judge_inputs(ro, j)
  p = np.asarray(reward_hooks.yes_probability(j.model_config, j.params, jnp.asarray(tokens),
                                              jnp.asarray(last), len(j.yes_ids),
                                              jnp.asarray(j.yes_ids + j.no_ids)))
  assert np.all((p > 0) & (p < 1)) and p[0] > p[1], p
