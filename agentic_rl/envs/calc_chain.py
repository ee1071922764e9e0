"""Arithmetic chains: numbers too large to compute token by token.

An instance is a left-nested chain ``((a0 op1 b1) op2 b2) ... opk bk`` of
non-negative integers with ``op`` in ``+ - * /`` (``/`` is floor division);
every intermediate stays below ``10**9``, so the calculator can carry it. The
prompt shows the expression, e.g. ``Compute (482*93)+127.``; the answer is its
exact value. Difficulty sets the number of operations and operand sizes.

Scripted strategies:

* ``stepwise``: one ``calc`` per operation, carrying the last result
  (k calls);
* ``oneshot``: one ``calc`` on the whole expression (1 call, long call);
* ``memo``: stepwise, storing every result in memory and recalling the last
  before answering (2k + 1 calls).
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

_OPS = "+-*/"
LIMIT = 10**9 - 1  # intermediates stay at most 9 digits


@dataclasses.dataclass(frozen=True)
class CalcLevel:
  """One difficulty level: ``num_ops`` operations on a ``first_digits``-digit
  start value with ``operand_digits``-digit operands, drawn from ``ops``."""

  num_ops: int
  first_digits: int
  operand_digits: int
  ops: str = "+-*"

  def __post_init__(self):
    if not 1 <= self.num_ops <= 8:
      raise ValueError(f"CalcLevel.num_ops must be in [1, 8], got {self.num_ops}")
    for what in ("first_digits", "operand_digits"):
      if not 1 <= getattr(self, what) <= 4:
        raise ValueError(f"CalcLevel.{what} must be in [1, 4], got {getattr(self, what)}")
    if not self.ops or set(self.ops) - set(_OPS):
      raise ValueError(f"CalcLevel.ops must be a non-empty subset of {_OPS!r}, got {self.ops!r}")


LEVELS = (
    CalcLevel(2, 3, 2),
    CalcLevel(2, 4, 3),
    CalcLevel(3, 4, 3, "+-*/"),
    CalcLevel(4, 4, 3, "+-*/"),
    CalcLevel(5, 4, 4, "+-*/"),
)


@struct.dataclass
class CalcInstance:
  """``operands``: int32 ``[K+1]`` (a0, b1..bK); ``ops``: int32 ``[K]`` indices
  into ``"+-*/"``; ``num_ops``, ``answer``, ``level``: int32 ``[]``."""

  world: tools.World
  operands: jax.Array
  ops: jax.Array
  num_ops: jax.Array
  answer: jax.Array
  level: jax.Array


def _random_digits(u, digits):
  lo = jnp.asarray(10, jnp.int32) ** (digits - 1)
  return episode.uniform_ints(u, lo, lo * 10)


def expression(operands: np.ndarray, ops: np.ndarray, num_ops: int) -> str:
  """The chain as text, left-nested: ``((a0*b1)+b2)-b3``."""
  out = "(" * (num_ops - 1) + str(int(operands[0]))
  for i in range(num_ops):
    out += _OPS[int(ops[i])] + str(int(operands[i + 1])) + (")" if i < num_ops - 1 else "")
  return out


class CalcChainEnv(episode.ToolEnv):
  """Arithmetic chains (see the module docstring)."""

  name = "calc_chain"
  strategies = ("stepwise", "oneshot", "memo")

  def __init__(self, tokenizer_or_codec, *, levels=LEVELS, max_turns: int | None = None,
               max_action_len: int = 48, **kwargs):
    levels = tuple(levels)
    if not levels or not all(isinstance(l, CalcLevel) for l in levels):
      raise ValueError("levels must be a non-empty sequence of CalcLevel")
    self.levels = levels
    self.num_levels = len(levels)
    self.max_ops = max(l.num_ops for l in levels)
    # memo needs 2k+1 calls and the answer.
    if max_turns is None:
      max_turns = 2 * self.max_ops + 2
    super().__init__(tokenizer_or_codec, max_turns=max_turns,
                     max_action_len=max_action_len, **kwargs)
    # tags, name, space; k-1 "("; a0; per operation: op, operand (+1 digit
    # when noisy), ")".
    longest = 4 + (self.max_ops - 1) + 4 + self.max_ops * 7
    if max_action_len < longest:
      raise ValueError(f"max_action_len={max_action_len} is too short for the oneshot "
                       f"call of {self.max_ops} operations; need >= {longest}")
    self._table = {
        "num_ops": np.array([l.num_ops for l in levels], np.int32),
        "first": np.array([l.first_digits for l in levels], np.int32),
        "digits": np.array([l.operand_digits for l in levels], np.int32),
        "op_mask": np.array([[c in l.ops for c in _OPS] for l in levels], bool),
    }

  def _generate(self, key, level):
    K = self.max_ops
    get = lambda name: jnp.asarray(self._table[name])[level]
    num_ops = get("num_ops")
    u = jax.random.uniform(key, (2 * K + 1,))
    a0 = _random_digits(u[0], get("first"))
    # Operators uniform over the level's allowed ones.
    allowed = get("op_mask")
    pick = episode.uniform_ints(u[1:K + 1], 0, allowed.sum())
    ops = jnp.argmax(jnp.cumsum(allowed)[None, :] > pick[:, None], axis=1)
    bs = _random_digits(u[K + 1:], get("digits"))

    def body(r, x):
      i, op, b = x
      # Keep every intermediate in [1, LIMIT]: fall back to + (or - near LIMIT).
      op = jnp.where((op == 2) & (r > LIMIT // b), 0, op)
      op = jnp.where(((op == 1) & (b >= r)) | ((op == 3) & (b > r)), 0, op)
      op = jnp.where((op == 0) & (r > LIMIT - b), 1, op)
      value = jnp.select([op == 0, op == 1, op == 2], [r + b, r - b, r * b], r // b)
      live = i < num_ops
      return jnp.where(live, value, r), jnp.where(live, op, 0)

    answer, ops = jax.lax.scan(body, a0, (jnp.arange(K), ops, bs))
    return CalcInstance(world=tools.empty_world(), operands=jnp.concatenate([a0[None], bs]),
                        ops=ops.astype(jnp.int32), num_ops=num_ops, answer=answer,
                        level=level)

  def prompt_text(self, instance: CalcInstance) -> str:
    i = jax.tree.map(np.asarray, instance)
    return f"Compute {expression(i.operands, i.ops, int(i.num_ops))}."

  def _script(self, state, u, strategy, mistake):
    inst = state.instance
    v = self.vocab
    op_ids = jnp.asarray([v.plus, v.minus, v.times, v.divide])
    wrong = jnp.where(mistake == self.WRONG_ARGUMENT, episode.uniform_ints(u[0], 1, 10), 0)
    K = self.max_ops
    num = lambda x: T.render_int(x, v)
    # stepwise / memo: x op_j b_j with x the last result (a0 first).
    j = jnp.minimum(state.tool_successes[T.CALC], inst.num_ops - 1)
    x = jnp.where(state.tool_successes[T.CALC] == 0, inst.operands[0], state.last_value)
    single = self._call(T.CALC, [num(x), (op_ids[inst.ops[j]], None),
                                 num(inst.operands[j + 1] + wrong)], mistake)
    # oneshot: the whole expression, the last operand possibly wrong.
    last = jnp.arange(K) == inst.num_ops - 1
    live = jnp.arange(K) < inst.num_ops
    segments = [(jnp.full((K,), v.lparen), inst.num_ops - 1), num(inst.operands[0])]
    for i in range(K):
      b, b_len = num(inst.operands[i + 1] + jnp.where(last[i], wrong, 0))
      segments += [(op_ids[inst.ops[i]], live[i]), (b, b_len * live[i]),
                   (v.rparen, live[i] & ~last[i])]
    whole = self._call(T.CALC, segments, mistake)
    oneshot = strategy == self.strategies.index("oneshot")
    main = tuple(jnp.where(oneshot, w, s) for w, s in zip(whole, single))
    return self._chain_script(
        state, u[1], tool=T.CALC, steps=jnp.where(oneshot, 1, inst.num_ops),
        main_call=main, memo=strategy == self.strategies.index("memo"), mistake=mistake)
