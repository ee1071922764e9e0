"""Drawn combinations of the RL stage's options through ``loop.train``: each
one either trains (every iteration logged, finite losses) or is refused by
the config's validation, before anything compiles, with a message naming the
config key. Each option alone is tested for its effect elsewhere; this
checks that they compose."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentic_rl import objectives
from agentic_rl.train import config as config_lib
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from experiments.configs import default

OPTIONS = {
    "rl.loss": objectives.POLICY_LOSSES,
    "rl.advantage": objectives.ADVANTAGE_ESTIMATORS,
    "rl.correction": ("none", *objectives.CORRECTIONS),
    "rl.agg": objectives.AGG_MODES,
    "rl.signal.allocation": ("uniform", "dynamic", "knapsack", "ada"),
    "rl.signal.prompt_sampling": ("uniform", "prioritised"),
    "rl.signal.truncation": ("keep", "mask", "penalty"),
    "rl.actor": ("sync", "async"),
    "rl.max_staleness": (0, 1, 2),
    "rl.shift.stale_mode": ("drop", "downweight"),
    "rl.updates_per_batch": (1, 2),
    "rl.share_prefix": (False, True),
    "rl.kl_coef": (0.0, 0.1),
    "rl.entropy_coef": (0.0, 1e-3),
    "rl.top_p": (1.0, 0.9),
    "rl.toggle.phase_iterations": (0, 1),
    "sampling.share_prefill": (False, True),
    "micro_batches": (1, 2),
    "model.lora_rank": (0, 4),
    "tasks.difficulty": ((1,), (0, 2)),
}


def _set(cfg, dotted, value):
  *path, last = dotted.split(".")
  for key in path:
    cfg = cfg[key]
  cfg[last] = value


@pytest.mark.slow
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(choice=st.fixed_dictionaries({k: st.sampled_from(v) for k, v in OPTIONS.items()}))
def test_drawn_option_combinations_train_or_are_refused_up_front(choice, tmp_path_factory):
  cfg = default.get_config("tiny")
  cfg.stages = ("rl",)
  cfg.rl.update(iterations=2, group_size=4)
  cfg.eval.every = 100
  cfg.rl.advantage_kwargs.pass_at_k.k = 2
  for key, value in choice.items():
    _set(cfg, key, value)
  # Pairs refused by design (test_train.py, test_train_options.py): made
  # valid here so that most draws train.
  if cfg.rl.signal.allocation == "knapsack":
    cfg.rl.share_prefix = False
    if cfg.rl.advantage not in ("grpo", "dr_grpo", "rloo", "kimi"):
      cfg.rl.advantage = "grpo"
  if cfg.rl.advantage not in objectives.GLOBAL_STATS_ESTIMATORS:
    cfg.rl.signal.ada_global_stats = False
  try:
    config_lib.validate(cfg)
  except ValueError as e:
    assert str(e).startswith("config."), e
    return
  workdir = tmp_path_factory.mktemp("run")
  summary = loop.train(cfg, str(workdir))
  assert summary["steps"] == 2
  records = metrics_lib.read_metrics(os.path.join(str(workdir), "metrics.jsonl"))
  losses = [r["learner/loss"] for r in records if "learner/loss" in r]
  assert len(losses) == 2 and np.isfinite(losses).all(), (choice, losses)
