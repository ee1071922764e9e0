"""Small helpers shared by the experiment scripts."""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(path: str, obj: Any, **dump_kwargs) -> None:
  """Writes ``obj`` as JSON to ``path``, creating its folder (``indent=2`` by default)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(obj, f, **{"indent": 2, **dump_kwargs})
