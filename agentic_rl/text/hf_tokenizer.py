"""A pretrained checkpoint's own tokenizer, read from its directory.

Files read (as a Hugging Face checkpoint has them)::

  tokenizer.json           the tokenizers pipeline and vocabulary (required)
  tokenizer_config.json    bos/eos/pad tokens, add_bos_token, added tokens,
                           chat_template (a string or a list of named ones)
  chat_template.jinja      the chat template, as transformers 5 saves it
  special_tokens_map.json  bos/eos/pad tokens of older checkpoints
  generation_config.json   eos_token_id: an id or a list of end ids

Token ids follow the file exactly; nothing is downloaded. :meth:`encode`
adds no BOS/EOS and recognises added tokens in the text (``"hi<|im_end|>"``
ends with the ``<|im_end|>`` id): it is for the policy's own text.
:meth:`encode_plain` recognises none (for text from outside the policy).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import tokenizers

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")


def _token_str(value: Any) -> str | None:
  """A token as written in a config: a string or an AddedToken dict."""
  if isinstance(value, dict):
    return value.get("content")
  return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


class HFTokenizer:
  """A checkpoint's tokenizer. Create with :meth:`from_pretrained`."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict[str, Any], *,
               chat_template: str | dict[str, str] | None = None,
               generation_eos: Sequence[int] = ()):
    self.backend = tokenizer
    self.config = config
    self.chat_template = chat_template
    self._add_declared_tokens(config)
    self.special_tokens = {k: t for k in SPECIAL_TOKEN_KEYS
                           if (t := _token_str(config.get(k))) is not None}
    self.add_bos_token = bool(config.get("add_bos_token", False))
    self.bos_id = self._optional_id(self.special_tokens.get("bos_token"))
    eos = self._optional_id(self.special_tokens.get("eos_token"))
    ends = [i for i in [eos, *generation_eos] if i is not None]
    if not ends:
      raise ValueError("the checkpoint names no eos token (tokenizer_config.json "
                       "eos_token or generation_config.json eos_token_id)")
    self.eos_id = ends[0]
    self.eos_ids = tuple(dict.fromkeys(ends))
    pad = self._optional_id(self.special_tokens.get("pad_token"))
    self.pad_id = self.eos_id if pad is None else pad
    decoder = tokenizer.get_added_tokens_decoder()
    self.added_ids = frozenset(decoder)
    self.special_ids = frozenset(i for i, t in decoder.items() if t.special)
    self.added_pieces = {t.content: i for i, t in decoder.items()}

  def _add_declared_tokens(self, config: dict[str, Any]) -> None:
    """Adds the config's declared added tokens the tokenizer.json lacks."""
    have = {t.content for t in self.backend.get_added_tokens_decoder().values()}
    declared = config.get("added_tokens_decoder") or {}
    for _, spec in sorted(declared.items(), key=lambda kv: int(kv[0])):
      if spec["content"] in have:
        continue
      token = tokenizers.AddedToken(
          spec["content"], single_word=spec.get("single_word", False),
          lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
          normalized=spec.get("normalized", not spec.get("special", False)),
          special=spec.get("special", False))
      (self.backend.add_special_tokens if spec.get("special") else self.backend.add_tokens)([token])
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    for t in extra if isinstance(extra, list) else []:
      if (s := _token_str(t)) is not None and s not in have:
        self.backend.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False)])

  def _optional_id(self, piece: str | None) -> int | None:
    return None if piece is None else self.backend.token_to_id(piece)

  @classmethod
  def from_pretrained(cls, path: str) -> HFTokenizer:
    """Loads the tokenizer of the checkpoint directory ``path``, or of the
    GGUF file ``path`` (:mod:`agentic_rl.text.gguf_tokenizer`).

    Raises:
      ValueError: no ``tokenizer.json`` (a SentencePiece-only checkpoint:
        save its tokenizer once with transformers, which writes one), or a
        GGUF tokenizer that cannot be rebuilt.
    """
    if str(path).endswith(".gguf"):
      from agentic_rl.text import gguf_tokenizer  # pylint: disable=import-outside-toplevel
      backend, config = gguf_tokenizer.read_gguf_tokenizer(path)
      return cls(backend, config, chat_template=config.get("chat_template"))
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
      hint = (" It has only a SentencePiece tokenizer.model: save it once with "
              "transformers (`AutoTokenizer.from_pretrained(path).save_pretrained(path)`), "
              "which writes tokenizer.json."
              if os.path.exists(os.path.join(path, "tokenizer.model")) else "")
      raise ValueError(f"no tokenizer.json in {path!r}.{hint}")
    config = _read_json(os.path.join(path, "special_tokens_map.json"))
    config.update(_read_json(os.path.join(path, "tokenizer_config.json")))
    template = config.get("chat_template")
    if isinstance(template, list):
      template = {t["name"]: t["template"] for t in template}
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_file):
      with open(jinja_file, encoding="utf-8") as f:
        template = f.read()
    gen = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
    gen = [] if gen is None else [gen] if isinstance(gen, int) else list(gen)
    return cls(tokenizers.Tokenizer.from_file(file), config, chat_template=template,
               generation_eos=[int(i) for i in gen])

  def save(self, path: str) -> None:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` (special
    tokens, ``add_bos_token``, the chat template) to the directory ``path``,
    as transformers' ``AutoTokenizer`` reads them."""
    os.makedirs(path, exist_ok=True)
    self.backend.save(os.path.join(path, "tokenizer.json"))
    config = {k: v for k, v in self.config.items() if k != "added_tokens_decoder"}
    config.update(self.special_tokens, add_bos_token=self.add_bos_token,
                  tokenizer_class="PreTrainedTokenizerFast")
    if self.chat_template is not None:
      config["chat_template"] = self.chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump(config, f, indent=1, ensure_ascii=False)

  # ---------------------------------------------------------------- vocabulary
  @property
  def vocab_size(self) -> int:
    """The tokenizer's size with added tokens (a model's embedding may be larger)."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  def piece_id(self, piece: str) -> int:
    """The id of a piece that must exist as one token."""
    i = self.backend.token_to_id(piece)
    if i is None:
      raise ValueError(f"piece {piece!r} is not in the tokenizer's vocabulary")
    return i

  def id_to_piece(self, i: int) -> str:
    return self.backend.id_to_token(int(i))

  # ---------------------------------------------------------------- text
  def encode(self, text: str) -> list[int]:
    """Text to ids, no BOS/EOS added; added and special tokens in the text
    are recognised."""
    return self.backend.encode(text, add_special_tokens=False).ids

  def encode_plain(self, text: str) -> list[int]:
    """Text to ids recognising no added token: normaliser, pre-tokeniser
    and model only, so ``"<|im_end|>"`` becomes ordinary pieces. Equal to
    :meth:`encode` on text without added-token strings."""
    backend = self.backend
    if backend.normalizer is not None:
      text = backend.normalizer.normalize_str(text)
    splits = [text]
    if backend.pre_tokenizer is not None:
      splits = [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
    return [t.id for s in splits for t in backend.model.tokenize(s)]

  def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = False) -> str:
    """Ids to text; with ``skip_special_tokens`` special tokens decode to
    nothing (non-special added tokens such as ``<tool_call>`` stay)."""
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
