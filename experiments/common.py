"""Small helpers shared by the experiment scripts."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any


def write_json(path: str, obj: Any, **dump_kwargs) -> None:
  """Writes ``obj`` as JSON to ``path``, creating its folder (``indent=2`` by default)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(obj, f, **{"indent": 2, **dump_kwargs})


def time_interleaved(contenders: Mapping[Hashable, Callable[[], Any]], *, warmup: int,
                     repeats: int, calls: int = 1) -> dict[Hashable, list[float]]:
  """Seconds per call of each contender (each blocks until its work is done).

  ``warmup`` untimed calls each, then ``repeats`` rounds; a round times
  ``calls`` calls in a row of every contender, in an order reversed every
  round so that no contender always follows the same one. Returns the
  ``repeats`` mean seconds per call of each.
  """
  for fn in contenders.values():
    for _ in range(warmup):
      fn()
  times = {key: [] for key in contenders}
  order = list(contenders)
  for _ in range(repeats):
    for key in order:
      start = time.perf_counter()
      for _ in range(calls):
        contenders[key]()
      times[key].append((time.perf_counter() - start) / calls)
    order.reverse()
  return times
