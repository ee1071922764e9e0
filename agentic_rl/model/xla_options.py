"""XLA compiler options for the project's jitted model code, per platform
and compute dtype.

Every ``jax.jit`` that runs the model (the rollout engine's loops, the host
loop's segments, the learner's and scorer's steps) passes
``compiler_options=compiler_options(platform or mesh, config.compute_dtype)``,
so sampling and learning compile the model the same way.

On CPU, XLA hands matmuls to YNNPACK fusions by default. In float32, Eigen,
XLA's other CPU dot, is faster on this project's shapes, so the float32 CPU
options switch them off (``xla_cpu_experimental_ynn_fusion_type=""``,
accepted by jax 0.10.2 to 0.12.0.1). In bfloat16 and float16 YNNPACK is the
one that uses the CPU's 16-bit units (AMX, AVX512-BF16; Eigen computes a
16-bit matmul in float32 after converting its operands), so 16-bit compute
keeps it. Both ask XLA's own loops (the decode step's matrix-vector
products over the KV cache) for 512-bit vectors
(``xla_cpu_prefer_vector_width="512"``; LLVM caps it at what the host has).
On Intel CPUs that lower their clock for 512-bit code, check it with
``experiments.bench_rollout``. The options change float rounding (logits by
about 1e-6), which training amplifies: judge a recipe on several seeds.
Measurements: BENCHMARKS.md, "Rollout decode", "Training run" and "A real
model".

Other platforms get no options (None).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CPU = {"xla_cpu_experimental_ynn_fusion_type": "",
       "xla_cpu_prefer_vector_width": "512"}
CPU_16BIT = {"xla_cpu_prefer_vector_width": "512"}


def compiler_options(where=None, dtype=None) -> dict[str, str] | None:
  """The options for a platform and compute dtype, or None where the
  defaults are kept.

  Args:
    where: a platform name ("cpu", "gpu", "tpu"), a ``jax.sharding.Mesh``
      or ``AbstractMesh`` (its platform, :func:`mesh_platform`), or None
      (JAX's default backend).
    dtype: the model's compute dtype (``TransformerConfig.compute_dtype``);
      None is float32.
  """
  if where is None:
    platform = jax.default_backend()
  elif isinstance(where, str):
    platform = where
  else:
    platform = mesh_platform(where)
  if platform != "cpu":
    return None
  low = dtype is not None and jnp.finfo(dtype).bits < 32
  return dict(CPU_16BIT if low else CPU)


def mesh_platform(mesh) -> str:
  """The platform of a ``jax.sharding.Mesh``'s devices (an ``AbstractMesh``
  has none: JAX's default backend)."""
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return jax.default_backend()
  return mesh.devices.flat[0].platform
