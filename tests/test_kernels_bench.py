"""The kernel benchmark's machinery: timing rows, errors, table, JSON."""

import dataclasses
import json

import jax.numpy as jnp
import pytest

from experiments import bench_kernels as bench


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


def _quick_decode_case():
  [case] = bench.cases(quick=True, ops={"decode_attention"})
  return case


def test_tune_keeps_the_fastest_tiles_and_records_failures():
  case = _quick_decode_case()
  result = bench.tune(case, repeats=1, warmup=0, deadline=float("inf"),
                      grid={"block_k": (24, 32),
                            ("num_splits", "num_warps"): ((2, 2),)})
  trials = result["trials"]
  # The defaults, then each candidate once (block_k=24 is not a power of 2);
  # a tuple of fields is set jointly.
  assert [t["blocks"]["block_k"] for t in trials[:3]] == [128, 24, 32]
  assert len(trials) == 4
  assert (trials[3]["blocks"]["num_splits"], trials[3]["blocks"]["num_warps"]
          ) == (2, 2)
  assert "error" in trials[1] and "ms" not in trials[1]
  timed = [t for t in trials if "ms" in t]
  fastest = min(timed, key=lambda t: t["ms"])
  assert result["best_ms"] == fastest["ms"]
  assert result["best_blocks"] == fastest["blocks"]
  assert result["default_ms"] == trials[0]["ms"]


def test_tune_run_writes_json_and_stops_at_the_deadline(tmp_path):
  out = tmp_path / "tune.json"
  bench.main(["--out", str(out), "--quick", "--ops", "decode_attention",
              "--tune", "--max_seconds", "0", "--repeats", "1"])
  [result] = json.loads(out.read_text())["tuning"]
  assert len(result["trials"]) == 1  # past the deadline: the defaults only
  assert result["best_blocks"] == result["trials"][0]["blocks"]


def test_tune_starts_from_the_faster_of_defaults_and_start():
  case = _quick_decode_case()
  bad_start = case.blocks(block_k=24)  # fails: scores infinity
  result = bench.tune(case, repeats=1, warmup=0, deadline=0.0, start=bad_start)
  assert len(result["trials"]) == 2 and "error" in result["trials"][1]
  assert result["best_blocks"] == result["trials"][0]["blocks"]
  assert result["best_ms"] == result["default_ms"]


def test_quick_run_of_the_mosaic_kernels_writes_json(tmp_path):
  """--backend mosaic_tpu runs the TPU kernels (interpreted on CPU) with
  their own tile sizes."""
  out = tmp_path / "bench.json"
  bench.main(["--out", str(out), "--quick", "--ops", "decode_attention",
              "--repeats", "1", "--backend", "mosaic_tpu"])
  saved = json.loads(out.read_text())
  assert saved["pallas_backend"] == "mosaic_tpu"
  [pallas] = [r for r in saved["rows"] if r["impl"] == "pallas"]
  assert "error" not in pallas and pallas["ms"] > 0
  [case] = bench.cases(quick=True, ops={"decode_attention"},
                       backend="mosaic_tpu")
  assert case.blocks is bench.kernels.TpuDecodeBlockSizes


@pytest.mark.parametrize("family,grids", [("triton", bench.TUNE_GRIDS),
                                          ("mosaic_tpu", bench.TPU_TUNE_GRIDS)])
def test_tune_grids_name_tile_fields(family, grids):
  """Every searched field exists, and joint candidates set every field."""
  for (op, _), grid in grids.items():
    fields = {f.name for f in dataclasses.fields(bench._BLOCKS[family][op])}
    for field, values in grid.items():
      names = field if isinstance(field, tuple) else (field,)
      assert set(names) <= fields, (op, names)
      if isinstance(field, tuple):
        assert all(len(v) == len(names) for v in values), (op, names)


def test_ab_times_each_value_in_every_round(tmp_path):
  out = tmp_path / "ab.json"
  bench.main(["--out", str(out), "--quick", "--ops", "decode_attention",
              "--repeats", "1", "--ab", "block_k=24,32", "--rounds", "2"])
  [result] = json.loads(out.read_text())["ab"]
  bad, good = result["runs"]
  assert result["field"] == "block_k"
  assert bad["value"] == 24 and "error" in bad and "ms" not in bad
  assert good["value"] == 32 and len(good["ms"]) == 2
  assert good["median_ms"] == pytest.approx(sum(good["ms"]) / 2)


def test_ab_rejects_a_malformed_or_unknown_field():
  with pytest.raises(ValueError, match="FIELD=V1"):
    bench.parse_ab("block_k")
  with pytest.raises(ValueError, match="has no field 'num_stages_fwd'"):
    bench.ab(_quick_decode_case(), "num_stages_fwd", (2, 3), 1, 0, 1)


def test_ab_holds_the_base_fields(tmp_path):
  """--ab_base changes the other fields of every value: a bad base tile makes
  both values fail."""
  out = tmp_path / "ab.json"
  bench.main(["--out", str(out), "--quick", "--ops", "decode_attention",
              "--repeats", "1", "--ab", "num_splits=1,2", "--rounds", "1",
              "--ab_base", '{"block_k": 24}'])
  [result] = json.loads(out.read_text())["ab"]
  assert result["base"] == {"block_k": 24}
  assert [("error" in r) for r in result["runs"]] == [True, True]
  with pytest.raises(ValueError, match="has no field 'nope'"):
    bench.ab(_quick_decode_case(), "block_k", (32,), 1, 0, 1, {"nope": 1})
