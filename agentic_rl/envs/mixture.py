"""A task mix: several environments behind one ``JaxEnv``, so one jitted
rollout runs a batch that mixes families.

Every episode holds every member's instance and state (fixed shapes); its
``family`` index picks the member that acts, through ``lax.switch`` (under
vmap, every member runs and the results are selected). Members must produce
the same ``StepOutput`` structure (every ``ToolEnv`` does); observations and
actions are padded to the largest member's lengths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from agentic_rl.envs.base import EqualByValue, StepOutput

PyTree = Any


@struct.dataclass
class MixtureInstance:
  """``family``: int32 ``[]`` index of the acting member; ``members``: one
  instance per member (only ``members[family]`` is played)."""

  family: jax.Array
  members: tuple

  @property
  def answer(self) -> jax.Array:
    return _pick(self.family, [m.answer for m in self.members])


def _pick(family: jax.Array, values) -> jax.Array:
  return jnp.stack(values)[family]


@struct.dataclass
class MixtureState:
  """``family``: int32 ``[]``; ``members``: every member's episode state."""

  family: jax.Array
  members: tuple

  @property
  def done(self) -> jax.Array:
    return _pick(self.family, [m.done for m in self.members])

  @property
  def truncated(self) -> jax.Array:
    return _pick(self.family, [m.truncated for m in self.members])


def _pad_to(x: jax.Array, size: int, pad: int) -> jax.Array:
  return jnp.concatenate([x, jnp.full((size - x.shape[-1],), pad, x.dtype)], axis=-1)


class MixtureEnv(EqualByValue):
  """Dispatches to member environments by a per-episode family index."""

  name = "mixture"

  def __init__(self, envs: Sequence[Any], weights: Sequence[float] | None = None):
    envs = tuple(envs)
    if not envs:
      raise ValueError("MixtureEnv needs at least one member environment")
    weights = (1.0,) * len(envs) if weights is None else tuple(weights)
    if len(weights) != len(envs):
      raise ValueError(f"got {len(weights)} weights for {len(envs)} environments")
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
      raise ValueError(f"weights must be finite, >= 0 and not all 0, got {weights}")
    if any(e.codec is None for e in envs):
      raise ValueError("every member of a MixtureEnv needs a tokenizer")
    if len({e.codec.tokenizer.sp.serialized_model_proto() for e in envs}) != 1:
      raise ValueError("member environments use different tokenizers")
    self.envs = envs
    self.names = tuple(e.name for e in envs)
    self.weights = np.asarray(weights, np.float64) / sum(weights)
    self.codec = envs[0].codec
    self.max_obs_len = max(e.max_obs_len for e in envs)
    self.max_action_len = max(e.max_action_len for e in envs)
    self.max_turns = max(e.max_turns for e in envs)
    self.num_levels = min(e.num_levels for e in envs)
    self.strategies = tuple(range(max(len(e.strategies) for e in envs)))

  def __repr__(self):
    parts = ", ".join(f"{n}:{w:.2f}" for n, w in zip(self.names, self.weights))
    return f"MixtureEnv({parts})"

  def _levels(self, difficulty):
    if isinstance(difficulty, (list, tuple)):
      if len(difficulty) != len(self.envs):
        raise ValueError(f"got {len(difficulty)} difficulties for {len(self.envs)} members")
      return difficulty
    return (difficulty,) * len(self.envs)

  def generate(self, key: jax.Array, difficulty) -> MixtureInstance:
    """Picks the family by the weights; ``difficulty`` is one level for all
    members or a sequence with one per member."""
    levels = self._levels(difficulty)
    keys = jax.random.split(key, len(self.envs) + 1)
    cumulative = jnp.asarray(np.cumsum(self.weights)[:-1], jnp.float32)
    family = jnp.sum(jax.random.uniform(keys[0]) >= cumulative)
    members = tuple(e.generate(k, d) for e, k, d in zip(self.envs, keys[1:], levels))
    return MixtureInstance(family=family.astype(jnp.int32), members=members)

  def prompt_text(self, instance: MixtureInstance) -> str:
    f = int(instance.family)
    return self.envs[f].prompt_text(instance.members[f])

  def reset(self, instance: MixtureInstance) -> MixtureState:
    return MixtureState(family=instance.family,
                        members=tuple(e.reset(m) for e, m in zip(self.envs, instance.members)))

  def step(self, state: MixtureState, action_A: jax.Array, action_len: jax.Array,
           ) -> tuple[MixtureState, StepOutput]:
    pad = self.codec.ids.pad

    def branch(i):
      def run(members):
        s, out = self.envs[i].step(members[i], action_A, action_len)
        out = out.replace(obs_A=_pad_to(out.obs_A, self.max_obs_len, pad))
        return members[:i] + (s,) + members[i + 1:], out
      return run

    members, out = jax.lax.switch(state.family, [branch(i) for i in range(len(self.envs))],
                                  state.members)
    return state.replace(members=members), out

  def strategy_index(self, strategy) -> jax.Array:
    """Mixture strategies are indices; member ``i`` plays its strategy
    ``index % len(member.strategies)``."""
    if isinstance(strategy, str):
      raise ValueError("a MixtureEnv strategy is an index, not a name "
                       f"(members have {[e.strategies for e in self.envs]})")
    return jnp.asarray(strategy, jnp.int32)

  def reference_action(self, state: MixtureState, key: jax.Array, strategy=0,
                       noise=0.0) -> tuple[jax.Array, jax.Array]:
    strategy = self.strategy_index(strategy)
    pad = self.codec.ids.pad

    def branch(i):
      def run(members):
        a, n = self.envs[i].reference_action(members[i], key, strategy, noise)
        return _pad_to(a, self.max_action_len, pad), n
      return run

    return jax.lax.switch(state.family, [branch(i) for i in range(len(self.envs))],
                          state.members)
