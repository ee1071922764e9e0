"""Hugging Face checkpoints in and out: Llama, Qwen2, Qwen3, Gemma, Gemma 2
and Gemma 3 (text).

:func:`load_hf_checkpoint` reads a checkpoint directory (``config.json``
plus ``*.safetensors``, sharded or not) with the ``safetensors`` numpy
loader, no torch; :func:`save_hf_checkpoint` writes one that
``transformers.AutoModelForCausalLM.from_pretrained`` loads;
:func:`params_from_tensors` maps tensors under HF names (a directory's, or a
GGUF file's from :mod:`agentic_rl.model.gguf`) to ours. One table
(:func:`_tensor_map`) names every tensor both ways. Our RoPE uses HF's
"rotate_half" convention, so q/k projection weights are used as stored.

HF ``nn.Linear`` weights are ``[out, in]``; ours are ``[in, ...out]``:
``q_proj [H*Dh, D] -> wq [D, H, Dh]``, ``o_proj [D, H*Dh] -> wo [H, Dh, D]``,
``gate/up_proj [F, D] -> [D, F]``, ``down_proj [D, F] -> [F, D]``,
``lm_head [V, D] -> unembed [D, V]``.

What each architecture adds to the Llama layer: Qwen2 q/k/v biases (and
optional sliding windows), Qwen3 RMSNorms on queries and keys (``qk_norm``),
Gemma the ``1 + w`` norms, embeddings scaled by ``sqrt(d_model)``, tanh-GELU
and tied embeddings. Gemma 2 adds sandwich norms (``post_norms``: HF's
``input_layernorm``, ``post_attention_layernorm``,
``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` are our
``attn_norm``, ``post_attn_norm``, ``mlp_norm`` and ``post_mlp_norm``; in
the other architectures ``post_attention_layernorm`` is ``mlp_norm``),
``query_pre_attn_scalar``, attention and final logit soft-capping and
sliding-window layers (``layer_types``, else every other layer from the
first). Gemma 3 (``Gemma3ForCausalLM``, ``model_type`` "gemma3_text") adds
q/k norms, one global layer per ``sliding_window_pattern`` (or
``layer_types``), a RoPE base of the sliding-window layers
(``rope_local_base_freq``, or ``rope_parameters["sliding_attention"]``) and
linear RoPE scaling on the global layers; it has no attention
soft-capping (transformers ignores ``attn_logit_softcapping`` there, and so
do we). Multimodal Gemma 3 checkpoints (``Gemma3ForConditionalGeneration``)
are refused: use the text model.
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
                "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM",
                "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPES.values())
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu"}
# Non-persistent buffers that some older checkpoints saved; not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_GEMMAS = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# transformers' defaults for keys a Gemma 2 / 3 config.json may leave out.
_GEMMA_DEFAULTS = {
    "Gemma2ForCausalLM": dict(head_dim=256, query_pre_attn_scalar=256,
                              sliding_window=4096, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0, rope_theta=10_000.0),
    "Gemma3ForCausalLM": dict(head_dim=256, query_pre_attn_scalar=256,
                              sliding_window=4096, final_logit_softcapping=None,
                              rope_theta=1_000_000.0,
                              rope_local_base_freq=10_000.0, sliding_window_pattern=6),
}


def _multimodal(hf: dict[str, Any]) -> bool:
  return (hf.get("model_type") == "gemma3"
          or "Gemma3ForConditionalGeneration" in (hf.get("architectures") or []))


def _architecture(hf: dict[str, Any]) -> str:
  if _multimodal(hf):
    raise ValueError(
        "multimodal Gemma 3 checkpoints (Gemma3ForConditionalGeneration, "
        "model_type 'gemma3') are not supported; use the text model "
        "(Gemma3ForCausalLM, model_type 'gemma3_text')")
  archs = hf.get("architectures") or [_MODEL_TYPES.get(hf.get("model_type"))]
  for arch in archs:
    if arch in SUPPORTED_ARCHITECTURES:
      return arch
  raise ValueError(
      f"unsupported architecture {archs} (model_type "
      f"{hf.get('model_type')!r}); supported: {SUPPORTED_ARCHITECTURES}")


def _rope_type(rope: dict[str, Any] | None) -> str:
  rope = rope or {}
  return rope.get("rope_type", rope.get("type", "default"))


def _gemma3_rope(hf: dict[str, Any]) -> dict[str, Any]:
  """``rope_theta``, ``local_rope_theta`` and ``rope_scaling_factor`` of a
  Gemma 3 config, read as transformers does: ``rope_parameters`` per layer
  type, else ``rope_theta`` / ``rope_local_base_freq``, with the old
  ``rope_scaling`` applied to the global (``full_attention``) layers."""
  defaults = _GEMMA_DEFAULTS["Gemma3ForCausalLM"]
  params = hf.get("rope_parameters") or {}
  unknown = set(params) - {"full_attention", "sliding_attention"}
  if unknown:
    raise ValueError("Gemma 3 rope_parameters must be keyed by layer type "
                     f"(full_attention, sliding_attention), got {sorted(unknown)}")
  full = dict(params.get("full_attention") or {})
  full.update(hf.get("rope_scaling") or {})
  full.setdefault("rope_theta", hf.get("rope_theta", defaults["rope_theta"]))
  local = dict(params.get("sliding_attention") or {})
  local.setdefault("rope_theta", hf.get("rope_local_base_freq",
                                        defaults["rope_local_base_freq"]))

  def factor(rope, layers):
    kind = _rope_type(rope)
    if kind not in ("default", "linear"):
      raise ValueError(f"RoPE scaling {kind!r} is not supported on Gemma 3's "
                       f"{layers} layers (only the default and linear RoPE)")
    return float(rope["factor"]) if kind == "linear" else 1.0

  theta, scale = float(full["rope_theta"]), factor(full, "full_attention")
  local_theta = float(local["rope_theta"])
  local_scale = factor(local, "sliding_attention")
  if (local_theta, local_scale) == (theta, scale):
    local_theta = None  # One RoPE for all layers.
  elif local_scale != 1.0:
    raise ValueError("Gemma 3 sliding-window layers with a linear RoPE scaling "
                     "of their own are not supported")
  return dict(rope_theta=theta, local_rope_theta=local_theta,
              rope_scaling_factor=scale)


def _gemma_windows(hf: dict[str, Any], arch: str, n_layers: int):
  """Per-layer windows of a Gemma 2 / 3 config: ``layer_types``, else every
  ``sliding_window_pattern``-th layer (2 for Gemma 2) global, counting from
  1; None when no layer has a window."""
  defaults = _GEMMA_DEFAULTS[arch]
  every = 2 if arch == "Gemma2ForCausalLM" else hf.get(
      "sliding_window_pattern", defaults["sliding_window_pattern"])
  layer_types = hf.get("layer_types") or [
      "sliding_attention" if (i + 1) % every else "full_attention"
      for i in range(n_layers)]
  if len(layer_types) != n_layers or not set(layer_types) <= {
      "sliding_attention", "full_attention"}:
    raise ValueError(f"layer_types must be {n_layers} of 'sliding_attention' / "
                     f"'full_attention', got {layer_types}")
  window = hf.get("sliding_window", defaults["sliding_window"])
  if window is None or "sliding_attention" not in layer_types:
    return None
  return tuple(window if t == "sliding_attention" else None for t in layer_types)


def config_from_hf(hf: dict[str, Any], **overrides) -> TransformerConfig:
  """Our config from an HF ``config.json`` dict.

  ``overrides`` replace fields of the result (e.g. ``dtype="bfloat16"``).
  Raises ``ValueError`` for unsupported architectures or features (RoPE
  scaling other than Gemma 3's linear one, Llama attention/MLP biases, other
  activations, multimodal Gemma 3, bidirectional attention). Keys a Gemma 2
  / 3 config leaves out take transformers' defaults.
  """
  arch = _architecture(hf)
  gemma = arch in _GEMMAS
  defaults = _GEMMA_DEFAULTS.get(arch, {})
  rope_params = hf.get("rope_parameters") or {}
  if arch == "Gemma3ForCausalLM":
    rope = _gemma3_rope(hf)
  else:
    rope = dict(rope_theta=float(rope_params.get(
        "rope_theta", hf.get("rope_theta", defaults.get("rope_theta", 10_000.0)))))
    for params in (rope_params, hf.get("rope_scaling") or {}):
      rope_type = _rope_type(params)
      if rope_type == "llama3" and arch == "LlamaForCausalLM":
        rope["rope_llama3"] = (float(params["factor"]), float(params["low_freq_factor"]),
                               float(params["high_freq_factor"]),
                               int(params["original_max_position_embeddings"]))
      elif rope_type != "default":
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported "
                         "(only the default RoPE; llama3 on Llama, linear on Gemma 3)")
  act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
  if act not in _ACTIVATIONS:
    raise ValueError(f"hidden_act {act!r} is not supported; "
                     f"supported: {tuple(_ACTIVATIONS)}")
  if arch != "Qwen2ForCausalLM":
    for flag in ("attention_bias", "mlp_bias"):
      if hf.get(flag):
        raise ValueError(f"{arch} checkpoints with {flag}=True are not supported")
  if hf.get("use_bidirectional_attention"):
    raise ValueError("bidirectional attention (use_bidirectional_attention) "
                     "is not supported: the policy is causal")
  n_layers = hf["num_hidden_layers"]
  windows = None
  if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and hf.get("use_sliding_window"):
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf["max_window_layers"] else
        "full_attention" for i in range(n_layers)]
    windows = tuple(hf["sliding_window"] if t == "sliding_attention" else None
                    for t in layer_types)
  elif arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
    windows = _gemma_windows(hf, arch, n_layers)
  n_heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or defaults.get("head_dim") or hf["hidden_size"] // n_heads
  gemma23 = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
  query_pre_attn_scalar = None
  if gemma23:
    query_pre_attn_scalar = hf.get("query_pre_attn_scalar",
                                   defaults["query_pre_attn_scalar"])
    if query_pre_attn_scalar == head_dim:
      query_pre_attn_scalar = None
  # transformers' Gemma 3 attention takes no soft-cap.
  attn_softcap = (hf.get("attn_logit_softcapping", defaults["attn_logit_softcapping"])
                  if arch == "Gemma2ForCausalLM" else None)
  final_softcap = (hf.get("final_logit_softcapping", defaults["final_logit_softcapping"])
                   if gemma23 else None)
  fields = dict(
      vocab_size=hf["vocab_size"],
      d_model=hf["hidden_size"],
      n_layers=n_layers,
      n_heads=n_heads,
      n_kv_heads=hf.get("num_key_value_heads") or n_heads,
      head_dim=head_dim,
      mlp_dim=hf["intermediate_size"],
      mlp_activation=_ACTIVATIONS[act],
      norm_eps=hf.get("rms_norm_eps", 1e-6),
      norm_plus_one=gemma,
      embed_scale=gemma,
      **rope,
      query_pre_attn_scalar=query_pre_attn_scalar,
      qkv_bias=arch == "Qwen2ForCausalLM",
      qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
      post_norms=gemma23,
      tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
      attn_logit_softcap=attn_softcap,
      final_logit_softcap=final_softcap,
      sliding_windows=windows,
  )
  return TransformerConfig(**{**fields, **overrides}).validate()


def architecture_of(config: TransformerConfig) -> str:
  """The HF architecture that expresses ``config``; ValueError if none does."""
  gemma = (config.norm_plus_one, config.embed_scale, config.mlp_activation == "gelu")
  if any(gemma):
    if not all(gemma) or config.qkv_bias:
      raise ValueError("a Gemma checkpoint has 1 + w norms, scaled embeddings and tanh-GELU "
                       "together, without q/k/v biases")
    if config.post_norms:
      arch = "Gemma3ForCausalLM" if config.qk_norm else "Gemma2ForCausalLM"
    elif config.qk_norm:
      raise ValueError("a Gemma checkpoint with q/k norms is Gemma 3, which also has "
                       "post_norms")
    else:
      arch = "GemmaForCausalLM"
  elif config.post_norms:
    raise ValueError("post_norms (sandwich norms) are Gemma 2 / 3's, with 1 + w norms, "
                     "scaled embeddings and tanh-GELU")
  elif config.qkv_bias and config.qk_norm:
    raise ValueError("no supported architecture has both q/k/v biases and q/k norms")
  elif config.qkv_bias:
    arch = "Qwen2ForCausalLM"
  elif config.qk_norm:
    arch = "Qwen3ForCausalLM"
  else:
    arch = "LlamaForCausalLM"
  gemma23 = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
  if config.query_scale is not None and not gemma23:
    raise ValueError(f"{arch} has no query_pre_attn_scalar (Gemma 2 / 3 have)")
  if config.attn_logit_softcap is not None and arch != "Gemma2ForCausalLM":
    raise ValueError("attention logit soft-capping is exported as Gemma 2 only "
                     f"(not {arch})")
  if config.final_logit_softcap is not None and not gemma23:
    raise ValueError(f"final logit soft-capping is exported as Gemma 2 / 3 only (not {arch})")
  if arch != "Gemma3ForCausalLM" and (config.has_local_rope
                                      or config.rope_scaling_factor != 1.0):
    raise ValueError("a local RoPE base and linear RoPE scaling are exported as "
                     f"Gemma 3 only (not {arch})")
  if config.rope_llama3 is not None and arch != "LlamaForCausalLM":
    raise ValueError(f"Llama 3.1's RoPE scaling is exported as Llama only (not {arch})")
  if config.sliding_windows is not None and arch not in (
      "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"):
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
  if config.rope_llama3 is not None:
    factor, low, high, context = config.rope_llama3
    hf["rope_parameters"] = hf["rope_scaling"] = dict(
        rope_type="llama3", rope_theta=config.rope_theta, factor=factor, low_freq_factor=low,
        high_freq_factor=high, original_max_position_embeddings=context)
  act = {v: k for k, v in _ACTIVATIONS.items()}[config.mlp_activation]
  hf["hidden_activation" if arch in _GEMMAS else "hidden_act"] = act
  windows = [w for w in config.sliding_windows or () if w is not None]
  if len(set(windows)) > 1:
    raise ValueError("HF checkpoints have one sliding window size")
  layer_types = ["full_attention" if w is None else "sliding_attention"
                 for w in config.sliding_windows or (None,) * config.n_layers]
  if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
    hf.update(query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
              final_logit_softcapping=config.final_logit_softcap,
              attn_logit_softcapping=config.attn_logit_softcap,
              sliding_window=windows[0] if windows else 4096,
              layer_types=layer_types)
  elif config.sliding_windows is not None:
    hf.update(use_sliding_window=True, sliding_window=windows[0], max_window_layers=0,
              layer_types=layer_types)
  if arch == "Gemma3ForCausalLM":
    full = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling_factor != 1.0:
      full.update(rope_type="linear", factor=config.rope_scaling_factor)
    local = ({"rope_type": "default", "rope_theta": config.local_rope_theta}
             if config.has_local_rope else dict(full))
    del hf["rope_theta"]
    hf["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
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
  if config.post_norms:  # Gemma 2 / 3: post_attention_layernorm is a post-norm.
    table["post_attn_norm"] = ("post_attention_layernorm.weight", same, same)
    table["mlp_norm"] = ("pre_feedforward_layernorm.weight", same, same)
    table["post_mlp_norm"] = ("post_feedforward_layernorm.weight", same, same)
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


def read_config(path: str) -> dict[str, Any]:
  """The ``config.json`` dict of the checkpoint directory ``path``."""
  config_path = os.path.join(path, "config.json")
  if not os.path.exists(config_path):
    raise ValueError(f"no config.json in {path}")
  with open(config_path) as f:
    return json.load(f)


def load_hf_checkpoint(path: str, **overrides):
  """Load an HF checkpoint directory; returns ``(config, params)``.

  ``overrides`` go to :func:`config_from_hf`; params are converted to the
  config's ``param_dtype``. Missing or unexpected tensors raise
  ``ValueError``.
  """
  config = config_from_hf(read_config(path), **overrides)
  return config, jax.tree.map(jnp.asarray, load_hf_params(path, config))


def load_hf_params(path: str, config: TransformerConfig):
  """The parameters of the checkpoint directory ``path`` as host (numpy)
  arrays in ``config.param_dtype``, in :func:`init_params`' layout, for
  ``config`` (from :func:`config_from_hf`, possibly with other runtime
  fields): placed on devices by the caller, e.g. sharded over a mesh.
  Missing or unexpected tensors raise ``ValueError``."""
  return params_from_tensors(_read_tensors(path), config, path)


def params_from_tensors(tensors: dict[str, np.ndarray], config: TransformerConfig,
                        source: str = "the checkpoint"):
  """Our parameters (host arrays in ``config.param_dtype``) of ``tensors``
  under Hugging Face names; ``source`` names them in errors. Missing or
  unexpected tensors raise ``ValueError``."""
  tensors = dict(tensors)
  path = source

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
  return jax.tree.map(lambda w: np.asarray(w, dtype), params)


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
