"""Interrupts: SIGTERM / SIGINT become a flag, handlers come back after."""

import os
import signal
import threading

import pytest

from agentic_rl.train.interrupt import Interrupts


@pytest.fixture(autouse=True)
def _main_thread_only():
  if threading.current_thread() is not threading.main_thread():
    pytest.skip("signals are handled on the main thread only")


def test_sigterm_sets_the_flag_and_handlers_are_restored(capfd):
  calls = []
  previous = signal.signal(signal.SIGTERM, lambda *a: calls.append(a))
  try:
    with Interrupts() as interrupts:
      assert interrupts.active and interrupts.requested is None
      os.kill(os.getpid(), signal.SIGTERM)
      assert interrupts.requested == "SIGTERM"
      os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM: still pending
      assert interrupts.requested == "SIGTERM"
    assert not interrupts.active
    assert "SIGTERM: stopping after this step" in capfd.readouterr().err
    assert calls == []
    os.kill(os.getpid(), signal.SIGTERM)  # the earlier handler is back
    assert len(calls) == 1
  finally:
    signal.signal(signal.SIGTERM, previous)


def test_sigint_is_a_request_and_a_second_one_force_quits():
  before = signal.getsignal(signal.SIGINT)
  with pytest.raises(KeyboardInterrupt):
    with Interrupts() as interrupts:
      os.kill(os.getpid(), signal.SIGINT)
      assert interrupts.requested == "SIGINT"  # no KeyboardInterrupt yet
      os.kill(os.getpid(), signal.SIGINT)
      pytest.fail("the second SIGINT did not raise")
  assert signal.getsignal(signal.SIGINT) is before
  if before is signal.default_int_handler:
    with pytest.raises(KeyboardInterrupt):  # ordinary Ctrl-C again
      os.kill(os.getpid(), signal.SIGINT)


def test_sigint_after_sigterm_force_quits():
  with pytest.raises(KeyboardInterrupt):
    with Interrupts() as interrupts:
      os.kill(os.getpid(), signal.SIGTERM)
      os.kill(os.getpid(), signal.SIGINT)
  assert interrupts.requested == "SIGTERM"


def test_outside_the_main_thread_it_does_nothing():
  before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  seen = {}

  def worker():
    with Interrupts() as interrupts:
      seen["active"] = interrupts.active
      seen["handlers"] = {s: signal.getsignal(s) for s in before}
    seen["requested"] = interrupts.requested

  thread = threading.Thread(target=worker)
  thread.start()
  thread.join()
  assert seen == {"active": False, "handlers": before, "requested": None}
  assert {s: signal.getsignal(s) for s in before} == before
