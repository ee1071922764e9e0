"""Invariant alarms: a band per metric, a check, a console line, and a band controller.

Each invariant's config carries ``bands``: ``(metric_name, Band)`` pairs. After a
step the trainer calls ``check_alarms(metrics, bands)``; an alarm is raised when
a metric leaves its band (``low <= value <= high`` is inside; NaN is outside).
``alarm_metrics`` turns the result into ``alarm/<name>`` scalars for the metrics
file, ``format_alarms`` into a console line.

``band_update`` is the reaction side: a multiplicative controller that moves a
positive knob (an entropy-bonus coefficient, a temperature) so that the metric
it drives comes back into its band.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Band:
  """The closed interval ``[low, high]`` a metric should stay in.

  Either side may be infinite (the default), for a one-sided band such as
  ``Band(high=0.5)`` for ``signal/zero_variance_frac``.
  """

  low: float = -math.inf
  high: float = math.inf

  def __post_init__(self):
    for name in ("low", "high"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"Band.{name} must be a number, got {value!r}")
      if math.isnan(value):
        raise ValueError(f"Band.{name} is NaN")
    if self.low > self.high:
      raise ValueError(f"Band low={self.low} is above high={self.high}")

  def contains(self, value: float) -> bool:
    """Whether ``value`` lies in the band (NaN never does)."""
    return bool(self.low <= value <= self.high)


def validate_bands(bands: Any, prefix: str) -> None:
  """Checks a config's ``bands`` field: ``(name, Band)`` pairs named ``prefix/...``.

  Raises:
    ValueError: naming the first malformed entry.
  """
  if not isinstance(bands, tuple):
    raise ValueError(f"bands must be a tuple of (name, Band) pairs, got {type(bands).__name__}")
  seen = set()
  for entry in bands:
    if (not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], str)
        or not isinstance(entry[1], Band)):
      raise ValueError(f"bands entry {entry!r} is not a (name, Band) pair")
    name = entry[0]
    if not name.startswith(prefix + "/"):
      raise ValueError(f"band {name!r} does not belong to this invariant (expected '{prefix}/...')")
    if name in seen:
      raise ValueError(f"band {name!r} is given twice")
    seen.add(name)


def _as_float(value: Any) -> float:
  return float(jax.device_get(value))


def check_alarms(metrics: Mapping[str, Any], bands: Mapping[str, Band]) -> dict[str, bool]:
  """Which metrics are outside their band.

  Args:
    metrics: metric name -> scalar (Python number or 0-d array).
    bands: metric name -> Band. Names absent from ``metrics`` are skipped (for
      example ``eval/*`` metrics on steps without evaluation).

  Returns:
    name -> True when the metric is outside its band (an alarm), for every band
    whose metric is present.
  """
  return {name: not band.contains(_as_float(metrics[name]))
          for name, band in bands.items() if name in metrics}


def alarm_metrics(alarms: Mapping[str, bool]) -> dict[str, float]:
  """``{"alarm/<name>": 1.0 or 0.0}`` for the metrics file."""
  return {f"alarm/{name}": float(fired) for name, fired in alarms.items()}


def format_alarms(metrics: Mapping[str, Any], bands: Mapping[str, Band]) -> str:
  """One console line listing every metric outside its band, or ``""``.

  Example: ``ALARM signal/zero_variance_frac=0.625 not in [-inf, 0.5]``.
  """
  fired = [name for name, bad in check_alarms(metrics, bands).items() if bad]
  parts = [f"{name}={_as_float(metrics[name]):.4g} not in [{bands[name].low:g}, {bands[name].high:g}]"
           for name in fired]
  return ("ALARM " + "; ".join(parts)) if parts else ""


def band_update(knob: jax.Array, value: jax.Array, band: Band, factor: float,
                knob_min: float, knob_max: float, raise_when_low: bool = True) -> jax.Array:
  """One step of a multiplicative band controller (jittable).

  With ``raise_when_low`` (a knob that pushes the metric up, such as an entropy
  bonus coefficient): ``knob * factor`` when ``value < band.low``,
  ``knob / factor`` when ``value > band.high``, unchanged inside the band; the
  result is clipped to ``[knob_min, knob_max]``. ``raise_when_low=False``
  reverses the direction. A NaN ``value`` leaves the knob unchanged.

  Args:
    knob: float scalar, the current setting.
    value: float scalar, the metric the knob drives.
    band: the target band of ``value``.
    factor: > 1, the multiplicative step.
    knob_min, knob_max: bounds on the knob.

  Returns:
    float32 scalar, the new setting.
  """
  if not factor > 1.0:
    raise ValueError(f"band_update factor must be > 1, got {factor}")
  if not 0.0 <= knob_min <= knob_max:
    raise ValueError(f"band_update needs 0 <= knob_min <= knob_max, got {knob_min}, {knob_max}")
  up = jnp.float32(factor if raise_when_low else 1.0 / factor)
  knob = jnp.asarray(knob, jnp.float32)
  value = jnp.asarray(value, jnp.float32)
  scale = jnp.where(value < band.low, up, jnp.where(value > band.high, 1.0 / up, 1.0))
  return jnp.clip(knob * scale, knob_min, knob_max)
