"""Truncated (over-long) responses: mask them or punish them (DAPO, arXiv 2503.14476).

A truncated response has no real outcome: scoring it as a failure teaches the
policy that length is bad only by accident, and it adds noise to the signal.
DAPO either filters such samples out of the loss (overlong filtering) or adds a
soft length punishment to the reward:

    R_len(y) = 0                               if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                              if |y| > L_max (or truncated)

Jittable; shapes are whatever the inputs share (``[P, G]`` or ``[B]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentic_rl.invariants.signal.config import SignalConfig


def overlong_penalty(lengths: jax.Array, truncated: jax.Array, max_len: int | None = None,
                     cache_len: int = 0) -> jax.Array:
  """DAPO's soft overlong punishment R_len, float32, in [-1, 0].

  Args:
    lengths: int response lengths (policy tokens).
    truncated: bool, the response hit a limit; punished with -1 whatever its
      length.
    max_len: L_max; None punishes truncated responses only.
    cache_len: L_cache, the width of the linear ramp below L_max (0: no ramp).
  """
  lengths = jnp.asarray(lengths).astype(jnp.float32)
  truncated = jnp.asarray(truncated, bool)
  if lengths.shape != truncated.shape:
    raise ValueError(f"lengths {lengths.shape} and truncated {truncated.shape} differ in shape")
  penalty = jnp.zeros_like(lengths)
  if max_len is not None:
    over = lengths > max_len
    if cache_len > 0:
      start = max_len - cache_len
      ramp = jnp.clip((start - lengths) / cache_len, -1.0, 0.0)
      penalty = jnp.where(lengths > start, ramp, penalty)
    penalty = jnp.where(over, -1.0, penalty)
  return jnp.where(truncated, -1.0, penalty)


def shape_truncated(config: SignalConfig, rewards: jax.Array, truncated: jax.Array,
                    lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Applies ``config.truncation`` to a batch of sequence rewards.

  Args:
    config: ``truncation``, ``overlong_max_len``, ``overlong_cache_len`` and
      ``overlong_penalty_coef`` are used.
    rewards: float sequence rewards.
    truncated: bool, same shape.
    lengths: int response lengths, same shape.

  Returns:
    ``(rewards, sequence_weight)``, float32, same shape: ``keep`` returns the
    rewards and weight 1; ``mask`` weight 0 on truncated responses (multiply it
    into their tokens' loss weights); ``penalty`` adds
    ``overlong_penalty_coef * R_len`` to the rewards.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  truncated = jnp.asarray(truncated, bool)
  if rewards.shape != truncated.shape:
    raise ValueError(f"rewards {rewards.shape} and truncated {truncated.shape} differ in shape")
  weight = jnp.ones_like(rewards)
  if config.truncation == "mask":
    weight = jnp.where(truncated, 0.0, weight)
  elif config.truncation == "penalty":
    rewards = rewards + config.overlong_penalty_coef * overlong_penalty(
        lengths, truncated, config.overlong_max_len, config.overlong_cache_len)
  return rewards, weight
