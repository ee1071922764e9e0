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
* ``efficiency``: how little of its budgets the episode used, counted in
  tool calls, policy tokens and wall-clock seconds of environment steps
  (MiniMax's agent RL rewards an episode's efficiency in the same three
  currencies; docs/references.md, "Efficiency reward")::

      efficiency = clip(1 - w_calls * calls / max_turns
                          - w_tokens * tokens / (max_turns * max_action_len)
                          - w_time * seconds / time_budget_s, 0, 1)

  with ``(w_calls, w_tokens, w_time) = efficiency_weights`` (default
  ``(0.5, 0.5, 0)``); a part whose weight is 0 is left out of the sum. With
  weights summing to 1 it is the weighted mean of the parts below (before
  their clipping).
* ``efficiency_calls``, ``efficiency_tokens``, ``efficiency_time``: each
  budget's unused share alone, ``clip(1 - used / budget, 0, 1)``, unweighted
  (reported; only ``efficiency`` enters the reward).

``seconds`` is the episode's time in its environment: for a Python (host)
environment the measured wall time of its ``reset``, ``step`` and
``call_tool`` calls; for the built-in jitted families, whose steps inside
``jit`` take no measurable time, the sum of the nominal latencies declared
per tool (``tools.LATENCY_S``) over the episode's calls. For host
environments ``max_turns`` and ``max_action_len`` are the sampling limits
(``max_turns``, ``max_new_tokens_per_turn``). Both sources default to the
same weights, time 0 (``time_budget_s`` 1 s): the jitted families' rewards
are then exactly the calls-and-tokens ones, and a host run's stay
reproducible, since measured time varies with the machine's load.

``reward = outcome_w * outcome + format_w * format + efficiency_w *
efficiency * (outcome if efficiency_needs_success else 1)``. Gating efficiency
on success (the default) keeps "answer at once" from paying when it fails,
the reward-hacking route a budget term otherwise opens (Kimi k1.5's length
reward is likewise positive only for correct answers). A host environment's
reward is its own summed step reward plus the same efficiency term
(:func:`host_components`), gated on its success.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

WEIGHTED = ("outcome", "format", "efficiency")
EFFICIENCY_PARTS = ("calls", "tokens", "time")
# Every component an environment reports.
COMPONENTS = WEIGHTED + tuple(f"efficiency_{p}" for p in EFFICIENCY_PARTS)


def _check_weight(where: str, w) -> None:
  if (isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)
      or w < 0):
    raise ValueError(f"{where} must be a finite weight >= 0, got {w!r}")


@dataclasses.dataclass(frozen=True)
class EfficiencyWeights:
  """The weight of each budget in the ``efficiency`` component."""

  calls: float = 0.5
  tokens: float = 0.5
  time: float = 0.0

  def __post_init__(self):
    for name in EFFICIENCY_PARTS:
      _check_weight(f"efficiency_weights.{name}", getattr(self, name))


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Weights of the reward components (see the module docstring).

  ``efficiency_weights`` may be given as a mapping (``{"time": 0.2}``);
  ``time_budget_s`` is the episode's wall-clock budget in seconds.
  """

  outcome: float = 1.0
  format: float = 0.1
  efficiency: float = 0.1
  efficiency_needs_success: bool = True
  efficiency_weights: EfficiencyWeights = EfficiencyWeights()
  time_budget_s: float = 1.0

  def __post_init__(self):
    for name in WEIGHTED:
      _check_weight(f"RewardConfig.{name}", getattr(self, name))
    weights = self.efficiency_weights
    if not isinstance(weights, EfficiencyWeights):
      weights = EfficiencyWeights(**_known_keys("efficiency_weights", weights,
                                                EfficiencyWeights))
      object.__setattr__(self, "efficiency_weights", weights)
    b = self.time_budget_s
    if (isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)
        or b <= 0):
      raise ValueError(f"RewardConfig.time_budget_s must be a finite number of seconds > 0, "
                       f"got {b!r}")

  @classmethod
  def from_mapping(cls, values) -> RewardConfig:
    """A config from a mapping (or an ``ml_collections.ConfigDict``); a
    misspelt key is a ValueError listing the valid ones."""
    return cls(**_known_keys("rewards", values, cls))


def _known_keys(where: str, values, cls) -> dict:
  if not isinstance(values, Mapping) and not callable(getattr(values, "items", None)):
    raise ValueError(f"{where} must be a mapping, got {values!r}")
  values = dict(values.items())
  valid = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(set(values) - set(valid))
  if unknown:
    raise ValueError(f"{where} has unknown keys {unknown}; valid: {valid}")
  return values


def efficiency_components(*, calls, tokens, seconds, max_turns: int, max_action_len: int,
                          config: RewardConfig) -> dict[str, jax.Array]:
  """``efficiency`` and its parts (see the module docstring).

  Args:
    calls, tokens, seconds: an episode's tool calls, policy tokens and
      environment seconds; scalars or arrays of one shape (any dtype).
    max_turns, max_action_len: the call budget is ``max_turns`` and the
      token budget ``max_turns * max_action_len``.
    config: the efficiency weights and ``time_budget_s``.
  Returns:
    float32 arrays of the inputs' shape: ``efficiency``, ``efficiency_calls``,
    ``efficiency_tokens``, ``efficiency_time``.
  """
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  calls, tokens, seconds = f32(calls), f32(tokens), f32(seconds)
  w, budget = config.efficiency_weights, config.time_budget_s
  max_tokens = max_turns * max_action_len
  # Terms of weight 0 are left out, so the others run the same float32
  # operations in the same order whichever weights are 0.
  eff = 1.0
  if w.calls:
    eff = eff - w.calls * calls / max_turns
  if w.tokens:
    eff = eff - w.tokens * tokens / max_tokens
  if w.time:
    eff = eff - w.time * seconds / budget
  shape = jnp.broadcast_shapes(calls.shape, tokens.shape, seconds.shape)
  clip = lambda x: jnp.broadcast_to(jnp.clip(x, 0.0, 1.0), shape).astype(jnp.float32)
  return {"efficiency": clip(eff),
          "efficiency_calls": clip(1.0 - calls / max_turns),
          "efficiency_tokens": clip(1.0 - tokens / max_tokens),
          "efficiency_time": clip(1.0 - seconds / budget)}


def episode_components(*, correct, answered, calls, malformed_calls, tokens, seconds,
                       max_turns: int, max_action_len: int,
                       config: RewardConfig) -> dict[str, jax.Array]:
  """Every component (:data:`COMPONENTS`) of a finished episode, float32
  scalars or arrays of the inputs' shape."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  fmt = f32(answered) * (1.0 - f32(malformed_calls) / jnp.maximum(f32(calls), 1.0))
  return {"outcome": f32(correct), "format": fmt, **efficiency_components(
      calls=calls, tokens=tokens, seconds=seconds, max_turns=max_turns,
      max_action_len=max_action_len, config=config)}


def efficiency_term(components: dict[str, jax.Array], config: RewardConfig) -> jax.Array:
  """``efficiency_w * efficiency * (outcome if efficiency_needs_success else 1)``."""
  gate = components["outcome"] if config.efficiency_needs_success else 1.0
  return config.efficiency * components["efficiency"] * gate


def combine(components: dict[str, jax.Array], config: RewardConfig) -> jax.Array:
  """The weighted reward of a components dict."""
  return (config.outcome * components["outcome"] + config.format * components["format"]
          + efficiency_term(components, config)).astype(jnp.float32)


def host_components(*, success, calls, tokens, seconds, max_turns: int, max_action_len: int,
                    config: RewardConfig) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """The components of host-environment episodes and their efficiency term.

  Args:
    success: bool ``[B]`` the episode succeeded (its ``outcome``).
    calls, tokens, seconds: ``[B]`` tool calls, policy tokens and measured
      environment seconds.
    max_turns, max_action_len, config: as :func:`efficiency_components`.
  Returns:
    ``(components, term_B)``: float32 numpy ``[B]`` arrays: ``outcome`` and
    the efficiency components; and :func:`efficiency_term` of them, the
    reward added to the environment's own.
  """
  comps = {"outcome": jnp.asarray(success, jnp.float32), **efficiency_components(
      calls=calls, tokens=tokens, seconds=seconds, max_turns=max_turns,
      max_action_len=max_action_len, config=config)}
  term = jnp.asarray(efficiency_term(comps, config), jnp.float32)
  return {k: np.asarray(v) for k, v in comps.items()}, np.asarray(term)
