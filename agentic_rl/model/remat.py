"""Recomputing a function's intermediates in the backward pass, bit for bit.

``recompute_in_backward(fn, *args)`` is ``fn(*args)`` whose reverse-mode
derivative keeps only ``args`` from the forward and recomputes everything
else ``fn`` computes when the backward runs: ``jax.vjp(fn, *args)`` applied
to the output's cotangent, so the gradients are autodiff's own, bit for bit.

Why not ``jax.checkpoint``: XLA:CPU expands the optimisation barriers that
keep a checkpoint's recomputation apart before its common-subexpression
elimination runs, which then merges the recomputation back into the forward
(the same residuals, the same memory; BENCHMARKS.md). Here the backward
recomputes from ``a + (-0.0 * |c|)`` for every floating input ``a`` with the
batch axis, ``c`` the cotangent's first element in each row: the same values
(``x + -0.0 == x`` for every float ``x``, signed zeros included; NaN only in
a row whose cotangent is not finite, and then its gradient is not either),
but not the same XLA values, so no pass folds the two computations together.
Per-row elements keep a batch split over devices where it is (one element
of the whole array would be a collective per call).

What it buys on XLA:CPU (``TransformerConfig.backward_recompute``): a
learner step's temporaries are one buffer per execution, page-faulted anew
whenever glibc serves it with a fresh ``mmap`` (above 32 MiB, every step).
Keeping the attention core's inputs instead of its ``[B, H, T, T]``
intermediates and the gated MLP's gate and up instead of ``act(gate) * up``
halves that buffer at the learner benchmark's size (BENCHMARKS.md, "Learner
step"); the recomputation costs elementwise passes and the attention scores'
matmul.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def recompute_in_backward(fn: Callable[..., jax.Array], *args) -> jax.Array:
  """``fn(*args)`` (one array out); its backward recomputes ``fn`` from ``args``.

  Floating-point array ``args`` are differentiated; other arrays (masks,
  segment ids, a traced window) get no cotangent, and non-arrays (None,
  Python numbers) are passed through as they are. ``fn`` must be
  deterministic: the backward reruns it.
  """
  is_array = [isinstance(a, (jax.Array, np.ndarray)) for a in args]
  arrays = tuple(a for a, arr in zip(args, is_array) if arr)

  def call(arrays):
    it = iter(arrays)
    return fn(*(next(it) if arr else a for a, arr in zip(args, is_array)))

  @jax.custom_vjp
  def f(*arrays):
    return call(arrays)

  def fwd(*arrays):
    return call(arrays), arrays

  def bwd(arrays, ct):
    floats = [i for i, a in enumerate(arrays) if _is_float(a)]
    moved = {i: _plus_negative_zero(arrays[i], ct) for i in floats}

    def of_floats(*xs):
      return call(tuple(xs[floats.index(i)] if i in moved else a
                        for i, a in enumerate(arrays)))

    _, vjp = jax.vjp(of_floats, *(moved[i] for i in floats))
    grads = dict(zip(floats, vjp(ct)))
    return tuple(grads.get(i) for i in range(len(arrays)))

  f.defvjp(fwd, bwd)
  return f(*arrays)


def _plus_negative_zero(a: jax.Array, ct: jax.Array) -> jax.Array:
  """``a + (-0.0 * |c|)``, ``a`` bit for bit where ``c`` is finite, for an
  ``a`` with the cotangent's leading size (a batch); other arrays as they are.

  ``c`` is the cotangent's first element of each leading index (each row of
  the batch), broadcast over ``a``'s other axes, so a batch split over
  devices stays where it is (no collective). Arrays without the batch axis
  (weights) need no change: what the backward recomputes from them depends
  on the batch inputs too.
  """
  if not (a.ndim and ct.ndim and a.shape[0] == ct.shape[0]):
    return a
  c = ct[(slice(None),) + (0,) * (ct.ndim - 1)].reshape((-1,) + (1,) * (a.ndim - 1))
  return a + (-0.0 * jnp.abs(c)).astype(a.dtype)
