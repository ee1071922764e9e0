"""The staleness controller: the bound on how far the actor may lag the
learner tightens while the behaviour/learner KL is out of its band and
loosens back once it has stayed inside.

With ``ShiftConfig.adaptive_staleness``, after each iteration: if
``shift/kl_behaviour_learner`` is above its band (``ShiftConfig.bands``),
the bound drops by one update (not below 0, which is on-policy); after
``staleness_patience`` iterations in a row inside the band it rises by one,
up to ``max_staleness``. The actor reads the bound for its next batch
(``shift/staleness_bound``). Host-side and pure.
"""

from __future__ import annotations

import dataclasses

from agentic_rl.invariants.shift.config import ShiftConfig

KL_KEY = "shift/kl_behaviour_learner"


@dataclasses.dataclass(frozen=True)
class StalenessBound:
  """The controller's state: the current ``bound`` (learner updates) and
  the iterations in a row the KL has been inside its band."""

  bound: int
  calm: int = 0


def init_staleness_bound(config: ShiftConfig) -> StalenessBound:
  return StalenessBound(int(config.max_staleness or 0))


def update_staleness_bound(config: ShiftConfig, state: StalenessBound,
                           kl: float) -> StalenessBound:
  """The next bound given this iteration's behaviour/learner KL; the bound
  stays at ``max_staleness`` unless ``config.adaptive_staleness``."""
  if not config.adaptive_staleness:
    return state
  band = dict(config.bands).get(KL_KEY)
  if band is not None and kl > band.high:
    return StalenessBound(max(state.bound - 1, 0), 0)
  calm = state.calm + 1
  if calm >= config.staleness_patience and state.bound < int(config.max_staleness or 0):
    return StalenessBound(state.bound + 1, 0)
  return StalenessBound(state.bound, calm)
