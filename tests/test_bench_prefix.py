"""The prefix-sharing benchmark runs end to end on a tiny shape and writes its JSON."""

import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_tiny_run_writes_json(tmp_path):
  out = tmp_path / "bench_prefix.json"
  subprocess.run(
      [sys.executable, "-m", "experiments.bench_prefix", f"--out={out}",
       "--prompt_len=16", "--new_tokens=4", "--groups=4", "--prompts=2", "--d_model=32",
       "--n_layers=1", "--n_heads=2", "--n_kv_heads=1", "--mlp_dim=64", "--vocab=64",
       "--repeats=2", "--calls=1", "--warmup=0"],
      cwd=_ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), check=True,
      capture_output=True, text=True, timeout=600)
  result = json.loads(out.read_text())
  assert result["config"]["groups"] == [4] and result["config"]["batch_rows"] == {"4": 8}
  for part, names in (("rollout", {"shared", "shared_prefill", "plain"}),
                      ("learner", {"shared", "plain"})):
    assert set(result[f"{part}_speedup"]) == {"4"}
    assert result[f"{part}_speedup"]["4"] > 0
    times = result[f"{part}_s"]["4"]
    assert set(times) == names
    assert all(0 < t["min"] <= t["median"] for t in times.values())
  assert result["rollout_prefill_only_speedup"]["4"] > 0
  # The contenders compute the same: the tokens (the shared decode's
  # log-probs to rounding), the learner's log-probs and gradient norm.
  assert result["rollout_tokens_equal"]["4"]["shared_prefill"]
  assert result["rollout_rows_differing"]["4"]["shared_prefill"] == 0
  assert result["rollout_logp_max_abs_diff"]["4"] < 1e-5
  assert result["learner_logp_max_abs_diff"]["4"] < 1e-5
  assert result["learner_grad_norm_rel_diff"]["4"] < 1e-5
  assert result["prefix_len"] == {"4": 16}  # the whole prompt, a bucket
  assert result["model_params"] > 0
