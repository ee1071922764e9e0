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


@pytest.mark.slow
def test_a_run_exports_and_transformers_reproduces_its_logits(tmp_path):
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  cfg = default.get_config("tiny")
  cfg.stages = ("sft",)
  cfg.sft.steps = 2
  cfg.export.deploy_check = "on"
  workdir, out = str(tmp_path / "run"), str(tmp_path / "hf")
  summary = loop.train(cfg, workdir)
  # The run ends with the deployment check (the tiny config's default is off).
  assert summary["shift/deploy_tokens"] > 0
  assert summary["shift/deploy_logprob_diff_max"] <= 1e-5
  done = subprocess.run([sys.executable, "-m", "experiments.export", f"--workdir={workdir}",
                         f"--out={out}", "--check", "--check_prompts=4"], cwd=_ROOT,
                        capture_output=True, text=True,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
  assert done.returncode == 0, done.stderr
  assert "LlamaForCausalLM" in done.stdout
  # The deployed model's per-token log-probs on the run's own rollouts.
  check = json.loads((tmp_path / "hf" / "deploy_check.json").read_text())
  assert check["shift/deploy_tokens"] > 0 and check["shift/deploy_logprob_diff_max"] <= 1e-5
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


def test_deploy_check_modes_are_validated(monkeypatch):
  from agentic_rl.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from agentic_rl.train import export as export_lib  # pylint: disable=g-import-not-at-top
  cfg = default.get_config("tiny")
  cfg.export.deploy_check = "always"
  with pytest.raises(config_lib.ConfigError, match="deploy_check is 'always'"):
    config_lib.validate(cfg)
  cfg.export.deploy_check = "on"
  monkeypatch.setattr(export_lib, "transformers_available", lambda: False)
  with pytest.raises(config_lib.ConfigError, match="needs torch and transformers"):
    config_lib.validate(cfg)
  cfg.export.deploy_check = "auto"
  config_lib.validate(cfg)  # auto without transformers: no check, no error


def test_library_experiments_import_beside_the_trainer():
  """export, ablate and long_horizon are imported as libraries (tests,
  notebooks): they define their flags only when run, so no flag clashes
  with the trainer's (--workdir) or with each other's (--out)."""
  done = subprocess.run(
      [sys.executable, "-c", "import experiments.train, experiments.export, "
       "experiments.ablate, experiments.long_horizon"], cwd=_ROOT, capture_output=True,
      text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
  assert done.returncode == 0, done.stderr
