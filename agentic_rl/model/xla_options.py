"""XLA compiler options for the project's jitted model code, per platform.

Every ``jax.jit`` that runs the model (the rollout engine's loops, the host
loop's segments, the learner's and scorer's steps) passes
``compiler_options=compiler_options(platform or mesh)``, so sampling and
learning compile the model the same way.

On CPU (jax 0.10.2 to 0.12), XLA hands f32 matmuls to YNNPACK fusions by
default. On this project's shapes Eigen, XLA's other CPU dot, is faster, so
the CPU options switch the YNN fusions off
(``xla_cpu_experimental_ynn_fusion_type=""``; the option is accepted by jax
0.10.2, 0.11.2 and 0.12.0.1). Measured on a 2-core x86_64 VM (AVX2), jax
0.10.2, scratch A/Bs in one process, best of 4-7 rounds (BENCHMARKS.md):

* rollout decode, ``llama_10m``, batch 32, 256 tokens, rows over two host
  devices: 2184 -> 2517 tokens/s (one device: 1639 -> 1689);
* 8 layers of projection and MLP matmuls at 16 rows per device: 8.5-9.3 ->
  4.8-5.7 ms per step;
* learner forward and backward, ``llama_10m``, ``[32, 272]`` tokens: 9.35 ->
  7.47 s; ``[8, 272]``: 2.38 -> 2.09 s.

The CPU options also ask XLA's own loops for 512-bit vectors
(``xla_cpu_prefer_vector_width="512"``; XLA's default is 256, LLVM caps it at
what the host has, so hosts without AVX-512 compile as before). XLA emits
the decode step's batched matrix-vector products, attention's score and
value products over the KV cache, itself: on a 2-core AMD EPYC (Zen 5,
AVX-512) VM, jax 0.10.2, the value product read the cache at 51-56 instead
of 42-44 GB/s, and the rollout engine (``llama_10m``, batch 32, 256 tokens,
two host devices; same process, 16 rounds in random order, best round) ran
at 6459 against 5787 tokens/s when the machine was quiet, and 2-5% faster
when it was busy. The learner's forward and backward were unchanged (2.03
against 2.06 s at ``[16, 272]``, median of 8). On Intel CPUs that lower
their clock for 512-bit code (Skylake-SP), check it with
``experiments.bench_rollout``.

Eigen rounds differently from YNNPACK (logits agree to about 1e-6), and
training amplifies rounding: the default run's SFT warm start went from
held-out success 0.375 to 0.047 with this switch alone (README). Judge a
recipe on several seeds, not on one compile.

Other platforms get no options (None).
"""

from __future__ import annotations

import jax

CPU = {"xla_cpu_experimental_ynn_fusion_type": "",
       "xla_cpu_prefer_vector_width": "512"}


def compiler_options(where=None) -> dict[str, str] | None:
  """The options for a platform, or None where the defaults are kept.

  Args:
    where: a platform name ("cpu", "gpu", "tpu"), a ``jax.sharding.Mesh``
      or ``AbstractMesh`` (its platform, :func:`mesh_platform`), or None
      (JAX's default backend).
  """
  if where is None:
    platform = jax.default_backend()
  elif isinstance(where, str):
    platform = where
  else:
    platform = mesh_platform(where)
  return dict(CPU) if platform == "cpu" else None


def mesh_platform(mesh) -> str:
  """The platform of a ``jax.sharding.Mesh``'s devices (an ``AbstractMesh``
  has none: JAX's default backend)."""
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return jax.default_backend()
  return mesh.devices.flat[0].platform
