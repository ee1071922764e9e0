"""Hugging Face checkpoints in and out: Llama, Qwen2, Qwen3 and Gemma.

:func:`load_hf_checkpoint` reads a checkpoint directory (``config.json``
plus ``*.safetensors``, sharded or not) with the ``safetensors`` numpy
loader, no torch; :func:`save_hf_checkpoint` writes one that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. One table
(:func:`_tensor_map`) names every tensor both ways. Our RoPE uses HF's
"rotate_half" convention, so q/k projection weights are used as stored.

HF ``nn.Linear`` weights are ``[out, in]``; ours are ``[in, ...out]``:
``q_proj [H*Dh, D] -> wq [D, H, Dh]``, ``o_proj [D, H*Dh] -> wo [H, Dh, D]``,
``gate/up_proj [F, D] -> [D, F]``, ``down_proj [D, F] -> [F, D]``,
``lm_head [V, D] -> unembed [D, V]``.

What each architecture adds to the Llama layer: Qwen2 q/k/v biases (and
optional sliding windows), Qwen3 RMSNorms on queries and keys (``qk_norm``),
Gemma the ``1 + w`` norms, embeddings scaled by ``sqrt(d_model)``, tanh-GELU
and tied embeddings. Gemma 2 and 3 (post-attention and post-MLP norms,
``query_pre_attn_scalar``, per-layer RoPE bases) are not supported yet.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from agentic_rl.model.config import TransformerConfig

_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPES.values())
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
  """Our config from an HF ``config.json`` dict.

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
  gemma = arch == "GemmaForCausalLM"
  act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
  if act not in _ACTIVATIONS:
    raise ValueError(f"hidden_act {act!r} is not supported; "
                     f"supported: {tuple(_ACTIVATIONS)}")
  if arch != "Qwen2ForCausalLM":
    for flag in ("attention_bias", "mlp_bias"):
      if hf.get(flag):
        raise ValueError(f"{arch} checkpoints with {flag}=True are not supported")
  n_layers = hf["num_hidden_layers"]
  windows = None
  if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and hf.get("use_sliding_window"):
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
      norm_plus_one=gemma,
      embed_scale=gemma,
      rope_theta=float(rope_params.get("rope_theta",
                                       hf.get("rope_theta", 10_000.0))),
      qkv_bias=arch == "Qwen2ForCausalLM",
      qk_norm=arch == "Qwen3ForCausalLM",
      tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
      sliding_windows=windows,
  )
  return TransformerConfig(**{**fields, **overrides}).validate()


def architecture_of(config: TransformerConfig) -> str:
  """The HF architecture that expresses ``config``; ValueError if none does."""
  gemma = (config.norm_plus_one, config.embed_scale, config.mlp_activation == "gelu")
  if any(gemma):
    if not all(gemma) or config.qkv_bias or config.qk_norm:
      raise ValueError("a Gemma checkpoint has 1 + w norms, scaled embeddings and tanh-GELU "
                       "together, without q/k/v biases or q/k norms")
    arch = "GemmaForCausalLM"
  elif config.qkv_bias and config.qk_norm:
    raise ValueError("no supported architecture has both q/k/v biases and q/k norms")
  elif config.qkv_bias:
    arch = "Qwen2ForCausalLM"
  elif config.qk_norm:
    arch = "Qwen3ForCausalLM"
  else:
    arch = "LlamaForCausalLM"
  if config.attn_logit_softcap is not None or config.final_logit_softcap is not None:
    raise ValueError("logit soft-capping (Gemma 2) cannot be exported yet")
  if config.sliding_windows is not None and arch not in ("Qwen2ForCausalLM",
                                                         "Qwen3ForCausalLM"):
    raise ValueError(f"{arch} has no sliding windows")
  return arch


def config_to_hf(config: TransformerConfig) -> dict[str, Any]:
  """The ``config.json`` of ``config`` (see :func:`architecture_of`)."""
  arch = architecture_of(config)
  model_type = {v: k for k, v in _MODEL_TYPES.items()}[arch]
  hf = dict(
      architectures=[arch], model_type=model_type, vocab_size=config.vocab_size,
      hidden_size=config.d_model, num_hidden_layers=config.n_layers,
      num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
      head_dim=config.head_dim, intermediate_size=config.mlp_dim,
      rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings,
      rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
      rope_theta=config.rope_theta, attention_bias=False, torch_dtype="float32")
  act = {v: k for k, v in _ACTIVATIONS.items()}[config.mlp_activation]
  hf["hidden_activation" if arch == "GemmaForCausalLM" else "hidden_act"] = act
  if config.sliding_windows is not None:
    windows = [w for w in config.sliding_windows if w is not None]
    if len(set(windows)) > 1:
      raise ValueError("HF checkpoints have one sliding window size")
    hf.update(use_sliding_window=True, sliding_window=windows[0], max_window_layers=0,
              layer_types=["full_attention" if w is None else "sliding_attention"
                           for w in config.sliding_windows])
  return hf


def _tensor_map(config: TransformerConfig) -> dict[str, tuple[str, Any, Any]]:
  """Our per-layer parameter -> (HF name in layer i, HF -> ours, ours -> HF)."""
  D, H, K, Dh = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim
  same = lambda w: w  # noqa: E731
  table = {
      "attn_norm": ("input_layernorm.weight", same, same),
      "wq": ("self_attn.q_proj.weight", lambda w: w.T.reshape(D, H, Dh),
             lambda w: w.reshape(D, H * Dh).T),
      "wk": ("self_attn.k_proj.weight", lambda w: w.T.reshape(D, K, Dh),
             lambda w: w.reshape(D, K * Dh).T),
      "wv": ("self_attn.v_proj.weight", lambda w: w.T.reshape(D, K, Dh),
             lambda w: w.reshape(D, K * Dh).T),
      "wo": ("self_attn.o_proj.weight", lambda w: w.T.reshape(H, Dh, D),
             lambda w: w.reshape(H * Dh, D).T),
      "mlp_norm": ("post_attention_layernorm.weight", same, same),
      "w_gate": ("mlp.gate_proj.weight", lambda w: w.T, lambda w: w.T),
      "w_up": ("mlp.up_proj.weight", lambda w: w.T, lambda w: w.T),
      "w_down": ("mlp.down_proj.weight", lambda w: w.T, lambda w: w.T),
  }
  if config.qkv_bias:
    table["bq"] = ("self_attn.q_proj.bias", lambda b: b.reshape(H, Dh), lambda b: b.reshape(-1))
    table["bk"] = ("self_attn.k_proj.bias", lambda b: b.reshape(K, Dh), lambda b: b.reshape(-1))
    table["bv"] = ("self_attn.v_proj.bias", lambda b: b.reshape(K, Dh), lambda b: b.reshape(-1))
  if config.qk_norm:
    table["q_norm"] = ("self_attn.q_norm.weight", same, same)
    table["k_norm"] = ("self_attn.k_norm.weight", same, same)
  return table


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

  def take(name: str) -> np.ndarray:
    if name not in tensors:
      raise ValueError(f"checkpoint {path} has no tensor {name!r}")
    return tensors.pop(name)

  params = {
      "embed": take("model.embed_tokens.weight"),
      "layers": {
          ours: np.stack([to_ours(take(f"model.layers.{i}.{theirs}"))
                          for i in range(config.n_layers)])
          for ours, (theirs, to_ours, _) in _tensor_map(config).items()},
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


def save_hf_checkpoint(path: str, config: TransformerConfig, params) -> None:
  """Writes ``config.json`` and ``model.safetensors`` (the parameters in
  float32, which holds bfloat16 ones exactly) to the directory ``path``,
  for the architecture :func:`architecture_of` picks; ValueError if none
  expresses ``config``, or for LoRA adapters (``lora.merge`` them first)."""
  if config.lora_rank:
    raise ValueError("save_hf_checkpoint writes plain weights: fold the LoRA adapters in "
                     "first, config, params = agentic_rl.model.lora.merge(params, config)")
  hf = config_to_hf(config)
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(params))
  if "layers" not in params:  # unstacked (a list of layers)
    raise ValueError("save_hf_checkpoint takes the stacked parameters (init_params' layout)")
  tensors = {"model.embed_tokens.weight": params["embed"],
             "model.norm.weight": params["final_norm"]}
  for ours, (theirs, _, to_hf) in _tensor_map(config).items():
    for i in range(config.n_layers):
      tensors[f"model.layers.{i}.{theirs}"] = to_hf(params["layers"][ours][i])
  if not config.tie_embeddings:
    tensors["lm_head.weight"] = params["unembed"].T
  os.makedirs(path, exist_ok=True)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
            os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=1)
