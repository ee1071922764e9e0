"""A GGUF file's tokenizer as a ``tokenizers`` pipeline.

llama.cpp stores the tokenizer as metadata: ``tokenizer.ggml.model`` (the
algorithm), ``.pre`` (how text is split before it), ``.tokens``,
``.token_type``, ``.merges``, the special ids and ``tokenizer.chat_template``.
Byte-level BPE vocabularies (``model == "gpt2"``: Llama 3, Qwen 2/3,
SmolLM, ...) are rebuilt here with the split their merges were learnt on;
SentencePiece ones (``"llama"``: Llama 2, Gemma) and unknown splits are
refused, naming what was found: load the checkpoint's Hugging Face
directory for those.

Token types (llama.cpp): 3 is a control token (``<|im_end|>``), added as a
special token; 4 is user-defined (``<think>``), added as a plain added
token; both are matched whole in text.
"""

from __future__ import annotations

import functools
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# ``tokenizer.ggml.pre`` -> (split regex or None for GPT-2's own, digits
# split one by one first, BPE ignore_merges).
_PRE = {
    "default": (None, False, False),
    "gpt-2": (None, False, False),
    "smollm": (None, True, False),
    "llama3": (_LLAMA3_SPLIT, False, True),
    "llama-v3": (_LLAMA3_SPLIT, False, True),
    "llama-bpe": (_LLAMA3_SPLIT, False, True),
    "smaug-bpe": (_LLAMA3_SPLIT, False, True),
    "qwen2": (_QWEN2_SPLIT, False, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False, False),
}
SUPPORTED_PRE = tuple(_PRE)


@functools.cache
def _byte_chars() -> dict[int, str]:
  """GPT-2's byte -> printable character map of byte-level vocabularies."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  chars, extra = {}, 0
  for b in range(256):
    if b in keep:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return chars


def _byte_level(token: str) -> str:
  """``token`` in the byte-level spelling (tokens already in it are kept)."""
  chars = _byte_chars()
  alphabet = set(chars.values())
  if set(token) <= alphabet:
    return token
  return "".join(chars[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str):
  if pre not in _PRE:
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                     f"{SUPPORTED_PRE}. Load the checkpoint's Hugging Face directory instead")
  split, digits, ignore_merges = _PRE[pre]
  if split is None:
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
  else:
    steps = [pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
  if digits:
    steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
  return pre_tokenizers.Sequence(steps), ignore_merges


def read_gguf_tokenizer(path: str) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
  """The tokenizer of the GGUF file ``path`` and a ``tokenizer_config.json``
  dict for it (bos/eos/unk/pad tokens, ``add_bos_token``,
  ``chat_template``). ValueError for a tokenizer it cannot rebuild."""
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ImportError(f"reading the GGUF file {path!r} needs the gguf package: "
                      'pip install -e ".[gguf]"') from None
  fields = gguf.GGUFReader(path).fields
  get = lambda key, default=None: (  # noqa: E731
      fields[key].contents() if key in fields else default)
  kind = get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, "
                     "'gpt2'): load the checkpoint's Hugging Face directory (tokenizer.json)")
  pre_tokenizer, ignore_merges = _pre_tokenizer(get("tokenizer.ggml.pre", "default"))
  tokens = [_byte_level(t) for t in get("tokenizer.ggml.tokens")]
  merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
  backend = tokenizers.Tokenizer(models.BPE(
      vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
      ignore_merges=ignore_merges))
  backend.pre_tokenizer = pre_tokenizer
  backend.decoder = decoders.ByteLevel()
  types = get("tokenizer.ggml.token_type", [])
  for token_type, special in ((_CONTROL, True), (_USER_DEFINED, False)):
    added = [tokenizers.AddedToken(t, special=special, normalized=False)
             for t, k in zip(tokens, types) if k == token_type]
    (backend.add_special_tokens if special else backend.add_tokens)(added)
  config: dict[str, Any] = {"add_bos_token": bool(get("tokenizer.ggml.add_bos_token", False))}
  for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                    ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
    if (i := get(f"tokenizer.ggml.{key}")) is not None:
      config[name] = tokens[int(i)]
  if (template := get("tokenizer.chat_template")) is not None:
    config["chat_template"] = template
  return backend, config
