"""The whole trainer on 2, 4 and 8 simulated devices and on two processes:
every layout gives the one-device run's metrics."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import train_devices
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORKER = os.path.join(os.path.dirname(__file__), "train_devices.py")
# Float noise itself (|learner - behaviour| log-probs, ~1e-6), not a result.
_NOISE = ("shift/logprob_mismatch", "shift/prob_mismatch", "shift/kl_behaviour_learner")


def _env(devices: int) -> dict[str, str]:
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                         + f" --xla_force_host_platform_device_count={devices}"),
              PYTHONPATH=os.pathsep.join([ROOT, os.path.dirname(__file__)]))


def _assert_same_metrics(got_dir, want_dir):
  got, want = (metrics_lib.read_metrics(os.path.join(d, "metrics.jsonl"))
               for d in (got_dir, want_dir))
  assert len(got) == len(want) == 7
  for g, w in zip(got, want):
    assert g.keys() == w.keys()
    for k, v in w.items():
      if k.startswith(("perf/",) + _NOISE) or k == "wall_time":
        continue
      np.testing.assert_allclose(g[k], v, rtol=1e-5, atol=1e-6, err_msg=f"{k} at {w['step']}")
  rl = [r for r in want if r["stage"] == 1]
  assert all(r["learner/grad_norm"] > 0 for r in rl[1:])  # the RL updates move


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("one_device"))
  mesh = jax.devices()[:1]
  assert len(mesh) == 1
  loop.train(train_devices.config(), workdir)
  return workdir


def _run_layouts(tmp_path, devices, layouts, *flags):
  out = subprocess.run([sys.executable, _WORKER, str(tmp_path), *layouts, *flags],
                       env=_env(devices),
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("devices, layouts", [
    (2, ("fsdp=2",)),
    pytest.param(4, ("data=2,fsdp=2",), marks=pytest.mark.slow),
    pytest.param(2, ("data=2", "tensor=2"), marks=pytest.mark.slow),
    pytest.param(4, ("data=4", "fsdp=4", "data=2,tensor=2"), marks=pytest.mark.slow),
    pytest.param(8, ("data=2,fsdp=2,tensor=2", "fsdp=8"), marks=pytest.mark.slow),
])
def test_trainer_on_simulated_devices_matches_one_device(devices, layouts, one_device, tmp_path):
  for workdir in _run_layouts(tmp_path, devices, layouts):
    _assert_same_metrics(workdir, one_device)


@pytest.mark.slow  # resume is bit-exact on one device in the default run
def test_a_run_resumed_inside_rl_on_two_devices_matches_one_device(one_device, tmp_path):
  """Stopped in the RL stage and resumed from its checkpoint on a mesh: the
  restored state (the PRNG key, the stale actor's parameters) runs beside the
  sharded parameters, and the metrics are the uninterrupted run's."""
  stop = train_devices.config().sft.steps + 1
  for workdir in _run_layouts(tmp_path, 2, ("data=2",), f"--stop_after={stop}"):
    _assert_same_metrics(workdir, one_device)


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_of_experiments_train_match_one_process(one_device, tmp_path):
  if "jax_cpu_collectives_implementation" not in jax.config.values:
    pytest.skip("this jax has no CPU cross-process collectives option")
  port, workdir = _free_port(), str(tmp_path / "run")
  overrides = ["--config.rl.updates_per_batch=2", "--config.rl.max_staleness=2",
               "--config.rl.kl_coef=0.05", "--config.rl.kl_estimator=k1", "--config.mesh.data=2"]
  procs = [subprocess.Popen(
      [sys.executable, "-m", "experiments.train",
       "--config=experiments/configs/default.py:tiny", f"--workdir={workdir}", *overrides,
       f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
       f"--process_id={pid}"],
      env=_env(1), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for pid in range(2)]
  try:
    for p in procs:
      _, err = p.communicate(timeout=900)
      assert p.returncode == 0, err[-3000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  _assert_same_metrics(workdir, one_device)
