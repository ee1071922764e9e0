"""A rollout with its rows split over devices equals the one-device rollout,
with each prompt's prefill shared by its rows on a device or not."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from agentic_rl import model as model_lib
from agentic_rl import rollout

_WORKER = os.path.join(os.path.dirname(__file__), "rollout_devices.py")


@pytest.mark.slow
def test_rows_split_over_four_devices_match_one_device():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
             + " --xla_force_host_platform_device_count=4")
  proc = subprocess.run([sys.executable, _WORKER], env=env, capture_output=True,
                        text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  one = out["one_device"]
  assert one["devices"] == 1
  # Real multi-turn episodes: both scripted tool calls ran in every row.
  assert one["num_tool_calls_B"] == [2] * 8
  assert 0 < out["unfinished_after_40"]  # the partial rollout did carry over
  assert out["loop_row_sharding"] == str(P(("data", "fsdp")))
  # The loop's engine (group size 1, prompts repeated) prefills every row;
  # the others prefill each prompt once per device holding its rows.
  for name, ref in (("partial_four_devices", "one_device"), ("loop_engine", "one_device"),
                    ("group_split_four_devices", "loop_engine_groups_of_4"),
                    ("group_split_shared_decode", "loop_engine_groups_of_4")):
    got, want = out[name], out[ref]
    assert got["devices"] == 4, name
    for field in ("tokens_BxT", "loss_mask_BxT", "version_BxT", "reward_B",
                  "done_B", "truncated_B", "num_tool_calls_B"):
      np.testing.assert_array_equal(got[field], want[field], err_msg=f"{name}/{field}")
    # Only the matmul batch (rows per device) differs: float rounding.
    np.testing.assert_allclose(got["behaviour_logp_BxT"], want["behaviour_logp_BxT"],
                               atol=1e-5, err_msg=name)
  assert out["group_split_four_devices"]["num_tool_calls_B"] == [2] * 8


def test_row_sharding_must_divide_the_batch():
  config = model_lib.TransformerConfig.tiny(vocab_size=64)
  sampling = rollout.SamplingConfig(max_new_tokens_per_turn=4, max_turns=1,
                                    max_total_tokens=16)
  mesh = jax.sharding.AbstractMesh((3,), ("rows",))
  with pytest.raises(ValueError, match="does not split into the 3 row shards"):
    rollout.RolloutEngine(config, sampling, None, batch_size=8,
                          row_sharding=NamedSharding(mesh, P("rows")))
  # A divisible batch is accepted.
  rollout.RolloutEngine(config, sampling, None, batch_size=6,
                        row_sharding=NamedSharding(mesh, P("rows")))
