"""Python ("host") environments as the trainer's task source.

``config.tasks.source="host"`` with ``config.tasks.host_env`` naming a
factory (:func:`agentic_rl.envs.factories.load_factory`). The factory is called
with ``config.tasks.host_kwargs`` once per rollout row.

Prompt ``i`` of a split is the episode ``reset(seed)`` with
``seed = SPLIT_OFFSETS[split] + i``: the training, held-out and
demonstration seeds are disjoint streams, and a group of G rollouts is G
episodes of one seed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from agentic_rl.envs import remote

# Seeds of prompt i by split; streams stay disjoint up to 2**28 prompts each.
SPLIT_OFFSETS = {"train": 0, "validation": 1 << 28, "test": 2 << 28, "demo": 3 << 28}



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
