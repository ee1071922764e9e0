"""The training run: stages (SFT warm start, then RL) over one policy.

``train(cfg, workdir)`` builds everything from a validated config
(:mod:`agentic_rl.train.config`), resumes from ``workdir`` if it holds a
checkpoint, runs the stages in order and writes ``summary.json``. Every RL
iteration reports the three invariants (``explore/*``, ``signal/*``,
``shift/*``) next to rewards and throughput.

An RL iteration:

1. the signal controller picks prompts and allocates rollouts
   (``invariants.signal.allocate_rollouts``: uniform, DAPO dynamic sampling,
   Reinforce-Ada or Knapsack), sampling through the jitted rollout engine with
   the *actor's* parameters, which lag the learner by ``max_staleness``
   updates in off-policy mode;
   the exploration controllers set the sampling temperature (schedule) and
   the entropy-bonus coefficient (band controller), passed as data;
2. advantages from the rewards of each group (``objectives``);
3. the learner scores the batch once (``old_logp``: the iteration's start,
   which is also the train/inference mismatch monitor), the shift controller
   turns staleness, partial-rollout and correction rules into per-token loss
   weights, and ``updates_per_batch`` optimiser steps follow.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl import envs as envs_lib
from agentic_rl import invariants
from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl.envs import scripted
from agentic_rl.invariants import exploration, shift, signal
from agentic_rl.rollout.engine import RolloutEngine
from agentic_rl.rollout.sampling import SamplingConfig
from agentic_rl.rollout.types import Rollout
from agentic_rl.text import codec as codec_lib
from agentic_rl.text import load_tokenizer
from agentic_rl.train import checkpoint as checkpoint_lib
from agentic_rl.train import config as config_lib
from agentic_rl.train import interrupt
from agentic_rl.train import learner
from agentic_rl.train import metrics as metrics_lib
from agentic_rl.train import resume
from agentic_rl.train import sharding
from agentic_rl.train.tasks import Tasks, encode_prompts, generate_levels


@dataclasses.dataclass
class Run:
  """Everything built once from the config."""

  cfg: Any
  codec: codec_lib.Codec
  env: Any
  tasks: Tasks
  model_config: model_lib.TransformerConfig
  mesh: Any
  engines: dict = dataclasses.field(default_factory=dict)

  def engine(self, sampling: SamplingConfig, rows: int) -> RolloutEngine:
    """One compiled engine per (sampling settings, batch rows), shared by
    the RL stages and evaluation. Rows are episodes (group size 1): groups
    are made by repeating prompts. On a single-process mesh with several
    batch shards the rows are split over them (a data-parallel rollout)
    when they divide evenly."""
    key = (sampling, rows)
    if key not in self.engines:
      shards = sharding.batch_shards(self.mesh)
      split = jax.process_count() == 1 and shards > 1 and rows % shards == 0
      self.engines[key] = RolloutEngine(
          self.model_config, sampling, self.codec.ids, env=self.env, batch_size=rows,
          row_sharding=sharding.batch_sharding(self.mesh) if split else None)
    return self.engines[key]

  def rollout(self, params, sampling: SamplingConfig, split: str, ids: np.ndarray, key,
              version: int, rows: int, temperature: float | None = None) -> Rollout:
    """Episodes for prompts ``ids`` (repeats allowed), in fixed-size calls;
    ``temperature`` overrides ``sampling.temperature`` without recompiling."""
    engine = self.engine(sampling, rows)
    parts = []
    for start in range(0, len(ids), rows):
      chunk = ids[start:start + rows]
      inst = self.tasks.instances(split, np.resize(chunk, rows))
      prompts, lens = self.tasks.prompts(inst)
      ro = engine.rollout(params, prompts, lens, inst, jax.random.fold_in(key, start), version,
                          temperature=temperature)
      parts.append(jax.tree.map(lambda x: np.asarray(x)[:len(chunk)], ro))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def build(cfg) -> Run:
  config_lib.validate(cfg)
  codec = codec_lib.Codec(load_tokenizer())
  env = envs_lib.make_env(
      "mixture", codec, members=tuple(cfg.tasks.families),
      weights=tuple(cfg.tasks.weights),
      rewards=envs_lib.RewardConfig(**cfg.tasks.rewards))
  model_config = config_lib.model_config(cfg, codec.tokenizer.vocab_size)
  mesh = sharding.make_mesh(sharding.MeshConfig(**cfg.mesh))
  tasks = Tasks(env, seed=cfg.seed, difficulty=cfg.tasks.difficulty,
                prompt_len=cfg.sampling.max_total_tokens // 2)
  return Run(cfg, codec, env, tasks, model_config, mesh)


# ------------------------------------------------------------------ evaluation
def evaluate(run: Run, params, key) -> dict[str, float]:
  """Greedy success on ``num_prompts`` held-out test prompts, and pass@k from
  ``pass_k`` samples (temperature 1) on the first ``pass_k_prompts``."""
  cfg = run.cfg
  n, k, n_k, rows = (cfg.eval.num_prompts, cfg.eval.pass_k, cfg.eval.pass_k_prompts,
                     cfg.eval.batch_rows)
  greedy = run.rollout(params, config_lib.sampling_config(cfg, greedy=True), "test",
                       np.arange(n), key, 0, rows)
  success = np.asarray(greedy.reward_components["outcome"]) > 0.5
  sampled = run.rollout(params, config_lib.sampling_config(cfg), "test",
                        np.repeat(np.arange(n_k), k), key, 0, rows)
  success_PxK = np.asarray(sampled.reward_components["outcome"]).reshape(n_k, k) > 0.5
  out = {"eval/success": float(success.mean())}
  out.update({k_: float(v) for k_, v in
              exploration.pass_at_k_metrics(success_PxK, k).items()})
  return out


# ------------------------------------------------------------------ SFT stage
def demonstrations(run: Run, stage, key) -> dict[str, np.ndarray]:
  """Scripted demonstrations as token streams with loss masks, ``[N, T]``.

  Each task family contributes in proportion to its mixture weight, with its
  scripted strategies in turn and ``stage.demo_noise`` (wrong steps, early
  answers), so the warm-started policy is competent but imperfect. A
  demonstration is exactly the stream the rollout engine would record for the
  scripted actions: prompt (mask 0), actions (mask 1) and framed
  observations (mask 0). Instances come from their own seed stream.
  """
  T = run.cfg.sampling.max_total_tokens
  ids = run.codec.ids
  rows, masks = [], []
  members = getattr(run.env, "envs", (run.env,))
  weights = getattr(run.env, "weights", (1.0,))
  for f, (env, w) in enumerate(zip(members, weights)):
    per_strategy = -(-int(round(stage.num_demos * w)) // len(env.strategies))
    for s in range(len(env.strategies)):
      k_inst, k_play = jax.random.split(jax.random.fold_in(jax.random.fold_in(key, f), s))
      inst = generate_levels(env, jax.random.split(k_inst, per_strategy),
                             run.tasks.difficulty_of(np.arange(per_strategy)))
      prompts, plens = encode_prompts(env, inst, T)
      traj = scripted.batch_rollouts(env, inst, jax.random.split(k_play, per_strategy),
                                     strategy=s, noise=stage.demo_noise)
      framed, framed_len = codec_lib.frame_observation(traj.obs, traj.obs_lens, ids)
      traj, framed, framed_len = jax.tree.map(np.asarray, (traj, framed, framed_len))
      for i in range(per_strategy):
        seg_ids, seg_mask = [prompts[i, :plens[i]]], [np.zeros(plens[i], np.float32)]
        for t in np.flatnonzero(traj.live[i]):
          n_act, n_obs = traj.action_lens[i, t], framed_len[i, t] if traj.obs_lens[i, t] else 0
          seg_ids += [traj.actions[i, t, :n_act], framed[i, t, :n_obs]]
          seg_mask += [np.ones(n_act, np.float32), np.zeros(n_obs, np.float32)]
        row = np.concatenate(seg_ids)
        if len(row) <= T:
          rows.append(row)
          masks.append(np.concatenate(seg_mask))
  if not rows:
    raise ValueError(f"no demonstration fits in max_total_tokens={T}")
  return {"tokens_BxT": codec_lib.pad_batch(rows, T, ids.pad),
          "loss_mask_BxT": codec_lib.pad_batch(masks, T, 0.0)}


# ------------------------------------------------------------------ RL stage
def _gather_rows(parts: list[Rollout], call: np.ndarray, row: np.ndarray) -> Rollout:
  """The rows ``(call[i], row[i])`` of several rollout batches, in order."""
  stacked = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *parts)
  offsets = np.cumsum([0] + [int(p.length_B.shape[0]) for p in parts])
  flat = offsets[call] + row
  return jax.tree.map(lambda x: x[flat], stacked)


def _equal_group_size(group_B: np.ndarray, num_groups: int) -> int | None:
  """G when every group holds G rows (a ``[P, G]`` layout), else None."""
  sizes = np.bincount(group_B, minlength=num_groups)
  return int(sizes[0]) if (sizes == sizes[0]).all() else None


def group_advantages(adv_fn, rewards_B: np.ndarray, group_B: np.ndarray,
                     num_groups: int, **per_group: np.ndarray) -> np.ndarray:
  """Per-rollout advantages from a group estimator, for equal or ragged groups.

  Rows are grouped by ``group_B`` (non-decreasing). Equal groups go through the
  estimator as one ``[P, G]`` array; ragged groups (Knapsack budgets) one group
  at a time, as ``[1, n_i]``, which is exact for every estimator that
  normalises within a group. ``per_group`` arrays (leading axis ``[P]``, such
  as ReMax's ``greedy_rewards_P``) are passed along, sliced to match.
  """
  if _equal_group_size(group_B, num_groups):
    return np.asarray(adv_fn(jnp.asarray(rewards_B.reshape(num_groups, -1)),
                             **per_group)).reshape(-1)
  sizes = np.bincount(group_B, minlength=num_groups)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  return np.concatenate([
      np.asarray(adv_fn(jnp.asarray(rewards_B[a:b][None]),
                        **{k: v[i:i + 1] for k, v in per_group.items()}))[0]
      for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])


def turn_advantages(adv_fn, batch: Rollout, rewards_B: np.ndarray) -> np.ndarray:
  """Turn-level advantages (REBN) on the tokens of each turn, ``[B, T]``.

  A turn's reward is its environment step's (``batch.turn_rewards_BxC``);
  whatever the episode-level shaping (``signal.shape_truncated``) added to
  ``reward_B`` goes to the episode's last turn, so the turns still sum to
  ``rewards_B``. Turns ``0 .. num_turns - 1`` are valid; tokens of action
  segment k (``turn_BxT == k``) get turn ``k - 1``'s advantage.
  """
  turn_rewards = np.array(batch.turn_rewards_BxC, np.float32)
  B, C = turn_rewards.shape
  num_turns = np.asarray(batch.num_turns_B)
  last = np.clip(num_turns - 1, 0, C - 1)
  turn_rewards[np.arange(B), last] += rewards_B - np.asarray(batch.reward_B)
  turn_mask = np.arange(C)[None, :] < num_turns[:, None]
  adv_BxC = adv_fn(jnp.asarray(turn_rewards), jnp.asarray(turn_mask))
  return np.asarray(objectives.broadcast_turn_advantages(
      adv_BxC, jnp.asarray(batch.turn_BxT) - 1))


@dataclasses.dataclass
class Controls:
  """Host-side state of the invariant controllers, checkpointed with the run:
  each prompt's success history (signal) and the entropy-bonus coefficient
  (exploration)."""

  history: signal.PromptHistory
  entropy_coef: float


@dataclasses.dataclass
class RLStage:
  """The RL stage's compiled pieces and host-side settings."""

  sampling: SamplingConfig
  objective: objectives.ObjectiveConfig
  needs: frozenset  # objectives.required_inputs: what the estimator and loss take
  signal_cfg: signal.SignalConfig
  shift_cfg: shift.ShiftConfig
  explore_cfg: exploration.ExplorationConfig
  step_fn: Any
  state_sharding: Any
  rows: int
  # The old (and reference) log-probs before the first of several updates per
  # batch; None with one update, whose forward gives them.
  score_fn: Any = None
  # Kimi k1.5 mirror descent: the optimiser state restarts every iteration.
  reset_fn: Any = None
  # ReMax: the greedy decode of each prompt gives its baseline; else None.
  greedy_sampling: SamplingConfig | None = None


def make_rl_stage(run: Run, stage, optimizer, params) -> RLStage:
  cfg = run.cfg
  P, G = stage.prompts_per_step, stage.group_size
  sampling = config_lib.sampling_config(cfg, temperature=stage.temperature,
                                        top_k=stage.top_k, top_p=stage.top_p)
  objective = config_lib.objective_config(stage)
  signal_cfg = config_lib.signal_config(stage)
  needs = objectives.required_inputs(
      objective, global_stats=signal_cfg.allocation == "ada" and signal_cfg.ada_global_stats)
  explore_cfg = config_lib.exploration_config(stage)
  scoring = dict(temperature=stage.temperature, logprob_impl=cfg.model.logprob_impl,
                 scheduled_temperature=explore_cfg.scheduled_temperature)
  with_reference = "ref_logp_BxT" in needs
  loss_fn = learner.rl_loss(run.model_config, objective,
                            adaptive_entropy=explore_cfg.adaptive_entropy, **scoring)
  prepare = learner.reference_inputs(run.model_config, **scoring) if with_reference else None
  step_fn, state_sharding = learner.shard_train_step(
      learner.make_train_step(loss_fn, optimizer, micro_batches=cfg.micro_batches,
                              prepare=prepare),
      run.mesh, run.model_config, optimizer, params, with_reference=with_reference)
  score_fn = reset_fn = None
  if stage.updates_per_batch > 1:
    score_fn = learner.shard_score(run.mesh, run.model_config, params,
                                   with_reference=with_reference, **scoring)
  if config_lib.optimizer_config(stage, stage.iterations).reset_each_iteration:
    reset_fn = sharding.jit_sharded(
        lambda st: st.replace(opt_state=objectives.reset_optimizer_state(
            optimizer, st.opt_state, st.params)),
        run.mesh, in_shardings=(state_sharding,), out_shardings=state_sharding,
        donate_argnums=(0,))
  greedy = (config_lib.sampling_config(cfg, greedy=True)
            if "greedy_rewards_P" in needs else None)
  return RLStage(sampling, objective, needs, signal_cfg, config_lib.shift_config(stage),
                 explore_cfg, step_fn, state_sharding, P * G, score_fn, reset_fn, greedy)


def greedy_rewards(run: Run, rl: RLStage, actor_params, actor_version: int,
                   prompt_ids_P: np.ndarray, key) -> np.ndarray:
  """ReMax's baselines: the reward of each prompt's greedy decode ``[P]``.

  Decoded by the actor that sampled the groups, on the same instances, and
  shaped like the sampled rewards (``signal.shape_truncated``).
  """
  greedy = run.rollout(actor_params, rl.greedy_sampling, "train", np.asarray(prompt_ids_P),
                       jax.random.fold_in(key, 1), actor_version, rl.rows)
  rewards, _ = signal.shape_truncated(rl.signal_cfg, greedy.reward_B, greedy.truncated_B,
                                      greedy.length_B)
  return np.asarray(rewards, np.float32)


def all_rewards(rl: RLStage, generated: Rollout, generated_ids: np.ndarray,
                prompt_ids_P: np.ndarray) -> dict[str, np.ndarray]:
  """Reinforce-Ada's global statistics: the shaped rewards of every rollout
  generated for each group's prompt this iteration, kept or not, as
  ``all_rewards_PxN`` with ``all_mask_PxN`` (N the most any prompt got)."""
  rewards, _ = signal.shape_truncated(rl.signal_cfg, generated.reward_B, generated.truncated_B,
                                      generated.length_B)
  rewards = np.asarray(rewards, np.float32)
  per_prompt = [rewards[generated_ids == p] for p in prompt_ids_P]
  N = max(len(r) for r in per_prompt)
  out = np.zeros((len(per_prompt), N), np.float32)
  mask = np.zeros((len(per_prompt), N), bool)
  for i, r in enumerate(per_prompt):
    out[i, :len(r)], mask[i, :len(r)] = r, True
  return {"all_rewards_PxN": out, "all_mask_PxN": mask}


def rl_iteration(run: Run, rl: RLStage, stage, state: learner.TrainState, actor_params,
                 actor_version: int, draw_prompts, controls: Controls, key, step: int):
  """RL iteration ``step`` of the stage; returns ``(state, controls, metrics)``.

  ``draw_prompts(num, key) -> ids`` yields training prompt ids (it advances
  the data position); ``actor_params`` made the rollouts (``actor_version``
  updates old). The exploration controllers set this iteration's sampling
  temperature (schedule) and entropy-bonus coefficient, and the coefficient
  then moves towards its entropy band.
  """
  P, G = stage.prompts_per_step, stage.group_size
  history = controls.history
  tau = float(exploration.temperature_at(rl.explore_cfg, step))
  scheduled = rl.explore_cfg.scheduled_temperature
  parts: list[Rollout] = []
  part_ids: list[np.ndarray] = []
  t0 = time.perf_counter()

  def sample_fn(ids_N, n, k):
    """Outcomes of ``n`` rollouts for each of the prompts ``ids_N``."""
    ids = np.repeat(np.asarray(ids_N), n)
    ro = run.rollout(actor_params, rl.sampling, "train", ids, k, actor_version, rl.rows,
                     temperature=tau if scheduled else None)
    parts.append(ro)
    part_ids.append(ids)
    return (ro.reward_components["outcome"] > 0.5).reshape(len(ids_N), n)

  key, draw_key = jax.random.split(key)
  prompt_ids = draw_prompts(P, draw_key)
  sampled = signal.allocate_rollouts(rl.signal_cfg, sample_fn, prompt_ids, G, key,
                                     draw_prompts=draw_prompts, history=history)
  generated = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *parts)
  per_group = {}
  if "greedy_rewards_P" in rl.needs:
    per_group["greedy_rewards_P"] = greedy_rewards(run, rl, actor_params, actor_version,
                                                   sampled.prompt_ids, key)
  if "all_rewards_PxN" in rl.needs:
    per_group.update(all_rewards(rl, generated, np.concatenate(part_ids), sampled.prompt_ids))
  rollout_s = time.perf_counter() - t0
  batch = _gather_rows(parts, sampled.call, sampled.row)
  history = signal.update_history(history, sampled.prompt_ids[sampled.group],
                                  sampled.success, decay=rl.signal_cfg.history_decay)
  rewards, seq_weight = signal.shape_truncated(
      rl.signal_cfg, batch.reward_B, batch.truncated_B, batch.length_B)
  rewards, seq_weight = np.asarray(rewards), np.asarray(seq_weight)
  adv_fn = objectives.make_advantage_fn(rl.objective)
  if "turn_rewards" in rl.needs:
    advantages = turn_advantages(adv_fn, batch, rewards)
  else:
    advantages = group_advantages(adv_fn, rewards, sampled.group, sampled.num_groups,
                                  **per_group)
  groups = dict(group_B=jnp.asarray(sampled.group), num_groups=sampled.num_groups)

  # Staleness is counted in learner updates: the lag of each token behind
  # the learner when the batch's first update begins.
  t1 = time.perf_counter()
  version = int(state.step)
  tokens = jnp.asarray(batch.tokens_BxT)
  weights, shift_stats = shift.shift_weights(
      rl.shift_cfg, batch.loss_mask_BxT, batch.version_BxT, version)
  weights = weights * seq_weight[:, None]
  learn_batch = {"tokens_BxT": tokens, "loss_mask_BxT": weights,
                 "advantages": jnp.asarray(advantages, jnp.float32),
                 "behaviour_logp_BxT": jnp.asarray(batch.behaviour_logp_BxT),
                 "entropy_coef_B": jnp.full(tokens.shape[:1], controls.entropy_coef, jnp.float32),
                 "temperature_B": jnp.full(tokens.shape[:1], tau, jnp.float32)}
  learn_batch = sharding.shard_batch(learn_batch, run.mesh)
  if rl.score_fn is not None:
    learn_batch.update(rl.score_fn(state.params, state.ref_params, learn_batch["tokens_BxT"],
                                   jnp.float32(tau)))
  if rl.reset_fn is not None:
    state = rl.reset_fn(state)
  learn_metrics = []
  for k in range(stage.updates_per_batch):
    state, m, outputs = rl.step_fn(state, learn_batch)
    if k == 0:  # the forward at the iteration's start: the learner's old log-probs
      old_logp = learn_batch.get("old_logp_BxT", outputs["logp_BxT"])
      learner_entropy_BxT = outputs["entropy_BxT"]
    learn_metrics.append(m)
  learn_s = time.perf_counter() - t1

  success = np.asarray(batch.reward_components["outcome"]) > 0.5
  metrics = {"reward/mean": float(rewards.mean())}
  if "greedy_rewards_P" in per_group:
    metrics["reward/greedy_baseline"] = float(per_group["greedy_rewards_P"].mean())
  metrics.update({f"reward/{k}": float(np.mean(v)) for k, v in batch.reward_components.items()})
  G_equal = _equal_group_size(sampled.group, sampled.num_groups)
  if G_equal:  # the [P, G] layout, which also gets edit distances
    hashes = batch.call_hashes_BxC.reshape(sampled.num_groups, G_equal, -1)
    layout = {}
  else:
    hashes, layout = batch.call_hashes_BxC, groups
  metrics.update(exploration.exploration_metrics(
      batch.entropy_BxT, batch.loss_mask_BxT, hashes, success, **layout))
  metrics.update(signal.signal_metrics(success, advantages,
                                       batch.loss_mask_BxT, loss_weight_BxT=weights, **groups))
  metrics.update(sampled.metrics)
  metrics["signal/prompt_difficulty"] = float(np.mean(run.tasks.difficulty_of(sampled.prompt_ids)))
  metrics.update(shift.shift_metrics(batch.loss_mask_BxT, batch.behaviour_logp_BxT,
                                     sharding.to_host(old_logp), batch.version_BxT, version))
  metrics.update(shift_stats)
  entropy_coef = float(exploration.update_entropy_coef(
      rl.explore_cfg, exploration.EntropyCoefState(jnp.float32(controls.entropy_coef)),
      metrics["explore/entropy"]).coef)
  metrics.update({"explore/entropy_coef": controls.entropy_coef, "explore/temperature": tau})
  learn_metrics = sharding.to_host(learn_metrics)
  mask = np.asarray(batch.loss_mask_BxT) > 0
  metrics["learner/entropy"] = float(np.sum(sharding.to_host(learner_entropy_BxT) * mask)
                                     / max(mask.sum(), 1))
  metrics.update(jax.tree.map(float, learn_metrics[-1]))
  metrics.update({
      "learner/skipped": sum(float(m["learner/skipped"]) for m in learn_metrics),
      "episode/turns": float(np.mean(batch.num_turns_B)),
      "episode/tool_errors": float(np.mean(batch.num_tool_errors_B)),
      "episode/truncated": float(np.mean(batch.truncated_B)),
      "episode/length": float(np.mean(batch.length_B)),
      "perf/rollout_tokens_per_s": int(generated.loss_mask_BxT.sum()) / max(rollout_s, 1e-9),
      "perf/learner_tokens_per_s": stage.updates_per_batch * float(np.sum(batch.length_B))
                                   / max(learn_s, 1e-9),
  })
  return (state, Controls(history, entropy_coef),
          {k: float(v) for k, v in metrics.items()})


# ------------------------------------------------------------------ the run
# The console progress line: what is learnt, and one number per invariant.
PROGRESS_KEYS = ("sft/nll", "reward/outcome", "eval/success", "explore/entropy",
                 "signal/zero_variance_frac", "shift/kl_behaviour_learner")
# Alarms of the learner itself, in every stage: updates skipped as non-finite
# and a policy collapsed to uniform (maximal entropy, zero gradient).
LEARNER_BANDS = (("learner/skipped_consecutive", invariants.Band(high=0.5)),
                 ("learner/uniform_policy", invariants.Band(high=0.5)))


class TrainingHalted(RuntimeError):
  """The run stopped itself because a guard tripped (the message says which
  and what to change); its last checkpoint is saved."""


@dataclasses.dataclass
class Progress:
  """Host-side position of the run (checkpointed as JSON meta)."""

  stage_index: int = 0
  stage_step: int = 0
  global_step: int = 0
  data_pos: int = 0
  skipped_total: int = 0
  skipped_consecutive: int = 0


def _stage_optimizer(stage, total_steps: int):
  return objectives.make_optimizer(config_lib.optimizer_config(stage, total_steps))


def _stage_steps(stage) -> int:
  return stage.steps if stage.kind == "sft" else stage.iterations


def _restore_opt_state(optimizer, params, leaves):
  target = jax.eval_shape(optimizer.init, params)
  return jax.tree.unflatten(jax.tree.structure(target), leaves)


def reference_policy(stage, params):
  """The frozen policy a KL penalty keeps the stage near, or None without one:
  the parameters of the latest checkpoint in ``stage.reference_from``, else
  those the stage starts from (``params``)."""
  if stage.kind != "rl" or not config_lib.objective_config(stage).kl_coef:
    return None
  if not stage.get("reference_from"):
    return jax.tree.map(jnp.copy, params)
  with checkpoint_lib.Checkpointer(stage.reference_from) as source:
    restored, _ = source.restore()
  reference = jax.tree.map(jnp.asarray, restored["params"])
  if jax.tree.structure(reference) != jax.tree.structure(params) or any(
      a.shape != b.shape for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(params))):
    raise config_lib.ConfigError(
        f"config reference_from={stage.reference_from!r}: its parameters do not have this "
        "model's structure and shapes (config.model)")
  return reference


def _uniform_policy(record: dict[str, float], vocab_size: int) -> float:
  """1.0 when the step's gradient is exactly 0 and the policy's entropy (or
  the SFT loss) is ``ln V``: a policy collapsed to uniform, which no update
  can leave."""
  spread = record.get("explore/entropy", record.get("sft/nll", 0.0))
  return float(record["learner/grad_norm"] == 0 and spread >= 0.999 * np.log(vocab_size))


def train(cfg, workdir: str, *, stop_after: int | None = None) -> dict[str, Any]:
  """Runs (or resumes) the configured stages; returns the summary.

  A workdir with a checkpoint resumes, provided the config changes nothing
  the checkpoint holds (:func:`resume.check_resume`). SIGTERM and SIGINT end
  the run after the current step with a checkpoint (the summary's
  ``stopped`` names the signal); so does ``stop_after`` after that many global
  steps. ``cfg.guards.max_consecutive_skips`` non-finite steps in a row raise
  :class:`TrainingHalted`.
  """
  t_start = time.perf_counter()
  run = build(cfg)
  ckpt = checkpoint_lib.Checkpointer(workdir, keep=cfg.checkpoint.keep)
  if ckpt.latest_step() is not None and (saved := resume.load_run_config(workdir)):
    try:
      notices = resume.check_resume(saved, resume.config_to_dict(cfg))
    except ValueError as e:
      ckpt.close()
      raise config_lib.ConfigError(f"cannot resume {workdir}: {e}") from None
    for notice in notices:
      print(notice, file=sys.stderr)
  resume.save_run_config(workdir, cfg)
  stages = [cfg[name] for name in cfg.stages]
  total = sum(_stage_steps(s) for s in stages)
  root_key = jax.random.key(cfg.seed)
  params = model_lib.init_params(run.model_config, jax.random.fold_in(root_key, 0))
  progress = Progress()
  controls = Controls(signal.init_history(cfg.tasks.train_size), 0.0)
  summary: dict[str, Any] = {}
  restored = None
  if ckpt.latest_step() is not None:
    restored, meta = ckpt.restore(ckpt.latest_step())
    progress = Progress(**meta["progress"])
    summary = dict(meta["summary"])
    params = restored["params"]
    controls = Controls(signal.PromptHistory(**restored["history"]),
                        float(restored["entropy_coef"]))
    root_key = restored["rng"]
    print(f"resuming {workdir} at step {progress.global_step}")
  earlier = dict(summary)  # the summary as this invocation found it
  writer = metrics_lib.MetricsWriter(workdir, total, start_step=progress.global_step,
                                     progress_keys=PROGRESS_KEYS)

  def save(state: learner.TrainState, actors):
    summary.update(metrics_lib.wall_times(earlier, time.perf_counter() - t_start))
    tree = {"params": state.params, "opt_state": state.opt_state, "step": state.step,
            "ref_params": state.ref_params,
            "actors": [a[0] for a in actors], "actor_versions": [a[1] for a in actors],
            "history": dataclasses.asdict(controls.history),
            "entropy_coef": np.float32(controls.entropy_coef), "rng": root_key}
    ckpt.save(progress.global_step, tree,
              {"progress": dataclasses.asdict(progress), "summary": summary})

  def close():
    ckpt.close()
    writer.close()

  last_alarms: set[str] = set()

  def finish_step(name, bands, record, t0, state, actors) -> str | None:
    """Alarms, logging, guards and checkpoints after a step; returns why the
    run stops here (a signal's name or "stop_after"), else None."""
    nonlocal last_alarms
    skipped = record["learner/skipped"] > 0
    progress.skipped_total += int(record["learner/skipped"])
    progress.skipped_consecutive = progress.skipped_consecutive + 1 if skipped else 0
    record.update({"learner/skipped_total": float(progress.skipped_total),
                   "learner/skipped_consecutive": float(progress.skipped_consecutive),
                   "learner/uniform_policy": _uniform_policy(record,
                                                             run.model_config.vocab_size)})
    bands = dict(bands + LEARNER_BANDS)
    alarms = invariants.check_alarms(record, bands)
    record.update(invariants.alarm_metrics(alarms))
    fired = {k for k, v in alarms.items() if v}
    if fired != last_alarms:  # on the console when the set of alarms changes
      print(f"[{name} {progress.stage_step}] "
            f"{invariants.format_alarms(record, bands) or 'alarms cleared'}",
            file=sys.stderr, flush=True)
      last_alarms = fired
    record.update({"perf/step_s": time.perf_counter() - t0, "stage": progress.stage_index})
    writer.write(progress.global_step, record)
    progress.stage_step += 1
    progress.global_step += 1
    if progress.skipped_consecutive >= cfg.guards.max_consecutive_skips:
      save(state, actors)
      close()
      raise TrainingHalted(
          f"{progress.skipped_consecutive} consecutive steps of config.{name} were skipped "
          f"because the loss or gradient was not finite ({progress.skipped_total} in all); the "
          f"parameters are those before them, saved at step {progress.global_step}. Lower "
          f"config.{name}.learning_rate or check the rewards, then rerun (a new --workdir "
          "starts afresh); config.guards.max_consecutive_skips sets the limit")
    stop = "stop_after" if stop_after is not None and progress.global_step >= stop_after else None
    if sharding.agree(interrupts.requested is not None):  # every process stops together
      stop = interrupts.requested or "a signal to another process"
    if progress.stage_step == _stage_steps(stages[progress.stage_index]):
      return stop  # the stage's end saves a checkpoint anyway
    if stop or progress.stage_step % cfg.checkpoint.every == 0:
      save(state, actors)
    return stop

  with interrupt.Interrupts() as interrupts:
    while progress.stage_index < len(stages):
      stage, name = stages[progress.stage_index], cfg.stages[progress.stage_index]
      n_steps = _stage_steps(stage)
      optimizer = _stage_optimizer(stage, n_steps)
      reference = reference_policy(stage, params)
      state = learner.init_train_state(params, optimizer, reference)
      actors: collections.deque = collections.deque()
      if restored is not None and progress.stage_step:
        state = learner.TrainState(
            params, _restore_opt_state(optimizer, params, jax.tree.leaves(restored["opt_state"])),
            jnp.asarray(restored["step"], jnp.int32),
            restored.get("ref_params") if reference is not None else None)
        actors.extend(zip(restored["actors"], restored["actor_versions"]))
      restored = None
      stage_key = jax.random.fold_in(root_key, 1 + progress.stage_index)
      stop = None

      if stage.kind == "sft":
        data = demonstrations(run, stage, stage_key)
        n_rows = data["tokens_BxT"].shape[0]
        step_fn, state_sharding = learner.shard_train_step(learner.make_train_step(
            learner.sft_loss(run.model_config, logprob_impl=cfg.model.logprob_impl),
            optimizer, micro_batches=cfg.micro_batches),
            run.mesh, run.model_config, optimizer, state.params)
        state = jax.device_put(state, state_sharding)
        while progress.stage_step < n_steps:
          t0 = time.perf_counter()
          rows = np.random.default_rng([cfg.seed, progress.global_step]).choice(
              n_rows, stage.batch_size, replace=False)
          state, m, _ = step_fn(state, {k: jnp.asarray(v[rows]) for k, v in data.items()})
          record = {k: float(v) for k, v in sharding.to_host(m).items()}
          if progress.stage_step == n_steps - 1:
            record.update(evaluate(run, state.params, stage_key))
            summary[f"{name}_success"] = summary["sft_success"] = record["eval/success"]
          if stop := finish_step(name, (), record, t0, state, actors):
            break
      else:
        rl = make_rl_stage(run, stage, optimizer, state.params)
        state = jax.device_put(state, rl.state_sharding)
        if progress.stage_step == 0:
          controls = dataclasses.replace(controls, entropy_coef=rl.explore_cfg.entropy_coef)

        def draw_prompts(num, key):
          """In data order, or prioritised by each prompt's failure rate and/or
          restricted to the curriculum's current difficulties (Kimi k1.5)."""
          if rl.signal_cfg.prompt_sampling == "prioritised" or rl.signal_cfg.curriculum:
            return signal.select_prompts(
                rl.signal_cfg, controls.history, num, key, step=progress.stage_step,
                difficulty_N=run.tasks.difficulty_of(np.arange(cfg.tasks.train_size)))
          ids = (progress.data_pos + np.arange(num)) % cfg.tasks.train_size
          progress.data_pos += num
          return ids

        bands = rl.signal_cfg.bands + rl.shift_cfg.bands + rl.explore_cfg.bands
        while progress.stage_step < n_steps:
          t0 = time.perf_counter()
          it_key = jax.random.fold_in(stage_key, progress.stage_step)
          # Off-policy mode: the actor runs the oldest parameters at most
          # max_staleness learner updates behind (snapshots are taken per
          # batch, so with several updates per batch the lag is a multiple
          # of them).
          actors.append((jax.tree.map(jnp.copy, state.params), int(state.step)))
          while int(state.step) - actors[0][1] > stage.max_staleness:
            actors.popleft()
          state, controls, record = rl_iteration(run, rl, stage, state, *actors[0],
                                                 draw_prompts, controls, it_key,
                                                 progress.stage_step)
          last = progress.stage_step == n_steps - 1
          if (progress.stage_step + 1) % cfg.eval.every == 0 or last:
            record.update(evaluate(run, state.params, it_key))
          if last:
            summary[f"{name}_success"] = summary["rl_success"] = record["eval/success"]
          if stop := finish_step(name, bands, record, t0, state, actors):
            break
      if progress.stage_step < n_steps:  # stopped inside the stage (saved)
        close()
        print(f"stopped ({stop}) at step {progress.global_step}; run again with the same "
              "workdir to resume", file=sys.stderr)
        return dict(summary, stopped=stop)
      params = state.params
      if f"{name}_success" not in summary:  # resumed with fewer steps than were done
        summary[f"{name}_success"] = evaluate(run, params, stage_key)["eval/success"]
      print(f"[{name}] held-out success: {summary[f'{name}_success']:.3f}")
      progress.stage_index += 1
      progress.stage_step = 0
      save(learner.TrainState(params, {}, jnp.zeros((), jnp.int32)), ())
      if stop and progress.stage_index < len(stages):
        close()
        return dict(summary, stopped=stop)

  close()
  summary.update(steps=progress.global_step,
                 **metrics_lib.wall_times(earlier, time.perf_counter() - t_start))
  metrics_lib.write_summary(workdir, summary)
  return summary
