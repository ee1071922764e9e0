"""One driver per stage kind: ``sft``, ``distill`` and ``rl``.

Each runs its stage's steps from the run's position (``driver.progress``)
until the stage ends or the run stops, and returns ``(state, controls,
stop)``: ``stop`` names why the run stops inside or at the end of the stage
(a signal, ``"stop_after"``), else None. The run's shell
(:func:`agentic_rl.train.loop.train`) builds each stage's optimiser and
train state, and owns checkpoints, resume and the summary; ``driver`` is its
bookkeeping (:class:`agentic_rl.train.loop.Driver`).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.invariants import shift
from agentic_rl.text import codec as codec_lib
from agentic_rl.train import actor as actor_lib
from agentic_rl.train import distill, learner, rl, sharding
from agentic_rl.train.run import evaluate


def stage_steps(stage) -> int:
  return stage.steps if stage.kind == "sft" else stage.iterations


def budget_spent(stage, progress) -> bool:
  """An RL stage with ``rollout_budget`` > 0 ends once it has generated that
  many episodes (all of them, dropped groups included), so arms whose
  allocation spends rollouts differently compare at equal sampling cost."""
  budget = stage.kind == "rl" and stage.rollout_budget
  return bool(budget) and progress.stage_rollouts >= budget


def summarise_success(driver, name: str, record, alias: str) -> None:
  """A stage's held-out success into the summary: greedy as
  ``<stage>_success`` (and ``alias``), sampled at temperature 1
  (``eval/pass_at_1``) as ``<stage>_success_sampled`` (and
  ``<alias>_sampled``), and each family's as ``<stage>_success/<family>`` and
  ``<stage>_success_sampled/<family>``."""
  s = driver.summary
  s[f"{name}_success"] = s[alias] = record["eval/success"]
  s[f"{name}_success_sampled"] = s[f"{alias}_sampled"] = record["eval/pass_at_1"]
  for metric, key in (("eval/success/", "success"), ("eval/pass_at_1/", "success_sampled")):
    s.update({f"{name}_{key}/{k[len(metric):]}": v
              for k, v in record.items() if k.startswith(metric)})


def _evaluate_at(run, driver, name: str, stage, params, stage_key, record) -> None:
  """Held-out evaluation into ``record`` every ``config.eval.every`` steps
  of an RL or distill stage and at its last (its final iteration, or the
  one that spent its rollout budget), whose success (and each family's) goes
  into the summary as ``<stage>_success`` and ``rl_success``."""
  p = driver.progress
  last = p.stage_step == stage_steps(stage) - 1 or budget_spent(stage, p)
  if (p.stage_step + 1) % run.cfg.eval.every == 0 or last:
    record.update(evaluate(run, params, jax.random.fold_in(stage_key, p.stage_step)))
  if last:
    summarise_success(driver, name, record, "rl_success")


def sft(run, driver, name, stage, state, optimizer, controls, stage_key, snapshots):
  """Supervised steps on the stage's demonstrations (packed when
  ``stage.pack``), each on ``batch_size`` rows drawn by the global step."""
  del snapshots
  cfg, p = run.cfg, driver.progress
  data = run.demonstrations(state.params, stage, stage_key)
  demos_per_row = np.ones(data["tokens_BxT"].shape[0])
  if stage.pack:
    data = codec_lib.pack_rows(data["tokens_BxT"], data["loss_mask_BxT"], run.codec.ids.pad)
    demos_per_row = data["segment_ids_BxT"].max(axis=1)
  if data["tokens_BxT"].shape[0] < stage.batch_size:
    raise ValueError(
        f"config.{name}.batch_size={stage.batch_size} is more than the "
        f"{data['tokens_BxT'].shape[0]} rows of demonstrations: of the "
        f"{stage.num_demos} played, those that fit in config.sampling.max_total_tokens "
        f"with every action within config.sampling.max_new_tokens_per_turn"
        f"{f', packed by config.{name}.pack' if stage.pack else ''}; "
        f"lower it, or raise config.{name}.num_demos or those limits")
  step_fn, state_sharding = learner.shard_train_step(learner.make_train_step(
      learner.sft_loss(run.model_config, logprob_impl=cfg.model.logprob_impl),
      optimizer, micro_batches=cfg.micro_batches,
      trainable=learner.trainable(run.model_config)),
      run.mesh, run.model_config, optimizer, state.params)
  state = jax.device_put(state, state_sharding)
  stop, n_steps = None, stage_steps(stage)
  while p.stage_step < n_steps and not stop:
    t0 = time.perf_counter()
    rows = np.random.default_rng([cfg.seed, p.global_step]).choice(
        data["tokens_BxT"].shape[0], stage.batch_size, replace=False)
    batch = {k: v[rows] for k, v in data.items()}
    batch = learner.trim_time(batch, learner.used_length(batch["loss_mask_BxT"]))
    state, m, _ = step_fn(state, {k: jnp.asarray(v) for k, v in batch.items()})
    record = {k: float(v) for k, v in sharding.to_host(m).items()}
    record["sft/demos"] = float(demos_per_row[rows].sum())
    if p.stage_step == n_steps - 1:
      record.update(evaluate(run, state.params, stage_key))
      summarise_success(driver, name, record, "sft_success")
    stop = driver.finish_step(name, (), record, t0,
                              lambda: driver.save(state, (), controls))  # noqa: B023
  return state, controls, stop


def distill_stage(run, driver, name, stage, state, optimizer, controls, stage_key, snapshots):
  """A student from a teacher per family (:mod:`agentic_rl.train.distill`);
  checkpoints leave the teachers out (the stage loads them again)."""
  del snapshots
  p = driver.progress
  ds = distill.make_distill_stage(run, stage, optimizer, state.params)
  state = jax.device_put(state.replace(ref_params=ds.teachers if ds.on_policy else None),
                         ds.rl.state_sharding)
  prompts = rl.PromptSource(ds.rl.signal_cfg,
                            run.tasks.difficulty_of(np.arange(run.cfg.tasks.train_size)),
                            p.data_pos, pool=run.prompt_pool(stage.families))
  stop = None
  while p.stage_step < stage_steps(stage) and not stop:
    t0 = time.perf_counter()
    state, record = distill.distill_iteration(
        run, ds, state, prompts, controls.history,
        jax.random.fold_in(stage_key, p.stage_step), p.stage_step)
    p.data_pos = prompts.position
    _evaluate_at(run, driver, name, stage, state.params, stage_key, record)
    stop = driver.finish_step(name, (), record, t0, lambda: driver.save(  # noqa: B023
        state.replace(ref_params=None), (), controls))
  return state, controls, stop


def rl_stage(run, driver, name, stage, state, optimizer, controls, stage_key, snapshots):
  """RL iterations (:func:`agentic_rl.train.rl.rl_iteration`) with the
  stage's actor (:mod:`agentic_rl.train.actor`), until ``iterations`` or
  the stage's rollout budget."""
  p, n_steps = driver.progress, stage_steps(stage)
  stage_rl = rl.make_rl_stage(run, stage, optimizer, state.params,
                              reset_each_iteration=driver.optimizer_cfg.reset_each_iteration)
  state = jax.device_put(state, stage_rl.state_sharding)
  if p.stage_step == 0:
    controls = dataclasses.replace(
        controls, entropy_coef=stage_rl.explore_cfg.entropy_coef,
        staleness=shift.init_staleness_bound(stage_rl.shift_cfg))
  prompts = rl.PromptSource(stage_rl.signal_cfg,
                            run.tasks.difficulty_of(np.arange(run.cfg.tasks.train_size)),
                            p.data_pos, p.data_skip, pool=run.prompt_pool(stage.families))
  bands = stage_rl.signal_cfg.bands + stage_rl.shift_cfg.bands + stage_rl.explore_cfg.bands
  actor = actor_lib.make_actor(stage.actor, run, stage_rl, prompts, stage_key, state,
                               p.stage_step, controls, controls.staleness.bound,
                               end_step=n_steps, snapshots=snapshots)
  stop = None
  try:
    while p.stage_step < n_steps and not stop and not budget_spent(stage, p):
      t0 = time.perf_counter()
      state, controls, collected, record = rl.rl_iteration(
          run, stage_rl, actor, state, controls, p.stage_step)
      p.data_pos, p.data_skip = collected.data_pos, list(collected.data_skip)
      p.stage_rollouts += int(record["signal/rollouts"])
      record["signal/stage_rollouts"] = float(p.stage_rollouts)
      _evaluate_at(run, driver, name, stage, state.params, stage_key, record)
      stop = driver.finish_step(name, bands, record, t0, lambda: driver.save(  # noqa: B023
          state, actor.checkpoint(), controls))
  finally:
    if discarded := actor.close():
      key = f"{name}_discarded_batches"
      driver.summary[key] = driver.summary.get(key, 0) + discarded
  return state, controls, stop


DRIVERS = {"sft": sft, "distill": distill_stage, "rl": rl_stage}
