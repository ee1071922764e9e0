"""Exploration controllers: an entropy-bonus coefficient that tracks a band, and a
sampling-temperature schedule. Both are jittable pure functions of a static
``ExplorationConfig``.

- Adaptive entropy bonus: the loss adds ``-coef * entropy``; ``coef`` is raised
  multiplicatively while ``explore/entropy`` is below the target band and
  lowered while above (a multiplicative band controller, ``alarms.band_update``;
  in the spirit of the automatic entropy tuning of SAC, Haarnoja et al. 2018,
  but aimed at a band rather than a point).
- Temperature schedule: high early for exploration, decayed later (Kimi K2's
  temperature decay, arXiv 2507.20534): ``constant``, ``linear`` or
  ``cosine`` from ``temperature`` to ``temperature_final`` over
  ``temperature_steps``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from agentic_rl.invariants.alarms import band_update
from agentic_rl.invariants.exploration.config import ExplorationConfig


@struct.dataclass
class EntropyCoefState:
  """The adaptive entropy-bonus coefficient (float32 scalar)."""

  coef: jax.Array


def init_entropy_coef(config: ExplorationConfig) -> EntropyCoefState:
  return EntropyCoefState(coef=jnp.float32(config.entropy_coef))


def update_entropy_coef(config: ExplorationConfig, state: EntropyCoefState,
                        entropy: jax.Array) -> EntropyCoefState:
  """Moves the coefficient towards keeping ``entropy`` inside ``config.entropy_band``.

  Args:
    config: the exploration config; without ``entropy_band`` the coefficient
      is fixed and ``state`` is returned unchanged.
    state: the current coefficient.
    entropy: float scalar, this step's ``explore/entropy``.
  """
  if config.entropy_band is None:
    return state
  coef = band_update(state.coef, entropy, config.entropy_band, config.entropy_coef_factor,
                     config.entropy_coef_min, config.entropy_coef_max, raise_when_low=True)
  return EntropyCoefState(coef=coef)


def temperature_at(config: ExplorationConfig, step: int | jax.Array) -> jax.Array:
  """Sampling temperature at training ``step`` (float32 scalar).

  ``linear``: ``t0 + (t1 - t0) * s``; ``cosine``: ``t1 + (t0 - t1) * (1 + cos(pi s)) / 2``,
  with ``s = min(step / temperature_steps, 1)``.
  """
  t0 = jnp.float32(config.temperature)
  if config.temperature_schedule == "constant":
    return t0
  t1 = jnp.float32(config.temperature_final)
  s = jnp.clip(jnp.asarray(step, jnp.float32) / config.temperature_steps, 0.0, 1.0)
  if config.temperature_schedule == "linear":
    return t0 + (t1 - t0) * s
  return t1 + (t0 - t1) * 0.5 * (1.0 + jnp.cos(jnp.pi * s))
