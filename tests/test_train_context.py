"""Context management through the trainer: the long-horizon ledger family
with each context policy, every segment scored as the policy saw it, and
the refusals."""

import os

import numpy as np
import pytest

from agentic_rl.train import config as config_lib
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from experiments.configs import default


def _ledger_cfg(policy):
  cfg = default.get_config("tiny,ledger")
  cfg.context.policy = policy
  cfg.tasks.host_kwargs = '{"entries": 8}'  # every episode outgrows the context
  # Enough SFT for the tiny policy to close its actions, so episodes run long.
  cfg.sft.update(steps=60, learning_rate=1e-2)
  cfg.rl.iterations = 2
  cfg.eval.every = 2
  return cfg


@pytest.mark.parametrize("policy,actor", [("drop_tool_results", "sync"), ("summary", "sync"),
                                          ("discard_all", "async")])
def test_each_context_policy_trains_on_every_segment(tmp_path, policy, actor):
  cfg = _ledger_cfg(policy)
  if actor == "async":  # continuous batching, one update of staleness, partial masking
    cfg.rl.update(actor="async", max_staleness=1, actor_rows=16)
    cfg.rl.signal.allocation = "uniform"
    cfg.rl.shift.partial_rollout = "mask"
  summary = loop.train(cfg, str(tmp_path))
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
  rl = [r for r in records if "episode/context_resets" in r]
  assert len(rl) == 2 and summary["steps"] == 62
  # Episodes outgrew their context and went on in new segments ...
  assert max(r["episode/context_resets"] for r in rl) > 0
  assert all(r["episode/peak_context_tokens"] <= 224 for r in rl)
  for r in rl:
    assert r["learner/grad_norm"] > 0 and r["shift/staleness_max"] <= 1
    if r["shift/staleness_max"] == 0:
      # ... and the learner scored every segment as the policy saw it: its
      # log-probs at the update equal the behaviour log-probs on every row.
      assert r["shift/logprob_mismatch_max"] < 1e-4, r["shift/logprob_mismatch_max"]
  assert any(r["shift/staleness_max"] == 0 for r in rl)


def test_without_context_management_no_ledger_demonstration_fits(tmp_path):
  with pytest.raises(ValueError, match="no demonstration of host_env='ledger' ended done"):
    loop.train(_ledger_cfg("none"), str(tmp_path))


def test_context_management_refusals():
  cfg = default.get_config("tiny")
  cfg.context.policy = "discard_all"
  with pytest.raises(config_lib.ConfigError, match="tasks.source=host"):
    config_lib.validate(cfg)
  cfg = default.get_config("tiny,ledger")
  cfg.context.update(policy="drop_tool_results", keep_tool_results=0)
  with pytest.raises(config_lib.ConfigError, match="keep_tool_results"):
    config_lib.validate(cfg)
  cfg = default.get_config("tiny,ledger")
  cfg.context.policy = "summary"
  cfg.rl.advantage = "rebn"
  with pytest.raises(config_lib.ConfigError, match="per-token advantages by turn"):
    config_lib.validate(cfg)
  cfg = default.get_config("tiny")
  cfg.tasks.update(source="host", host_env="guess_number")
  cfg.context.policy = "summary"
  with pytest.raises(config_lib.ConfigError, match="summary\\(observations\\)"):
    config_lib.validate(cfg)
  cfg.stages = ("rl",)
  config_lib.validate(cfg)  # RL alone needs no demonstrated summaries
