"""Environment calls run concurrently, each with a time limit.

Python environments (games, sandboxes, web tools) are slow, sometimes hang
and sometimes raise. :class:`EnvWorkers` runs a list of calls (one per
episode) on up to ``workers`` threads at once and returns one
:class:`Outcome` per call: its value, the exception it raised, or that it
ran past ``timeout_s``. Threads are daemons, so a call that never returns
is abandoned (its thread may finish later and is ignored) rather than
holding up the batch or the interpreter's exit; the environment it belonged
to should be replaced.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What one call gave: ``value``, or the ``error`` it raised, or
  ``timed_out``."""

  value: Any = None
  error: BaseException | None = None
  timed_out: bool = False

  @property
  def ok(self) -> bool:
    return self.error is None and not self.timed_out


class EnvWorkers:
  """Runs calls concurrently on at most ``workers`` daemon threads.

  ``workers=1`` without a timeout runs the calls in order on the calling
  thread (exceptions still become outcomes).
  """

  def __init__(self, workers: int = 1, timeout_s: float | None = None):
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
      raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if timeout_s is not None and not timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s!r}")
    self.workers, self.timeout_s = workers, timeout_s

  def map(self, calls: Sequence[Callable[[], Any]]) -> list[Outcome]:
    """One outcome per call, in order."""
    if self.workers == 1 and self.timeout_s is None:
      return [_run(call) for call in calls]
    n = len(calls)
    out: list[Outcome | None] = [None] * n
    started: dict[int, float] = {}  # running calls and when they started
    cond = threading.Condition()

    def target(i: int):
      outcome = _run(calls[i])
      with cond:
        if out[i] is None:  # not abandoned
          out[i] = outcome
          started.pop(i, None)
        cond.notify_all()

    nxt = 0
    with cond:
      while nxt < n or started:
        while nxt < n and len(started) < self.workers:
          started[nxt] = time.monotonic()
          threading.Thread(target=target, args=(nxt,), daemon=True).start()
          nxt += 1
        wait = None
        if self.timeout_s is not None and started:
          now = time.monotonic()
          for i in [i for i, t0 in started.items() if now - t0 >= self.timeout_s]:
            out[i] = Outcome(timed_out=True)
            del started[i]
          if started:
            wait = min(t0 for t0 in started.values()) + self.timeout_s - now
        if started and (wait is None or wait > 0):
          cond.wait(timeout=wait)
    return out


def _run(call: Callable[[], Any]) -> Outcome:
  try:
    return Outcome(value=call())
  except Exception as e:  # pylint: disable=broad-except
    return Outcome(error=e)
