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

from agentic_rl.envs import text_games
from agentic_rl.envs.gem import GemEnv

BUILTIN: dict[str, Callable[..., Any]] = {"guess_number": text_games.GuessNumber}
# Seeds of prompt i by split; streams stay disjoint up to 2**28 prompts each.
SPLIT_OFFSETS = {"train": 0, "validation": 1 << 28, "test": 2 << 28, "demo": 3 << 28}


def load_factory(spec: str) -> Callable[..., Any]:
  """The environment factory ``spec`` names; ValueError saying what is
  accepted when it cannot be loaded."""
  if spec in BUILTIN:
    return BUILTIN[spec]
  if spec.startswith("gem:"):
    return functools.partial(GemEnv, spec[len("gem:"):])
  module, _, attr = spec.partition(":")
  if not module or not attr:
    raise ValueError(f"host_env={spec!r}: expected 'MODULE:FACTORY', 'gem:<id>' or one of "
                     f"{sorted(BUILTIN)}")
  try:
    factory = getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"host_env={spec!r} cannot be loaded: {e}") from None
  if not callable(factory):
    raise ValueError(f"host_env={spec!r} is not callable")
  return factory


def host_kwargs(value) -> dict[str, Any]:
  """``config.tasks.host_kwargs``: a mapping, or a JSON object as a string
  (for the command line: ``--config.tasks.host_kwargs='{"high": 32}'``)."""
  if isinstance(value, str):
    value = json.loads(value) if value.strip() else {}
  if not isinstance(value, Mapping):
    raise ValueError(f"host_kwargs must be a mapping or a JSON object, got {value!r}")
  return dict(value)


class HostTasks:
  """Environments of one factory, and the seeds of each split's prompts."""

  def __init__(self, factory: Callable[..., Any], kwargs: Mapping[str, Any] | None = None):
    self.factory, self.kwargs = factory, dict(kwargs or {})

  def make(self):
    """A fresh environment."""
    return self.factory(**self.kwargs)

  @property
  def has_demonstrations(self) -> bool:
    return callable(getattr(self.make(), "demonstration", None))

  def seeds(self, split: str, ids) -> np.ndarray:
    """int64 ``[N]``: the ``reset`` seed of prompts ``ids`` of ``split``."""
    return SPLIT_OFFSETS[split] + np.asarray(ids, np.int64)

  def difficulty_of(self, ids) -> np.ndarray:
    """Host environments have one difficulty level, 0."""
    return np.zeros(np.shape(ids), np.int64)
