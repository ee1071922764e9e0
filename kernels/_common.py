"""Shared plumbing for the kernels: backend choice, argument checks, padding.

Pallas kernels here are written for the Triton backend (``impl="pallas"`` on
GPU). On CPU the very same kernels run with ``interpret=True`` so that tests
run everywhere. TPU has no Mosaic version of these kernels: asking for
``impl="pallas"`` there raises a ``ValueError`` pointing at ``impl="xla"``.
In-kernel dots take their precision from ``jax_default_matmul_precision``
(:func:`dot_precision`).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

# Smallest tile edge: Triton's tensor-core dot needs M, N, K >= 16.
MIN_BLOCK = 16
# Finite "minus infinity" for masked logits: keeps every exp() argument finite.
MASKED = -0.7 * float(np.finfo(np.float32).max)
# A squeezed block dimension: the kernel's ref does not have it.
SQUEEZED = pl.squeezed


def check_impl(op: str, impl: str, allowed: tuple[str, ...]) -> None:
  if impl not in allowed:
    raise ValueError(f"{op}: unknown impl {impl!r}; expected one of {allowed}")


def pallas_interpret(op: str) -> bool:
  """Whether ``impl="pallas"`` runs interpreted (CPU) or compiled (GPU)."""
  backend = jax.default_backend()
  if backend == "cpu":
    return True
  if backend in ("gpu", "cuda", "rocm"):
    return False
  raise ValueError(
      f"{op}: impl='pallas' has Triton (GPU) kernels only, and runs them "
      f"interpreted on CPU; there is no Mosaic kernel for backend "
      f"{backend!r}. Use impl='xla'.")


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


def online_softmax_step(carry, s, mask, v):
  """Folds logits ``s [rows, cols]`` (fp32) and values ``v [cols, width]``
  into the online softmax (FlashAttention-2, Alg. 1): rescale the running
  ``acc`` and denominator by ``exp(m_old - m_new)``, add ``exp(s - m_new)``.
  ``mask`` (bool, or None for all visible) hides entries exactly."""
  acc, m, l = carry
  if mask is not None:
    s = jnp.where(mask, s, MASKED)
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  p = jnp.exp(s - m_new[:, None])
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  alpha = jnp.exp(m - m_new)
  acc = alpha[:, None] * acc + dot_nn(p.astype(v.dtype), v)
  return acc, m_new, alpha * l + jnp.sum(p, axis=1)
