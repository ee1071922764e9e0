"""The one conversation codec: messages <-> token ids, loss mask, roles, turns.

Nothing else in the code base knows the conversation format. The format
(each tag is one reserved token, see ``tokenizer.py``)::

  <s><|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>
  {text}<tool_call>{call}</tool_call><tool_result>{result}</tool_result>
  {text}<tool_call>{call}</tool_call><tool_result>{result}</tool_result>
  {text}<answer>{answer}</answer>

Tool results are injected inline into the assistant's turn (no role header),
so a multi-turn episode is one growing token sequence. The policy's side of an
episode ends at a stop token: ``</tool_call>`` hands control to the
environment, ``</answer>``, ``<|end|>`` or ``</s>`` end the turn. An assistant
turn followed by another user or system message is closed by ``<|end|>``.

Loss mask: 1 exactly on tokens the policy generates (assistant text, tool-call
tags and arguments, answer tags, the closing ``<|end|>``); 0 on the prompt,
framing the environment adds and tool results. Turn ids: 0 on the prompt;
the k-th action segment of the assistant (k >= 1, a segment ends with a tool
call) and the tool result that answers it carry k.

Trajectories are built token-in/token-out: the rollout engine appends sampled
ids as they are and frames observations with :func:`frame_observation`; text
is never re-tokenised.

Tools of a Python environment are described by JSON schemas
(``{"name", "description", "parameters": {"type": "object", "properties",
"required"}}``); :meth:`Codec.describe_tools` renders them for the system
prompt and :meth:`Codec.parse_tool_call` reads the policy's call,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, checked
against them (:class:`ToolCallError` says what is wrong).
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.text import tokenizer as tok_lib
from agentic_rl.text.tools import ToolCall, ToolCallError, check_call, loads_call

ROLES = ("special", "system", "user", "assistant", "tool_call", "tool_result")
ROLE_ID = {r: i for i, r in enumerate(ROLES)}
_MESSAGE_ROLES = ROLES[1:]


@dataclasses.dataclass(frozen=True)
class Message:
  role: str  # one of system, user, assistant, tool_call, tool_result
  content: str


@dataclasses.dataclass(frozen=True)
class Encoded:
  """An encoded conversation; all int32/float32 numpy arrays of shape ``[T]``."""

  ids: np.ndarray
  loss_mask: np.ndarray
  role_ids: np.ndarray
  turn_ids: np.ndarray


@dataclasses.dataclass(frozen=True)
class FormatIds:
  """Token ids of the format's reserved pieces (plain ints, static under jit)."""

  pad: int
  bos: int
  eos: int
  system: int
  user: int
  assistant: int
  end: int
  tool_call_open: int
  tool_call_close: int
  tool_result_open: int
  tool_result_close: int
  answer_open: int
  answer_close: int

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Tokens after which the policy yields: to the environment or for good."""
    return (self.tool_call_close, self.answer_close, self.end, self.eos)

  @property
  def final_ids(self) -> tuple[int, ...]:
    """Stop tokens that end the episode on the policy's side."""
    return (self.answer_close, self.end, self.eos)


class Codec:
  """Encodes and decodes conversations with one tokenizer."""

  def __init__(self, tokenizer: tok_lib.Tokenizer):
    tokenizer.require(tok_lib.FRAMING)
    self.tokenizer = tokenizer
    p = tokenizer.piece_id
    self.ids = FormatIds(
        pad=tokenizer.pad_id, bos=tokenizer.bos_id, eos=tokenizer.eos_id,
        system=p(tok_lib.SYSTEM), user=p(tok_lib.USER),
        assistant=p(tok_lib.ASSISTANT), end=p(tok_lib.END),
        tool_call_open=p(tok_lib.TOOL_CALL_OPEN),
        tool_call_close=p(tok_lib.TOOL_CALL_CLOSE),
        tool_result_open=p(tok_lib.TOOL_RESULT_OPEN),
        tool_result_close=p(tok_lib.TOOL_RESULT_CLOSE),
        answer_open=p(tok_lib.ANSWER_OPEN), answer_close=p(tok_lib.ANSWER_CLOSE))
    # Framing tokens that may not appear inside any message's content.
    self._framing = frozenset(
        dataclasses.astuple(self.ids)) - {self.ids.answer_open, self.ids.answer_close}
    self._reserved_ids = frozenset(dataclasses.astuple(self.ids))
    pieces = sorted({tokenizer.id_to_piece(i) for i in self._reserved_ids}, key=len, reverse=True)
    self._reserved_re = re.compile("|".join(re.escape(p) for p in pieces))

  def frame_observation_ids(self, obs_ids: Sequence[int], *, tool: bool = True) -> list[int]:
    """An observation's ids framed as a tool result (on the host; in jit,
    :func:`frame_observation`). Every observation is a tool result in this
    format, the answer to a tool call (``tool``) or not."""
    del tool
    return [self.ids.tool_result_open, *obs_ids, self.ids.tool_result_close]

  @property
  def turn_end_id(self) -> int:
    """The stop id that ends a turn without calling a tool or answering."""
    return self.ids.end

  def calls_tool(self, action_ids: Sequence[int] | np.ndarray) -> bool:
    """Whether an action attempts a tool call: it ends with ``</tool_call>``."""
    return len(action_ids) > 0 and int(action_ids[-1]) == self.ids.tool_call_close

  def action_text(self, action_ids: Sequence[int] | np.ndarray) -> str:
    """The text an environment's ``step`` receives for an action."""
    return self.tokenizer.decode(action_ids)

  # ---------------------------------------------------------------- tools
  def describe_tools(self, tools: Sequence[Mapping[str, Any]]) -> str:
    """The system-prompt text that offers ``tools`` (JSON schemas) and says
    how to call them."""
    lines = ['Call a tool as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>. Tools:']
    for tool in tools:
      props = (tool.get("parameters") or {}).get("properties") or {}
      args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
      lines.append(f"{tool['name']}({args}): {tool.get('description', '')}".rstrip(": "))
    return "\n".join(lines)

  def parse_tool_call(self, action_ids: Sequence[int] | np.ndarray,
                      tools: Sequence[Mapping[str, Any]]) -> ToolCall | None:
    """The call in an action that ends with ``</tool_call>``: the JSON
    object after its last ``<tool_call>``; None for an action that calls no
    tool (:meth:`calls_tool`).

    Raises:
      ToolCallError: the call is malformed, names no tool of ``tools`` or
        its arguments do not match the tool's schema.
    """
    if not self.calls_tool(action_ids):
      return None
    ids = [int(t) for t in action_ids]
    opens = [i for i, t in enumerate(ids) if t == self.ids.tool_call_open]
    if not opens:
      raise ToolCallError("a tool call starts with <tool_call>")
    text = self.tokenizer.decode(ids[opens[-1] + 1:-1])
    return check_call(loads_call(text), tools)

  # ---------------------------------------------------------------- encode
  def encode_text(self, text: str) -> list[int]:
    """Ids of ``text`` as plain text: where it contains a reserved piece
    (``<tool_result>``, ``<|end|>``, ...) that piece is encoded as two
    ordinary pieces (its first character, then the rest), so it decodes to
    the same text but never frames anything. For text from outside the
    policy (environment observations), which may echo the format."""
    ids = self.tokenizer.encode(text)
    if not self._reserved_ids.intersection(ids):
      return ids
    out, start = [], 0
    for match in self._reserved_re.finditer(text):
      piece = match.group(0)
      out += self.tokenizer.encode(text[start:match.start()]) if match.start() > start else []
      out += self.tokenizer.encode(piece[0]) + self.tokenizer.encode(piece[1:])
      start = match.end()
    return out + (self.tokenizer.encode(text[start:]) if start < len(text) else [])

  def _content(self, m: Message, escape: bool = False) -> list[int]:
    if escape and m.role in ("system", "user", "tool_result"):
      return self.encode_text(m.content)
    ids = self.tokenizer.encode(m.content)
    bad = sorted({self.tokenizer.id_to_piece(i) for i in ids if i in self._framing})
    if bad:
      raise ValueError(f"{m.role} message content contains reserved tokens {bad}")
    if m.role != "assistant" and (self.ids.answer_open in ids or
                                  self.ids.answer_close in ids):
      raise ValueError(f"answer tags may only appear in assistant messages, "
                       f"not in a {m.role} message")
    return ids

  def encode(self, messages: Sequence[Message], *,
             add_generation_prompt: bool = False, escape: bool = False) -> Encoded:
    """Encodes a conversation.

    With ``add_generation_prompt`` the ids end where the policy starts
    generating (after ``<|assistant|>``, or after a tool result). Reserved
    pieces in a message's content are a ValueError, or with ``escape`` (for
    system, user and tool-result text from outside the policy) plain text
    (:meth:`encode_text`).
    """
    ids, mask, roles, turns = [self.ids.bos], [0], [ROLE_ID["special"]], [0]
    turn = 0
    in_assistant = False  # inside an assistant turn (header emitted)
    segment_open = False  # the current action segment has a turn id

    def emit(tokens, role, m, t):
      ids.extend(tokens)
      mask.extend([m] * len(tokens))
      roles.extend([ROLE_ID[role]] * len(tokens))
      turns.extend([t] * len(tokens))

    for i, m in enumerate(messages):
      if m.role not in _MESSAGE_ROLES:
        raise ValueError(f"unknown role {m.role!r}; expected one of {_MESSAGE_ROLES}")
      content = self._content(m, escape)
      if m.role == "assistant" and (not content or (
          i and messages[i - 1].role == "assistant")):
        raise ValueError("assistant messages must be non-empty and not adjacent "
                         "(merge adjacent ones): the token stream cannot tell "
                         "them apart")
      if m.role in ("system", "user"):
        if in_assistant:
          emit([self.ids.end], "assistant", 1, turn)
          in_assistant = segment_open = False
        header = self.ids.system if m.role == "system" else self.ids.user
        emit([header] + content + [self.ids.end], m.role, 0, turn)
        continue
      if m.role == "tool_result":
        prev = messages[i - 1].role if i else None
        if prev != "tool_call":
          raise ValueError("a tool_result message must follow a tool_call message")
        emit([self.ids.tool_result_open] + content + [self.ids.tool_result_close],
             "tool_result", 0, turn)
        segment_open = False
        continue
      # assistant or tool_call: the policy's tokens.
      if not in_assistant:
        emit([self.ids.assistant], "assistant", 0, turn)
        in_assistant = True
      if not segment_open:
        turn += 1
        segment_open = True
      if m.role == "tool_call":
        emit([self.ids.tool_call_open] + content + [self.ids.tool_call_close],
             "tool_call", 1, turn)
      else:
        emit(content, "assistant", 1, turn)
    if add_generation_prompt and not in_assistant:
      emit([self.ids.assistant], "assistant", 0, turn)
    as_np = lambda x, dt: np.asarray(x, dtype=dt)
    return Encoded(as_np(ids, np.int32), as_np(mask, np.float32),
                   as_np(roles, np.int32), as_np(turns, np.int32))

  def encode_prompt(self, messages: Sequence[Message], *, tools=None,
                    escape: bool = False) -> np.ndarray:
    """Prompt ids ending with the assistant header, ready for generation.

    ``tools`` (JSON schemas) are offered in the system message
    (:meth:`describe_tools`, after the system text if there is one)."""
    if tools:
      messages = list(messages)
      offer = self.describe_tools(tools)
      if messages and messages[0].role == "system":
        messages[0] = Message("system", f"{messages[0].content}\n{offer}")
      else:
        messages.insert(0, Message("system", offer))
    return self.encode(messages, add_generation_prompt=True, escape=escape).ids

  # ---------------------------------------------------------------- decode
  def decode(self, ids: Sequence[int] | np.ndarray) -> list[Message]:
    """Token ids back to messages; ``decode(encode(x).ids) == x``.

    Padding after the conversation is ignored. Raises ValueError on ids that
    do not follow the format (an unclosed tag, a stray closing tag).
    """
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    while ids and ids[-1] == self.ids.pad:
      ids.pop()
    if not ids or ids[0] != self.ids.bos:
      raise ValueError("a conversation starts with the bos token")
    x = self.ids
    out: list[Message] = []
    buf: list[int] = []
    i = 1

    def flush_assistant():
      if buf:
        out.append(Message("assistant", self.tokenizer.decode(buf)))
        buf.clear()

    def read_until(start, close, what):
      try:
        j = ids.index(close, start)
      except ValueError:
        raise ValueError(f"unclosed {what} starting at token {start - 1}") from None
      return j, self.tokenizer.decode(ids[start:j])

    while i < len(ids):
      t = ids[i]
      if t in (x.system, x.user):
        flush_assistant()
        j, text = read_until(i + 1, x.end, "system/user message")
        out.append(Message("system" if t == x.system else "user", text))
        i = j + 1
      elif t == x.assistant:
        flush_assistant()
        i += 1
      elif t == x.tool_call_open:
        flush_assistant()
        j, text = read_until(i + 1, x.tool_call_close, "tool call")
        out.append(Message("tool_call", text))
        i = j + 1
      elif t == x.tool_result_open:
        flush_assistant()
        j, text = read_until(i + 1, x.tool_result_close, "tool result")
        out.append(Message("tool_result", text))
        i = j + 1
      elif t in (x.end, x.eos):
        flush_assistant()
        i += 1
      elif t in (x.bos, x.tool_call_close, x.tool_result_close, x.pad):
        raise ValueError(f"unexpected {self.tokenizer.id_to_piece(t)!r} at token {i}")
      else:
        buf.append(t)
        i += 1
    flush_assistant()
    return out


def frame_observation(obs_A: jax.Array, obs_len: jax.Array, ids: FormatIds,
                      ) -> tuple[jax.Array, jax.Array]:
  """Wraps raw tool-result ids in the tool-result tags, inside jit.

  Args:
    obs_A: int32 ``[..., A]`` observation content, padded after ``obs_len``.
    obs_len: int32 ``[...]`` valid length.
    ids: the codec's ``FormatIds``.
  Returns:
    ``(framed_[..., A+2], framed_len_[...])``: ``<tool_result> obs
    </tool_result>`` then padding.
  """
  A = obs_A.shape[-1]
  pos = jnp.arange(A + 2)
  n = obs_len[..., None]
  body = jnp.take_along_axis(
      obs_A, jnp.clip(pos - 1, 0, A - 1) * jnp.ones_like(n), axis=-1)
  framed = jnp.where(pos == 0, ids.tool_result_open,
                     jnp.where(pos <= n, body,
                               jnp.where(pos == n + 1, ids.tool_result_close, ids.pad)))
  return framed.astype(jnp.int32), (obs_len + 2).astype(jnp.int32)


def pack_rows(tokens_NxT: np.ndarray, loss_mask_NxT: np.ndarray, pad_id: int
              ) -> dict[str, np.ndarray]:
  """Packs right-padded sequences into fewer rows of the same length T.

  Best-fit decreasing: each sequence (its tokens before the first ``pad_id``)
  goes, longest first, into the open row with the least room that still
  holds it. A packed row holds its sequences back to back, then pad.

  Returns ``tokens_BxT``, ``loss_mask_BxT`` (each sequence's own, 0 on pad),
  ``positions_BxT`` (int32, restarting at 0 for each sequence) and
  ``segment_ids_BxT`` (int32, 1, 2, ... per sequence within its row, 0 on
  pad): the forward with these positions and segment ids gives every
  sequence the log-probs it has alone (its first token, predicted from the
  previous sequence, has loss mask 0 as a prompt token does).
  """
  tokens_NxT, loss_mask_NxT = np.asarray(tokens_NxT), np.asarray(loss_mask_NxT)
  N, T = tokens_NxT.shape
  is_pad = tokens_NxT == pad_id
  lengths = np.where(is_pad.any(1), is_pad.argmax(1), T)
  rows: list[list[int]] = []  # sequence indices per packed row
  room: list[tuple[int, int]] = []  # sorted (free slots, row)
  for i in np.argsort(-lengths, kind="stable"):
    at = bisect.bisect_left(room, (int(lengths[i]), -1))
    if at == len(room):
      rows.append([])
      free, r = T, len(rows) - 1
    else:
      free, r = room.pop(at)
    rows[r].append(int(i))
    bisect.insort(room, (free - int(lengths[i]), r))
  B = len(rows)
  out = {"tokens_BxT": np.full((B, T), pad_id, tokens_NxT.dtype),
         "loss_mask_BxT": np.zeros((B, T), loss_mask_NxT.dtype),
         "positions_BxT": np.zeros((B, T), np.int32),
         "segment_ids_BxT": np.zeros((B, T), np.int32)}
  for r, members in enumerate(rows):
    at = 0
    for k, i in enumerate(members):
      n = int(lengths[i])
      out["tokens_BxT"][r, at:at + n] = tokens_NxT[i, :n]
      out["loss_mask_BxT"][r, at:at + n] = loss_mask_NxT[i, :n]
      out["positions_BxT"][r, at:at + n] = np.arange(n)
      out["segment_ids_BxT"][r, at:at + n] = k + 1
      at += n
  return out


def pad_batch(rows: Sequence[np.ndarray], length: int, pad_value=0) -> np.ndarray:
  """Right-pads 1-D arrays to ``[len(rows), length]``; ValueError if one is longer."""
  too_long = [len(r) for r in rows if len(r) > length]
  if too_long:
    raise ValueError(f"sequence of length {max(too_long)} exceeds the padded "
                     f"length {length}")
  dtype = np.asarray(rows[0]).dtype if rows else np.int32
  out = np.full((len(rows), length), pad_value, dtype=dtype)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return out
