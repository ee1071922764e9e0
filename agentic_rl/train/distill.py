"""The distill stage: one student from several teachers (``kind="distill"``).

GLM-4.5 trains experts stage by stage and merges them into one model by
distillation, so that later training does not erase earlier abilities. Here
each task family (``config.tasks.families``; a host environment is the one
family ``"host"``) has a teacher, the latest checkpoint of a run directory
(``stage.teachers.<family>``, or ``stage.teachers.all`` for every family
without its own), with the student's architecture. One iteration::

  draw prompts -> rollouts -> each row's teacher -> one update

``mode="on_policy"``: the student samples and the loss is the per-token
reverse KL to the teacher of the prompt's family over the whole vocabulary
(:func:`agentic_rl.train.learner.distill_loss`,
:mod:`agentic_rl.objectives.distill`). ``mode="teacher_sft"``: each
teacher samples its own family's prompts and the student takes the
negative log-likelihood of the teacher's tokens (SFT on teacher rollouts).
Rollouts, context segments and evaluation are the RL stage's
(:func:`agentic_rl.train.rl.collect`), with uniform allocation and the
stage's sampling settings.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl import objectives
from agentic_rl.invariants import exploration, shift, signal
from agentic_rl.objectives import toggle
from agentic_rl.rollout import context
from agentic_rl.train import checkpoint as checkpoint_lib
from agentic_rl.train import config as config_lib
from agentic_rl.train import learner, rl, sharding
from agentic_rl.train.run import Run


@dataclasses.dataclass
class DistillStage:
  """The stage's collection settings and compiled step (``rl``: an
  :class:`~agentic_rl.train.rl.RLStage` with uniform allocation), its
  teachers' parameters (on the mesh, laid out as the policy) and the
  teacher of each task family (int ``[F]``, into ``teachers``)."""

  rl: rl.RLStage
  teachers: list[Any]
  teacher_of_family: np.ndarray
  on_policy: bool


def teacher_dirs(run: Run, stage) -> list[str]:
  """The run directory of each task family's teacher (``stage.teachers``:
  the family's own entry, else ``all``), in :attr:`Run.family_names` order."""
  table = stage.teachers
  return [table.get(name) or table.get("all", "") for name in run.family_names]


def make_distill_stage(run: Run, stage, optimizer, params) -> DistillStage:
  """Loads the teachers (one per distinct run directory) and compiles the
  stage's step for ``run.mesh``."""
  dirs = teacher_dirs(run, stage)
  unique = list(dict.fromkeys(dirs))
  params_sh = learner.params_sharding(run.mesh, run.model_config, params)
  teachers = []
  for d in unique:
    try:
      teachers.append(jax.device_put(checkpoint_lib.load_params(d, like=params), params_sh))
    except ValueError as e:
      raise config_lib.ConfigError(
          f"config teacher {d!r}: {e}; a teacher is a run of this model (config.model)"
      ) from None
  on_policy = stage.mode == "on_policy"
  model_config, cfg = run.model_config, run.cfg
  loss = (learner.distill_loss(model_config) if on_policy
          else learner.sft_loss(model_config, logprob_impl=cfg.model.logprob_impl))
  step_fn, state_sharding = learner.shard_train_step(
      learner.make_train_step(loss, optimizer, micro_batches=cfg.micro_batches,
                              trainable=learner.trainable(model_config),
                              reference_in_loss=on_policy),
      run.mesh, model_config, optimizer, params, teachers=len(teachers) if on_policy else 0)
  sampling = config_lib.sampling_config(cfg, temperature=stage.temperature,
                                        top_k=stage.top_k, top_p=stage.top_p)
  collection = rl.RLStage(
      stage.prompts_per_step, stage.group_size, 1, sampling, objectives.ObjectiveConfig(),
      frozenset(), signal.SignalConfig(allocation="uniform"), shift.ShiftConfig(),
      exploration.ExplorationConfig(temperature=stage.temperature), step_fn, state_sharding)
  return DistillStage(collection, teachers, np.array([unique.index(d) for d in dirs]),
                      on_policy)


def teacher_rollouts(run: Run, ds: DistillStage, ids: np.ndarray, teacher_N: np.ndarray,
                     key, version: int):
  """``(rollouts, ids)``: each teacher's rollouts of its prompts ``ids``
  (teacher by teacher, so reordered)."""
  parts, order = [], []
  for t in np.unique(teacher_N):
    mine = ids[teacher_N == t]
    parts.append(run.rollout(ds.teachers[t], ds.rl.sampling, "train", mine,
                             jax.random.fold_in(key, int(t)), version, ds.rl.rows))
    order.append(mine)
  return jax.tree.map(lambda *xs: np.concatenate(xs), *parts), np.concatenate(order)


def distill_iteration(run: Run, ds: DistillStage, state: learner.TrainState,
                      prompts: rl.PromptSource, history: signal.PromptHistory, key,
                      step: int) -> tuple[learner.TrainState, dict[str, float]]:
  """One iteration (the module's pipeline); returns ``(state, metrics)``."""
  t0 = time.perf_counter()
  P, G = ds.rl.prompts_per_step, ds.rl.group_size
  if ds.on_policy:
    collected = rl.collect(run, ds.rl, (state.params, int(state.step)), prompts, history,
                           key, step)
    batch, ids = collected.batch, collected.prompt_B
  else:
    ids = np.repeat(prompts.draw(P, key, history=history, step=step), G)
    batch, ids = teacher_rollouts(run, ds, ids,
                                  ds.teacher_of_family[run.families_of("train", ids)],
                                  jax.random.fold_in(key, 1), int(state.step))
  rollout_s = time.perf_counter() - t0
  rows = context.scored_rows(batch)  # each context segment as the policy saw it
  teacher_B = ds.teacher_of_family[run.families_of("train", ids)]
  learn_batch = sharding.shard_batch({
      "tokens_BxT": jnp.asarray(rows["tokens_RxT"]),
      "loss_mask_BxT": jnp.asarray(rows["loss_mask_RxT"], jnp.float32),
      "teacher_B": jnp.asarray(rows.per_row(teacher_B), jnp.int32)}, run.mesh)
  t1 = time.perf_counter()
  state, m, _ = ds.rl.step_fn(state, learn_batch)
  metrics = {k: float(v) for k, v in sharding.to_host(m).items()}
  success = np.asarray(batch.reward_components["outcome"]) > 0.5
  metrics.update({f"reward/{k}": float(np.mean(v)) for k, v in batch.reward_components.items()})
  metrics.update({
      "reward/mean": float(np.mean(batch.reward_B)),
      "reward/tokens_per_success": toggle.tokens_per_success(rl.policy_tokens(batch), success),
      "episode/turns": float(np.mean(batch.num_turns_B)),
      "episode/length": float(np.mean(batch.length_B)),
      **context.context_metrics(batch),
      "perf/rollout_s": rollout_s,
      "perf/learner_s": time.perf_counter() - t1})
  return state, metrics
