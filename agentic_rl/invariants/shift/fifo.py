"""Windowed-FIFO collection of finished groups in asynchronous mode (host-side).

In asynchronous RL, groups are launched in order and finish in any order. Greedy
collection (take whatever finished first) biases batches towards fast, easy
episodes; strict FIFO stalls on the slowest one. Windowed FIFO (MiniMax Forge,
2026; docs/references.md#windowed-fifo) takes only finished groups among the first W launched
groups not yet collected: the window at the head of the queue slides forward as
its oldest groups are collected, so a group is taken only while fewer than W
older groups are still waiting, and a slow group holds back collection once W
younger ones have finished.

The queue is a frozen dataclass of numpy arrays; every function returns a new
queue.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from agentic_rl.invariants.checks import check_int
from agentic_rl.invariants.shift.config import ShiftConfig


@dataclasses.dataclass(frozen=True)
class LaunchQueue:
  """Groups launched and not yet collected, oldest first.

  Attributes:
    group_ids: int64 ``[Q]`` ids chosen by the caller, in launch order.
    finished: bool ``[Q]`` whether each group's rollouts have all finished.
  """

  group_ids: np.ndarray
  finished: np.ndarray


def init_queue() -> LaunchQueue:
  return LaunchQueue(np.zeros((0,), np.int64), np.zeros((0,), bool))


def _ids(group_ids) -> np.ndarray:
  ids = np.asarray(group_ids)
  if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
    raise ValueError(f"group ids must be a 1-D integer array, got {ids.dtype}{ids.shape}")
  return ids.astype(np.int64)


def launch(queue: LaunchQueue, group_ids) -> LaunchQueue:
  """Appends newly launched groups (unfinished) at the tail.

  Raises:
    ValueError: when an id is repeated or already in the queue.
  """
  ids = _ids(group_ids)
  if np.unique(ids).size != ids.size or np.isin(ids, queue.group_ids).any():
    raise ValueError(f"group ids {ids.tolist()} repeat or are already queued")
  return LaunchQueue(np.concatenate([queue.group_ids, ids]),
                     np.concatenate([queue.finished, np.zeros(ids.size, bool)]))


def finish(queue: LaunchQueue, group_ids, finished: bool = True) -> LaunchQueue:
  """Marks groups as finished (or, with ``finished=False``, as running
  again: some of their rollouts are to be played again).

  Raises:
    ValueError: when an id is not in the queue.
  """
  ids = _ids(group_ids)
  known = np.isin(ids, queue.group_ids)
  if not known.all():
    raise ValueError(f"group ids {ids[~known].tolist()} are not in the queue")
  hit = np.isin(queue.group_ids, ids)
  return LaunchQueue(queue.group_ids, queue.finished | hit if finished
                     else queue.finished & ~hit)


def collect(queue: LaunchQueue, max_groups: int,
            window: int | None) -> tuple[LaunchQueue, np.ndarray]:
  """Takes up to ``max_groups`` finished groups from the head window.

  Args:
    queue: the launch queue.
    max_groups: the most groups to take.
    window: W, only the first W queued groups are eligible; None takes any
      finished group (greedy first-finished-first-out).

  Returns:
    ``(queue, collected_ids)``: the queue without the collected groups, and
    their ids in launch order (possibly fewer than ``max_groups``: the caller
    waits for more to finish).
  """
  check_int("max_groups", max_groups, minimum=0)
  if window is not None:
    check_int("window", window, minimum=1)
  eligible = queue.finished.copy()
  if window is not None:
    eligible[window:] = False
  take = np.flatnonzero(eligible)[:max_groups]
  keep = np.ones(queue.group_ids.size, bool)
  keep[take] = False
  return LaunchQueue(queue.group_ids[keep], queue.finished[keep]), queue.group_ids[take]


def fifo_window(config: ShiftConfig, num_groups: int) -> int | None:
  """W = ``ceil(fifo_window_ratio * num_groups)``, or None (greedy) when unset."""
  check_int("num_groups", num_groups, minimum=1)
  if config.fifo_window_ratio is None:
    return None
  return math.ceil(config.fifo_window_ratio * num_groups)
