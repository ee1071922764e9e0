"""Composed tool tasks: a family defined by programs over the built-in tools.

A *program* is a sequence of operations on one running number, each done
with a tool: ``lookup`` (the number is a key of the hidden table: take its
value), ``open`` (the number is a box: take what it holds), ``add`` /
``sub`` / ``mul`` by a constant (``calc``). An instance draws a program,
a start and constants, and builds the hidden world the program reads; the
prompt says what to do, e.g. ``Start with 417; look it up, add 35, look it
up. Answer the result.``, and the answer is the number at the end.

Not every program can be solved: ``open`` after a lookup asks for a box
numbered in the hundreds, a product can overflow, a number can come back
to a key already used with another value. Such instances keep their
answer but the tools cannot reach it (``valid`` is False): the synthesis
filter (:mod:`agentic_rl.envs.synthesis`) runs the scripted solver to find
and drop these programs.

Difficulty: level ``d`` draws uniformly among the programs at most ``d``
operations longer than the shortest. The scripted policy (``direct``) does
one call per operation, carrying the last result, then answers it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from agentic_rl.envs import episode
from agentic_rl.envs import tokens as T
from agentic_rl.envs import tools

OPS = ("lookup", "open", "add", "sub", "mul")
LOOKUP, OPEN, ADD, SUB, MUL = range(len(OPS))
MAX_OPS = 6
LIMIT = 10**9 - 1
NUM_BOXES, DISTRACTORS = 8, 4
# A small set of programs; a synthesised set replaces it (``programs=``).
DEFAULT_PROGRAMS = (("lookup", "add"), ("add", "lookup"), ("open", "mul"),
                    ("lookup", "sub", "lookup"), ("open", "add", "lookup"))


@struct.dataclass
class ComposedInstance:
  """``ops``, ``consts``: int32 ``[MAX_OPS]`` (the program, -1 padded, and
  each operation's constant); ``start``, ``num_ops``, ``answer``,
  ``program``, ``level``: int32 ``[]``; ``valid``: bool ``[]`` the tools can
  reach the answer."""

  world: tools.World
  start: jax.Array
  ops: jax.Array
  consts: jax.Array
  num_ops: jax.Array
  answer: jax.Array
  valid: jax.Array
  program: jax.Array
  level: jax.Array


def check_programs(programs) -> tuple[tuple[str, ...], ...]:
  """``programs`` as a tuple of tuples of :data:`OPS` names; ValueError
  saying what is wrong."""
  out = tuple(tuple(p) for p in programs)
  if not out:
    raise ValueError("composed: programs is empty")
  for p in out:
    if not 1 <= len(p) <= MAX_OPS or any(op not in OPS for op in p):
      raise ValueError(f"composed: a program is 1 to {MAX_OPS} of {OPS}, got {p!r}")
  return out


class ComposedEnv(episode.ToolEnv):
  """Programs over the built-in tools (see the module docstring)."""

  name = "composed"
  strategies = ("direct",)
  num_levels = MAX_OPS

  def __init__(self, tokenizer_or_codec, *, programs=DEFAULT_PROGRAMS,
               max_turns: int | None = None, max_action_len: int = 24, **kwargs):
    self.programs = check_programs(programs)
    L = MAX_OPS
    self._ops = np.array([[OPS.index(op) for op in p] + [-1] * (L - len(p))
                          for p in self.programs], np.int32)
    self._lens = np.array([len(p) for p in self.programs], np.int32)
    if max_turns is None:
      max_turns = int(self._lens.max()) + 2
    super().__init__(tokenizer_or_codec, max_turns=max_turns,
                     max_action_len=max_action_len, **kwargs)

  def _generate(self, key, level):
    lens = jnp.asarray(self._lens)
    allowed = lens <= lens.min() + level
    pick = episode.uniform_ints(jax.random.uniform(jax.random.fold_in(key, 1)), 0,
                                allowed.sum())
    return self.instance_of(key, jnp.argmax(jnp.cumsum(allowed) > pick), level)

  def instance_of(self, key, program, level=0) -> ComposedInstance:
    """An instance of program number ``program`` (int32, may be traced)."""
    L, M, N = MAX_OPS, NUM_BOXES, MAX_OPS + DISTRACTORS
    lens = jnp.asarray(self._lens)
    u = jax.random.uniform(key, (3 + 3 * L + N + M,))
    ops, n = jnp.asarray(self._ops)[program], lens[program]
    start = jnp.where(ops[0] == OPEN, episode.uniform_ints(u[1], 1, M + 1),
                      episode.uniform_ints(u[1], 100, 1000))
    consts = jnp.where(ops == MUL, episode.uniform_ints(u[3:3 + L], 2, 10),
                       episode.uniform_ints(u[3:3 + L], 1, 100))
    fresh = episode.uniform_ints(u[3 + L:3 + 2 * L], 100, 1000)  # looked-up values
    held = episode.uniform_ints(u[3 + 2 * L:3 + 3 * L], 1, 1000)  # opened boxes' contents
    # Distractor rows (after the program's, so a repeated key reads the
    # program's value) and boxes the program does not open.
    keys = jnp.concatenate([jnp.full((L,), -1), episode.uniform_ints(u[3 + 3 * L:3 + 3 * L + N - L],
                                                                       100, 1000)])
    values = jnp.concatenate([jnp.zeros((L,), jnp.int32),
                              episode.uniform_ints(u[3 + 3 * L + N - L:3 + 3 * L + N], 100, 1000)])
    boxes = episode.uniform_ints(u[3 + 3 * L + N:], 1, 1000)

    def body(carry, i):
      x, valid, keys, values, boxes, opened = carry
      op, c, live = ops[i], consts[i], i < n
      is_lookup, is_open = live & (op == LOOKUP), live & (op == OPEN)
      reused = jnp.any((keys[:L] == x) & (jnp.arange(L) < i))
      in_range = (x >= 1) & (x <= M)
      box = jnp.clip(x - 1, 0, M - 1)
      calc = jnp.select([op == ADD, op == SUB], [x + c, x - c], x * jnp.minimum(c, 9))
      y = jnp.select([op == LOOKUP, op == OPEN], [fresh[i], held[i]], calc)
      ok = jnp.select([op == LOOKUP, op == OPEN], [~reused, in_range & ~opened[box]],
                      (calc >= 0) & (calc <= LIMIT) & (x <= LIMIT // 9))
      keys = keys.at[i].set(jnp.where(is_lookup, x, keys[i]))
      values = values.at[i].set(jnp.where(is_lookup, y, values[i]))
      write_box = is_open & in_range
      boxes = boxes.at[box].set(jnp.where(write_box, y, boxes[box]))
      opened = opened.at[box].set(opened[box] | write_box)
      return (jnp.where(live, y, x), valid & (ok | ~live), keys, values, boxes, opened), None

    init = (start, jnp.ones((), bool), keys.astype(jnp.int32), values.astype(jnp.int32),
            boxes.astype(jnp.int32), jnp.zeros((M,), bool))
    (answer, valid, keys, values, boxes, _), _ = jax.lax.scan(body, init, jnp.arange(L))
    world = tools.World(table_keys=keys, table_values=values, table_size=jnp.int32(N),
                        boxes=boxes, num_boxes=jnp.int32(M))
    return ComposedInstance(world=world, start=start.astype(jnp.int32), ops=ops,
                            consts=consts.astype(jnp.int32), num_ops=n,
                            answer=answer.astype(jnp.int32), valid=valid,
                            program=jnp.asarray(program, jnp.int32),
                            level=jnp.asarray(level, jnp.int32))

  def prompt_text(self, instance: ComposedInstance) -> str:
    i = jax.tree.map(np.asarray, instance)
    phrase = {LOOKUP: lambda c: "look it up", OPEN: lambda c: "open that box",
              ADD: lambda c: f"add {c}", SUB: lambda c: f"subtract {c}",
              MUL: lambda c: f"multiply by {c}"}
    steps = ", ".join(phrase[int(op)](int(c)) for op, c in
                      zip(i.ops[:int(i.num_ops)], i.consts[:int(i.num_ops)]))
    return f"Start with {int(i.start)}; {steps}. Answer the result."

  def _script(self, state, u, strategy, mistake):
    del strategy
    inst, v = state.instance, self.vocab
    done = (state.tool_successes[T.LOOKUP] + state.tool_successes[T.OPEN]
            + state.tool_successes[T.CALC])
    stage = jnp.minimum(done, MAX_OPS - 1)
    x = jnp.where(done == 0, inst.start, state.last_value)
    x = x + jnp.where(mistake == self.WRONG_ARGUMENT, episode.uniform_ints(u[0], 1, 10), 0)
    op, c = inst.ops[stage], inst.consts[stage]
    num = lambda value: T.render_int(value, v)
    operator = jnp.select([op == ADD, op == SUB], [v.plus, v.minus], v.times)
    calls = [self._call(T.LOOKUP, [num(x)], mistake), self._call(T.OPEN, [num(x)], mistake),
             self._call(T.CALC, [num(x), (operator, None), num(c)], mistake)]
    which = jnp.select([op == LOOKUP, op == OPEN], [0, 1], 2)
    call = tuple(jnp.stack(parts)[which] for parts in zip(*calls))
    return self._finish(state, call, state.last_value, done >= inst.num_ops,
                        state.last_value, mistake)
