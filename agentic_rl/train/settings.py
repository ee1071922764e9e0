"""The run's settings: the experiment's config as frozen, typed dataclasses.

An experiment is an ``ml_collections`` config (``experiments/configs``);
:func:`parse` turns it into :class:`Settings` once, in ``run.build``, and
nothing below reads the ConfigDict. Every field's default lives here, or in
the library dataclass a section is (the reward weights, the mesh, context
management, the signal and shift controllers, Toggle); :func:`config_dict`
generates a ConfigDict with these defaults, which is how the experiment
configs are written. Each dataclass checks its own fields when it is
built; the rules across sections are :func:`agentic_rl.train.config.
validate`'s.

A section missing from the ConfigDict takes its defaults; the optional
mechanisms (``parl``, ``reward_hooks``) are None unless their section is
there. A key a section does not have is refused, naming the valid ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections
from ml_collections.config_dict import placeholder

from agentic_rl import objectives
from agentic_rl.envs import registry
from agentic_rl.envs.rewards import RewardConfig
from agentic_rl.invariants import shift, signal
from agentic_rl.objectives.toggle import ToggleConfig
from agentic_rl.rollout.context import ContextConfig
from agentic_rl.train.sharding import MeshConfig


class ConfigError(ValueError):
  """A config the trainer refuses, before anything is built; the message
  names the key and the fix."""


# The hyper-parameter tables of an RL stage, by the objectives' registry kind.
KWARGS_TABLES = {"advantage_kwargs": "advantage", "loss_kwargs": "loss",
                 "correction_kwargs": "correction"}


def _full_table(kind: str, table: Mapping[str, Mapping[str, Any]]) -> dict:
  """Every estimator's (loss's, correction's) hyper-parameters: their
  defaults, with ``table``'s values (a name that is none of them is kept, for
  the config's check to name)."""
  full = objectives.hyperparameter_defaults()[kind]
  for name, values in table.items():
    full[name] = {**full.get(name, {}), **dict(values or {})}
  return full


def _table(**defaults):
  """A dict field whose default is ``defaults`` (a fresh copy per instance)."""
  return dataclasses.field(default_factory=lambda: dict(defaults))


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """``config.model``: the policy's architecture (ignored but for the
  runtime keys with ``init_from``: a Hugging Face directory or GGUF file
  whose own architecture, weights and tokenizer the run starts from),
  precision, kernel backends (``agentic_rl.kernels.backends``: "auto" is
  the platform's choice) and LoRA (rank > 0 trains adapters on
  ``lora_targets`` only)."""

  d_model: int = 128
  n_layers: int = 3
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  mlp_dim: int = 384
  rope_theta: float = 10_000.0
  tie_embeddings: bool = True
  dtype: str = "float32"
  param_dtype: str = "float32"
  attn_impl: str = "auto"
  logprob_impl: str = "auto"
  remat: bool = False
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
  lora_dtype: str = "float32"
  init_from: str = ""


@dataclasses.dataclass(frozen=True)
class TasksSettings:
  """``config.tasks``: where the prompts come from. ``source="jax"``: the
  built-in ``families`` (mixed by ``weights``, at ``difficulty`` levels),
  stepped inside the jitted rollout; ``"host"``: the Python environment
  ``host_env`` (``"MODULE:FACTORY"``, ``"gem:<id>"``,
  ``"reasoning_gym:<dataset>"`` or a built-in name) built with
  ``host_kwargs`` (a mapping, or a JSON object), in
  ``env_pool`` ("threads", "processes" or "ray"). ``host_reward="success"``
  pays ``rewards.outcome`` when the environment's summed reward is above
  ``success_threshold``, else 0; ``"env"`` pays its own (plus the
  efficiency term)."""

  source: str = "jax"
  host_env: str = ""
  host_kwargs: Any = ""
  env_pool: str = "threads"
  env_workers: int = 8
  env_timeout_s: float | None = 60.0
  max_obs_tokens: int = 64
  obs_overflow: str = "end"
  success_threshold: float = 0.5
  host_reward: str = "env"
  families: tuple[str, ...] = ("calc_chain", "multihop", "boxes")
  programs: str = ""
  weights: tuple[float, ...] = (0.34, 0.33, 0.33)
  difficulty: Any = (1,)
  rewards: RewardConfig = RewardConfig()
  train_size: int = 20_000
  test_size: int = 256


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
  """``config.sampling``: the limits of an episode, and how the jitted
  engine shares a group's prompt: ``share_prefill`` prefills it once per
  group, ``decode_shared_prefix`` also decodes the group from one copy of
  its cache (``agentic_rl.model.prefix``)."""

  max_turns: int = 6
  max_new_tokens_per_turn: int = 24
  max_total_tokens: int = 160
  share_prefill: bool = False
  decode_shared_prefix: bool = False


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """``config.eval``: held-out evaluation every ``every`` iterations and at
  each stage's end (and, with ``at_start``, of the initial parameters
  before the first stage: the summary's ``init_success``, e.g. a pretrained
  model's zero-shot success): greedy success on ``num_prompts`` test
  prompts, and ``pass_k`` samples at temperature 1 on each of
  ``pass_k_prompts``."""

  every: int = 15
  at_start: bool = False
  num_prompts: int = 128
  pass_k: int = 4
  pass_k_prompts: int = 128
  batch_rows: int = 128


@dataclasses.dataclass(frozen=True)
class ExportSettings:
  """``config.export``: after the last step, export the policy and score
  ``check_prompts`` held-out episodes with it in transformers: "auto"
  where torch and transformers are installed, "on" or "off"."""

  deploy_check: str = "auto"
  check_prompts: int = 8


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
  every: int = 20
  keep: int = 2


@dataclasses.dataclass(frozen=True)
class GuardsSettings:
  """The run stops (with a checkpoint and a message) after
  ``max_consecutive_skips`` steps in a row whose loss or gradient was not
  finite."""

  max_consecutive_skips: int = 20


@dataclasses.dataclass(frozen=True)
class ParlSettings:
  """``config.parl`` (``agentic_rl.train.parl``): frozen sub-agents a host
  environment's steps may spawn; ``agents`` is ``{name: run directory}``
  (a JSON object on the command line)."""

  agents: Any = ""
  rows: int = 16
  max_width: int = 4
  max_critical_steps: int = 0
  charge: str = "critical"
  parallel_bonus: float = 0.0
  finish_bonus: float = 0.0
  anneal_iterations: int = 0


@dataclasses.dataclass(frozen=True)
class JudgeSettings:
  """The judge: ``checkpoint`` is a run directory of this project, a
  Hugging Face model directory or a ``.gguf`` file; it reads each episode
  through its own tokenizer and chat template."""

  weight: float = 0.0
  checkpoint: str = ""
  samples: int = 1
  aggregate: str = "mean"
  rubric: str = "\nDid the assistant answer the question correctly? Answer yes or no: "


@dataclasses.dataclass(frozen=True)
class FunctionSettings:
  weight: float = 0.0
  fn: str = ""


@dataclasses.dataclass(frozen=True)
class RewardHooksSettings:
  """``config.reward_hooks`` (``agentic_rl.train.reward_hooks``): reward
  terms beyond the environment's rules, each weighted (0: off)."""

  judge: JudgeSettings = JudgeSettings()
  function: FunctionSettings = FunctionSettings()


@dataclasses.dataclass(frozen=True)
class ExplorationSettings:
  """An RL stage's exploration controllers (``ExplorationConfig``):
  ``entropy_band=(low, high)`` adapts the entropy bonus; the temperature
  schedule decays the sampling temperature to ``temperature_final``."""

  entropy_band: tuple[float, ...] = ()
  entropy_coef_factor: float = 1.1
  entropy_coef_min: float = 1e-5
  entropy_coef_max: float = 0.1
  temperature_schedule: str = "constant"
  temperature_final: float = 1.0
  temperature_steps: int = 0


@dataclasses.dataclass(frozen=True)
class SFTStage:
  """A supervised stage on the scripted policies' (or a host environment's)
  demonstrations, ``demo_noise`` of them with mistakes; ``pack`` packs
  several into each row; ``strategy_weights`` (family -> one weight per
  scripted strategy) shares them among a family's strategies."""

  kind: str = "sft"
  steps: int = 250
  batch_size: int = 32
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  schedule: str = ""
  weight_decay: float = 0.0
  demo_noise: float = 0.35
  num_demos: int = 8192
  pack: bool = True
  strategy_weights: dict = dataclasses.field(  # () for equal shares
      default_factory=lambda: {name: () for name in registry.ENVS})


@dataclasses.dataclass(frozen=True)
class RLStage:
  """An RL stage: ``iterations`` of ``prompts_per_step`` groups of
  ``group_size`` rollouts (or until ``rollout_budget`` episodes, when > 0),
  the objective (an advantage estimator, a loss, a behaviour/learner
  correction, each with its hyper-parameters keyed by name), the actor
  (``sync`` or ``async``, at most ``max_staleness`` updates behind) and the
  invariant controllers."""

  kind: str = "rl"
  iterations: int = 30
  rollout_budget: int = 0
  prompts_per_step: int = 16
  group_size: int = 8
  advantage: str = "grpo"
  advantage_kwargs: dict = _table(grpo={"ddof": 0})
  loss: str = "ppo"
  loss_kwargs: dict = _table(ppo={"eps_high": 0.28})  # DAPO's clip-higher
  agg: str = "token_mean"
  correction: str = "none"
  correction_kwargs: dict = dataclasses.field(default_factory=dict)
  entropy_coef: float = 0.0
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  reference_from: str = ""
  learning_rate: float = 1e-3
  warmup_steps: int = 0
  schedule: str = ""
  weight_decay: float = 0.0
  updates_per_batch: int = 1
  share_prefix: bool = False
  optimizer: str = "adamw"
  actor: str = "sync"
  actor_rows: int = 0
  toggle: ToggleConfig = ToggleConfig()
  max_staleness: int = 0
  # Dynamic sampling: with uniform allocation most groups of the built-in
  # tasks have all-equal outcomes and carry no gradient; it redraws at most
  # one batch's worth of episodes per iteration.
  signal: signal.SignalConfig = signal.SignalConfig(allocation="dynamic",
                                                    max_extra_rollout_frac=1.0)
  shift: shift.ShiftConfig = shift.ShiftConfig()
  exploration: ExplorationSettings = ExplorationSettings()
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  families: tuple[str, ...] = ()

  def __post_init__(self):
    for key, kind in KWARGS_TABLES.items():  # each table whole
      object.__setattr__(self, key, _full_table(kind, getattr(self, key)))


@dataclasses.dataclass(frozen=True)
class DistillStage:
  """One student from a teacher per task family (``teachers``: family or
  "all" -> a run directory of this model): ``on_policy`` (the student
  samples; per-token reverse KL) or ``teacher_sft`` (the teachers
  sample)."""

  kind: str = "distill"
  mode: str = "on_policy"
  teachers: dict = dataclasses.field(  # "" for none
      default_factory=lambda: {name: "" for name in (*registry.ENVS, "host", "all")})
  iterations: int = 40
  prompts_per_step: int = 16
  group_size: int = 1
  learning_rate: float = 1e-3
  warmup_steps: int = 0
  schedule: str = ""
  weight_decay: float = 0.0
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  families: tuple[str, ...] = ()


STAGES = {"sft": SFTStage, "rl": RLStage, "distill": DistillStage}


@dataclasses.dataclass(frozen=True)
class Settings:
  """The whole run. ``stages`` names the stage sections in order;
  ``settings[name]`` is one (an :class:`SFTStage`, :class:`RLStage` or
  :class:`DistillStage`)."""

  seed: int = 0
  model: ModelSettings = ModelSettings()
  tasks: TasksSettings = TasksSettings()
  sampling: SamplingSettings = SamplingSettings()
  context: ContextConfig = ContextConfig()
  eval: EvalSettings = EvalSettings()
  export: ExportSettings = ExportSettings()
  mesh: MeshConfig = MeshConfig()
  micro_batches: int = 1
  checkpoint: CheckpointSettings = CheckpointSettings()
  guards: GuardsSettings = GuardsSettings()
  parl: ParlSettings | None = None
  reward_hooks: RewardHooksSettings | None = None
  stages: tuple[str, ...] = ("sft", "rl")
  sections: tuple[tuple[str, Any], ...] = (("sft", SFTStage()), ("rl", RLStage()))

  def __getitem__(self, name: str):
    for key, section in self.sections:
      if key == name:
        return section
    raise KeyError(name)

  def __contains__(self, name: str) -> bool:
    return any(key == name for key, _ in self.sections)

  def to_dict(self) -> dict[str, Any]:
    """The settings as plain data, laid out as the ConfigDict is (each
    stage section at the top level under its name)."""
    out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
           if f.name != "sections" and getattr(self, f.name) is not None}
    out.update({name: _plain(section) for name, section in self.sections})
    return out


_SECTIONS = {f.name for f in dataclasses.fields(Settings)} - {"sections"}
# The optional mechanisms' sections (None in Settings unless the config has them).
_OPTIONAL = {"parl": ParlSettings, "reward_hooks": RewardHooksSettings}


# Fields of the library's dataclasses that the config does not hold: alarm
# bands are set in code, and the shift section's staleness bound is its
# stage's max_staleness.
_NOT_IN_CONFIG = {signal.SignalConfig: ("bands",), shift.ShiftConfig: ("bands", "max_staleness")}


def _fields(value) -> list[str]:
  """The fields of the dataclass ``value`` that the config holds."""
  hidden = _NOT_IN_CONFIG.get(type(value), ())
  return [f.name for f in dataclasses.fields(value) if f.name not in hidden]


def _plain(value):
  """Dataclasses (the fields the config holds), ConfigDicts and mappings as
  dicts, lists as tuples."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {name: _plain(getattr(value, name)) for name in _fields(value)}
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return tuple(_plain(v) for v in value)
  return value


def _fill(default, raw, where: str):
  """``default`` (a dataclass instance) with the fields ``raw`` sets."""
  raw = _plain(raw) if raw is not None else {}
  if not isinstance(raw, Mapping):
    raise ConfigError(f"config.{where} is a section of keys, got {raw!r}")
  fields = {f.name for f in dataclasses.fields(default)}
  if unknown := sorted(set(raw) - fields):
    raise ConfigError(f"config.{where} has no key {', '.join(unknown)}; its keys: "
                      f"{', '.join(sorted(fields))}")
  values = {}
  for name, value in raw.items():
    current = getattr(default, name)
    if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
      value = _fill(current, value, f"{where}.{name}")
    elif isinstance(current, Mapping) and isinstance(value, Mapping):
      value = _merge(current, value)
    values[name] = value
  try:
    return dataclasses.replace(default, **values)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.{where}: {e}") from None


def _merge(default: Mapping, raw: Mapping) -> dict:
  """``default`` with the keys of ``raw`` (tables merged key by key)."""
  out = dict(default)
  for key, value in raw.items():
    current = out.get(key)
    out[key] = (_merge(current, value) if isinstance(current, Mapping)
                and isinstance(value, Mapping) else value)
  return out


def section_default(path: str, kind: str | None = None):
  """The default of the section at the dotted ``path`` (``"rl.signal"``,
  ``"parl"``, ``"tasks.rewards"``); a stage section's class is its
  ``kind`` (else the one its name is: ``sft``, ``rl``, ``distill``).
  ValueError for a path that is no section."""
  top, *rest = path.split(".")
  if top in _SECTIONS:
    value = getattr(Settings(), top)
    if value is None:
      value = _OPTIONAL[top]()
  elif (kind or top) in STAGES:
    value = STAGES[kind or top]()
  else:
    raise ValueError(f"{path!r} is not a section of the config")
  for name in rest:
    value = getattr(value, name, None)
    if value is None or not (dataclasses.is_dataclass(value) or isinstance(value, Mapping)):
      raise ValueError(f"{path!r} is not a section of the config")
  return value


def parse(cfg) -> Settings:
  """The :class:`Settings` of the ConfigDict (or mapping) ``cfg``."""
  if isinstance(cfg, Settings):
    return cfg
  raw = _plain(cfg)
  stages = tuple(raw.get("stages", Settings.stages))
  if not stages:
    raise ConfigError("config.stages is empty: name at least one stage section "
                      "(e.g. 'sft', 'rl')")
  sections = []
  for name in stages:
    if name not in raw and "stages" not in raw:  # the default stages
      raw[name] = {"kind": name}
    if name not in raw or not isinstance(raw[name], Mapping):
      hint = (f"; on the command line a tuple is written \"--config.stages="
              f"{tuple(name.split(','))!r}\"" if "," in name else "")
      raise ConfigError(f"stage {name!r} in config.stages has no section config.{name}{hint}")
    kind = raw[name].get("kind")
    if kind not in STAGES:
      raise ConfigError(f"config.{name}.kind is {kind!r}; expected one of {tuple(STAGES)}")
    section = dict(raw[name])
    if kind == "rl":  # the shift controller's bound is the stage's max_staleness
      section["shift"] = {**dict(section.get("shift") or {}),
                          "max_staleness": section.get("max_staleness", RLStage.max_staleness)}
    sections.append((name, _fill(STAGES[kind](), section, name)))
  values = {"stages": stages, "sections": tuple(sections)}
  for key, value in raw.items():
    if key in ("stages",) or key in stages:
      continue
    if key not in _SECTIONS:
      if isinstance(value, Mapping) and value.get("kind") in STAGES:
        continue  # a stage section this run does not list
      raise ConfigError(f"config.{key} is not a section of the config; its sections: "
                        f"{', '.join(sorted(_SECTIONS))} and the stages")
    default = getattr(Settings(), key)
    if default is None:
      default = _OPTIONAL[key]()
    values[key] = _fill(default, value, key) if dataclasses.is_dataclass(default) else value
  return Settings(**values)


def config_dict(section, **overrides) -> ml_collections.ConfigDict:
  """A ConfigDict of every field of ``section`` (a dataclass, an instance or
  a mapping) at its default, with ``overrides``; None defaults become typed
  placeholders (so the command line can set them); an RL stage's
  hyper-parameter tables (``*_kwargs``) list every estimator's, loss's and
  correction's hyper-parameters."""
  instance = section() if isinstance(section, type) else section
  if isinstance(instance, Mapping):
    return _config_value(dict(instance, **overrides))
  values = {}
  for name in _fields(instance):
    values[name] = _config_value(overrides.pop(name, getattr(instance, name)))
  if overrides:
    raise ValueError(f"{type(instance).__name__} has no fields {sorted(overrides)}")
  return ml_collections.ConfigDict(values)


def _config_value(value):
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return config_dict(value)
  if isinstance(value, Mapping):
    return ml_collections.ConfigDict({k: _config_value(v) for k, v in value.items()})
  return placeholder(object) if value is None else value
