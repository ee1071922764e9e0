"""Environment calls run concurrently, each with a time limit.

Python environments (games, sandboxes, web tools) are slow, sometimes hang
and sometimes raise. :class:`EnvWorkers` runs a list of calls (one per
episode) on up to ``workers`` threads at once and returns one
:class:`Outcome` per call: its value, the exception it raised, or that it
ran past ``timeout_s``, and how long it ran. Threads are daemons, so a call
that never returns is abandoned (its thread may finish later and is
ignored) rather than holding up the batch or the interpreter's exit; the
environment it belonged to should be replaced.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What one call gave: ``value``, or the ``error`` it raised, or
  ``timed_out``; ``seconds``: the wall time it ran (until its time limit,
  when it timed out; 0 for an outcome no call made). Outcomes compare
  without it."""

  value: Any = None
  error: BaseException | None = None
  timed_out: bool = False
  seconds: float = dataclasses.field(default=0.0, compare=False)

  @property
  def ok(self) -> bool:
    return self.error is None and not self.timed_out


class EnvWorkers:
  """Runs calls concurrently on at most ``workers`` daemon threads.

  :meth:`submit` queues a call under a caller's tag and :meth:`results`
  returns the ``(tag, Outcome)`` of calls that have finished (or timed
  out) since the last call, so a caller can go on while environments run;
  :meth:`map` runs a list of calls and returns their outcomes in order.
  ``workers=1`` without a timeout runs each call on the calling thread when
  it is submitted (exceptions still become outcomes).
  """

  def __init__(self, workers: int = 1, timeout_s: float | None = None):
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
      raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if timeout_s is not None and not timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s!r}")
    self.workers, self.timeout_s = workers, timeout_s
    self._inline = workers == 1 and timeout_s is None
    self._cond = threading.Condition()
    self._queued: collections.deque = collections.deque()  # (ticket, tag, call)
    self._running: dict[int, tuple[Any, float]] = {}  # ticket -> (tag, start time)
    self._done: list[tuple[Any, Outcome]] = []
    self._tickets = itertools.count()

  @property
  def pending(self) -> int:
    """Calls submitted whose outcome :meth:`results` has not returned."""
    with self._cond:
      return len(self._queued) + len(self._running) + len(self._done)

  def submit(self, tag: Any, call: Callable[[], Any]) -> None:
    """Queues ``call``; its outcome comes back from :meth:`results` as
    ``(tag, outcome)``."""
    if self._inline:
      outcome = _run(call)
      with self._cond:
        self._done.append((tag, outcome))
      return
    with self._cond:
      self._queued.append((next(self._tickets), tag, call))
      self._start()

  def results(self, block: bool = False) -> list[tuple[Any, Outcome]]:
    """The outcomes of the calls finished since the last call, in the order
    they finished; with ``block``, waits until there is at least one (or
    nothing is pending)."""
    with self._cond:
      while True:
        self._expire()
        if self._done or not block or not (self._queued or self._running):
          break
        wait = None
        if self.timeout_s is not None and self._running:
          first = min(t0 for _, t0 in self._running.values())
          wait = max(first + self.timeout_s - time.monotonic(), 0.0)
        self._cond.wait(timeout=wait)
      done, self._done = self._done, []
      return done

  def map(self, calls: Sequence[Callable[[], Any]]) -> list[Outcome]:
    """One outcome per call, in order (nothing else may be pending)."""
    if self.pending:
      raise RuntimeError("map needs idle workers; collect the submitted calls first")
    for i, call in enumerate(calls):
      self.submit(i, call)
    out: list[Outcome | None] = [None] * len(calls)
    while self.pending:
      for i, outcome in self.results(block=True):
        out[i] = outcome
    return out

  def abandon(self) -> None:
    """Forgets every queued, running and unreported call (a running one's
    thread finishes on its own; its outcome is ignored)."""
    with self._cond:
      self._queued.clear()
      self._running.clear()
      self._done.clear()

  # The methods below run with the condition held.
  def _start(self) -> None:
    while self._queued and len(self._running) < self.workers:
      ticket, tag, call = self._queued.popleft()
      self._running[ticket] = (tag, time.monotonic())
      threading.Thread(target=self._target, args=(ticket, call), daemon=True).start()

  def _target(self, ticket: int, call: Callable[[], Any]) -> None:
    outcome = _run(call)
    with self._cond:
      if ticket in self._running:  # not abandoned after its time limit
        tag, _ = self._running.pop(ticket)
        self._done.append((tag, outcome))
        self._start()
      self._cond.notify_all()

  def _expire(self) -> None:
    if self.timeout_s is None:
      return
    now = time.monotonic()
    for ticket, (tag, t0) in list(self._running.items()):
      if now - t0 >= self.timeout_s:  # abandoned: its thread's result is ignored
        del self._running[ticket]
        self._done.append((tag, Outcome(timed_out=True, seconds=now - t0)))
    self._start()


def _run(call: Callable[[], Any]) -> Outcome:
  start = time.perf_counter()
  try:
    value = call()
  except Exception as e:  # pylint: disable=broad-except
    return Outcome(error=e, seconds=time.perf_counter() - start)
  return Outcome(value=value, seconds=time.perf_counter() - start)
