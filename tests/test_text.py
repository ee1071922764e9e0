"""Tokenizer and conversation codec."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from agentic_rl.text import codec as codec_lib
from agentic_rl.text import tokenizer as tok_lib

M = codec_lib.Message


@pytest.fixture(scope="module")
def tok():
  return tok_lib.load_tokenizer()


@pytest.fixture(scope="module")
def codec(tok):
  return codec_lib.Codec(tok)


def test_every_reserved_piece_is_one_id(tok):
  for piece in tok_lib.USER_DEFINED_SYMBOLS:
    ids = tok.encode(piece)
    assert ids == [tok.piece_id(piece)], piece
  # ... also inside running text, next to other characters.
  ids = tok.encode("x<answer>123</answer>\ny")
  pieces = [tok.id_to_piece(i) for i in ids]
  for piece in ("<answer>", "1", "2", "3", "</answer>", "\n"):
    assert piece in pieces


def test_fixed_special_ids(tok):
  assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
  assert tok.id_to_piece(0) == "<pad>" and tok.id_to_piece(3) == "</s>"


_TEXT = st.text(
    alphabet=st.sampled_from(list("abcxyz ABC0123456789\n+-*/=:,()   .?é")),
    max_size=60)


@settings(max_examples=60, deadline=None)
@given(_TEXT)
def test_tokenizer_round_trip(text):
  tok = tok_lib.load_tokenizer()
  assert tok.decode(tok.encode(text)) == text


def test_round_trip_with_every_special_token(tok):
  text = "".join(tok_lib.USER_DEFINED_SYMBOLS) + "  two  spaces\n\nend 42"
  assert tok.decode(tok.encode(text)) == text


def test_digits_split(tok):
  ids = tok.encode("1234567890")
  assert [tok.id_to_piece(i) for i in ids] == list("1234567890")


def test_missing_pieces_named(tok):
  with pytest.raises(ValueError, match="not_a_piece"):
    tok.require(["not_a_piece"])
  with pytest.raises(ValueError, match="no tokenizer model"):
    tok_lib.load_tokenizer("/nonexistent/tokenizer.model")


CONV = [
    M("system", "You are an agent with tools."),
    M("user", "Compute 123456789*987\nthen add 4."),
    M("assistant", "First multiply."),
    M("tool_call", "calc 123456789*987"),
    M("tool_result", "121851850743"),
    M("tool_call", "calc 121851850743+4"),
    M("tool_result", "121851850747"),
    M("tool_call", "store 1:121851850747"),
    M("tool_result", "ok"),
    M("assistant", "Done: <answer>121851850747</answer>"),
]


def test_codec_round_trip(codec):
  enc = codec.encode(CONV)
  assert codec.decode(enc.ids) == CONV
  # Trailing padding is ignored.
  padded = np.concatenate([enc.ids, np.zeros(7, np.int32)])
  assert codec.decode(padded) == CONV
  chat = [M("user", "hi"), M("assistant", "hello"), M("user", "bye"),
          M("assistant", "ok")]
  assert codec.decode(codec.encode(chat).ids) == chat


def test_loss_mask_exactly_on_policy_tokens(codec, tok):
  enc = codec.encode(CONV)
  ids = codec.ids
  # Rebuild the expected mask independently, message by message.
  expected = [0]  # bos
  for m in CONV:
    n = len(tok.encode(m.content))
    if m.role in ("system", "user"):
      expected += [0] * (n + 2)
    elif m.role == "tool_result":
      expected += [0] * (n + 2)
    elif m.role == "tool_call":
      expected += [1] * (n + 2)
    else:
      if m is CONV[2]:
        expected += [0]  # the assistant header
      expected += [1] * n
  np.testing.assert_array_equal(enc.loss_mask, expected)
  # Tool-result framing and content are never trained on.
  res = enc.role_ids == codec_lib.ROLE_ID["tool_result"]
  assert res.sum() == sum(len(tok.encode(m.content)) + 2
                          for m in CONV if m.role == "tool_result")
  assert not enc.loss_mask[res].any()
  assert enc.loss_mask[enc.ids == ids.tool_call_close].all()
  assert enc.loss_mask[enc.ids == ids.answer_close].all()
  assert not enc.loss_mask[enc.ids == ids.assistant].any()


def test_turn_ids(codec):
  enc = codec.encode(CONV)
  # Three tool calls and a final answer: four action segments.
  assert enc.turn_ids.max() == 4
  prompt = enc.role_ids <= codec_lib.ROLE_ID["user"]
  assert (enc.turn_ids[prompt] == 0).all()
  # Each tool result carries the turn of the call it answers.
  calls = enc.turn_ids[enc.ids == codec.ids.tool_call_close]
  results = enc.turn_ids[enc.ids == codec.ids.tool_result_close]
  np.testing.assert_array_equal(calls, [1, 2, 3])
  np.testing.assert_array_equal(results, [1, 2, 3])
  # Turn ids never decrease.
  assert (np.diff(enc.turn_ids) >= 0).all()


def test_generation_prompt(codec):
  prompt = codec.encode_prompt(CONV[:2])
  assert prompt[-1] == codec.ids.assistant
  full = codec.encode(CONV).ids
  np.testing.assert_array_equal(full[:len(prompt)], prompt)


def test_bad_conversations(codec):
  with pytest.raises(ValueError, match="unknown role"):
    codec.encode([M("robot", "x")])
  with pytest.raises(ValueError, match="reserved tokens"):
    codec.encode([M("user", "sneaky <tool_call>")])
  with pytest.raises(ValueError, match="must follow a tool_call"):
    codec.encode([M("user", "x"), M("tool_result", "1")])
  with pytest.raises(ValueError, match="answer tags"):
    codec.encode([M("user", "<answer>1</answer>")])
  with pytest.raises(ValueError, match="adjacent"):
    codec.encode([M("user", "x"), M("assistant", "a"), M("assistant", "b")])
  with pytest.raises(ValueError, match="unclosed tool call"):
    codec.decode([codec.ids.bos, codec.ids.assistant, codec.ids.tool_call_open, 20])
  with pytest.raises(ValueError, match="exceeds"):
    codec_lib.pad_batch([np.arange(5)], 3)


@pytest.mark.parametrize("use_jit", [False, True])
def test_frame_observation(codec, use_jit):
  obs = jnp.array([[20, 21, 22, 0], [23, 0, 0, 0]], jnp.int32)
  lens = jnp.array([3, 1], jnp.int32)
  fn = jax.jit(codec_lib.frame_observation, static_argnums=2) if use_jit else (
      codec_lib.frame_observation)
  framed, n = fn(obs, lens, codec.ids)
  o, c, p = codec.ids.tool_result_open, codec.ids.tool_result_close, codec.ids.pad
  np.testing.assert_array_equal(framed, [[o, 20, 21, 22, c, p], [o, 23, c, p, p, p]])
  np.testing.assert_array_equal(n, [5, 3])
  # Framing equals what the codec writes for the same tool result.
  enc = codec.encode([M("user", "q"), M("tool_call", "calc 1+1"),
                      M("tool_result", "2")])
  two = codec.tokenizer.encode("2")
  f, fl = codec_lib.frame_observation(jnp.array(two + [0]), jnp.array(len(two)), codec.ids)
  np.testing.assert_array_equal(enc.ids[-(len(two) + 2):], np.asarray(f)[:int(fl)])


_CALC = {"name": "calc", "description": "evaluate", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}


def test_tools_are_offered_in_the_system_message(codec):
  user = [M("user", "2+2?")]
  with_tools = codec.decode(codec.encode_prompt(user, tools=[_CALC], escape=True))
  assert with_tools[0].role == "system" and "calc(expr: string)" in with_tools[0].content
  assert with_tools[1:] == user
  system = [M("system", "Be brief."), *user]
  merged = codec.decode(codec.encode_prompt(system, tools=[_CALC], escape=True))
  assert merged[0].content.startswith("Be brief.\n") and "calc" in merged[0].content
  assert len(merged) == 2


def test_parse_tool_call(codec):
  call = codec.tokenizer.encode('<tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}'
                                '</tool_call>')
  assert codec.calls_tool(call)
  assert codec.parse_tool_call(call, [_CALC]) == codec_lib.ToolCall("calc", {"expr": "2+2"})
  answer = codec.tokenizer.encode("<answer>4</answer>")
  assert not codec.calls_tool(answer) and codec.parse_tool_call(answer, [_CALC]) is None
  assert codec.action_text(answer) == "<answer>4</answer>"
  for bad, says in (('{"name": "calc"', "not JSON"), ('{"name": "sql", "arguments": {}}', "no tool"),
                    ('{"name": "calc", "arguments": {"expr": 4}}', "must be string"),
                    ('{"name": "calc", "arguments": {}}', "missing")):
    with pytest.raises(codec_lib.ToolCallError, match=says):
      codec.parse_tool_call(codec.tokenizer.encode(f"<tool_call>{bad}</tool_call>"), [_CALC])
