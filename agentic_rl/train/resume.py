"""The run's config, saved in its workdir, and the check that a resume keeps it.

``train(cfg, workdir)`` resumes whatever checkpoint ``workdir`` holds.  With
another model, task mix or objective the restored state would not fit, or
worse, would fit and silently splice two experiments into one run (one
``metrics.jsonl``, one ``summary.json``).  So the config a run starts with is
written to ``WORKDIR/config.json`` and a resume compares against it: changes
that leave the restored state and the training maths valid (:data:`SAFE_ON_RESUME`
and the step counts of the stages) are allowed and reported; any other
change is refused.

Intended call in ``loop.train``, once the checkpointer is open and before the
checkpoint is restored::

    if ckpt.latest_step() is not None:
      saved = resume.load_run_config(workdir)
      if saved is not None:  # None: a run from before config.json existed
        for notice in resume.check_resume(saved, resume.config_to_dict(cfg)):
          print(notice)
    resume.save_run_config(workdir, cfg)

The check runs only when there is a checkpoint to resume: a run that died
before its first checkpoint restarts from scratch under any config.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import numpy as np

from agentic_rl.train import metrics as metrics_lib

CONFIG_FILE = "config.json"

# Keys that may change when a run resumes: a dotted prefix ending in "." covers
# a whole section.
SAFE_ON_RESUME = (
    # Evaluation reads the parameters and trains nothing: its cadence, size
    # and batch rows change what is logged, not the run.
    "eval.",
    # When to save and how many old checkpoints to keep: any step resumes.
    "checkpoint.every",
    "checkpoint.keep",
    # How the processes find each other, not what they compute.
    "distributed.",
    # The deployment check after the last step measures, trains nothing.
    "export.",
    # The device layout: orbax restores the arrays onto any mesh, and the
    # maths is the same on every layout (up to the order of reductions).
    "mesh.",
)

# The step count of each kind of stage.  Changing it lengthens or shortens
# the stage; it is allowed unless the learning-rate schedule depends on it.
STEP_KEYS = {"sft": "steps", "rl": "iterations", "distill": "iterations"}

# Learning-rate schedules whose value at a step depends on the total number
# of steps (the cosine decays to the stage's end), so a new total would
# change the learning rate of the steps still to come.  The configs set
# ``warmup_steps``, which gives a constant schedule (after a warm-up); a
# stage section may also name its ``schedule``.
TOTAL_DEPENDENT_SCHEDULES = ("warmup_cosine",)

_ABSENT = "<absent>"


def _plain(value: Any, path: str) -> Any:
  if hasattr(value, "to_dict"):  # a ConfigDict, placeholders resolved
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {str(k): _plain(v, f"{path}.{k}") for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
  if isinstance(value, np.generic):
    return value.item()
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  raise TypeError(f"{path} has type {type(value).__name__} ({value!r}); a run config "
                  "holds only dicts, lists, str, numbers, bools and None")


def config_to_dict(cfg) -> dict[str, Any]:
  """``cfg`` (a ``ConfigDict`` or a nested mapping) as a plain JSON-able dict:
  nested dicts, tuples as lists, numpy scalars as Python numbers.

  Raises:
    TypeError: a value that JSON cannot hold, naming its key.
  """
  return _plain(cfg, "config")


def save_run_config(workdir: str | os.PathLike, cfg) -> str | None:
  """Write ``cfg`` to ``WORKDIR/config.json`` atomically (from process 0
  only, so a multi-process run writes it once).

  Returns:
    The file's path, or None on the other processes.
  """
  text = json.dumps(config_to_dict(cfg), indent=2, sort_keys=True) + "\n"
  if jax.process_index() != 0:
    return None
  os.makedirs(os.fspath(workdir), exist_ok=True)
  path = os.path.join(os.fspath(workdir), CONFIG_FILE)
  metrics_lib.atomic_write(path, text)
  return path


def load_run_config(workdir: str | os.PathLike) -> dict[str, Any] | None:
  """The dict :func:`save_run_config` wrote, or None if there is none."""
  path = os.path.join(os.fspath(workdir), CONFIG_FILE)
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def saved_config(workdir: str | os.PathLike):
  """The run's config as an ``ml_collections.ConfigDict`` (JSON's lists
  back as the tuples the config holds), or None if there is none."""
  def tuples(x):
    if isinstance(x, list):
      return tuple(tuples(v) for v in x)
    if isinstance(x, dict):
      return {k: tuples(v) for k, v in x.items()}
    return x

  saved = load_run_config(workdir)
  return None if saved is None else ml_collections.ConfigDict(tuples(saved))


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; an empty dict stays a value, so
  that adding or removing one is seen."""
  flat = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    if isinstance(value, Mapping) and value:
      flat.update(_flatten(value, path + "."))
    else:
      flat[path] = value
  return flat


def _same(a: Any, b: Any) -> bool:
  """Equal values, with NaN equal to NaN and a bool never equal to a number."""
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
    return True
  return isinstance(a, bool) == isinstance(b, bool) and a == b


def _show(value: Any) -> str:
  return _ABSENT if value is _ABSENT else json.dumps(value)


def _step_keys(saved: Mapping[str, Any], new: Mapping[str, Any]
               ) -> tuple[set[str], dict[str, str]]:
  """The step-count keys that may change, and why the others may not."""
  allowed, refused = set(), {}
  for name in set(saved.get("stages") or ()) & set(new.get("stages") or ()):
    old, cur = saved.get(name), new.get(name)
    if not (isinstance(old, Mapping) and isinstance(cur, Mapping)):
      continue
    kind = cur.get("kind")
    if kind != old.get("kind") or kind not in STEP_KEYS:
      continue
    key = f"{name}.{STEP_KEYS[kind]}"
    schedule = next((s.get("schedule") for s in (old, cur)
                     if s.get("schedule") in TOTAL_DEPENDENT_SCHEDULES), None)
    if schedule is None:
      allowed.add(key)
    else:
      refused[key] = f"the {schedule} learning-rate schedule depends on it"
  return allowed, refused


def check_resume(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
  """Compare the config a run was started with to the one resuming it.

  Args:
    saved: the run's config, as :func:`load_run_config` returns it.
    new: the resuming config, as :func:`config_to_dict` returns it.

  Returns:
    One notice per allowed difference, e.g. ``"config.eval.every: 20 -> 10
    (allowed on resume)"``, sorted by key; empty if the configs are equal.

  Raises:
    ValueError: a key outside :data:`SAFE_ON_RESUME` and the stages' step
      counts differs (added and removed keys included); the message lists
      every differing key with its old and new values.
  """
  saved, new = config_to_dict(saved), config_to_dict(new)
  old_flat, new_flat = _flatten(saved), _flatten(new)
  step_keys, step_refusals = _step_keys(saved, new)
  notices, refused = [], []
  for key in sorted(old_flat.keys() | new_flat.keys()):
    old, cur = old_flat.get(key, _ABSENT), new_flat.get(key, _ABSENT)
    if old is not _ABSENT and cur is not _ABSENT and _same(old, cur):
      continue
    change = f"config.{key}: {_show(old)} -> {_show(cur)}"
    if key in step_keys or any(
        key == safe or (safe.endswith(".") and key.startswith(safe))
        for safe in SAFE_ON_RESUME):
      notices.append(f"{change} (allowed on resume)")
    elif key in step_refusals:
      refused.append(f"{change} ({step_refusals[key]})")
    else:
      refused.append(change)
  if refused:
    lines = [f"the config differs from the one this run was started with "
             f"({CONFIG_FILE} in the workdir), and these keys cannot change "
             "on resume:"]
    lines += [f"  {line}" for line in refused]
    if notices:
      lines.append("and these differences are allowed:")
      lines += [f"  {line}" for line in notices]
    lines.append("Use a new --workdir to start a new run, or restore the old "
                 "values to resume this one.")
    raise ValueError("\n".join(lines))
  return notices


def begin(workdir: str | os.PathLike, cfg, *, has_checkpoint: bool) -> None:
  """Checks that ``cfg`` may resume the run in ``workdir`` (when it has a
  checkpoint and a saved config), prints the notices of
  :func:`check_resume`, and saves ``cfg`` as the run's config.

  Raises ``ValueError`` ("cannot resume WORKDIR: ...") when the config
  changes what the checkpoint holds.
  """
  if has_checkpoint and (saved := load_run_config(workdir)):
    try:
      notices = check_resume(saved, config_to_dict(cfg))
    except ValueError as e:
      raise ValueError(f"cannot resume {os.fspath(workdir)}: {e}") from None
    for notice in notices:
      print(notice, file=sys.stderr)
  save_run_config(workdir, cfg)
