"""``decode_attention``: one query token per row against a KV cache.

The entry point and its checks. :func:`decode_attention` dispatches on
``impl``: ``"xla"`` (:func:`agentic_rl.kernels.reference.attention` with the
positions below) or ``"pallas"``, whose kernel family is the platform's or
``backend=``'s: ``"triton"`` (GPU, :mod:`agentic_rl.kernels.triton.decode`)
or ``"mosaic_tpu"`` (TPU, :mod:`agentic_rl.kernels.tpu.decode`).

For the rollout engine. Row ``b`` has ``lengths[b]`` filled cache slots and its
query sits at position ``lengths[b] - 1``, so slot ``j`` is visible iff ``j <
lengths[b]`` and, with a window ``w``, ``lengths[b] - 1 - j < w`` (the same
rule as :func:`reference.attention` with those positions). Rows with length 0
return zeros. The cache may be sequence-major ``[B, S, K, D]`` or head-major
``[B, K, S, D]`` (the model's KV cache). Forward only (no VJP).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentic_rl.kernels import _common
from agentic_rl.kernels import reference
from agentic_rl.kernels.tpu import decode as tpu_decode
from agentic_rl.kernels.tpu.decode import TpuDecodeBlockSizes
from agentic_rl.kernels.triton import decode as triton_decode
from agentic_rl.kernels.triton.decode import DecodeBlockSizes

__all__ = ["DecodeBlockSizes", "TpuDecodeBlockSizes", "decode_attention"]


def _validate(q, k, v, lengths, kv_layout):
  op = "decode_attention"
  if kv_layout not in reference.KV_LAYOUTS:
    raise ValueError(f"{op}: kv_layout must be one of {reference.KV_LAYOUTS}, "
                     f"got {kv_layout!r}")
  if q.ndim != 3:
    raise ValueError(f"{op}: q must be [batch, heads, head_dim], got {q.shape}")
  dims = ("[batch, slots, kv_heads, head_dim]" if kv_layout == "BSKD"
          else "[batch, kv_heads, slots, head_dim]")
  if k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"{op}: caches must both be {dims}, got {k.shape} and "
                     f"{v.shape}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"{op}: q must be floating point, got {q.dtype}")
  if k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(f"{op}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, "
                     f"{v.dtype}")
  B, H, D = q.shape
  if k.shape[0] != B or k.shape[3] != D:
    raise ValueError(f"{op}: q {q.shape} and cache {k.shape} disagree on "
                     f"batch or head_dim")
  K = k.shape[2] if kv_layout == "BSKD" else k.shape[1]
  if H % K:
    raise ValueError(f"{op}: query heads {H} must be a multiple of key/value "
                     f"heads {K}")
  if min(q.shape) == 0 or min(k.shape) == 0:
    raise ValueError(f"{op}: empty input: q {q.shape}, cache {k.shape}")
  if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"{op}: lengths must be integers of shape {(B,)}, got "
                     f"{lengths.dtype} {lengths.shape}")


IMPLS = ("xla", "pallas")


def decode_attention(
    q_BxHxD: jax.Array,
    k_cache_BxSxKxD: jax.Array,
    v_cache_BxSxKxD: jax.Array,
    lengths_B: jax.Array,
    *,
    sliding_window: int | jax.Array | None = None,
    softcap: float | None = None,
    impl: str = "pallas",
    block_sizes: DecodeBlockSizes | TpuDecodeBlockSizes | None = None,
    kv_layout: str = "BSKD",
    backend: str | None = None,
) -> jax.Array:
  """Attention of one new token per row over its cache; ``[B, H, D]``.

  Args:
    q_BxHxD: queries (the token at position ``lengths - 1``).
    k_cache_BxSxKxD, v_cache_BxSxKxD: caches, ``H % K == 0``, q's dtype;
      ``[B, K, S, D]`` with ``kv_layout="BKSD"``.
    lengths_B: int, slots ``< lengths[b]`` are visible (0 gives zeros).
    sliding_window: optional int >= 1 or int32 scalar array (may be traced):
      slot ``j`` needs ``lengths - 1 - j < window``.
    softcap: optional ``c``: logits become ``c * tanh(logits / c)``.
    impl: ``"pallas"`` (the kernels of ``backend``) or ``"xla"``.
    block_sizes: Pallas tiling: :class:`DecodeBlockSizes` for Triton,
      :class:`TpuDecodeBlockSizes` for Mosaic; None for the defaults.
    kv_layout: ``"BSKD"`` (sequence-major) or ``"BKSD"`` (head-major).
    backend: ``"triton"``, ``"mosaic_tpu"`` (:mod:`tpu.decode`) or None for
      the platform's (see :func:`_common.pallas_backend`).
  """
  op = "decode_attention"
  _common.check_impl(op, impl, IMPLS)
  q, k, v = q_BxHxD, k_cache_BxSxKxD, v_cache_BxSxKxD
  _validate(q, k, v, lengths_B, kv_layout)
  softcap = _common.static_positive_float(op, "softcap", softcap)
  window = _common.window_operand(op, sliding_window)
  lengths = lengths_B.astype(jnp.int32)
  B, H, D = q.shape
  head_major = kv_layout == "BKSD"
  s_axis = 2 if head_major else 1
  S, K = k.shape[s_axis], k.shape[3 - s_axis]
  if impl == "xla":
    out = reference.attention(
        q[:, None], k, v, causal=True, q_positions=(lengths - 1)[:, None],
        kv_positions=jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)),
        sliding_window=window, softcap=softcap, kv_layout=kv_layout)
    return out[:, 0]
  family, interpret = _common.pallas_backend(op, backend)
  G = H // K
  lengths = jnp.minimum(lengths, S)  # slots past the cache do not exist
  if family == "mosaic_tpu":
    blocks = _common.block_sizes_for(op, family, block_sizes,
                                     TpuDecodeBlockSizes)
    cfg = tpu_decode.make_config(q.shape, S, softcap=softcap,
                                 has_window=window is not None, blocks=blocks,
                                 interpret=interpret)
    if not head_major:
      k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    out = tpu_decode.attention(cfg, q.reshape(B, K, G, D), k, v, lengths,
                               window)
    return out.reshape(B, H, D)
  cfg = triton_decode.make_config(
      q.shape, S, K, softcap=softcap, has_window=window is not None,
      blocks=_common.block_sizes_for(op, family, block_sizes,
                                     DecodeBlockSizes),
      interpret=interpret)
  out = triton_decode.attention(cfg, q.reshape(B, K, G, D), k, v, lengths,
                                window, head_major)
  return out.reshape(B, H, D)
