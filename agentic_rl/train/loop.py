"""The training run: stages (SFT warm start, then RL) over one policy.

``train(cfg, workdir)`` builds everything from a validated config
(:mod:`agentic_rl.train.config`, :mod:`agentic_rl.train.run`), resumes from
``workdir`` if it holds a checkpoint, runs the stages in order and writes
``summary.json``. This module is the run's shell: checkpoints, resume,
alarms, guards and signals; each stage kind has its driver
(:mod:`agentic_rl.train.stages`). An RL iteration is
:func:`agentic_rl.train.rl.rl_iteration`; every one reports the three
invariants (``explore/*``, ``signal/*``, ``shift/*``) next to rewards and
throughput.
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
from agentic_rl import objectives
from agentic_rl.invariants import shift, signal
from agentic_rl.model import lora
from agentic_rl.train import checkpoint as checkpoint_lib
from agentic_rl.train import config as config_lib
from agentic_rl.train import export as export_lib
from agentic_rl.train import interrupt, learner, resume, rl, sharding, stages
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


def _uniform_policy(record: dict[str, float], vocab_size: int) -> float:
  """1.0 when the step's gradient is exactly 0 and the policy's entropy (or
  the SFT loss) is ``ln V``: a policy collapsed to uniform, which no update
  can leave."""
  spread = record.get("explore/entropy", record.get("sft/nll", 0.0))
  return float(record["learner/grad_norm"] == 0 and spread >= 0.999 * np.log(vocab_size))


class Driver:
  """The run's bookkeeping between steps: progress, checkpoints, the metrics
  writer, alarms and guards, and how the run stops. ``optimizer_cfg`` is
  the current stage's (its learning rate is logged)."""

  def __init__(self, cfg, workdir: str, stop_after: int | None, interrupts, model_config):
    self.cfg, self.workdir, self.stop_after, self.interrupts = cfg, workdir, stop_after, interrupts
    self.model_config = model_config
    self.rng = jax.random.key(cfg.seed)  # the run's root key (checkpointed)
    self.t_start = time.perf_counter()
    self.ckpt = checkpoint_lib.Checkpointer(workdir, keep=cfg.checkpoint.keep)
    try:
      resume.begin(workdir, cfg, has_checkpoint=self.ckpt.latest_step() is not None)
    except ValueError as e:
      self.ckpt.close()
      raise config_lib.ConfigError(str(e)) from None
    self.stages = [cfg[name] for name in cfg.stages]
    self.progress, self.summary, self.restored = Progress(), {}, None
    self.optimizer_cfg = objectives.OptimizerConfig()
    if self.ckpt.latest_step() is not None:
      self.restored, meta = self.ckpt.restore(self.ckpt.latest_step())
      self.progress, self.summary = Progress(**meta["progress"]), dict(meta["summary"])
      print(f"resuming {workdir} at step {self.progress.global_step}")
    self.earlier = dict(self.summary)  # the summary as this invocation found it
    self.writer = metrics_lib.MetricsWriter(
        workdir, sum(stages.stage_steps(s) for s in self.stages),
        start_step=self.progress.global_step, progress_keys=PROGRESS_KEYS)
    self.last_alarms: set[str] = set()

  def save(self, state: learner.TrainState, actors, controls: rl.Controls) -> None:
    self.summary.update(metrics_lib.wall_times(self.earlier, time.perf_counter() - self.t_start))
    tree = {"params": checkpoint_lib.saved_params(state.params, self.model_config),
            "opt_state": state.opt_state, "step": state.step,
            "ref_params": checkpoint_lib.saved_params(state.ref_params, self.model_config),
            "actors": [a[0] for a in actors], "actor_versions": [a[1] for a in actors],
            "history": dataclasses.asdict(controls.history),
            "entropy_coef": np.float32(controls.entropy_coef),
            "staleness": np.array(dataclasses.astuple(controls.staleness), np.int64),
            "budget": controls.budget, "rng": self.rng}
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

  def finish_step(self, name, bands, record, t0, save) -> str | None:
    """Alarms, logging, guards and checkpoints (``save()``) after a step;
    returns why the run stops here (a signal's name or "stop_after"), else None."""
    p, cfg = self.progress, self.cfg
    p.skipped_total += int(record["learner/skipped"])
    p.skipped_consecutive = p.skipped_consecutive + 1 if record["learner/skipped"] > 0 else 0
    record.update({"learner/lr": float(objectives.make_schedule(self.optimizer_cfg)(p.stage_step)),
                   "learner/skipped_total": float(p.skipped_total),
                   "learner/skipped_consecutive": float(p.skipped_consecutive),
                   "learner/uniform_policy": _uniform_policy(record,
                                                             self.model_config.vocab_size)})
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
    if p.stage_step == stages.stage_steps(stage) or stages.budget_spent(stage, p):
      return stop  # the stage's end saves a checkpoint anyway
    if stop or p.stage_step % cfg.checkpoint.every == 0:
      save()
    return stop


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
  cfg = run.cfg  # the run's Settings
  with interrupt.Interrupts() as interrupts:
    d = Driver(cfg, workdir, stop_after, interrupts, run.model_config)
    progress, restored = d.progress, d.restored
    controls = rl.Controls(signal.init_history(cfg.tasks.train_size), 0.0,
                           budget=objectives.toggle.init_budgets(cfg.tasks.train_size))
    if restored is None:
      params = checkpoint_lib.initial_params(run, checkpoint_lib.params_key(cfg))
    else:
      params, d.rng = checkpoint_lib.restored_params(run, restored["params"]), restored["rng"]
      if run.model_config.lora_rank and restored.get("ref_params") is not None:
        # The reference's own copy of the base, as rl.reference_policy makes it
        # (the train state is donated, and one buffer cannot be donated twice).
        restored = dict(restored, ref_params=lora.with_adapters(
            jax.tree.map(jnp.copy, params), restored["ref_params"]))
      controls = rl.Controls(signal.PromptHistory(**restored["history"]),
                             float(restored["entropy_coef"]),
                             shift.StalenessBound(*map(int, restored["staleness"])),
                             np.asarray(restored["budget"], np.float32))
    if cfg.eval.at_start and restored is None:  # the parameters before any step
      stages.summarise_success(d, "init", evaluate(run, params, jax.random.fold_in(d.rng, 0)),
                               "init_success")
      print(f"[init] held-out success: {d.summary['init_success']:.3f} greedy, "
            f"{d.summary['init_success_sampled']:.3f} sampled")
    while progress.stage_index < len(d.stages):
      stage, name = d.stages[progress.stage_index], cfg.stages[progress.stage_index]
      n_steps = stages.stage_steps(stage)
      d.optimizer_cfg = config_lib.optimizer_config(stage, n_steps)
      optimizer = objectives.make_optimizer(d.optimizer_cfg)
      if run.model_config.lora_rank:
        optimizer = lora.freeze_base(optimizer, params)
      mid_stage = restored is not None and progress.stage_step > 0
      state = learner.init_train_state(params, optimizer, rl.reference_policy(stage, params),
                                       restored if mid_stage else None)
      snapshots = (list(zip(restored["actors"], restored["actor_versions"]))
                   if mid_stage else [])
      restored = None
      stage_key = jax.random.fold_in(d.rng, 1 + progress.stage_index)
      state, controls, stop = stages.DRIVERS[stage.kind](
          run, d, name, stage, state, optimizer, controls, stage_key, snapshots)
      if progress.stage_step < n_steps and not stages.budget_spent(stage, progress):
        return d.close(stop)  # stopped inside the stage (saved)
      params = state.params
      if f"{name}_success" not in d.summary:  # resumed with fewer steps than were done
        stages.summarise_success(d, name, evaluate(run, params, stage_key), f"{name}_success")
      print(f"[{name}] held-out success: {d.summary[f'{name}_success']:.3f} greedy, "
            f"{d.summary[f'{name}_success_sampled']:.3f} sampled")
      progress.stage_index += 1
      progress.stage_step = progress.stage_rollouts = 0
      d.save(learner.TrainState(params, {}, jnp.zeros((), jnp.int32)), (), controls)
      if stop and progress.stage_index < len(d.stages):
        return d.close(stop)
    if export_lib.wants_deploy_check(cfg, run.model_config):
      with tempfile.TemporaryDirectory() as out:
        export_lib.export_policy(cfg, run.model_config, params, out)
        d.summary.update(export_lib.deploy_check(
            run, params, out, cfg.export.check_prompts, config_lib.sampling_config(cfg)))
      print(f"deployed model: per-token log-prob difference at most "
            f"{d.summary['shift/deploy_logprob_diff_max']:.2e}")
  return d.close()
