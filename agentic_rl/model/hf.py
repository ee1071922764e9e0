"""Import Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` checkpoints.

Reads a checkpoint directory (``config.json`` plus ``*.safetensors``, sharded
or not) with the ``safetensors`` numpy loader; no torch. Our RoPE uses HF's
"rotate_half" convention, so q/k projection weights are used as stored.

HF ``nn.Linear`` weights are ``[out, in]``; ours are ``[in, ...out]``:
``q_proj [H*Dh, D] -> wq [D, H, Dh]``, ``o_proj [D, H*Dh] -> wo [H, Dh, D]``,
``gate/up_proj [F, D] -> [D, F]``, ``down_proj [D, F] -> [F, D]``,
``lm_head [V, D] -> unembed [D, V]``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from agentic_rl.model.config import TransformerConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu"}
# Non-persistent buffers that some older checkpoints saved; not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _architecture(hf: dict[str, Any]) -> str:
  archs = hf.get("architectures") or [_MODEL_TYPES.get(hf.get("model_type"))]
  for arch in archs:
    if arch in SUPPORTED_ARCHITECTURES:
      return arch
  raise ValueError(
      f"unsupported architecture {archs} (model_type "
      f"{hf.get('model_type')!r}); supported: {SUPPORTED_ARCHITECTURES}")


def config_from_hf(hf: dict[str, Any], **overrides) -> TransformerConfig:
  """Our config from an HF ``config.json`` dict (Llama or Qwen2).

  ``overrides`` replace fields of the result (e.g. ``dtype="bfloat16"``).
  Raises ``ValueError`` for unsupported architectures or features (RoPE
  scaling, Llama attention/MLP biases, other activations).
  """
  arch = _architecture(hf)
  rope_params = hf.get("rope_parameters") or {}
  for rope in (rope_params, hf.get("rope_scaling") or {}):
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
      raise ValueError(f"RoPE scaling {rope_type!r} is not supported "
                       "(only the default RoPE)")
  act = hf.get("hidden_act", "silu")
  if act not in _ACTIVATIONS:
    raise ValueError(f"hidden_act {act!r} is not supported; "
                     f"supported: {tuple(_ACTIVATIONS)}")
  if arch == "LlamaForCausalLM":
    for flag in ("attention_bias", "mlp_bias"):
      if hf.get(flag):
        raise ValueError(f"Llama checkpoints with {flag}=True are not "
                         "supported")
  n_layers = hf["num_hidden_layers"]
  windows = None
  if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf["max_window_layers"] else
        "full_attention" for i in range(n_layers)]
    windows = tuple(hf["sliding_window"] if t == "sliding_attention" else None
                    for t in layer_types)
  n_heads = hf["num_attention_heads"]
  fields = dict(
      vocab_size=hf["vocab_size"],
      d_model=hf["hidden_size"],
      n_layers=n_layers,
      n_heads=n_heads,
      n_kv_heads=hf.get("num_key_value_heads") or n_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
      mlp_dim=hf["intermediate_size"],
      mlp_activation=_ACTIVATIONS[act],
      norm_eps=hf.get("rms_norm_eps", 1e-6),
      rope_theta=float(rope_params.get("rope_theta",
                                       hf.get("rope_theta", 10_000.0))),
      qkv_bias=arch == "Qwen2ForCausalLM",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      sliding_windows=windows,
  )
  return TransformerConfig(**{**fields, **overrides}).validate()


def _read_tensors(path: str) -> dict[str, np.ndarray]:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise ValueError(f"no *.safetensors files in {path}")
  tensors = {}
  for name in files:
    with safe_open(os.path.join(path, name), framework="numpy") as f:
      for key in f.keys():
        tensors[key] = f.get_tensor(key)
  return tensors


def load_hf_checkpoint(path: str, **overrides):
  """Load an HF checkpoint directory; returns ``(config, params)``.

  ``overrides`` go to :func:`config_from_hf`; params are converted to the
  config's ``param_dtype``. Missing or unexpected tensors raise
  ``ValueError``.
  """
  config_path = os.path.join(path, "config.json")
  if not os.path.exists(config_path):
    raise ValueError(f"no config.json in {path}")
  with open(config_path) as f:
    config = config_from_hf(json.load(f), **overrides)
  tensors = _read_tensors(path)
  D, H, K, Dh = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim

  def take(name: str) -> np.ndarray:
    if name not in tensors:
      raise ValueError(f"checkpoint {path} has no tensor {name!r}")
    return tensors.pop(name)

  per_layer = {
      "attn_norm": ("input_layernorm.weight", lambda w: w),
      "wq": ("self_attn.q_proj.weight", lambda w: w.T.reshape(D, H, Dh)),
      "wk": ("self_attn.k_proj.weight", lambda w: w.T.reshape(D, K, Dh)),
      "wv": ("self_attn.v_proj.weight", lambda w: w.T.reshape(D, K, Dh)),
      "wo": ("self_attn.o_proj.weight", lambda w: w.T.reshape(H, Dh, D)),
      "mlp_norm": ("post_attention_layernorm.weight", lambda w: w),
      "w_gate": ("mlp.gate_proj.weight", lambda w: w.T),
      "w_up": ("mlp.up_proj.weight", lambda w: w.T),
      "w_down": ("mlp.down_proj.weight", lambda w: w.T),
  }
  if config.qkv_bias:
    per_layer["bq"] = ("self_attn.q_proj.bias", lambda b: b.reshape(H, Dh))
    per_layer["bk"] = ("self_attn.k_proj.bias", lambda b: b.reshape(K, Dh))
    per_layer["bv"] = ("self_attn.v_proj.bias", lambda b: b.reshape(K, Dh))

  params = {
      "embed": take("model.embed_tokens.weight"),
      "layers": {
          ours: np.stack([convert(take(f"model.layers.{i}.{theirs}"))
                          for i in range(config.n_layers)])
          for ours, (theirs, convert) in per_layer.items()},
      "final_norm": take("model.norm.weight"),
  }
  if config.tie_embeddings:
    tensors.pop("lm_head.weight", None)
  else:
    params["unembed"] = take("lm_head.weight").T
  unexpected = [k for k in tensors if not k.endswith(_IGNORED_SUFFIXES)]
  if unexpected:
    raise ValueError(f"checkpoint {path} has tensors this loader does not "
                     f"map (unsupported features?): {sorted(unexpected)[:5]}")
  dtype = config.params_dtype
  return config, jax.tree.map(lambda w: jnp.asarray(w, dtype), params)
