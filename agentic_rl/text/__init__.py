"""Tokenizer and the one conversation codec."""

from agentic_rl.text.codec import (Codec, Encoded, FormatIds, Message, ToolCall, ToolCallError,
                                   frame_observation, pad_batch)
from agentic_rl.text.tokenizer import Tokenizer, load_tokenizer


def default_codec() -> Codec:
  """The codec over the shipped tokenizer."""
  return Codec(load_tokenizer())

__all__ = ["Codec", "Encoded", "FormatIds", "Message", "Tokenizer", "ToolCall", "ToolCallError",
           "default_codec",
           "frame_observation", "load_tokenizer", "pad_batch"]
