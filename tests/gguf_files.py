"""Small GGUF files for the tests, written with the ``gguf`` package's
writer as llama.cpp's converter writes them: llama q/k rows permuted to
interleaved RoPE pairs, Gemma norms stored as ``1 + w``, tensors under
llama.cpp's names, the tokenizer as ``tokenizer.ggml.*`` metadata.

``write_gguf(net, tokenizer_dir, path, qtype)`` takes a transformers model
and a tiny byte-level tokenizer directory (``experiments.tiny_checkpoint``).
Matrices are stored in ``qtype``: quantised by ``gguf.quants`` where it can
(F16, BF16, Q8_0, Q4_0, Q4_1), else (the K-quants, which ``gguf`` reads but
does not write) as random valid blocks, so the file's weights are whatever
its blocks decode to, the same for every reader.
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import tokenizers

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
}
_GEMMA23 = {"pre_feedforward_layernorm": "ffn_norm",
            "post_attention_layernorm": "post_attention_norm",
            "post_feedforward_layernorm": "post_ffw_norm"}


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's permutation of llama q/k rows (HF's rotate_half layout to
  interleaved pairs)."""
  return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _gguf_name(arch: str, name: str) -> str:
  if name == "model.embed_tokens.weight":
    return "token_embd.weight"
  if name == "model.norm.weight":
    return "output_norm.weight"
  if name == "lm_head.weight":
    return "output.weight"
  _, _, layer, rest = name.split(".", 3)
  module, suffix = rest.rsplit(".", 1)
  table = {**_HF_TO_GGUF, **_GEMMA23} if arch in ("gemma2", "gemma3") else _HF_TO_GGUF
  return f"blk.{layer}.{table[module]}.{suffix}"


_F16_OFFSETS = {  # Byte offsets of a block's float16 scales, and its size.
    gguf.GGMLQuantizationType.Q4_K: ((0, 2), 144),
    gguf.GGMLQuantizationType.Q5_K: ((0, 2), 176),
    gguf.GGMLQuantizationType.Q6_K: ((208,), 210),
    gguf.GGMLQuantizationType.Q2_K: ((80, 82), 84),
}


def _random_blocks(shape, qtype, rng) -> np.ndarray:
  """Random ``qtype`` blocks for a ``[rows, cols]`` matrix, with small
  float16 scales (random bytes there could decode to inf)."""
  offsets, size = _F16_OFFSETS[qtype]
  rows, cols = shape
  blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
  for off in offsets:
    blocks[..., off:off + 2] = np.frombuffer(np.float16(0.0002).tobytes(), np.uint8)
  if qtype == gguf.GGMLQuantizationType.Q6_K:  # int8 sub-block scales: keep them small
    blocks[..., 192:208] = rng.integers(-8, 8, (rows, cols // 256, 16)).astype(np.int8).view(
        np.uint8)
  return blocks.reshape(rows, -1)


def write_gguf(net, tokenizer_dir: str, path: str, *, arch: str,
               qtype: str = "F32", pre: str = "qwen2", seed: int = 0) -> None:
  """Writes the transformers model ``net`` with the tokenizer in
  ``tokenizer_dir`` as the GGUF file ``path``."""
  cfg = net.config
  kind = gguf.GGMLQuantizationType[qtype]
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(cfg.num_hidden_layers)
  w.add_context_length(4096)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_attention_heads)
  w.add_head_count_kv(cfg.num_key_value_heads)
  w.add_key_length(cfg.head_dim)
  w.add_value_length(cfg.head_dim)
  w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]
                             if "rope_theta" in (cfg.rope_parameters or {})
                             else cfg.rope_parameters["full_attention"]["rope_theta"]))
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_vocab_size(cfg.vocab_size)
  if arch in ("gemma2", "gemma3"):
    w.add_sliding_window(cfg.sliding_window)
    if cfg.final_logit_softcapping is not None:
      w.add_final_logit_softcapping(cfg.final_logit_softcapping)
  if arch == "gemma2":
    w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
  _add_tokenizer(w, tokenizer_dir, cfg.vocab_size, pre)
  for name, tensor in net.state_dict().items():
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
      continue
    x = tensor.detach().numpy().astype(np.float32)
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
      heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
      x = _permute(x, heads)
    if arch.startswith("gemma") and name.endswith("norm.weight"):
      x = x + 1.0
    out = _gguf_name(arch, name)
    if x.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
      w.add_tensor(out, x)
    elif kind in _F16_OFFSETS:
      w.add_tensor(out, _random_blocks(x.shape, kind, rng), raw_dtype=kind)
    elif kind == gguf.GGMLQuantizationType.F16:
      w.add_tensor(out, x.astype(np.float16))
    else:
      w.add_tensor(out, gguf.quants.quantize(x, kind), raw_dtype=kind)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _add_tokenizer(w, tokenizer_dir: str, vocab_size: int, pre: str) -> None:
  tok = tokenizers.Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
  model = json.loads(tok.to_str())["model"]
  size = tok.get_vocab_size(with_added_tokens=True)
  tokens = [tok.id_to_token(i) for i in range(size)]
  added = tok.get_added_tokens_decoder()
  types = [(3 if added[i].special else 4) if i in added else 1 for i in range(size)]
  tokens += [f"[PAD{i}]" for i in range(size, vocab_size)]  # as llama.cpp pads
  types += [5] * (vocab_size - size)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
  with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), encoding="utf-8") as f:
    config = json.load(f)
  w.add_eos_token_id(tok.token_to_id(config["eos_token"]))
  if config.get("bos_token"):
    w.add_bos_token_id(tok.token_to_id(config["bos_token"]))
  if config.get("pad_token"):
    w.add_pad_token_id(tok.token_to_id(config["pad_token"]))
  w.add_add_bos_token(bool(config.get("add_bos_token")))
  w.add_chat_template(config["chat_template"])
