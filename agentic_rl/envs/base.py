"""The protocol every in-jit (pure-JAX) environment follows.

An environment is a task family written as pure functions over pytrees: no
Python control flow on traced values, vmappable over a batch of episodes, and
callable inside the rollout engine's ``lax.while_loop``.

Life of an episode (one row of a batch):

1. ``instance = env.generate(key, difficulty)`` makes a task instance (a pytree
   of fixed-shape arrays: the hidden data and the answer). Host code renders
   ``env.prompt_text(instance)`` through the conversation codec into prompt
   token ids.
2. ``state = env.reset(instance)`` starts the episode.
3. Whenever the policy closes a tool call or an answer, the rollout engine calls
   ``state, out = env.step(state, action_A, action_len)`` with the token ids of
   the completed action segment: everything the policy generated since the
   previous observation, up to and including the closing tag
   (``</tool_call>`` or ``</answer>``), padded to ``max_action_len``.
4. ``out.obs_A`` (padded to ``max_obs_len``, ``out.obs_len`` valid) is the raw
   content of the tool result. The engine wraps it in the codec's tool-result
   framing and forces it into the context with loss mask 0. A malformed or
   unknown call yields an error observation, and the episode goes on.
5. The episode ends when ``out.done`` (answer given) or ``out.truncated``
   (turn limit) is set. Rewards arrive in ``out.reward`` (the config-weighted
   sum) and ``out.reward_components`` (every named component, reported apart).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import numpy as np
from flax import struct

PyTree = Any


class EqualByValue:
  """Equality and hash by attribute values, for environments.

  ``jax.jit`` keys a static argument by its hash and equality: two
  environments built alike (each run builds its own) then share the
  programs compiled for either, such as the scripted rollouts of the SFT
  demonstrations. Arrays compare by contents, dataclasses by their fields,
  the ``codec`` attribute by its framing ids (all that jitted environment
  code reads of it; token tables are attributes of their own), any other
  object by identity. Attributes must not change after construction: the
  key is computed once.
  """

  def _value_key(self):
    key = self.__dict__.get("_value_key_cache")
    if key is None:
      codec = self.__dict__.get("codec")
      key = (type(self), None if codec is None else codec.ids,
             _frozen({k: v for k, v in vars(self).items()
                      if k not in ("codec", "_value_key_cache")}))
      self.__dict__["_value_key_cache"] = key
    return key

  def __eq__(self, other):
    return type(other) is type(self) and self._value_key() == other._value_key()

  def __hash__(self):
    return hash(self._value_key())


def _frozen(value):
  """A hashable stand-in for ``value`` that is equal exactly when it is."""
  if isinstance(value, EqualByValue):
    return value
  if isinstance(value, (np.ndarray, jax.Array, np.generic)):
    a = np.asarray(value)
    return ("array", a.dtype.str, a.shape, a.tobytes())
  if isinstance(value, dict):
    return ("dict", tuple(sorted((k, _frozen(v)) for k, v in value.items())))
  if isinstance(value, (list, tuple)):
    return (type(value), tuple(_frozen(v) for v in value))
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return (type(value), tuple((f.name, _frozen(getattr(value, f.name)))
                               for f in dataclasses.fields(value)))
  if isinstance(value, (str, bytes, int, float, bool, type(None))):
    return value
  return ("object", id(value))  # anything else: equal only to itself


@struct.dataclass
class StepOutput:
  """What an environment step returns (shapes for one episode; vmap adds B).

  Attributes:
    obs_A: int32 ``[max_obs_len]`` observation token ids, padded with pad id.
    obs_len: int32 ``[]`` number of valid observation tokens.
    reward: float32 ``[]`` weighted sum of the components for this step.
    reward_components: dict of float32 ``[]`` (``outcome``, ``format``,
      ``efficiency``, ...), the same keys at every step.
    done: bool ``[]`` the episode ended with an answer.
    truncated: bool ``[]`` the episode ended on a limit.
    info: dict of arrays (for example ``tool_calls``, ``tool_errors``,
      ``tool_id`` of this call), the same keys at every step.
  """

  obs_A: jax.Array
  obs_len: jax.Array
  reward: jax.Array
  reward_components: dict[str, jax.Array]
  done: jax.Array
  truncated: jax.Array
  info: dict[str, jax.Array]


class JaxEnv(Protocol):
  """A task family runnable inside ``jax.jit`` (see the module docstring).

  ``max_turns`` is the number of actions after which the episode is
  truncated; ``codec`` is the conversation codec its token ids belong to.
  An environment is a static argument of the rollout programs: one that
  subclasses :class:`EqualByValue` shares them with any environment built
  alike, any other compares by identity (its programs compile per run).
  """

  name: str
  max_obs_len: int
  max_action_len: int
  max_turns: int
  codec: Any

  def generate(self, key: jax.Array, difficulty: int) -> PyTree:
    ...

  def prompt_text(self, instance: PyTree) -> str:
    ...

  def reset(self, instance: PyTree) -> PyTree:
    ...

  def step(self, state: PyTree, action_A: jax.Array,
           action_len: jax.Array) -> tuple[PyTree, StepOutput]:
    ...


class ScriptedEnv(JaxEnv, Protocol):
  """A ``JaxEnv`` with scripted reference policies (for SFT data and tests).

  ``reference_action`` is jittable and vmappable; ``strategy`` is a name from
  ``strategies`` or an index (traced allowed), ``noise`` the per-action
  mistake probability. ``strategy_index`` normalises a strategy argument.
  """

  strategies: tuple

  def strategy_index(self, strategy) -> jax.Array:
    ...

  def reference_action(self, state: PyTree, key: jax.Array, strategy=0,
                       noise=0.0) -> tuple[jax.Array, jax.Array]:
    ...
