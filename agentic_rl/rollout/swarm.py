"""Frozen sub-agents for an orchestrator's spawns (PARL, Agent Swarm).

A host environment delegates by returning a :class:`~agentic_rl.envs.swarm.
Spawn` from ``step`` (:mod:`agentic_rl.envs.swarm`). The :class:`~agentic_rl.
rollout.HostLoop` given a :class:`Swarm` collects the spawns its rows make
between two jitted segments and runs them here together: every sub-task is
its own episode, played by its agent's frozen policy (greedy), all of one
agent's episodes batched through one engine; then each spawn's ``then``
gives its row's observation. Only the orchestrator's tokens are trained; the
sub-episodes reach it as observations.

A sub-agent trained on the built-in families plays built-in sub-tasks in the
jitted :class:`~agentic_rl.rollout.RolloutEngine` (prompts and tool results
exactly as in its training); one trained on host environments plays text
sub-tasks in a :class:`~agentic_rl.rollout.HostLoop`.

Per orchestrator episode (Kimi K2.5's critical steps)::

  critical_steps = sum_t (1 + max_i turns(sub-episode i of step t))
  total_steps    = sum_t (1 + sum_i turns(sub-episode i of step t))

over its actions t (a step without spawns counts 1 in both). They are
reported in ``Rollout.info`` with ``parl/spawns`` (sub-episodes),
``parl/parallel_width`` (most sub-episodes of one step) and
``parl/finished`` (the share of sub-episodes that ended done).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from agentic_rl import model as model_lib
from agentic_rl.envs import registry
from agentic_rl.envs import tasks as tasks_lib
from agentic_rl.envs.swarm import Spawn, SubResult
from agentic_rl.rollout.engine import RolloutEngine
from agentic_rl.rollout.host_loop import Episode, HostLoop
from agentic_rl.rollout.sampling import SamplingConfig
from agentic_rl.rollout.types import Rollout
from agentic_rl.text.codec import Codec

INFO = ("parl/spawns", "parl/parallel_width", "parl/critical_steps", "parl/total_steps",
        "parl/finished")


@dataclasses.dataclass
class SubAgent:
  """A frozen policy: its parameters and architecture, how it samples, what
  it was trained on (``source``: ``"jax"``, the built-in families, or
  ``"host"``) and, for ``"host"``, its host loop's keyword arguments."""

  params: Any
  model_config: model_lib.TransformerConfig
  sampling: SamplingConfig
  source: str = "jax"
  system_prompt: str | None = None
  host_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Swarm:
  """The frozen sub-agents by name, and how many spawns a step may make.

  Args:
    agents: name -> :class:`SubAgent`.
    codec: the conversation codec (shared with the orchestrator).
    rows: rows of each sub-agent engine call.
    max_width: sub-tasks one spawn may ask for (more is an error
      observation).
    max_critical_steps: an orchestrator episode whose critical steps reach
      this many is truncated (0: no limit).
  """

  def __init__(self, agents: Mapping[str, SubAgent], codec: Codec, *, rows: int = 16,
               max_width: int = 8, max_critical_steps: int = 0):
    if not agents:
      raise ValueError("a Swarm needs at least one sub-agent")
    if rows < 1 or max_width < 1 or max_critical_steps < 0:
      raise ValueError(f"need rows >= 1, max_width >= 1 and max_critical_steps >= 0, got "
                       f"{rows}, {max_width}, {max_critical_steps}")
    self.agents, self.codec, self.rows = dict(agents), codec, rows
    self.max_width, self.max_critical_steps = max_width, max_critical_steps
    self._engines: dict[tuple, Any] = {}

  def tally(self, rows: int) -> Tally:
    return Tally(rows)

  def unbounded(self) -> Swarm:
    """The same sub-agents (and compiled engines) without the critical-step
    budget."""
    other = copy.copy(self)
    other.max_critical_steps = 0
    return other

  def check(self, spawn: Spawn) -> str | None:
    """Why ``spawn`` cannot run (the policy's error observation), or None."""
    agent = self.agents.get(spawn.agent)
    if agent is None:
      return f"error: no agent {spawn.agent!r}; agents: {', '.join(sorted(self.agents))}"
    if not 1 <= len(spawn.tasks) <= self.max_width:
      return f"error: a spawn runs 1 to {self.max_width} tasks, got {len(spawn.tasks)}"
    if any(bool(t.family) != (agent.source == "jax") for t in spawn.tasks):
      kind = "built-in family" if agent.source == "jax" else "text environment"
      return f"error: agent {spawn.agent!r} plays {kind} tasks"
    return None

  def run(self, spawns: Sequence[Spawn], key) -> list[list[SubResult]]:
    """Plays every task of every (checked) spawn; the results per spawn,
    in order. One agent's tasks of one family share engine calls."""
    results: list[list[SubResult | None]] = [[None] * len(s.tasks) for s in spawns]
    groups = collections.defaultdict(list)  # (agent, family) -> [(spawn, task)]
    for i, spawn in enumerate(spawns):
      for j, task in enumerate(spawn.tasks):
        groups[(spawn.agent, task.family)].append((i, j))
    for n, ((name, family), where) in enumerate(sorted(groups.items())):
      tasks = [spawns[i].tasks[j] for i, j in where]
      played = (self._play_family(name, family, tasks, jax.random.fold_in(key, n)) if family
                else self._play_text(name, tasks, jax.random.fold_in(key, n)))
      for (i, j), result in zip(where, played):
        results[i][j] = result
    return results

  def _result(self, ro: Rollout, b: int) -> SubResult:
    turns = int(ro.num_turns_B[b])
    last = (np.asarray(ro.turn_BxT[b]) == turns) & (np.asarray(ro.loss_mask_BxT[b]) > 0)
    return SubResult(self.codec.action_text(np.asarray(ro.tokens_BxT[b])[last]), turns,
                     bool(ro.done_B[b]) and not bool(ro.truncated_B[b]), float(ro.reward_B[b]))

  def _play_family(self, name: str, family: str, tasks, key) -> list[SubResult]:
    agent = self.agents[name]
    if (name, family) not in self._engines:
      env = registry.make_env(family, self.codec)
      self._engines[(name, family)] = RolloutEngine(
          agent.model_config, agent.sampling, self.codec.ids, env=env, batch_size=self.rows)
    engine = self._engines[(name, family)]
    out = []
    for start in range(0, len(tasks), self.rows):
      chunk = np.resize(np.arange(start, min(start + self.rows, len(tasks))), self.rows)
      instances = jax.tree.map(lambda *xs: np.stack(xs), *(tasks[i].instance for i in chunk))
      prompts, lens = tasks_lib.encode_prompts(engine.env, instances,
                                               agent.sampling.max_total_tokens // 2)
      ro = engine.rollout(agent.params, prompts, lens, instances,
                          jax.random.fold_in(key, start), 0)
      ro = jax.tree.map(np.asarray, ro)
      out += [self._result(ro, b) for b in range(min(self.rows, len(tasks) - start))]
    return out

  def _play_text(self, name: str, tasks, key) -> list[SubResult]:
    agent = self.agents[name]
    slot = (name, threading.get_ident())  # a loop plays one set of episodes at a time
    if slot not in self._engines:
      self._engines[slot] = HostLoop(agent.model_config, agent.sampling, self.codec,
                                     batch_size=self.rows, system_prompt=agent.system_prompt,
                                     **agent.host_kwargs)
    loop = self._engines[slot]
    keys = jax.random.split(key, len(tasks))
    todo = collections.deque(Episode(t.env, t.seed, keys[i], i) for i, t in enumerate(tasks))
    rows: dict[int, Rollout] = {}
    loop.play(lambda: (agent.params, 0), lambda: todo.popleft() if todo else None,
              rows.__setitem__)
    return [self._result(rows[i], 0) for i in range(len(tasks))]


class Tally:
  """Per-row delegation counts of a host loop's B rows (:data:`INFO`)."""

  def __init__(self, rows: int):
    self.spawns, self.width, self.finished, self.critical, self.total = (
        np.zeros(rows, np.int64) for _ in range(5))

  def reset(self, b: int) -> None:
    for counts in (self.spawns, self.width, self.finished, self.critical, self.total):
      counts[b] = 0

  def add(self, b: int, results: Sequence[SubResult]) -> None:
    """Row b's step spawned ``results`` (its own 1 step is counted by the
    loop's actions)."""
    turns = [r.turns for r in results]
    self.spawns[b] += len(results)
    self.width[b] = max(self.width[b], len(results))
    self.finished[b] += sum(r.done for r in results)
    self.critical[b] += max(turns, default=0)
    self.total[b] += sum(turns)

  def critical_steps(self, b: int, actions: int) -> int:
    return actions + int(self.critical[b])

  def info(self, b: int, actions: int) -> dict[str, np.ndarray]:
    """Row b's :data:`INFO`, float32 ``[1]``, after ``actions`` actions."""
    spawns = int(self.spawns[b])
    values = (spawns, self.width[b], actions + self.critical[b], actions + self.total[b],
              self.finished[b] / spawns if spawns else 0.0)
    return {k: np.array([v], np.float32) for k, v in zip(INFO, values)}
