"""Token-id tables for in-jit tools, built once from the tokenizer.

Tools never detokenise inside ``jax.jit``: every token id maps to a *class*
(digit, space, one of the operators ``+ - * / ( ) :``, or other) and digits to
their value, through lookup tables indexed by id. Digits, operators and tool
names are reserved single-id pieces (``agentic_rl.text.tokenizer``), so the
tables are exact. Whitespace-only pieces (``"\u2581"`` runs) and the newline
are spaces: they separate tokens and are otherwise skipped.

The same module renders tool results and scripted actions back into token
ids: integers as digit tokens, fixed messages (``"ok"``, ``"error: ..."``)
pre-encoded once, and :func:`concat` to join variable-length segments into a
fixed-size buffer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.text import codec as codec_lib
from agentic_rl.text import tokenizer as tok_lib

# Token classes.
OTHER, DIGIT, SPACE, PLUS, MINUS, TIMES, DIVIDE, LPAREN, RPAREN, COLON, PAD = range(11)
_OPERATOR_CLASS = {"+": PLUS, "-": MINUS, "*": TIMES, "/": DIVIDE, "(": LPAREN,
                   ")": RPAREN, ":": COLON}

# The tools, in tool-id order (``tool_id`` in step infos indexes this tuple).
TOOLS = tok_lib.TOOL_NAMES
CALC, STORE, RECALL, LOOKUP, OPEN = (TOOLS.index(t) for t in
                                     ("calc", "store", "recall", "lookup", "open"))

# Tool-result messages, by status code (0 = success: the result is a number or
# "ok"). The texts are encoded once by the tokenizer.
MESSAGES = ("ok", "error: malformed call", "error: unknown tool",
            "error: division by zero", "error: overflow", "error: not found",
            "error: memory full", "error: no such box")
OK, MALFORMED, UNKNOWN_TOOL, DIV_ZERO, OVERFLOW, NOT_FOUND, MEMORY_FULL, NO_BOX = range(
    len(MESSAGES))

# The integer range of every tool: the signed 32-bit range without its most
# negative value, so negation never overflows. All 9-digit integers fit.
MAX_INT = 2**31 - 1
NUMBER_LEN = 11  # sign + 10 digits


@dataclasses.dataclass(frozen=True, eq=False)
class Vocab:
  """Lookup tables over token ids (numpy: constants under jit).

  Attributes:
    ids: the codec's framing ids.
    size: vocabulary size V.
    token_class: int32 ``[V]`` class of each id.
    digit_value: int32 ``[V]`` value of digit ids (0 elsewhere).
    tool_index: int32 ``[V]`` index into ``TOOLS`` of tool-name ids, else -1.
    digit_ids: int32 ``[10]``; ``tool_ids``: int32 ``[len(TOOLS)]``.
    space, plus, minus, times, divide, lparen, rparen, colon: single ids.
    messages: int32 ``[len(MESSAGES), L]`` encoded messages, padded;
      ``message_lens``: int32 ``[len(MESSAGES)]``.
  """

  ids: codec_lib.FormatIds
  size: int
  token_class: np.ndarray
  digit_value: np.ndarray
  tool_index: np.ndarray
  digit_ids: np.ndarray
  tool_ids: np.ndarray
  space: int
  plus: int
  minus: int
  times: int
  divide: int
  lparen: int
  rparen: int
  colon: int
  messages: np.ndarray
  message_lens: np.ndarray

  @property
  def max_message_len(self) -> int:
    return self.messages.shape[1]

  def classes(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(class, digit value)`` of int32 token ids of any shape.

    Out-of-vocabulary ids are ``OTHER``.
    """
    inside = (tokens >= 0) & (tokens < self.size)
    safe = jnp.where(inside, tokens, 0)
    cls = jnp.where(inside, jnp.asarray(self.token_class)[safe], OTHER)
    return cls, jnp.asarray(self.digit_value)[safe]

  def tool_of(self, tokens: jax.Array) -> jax.Array:
    """Index into ``TOOLS`` of token ids (any shape), -1 for other ids."""
    inside = (tokens >= 0) & (tokens < self.size)
    return jnp.where(inside, jnp.asarray(self.tool_index)[jnp.where(inside, tokens, 0)], -1)


def build_vocab(codec: codec_lib.Codec) -> Vocab:
  """Builds the tables; ValueError if a reserved piece is missing."""
  tok = codec.tokenizer
  tok.require(tok_lib.DIGITS + tok_lib.OPERATORS + tok_lib.TOOL_NAMES + (tok_lib.NEWLINE,))
  V = tok.vocab_size
  token_class = np.full(V, OTHER, np.int32)
  digit_value = np.zeros(V, np.int32)
  tool_index = np.full(V, -1, np.int32)
  for i in range(V):
    piece = tok.id_to_piece(i)
    if piece == tok_lib.NEWLINE or (piece and set(piece) == {tok_lib.SPACE_PIECE}):
      token_class[i] = SPACE
  digit_ids = np.array([tok.piece_id(d) for d in tok_lib.DIGITS], np.int32)
  token_class[digit_ids] = DIGIT
  digit_value[digit_ids] = np.arange(10)
  for sym, cls in _OPERATOR_CLASS.items():
    token_class[tok.piece_id(sym)] = cls
  tool_ids = np.array([tok.piece_id(t) for t in TOOLS], np.int32)
  tool_index[tool_ids] = np.arange(len(TOOLS))
  space = tok.encode(" ")
  if len(space) != 1 or token_class[space[0]] != SPACE:
    raise ValueError(f"tokenizer encodes a space as {space}, not one space piece")
  encoded = [tok.encode(m) for m in MESSAGES]
  messages = codec_lib.pad_batch([np.asarray(e, np.int32) for e in encoded],
                                 max(map(len, encoded)), codec.ids.pad)
  p = tok.piece_id
  return Vocab(
      ids=codec.ids, size=V, token_class=token_class, digit_value=digit_value,
      tool_index=tool_index, digit_ids=digit_ids, tool_ids=tool_ids,
      space=space[0], plus=p("+"), minus=p("-"), times=p("*"), divide=p("/"),
      lparen=p("("), rparen=p(")"), colon=p(":"), messages=messages,
      message_lens=np.array([len(e) for e in encoded], np.int32))


def render_int(value: jax.Array, vocab: Vocab) -> tuple[jax.Array, jax.Array]:
  """An int32 ``[]`` in ``[-MAX_INT, MAX_INT]`` as digit tokens.

  Returns ``(tokens_[NUMBER_LEN], length_[])``: an optional ``-`` then the
  decimal digits without leading zeros, padded.
  """
  value = jnp.asarray(value, jnp.int32)
  neg = value < 0
  mag = jnp.abs(value)
  powers = jnp.asarray(10 ** np.arange(9, -1, -1), jnp.int32)  # 10^9 .. 1
  digits = (mag // powers) % 10  # [10], most significant first
  ndig = jnp.maximum(1, 10 - jnp.argmax(jnp.append(digits[:-1] > 0, True)))
  n = ndig + neg
  pos = jnp.arange(NUMBER_LEN)
  k = jnp.clip(pos - neg + (10 - ndig), 0, 9)
  body = jnp.asarray(vocab.digit_ids)[digits[k]]
  out = jnp.where(neg & (pos == 0), vocab.minus, body)
  out = jnp.where(pos < n, out, vocab.ids.pad)
  return out.astype(jnp.int32), n.astype(jnp.int32)


def message(code: jax.Array, vocab: Vocab) -> tuple[jax.Array, jax.Array]:
  """The encoded message for a status code: ``(tokens_[L], length_[])``."""
  return (jnp.asarray(vocab.messages)[code],
          jnp.asarray(vocab.message_lens)[code])


def concat(segments, size: int, pad: int) -> tuple[jax.Array, jax.Array]:
  """Joins variable-length segments into one padded int32 ``[size]`` buffer.

  Args:
    segments: sequence of ``(tokens, length)``; ``tokens`` is an int scalar or
      a 1-D array whose first ``length`` entries are used (a scalar has length
      1 when ``length`` is None).
    size: output length. Tokens past it are dropped.
    pad: fill value.
  Returns:
    ``(tokens_[size], total_length_[])``; ``total_length`` may exceed ``size``
    when the segments do not fit (callers check it).
  """
  values, targets = [], []
  offset = jnp.zeros((), jnp.int32)
  for tokens, length in segments:
    tokens = jnp.atleast_1d(jnp.asarray(tokens, jnp.int32))
    length = jnp.asarray(1 if length is None else length, jnp.int32)
    i = jnp.arange(tokens.shape[0])
    values.append(tokens)
    targets.append(jnp.where(i < length, offset + i, size))  # size: dropped
    offset = offset + length
  out = jnp.full((size,), pad, jnp.int32).at[jnp.concatenate(targets)].set(
      jnp.concatenate(values), mode="drop")
  return out, offset


def call_action(tool: int | jax.Array, args, vocab: Vocab, size: int, *,
                with_name: bool | jax.Array = True) -> tuple[jax.Array, jax.Array]:
  """``<tool_call>TOOL ARGS</tool_call>`` as ``(tokens_[size], length_[])``.

  Args:
    tool: index into ``TOOLS``.
    args: segments for :func:`concat`.
    with_name: False drops the tool name (a malformed call, for noisy scripts).
  """
  name = jnp.asarray(with_name, jnp.int32)
  return concat([(vocab.ids.tool_call_open, None),
                 (jnp.asarray(vocab.tool_ids)[tool], name), (vocab.space, name),
                 *args, (vocab.ids.tool_call_close, None)], size, vocab.ids.pad)


def answer_action(value: jax.Array, vocab: Vocab, size: int) -> tuple[jax.Array, jax.Array]:
  """``<answer>VALUE</answer>`` as ``(tokens_[size], length_[])``."""
  return concat([(vocab.ids.answer_open, None), render_int(value, vocab),
                 (vocab.ids.answer_close, None)], size, vocab.ids.pad)
