"""Two processes on loopback, joined by ``jax.distributed.initialize``, train
the toy network over one global mesh, match a single process, and save and
restore one sharded checkpoint together."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import sharding_toy as toy
from agentic_rl.train import distributed
from agentic_rl.train import sharding as sh

N_PROC, N_STEPS, TIMEOUT_S = 2, 2, 180


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_workers(workdir) -> list[dict]:
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, toy.__file__, "worker", str(pid), str(N_PROC),
       str(port), str(N_STEPS), str(workdir)],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for pid in range(N_PROC)]
  results = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=TIMEOUT_S)
      assert p.returncode == 0, err[-3000:]
      results.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return results


def test_two_processes_match_one_process_and_checkpoint_together(tmp_path):
  if "jax_cpu_collectives_implementation" not in jax.config.values:
    pytest.skip("this jax has no CPU cross-process collectives option")
  results = _run_workers(tmp_path)
  mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1), jax.devices()[:1])
  ref_losses, ref_params = toy.run(mesh, N_STEPS)
  ref_norm = sum(float(np.sum(np.asarray(x) ** 2))
                 for x in jax.tree.leaves(ref_params))
  assert [r["pid"] for r in results] == list(range(N_PROC))
  for r in results:
    assert r["process_count"] == N_PROC
    assert r["devices"] == 2 * N_PROC  # one global mesh over both processes
    np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5)
    np.testing.assert_allclose(r["param_sq_norm"], ref_norm, rtol=1e-5)
    assert r["restored_sq_norm"] == r["param_sq_norm"]
    assert r["restored_losses"] == r["losses"]
  assert os.listdir(tmp_path / "checkpoints") == [str(N_STEPS)]


def test_maybe_initialize_is_a_no_op_without_arguments():
  assert distributed.maybe_initialize() is False
  assert jax.process_count() == 1


@pytest.mark.parametrize("args, match", [
    (("127.0.0.1:1234", 2, None), r"missing \['process_id'\]"),
    ((None, 2, 0), r"missing \['coordinator_address'\]"),
    (("127.0.0.1", 2, 0), "'host:port'"),
    (("127.0.0.1:1234", 0, 0), "num_processes must be >= 1"),
    (("127.0.0.1:1234", 2, 2), r"process_id must be in \[0, 2\)"),
])
def test_maybe_initialize_rejects_bad_arguments(args, match):
  with pytest.raises(ValueError, match=match):
    distributed.maybe_initialize(*args)
