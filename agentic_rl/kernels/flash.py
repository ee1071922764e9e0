"""``flash_attention``: the entry point, its checks and its ``custom_vjp``.

:func:`flash_attention` dispatches on ``impl``: ``"xla"``
(:func:`agentic_rl.kernels.reference.attention`), ``"cudnn"`` (GPU, through
``jax.nn.dot_product_attention``) or ``"pallas"``, whose kernel family is
the platform's or ``backend=``'s:

* ``"triton"`` (GPU): :mod:`agentic_rl.kernels.triton.flash`, with either
  side replaceable by the Hopper kernels of
  :mod:`agentic_rl.kernels.hopper.flash`
  (``AttentionBlockSizes(fwd="mosaic_gpu", bwd="mosaic_gpu")``);
* ``"mosaic_tpu"`` (TPU): :mod:`agentic_rl.kernels.tpu.flash`.

Every family computes the same FlashAttention-2 forward (Dao, 2023,
arXiv:2307.08691) with a base-2 log-sum-exp ``lse`` and takes the same
residuals back, so the one ``custom_vjp`` here serves all of them: the
forward saves ``(q, k, v, out, lse)``, the backward computes ``delta =
rowsum(O * dO)`` (:func:`row_delta`) and calls the family's dQ and dK/dV
kernels. Masking follows :func:`agentic_rl.kernels.reference.attention`.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp

from agentic_rl.kernels import _common
from agentic_rl.kernels import reference
from agentic_rl.kernels.hopper import flash as hopper_flash
from agentic_rl.kernels.tpu import flash as tpu_flash
from agentic_rl.kernels.tpu.flash import TpuAttentionBlockSizes
from agentic_rl.kernels.triton import flash as triton_flash
from agentic_rl.kernels.triton.flash import AttentionBlockSizes

__all__ = ["AttentionBlockSizes", "TpuAttentionBlockSizes", "flash_attention",
           "row_delta"]


# --------------------------------------------------------------------------
# GPU forward and backward on [B, T, H, D] operands: the Triton kernels, or
# the Hopper (Mosaic GPU) ones for a side that selects them.


def _gpu_forward(cfg: triton_flash.Config, q, k, v, segment_ids, window):
  if cfg.mosaic_fwd is not None:  # lse padded as the Triton backward reads it
    out, lse = hopper_flash.forward(cfg.mosaic_fwd, q, k, v)
    return out, _common.pad_axis(lse, 2, cfg.Tp)
  return triton_flash.forward(cfg, q, k, v, segment_ids, window)


def _gpu_backward(cfg: triton_flash.Config, q, k, v, d_out, lse, delta_BxHxT,
                  segment_ids, window):
  if cfg.mosaic_bwd is not None:
    return hopper_flash.backward(cfg.mosaic_bwd, q, k, v, d_out, lse,
                                 delta_BxHxT)
  return triton_flash.backward(cfg, q, k, v, d_out, lse, delta_BxHxT,
                               segment_ids, window)


# --------------------------------------------------------------------------
# The custom_vjp, for either kernel family (chosen by the config's type).


def _family(cfg):
  """``(forward, backward)`` of the kernel family ``cfg`` configures."""
  if isinstance(cfg, tpu_flash.Config):
    return tpu_flash.forward, tpu_flash.backward
  return _gpu_forward, _gpu_backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, segment_ids, window):
  return _family(cfg)[0](cfg, q, k, v, segment_ids, window)[0]


def _flash_fwd(cfg, q, k, v, segment_ids, window):
  out, lse = _family(cfg)[0](cfg, q, k, v, segment_ids, window)
  return out, (q, k, v, segment_ids, window, out, lse)


def row_delta(out_BxTxHxD, d_out_BxTxHxD):
  """``delta = rowsum(O * dO)``, fp32 ``[B, H, T]``: the backward kernels'
  per-row term of ``dS = P * (dP - delta)``."""
  return jnp.einsum("bthd,bthd->bht", out_BxTxHxD.astype(jnp.float32),
                    d_out_BxTxHxD.astype(jnp.float32))


def _flash_bwd(cfg, res, d_out):
  """:func:`row_delta`, then the family's dQ and dK/dV kernels."""
  q, k, v, segment_ids, window, out, lse = res
  d_out = d_out.astype(q.dtype)
  delta = row_delta(out, d_out)
  grads = _family(cfg)[1](cfg, q, k, v, d_out, lse, delta, segment_ids,
                          window)
  return (*grads, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


# --------------------------------------------------------------------------
# Public entry point.

IMPLS = ("xla", "pallas", "cudnn")


def _validate(q, k, v, segment_ids):
  op = "flash_attention"
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{op}: {name} must be [batch, time, heads, head_dim], "
                       f"got shape {x.shape}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"{op}: q must be floating point, got {q.dtype}")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(f"{op}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, "
                     f"{v.dtype}")
  if k.shape != v.shape:
    raise ValueError(f"{op}: k {k.shape} and v {v.shape} shapes differ")
  B, T, H, D = q.shape
  if k.shape[0] != B or k.shape[3] != D:
    raise ValueError(f"{op}: q {q.shape} and k {k.shape} disagree on batch "
                     f"or head_dim")
  if H % k.shape[2]:
    raise ValueError(f"{op}: query heads {H} must be a multiple of key/value "
                     f"heads {k.shape[2]}")
  if min(q.shape) == 0 or min(k.shape) == 0:
    raise ValueError(f"{op}: empty input: q {q.shape}, k {k.shape}")
  if segment_ids is not None:
    if segment_ids.shape != (B, T):
      raise ValueError(f"{op}: segment_ids must have shape {(B, T)}, got "
                       f"{segment_ids.shape}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"{op}: segment_ids must be integers, got "
                       f"{segment_ids.dtype}")
    if k.shape[1] != T:
      raise ValueError(f"{op}: segment_ids need equal query and key lengths, "
                       f"got {T} and {k.shape[1]}")


def _cudnn(q, k, v, *, causal, segment_ids, window, softcap):
  op = "flash_attention(impl='cudnn')"
  if (platform := _common.target_platform()) not in ("gpu", "cuda"):
    raise ValueError(f"{op} needs a GPU; the platform is {platform!r}")
  if q.dtype not in (jnp.float16, jnp.bfloat16):
    raise ValueError(f"{op} needs float16 or bfloat16 inputs, got {q.dtype}")
  if softcap is not None:
    raise ValueError(f"{op} does not support softcap")
  local = None
  if window is not None:
    if not isinstance(window, int):
      raise ValueError(f"{op} needs a static int sliding_window")
    if not causal:
      raise ValueError(f"{op} supports sliding_window only with causal=True")
    local = (window - 1, 0)
  mask = None
  if segment_ids is not None:
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
  return jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=causal, local_window_size=local,
      implementation="cudnn")


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    sliding_window: int | jax.Array | None = None,
    softcap: float | None = None,
    impl: str = "pallas",
    block_sizes: AttentionBlockSizes | TpuAttentionBlockSizes | None = None,
    backend: str | None = None,
) -> jax.Array:
  """Multi-head attention ``softmax(q k^T / sqrt(D)) v``, differentiable.

  Args:
    q: ``[B, T, H, D]`` queries. k, v: ``[B, S, K, D]`` with ``H % K == 0``
      (GQA/MQA), same floating dtype as q.
    causal: query ``t`` sees keys ``s <= t`` (positions are ``arange``).
    segment_ids: optional int ``[B, T]`` (needs ``S == T``); tokens attend
      only within their segment (packed or padded sequences).
    sliding_window: optional window ``w``: query ``t`` sees keys with
      ``t - s < w``. A Python int >= 1 or an int32 scalar array (may be
      traced; ``reference.NO_WINDOW`` is global attention).
    softcap: optional ``c > 0``: logits become ``c * tanh(logits / c)``.
    impl: ``"pallas"`` (the kernels of ``backend``), ``"xla"``
      (:func:`reference.attention`) or ``"cudnn"`` (GPU only, through
      ``jax.nn.dot_product_attention``; no softcap, static causal window).
    block_sizes: Pallas tiles: :class:`AttentionBlockSizes` for Triton,
      :class:`TpuAttentionBlockSizes` for Mosaic; None for the defaults.
    backend: Pallas kernels, ``"triton"`` or ``"mosaic_tpu"``; None picks the
      platform's (Triton on GPU and CPU, Mosaic on TPU). On CPU both run
      interpreted.

  Returns:
    ``[B, T, H, D]`` in q's dtype; rows that see no key are zero.
  """
  _common.check_impl("flash_attention", impl, IMPLS)
  _validate(q, k, v, segment_ids)
  softcap = _common.static_positive_float("flash_attention", "softcap", softcap)
  window = _common.window_operand("flash_attention", sliding_window)
  if impl == "xla":
    return reference.attention(q, k, v, causal=causal, segment_ids=segment_ids,
                               sliding_window=sliding_window, softcap=softcap)
  if impl == "cudnn":
    return _cudnn(q, k, v, causal=causal, segment_ids=segment_ids,
                  window=sliding_window, softcap=softcap)
  family, interpret = _common.pallas_backend("flash_attention", backend)
  if segment_ids is not None:
    segment_ids = segment_ids.astype(jnp.int32)
  config = dict(causal=bool(causal), softcap=softcap,
                has_segments=segment_ids is not None,
                has_window=window is not None, interpret=interpret)
  if family == "mosaic_tpu":
    blocks = _common.block_sizes_for("flash_attention", family, block_sizes,
                                     TpuAttentionBlockSizes)
    cfg = tpu_flash.make_config(q.shape, k.shape, blocks=blocks, **config)
    return _flash(cfg, q, k, v, segment_ids, window)
  blocks = _common.block_sizes_for("flash_attention", family, block_sizes,
                                   AttentionBlockSizes)
  cfg = triton_flash.make_config(q.shape, k.shape, blocks=blocks, **config)
  mosaic = functools.partial(
      _mosaic_config, q, k, blocks, causal=bool(causal),
      segment_ids=segment_ids, sliding_window=sliding_window, softcap=softcap,
      interpret=interpret)
  cfg = dataclasses.replace(cfg, mosaic_fwd=mosaic("fwd"),
                            mosaic_bwd=mosaic("bwd"))
  return _flash(cfg, q, k, v, segment_ids, window)


# AttentionBlockSizes' Mosaic GPU fields, per side.
_MGPU_FIELDS = {
    "fwd": ("block_q_fwd_mgpu", "block_k_fwd_mgpu", "stages_fwd_mgpu",
            "warpgroups_fwd_mgpu"),
    "bwd": ("block_q_mgpu", "block_k_mgpu", "stages_mgpu", "warpgroups_mgpu"),
}


def _mosaic_config(q, k, blocks: AttentionBlockSizes, side: str, *, causal,
                   segment_ids, sliding_window, softcap, interpret):
  """The :mod:`hopper.flash` config of ``side`` ("fwd" or "bwd") when
  ``blocks`` selects ``"mosaic_gpu"`` for it (None for ``"triton"``), or a
  clear error for a case it does not cover."""
  kind = getattr(blocks, side)
  if kind == "triton":
    return None
  op = (f"flash_attention(block_sizes=AttentionBlockSizes("
        f"{side}='mosaic_gpu'))")
  if kind != "mosaic_gpu":
    raise ValueError(f"flash_attention: AttentionBlockSizes.{side} must be "
                     f"'triton' or 'mosaic_gpu', got {kind!r}")
  if sliding_window is not None:
    if not isinstance(sliding_window, numbers.Integral):
      raise ValueError(f"{op} needs a static int sliding_window, got "
                       f"{type(sliding_window).__name__}")
    sliding_window = int(sliding_window)
  bq, bk, stages, warpgroups = (getattr(blocks, f) for f in _MGPU_FIELDS[side])
  fused_dq = side == "bwd" and blocks.fused_dq_mgpu
  for name, value in zip(_MGPU_FIELDS[side][2:], (stages, warpgroups)):
    if value < 1:
      raise ValueError(f"{op}: {name} must be >= 1, got {value}")
  reason = hopper_flash.unsupported(
      q.shape, k.shape, q.dtype, has_segments=segment_ids is not None,
      softcap=softcap, bq=bq, bk=bk, warpgroups=warpgroups, fused_dq=fused_dq)
  if reason:
    raise ValueError(f"{op} {reason}; {side}='triton' covers every case")
  if interpret and not hopper_flash.CAN_INTERPRET:
    raise ValueError(f"{op} runs off a GPU only in Pallas' GPU interpreter, "
                     f"which needs jax >= 0.11 (this is {jax.__version__})")
  return hopper_flash.make_config(
      q.shape, k.shape, causal=causal, window=sliding_window, bq=bq, bk=bk,
      stages=stages, warpgroups=warpgroups, interpret=interpret,
      longest_first=blocks.longest_first_mgpu,
      pingpong=side == "fwd" and blocks.pingpong_fwd_mgpu,
      register_operands=blocks.register_operands_mgpu, fused_dq=fused_dq)
