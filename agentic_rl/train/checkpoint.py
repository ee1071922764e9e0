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
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

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
    return jax.random.key_data(x)
  if isinstance(x, np.generic):
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


class Checkpointer:
  """Save / restore ``(state pytree, meta dict)`` under ``WORKDIR/checkpoints``.

  Args:
    workdir: the run directory (created if missing).
    keep: how many of the newest checkpoints to keep (>= 1).
    async_save: write in a background thread after copying the arrays to
      host memory; call :meth:`wait` (or :meth:`close`) before reading the
      files or exiting.
  """

  def __init__(self, workdir: str | os.PathLike, keep: int = 3, *,
               async_save: bool = False):
    if not isinstance(keep, int) or keep < 1:
      raise ValueError(f"keep must be a positive int, got {keep!r}")
    self.directory = os.path.join(os.fspath(workdir), "checkpoints")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_names=("state", "meta", "typed_keys"))

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
    saved = self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(jax.tree.map(_to_savable, state)),
        meta=ocp.args.JsonSave(meta),
        typed_keys=ocp.args.JsonSave({"typed_keys": typed_keys})))
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
        and lists, arrays on the default device); typed keys are re-typed
        either way.

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
      impl = impls.get(_path_names(path))
      return value if impl is None else jax.random.wrap_key_data(
          value, impl=impl)

    state = jax.tree_util.tree_map_with_path(retype, restored.state)
    if target is not None:
      state = jax.tree.map(_like_target, target, state)
    return state, dict(restored.meta)

  def wait(self) -> None:
    """Block until an asynchronous save has finished writing."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Finish pending writes and release the manager."""
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
