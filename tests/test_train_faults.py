"""Faults a user meets: a changed config on resume, signals, runaway updates."""

import contextlib
import io
import os
import signal
import subprocess
import sys
import time

import pytest

from agentic_rl.train import checkpoint as checkpoint_lib
from agentic_rl.train import config as config_lib
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from experiments.configs import default

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sft_only(steps=4, **sft):
  cfg = default.get_config("all,tiny")
  cfg.stages = ("sft",)
  cfg.sft.update(steps=steps, **sft)
  return cfg


def _records(workdir):
  return metrics_lib.read_metrics(os.path.join(str(workdir), "metrics.jsonl"))


@pytest.mark.slow
def test_resume_refuses_a_config_that_changes_the_checkpoint(tmp_path):
  cfg = _sft_only(steps=2)
  first = loop.train(cfg, str(tmp_path), stop_after=1)
  assert first["stopped"] == "stop_after"
  changed = _sft_only(steps=2)
  changed.model.d_model = 64
  changed.seed = 7
  with pytest.raises(config_lib.ConfigError) as e:
    loop.train(changed, str(tmp_path))
  assert "config.model.d_model: 32 -> 64" in str(e.value)
  assert "config.seed: 0 -> 7" in str(e.value)
  # A longer stage and another eval cadence are allowed, and said so; the
  # run goes on where it stopped, and the wall time adds up.
  longer = _sft_only(steps=3)
  longer.eval.every = 5
  console = io.StringIO()
  with contextlib.redirect_stderr(console):
    summary = loop.train(longer, str(tmp_path))
  assert "config.sft.steps: 2 -> 3 (allowed on resume)" in console.getvalue()
  assert summary["steps"] == 3 and [r["step"] for r in _records(tmp_path)] == [0, 1, 2]
  assert summary["wall_s"] == pytest.approx(first["wall_s"] + summary["wall_s_last"])


def test_non_finite_updates_halt_the_run_with_a_checkpoint(tmp_path):
  cfg = _sft_only(steps=6, learning_rate=1e38, warmup_steps=0)
  cfg.guards.max_consecutive_skips = 2
  with pytest.raises(loop.TrainingHalted, match="2 consecutive steps of config.sft"):
    loop.train(cfg, str(tmp_path))
  records = _records(tmp_path)
  assert [r["learner/skipped"] for r in records] == [0, 1, 1]
  assert records[-1]["learner/skipped_total"] == 2
  assert records[-1]["alarm/learner/skipped_consecutive"] == 1
  assert checkpoint_lib.Checkpointer(str(tmp_path)).latest_step() == 3


@pytest.mark.slow
def test_a_policy_collapsed_to_uniform_raises_an_alarm(tmp_path):
  console = io.StringIO()
  with contextlib.redirect_stderr(console):
    loop.train(_sft_only(steps=3, learning_rate=1e4, warmup_steps=0), str(tmp_path))
  records = _records(tmp_path)
  assert records[0]["learner/uniform_policy"] == 0
  assert all(r["learner/uniform_policy"] == 1 and r["learner/grad_norm"] == 0
             for r in records[1:])
  assert "ALARM learner/uniform_policy=1" in console.getvalue()


@pytest.mark.parametrize("sig", [signal.SIGTERM,
                                 pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_ends_the_run_after_the_step_with_a_checkpoint(sig, tmp_path):
  workdir = str(tmp_path / "run")
  proc = subprocess.Popen(
      [sys.executable, "-m", "experiments.train",
       "--config=experiments/configs/default.py:tiny", f"--workdir={workdir}",
       "--config.sft.steps=200", "--config.checkpoint.every=1000"],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + 240
  while time.monotonic() < deadline and proc.poll() is None:
    if os.path.exists(metrics) and len(_records(workdir)) >= 2:
      break
    time.sleep(0.5)
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=240)
  assert proc.returncode == 128 + sig, err[-2000:]
  assert "Traceback" not in err
  step = len(_records(workdir))
  assert f"stopped ({signal.Signals(sig).name}) at step {step}" in err
  assert checkpoint_lib.Checkpointer(workdir).latest_step() == step
