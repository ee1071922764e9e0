"""Stop a run cleanly on SIGTERM or Ctrl-C: finish the step, checkpoint, exit.

A preempted or cancelled job gets SIGTERM (and SIGKILL after a grace
period); a user presses Ctrl-C (SIGINT).  Left alone, SIGTERM kills the run
mid-step, losing everything since the last checkpoint, and SIGINT raises
KeyboardInterrupt wherever the main thread happens to be, an orbax save
included.  While an :class:`Interrupts` is active, either signal only sets
a flag that the training loop reads between steps.  Intended use in
``loop.train``, around the stages::

    with interrupt.Interrupts() as interrupts:
      while ...:  # each stage's steps
        ...one step, log...
        if interrupts.requested:  # "SIGTERM" or "SIGINT"
          save(state, actors)
          ckpt.close(); writer.close()
          return summary  # the next train() call resumes from here

A second Ctrl-C while a stop is pending raises KeyboardInterrupt at once, so
a user can still force-quit.  Signals reach only the main thread, so
elsewhere an :class:`Interrupts` changes nothing and never requests.  In a
multi-process run each process gets its own signal, not necessarily between
the same two steps; as saving is collective, the processes must agree before
acting on it (e.g. ``multihost_utils.process_allgather`` of the flag).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupts:
  """While active, SIGTERM and SIGINT set :attr:`requested` instead of
  killing the process or raising KeyboardInterrupt; the previous handlers
  are restored on exit.

  Attributes:
    requested: the name of the first signal received (``"SIGTERM"``,
      ``"SIGINT"``), or None.
    active: whether the handlers are installed (False outside the main
      thread, where Python cannot handle signals).
  """

  def __init__(self):
    self.requested: str | None = None
    self.active = False
    self._previous: dict[int, Any] = {}

  def _handle(self, signum: int, frame) -> None:
    del frame
    if self.requested is not None:
      if signum == signal.SIGINT:
        raise KeyboardInterrupt
      return
    self.requested = signal.Signals(signum).name
    # os.write, not print: a handler that prints while the interrupted code
    # is printing to the same stream raises "reentrant call".
    os.write(2, f"\n{self.requested}: stopping after this step "
                "(Ctrl-C again to quit now)\n".encode())

  def __enter__(self) -> Interrupts:
    if threading.current_thread() is not threading.main_thread():
      return self
    for sig in SIGNALS:
      self._previous[sig] = signal.getsignal(sig)
      signal.signal(sig, self._handle)
    self.active = True
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      # None: a handler installed outside Python, which cannot be put back.
      signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    self._previous.clear()
    self.active = False
