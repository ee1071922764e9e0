"""Which Python environment a name means: the factories of
``config.tasks.host_env`` and the callables of ``"MODULE:NAME"`` options.

``"MODULE:ATTR"`` is any importable callable returning a text environment,
``"gem:<id>"`` a GEM game through :class:`~agentic_rl.envs.gem.GemEnv`,
``"reasoning_gym:<dataset>"`` a reasoning-gym dataset through
:class:`~agentic_rl.envs.reasoning.ReasoningGymEnv`, and the built-in names
are :data:`BUILTIN`.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from agentic_rl.envs import swarm, text_games
from agentic_rl.envs.gem import GemEnv
from agentic_rl.envs.reasoning import ReasoningGymEnv

BUILTIN: dict[str, Callable[..., Any]] = {"guess_number": text_games.GuessNumber,
                                           "ledger": text_games.Ledger,
                                           "calculator": text_games.Calculator,
                                           "parallel_hops": swarm.ParallelHops}


def load_factory(spec: str) -> Callable[..., Any]:
  """The environment factory ``spec`` names; ValueError saying what is
  accepted when it cannot be loaded."""
  if spec in BUILTIN:
    return BUILTIN[spec]
  if spec.startswith("gem:"):
    return functools.partial(GemEnv, spec[len("gem:"):])
  if spec.startswith("reasoning_gym:"):
    return functools.partial(ReasoningGymEnv, spec[len("reasoning_gym:"):])
  return load_callable(spec, "host_env", "'MODULE:FACTORY', 'gem:<id>', "
                       f"'reasoning_gym:<dataset>' or one of {sorted(BUILTIN)}")


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
