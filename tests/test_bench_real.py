"""The real-model benchmark runs every figure on a tiny random Llama checkpoint
(tiny sizes, one round) and returns a complete JSON record."""

import importlib.util
import json
import math

import pytest


def _tiny_llama(path) -> None:
  """A random 2-layer Llama (hidden 64, 4 query / 2 key-value heads of 16)
  with a small BPE tokenizer, saved as an HF checkpoint directory."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from experiments import tiny_checkpoint  # pylint: disable=import-outside-toplevel
  size = tiny_checkpoint.write_tokenizer("llama", str(path), vocab_size=64)
  tiny_checkpoint.write_model("llama", str(path), size)


def _positive(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow  # a whole benchmark run
def test_tiny_run_has_every_figure(tmp_path):
  _tiny_llama(tmp_path)
  from experiments import bench_real  # pylint: disable=import-outside-toplevel
  with_trl = importlib.util.find_spec("trl") is not None
  cfg = bench_real.Config(
      model=str(tmp_path), rounds=1, matmul_size=64, rollout_batches=(2, 4),
      rollout_prompt_len=8, rollout_new_tokens=4, learner_batch=4, learner_seq_len=16,
      learner_prompt_len=4, learner_micro_batches=2, e2e_prompts=2, e2e_samples=2,
      e2e_new_tokens=4, e2e_prompt_len=6, trl="auto" if with_trl else "off")
  result = json.loads(json.dumps(bench_real.run(cfg)))  # JSON-serialisable
  bench_real.print_table(result)

  assert result["logits_max_abs_diff_vs_torch"] < 1e-4
  bf16 = result["bf16"]
  peak = result["peak_gflops"]
  assert set(peak) == {"xla_f32", "torch_f32", "xla_bf16", "torch_bf16"}
  for name, value in peak.items():
    assert _positive(value) if bf16 or name.endswith("f32") else value is None, name
  assert set(result["rollout_vs_generate"]) == {"2", "4"}
  assert all(_positive(v) for v in result["rollout_vs_generate"].values())
  for b in ("2", "4"):
    assert _positive(result["rollout"][b]["engine_tokens_per_s"])
    assert _positive(result["rollout"][b]["generate_tokens_per_s"])
  for key in ("learner_vs_torch", "learner_peak_frac"):
    assert _positive(result[key]), key
  for key in ("learner_vs_torch_bf16", "learner_peak_frac_bf16"):
    assert _positive(result[key]) if bf16 else result[key] is None, key
  # Both learners score the batch alike (the torch step's first forward).
  assert result["learner"]["logp_max_abs_diff_vs_torch"]["f32"] < 1e-4
  assert _positive(result["e2e"]["ours_s"])
  if with_trl:
    assert result["e2e_error"] is None and _positive(result["e2e_vs_trl"])
  else:
    assert result["e2e_vs_trl"] is None and result["e2e_error"]
  # The trainer's timed iteration holds its own rollout and update.
  trainer = result["trainer"]
  assert _positive(result["trainer_overhead"])
  fastest = trainer["fastest"]
  assert fastest["perf/step_s"] >= fastest["perf/rollout_s"] + fastest["perf/learner_s"]
  assert len(trainer["iteration_s"]) == 1 and trainer["rows"] == 4
  assert _positive(trainer["rollout_alone_s"]) and _positive(trainer["step_alone_s"])
  for key in ("machine", "date", "jax", "torch", "command", "figure_seconds"):
    assert result[key], key
  assert set(result["figure_seconds"]) >= set(bench_real.FIGURES)


def test_only_runs_the_named_figures(tmp_path):
  _tiny_llama(tmp_path)
  from experiments import bench_real  # pylint: disable=import-outside-toplevel
  cfg = bench_real.Config(model=str(tmp_path), rounds=1, only=("peak",), matmul_size=32,
                          rollout_batches=(2,), rollout_prompt_len=4)
  result = bench_real.run(cfg)
  assert _positive(result["peak_gflops"]["xla_f32"])
  for key in ("rollout_vs_generate", "learner_vs_torch", "learner_peak_frac", "e2e_vs_trl",
              "trainer_overhead"):
    assert key in result and result[key] is None, key
  with pytest.raises(ValueError, match="unknown figures"):
    bench_real.run(bench_real.Config(model=str(tmp_path), only=("nope",)))


def test_rollout_in_bfloat16(tmp_path):
  # --rollout_dtype=bfloat16: our engine computes in bfloat16, generate runs
  # the model cast to it; both produce their tokens.
  _tiny_llama(tmp_path)
  from experiments import bench_real  # pylint: disable=import-outside-toplevel
  cfg = bench_real.Config(model=str(tmp_path), rounds=1, only=("rollout",),
                          rollout_batches=(2,), rollout_prompt_len=4, rollout_new_tokens=3,
                          rollout_dtype="bfloat16")
  result = bench_real.run(cfg)
  assert result["config"]["rollout_dtype"] == "bfloat16"
  assert _positive(result["rollout"]["2"]["engine_tokens_per_s"])
  assert _positive(result["rollout_vs_generate"]["2"])
  with pytest.raises(ValueError, match="rollout_dtype"):
    bench_real.Config(model=str(tmp_path), rollout_dtype="float16").validate()
