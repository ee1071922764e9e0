"""The config an ``experiments.train`` command line gives (for the studies'
tests)."""

import ast

from experiments import common
from experiments.configs import default


def config_of(variant: str, overrides: dict):
  """The config ``common.train_command(..., variant, overrides)`` trains,
  its values parsed as the flags parse them."""
  cmd = common.train_command("/tmp/x", variant, overrides)
  variants = ",".join(filter(None, ("all", variant)))
  assert f"--config=experiments/configs/default.py:{variants}" in cmd
  cfg = default.get_config(variants)
  for arg in cmd[5:]:
    dotted, value = arg[len("--config."):].split("=", 1)
    *path, key = dotted.split(".")
    node = cfg
    for part in path:
      node = node[part]
    node[key] = ast.literal_eval(value) if value.startswith("(") else type(node[key])(value)
  return cfg
