"""The learner benchmark runs end to end on a tiny shape and writes its JSON."""

import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_run_writes_json(tmp_path):
  out = tmp_path / "bench_learner.json"
  subprocess.run(
      [sys.executable, "-m", "experiments.bench_learner", f"--out={out}",
       "--batch=4", "--seq_len=16", "--prompt_len=4", "--d_model=32",
       "--n_layers=1", "--n_heads=2", "--mlp_dim=64", "--vocab=64",
       "--repeats=2", "--warmup=0", "--cpu_devices=2", "--attn_impl=xla_vjp"],
      cwd=_ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), check=True,
      capture_output=True, text=True, timeout=600)
  result = json.loads(out.read_text())
  assert result["devices"] == 2
  assert result["config"]["batch"] == 4 and result["config"]["seq_len"] == 16
  assert result["config"]["attn_impl"] == "xla_vjp"
  for layout in ("data", "fsdp"):
    assert set(result["ours_ms"][layout]) == {"min", "median"}
    assert result["ours_ms"][layout]["min"] > 0
  assert result["ours_fsdp_over_data"] > 0
  assert result["model_params"] > 0
  if "tunix_skipped" in result:
    assert "tunix_ms" not in result and "speedup_vs_tunix" not in result
  else:
    assert set(result["speedup_vs_tunix"]) == {"data", "fsdp"}
    assert result["logp_max_abs_diff_vs_tunix_data"] < 1e-4
