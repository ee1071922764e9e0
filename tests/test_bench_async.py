"""The asynchronous-actor benchmark runs and writes its JSON."""

import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # four short training runs
def test_tiny_run_writes_json(tmp_path):
  out = tmp_path / "bench.json"
  subprocess.run(
      [sys.executable, "-m", "experiments.bench_async", f"--out={out}", "--iterations=4",
       "--staleness=1", "--sft_steps=2", "--median_ms=1"],
      cwd=_ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), check=True,
      capture_output=True, text=True, timeout=900)
  result = json.loads(out.read_text())
  assert set(result["runs"]) == {"sync", "async_1"} and set(result["speedup"]) == {"1"}
  sync, async_ = result["runs"]["sync"], result["runs"]["async_1"]
  assert sync["learner_tokens_per_s"] > 0 and result["speedup"]["1"] > 0
  assert sync["staleness_max"] == 0 and async_["staleness_max"] <= 1
  assert sync["iterations_timed"] == async_["iterations_timed"] == 2
