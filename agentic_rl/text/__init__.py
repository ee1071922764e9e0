"""Tokenizer and the one conversation codec."""

from agentic_rl.text.codec import (Codec, Encoded, FormatIds, Message, ToolCall, ToolCallError,
                                   frame_observation, pad_batch)
from agentic_rl.text.tokenizer import Tokenizer, load_tokenizer


def default_codec() -> Codec:
  """The codec over the shipped tokenizer."""
  return Codec(load_tokenizer())


def load_codec(path: str | None = None, **kwargs):
  """The project codec (``path`` None) or a checkpoint's own chat codec
  (:class:`agentic_rl.text.chat.ChatCodec` of the directory ``path``)."""
  if path is None:
    return default_codec()
  from agentic_rl.text.chat import ChatCodec  # jinja2 and tokenizers only when asked for
  return ChatCodec.from_pretrained(path, **kwargs)

__all__ = ["Codec", "Encoded", "FormatIds", "Message", "Tokenizer", "ToolCall", "ToolCallError",
           "default_codec", "load_codec",
           "frame_observation", "load_tokenizer", "pad_batch"]
