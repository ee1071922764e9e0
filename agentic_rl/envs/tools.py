"""The tools, as pure JAX functions over token classes (see ``tokens.py``).

* ``calc EXPR``: integer arithmetic with ``+ - * /`` (floor division, as
  Python's ``//``), unary ``+``/``-`` and parentheses, usual precedence.
  Every literal, intermediate and result must lie in ``[-MAX_INT, MAX_INT]``
  (so all 9-digit integers work); otherwise ``error: overflow``. Division by
  zero gives ``error: division by zero`` and anything not in the grammar
  ``error: malformed call``. When several errors occur, a malformed expression
  wins, else the first evaluation error in post-order (the order Python
  evaluates the same expression in).
* ``store K:V`` / ``recall K``: a key-value memory of ``S`` integer slots kept
  in the episode state (``ok``; ``error: memory full``; ``error: not found``).
* ``lookup K``: reads a hidden table of the episode (``error: not found``).
* ``open N``: reads hidden box ``N`` (1-based; ``error: no such box``).

Spaces separate tokens and are skipped, but never split a number.

Every tool declares a nominal latency in seconds (:data:`LATENCY_S`), a model
of what the real tool it stands for would cost: arithmetic and a local
memory answer in milliseconds, opening a box (a file) takes longer, and a
lookup (a database or search query) longest. The tools themselves run
inside ``jit`` in no measurable time; an episode sums the latencies of its
calls as its environment time (``EpisodeState.env_seconds``), the quantity a
Python environment's measured step time stands for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from agentic_rl.envs import tokens as T

MAX_INT = T.MAX_INT

# Nominal latency of one call of each tool, in seconds (see the module
# docstring).
LATENCY_S = {"calc": 0.01, "store": 0.005, "recall": 0.005, "lookup": 0.25, "open": 0.05}


def latencies() -> np.ndarray:
  """float32 ``[len(TOOLS)]``: :data:`LATENCY_S` in tool-id order."""
  return np.asarray([LATENCY_S[name] for name in T.TOOLS], np.float32)


@struct.dataclass
class World:
  """Hidden episode data the tools read (fixed shapes per environment).

  Attributes:
    table_keys, table_values: int32 ``[N]``, the lookup table; rows at and
      after ``table_size`` are unused.
    table_size: int32 ``[]``.
    boxes: int32 ``[M]`` box contents; box ``n`` (1-based) is ``boxes[n-1]``.
    num_boxes: int32 ``[]``.
  """

  table_keys: jax.Array
  table_values: jax.Array
  table_size: jax.Array
  boxes: jax.Array
  num_boxes: jax.Array


def empty_world(table_rows: int = 1, max_boxes: int = 1) -> World:
  """A world with an empty table and no boxes (shapes kept static)."""
  z = lambda n: jnp.zeros((n,), jnp.int32)
  return World(z(table_rows), z(table_rows), jnp.zeros((), jnp.int32),
               z(max_boxes), jnp.zeros((), jnp.int32))


@struct.dataclass
class Memory:
  """The key-value memory: int32 ``keys``/``values`` and bool ``used``, ``[S]``."""

  keys: jax.Array
  values: jax.Array
  used: jax.Array


def empty_memory(slots: int) -> Memory:
  return Memory(jnp.zeros((slots,), jnp.int32), jnp.zeros((slots,), jnp.int32),
                jnp.zeros((slots,), bool))


def _fold_tokens(body, carry, cls_A: jax.Array, digit_A: jax.Array):
  """Runs ``body(carry, (class, digit))`` over the tokens before the first
  ``PAD``, then once on a ``PAD`` sentinel. A while loop, so a vmapped batch
  stops at its longest row rather than at ``A``."""
  A = cls_A.shape[0]
  is_pad = cls_A == T.PAD
  length = jnp.where(is_pad.any(), jnp.argmax(is_pad), A)

  def step(state):
    i, carry = state
    j = jnp.minimum(i, A - 1)
    token = (jnp.where(i < length, cls_A[j], T.PAD).astype(jnp.int32),
             digit_A[j].astype(jnp.int32))
    return i + 1, body(carry, token)[0]

  return jax.lax.while_loop(lambda state: state[0] <= length, step,
                            (jnp.zeros((), jnp.int32), carry))[1]


# --------------------------------------------------------------- calculator
# The calculator reads tokens left to right keeping, for the innermost open
# parenthesis, the running sum ``total`` with its pending ``+``/``-``, the
# running product ``term`` with its pending ``*``/``/``, and a pending unary
# sign; ``(`` pushes these registers on a stack and ``)`` pops them. A
# finished factor (a number, or a parenthesised sum, folded one token later)
# is folded into the term, and ``+``, ``-`` or ``)`` fold the term into the
# sum: at most one of each per token, no inner loop, and in the order Python
# evaluates the same expression.
_NONE, _ADD, _SUB, _MUL, _DIV = range(5)


@struct.dataclass
class _Regs:
  """The registers of one parenthesis level (int32 scalars, or ``[D]`` stacks)."""

  total: jax.Array   # sum of the finished terms
  add_op: jax.Array  # _NONE (no term yet), _ADD or _SUB
  term: jax.Array    # product of the finished factors
  mul_op: jax.Array  # _NONE (term start), _MUL or _DIV
  neg: jax.Array     # int32 0/1: the next factor is negated


@struct.dataclass
class _Calc:
  regs: _Regs        # the innermost level
  stack: _Regs       # the enclosing levels, [D] each
  depth: jax.Array
  acc: jax.Array     # the literal being read
  in_num: jax.Array
  closed: jax.Array  # the previous token was ")": ``value`` is a factor
  value: jax.Array
  expect: jax.Array  # an operand is expected next
  syntax: jax.Array  # the expression is malformed
  err: jax.Array     # first evaluation error (status code) or OK


def _latch(err, cond, code):
  return jnp.where((err == T.OK) & cond, code, err)


def _add_sub(op, a, b):
  """``a + b`` or ``a - b`` (op ``_ADD``/``_SUB``) and its status; inputs in range."""
  b = jnp.where(op == _SUB, -b, b)
  ovf = ((b > 0) & (a > MAX_INT - b)) | ((b < 0) & (a < -MAX_INT - b))
  return a + b, jnp.where(ovf, T.OVERFLOW, T.OK)


def _mul_div(op, a, b):
  """``a * b`` or ``a // b`` (op ``_MUL``/``_DIV``, floor division) and its status."""
  mul_ovf = (a != 0) & (jnp.abs(b) > MAX_INT // jnp.maximum(jnp.abs(a), 1))
  safe_b = jnp.where(b == 0, 1, b)
  q = jax.lax.div(a, safe_b)  # truncates towards zero
  q = q - ((jax.lax.rem(a, safe_b) != 0) & ((a < 0) != (safe_b < 0)))
  is_div = op == _DIV
  status = jnp.where(is_div, jnp.where(b == 0, T.DIV_ZERO, T.OK),
                     jnp.where(mul_ovf, T.OVERFLOW, T.OK))
  return jnp.where(is_div, q, a * b), status


def _calc_token(s: _Calc, x) -> tuple[_Calc, None]:
  c, d = x
  r = s.regs
  is_digit = c == T.DIGIT
  # A finished factor: the number this token ends, or the previous ")".
  fold = (s.in_num & ~is_digit) | s.closed
  factor = jnp.where(s.closed, s.value, s.acc)
  factor = jnp.where(r.neg > 0, -factor, factor)
  product, status = _mul_div(r.mul_op, r.term, factor)
  r = r.replace(term=jnp.where(fold, jnp.where(r.mul_op == _NONE, factor, product), r.term),
                mul_op=jnp.where(fold, _NONE, r.mul_op), neg=jnp.where(fold, 0, r.neg))
  err = _latch(s.err, fold & (s.regs.mul_op != _NONE), status)
  # Digits.
  starts = is_digit & ~s.in_num
  base = jnp.where(s.in_num, s.acc, 0)
  lit_ovf = is_digit & (base > (MAX_INT - d) // 10)
  acc = jnp.where(is_digit, jnp.where(lit_ovf, MAX_INT, base * 10 + d), s.acc)
  expect = s.expect & ~is_digit & ~s.in_num
  err = _latch(err, lit_ovf, T.OVERFLOW)
  # Operators.
  sign = (c == T.PLUS) | (c == T.MINUS)
  unary = sign & expect
  add = sign & ~expect
  mul = ((c == T.TIMES) | (c == T.DIVIDE)) & ~expect
  lparen = (c == T.LPAREN) & expect
  rparen = (c == T.RPAREN) & ~expect & (s.depth > 0)
  bad = (starts & ~s.expect) | ~(is_digit | sign | mul | lparen | rparen | (c == T.SPACE)
                                 | (c == T.PAD))
  # "+"/"-" after an operand, or ")": the term is finished.
  total, status = _add_sub(r.add_op, r.total, r.term)
  value = jnp.where(r.add_op == _NONE, r.term, total)
  err = _latch(err, (add | rparen) & (r.add_op != _NONE), status)
  r = r.replace(total=jnp.where(add, value, r.total),
                add_op=jnp.where(add, jnp.where(c == T.PLUS, _ADD, _SUB), r.add_op),
                mul_op=jnp.where(mul, jnp.where(c == T.TIMES, _MUL, _DIV), r.mul_op),
                neg=r.neg ^ (unary & (c == T.MINUS)))
  # "(" pushes the registers and starts fresh ones; ")" pops them (its sum
  # is then a factor, folded at the next token).
  top = jnp.clip(s.depth, 0, s.stack.total.shape[0] - 1)
  below = jnp.clip(s.depth - 1, 0, s.stack.total.shape[0] - 1)
  stack = jax.tree.map(lambda st, x: jnp.where(lparen, st.at[top].set(x), st), s.stack, r)
  fresh = _Regs(*(jnp.zeros((), jnp.int32),) * 5)
  popped = jax.tree.map(lambda st: st[below], s.stack)
  r = jax.tree.map(lambda f, p, x: jnp.select([lparen, rparen], [f, p], x), fresh, popped, r)
  return s.replace(
      regs=r, stack=stack, depth=s.depth + lparen - rparen, acc=acc, in_num=is_digit,
      closed=rparen, value=value,
      expect=jnp.where(unary | add | mul | lparen, True, expect & ~rparen),
      syntax=s.syntax | bad, err=err), None


def calculate(cls_A: jax.Array, digit_A: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Evaluates an expression given as token classes.

  Args:
    cls_A: int32 ``[A]`` token classes (``PAD`` after the expression).
    digit_A: int32 ``[A]`` digit values.
  Returns:
    ``(value, status)``: int32 ``[]`` each; value is 0 unless status is OK.
  """
  # A well-formed expression nests at most (A - 1) // 2 levels deep.
  D = (cls_A.shape[0] + 1) // 2 + 1
  zero = jnp.zeros((), jnp.int32)
  f = jnp.zeros((), bool)
  s = _Calc(regs=_Regs(*(zero,) * 5), stack=_Regs(*(jnp.zeros((D,), jnp.int32),) * 5),
            depth=zero, acc=zero, in_num=f, closed=f, value=zero, expect=~f, syntax=f,
            err=zero + T.OK)
  s = _fold_tokens(_calc_token, s, cls_A, digit_A)
  # The PAD sentinel folded the last factor; the outermost sum remains.
  r = s.regs
  total, sum_status = _add_sub(r.add_op, r.total, r.term)
  value = jnp.where(r.add_op == _NONE, r.term, total)
  err = _latch(s.err, r.add_op != _NONE, sum_status)
  status = jnp.where(s.syntax | s.expect | (s.depth != 0), T.MALFORMED, err)
  return jnp.where(status == T.OK, value, 0), status


# ---------------------------------------------------------------- numbers
def parse_numbers(cls_A: jax.Array, digit_A: jax.Array, max_count: int = 2,
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Parses ``NUM (':' NUM)*`` with ``NUM = '-'? digit+``, spaces around.

  Returns:
    ``(values_[max_count], count_[], status_[])``: status is OK, MALFORMED
    (not the grammar, or more than ``max_count`` numbers) or OVERFLOW.
  """
  def body(carry, x):
    vals, count, acc, in_num, neg, sign, need, bad, ovf = carry
    c, d = x
    is_digit = c == T.DIGIT
    ends = in_num & ~is_digit
    vals = jnp.where(ends, vals.at[jnp.clip(count, 0, max_count - 1)].set(
        jnp.where(neg, -acc, acc)), vals)
    bad = bad | (ends & (count >= max_count)) | (sign & ~is_digit)
    count = count + ends
    need = need & ~ends
    neg = neg & ~ends
    bad = bad | (is_digit & ~in_num & ~need)
    base = jnp.where(in_num, acc, 0)
    lit_ovf = is_digit & (base > (MAX_INT - d) // 10)
    acc = jnp.where(is_digit, jnp.where(lit_ovf, MAX_INT, base * 10 + d), acc)
    minus, colon = c == T.MINUS, c == T.COLON
    bad = bad | (minus & ~need) | (colon & (need | (count == 0))) | ~(
        is_digit | minus | colon | (c == T.SPACE) | (c == T.PAD))
    return (vals, count, acc, is_digit, neg | minus, minus, need | colon,
            bad, ovf | lit_ovf), None

  f, t, z = jnp.zeros((), bool), jnp.ones((), bool), jnp.zeros((), jnp.int32)
  carry = (jnp.zeros((max_count,), jnp.int32), z, z, f, f, f, t, f, f)
  vals, count, _, _, _, _, need, bad, ovf = _fold_tokens(body, carry, cls_A, digit_A)
  status = jnp.where(bad | need, T.MALFORMED, jnp.where(ovf, T.OVERFLOW, T.OK))
  return vals, count, status


# ------------------------------------------------------------------ hashing
_HASH_PRIME = 0x01000193
_HASH_POWERS = np.array([pow(_HASH_PRIME, k, 2**32) for k in range(512)], np.uint32)


def _fmix(h: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finaliser (uint32 -> uint32)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def hash_ints(values: jax.Array, mask: jax.Array, seed: int | jax.Array = 0) -> jax.Array:
  """A non-negative int32 hash of the masked entries of a 1-D int array, in order.

  Masked-out entries are skipped (their neighbours hash as if adjacent).
  """
  n = values.shape[0]
  if n > len(_HASH_POWERS):
    raise ValueError(f"hash_ints supports at most {len(_HASH_POWERS)} values, got {n}")
  rank = jnp.cumsum(mask) - 1
  terms = (values.astype(jnp.uint32) + jnp.uint32(1)) * jnp.asarray(_HASH_POWERS)[
      jnp.clip(rank, 0, n - 1)]
  h = jnp.sum(jnp.where(mask, terms, jnp.uint32(0)), dtype=jnp.uint32)
  h = _fmix(h ^ (jnp.asarray(seed).astype(jnp.uint32) * jnp.uint32(0x9E3779B9))
            ^ jnp.sum(mask, dtype=jnp.uint32))
  return (h & jnp.uint32(0x7FFFFFFF)).astype(jnp.int32)


# -------------------------------------------------------------- dispatcher
@struct.dataclass
class ToolOutput:
  """A tool's result for one call.

  Attributes:
    status: int32 ``[]`` message code (``tokens.OK`` on success).
    value: int32 ``[]`` the numeric result, when ``has_value``.
    has_value: bool ``[]`` the observation is ``value`` (else the message).
    memory: the memory after the call.
    opened_box: int32 ``[]`` 0-based box opened by the call, -1 if none.
    args_hash: int32 ``[]`` hash of the normalised arguments: parsed numbers
      for store/recall/lookup/open, the non-space tokens otherwise.
  """

  status: jax.Array
  value: jax.Array
  has_value: jax.Array
  memory: Memory
  opened_box: jax.Array
  args_hash: jax.Array


@struct.dataclass
class Args:
  """A call's argument tokens, read once.

  Attributes:
    tokens, cls, digit: int32 ``[A]`` ids, classes (``PAD`` after the
      arguments) and digit values.
    numbers, count, number_status: :func:`parse_numbers` of the arguments.
  """

  tokens: jax.Array
  cls: jax.Array
  digit: jax.Array
  numbers: jax.Array
  count: jax.Array
  number_status: jax.Array


def read_args(tokens: jax.Array, cls: jax.Array, digit: jax.Array) -> Args:
  numbers, count, status = parse_numbers(cls, digit)
  return Args(tokens, cls, digit, numbers, count, status)


def run_tool(tool: jax.Array, args: Args, world: World, memory: Memory) -> ToolOutput:
  """Runs tool number ``tool`` (index into ``tokens.TOOLS``) on its arguments.

  Args:
    tool: int32 ``[]`` in ``[0, len(TOOLS))``.
    args: the call's arguments.
    world: hidden episode data; memory: the episode's memory.
  """
  calc_value, calc_status = calculate(args.cls, args.digit)
  nums, count = args.numbers, args.count
  key, val = nums[0], nums[1]
  want = jnp.where(tool == T.STORE, 2, 1)
  num_status = jnp.where((args.number_status == T.OK) & (count != want), T.MALFORMED,
                         args.number_status)

  # store / recall
  hit = memory.used & (memory.keys == key)
  free = ~memory.used
  slot = jnp.where(hit.any(), jnp.argmax(hit), jnp.argmax(free))
  can_store = hit.any() | free.any()
  stored = Memory(memory.keys.at[slot].set(key), memory.values.at[slot].set(val),
                  memory.used.at[slot].set(True))
  recalled = memory.values[jnp.argmax(hit)]
  # lookup
  rows = jnp.arange(world.table_keys.shape[0]) < world.table_size
  match = rows & (world.table_keys == key)
  looked_up = world.table_values[jnp.argmax(match)]
  # open
  box_ok = (key >= 1) & (key <= world.num_boxes)
  box = jnp.clip(key - 1, 0, world.boxes.shape[0] - 1)

  tool_status = jnp.select(
      [tool == T.STORE, tool == T.RECALL, tool == T.LOOKUP, tool == T.OPEN],
      [jnp.where(can_store, T.OK, T.MEMORY_FULL), jnp.where(hit.any(), T.OK, T.NOT_FOUND),
       jnp.where(match.any(), T.OK, T.NOT_FOUND), jnp.where(box_ok, T.OK, T.NO_BOX)])
  is_calc = tool == T.CALC
  status = jnp.where(is_calc, calc_status,
                     jnp.where(num_status == T.OK, tool_status, num_status))
  ok = status == T.OK
  value = jnp.select([is_calc, tool == T.RECALL, tool == T.LOOKUP, tool == T.OPEN],
                     [calc_value, recalled, looked_up, world.boxes[box]], 0)
  new_memory = jax.tree.map(lambda a, b: jnp.where(ok & (tool == T.STORE), a, b),
                            stored, memory)
  numeric = ~is_calc & (num_status == T.OK)
  args_hash = jnp.where(
      numeric, hash_ints(nums, jnp.arange(nums.shape[0]) < count, seed=1),
      hash_ints(args.tokens, (args.cls != T.SPACE) & (args.cls != T.PAD), seed=2))
  return ToolOutput(
      status=status.astype(jnp.int32), value=jnp.where(ok, value, 0).astype(jnp.int32),
      has_value=ok & (tool != T.STORE), memory=new_memory,
      opened_box=jnp.where(ok & (tool == T.OPEN), box, -1).astype(jnp.int32),
      args_hash=args_hash)
