"""Crash-safe training checkpoints with orbax-checkpoint.

A checkpoint holds everything a run needs to resume exactly:

* ``state``: any pytree of arrays - parameters, optimiser state, typed RNG
  keys (``jax.random.key``), numpy host arrays and scalars (dataset position,
  controller statistics, ...), sharded or not;
* ``meta``: a JSON-able dict (step counters, controller settings, the numpy
  ``Generator.bit_generator.state``, config echo, ...).

Layout: ``WORKDIR/checkpoints/<step>/{state,meta,typed_keys}``.  Orbax writes
each step into ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>``
only once every file is written, so a process killed mid-write leaves the
previous checkpoint intact and the partial one invisible (its temporary
directory is deleted the next time a :class:`Checkpointer` opens the
workdir).  Only the newest ``keep`` steps are kept.

Resuming::

    ckpt = Checkpointer(workdir, keep=3)
    if ckpt.latest_step() is not None:
      state, meta = ckpt.restore(target=abstract_state)  # shardings from it
    ...
    ckpt.save(step, state, {"dataset_position": pos, ...})
    ckpt.close()

In a multi-process run every process calls ``save`` / ``restore`` with its
shards of the same global state; orbax coordinates the writes.

A write that fails on a file error (a full disk, a quota, a read-only or
vanished directory) raises :class:`CheckpointWriteError`, one line naming the
directory, the step and the cause, instead of orbax's error: orbax's threads
log the failure once per thread with a traceback, and tensorstore callbacks
that finish after their event loop was closed print ``RuntimeError: Event
loop is closed`` many times over.  Those reports are dropped (see
:func:`_quiet_orbax_write_failures`); the error itself is raised once.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import re
import shutil
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from agentic_rl import model as model_lib
from agentic_rl.model import lora, pretrained
from agentic_rl.train import learner
from agentic_rl.train import settings as settings_lib

_KEY_DTYPE = jax.dtypes.prng_key


def _is_typed_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, _KEY_DTYPE)


def _path_names(path) -> tuple[str, ...]:
  """A key path as strings, the same for a dict, a namedtuple and a list
  (orbax restores the latter two as dict / list without a target)."""
  names = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        names.append(str(getattr(k, attr)))
        break
    else:
      raise ValueError(f"unsupported pytree key {k!r}")
  return tuple(names)


def _to_savable(x: Any) -> Any:
  if _is_typed_key(x):
    x = jax.random.key_data(x)
  if isinstance(x, np.generic):
    return np.asarray(x)
  # In a multi-process run orbax writes global arrays only; an array on this
  # process's devices alone (a key, a host-side statistic) is saved as the
  # numpy value every process holds.
  if isinstance(x, jax.Array) and jax.process_count() > 1 and x.is_fully_addressable:
    return np.asarray(x)
  return x


def _to_restore_target(x: Any) -> Any:
  """Restore target of one leaf: arrays become ShapeDtypeStructs that keep
  their sharding; typed keys become their uint32 key data."""
  sharding = getattr(x, "sharding", None)
  if _is_typed_key(x):
    data = jax.eval_shape(jax.random.key_data, x)
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  if isinstance(x, np.generic):
    return np.asarray(x)
  return x


def _uncommitted(x: Any) -> Any:
  """``x`` as a freshly made array: restored without a target, orbax
  commits every array to the default device, and a computation on a mesh
  refuses a committed single-device argument beside sharded ones (the run's
  restored PRNG key beside its parameters)."""
  if isinstance(x, jax.Array) and x.is_fully_addressable and len(x.sharding.device_set) == 1:
    return jax.device_put(np.asarray(x))
  return x


def _like_target(target_leaf: Any, value: Any) -> Any:
  """Give a restored leaf the Python / numpy type of its target leaf."""
  if isinstance(target_leaf, np.generic):
    return np.asarray(value, dtype=target_leaf.dtype)[()]
  if isinstance(target_leaf, (bool, int, float)):
    return type(target_leaf)(value)
  return value


def _check_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
  if not isinstance(meta, Mapping):
    raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
  for key in meta:
    if not isinstance(key, str):
      raise ValueError(f"meta keys must be str, got {key!r}")
  try:
    json.dumps(dict(meta))
  except (TypeError, ValueError) as e:
    raise ValueError(f"meta must be JSON-serialisable: {e}") from None
  return dict(meta)


class CheckpointWriteError(OSError):
  """A checkpoint could not be written: disk full, quota, permissions, ...

  ``errno`` is the cause's (``errno.ENOSPC`` for a full disk), ``filename``
  the checkpoint directory, and the message one line.  The complete
  checkpoints on disk are intact: orbax writes each step into a temporary
  directory and renames it only once complete.
  """

  def __str__(self) -> str:
    return self.strerror


# tensorstore's errors reach orbax's caller as ValueError, the OS error in the
# text: "... No space left on device [os_error_code='28']".
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _write_errno(exc: BaseException | None) -> int | None:
  """The errno of the failed file operation behind ``exc`` (following its
  chain of causes), or None if it is not a file error."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno:
      return exc.errno
    match = _OS_ERROR_CODE.search(str(exc))
    if match:
      return int(match.group(1))
    exc = exc.__cause__ or exc.__context__
  return None


def _in_orbax(filename: str) -> bool:
  return f"{os.sep}orbax{os.sep}" in filename


class _OrbaxWriteFailureFilter(logging.Filter):
  """Drops log records of a file error in an orbax save.

  Each of orbax's save threads (one per array handler, JSON item, metadata
  and the finaliser) logs the same error with its traceback, and asyncio
  logs "Task exception was never retrieved" for each write task left behind:
  hundreds of lines for one full disk, which :class:`Checkpointer` raises
  once instead.  Once a write has failed, the threads still running report
  the temporary directory vanishing under them (``NOT_FOUND`` on a path in
  ``<step>.orbax-checkpoint-tmp``, no OS error code): dropped too.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    if exc is None:  # some threads pass the exception as a message argument
      args = record.args if isinstance(record.args, tuple) else ()
      exc = next((a for a in args if isinstance(a, BaseException)), None)
    if exc is None:
      return True
    frames = traceback.extract_tb(exc.__traceback__)
    from_orbax = (_in_orbax(record.pathname)
                  or any(_in_orbax(f.filename) for f in frames))
    failed_write = _write_errno(exc) is not None or _TMP_SUFFIX in str(exc)
    return not (from_orbax and failed_write)


def _unraisable_filter(previous):
  """A ``sys.unraisablehook`` that drops the leftovers of an orbax save
  aborted by an error and passes everything else to ``previous``.

  When one write fails, orbax closes its event loop while tensorstore still
  has writes in flight.  As each finishes, its callback calls
  ``loop.call_soon_threadsafe`` on the closed loop (``RuntimeError: Event
  loop is closed``, reported as unraisable), and the coroutines that were
  awaiting them are finalised unfinished, at interpreter exit with
  ``ImportError: sys.meta_path is None``.  Only the names the hook needs are
  bound here, so that it still works while the interpreter shuts down.
  """
  def hook(unraisable, previous=previous, in_orbax=_in_orbax,
           extract_tb=traceback.extract_tb):
    exc, obj = unraisable.exc_value, unraisable.object
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and any(
        f.name == "call_soon_threadsafe"
        for f in extract_tb(unraisable.exc_traceback)):
      return
    code = getattr(obj, "cr_code", None)
    if code is not None and in_orbax(code.co_filename):
      return
    previous(unraisable)

  hook.drops_orbax_leftovers = True
  return hook


def _quiet_orbax_write_failures() -> None:
  """Install the log filter and unraisable hook above (once each; the hook
  again if something replaced it).  Both only drop reports of failures that
  :class:`Checkpointer` raises as :class:`CheckpointWriteError`."""
  for name in ("absl", "asyncio"):  # orbax logs through absl
    logger = logging.getLogger(name)
    if not any(isinstance(f, _OrbaxWriteFailureFilter) for f in logger.filters):
      logger.addFilter(_OrbaxWriteFailureFilter())
  if not getattr(sys.unraisablehook, "drops_orbax_leftovers", False):
    sys.unraisablehook = _unraisable_filter(sys.unraisablehook)


class Checkpointer:
  """Save / restore ``(state pytree, meta dict)`` under ``WORKDIR/checkpoints``.

  Args:
    workdir: the run directory (created if missing).
    keep: how many of the newest checkpoints to keep (>= 1).
    async_save: write in a background thread after copying the arrays to
      host memory; call :meth:`wait` (or :meth:`close`) before reading the
      files or exiting.  A failed background write is raised by the next
      :meth:`save`, :meth:`wait` or :meth:`close`.

  Raises:
    CheckpointWriteError: the directory cannot be created or written.
  """

  def __init__(self, workdir: str | os.PathLike, keep: int = 3, *,
               async_save: bool = False):
    if not isinstance(keep, int) or keep < 1:
      raise ValueError(f"keep must be a positive int, got {keep!r}")
    self.directory = os.path.join(os.fspath(workdir), "checkpoints")
    self._async = async_save
    self._unfinished: int | None = None  # step of an async save in flight
    self._failed = False  # a CheckpointWriteError was raised
    self._failed_steps: set[int] = set()  # whose partial directories to remove
    _quiet_orbax_write_failures()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=async_save)
    with self._write_errors(None):
      self._manager = ocp.CheckpointManager(
          self.directory, options=options,
          item_names=("state", "meta", "typed_keys"))

  @contextlib.contextmanager
  def _write_errors(self, step: int | None) -> Iterator[None]:
    """Turn a file error in the block into :class:`CheckpointWriteError` for
    ``step``, after deleting its partial write (process 0) to give the space
    back."""
    try:
      yield
    except CheckpointWriteError:
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      code = _write_errno(e)
      if code is None:
        raise
      self._failed = True
      if step is not None and jax.process_index() == 0:
        self._failed_steps.add(step)
        self._remove_partial()
      raise CheckpointWriteError(code, self._write_error_message(step, code),
                                 self.directory) from None

  def _remove_partial(self) -> None:
    """Removes the temporary directories of failed saves. Orbax's writer
    threads may still be finishing one when the error arrives, so this
    looks again until none is left (for up to a second)."""
    for _ in range(20):
      partial = [tmp for step in self._failed_steps for tmp in glob.glob(
          os.path.join(glob.escape(self.directory), f"{step}{_TMP_SUFFIX}*"))]
      if not partial:
        return
      for tmp in partial:
        shutil.rmtree(tmp, ignore_errors=True)
      time.sleep(0.05)

  def _write_error_message(self, step: int | None, code: int) -> str:
    what = "checkpoints" if step is None else f"checkpoint {step}"
    manager = getattr(self, "_manager", None)
    latest = None if manager is None else manager.latest_step()
    kept = ("there is no earlier checkpoint" if latest is None else
            f"checkpoint {latest} is intact and a rerun with the same workdir "
            "resumes from it")
    fix = ("free some space or use a workdir on a larger disk"
           if code in (errno.ENOSPC, errno.EDQUOT)
           else "check that the directory is writable")
    name = errno.errorcode.get(code, str(code))
    return (f"cannot write {what} in {self.directory}: {os.strerror(code)} "
            f"({name}); {fix}; {kept}")

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints on disk, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None if there is none."""
    return self._manager.latest_step()

  def save(self, step: int, state: Any,
           meta: Mapping[str, Any] | None = None) -> None:
    """Write checkpoint ``step`` (then drop all but the newest ``keep``).

    Args:
      step: a non-negative int greater than every saved step.
      state: pytree of ``jax.Array`` (typed keys included), numpy arrays and
        Python / numpy scalars.
      meta: JSON-serialisable dict (default empty).

    Raises:
      ValueError: bad step (not after the latest checkpoint) or meta.
      CheckpointWriteError: a file error (a full disk, ...) while writing
        this step, or an earlier asynchronous one.
    """
    if not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"step must be a non-negative int, got {step!r}")
    step = int(step)
    meta = _check_meta({} if meta is None else meta)
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise ValueError(
          f"cannot save step {step}: {self.directory} already has step "
          f"{latest}; steps must increase (resume from the latest checkpoint "
          "or use a new workdir)")
    leaves = jax.tree_util.tree_leaves_with_path(state)
    typed_keys = [[list(_path_names(p)), str(jax.random.key_impl(x))]
                  for p, x in leaves if _is_typed_key(x)]
    if self._unfinished is not None:  # orbax waits for it first
      self.wait()
    with self._write_errors(step):
      saved = self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(jax.tree.map(_to_savable, state)),
          meta=ocp.args.JsonSave(meta),
          typed_keys=ocp.args.JsonSave({"typed_keys": typed_keys})))
    if self._async:
      self._unfinished = step
    if not saved:
      raise RuntimeError(f"orbax declined to save step {step} in "
                         f"{self.directory}")

  def restore(self, step: int | None = None,
              target: Any = None) -> tuple[Any, dict[str, Any]]:
    """Read a checkpoint back.

    Args:
      step: which checkpoint; default the latest.
      target: the state's structure - concrete arrays or
        ``jax.ShapeDtypeStruct``s (with ``.sharding`` to restore sharded
        across the current mesh).  With it the result has exactly the
        target's tree types, dtypes, shardings and leaf types.  Without it
        orbax's saved structure comes back (namedtuples and tuples as dicts
        and lists, arrays on the default device and uncommitted, as freshly
        made ones, so a computation on a mesh takes them); typed keys are
        re-typed either way.

    Returns:
      ``(state, meta)``.

    Raises:
      FileNotFoundError: no (such) checkpoint in the workdir.
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint in {self.directory}")
    elif step not in self.all_steps():
      raise FileNotFoundError(
          f"no checkpoint for step {step} in {self.directory}; have "
          f"{self.all_steps()}")
    if target is None:
      state_args = ocp.args.StandardRestore()
    else:
      state_args = ocp.args.StandardRestore(
          jax.tree.map(_to_restore_target, target))
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=state_args, meta=ocp.args.JsonRestore(),
        typed_keys=ocp.args.JsonRestore()))
    impls = {tuple(p): impl for p, impl in
             restored.typed_keys["typed_keys"]}

    def retype(path, value):
      if target is None:
        value = _uncommitted(value)
      impl = impls.get(_path_names(path))
      return value if impl is None else jax.random.wrap_key_data(
          value, impl=impl)

    state = jax.tree_util.tree_map_with_path(retype, restored.state)
    if target is not None:
      state = jax.tree.map(_like_target, target, state)
    return state, dict(restored.meta)

  def wait(self) -> None:
    """Block until an asynchronous save has finished writing.

    Raises:
      CheckpointWriteError: that save failed on a file error.
    """
    step, self._unfinished = self._unfinished, None
    with self._write_errors(step):
      self._manager.wait_until_finished()

  def close(self) -> None:
    """Finish pending writes and release the manager.

    Raises:
      CheckpointWriteError: a pending asynchronous save failed on a file
        error.  A failure already raised is not raised again, so closing in
        a ``finally`` block (or ``with``) keeps the first report.
    """
    step, self._unfinished = self._unfinished, None
    reported = self._failed
    try:
      with self._write_errors(step):
        self._manager.close()
    except CheckpointWriteError:
      if step is not None or not reported:
        raise
    finally:
      self._remove_partial()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def load_params(workdir: str, *, like: Any) -> Any:
  """The parameters of the latest checkpoint of the run in ``workdir``, as
  device arrays; ValueError if their structure or shapes are not ``like``'s."""
  with Checkpointer(workdir) as source:
    restored, _ = source.restore()
  params = jax.tree.map(jnp.asarray, restored["params"])
  if jax.tree.structure(params) != jax.tree.structure(like) or any(
      a.shape != b.shape for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(like))):
    raise ValueError("its parameters do not have this model's structure and shapes")
  return params



def is_run_dir(path: str) -> bool:
  """Whether ``path`` is a run directory of this project (``checkpoints/``
  and ``config.json``)."""
  return (os.path.isdir(os.path.join(path, "checkpoints"))
          and os.path.isfile(os.path.join(path, "config.json")))


def load_frozen(run_dir: str, model_config_of) -> tuple[Any, Any, Any]:
  """``(params, model_config, config)`` of the run in ``run_dir``: the
  latest checkpoint's parameters for the architecture of its
  ``config.json`` (its :class:`~agentic_rl.train.settings.Settings`,
  through ``model_config_of``, the trainer's ``config.model_config``). For a
  frozen policy of another run: a judge, a sub-agent."""
  with open(os.path.join(run_dir, "config.json")) as f:
    config = settings_lib.parse(json.load(f))
  model_config = model_config_of(config)
  like = jax.eval_shape(lambda: model_lib.init_params(model_config, jax.random.key(0)))
  return load_params(run_dir, like=like), model_config, config


# ------------------------------------------------------------------ the run's parameters
def initial_params(run, key: jax.Array):
  """The parameters the run starts from: the checkpoint's
  (``config.model.init_from``), placed sharded over the mesh as the learner
  keeps them, or ``init_params`` of the run's model from ``key``; with LoRA,
  that base and fresh adapters from ``key``. A LoRA run's checkpoints hold
  only its adapters: resuming rebuilds the base here
  (:func:`restored_params`), so this must give the same base every time."""
  config = run.model_config
  if not (path := run.cfg.model.init_from):
    return model_lib.init_params(config, key)
  host = pretrained.load_params(path, config)
  if config.lora_rank:
    host = jax.tree.map(np.asarray, lora.add_adapters(host, config, key))
  return jax.device_put(host, learner.params_sharding(run.mesh, config, host))


def params_key(cfg) -> jax.Array:
  """The key of :func:`initial_params`."""
  return jax.random.fold_in(jax.random.key(cfg.seed), 0)


def saved_params(params, model_config):
  """What a checkpoint holds of ``params``: the adapters alone with LoRA
  (the base is frozen and rebuilt on restore), else all of them."""
  if params is None or not model_config.lora_rank:
    return params
  return lora.adapters(params)


def restored_params(run, saved):
  """The parameters of a checkpoint's ``saved`` ones (:func:`saved_params`):
  with LoRA the base of :func:`initial_params` with the saved adapters."""
  if not run.model_config.lora_rank:
    return saved
  return lora.with_adapters(initial_params(run, params_key(run.cfg)), saved)
