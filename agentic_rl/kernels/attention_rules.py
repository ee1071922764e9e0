"""Masking and block-skipping rules shared by the attention kernels.

One statement of which (query, key) pairs are visible and which tiles a
kernel may skip, used by the Triton kernels (:mod:`triton.flash`), the
Mosaic TPU kernels (:mod:`tpu.flash`) and the Hopper kernels
(:mod:`hopper.flash`); :func:`reference.attention` is the specification
they are tested against. ``cfg`` is either kernel family's
config: it needs ``causal``, ``softcap``, ``scale``, ``has_segments``,
``has_window``, ``T``, ``S`` (true lengths) and ``Sp`` (padded key length).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from agentic_rl.kernels import _common


def logits(cfg, q, k, *, base2=False):
  """Scaled (and soft-capped) logits ``[bq, bk]`` fp32, and tanh or None.

  ``base2``: the logits times ``log2(e)``, for a softmax taken with ``exp2``
  (the same probabilities; see :func:`_common.online_softmax_step`)."""
  unit = _common.LOG2E if base2 else 1.0
  if cfg.softcap is None:
    return _common.dot_nt(q, k) * (cfg.scale * unit), None
  t = jnp.tanh(_common.dot_nt(q, k) * (cfg.scale / cfg.softcap))
  return (cfg.softcap * unit) * t, t


def visible(cfg, qp, kp, q_seg, k_seg, window, shape):
  """Boolean ``shape`` (``[bq, bk]``) visibility, or None when everything is
  visible. Query positions and segment ids are ``[bq, 1]`` (or ``[bq, bk]``),
  key ones ``[1, bk]``; this is the one statement of the masking rules for
  the Triton and Mosaic kernels."""
  mask = None

  def conj(m, c):
    return c if m is None else m & c

  if cfg.causal:
    mask = conj(mask, kp <= qp)
  if window is not None:
    mask = conj(mask, qp - kp < window)
  if q_seg is not None:
    mask = conj(mask, q_seg == k_seg)
  if cfg.Sp > cfg.S:  # zero-padded keys
    mask = conj(mask, kp < cfg.S)
  if mask is not None:
    mask = jnp.broadcast_to(mask, shape)
  return mask


def key_blocks(cfg, q_start, bq, bk, window):
  """Half-open range of key blocks that queries [q_start, q_start+bq) see."""
  hi = pl.cdiv(cfg.S, bk)
  if cfg.causal:
    hi = jnp.minimum(hi, lax.div(q_start + bq + bk - 1, bk))
  lo = 0
  if window is not None:
    lo = lax.div(jnp.maximum(q_start - window + 1, 0), bk)
  return lo, hi


def query_blocks(cfg, k_start, bk, bq, window):
  """Half-open range of query blocks that see keys [k_start, k_start+bk)."""
  hi = pl.cdiv(cfg.T, bq)
  if window is not None:  # t - s < window  =>  t <= k_last + window - 1
    hi = jnp.minimum(hi, lax.div(k_start + bk - 1 + window - 1, bq) + 1)
  lo = lax.div(k_start, bq) if cfg.causal else 0
  return lo, hi


def needs_mask(cfg) -> bool:
  return (cfg.causal or cfg.has_window or cfg.has_segments or cfg.Sp > cfg.S)


def full_key_blocks(cfg, q_start, bq, bk, window):
  """Key blocks fully visible to queries [q_start, q_start+bq), or None."""
  if cfg.has_segments:
    return None
  full_lo, full_hi = 0, cfg.S // bk  # blocks free of padded keys
  if cfg.causal:  # last key <= first query
    full_hi = jnp.minimum(full_hi, lax.div(q_start + 1, bk))
  if window is not None:  # last query - first key < window
    full_lo = lax.div(jnp.maximum(q_start + bq - 1 - window + bk, 0), bk)
  return full_lo, full_hi


def full_query_blocks(cfg, k_start, bk, bq, window):
  """Query blocks that see all keys [k_start, k_start+bk), or None."""
  if cfg.has_segments:
    return None
  full_lo, full_hi = 0, pl.cdiv(cfg.T, bq)
  if cfg.Sp > cfg.S:  # a block holding padded keys is never fully visible
    # Strongly typed branches: jax's Triton lowering gives a weakly typed
    # scalar literal in a select the predicate's type (i1).
    full_hi = jnp.where(k_start + bk > cfg.S, jnp.int32(0),
                        jnp.int32(full_hi))
  if cfg.causal:  # first query >= last key
    full_lo = lax.div(k_start + bk - 1 + bq - 1, bq)
  if window is not None:  # last query - first key < window
    last = jnp.maximum(window + k_start + 1 - bq, 0)
    full_hi = jnp.minimum(full_hi, lax.div(last + bq - 1, bq))
  return full_lo, full_hi
