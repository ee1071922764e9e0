"""Per-step training metrics: JSON lines, TensorBoard and a console progress
line with ETA.

Files under the run's ``WORKDIR``:

* ``metrics.jsonl`` - one JSON object per line:
  ``{"step": 12, "wall_time": 1764470000.1, "loss": 0.53, ...}``.  Every line
  is strict JSON: a non-finite value is written as the string ``"nan"``,
  ``"inf"`` or ``"-inf"`` (:func:`read_metrics` turns them back into floats).
* ``tensorboard/`` - event files (tensorboardX), one scalar per metric.
* ``summary.json`` - :func:`write_summary`'s final numbers; a resumed run's
  wall time over all its invocations comes from :func:`wall_times`.

Only process 0 writes by default, so a multi-process run logs once.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import jax
import numpy as np

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"
RESERVED_KEYS = ("step", "wall_time")

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _encode(value: float) -> float | str:
  if math.isnan(value):
    return "nan"
  if math.isinf(value):
    return "inf" if value > 0 else "-inf"
  return value


def _decode(obj: Any) -> Any:
  """Inverse of :func:`_encode` over a parsed JSON value."""
  if isinstance(obj, str):
    return _NON_FINITE.get(obj, obj)
  if isinstance(obj, dict):
    return {k: _decode(v) for k, v in obj.items()}
  if isinstance(obj, list):
    return [_decode(v) for v in obj]
  return obj


def _encode_tree(obj: Any) -> Any:
  if isinstance(obj, Mapping):
    return {str(k): _encode_tree(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_encode_tree(v) for v in obj]
  if isinstance(obj, (np.ndarray, np.generic)):
    return _encode_tree(obj.tolist())
  if isinstance(obj, float):
    return _encode(obj)
  return obj


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
  """Validate and convert metric values to Python floats (one device_get)."""
  if not isinstance(metrics, Mapping):
    raise ValueError(f"metrics must be a dict, got {type(metrics).__name__}")
  for key in metrics:
    if not isinstance(key, str) or not key:
      raise ValueError(f"metric names must be non-empty str, got {key!r}")
    if key in RESERVED_KEYS:
      raise ValueError(f"metric name {key!r} is reserved "
                       f"({RESERVED_KEYS} are written by MetricsWriter)")
  host = jax.device_get(dict(metrics))
  out = {}
  for key, value in host.items():
    if np.ndim(value) != 0:
      raise ValueError(f"metric {key!r} must be a scalar, got shape "
                       f"{np.shape(value)}")
    try:
      out[key] = float(value)
    except (TypeError, ValueError):
      raise ValueError(f"metric {key!r} is not a number: {value!r}") from None
  return out


def _summary_writer_cls():
  """``tensorboardX.SummaryWriter``, imported without importing PyTorch, and
  without its warning on NaN / inf scalars.

  ``tensorboardX.writer`` runs ``try: import torch`` at import time only to
  accept torch tensors; with torch installed that costs seconds and hundreds
  of MB in a JAX process.  Hiding torch for the duration of the import makes
  that optional import fail fast; torch is untouched if already loaded.
  """
  hide_torch = "torch" not in sys.modules and "tensorboardX" not in sys.modules
  if hide_torch:
    sys.modules["torch"] = None  # `import torch` now raises ImportError
  try:
    from tensorboardX import SummaryWriter
  finally:
    if hide_torch:
      del sys.modules["torch"]
  # Non-finite metrics are expected (and kept); don't warn on every step.
  logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
  return SummaryWriter


def _format_duration(seconds: float) -> str:
  return str(datetime.timedelta(seconds=int(round(seconds))))


class MetricsWriter:
  """Write each step's scalar metrics to jsonl, TensorBoard and the console.

  Args:
    workdir: run directory (created if missing).
    total_steps: the run's length, for the progress fraction and ETA.
    start_step: the index of the first step this writer will see: 0, or on
      resume the number of steps already done (the checkpoint's step; the
      loop saves after step ``k - 1`` as checkpoint ``k``).  Records of an
      existing ``metrics.jsonl`` with ``step >= start_step`` (written by an
      earlier attempt after the checkpoint being resumed; all of them for a
      fresh start) are dropped, and TensorBoard hides its events from
      ``start_step`` on (``purge_step``).
    enabled: whether this process writes; default ``jax.process_index() ==
      0``.  A disabled writer still validates its input.
    tensorboard: also write TensorBoard event files.
    stream: where the progress line goes (default ``sys.stderr``).  On a
      terminal the line is redrawn in place; otherwise a new line is printed.
    progress_every_s: minimum seconds between progress lines (the first and
      the last step are always shown).
    progress_keys: metrics shown on the progress line, default the first 6.
    clock: seconds since the epoch (``time.time``; replaceable in tests).
  """

  def __init__(self, workdir: str | os.PathLike, total_steps: int, *,
               start_step: int = 0, enabled: bool | None = None,
               tensorboard: bool = True, stream: TextIO | None = None,
               progress_every_s: float = 5.0,
               progress_keys: Sequence[str] | None = None,
               clock: Callable[[], float] = time.time):
    if not isinstance(total_steps, int) or total_steps < 1:
      raise ValueError(f"total_steps must be a positive int, got "
                       f"{total_steps!r}")
    if not isinstance(start_step, int) or not 0 <= start_step <= total_steps:
      raise ValueError(f"start_step must be an int in [0, {total_steps}], "
                       f"got {start_step!r}")
    self.workdir = os.fspath(workdir)
    self.path = os.path.join(self.workdir, METRICS_FILE)
    self.total_steps = total_steps
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._stream = sys.stderr if stream is None else stream
    self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
    self._progress_every_s = progress_every_s
    self._progress_keys = progress_keys
    self._clock = clock
    self._first: tuple[int, float] | None = None  # (step, time) of 1st write
    self._last_progress = -math.inf
    self._last_step: int | None = None
    self._file = None
    self._tb = None
    if not self.enabled:
      return
    os.makedirs(self.workdir, exist_ok=True)
    if os.path.exists(self.path):
      kept = [r for r in read_metrics(self.path) if r["step"] < start_step]
      atomic_write(self.path, "".join(_json_line(r) for r in kept))
    self._file = open(self.path, "a", encoding="utf-8")
    if tensorboard:
      # tensorboardX names files by the second and opens them with "wb": a
      # unique, increasing suffix keeps a quick restart from overwriting.
      self._tb = _summary_writer_cls()(
          logdir=os.path.join(self.workdir, TENSORBOARD_DIR),
          purge_step=start_step, flush_secs=10,
          filename_suffix=f".{time.time_ns()}")

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Record ``metrics`` (name -> scalar, host or device) for ``step``.

    ``step`` is the 0-based index of the step just finished (so ``step + 1``
    steps are done; the last is ``total_steps - 1``) and must increase from
    call to call.
    """
    if not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"step must be a non-negative int, got {step!r}")
    step = int(step)
    if self._last_step is not None and step <= self._last_step:
      raise ValueError(f"step {step} written after step {self._last_step}; "
                       "steps must increase")
    values = _scalars(metrics)
    self._last_step = step
    if not self.enabled:
      return
    now = self._clock()
    self._file.write(_json_line({"step": step, "wall_time": now, **values}))
    self._file.flush()
    if self._tb is not None:
      for key, value in values.items():
        self._tb.add_scalar(key, value, step, walltime=now)
    self._progress(step, values, now)

  def _progress(self, step: int, values: dict[str, float], now: float):
    if self._first is None:
      self._first = (step, now)
    done = step + 1 >= self.total_steps
    if not done and now - self._last_progress < self._progress_every_s:
      return
    self._last_progress = now
    line = self._progress_line(step, values, now)
    if self._tty:
      self._stream.write("\r\x1b[K" + line + ("\n" if done else ""))
    else:
      self._stream.write(line + "\n")
    self._stream.flush()

  def _progress_line(self, step: int, values: dict[str, float],
                     now: float) -> str:
    """``[ 40/100]  40.0% |########------------| 2.5 step/s ETA 0:00:24 |
    loss=0.53 reward=0.1`` after step index 39 (40 steps done)."""
    first_step, first_time = self._first
    done = step + 1
    fraction = min(done / self.total_steps, 1.0)
    filled = int(fraction * 20)
    line = (f"[{done:>{len(str(self.total_steps))}}/{self.total_steps}] "
            f"{100 * fraction:5.1f}% |{'#' * filled}{'-' * (20 - filled)}| ")
    if step > first_step and now > first_time:
      rate = (step - first_step) / (now - first_time)
      eta = max(self.total_steps - done, 0) / rate
      line += f"{rate:.3g} step/s ETA {_format_duration(eta)}"
    else:
      line += "ETA ?"
    keys = (list(values)[:6] if self._progress_keys is None
            else [k for k in self._progress_keys if k in values])
    if keys:
      line += " | " + " ".join(f"{k}={values[k]:.4g}" for k in keys)
    return line

  def close(self) -> None:
    """Flush and close the files (safe to call twice)."""
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._tty and self.enabled and self._last_step is not None and (
        self._last_step + 1 < self.total_steps):
      self._stream.write("\n")
      self._stream.flush()

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _json_line(record: Mapping[str, Any]) -> str:
  return json.dumps(_encode_tree(record), allow_nan=False) + "\n"


def atomic_write(path: str, text: str) -> None:
  """Write ``text`` to ``path`` through a temporary file and a rename, so a
  reader (or a crash) never sees half a file."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Records of a ``metrics.jsonl`` (or of ``path/metrics.jsonl`` if ``path``
  is a directory), non-finite values back as floats.

  A final line without its newline (a crash mid-write) is skipped; any other
  unparsable line raises ValueError naming it.
  """
  path = os.fspath(path)
  if os.path.isdir(path):
    path = os.path.join(path, METRICS_FILE)
  with open(path, encoding="utf-8") as f:
    text = f.read()
  records = []
  # The piece after the last newline is empty, or an interrupted write.
  for number, line in enumerate(text.split("\n")[:-1], 1):
    if not line.strip():
      continue
    try:
      records.append(_decode(json.loads(line)))
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{number} is not valid JSON: {e}") from None
  return records


def write_summary(workdir: str | os.PathLike,
                  summary: Mapping[str, Any]) -> str:
  """Write ``summary`` (JSON-able; numpy / JAX scalars and arrays allowed,
  non-finite floats as strings) to ``WORKDIR/summary.json`` atomically.

  Returns:
    The file's path.
  """
  if not isinstance(summary, Mapping):
    raise ValueError(f"summary must be a dict, got {type(summary).__name__}")
  try:
    text = json.dumps(_encode_tree(jax.device_get(dict(summary))),
                      allow_nan=False, indent=2, sort_keys=True)
  except (TypeError, ValueError) as e:
    raise ValueError(f"summary must be JSON-serialisable: {e}") from None
  os.makedirs(os.fspath(workdir), exist_ok=True)
  path = os.path.join(os.fspath(workdir), SUMMARY_FILE)
  atomic_write(path, text + "\n")
  return path


def wall_times(previous_summary: Mapping[str, Any] | None,
               this_invocation_s: float) -> dict[str, float]:
  """The run's wall time when it spans several invocations (resumes).

  ``wall_s`` is the total over the invocations, ``wall_s_last`` this
  invocation's.  Intended use in ``loop.train``: keep the summary restored
  from the checkpoint as it was (``resumed = dict(summary)``, ``{}`` for a
  fresh run), and before each checkpoint and at the end::

      summary.update(metrics.wall_times(resumed, time.perf_counter() - t_start))

  so every checkpoint carries the time so far.  Pass that snapshot every
  time, not the summary being updated, or earlier time counts twice.  The
  time a killed invocation spent after its last checkpoint is not counted.

  Args:
    previous_summary: the summary when this invocation started; its
      ``wall_s`` (absent: 0) is the earlier invocations' time.
    this_invocation_s: seconds this invocation has run.

  Raises:
    ValueError: a negative or non-finite ``this_invocation_s``.
  """
  this = float(this_invocation_s)
  if not math.isfinite(this) or this < 0:
    raise ValueError(f"this_invocation_s must be a finite number >= 0, got "
                     f"{this_invocation_s!r}")
  earlier = float((previous_summary or {}).get("wall_s", 0.0))
  if not math.isfinite(earlier) or earlier < 0:
    earlier = 0.0
  return {"wall_s": earlier + this, "wall_s_last": this}


def read_summary(workdir: str | os.PathLike) -> dict[str, Any]:
  """The dict :func:`write_summary` wrote, non-finite values as floats."""
  with open(os.path.join(os.fspath(workdir), SUMMARY_FILE),
            encoding="utf-8") as f:
    return _decode(json.load(f))
