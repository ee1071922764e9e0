"""The training run: stages (SFT warm start, then RL) over one policy.

``train(cfg, workdir)`` builds everything from a validated config
(:mod:`agentic_rl.train.config`, :mod:`agentic_rl.train.run`), resumes from
``workdir`` if it holds a checkpoint, runs the stages in order and writes
``summary.json``. This module is the stage driver: checkpoints, resume,
alarms, guards and signals. An RL iteration is :func:`agentic_rl.train.rl.
rl_iteration`; every one reports the three invariants (``explore/*``,
``signal/*``, ``shift/*``) next to rewards and throughput.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl import invariants
from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl.invariants import shift, signal
from agentic_rl.model import lora
from agentic_rl.text import codec as codec_lib
from agentic_rl.train import checkpoint as checkpoint_lib
from agentic_rl.train import config as config_lib
from agentic_rl.train import actor as actor_lib
from agentic_rl.train import distill
from agentic_rl.train import export as export_lib
from agentic_rl.train import interrupt, learner, resume, rl, sharding
from agentic_rl.train import metrics as metrics_lib
from agentic_rl.train.run import build, evaluate

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
  data_skip: list[int] = dataclasses.field(default_factory=list)
  skipped_total: int = 0
  skipped_consecutive: int = 0
  stage_rollouts: int = 0  # episodes generated in this RL stage (signal/rollouts)


def _stage_steps(stage) -> int:
  return stage.steps if stage.kind == "sft" else stage.iterations


def _budget_spent(stage, progress: Progress) -> bool:
  """An RL stage with ``rollout_budget`` > 0 ends once it has generated that
  many episodes (all of them, dropped groups included), so arms whose
  allocation spends rollouts differently compare at equal sampling cost."""
  budget = stage.get("rollout_budget", 0)
  return bool(budget) and progress.stage_rollouts >= budget


def _uniform_policy(record: dict[str, float], vocab_size: int) -> float:
  """1.0 when the step's gradient is exactly 0 and the policy's entropy (or
  the SFT loss) is ``ln V``: a policy collapsed to uniform, which no update
  can leave."""
  spread = record.get("explore/entropy", record.get("sft/nll", 0.0))
  return float(record["learner/grad_norm"] == 0 and spread >= 0.999 * np.log(vocab_size))


def _initial_params(run, key: jax.Array):
  """The parameters the run starts from: the checkpoint's
  (``config.model.init_from``), placed sharded over the mesh as the learner
  keeps them, or ``init_params`` of the run's model from ``key``; with LoRA,
  that base and fresh adapters from ``key``. A LoRA run's checkpoints hold
  only its adapters: resuming rebuilds the base here
  (:func:`restored_params`), so this must give the same base every time."""
  config = run.model_config
  if not (path := run.cfg.model.get("init_from", "")):
    return model_lib.init_params(config, key)
  host = model_lib.hf.load_hf_params(path, config)
  if config.lora_rank:
    host = jax.tree.map(np.asarray, lora.add_adapters(host, config, key))
  return jax.device_put(host, learner.params_sharding(run.mesh, config, host))


def _params_key(cfg) -> jax.Array:
  """The key of :func:`_initial_params`."""
  return jax.random.fold_in(jax.random.key(cfg.seed), 0)


def saved_params(params, model_config):
  """What a checkpoint holds of ``params``: the adapters alone with LoRA
  (the base is frozen and rebuilt on restore), else all of them."""
  if params is None or not model_config.lora_rank:
    return params
  return lora.adapters(params)


def restored_params(run, saved):
  """The parameters of a checkpoint's ``saved`` ones (:func:`saved_params`):
  with LoRA the base of :func:`_initial_params` with the saved adapters."""
  if not run.model_config.lora_rank:
    return saved
  return lora.with_adapters(_initial_params(run, _params_key(run.cfg)), saved)


class _Driver:
  """The run's bookkeeping between steps: progress, checkpoints, the metrics
  writer, alarms and guards, and how the run stops."""

  def __init__(self, cfg, workdir: str, stop_after: int | None, interrupts, model_config):
    self.cfg, self.workdir, self.stop_after, self.interrupts = cfg, workdir, stop_after, interrupts
    self.model_config = model_config
    self.t_start = time.perf_counter()
    self.ckpt = checkpoint_lib.Checkpointer(workdir, keep=cfg.checkpoint.keep)
    try:
      resume.begin(workdir, cfg, has_checkpoint=self.ckpt.latest_step() is not None)
    except ValueError as e:
      self.ckpt.close()
      raise config_lib.ConfigError(str(e)) from None
    self.stages = [cfg[name] for name in cfg.stages]
    self.progress, self.summary, self.restored = Progress(), {}, None
    self.learning_rate = objectives.make_schedule(objectives.OptimizerConfig())  # per stage
    if self.ckpt.latest_step() is not None:
      self.restored, meta = self.ckpt.restore(self.ckpt.latest_step())
      self.progress, self.summary = Progress(**meta["progress"]), dict(meta["summary"])
      print(f"resuming {workdir} at step {self.progress.global_step}")
    self.earlier = dict(self.summary)  # the summary as this invocation found it
    self.writer = metrics_lib.MetricsWriter(
        workdir, sum(_stage_steps(s) for s in self.stages),
        start_step=self.progress.global_step, progress_keys=PROGRESS_KEYS)
    self.last_alarms: set[str] = set()

  def save(self, state: learner.TrainState, actors, controls: rl.Controls, rng) -> None:
    self.summary.update(metrics_lib.wall_times(self.earlier, time.perf_counter() - self.t_start))
    tree = {"params": saved_params(state.params, self.model_config),
            "opt_state": state.opt_state, "step": state.step,
            "ref_params": saved_params(state.ref_params, self.model_config),
            "actors": [a[0] for a in actors], "actor_versions": [a[1] for a in actors],
            "history": dataclasses.asdict(controls.history),
            "entropy_coef": np.float32(controls.entropy_coef),
            "staleness": np.array(dataclasses.astuple(controls.staleness), np.int64),
            "budget": controls.budget, "rng": rng}
    self.ckpt.save(self.progress.global_step, tree,
                   {"progress": dataclasses.asdict(self.progress), "summary": self.summary})

  def close(self, stopped: str | None = None) -> dict[str, Any]:
    """Closes the checkpointer and writer; returns the summary (with
    ``stopped`` when the run ends early)."""
    self.ckpt.close()
    self.writer.close()
    if stopped is None:
      self.summary.update(steps=self.progress.global_step, **metrics_lib.wall_times(
          self.earlier, time.perf_counter() - self.t_start))
      metrics_lib.write_summary(self.workdir, self.summary)
      return self.summary
    print(f"stopped ({stopped}) at step {self.progress.global_step}; run again with the same "
          "workdir to resume", file=sys.stderr)
    return dict(self.summary, stopped=stopped)

  def finish_step(self, name, bands, record, t0, vocab_size, save) -> str | None:
    """Alarms, logging, guards and checkpoints (``save()``) after a step;
    returns why the run stops here (a signal's name or "stop_after"), else None."""
    p, cfg = self.progress, self.cfg
    p.skipped_total += int(record["learner/skipped"])
    p.skipped_consecutive = p.skipped_consecutive + 1 if record["learner/skipped"] > 0 else 0
    record.update({"learner/lr": float(self.learning_rate(p.stage_step)),
                   "learner/skipped_total": float(p.skipped_total),
                   "learner/skipped_consecutive": float(p.skipped_consecutive),
                   "learner/uniform_policy": _uniform_policy(record, vocab_size)})
    bands = dict(bands + LEARNER_BANDS)
    alarms = invariants.check_alarms(record, bands)
    record.update(invariants.alarm_metrics(alarms))
    if (fired := {k for k, v in alarms.items() if v}) != self.last_alarms:
      print(f"[{name} {p.stage_step}] "  # on the console when the set of alarms changes
            f"{invariants.format_alarms(record, bands) or 'alarms cleared'}",
            file=sys.stderr, flush=True)
      self.last_alarms = fired
    record.update({"perf/step_s": time.perf_counter() - t0, "stage": p.stage_index})
    self.writer.write(p.global_step, record)
    p.stage_step += 1
    p.global_step += 1
    if p.skipped_consecutive >= cfg.guards.max_consecutive_skips:
      save()
      self.close()
      raise TrainingHalted(
          f"{p.skipped_consecutive} consecutive steps of config.{name} were skipped "
          f"because the loss or gradient was not finite ({p.skipped_total} in all); the "
          f"parameters are those before them, saved at step {p.global_step}. Lower "
          f"config.{name}.learning_rate or check the rewards, then rerun (a new --workdir "
          "starts afresh); config.guards.max_consecutive_skips sets the limit")
    stop = "stop_after" if self.stop_after is not None and p.global_step >= self.stop_after else None
    if sharding.agree(self.interrupts.requested is not None):  # every process stops together
      stop = self.interrupts.requested or "a signal to another process"
    stage = self.stages[p.stage_index]
    if p.stage_step == _stage_steps(stage) or _budget_spent(stage, p):
      return stop  # the stage's end saves a checkpoint anyway
    if stop or p.stage_step % cfg.checkpoint.every == 0:
      save()
    return stop


def _evaluate_at(run, d: _Driver, name: str, params, stage_key, record) -> None:
  """Held-out evaluation into ``record`` every ``config.eval.every`` steps
  of an RL or distill stage and at its last (its final iteration, or the
  one that spent its rollout budget), whose success (and each family's) goes
  into the summary as ``<stage>_success`` and ``rl_success``."""
  p = d.progress
  stage = d.stages[p.stage_index]
  last = p.stage_step == _stage_steps(stage) - 1 or _budget_spent(stage, p)
  if (p.stage_step + 1) % run.cfg.eval.every == 0 or last:
    record.update(evaluate(run, params, jax.random.fold_in(stage_key, p.stage_step)))
  if last:
    _summarise_success(d, name, record, "rl_success")


def _summarise_success(d: _Driver, name: str, record, alias: str) -> None:
  """A stage's held-out success into the summary: greedy as
  ``<stage>_success`` (and ``alias``), sampled at temperature 1
  (``eval/pass_at_1``) as ``<stage>_success_sampled`` (and
  ``<alias>_sampled``), and each family's as ``<stage>_success/<family>`` and
  ``<stage>_success_sampled/<family>``."""
  d.summary[f"{name}_success"] = d.summary[alias] = record["eval/success"]
  d.summary[f"{name}_success_sampled"] = d.summary[f"{alias}_sampled"] = record["eval/pass_at_1"]
  for metric, key in (("eval/success/", "success"), ("eval/pass_at_1/", "success_sampled")):
    d.summary.update({f"{name}_{key}/{k[len(metric):]}": v
                      for k, v in record.items() if k.startswith(metric)})


def train(cfg, workdir: str, *, stop_after: int | None = None) -> dict[str, Any]:
  """Runs (or resumes) the configured stages; returns the summary.

  A workdir with a checkpoint resumes, provided the config changes nothing
  the checkpoint holds (:func:`resume.check_resume`). SIGTERM and SIGINT end
  the run after the current step with a checkpoint (the summary's
  ``stopped`` names the signal); so does ``stop_after`` after that many global
  steps. ``cfg.guards.max_consecutive_skips`` non-finite steps in a row raise
  :class:`TrainingHalted`.
  """
  run = build(cfg)
  with interrupt.Interrupts() as interrupts:
    d = _Driver(cfg, workdir, stop_after, interrupts, run.model_config)
    progress, restored = d.progress, d.restored
    root_key = jax.random.key(cfg.seed)
    controls = rl.Controls(signal.init_history(cfg.tasks.train_size), 0.0,
                           budget=objectives.toggle.init_budgets(cfg.tasks.train_size))
    if restored is None:
      params = _initial_params(run, _params_key(cfg))
    else:
      params, root_key = restored_params(run, restored["params"]), restored["rng"]
      if run.model_config.lora_rank and restored.get("ref_params") is not None:
        # The reference's own copy of the base, as rl.reference_policy makes it
        # (the train state is donated, and one buffer cannot be donated twice).
        restored = dict(restored, ref_params=lora.with_adapters(
            jax.tree.map(jnp.copy, params), restored["ref_params"]))
      controls = rl.Controls(signal.PromptHistory(**restored["history"]),
                             float(restored["entropy_coef"]),
                             shift.StalenessBound(*map(int, restored["staleness"])),
                             np.asarray(restored["budget"], np.float32))
    while progress.stage_index < len(d.stages):
      stage, name = d.stages[progress.stage_index], cfg.stages[progress.stage_index]
      n_steps = _stage_steps(stage)
      opt_cfg = config_lib.optimizer_config(stage, n_steps)
      optimizer = objectives.make_optimizer(opt_cfg)
      d.learning_rate = objectives.make_schedule(opt_cfg)
      if run.model_config.lora_rank:
        optimizer = lora.freeze_base(optimizer, params)
      reference = rl.reference_policy(stage, params)
      mid_stage = restored is not None and progress.stage_step > 0
      state = learner.init_train_state(params, optimizer, reference,
                                       restored if mid_stage else None)
      snapshots = (list(zip(restored["actors"], restored["actor_versions"]))
                   if mid_stage else [])
      restored = None
      stage_key = jax.random.fold_in(root_key, 1 + progress.stage_index)
      save = lambda: d.save(state, snapshots, controls, root_key)  # noqa: E731
      stop = None

      if stage.kind == "sft":
        data = run.demonstrations(state.params, stage, stage_key)
        demos_per_row = np.ones(data["tokens_BxT"].shape[0])
        if stage.get("pack", False):
          data = codec_lib.pack_rows(data["tokens_BxT"], data["loss_mask_BxT"],
                                     run.codec.ids.pad)
          demos_per_row = data["segment_ids_BxT"].max(axis=1)
        if data["tokens_BxT"].shape[0] < stage.batch_size:
          raise ValueError(
              f"config.{name}.batch_size={stage.batch_size} is more than the "
              f"{data['tokens_BxT'].shape[0]} rows of demonstrations: of the "
              f"{stage.num_demos} played, those that fit in config.sampling.max_total_tokens "
              f"with every action within config.sampling.max_new_tokens_per_turn"
              f"{f', packed by config.{name}.pack' if stage.get('pack', False) else ''}; "
              f"lower it, or raise config.{name}.num_demos or those limits")
        step_fn, state_sharding = learner.shard_train_step(learner.make_train_step(
            learner.sft_loss(run.model_config, logprob_impl=cfg.model.logprob_impl),
            optimizer, micro_batches=cfg.micro_batches,
            trainable=learner.trainable(run.model_config)),
            run.mesh, run.model_config, optimizer, state.params)
        state = jax.device_put(state, state_sharding)
        while progress.stage_step < n_steps and not stop:
          t0 = time.perf_counter()
          rows = np.random.default_rng([cfg.seed, progress.global_step]).choice(
              data["tokens_BxT"].shape[0], stage.batch_size, replace=False)
          state, m, _ = step_fn(state, {k: jnp.asarray(v[rows]) for k, v in data.items()})
          record = {k: float(v) for k, v in sharding.to_host(m).items()}
          record["sft/demos"] = float(demos_per_row[rows].sum())
          if progress.stage_step == n_steps - 1:
            record.update(evaluate(run, state.params, stage_key))
            _summarise_success(d, name, record, "sft_success")
          stop = d.finish_step(name, (), record, t0, run.model_config.vocab_size, save)
      elif stage.kind == "distill":
        ds = distill.make_distill_stage(run, stage, optimizer, state.params)
        state = jax.device_put(state.replace(ref_params=ds.teachers if ds.on_policy else None),
                               ds.rl.state_sharding)
        prompts = rl.PromptSource(ds.rl.signal_cfg,
                                  run.tasks.difficulty_of(np.arange(cfg.tasks.train_size)),
                                  progress.data_pos, pool=run.prompt_pool(stage.families))
        # Checkpoints leave the teachers out: the stage loads them again.
        save = lambda: d.save(state.replace(ref_params=None), (), controls, root_key)  # noqa: E731
        while progress.stage_step < n_steps and not stop:
          t0 = time.perf_counter()
          state, record = distill.distill_iteration(
              run, ds, state, prompts, controls.history,
              jax.random.fold_in(stage_key, progress.stage_step), progress.stage_step)
          progress.data_pos = prompts.position
          _evaluate_at(run, d, name, state.params, stage_key, record)
          stop = d.finish_step(name, (), record, t0, run.model_config.vocab_size, save)
      else:
        stage_rl = rl.make_rl_stage(run, stage, optimizer, state.params,
                                    reset_each_iteration=opt_cfg.reset_each_iteration)
        state = jax.device_put(state, stage_rl.state_sharding)
        if progress.stage_step == 0:
          controls = dataclasses.replace(
              controls, entropy_coef=stage_rl.explore_cfg.entropy_coef,
              staleness=shift.init_staleness_bound(stage_rl.shift_cfg))
        prompts = rl.PromptSource(stage_rl.signal_cfg,
                                  run.tasks.difficulty_of(np.arange(cfg.tasks.train_size)),
                                  progress.data_pos, progress.data_skip,
                                  pool=run.prompt_pool(stage.get("families", ())))
        bands = stage_rl.signal_cfg.bands + stage_rl.shift_cfg.bands + stage_rl.explore_cfg.bands
        actor = actor_lib.make_actor(stage.actor, run, stage_rl, prompts, stage_key, state,
                                     progress.stage_step, controls, controls.staleness.bound,
                                     end_step=n_steps, snapshots=snapshots)
        save = lambda: d.save(state, actor.checkpoint(), controls, root_key)  # noqa: E731
        try:
          while progress.stage_step < n_steps and not stop and not _budget_spent(stage, progress):
            t0 = time.perf_counter()
            collected = actor.next(state, controls, progress.stage_step)
            state, controls, record = rl.rl_iteration(run, stage_rl, state, collected, controls)
            actor.bound = controls.staleness.bound
            actor.updated(state)
            record.update(actor.stats())
            progress.data_pos, progress.data_skip = collected.data_pos, list(collected.data_skip)
            progress.stage_rollouts += int(record["signal/rollouts"])
            record["signal/stage_rollouts"] = float(progress.stage_rollouts)
            _evaluate_at(run, d, name, state.params, stage_key, record)
            stop = d.finish_step(name, bands, record, t0, run.model_config.vocab_size, save)
        finally:
          if discarded := actor.close():
            d.summary[f"{name}_discarded_batches"] = (
                d.summary.get(f"{name}_discarded_batches", 0) + discarded)
      if progress.stage_step < n_steps and not _budget_spent(stage, progress):
        return d.close(stop)  # stopped inside the stage (saved)
      params = state.params
      if f"{name}_success" not in d.summary:  # resumed with fewer steps than were done
        _summarise_success(d, name, evaluate(run, params, stage_key), f"{name}_success")
      print(f"[{name}] held-out success: {d.summary[f'{name}_success']:.3f} greedy, "
            f"{d.summary[f'{name}_success_sampled']:.3f} sampled")
      progress.stage_index += 1
      progress.stage_step = progress.stage_rollouts = 0
      d.save(learner.TrainState(params, {}, jnp.zeros((), jnp.int32)), (), controls, root_key)
      if stop and progress.stage_index < len(d.stages):
        return d.close(stop)
    if export_lib.wants_deploy_check(cfg, run.model_config):
      with tempfile.TemporaryDirectory() as out:
        export_lib.export_policy(cfg, run.model_config, params, out)
        d.summary.update(export_lib.deploy_check(
            run, params, out, cfg.export.check_prompts))
      print(f"deployed model: per-token log-prob difference at most "
            f"{d.summary['shift/deploy_logprob_diff_max']:.2e}")
  return d.close()
