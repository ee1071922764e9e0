"""Search among hidden boxes: several strategies succeed at different cost.

An instance hides ``n`` boxes holding distinct numbers in increasing order;
the prompt names a number (``Boxes 1-8 hold sorted numbers. Which box holds
4821?``) and the answer is the box holding it. ``open N`` reveals box ``N``.
Difficulty sets the number of boxes and the size of the numbers.

Scripted strategies, all exact, with different call counts: ``linear``
(open boxes upwards), ``reverse`` (downwards) and ``binary`` (bisect). Each
answers as soon as the box is seen or is the only one left (boxes below the
number hold smaller values, boxes above larger ones), so the cost of each
depends on where the number lies.
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


@dataclasses.dataclass(frozen=True)
class BoxLevel:
  """``boxes`` boxes holding ``digits``-digit numbers."""

  boxes: int
  digits: int

  def __post_init__(self):
    if not 2 <= self.boxes <= 64 or not 2 <= self.digits <= 6:
      raise ValueError(f"BoxLevel needs 2 <= boxes <= 64 and 2 <= digits <= 6, got {self}")
    if 9 * 10 ** (self.digits - 1) < 2 * self.boxes:
      raise ValueError(f"BoxLevel {self}: too few {self.digits}-digit numbers")


LEVELS = (BoxLevel(4, 2), BoxLevel(6, 3), BoxLevel(8, 3), BoxLevel(12, 4), BoxLevel(16, 4))


@struct.dataclass
class BoxInstance:
  """``target`` (the number sought), ``answer`` (its box, 1-based), ``level``:
  int32 ``[]``; the boxes are in ``world``."""

  world: tools.World
  target: jax.Array
  answer: jax.Array
  level: jax.Array


class BoxesEnv(episode.ToolEnv):
  """Search among hidden sorted boxes (see the module docstring)."""

  name = "boxes"
  strategies = ("linear", "reverse", "binary")

  def __init__(self, tokenizer_or_codec, *, levels=LEVELS, max_turns: int | None = None,
               max_action_len: int = 24, **kwargs):
    levels = tuple(levels)
    if not levels or not all(isinstance(l, BoxLevel) for l in levels):
      raise ValueError("levels must be a non-empty sequence of BoxLevel")
    self.levels = levels
    self.num_levels = len(levels)
    self.max_boxes = max(l.boxes for l in levels)
    # linear and reverse may open every box but one, then answer.
    if max_turns is None:
      max_turns = self.max_boxes + 1
    super().__init__(tokenizer_or_codec, max_turns=max_turns,
                     max_action_len=max_action_len, **kwargs)
    if max_action_len < 16:
      raise ValueError(f"max_action_len={max_action_len} is too short; need >= 16")
    self._boxes = np.array([l.boxes for l in levels], np.int32)
    self._digits = np.array([l.digits for l in levels], np.int32)

  def _generate(self, key, level):
    M = self.max_boxes
    n = jnp.asarray(self._boxes)[level]
    lo = jnp.asarray(10, jnp.int32) ** (jnp.asarray(self._digits)[level] - 1)
    u = jax.random.uniform(key, (M + 1,))
    # Distinct increasing numbers in [lo, 10 lo): positive random gaps.
    max_gap = (9 * lo) // n
    gaps = episode.uniform_ints(u[:M], 1, max_gap + 1)
    i = jnp.arange(M)
    contents = jnp.where(i < n, lo - 1 + jnp.cumsum(gaps), 0).astype(jnp.int32)
    box = episode.uniform_ints(u[M], 0, n)
    world = tools.World(table_keys=jnp.zeros((1,), jnp.int32),
                        table_values=jnp.zeros((1,), jnp.int32),
                        table_size=jnp.zeros((), jnp.int32), boxes=contents, num_boxes=n)
    return BoxInstance(world=world, target=contents[box], answer=(box + 1).astype(jnp.int32),
                       level=level)

  def prompt_text(self, instance: BoxInstance) -> str:
    n = int(instance.world.num_boxes)
    return f"Boxes 1-{n} hold sorted numbers. Which box holds {int(instance.target)}?"

  def _script(self, state, u, strategy, mistake):
    inst = state.instance
    boxes = inst.world.boxes
    n = inst.world.num_boxes
    i = jnp.arange(boxes.shape[0])
    seen = state.opened & (i < n)
    # What the opened boxes tell: the number lies in boxes lo..hi (0-based).
    lo = jnp.max(jnp.where(seen & (boxes < inst.target), i, -1)) + 1
    hi = jnp.min(jnp.where(seen & (boxes > inst.target), i, n)) - 1
    found = seen & (boxes == inst.target)
    answer_now = found.any() | (lo >= hi)
    answer = jnp.where(found.any(), jnp.argmax(found), lo) + 1
    probe = jnp.select([strategy == 0, strategy == 1], [lo, hi], (lo + hi) // 2)
    probe = jnp.where(mistake == self.WRONG_ARGUMENT, episode.uniform_ints(u[0], 0, n), probe)
    call = self._call(T.OPEN, [T.render_int(probe + 1, self.vocab)], mistake)
    return self._finish(state, call, answer, answer_now, (lo + hi) // 2 + 1, mistake)
