"""Context management through the trainer: the long-horizon ledger family
with each context policy, every segment scored as the policy saw it, and
the refusals."""

import os
import re

import numpy as np
import pytest

from agentic_rl.rollout import context as context_lib
from agentic_rl.text import default_codec
from agentic_rl.train import config as config_lib
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from experiments.configs import default


def _ledger_cfg(policy):
  cfg = default.get_config("all,tiny,ledger")
  cfg.context.policy = policy
  cfg.tasks.host_kwargs = '{"entries": 8}'  # every episode outgrows the context
  # Enough SFT for the tiny policy to close its actions, so episodes run long.
  cfg.sft.update(steps=60, learning_rate=1e-2)
  cfg.rl.iterations = 2
  cfg.eval.every = 2
  return cfg


@pytest.mark.parametrize("policy,actor", [
    ("drop_tool_results", "sync"),
    pytest.param("summary", "sync", marks=pytest.mark.slow),
    pytest.param("discard_all", "async", marks=pytest.mark.slow),
])
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


class Notes:
  """Twenty turns whatever the policy writes (five when the seed divides by
  three); observation n is ``note n`` and filler, so a long episode outgrows
  the context several times. Its demonstrations (``ok`` each turn; the short
  ones fit) teach the tiny policy to close its actions."""

  def reset(self, seed: int) -> str:
    self.n, self.turns = 0, 5 if seed % 3 == 0 else 20
    return "Read the notes."

  def step(self, action: str) -> tuple[str, float, bool]:
    self.n += 1
    return f"note {self.n}: " + "la " * 5, 0.0, self.n >= self.turns

  def demonstration(self, seed: int) -> list[str]:
    self.reset(seed)
    return ["ok"] * self.turns

  def summary(self, observations: list[str]) -> str:
    return f"{len(observations)} notes"


def _option_run(tmp_path, monkeypatch, **context):
  """A short warm start and one RL iteration of the tiny policy on
  :class:`Notes` with ``config.context`` set to ``context``; the learner's
  batch as it arrived."""
  cfg = default.get_config("all,tiny,ledger")
  cfg.tasks.update(host_env=f"{__name__}:Notes", host_kwargs="")
  cfg.context.update(**context)
  cfg.sampling.max_turns = 20
  cfg.sft.update(steps=30, learning_rate=1e-2)
  cfg.rl.iterations = 1
  seen = []
  scored_rows = context_lib.scored_rows
  monkeypatch.setattr(context_lib, "scored_rows",
                      lambda batch: seen.append(batch) or scored_rows(batch))
  loop.train(cfg, str(tmp_path))
  (batch,) = seen
  # Each rewritten context up to the policy's first token in it: segments
  # 1.. of every episode, and the final context of one rewritten at all.
  seg, count_B = batch.segments, np.asarray(batch.segments.count_B)
  rows = [(seg.tokens_BxKxT[b, k], seg.loss_mask_BxKxT[b, k])
          for b in range(len(count_B)) for k in range(1, count_B[b])]
  rows += [(batch.tokens_BxT[b], batch.loss_mask_BxT[b]) for b in np.flatnonzero(count_B)]
  decode = default_codec().tokenizer.decode
  heads = [decode(np.asarray(t)[:np.flatnonzero(np.asarray(m))[0]]) for t, m in rows]
  return batch, heads


@pytest.mark.slow
def test_context_options_through_the_trainer(tmp_path, monkeypatch):
  """``keep_tool_results``, ``max_resets`` and ``summary_request`` reach the
  episodes the learner trains on."""
  batch, heads = _option_run(tmp_path / "drop", monkeypatch, policy="drop_tool_results",
                             keep_tool_results=3, max_resets=1)
  count_B = np.asarray(batch.segments.count_B)
  assert batch.segments.tokens_BxKxT.shape[1] == 1 and count_B.max() == 1
  assert np.asarray(batch.truncated_B)[count_B == 1].any()  # the second overflow truncates
  assert heads
  for head in heads:  # the last three notes stay, the older ones are omitted
    notes = [int(n) for n in re.findall(r"note (\d+):", head)]
    assert len(notes) == 3 and notes == list(range(notes[0], notes[0] + 3)), head
    assert head.count(context_lib.OMITTED) == notes[0] - 1, head

  request = "Squeeze the notes now."
  batch, heads = _option_run(tmp_path / "summary", monkeypatch, policy="summary",
                             max_resets=3, summary_request=request)
  assert batch.segments.tokens_BxKxT.shape[1] == 3
  assert np.asarray(batch.segments.count_B).max() > 1
  assert heads and all(head.count(request) == 1 for head in heads), heads
  assert not any(context_lib.SUMMARY_REQUEST in head for head in heads)


def test_without_context_management_no_ledger_demonstration_fits(tmp_path):
  with pytest.raises(ValueError, match="no demonstration of host_env='ledger' ended done"):
    loop.train(_ledger_cfg("none"), str(tmp_path))


def test_context_management_refusals():
  cfg = default.get_config("all,tiny")
  cfg.context.policy = "discard_all"
  with pytest.raises(config_lib.ConfigError, match="tasks.source=host"):
    config_lib.validate(cfg)
  cfg = default.get_config("all,tiny,ledger")
  cfg.context.update(policy="drop_tool_results", keep_tool_results=0)
  with pytest.raises(config_lib.ConfigError, match="keep_tool_results"):
    config_lib.validate(cfg)
  cfg = default.get_config("all,tiny,ledger")
  cfg.context.policy = "summary"
  cfg.rl.advantage = "rebn"
  with pytest.raises(config_lib.ConfigError, match="per-token advantages by turn"):
    config_lib.validate(cfg)
  cfg = default.get_config("all,tiny")
  cfg.tasks.update(source="host", host_env="guess_number")
  cfg.context.policy = "summary"
  with pytest.raises(config_lib.ConfigError, match="summary\\(observations\\)"):
    config_lib.validate(cfg)
  cfg.stages = ("rl",)
  config_lib.validate(cfg)  # RL alone needs no demonstrated summaries
