"""Task instances by split and index, rendered to prompt ids.

Instance ``i`` of a split is the environment's seeded stream
(``agentic_rl.envs.splits``: the one definition, shared with the task
datasets), so train, validation and test draw from disjoint key streams.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.envs import prompts as prompts_lib
from agentic_rl.envs import splits
from agentic_rl.text import codec as codec_lib


class Tasks:
  """Instances of one environment (or mixture); prompt ``i`` of every split has
  difficulty ``levels[i % len(levels)]``."""

  def __init__(self, env, *, seed: int, difficulty: int | Sequence[int], prompt_len: int):
    self.env = env
    self.seed = seed
    self.levels = tuple(int(d) for d in difficulty_levels(difficulty))
    self.prompt_len = prompt_len

  def difficulty_of(self, ids) -> np.ndarray:
    """int ``[N]``: the difficulty level of prompts ``ids``."""
    return np.asarray(self.levels)[np.asarray(ids) % len(self.levels)]

  def instances(self, split: str, ids: np.ndarray):
    """Instance pytree with leading axis ``len(ids)``."""
    ids = np.asarray(ids)
    return generate_levels(self.env, splits.instance_keys(self.seed, split, ids),
                           self.difficulty_of(ids))

  def prompts(self, instances) -> tuple[np.ndarray, np.ndarray]:
    """``(prompts_NxL, prompt_len_N)``: the codec's prompt ids, right-padded."""
    return encode_prompts(self.env, instances, self.prompt_len)


def difficulty_levels(difficulty) -> tuple:
  """``config.tasks.difficulty`` (one level, or a sequence of them) as a tuple."""
  return tuple(difficulty) if isinstance(difficulty, Sequence) else (difficulty,)


@functools.partial(jax.jit, static_argnums=(0, 2))
def generate(env, keys_N: jax.Array, difficulty: int):
  """``vmap(env.generate)`` over keys, compiled once per environment."""
  return jax.vmap(lambda k: env.generate(k, difficulty))(keys_N)


def generate_levels(env, keys_N: jax.Array, levels_N: np.ndarray):
  """``generate`` with a difficulty level per row (one compile per level)."""
  levels_N = np.asarray(levels_N)
  unique = np.unique(levels_N)
  if len(unique) == 1:
    return generate(env, keys_N, int(unique[0]))
  rows = [np.flatnonzero(levels_N == level) for level in unique]
  parts = [generate(env, keys_N[r], int(level)) for r, level in zip(rows, unique)]
  inverse = np.argsort(np.concatenate(rows))
  return jax.tree.map(lambda *xs: jnp.concatenate(xs)[inverse], *parts)


class PromptTooLong(ValueError):
  """A task prompt of ``length`` tokens is longer than ``limit``."""

  def __init__(self, length: int, limit: int):
    super().__init__(f"a task prompt of {length} tokens is longer than prompt_len={limit}")
    self.length, self.limit = length, limit


def encode_prompts(env, instances, prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
  """``(prompts_NxL, prompt_len_N)`` for a batch of instances of ``env``;
  raises :class:`PromptTooLong` when one is longer than ``prompt_len``."""
  instances = jax.tree.map(np.asarray, instances)
  n = jax.tree.leaves(instances)[0].shape[0]
  codec = env.codec
  rows = [codec.encode_prompt(prompts_lib.prompt_messages(
      env, jax.tree.map(lambda x, i=i: x[i], instances))) for i in range(n)]
  lens = np.array([len(r) for r in rows], np.int32)
  if lens.max(initial=0) > prompt_len:
    raise PromptTooLong(int(lens.max()), prompt_len)
  return codec_lib.pad_batch(rows, prompt_len, codec.ids.pad), lens
