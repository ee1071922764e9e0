"""Continuous collection for the asynchronous actor on host environments.

The actor keeps every rollout row busy: a row whose episode ends takes the
next one at once (:meth:`agentic_rl.rollout.HostLoop.play`), whichever
group it belongs to, so a slow episode holds up only its own row. Groups
(G episodes of one prompt) are launched in data order and finish in any
order; finished groups are collected into batches by windowed FIFO
(:mod:`agentic_rl.invariants.shift.fifo`, ``shift.fifo_window_ratio``):
only the first W = ceil(ratio * P) launched groups not yet collected may
be taken, so a group is taken only while fewer than W older ones wait and
easy, fast prompts cannot crowd out hard, slow ones. Without a ratio any
finished group is taken (first finished, first out).

The staleness bound holds for every token: batch k is consumed at learner
version ``c_k`` and may hold no token older than ``c_k - bound``. The actor
waits for weights before generating tokens that would already be too old,
and an episode whose oldest token falls out of the bound before its batch
is formed is replayed from its reset under the current weights
(``shift/replayed_episodes``). ``partial_rollout="restart"`` replays every
episode still running when new weights arrive.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from agentic_rl.invariants import exploration, shift, signal
from agentic_rl.objectives import GroupLayout
from agentic_rl.rollout.host_loop import Episode
from agentic_rl.rollout.types import EPISODE_STATUS
from agentic_rl.train import rl as rl_lib

_TIMEOUT = EPISODE_STATUS.index("env_timeout")


@dataclasses.dataclass
class _Group:
  prompt_id: int
  position: int  # its index in the data order
  rollouts: dict[int, Any] = dataclasses.field(default_factory=dict)  # j -> one-row Rollout


class HostStream:
  """Plays the RL stage's host episodes continuously and hands the learner
  one :class:`~agentic_rl.train.rl.Collected` batch of P groups at a time.

  Args:
    run, rl, prompts, stage_key: as :func:`agentic_rl.train.rl.collect`'s.
    weights: ``() -> (params, version)``, the actor's latest weights.
    need: ``(step) -> version``: the oldest version batch ``step`` may hold.
    emit: receives each batch.
    first_step, end_step: the stage iterations to make batches for.
    history: ``() -> PromptHistory``, the controllers' latest.
    stop: ``() -> bool``, asked before every jitted segment.
  """

  def __init__(self, run, rl: rl_lib.RLStage, prompts: rl_lib.PromptSource, stage_key,
               weights: Callable[[], tuple], need: Callable[[int], int],
               emit: Callable[[rl_lib.Collected], None], *, first_step: int, end_step: int,
               history: Callable[[], signal.PromptHistory], stop: Callable[[], bool]):
    self.run, self.rl, self.prompts = run, rl, prompts
    self.key, self.draw_key = jax.random.split(jax.random.fold_in(stage_key, first_step))
    self.weights, self.need, self.emit = weights, need, emit
    self.step, self.end_step = first_step, end_step
    self.history, self.stop = history, stop
    rows = rl.actor_rows or rl.rows
    self.loop = run.collector.new_host_loop(rl.sampling, rows)
    P, G = rl.prompts_per_step, rl.group_size
    self.window = shift.fifo_window(rl.shift_cfg, P)
    self.max_groups = max(self.window or P, P) + math.ceil(rows / G)
    self.queue = shift.init_queue()
    self.groups: dict[int, _Group] = {}
    self.todo: collections.deque = collections.deque()  # (gid, j) to play
    self.envs: list[Any] = []  # free environments
    self.env_of: dict[tuple[int, int], Any] = {}
    self.batch: list[int] = []  # gids collected for the next batch
    self.next_gid = 0
    # Data positions launched and not consumed: the learner's data position
    # is the first of them; those consumed beyond it are skipped by the
    # prompt source after a resume.
    self.unconsumed: set[int] = set()
    self.consumed_ahead: set[int] = set(prompts.skip)
    self.version = -1
    self.replayed = 0
    # episode/* failure counts of the episodes ended since the last batch.
    self.health: dict[str, float] = {}
    self.t_last = time.perf_counter()

  def play(self) -> None:
    """Runs until the stage's batches are made or ``stop()``."""
    self.loop.play(self._weights, self._next_episode, self._finished,
                   chunk_steps=max(1, self.rl.sampling.max_new_tokens_per_turn // 2),
                   stale=self._stale,
                   stop=lambda: self.stop() or self.step >= self.end_step)

  # ------------------------------------------------------------------ callbacks of play
  def _weights(self):
    params, version = self.weights()
    self.version = int(version)
    return params, version

  def _stale(self, tag, oldest: int) -> bool:
    old = oldest < self.need(self.step)
    if self.rl.shift_cfg.partial_rollout == "restart":
      old |= oldest < self.version
    self.replayed += old
    return old

  def _next_episode(self) -> Episode | None:
    if not self.todo and len(self.groups) < self.max_groups:
      self._launch()
    if not self.todo:
      return None
    gid, j = self.todo.popleft()
    env = self.envs.pop() if self.envs else self.run.collector.tasks.make()
    self.env_of[gid, j] = env
    seed = int(self.run.collector.tasks.seeds("train", [self.groups[gid].prompt_id])[0])
    key = jax.random.fold_in(jax.random.fold_in(self.key, gid), j)
    return Episode(env, seed, key, (gid, j))

  def _launch(self) -> None:
    gid, self.next_gid = self.next_gid, self.next_gid + 1
    ids = self.prompts.draw(1, jax.random.fold_in(self.draw_key, gid),
                            history=self.history(), step=self.step)
    position = self.prompts.last_position
    self.groups[gid] = _Group(int(ids[0]), position)
    self.unconsumed.add(position)
    self.queue = shift.launch(self.queue, [gid])
    self.todo.extend((gid, j) for j in range(self.rl.group_size))

  def _finished(self, tag, rollout) -> None:
    gid, j = tag
    env = self.env_of.pop(tag)
    timed_out = int(rollout.status_B[0]) == _TIMEOUT
    self.envs.append(self.run.collector.tasks.replace(env) if timed_out else env)
    # Counted as it ends: a failed episode may be replayed or dropped later.
    health = rl_lib.episode_health(rollout)
    self.health = {k: self.health.get(k, 0.0) + v for k, v in health.items()}
    group = self.groups[gid]
    group.rollouts[j] = self.run.collector.with_outcome(rollout)
    if len(group.rollouts) == self.rl.group_size:
      self.queue = shift.finish(self.queue, [gid])
      self._collect()

  # ------------------------------------------------------------------ batches
  def _collect(self) -> None:
    P = self.rl.prompts_per_step
    # Episodes gone stale while their group waited are played again.
    need = self.need(self.step)
    for gid in self.queue.group_ids[self.queue.finished]:
      group = self.groups[int(gid)]
      old = [j for j, ro in group.rollouts.items() if _oldest(ro) < need]
      for j in old:
        del group.rollouts[j]
        self.todo.appendleft((int(gid), j))
      if old:
        self.replayed += len(old)
        self.queue = shift.finish(self.queue, [gid], finished=False)
    self.queue, taken = shift.collect(self.queue, P - len(self.batch), self.window)
    self.batch.extend(int(g) for g in taken)
    if len(self.batch) == P:
      gids, self.batch = sorted(self.batch), []  # in launch order
      self.emit(self._batch(gids))

  def _batch(self, gids: list[int]) -> rl_lib.Collected:
    G = self.rl.group_size
    groups = [self.groups.pop(g) for g in gids]
    rows = [g.rollouts[j] for g in groups for j in range(G)]
    batch = jax.tree.map(lambda *xs: np.concatenate(xs), *rows)
    success = np.asarray(batch.reward_components["outcome"]).reshape(len(gids), G) > 0.5
    ids = np.array([g.prompt_id for g in groups], np.int64)
    sampled = signal.uniform_sampling(lambda ids_N, n, k: (success, batch), ids, G,
                                      jax.random.fold_in(self.key, self.step))
    sampled.metrics["shift/replayed_episodes"] = float(self.replayed)
    self.replayed = 0
    for g in groups:
      self.unconsumed.discard(g.position)
      self.consumed_ahead.add(g.position)
    data_pos = min(self.unconsumed, default=self.prompts.position)
    self.consumed_ahead = {p for p in self.consumed_ahead if p >= data_pos}
    now = time.perf_counter()
    collected = rl_lib.Collected(
        batch, GroupLayout.of(sampled.group, sampled.num_groups), sampled, None,
        now - self.t_last, float(exploration.temperature_at(self.rl.explore_cfg, self.step)),
        data_pos, tuple(sorted(self.consumed_ahead)), self.step, self.health)
    self.t_last, self.health = now, {}
    self.step += 1
    return collected


def _oldest(rollout) -> int:
  """The version of a one-row rollout's oldest policy token (a large number
  without any)."""
  mask = np.asarray(rollout.loss_mask_BxT[0]) > 0
  return int(np.asarray(rollout.version_BxT[0])[mask].min()) if mask.any() else 1 << 30
