"""What a run builds once from its config: the codec, the task source, the
model config, the mesh and the compiled rollout engines; and the held-out
evaluation that every stage ends with.

Two task sources (``config.tasks.source``): ``"jax"``, the built-in task
families stepped inside the jitted rollout engine, and ``"host"``, Python
environments stepped between jitted segments by the host loop
(:mod:`agentic_rl.envs.python_tasks`, :class:`agentic_rl.rollout.HostLoop`). Both
give the same :class:`Rollout`, with ``reward_components["outcome"]`` the
success the signal controller and the evaluation count; for host
environments it is 1 when the episode's reward exceeds
``config.tasks.success_threshold``. Both report the efficiency components
of ``config.tasks.rewards`` (:mod:`agentic_rl.envs.rewards`), and a host
episode's reward gains the same efficiency term as a jitted one's.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import jax
import numpy as np

from agentic_rl import envs as envs_lib
from agentic_rl import model as model_lib
from agentic_rl.envs import factories
from agentic_rl.envs import rewards as rewards_lib
from agentic_rl.envs import scripted, synthesis
from agentic_rl.envs.python_tasks import HostTasks
from agentic_rl.envs.tasks import PromptTooLong, Tasks
from agentic_rl.invariants import exploration
from agentic_rl.rollout.context import policy_tokens, scored_rows
from agentic_rl.rollout.engine import RolloutEngine, prompt_group_size
from agentic_rl.rollout.host_loop import HostLoop, ScriptTooLong
from agentic_rl.rollout.sampling import SamplingConfig
from agentic_rl.rollout.swarm import Swarm
from agentic_rl.rollout.types import EPISODE_STATUS, Rollout, select_rows
from agentic_rl.text import load_codec
from agentic_rl.train import config as config_lib
from agentic_rl.train import parl, reward_hooks, sharding
from agentic_rl.train.settings import Settings


@dataclasses.dataclass
class Run:
  """Everything built once from the config; ``cfg`` is the run's
  :class:`~agentic_rl.train.settings.Settings`."""

  cfg: Settings
  codec: Any  # agentic_rl.text.Codec, or a checkpoint's ChatCodec (init_from)
  env: Any  # the jitted environment (mixture), or None for host environments
  tasks: Tasks | HostTasks
  model_config: model_lib.TransformerConfig
  mesh: Any
  engines: dict = dataclasses.field(default_factory=dict)
  hooks: reward_hooks.Hooks = dataclasses.field(default_factory=reward_hooks.Hooks)
  swarm: Swarm | None = None  # the frozen sub-agents of config.parl

  @property
  def host(self) -> bool:
    return isinstance(self.tasks, HostTasks)

  @property
  def family_names(self) -> tuple[str, ...]:
    """The task families, in the order of :meth:`families_of`'s indices: a
    host environment is one family, ``"host"``."""
    return ("host",) if self.host else tuple(self.cfg.tasks.families)

  def families_of(self, split: str, ids) -> np.ndarray:
    """int ``[N]``: the family (index into :attr:`family_names`) of prompts
    ``ids`` of ``split``."""
    ids = np.asarray(ids)
    if self.host:
      return np.zeros(ids.shape, np.int64)
    return np.asarray(self.tasks.instances(split, ids).family, np.int64)

  def prompt_pool(self, families) -> np.ndarray | None:
    """int: the training prompts of the named ``families`` (a stage's
    ``families``), in data order; None (every prompt) when empty."""
    if not families:
      return None
    ids = np.arange(self.cfg.tasks.train_size)
    wanted = [self.family_names.index(f) for f in families]
    return ids[np.isin(self.families_of("train", ids), wanted)]

  def engine(self, sampling: SamplingConfig, rows: int, group_size: int = 1) -> RolloutEngine:
    """One compiled engine per (sampling settings, batch rows, group size),
    shared by the RL stages and evaluation (:meth:`rollout` passes the
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

  def rollout(self, params, sampling: SamplingConfig, split: str, ids: np.ndarray, key,
              version: int, rows: int, temperature: float | None = None,
              weights=None, restart: bool = False, group_size: int | None = None,
              ) -> Rollout:
    """Episodes for prompts ``ids`` (repeats allowed), in fixed-size calls;
    ``temperature`` overrides ``sampling.temperature`` without recompiling.
    Runs of equal ids share their prompt's prefill, in groups of at most
    ``group_size`` rows (None: no limit); 1, or ``sampling.share_prefill``
    False, runs them on the engine of distinct prompts (evaluation's samples:
    one compiled program fewer).

    ``weights() -> (params, version)`` (an asynchronous actor's latest
    weights), when given, is asked again every turn's worth of tokens, and
    running episodes continue under newer weights (partial rollouts), or
    with ``restart`` start again under them."""
    parts = []
    group = math.gcd(prompt_group_size(ids), group_size or 0, rows)
    if not self.cfg.sampling.share_prefill:
      group = 1
    for start in range(0, len(ids), rows):
      chunk = ids[start:start + rows]
      ro = self._rollout_rows(params, sampling, split, np.resize(chunk, rows),
                              jax.random.fold_in(key, start), version, temperature,
                              weights=weights, restart=restart, group_size=group)
      parts.append(jax.tree.map(lambda x: np.asarray(x)[:len(chunk)], ro))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)

  def _rollout_rows(self, params, sampling, split, ids, key, version, temperature,
                    actor=None, weights=None, restart=False, group_size=1) -> Rollout:
    if not self.host:
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
        return engine.rollout(params, prompts, lens, inst, key, version,
                              temperature=temperature)
      start = state = engine.init_state(prompts, lens, inst, key)
      while not bool(np.all(np.asarray(state.ended_B))):
        new_params, new_version = weights()
        if restart and new_version != version:  # unfinished episodes start again
          state = select_rows(~state.ended_B, start, state)
        params, version = new_params, new_version
        state = engine.resume(params, state, version, temperature=temperature,
                              max_steps=sampling.max_new_tokens_per_turn)
      return state.to_rollout()
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
    key = ("host", sampling, rows, scripted, threading.get_ident())
    if key not in self.engines:
      self.engines[key] = (self.new_host_loop(sampling, rows, scripted),
                           [self.tasks.make() for _ in range(rows)])
    return self.engines[key]

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
    """The SFT stage's batch: ``tokens_BxT`` and ``loss_mask_BxT``, ``[N, T]``.

    Built-in families: the scripted policies' streams
    (:func:`agentic_rl.envs.demonstration_batch`). Host environments: each
    one's ``demonstration(seed)`` actions, played through the host loop (so
    a demonstration is exactly the stream a rollout would record) on the
    demonstration seeds; episodes that do not end done are left out. With
    context management every segment of an episode is a row of its own, and
    a summary the context asks for is the environment's
    ``summary(observations)``.
    """
    T = self.cfg.sampling.max_total_tokens
    if not self.host:
      return scripted.demonstration_batch(
          self.tasks, stage.num_demos, key, noise=stage.demo_noise, max_len=T,
          max_action_len=self.cfg.sampling.max_new_tokens_per_turn,
          strategy_weights=config_lib.strategy_weights(stage))
    rows = min(stage.num_demos, self.cfg.eval.batch_rows)
    sampling = config_lib.sampling_config(self.cfg, greedy=True)
    demo_env = self.tasks.make()
    request = config_lib.context_config(self.cfg).summary_request
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
          raise ValueError(f"host_env={self.cfg.tasks.host_env!r}: demonstration("
                           f"{int(seeds[b])}) ran out of actions before the episode ended")
        return scripts[b].pop(0)

      try:
        ro = self._rollout_rows(params, sampling, "demo", np.arange(start, start + rows),
                                jax.random.fold_in(key, start), 0, None, actor=actor)
      except ScriptTooLong as e:
        raise ValueError(
            f"host_env={self.cfg.tasks.host_env!r}: a demonstration's action has {e.tokens} "
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
      raise ValueError(f"no demonstration of host_env={self.cfg.tasks.host_env!r} ended done "
                       f"within max_total_tokens={T} and max_turns={self.cfg.sampling.max_turns}"
                       f"{why}")
    return {"tokens_BxT": np.concatenate(tokens)[:stage.num_demos],
            "loss_mask_BxT": np.concatenate(masks)[:stage.num_demos]}


def build(cfg) -> Run:
  """The run of the experiment config ``cfg`` (a ConfigDict, parsed into
  :class:`~agentic_rl.train.settings.Settings` and validated here: the one
  place the ConfigDict is read)."""
  cfg = config_lib.validate(cfg)
  codec = load_codec(cfg.model.init_from or None)
  model_config = config_lib.model_config(cfg)
  mesh = sharding.make_mesh(cfg.mesh)
  hooks = reward_hooks.make_hooks(cfg, codec, config_lib.model_config)
  if cfg.tasks.source == "host":
    tasks = HostTasks(factories.load_factory(cfg.tasks.host_env),
                      factories.host_kwargs(cfg.tasks.host_kwargs), spec=cfg.tasks.host_env,
                      pool=cfg.tasks.env_pool)
    swarm = parl.make_swarm(cfg, codec, config_lib.model_config, config_lib.sampling_config)
    return Run(cfg, codec, None, tasks, model_config, mesh, hooks=hooks, swarm=swarm)
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
  return Run(cfg, codec, env, tasks, model_config, mesh, hooks=hooks)


def evaluate(run: Run, params, key) -> dict[str, float]:
  """Held-out success of the policy on the test split.

  ``eval/success``: greedy decoding on the first ``num_prompts`` test
  prompts; ``eval/pass_at_1`` and ``eval/pass_at_k``: from ``pass_k``
  samples at temperature 1 of each of the first ``pass_k_prompts`` (pass@1
  is their mean success: the sampling policy's, which RL optimises); with
  several task families, each family's ``eval/success/<family>`` and
  ``eval/pass_at_1/<family>``."""
  cfg = run.cfg
  n, k, n_k, rows = (cfg.eval.num_prompts, cfg.eval.pass_k, cfg.eval.pass_k_prompts,
                     cfg.eval.batch_rows)
  greedy = run.rollout(params, config_lib.sampling_config(cfg, greedy=True), "test",
                       np.arange(n), key, 0, rows)
  success = np.asarray(greedy.reward_components["outcome"]) > 0.5
  sampled = run.rollout(params, config_lib.sampling_config(cfg), "test",
                        np.repeat(np.arange(n_k), k), key, 0, rows, group_size=1)
  success_PxK = np.asarray(sampled.reward_components["outcome"]).reshape(n_k, k) > 0.5
  out = {"eval/success": float(success.mean())}
  if len(run.family_names) > 1:  # and each family's share of it
    family = run.families_of("test", np.arange(max(n, n_k)))
    for f, name in enumerate(run.family_names):
      if np.any(family[:n] == f):
        out[f"eval/success/{name}"] = float(success[family[:n] == f].mean())
      if np.any(family[:n_k] == f):
        out[f"eval/pass_at_1/{name}"] = float(success_PxK[family[:n_k] == f].mean())
  out.update({k_: float(v) for k_, v in
              exploration.pass_at_k_metrics(success_PxK, k).items()})
  out.update({f"eval/{k_}": float(np.mean(v)) for k_, v in greedy.info.items()})  # parl/*
  return out
