"""The efficiency reward in tool calls, policy tokens and environment time:
the formula, its config, the nominal latencies of the jitted tools, the
measured time of host environments, and the trainer's per-part metrics."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import envs as E
from agentic_rl import model as model_lib
from agentic_rl import rollout
from agentic_rl.envs import rewards as R
from agentic_rl.envs import text_games
from agentic_rl.envs import tokens as T
from agentic_rl.envs import tools
from agentic_rl.text import default_codec
from agentic_rl.train import config as config_lib
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from agentic_rl.train.collectors import HostCollector
from experiments.configs import default

PARTS = ("reward/efficiency", "reward/efficiency_calls", "reward/efficiency_tokens",
         "reward/efficiency_time")


@pytest.fixture(scope="module")
def codec():
  return default_codec()


# ------------------------------------------------------------------ formula
def _components(config, calls, tokens, seconds, max_turns=4, max_action_len=10):
  out = R.efficiency_components(calls=calls, tokens=tokens, seconds=seconds,
                                max_turns=max_turns, max_action_len=max_action_len,
                                config=config)
  return {k: float(v) for k, v in out.items()}


def test_efficiency_and_its_parts_by_hand():
  # 2 of 4 calls, 10 of 40 tokens, 0.3 of 1.2 s.
  w = dict(calls=0.2, tokens=0.3, time=0.5)
  c = _components(R.RewardConfig(efficiency_weights=w, time_budget_s=1.2), 2, 10, 0.3)
  np.testing.assert_allclose(
      [c["efficiency_calls"], c["efficiency_tokens"], c["efficiency_time"]],
      [0.5, 0.75, 0.75], rtol=1e-6)
  # 1 - 0.2 * 0.5 - 0.3 * 0.25 - 0.5 * 0.25; weights summing to 1: the
  # weighted mean of the parts.
  np.testing.assert_allclose(c["efficiency"], 0.7, rtol=1e-6)
  np.testing.assert_allclose(c["efficiency"], 0.2 * 0.5 + 0.3 * 0.75 + 0.5 * 0.75, rtol=1e-6)
  # The defaults count calls and tokens only: 1 - 0.5 * 0.5 - 0.5 * 0.25.
  assert R.RewardConfig().efficiency_weights == R.EfficiencyWeights(0.5, 0.5, 0.0)
  c = _components(R.RewardConfig(), 2, 10, 100.0)
  np.testing.assert_allclose(c["efficiency"], 0.625, rtol=1e-6)
  assert c["efficiency_time"] == 0.0  # 100 s of a 1 s budget, clipped
  # Time alone, and overspending clipped at 0.
  only_time = R.RewardConfig(efficiency_weights=dict(calls=0.0, tokens=0.0, time=1.0),
                             time_budget_s=2.0)
  np.testing.assert_allclose(_components(only_time, 4, 40, 0.5)["efficiency"], 0.75,
                             rtol=1e-6)
  assert _components(only_time, 0, 0, 3.0)["efficiency"] == 0.0
  no_weights = R.RewardConfig(efficiency_weights=dict(calls=0.0, tokens=0.0, time=0.0))
  out = R.efficiency_components(calls=np.array([1, 2, 3]), tokens=0, seconds=0.0,
                                max_turns=4, max_action_len=10, config=no_weights)
  assert all(v.shape == (3,) and v.dtype == jnp.float32 for v in out.values())
  np.testing.assert_array_equal(out["efficiency"], [1.0, 1.0, 1.0])


def test_the_host_term_is_gated_on_success():
  config = R.RewardConfig(efficiency=0.5, efficiency_weights=dict(time=1.0),
                          time_budget_s=2.0)
  comps, term = R.host_components(success=np.array([True, False]), calls=np.array([0, 2]),
                                  tokens=np.array([10, 10]), seconds=np.array([1.0, 0.0]),
                                  max_turns=4, max_action_len=10, config=config)
  np.testing.assert_array_equal(comps["outcome"], [1.0, 0.0])
  np.testing.assert_allclose(comps["efficiency"], [1 - 0.125 - 0.5, 1 - 0.25 - 0.125],
                             rtol=1e-6)
  np.testing.assert_allclose(term, [0.5 * 0.375, 0.0], rtol=1e-6)
  ungated = R.RewardConfig(efficiency=0.5, efficiency_needs_success=False)
  _, term = R.host_components(success=np.array([False]), calls=np.array([0]),
                              tokens=np.array([0]), seconds=np.array([5.0]), max_turns=4,
                              max_action_len=10, config=ungated)
  np.testing.assert_allclose(term, [0.5])


def _old_components(*, correct, answered, calls, malformed_calls, tokens, max_turns,
                    max_action_len):
  """The calls-and-tokens formula as it was before the time part."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  calls, tokens = f32(calls), f32(tokens)
  fmt = f32(answered) * (1.0 - f32(malformed_calls) / jnp.maximum(calls, 1.0))
  eff = 1.0 - 0.5 * calls / max_turns - 0.5 * tokens / (max_turns * max_action_len)
  return {"outcome": f32(correct), "format": fmt, "efficiency": jnp.clip(eff, 0.0, 1.0)}


def _old_reward(c, config):
  gate = c["outcome"] if config.efficiency_needs_success else 1.0
  return (config.outcome * c["outcome"] + config.format * c["format"]
          + config.efficiency * c["efficiency"] * gate).astype(jnp.float32)


@pytest.mark.parametrize("max_turns, max_action_len", [(6, 24), (7, 48), (3, 17)])
def test_time_weight_zero_is_bit_identical_to_the_calls_and_tokens_formula(
    max_turns, max_action_len):
  rng = np.random.default_rng(max_turns)
  n = 4096
  calls = rng.integers(0, max_turns + 1, n).astype(np.int32)
  inputs = dict(correct=rng.random(n) < 0.5, answered=rng.random(n) < 0.7, calls=calls,
                malformed_calls=rng.integers(0, calls + 1).astype(np.int32),
                tokens=rng.integers(0, max_turns * max_action_len + 1, n).astype(np.int32))
  seconds = rng.random(n).astype(np.float32) * 5
  bits = lambda x: np.asarray(x, np.float32).view(np.uint32)
  for needs in (True, False):
    config = R.RewardConfig(efficiency_needs_success=needs)
    limits = dict(max_turns=max_turns, max_action_len=max_action_len)

    def new(inputs, seconds, config=config, limits=limits):
      c = R.episode_components(**inputs, seconds=seconds, config=config, **limits)
      return R.combine(c, config), c

    def old(inputs, config=config, limits=limits):
      c = _old_components(**inputs, **limits)
      return _old_reward(c, config), c

    for run_new, run_old in ((new, old), (jax.jit(new), jax.jit(old)),
                             (jax.jit(jax.vmap(new)), jax.jit(jax.vmap(old)))):
      (r_new, c_new), (r_old, c_old) = run_new(inputs, seconds), run_old(inputs)
      np.testing.assert_array_equal(bits(r_new), bits(r_old))
      for k in ("outcome", "format", "efficiency"):
        np.testing.assert_array_equal(bits(c_new[k]), bits(c_old[k]))


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("kwargs, match", [
    (dict(efficiency_weights=dict(time=-0.1)), "efficiency_weights.time"),
    (dict(efficiency_weights=dict(calls=float("inf"))), "efficiency_weights.calls"),
    (dict(efficiency_weights=dict(tokens=float("nan"))), "efficiency_weights.tokens"),
    (dict(efficiency_weights=dict(tme=0.5)), r"unknown keys \['tme'\]"),
    (dict(time_budget_s=0.0), "time_budget_s"),
    (dict(time_budget_s=float("inf")), "time_budget_s"),
    (dict(efficiency=-1.0), "RewardConfig.efficiency"),
])
def test_reward_config_refuses_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    R.RewardConfig(**kwargs)


@pytest.mark.parametrize("edit, match", [
    (lambda r: r.update(efficency=0.1), r"config.tasks.rewards has no key efficency"),
    (lambda r: r.efficiency_weights.update(tme=0.5),
     r"config.tasks.rewards.efficiency_weights has no key tme"),
    (lambda r: r.efficiency_weights.update(time=-1.0), "efficiency_weights.time"),
    (lambda r: r.update(time_budget_s=0.0), "time_budget_s"),
    (lambda r: r.update(format=float("nan")), "RewardConfig.format"),
])
def test_bad_reward_configs_fail_before_compiling(edit, match):
  cfg = default.get_config("all,tiny")
  edit(cfg.tasks.rewards)
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(cfg)


# ------------------------------------------------------- jitted families
def test_jitted_tools_declare_latencies_a_lookup_slower_than_a_calculator():
  lat = tools.latencies()
  assert lat.shape == (len(T.TOOLS),) and lat.dtype == np.float32 and (lat > 0).all()
  assert lat[T.LOOKUP] > lat[T.OPEN] > lat[T.CALC]


BOXES_SCRIPT = ["<tool_call>open 1</tool_call>", "<tool_call>lookup 3</tool_call>",
                "<tool_call>dance 2</tool_call>", "<tool_call>open</tool_call>",
                "<answer>3</answer>"]


def test_a_jitted_episode_sums_its_tools_latencies(codec):
  """Calls naming a known tool cost its latency (a malformed one too: the
  tool ran and answered with an error); an unknown tool and the answer
  cost nothing. The time weight moves ``efficiency`` by ``w * s / budget``."""
  config = R.RewardConfig(efficiency_weights=dict(time=0.5), time_budget_s=2.0)
  env = E.BoxesEnv(codec, max_turns=6, rewards=config)
  state = env.reset(env.generate(jax.random.key(0), 0))
  step = jax.jit(env.step)
  A = env.max_action_len
  seconds = []
  for text in BOXES_SCRIPT:
    ids = codec.tokenizer.encode(text)
    state, out = step(state, jnp.asarray(np.pad(ids, (0, A - len(ids))), jnp.int32),
                      jnp.int32(len(ids)))
    seconds.append(float(out.info["env_seconds"]))
  lat = tools.latencies()
  open_, lookup = float(lat[T.OPEN]), float(lat[T.LOOKUP])
  np.testing.assert_allclose(seconds, [open_, open_ + lookup, open_ + lookup,
                                       2 * open_ + lookup, 2 * open_ + lookup], rtol=1e-6)
  c = {k: float(v) for k, v in out.reward_components.items()}
  total = 2 * open_ + lookup
  np.testing.assert_allclose(c["efficiency_time"], 1 - total / 2.0, rtol=1e-6)
  tokens = int(state.policy_tokens)
  np.testing.assert_allclose(
      c["efficiency"], 1 - 0.5 * 4 / 6 - 0.5 * tokens / (6 * A) - 0.5 * total / 2.0, rtol=1e-6)


# ------------------------------------------------------- host environments
class TwoGuesses:
  """Ends on the second action; succeeds (reward 1) on even seeds."""

  delay = 0.0

  def reset(self, seed):
    time.sleep(self.delay)
    self.seed, self.actions = seed, 0
    return "guess twice"

  def step(self, action):
    time.sleep(self.delay)
    self.actions += 1
    done = self.actions == 2
    return "again", float(done and self.seed % 2 == 0), done


class SlowTwoGuesses(TwoGuesses):
  delay = 0.05


def _host_run(**rewards):
  cfg = default.get_config("all,tiny")
  cfg.tasks.rewards.update(**rewards)
  return HostCollector(config_lib.validate(cfg), codec=None, model_config=None, tasks=None)


def test_a_slow_host_environment_gets_a_lower_time_efficiency(codec):
  config = model_lib.TransformerConfig.tiny(vocab_size=codec.tokenizer.vocab_size)
  params = model_lib.init_params(config, jax.random.key(0))
  sampling = rollout.SamplingConfig(max_new_tokens_per_turn=16, max_turns=4,
                                    max_total_tokens=128)
  host = rollout.HostLoop(config, sampling, codec, batch_size=3, max_obs_tokens=16)
  envs = [TwoGuesses(), SlowTwoGuesses(), SlowTwoGuesses()]
  ro = host.run(params, envs, [0, 0, 1], jax.random.key(1), 0,
                actor=lambda tag, obs: "<answer>1</answer>")
  seconds = np.asarray(ro.env_seconds_B)
  assert seconds.dtype == np.float32
  # A reset and two steps, 50 ms each on the slow rows.
  assert seconds[0] < 0.05 and (seconds[1:] >= 0.15).all() and (seconds[1:] < 1.0).all()

  collector = _host_run(efficiency=0.5, efficiency_needs_success=True, time_budget_s=1.0,
                  efficiency_weights=dict(calls=0.5, tokens=0.5, time=1.0))
  out = collector.with_outcome(ro)
  c = out.reward_components
  np.testing.assert_array_equal(c["outcome"], [1.0, 1.0, 0.0])
  np.testing.assert_allclose(c["efficiency_time"], 1 - seconds, rtol=1e-5)
  assert c["efficiency_time"][0] > 0.95 > 0.85 > c["efficiency_time"][1]
  np.testing.assert_array_equal(c["efficiency_calls"], [1.0, 1.0, 1.0])  # no tools offered
  tokens = (np.asarray(ro.loss_mask_BxT) > 0).sum(axis=1)
  s = collector.cfg.sampling
  np.testing.assert_allclose(
      c["efficiency_tokens"], 1 - tokens / (s.max_turns * s.max_new_tokens_per_turn), rtol=1e-6)
  np.testing.assert_allclose(c["efficiency"],
                             1 - 0.5 * (1 - c["efficiency_tokens"]) - seconds, rtol=1e-5)
  # The gated term joins the environment's reward, on the last turn.
  term = np.array([0.5 * c["efficiency"][0], 0.5 * c["efficiency"][1], 0.0], np.float32)
  np.testing.assert_allclose(out.reward_B, np.asarray(ro.reward_B) + term, rtol=1e-6)
  np.testing.assert_allclose(out.turn_rewards_BxC.sum(axis=1), out.reward_B, rtol=1e-6)
  np.testing.assert_allclose(out.turn_rewards_BxC[:, 1] - ro.turn_rewards_BxC[:, 1], term,
                             rtol=1e-6)
  assert out.reward_B[0] > out.reward_B[1] > 1.0 and out.reward_B[2] == 0.0


class SlowResetGuess(text_games.GuessNumber):
  """The example game with a 50 ms reset (the untrained policy seldom
  closes an action, so resets are the calls every episode makes)."""

  def reset(self, seed):
    time.sleep(0.05)
    return super().reset(seed)


def test_the_time_weight_changes_the_reward_in_training(tmp_path):
  records = {}
  for time_weight in (0.0, 0.5):
    cfg = default.get_config("all,tiny")
    cfg.stages = ("rl",)
    cfg.tasks.update(source="host", host_env=f"{__name__}:SlowResetGuess")
    cfg.tasks.rewards.update(time_budget_s=0.2)
    cfg.tasks.rewards.efficiency_weights.time = time_weight
    cfg.rl.update(iterations=1)
    cfg.rl.signal.allocation = "uniform"  # the same batch whatever the rewards
    cfg.eval.update(num_prompts=2, pass_k_prompts=1)
    workdir = os.path.join(str(tmp_path), str(time_weight))
    loop.train(cfg, workdir)
    records[time_weight] = metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl"))[0]
  free, timed = records[0.0], records[0.5]
  for r in (free, timed):
    assert all(k in r for k in PARTS), [k for k in PARTS if k not in r]
    assert r["reward/efficiency_time"] < 0.8  # 50 ms of a 200 ms budget at least
  # The same episodes: their outcome, calls and tokens agree; the time part
  # costs efficiency, and so reward.
  for k in ("reward/outcome", "reward/efficiency_calls", "reward/efficiency_tokens"):
    assert free[k] == timed[k], k
  assert timed["reward/efficiency"] < free["reward/efficiency"]
  assert timed["reward/mean"] < free["reward/mean"]
