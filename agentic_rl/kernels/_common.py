"""Shared plumbing for the kernels: backend choice, argument checks, padding.

``impl="pallas"`` runs one of two kernel families (:func:`pallas_backend`):
``"triton"`` kernels (written for GPU) or ``"mosaic_tpu"`` kernels (TPU
layout and pipelining: ``*_tpu.py``). The platform picks the family (GPU:
Triton, TPU: Mosaic, CPU: Triton) unless ``backend=`` names one; a family
runs interpreted off its own platform, so tests of both run on CPU. The
platform is the one the program is being lowered for
(:func:`target_platform`): an abstract mesh's device when one is set, so
kernels compile for a GPU or TPU that is not attached
(``experiments/aot_kernels.py``). In-kernel
dots take their precision from ``jax_default_matmul_precision``
(:func:`dot_precision`).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Smallest tile edge: Triton's tensor-core dot needs M, N, K >= 16.
MIN_BLOCK = 16
# Finite "minus infinity" for masked logits: keeps every exp() argument finite.
MASKED = -0.7 * float(np.finfo(np.float32).max)
LOG2E = float(np.log2(np.e))
# A squeezed block dimension: the kernel's ref does not have it.
SQUEEZED = pl.squeezed
# A TPU vector register is 8 sublanes x 128 lanes (32-bit).
TPU_LANES, TPU_SUBLANES = 128, 8

BACKENDS = ("triton", "mosaic_tpu")
_PLATFORM_BACKEND = {"gpu": "triton", "cuda": "triton", "rocm": "triton",
                     "tpu": "mosaic_tpu"}


def check_impl(op: str, impl: str, allowed: tuple[str, ...]) -> None:
  if impl not in allowed:
    raise ValueError(f"{op}: unknown impl {impl!r}; expected one of {allowed}")


def target_platform() -> str:
  """The platform being lowered for: the device of the abstract mesh in
  context (``jax.sharding.use_abstract_mesh`` or ``jax.set_mesh``) when it
  names one, else JAX's default backend."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  platform = getattr(device, "platform", None)
  return platform or jax.default_backend()


def pallas_backend(op: str, backend: str | None = None) -> tuple[str, bool]:
  """``(kernel family, interpret)`` for ``impl="pallas"`` on the target
  platform (:func:`target_platform`).

  ``backend=None`` takes the platform's family (GPU: Triton, TPU: Mosaic,
  CPU: Triton). A family compiles on its own platform and runs interpreted
  anywhere else (so Mosaic TPU kernels can be debugged on CPU or GPU).
  """
  platform = target_platform()
  if backend is not None and backend not in BACKENDS:
    raise ValueError(f"{op}: unknown Pallas backend {backend!r}; expected one "
                     f"of {BACKENDS} or None (the platform's)")
  native = _PLATFORM_BACKEND.get(platform)
  if backend is None:
    if native is None and platform != "cpu":
      raise ValueError(f"{op}: impl='pallas' has no kernels for platform "
                       f"{platform!r}. Use impl='xla'.")
    backend = native or "triton"
  return backend, backend != native


def tpu_interpret(interpret: bool):
  """The ``interpret`` argument of a Mosaic kernel's ``pallas_call``: the TPU
  interpreter (out-of-bounds and uninitialised memory read as NaN)."""
  return pltpu.InterpretParams() if interpret else False


def tpu_tile(requested: int, extent: int, name: str, *, owner: str) -> int:
  """A Mosaic tile edge: a multiple of 128, no larger than ``extent`` rounded
  up to 128 (so small inputs get one tile)."""
  if requested < TPU_LANES or requested % TPU_LANES:
    raise ValueError(f"{owner}.{name} must be a positive multiple of "
                     f"{TPU_LANES}, got {requested}")
  return min(requested, round_up(extent, TPU_LANES))


def block_sizes_for(op: str, family: str, blocks, cls):
  """``blocks`` (or ``cls()`` when None), checked to be the tiling of the
  kernel family that runs."""
  if blocks is None:
    return cls()
  if not isinstance(blocks, cls):
    raise ValueError(f"{op}: the {family!r} kernels take {cls.__name__}, got "
                     f"{type(blocks).__name__}")
  return blocks


def next_pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def block_size(requested: int, extent: int, name: str) -> int:
  """A power-of-two tile edge >= 16, no larger than ``extent`` needs."""
  if requested < MIN_BLOCK or requested & (requested - 1):
    raise ValueError(
        f"{name} must be a power of two >= {MIN_BLOCK}, got {requested}")
  return min(requested, max(MIN_BLOCK, next_pow2(extent)))


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
  """Pads ``x`` with ``value`` at the end of ``axis`` up to ``size``."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def static_positive_float(op: str, name: str, value) -> float | None:
  """``None`` or a Python float > 0 (kernels specialise on it)."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(
        f"{op}: {name} must be a Python number (it is compiled into the "
        f"kernel), got {type(value).__name__}")
  value = float(value)
  if not np.isfinite(value) or value <= 0:
    raise ValueError(f"{op}: {name} must be finite and > 0, got {value}")
  return value


def window_operand(op: str, window) -> jax.Array | None:
  """``None``, or the sliding window as an int32 scalar array.

  A Python int must be >= 1; a (possibly traced) integer scalar array is
  passed through to the kernels as an operand, so per-layer windows can be
  scanned over (``reference.NO_WINDOW`` means global attention).
  """
  if window is None:
    return None
  if isinstance(window, bool):
    raise ValueError(f"{op}: sliding_window must be an int, got a bool")
  if isinstance(window, numbers.Integral):
    if window < 1:
      raise ValueError(f"{op}: sliding_window must be >= 1, got {window}")
    return jnp.asarray(window, jnp.int32)
  if not hasattr(window, "dtype") or not hasattr(window, "shape"):
    raise ValueError(
        f"{op}: sliding_window must be an int or an integer scalar array, "
        f"got {type(window).__name__}")
  if np.shape(window) != () or not jnp.issubdtype(window.dtype, jnp.integer):
    raise ValueError(
        f"{op}: sliding_window must be an integer scalar, got shape "
        f"{np.shape(window)} dtype {window.dtype}")
  return jnp.asarray(window, jnp.int32)


# --------------------------------------------------------------------------
# In-kernel helpers (plain jnp on tiles; they lower to Triton and interpret).


# jax_default_matmul_precision values -> the lax.Precision of in-kernel dots.
_PRECISIONS = {
    "highest": lax.Precision.HIGHEST, "float32": lax.Precision.HIGHEST,
    "high": lax.Precision.HIGH, "tensorfloat32": lax.Precision.HIGH,
    "default": lax.Precision.DEFAULT, "bfloat16": lax.Precision.DEFAULT,
}


def dot_precision() -> lax.Precision | None:
  """The in-kernel dots' precision: ``jax_default_matmul_precision``.

  XLA dots follow that setting by themselves, but a Pallas dot only sees its
  own ``precision``, and Triton lowers the default for fp32 operands to TF32.
  Reading the setting when the kernel is traced keeps the kernels and the
  ``impl="xla"`` references at the same precision (``"highest"``: IEEE fp32
  on GPU). Unset or an algorithm name: None (the backend default).
  """
  value = jax.config.jax_default_matmul_precision
  return _PRECISIONS.get(str(value).lower()) if value is not None else None


def _dot(a, b, contract):
  return lax.dot_general(a, b, (contract, ((), ())), precision=dot_precision(),
                         preferred_element_type=jnp.float32)


def dot_nn(a, b):
  """``a @ b`` with fp32 accumulation."""
  return _dot(a, b, ((1,), (0,)))


def dot_nt(a, b):
  """``a @ b.T`` with fp32 accumulation."""
  return _dot(a, b, ((1,), (1,)))


def dot_tn(a, b):
  """``a.T @ b`` with fp32 accumulation."""
  return _dot(a, b, ((0,), (0,)))


def online_softmax_init(rows: int, width: int):
  """``(acc [rows, width], running max [rows], denominator [rows])``."""
  return (jnp.zeros((rows, width), jnp.float32),
          jnp.full((rows,), MASKED, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def online_softmax_step(carry, s, mask, v, keepdims=False, base2=False):
  """Folds logits ``s [rows, cols]`` (fp32) and values ``v [cols, width]``
  into the online softmax (FlashAttention-2, Alg. 1): rescale the running
  ``acc`` and denominator by ``exp(m_old - m_new)``, add ``exp(s - m_new)``.
  ``mask`` (bool, or None for all visible) hides entries exactly. The running
  max and denominator are ``[rows]``, or ``[rows, 1]`` with ``keepdims``
  (Mosaic keeps vectors 2-D).

  ``base2``: ``s`` is in base 2 (natural logits times ``log2(e)``) and the
  exponentials are ``exp2``, so ``log2 l + m`` is a base-2 log-sum-exp. On
  GPU, Pallas lowers ``exp2`` to libdevice's ``__nv_exp2f`` and ``exp`` to
  ``__nv_expf``, which adds a range reduction; the softmax exponentials
  compete with the tile matmuls for issue slots (FlashAttention-3, Shah et
  al., 2024, arXiv:2407.08608, section 3)."""
  acc, m, l = carry
  exp = jnp.exp2 if base2 else jnp.exp
  if mask is not None:
    s = jnp.where(mask, s, MASKED)
  col = (lambda x: x) if keepdims else (lambda x: x[:, None])
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=keepdims))
  p = exp(s - col(m_new))
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  alpha = exp(m - m_new)
  acc = col(alpha) * acc + dot_nn(p.astype(v.dtype), v)
  return acc, m_new, alpha * l + jnp.sum(p, axis=1, keepdims=keepdims)
