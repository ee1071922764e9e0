"""Environment calls on worker threads: results in order, errors and time
limits as outcomes, at most ``workers`` at once, and overlap."""

import threading
import time

import pytest

from agentic_rl.rollout.workers import EnvWorkers


def test_outcomes_in_order_with_errors_kept():
  def boom():
    raise RuntimeError("boom")

  for workers in (1, 3):
    out = EnvWorkers(workers).map([lambda: 1, boom, lambda: "x"])
    assert [o.value for o in out] == [1, None, "x"]
    assert [o.ok for o in out] == [True, False, True]
    assert isinstance(out[1].error, RuntimeError)


def test_a_hung_call_times_out_and_the_others_finish():
  release = threading.Event()
  out = EnvWorkers(2, timeout_s=0.2).map(
      [lambda: release.wait(30) or "late", lambda: "a", lambda: "b", lambda: "c"])
  release.set()
  assert out[0].timed_out and not out[0].ok
  assert [o.value for o in out[1:]] == ["a", "b", "c"]


def test_at_most_workers_run_at_once_and_they_overlap():
  lock, running, peak, spans = threading.Lock(), [0], [0], []

  def call():
    with lock:
      running[0] += 1
      peak[0] = max(peak[0], running[0])
    t0 = time.monotonic()
    time.sleep(0.05)
    spans.append((t0, time.monotonic()))
    with lock:
      running[0] -= 1

  EnvWorkers(3).map([call] * 9)
  assert peak[0] == 3
  spans.sort()
  assert any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:]))  # overlapping calls


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match="workers"):
    EnvWorkers(0)
  with pytest.raises(ValueError, match="timeout_s"):
    EnvWorkers(2, timeout_s=0)
