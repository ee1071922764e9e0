"""Checkpointer: round trips, keep-N, resume, crash safety, sharded restore."""

import os
import signal
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from agentic_rl.train import sharding as sh
from agentic_rl.train.checkpoint import Checkpointer


def _state(seed=0):
  params = {"w": jnp.arange(6.0).reshape(2, 3) + seed, "b": jnp.zeros(3)}
  return {
      "params": params,
      "opt": optax.adam(1e-3).init(params),
      "rng": jax.random.key(seed),
      "rngs": jax.random.split(jax.random.key(seed + 1), 3),
      "legacy_rng": jax.random.PRNGKey(seed + 2),
      "data": {"position": np.int64(17 + seed), "order": np.arange(5)},
      "controller": (np.float32(0.25), 3, 1.5, True),
  }


def _assert_same(a, b):
  """Equal values, tree types and leaf types; keys compared by key data."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert type(x) is type(y), (type(x), type(y))
    if hasattr(x, "dtype"):
      assert x.dtype == y.dtype
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x, y = jax.random.key_data(x), jax.random.key_data(y)
    np.testing.assert_array_equal(x, y)


def test_round_trip_with_concrete_and_abstract_targets(tmp_path):
  state = _state()
  meta = {"dataset": {"epoch": 2, "index": 17}, "kl_coef": 0.1,
          "bit_generator": np.random.default_rng(3).bit_generator.state}
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() is None
    ckpt.save(10, state, meta)
    assert ckpt.latest_step() == 10
    restored, restored_meta = ckpt.restore(target=state)
    _assert_same(restored, state)
    assert restored_meta == meta
    rng = np.random.default_rng()
    rng.bit_generator.state = restored_meta["bit_generator"]
    assert rng.integers(1 << 30) == np.random.default_rng(3).integers(1 << 30)

    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.Array) else x, state)
    restored, _ = ckpt.restore(step=10, target=abstract)
    _assert_same(restored, state)


def test_restore_without_target_keeps_values_and_key_types(tmp_path):
  state = _state(seed=4)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, state)
    restored, meta = ckpt.restore()
  assert meta == {}
  assert jax.dtypes.issubdtype(restored["rng"].dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(jax.random.key_data(restored["rngs"]),
                                jax.random.key_data(state["rngs"]))
  assert restored["legacy_rng"].dtype == jnp.uint32
  np.testing.assert_array_equal(restored["opt"][0]["mu"]["w"],
                                state["opt"][0].mu["w"])
  assert int(restored["data"]["position"]) == 21


def test_sharded_target_restores_with_its_sharding(tmp_path):
  mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1), jax.devices()[:1])
  axes = {"w": ("embed", "mlp"), "b": ("mlp",)}
  state = {"w": jnp.ones((2, 3)), "b": jnp.arange(3.0)}
  shardings = sh.logical_to_sharding(axes, mesh, shapes=state)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state)
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        state, shardings)
    restored, _ = ckpt.restore(target=target)
  chex.assert_trees_all_equal(restored, state)
  assert restored["w"].sharding == shardings["w"]


def test_keeps_the_newest_n(tmp_path):
  with Checkpointer(tmp_path, keep=2) as ckpt:
    for step in range(1, 6):
      ckpt.save(step, {"x": np.full(2, step)}, {"step": step})
    assert ckpt.all_steps() == [4, 5]
    state, meta = ckpt.restore(step=4)
    np.testing.assert_array_equal(state["x"], [4, 4])
    assert meta == {"step": 4}
    with pytest.raises(FileNotFoundError, match=r"step 3 .* \[4, 5\]"):
      ckpt.restore(step=3)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4", "5"]


def test_async_save_round_trips(tmp_path):
  state = _state(seed=1)
  ckpt = Checkpointer(tmp_path, async_save=True)
  ckpt.save(3, state, {"a": 1})
  ckpt.wait()
  restored, meta = ckpt.restore(target=state)
  ckpt.close()
  _assert_same(restored, state)
  assert meta == {"a": 1}


def test_bad_input_is_rejected(tmp_path):
  with pytest.raises(ValueError, match="keep must be a positive int"):
    Checkpointer(tmp_path, keep=0)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
      ckpt.restore()
    with pytest.raises(ValueError, match="JSON-serialisable"):
      ckpt.save(1, {"x": np.zeros(2)}, {"arr": np.zeros(2)})
    with pytest.raises(ValueError, match="meta keys must be str"):
      ckpt.save(1, {"x": np.zeros(2)}, {1: "a"})
    with pytest.raises(ValueError, match="non-negative int"):
      ckpt.save(-1, {"x": np.zeros(2)})
    ckpt.save(5, {"x": np.zeros(2)})
    with pytest.raises(ValueError, match="already has step 5"):
      ckpt.save(5, {"x": np.ones(2)})
    with pytest.raises(ValueError, match="already has step 5"):
      ckpt.save(4, {"x": np.ones(2)})


# --- resume an interrupted run ---------------------------------------------------

_DATA = np.random.default_rng(0).standard_normal((12, 4, 3)).astype(np.float32)


@jax.jit
def _noisy_sgd_step(state):
  """One step on batch ``position`` of a linear regression with RNG noise."""
  batch = jnp.asarray(_DATA)[state["position"] % 12]
  x, y = batch[:, :2], batch[:, 2]
  rng, noise_rng = jax.random.split(state["rng"])
  noise = 0.01 * jax.random.normal(noise_rng, state["w"].shape)
  grad = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(state["w"])
  return {"w": state["w"] - 0.1 * grad + noise, "rng": rng,
          "position": state["position"] + 1}


def _train(workdir, until, save_every=2):
  """Resume from ``workdir`` if it has a checkpoint; train up to ``until``."""
  state = {"w": jnp.zeros(2), "rng": jax.random.key(42),
           "position": jnp.int32(0)}
  with Checkpointer(workdir, keep=2) as ckpt:
    step = 0
    if ckpt.latest_step() is not None:
      state, meta = ckpt.restore(target=state)
      step = meta["step"]
    while step < until:
      state = _noisy_sgd_step(state)
      step += 1
      if step % save_every == 0:
        ckpt.save(step, state, {"step": step})
  return state


def test_interrupted_run_resumes_to_the_same_result(tmp_path):
  reference = _train(tmp_path / "straight", until=6)
  interrupted = tmp_path / "interrupted"
  _train(interrupted, until=3)  # "crashes" after step 3: last save at 2
  assert Checkpointer(interrupted).latest_step() == 2
  resumed = _train(interrupted, until=6)
  _assert_same(resumed, reference)


# --- crashes during a write ------------------------------------------------------

_KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import orbax.checkpoint as ocp
    from agentic_rl.train.checkpoint import Checkpointer

    ckpt = Checkpointer(sys.argv[1], keep=3)
    ckpt.save(1, {"w": np.full(4, 1.0)}, {"step": 1})

    async def killed(self):  # every file is written; die before the rename
      os.kill(os.getpid(), signal.SIGKILL)

    ocp.path.atomicity.AtomicRenameTemporaryPath.finalize = killed
    ckpt.save(2, {"w": np.full(4, 2.0)}, {"step": 2})
    """)


def test_process_killed_mid_write_leaves_previous_checkpoint(tmp_path):
  proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)],
                        capture_output=True, text=True, timeout=120,
                        check=False)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  leftovers = os.listdir(tmp_path / "checkpoints")
  assert "1" in leftovers and "2" not in leftovers
  assert any(name.startswith("2.orbax-checkpoint-tmp") for name in leftovers)

  with Checkpointer(tmp_path, keep=3) as ckpt:
    assert ckpt.latest_step() == 1
    state, meta = ckpt.restore()
    np.testing.assert_array_equal(state["w"], np.full(4, 1.0))
    assert meta == {"step": 1}
    ckpt.save(2, {"w": np.full(4, 2.0)}, {"step": 2})  # the retry works
    assert ckpt.all_steps() == [1, 2]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]


def test_leftover_partial_directory_is_ignored_and_cleaned(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"w": np.ones(3)})
  partial = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1234567"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "junk").write_bytes(b"\x00" * 10)
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 1
    state, _ = ckpt.restore()
    np.testing.assert_array_equal(state["w"], np.ones(3))
  assert not partial.exists()


# --- sharded across 8 devices, restored on another mesh -----------------------------

_RESHARD = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from agentic_rl.train import sharding as sh
    from agentic_rl.train.checkpoint import Checkpointer

    axes = {"w": ("embed", "mlp"), "rng": ("batch",)}
    def state_on(mesh):
      host = {"w": np.arange(48.0, dtype=np.float32).reshape(8, 6),
              "rng": jax.random.split(jax.random.key(0), 8)}
      shard = sh.logical_to_sharding(axes, mesh, shapes=host)
      return jax.device_put(host, shard), shard

    saved, _ = state_on(sh.make_mesh(sh.MeshConfig(2, 2, 2)))
    ckpt = Checkpointer(sys.argv[1])
    ckpt.save(1, saved)
    ckpt.wait()
    _, shard = state_on(sh.make_mesh(sh.MeshConfig(1, 8, 1)))
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        saved, shard)
    restored, _ = ckpt.restore(target=target)
    assert restored["w"].sharding == shard["w"], restored["w"].sharding
    assert restored["w"].sharding.spec == jax.sharding.PartitionSpec(
        "fsdp", "tensor")
    assert saved["w"].sharding.spec == jax.sharding.PartitionSpec(
        "fsdp", "tensor") and saved["w"].sharding.mesh.shape["data"] == 2
    np.testing.assert_array_equal(restored["w"], saved["w"])
    np.testing.assert_array_equal(jax.random.key_data(restored["rng"]),
                                  jax.random.key_data(saved["rng"]))
    print("ok")
    """)


def test_sharded_checkpoint_restores_onto_a_different_mesh(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  proc = subprocess.run([sys.executable, "-c", _RESHARD, str(tmp_path)],
                        env=env, capture_output=True, text=True, timeout=120,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip().endswith("ok")
