"""Episode reward components and their weighted combination.

Rewards are terminal: every component is 0 on non-final steps and carries the
whole episode's value on the step that ends it (answer, stop or limit), so the
sum over an episode's steps equals its final-step value.

Components (all float32 in ``[0, 1]``):

* ``outcome``: 1 iff the final action is a well-formed answer
  (``<answer>INTEGER</answer>``) equal to the instance's answer. An answer
  outside the answer tags, a malformed one, a stop without an answer and a
  truncated episode all score 0.
* ``format``: ``answered * (1 - malformed_calls / max(calls, 1))``: the
  episode ended with a well-formed answer, discounted by the fraction of tool
  calls that were malformed or named an unknown tool.
* ``efficiency``: ``1 - calls / (2 max_turns) - tokens / (2 max_turns
  max_action_len)``: the share of the episode's call and token budget left
  unused.

``reward = outcome_w * outcome + format_w * format + efficiency_w *
efficiency * (outcome if efficiency_needs_success else 1)``. Gating efficiency
on success (the default) keeps "answer at once" from paying when it fails,
the reward-hacking route a budget term otherwise opens (Kimi k1.5's length
reward is likewise positive only for correct answers).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

COMPONENTS = ("outcome", "format", "efficiency")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Weights of the reward components (see the module docstring)."""

  outcome: float = 1.0
  format: float = 0.1
  efficiency: float = 0.1
  efficiency_needs_success: bool = True

  def __post_init__(self):
    for name in COMPONENTS:
      w = getattr(self, name)
      if not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
        raise ValueError(f"RewardConfig.{name} must be a finite weight >= 0, got {w!r}")


def episode_components(*, correct, answered, calls, malformed_calls, tokens,
                       max_turns: int, max_action_len: int) -> dict[str, jax.Array]:
  """The components of a finished episode (scalars or batched arrays)."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  calls, tokens = f32(calls), f32(tokens)
  fmt = f32(answered) * (1.0 - f32(malformed_calls) / jnp.maximum(calls, 1.0))
  eff = 1.0 - 0.5 * calls / max_turns - 0.5 * tokens / (max_turns * max_action_len)
  return {"outcome": f32(correct), "format": fmt, "efficiency": jnp.clip(eff, 0.0, 1.0)}


def combine(components: dict[str, jax.Array], config: RewardConfig) -> jax.Array:
  """The weighted reward of a components dict."""
  gate = components["outcome"] if config.efficiency_needs_success else 1.0
  return (config.outcome * components["outcome"] + config.format * components["format"]
          + config.efficiency * components["efficiency"] * gate).astype(jnp.float32)
