"""A trained run exported as a Hugging Face checkpoint: transformers loads
it and gives the learner's logits."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from agentic_rl import model as model_lib
from agentic_rl.train import checkpoint, loop
from agentic_rl.train import run as run_lib
from experiments.configs import default

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_run_exports_and_transformers_reproduces_its_logits(tmp_path):
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  cfg = default.get_config("tiny")
  cfg.stages = ("sft",)
  cfg.sft.steps = 2
  workdir, out = str(tmp_path / "run"), str(tmp_path / "hf")
  loop.train(cfg, workdir)
  done = subprocess.run([sys.executable, "-m", "experiments.export", f"--workdir={workdir}",
                         f"--out={out}", "--check", "--check_prompts=4"], cwd=_ROOT,
                        capture_output=True, text=True,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
  assert done.returncode == 0, done.stderr
  assert "LlamaForCausalLM" in done.stdout
  # The deployed model's per-token log-probs on the run's own rollouts.
  check = json.loads((tmp_path / "hf" / "deploy_check.json").read_text())
  assert check["tokens"] > 0 and check["shift/deploy_logprob_diff_max"] <= 1e-5
  net = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  config = run_lib.build(cfg).model_config  # the run's own model
  like = jax.eval_shape(lambda: model_lib.init_params(config, jax.random.key(0)))
  params = checkpoint.load_params(workdir, like=like)
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 16))
  with torch.no_grad():
    theirs = net(torch.tensor(tokens)).logits.numpy()
  with jax.default_matmul_precision("float32"):
    ours = np.asarray(model_lib.forward(params, tokens, config))
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)


def test_export_refuses_a_directory_that_is_not_a_run(tmp_path):
  done = subprocess.run([sys.executable, "-m", "experiments.export", f"--workdir={tmp_path}",
                         f"--out={tmp_path / 'hf'}"], cwd=_ROOT, capture_output=True,
                        text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
  assert done.returncode != 0 and "no config.json" in done.stderr
