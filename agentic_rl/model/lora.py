"""LoRA: low-rank adapters on the policy's projections (Hu et al. 2021).

With ``config.lora_rank = r > 0`` every targeted projection ``W`` (of
``config.lora_targets``; ``[in..., out...]``) carries two adapters in the
params tree, per layer::

  layers/lora_<w>_a [L, in..., r]     A ~ N(0, 1 / fan_in)
  layers/lora_<w>_b [L, r, out...]    B = 0

and computes ``W x + (alpha / r) B(A x)`` (``transformer._project``), so the
rollout engine, the learner's scoring, evaluation and the KV-cache decode
all run the adapted model through the one model path. The trainer freezes
the base (it gets no gradient, the optimiser holds state for the adapters
only: :func:`freeze_base`) and checkpoints only the adapters
(:func:`adapters`); :func:`merge` folds them into the base for export.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from agentic_rl.model.config import TransformerConfig
from agentic_rl.model.transformer import Params, init_adapters, is_adapter_name


def adapter_mask(params: Params) -> Any:
  """``params``' tree of bools: True on the LoRA adapters (``layers/lora_*``)."""
  def mask(path, _):
    return any(is_adapter_name(str(getattr(k, "key", ""))) for k in path)
  return jax.tree_util.tree_map_with_path(mask, params)


def has_adapters(params: Params) -> bool:
  return any(jax.tree.leaves(adapter_mask(params)))


def adapters(params: Params) -> Params:
  """Only the adapters: ``{"layers": {lora_<w>_a, lora_<w>_b, ...}}``."""
  return {"layers": {k: v for k, v in params["layers"].items() if is_adapter_name(k)}}


def base(params: Params) -> Params:
  """``params`` without the adapters."""
  return {**params, "layers": {k: v for k, v in params["layers"].items()
                               if not is_adapter_name(k)}}


def with_adapters(base_params: Params, adapter_params: Params) -> Params:
  """The base (any adapters in it replaced) with ``adapter_params``' adapters
  (:func:`adapters`' layout)."""
  layers = {**base(base_params)["layers"], **adapter_params["layers"]}
  return {**base_params, "layers": layers}


def add_adapters(params: Params, config: TransformerConfig, key: jax.Array) -> Params:
  """A base params tree (``config`` without LoRA's, e.g. a pretrained
  checkpoint) with fresh adapters for ``config`` (``B = 0``: the same
  model)."""
  if not config.lora_rank:
    raise ValueError("add_adapters needs config.lora_rank > 0")
  return with_adapters(params, init_adapters(config, key))


def merge(params: Params, config: TransformerConfig) -> tuple[TransformerConfig, Params]:
  """Folds the adapters into the base weights: ``(config without LoRA,
  params)`` with ``W' = W + (alpha / r) A @ B`` for each targeted ``W``
  (contracting the rank axis, fp32, stored in ``param_dtype``). The merged
  model equals the adapted one up to float rounding."""
  if not config.lora_rank:
    return config, params
  layers, scale = dict(base(params)["layers"]), config.lora_scale
  for name in config.lora_targets:
    a = params["layers"][f"lora_{name}_a"].astype(jnp.float32)  # [L, in..., r]
    b = params["layers"][f"lora_{name}_b"].astype(jnp.float32)  # [L, r, out...]
    w = layers[name]
    delta = jnp.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]),
                       b.reshape(b.shape[0], b.shape[1], -1),
                       precision=jax.lax.Precision.HIGHEST).reshape(w.shape)
    layers[name] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
  merged = dataclasses.replace(config, lora_rank=0)
  return merged, {**params, "layers": layers}


def freeze_base(optimizer: optax.GradientTransformation,
                params: Params) -> optax.GradientTransformation:
  """``optimizer`` on the adapters of ``params`` only (``optax.masked``):
  its state has no leaves for the base, whose updates it does not compute
  (the train step leaves the base as it is: ``learner.make_train_step``)."""
  return optax.masked(optimizer, adapter_mask(params))
