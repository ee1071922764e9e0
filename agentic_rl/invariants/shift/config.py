"""``ShiftConfig``: the switches of the distribution-shift controllers (I3).

Defaults are off: no staleness bound, partial-rollout segments kept, no
behaviour/learner correction, greedy (first-finished) collection.
"""

from __future__ import annotations

import dataclasses

from agentic_rl.invariants.alarms import Band, validate_bands
from agentic_rl.invariants.checks import check_choice, check_float, check_int

STALE_MODES = ("drop", "downweight")
PARTIAL_ROLLOUT_MODES = ("keep", "mask", "correct")
CORRECTIONS = ("none", "tis", "mis", "mask", "opsm")
CORRECTION_LEVELS = ("token", "sequence", "geometric")


@dataclasses.dataclass(frozen=True)
class ShiftConfig:
  """Bounds and corrections on the gap between the behaviour and learner policies.

  Attributes:
    max_staleness: tokens produced more than this many policy versions before
      the learner's current version never enter an update (None: no bound;
      0: on-policy tokens only).
    stale_mode: ``drop`` (weight 0 beyond the bound, 1 within) or
      ``downweight`` (also ``stale_decay ** staleness`` within the bound).
    stale_decay: in (0, 1], the per-version factor of ``downweight``.
    partial_rollout: what happens to the segments of a partial rollout made by
      parameters older than the sequence's newest segment: ``keep``, ``mask``
      (weight 0: train on the newest policy's tokens only, like Kimi k1.5 and
      slime's ``--mask-offpolicy-in-partial-rollout``) or ``correct`` (keep
      them and rely on the behaviour/learner ``correction``, which must then
      be set).
    correction: the behaviour/learner importance correction, computed from
      ``r_t = pi_learner(y_t) / pi_behaviour(y_t)`` (``algorithms.md`` §9.6):
      ``none``; ``tis`` (truncate: ``min(r, tis_clip)``); ``mis`` (mask:
      ``r`` inside ``[ratio_low, ratio_high]``, else 0; IcePop at token level);
      ``mask`` (weight 1 inside the band, 0 outside; Kimi K2.5's token-level
      mask / Geo-RS at geometric level); ``opsm`` (DeepSeek-V3.2: drop a
      sequence with negative advantage whose mean ``log(pi_behaviour /
      pi_learner)`` exceeds ``opsm_delta``).
    correction_level: where the ratio is taken for ``tis``, ``mis`` and
      ``mask``: ``token`` (r_t), ``sequence`` (``prod_t r_t``) or ``geometric``
      (``(prod_t r_t)^(1/|y|)``). ``opsm`` is sequence-level by definition and
      takes ``token`` here.
    tis_clip: C of TIS, > 0 (slime's default 2).
    ratio_low, ratio_high: the band of ``mis`` and ``mask`` (IcePop 0.5, 5).
    opsm_delta: delta of OPSM (slime's default 1e-4).
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
  correction: str = "none"
  correction_level: str = "token"
  tis_clip: float = 2.0
  ratio_low: float = 0.5
  ratio_high: float = 5.0
  opsm_delta: float = 1e-4
  fifo_window_ratio: float | None = None
  bands: tuple[tuple[str, Band], ...] = (("shift/kl_behaviour_learner", Band(high=1e-2)),)

  def __post_init__(self):
    if self.max_staleness is not None:
      check_int("max_staleness", self.max_staleness, minimum=0)
    check_choice("stale_mode", self.stale_mode, STALE_MODES)
    check_float("stale_decay", self.stale_decay, low=0.0, high=1.0, low_open=True)
    if self.stale_mode == "downweight" and self.max_staleness is None:
      raise ValueError("stale_mode='downweight' needs max_staleness")
    check_choice("partial_rollout", self.partial_rollout, PARTIAL_ROLLOUT_MODES)
    check_choice("correction", self.correction, CORRECTIONS)
    check_choice("correction_level", self.correction_level, CORRECTION_LEVELS)
    if self.partial_rollout == "correct" and self.correction == "none":
      raise ValueError("partial_rollout='correct' needs a correction (tis, mis, mask or opsm)")
    if self.correction == "opsm" and self.correction_level != "token":
      raise ValueError("correction='opsm' is sequence-level by definition; leave "
                       "correction_level='token'")
    check_float("tis_clip", self.tis_clip, low=0.0, low_open=True)
    check_float("ratio_low", self.ratio_low, low=0.0)
    check_float("ratio_high", self.ratio_high, low=self.ratio_low, low_open=True)
    check_float("opsm_delta", self.opsm_delta, low=0.0)
    if self.fifo_window_ratio is not None:
      check_float("fifo_window_ratio", self.fifo_window_ratio, low=1.0)
    validate_bands(self.bands, "shift")
