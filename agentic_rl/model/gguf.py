"""GGUF checkpoints in: llama, qwen2, qwen3, gemma, gemma2 and gemma3.

A GGUF file (llama.cpp's format) holds the architecture as metadata keys
(``{arch}.block_count``, ``{arch}.attention.head_count``, ...), the tokenizer
(``tokenizer.ggml.*``, read by :mod:`agentic_rl.text.gguf_tokenizer`) and
the tensors, possibly quantised. This module reads the metadata into the
``config.json`` dict a Hugging Face checkpoint of the same model has
(:func:`hf_config`) and the tensors into that checkpoint's names and
layouts (:func:`hf_tensors`), so :mod:`agentic_rl.model.hf` turns both into
our config and parameters with the one table it has: a ``.gguf`` path works
wherever a checkpoint directory does (``config.model.init_from``).

What llama.cpp's converter changed, undone here:

* llama: q/k projection rows are permuted from HF's "rotate_half" RoPE
  layout to interleaved pairs; per head, row ``2i + j`` of the file is row
  ``j * Dh/2 + i`` of the checkpoint.
* gemma family: every RMSNorm weight is stored as ``1 + w``.
* Gemma 2 / 3 27B scale queries by ``hidden / heads`` instead of ``head_dim``
  (llama.cpp picks this by model size; the file carries no key for it).

Weights are dequantised with the ``gguf`` package (F32, F16, BF16, Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants among others); a type it cannot
dequantise, an architecture or a RoPE scaling outside the list is refused
with a message naming it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.model import hf as hf_lib

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")
_MODEL_TYPES = {"gemma3": "gemma3_text"}  # HF's model_type, where it differs.
_GEMMA = ("gemma", "gemma2", "gemma3")
# Layer counts of the 27B Gemma 2 / 3, whose query scale llama.cpp derives
# from the model size.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# GGUF per-layer tensor -> HF name in layer i (``model.layers.{i}.``).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# ``ffn_norm`` is the norm before the MLP: HF's post_attention_layernorm in
# Llama / Qwen, pre_feedforward_layernorm in Gemma 2 / 3, which also have
# post-norms.
_GEMMA23_NORMS = {"ffn_norm": "pre_feedforward_layernorm",
                  "post_attention_norm": "post_attention_layernorm",
                  "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def _reader(path: str):
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ImportError(f"reading the GGUF file {path!r} needs the gguf package: "
                      'pip install -e ".[gguf]"') from None
  try:
    return gguf.GGUFReader(path)
  except (ValueError, OSError) as e:
    raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from None


def _metadata(reader) -> dict[str, Any]:
  """A reader's metadata as Python values, long arrays (the tokenizer's
  vocabulary) left out but for ``tokenizer.ggml.token_count``."""
  meta = {name: f.contents() for name, f in reader.fields.items() if len(f.data) <= 64}
  if "tokenizer.ggml.tokens" in reader.fields:
    meta["tokenizer.ggml.token_count"] = len(reader.fields["tokenizer.ggml.tokens"].data)
  return meta


def _architecture(meta: dict[str, Any]) -> str:
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {ARCHITECTURES}")
  return arch


def hf_config(meta: dict[str, Any], tensor_names: frozenset[str]) -> dict[str, Any]:
  """The Hugging Face ``config.json`` dict of a GGUF file's metadata
  ``meta`` (:func:`_metadata`) and tensor names. ValueError for an
  unsupported architecture or RoPE scaling."""
  arch = _architecture(meta)
  get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
  heads = int(get("attention.head_count"))
  hidden = int(get("embedding_length"))
  head_dim = int(get("attention.key_length", hidden // heads))
  if get("attention.value_length", head_dim) != head_dim:
    raise ValueError("GGUF models whose keys and values differ in size are not supported")
  vocab = get("vocab_size") or meta.get("tokenizer.ggml.token_count")
  if vocab is None:
    raise ValueError(f"the GGUF file has neither {arch}.vocab_size nor a tokenizer")
  n_layers = int(get("block_count"))
  hf = dict(
      model_type=_MODEL_TYPES.get(arch, arch),
      num_hidden_layers=n_layers,
      hidden_size=hidden,
      intermediate_size=int(get("feed_forward_length")),
      num_attention_heads=heads,
      num_key_value_heads=int(get("attention.head_count_kv", heads)),
      head_dim=head_dim,
      rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
      rope_theta=float(get("rope.freq_base", 10_000.0)),
      vocab_size=int(vocab),
      tie_word_embeddings="output.weight" not in tensor_names,
  )
  if "rope_freqs.weight" in tensor_names:
    raise ValueError("GGUF files with a rope_freqs tensor (Llama 3.1's RoPE scaling) are not "
                     "supported: load the Hugging Face checkpoint directory instead")
  scaling, factor = get("rope.scaling.type", "none"), get("rope.scaling.factor")
  if scaling == "linear" and arch == "gemma3":
    hf["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
  elif scaling not in ("none", None) and factor not in (None, 1.0):
    raise ValueError(f"GGUF RoPE scaling {scaling!r} on {arch} is not supported "
                     "(only the default RoPE, and linear on gemma3)")
  if arch in _GEMMA:
    hf.update(hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
  if arch in ("gemma2", "gemma3"):
    big = n_layers == _GEMMA_27B_LAYERS[arch]
    hf.update(query_pre_attn_scalar=hidden // heads if big else head_dim,
              sliding_window=get("attention.sliding_window"),
              final_logit_softcapping=get("final_logit_softcapping"))
  if arch == "gemma2":
    hf["attn_logit_softcapping"] = get("attn_logit_softcapping")
  if arch == "gemma3":
    hf.update(rope_local_base_freq=10_000.0, sliding_window_pattern=6)
  return hf


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's q/k row order (interleaved RoPE pairs) back to HF's."""
  rows = w.shape[0]
  return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _dequantize(tensor) -> np.ndarray:
  from gguf import quants  # pylint: disable=import-outside-toplevel  (_reader checked it)
  kind = tensor.tensor_type
  try:
    return np.asarray(quants.dequantize(tensor.data, kind), np.float32)
  except NotImplementedError:
    raise ValueError(f"GGUF tensor {tensor.name!r} has type {kind.name}, which this loader "
                     "cannot dequantise") from None


def _hf_name(arch: str, name: str) -> str | None:
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  parts = name.split(".")
  if parts[0] != "blk" or len(parts) != 4:
    return None
  layer, kind, suffix = parts[1], parts[2], parts[3]
  if arch in ("gemma2", "gemma3") and kind in _GEMMA23_NORMS:
    theirs = _GEMMA23_NORMS[kind]
  elif kind == "ffn_norm":
    theirs = "post_attention_layernorm"
  elif kind in _LAYER_NAMES:
    theirs = _LAYER_NAMES[kind]
  else:
    return None
  return f"model.layers.{layer}.{theirs}.{suffix}"


def hf_tensors(path: str, hf: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
  """The tensors of the GGUF file ``path`` under their Hugging Face names
  and layouts, dequantised to float32. ValueError for a tensor this loader
  does not map or cannot dequantise."""
  reader = _reader(path)
  meta = _metadata(reader)
  arch = _architecture(meta)
  if hf is None:
    hf = hf_config(meta, frozenset(t.name for t in reader.tensors))
  tensors, unknown = {}, []
  for tensor in reader.tensors:
    name = _hf_name(arch, tensor.name)
    if name is None:
      unknown.append(tensor.name)
      continue
    w = _dequantize(tensor)
    if arch == "llama" and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
      heads = hf["num_attention_heads" if ".attn_q." in tensor.name else "num_key_value_heads"]
      w = _unpermute(w, heads)
    if arch in _GEMMA and tensor.name.endswith("norm.weight"):
      w = w - 1.0
    tensors[name] = w
  if unknown:
    raise ValueError(f"GGUF file {path} has tensors this loader does not map "
                     f"(unsupported features?): {sorted(unknown)[:5]}")
  return tensors


def config_of(path: str) -> dict[str, Any]:
  """The Hugging Face ``config.json`` dict of the GGUF file ``path``."""
  reader = _reader(path)
  return hf_config(_metadata(reader), frozenset(t.name for t in reader.tensors))


def load_gguf(path: str, **overrides):
  """Load a GGUF file; returns ``(TransformerConfig, params)``.

  ``overrides`` replace config fields (e.g. ``dtype="bfloat16"``); params
  are dequantised into the config's ``param_dtype``.
  """
  config = hf_lib.config_from_hf(config_of(path), **overrides)
  return config, jax.tree.map(jnp.asarray, load_params(path, config))


def load_params(path: str, config) -> dict[str, Any]:
  """The parameters of the GGUF file ``path`` as host (numpy) arrays in
  ``config.param_dtype`` (``config`` from :func:`config_of`'s dict)."""
  return hf_lib.params_from_tensors(hf_tensors(path), config, path)
