"""The learner step gives the same losses on 1 device and on 8 simulated ones."""

import json
import os
import subprocess
import sys

import numpy as np

_WORKER = os.path.join(os.path.dirname(__file__), "learner_devices.py")


def _losses(*mesh):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, _WORKER, *map(str, mesh)], env=env,
                       capture_output=True, text=True, timeout=600, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_eight_devices_match_one_device():
  one = _losses(1, 1, 1)
  assert one["devices"] == 1
  for mesh in [(2, 2, 2), (8, 1, 1)]:
    many = _losses(*mesh)
    assert many["devices"] == 8
    np.testing.assert_allclose(many["losses"], one["losses"], rtol=1e-5)
  # The steps trained: the loss moved.
  assert one["losses"][0] != one["losses"][-1]
