"""``ShiftConfig``: the switches of the distribution-shift controllers (I3).

Defaults are off: no staleness bound, partial-rollout segments kept, greedy
(first-finished) collection. The behaviour/learner importance corrections
(TIS, MIS / IcePop, OPSM, decoupled PPO) are loss terms and live in
``agentic_rl.objectives.corrections`` (``ObjectiveConfig.correction``); this
package monitors the mismatch they correct.
"""

from __future__ import annotations

import dataclasses

from agentic_rl.invariants.alarms import Band, validate_bands
from agentic_rl.invariants.checks import check_choice, check_float, check_int

STALE_MODES = ("drop", "downweight")
PARTIAL_ROLLOUT_MODES = ("keep", "mask", "restart")


@dataclasses.dataclass(frozen=True)
class ShiftConfig:
  """Bounds on the gap between the behaviour and learner policies.

  Attributes:
    max_staleness: tokens produced more than this many policy versions before
      the learner's current version never enter an update (None: no bound;
      0: on-policy tokens only).
    stale_mode: ``drop`` (weight 0 beyond the bound, 1 within) or
      ``downweight`` (also ``stale_decay ** staleness`` within the bound).
    stale_decay: in (0, 1], the per-version factor of ``downweight``.
    partial_rollout: what happens to the segments of a partial rollout made by
      parameters older than the sequence's newest segment: ``mask`` (weight 0:
      train on the newest policy's tokens only, like Kimi k1.5 and slime's
      ``--mask-offpolicy-in-partial-rollout``), ``keep`` (they enter the
      loss; to correct them, set an ``ObjectiveConfig.correction``, whose
      ratio uses each token's own behaviour log-prob) or ``restart`` (the
      actor replays every episode still running when new weights arrive
      from its start, so each episode is made by one version).
    adaptive_staleness: let the staleness controller
      (``controllers.update_staleness_bound``) tighten the actor's bound
      below ``max_staleness`` while ``shift/kl_behaviour_learner`` is above
      its band, and loosen it back after ``staleness_patience`` iterations
      inside it.
    staleness_patience: iterations in the band before the bound loosens.
    fifo_window_ratio: windowed-FIFO collection in asynchronous mode: only
      finished groups among the first ``ceil(ratio * P)`` launched and not yet
      collected may be taken (P groups per batch, ratio >= 1). None: greedy,
      any finished group.
    bands: alarm bands, ``(("shift/...", Band), ...)``; the default K3 KL bound
      is above what dense models typically show (1e-5 to 1e-3).
  """

  max_staleness: int | None = None
  stale_mode: str = "drop"
  stale_decay: float = 1.0
  partial_rollout: str = "keep"
  fifo_window_ratio: float | None = None
  adaptive_staleness: bool = False
  staleness_patience: int = 3
  bands: tuple[tuple[str, Band], ...] = (("shift/kl_behaviour_learner", Band(high=1e-2)),)

  def __post_init__(self):
    if self.max_staleness is not None:
      check_int("max_staleness", self.max_staleness, minimum=0)
    check_choice("stale_mode", self.stale_mode, STALE_MODES)
    check_float("stale_decay", self.stale_decay, low=0.0, high=1.0, low_open=True)
    if self.stale_mode == "downweight" and self.max_staleness is None:
      raise ValueError("stale_mode='downweight' needs max_staleness")
    check_choice("partial_rollout", self.partial_rollout, PARTIAL_ROLLOUT_MODES)
    if self.fifo_window_ratio is not None:
      check_float("fifo_window_ratio", self.fifo_window_ratio, low=1.0)
    check_int("staleness_patience", self.staleness_patience, minimum=1)
    if self.adaptive_staleness and not self.max_staleness:
      raise ValueError("adaptive_staleness needs max_staleness >= 1 (the bound it moves under)")
    if self.adaptive_staleness and "shift/kl_behaviour_learner" not in dict(self.bands):
      raise ValueError("adaptive_staleness needs a band for shift/kl_behaviour_learner")
    validate_bands(self.bands, "shift")
