"""The in-jit tools: calculator (against Python), numbers, memory, lookup, open."""

import ast
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from agentic_rl.envs import tokens as T
from agentic_rl.envs import tools
from agentic_rl.text import default_codec

A = 40  # argument buffer length in these tests
MAX = T.MAX_INT


@pytest.fixture(scope="module")
def codec():
  return default_codec()


@pytest.fixture(scope="module")
def vocab(codec):
  return T.build_vocab(codec)


def _classes(vocab, ids):
  cls, digit = vocab.classes(ids)
  return jnp.where(ids == vocab.ids.pad, T.PAD, cls), digit


def _encode(codec, texts):
  rows = [np.asarray(codec.tokenizer.encode(t), np.int32) for t in texts]
  return jnp.asarray(np.stack([np.pad(r, (0, A - len(r))) for r in rows]))


_BATCH = 32  # one compiled shape for every calculator batch


@pytest.fixture(scope="module")
def calc_batch(codec, vocab):
  fn = jax.jit(jax.vmap(lambda ids: tools.calculate(*_classes(vocab, ids))))
  def run(texts):
    out = []
    for i in range(0, len(texts), _BATCH):
      chunk = texts[i:i + _BATCH]
      value, status = fn(_encode(codec, chunk + [""] * (_BATCH - len(chunk))))
      out += [(int(v), int(s)) for v, s in zip(value[:len(chunk)], status[:len(chunk)])]
    return out
  return run


class _Error(Exception):
  def __init__(self, status):
    super().__init__(status)
    self.status = status


def reference(text: str) -> tuple[int, int]:
  """(value, status) of an expression, by Python's parser and integers.

  ``/`` is floor division; leading zeros are allowed; every literal and
  intermediate must lie in [-MAX, MAX]; the first error in evaluation order
  wins, a syntax error over everything.
  """
  src = re.sub(r"\d+", lambda m: str(int(m.group())), text).replace("/", "//")
  src = src.strip()  # ast.parse reads leading spaces as an indent
  try:
    tree = ast.parse(src, mode="eval").body
  except SyntaxError:
    return 0, T.MALFORMED

  def check(x):
    if abs(x) > MAX:
      raise _Error(T.OVERFLOW)
    return x

  def ev(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return check(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
      v = ev(node.operand)
      return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult,
                                                            ast.FloorDiv)):
      a, b = ev(node.left), ev(node.right)
      if isinstance(node.op, ast.FloorDiv):
        if b == 0:
          raise _Error(T.DIV_ZERO)
        return a // b
      return check({ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}[type(node.op)])
    raise _Error(T.MALFORMED)

  def has_bad_node(node):
    return any(not isinstance(n, (ast.Constant, ast.UnaryOp, ast.BinOp, ast.USub, ast.UAdd,
                                  ast.Add, ast.Sub, ast.Mult, ast.FloorDiv))
               or (isinstance(n, ast.Constant) and type(n.value) is not int)
               for n in ast.walk(node))

  if has_bad_node(tree):
    return 0, T.MALFORMED
  try:
    return ev(tree), T.OK
  except _Error as e:
    return 0, e.status


def test_reference_itself():
  assert reference("2*3+4") == (10, T.OK)
  assert reference("-7/2") == (-4, T.OK)
  assert reference("007+1") == (8, T.OK)
  assert reference(" 0 ") == (0, T.OK)
  assert reference("1/0") == (0, T.DIV_ZERO)
  assert reference("2147483647+1") == (0, T.OVERFLOW)
  assert reference("()") == (0, T.MALFORMED)
  assert reference("(1)(2)") == (0, T.MALFORMED)


# Expressions: random trees rendered with random spacing and redundant
# parentheses, and random strings over the calculator's alphabet.
_NUMBERS = st.one_of(st.integers(0, 99), st.integers(0, 99999),
                     st.integers(MAX - 100, MAX + 100), st.integers(0, 10**12),
                     st.sampled_from([0, 1, 46340, 46341, 65535, 65536]))


def _render(draw, depth):
  sp = lambda: draw(st.sampled_from(["", "", " "]))
  if depth == 0 or draw(st.booleans()):
    text = str(draw(_NUMBERS))
    if draw(st.integers(0, 9)) == 0:
      text = "0" + text
  elif draw(st.integers(0, 4)) == 0:
    text = draw(st.sampled_from("-+")) + sp() + _render(draw, depth - 1)
  else:
    op = draw(st.sampled_from("+-*/"))
    text = _render(draw, depth - 1) + sp() + op + sp() + _render(draw, depth - 1)
  if depth and draw(st.integers(0, 2)) == 0:
    text = "(" + sp() + text + sp() + ")"
  return text


@st.composite
def expressions(draw):
  return _render(draw, draw(st.integers(0, 4)))


_GARBAGE = st.text(alphabet=st.sampled_from(list("0123456789+-*/()  :")), max_size=24)


def _fit(texts, codec):
  return [t for t in texts if len(codec.tokenizer.encode(t)) <= A]


@settings(max_examples=30, deadline=None)
@given(st.lists(expressions(), min_size=1, max_size=24))
def test_calculator_matches_python(calc_batch, codec, texts):
  texts = _fit(texts, codec)
  if texts:
    assert calc_batch(texts) == [reference(t) for t in texts], texts


@settings(max_examples=30, deadline=None)
@given(st.lists(_GARBAGE, min_size=1, max_size=24))
def test_calculator_matches_python_on_arbitrary_strings(calc_batch, codec, texts):
  texts = _fit(texts, codec)
  if texts:
    assert calc_batch(texts) == [reference(t) for t in texts], texts


def test_calculator_cases(calc_batch):
  cases = {
      "1+2*3": (7, T.OK), "(1+2)*3": (9, T.OK), "-3/2": (-2, T.OK), "7/-2": (-4, T.OK),
      "2*-3": (-6, T.OK), "--3": (3, T.OK), "-(2+3)*4": (-20, T.OK),
      "((4821*93)+1207)*88": (39561280, T.OK), "999999999*2": (1999999998, T.OK),
      "123456789+987654321": (1111111110, T.OK),
      "46340*46340": (2147395600, T.OK), "46341*46341": (0, T.OVERFLOW),
      "2147483647": (MAX, T.OK), "2147483648": (0, T.OVERFLOW), "-2147483647-1": (0, T.OVERFLOW),
      "1/0": (0, T.DIV_ZERO), "1/(2-2)": (0, T.DIV_ZERO),
      # The first error in evaluation order wins; a syntax error wins over all.
      "1/0+99999999999": (0, T.DIV_ZERO), "99999999999+1/0": (0, T.OVERFLOW),
      "1/0+": (0, T.MALFORMED),
      "": (0, T.MALFORMED), "3 4": (0, T.MALFORMED), "(3": (0, T.MALFORMED),
      "3)": (0, T.MALFORMED), "()": (0, T.MALFORMED), "2(3)": (0, T.MALFORMED),
      "1:2": (0, T.MALFORMED), "5-": (0, T.MALFORMED), "*5": (0, T.MALFORMED),
  }
  assert calc_batch(list(cases)) == list(cases.values())


def test_calculator_without_jit_and_shapes(codec, vocab):
  ids = _encode(codec, ["(12+3)*-4"])[0]
  value, status = tools.calculate(*_classes(vocab, ids))
  chex.assert_shape((value, status), ())
  chex.assert_type((value, status), jnp.int32)
  assert (int(value), int(status)) == (-60, T.OK)
  # Tokens that are not calculator symbols are malformed, even unknown ids.
  bad = jnp.zeros((A,), jnp.int32).at[0].set(vocab.size + 5)
  assert int(tools.calculate(*_classes(vocab, bad))[1]) == T.MALFORMED


@pytest.mark.parametrize("text,expected", [
    ("7", ([7, 0], 1, T.OK)), (" 12 : -34 ", ([12, -34], 2, T.OK)), ("-5", ([-5, 0], 1, T.OK)),
    ("- 5", (None, None, T.MALFORMED)), ("1 2", (None, None, T.MALFORMED)),
    ("1:", (None, None, T.MALFORMED)), (":1", (None, None, T.MALFORMED)),
    ("1:2:3", (None, None, T.MALFORMED)), ("", (None, None, T.MALFORMED)),
    ("1+2", (None, None, T.MALFORMED)), ("99999999999", (None, None, T.OVERFLOW)),
])
def test_parse_numbers(codec, vocab, text, expected):
  ids = _encode(codec, [text])[0]
  values, count, status = jax.jit(tools.parse_numbers)(*_classes(vocab, ids))
  want_values, want_count, want_status = expected
  assert int(status) == want_status
  if want_status == T.OK:
    assert int(count) == want_count
    np.testing.assert_array_equal(values, want_values)


@pytest.fixture(scope="module")
def run_tool(codec, vocab):
  fn = jax.jit(lambda tool, ids, world, memory: tools.run_tool(
      tool, tools.read_args(ids, *_classes(vocab, ids)), world, memory))
  def run(tool_name, text, world, memory):
    return fn(jnp.int32(T.TOOLS.index(tool_name)), _encode(codec, [text])[0], world, memory)
  return run


def _world():
  return tools.World(table_keys=jnp.array([417, 582, 0, 0], jnp.int32),
                     table_values=jnp.array([582, 123, 9, 9], jnp.int32),
                     table_size=jnp.int32(2), boxes=jnp.array([10, 20, 30, 0], jnp.int32),
                     num_boxes=jnp.int32(3))


def test_memory_lookup_and_boxes(run_tool):
  world, memory = _world(), tools.empty_memory(2)
  out = run_tool("recall", "1", world, memory)
  assert int(out.status) == T.NOT_FOUND and not bool(out.has_value)
  out = run_tool("store", "1:-42", world, memory)
  assert int(out.status) == T.OK and not bool(out.has_value)
  memory = out.memory
  out = run_tool("recall", " 1 ", world, memory)
  assert (int(out.status), int(out.value), bool(out.has_value)) == (T.OK, -42, True)
  memory = run_tool("store", "1:7", world, memory).memory  # overwrite
  memory = run_tool("store", "2:8", world, memory).memory
  assert int(run_tool("recall", "1", world, memory).value) == 7
  assert int(run_tool("store", "3:9", world, memory).status) == T.MEMORY_FULL
  assert int(run_tool("store", "3", world, memory).status) == T.MALFORMED
  # lookup reads only the table's live rows.
  assert int(run_tool("lookup", "417", world, memory).value) == 582
  assert int(run_tool("lookup", "0", world, memory).status) == T.NOT_FOUND
  assert int(run_tool("lookup", "999", world, memory).status) == T.NOT_FOUND
  # open is 1-based over the live boxes.
  out = run_tool("open", "2", world, memory)
  assert (int(out.value), int(out.opened_box)) == (20, 1)
  for bad in ("0", "4", "-1"):
    out = run_tool("open", bad, world, memory)
    assert int(out.status) == T.NO_BOX and int(out.opened_box) == -1
  assert int(run_tool("calc", "6*7", world, memory).value) == 42


def test_args_hash_normalises_numbers(run_tool):
  world, memory = _world(), tools.empty_memory(2)
  h = lambda tool, text: int(run_tool(tool, text, world, memory).args_hash)
  assert h("open", "2") == h("open", " 02 ") != h("open", "3")
  assert h("calc", "1+2") == h("calc", "1 + 2") != h("calc", "2+1")
  assert h("calc", "1+2") >= 0


def test_render_int_round_trips(codec, vocab):
  values = np.array([0, 7, -7, 10, 100, 123456789, -MAX, MAX, 10**9], np.int32)
  tokens, lengths = jax.jit(jax.vmap(lambda x: T.render_int(x, vocab)))(values)
  chex.assert_shape(tokens, (len(values), T.NUMBER_LEN))
  for v, t, n in zip(values, np.asarray(tokens), np.asarray(lengths)):
    assert codec.tokenizer.decode(t[:n]) == str(v)
    assert (t[n:] == vocab.ids.pad).all()


def test_concat_and_actions(codec, vocab):
  @jax.jit
  def build(length):
    return (T.concat([(jnp.array([5, 6, 7]), length), (9, None), (jnp.array([1, 2]), 0),
                      (jnp.array([3, 4]), 2)], 8, 0),
            T.concat([(jnp.arange(1, 6), 5)], 3, 0),
            T.call_action(T.CALC, [T.render_int(jnp.int32(12), vocab), (vocab.times, None),
                                   T.render_int(jnp.int32(3), vocab)], vocab, 24),
            T.answer_action(jnp.int32(-5), vocab, 24))

  (out, n), (cut, cut_n), (call, call_n), (ans, ans_n) = build(2)
  np.testing.assert_array_equal(out, [5, 6, 9, 3, 4, 0, 0, 0])
  assert int(n) == 5
  np.testing.assert_array_equal(cut, [1, 2, 3])  # overflow: dropped, but reported
  assert int(cut_n) == 5
  decode = lambda x, k: codec.tokenizer.decode(np.asarray(x)[:int(k)])
  assert decode(call, call_n) == "<tool_call>calc 12*3</tool_call>"
  assert decode(ans, ans_n) == "<answer>-5</answer>"


def test_hash_ints_properties():
  h = jax.jit(tools.hash_ints)
  x = jnp.array([3, 1, 4, 1, 5, 0], jnp.int32)
  on = jnp.array([1, 1, 1, 1, 1, 0], bool)
  base = int(h(x, on, 0))
  assert base >= 0
  assert int(h(jnp.array([5, 1, 4, 1, 3, 0]), on, 0)) != base  # order matters
  gap = jnp.array([3, 1, 99, 4, 1, 5], jnp.int32)
  mask = jnp.array([1, 1, 0, 1, 1, 1], bool)
  assert int(h(gap, mask, 0)) == base  # masked entries are skipped
  assert int(h(x, on, 1)) != base
