"""Invariant I3, bounded distribution shift: monitors and controllers.

- ``monitors``: staleness (mean, max, histogram) and behaviour/learner
  mismatch (log-prob gap, K3 KL, importance ratios);
- ``weights``: per-token loss weights enforcing ``max_staleness`` and masking
  partial-rollout segments;
- ``controllers``: the adaptive staleness bound;
- ``fifo``: windowed-FIFO collection of finished groups in asynchronous mode.

Switches live in ``ShiftConfig``; everything defaults to off. The
behaviour/learner corrections (TIS, MIS / IcePop, OPSM) are loss terms in
``agentic_rl.objectives.corrections``.
"""

from agentic_rl.invariants.shift.config import ShiftConfig
from agentic_rl.invariants.shift.controllers import (StalenessBound, init_staleness_bound,
                                                     update_staleness_bound)
from agentic_rl.invariants.shift.fifo import (LaunchQueue, collect, fifo_window, finish,
                                              init_queue, launch)
from agentic_rl.invariants.shift.monitors import (check_versions, mismatch_metrics,
                                                  shift_metrics, staleness,
                                                  staleness_histogram)
from agentic_rl.invariants.shift.weights import (partial_rollout_weights, shift_weights,
                                                 staleness_weights)

__all__ = [
    "LaunchQueue", "ShiftConfig", "StalenessBound", "init_staleness_bound",
    "update_staleness_bound", "check_versions", "collect", "fifo_window", "finish",
    "init_queue", "launch", "mismatch_metrics", "partial_rollout_weights", "shift_metrics",
    "shift_weights", "staleness", "staleness_histogram", "staleness_weights",
]
