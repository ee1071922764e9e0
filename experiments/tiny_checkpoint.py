"""Tiny local checkpoints in the layout of real model families.

``write_tokenizer(family, out)`` trains a small BPE tokenizer (a few
hundred pieces, on a built-in corpus of English, digits, JSON, code and
non-ASCII text) with the ``tokenizers`` library, gives it the family's
special tokens and pipeline, and writes::

  tokenizer.json, tokenizer_config.json (with the family's chat template),
  special_tokens_map.json, generation_config.json

Families (templates in ``experiments/chat_templates/``):

  qwen2  Qwen2.5: byte-level BPE, ChatML (<|im_start|>, <|im_end|>), tools in
         the system prompt inside <tools></tools>, calls as <tool_call> JSON
         </tool_call>, tool results as user turns inside <tool_response>
  qwen3  Qwen3: as qwen2, plus <think> blocks and <tool_response> tokens
  llama  Llama 3.1: byte-level BPE, <|start_header_id|>role<|end_header_id|>,
         <|eot_id|>; tools in the first user message, calls as a JSON object
         {"name", "parameters"}, results in ``ipython`` turns
  gemma  Gemma: SentencePiece-style BPE with byte fallback,
         <start_of_turn>/<end_of_turn>, no system or tool role; gemma2 and
         gemma3 have its tokenizer and template, and their own models

The command line also writes a random tiny transformers model (float32), so
the directory is a complete checkpoint::

  python -m experiments.tiny_checkpoint --family=qwen2 --out=/tmp/tiny_qwen
"""

from __future__ import annotations

import argparse
import json
import os

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers

FAMILIES = ("qwen2", "qwen3", "llama", "gemma", "gemma2", "gemma3")
TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")

QWEN_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
              r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
               r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. It was a sunny day in the city.",
    "You are a helpful assistant. Answer the question and show your work.",
    "What is 12 + 30? The answer is 42. Then 7 * 6 = 42 and 100 / 4 = 25.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 256 1024 65536 3.14159 -17 2024-07-26",
    '{"name": "calc", "arguments": {"expr": "1 + 2"}}',
    '{"name": "search", "parameters": {"query": "weather in Paris", "limit": 3}}',
    '[{"id": 1, "ok": true, "tags": ["a", "b"], "value": null}, {"id": 2}]',
    "def add(x, y):\n    return x + y\n\nfor i in range(10):\n    print(i, add(i, 1))\n",
    "class Tool:\n    def __init__(self, name):\n        self.name = name  # the tool\n",
    "if (a && b) { return a[i] * b[j]; } else { x += 1; }\t// done\n",
    "Café, naïve, über, façade, jalapeño; Straße; déjà vu; São Paulo.",
    "中文文本，日本語のテキスト，한국어 텍스트; Ελληνικά; русский текст.",
    "Observation: the file contains 3 lines.\nResult: ok\n\nNext step?",
    "Let me think step by step. First, we add the numbers. Then we check.",
    "I will call the tool to get the result, then answer the user.",
)


def corpus() -> list[str]:
  return [line for _ in range(4) for line in _CORPUS]


def _spec(family: str) -> dict:
  """Special tokens, ids and config entries of a family."""
  if family in ("qwen2", "qwen3"):
    added = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
             ("<tool_call>", False), ("</tool_call>", False)]
    if family == "qwen3":
      added += [("<tool_response>", False), ("</tool_response>", False),
                ("<think>", False), ("</think>", False)]
    return dict(added=added, byte_level=True, regex=QWEN_REGEX, tokenizer_class="Qwen2Tokenizer",
                tokens=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            unk_token=None),
                gen_eos=["<|im_end|>", "<|endoftext|>"], add_bos=False)
  if family == "llama":
    added = [(t, True) for t in (
        "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
        "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")]
    return dict(added=added, byte_level=True, regex=LLAMA_REGEX,
                tokenizer_class="PreTrainedTokenizerFast",
                tokens=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                            pad_token=None, unk_token=None),
                gen_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], add_bos=True)
  if family in ("gemma", "gemma2", "gemma3"):
    added = [(t, True) for t in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>",
                                 "<start_of_turn>", "<end_of_turn>")]
    return dict(added=added, byte_level=False, tokenizer_class="GemmaTokenizer",
                tokens=dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>", mask_token="<mask>"),
                gen_eos=["<eos>", "<end_of_turn>"], add_bos=True)
  raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def _byte_level(spec: dict, vocab_size: int) -> tokenizers.Tokenizer:
  tok = tokenizers.Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC() if spec["regex"] == QWEN_REGEX else None
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(spec["regex"]), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=256 + vocab_size, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(corpus(), trainer=trainer)
  return tok


def _byte_fallback(spec: dict, vocab_size: int) -> tokenizers.Tokenizer:
  """SentencePiece-style BPE: spaces as "▁", unknown characters as <0xXX>
  byte pieces; the special tokens take the first ids, then the bytes."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.normalizer = normalizers.Replace(" ", "▁")
  tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
  tok.train_from_iterator(corpus(), trainer=trainers.BpeTrainer(
      vocab_size=vocab_size, show_progress=False))
  trained = json.loads(tok.to_str())["model"]
  vocab = {t: i for i, (t, _) in enumerate(spec["added"])}
  for b in range(256):
    vocab[f"<0x{b:02X}>"] = len(vocab)
  for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
    vocab.setdefault(piece, len(vocab))
  merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
  out = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                        fuse_unk=True, byte_fallback=True))
  out.normalizer = tok.normalizer
  out.pre_tokenizer = tok.pre_tokenizer
  out.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse()])
  return out


def build_tokenizer(family: str, vocab_size: int = 400) -> tokenizers.Tokenizer:
  """The family's tokenizer with about ``vocab_size`` learned pieces."""
  spec = _spec(family)
  tok = (_byte_level if spec["byte_level"] else _byte_fallback)(spec, vocab_size)
  tok.add_special_tokens([AddedToken(t, special=s, normalized=False) for t, s in spec["added"]
                          if s])
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, s in spec["added"]
                  if not s])
  if family == "llama":
    bos = spec["tokens"]["bos_token"]
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
  return tok


def chat_template(family: str) -> str:
  name = "gemma" if family.startswith("gemma") else family  # one template for Gemma 1-3
  with open(os.path.join(TEMPLATE_DIR, f"{name}.jinja"), encoding="utf-8") as f:
    return f.read()


def write_tokenizer(family: str, out: str, *, vocab_size: int = 400,
                    template_file: bool = False) -> int:
  """Writes the family's tokenizer files into ``out``; returns the
  tokenizer's size. With ``template_file`` the chat template goes to
  ``chat_template.jinja`` (as transformers 5 saves it) instead of
  tokenizer_config.json."""
  spec = _spec(family)
  tok = build_tokenizer(family, vocab_size)
  os.makedirs(out, exist_ok=True)
  tok.save(os.path.join(out, "tokenizer.json"))
  decoder = tok.get_added_tokens_decoder()
  config = {
      "tokenizer_class": spec["tokenizer_class"],
      "added_tokens_decoder": {str(i): {
          "content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
          "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
          for i, t in sorted(decoder.items())},
      **spec["tokens"],
      "add_bos_token": spec["add_bos"],
      "clean_up_tokenization_spaces": False,
      "model_max_length": 4096,
  }
  if template_file:
    with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
      f.write(chat_template(family))
  else:
    config["chat_template"] = chat_template(family)
  special_map = {k: v for k, v in spec["tokens"].items() if v is not None}
  gen = {"eos_token_id": [tok.token_to_id(t) for t in spec["gen_eos"]]}
  if spec["tokens"]["bos_token"]:
    gen["bos_token_id"] = tok.token_to_id(spec["tokens"]["bos_token"])
  for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map),
                    ("generation_config.json", gen)):
    with open(os.path.join(out, name), "w", encoding="utf-8") as f:
      json.dump(obj, f, indent=2, ensure_ascii=False)
  return tok.get_vocab_size(with_added_tokens=True)


def write_model(family: str, out: str, vocab_size: int, *, seed: int = 0) -> None:
  """A random tiny transformers model of the family (float32), saved to
  ``out``; its embedding is ``vocab_size`` rounded up to a multiple of 64."""
  import torch
  import transformers

  torch.manual_seed(seed)
  config_cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                "llama": transformers.LlamaConfig, "gemma": transformers.GemmaConfig,
                "gemma2": transformers.Gemma2Config,
                "gemma3": transformers.Gemma3TextConfig}[family]
  # Gemma 2 and 3: local layers with a window shorter than an episode.
  extra = dict(sliding_window=64) if family in ("gemma2", "gemma3") else {}
  tok = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
  with open(os.path.join(out, "generation_config.json"), encoding="utf-8") as f:
    gen = json.load(f)
  spec = _spec(family)
  pad = spec["tokens"]["pad_token"]
  config = config_cls(
      vocab_size=-(-vocab_size // 64) * 64, hidden_size=64, intermediate_size=128,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      max_position_embeddings=1024, tie_word_embeddings=True,
      bos_token_id=gen.get("bos_token_id"), eos_token_id=gen["eos_token_id"],
      pad_token_id=tok.token_to_id(pad) if pad else None, **extra)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  model.save_pretrained(out)
  with open(os.path.join(out, "generation_config.json"), "w", encoding="utf-8") as f:
    json.dump(gen, f, indent=2)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--family", choices=FAMILIES, required=True)
  parser.add_argument("--out", required=True, help="the checkpoint directory to write")
  parser.add_argument("--vocab_size", type=int, default=400, help="learned pieces")
  parser.add_argument("--no_model", action="store_true", help="write the tokenizer only")
  args = parser.parse_args(argv)
  size = write_tokenizer(args.family, args.out, vocab_size=args.vocab_size)
  if not args.no_model:
    write_model(args.family, args.out, size)
  print(f"wrote a tiny {args.family} checkpoint to {args.out} ({size} tokens)")


if __name__ == "__main__":
  main()
