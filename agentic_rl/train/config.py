"""From the experiment's ``ml_collections`` config to the library's dataclasses.

The experiment config (``experiments/configs/default.py``) is plain data;
:func:`validate` checks it whole, before anything is built or compiled, and
the ``*_config`` functions turn its sections into the validated dataclasses
that the model, sampler, objectives and invariant controllers take.
"""

from __future__ import annotations


from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl.envs import registry
from agentic_rl.invariants import exploration, shift, signal
from agentic_rl.invariants.alarms import Band
from agentic_rl.rollout.sampling import SamplingConfig
from agentic_rl.text import tokenizer as tok_lib
from agentic_rl.train import sharding
from agentic_rl.train import tasks as tasks_lib

STAGE_KINDS = ("sft", "rl")
OPTIMIZERS = ("adamw", "mirror_descent")
# Estimators that normalise over the whole batch rather than within a group.
GLOBAL_ESTIMATORS = ("reinforce_pp",)


def _err(msg: str):
  raise ValueError(msg)


def model_config(cfg, vocab_size: int) -> model_lib.TransformerConfig:
  m = dict(cfg.model)
  m.pop("logprob_impl")
  return model_lib.TransformerConfig(vocab_size=vocab_size, **m).validate()


def sampling_config(cfg, **overrides) -> SamplingConfig:
  s = cfg.sampling
  return SamplingConfig(max_turns=s.max_turns,
                        max_new_tokens_per_turn=s.max_new_tokens_per_turn,
                        max_total_tokens=s.max_total_tokens, **overrides).validate()


def objective_config(stage) -> objectives.ObjectiveConfig:
  correction = None if stage.correction == "none" else stage.correction
  return objectives.ObjectiveConfig(
      advantage=stage.advantage, advantage_kwargs=dict(stage.advantage_kwargs),
      loss=stage.loss, loss_kwargs=dict(stage.loss_kwargs), agg=stage.agg,
      correction=correction,
      correction_kwargs={correction: dict(stage.correction_kwargs)} if correction else {},
      entropy_coef=stage.entropy_coef, kl_coef=stage.kl_coef)


def optimizer_config(stage, total_steps: int) -> objectives.OptimizerConfig:
  return objectives.OptimizerConfig(
      learning_rate=stage.learning_rate,
      schedule="warmup_constant" if stage.warmup_steps else "constant",
      warmup_steps=stage.warmup_steps, weight_decay=stage.weight_decay,
      total_steps=total_steps,
      reset_each_iteration=stage.get("optimizer", "adamw") == "mirror_descent")


def signal_config(stage) -> signal.SignalConfig:
  return signal.SignalConfig(**dict(stage.get("signal", {})))


def exploration_config(stage) -> exploration.ExplorationConfig:
  """``stage.entropy_coef`` and ``stage.temperature`` are the starting values;
  ``stage.exploration`` holds the controllers (``entropy_band=(low, high)``
  turns the adaptive coefficient on, ``()`` keeps it fixed)."""
  extra = dict(stage.get("exploration", {}))
  band = tuple(extra.pop("entropy_band", ()) or ())
  if band and len(band) != 2:
    raise ValueError(f"exploration.entropy_band must be () or (low, high), got {band!r}")
  return exploration.ExplorationConfig(
      entropy_coef=stage.entropy_coef, temperature=stage.temperature,
      entropy_band=Band(*band) if band else None, **extra)


def shift_config(stage) -> shift.ShiftConfig:
  extra = dict(stage.get("shift", {}))
  return shift.ShiftConfig(max_staleness=stage.max_staleness, **extra)


def validate(cfg) -> None:
  """Raises ValueError naming the problem and the fix; builds nothing."""
  if not cfg.stages:
    _err("config.stages is empty: name at least one stage section (e.g. 'sft', 'rl')")
  for name in cfg.stages:
    if name not in cfg:
      _err(f"stage {name!r} in config.stages has no section config.{name}")
    kind = cfg[name].get("kind")
    if kind not in STAGE_KINDS:
      _err(f"config.{name}.kind is {kind!r}; expected one of {STAGE_KINDS}")
  unknown = set(cfg.tasks.families) - set(registry.ENVS)
  if unknown:
    _err(f"config.tasks.families has unknown task families {sorted(unknown)}; "
         f"valid: {sorted(registry.ENVS)}")
  levels = tasks_lib.difficulty_levels(cfg.tasks.difficulty)
  if not levels or not all(isinstance(d, int) and d >= 0 for d in levels):
    _err(f"config.tasks.difficulty must be a level >= 0 or a non-empty tuple of them, got "
         f"{cfg.tasks.difficulty!r}")
  if len(cfg.tasks.weights) != len(cfg.tasks.families):
    _err("config.tasks.weights needs one weight per family in config.tasks.families")
  tok = tok_lib.load_tokenizer()  # also checks the reserved pieces
  model_config(cfg, tok.vocab_size)
  sampling_config(cfg)
  if cfg.micro_batches < 1:
    _err(f"config.micro_batches must be >= 1, got {cfg.micro_batches}")
  mesh_cfg = sharding.MeshConfig(**cfg.mesh)
  mesh = sharding.make_mesh(mesh_cfg)
  for name in cfg.stages:
    stage = cfg[name]
    if stage.kind == "sft":
      rows = stage.batch_size
    else:
      if stage.get("optimizer", "adamw") not in OPTIMIZERS:
        _err(f"config.{name}.optimizer is {stage.optimizer!r}; expected one of {OPTIMIZERS}")
      try:
        objectives.validate_objective_config(objective_config(stage),
                                             group_size=stage.group_size)
      except objectives.UnknownHyperParameterError as e:
        # The default's kwargs belong to its estimator and loss; switching
        # either on the command line needs its kwargs switched too.
        _err(f"config.{name}: {e}. Set config.{name}.advantage_kwargs / loss_kwargs to "
             f"match (--config.{name}.advantage_kwargs={{}} clears them)")
      signal_config(stage).validate_group_size(stage.group_size)
      if (signal_config(stage).allocation == "knapsack" and
          stage.advantage in GLOBAL_ESTIMATORS):
        _err(f"config.{name}: allocation='knapsack' makes ragged groups, which the "
             f"batch-normalising estimator {stage.advantage!r} does not support; use a "
             "group estimator (grpo, dr_grpo, rloo, kimi)")
      shift_config(stage)
      for start, lo, hi in signal_config(stage).curriculum:
        if not any(lo <= d <= hi for d in levels):
          _err(f"config.{name}.signal.curriculum stage at step {start} admits difficulties "
               f"[{lo}, {hi}], but the task pool has only {levels} (config.tasks.difficulty)")
      expl = exploration_config(stage)
      if (expl.scheduled_temperature
          and model_config(cfg, tok.vocab_size).final_logit_softcap is not None):
        _err(f"config.{name}.exploration.temperature_schedule needs final_logit_softcap=None "
             "(the learner scores a scheduled temperature by scaling hidden states)")
      if stage.max_staleness < 0:
        _err(f"config.{name}.max_staleness must be >= 0, got {stage.max_staleness}")
      rows = stage.prompts_per_step * stage.group_size
    if rows % cfg.micro_batches:
      _err(f"config.{name}: a batch of {rows} rows does not split into "
           f"config.micro_batches={cfg.micro_batches}; make it a multiple")
    try:
      sharding.check_batch_divides(rows, mesh)
    except ValueError as e:
      raise ValueError(f"config.{name}: {e}") from None
