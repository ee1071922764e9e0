"""Corrections for the mismatch between the behaviour (sampler) and the learner.

Three log-prob streams reach the loss (all ``[B, T]``):

* ``logp`` -- the learner at the current parameters (differentiable);
* ``old_logp`` -- the learner at the parameters that started this iteration
  (the *proximal* policy ``pi_old``);
* ``behaviour_logp`` -- what the rollout engine recorded while sampling
  (``pi_behav``; differs from ``pi_old`` through numerics, quantisation or
  staleness).

Each correction returns a non-negative, stop-gradient weight ``w`` ``[B, T]``
that multiplies the base loss's per-token term, and metrics over masked tokens.
The IS ratio is ``rho = pi_old / pi_behav`` per token (``level='token'``), its
product over the sequence (``'sequence'``), or the geometric mean
``rho_seq^(1 / |y|)`` (``'geometric'``).

All corrections share the signature ``fn(logp, old_logp, behaviour_logp,
advantages_BxT, mask, **hyper_parameters) -> (w_BxT, metrics)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from agentic_rl.objectives.aggregation import masked_max, masked_mean

IS_LEVELS = ("token", "sequence", "geometric")

_CORRECTIONS: dict[str, Callable[..., tuple[jax.Array, dict[str, jax.Array]]]] = {}


def _register(*names: str):
  def decorate(fn):
    for name in names:
      _CORRECTIONS[name] = fn
    return fn
  return decorate


def _log_is_ratio(old_logp, behaviour_logp, mask, level: str) -> jax.Array:
  """``log rho`` ``[B, T]`` at the given level (constant along T unless token)."""
  if level not in IS_LEVELS:
    raise ValueError(f"unknown importance-sampling level {level!r}; valid: {', '.join(IS_LEVELS)}")
  valid = mask != 0
  log_rho = jnp.where(valid, old_logp - behaviour_logp, 0.0)
  if level == "token":
    return log_rho
  seq_B1 = log_rho.sum(axis=-1, keepdims=True)
  if level == "geometric":
    seq_B1 = seq_B1 / jnp.maximum(valid.sum(axis=-1, keepdims=True), 1)
  return jnp.broadcast_to(seq_B1, log_rho.shape)


@_register("tis")
def truncated_is(logp_BxT, old_logp_BxT, behaviour_logp_BxT, advantages_BxT, mask_BxT, *,
                 level: str = "token", cap: float = 2.0):
  """Truncated importance sampling, TIS (Yao et al. 2025, "Your efficient RL
  framework secretly brings you off-policy RL training").

  ``w = min(rho, C)`` with ``rho = pi_old / pi_behav`` (token, sequence product
  -- Seq-TIS of Liu et al. 2025 -- or geometric mean). With the ``ppo`` loss
  this is the paper's PPO form: the clipped PPO term times ``min(pi_old /
  pi_sampler, C)``. ``C = 2`` is slime's ``--tis-clip`` default.
  """
  del logp_BxT, advantages_BxT
  if cap <= 0:
    raise ValueError(f"tis: cap C must be > 0, got {cap}")
  log_rho = _log_is_ratio(old_logp_BxT, behaviour_logp_BxT, mask_BxT, level)
  w = jax.lax.stop_gradient(jnp.exp(jnp.minimum(log_rho, math.log(cap))))
  metrics = {
      "weight_mean": masked_mean(w, mask_BxT),
      "weight_max": masked_max(w, mask_BxT),
      "trunc_frac": masked_mean(log_rho > math.log(cap), mask_BxT),
  }
  return w, metrics


@_register("mis", "icepop")
def masked_is(logp_BxT, old_logp_BxT, behaviour_logp_BxT, advantages_BxT, mask_BxT, *,
              level: str = "token", low: float = 0.5, high: float = 5.0):
  """Masked importance sampling, MIS / IcePop.

  ``w = rho * 1[low <= rho <= high]``: tokens (or whole sequences) whose ratio
  leaves the band get no gradient at all. Token level with ``[0.5, 5]`` is
  IcePop (Ring-1T, arXiv 2510.18855, ``M(k) = k if k in [alpha, beta] else
  0``); sequence level with ``low=0`` is Seq-MIS (Liu et al. 2025, "When speed
  kills stability"); ``level='geometric'`` is their Geo-RS band (where the
  weight is the geometric-mean ratio).
  """
  del logp_BxT, advantages_BxT
  if not 0.0 <= low < high:
    raise ValueError(f"mis: need 0 <= low < high, got low={low}, high={high}")
  log_rho = _log_is_ratio(old_logp_BxT, behaviour_logp_BxT, mask_BxT, level)
  log_low = math.log(low) if low > 0 else -math.inf
  inside = (log_rho >= log_low) & (log_rho <= math.log(high))
  rho = jnp.exp(jnp.clip(log_rho, log_low, math.log(high)))
  w = jax.lax.stop_gradient(jnp.where(inside, rho, 0.0))
  metrics = {
      "weight_mean": masked_mean(w, mask_BxT),
      "weight_max": masked_max(w, mask_BxT),
      "masked_frac": masked_mean(~inside, mask_BxT),
  }
  return w, metrics


@_register("opsm")
def off_policy_sequence_mask(logp_BxT, old_logp_BxT, behaviour_logp_BxT, advantages_BxT, mask_BxT,
                             *, delta: float = 1e-4):
  """Off-policy sequence masking, OPSM (DeepSeek-V3.2, arXiv 2512.02556, §3.1).

  ``w_{i,t} = 0`` if ``A_{i,t} < 0`` and ``(1/|y_i|) sum_t log(pi_behav /
  pi_theta) > delta``, else 1: negative-advantage sequences that drifted too
  far from the sampler are dropped. ``pi_theta`` is the current learner
  (stop-gradient), ``pi_behav`` the inference engine, so staleness and engine
  mismatch both count. ``delta = 1e-4`` is slime's ``--opsm-delta`` default.
  """
  del old_logp_BxT
  valid = mask_BxT != 0
  drift = jnp.where(valid, behaviour_logp_BxT - jax.lax.stop_gradient(logp_BxT), 0.0)
  seq_kl_B1 = drift.sum(axis=-1, keepdims=True) / jnp.maximum(valid.sum(axis=-1, keepdims=True), 1)
  dropped = (advantages_BxT < 0) & (seq_kl_B1 > delta)
  w = jnp.where(dropped, 0.0, 1.0)
  seq_valid_B1 = valid.any(axis=-1, keepdims=True)
  metrics = {
      "masked_frac": masked_mean(dropped, mask_BxT),
      "seq_kl_mean": masked_mean(seq_kl_B1, seq_valid_B1),
  }
  return w, metrics


@_register("decoupled")
def decoupled(logp_BxT, old_logp_BxT, behaviour_logp_BxT, advantages_BxT, mask_BxT, *,
              cap: float = 2.0):
  """Decoupled three-policy PPO weight (Hilton et al. 2022, arXiv 2110.00641;
  AReaL's ``use_decoupled_loss``).

  The PPO ratio is taken to the proximal policy, ``r = pi_theta / pi_old``
  (the base loss does that), and each token is weighted by the truncated
  proximal-to-behaviour ratio ``w = min(pi_old / pi_behav, C)``. Only valid
  with losses built on ``r`` (checked by the loss). Same weight as token-level
  ``tis``; the separate name records the intent.
  """
  return truncated_is(logp_BxT, old_logp_BxT, behaviour_logp_BxT, advantages_BxT, mask_BxT,
                      level="token", cap=cap)


CORRECTIONS = tuple(_CORRECTIONS)


def get_correction(name: str):
  """The correction registered as ``name`` (see :data:`CORRECTIONS`)."""
  if name not in _CORRECTIONS:
    raise ValueError(f"unknown correction {name!r}; valid corrections: {', '.join(CORRECTIONS)}")
  return _CORRECTIONS[name]
