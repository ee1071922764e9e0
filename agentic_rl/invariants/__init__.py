"""The three invariants of an agentic RL run, each with its monitors and controllers.

- ``exploration`` (I1): keep several distinct, feasible behaviour paths;
- ``signal`` (I2): keep groups' outcomes mixed so the batch carries gradient;
- ``shift`` (I3): keep staleness and behaviour/learner drift bounded and
  corrected;
- ``alarms``: a band per metric, the check, the console line and the band
  controller shared by all three.

Monitors are jittable array math returning ``dict[str, scalar]`` under the
trainer's metric names; host-side controllers (sampling, allocation,
collection) are numpy driven by user-supplied samplers. Each invariant is
switched from its config dataclass (``ExplorationConfig``, ``SignalConfig``,
``ShiftConfig``), validated on construction.
"""

from agentic_rl.invariants import alarms, exploration, shift, signal
from agentic_rl.invariants.alarms import Band, alarm_metrics, check_alarms, format_alarms
from agentic_rl.invariants.exploration import ExplorationConfig
from agentic_rl.invariants.shift import ShiftConfig
from agentic_rl.invariants.signal import SignalConfig

__all__ = [
    "Band", "ExplorationConfig", "ShiftConfig", "SignalConfig", "alarm_metrics", "alarms",
    "check_alarms", "exploration", "format_alarms", "shift", "signal",
]
