"""Pretrained weights from disk, by what ``path`` names: a Hugging Face
checkpoint directory (:mod:`agentic_rl.model.hf`) or a GGUF file
(:mod:`agentic_rl.model.gguf`). ``config.model.init_from`` takes either.
"""

from __future__ import annotations

from typing import Any

from agentic_rl.model import gguf, hf
from agentic_rl.model.config import TransformerConfig


def is_gguf(path: str) -> bool:
  """Whether ``path`` names a GGUF file."""
  return str(path).endswith(".gguf")


def read_config(path: str) -> dict[str, Any]:
  """The Hugging Face ``config.json`` dict of the checkpoint ``path``."""
  return gguf.config_of(path) if is_gguf(path) else hf.read_config(path)


def load_params(path: str, config: TransformerConfig):
  """The parameters of the checkpoint ``path`` as host (numpy) arrays in
  ``config.param_dtype``, for ``config`` (from :func:`read_config` through
  ``hf.config_from_hf``, possibly with other runtime fields)."""
  return gguf.load_params(path, config) if is_gguf(path) else hf.load_hf_params(path, config)


def load(path: str, **overrides) -> tuple[TransformerConfig, Any]:
  """``(TransformerConfig, params)`` of the checkpoint ``path``;
  ``overrides`` replace config fields."""
  return gguf.load_gguf(path, **overrides) if is_gguf(path) else hf.load_hf_checkpoint(
      path, **overrides)
