"""Where a run's episodes come from: one :class:`Collector`, chosen once in
:func:`agentic_rl.train.run.build` from ``config.tasks.source``.

* :class:`FamilyCollector` (``"jax"``): the built-in task families, stepped
  inside the jitted rollout engine (:class:`~agentic_rl.rollout.RolloutEngine`).
* :class:`HostCollector` (``"host"``): Python environments stepped between
  jitted segments by the host loop (:mod:`agentic_rl.envs.python_tasks`,
  :class:`~agentic_rl.rollout.HostLoop`); the asynchronous actor can play
  them continuously (:mod:`agentic_rl.train.stream`).

Both give the same :class:`~agentic_rl.rollout.types.Rollout`, with
``reward_components["outcome"]`` the success the signal controller and the
evaluation count; for host environments it is 1 when the episode's reward
exceeds ``config.tasks.success_threshold``. Both report the efficiency
components of ``config.tasks.rewards`` (:mod:`agentic_rl.envs.rewards`),
and a host episode's reward gains the same efficiency term as a jitted
one's. Nothing outside this module asks which source a run has.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Protocol

import jax
import numpy as np

from agentic_rl import envs as envs_lib
from agentic_rl import model as model_lib
from agentic_rl.envs import factories
from agentic_rl.envs import rewards as rewards_lib
from agentic_rl.envs import scripted, synthesis
from agentic_rl.envs.python_tasks import HostTasks
from agentic_rl.envs.tasks import PromptTooLong, Tasks
from agentic_rl.rollout.context import policy_tokens, scored_rows
from agentic_rl.rollout.engine import RolloutEngine
from agentic_rl.rollout.host_loop import HostLoop, ScriptTooLong
from agentic_rl.rollout.sampling import SamplingConfig
from agentic_rl.rollout.swarm import Swarm
from agentic_rl.rollout.types import EPISODE_STATUS, Rollout, select_rows
from agentic_rl.train import config as config_lib
from agentic_rl.train import parl, sharding
from agentic_rl.train.settings import Settings


class Collector(Protocol):
  """A run's task source: its prompts and how their episodes are played.

  ``tasks`` has ``difficulty_of(ids)``; ``family_names`` orders the
  families :meth:`families_of` indexes."""

  tasks: Any
  family_names: tuple[str, ...]

  def families_of(self, split: str, ids) -> np.ndarray:
    """int ``[N]``: the family of prompts ``ids`` of ``split``."""

  def rows(self, params, sampling: SamplingConfig, split: str, ids: np.ndarray, key,
           version: int, *, temperature: float | None, weights, restart: bool,
           group_size: int) -> Rollout:
    """Episodes of one engine batch: ``ids`` (len = the batch's rows) in runs
    of ``group_size`` equal ids sharing their prompt's prefill.
    ``temperature`` overrides ``sampling.temperature``; ``weights() ->
    (params, version)`` is polled between segments (partial rollouts, or
    with ``restart`` unfinished episodes start again under newer ones)."""

  def demonstrations(self, params, stage, key) -> dict[str, np.ndarray]:
    """The SFT stage's ``tokens_BxT`` and ``loss_mask_BxT``."""

  def streams(self, allocation: str) -> bool:
    """Whether the asynchronous actor plays episodes continuously under
    the signal controller's ``allocation``."""


@dataclasses.dataclass
class FamilyCollector:
  """The built-in task families (a :func:`agentic_rl.envs.make_env`
  mixture) in the jitted rollout engine."""

  cfg: Settings
  codec: Any
  model_config: model_lib.TransformerConfig
  mesh: Any
  env: Any
  tasks: Tasks
  engines: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def build(cls, cfg: Settings, codec, model_config, mesh) -> FamilyCollector:
    member_kwargs = {}
    if cfg.tasks.programs:  # a synthesised task dataset
      member_kwargs["composed"] = {"programs": synthesis.load_programs(cfg.tasks.programs)}
    env = envs_lib.make_env(
        "mixture", codec, members=tuple(cfg.tasks.families),
        weights=tuple(cfg.tasks.weights), member_kwargs=member_kwargs,
        rewards=cfg.tasks.rewards)
    if cfg.sampling.max_new_tokens_per_turn > env.max_action_len:
      raise ValueError(
          f"config.sampling.max_new_tokens_per_turn={cfg.sampling.max_new_tokens_per_turn}: "
          f"the task families read actions of at most {env.max_action_len} tokens; lower it")
    T = cfg.sampling.max_total_tokens
    tasks = Tasks(env, seed=cfg.seed, difficulty=cfg.tasks.difficulty, prompt_len=T // 2)
    # Before the model compiles: a batch of evaluation's shape from each split
    # (a longer prompt drawn later still raises PromptTooLong).
    try:
      for split, size in (("train", cfg.tasks.train_size), ("test", cfg.tasks.test_size)):
        tasks.prompts(tasks.instances(split, np.resize(np.arange(size), cfg.eval.batch_rows)))
    except PromptTooLong as e:
      raise ValueError(
          f"config.sampling.max_total_tokens={T}: task prompts take up to {e.length} tokens "
          f"and a prompt may fill half the context ({T // 2}); raise "
          f"--config.sampling.max_total_tokens to at least {2 * e.length}") from None
    return cls(cfg, codec, model_config, mesh, env, tasks)

  @property
  def family_names(self) -> tuple[str, ...]:
    return tuple(self.cfg.tasks.families)

  def families_of(self, split: str, ids) -> np.ndarray:
    return np.asarray(self.tasks.instances(split, np.asarray(ids)).family, np.int64)

  def streams(self, allocation: str) -> bool:
    del allocation
    return False

  def engine(self, sampling: SamplingConfig, rows: int, group_size: int = 1) -> RolloutEngine:
    """One compiled engine per (sampling settings, batch rows, group size),
    shared by the RL stages and evaluation (:meth:`rows` passes the
    temperature and greedy decoding as arguments of one program). Rows are
    episodes: groups are made by repeating prompts, and ``group_size``
    consecutive rows of one prompt share its prefill (and, with
    ``sampling.decode_shared_prefix``, its cache while decoding). On a
    single-process mesh with several batch shards the rows are split over
    them (a data-parallel rollout) when they divide evenly."""
    key = (sampling, rows, group_size)
    if key not in self.engines:
      shards = sharding.batch_shards(self.mesh)
      split = jax.process_count() == 1 and shards > 1 and rows % shards == 0
      self.engines[key] = RolloutEngine(
          self.model_config, sampling, self.codec.ids, env=self.env, batch_size=rows,
          group_size=group_size,
          row_sharding=sharding.batch_sharding(self.mesh) if split else None,
          decode_shared_prefix=self.cfg.sampling.decode_shared_prefix)
    return self.engines[key]

  def rows(self, params, sampling, split, ids, key, version, *, temperature, weights,
           restart, group_size) -> Rollout:
    inst = self.tasks.instances(split, ids[::group_size])
    prompts, lens = self.tasks.prompts(inst)
    # The engine is keyed without the temperature and greedy decoding: both
    # are arguments of its program (temperature 0 decodes greedily).
    if sampling.greedy:
      temperature = 0.0
    elif temperature is None:
      temperature = sampling.temperature
    sampling = dataclasses.replace(sampling, temperature=1.0, greedy=False)
    engine = self.engine(sampling, len(ids), group_size)
    if weights is None:
      return engine.rollout(params, prompts, lens, inst, key, version, temperature=temperature)
    start = state = engine.init_state(prompts, lens, inst, key)
    while not bool(np.all(np.asarray(state.ended_B))):
      new_params, new_version = weights()
      if restart and new_version != version:  # unfinished episodes start again
        state = select_rows(~state.ended_B, start, state)
      params, version = new_params, new_version
      state = engine.resume(params, state, version, temperature=temperature,
                            max_steps=sampling.max_new_tokens_per_turn)
    return state.to_rollout()

  def demonstrations(self, params, stage, key) -> dict[str, np.ndarray]:
    """The scripted policies' streams (:func:`agentic_rl.envs.demonstration_batch`)."""
    del params
    return scripted.demonstration_batch(
        self.tasks, stage.num_demos, key, noise=stage.demo_noise,
        max_len=self.cfg.sampling.max_total_tokens,
        max_action_len=self.cfg.sampling.max_new_tokens_per_turn,
        strategy_weights=config_lib.strategy_weights(stage))


@dataclasses.dataclass
class HostCollector:
  """Python environments (``config.tasks.host_env``) played by the host
  loop, with the frozen sub-agents of ``config.parl`` (``swarm``)."""

  cfg: Settings
  codec: Any
  model_config: model_lib.TransformerConfig
  tasks: HostTasks
  swarm: Swarm | None = None
  loops: dict = dataclasses.field(default_factory=dict)
  family_names: tuple[str, ...] = ("host",)

  @classmethod
  def build(cls, cfg: Settings, codec, model_config) -> HostCollector:
    tasks = HostTasks(factories.load_factory(cfg.tasks.host_env),
                      factories.host_kwargs(cfg.tasks.host_kwargs), spec=cfg.tasks.host_env,
                      pool=cfg.tasks.env_pool)
    swarm = parl.make_swarm(cfg, codec, config_lib.model_config, config_lib.sampling_config)
    return cls(cfg, codec, model_config, tasks, swarm)

  def families_of(self, split: str, ids) -> np.ndarray:
    del split
    return np.zeros(np.shape(ids), np.int64)

  def streams(self, allocation: str) -> bool:
    return allocation == "uniform"

  def rows(self, params, sampling, split, ids, key, version, *, temperature, weights,
           restart, group_size, actor=None) -> Rollout:
    """As :meth:`Collector.rows`; ``actor(b, observation) -> action``, when
    given, writes row b's actions instead of the policy (demonstrations).
    ``group_size`` is unused: the host loop prefills every row."""
    del group_size
    if temperature is not None:
      raise ValueError("host environments sample at the sampling config's temperature")
    loop, envs = self.host_loop(sampling, len(ids), scripted=actor is not None)
    latest = [version]

    def polled():
      params, latest[0] = weights()
      return params, latest[0]

    ro = loop.run(params, envs, self.tasks.seeds(split, ids), key, version, actor=actor,
                  weights=polled if weights is not None else None,
                  stale=(lambda tag, oldest: oldest < latest[0]) if restart else None)
    for b in np.flatnonzero(np.asarray(ro.status_B) == EPISODE_STATUS.index("env_timeout")):
      envs[b] = self.tasks.replace(envs[b])
    overflow = EPISODE_STATUS.index("obs_overflow")
    if np.all(np.asarray(ro.status_B) == overflow) and not np.any(policy_tokens(ro)):
      raise ValueError(
          f"host_env={self.cfg.tasks.host_env!r}: no episode of a batch could act: first "
          f"prompts of up to {loop.longest_unfit_prompt} tokens (the environment's first "
          f"observation in the chat template) leave no room in "
          f"max_total_tokens={self.cfg.sampling.max_total_tokens}; raise "
          f"--config.sampling.max_total_tokens")
    return self.with_outcome(ro)

  def with_outcome(self, ro: Rollout) -> Rollout:
    """A host rollout with its success as ``reward_components["outcome"]``
    (1.0 where the environment's summed reward is above
    ``tasks.success_threshold``) and the efficiency components of its tool
    calls, policy tokens and measured ``env_seconds_B``
    (:func:`agentic_rl.envs.rewards.host_components`); their weighted term
    is added to ``reward_B`` and to its last turn's reward. With
    ``tasks.host_reward="success"`` the environment's own rewards are
    replaced by ``tasks.rewards.outcome`` times the success, paid on the
    last turn: no partial credit (GEM's GuessTheNumber pays
    ``1 - distance / 9`` for a wrong last guess)."""
    cfg = self.cfg
    config = cfg.tasks.rewards
    success_B = np.asarray(ro.reward_B) > cfg.tasks.success_threshold
    comps, term_B = rewards_lib.host_components(
        success=success_B, calls=parl.charged_steps(cfg, ro), tokens=policy_tokens(ro),
        seconds=ro.env_seconds_B, max_turns=cfg.sampling.max_turns,
        max_action_len=cfg.sampling.max_new_tokens_per_turn, config=config)
    reward_B = np.asarray(ro.reward_B, np.float32)
    turn_rewards = np.array(ro.turn_rewards_BxC, np.float32)
    rows = np.arange(len(reward_B))
    last_B = np.clip(np.asarray(ro.num_turns_B) - 1, 0, turn_rewards.shape[1] - 1)
    if cfg.tasks.host_reward == "success":
      reward_B = np.float32(config.outcome) * success_B.astype(np.float32)
      turn_rewards = np.zeros_like(turn_rewards)
      turn_rewards[rows, last_B] = reward_B
    turn_rewards[rows, last_B] += term_B
    reward_B = reward_B + term_B
    return ro.replace(reward_B=reward_B, turn_rewards_BxC=turn_rewards, reward_components=comps)

  def host_loop(self, sampling: SamplingConfig, rows: int, scripted: bool = False,
                ) -> tuple[HostLoop, list]:
    """One compiled host loop and its ``rows`` environments per (sampling
    settings, batch rows, ``scripted``: for demonstrations) and thread: a
    loop and its environments hold the episodes they play, and the
    asynchronous actor's thread plays while the learner's evaluates."""
    scripted = scripted and self.swarm is not None and self.swarm.max_critical_steps > 0
    # scripted: demonstrations differ only by the budget.
    key = (sampling, rows, scripted, threading.get_ident())
    if key not in self.loops:
      self.loops[key] = (self.new_host_loop(sampling, rows, scripted),
                         [self.tasks.make() for _ in range(rows)])
    return self.loops[key]

  def new_host_loop(self, sampling: SamplingConfig, rows: int,
                    scripted: bool = False) -> HostLoop:
    """A host loop of ``rows`` rows with the config's observation limits,
    environment workers, context management and sub-agents. The
    critical-step budget (``parl.max_critical_steps``) constrains the
    policy's episodes, not ``scripted`` demonstrations."""
    t = self.cfg.tasks
    swarm = self.swarm.unbounded() if scripted and self.swarm is not None else self.swarm
    return HostLoop(self.model_config, sampling, self.codec, batch_size=rows,
                    max_obs_tokens=t.max_obs_tokens, obs_overflow=t.obs_overflow,
                    env_workers=t.env_workers, env_timeout_s=t.env_timeout_s or None,
                    context=config_lib.context_config(self.cfg), swarm=swarm)

  def demonstrations(self, params, stage, key) -> dict[str, np.ndarray]:
    """Each environment's ``demonstration(seed)`` actions, played through the
    host loop (so a demonstration is exactly the stream a rollout would
    record, without running the model) on the demonstration seeds;
    episodes that do not end done are left out. With context management
    every segment of an episode is a row of its own, and a summary the
    context asks for is the environment's ``summary(observations)``."""
    del params  # scripted actions need no model
    cfg = self.cfg
    T = cfg.sampling.max_total_tokens
    rows = min(stage.num_demos, cfg.eval.batch_rows)
    sampling = config_lib.sampling_config(cfg, greedy=True)
    demo_env = self.tasks.make()
    request = config_lib.context_config(cfg).summary_request
    tokens, masks, status = [], [], []
    for start in range(0, stage.num_demos, rows):
      seeds = self.tasks.seeds("demo", np.arange(start, start + rows))
      # demonstration(seed, noise): positional, as environment proxies forward.
      noise = (stage.demo_noise,) if stage.demo_noise else ()
      scripts = [list(demo_env.demonstration(int(s), *noise)) for s in seeds]
      seen = [[] for _ in seeds]

      def actor(b, obs, scripts=scripts, seeds=seeds, seen=seen):
        if obs == request:
          return demo_env.summary(list(seen[b]))
        seen[b].append(obs)
        if not scripts[b]:
          raise ValueError(f"host_env={cfg.tasks.host_env!r}: demonstration("
                           f"{int(seeds[b])}) ran out of actions before the episode ended")
        return scripts[b].pop(0)

      try:
        ro = self.rows(None, sampling, "demo", np.arange(start, start + rows),
                       jax.random.fold_in(key, start), 0, temperature=None, weights=None,
                       restart=False, group_size=1, actor=actor)
      except ScriptTooLong as e:
        raise ValueError(
            f"host_env={cfg.tasks.host_env!r}: a demonstration's action has {e.tokens} "
            f"tokens, more than max_new_tokens_per_turn={e.limit} (the policy's tokens per "
            f"turn): {e.action!r:.200}; raise --config.sampling.max_new_tokens_per_turn to the "
            f"longest action's length, at least {e.tokens}") from None
      status.append(np.asarray(ro.status_B))
      keep = np.asarray(ro.done_B) & (status[-1] == 0)
      scored = scored_rows(ro)
      keep_R = scored.per_row(keep, fill=False)
      tokens.append(scored["tokens_RxT"][keep_R])
      masks.append(scored["loss_mask_RxT"][keep_R])
    if not sum(len(t) for t in tokens):
      status = np.concatenate(status)
      ended = {name: int(np.sum(status == i)) for i, name in enumerate(EPISODE_STATUS)
               if i and np.any(status == i)}
      why = ""
      if ended:
        failures = self.host_loop(sampling, rows, scripted=True)[0].env_failures
        most = (f", most often {failures.most_common(1)[0][0]!r}" if failures else "")
        why = f"; of {len(status)} episodes, these ended early: {ended}{most}"
      raise ValueError(f"no demonstration of host_env={cfg.tasks.host_env!r} ended done "
                       f"within max_total_tokens={T} and max_turns={cfg.sampling.max_turns}"
                       f"{why}")
    return {"tokens_BxT": np.concatenate(tokens)[:stage.num_demos],
            "loss_mask_BxT": np.concatenate(masks)[:stage.num_demos]}


def make_collector(cfg: Settings, codec, model_config, mesh) -> Collector:
  """The collector of ``config.tasks.source``."""
  if cfg.tasks.source == "host":
    return HostCollector.build(cfg, codec, model_config)
  return FamilyCollector.build(cfg, codec, model_config, mesh)
