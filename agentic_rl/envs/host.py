"""Python ("host") environments as the trainer's task source.

``config.tasks.source="host"`` with ``config.tasks.host_env`` naming a
factory: ``"MODULE:ATTR"`` (any importable callable returning a text
environment), ``"gem:<id>"`` (a GEM game through :class:`~agentic_rl.envs.
gem.GemEnv`), or a built-in name (:data:`BUILTIN`). The factory is called
with ``config.tasks.host_kwargs`` once per rollout row.

Prompt ``i`` of a split is the episode ``reset(seed)`` with
``seed = SPLIT_OFFSETS[split] + i``: the training, held-out and
demonstration seeds are disjoint streams, and a group of G rollouts is G
episodes of one seed.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from agentic_rl.envs import remote, swarm, text_games
from agentic_rl.envs.gem import GemEnv

BUILTIN: dict[str, Callable[..., Any]] = {"guess_number": text_games.GuessNumber,
                                           "ledger": text_games.Ledger,
                                           "parallel_hops": swarm.ParallelHops}
# Seeds of prompt i by split; streams stay disjoint up to 2**28 prompts each.
SPLIT_OFFSETS = {"train": 0, "validation": 1 << 28, "test": 2 << 28, "demo": 3 << 28}


def load_factory(spec: str) -> Callable[..., Any]:
  """The environment factory ``spec`` names; ValueError saying what is
  accepted when it cannot be loaded."""
  if spec in BUILTIN:
    return BUILTIN[spec]
  if spec.startswith("gem:"):
    return functools.partial(GemEnv, spec[len("gem:"):])
  return load_callable(spec, "host_env", f"'MODULE:FACTORY', 'gem:<id>' or one of "
                       f"{sorted(BUILTIN)}")


def load_callable(spec: str, what: str, expected: str = "'MODULE:NAME'") -> Callable[..., Any]:
  """The callable ``"MODULE:NAME"`` names; ValueError naming ``what`` (the
  config key) and the ``expected`` form when it cannot be loaded."""
  module, _, attr = spec.partition(":")
  if not module or not attr:
    raise ValueError(f"{what}={spec!r}: expected {expected}")
  try:
    fn = getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"{what}={spec!r} cannot be loaded: {e}") from None
  if not callable(fn):
    raise ValueError(f"{what}={spec!r} is not callable")
  return fn


def host_kwargs(value) -> dict[str, Any]:
  """``config.tasks.host_kwargs``: a mapping, or a JSON object as a string
  (for the command line: ``--config.tasks.host_kwargs='{"high": 32}'``)."""
  if isinstance(value, str):
    value = json.loads(value) if value.strip() else {}
  if not isinstance(value, Mapping):
    raise ValueError(f"host_kwargs must be a mapping or a JSON object, got {value!r}")
  return dict(value)


class HostTasks:
  """Environments of one factory, and the seeds of each split's prompts.

  ``pool`` is where each environment runs (:data:`agentic_rl.envs.remote.
  ENV_POOLS`): "threads" builds it here; "processes" and "ray" build it
  from ``spec`` (the factory's name) in a process or Ray actor of its own.
  """

  def __init__(self, factory: Callable[..., Any], kwargs: Mapping[str, Any] | None = None,
               *, spec: str = "", pool: str = "threads"):
    if pool not in remote.ENV_POOLS:
      raise ValueError(f"env_pool must be one of {remote.ENV_POOLS}, got {pool!r}")
    if pool != "threads" and not spec:
      raise ValueError(f"env_pool={pool!r} builds environments from the factory's name: "
                       "pass spec")
    self.factory, self.kwargs, self.spec, self.pool = factory, dict(kwargs or {}), spec, pool

  def make(self):
    """A fresh environment (or a proxy of one in another process)."""
    if self.pool == "threads":
      return self.factory(**self.kwargs)
    return remote.make_env(self.pool, self.spec, self.kwargs)

  def replace(self, env):
    """A fresh environment for one whose call ran past its time limit (it may
    still be running: it is closed, where it can be, and never reused)."""
    if callable(close := getattr(env, "close", None)):
      try:
        close()
      except Exception:  # pylint: disable=broad-except
        pass
    return self.make()

  @property
  def has_demonstrations(self) -> bool:
    return callable(getattr(self.make(), "demonstration", None))

  def seeds(self, split: str, ids) -> np.ndarray:
    """int64 ``[N]``: the ``reset`` seed of prompts ``ids`` of ``split``."""
    return SPLIT_OFFSETS[split] + np.asarray(ids, np.int64)

  def difficulty_of(self, ids) -> np.ndarray:
    """Host environments have one difficulty level, 0."""
    return np.zeros(np.shape(ids), np.int64)
