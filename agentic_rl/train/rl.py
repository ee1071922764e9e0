"""The RL iteration as a pipeline of values::

  collect -> shape rewards -> advantages -> score and weight -> update
          -> invariant metrics (and the controllers' next state)

each stage a function of what the previous ones returned;
:func:`rl_iteration` reads them top to bottom. The actor
(:mod:`agentic_rl.train.actor`, in the learner's thread or its own) calls
:func:`collect`.

1. :func:`collect`: the signal controller picks prompts (a
   :class:`PromptSource`) and allocates rollouts
   (``invariants.signal.allocate_rollouts``: uniform, DAPO dynamic sampling,
   Reinforce-Ada or Knapsack), sampled by the rollout engine or the host
   loop with the actor's parameters (at most the staleness bound behind the
   learner); the exploration schedule sets the sampling temperature.
2. :func:`shape_rewards`: over-long episodes masked or punished, and the
   per-group inputs an estimator takes (ReMax's greedy baselines,
   Reinforce-Ada's every-rollout statistics).
3. :func:`compute_advantages`: from each group's rewards, over the batch's
   :class:`~agentic_rl.objectives.GroupLayout` (or per turn).
4. :func:`score_and_weight`: the shift controller's per-token loss weights
   (staleness, partial rollouts, corrections) and, with several updates per
   batch, the learner's log-probs at the iteration's start.
5. :func:`update`: ``updates_per_batch`` optimiser steps.
6. :func:`invariant_metrics`: rewards, the three invariants' monitors,
   episode health, throughput; :func:`next_controls` records each prompt's
   outcomes, moves the entropy-bonus coefficient towards its band and the
   staleness bound after the KL.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl import objectives
from agentic_rl.invariants import exploration, shift, signal
from agentic_rl.objectives import GroupLayout, toggle
from agentic_rl.rollout import context
from agentic_rl.rollout.context import ScoredRows
from agentic_rl.rollout.sampling import SamplingConfig
from agentic_rl.rollout.types import EPISODE_STATUS, FAILED_STATUS, Rollout
from agentic_rl.train import checkpoint as checkpoint_lib
from agentic_rl.train import config as config_lib
from agentic_rl.train import learner
from agentic_rl.train import parl, reward_hooks
from agentic_rl.train import sharding
from agentic_rl.train.run import Run


@dataclasses.dataclass
class Controls:
  """Host-side state of the invariant controllers, checkpointed with the run:
  each prompt's success history (signal), the entropy-bonus coefficient
  (exploration), the actor's staleness bound (shift) and Toggle's length
  budgets."""

  history: signal.PromptHistory
  entropy_coef: float
  staleness: shift.StalenessBound = shift.StalenessBound(0)
  # Toggle's length budgets (objectives.toggle): [N + 1], one per training
  # prompt, then the shared one; -1 for none yet.
  budget: np.ndarray | None = None


class PromptSource:
  """The RL stage's training prompt ids; owns the position in the data.

  In data order (``position`` advances by what is drawn, passing over the
  positions in ``skip``: those an asynchronous actor's batches consumed
  ahead of the position before a resume), or prioritised by each prompt's
  failure rate and/or restricted to the curriculum's current difficulties
  (``signal.select_prompts``; the position stays). ``pool`` (int ids, None
  for all N) restricts data order to those prompts (a stage's task
  families): position ``i`` is ``pool[i % len(pool)]``.
  """

  def __init__(self, signal_cfg: signal.SignalConfig, difficulty_N: np.ndarray,
               position: int = 0, skip=(), pool: np.ndarray | None = None):
    self.signal_cfg = signal_cfg
    self.difficulty_N = np.asarray(difficulty_N)
    self.pool = np.arange(len(self.difficulty_N)) if pool is None else np.asarray(pool)
    self.position = int(position)
    self.skip = {int(p) for p in skip}
    self.last_position = self.position - 1  # of the last prompt drawn

  def draw(self, num: int, key, *, history: signal.PromptHistory, step: int) -> np.ndarray:
    """int ``[num]`` prompt ids of the training pool."""
    if self.signal_cfg.prompt_sampling == "prioritised" or self.signal_cfg.curriculum:
      return signal.select_prompts(self.signal_cfg, history, num, key, step=step,
                                   difficulty_N=self.difficulty_N)
    positions = []
    while len(positions) < num:
      if self.position in self.skip:
        self.skip.discard(self.position)
      else:
        positions.append(self.position)
      self.position += 1
    self.last_position = positions[-1] if positions else self.last_position
    return self.pool[np.asarray(positions, np.int64) % len(self.pool)]


@dataclasses.dataclass
class RLStage:
  """The RL stage's compiled pieces and host-side settings."""

  prompts_per_step: int
  group_size: int
  updates_per_batch: int
  sampling: SamplingConfig
  objective: objectives.ObjectiveConfig
  needs: frozenset  # objectives.required_inputs: what the estimator and loss take
  signal_cfg: signal.SignalConfig
  shift_cfg: shift.ShiftConfig
  explore_cfg: exploration.ExplorationConfig
  step_fn: Any
  state_sharding: Any
  # The old (and reference) log-probs before the first of several updates per
  # batch; None with one update, whose forward gives them.
  score_fn: Any = None
  # Kimi k1.5 mirror descent: the optimiser state restarts every iteration.
  reset_fn: Any = None
  # ReMax: the greedy decode of each prompt gives its baseline; else None.
  greedy_sampling: SamplingConfig | None = None
  # Episodes the asynchronous actor keeps in flight on host environments
  # (agentic_rl.train.stream); 0: one batch.
  actor_rows: int = 0
  toggle_cfg: toggle.ToggleConfig = toggle.ToggleConfig()

  @property
  def rows(self) -> int:
    """Rollout rows per engine call: one batch's worth, P * G."""
    return self.prompts_per_step * self.group_size


def make_rl_stage(run: Run, stage, optimizer, params, *, reset_each_iteration: bool) -> RLStage:
  """Compiles the stage's learner step (and scoring pass and optimiser reset
  where the config asks for them) for ``run.mesh``."""
  cfg = run.cfg
  sampling = config_lib.sampling_config(cfg, temperature=stage.temperature,
                                        top_k=stage.top_k, top_p=stage.top_p)
  objective = config_lib.objective_config(stage, horizon=cfg.sampling.max_total_tokens)
  signal_cfg = config_lib.signal_config(stage)
  needs = objectives.required_inputs(
      objective, global_stats=signal_cfg.allocation == "ada" and signal_cfg.ada_global_stats)
  explore_cfg = config_lib.exploration_config(stage)
  scoring = dict(temperature=stage.temperature, logprob_impl=cfg.model.logprob_impl,
                 scheduled_temperature=explore_cfg.scheduled_temperature,
                 group_size=stage.group_size if stage.share_prefix else 1)
  with_reference = "ref_logp_BxT" in needs
  loss_fn = learner.rl_loss(run.model_config, objective,
                            adaptive_entropy=explore_cfg.adaptive_entropy, **scoring)
  prepare = learner.reference_inputs(run.model_config, **scoring) if with_reference else None
  step_fn, state_sharding = learner.shard_train_step(
      learner.make_train_step(loss_fn, optimizer, micro_batches=cfg.micro_batches,
                              prepare=prepare, trainable=learner.trainable(run.model_config)),
      run.mesh, run.model_config, optimizer, params, with_reference=with_reference,
      group_size=scoring["group_size"])
  score_fn = reset_fn = None
  if stage.updates_per_batch > 1:
    score_fn = learner.shard_score(run.mesh, run.model_config, params,
                                   with_reference=with_reference, **scoring)
  if reset_each_iteration:
    reset_fn = sharding.jit_sharded(
        lambda st: st.replace(opt_state=objectives.reset_optimizer_state(
            optimizer, st.opt_state, st.params)),
        run.mesh, in_shardings=(state_sharding,), out_shardings=state_sharding,
        donate_argnums=(0,))
  greedy = (config_lib.sampling_config(cfg, greedy=True)
            if "greedy_rewards_P" in needs else None)
  return RLStage(stage.prompts_per_step, stage.group_size, stage.updates_per_batch, sampling,
                 objective, needs, signal_cfg, config_lib.shift_config(stage), explore_cfg,
                 step_fn, state_sharding, score_fn, reset_fn, greedy,
                 stage.actor_rows, config_lib.toggle_config(stage))


def reference_policy(stage, params):
  """The frozen policy a KL penalty keeps the stage near, or None without one:
  the parameters of the latest checkpoint in ``stage.reference_from``, else
  those the stage starts from (``params``)."""
  if stage.kind != "rl" or not config_lib.objective_config(stage).kl_coef:
    return None
  if not stage.reference_from:
    return jax.tree.map(jnp.copy, params)
  try:
    return checkpoint_lib.load_params(stage.reference_from, like=params)
  except ValueError as e:
    raise config_lib.ConfigError(f"config reference_from={stage.reference_from!r}: {e} "
                                 "(config.model)") from None


# ------------------------------------------------------------------ 1. collect
@dataclasses.dataclass(frozen=True)
class Collected:
  """One iteration's rollouts.

  Attributes:
    batch: the kept rollouts, group by group (leading axis B).
    layout: the group of each row of ``batch``.
    sampled: the allocation (prompts, outcomes, every generated rollout,
      its metrics).
    greedy: ReMax's greedy decode of each group's prompt (leading axis P),
      or None.
    seconds: wall time of the rollouts.
    tau: the sampling temperature.
    data_pos: the prompt source's position after this batch's prompts.
    data_skip: positions beyond ``data_pos`` already consumed (an
      asynchronous actor's batches may take groups out of data order).
    step: the iteration the rollouts were collected for.
    health: :func:`episode_health` of every episode that ended since the
      previous batch (a continuous stream's, whose episodes may end without
      reaching a batch), or None: that of ``sampled``'s generated rollouts.
  """

  batch: Rollout
  layout: GroupLayout
  sampled: signal.SampledBatch
  greedy: Rollout | None
  seconds: float
  tau: float = 1.0
  data_pos: int = 0
  data_skip: tuple[int, ...] = ()
  step: int = 0
  health: dict[str, float] | None = None

  @property
  def prompt_B(self) -> np.ndarray:
    """int ``[B]``: the training prompt of each row of ``batch``."""
    return np.asarray(self.sampled.prompt_ids)[self.layout.group_B]

  @property
  def success_B(self) -> np.ndarray:
    """bool ``[B]``: each row of ``batch`` succeeded (its outcome)."""
    return np.asarray(self.batch.reward_components["outcome"]) > 0.5


def collect(run: Run, rl: RLStage, actor, prompts: PromptSource,
            history: signal.PromptHistory, key, step: int) -> Collected:
  """Rollouts of the actor: P groups as the signal controller allocates
  them, at the exploration schedule's temperature for iteration ``step``.

  ``actor`` is ``(params, version)``, or a callable returning the latest
  ``(params, version)`` (an asynchronous actor's weights): then episodes
  still running when new weights arrive continue under them (partial
  rollouts; each token records its version).
  """
  weights = actor if callable(actor) else lambda: actor
  params, version = weights()
  t0 = time.perf_counter()
  tau = float(exploration.temperature_at(rl.explore_cfg, step))
  scheduled = rl.explore_cfg.scheduled_temperature

  def sample_fn(ids_N, n, k):
    """``n`` rollouts of each of the prompts ``ids_N``, and their outcomes."""
    ids = np.repeat(np.asarray(ids_N), n)
    ro = run.rollout(params, rl.sampling, "train", ids, k, version, rl.rows,
                     temperature=tau if scheduled else None,
                     weights=weights if callable(actor) else None,
                     restart=rl.shift_cfg.partial_rollout == "restart")
    ro = reward_hooks.apply(run.hooks, ro, jax.random.fold_in(k, 1))  # judge, function
    ro = parl.with_bonus(run.cfg, ro, step)  # sub-agents' r_parallel, r_finish
    return (ro.reward_components["outcome"] > 0.5).reshape(len(ids_N), n), ro

  draw = functools.partial(prompts.draw, history=history, step=step)
  key, draw_key = jax.random.split(key)
  sampled = signal.allocate_rollouts(rl.signal_cfg, sample_fn,
                                     draw(rl.prompts_per_step, draw_key), rl.group_size, key,
                                     draw_prompts=draw, history=history)
  greedy = None
  if rl.greedy_sampling is not None:
    greedy = run.rollout(params, rl.greedy_sampling, "train", sampled.prompt_ids,
                         jax.random.fold_in(key, 1), version, rl.rows)
  return Collected(sampled.rollouts, GroupLayout.of(sampled.group, sampled.num_groups),
                   sampled, greedy, time.perf_counter() - t0, tau, prompts.position,
                   tuple(sorted(prompts.skip)), step)


# ------------------------------------------------------------------ 2. shape rewards
@dataclasses.dataclass(frozen=True)
class Shaped:
  """Shaped rewards: ``rewards_B`` and ``seq_weight_B`` (0 masks an
  over-long episode out of the loss), with the per-group inputs of the
  estimator (``[P, ...]`` arrays by name). ``valid_B`` is False for an
  episode its environment failed (``Rollout.status_B``) and for the rest of
  a group it leaves with fewer than two: those are left out of the
  advantages and of the loss."""

  rewards_B: np.ndarray
  seq_weight_B: np.ndarray
  per_group: dict[str, np.ndarray]
  valid_B: np.ndarray
  over_budget_B: np.ndarray | None = None  # Toggle's penalised rollouts


def _shape(rl: RLStage, ro: Rollout) -> tuple[np.ndarray, np.ndarray]:
  rewards, weight = signal.shape_truncated(rl.signal_cfg, ro.reward_B, ro.truncated_B,
                                           ro.length_B)
  return np.asarray(rewards, np.float32), np.asarray(weight)


def policy_tokens(ro: Rollout) -> np.ndarray:
  """int ``[B]``: the tokens each rollout's policy wrote, ``|y|`` (over all
  its context segments)."""
  return context.policy_tokens(ro)


def shape_rewards(rl: RLStage, collected: Collected, budget_N1: np.ndarray | None = None
                  ) -> Shaped:
  """The rewards the advantages see: over-long episodes shaped
  (``signal.shape_truncated``) and, with Toggle, over-budget ones penalised
  in its budget phases (``budget_N1``, :mod:`agentic_rl.objectives.toggle`)."""
  rewards_B, seq_weight_B = _shape(rl, collected.batch)
  over_B = None
  if rl.toggle_cfg.enabled:
    batch, layout = collected.batch, collected.layout
    rewards_B, over_B = toggle.budget_rewards(
        rl.toggle_cfg, rewards_B, policy_tokens(batch), collected.success_B, layout.group_B,
        layout.num_groups, toggle.prompt_budgets(budget_N1, collected.prompt_B),
        collected.step)
  per_group = {}
  if "greedy_rewards_P" in rl.needs:  # ReMax: shaped like the sampled rewards
    per_group["greedy_rewards_P"] = _shape(rl, collected.greedy)[0]
  if "all_rewards_PxN" in rl.needs:
    # Reinforce-Ada's global statistics: every rollout generated for each
    # group's prompt, kept or not (N the most any prompt got).
    sampled = collected.sampled
    generated = _shape(rl, sampled.generated)[0]
    per_prompt = [generated[sampled.generated_ids == p] for p in sampled.prompt_ids]
    N = max(len(r) for r in per_prompt)
    all_PxN = np.zeros((len(per_prompt), N), np.float32)
    mask_PxN = np.zeros((len(per_prompt), N), bool)
    for i, r in enumerate(per_prompt):
      all_PxN[i, :len(r)], mask_PxN[i, :len(r)] = r, True
    per_group.update(all_rewards_PxN=all_PxN, all_mask_PxN=mask_PxN)
  # Failed episodes leave the batch, and so does a group left with fewer
  # than two episodes (nothing to compare).
  valid_B = ~np.isin(np.asarray(collected.batch.status_B), FAILED_STATUS)
  group_B = collected.layout.group_B
  valid_B &= np.bincount(group_B[valid_B], minlength=collected.layout.num_groups)[group_B] >= 2
  return Shaped(rewards_B, seq_weight_B, per_group, valid_B, over_B)


# ------------------------------------------------------------------ 3. advantages
def compute_advantages(rl: RLStage, collected: Collected, shaped: Shaped) -> np.ndarray:
  """float32 ``[B]`` per-rollout advantages, or ``[B, T]`` per-token ones
  from a turn-level estimator."""
  adv_fn = objectives.make_advantage_fn(rl.objective)
  batch, valid = collected.batch, shaped.valid_B
  if "turn_rewards" in rl.needs:
    turn_inputs = {}
    if "turn_states" in rl.needs:  # GiGPO's anchor states
      C = np.shape(batch.turn_rewards_BxC)[1]
      turn_inputs = {"group_B": collected.layout.group_B, "state_BxN": objectives.turn_states(
          batch.tokens_BxT, batch.turn_BxT, batch.loss_mask_BxT, batch.length_B,
          batch.num_turns_B, collected.layout.group_B, C)}
    return objectives.turn_advantages(
        adv_fn, batch.turn_rewards_BxC, batch.num_turns_B, batch.turn_BxT,
        episode_bonus_B=shaped.rewards_B - np.asarray(batch.reward_B), valid_B=valid,
        **turn_inputs) * valid[:, None]
  if valid.all():
    return objectives.group_advantages(adv_fn, shaped.rewards_B, collected.layout,
                                       **shaped.per_group)
  layout = GroupLayout.of(collected.layout.group_B[valid], collected.layout.num_groups)
  advantages = np.zeros(valid.shape, np.float32)
  advantages[valid] = objectives.group_advantages(adv_fn, shaped.rewards_B[valid], layout,
                                                  **shaped.per_group)
  return advantages


# ------------------------------------------------------------------ 4. score and weight
def score_and_weight(run: Run, rl: RLStage, state: learner.TrainState, rows: ScoredRows,
                     shaped: Shaped, advantages: np.ndarray, entropy_coef: float,
                     tau: float) -> tuple[dict[str, jax.Array], dict[str, float]]:
  """The learner's batch on the mesh, one row per scored sequence
  (``rows``: each episode's contexts, :func:`agentic_rl.rollout.context.
  scored_rows`): tokens, per-token loss weights (the shift controller's,
  times the episode's sequence weight), the episode's advantages, behaviour
  log-probs and the controllers' settings as per-row arrays; with
  ``score_fn``, also the learner's log-probs before the first update. The
  per-token arrays stop after the last scored token (:func:`learner.
  used_length`, a bucket: the learner's cost follows the episodes' length,
  not ``max_total_tokens``). Returns ``(learn_batch, shift_stats)``.

  Staleness is counted in learner updates: the lag of each token behind the
  learner when the batch's first update begins.
  """
  weights, shift_stats = shift.shift_weights(
      rl.shift_cfg, rows["loss_mask_RxT"], rows["version_RxT"], int(state.step),
      newest_B=rows.per_row(rows.episode_max(rows["version_RxT"], rows["loss_mask_RxT"] > 0)))
  R = rows.num_rows
  learn_batch = sharding.shard_batch(learner.trim_time({
      "tokens_BxT": jnp.asarray(rows["tokens_RxT"]),
      "loss_mask_BxT": weights * rows.per_row(shaped.seq_weight_B * shaped.valid_B)[:, None],
      "advantages": jnp.asarray(rows.per_row(advantages), jnp.float32),
      "behaviour_logp_BxT": jnp.asarray(rows["behaviour_logp_RxT"]),
      "entropy_coef_B": jnp.full((R,), entropy_coef, jnp.float32),
      "temperature_B": jnp.full((R,), tau, jnp.float32)},
      learner.used_length(rows["loss_mask_RxT"])), run.mesh)
  if rl.score_fn is not None:
    learn_batch.update(rl.score_fn(state.params, state.ref_params, learn_batch["tokens_BxT"],
                                   jnp.float32(tau)))
  return learn_batch, shift_stats


# ------------------------------------------------------------------ 5. update
@dataclasses.dataclass(frozen=True)
class Learned:
  """What the updates report: each step's metrics (on the host), the
  learner's log-probs and entropy at the iteration's start (``[R, T]``, the
  scored rows), and the wall time."""

  metrics: list[dict[str, float]]
  old_logp_BxT: np.ndarray
  entropy_BxT: np.ndarray
  seconds: float


def update(rl: RLStage, state: learner.TrainState, learn_batch: dict[str, jax.Array],
           width: int) -> tuple[learner.TrainState, Learned]:
  """``updates_per_batch`` optimiser steps on one batch (after the mirror
  descent reset where configured); the learner's log-probs and entropy come
  back ``width`` (the scored rows' T) positions wide."""
  t0 = time.perf_counter()
  if rl.reset_fn is not None:
    state = rl.reset_fn(state)
  metrics = []
  for k in range(rl.updates_per_batch):
    state, m, outputs = rl.step_fn(state, learn_batch)
    if k == 0:  # the forward at the iteration's start: the learner's old log-probs
      old_logp = learn_batch.get("old_logp_BxT", outputs["logp_BxT"])
      entropy = outputs["entropy_BxT"]
    metrics.append(m)
  metrics = [jax.tree.map(float, m) for m in sharding.to_host(metrics)]
  old_logp, entropy = (learner.pad_time(x, width) for x in sharding.to_host((old_logp, entropy)))
  return state, Learned(metrics, old_logp, entropy, time.perf_counter() - t0)


# ------------------------------------------------------------------ 6. invariant metrics
def invariant_metrics(run: Run, rl: RLStage, collected: Collected, rows: ScoredRows,
                      shaped: Shaped, advantages: np.ndarray, learn_batch: dict[str, jax.Array],
                      shift_stats: dict[str, float], learned: Learned, version: int,
                      controls: Controls, tau: float) -> dict[str, float]:
  """The iteration's record: rewards, ``explore/*``, ``signal/*``,
  ``shift/*``, ``learner/*``, ``episode/*`` and ``perf/*`` (docs/metrics.md).
  ``version`` is the learner's step when the batch's first update began.
  Shift and learner metrics cover every scored row (``rows``); exploration
  and signal metrics each episode's final context (the first B rows)."""
  batch, layout, sampled = collected.batch, collected.layout, collected.sampled
  B = batch.tokens_BxT.shape[0]
  success = collected.success_B
  loss_mask = np.asarray(batch.loss_mask_BxT)
  metrics = {"reward/mean": float(shaped.rewards_B.mean())}
  if "greedy_rewards_P" in shaped.per_group:
    metrics["reward/greedy_baseline"] = float(shaped.per_group["greedy_rewards_P"].mean())
  metrics.update({f"reward/{k}": float(np.mean(v)) for k, v in batch.reward_components.items()})
  metrics.update({k: float(np.mean(v)) for k, v in batch.info.items()})  # parl/*
  metrics["reward/tokens_per_success"] = toggle.tokens_per_success(policy_tokens(batch), success)
  if shaped.over_budget_B is not None:
    metrics["reward/toggle_budget_phase"] = float(
        toggle.budget_phase(rl.toggle_cfg, collected.step))
    metrics["reward/toggle_over_budget_frac"] = float(shaped.over_budget_B.mean())
  if layout.size:  # the [P, G] layout, which also gets edit distances
    hashes = batch.call_hashes_BxC.reshape(layout.num_groups, layout.size, -1)
    ragged = {}
  else:
    hashes, ragged = batch.call_hashes_BxC, layout.monitor_kwargs()
  metrics.update(exploration.exploration_metrics(batch.entropy_BxT, loss_mask, hashes,
                                                 success, **ragged))
  metrics.update(signal.signal_metrics(success, advantages, loss_mask,
                                       loss_weight_BxT=learner.pad_time(sharding.to_host(
                                           learn_batch["loss_mask_BxT"])[:B],
                                           loss_mask.shape[1]),
                                       **layout.monitor_kwargs()))
  metrics.update(sampled.metrics)
  # Per episode generated, groups dropped by dynamic sampling included: the
  # share of the sampling cost that carries a gradient.
  metrics["signal/nonzero_grad_per_rollout"] = (
      float(metrics["signal/nonzero_grad_rollouts"]) / max(metrics["signal/rollouts"], 1.0))
  metrics["signal/prompt_difficulty"] = float(np.mean(
      run.tasks.difficulty_of(sampled.prompt_ids)))
  metrics.update(shift.shift_metrics(rows["loss_mask_RxT"], rows["behaviour_logp_RxT"],
                                     learned.old_logp_BxT, rows["version_RxT"], version))
  metrics.update(shift_stats)
  metrics.update({"explore/entropy_coef": controls.entropy_coef, "explore/temperature": tau})
  mask = rows["loss_mask_RxT"] > 0
  metrics["learner/entropy"] = float(np.sum(learned.entropy_BxT * mask) / max(mask.sum(), 1))
  metrics.update(learned.metrics[-1])
  metrics.update({
      "learner/skipped": sum(m["learner/skipped"] for m in learned.metrics),
      "episode/turns": float(np.mean(batch.num_turns_B)),
      "episode/tool_errors": float(np.mean(batch.num_tool_errors_B)),
      "episode/truncated": float(np.mean(batch.truncated_B)),
      "episode/length": float(np.mean(batch.length_B)),
      **(episode_health(sampled.generated) if collected.health is None else collected.health),
      **context.context_metrics(batch),
      "perf/rollout_s": collected.seconds,
      "perf/learner_s": learned.seconds,
      "perf/rollout_tokens_per_s": int(sampled.generated.loss_mask_BxT.sum())
                                   / max(collected.seconds, 1e-9),
      "perf/learner_tokens_per_s": rl.updates_per_batch * float(np.sum(batch.length_B))
                                   / max(learned.seconds, 1e-9),
  })
  return {k: float(v) for k, v in metrics.items()}


def episode_health(rollouts: Rollout) -> dict[str, float]:
  """How many of the rollouts' environments failed, and how (counts over
  every rollout generated; ``Rollout.status_B``), and how many
  observations were clipped."""
  status = np.asarray(rollouts.status_B)
  out = {f"episode/{name}": float(np.sum(status == EPISODE_STATUS.index(reason)))
         for name, reason in (("env_errors", "env_error"), ("env_timeouts", "env_timeout"),
                              ("nonfinite_rewards", "nonfinite_reward"),
                              ("obs_overflow", "obs_overflow"))}
  out["episode/obs_clipped"] = float(np.sum(rollouts.obs_clipped_B))
  return out


def next_controls(rl: RLStage, controls: Controls, collected: Collected,
                  metrics: dict[str, float]) -> Controls:
  """Each prompt's outcomes into the history; the entropy-bonus coefficient
  one step towards its band; the staleness bound after this iteration's KL."""
  sampled = collected.sampled
  history = signal.update_history(controls.history, sampled.prompt_ids[sampled.group],
                                  sampled.success, decay=rl.signal_cfg.history_decay)
  coef = exploration.update_entropy_coef(
      rl.explore_cfg, exploration.EntropyCoefState(jnp.float32(controls.entropy_coef)),
      metrics["explore/entropy"]).coef
  staleness = shift.update_staleness_bound(rl.shift_cfg, controls.staleness,
                                           metrics["shift/kl_behaviour_learner"])
  budget = controls.budget
  if rl.toggle_cfg.enabled:
    budget = toggle.update_budgets(rl.toggle_cfg, budget, collected.prompt_B,
                                   policy_tokens(collected.batch), collected.success_B)
  return Controls(history, float(coef), staleness, budget)


# ------------------------------------------------------------------ the iteration
def rl_iteration(run: Run, rl: RLStage, actor, state: learner.TrainState, controls: Controls,
                 step: int) -> tuple[learner.TrainState, Controls, Collected, dict[str, float]]:
  """RL iteration ``step`` of the stage: the actor's rollouts (``actor``,
  :mod:`agentic_rl.train.actor`, calls :func:`collect`), then one update;
  returns ``(state, controls, collected, metrics)``."""
  collected = actor.next(state, controls, step)
  shaped = shape_rewards(rl, collected, controls.budget)
  advantages = compute_advantages(rl, collected, shaped)
  version = int(state.step)
  rows = context.scored_rows(collected.batch)
  learn_batch, shift_stats = score_and_weight(run, rl, state, rows, shaped, advantages,
                                              controls.entropy_coef, collected.tau)
  state, learned = update(rl, state, learn_batch, rows["tokens_RxT"].shape[1])
  metrics = invariant_metrics(run, rl, collected, rows, shaped, advantages, learn_batch,
                              shift_stats, learned, version, controls, collected.tau)
  controls = next_controls(rl, controls, collected, metrics)
  actor.bound = controls.staleness.bound
  actor.updated(state)  # publishes the new weights
  metrics["shift/staleness_bound"] = float(controls.staleness.bound)
  metrics.update(actor.stats())
  return state, controls, collected, metrics
