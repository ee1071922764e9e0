"""The trainer on Python ("host") environments: the built-in example with
demonstrations, broken environments that cost nothing but their own
episodes, and the refusals."""

import math
import os
import threading
import time

import jax
import numpy as np
import pytest

from agentic_rl import model as model_lib
from agentic_rl.envs import text_games
from agentic_rl.train import checkpoint as checkpoint_lib
from agentic_rl.train import config as config_lib
from agentic_rl.train import learner
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from agentic_rl.train import run as run_lib
from agentic_rl.train import stream
from agentic_rl.rollout.types import EPISODE_STATUS
from experiments.configs import default

INVARIANT_KEYS = (
    "reward/mean", "reward/outcome", "reward/efficiency", "reward/efficiency_calls",
    "reward/efficiency_tokens", "reward/efficiency_time", "eval/success", "eval/pass_at_k",
    "explore/entropy",
    "explore/distinct_tool_seqs", "explore/tool_seq_edit_dist", "signal/zero_variance_frac",
    "signal/adv_std", "signal/effective_token_frac", "shift/staleness_mean",
    "shift/kl_behaviour_learner", "shift/is_ratio_mean", "shift/weight_zero_frac",
    "learner/grad_norm", "learner/loss", "learner/entropy", "episode/turns",
    "episode/env_errors", "episode/env_timeouts", "episode/nonfinite_rewards",
    "episode/obs_clipped", "episode/obs_overflow", "perf/rollout_tokens_per_s")


def _host_cfg(host_env="guess_number", stages=("sft", "rl")):
  cfg = default.get_config("tiny")
  cfg.stages = stages
  cfg.tasks.update(source="host", host_env=host_env)
  return cfg


def _records(cfg, workdir):
  summary = loop.train(cfg, str(workdir))
  return summary, metrics_lib.read_metrics(os.path.join(str(workdir), "metrics.jsonl"))


def test_sft_then_rl_on_the_built_in_host_environment(tmp_path):
  summary, records = _records(_host_cfg(), tmp_path)
  assert summary["steps"] == 7 and 0 <= summary["rl_success"] <= 1
  sft, rl = records[:4], records[4:]
  assert all(np.isfinite(r["sft/nll"]) for r in sft) and sft[-1]["sft/nll"] < sft[0]["sft/nll"]
  for r in rl:
    missing = [k for k in INVARIANT_KEYS if k not in r and not k.startswith("eval/")]
    assert not missing, missing
    assert r["episode/env_errors"] == r["episode/env_timeouts"] == 0
  assert "eval/success" in rl[-1]
  # Actions are hashed, so the behaviour paths of a group can be told apart.
  assert any(r["explore/distinct_tool_seqs"] > 0 for r in rl)


def test_eval_at_start_scores_the_initial_parameters(tmp_path):
  cfg = _host_cfg(stages=("rl",))
  cfg.rl.iterations = 1
  cfg.eval.at_start = True
  summary, _ = _records(cfg, tmp_path / "on")
  run = run_lib.build(cfg)
  expected = run_lib.evaluate(run, checkpoint_lib.initial_params(run, checkpoint_lib.params_key(
      run.cfg)), jax.random.fold_in(jax.random.key(cfg.seed), 0))
  assert summary["init_success"] == expected["eval/success"]
  assert summary["init_success_sampled"] == expected["eval/pass_at_1"]
  # Resumed, the run keeps the first evaluation (its parameters are no longer
  # the initial ones).
  cfg.rl.iterations = 2
  assert loop.train(cfg, str(tmp_path / "on"))["init_success"] == summary["init_success"]
  cfg.eval.at_start = False
  assert "init_success" not in loop.train(cfg, str(tmp_path / "off"))


def test_the_learner_reads_only_the_positions_its_batches_fill(tmp_path, monkeypatch):
  """SFT and RL batches stop at their last scored token's bucket, not at
  max_total_tokens (the episodes here are under 128 tokens)."""
  widths = []
  shard = learner.shard_train_step

  def recording(*args, **kwargs):
    step, state_sharding = shard(*args, **kwargs)

    def recorded(state, batch):
      widths.append(batch["tokens_BxT"].shape[1])
      return step(state, batch)
    return recorded, state_sharding

  monkeypatch.setattr(learner, "shard_train_step", recording)
  cfg = _host_cfg()
  cfg.sampling.max_total_tokens = 512
  summary, records = _records(cfg, tmp_path)
  assert len(widths) == summary["steps"] and set(widths) == {128}
  assert all(math.isfinite(r["shift/kl_behaviour_learner"]) for r in records[cfg.sft.steps:])


class FlakyGuess(text_games.GuessNumber):
  """The example game, misbehaving on some seeds as ``seed % 8`` says: 0
  raises and 1 returns None at reset, 3 hangs past the time limit there, 4
  echoes the format's framing strings in its observations; on its steps 2
  gives a NaN reward and 5 raises. The rest play fair. (An untrained policy
  rarely closes an action, so the reset faults are the ones every run sees;
  tests/test_rollout_host.py drives each fault through a scripted actor.)"""

  def reset(self, seed):
    self.kind = seed % 8
    if self.kind == 0:
      raise RuntimeError("the game did not start")
    if self.kind == 1:
      return None
    if self.kind == 3:
      time.sleep(30)
    obs = super().reset(seed)
    return f"<tool_result>{obs}</tool_result><|end|>" if self.kind == 4 else obs

  def step(self, action):
    obs, reward, done = super().step(action)
    if self.kind == 2:
      return obs, math.nan, done
    if self.kind == 5:
      raise RuntimeError("the game crashed")
    return obs, reward, done


class LongWelcome(text_games.GuessNumber):
  """The example game whose first observation outgrows the tiny context
  (160 tokens) on every seed, or with ``only_odd`` on odd seeds only."""

  def __init__(self, only_odd=False, **kwargs):
    super().__init__(**kwargs)
    self.only_odd = only_odd

  def reset(self, seed):
    obs = super().reset(seed)
    return obs + " Welcome!" * 200 if seed % 2 or not self.only_odd else obs


@pytest.mark.parametrize("only_odd", [False, True])
def test_first_observations_that_leave_no_room_to_act_are_refused(only_odd, tmp_path):
  cfg = _host_cfg(host_env=f"{__name__}:LongWelcome", stages=("rl",))
  cfg.tasks.host_kwargs = '{"only_odd": %s}' % str(only_odd).lower()
  cfg.rl.update(iterations=1, prompts_per_step=4, group_size=2)
  cfg.rl.signal.allocation = "uniform"
  if not only_odd:
    with pytest.raises(ValueError, match=r"first prompts of up to \d+ tokens .* leave no room "
                       r"in max_total_tokens=160; raise --config\.sampling\.max_total_tokens"):
      loop.train(cfg, str(tmp_path))
    return
  # Where some episodes can act, those that cannot end as overflows and the
  # rest play.
  summary, records = _records(cfg, tmp_path)
  assert summary["steps"] == 1
  assert 0 < records[0]["episode/obs_overflow"] < records[0]["signal/rollouts"] == 8
  assert records[0]["episode/turns"] > 0


class LongFirstAction(text_games.GuessNumber):
  """The example game whose demonstrations think aloud before the first
  guess: an action longer than the tiny config's 24 tokens per turn."""

  def demonstration(self, seed, noise=0.0):
    first, *rest = super().demonstration(seed, noise)
    return ["I halve the range each time, so the first guess is the middle. " + first, *rest]


def test_demonstration_actions_longer_than_a_turn_are_refused_with_the_limit_that_fits(tmp_path):
  cfg = _host_cfg(host_env=f"{__name__}:LongFirstAction", stages=("sft",))
  cfg.sft.demo_noise = 0.0  # every first action is then the same
  with pytest.raises(ValueError, match=r"a demonstration's action has \d+ tokens, more than "
                     r"max_new_tokens_per_turn=24 .*'I halve the range.*raise --config\."
                     r"sampling\.max_new_tokens_per_turn to the longest action's length, "
                     r"at least \d+") as e:
    loop.train(cfg, str(tmp_path / "refused"))
  # The first actions are the longest here, so the length named is enough.
  cfg.sampling.max_new_tokens_per_turn = int(str(e.value).rsplit(" ", 1)[-1])
  summary, records = _records(cfg, tmp_path / "fits")
  assert summary["steps"] == 4 and all(np.isfinite(r["sft/nll"]) for r in records)


class GymStep(text_games.GuessNumber):
  """The example game with a Gym-style step: five values, not three."""

  def step(self, action):
    return *super().step(action), False, {}


def test_demonstrations_that_all_fail_in_the_environment_say_why(tmp_path):
  cfg = _host_cfg(host_env=f"{__name__}:GymStep", stages=("sft",))
  with pytest.raises(ValueError, match=r"no demonstration .* ended done .*; of 64 episodes, "
                     r"these ended early: \{'env_error': 64\}, most often \"step: TypeError: "
                     r"step must return \(observation, reward, done\), got tuple"):
    loop.train(cfg, str(tmp_path))


def test_broken_environments_cost_only_their_own_episodes(tmp_path):
  cfg = _host_cfg(host_env=f"{__name__}:FlakyGuess", stages=("rl",))
  cfg.tasks.update(env_timeout_s=0.3, env_workers=8, train_size=64)
  cfg.rl.update(iterations=1, prompts_per_step=8, group_size=2)
  cfg.rl.signal.allocation = "uniform"
  cfg.eval.update(num_prompts=4, pass_k_prompts=2)
  summary, records = _records(cfg, tmp_path)
  assert summary["steps"] == 1 and "eval/success" in records[-1]
  for r in records:
    # The iteration's 8 consecutive seeds hold each fault once, G = 2 each.
    assert r["episode/env_errors"] >= 4 and r["episode/env_timeouts"] == 2
    assert np.isfinite(r["learner/loss"]) and r["learner/skipped"] == 0
    assert r["signal/rollouts"] == 16


class HalfBroken(text_games.GuessNumber):
  """The episodes of odd seeds fail at their reset, and every second action
  of the others raises."""

  def reset(self, seed):
    if seed % 2:
      raise RuntimeError("broken reset")
    return super().reset(seed)

  def step(self, action):
    if self.guesses % 2:
      raise RuntimeError("broken step")
    return super().step(action)


def test_an_asynchronous_run_counts_every_failed_episode_once(tmp_path, monkeypatch):
  """Failures are counted as their episodes end, in the next batch's record,
  also when the episode is later replayed as stale or never reaches a batch."""
  ended, batches = [], []
  finished, batch = stream.HostStream._finished, stream.HostStream._batch

  def on_finished(self, tag, rollout):
    ended.append(int(rollout.status_B[0]) == EPISODE_STATUS.index("env_error"))
    return finished(self, tag, rollout)

  def on_batch(self, gids):
    batches.append(len(ended))  # the episodes ended before this batch
    return batch(self, gids)

  monkeypatch.setattr(stream.HostStream, "_finished", on_finished)
  monkeypatch.setattr(stream.HostStream, "_batch", on_batch)
  cfg = _host_cfg(host_env=f"{__name__}:HalfBroken", stages=("rl",))
  cfg.rl.update(actor="async", max_staleness=1, iterations=4)
  cfg.rl.signal.allocation = "uniform"
  summary, records = _records(cfg, tmp_path)
  assert summary["steps"] == 4 and len(batches) == 4
  counted = [r["episode/env_errors"] for r in records]
  assert counted == [sum(ended[a:b]) for a, b in zip([0] + batches[:-1], batches)]
  assert sum(counted) > 0


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.tasks.update(host_env="nope"), "expected 'MODULE:FACTORY'"),
    (lambda c: c.tasks.update(host_env="no_such_module:Env"), "cannot be loaded"),
    (lambda c: c.tasks.update(host_kwargs='{"high": 0}'), "building it with host_kwargs"),
    (lambda c: c.tasks.update(host_kwargs="[1]"), "mapping or a JSON object"),
    (lambda c: c.tasks.update(host_env=f"{__name__}:NoDemos"), r"--config\.stages=rl"),
    (lambda c: c.tasks.update(host_env=f"{__name__}:NotAnEnv"), "lacks"),
    (lambda c: c.tasks.update(obs_overflow="wrap"), "obs_overflow"),
    (lambda c: c.tasks.update(source="remote"), "config.tasks.source"),
    (lambda c: c.tasks.update(env_pool="cluster"), "config.tasks.env_pool"),
    (lambda c: c.tasks.update(host_env=f"{__name__}:ToolsWithoutCall"), "call_tool"),
    (lambda c: c.tasks.update(host_env=f"{__name__}:BadTools"), "list of JSON schemas"),
    (lambda c: c.rl.exploration.update(temperature_schedule="linear", temperature_final=0.5),
     "temperature_schedule"),
    (lambda c: c.tasks.update(host_env=f"{__name__}:CleanDemos"), r"--config\.sft\.demo_noise=0"),
    (lambda c: c.tasks.update(host_reward="partial"), "config.tasks.host_reward"),
    (lambda c: c.tasks.update(source="jax", host_reward="success"), "own reward"),
])
def test_bad_host_configs_fail_before_compiling(edit, match):
  cfg = _host_cfg()
  edit(cfg)
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(cfg)


class NoDemos:
  def reset(self, seed):
    return "hello"

  def step(self, action):
    return "", 0.0, True


class NotAnEnv:
  pass


class CleanDemos(NoDemos):
  def demonstration(self, seed):
    return ["<answer>1</answer>"]


class ToolsWithoutCall(NoDemos):
  tools = [{"name": "search"}]


class BadTools(NoDemos):
  tools = ["search"]

  def call_tool(self, name, arguments):
    return "", 0.0, False


@pytest.mark.parametrize("actor", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_a_gem_game_trains_where_gem_is_installed(tmp_path, actor):
  pytest.importorskip("gem", reason="GEM (pip install gem-llm==0.1.0) is optional")
  cfg = _host_cfg(host_env="gem:game:GuessTheNumber-v0-easy", stages=("rl",))
  cfg.sampling.max_total_tokens = 1024
  cfg.rl.actor = actor
  summary, records = _records(cfg, tmp_path)
  assert summary["steps"] == cfg.rl.iterations
  assert all(k in records[-1] for k in INVARIANT_KEYS)


def test_a_gem_game_warm_starts_on_its_expert_then_trains(tmp_path):
  pytest.importorskip("gem", reason="GEM (pip install gem-llm==0.1.0) is optional")
  cfg = default.get_config("gem,tiny")
  summary, records = _records(cfg, tmp_path)
  assert summary["steps"] == cfg.sft.steps + cfg.rl.iterations
  sft, rl = records[:cfg.sft.steps], records[cfg.sft.steps:]
  # The demonstrations are the expert's games, played through the host loop.
  assert sft[-1]["sft/nll"] < sft[0]["sft/nll"] and sft[0]["sft/demos"] > 0
  assert all(k in rl[-1] for k in INVARIANT_KEYS)
  assert all(r["episode/env_errors"] == 0 for r in rl)


def test_each_thread_plays_on_its_own_host_loop():
  """The asynchronous actor plays in its thread while the learner evaluates
  in its own: they never share a loop or its environments."""
  run = run_lib.build(_host_cfg())
  sampling = config_lib.sampling_config(run.cfg)
  loop_here, envs_here = run.collector.host_loop(sampling, 2)
  assert run.collector.host_loop(sampling, 2)[0] is loop_here
  there = []
  thread = threading.Thread(target=lambda: there.extend(run.collector.host_loop(sampling, 2)))
  thread.start()
  thread.join()
  assert there[0] is not loop_here and not {id(e) for e in there[1]} & {id(e) for e in envs_here}


def _rl_only(host_env="guess_number", **tasks):
  cfg = _host_cfg(host_env=host_env, stages=("rl",))
  cfg.tasks.update(**tasks)
  cfg.rl.update(iterations=2, prompts_per_step=4, group_size=4)
  cfg.eval.update(num_prompts=4, pass_k_prompts=2)
  return cfg


def test_success_threshold_decides_which_episodes_succeed(tmp_path):
  # Every episode's reward (0 when the untrained policy never guesses right)
  # is above -1: all succeed.
  _, records = _records(_rl_only(success_threshold=-1.0), tmp_path)
  assert all(r["reward/outcome"] == 1.0 for r in records)
  assert records[-1]["eval/success"] == 1.0


class LongReplies(text_games.GuessNumber):
  """The guessing game whose replies run to about 200 tokens."""

  def step(self, action):
    obs, reward, done = super().step(action)
    return obs + " hint" * 100, reward, done


@pytest.mark.parametrize("overflow", ["end", "clip"])
def test_obs_overflow_ends_or_clips_long_observations(tmp_path, overflow):
  cfg = _rl_only(f"{__name__}:LongReplies", obs_overflow=overflow, max_obs_tokens=16)
  _, records = _records(cfg, tmp_path)
  ended = sum(r["episode/obs_overflow"] for r in records)
  clipped = sum(r["episode/obs_clipped"] for r in records)
  if overflow == "end":
    assert ended > 0 and clipped == 0
  else:
    assert clipped > 0 and ended == 0


class CountedGuess(text_games.GuessNumber):
  """The guessing game with slow resets that counts how many run at once."""

  lock, running, peak = threading.Lock(), [0], [0]

  def reset(self, seed):
    with self.lock:
      self.running[0] += 1
      self.peak[0] = max(self.peak[0], self.running[0])
    time.sleep(0.05)
    with self.lock:
      self.running[0] -= 1
    return super().reset(seed)


@pytest.mark.parametrize("workers", [1, 4])
def test_env_workers_is_how_many_environment_calls_run_at_once(tmp_path, workers):
  CountedGuess.peak[0] = 0
  cfg = _rl_only(f"{__name__}:CountedGuess", env_workers=workers)
  cfg.rl.iterations = 1
  _records(cfg, tmp_path)
  assert CountedGuess.peak[0] == workers


def test_a_stopped_synchronous_host_run_resumes_bit_exact(tmp_path):
  cfg = _rl_only()
  _, straight = _records(cfg, tmp_path / "straight")
  assert loop.train(cfg, str(tmp_path / "resumed"), stop_after=1)["stopped"] == "stop_after"
  _, resumed = _records(cfg, tmp_path / "resumed")
  assert len(resumed) == len(straight) == 2
  drop = ("perf/", "wall_time", "reward/efficiency_time")  # measured time varies
  for a, b in zip(straight, resumed):
    assert {k: v for k, v in a.items() if not k.startswith(drop)} == {
        k: v for k, v in b.items() if not k.startswith(drop)}


class PartialGuess(text_games.GuessNumber):
  """The guessing game paying 0.05 for each wrong guess: partial credit that
  never adds up to a success."""

  def step(self, action):
    observation, reward, done = super().step(action)
    return observation, reward or 0.05, done


@pytest.mark.parametrize("host_reward", ["env", "success"])
def test_host_reward_success_pays_the_outcome_alone(tmp_path, host_reward):
  cfg = _rl_only(f"{__name__}:PartialGuess", host_reward=host_reward)
  cfg.tasks.rewards.efficiency = 0.0
  if host_reward == "success":
    # An episode with a guess earns 0.05 or more, above the threshold: a
    # success, paid rewards.outcome whatever the environment paid.
    cfg.tasks.update(success_threshold=0.0)
    cfg.tasks.rewards.outcome = 2.0
  _, records = _records(cfg, tmp_path)
  rl = [r for r in records if "reward/mean" in r]
  assert len(rl) == cfg.rl.iterations
  for r in rl:
    if host_reward == "env":  # wrong guesses earn 0.05 each, none succeeds
      assert r["reward/mean"] > r["reward/outcome"] == 0.0
    else:
      assert r["reward/mean"] == pytest.approx(2.0 * r["reward/outcome"])
  assert any(r["reward/outcome"] > 0 for r in rl) == (host_reward == "success")


def test_demo_noise_makes_mistakes_in_host_demonstrations(tmp_path, monkeypatch):
  """sft.demo_noise reaches the environment's demonstration(seed, noise):
  noisy demonstrations guess off the binary search, clean ones do not."""
  played = {}
  original = text_games.GuessNumber.demonstration

  def spy(self, seed, *noise):
    played[(seed, noise)] = original(self, seed, *noise)
    return played[(seed, noise)]

  monkeypatch.setattr(text_games.GuessNumber, "demonstration", spy)
  for demo_noise in (0.0, 0.5):
    cfg = _host_cfg(stages=("sft",))
    cfg.sft.update(demo_noise=demo_noise, steps=1)
    loop.train(cfg, str(tmp_path / str(demo_noise)))
  clean = {seed: actions for (seed, noise), actions in played.items() if not noise}
  noisy = {seed: actions for (seed, noise), actions in played.items() if noise == (0.5,)}
  assert clean and noisy.keys() == clean.keys()
  assert all(original(text_games.GuessNumber(), s) == a for s, a in clean.items())
  assert sum(noisy[s] != clean[s] for s in clean) > len(clean) // 4


def test_the_calculator_answers_expressions_and_its_demonstrations_win():
  assert text_games.evaluate("12 * (3 - 40)") == -444
  for bad in ("2 ** 8", "7 / 2", "__import__('os')", "1 +"):
    with pytest.raises(ValueError, match="not an"):
      text_games.evaluate(bad)
  env = text_games.Calculator(digits=2, ops="*", max_turns=2)
  question = env.reset(5)
  a, b = (int(v) for v in question.split("?")[0].split()[-3::2])
  assert env.call_tool("calculator", {"expression": "2 ** 8"})[0].startswith("error: not an")
  assert env.step("I think it is 12.") == ("Call the calculator or answer <answer>n</answer>.",
                                           0.0, True)  # the second action: out of turns
  env.reset(5)
  assert env.step(f"<answer>{a * b}</answer>") == ("Correct.", 1.0, True)
  # Played through the host loop in the codec's tool-call format: one call,
  # then the right answer, on every demonstration seed.
  cfg = default.get_config("all,tiny,calculator")
  cfg.sampling.max_new_tokens_per_turn = 96
  run = run_lib.build(cfg)
  collector = run.collector
  seeds = np.arange(4)
  scripts = [list(run.tasks.make().demonstration(int(s)))
             for s in run.tasks.seeds("demo", seeds)]
  params = model_lib.init_params(run.model_config, jax.random.key(0))
  ro = collector.rows(params, config_lib.sampling_config(run.cfg, greedy=True), "demo", seeds,
                      jax.random.key(0), 0, temperature=None, weights=None, restart=False,
                      group_size=1,
                      actor=lambda b, obs: scripts[b].pop(0))
  np.testing.assert_array_equal(ro.reward_components["outcome"], 1.0)
  np.testing.assert_array_equal(ro.num_tool_calls_B, 1)
