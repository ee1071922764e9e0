"""The kernel benchmark's machinery: timing rows, errors, table, JSON."""

import json

import jax.numpy as jnp

from agentic_rl.kernels import bench


def test_run_case_times_each_impl_and_records_failures():
  x = jnp.ones((64, 64))

  def broken(x):
    raise ValueError("no kernel\nsecond line")

  case = bench.Case("op", "fwd", "64x64", "float32",
                    {"xla": lambda x: x @ x, "pallas": jnp.tanh,
                     "cudnn": broken}, (x,), flops=2.0 * 64**3)
  rows = bench.run_case(case, repeats=3, warmup=1)
  by_impl = {r["impl"]: r for r in rows}
  assert by_impl["xla"]["speedup_vs_xla"] == 1.0
  assert by_impl["xla"]["ms"] > 0 and by_impl["xla"]["tflops"] > 0
  assert by_impl["pallas"]["speedup_vs_xla"] > 0
  assert by_impl["cudnn"]["error"] == "ValueError: no kernel"
  assert "temp_size_in_bytes" in by_impl["xla"]
  table = bench.format_table(rows)
  assert len(table.splitlines()) == 2 + len(rows)
  assert "ERROR ValueError: no kernel" in table


def test_quick_decode_run_writes_json(tmp_path):
  out = tmp_path / "bench.json"
  report = bench.main(["--out", str(out), "--quick", "--ops",
                       "decode_attention", "--repeats", "1"])
  saved = json.loads(out.read_text())
  assert saved["quick"] and saved["backend"] == report["backend"]
  impls = {r["impl"] for r in saved["rows"]}
  assert impls == {"xla", "pallas"}
  assert all("error" not in r and r["gbps"] > 0 for r in saved["rows"])
