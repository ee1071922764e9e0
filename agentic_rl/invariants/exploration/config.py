"""``ExplorationConfig``: the switches of the exploration controllers (I1).

Only the controller / schedule side lives here: the adaptive entropy-bonus
coefficient and the sampling-temperature schedule. Clip-higher, Clip-Cov /
KL-Cov and the pass@k advantage are loss terms and belong to
``agentic_rl.objectives``. Defaults are off: no entropy bonus, constant
temperature 1.
"""

from __future__ import annotations

import dataclasses

from agentic_rl.invariants.alarms import Band, validate_bands
from agentic_rl.invariants.checks import check_choice, check_float, check_int

TEMPERATURE_SCHEDULES = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True)
class ExplorationConfig:
  """Exploration controls and the ``explore/*`` alarm bands.

  Attributes:
    entropy_coef: coefficient of the entropy bonus (0: no bonus); the initial
      value when ``entropy_band`` is set.
    entropy_band: target band of ``explore/entropy`` (nats per token). When set,
      the coefficient is multiplied by ``entropy_coef_factor`` while the entropy
      is below the band and divided by it while above (``band_update``).
    entropy_coef_factor: > 1, the multiplicative step.
    entropy_coef_min, entropy_coef_max: bounds on the adaptive coefficient.
    temperature: sampling temperature at step 0.
    temperature_final: temperature reached at ``temperature_steps`` and kept
      after (Kimi K2's decay); ignored by the ``constant`` schedule.
    temperature_schedule: ``constant``, ``linear`` or ``cosine``.
    temperature_steps: length of the decay, in training steps.
    bands: alarm bands, ``(("explore/...", Band), ...)``. The default fires
      when successful strategies per solved group average below 1.05, i.e.
      nearly every solved group succeeds one way only (collapse to a single
      path); tune it per task.
  """

  entropy_coef: float = 0.0
  entropy_band: Band | None = None
  entropy_coef_factor: float = 1.1
  entropy_coef_min: float = 1e-5
  entropy_coef_max: float = 0.1
  temperature: float = 1.0
  temperature_final: float = 1.0
  temperature_schedule: str = "constant"
  temperature_steps: int = 0
  bands: tuple[tuple[str, Band], ...] = (("explore/distinct_success_seqs_solved", Band(low=1.05)),)

  def __post_init__(self):
    check_float("entropy_coef", self.entropy_coef, low=0.0)
    if self.entropy_band is not None:
      if not isinstance(self.entropy_band, Band):
        raise ValueError(f"entropy_band must be a Band or None, got {self.entropy_band!r}")
      check_float("entropy_coef_factor", self.entropy_coef_factor, low=1.0, low_open=True)
      check_float("entropy_coef_min", self.entropy_coef_min, low=0.0, low_open=True)
      check_float("entropy_coef_max", self.entropy_coef_max, low=self.entropy_coef_min)
      if not self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max:
        raise ValueError(f"an adaptive entropy_coef={self.entropy_coef} must start inside "
                         f"[entropy_coef_min, entropy_coef_max] = [{self.entropy_coef_min}, "
                         f"{self.entropy_coef_max}]")
    check_float("temperature", self.temperature, low=0.0, low_open=True)
    check_float("temperature_final", self.temperature_final, low=0.0, low_open=True)
    check_choice("temperature_schedule", self.temperature_schedule, TEMPERATURE_SCHEDULES)
    check_int("temperature_steps", self.temperature_steps, minimum=0)
    if self.temperature_schedule != "constant" and self.temperature_steps == 0:
      raise ValueError(f"temperature_schedule={self.temperature_schedule!r} needs "
                       "temperature_steps > 0")
    validate_bands(self.bands, "explore")

  @property
  def adaptive_entropy(self) -> bool:
    """Whether the entropy-bonus coefficient follows ``entropy_band``."""
    return self.entropy_band is not None

  @property
  def scheduled_temperature(self) -> bool:
    """Whether the sampling temperature changes over training."""
    return self.temperature_schedule != "constant"
