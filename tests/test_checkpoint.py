"""Checkpointer: round trips, keep-N, resume, crash safety, file errors,
sharded restore."""

import errno
import logging
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
import orbax.checkpoint as ocp
import pytest

from agentic_rl.train import checkpoint as checkpoint_lib
from agentic_rl.train import sharding as sh
from agentic_rl.train.checkpoint import Checkpointer, CheckpointWriteError


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


# --- file errors: a full disk, a file-size limit ----------------------------------


@pytest.fixture
def full_disk(monkeypatch):
  """Makes orbax's JSON item writes (``meta``, ``typed_keys``, run in orbax's
  save threads) fail with ENOSPC while ``full_disk["on"]`` is true."""
  switch = {"on": False}
  original = ocp.JsonCheckpointHandler._save_fn

  async def save_fn(self, x, directory):
    if switch["on"]:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC),
                    os.fspath(directory / "metadata"))
    return await original(self, x, directory)

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", save_fn)
  return switch


def _orbax_errors(caplog):
  return [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_full_disk_raises_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, full_disk, caplog):
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"w": np.full(3, 1.0)}, {"step": 1})
    full_disk["on"] = True
    with pytest.raises(CheckpointWriteError) as raised:
      ckpt.save(2, {"w": np.full(3, 2.0)}, {"step": 2})
    error = raised.value
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    message = str(error)
    assert "\n" not in message
    assert str(tmp_path / "checkpoints") in message
    assert "checkpoint 2" in message and "No space left on device" in message
    assert "checkpoint 1 is intact" in message
    assert error.__cause__ is None and error.__suppress_context__
    assert not _orbax_errors(caplog)
    # The partial step is gone; step 1 is whole.
    assert os.listdir(tmp_path / "checkpoints") == ["1"]
    assert ckpt.all_steps() == [1]
    state, meta = ckpt.restore()
    np.testing.assert_array_equal(state["w"], np.full(3, 1.0))
    assert meta == {"step": 1}
    full_disk["on"] = False  # space freed: the same checkpointer goes on
    ckpt.save(3, {"w": np.full(3, 3.0)}, {"step": 3})
    assert ckpt.all_steps() == [1, 3]


def test_full_disk_in_an_async_save_is_raised_once(tmp_path, full_disk,
                                                   caplog):
  ckpt = Checkpointer(tmp_path, async_save=True)
  ckpt.save(1, {"w": np.ones(3)})
  ckpt.wait()
  full_disk["on"] = True
  with pytest.raises(CheckpointWriteError, match="checkpoint 2 .*No space"):
    ckpt.save(2, {"w": np.zeros(3)})
    ckpt.wait()
  ckpt.close()  # already reported: not raised again
  assert not _orbax_errors(caplog)
  assert os.listdir(tmp_path / "checkpoints") == ["1"]


def test_unreported_async_failure_is_raised_by_close(tmp_path, full_disk):
  ckpt = Checkpointer(tmp_path, async_save=True)
  full_disk["on"] = True
  try:
    ckpt.save(1, {"w": np.ones(3)})
  except CheckpointWriteError:
    pytest.skip("the write failed before save returned")
  with pytest.raises(CheckpointWriteError, match="checkpoint 1 .*no earlier"):
    ckpt.close()


def _record(pathname, exc):
  return logging.LogRecord(
      "absl", logging.ERROR, pathname, 387,
      "[thread=%s] _SignalingThread.run() raised an exception: %s",
      ("write_metadata_after_commits", exc), None)


def test_log_filter_drops_only_orbax_reports_of_a_failed_write():
  orbax_file = os.path.join(os.path.dirname(ocp.__file__), "_src", "future.py")
  vanished = ValueError(
      'NOT_FOUND: Error writing "w/0" in OCDBT database at local file '
      '"/ckpt/2.orbax-checkpoint-tmp/state/ocdbt.process_0/"')
  full = ValueError("... No space left on device [os_error_code='28']")
  other = ValueError("shape mismatch")
  keep = checkpoint_lib._OrbaxWriteFailureFilter().filter
  assert not keep(_record(orbax_file, vanished))
  assert not keep(_record(orbax_file, full))
  assert keep(_record(orbax_file, other))
  assert keep(_record(__file__, vanished))  # not logged by orbax


def test_other_errors_are_not_disguised(tmp_path, monkeypatch):
  async def broken(self, x, directory):
    raise RuntimeError("a bug, not a disk")

  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", broken)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(RuntimeError, match="a bug") as raised:
      ckpt.save(1, {"w": np.ones(3)})
  assert not isinstance(raised.value, CheckpointWriteError)


def test_write_errno_reads_tensorstore_errors_and_chains():
  ts_error = ValueError('RESOURCE_EXHAUSTED: Error writing "w/0": Failed to '
                        "write 8 bytes: No space left on device "
                        "[os_error_code='28']")
  assert checkpoint_lib._write_errno(ts_error) == errno.ENOSPC
  try:
    try:
      raise OSError(errno.EDQUOT, "quota")
    except OSError:
      raise RuntimeError("wrapped")  # pylint: disable=raise-missing-from
  except RuntimeError as e:
    assert checkpoint_lib._write_errno(e) == errno.EDQUOT
  assert checkpoint_lib._write_errno(ValueError("bad shape")) is None
  assert checkpoint_lib._write_errno(OSError("no errno")) is None


# A file-size limit makes tensorstore's own writes fail (EFBIG) in C++: the
# same path as a full disk, including callbacks that fire on closed loops.
_SIZE_LIMITED_WRITER = textwrap.dedent("""
    import resource, signal, sys, time
    import jax, jax.numpy as jnp
    from agentic_rl.train.checkpoint import Checkpointer, CheckpointWriteError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write instead
    ckpt = Checkpointer(sys.argv[1])
    ckpt.save(1, {f"p{i}": jnp.full(4, 1.0) for i in range(40)})
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, resource.RLIM_INFINITY))
    big = {f"p{i}": jax.random.normal(jax.random.key(i), (20000,))
           for i in range(40)}
    try:
      ckpt.save(2, big)
    except CheckpointWriteError as e:
      print("errno", e.errno)
      print(e)
    time.sleep(0.5)  # in-flight writes finish on closed loops meanwhile
    ckpt.close()
    """)


def test_failed_tensorstore_write_is_one_error_without_noise(tmp_path):
  resource = pytest.importorskip("resource")
  del resource
  proc = subprocess.run(
      [sys.executable, "-c", _SIZE_LIMITED_WRITER, str(tmp_path)],
      capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  assert lines[0] == f"errno {errno.EFBIG}", proc.stdout + proc.stderr[-3000:]
  assert lines[1].startswith(
      f"cannot write checkpoint 2 in {tmp_path / 'checkpoints'}: File too large")
  assert "Event loop is closed" not in proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert os.listdir(tmp_path / "checkpoints") == ["1"]
  with Checkpointer(tmp_path) as ckpt:
    state, _ = ckpt.restore()
  np.testing.assert_array_equal(state["p0"], np.full(4, 1.0))


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
         "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"}
  proc = subprocess.run([sys.executable, "-c", _RESHARD, str(tmp_path)],
                        env=env, capture_output=True, text=True, timeout=120,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip().endswith("ok")
