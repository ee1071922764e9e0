"""Tile math of the fused log-prob and entropy, shared by every path.

The Triton kernels (:mod:`triton.logprobs`), the pure-JAX chunked path
(:mod:`logprobs`) and the Mosaic TPU kernels (:mod:`tpu.logprobs`) all fold
logit tiles into the same online statistics and differentiate them the same
way; the formulas are in
:mod:`logprobs`'s docstring. ``cfg`` needs ``inv_temperature`` and
``softcap``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from agentic_rl.kernels import _common


class Stats(NamedTuple):
  """Online softmax state per row: max, sum e^(z-m), sum e^(z-m)(z-m), z_t."""
  m: jax.Array
  l: jax.Array
  s1: jax.Array
  zt: jax.Array


def empty_stats(shape) -> Stats:
  zeros = jnp.zeros(shape, jnp.float32)
  return Stats(jnp.full(shape, _common.MASKED, jnp.float32), zeros, zeros,
               zeros)


def merge(a: Stats, b: Stats) -> Stats:
  m = jnp.maximum(a.m, b.m)
  da, db = a.m - m, b.m - m
  ea, eb = jnp.exp(da), jnp.exp(db)
  return Stats(m, a.l * ea + b.l * eb,
               ea * (a.s1 + da * a.l) + eb * (b.s1 + db * b.l), a.zt + b.zt)


def transform(cfg, x):
  """fp32 logits -> (tempered, soft-capped logits z, tanh or None)."""
  if cfg.softcap is None:
    return x * cfg.inv_temperature, None
  t = jnp.tanh(x / cfg.softcap)
  return cfg.softcap * t * cfg.inv_temperature, t


def tile_stats(cfg, x, cols, valid, targets, keepdims=False) -> Stats:
  """Stats of one ``[rows, cols]`` logit tile. ``cols`` (column ids) and
  ``valid`` (columns to count) are ``[cols]``, ``targets`` ``[rows]``; with
  ``keepdims`` (Mosaic) they are 2-D, broadcasting to the tile
  (``[1 or rows, cols]``, ``[rows, 1]``), and so are the stats returned."""
  if not keepdims:
    cols, valid, targets = cols[None, :], valid[None, :], targets[:, None]
  z, _ = transform(cfg, x)
  valid = jnp.broadcast_to(valid, z.shape)
  z = jnp.where(valid, z, _common.MASKED)
  total = functools.partial(jnp.sum, axis=1, keepdims=keepdims)
  m = jnp.max(z, axis=1, keepdims=True)
  zm = z - m
  e = jnp.where(valid, jnp.exp(zm), 0.0)
  hit = valid & (cols == targets)
  return Stats(m if keepdims else m[:, 0], total(e), total(e * zm),
               total(jnp.where(hit, z, 0.0)))


def finalize(s: Stats):
  """-> (logp, entropy, lse, E_p[z]), all fp32 ``[rows]``."""
  log_l = jnp.log(s.l)
  mean_rel = s.s1 / s.l
  return s.zt - (s.m + log_l), log_l - mean_rel, s.m + log_l, s.m + mean_rel


def logit_grad(cfg, x, cols, valid, targets, lse, ez, d_logp, d_ent,
                keepdims=False):
  """dL/dx for one tile (fp32), zero on masked columns. Shapes as in
  :func:`tile_stats`: 1-D, or 2-D with ``keepdims`` (per-row values
  ``[rows, 1]``)."""
  if not keepdims:
    cols, valid = cols[None, :], valid[None, :]
    targets, lse, ez, d_logp, d_ent = (
        a[:, None] for a in (targets, lse, ez, d_logp, d_ent))
  z, t = transform(cfg, x)
  p = jnp.exp(z - lse)
  onehot = (cols == targets).astype(jnp.float32)
  g = d_logp * (onehot - p) - d_ent * p * (z - ez)
  g = g * cfg.inv_temperature
  if t is not None:
    g = g * (1.0 - t * t)
  return jnp.where(jnp.broadcast_to(valid, g.shape), g, 0.0)
