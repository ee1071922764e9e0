"""Small Python-side validators for the invariant configs and host-side inputs.

They raise ``ValueError`` naming the offending field, so bad configuration is
caught before anything is traced or compiled.
"""

from __future__ import annotations

import math
from typing import Any


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(f"{name}={value!r} is not one of {choices}")


def check_int(name: str, value: Any, minimum: int | None = None) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"{name} must be an int, got {value!r}")
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_float(name: str, value: Any, low: float = -math.inf, high: float = math.inf,
                low_open: bool = False, high_open: bool = False) -> None:
  """``value`` is a real number in ``[low, high]`` (or open at either end)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
    raise ValueError(f"{name} must be a number, got {value!r}")
  too_low = value <= low if low_open else value < low
  too_high = value >= high if high_open else value > high
  if too_low or too_high:
    lb = "(" if low_open else "["
    hb = ")" if high_open else "]"
    raise ValueError(f"{name}={value} is outside {lb}{low}, {high}{hb}")
