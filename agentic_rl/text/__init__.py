"""Tokenizer and the one conversation codec."""

from agentic_rl.text.codec import (Codec, Encoded, FormatIds, Message, ToolCall, ToolCallError,
                                   frame_observation, pad_batch)
from agentic_rl.text.tokenizer import Tokenizer, load_tokenizer


def default_codec() -> Codec:
  """The codec over the shipped tokenizer."""
  return Codec(load_tokenizer())


def load_codec(path: str | None = None):
  """The codec of the checkpoint directory ``path``; the project's codec
  over the shipped tokenizer when None."""
  if path is None:
    return default_codec()
  raise ValueError("checkpoint tokenizers are not supported yet")

__all__ = ["Codec", "Encoded", "FormatIds", "Message", "Tokenizer", "ToolCall", "ToolCallError",
           "default_codec",
           "frame_observation", "load_tokenizer", "pad_batch"]
