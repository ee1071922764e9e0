"""The learner step gives the same losses on 1 device and on 8 simulated ones;
on FSDP its layer scan gathers each layer's weights and otherwise
communicates no more than on data parallelism."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

_WORKER = os.path.join(os.path.dirname(__file__), "learner_devices.py")


def _worker(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
             + " --xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, _WORKER, *map(str, args)], env=env,
                       capture_output=True, text=True, timeout=600, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_eight_devices_match_one_device():
  one = _worker(1, 1, 1)
  assert one["devices"] == 1
  for mesh in [(2, 2, 2), (8, 1, 1)]:
    many = _worker(*mesh)
    assert many["devices"] == 8
    np.testing.assert_allclose(many["losses"], one["losses"], rtol=1e-5)
  # The steps trained: the loss moved.
  assert one["losses"][0] != one["losses"][-1]


def test_fsdp_layer_scan_gathers_each_layer_and_reduces_only_gradients():
  # Without the gathers (learner.gathered_params) the activations shard over
  # embed and the scan all-reduces its projections' partial sums: 8
  # collectives in the loop bodies here, against 1 (the layer's gradients).
  # The layer's 9 weights are all-gathered inside the scan (ZeRO-3), not
  # all at once before it.
  fsdp = _worker(1, 2, 1, "collectives")["loop_collectives"]
  data = _worker(2, 1, 1, "collectives")["loop_collectives"]
  assert fsdp.pop("all-gather", 0) == 9
  assert fsdp == data == {"all-reduce": 1}
