"""The run's settings checked whole, and turned into the library's dataclasses.

:func:`validate` parses the experiment's config into :class:`~agentic_rl.
train.settings.Settings` (each section checks its own fields) and checks
the rules across sections, before anything is built or compiled; the
``*_config`` functions turn the settings' sections into the dataclasses
that the model, sampler, objectives and invariant controllers take.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import dataclasses
import re

import jax

from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl.model import pretrained
from agentic_rl.envs import factories
from agentic_rl.envs import registry
from agentic_rl.envs import synthesis
from agentic_rl.envs import tasks as tasks_lib
from agentic_rl.envs.remote import ENV_POOLS
from agentic_rl.invariants import exploration, shift, signal
from agentic_rl.invariants.alarms import Band
from agentic_rl.kernels import backends
from agentic_rl.rollout.context import ContextConfig
from agentic_rl.rollout.host_loop import OBS_OVERFLOW
from agentic_rl.rollout.sampling import SamplingConfig
from agentic_rl.text import load_codec
from agentic_rl.text import tokenizer as tok_lib
from agentic_rl.train import checkpoint as checkpoint_lib
from agentic_rl.train import export as export_lib
from agentic_rl.train import parl, reward_hooks, sharding
from agentic_rl.train import settings as settings_lib
from agentic_rl.train.settings import ConfigError, Settings

DISTILL_MODES = ("on_policy", "teacher_sft")  # agentic_rl.train.distill
TASK_SOURCES = ("jax", "host")
HOST_REWARDS = ("env", "success")
ACTORS = ("sync", "async")  # agentic_rl.train.actor.make_actor
OPTIMIZERS = ("adamw", "mirror_descent")
# Mirror descent's KL-to-previous-policy term lives in the loss.
MIRROR_DESCENT_LOSSES = ("kimi",)
# Estimators that normalise over the whole batch rather than within a group.
GLOBAL_ESTIMATORS = ("reinforce_pp",)


def _err(msg: str):
  raise ConfigError(msg)


# config.model keys that say how the policy runs, not what it computes: the
# ones that apply to a checkpoint's model (config.model.init_from), whose
# architecture comes from its config.json.
RUNTIME_KEYS = ("dtype", "param_dtype", "attn_impl", "remat", "scan_unroll",
                "backward_recompute", "lora_rank", "lora_alpha", "lora_targets", "lora_dtype")


def model_config(cfg) -> model_lib.TransformerConfig:
  """The validated model config, ``attn_impl`` resolved for this platform
  (``"auto"`` becomes a backend; one that cannot run here is refused).

  With ``config.model.init_from`` (a Hugging Face checkpoint directory or a
  GGUF file) the architecture is the checkpoint's and only :data:`RUNTIME_KEYS` of
  ``config.model`` apply; otherwise it is ``config.model`` with the
  project tokenizer's vocabulary."""
  m = dataclasses.asdict(cfg.model)
  m.pop("logprob_impl")
  init_from = m.pop("init_from")
  try:
    if init_from:
      config = model_lib.hf.config_from_hf(
          pretrained.read_config(init_from),
          **{k: v for k, v in m.items() if k in RUNTIME_KEYS})
    else:
      config = model_lib.TransformerConfig(
          vocab_size=tok_lib.load_tokenizer().vocab_size, **m).validate()
    return config.resolved()
  except ValueError as e:
    if str(e).startswith("lora_"):
      raise ConfigError(f"config.model.{e} (--config.model.{str(e).split()[0]}=...)") from None
    raise ConfigError(f"config.model.{e}") from None


def check_logprob_impl(cfg) -> str:
  """``config.model.logprob_impl`` resolved for this platform; raises
  :class:`ConfigError` for a name or backend that cannot run here. (The
  learner resolves the same name again when it traces the scoring path.)"""
  try:
    return backends.resolve(backends.LOGPROBS, cfg.model.logprob_impl)
  except ValueError as e:
    raise ConfigError(f"config.model.{e}") from None


def toggle_config(stage) -> objectives.toggle.ToggleConfig:
  """An RL stage's Toggle settings (``config.<stage>.toggle``), validated."""
  return stage.toggle.validate()


def context_config(cfg) -> ContextConfig:
  """What an episode does when its context is full (``config.context``)."""
  return cfg.context.validate()


def sampling_config(cfg, **overrides) -> SamplingConfig:
  s = cfg.sampling
  return SamplingConfig(max_turns=s.max_turns,
                        max_new_tokens_per_turn=s.max_new_tokens_per_turn,
                        max_total_tokens=s.max_total_tokens, **overrides).validate()


# The stage keys whose values are hyper-parameters keyed by the name of the
# estimator, loss or correction they belong to, and the registry of names.
KEYED_KWARGS = {"advantage_kwargs": ("advantage", objectives.ADVANTAGE_ESTIMATORS),
                "loss_kwargs": ("loss", objectives.POLICY_LOSSES),
                "correction_kwargs": ("correction", objectives.CORRECTIONS)}


def _kwargs_of(stage, key: str, name: str) -> dict:
  """The hyper-parameters ``stage.<key>[name]`` (empty when absent)."""
  return dict(getattr(stage, key).get(name) or {})


def _where_to_set(name: str, stage, message: str) -> str:
  """Where the command line sets the hyper-parameters of the estimator, loss
  or correction whose error ``message`` (``"<its name>: ..."``) reports."""
  words = set(re.findall(r"\w+", message))
  flags = []  # (names a hyper-parameter of the message, its flags)
  for key, (field, _) in KEYED_KWARGS.items():
    chosen = getattr(stage, field)
    if chosen and chosen != "none" and message.startswith(f"{chosen}:"):
      named = [k for k in _kwargs_of(stage, key, chosen) if k in words]
      flags.append((bool(named), [f"--config.{name}.{key}.{chosen}.{k}"
                                  for k in named or ["<name>"]]))
  # An estimator and a loss may share a name (kimi): the one whose
  # hyper-parameter the message names.
  return f" ({', '.join(max(flags, key=lambda f: f[0])[1])})" if flags else ""


def objective_config(stage, horizon: int | None = None) -> objectives.ObjectiveConfig:
  """The stage's objective; each hyper-parameter table is keyed by name, so
  only the chosen estimator's, loss's and correction's own are used.
  ``horizon``: the constant of ``agg='seq_mean_token_sum_norm'`` (the run's
  ``sampling.max_total_tokens``: the learner's batches stop at their last
  scored token, so their width is no constant)."""
  correction = None if stage.correction == "none" else stage.correction
  return objectives.ObjectiveConfig(
      advantage=stage.advantage,
      advantage_kwargs=_kwargs_of(stage, "advantage_kwargs", stage.advantage),
      loss=stage.loss, loss_kwargs=_kwargs_of(stage, "loss_kwargs", stage.loss),
      agg=stage.agg, correction=correction,
      correction_kwargs=({correction: _kwargs_of(stage, "correction_kwargs", correction)}
                         if correction else {}),
      entropy_coef=stage.entropy_coef, kl_coef=stage.kl_coef,
      kl_estimator=stage.kl_estimator, horizon=horizon)


def optimizer_config(stage, total_steps: int) -> objectives.OptimizerConfig:
  return objectives.OptimizerConfig(
      learning_rate=stage.learning_rate,
      schedule=stage.schedule or ("warmup_constant" if stage.warmup_steps else "constant"),
      warmup_steps=stage.warmup_steps, weight_decay=stage.weight_decay,
      total_steps=total_steps,
      reset_each_iteration=stage.kind == "rl" and stage.optimizer == "mirror_descent")


def signal_config(stage) -> signal.SignalConfig:
  return stage.signal


def exploration_config(stage) -> exploration.ExplorationConfig:
  """``stage.entropy_coef`` and ``stage.temperature`` are the starting values;
  ``stage.exploration`` holds the controllers (``entropy_band=(low, high)``
  turns the adaptive coefficient on, ``()`` keeps it fixed)."""
  extra = dataclasses.asdict(stage.exploration)
  band = tuple(extra.pop("entropy_band"))
  if band and len(band) != 2:
    raise ValueError(f"exploration.entropy_band must be () or (low, high), got {band!r}")
  return exploration.ExplorationConfig(
      entropy_coef=stage.entropy_coef, temperature=stage.temperature,
      entropy_band=Band(*band) if band else None, **extra)


def shift_config(stage) -> shift.ShiftConfig:
  return dataclasses.replace(stage.shift, max_staleness=stage.max_staleness)


def _check_positive(where: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    _err(f"{where} must be an integer >= 1, got {value!r}")


def _validate_keyed_kwargs(name: str, stage) -> None:
  for key, (field, valid) in KEYED_KWARGS.items():
    table = getattr(stage, key)
    if stray := sorted(set(table) - set(valid)):
      _err(f"config.{name}.{key} is keyed by {field} name, and {stray} is not one; valid: "
           f"{', '.join(valid)} (e.g. --config.{name}.{key}.{getattr(stage, field)}.<name>=...)")


def _validate_rl_stage(name: str, stage, model_cfg, levels, host: bool) -> None:
  """The checks of one RL stage section; raises ValueError naming the fix."""
  for key in ("iterations", "updates_per_batch", "prompts_per_step", "group_size"):
    _check_positive(f"config.{name}.{key}", getattr(stage, key))
  budget = stage.rollout_budget
  if not isinstance(budget, int) or budget < 0:
    _err(f"config.{name}.rollout_budget={budget!r}: a number of episodes >= 0 (0: no budget)")
  try:
    toggle_config(stage)
  except ValueError as e:
    _err(f"config.{name}.{e}")
  optimizer = stage.optimizer
  if optimizer not in OPTIMIZERS:
    _err(f"config.{name}.optimizer is {optimizer!r}; expected one of {OPTIMIZERS}")
  if optimizer == "mirror_descent" and stage.loss not in MIRROR_DESCENT_LOSSES:
    _err(f"config.{name}.optimizer='mirror_descent' is Kimi k1.5's update: a policy gradient "
         "with the squared log-ratio to the iteration's start, (tau / 2) (log pi - log "
         f"pi_old)^2, which is the loss 'kimi'; set --config.{name}.loss=kimi (tau: "
         f"--config.{name}.loss_kwargs.kimi.tau), got loss={stage.loss!r}")
  _validate_keyed_kwargs(name, stage)
  if stage.reference_from:
    if model_cfg.lora_rank:
      _err(f"config.{name}.reference_from loads a full policy from another run, and a LoRA "
           "run (config.model.lora_rank > 0) keeps its reference as its own base with the "
           f"stage's starting adapters; clear config.{name}.reference_from or set "
           "config.model.lora_rank=0")
    if not stage.kl_coef:
      _err(f"config.{name}.reference_from names a reference policy, which only a KL "
           f"penalty uses; set config.{name}.kl_coef > 0 or clear reference_from")
    if not os.path.isdir(os.path.join(stage.reference_from, "checkpoints")):
      _err(f"config.{name}.reference_from={stage.reference_from!r} is not a run directory "
           "with checkpoints (WORKDIR/checkpoints)")
  if stage.kl_estimator not in objectives.KL_ESTIMATORS:
    _err(f"config.{name}.kl_estimator is {stage.kl_estimator!r}; valid: "
         f"{', '.join(objectives.KL_ESTIMATORS)}")
  objectives.validate_objective_config(objective_config(stage), group_size=stage.group_size)
  signal_cfg = signal_config(stage)
  signal_cfg.validate_group_size(stage.group_size)
  if signal_cfg.allocation == "knapsack" and stage.advantage in GLOBAL_ESTIMATORS:
    _err(f"config.{name}: allocation='knapsack' makes ragged groups, which the "
         f"batch-normalising estimator {stage.advantage!r} does not support; use a "
         "group estimator (grpo, dr_grpo, rloo, kimi)")
  if (signal_cfg.allocation == "ada" and signal_cfg.ada_global_stats
      and stage.advantage not in objectives.GLOBAL_STATS_ESTIMATORS):
    _err(f"config.{name}.signal.ada_global_stats: Reinforce-Ada's baseline over every "
         f"rollout generated for a prompt is defined for the estimators "
         f"{', '.join(objectives.GLOBAL_STATS_ESTIMATORS)}, not {stage.advantage!r}; set "
         f"--config.{name}.signal.ada_global_stats=False to use its down-sampling only")
  shift_cfg = shift_config(stage)
  actor = stage.actor
  if actor not in ACTORS:
    _err(f"config.{name}.actor is {actor!r}; valid: {', '.join(ACTORS)}")
  if actor == "sync" and shift_cfg.partial_rollout != "keep":
    _err(f"config.{name}.shift.partial_rollout={shift_cfg.partial_rollout!r} acts on partial "
         "rollouts, which only the asynchronous actor makes; set "
         f"--config.{name}.actor=async or keep partial_rollout='keep'")
  # The asynchronous actor on host environments with uniform allocation
  # batches continuously (agentic_rl.train.stream).
  streams = actor == "async" and host and signal_cfg.allocation == "uniform"
  if shift_cfg.fifo_window_ratio is not None and not streams:
    _err(f"config.{name}.shift.fifo_window_ratio={shift_cfg.fifo_window_ratio!r}: windowed-FIFO "
         "collection is how the asynchronous actor collects groups as they finish, which it "
         "does on host environments with uniform allocation (set --config.tasks.source=host, "
         f"--config.{name}.actor=async, --config.{name}.signal.allocation=uniform) or keep "
         "fifo_window_ratio=None")
  actor_rows = stage.actor_rows
  if isinstance(actor_rows, bool) or not isinstance(actor_rows, int) or actor_rows < 0:
    _err(f"config.{name}.actor_rows must be an integer >= 0 (0: one batch), got {actor_rows!r}")
  if actor_rows and not streams:
    _err(f"config.{name}.actor_rows={actor_rows} sets how many episodes the asynchronous actor "
         "keeps in flight on host environments with uniform allocation (set "
         f"--config.{name}.actor=async and --config.{name}.signal.allocation=uniform with "
         "--config.tasks.source=host) or keep actor_rows=0")
  if actor == "async" and jax.process_count() > 1:
    _err(f"config.{name}.actor='async' runs the actor in a thread of one process; with "
         f"{jax.process_count()} processes use --config.{name}.actor=sync")
  for start, lo, hi in signal_cfg.curriculum:
    if not any(lo <= d <= hi for d in levels):
      _err(f"config.{name}.signal.curriculum stage at step {start} admits difficulties "
           f"[{lo}, {hi}], but the task pool has only {levels} (config.tasks.difficulty)")
  if (exploration_config(stage).scheduled_temperature
      and model_cfg.final_logit_softcap is not None):
    _err(f"config.{name}.exploration.temperature_schedule needs final_logit_softcap=None "
         "(the learner scores a scheduled temperature by scaling hidden states)")
  if stage.max_staleness < 0:
    _err(f"config.{name}.max_staleness must be >= 0, got {stage.max_staleness}")
  share_prefix = stage.share_prefix
  if share_prefix and stage.group_size < 2:
    _err(f"config.{name}.share_prefix runs the prompt a group's rollouts share once per "
         f"group, and group_size=1 makes groups of one rollout; set "
         f"--config.{name}.group_size >= 2 or --config.{name}.share_prefix=False")
  if share_prefix and signal_cfg.allocation == "knapsack":
    _err(f"config.{name}.share_prefix needs groups of group_size rows, and "
         f"allocation='knapsack' makes groups of per-prompt sizes; use another "
         f"--config.{name}.signal.allocation or --config.{name}.share_prefix=False")


def strategy_weights(stage) -> dict[str, tuple[float, ...]]:
  """``stage.strategy_weights`` without its empty entries: family -> the share
  of each of its scripted strategies in the demonstrations."""
  table = stage.strategy_weights
  return {family: tuple(float(w) for w in ws) for family, ws in table.items() if ws}


def _validate_strategy_weights(name: str, stage, cfg) -> None:
  for family, ws in strategy_weights(stage).items():
    where = f"config.{name}.strategy_weights.{family}"
    if cfg.tasks.source == "host" or family not in cfg.tasks.families:
      _err(f"{where}: {family} is not one of this run's task families "
           f"({', '.join(cfg.tasks.families) if cfg.tasks.source != 'host' else 'host'}); "
           f"clear it")
    strategies = registry.ENVS[family].strategies
    if len(ws) != len(strategies) or min(ws) < 0 or not sum(ws):
      _err(f"{where}={ws}: one weight >= 0 per strategy {strategies}, not all 0")


def _validate_families(name: str, stage, cfg) -> None:
  """``stage.families``: a subset of the run's task families to draw the
  stage's prompts from (empty: all)."""
  families = () if stage.kind == "sft" else stage.families
  if not families:
    return
  if cfg.tasks.source == "host":
    _err(f"config.{name}.families picks task families of the built-in mixture, and a host "
         f"environment is one family; clear config.{name}.families")
  if stray := sorted(set(families) - set(cfg.tasks.families)):
    _err(f"config.{name}.families names {stray}, which config.tasks.families "
         f"{tuple(cfg.tasks.families)} does not hold; add them there or drop them here")
  signal_cfg = signal_config(stage) if stage.kind == "rl" else signal.SignalConfig()
  if signal_cfg.prompt_sampling == "prioritised" or signal_cfg.curriculum:
    _err(f"config.{name}.families restricts prompts in data order, and "
         f"config.{name}.signal picks them by priority or curriculum over the whole pool; "
         f"set --config.{name}.signal.prompt_sampling=uniform with no curriculum, or clear "
         "families")


def _validate_distill_stage(name: str, stage, cfg, model_cfg) -> None:
  """The checks of one distill stage section (agentic_rl.train.distill)."""
  for key in ("iterations", "prompts_per_step", "group_size"):
    _check_positive(f"config.{name}.{key}", getattr(stage, key))
  if stage.mode not in DISTILL_MODES:
    _err(f"config.{name}.mode is {stage.mode!r}; valid: {', '.join(DISTILL_MODES)}")
  if model_cfg.lora_rank:
    _err(f"config.{name}: a distill stage's teachers are full policies, and a LoRA run's "
         "checkpoints hold its adapters only; set config.model.lora_rank=0")
  families = ("host",) if cfg.tasks.source == "host" else tuple(cfg.tasks.families)
  teachers = {k: v for k, v in dict(stage.teachers).items() if v}
  if stray := sorted(set(teachers) - set(families) - {"all"}):
    _err(f"config.{name}.teachers sets {stray}, not task families of this run "
         f"({', '.join(families)}) nor 'all': no prompt would use them; clear them")
  missing = [f for f in families if not teachers.get(f) and not teachers.get("all")]
  if missing:
    _err(f"config.{name}.teachers has no teacher for the families {missing}: set "
         f"--config.{name}.teachers.<family>=WORKDIR (a run directory of this model) or "
         f"--config.{name}.teachers.all=WORKDIR")
  for family, path in teachers.items():
    if not os.path.isdir(os.path.join(path, "checkpoints")):
      _err(f"config.{name}.teachers.{family}={path!r} is not a run directory with "
           "checkpoints (WORKDIR/checkpoints)")
  if stage.temperature <= 0:
    _err(f"config.{name}.temperature must be > 0, got {stage.temperature}")


def _validate_reward_hooks(cfg) -> None:
  """``config.reward_hooks`` (agentic_rl.train.reward_hooks)."""
  h = cfg.reward_hooks
  if h is None:
    return
  if h.function.weight:
    try:
      reward_hooks.load_function(h.function.fn)
    except ValueError as e:
      _err(f"config.{e} (or set config.reward_hooks.function.weight=0)")
  j = h.judge
  if not j.weight:
    return
  if not checkpoint_lib.is_run_dir(j.checkpoint):
    _check_checkpoint(f"config.reward_hooks.judge.checkpoint={j.checkpoint!r}", j.checkpoint,
                      "a run directory of this project (WORKDIR with checkpoints/ and "
                      "config.json), ")
  _check_positive("config.reward_hooks.judge.samples", j.samples)
  if j.aggregate not in reward_hooks.AGGREGATES:
    _err(f"config.reward_hooks.judge.aggregate is {j.aggregate!r}; valid: "
         f"{', '.join(reward_hooks.AGGREGATES)}")
  if not j.rubric:
    _err("config.reward_hooks.judge.rubric is empty: write the question the judge answers "
         "yes or no")


def _takes_noise(demonstration) -> bool:
  try:
    return "noise" in inspect.signature(demonstration).parameters
  except (TypeError, ValueError):  # no signature to read (a builtin)
    return False


def _validate_host_tasks(cfg) -> None:
  """``config.tasks`` with ``source="host"``: the environment loads, builds
  and speaks the protocol; the stages ask nothing it cannot give."""
  t = cfg.tasks
  where = f"config.tasks.host_env={t.host_env!r}"
  try:
    factory = factories.load_factory(t.host_env)
    kwargs = factories.host_kwargs(t.host_kwargs)
  except ValueError as e:
    _err(f"config.tasks: {e}")
  try:
    env = factory(**kwargs)
  except Exception as e:  # pylint: disable=broad-except
    _err(f"{where}: building it with host_kwargs={kwargs} failed: {type(e).__name__}: {e}")
  missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
  if missing:
    _err(f"{where} makes {type(env).__name__}, which lacks {missing}: a host environment "
         "has reset(seed) -> str and step(action) -> (observation, reward, done)")
  tools = getattr(env, "tools", None)
  if tools is not None:
    if not callable(getattr(env, "call_tool", None)):
      _err(f"{where}: {type(env).__name__} offers tools but has no call_tool(name, arguments) "
           "-> (observation, reward, done) to run them")
    if not isinstance(tools, (list, tuple)) or not all(
        isinstance(x, dict) and isinstance(x.get("name"), str) for x in tools):
      _err(f"{where}: {type(env).__name__}.tools must be a list of JSON schemas, each a dict "
           'with a "name" (and "description", "parameters")')
  sft = [name for name in cfg.stages if cfg[name].kind == "sft"]
  if (sft and context_config(cfg).policy == "summary"
      and not callable(getattr(env, "summary", None))):
    _err(f"{where}: with context.policy='summary' the SFT stage {sft[0]!r} needs the "
         f"summaries of its demonstrations, and {type(env).__name__} has no "
         "summary(observations) -> str; give it one or train with RL only (--config.stages=rl)")
  if sft and not callable(getattr(env, "demonstration", None)):
    _err(f"{where}: the SFT stage {sft[0]!r} needs demonstrations, and "
         f"{type(env).__name__} has no demonstration(seed) -> list of actions; train with RL "
         f"only (--config.stages=rl) or give the environment one")
  noisy = [name for name in sft if cfg[name].demo_noise]
  if noisy and not _takes_noise(env.demonstration):
    _err(f"config.{noisy[0]}.demo_noise={cfg[noisy[0]].demo_noise}: {type(env).__name__}."
         "demonstration(seed) takes no noise argument to make mistakes with; set "
         f"--config.{noisy[0]}.demo_noise=0 or give it demonstration(seed, noise)")
  for key in ("env_workers", "max_obs_tokens"):
    _check_positive(f"config.tasks.{key}", getattr(t, key))
  if t.env_pool not in ENV_POOLS:
    _err(f"config.tasks.env_pool is {t.env_pool!r}; valid: {', '.join(ENV_POOLS)}")
  if t.env_pool == "ray" and importlib.util.find_spec("ray") is None:
    _err("config.tasks.env_pool='ray' needs Ray: pip install -e \".[ray]\" (or use "
         "env_pool=processes for environments on this machine)")
  if t.env_timeout_s is not None and t.env_timeout_s < 0:
    _err(f"config.tasks.env_timeout_s must be > 0 (0 or None: no limit), got {t.env_timeout_s}")
  if t.obs_overflow not in OBS_OVERFLOW:
    _err(f"config.tasks.obs_overflow is {t.obs_overflow!r}; valid: {', '.join(OBS_OVERFLOW)}")
  for name in cfg.stages:
    if cfg[name].kind == "rl" and exploration_config(cfg[name]).scheduled_temperature:
      _err(f"config.{name}.exploration.temperature_schedule: host environments sample at "
           f"one temperature (config.{name}.temperature); keep the schedule 'constant'")


def _validate_context(cfg) -> None:
  """``config.context``: its values, and a task source and objectives that
  can use it."""
  try:
    ctx = context_config(cfg)
  except (TypeError, ValueError) as e:
    _err(f"config.context: {e}")
  if not ctx.enabled:
    return
  if cfg.tasks.source != "host":
    _err(f"config.context.policy={ctx.policy!r}: contexts are rewritten between the host "
         "loop's jitted segments; set --config.tasks.source=host (the built-in long-horizon "
         "family is --config.tasks.host_env=ledger, or --config=experiments/configs/"
         "default.py:ledger), or keep context.policy='none'")
  for name in cfg.stages:
    stage = cfg[name]
    if stage.kind == "rl" and "turn_rewards" in objectives.required_inputs(
        objective_config(stage)):
      _err(f"config.{name}.advantage={stage.advantage!r} gives per-token advantages by turn, "
           "which a rewritten context splits over segments; with context management use an "
           "estimator of whole episodes (grpo, rloo, ...) or keep context.policy='none'")


def _check_checkpoint(where: str, path: str, also: str = "") -> None:
  """``path`` is a local checkpoint (a Hugging Face directory or a GGUF
  file) whose tokenizer loads; ``also`` names what else ``where`` takes."""
  if pretrained.is_gguf(path) and not os.path.isfile(path):
    _err(f"{where}: no such GGUF file (python -m experiments.get_model fetches one)")
  if not pretrained.is_gguf(path) and not os.path.isdir(path):
    _err(f"{where} is not a directory: give {also}a local Hugging Face checkpoint "
         "(config.json, *.safetensors, tokenizer files) or a .gguf file; nothing is "
         "downloaded")
  try:
    load_codec(path)
  except (ValueError, OSError) as e:
    _err(f"{where}: its tokenizer cannot be loaded: {e}")


def _validate_init_from(cfg, path: str) -> None:
  """``config.model.init_from``: a local checkpoint with its own tokenizer,
  which only host environments can use."""
  where = f"config.model.init_from={path!r}"
  if cfg.tasks.source != "host":
    _err(f"{where}: a checkpoint's own tokenizer lacks the reserved single-id tokens the "
         "built-in jitted task families read, so a pretrained policy trains on host "
         "environments: set --config.tasks.source=host and --config.tasks.host_env")
  _check_checkpoint(where, path)


def validate(cfg) -> Settings:
  """The :class:`Settings` of ``cfg`` (a ConfigDict, a mapping or settings),
  checked whole; raises :class:`ConfigError` naming the problem and the
  fix. Builds nothing."""
  try:
    cfg = settings_lib.parse(cfg)
    _validate(cfg)
  except ConfigError:
    raise
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return cfg


def _validate(cfg: Settings) -> None:
  for where in ("checkpoint.every", "checkpoint.keep", "eval.every", "eval.num_prompts",
                "eval.batch_rows", "guards.max_consecutive_skips"):
    section, key = where.split(".")
    _check_positive(f"config.{where}", getattr(getattr(cfg, section), key))
  for key in ("num_prompts", "pass_k_prompts"):
    if getattr(cfg.eval, key) > cfg.tasks.test_size:
      _err(f"config.eval.{key}={getattr(cfg.eval, key)} exceeds the held-out pool "
           f"config.tasks.test_size={cfg.tasks.test_size}; evaluation reads the first "
           "prompts of that pool")
  source = cfg.tasks.source
  if source not in TASK_SOURCES:
    _err(f"config.tasks.source is {source!r}; valid: {', '.join(TASK_SOURCES)}")
  if source == "host":
    _validate_host_tasks(cfg)
  host_reward = cfg.tasks.host_reward
  if host_reward not in HOST_REWARDS:
    _err(f"config.tasks.host_reward is {host_reward!r}; valid: {', '.join(HOST_REWARDS)}")
  if host_reward != "env" and source != "host":
    _err(f"config.tasks.host_reward={host_reward!r} replaces a host environment's own reward; "
         "the built-in families pay tasks.rewards (set --config.tasks.rewards.format=0 and "
         "--config.tasks.rewards.efficiency=0 for the outcome alone) or set "
         "--config.tasks.source=host")
  _validate_reward_hooks(cfg)
  parl.validate(cfg, _err)
  unknown = set(cfg.tasks.families) - set(registry.ENVS)
  if unknown:
    _err(f"config.tasks.families has unknown task families {sorted(unknown)}; "
         f"valid: {sorted(registry.ENVS)}")
  levels = tasks_lib.difficulty_levels(cfg.tasks.difficulty)
  if not levels or not all(isinstance(d, int) and d >= 0 for d in levels):
    _err(f"config.tasks.difficulty must be a level >= 0 or a non-empty tuple of them, got "
         f"{cfg.tasks.difficulty!r}")
  if programs := cfg.tasks.programs:
    if "composed" not in cfg.tasks.families:
      _err(f"config.tasks.programs={programs!r} gives the programs of the 'composed' family, "
           "which is not in config.tasks.families: add it or set programs=''")
    try:
      synthesis.load_programs(programs)
    except ValueError as e:
      _err(f"config.tasks.programs: {e}; write one with experiments.synthesize")
  if len(cfg.tasks.weights) != len(cfg.tasks.families):
    _err("config.tasks.weights needs one weight per family in config.tasks.families")
  if init_from := cfg.model.init_from:
    _validate_init_from(cfg, init_from)
  _validate_context(cfg)
  model_cfg = model_config(cfg)
  check_logprob_impl(cfg)
  sampling_config(cfg)
  if cfg.sampling.share_prefill and source == "host":
    _err("config.sampling.share_prefill shares a group's prefill in the jitted rollout engine; "
         "host environments run the host loop, which prefills each row: set it False")
  if cfg.sampling.decode_shared_prefix:
    if source == "host":
      _err("config.sampling.decode_shared_prefix shares a group's prompt cache in the jitted "
           "rollout engine; host environments run the host loop, which does not: set it False")
    if not cfg.sampling.share_prefill:
      _err("config.sampling.decode_shared_prefix decodes a group's rollouts from its shared "
           "prefill, and config.sampling.share_prefill=False prefills each row alone: set "
           "share_prefill True")
    if not any(cfg[n].kind == "rl" and cfg[n].group_size > 1 for n in cfg.stages):
      _err("config.sampling.decode_shared_prefix decodes a group's rollouts from one shared "
           "prompt cache, and no RL stage has group_size >= 2: raise group_size or set it False")
  export_lib.wants_deploy_check(cfg, model_cfg)
  if not 0 < cfg.export.check_prompts <= cfg.tasks.test_size:
    _err(f"config.export.check_prompts must be in [1, config.tasks.test_size="
         f"{cfg.tasks.test_size}], got {cfg.export.check_prompts}")
  if cfg.micro_batches < 1:
    _err(f"config.micro_batches must be >= 1, got {cfg.micro_batches}")
  mesh = sharding.make_mesh(cfg.mesh)
  for name in cfg.stages:
    stage = cfg[name]
    _validate_families(name, stage, cfg)
    length = "steps" if stage.kind == "sft" else "iterations"
    try:
      objectives.validate_optimizer_config(optimizer_config(stage, getattr(stage, length)))
    except ValueError as e:
      # The schedule's total_steps is the stage's length.
      _err(f"config.{name}: {str(e).replace('total_steps', f'config.{name}.{length}')}")
    if stage.kind == "sft":
      _check_positive(f"config.{name}.steps", stage.steps)
      if not 0.0 <= stage.demo_noise <= 1.0:
        _err(f"config.{name}.demo_noise={stage.demo_noise} is a probability: set it in [0, 1]")
      _validate_strategy_weights(name, stage, cfg)
      if stage.num_demos < stage.batch_size:
        _err(f"config.{name}.num_demos={stage.num_demos} demonstrations cannot fill a batch of "
             f"config.{name}.batch_size={stage.batch_size} rows; raise num_demos or lower "
             f"batch_size")
      rows = stage.batch_size
    elif stage.kind == "distill":
      _validate_distill_stage(name, stage, cfg, model_cfg)
      rows = stage.prompts_per_step * stage.group_size
    else:
      try:
        _validate_rl_stage(name, stage, model_cfg, levels, cfg.tasks.source == "host")
      except objectives.UnknownHyperParameterError as e:
        _err(f"config.{name}: {e}. Set it under config.{name}.advantage_kwargs.<estimator>, "
             f"loss_kwargs.<loss> or correction_kwargs.<correction>")
      except ValueError as e:
        if str(e).startswith("config."):
          raise
        _err(f"config.{name}: {e}{_where_to_set(name, stage, str(e))}")
      rows = stage.prompts_per_step * stage.group_size
    if rows % cfg.micro_batches:
      _err(f"config.{name}: a batch of {rows} rows does not split into "
           f"config.micro_batches={cfg.micro_batches}; make it a multiple")
    if stage.kind == "rl" and stage.share_prefix and stage.prompts_per_step % cfg.micro_batches:
      _err(f"config.{name}.share_prefix needs whole groups in every micro-batch, and "
           f"config.micro_batches={cfg.micro_batches} splits the {stage.prompts_per_step} "
           f"groups (prompts_per_step) unevenly; make prompts_per_step a multiple of "
           f"micro_batches or set --config.{name}.share_prefix=False")
    try:
      sharding.check_batch_divides(rows, mesh)
    except ValueError as e:
      raise ValueError(f"config.{name}: {e}") from None
