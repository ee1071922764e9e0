"""Optimisers: AdamW with clipping and schedules, and the mirror-descent reset.

Kimi k1.5 online mirror descent (arXiv 2501.12599, §2.3.2) runs iterations;
iteration i

1. takes the current parameters theta_i as the reference policy: the trainer
   computes ``old_logp_BxT = log pi_theta_i`` once on the iteration's batch
   (the "previous iterate" is therefore never copied: only its log-probs are
   kept);
2. resets the optimiser state, :func:`begin_iteration` with
   ``OptimizerConfig(reset_each_iteration=True)`` ("the optimizer is reset at
   the start of every iteration");
3. takes one or more optimiser steps on the ``kimi`` loss, whose
   ``(tau / 2) (log pi - log pi_old)^2`` term keeps theta near theta_i.

Optax provides AdamW, clipping and schedules; this module only builds them
from an :class:`~agentic_rl.objectives.config.OptimizerConfig` and adds the
reset, which restarts the Adam moments and bias correction but keeps the
learning-rate schedule's step count (a reset must not rewind the warm-up).
"""

from __future__ import annotations

import jax
import optax

from agentic_rl.objectives.config import OptimizerConfig, validate_optimizer_config


def make_schedule(config: OptimizerConfig) -> optax.Schedule:
  """The learning-rate schedule of ``config`` (step -> learning rate)."""
  validate_optimizer_config(config)
  lr = config.learning_rate
  if config.schedule == "constant":
    return optax.constant_schedule(lr)
  if config.schedule == "warmup_constant":
    return optax.warmup_constant_schedule(0.0, lr, config.warmup_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=config.warmup_steps,
      decay_steps=config.total_steps, end_value=lr * config.final_lr_fraction)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
  """``clip_by_global_norm`` (unless disabled) followed by ``optax.adamw``.

  Weight decay is decoupled and scaled by the scheduled learning rate, as
  ``torch.optim.AdamW``.
  """
  adamw = optax.adamw(make_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay)
  if config.grad_clip_norm is None:
    return adamw
  return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adamw)


def _is_schedule_state(x) -> bool:
  return isinstance(x, optax.ScaleByScheduleState)


def reset_optimizer_state(optimizer: optax.GradientTransformation, opt_state: optax.OptState,
                          params: optax.Params) -> optax.OptState:
  """A fresh state of ``optimizer`` for ``params`` that keeps the schedule's step.

  Every moment and count restarts as after ``optimizer.init(params)``, except
  the ``ScaleByScheduleState`` counts, which are carried over from
  ``opt_state``. Pure and jit-able.
  """
  fresh = optimizer.init(params)
  return jax.tree.map(lambda new, old: old if _is_schedule_state(new) else new,
                      fresh, opt_state, is_leaf=_is_schedule_state)


def begin_iteration(optimizer: optax.GradientTransformation, opt_state: optax.OptState,
                    params: optax.Params, config: OptimizerConfig) -> optax.OptState:
  """The optimiser state to start an iteration with.

  :func:`reset_optimizer_state` when ``config.reset_each_iteration`` (Kimi
  k1.5 mirror descent), else ``opt_state`` unchanged.
  """
  if config.reset_each_iteration:
    return reset_optimizer_state(optimizer, opt_state, params)
  return opt_state
