"""Who makes the RL stage's rollouts, and with which parameters.

Both actors give the learner one :class:`~agentic_rl.train.rl.Collected`
batch per iteration through ``next(state, controls)`` and hear of each
update through ``updated(state)``; ``bound`` is the staleness bound in
learner updates (``max_staleness``, or the adaptive controller's,
``shift.adaptive_staleness``).

* :class:`SyncActor` (``rl.actor="sync"``, the default): collects in the
  learner's thread, with the oldest parameter snapshot at most ``bound``
  updates behind the learner (off-policy batches without concurrency;
  bit-exact on resume, its snapshots are checkpointed).
* :class:`AsyncActor` (``rl.actor="async"``): collects in its own thread
  with its own copy of the parameters, while the learner updates. The
  learner publishes its parameters after every update; episodes still
  running then continue under them (partial rollouts across updates, each
  token recording the version that produced it). The bound is enforced by
  the actor waiting: batch k starts only once the learner has published
  the version that keeps every token of it within ``bound`` updates of the
  learner's step when it consumes the batch, so no batch is ever dropped
  for staleness. On host environments with uniform allocation the actor
  batches continuously (:class:`~agentic_rl.train.stream.HostStream`: rows
  refilled as episodes end, groups collected by windowed FIFO). On a stop
  or a resume the batches and episodes in flight are discarded
  (``<stage>_discarded_batches`` in the summary); the learner's data
  position only counts consumed groups, so none is lost or repeated.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp

from agentic_rl.train import learner
from agentic_rl.train import rl as rl_lib
from agentic_rl.train.stream import HostStream


def _copy(params):
  return jax.tree.map(jnp.copy, params)


def make_actor(kind: str, run, rl, prompts: rl_lib.PromptSource, stage_key,
               state: learner.TrainState, step: int, controls: rl_lib.Controls, bound: int,
               *, end_step: int, snapshots=()):
  """The stage's actor: ``kind`` is ``rl.actor`` ("sync" or "async",
  ``agentic_rl.train.config.ACTORS``);
  iterations ``step`` to ``end_step - 1`` remain."""
  if kind == "async":
    return AsyncActor(run, rl, prompts, stage_key, state, step, controls, bound,
                      end_step=end_step)
  return SyncActor(run, rl, prompts, stage_key, bound, snapshots)


class SyncActor:
  """Collects in the learner's thread with the oldest parameter snapshot
  at most ``bound`` learner updates behind (snapshots taken per batch, so
  with several updates per batch the lag is a multiple of them)."""

  def __init__(self, run, rl, prompts: rl_lib.PromptSource, stage_key, bound: int,
               snapshots=()):
    self.run, self.rl, self.prompts, self.stage_key = run, rl, prompts, stage_key
    self.bound = bound
    self.snapshots = collections.deque(snapshots)  # (params, version), oldest first

  def next(self, state: learner.TrainState, controls: rl_lib.Controls, step: int,
           ) -> rl_lib.Collected:
    self.snapshots.append((_copy(state.params), int(state.step)))
    while int(state.step) - self.snapshots[0][1] > self.bound:
      self.snapshots.popleft()
    return rl_lib.collect(self.run, self.rl, self.snapshots[0], self.prompts, controls.history,
                          jax.random.fold_in(self.stage_key, step), step)

  def updated(self, state: learner.TrainState) -> None:
    del state

  def checkpoint(self) -> list[tuple[Any, int]]:
    """The snapshots to save (and restore as ``snapshots``)."""
    return list(self.snapshots)

  def stats(self) -> dict[str, float]:
    return {}

  def close(self) -> int:
    return 0


class AsyncActor:
  """Collects in a thread of its own; see the module docstring.

  Args:
    run, rl, prompts, stage_key: as :func:`agentic_rl.train.rl.collect`'s.
    state: the learner's state at the stage's (or resume's) start.
    first_step: the stage iteration of the first batch.
    controls: the controllers' state (the actor reads the latest one).
    bound: the staleness bound (the actor reads the attribute each batch).
    end_step: the stage's iterations; the actor makes no batch beyond.
  """

  def __init__(self, run, rl, prompts: rl_lib.PromptSource, stage_key,
               state: learner.TrainState, first_step: int, controls: rl_lib.Controls,
               bound: int, *, end_step: int):
    self.run, self.rl, self.prompts, self.stage_key = run, rl, prompts, stage_key
    self.bound, self.controls = bound, controls
    self.first_step, self.first_version = first_step, int(state.step)
    self.end_step = end_step
    # Continuously where the collector can (host environments with uniform
    # allocation); otherwise batch by batch.
    self.streaming = run.collector.streams(rl.signal_cfg.allocation)
    self._cond = threading.Condition()
    self._weights = (_copy(state.params), int(state.step))
    self._stop = False
    self._queue: queue.Queue = queue.Queue()
    self._wait_s = self._learner_wait_s = 0.0  # seconds
    self._t_start = time.perf_counter()
    self._thread = threading.Thread(target=self._loop, name="actor", daemon=True)
    self._thread.start()

  # ------------------------------------------------------------------ actor thread
  def weights(self) -> tuple[Any, int]:
    with self._cond:
      return self._weights

  def need(self, step: int) -> int:
    """The oldest version batch ``step`` may hold: it is consumed when the
    learner is ``(step - first_step) * U`` updates past its start, and every
    token of it must be within ``bound`` of that."""
    U = self.rl.updates_per_batch
    return self.first_version + (step - self.first_step) * U - self.bound

  def _wait(self, step: int) -> bool:
    """Waits until the published weights may make batch ``step``; False on
    stop."""
    t0 = time.perf_counter()
    with self._cond:
      while not self._stop and self._weights[1] < self.need(step):
        self._cond.wait(timeout=1.0)  # the bound may move meanwhile
    self._wait_s += time.perf_counter() - t0
    return not self._stop

  def _loop(self):
    try:
      if self.streaming:
        self._stream()
        return
      step = self.first_step
      while step < self.end_step:
        if not self._wait(step):
          return
        self._queue.put(rl_lib.collect(self.run, self.rl, self.weights, self.prompts,
                                       self.controls.history,
                                       jax.random.fold_in(self.stage_key, step), step))
        step += 1
    except BaseException as e:  # pylint: disable=broad-except
      self._queue.put(e)  # the learner re-raises it

  def _stream(self):
    """Continuous batching over host episodes (:mod:`agentic_rl.train.stream`)."""
    stream = None

    def weights():
      self._wait(stream.step)
      return self.weights()

    stream = HostStream(self.run, self.rl, self.prompts, self.stage_key, weights, self.need,
                        self._queue.put, first_step=self.first_step, end_step=self.end_step,
                        history=lambda: self.controls.history, stop=lambda: self._stop)
    stream.play()

  # ------------------------------------------------------------------ learner side
  def next(self, state: learner.TrainState, controls: rl_lib.Controls, step: int,
           ) -> rl_lib.Collected:
    del state, step
    self.controls = controls
    t0 = time.perf_counter()
    item = self._queue.get()
    self._learner_wait_s = time.perf_counter() - t0
    if isinstance(item, BaseException):
      raise item
    return item

  def updated(self, state: learner.TrainState) -> None:
    """Publishes the learner's parameters after an update."""
    with self._cond:
      self._weights = (_copy(state.params), int(state.step))
      self._cond.notify_all()

  def checkpoint(self) -> list:
    return []  # batches in flight are discarded on resume

  def stats(self) -> dict[str, float]:
    """The actor's idle fraction since the stage (or resume) started
    (waiting for weights), and the seconds the learner last waited for a
    batch."""
    elapsed = max(time.perf_counter() - self._t_start, 1e-9)
    return {"perf/actor_idle_frac": min(self._wait_s / elapsed, 1.0),
            "perf/learner_wait_s": self._learner_wait_s}

  def close(self) -> int:
    """Stops the actor (after the rollout in progress); returns how many
    finished batches were discarded."""
    with self._cond:
      self._stop = True
      self._cond.notify_all()
    self._thread.join()
    return sum(not isinstance(item, BaseException) for item in list(self._queue.queue))
