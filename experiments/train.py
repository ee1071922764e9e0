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

import json
import os

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
  from agentic_rl.train import loop  # pylint: disable=g-import-not-at-top
  summary = loop.train(_CONFIG.value, _WORKDIR.value)
  print(json.dumps(summary, indent=1, sort_keys=True))


if __name__ == "__main__":
  app.run(main)
