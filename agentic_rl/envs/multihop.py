"""Multi-hop lookup over a hidden key-value graph: k hops need k tool calls.

An instance hides a table of distinct 3-digit node ids, each mapping to
another node. The prompt names a start node and a hop count (``Start at 417;
follow 3 hops.``); the answer is the node reached. Only ``lookup`` reveals the
table, and the node at the end of the path maps onward too, so the hops must
be counted. Difficulty sets the hops and the table size (distractors).

Scripted strategies: ``direct`` (look up each hop, answer the last result)
and ``memo`` (also store each hop in memory and recall the last one).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from agentic_rl.envs import episode
from agentic_rl.envs import tokens as T
from agentic_rl.envs import tools

FIRST_NODE, NUM_NODES = 100, 900  # node ids are 100..999


@dataclasses.dataclass(frozen=True)
class HopLevel:
  """``hops`` lookups through a table of ``entries`` nodes."""

  hops: int
  entries: int

  def __post_init__(self):
    if not 1 <= self.hops < self.entries <= 64:
      raise ValueError(f"HopLevel needs 1 <= hops < entries <= 64, got {self}")


LEVELS = (HopLevel(1, 4), HopLevel(2, 6), HopLevel(3, 8), HopLevel(4, 12), HopLevel(6, 16))


@struct.dataclass
class HopInstance:
  """``start``, ``hops``, ``answer``, ``level``: int32 ``[]``; the table is in
  ``world``."""

  world: tools.World
  start: jax.Array
  hops: jax.Array
  answer: jax.Array
  level: jax.Array


class MultiHopEnv(episode.ToolEnv):
  """Multi-hop lookup (see the module docstring)."""

  name = "multihop"
  strategies = ("direct", "memo")

  def __init__(self, tokenizer_or_codec, *, levels=LEVELS, max_turns: int | None = None,
               max_action_len: int = 24, **kwargs):
    levels = tuple(levels)
    if not levels or not all(isinstance(l, HopLevel) for l in levels):
      raise ValueError("levels must be a non-empty sequence of HopLevel")
    self.levels = levels
    self.num_levels = len(levels)
    self.max_entries = max(l.entries for l in levels)
    max_hops = max(l.hops for l in levels)
    if max_turns is None:
      max_turns = 2 * max_hops + 2
    super().__init__(tokenizer_or_codec, max_turns=max_turns,
                     max_action_len=max_action_len, **kwargs)
    if max_action_len < 18:
      raise ValueError(f"max_action_len={max_action_len} is too short; need >= 18")
    self._hops = np.array([l.hops for l in levels], np.int32)
    self._entries = np.array([l.entries for l in levels], np.int32)

  def _generate(self, key, level):
    N = self.max_entries
    hops = jnp.asarray(self._hops)[level]
    entries = jnp.asarray(self._entries)[level]
    u_nodes, u_shuffle, u_next, u_order = jax.random.uniform(key, (4, N))
    # N distinct ids: one uniform draw per stratum of the id range, shuffled.
    width = NUM_NODES // N
    i = jnp.arange(N)
    nodes = FIRST_NODE + i * width + episode.uniform_ints(u_nodes, 0, width)
    nodes = nodes[jnp.argsort(u_shuffle)]
    # Path nodes[0] -> nodes[1] -> ... -> nodes[hops]; every other row
    # (nodes[hops] included) points to a different random node.
    other = (i + 1 + episode.uniform_ints(u_next, 0, entries - 1)) % entries
    values = jnp.where(i < hops, nodes[jnp.minimum(i + 1, N - 1)], nodes[other])
    order = jnp.argsort(jnp.where(i < entries, u_order, 2.0))
    world = tools.World(
        table_keys=jnp.where(i < entries, nodes[order], 0).astype(jnp.int32),
        table_values=jnp.where(i < entries, values[order], 0).astype(jnp.int32),
        table_size=entries, boxes=jnp.zeros((1,), jnp.int32),
        num_boxes=jnp.zeros((), jnp.int32))
    return HopInstance(world=world, start=nodes[0].astype(jnp.int32), hops=hops,
                       answer=nodes[hops].astype(jnp.int32), level=level)

  def prompt_text(self, instance: HopInstance) -> str:
    hops = int(instance.hops)
    return f"Start at {int(instance.start)}; follow {hops} hop{'s' if hops > 1 else ''}."

  def _script(self, state, u, strategy, mistake):
    inst = state.instance
    table = inst.world
    # A wrong argument looks up another node of the table (a wrong turn).
    wrong = table.table_keys[episode.uniform_ints(u[0], 0, table.table_size)]
    first = state.tool_successes[T.LOOKUP] == 0
    node = jnp.where(first, inst.start, state.last_value)
    node = jnp.where(mistake == self.WRONG_ARGUMENT, wrong, node)
    call = self._call(T.LOOKUP, [T.render_int(node, self.vocab)], mistake)
    return self._chain_script(state, u[1], tool=T.LOOKUP, steps=inst.hops,
                              main_call=call, memo=strategy == self.strategies.index("memo"),
                              mistake=mistake)
