"""PARL: an orchestrator's spawns played by frozen sub-agents, their
critical steps, and the trainer's ``config.parl`` through ``loop.train``."""

import json
import os

import jax
import numpy as np
import pytest

from agentic_rl import model as model_lib
from agentic_rl.envs.python_tasks import SPLIT_OFFSETS
from agentic_rl.envs.swarm import ParallelHops, Spawn, SubResult, Subtask, answer_of
from agentic_rl.envs.text_games import GuessNumber
from agentic_rl.rollout import HostLoop, SamplingConfig
from agentic_rl.rollout.swarm import SubAgent, Swarm, Tally
from agentic_rl.rollout.types import Rollout
from agentic_rl.train import config as config_lib
from agentic_rl.train import loop, parl
from agentic_rl.train import metrics as metrics_lib
from agentic_rl.train.run import load_codec
from experiments.configs import default


# ------------------------------------------------------------------ the task
def test_parallel_hops_questions_are_disjoint_and_deterministic():
  env = ParallelHops(questions=3, level=1)
  prompt = env.reset(7)
  assert prompt == ParallelHops(questions=3, level=1).reset(7)
  assert prompt.startswith("Follow 2 hops from each of ")
  assert len(env.table) == 3 * 6  # three tables of six nodes, no id shared
  for inst in env.instances:  # each question's path is in the joint table
    node = int(inst.start)
    for _ in range(2):
      node = env.table[node]
    assert node == int(inst.answer)


def test_sequential_demonstration_solves_it_by_lookups():
  env = ParallelHops(questions=2, level=1, spawn_demos=0.0)
  actions = env.demonstration(3)
  env.reset(3)
  assert len(actions) == 2 * 2 + 1
  for action in actions[:-1]:
    obs, reward, done = env.step(action)
    assert obs.isdigit() and reward == 0 and not done
  assert env.step(actions[-1]) == ("Correct.", 1.0, True)


def test_a_spawn_names_one_subtask_per_question_and_reads_their_answers():
  env = ParallelHops(questions=3, level=1, spawn_demos=1.0, agent="hop")
  actions = env.demonstration(5)
  env.reset(5)
  assert len(actions) == 2 and actions[0].startswith("<tool_call>spawn hop ")
  spawn = env.step(actions[0])
  assert isinstance(spawn, Spawn) and spawn.agent == "hop"
  assert [t.family for t in spawn.tasks] == ["multihop"] * 3
  assert [int(t.instance.answer) for t in spawn.tasks] == env.answers
  results = [SubResult(f"<answer>{a}</answer>", 3, True, 1.0) for a in env.answers[:2]]
  results.append(SubResult("<tool_call>lookup 1</tool_call>", 6, False, 0.0))
  obs, reward, done = spawn.then(results)
  assert obs == f"{env.answers[0]} {env.answers[1]} none" and reward == 0 and not done
  assert env.step(actions[1]) == ("Correct.", 1.0, True)


@pytest.mark.parametrize("action, observation", [
    ("<tool_call>spawn hop 1</tool_call>", "error: 1 starts no question"),
    ("<tool_call>lookup 12</tool_call>", "error: no node 12"),
    ("hello", "Use <tool_call>lookup N</tool_call>"),
])
def test_bad_actions_get_error_observations(action, observation):
  env = ParallelHops()
  env.reset(0)
  obs, reward, done = env.step(action)
  assert obs.startswith(observation) and reward == 0 and not done


def test_answer_of_reads_the_last_answer():
  assert answer_of("x <answer> 12 </answer>") == "12"
  assert answer_of("<tool_call>lookup 3</tool_call>") == "none"


def test_tally_counts_critical_and_total_steps():
  tally = Tally(2)
  tally.add(0, [SubResult("", 3, True, 0), SubResult("", 5, False, 0)])
  tally.add(0, [SubResult("", 2, True, 0)])
  info = tally.info(0, 4)  # 4 orchestrator actions, two of them spawned
  assert info["parl/spawns"] == 3 and info["parl/parallel_width"] == 2
  assert info["parl/critical_steps"] == 4 + 5 + 2 and info["parl/total_steps"] == 4 + 10
  np.testing.assert_allclose(info["parl/finished"], 2 / 3)
  assert tally.info(1, 3)["parl/critical_steps"] == 3  # no spawn: its actions
  tally.reset(0)
  assert tally.info(0, 0)["parl/spawns"] == 0


# ------------------------------------------------------------------ the loop
@pytest.fixture(scope="module")
def codec():
  return load_codec(None)


def _agent(codec, seed=0, max_turns=3):
  config = model_lib.TransformerConfig(vocab_size=codec.tokenizer.vocab_size, d_model=32,
                                       n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                                       mlp_dim=64)
  sampling = SamplingConfig(max_turns=max_turns, max_new_tokens_per_turn=8,
                            max_total_tokens=96, greedy=True)
  return SubAgent(model_lib.init_params(config, jax.random.key(seed)), config, sampling)


def _orchestrate(codec, swarm, seeds, actor):
  config = model_lib.TransformerConfig(vocab_size=codec.tokenizer.vocab_size, d_model=32,
                                       n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                                       mlp_dim=64)
  loop_ = HostLoop(config, SamplingConfig(max_turns=6, max_new_tokens_per_turn=32,
                                          max_total_tokens=192),
                   codec, batch_size=len(seeds), swarm=swarm)
  envs = [ParallelHops(questions=3, level=1, spawn_demos=1.0, agent="a") for _ in seeds]
  params = model_lib.init_params(config, jax.random.key(1))
  ro = loop_.run(params, envs, seeds, jax.random.key(2), 0, actor=actor)
  return ro, envs


def test_spawns_are_played_by_the_sub_agent_and_counted(codec):
  swarm = Swarm({"a": _agent(codec)}, codec, rows=4, max_width=3)
  seeds = [11, 12]
  scripts = {b: ParallelHops(questions=3, level=1, spawn_demos=1.0, agent="a").demonstration(s)
             for b, s in enumerate(seeds)}
  spawn_actions = [scripts[b][0] for b in scripts]
  observed = {b: [] for b in scripts}

  def actor(b, obs):
    observed[b].append(obs)
    return scripts[b].pop(0)

  ro, envs = _orchestrate(codec, swarm, seeds, actor)
  for b, env in enumerate(envs):
    env.reset(seeds[b])
    alone = swarm.run([env.step(spawn_actions[b])], jax.random.key(0))[0]
    turns = [r.turns for r in alone]
    # The observation after the spawn is the sub-agents' answers, in order.
    assert observed[b][1] == " ".join(answer_of(r.text) for r in alone)
    assert ro.info["parl/spawns"][b] == 3 and ro.info["parl/parallel_width"][b] == 3
    assert ro.info["parl/critical_steps"][b] == 2 + max(turns)
    assert ro.info["parl/total_steps"][b] == 2 + sum(turns)
    assert ro.done_B[b] and ro.reward_B[b] == 1.0  # the scripted answer is right


def test_a_spawn_that_cannot_run_is_an_error_observation(codec):
  swarm = Swarm({"a": _agent(codec)}, codec, rows=4, max_width=2)
  observed = []
  spawn = ParallelHops(spawn_demos=1.0, agent="a").demonstration(0)[0]
  scripts = [spawn.replace("spawn a", "spawn zed"), spawn, "<answer>1</answer>"]

  def actor(b, obs):
    observed.append(obs)
    return scripts[len(observed) - 1]

  ro, _ = _orchestrate(codec, swarm, [0], actor)
  assert observed[1].startswith("error: no agent 'zed'; agents: a")
  assert observed[2] == "error: a spawn runs 1 to 2 tasks, got 3"
  assert ro.info["parl/spawns"][0] == 0 and ro.info["parl/critical_steps"][0] == 3


def test_the_critical_step_budget_truncates(codec):
  script = ParallelHops(spawn_demos=1.0, agent="a").demonstration(4)
  for limit, truncated in ((2, True), (3, False)):
    swarm = Swarm({"a": _agent(codec)}, codec, rows=4, max_critical_steps=limit)
    ro, _ = _orchestrate(codec, swarm, [4], lambda b, obs, s=list(script): s.pop(0))
    # The spawn's 1 step and its sub-episodes' 1 turn: 2 critical steps.
    assert ro.truncated_B[0] == truncated and ro.done_B[0] != truncated
    assert ro.info["parl/critical_steps"][0] == (2 if truncated else 3)


def test_a_loop_without_sub_agents_answers_spawns_with_an_error(codec):
  config = model_lib.TransformerConfig(vocab_size=codec.tokenizer.vocab_size, d_model=32,
                                       n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                                       mlp_dim=64)
  loop_ = HostLoop(config, SamplingConfig(max_turns=3, max_new_tokens_per_turn=32,
                                          max_total_tokens=160), codec, batch_size=1)
  observed = []
  script = ParallelHops(spawn_demos=1.0, agent="a").demonstration(1)

  def actor(b, obs):
    observed.append(obs)
    return script.pop(0)

  ro = loop_.run(model_lib.init_params(config, jax.random.key(0)), [ParallelHops()], [1],
                 jax.random.key(0), 0, actor=actor)
  assert observed[1] == "error: this loop has no sub-agents" and ro.info == {}


def test_subtask_is_a_family_instance_or_a_text_env():
  with pytest.raises(ValueError, match="either"):
    Subtask()
  with pytest.raises(ValueError, match="either"):
    Subtask(family="multihop", env=ParallelHops())


# ------------------------------------------------------------------ the trainer
class Delegator:
  """Whatever the policy does: its first action spawns two multi-hop
  sub-tasks with agent ``a``, its second three with agent ``b``, its third
  ends the episode with reward 1. A demonstration episode spawns nothing
  (the warm start learns to close three actions)."""

  def __init__(self):
    self.hops = ParallelHops(questions=3, level=1)
    self.actions, self.demo = 0, False

  def reset(self, seed):
    self.actions, self.demo = 0, seed >= SPLIT_OFFSETS["demo"]
    self.hops.reset(seed)
    return "Delegate."

  def step(self, action):
    del action
    self.actions += 1
    tasks = [Subtask("multihop", i) for i in self.hops.instances]
    if self.actions == 1:
      return ("two done", 0.0, False) if self.demo else Spawn(
          "a", tasks[:2], lambda results: ("two done", 0.0, False))
    if self.actions == 2:
      return ("three done", 0.0, False) if self.demo else Spawn(
          "b", tasks, lambda results: ("three done", 0.0, False))
    return "bye", 1.0, True

  def demonstration(self, seed):
    del seed
    return ["<answer>1</answer>"] * 3


@pytest.fixture(scope="module")
def sub_agent_dir(tmp_path_factory):
  """A tiny policy trained (briefly) on multihop: the frozen sub-agent."""
  cfg = default.get_config("all,tiny")
  cfg.stages = ("sft",)
  cfg.tasks.update(families=("multihop",), weights=(1.0,))
  cfg.sft.steps = 2
  workdir = str(tmp_path_factory.mktemp("sub_agent"))
  loop.train(cfg, workdir)
  return workdir


def _orchestrator_cfg(sub_agent_dir, **parl_values):
  cfg = default.get_config("all,tiny")
  cfg.tasks.update(source="host", host_env=f"{__name__}:Delegator")
  cfg.sft.update(steps=60, batch_size=16, num_demos=16, demo_noise=0.0)  # learns to close actions
  cfg.rl.iterations = 2
  cfg.sampling.update(max_turns=4, max_new_tokens_per_turn=8, max_total_tokens=96)
  cfg.parl.update(agents=json.dumps({"a": sub_agent_dir, "b": sub_agent_dir}), **parl_values)
  return cfg


@pytest.mark.slow  # trains two sub-agents first; the swarm's pieces are tested alone above
def test_orchestrator_with_two_frozen_sub_agents_trains(sub_agent_dir, tmp_path):
  cfg = _orchestrator_cfg(sub_agent_dir, max_width=3, charge="total", parallel_bonus=0.3,
                          finish_bonus=0.2, anneal_iterations=2)
  loop.train(cfg, str(tmp_path))
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
  rl = [r for r in records if "parl/spawns" in r]
  assert len(rl) == 2
  for r in rl:  # the policy closes its three actions: two spawns, five sub-episodes
    assert r["episode/turns"] == 3 and r["parl/spawns"] == 5
    assert r["parl/parallel_width"] == 3
    assert 3 + 2 <= r["parl/critical_steps"] < r["parl/total_steps"]
  # total steps are charged: the calls budget (max_turns=4) is spent.
  assert rl[0]["reward/efficiency_calls"] == 0
  # The bonus l1 * 3/3 + l2 * finished, annealed: full at iteration 0, half at 1.
  bonus0 = 0.3 + 0.2 * rl[0]["parl/finished"]
  np.testing.assert_allclose(rl[0]["reward/parl_bonus"], bonus0, rtol=1e-5)
  np.testing.assert_allclose(rl[1]["reward/parl_bonus"],
                             0.5 * (0.3 + 0.2 * rl[1]["parl/finished"]), rtol=1e-5)
  assert "eval/parl/critical_steps" in records[-1]


@pytest.mark.slow
def test_charging_critical_steps_and_their_budget(sub_agent_dir, tmp_path):
  cfg = _orchestrator_cfg(sub_agent_dir, max_width=3, charge="critical",
                          max_critical_steps=100)
  cfg.stages = ("sft", "rl")
  loop.train(cfg, str(tmp_path / "critical"))
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path / "critical"), "metrics.jsonl"))
  r = [r for r in records if "parl/spawns" in r][0]
  # Critical steps, not total ones, against max_turns=4: every episode over it.
  assert r["parl/critical_steps"] > 4 and r["reward/efficiency_calls"] == 0
  assert "reward/parl_bonus" not in r
  # The first spawn (1 step and two sub-episodes) reaches a budget of 2:
  # truncated. The demonstrations' 3 steps are not held to it (else none
  # would end done and the SFT stage would be refused).
  cfg.parl.max_critical_steps = 2
  loop.train(cfg, str(tmp_path / "budget"))
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path / "budget"), "metrics.jsonl"))
  r = [r for r in records if "parl/spawns" in r][0]
  assert r["episode/turns"] == 1 and r["episode/truncated"] == 1 and r["parl/spawns"] == 2
  assert r["reward/outcome"] == 0


@pytest.mark.parametrize("change, message", [
    (lambda c, d: c.parl.update(agents="{bad json"), "config.parl.agents is not a JSON object"),
    (lambda c, d: c.parl.update(agents='{"a": "/nonexistent"}'), "not a run directory"),
    (lambda c, d: c.tasks.update(source="jax"), "set --config.tasks.source=host"),
    (lambda c, d: c.parl.update(charge="all"), "config.parl.charge"),
    (lambda c, d: c.parl.update(max_width=0), "config.parl.max_width"),
    (lambda c, d: c.parl.update(finish_bonus=-1.0), "config.parl.finish_bonus"),
])
def test_bad_parl_configs_are_refused_before_building(change, message, sub_agent_dir):
  cfg = _orchestrator_cfg(sub_agent_dir)
  change(cfg, sub_agent_dir)
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(cfg)


def test_charged_steps_without_sub_agents_are_tool_calls():
  ro = Rollout.__new__(Rollout)
  object.__setattr__(ro, "num_tool_calls_B", np.array([2, 3]))
  object.__setattr__(ro, "info", {})
  np.testing.assert_array_equal(parl.charged_steps(default.get_config("all,tiny"), ro), [2, 3])


def test_text_subtasks_are_played_by_a_host_trained_sub_agent(codec):
  agent = _agent(codec)
  host_agent = SubAgent(agent.params, agent.model_config, agent.sampling, source="host")
  swarm = Swarm({"g": host_agent, "j": agent}, codec, rows=2)
  tasks = [Subtask(env=GuessNumber(high=4, max_guesses=2), seed=s) for s in range(3)]
  spawn = Spawn("g", tasks, lambda results: ("", 0.0, True))
  assert swarm.check(spawn) is None
  assert swarm.check(Spawn("j", tasks, spawn.then)) == "error: agent 'j' plays built-in family tasks"
  results = swarm.run([spawn], jax.random.key(0))[0]
  assert len(results) == 3 and all(1 <= r.turns <= 2 for r in results)
  # Played alone, each text episode ends the same way (greedy, its own seed).
  again = swarm.run([Spawn("g", tasks[1:2], spawn.then)], jax.random.key(0))[0]
  assert again[0].turns == results[1].turns and again[0].text == results[1].text
