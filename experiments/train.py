r"""Train an agent end to end: SFT warm start on scripted demonstrations, then RL.

  python -m experiments.train                      # the embedded default task
  python -m experiments.train --config=experiments/configs/default.py:tiny \
      --workdir=/tmp/run --config.rl.loss=cispo

``--workdir`` of an interrupted run resumes it. Metrics go to
``WORKDIR/metrics.jsonl`` and TensorBoard event files, the final numbers to
``WORKDIR/summary.json``.

Multi-host (one process per host, e.g. two hosts):
  python -m experiments.train --coordinator_address=HOST0:1234 \
      --num_processes=2 --process_id=0   # and --process_id=1 on the other
"""

import importlib.util
import json
import os
import signal
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from agentic_rl.train import distributed

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "configs", "default.py"),
    "Experiment config file (with an optional ':variant' suffix).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/agentic_rl_default",
                               "Run directory: checkpoints, metrics, summary.")
_COORD = flags.DEFINE_string("coordinator_address", "",
                             "host:port of process 0 for multi-host runs.")
_NPROC = flags.DEFINE_integer("num_processes", 1, "Processes in a multi-host run.")
_PID = flags.DEFINE_integer("process_id", 0, "This process's index.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  if _COORD.value:
    distributed.maybe_initialize(_COORD.value, _NPROC.value, _PID.value)
  from agentic_rl.train import checkpoint, loop  # pylint: disable=g-import-not-at-top
  from agentic_rl.train import config as config_lib  # pylint: disable=g-import-not-at-top
  try:
    summary = loop.train(_CONFIG.value, _WORKDIR.value)
  except (config_lib.ConfigError, loop.TrainingHalted, checkpoint.CheckpointWriteError) as e:
    # A refused config or resume, a guard that stopped the run, a full disk:
    # one line says what happened and what to change.
    raise SystemExit(f"error: {e}") from None
  if "stopped" in summary:
    signum = getattr(signal, summary["stopped"], None)
    raise SystemExit(128 + signum if signum else 1)
  print(json.dumps(summary, indent=1, sort_keys=True))


def _unknown_override(argv) -> str | None:
  """Names the first ``--config.a.b=...`` override whose key does not exist,
  with the valid keys at that level (ml_collections only suggests one)."""
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")),
              _CONFIG.default if isinstance(_CONFIG.default, str) else None)
  path, _, arg = (spec or "").partition(":")
  if not path or not os.path.exists(path):
    return None
  module_spec = importlib.util.spec_from_file_location("_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  cfg = module.get_config(arg) if arg else module.get_config()
  for a in argv:
    if not a.startswith("--config."):
      continue
    node, parts = cfg, a[len("--config."):].split("=", 1)[0].split(".")
    for i, part in enumerate(parts):
      if not hasattr(node, "keys") or part not in node:
        where = ".".join(["config"] + parts[:i])
        valid = sorted(node.keys()) if hasattr(node, "keys") else []
        return f"unknown config key {where}.{part}; valid keys of {where}: {valid}"
      node = node[part]
  return None


if __name__ == "__main__":
  try:
    app.run(main)
  except AttributeError as e:
    message = _unknown_override(sys.argv[1:])
    if message is None:
      raise
    raise SystemExit(message) from e
