"""Compiling the kernels for an H200 on a machine without a GPU
(``experiments/aot_kernels.py``).

The report parsers run everywhere. The compiles need JAX's CUDA plugin and
skip without it; run them with

    pip install -e ".[test,cuda]"   # in a separate environment (~4.4 GB)
    JAX_PLATFORMS=cpu python -m pytest -q tests/test_kernels_aot.py
"""

import importlib.util
import json

import jax
import jax.numpy as jnp
import pytest

from agentic_rl import kernels
from experiments import aot_kernels as aot



def _has_cuda_plugin() -> bool:
  if importlib.util.find_spec("jax_plugins") is None:
    return False
  return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}")
             for v in (12, 13))


_HAS_PLUGIN = _has_cuda_plugin()

# ptxas -v's report as Mosaic GPU's compile prints it (jax 0.11.2, CUDA 13).
_PTXAS_LOG = """\
ptxas info    : (C7519) warpgroup.arrive is injected in around line 793 by \
compiler to allow use of registers in GMMA in function \
'flash_attention_dkdv_mgpu_mosaic_gpu_kernel'
ptxas warning : Registers are spilled to local memory in function \
'flash_attention_dkdv_mgpu_mosaic_gpu_kernel', 12 bytes spill stores, 12 \
bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function \
'flash_attention_dkdv_mgpu_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for \
flash_attention_dkdv_mgpu_mosaic_gpu_kernel
    16 bytes stack frame, 12 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 16 bytes cumulative \
stack size, 1 bytes smem
ptxas info    : Compile time = 168.175 ms

ptxas info    : Compiling entry function \
'flash_attention_dq_mgpu_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for \
flash_attention_dq_mgpu_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 232 registers, used 16 barriers, 1 bytes smem
"""
_THUNKS = """\
001: kCustomKernel [source       | next=002 (1)] flash_attention_fwd grid: \
[32, 2, 8] threads: [256, 1, 1]  shared_memory: 229376 bytes
002: kCustomKernel [prev=001 (1) | next=004 (2)] input_reduce_fusion grid: \
[8192, 1, 1] threads: [256, 1, 1]  shared_memory: 0 bytes
004: kCustomCall   [prev=003 (1) | sink        ] kCustomCall
"""


def test_ptxas_report_is_read_per_kernel():
  dkdv, dq = aot._ptxas_kernels(_PTXAS_LOG)
  assert dkdv == aot.Kernel(
      name="flash_attention_dkdv_mgpu", source="ptxas", registers=168,
      spill_bytes=24, stack_bytes=16, notes=(
          dkdv.notes[0], "Registers are spilled to local memory in function "
          "'flash_attention_dkdv_mgpu_mosaic_gpu_kernel', 12 bytes spill "
          "stores, 12 bytes spill loads"))
  assert dkdv.notes[0].startswith("(C7519) warpgroup.arrive is injected")
  assert dq == aot.Kernel(name="flash_attention_dq_mgpu", source="ptxas",
                          registers=232, spill_bytes=0, stack_bytes=0)


def test_xla_thunks_are_read_per_kernel():
  assert aot._xla_kernels(_THUNKS) == [
      aot.Kernel(name="flash_attention_fwd", source="xla", grid=(32, 2, 8),
                 threads=(256, 1, 1), shared_memory_bytes=229376),
      aot.Kernel(name="input_reduce_fusion", source="xla", grid=(8192, 1, 1),
                 threads=(256, 1, 1), shared_memory_bytes=0)]


def test_captured_output_sees_what_cxx_writes():
  import os  # pylint: disable=import-outside-toplevel
  with aot._captured_output() as log:
    os.write(1, b"ptxas on stdout\n")
    os.write(2, b"and on stderr\n")
  assert log == ["ptxas on stdout\nand on stderr\n"]


@pytest.mark.skipif(_HAS_PLUGIN, reason="JAX's CUDA plugin is installed")
def test_missing_plugin_is_a_clear_error():
  with pytest.raises(RuntimeError, match=r"CUDA plugin.*\.\[cuda\]"):
    aot.mesh()
  with pytest.raises(ValueError, match="unknown target 'b200'"):
    aot.mesh("b200")


@pytest.fixture
def h200():
  if not _HAS_PLUGIN:
    pytest.skip('needs JAX\'s CUDA plugin: pip install -e ".[cuda]"')
  try:
    aot.mesh()
  except RuntimeError as e:
    pytest.skip(f"run with JAX_PLATFORMS=cpu ({e})")


def _qkv(B=2, T=4096, H=8, K=2, D=128):
  spec = jax.ShapeDtypeStruct
  return (spec((B, T, H, D), jnp.bfloat16), spec((B, T, K, D), jnp.bfloat16),
          spec((B, T, K, D), jnp.bfloat16))


@pytest.mark.parametrize("window", [None, 1024])
def test_mosaic_gpu_kernels_compile_for_h200(h200, window):
  """ptxas accepts the three Hopper kernels (named, so its reports and
  profilers tell them apart)."""
  blocks = kernels.AttentionBlockSizes(fwd="mosaic_gpu", bwd="mosaic_gpu")
  compiled, found = aot.compile_for(aot.attention_grad(blocks, window), *_qkv())
  assert "mosaic_gpu_v2" in compiled.as_text()
  by_name = {k.name: k for k in found}
  for name in ("flash_attention_fwd_mgpu", "flash_attention_dq_mgpu",
               "flash_attention_dkdv_mgpu"):
    assert by_name[name].source == "ptxas"
    assert 0 < by_name[name].registers <= 255


def test_triton_kernels_compile_for_h200(h200):
  """XLA launches the Triton kernels, within the H200's shared memory."""
  _, found = aot.compile_for(
      aot.attention_grad(kernels.AttentionBlockSizes()), *_qkv())
  by_name = {k.name: k for k in found if k.source == "xla"}
  for name in ("flash_attention_fwd", "flash_attention_dq",
               "flash_attention_dkdv"):
    assert 0 < by_name[name].shared_memory_bytes <= 232448


def test_the_command_writes_a_row_per_kernel(h200, tmp_path):
  out = tmp_path / "aot.json"
  assert aot.main(["--out", str(out), "--ops", "decode_attention"]) == 0
  report = json.loads(out.read_text())
  assert report["target"] == "h200" and report["jax"] == jax.__version__
  rows = report["rows"]
  assert {r["case"] for r in rows} == {
      f"decode_attention B{B} S{S} H{H} K{K} D{D}"
      for B, S, H, K, D in aot.bench.DECODE_SHAPES}
  assert all("error" not in r and r["source"] == "xla" for r in rows)
  assert any(r["name"].startswith("decode_attention") for r in rows)
