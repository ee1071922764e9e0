"""Delegation to frozen sub-agents (PARL, Agent Swarm): the environment side.

A Python (host) environment delegates by returning a :class:`Spawn` from
``step`` instead of ``(observation, reward, done)``: it names a sub-agent
and the sub-tasks to run, one episode each, in parallel. The rollout layer
(:mod:`agentic_rl.rollout.swarm`) plays them with that agent's frozen
policy, batched with the other spawns of the moment, and hands their
:class:`SubResult`\\ s to ``spawn.then``, whose return is the step's
``(observation, reward, done)``. The environment never sees a policy; it
decides what a sub-task is and how its results read.

A sub-task is an instance of a built-in family (``family``, ``instance``)
for a sub-agent trained on the built-in families, or a text environment
(``env``, ``seed``) for one trained on host environments.

:class:`ParallelHops` is the built-in task where decomposition pays:
``questions`` independent multi-hop lookups whose answers are asked for
together. Looked up one hop at a time by the orchestrator they take
``questions * hops`` sequential steps; spawned, one sub-agent per question,
they take one orchestrator step plus the longest sub-episode
(``hops + 1`` steps): fewer critical steps, more total steps.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from agentic_rl.envs.multihop import LEVELS, MultiHopEnv


@dataclasses.dataclass(frozen=True)
class Subtask:
  """One sub-episode: a built-in ``family``'s unbatched ``instance``, or a
  text environment ``env`` reset with ``seed``."""

  family: str = ""
  instance: Any = None
  env: Any = None
  seed: int = 0

  def __post_init__(self):
    if bool(self.family) == (self.env is not None):
      raise ValueError("a Subtask is either a family and an instance or a text env")


@dataclasses.dataclass(frozen=True)
class SubResult:
  """How a sub-episode ended: its final action as ``text``, its ``turns``
  (actions), whether it ended ``done`` (not truncated or failed) and its
  environment ``reward``."""

  text: str
  turns: int
  done: bool
  reward: float


@dataclasses.dataclass(frozen=True)
class Spawn:
  """A step that delegates: run ``tasks`` with sub-agent ``agent``, then
  ``then(results)`` (one :class:`SubResult` per task, in order) gives the
  step's ``(observation, reward, done)``."""

  agent: str
  tasks: Sequence[Subtask]
  then: Callable[[list[SubResult]], tuple[str, float, bool]]


_CALL = re.compile(r"<tool_call>([^<]*)</tool_call>\s*$")
_ANSWER = re.compile(r"<answer>([^<]*)</answer>\s*$")
_INT = re.compile(r"-?\d+")


def answer_of(text: str) -> str:
  """The content of the last ``<answer>...</answer>`` in ``text``, or
  ``"none"``."""
  found = re.findall(r"<answer>\s*([^<]*?)\s*</answer>", text)
  return found[-1] if found else "none"


class ParallelHops:
  """Answer ``questions`` independent multi-hop lookups at once.

  The prompt: ``Follow 2 hops from each of 417, 233, 581; answer the nodes
  reached, in order.`` Actions (the built-in families' syntax):

  * ``<tool_call>lookup N</tool_call>``: the node N maps to (one hop);
  * ``<tool_call>spawn AGENT N M ...</tool_call>``: one sub-agent episode per
    start node, ``Start at N; follow 2 hops.``, on its question's table; the
    observation is their answers in order (``none`` for one that did not
    answer);
  * ``<answer>a b c</answer>``: reward 1 when the integers are the nodes
    reached, in order; the episode ends.

  Anything else is told the format and costs a turn; the episode ends after
  ``max_actions``. Each question is a :class:`~agentic_rl.envs.multihop.
  MultiHopEnv` instance at ``level`` (its ``hops`` and table size); the
  questions' node ids are disjoint. ``demonstration(seed)`` solves it
  sequentially or, for a fraction ``spawn_demos`` of the seeds, by spawning
  ``agent`` on every question.
  """

  def __init__(self, questions: int = 3, level: int = 1, spawn_demos: float = 0.5,
               agent: str = "hop", max_actions: int = 16):
    if questions < 1 or not 0 <= level < len(LEVELS) or not 0.0 <= spawn_demos <= 1.0:
      raise ValueError(f"need questions >= 1, level in [0, {len(LEVELS)}) and spawn_demos in "
                       f"[0, 1], got {questions}, {level}, {spawn_demos}")
    self.questions, self.level, self.spawn_demos = questions, level, spawn_demos
    self.agent, self.max_actions = agent, max_actions
    self._family = MultiHopEnv(None)
    self._generate = jax.jit(self._family.generate, static_argnums=1)
    self.instances: list[Any] = []
    self.table: dict[int, int] = {}
    self.actions = 0

  def reset(self, seed: int) -> str:
    for attempt in range(100):  # questions on disjoint node ids
      keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), attempt), self.questions)
      instances = [jax.tree.map(np.asarray, self._generate(k, self.level)) for k in keys]
      tables = [dict(zip(i.world.table_keys[:int(i.world.table_size)].tolist(),
                         i.world.table_values[:int(i.world.table_size)].tolist()))
                for i in instances]
      if sum(map(len, tables)) == len({k for t in tables for k in t}):
        break
    self.instances, self.actions = instances, 0
    self.table = {k: v for t in tables for k, v in t.items()}
    hops = int(instances[0].hops)
    starts = ", ".join(str(int(i.start)) for i in instances)
    return (f"Follow {hops} hop{'s' if hops > 1 else ''} from each of {starts}; answer the "
            "nodes reached, in order.")

  @property
  def answers(self) -> list[int]:
    return [int(i.answer) for i in self.instances]

  def step(self, action: str):
    self.actions += 1
    last = self.actions >= self.max_actions
    if (m := _ANSWER.search(action)) is not None:
      right = [int(x) for x in _INT.findall(m.group(1))] == self.answers
      return ("Correct." if right else "Wrong."), float(right), True
    words = m.group(1).split() if (m := _CALL.search(action)) is not None else []
    if words[:1] == ["lookup"] and len(words) == 2 and _INT.fullmatch(words[1]):
      node = int(words[1])
      return (str(self.table[node]) if node in self.table else f"error: no node {node}"), 0.0, last
    if words[:1] == ["spawn"] and len(words) >= 3 and all(_INT.fullmatch(w) for w in words[2:]):
      by_start = {int(i.start): i for i in self.instances}
      starts = [int(w) for w in words[2:]]
      if missing := [s for s in starts if s not in by_start]:
        return f"error: {missing[0]} starts no question", 0.0, last
      return Spawn(words[1], [Subtask("multihop", by_start[s]) for s in starts],
                   lambda results: (" ".join(answer_of(r.text) for r in results), 0.0, last))
    return ("Use <tool_call>lookup N</tool_call>, <tool_call>spawn AGENT N ...</tool_call> or "
            "<answer>...</answer>."), 0.0, last

  def demonstration(self, seed: int) -> list[str]:
    self.reset(seed)
    answer = f"<answer>{' '.join(map(str, self.answers))}</answer>"
    if np.random.default_rng([seed, 1]).random() < self.spawn_demos:
      starts = " ".join(str(int(i.start)) for i in self.instances)
      return [f"<tool_call>spawn {self.agent} {starts}</tool_call>", answer]
    actions = []
    for inst in self.instances:
      node = int(inst.start)
      for _ in range(int(inst.hops)):
        actions.append(f"<tool_call>lookup {node}</tool_call>")
        node = self.table[node]
    return actions + [answer]
