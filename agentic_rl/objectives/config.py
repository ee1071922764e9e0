"""Objective and optimiser configs: plain data, validated before anything compiles.

The trainer calls :func:`validate_objective_config` (with the rollout's group
size) and :func:`validate_optimizer_config` once, then builds the functions
with :func:`make_advantage_fn`, :func:`make_policy_loss` and
:func:`agentic_rl.objectives.optim.make_optimizer`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from agentic_rl.objectives._checks import check_keywords, keyword_defaults
from agentic_rl.objectives.advantages import (
    ADVANTAGE_ESTIMATORS,
    GLOBAL_STATS_ESTIMATORS,
    get_advantage_fn,
)
from agentic_rl.objectives.corrections import CORRECTIONS, get_correction
from agentic_rl.objectives.losses import POLICY_LOSSES, get_policy_loss

SCHEDULES = ("constant", "warmup_constant", "warmup_cosine")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  """Which estimator, loss, correction and regularisers; all by name.

  ``*_kwargs`` hold the hyper-parameters of the named function (see
  ``docs/objectives.md``); ``correction_kwargs`` maps each correction name to
  its own. ``correction`` is one name, a tuple of names (weights multiply) or
  None. ``horizon`` is the constant of ``agg='seq_mean_token_sum_norm'``
  (default: the padded response length T).
  """
  advantage: str = "grpo"
  advantage_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  loss: str = "ppo"
  loss_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  agg: str = "token_mean"
  horizon: int | None = None
  correction: str | tuple[str, ...] | None = None
  correction_kwargs: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  entropy_coef: float = 0.0
  kl_coef: float = 0.0
  kl_estimator: str = "k3"


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW with global-norm clipping and a learning-rate schedule.

  ``schedule``: ``constant``; ``warmup_constant`` (linear 0 -> lr over
  ``warmup_steps``, then flat); ``warmup_cosine`` (linear warm-up, then cosine
  decay to ``final_lr_fraction * lr`` at ``total_steps``). ``grad_clip_norm``
  None disables clipping. ``reset_each_iteration`` resets the Adam moments at
  the start of every iteration (Kimi k1.5 mirror descent; the schedule keeps
  its position). Defaults: betas (0.9, 0.95) and clip 1.0 as GEM and
  MiniMax-M1; weight decay 0 as GEM.
  """
  learning_rate: float = 1e-6
  schedule: str = "constant"
  warmup_steps: int = 0
  total_steps: int | None = None
  final_lr_fraction: float = 0.0
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.0
  grad_clip_norm: float | None = 1.0
  reset_each_iteration: bool = False


def hyperparameter_defaults() -> dict[str, dict[str, dict[str, Any]]]:
  """Every estimator's, loss's and correction's hyper-parameters with their
  defaults, keyed ``{"advantage" | "loss" | "correction": {name: {kw: value}}}``.

  The functions' signatures are the one source of these values; a config
  that keys hyper-parameters by name starts from this table. A required
  hyper-parameter (``pass_at_k``'s ``k``) appears as None. ``clip_cov``'s
  ``key`` is an input (its random selection), not a hyper-parameter.
  """
  from agentic_rl.objectives.losses import _BASE_LOSSES  # pylint: disable=g-import-not-at-top
  return {"advantage": {n: keyword_defaults(get_advantage_fn(n)) for n in ADVANTAGE_ESTIMATORS},
          "loss": {n: keyword_defaults(_BASE_LOSSES[n], exclude=("key",))
                   for n in POLICY_LOSSES},
          "correction": {n: keyword_defaults(get_correction(n)) for n in CORRECTIONS}}


# The inputs an objective may need beyond rewards, current and old log-probs.
INPUTS = ("greedy_rewards_P", "turn_rewards", "turn_states", "all_rewards_PxN",
          "behaviour_logp_BxT", "ref_logp_BxT", "entropy_BxT")


def required_inputs(config: ObjectiveConfig, *, global_stats: bool = False) -> frozenset[str]:
  """Which of :data:`INPUTS` the configured estimator and loss need.

  ``greedy_rewards_P``: ReMax's greedy-decode baselines; ``turn_rewards``:
  per-turn rewards (REBN, GiGPO); ``turn_states``: each turn's anchor state
  and each episode's group (GiGPO); ``all_rewards_PxN``: the rewards of every rollout
  generated for a prompt (``global_stats``, Reinforce-Ada, for the estimators
  in ``GLOBAL_STATS_ESTIMATORS``); ``behaviour_logp_BxT``: the sampler's
  log-probs (a correction); ``ref_logp_BxT``: a frozen reference policy's
  (``kl_coef > 0``); ``entropy_BxT``: the per-token entropy (an entropy bonus).
  The trainer, the learner and validation all decide from this set.
  """
  needs = set()
  if config.advantage == "remax":
    needs.add("greedy_rewards_P")
  if config.advantage in ("rebn", "gigpo"):
    needs.add("turn_rewards")
  if config.advantage == "gigpo":
    needs.add("turn_states")
  if global_stats and config.advantage in GLOBAL_STATS_ESTIMATORS:
    needs.add("all_rewards_PxN")
  if config.correction:
    needs.add("behaviour_logp_BxT")
  if config.kl_coef:
    needs.add("ref_logp_BxT")
  if config.entropy_coef:
    needs.add("entropy_BxT")
  return frozenset(needs)


def make_advantage_fn(config: ObjectiveConfig) -> Callable[..., jax.Array]:
  """The configured estimator with its hyper-parameters bound."""
  return functools.partial(get_advantage_fn(config.advantage), **config.advantage_kwargs)


def make_policy_loss(config: ObjectiveConfig) -> Callable[..., tuple[jax.Array, dict]]:
  """The configured loss ``fn(logp, old_logp, advantages, mask, **arrays)``.

  Everything in the config is bound; the caller passes the arrays
  (``behaviour_logp_BxT``, ``ref_logp_BxT``, ``entropy_BxT``), the global
  ``num_tokens`` / ``num_seqs`` of a micro-batched step, and ``key`` for
  ``clip_cov``'s random selection.
  """
  return functools.partial(
      get_policy_loss(config.loss), agg=config.agg, horizon=config.horizon,
      correction=config.correction, correction_kwargs=config.correction_kwargs,
      entropy_coef=config.entropy_coef, kl_coef=config.kl_coef,
      kl_estimator=config.kl_estimator, **config.loss_kwargs)


def validate_objective_config(config: ObjectiveConfig, *, group_size: int) -> None:
  """Raise ``ValueError`` naming the problem if ``config`` cannot run.

  Checks every name (listing the valid ones), every hyper-parameter name and
  value, and that a group estimator gets ``group_size >= 2``, by tracing the
  configured functions on abstract shapes (``jax.eval_shape``: nothing is
  compiled or run).
  """
  if not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
  estimator = get_advantage_fn(config.advantage)
  get_policy_loss(config.loss)
  check_keywords(f"advantage estimator {config.advantage!r}", estimator, config.advantage_kwargs)

  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  adv_fn = make_advantage_fn(config)
  needs = required_inputs(config)
  if "turn_states" in needs:
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    jax.eval_shape(adv_fn, f32(2, 3), jax.ShapeDtypeStruct((2, 3), jnp.bool_), i32(2, 3),
                   i32(2))
  elif "turn_rewards" in needs:
    jax.eval_shape(adv_fn, f32(2, 3), jax.ShapeDtypeStruct((2, 3), jnp.bool_))
  elif "greedy_rewards_P" in needs:
    jax.eval_shape(adv_fn, f32(2, group_size), f32(2))
  else:
    jax.eval_shape(adv_fn, f32(2, group_size))

  optional = {k: f32(2, 4) for k in needs if k.endswith("_BxT")}
  # The loss checks the aggregation mode, corrections, KL estimator and every
  # hyper-parameter in Python before it traces anything.
  loss_fn = make_policy_loss(config)
  jax.eval_shape(loss_fn, f32(2, 4), f32(2, 4), f32(2),
                 jax.ShapeDtypeStruct((2, 4), jnp.bool_), **optional)


def validate_optimizer_config(config: OptimizerConfig) -> None:
  """Raise ``ValueError`` naming the problem if ``config`` is inconsistent."""
  if config.schedule not in SCHEDULES:
    raise ValueError(f"unknown schedule {config.schedule!r}; valid: {', '.join(SCHEDULES)}")
  if not (math.isfinite(config.learning_rate) and config.learning_rate > 0):
    raise ValueError(f"learning_rate must be a positive finite number, got {config.learning_rate}")
  if config.warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0, got {config.warmup_steps}")
  if config.schedule == "warmup_cosine":
    if config.total_steps is None or config.total_steps <= config.warmup_steps:
      raise ValueError(
          f"warmup_cosine needs total_steps > warmup_steps ({config.warmup_steps}), got "
          f"{config.total_steps}")
  if not 0.0 <= config.final_lr_fraction <= 1.0:
    raise ValueError(f"final_lr_fraction must be in [0, 1], got {config.final_lr_fraction}")
  for name in ("b1", "b2"):
    if not 0.0 <= getattr(config, name) < 1.0:
      raise ValueError(f"{name} must be in [0, 1), got {getattr(config, name)}")
  if config.eps < 0 or config.weight_decay < 0:
    raise ValueError(f"eps and weight_decay must be >= 0, got {config.eps}, {config.weight_decay}")
  if config.grad_clip_norm is not None and config.grad_clip_norm <= 0:
    raise ValueError(f"grad_clip_norm must be > 0 or None, got {config.grad_clip_norm}")
