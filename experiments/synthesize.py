r"""Synthesise a family of tool tasks and write it as a task dataset.

  python -m experiments.synthesize --out=/tmp/tasks.json
  python -m experiments.synthesize --policy=/tmp/run --out=/tmp/tasks.json \
      --spec='{"ops": ["lookup", "open", "add", "mul"], "max_ops": 3, "candidates": 48}'

Proposes programs over the built-in tools from ``--spec`` (a JSON object of
``agentic_rl.envs.synthesis.Spec`` fields), keeps those the scripted solver
solves and, with ``--policy`` (a run directory), those that run's policy does
not already solve, and writes the dataset to ``--out``. Train on it with

  python -m experiments.train "--config.tasks.families=('composed',)" \
      --config.tasks.weights='(1.0,)' --config.tasks.programs=/tmp/tasks.json
"""

import collections
import functools
import json

from absl import app
from absl import flags

from agentic_rl.envs import synthesis
from agentic_rl.train import synthesis as train_synthesis

_SPEC = flags.DEFINE_string("spec", "{}", "JSON object of Spec fields.")
_POLICY = flags.DEFINE_string("policy", "", "Run directory of the current policy (filter).")
_OUT = flags.DEFINE_string("out", None, "Where to write the dataset (JSON).", required=True)


def main(argv):
  del argv
  spec = synthesis.Spec.from_mapping(json.loads(_SPEC.value))
  policy = functools.partial(train_synthesis.policy_success, _POLICY.value,
                             samples=spec.samples, seed=spec.seed) if _POLICY.value else None
  dataset = synthesis.synthesize(spec, policy)
  if _POLICY.value:
    dataset["policy"] = _POLICY.value
  synthesis.write(_OUT.value, dataset)
  verdicts = collections.Counter(row["verdict"] for row in dataset["candidates"])
  print(json.dumps({"out": _OUT.value, "kept": len(dataset["programs"]), **verdicts}))


if __name__ == "__main__":
  app.run(main)
