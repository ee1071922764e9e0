"""MetricsWriter: jsonl lines, TensorBoard events, progress/ETA, resume,
summary."""

import glob
import io
import json
import math
import os
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.train import metrics as m


def _strict_json(line):
  def reject(constant):
    raise AssertionError(f"non-standard JSON constant {constant}")
  return json.loads(line, parse_constant=reject)


def _read_events(workdir):
  """(step, tag, value) of every scalar, and the session-log steps, from the
  TensorBoard event files (TFRecord framing: u64 length, u32 crc, data, u32
  crc)."""
  m._summary_writer_cls()  # import tensorboardX without torch first
  from tensorboardX.proto import event_pb2
  scalars, session_logs = [], []
  for path in sorted(glob.glob(os.path.join(workdir, m.TENSORBOARD_DIR,
                                            "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      if event.HasField("session_log"):
        session_logs.append(event.step)
      for v in event.summary.value:
        scalars.append((event.step, v.tag, v.simple_value))
  return scalars, session_logs


class FakeClock:
  def __init__(self, times):
    self.times = list(times)

  def __call__(self):
    return self.times.pop(0)


def test_jsonl_lines_are_strict_json_and_read_back(tmp_path):
  steps = [
      (1, {"loss": jnp.float32(2.5), "reward": np.float64(0.25), "n": 3}),
      (2, {"loss": float("nan"), "reward": math.inf, "n": -math.inf}),
      (5, {"loss": jnp.array(1.0), "reward": True, "n": np.int32(7)}),
  ]
  with m.MetricsWriter(tmp_path, 6, stream=io.StringIO()) as writer:
    for step, values in steps:
      writer.write(step, values)
  lines = (tmp_path / m.METRICS_FILE).read_text().splitlines()
  assert len(lines) == 3
  parsed = [_strict_json(line) for line in lines]
  assert [p["step"] for p in parsed] == [1, 2, 5]
  assert parsed[1]["loss"] == "nan" and parsed[1]["reward"] == "inf"
  assert parsed[1]["n"] == "-inf"
  records = m.read_metrics(tmp_path)
  assert records == m.read_metrics(tmp_path / m.METRICS_FILE)
  assert records[0] == {"step": 1, "wall_time": records[0]["wall_time"],
                        "loss": 2.5, "reward": 0.25, "n": 3.0}
  assert math.isnan(records[1]["loss"]) and records[1]["reward"] == math.inf
  assert records[1]["n"] == -math.inf
  assert records[2]["reward"] == 1.0 and records[2]["n"] == 7.0
  assert all(isinstance(r["wall_time"], float) for r in records)


def test_tensorboard_scalars(tmp_path):
  with m.MetricsWriter(tmp_path, 3, stream=io.StringIO()) as writer:
    writer.write(1, {"loss": 2.0, "kl": 0.5})
    writer.write(2, {"loss": float("nan")})
    writer.write(3, {"loss": 1.0, "kl": 0.25})
  scalars, _ = _read_events(tmp_path)
  loss = [(s, v) for s, t, v in scalars if t == "loss"]
  assert loss[0] == (1, 2.0) and loss[2] == (3, 1.0)
  assert loss[1][0] == 2 and math.isnan(loss[1][1])
  assert [(s, v) for s, t, v in scalars if t == "kl"] == [(1, 0.5), (3, 0.25)]


def test_progress_line_rate_and_eta(tmp_path):
  stream = io.StringIO()
  with m.MetricsWriter(tmp_path, 10, tensorboard=False, stream=stream,
                       progress_every_s=0,
                       clock=FakeClock([100.0, 102.0, 104.0])) as writer:
    writer.write(0, {"loss": 0.123456, "reward": 1})
    writer.write(1, {"loss": 0.5})
    writer.write(2, {"loss": 0.25})
  lines = stream.getvalue().splitlines()
  assert lines[0] == ("[ 1/10]  10.0% |##------------------| ETA ? | "
                      "loss=0.1235 reward=1")
  # Step indices 0..2: 3 done; 2 steps in 4 s: 0.5 step/s, 7 left: 14 s.
  assert lines[2] == ("[ 3/10]  30.0% |######--------------| 0.5 step/s "
                      "ETA 0:00:14 | loss=0.25")


def test_progress_is_throttled_and_redrawn_on_a_terminal(tmp_path):
  class Terminal(io.StringIO):
    def isatty(self):
      return True

  stream = Terminal()
  clock = FakeClock([0.0, 1.0, 2.0, 6.0, 7.0])
  with m.MetricsWriter(tmp_path, 5, tensorboard=False, stream=stream,
                       progress_every_s=5.0, progress_keys=["b"],
                       clock=clock) as writer:
    for step in range(5):
      writer.write(step, {"a": 1.0, "b": float(step + 1)})
  out = stream.getvalue()
  shown = [part.split("]")[0] for part in out.split("\r\x1b[K")[1:]]
  assert shown == ["[1/5", "[4/5", "[5/5"]  # first, after 5 s, last
  assert "a=" not in out and "b=5" in out
  assert out.endswith("\n")
  assert len(m.read_metrics(tmp_path)) == 5  # every step is still logged


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
  with m.MetricsWriter(tmp_path, 6, stream=io.StringIO()) as writer:
    for step in range(1, 6):
      writer.write(step, {"loss": float(step)})
  with m.MetricsWriter(tmp_path, 6, start_step=3,
                       stream=io.StringIO()) as writer:
    for step in range(3, 7):
      writer.write(step, {"loss": 10.0 * step})
  records = m.read_metrics(tmp_path)
  assert [(r["step"], r["loss"]) for r in records] == [
      (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0), (6, 60.0)]
  scalars, session_logs = _read_events(tmp_path)
  assert session_logs == [0, 3]  # TensorBoard's purge markers, in file order
  assert [s for s, _, _ in scalars] == [1, 2, 3, 4, 5, 3, 4, 5, 6]


def test_fresh_start_and_interrupted_line_are_not_appended_to(tmp_path):
  path = tmp_path / m.METRICS_FILE
  path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
  with m.MetricsWriter(tmp_path, 3, start_step=1, tensorboard=False,
                       stream=io.StringIO()) as writer:
    writer.write(1, {"x": 5.0})
  assert [(r["step"], r["x"]) for r in m.read_metrics(path)] == [(1, 5.0)]
  with m.MetricsWriter(tmp_path, 3, tensorboard=False,
                       stream=io.StringIO()) as writer:
    writer.write(2, {"x": 6.0})
  assert [(r["step"], r["x"]) for r in m.read_metrics(path)] == [(2, 6.0)]


def test_disabled_writer_writes_nothing_but_validates(tmp_path):
  stream = io.StringIO()
  writer = m.MetricsWriter(tmp_path / "run", 3, enabled=False, stream=stream)
  writer.write(1, {"loss": 1.0})
  with pytest.raises(ValueError, match="scalar"):
    writer.write(2, {"loss": np.zeros(2)})
  writer.close()
  assert not (tmp_path / "run").exists() and stream.getvalue() == ""


@pytest.mark.parametrize("step, values, match", [
    (1, {"step": 1.0}, "reserved"),
    (1, {"wall_time": 1.0}, "reserved"),
    (1, {"x": np.ones(3)}, r"'x' must be a scalar, got shape \(3,\)"),
    (1, {"x": "high"}, "'x' is not a number"),
    (1, {3: 1.0}, "non-empty str"),
    (-1, {"x": 1.0}, "non-negative int"),
    (1.5, {"x": 1.0}, "non-negative int"),
    (1, [("x", 1.0)], "must be a dict"),
])
def test_bad_metrics_are_rejected(tmp_path, step, values, match):
  with m.MetricsWriter(tmp_path, 3, stream=io.StringIO()) as writer:
    with pytest.raises(ValueError, match=match):
      writer.write(step, values)


def test_steps_must_increase_and_arguments_are_checked(tmp_path):
  with m.MetricsWriter(tmp_path, 3, stream=io.StringIO()) as writer:
    writer.write(2, {"x": 1.0})
    with pytest.raises(ValueError, match="step 2 written after step 2"):
      writer.write(2, {"x": 1.0})
  with pytest.raises(ValueError, match="total_steps"):
    m.MetricsWriter(tmp_path, 0)
  with pytest.raises(ValueError, match="start_step"):
    m.MetricsWriter(tmp_path, 3, start_step=4)


def test_read_metrics_skips_an_interrupted_last_line(tmp_path):
  path = tmp_path / m.METRICS_FILE
  path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": "-inf"}\n'
                  '{"step": 3, "x"')
  assert m.read_metrics(path) == [{"step": 1, "x": 1.0},
                                  {"step": 2, "x": -math.inf}]
  path.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not valid JSON"):
    m.read_metrics(path)


def test_summary_round_trip(tmp_path):
  summary = {"final_loss": jnp.float32(0.5), "best": np.float64("nan"),
             "per_env": {"sudoku": [1.0, math.inf]}, "steps": 100,
             "name": "run1", "hist": np.arange(3)}
  path = m.write_summary(tmp_path / "run", summary)
  text = open(path).read()
  _strict_json(text)
  back = m.read_summary(tmp_path / "run")
  assert back["final_loss"] == 0.5 and math.isnan(back["best"])
  assert back["per_env"] == {"sudoku": [1.0, math.inf]}
  assert back["steps"] == 100 and back["name"] == "run1"
  assert back["hist"] == [0, 1, 2]
  assert os.listdir(tmp_path / "run") == [m.SUMMARY_FILE]  # no temp file
  with pytest.raises(ValueError, match="JSON-serialisable"):
    m.write_summary(tmp_path, {"obj": object()})


def test_wall_times_add_up_over_resumed_invocations(tmp_path):
  first = m.wall_times({}, 30.0)
  assert first == {"wall_s": 30.0, "wall_s_last": 30.0}
  assert m.wall_times(None, 2.5) == {"wall_s": 2.5, "wall_s_last": 2.5}
  # The summary goes through a checkpoint or summary.json between invocations.
  m.write_summary(tmp_path, {"steps": 4, **first})
  resumed = m.read_summary(tmp_path)
  second = m.wall_times(resumed, 12.0)
  assert second == {"wall_s": 42.0, "wall_s_last": 12.0}
  # Repeated calls with the same snapshot do not accumulate.
  assert m.wall_times(resumed, 15.0) == {"wall_s": 45.0, "wall_s_last": 15.0}
  assert m.wall_times({"wall_s": math.nan}, 1.0)["wall_s"] == 1.0
  for bad in (-1.0, math.inf):
    with pytest.raises(ValueError, match="this_invocation_s"):
      m.wall_times({}, bad)


def test_importing_the_tensorboard_writer_does_not_import_torch():
  code = ("import sys; from agentic_rl.train import metrics; "
          "metrics._summary_writer_cls(); print('torch' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=120, check=True)
  assert out.stdout.strip() == "False"
