"""Compile the kernels for a GPU this machine does not have.

    python -m experiments.aot_kernels --out FILE [--ops a,b]
        [--sweep FIELD=V1,V2 ...] [--base JSON]

XLA's GPU compiler runs without a device when it is given a description of
the target (a ``GpuTargetConfigProto``: :data:`TARGETS`), and JAX exposes
that as compile-only devices (``jax.experimental.topologies``). With JAX's
CUDA plugin installed (``pip install -e ".[cuda]"``; no GPU or driver
needed), a program then compiles on a CPU-only machine all the way to
machine code for, say, an H200: the Triton kernels through XLA's Triton
pipeline, the Mosaic GPU kernels (``agentic_rl/kernels/hopper/``) through ptxas for
``sm_90a``. That checks what lowering alone does not (the PTX compile, each
kernel's register use and spills, the Triton kernels' shared memory) and
prints ptxas' own warnings, such as serialised ``wgmma``, before any GPU
time is spent. Nothing runs and nothing is timed.

:func:`compile_for` lowers under an abstract mesh of the compile-only
device, so ``impl="pallas"`` picks the target's kernels, compiled
(:func:`_common.target_platform`), and returns the executable with a
:class:`Kernel` record per GPU kernel: ptxas' report for the Mosaic GPU
kernels, XLA's launch dimensions and shared memory for the others (Triton
and fusions).

The command compiles the benchmark's attention shapes
(:mod:`experiments.bench_kernels`) with the Triton kernels and with the
Mosaic GPU ones, the latter at ``--base`` (a JSON object of
:class:`~agentic_rl.kernels.AttentionBlockSizes` fields, default ``{"fwd":
"mosaic_gpu", "bwd": "mosaic_gpu"}``) and with each ``--sweep`` value in
turn (as ``bench_kernels --ab``), plus the log-prob and decode kernels,
and writes one JSON row per compiled kernel. A case that fails to compile
(shared memory over the limit, a kernel ptxas rejects) is recorded with
its error and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp

from agentic_rl import kernels
from experiments import bench_kernels as bench

# The NVIDIA H200 (SXM, 141 GB) as XLA's GPU compiler sees it: the fields of
# stream_executor's GpuTargetConfigProto that a device query fills in (values
# from NVIDIA's H200 specification and the device tool's readings:
# 132 SMs, 1980 MHz, 60 MB of L2, 143771 MiB). XLA uses them for its cost
# models and launch limits; the code it generates depends on the compute
# capability and the shared-memory and register limits.
_H200 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 62914560
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200"
"""
TARGETS = {"h200": _H200}


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One GPU kernel of a compiled program.

  ``source``: ``"ptxas"`` (a Mosaic GPU kernel: register, spill and stack
  figures, ``notes`` = ptxas' warnings and performance remarks about it) or
  ``"xla"`` (a kernel XLA launches, Triton kernels included: launch
  dimensions and dynamic shared memory). Fields a source does not give are
  None.
  """
  name: str
  source: str
  registers: int | None = None
  spill_bytes: int | None = None  # stores + loads
  stack_bytes: int | None = None
  shared_memory_bytes: int | None = None
  grid: tuple[int, ...] | None = None
  threads: tuple[int, ...] | None = None
  notes: tuple[str, ...] = ()


def mesh(target: str = "h200") -> jax.sharding.Mesh:
  """A one-device mesh of ``target``'s compile-only device.

  Needs JAX's CUDA plugin (``pip install -e ".[cuda]"``) and, on a machine
  without a GPU, ``JAX_PLATFORMS=cpu`` set before JAX starts: otherwise the
  plugin's start-up checks of the CUDA libraries fail and it is not loaded.
  """
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  if target not in TARGETS:
    raise ValueError(f"unknown target {target!r}; expected one of "
                     f"{sorted(TARGETS)}")
  try:
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=TARGETS[target], topology="1x1x1")
  except (NotImplementedError, RuntimeError) as e:
    raise RuntimeError(
        "compiling for a GPU without one needs JAX's CUDA plugin, "
        "initialised: pip install -e \".[cuda]\" and run with "
        f"JAX_PLATFORMS=cpu ({type(e).__name__}: {e})") from e
  return topologies.make_mesh(topology, (1,), ("x",))


def compile_for(fn: Callable, *args, target: str = "h200"
                ) -> tuple[jax.stages.Compiled, list[Kernel]]:
  """``jax.jit(fn)`` compiled for ``target``, and its GPU kernels.

  ``args``: arrays or ``jax.ShapeDtypeStruct``s (only shapes and dtypes
  are used; they are placed replicated on :func:`mesh`). Raises what the
  compile raises (a kernel ptxas rejects, shared memory over the limit).
  """
  target_mesh = mesh(target)
  replicated = jax.sharding.NamedSharding(target_mesh,
                                          jax.sharding.PartitionSpec())
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated)
           for a in args]
  # Executables already built (in this process or in a persistent cache)
  # would skip ptxas and its report.
  jax.clear_caches()
  with jax.sharding.use_abstract_mesh(target_mesh.abstract_mesh):
    lowered = jax.jit(fn).lower(*specs)
  log = []
  try:
    with tempfile.TemporaryDirectory() as dump, \
        _config(jax_enable_compilation_cache=False), \
        _env(MOSAIC_GPU_DUMP_PTXAS="1"), _captured_output() as log:
      compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
      thunks = "".join(
          open(os.path.join(dump, f)).read()
          for f in sorted(os.listdir(dump))
          if f.endswith("thunk_sequence.txt"))
  except Exception:
    sys.stderr.write("".join(log))  # what ptxas and XLA said
    raise
  return compiled, _xla_kernels(thunks) + _ptxas_kernels(log[0])


@contextlib.contextmanager
def _config(**values):
  previous = {k: getattr(jax.config, k) for k in values}
  for k, v in values.items():
    jax.config.update(k, v)
  try:
    yield
  finally:
    for k, v in previous.items():
      jax.config.update(k, v)


@contextlib.contextmanager
def _env(**values):
  previous = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in previous.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


@contextlib.contextmanager
def _captured_output():
  """What the process writes to file descriptors 1 and 2 (ptxas' report
  comes from C++), as the only item of the yielded list once done."""
  sys.stdout.flush()
  sys.stderr.flush()
  result = []
  with tempfile.TemporaryFile() as log:
    saved = os.dup(1), os.dup(2)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
      yield result
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      for fd in saved:
        os.close(fd)
      log.seek(0)
      result.append(log.read().decode(errors="replace"))


# "001: kCustomKernel [...] flash_attention_fwd grid: [32, 2, 8] threads:
# [256, 1, 1]  shared_memory: 229376 bytes"
_THUNK = re.compile(r"kCustomKernel\s+\[[^\]]*\]\s+(\S+)\s+grid:\s*\[([^\]]*)\]"
                    r"\s+threads:\s*\[([^\]]*)\]\s+shared_memory:\s*(\d+)")


def _xla_kernels(thunk_sequence: str) -> list[Kernel]:
  def dims(text):
    return tuple(int(x) for x in text.split(","))
  return [Kernel(name=m[1], source="xla", grid=dims(m[2]),
                 threads=dims(m[3]), shared_memory_bytes=int(m[4]))
          for m in _THUNK.finditer(thunk_sequence)]


# ptxas -v, per entry function: "Function properties for NAME", then
# "16 bytes stack frame, 12 bytes spill stores, 12 bytes spill loads", then
# "Used 168 registers, ...". Warnings and remarks name the function.
_MOSAIC_SUFFIX = "_mosaic_gpu_kernel"


def _ptxas_kernels(log: str) -> list[Kernel]:
  found, current = {}, None
  for line in log.splitlines():
    if m := re.search(r"Function properties for (\w+)", line):
      current = m[1]
      found[current] = dict(notes=[])
    elif current and (m := re.search(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
        r"(\d+) bytes spill loads", line)):
      found[current].update(stack_bytes=int(m[1]),
                            spill_bytes=int(m[2]) + int(m[3]))
    elif current and (m := re.search(r"Used (\d+) registers", line)):
      found[current]["registers"] = int(m[1])
      current = None
  for line in log.splitlines():  # remarks come before or after the report
    if "ptxas" in line and ("warning" in line or "(C7" in line):
      for name, record in found.items():
        if f"'{name}'" in line:
          record["notes"].append(line.split(":", 1)[-1].strip())
  return [Kernel(name=name.removesuffix(_MOSAIC_SUFFIX), source="ptxas",
                 registers=r.get("registers"), spill_bytes=r.get("spill_bytes"),
                 stack_bytes=r.get("stack_bytes"), notes=tuple(r["notes"]))
          for name, r in found.items()]


# --------------------------------------------------------------------------
# The command.


def attention_grad(blocks, window=None):
  """The gradient of ``sum(flash_attention(q, k, v))`` with ``blocks``."""
  def loss(q, k, v):
    out = kernels.flash_attention(q, k, v, sliding_window=window,
                                  block_sizes=blocks)
    return jnp.sum(out.astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


def cases(ops: set[str], base: dict, sweep: list[tuple[str, list]]
          ) -> list[tuple[str, str, Callable, tuple]]:
  """``(case, blocks, fn, args)`` for each program the command compiles."""
  out = []
  spec = jax.ShapeDtypeStruct
  if "flash_attention" in ops:
    variants = [kernels.AttentionBlockSizes()]
    mosaic = dataclasses.replace(kernels.AttentionBlockSizes(), **base)
    variants.append(mosaic)
    for field, values in sweep:
      changed = (dataclasses.replace(mosaic, **{field: v}) for v in values)
      variants += [blocks for blocks in changed if blocks != mosaic]
    for B, T, H, K, D, window in bench.ATTENTION_SHAPES:
      name = f"attention fwd+bwd B{B} T{T} H{H} K{K} D{D}" + (
          f" w{window}" if window else "")
      args = (spec((B, T, H, D), jnp.bfloat16),
              spec((B, T, K, D), jnp.bfloat16),
              spec((B, T, K, D), jnp.bfloat16))
      for blocks in variants:
        out.append((name, _changed(blocks),
                    attention_grad(blocks, window), args))
  if "token_logprobs" in ops:
    for N, D, V in bench.LOGPROB_SHAPES:
      def logprob_loss(h, w, t):
        logp, ent = kernels.token_logprobs(h, w, t)
        return jnp.sum(logp) + 0.01 * jnp.sum(ent)
      out.append((f"token_logprobs fwd+bwd N{N} D{D} V{V}", "{}",
                  jax.grad(logprob_loss, argnums=(0, 1)),
                  (spec((N, D), jnp.bfloat16), spec((D, V), jnp.bfloat16),
                   spec((N,), jnp.int32))))
  if "decode_attention" in ops:
    for B, S, H, K, D in bench.DECODE_SHAPES:
      out.append((f"decode_attention B{B} S{S} H{H} K{K} D{D}", "{}",
                  lambda q, k, v, n: kernels.decode_attention(
                      q, k, v, n, kv_layout="BKSD"),
                  (spec((B, H, D), jnp.bfloat16),
                   spec((B, K, S, D), jnp.bfloat16),
                   spec((B, K, S, D), jnp.bfloat16), spec((B,), jnp.int32))))
  return out


def _changed(blocks) -> str:
  """The fields of ``blocks`` that differ from the defaults, as JSON."""
  default = type(blocks)()
  return json.dumps({f.name: getattr(blocks, f.name)
                     for f in dataclasses.fields(blocks)
                     if getattr(blocks, f.name) != getattr(default, f.name)})


def _ptxas_version() -> str | None:
  root = os.environ.get("MOSAIC_GPU_CUDA_ROOT")
  if not root:
    return None
  try:
    out = subprocess.run([os.path.join(root, "bin", "ptxas"), "--version"],
                         capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return None
  return out.strip().splitlines()[-1]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--target", default="h200", choices=sorted(TARGETS))
  parser.add_argument("--ops", default=",".join(bench.OPS))
  parser.add_argument("--base",
                      default='{"fwd": "mosaic_gpu", "bwd": "mosaic_gpu"}',
                      help="AttentionBlockSizes fields of the Mosaic GPU "
                           "variant (JSON)")
  parser.add_argument("--sweep", nargs="*", default=[],
                      help="FIELD=V1,V2: also compile --base with each value")
  args = parser.parse_args(argv)
  ops = set(args.ops.split(","))
  if ops - set(bench.OPS):
    parser.error(f"unknown ops {sorted(ops - set(bench.OPS))}")
  sweep = [bench.parse_ab(s) for s in args.sweep]
  mesh(args.target)  # fail early, and let the plugin set the CUDA root
  report = dict(
      target=args.target, jax=jax.__version__,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
      ptxas=_ptxas_version(), rows=[])
  for case, blocks, fn, fn_args in cases(ops, json.loads(args.base), sweep):
    t0 = time.perf_counter()
    row = dict(case=case, blocks=blocks)
    try:
      _, found = compile_for(fn, *fn_args, target=args.target)
      rows = [dict(row, **dataclasses.asdict(k)) for k in found]
    except Exception as e:  # pylint: disable=broad-except
      rows = [dict(row, error=bench.error_text(e))]
    for r in rows:
      r["compile_s"] = round(time.perf_counter() - t0, 2)
      print(_line(r), flush=True)
    report["rows"] += rows
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  return 0


def _line(r: dict) -> str:
  if "error" in r:
    return f"{r['case']} {r['blocks']}: ERROR {r['error']}"
  if r["source"] == "ptxas":
    notes = f" notes: {'; '.join(r['notes'])}" if r["notes"] else ""
    return (f"{r['case']} {r['blocks']}: {r['name']}: {r['registers']} "
            f"registers, {r['spill_bytes']} B spilled, {r['stack_bytes']} B "
            f"stack{notes}")
  return (f"{r['case']} {r['blocks']}: {r['name']}: grid {r['grid']} "
          f"threads {r['threads']} shared memory {r['shared_memory_bytes']} B")


if __name__ == "__main__":
  sys.exit(main())
