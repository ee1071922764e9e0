"""The asynchronous actor through ``loop.train``: it overlaps the learner,
keeps every token within the staleness bound, carries episodes across
weight updates, and resumes without losing or repeating a batch."""

import os
import threading
import time


from agentic_rl.envs import text_games
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from agentic_rl.train import rl
from experiments.configs import default


class SlowGuess(text_games.GuessNumber):
  """The example game with a slow start (0.1 s a reset): a batch of
  rollouts takes longer than an update of the tiny policy."""

  def reset(self, seed):
    time.sleep(0.1)
    return super().reset(seed)


def _async_cfg(iterations=4, staleness=1, **tasks):
  """RL only on the tiny config with the async actor, by default on
  :class:`SlowGuess` with one environment worker."""
  tasks = dict(dict(source="host", host_env=f"{__name__}:SlowGuess", env_workers=1), **tasks)
  cfg = default.get_config("tiny")
  cfg.stages = ("rl",)
  cfg.rl.update(iterations=iterations, actor="async", max_staleness=staleness)
  cfg.rl.signal.allocation = "uniform"
  cfg.eval.update(every=100, num_prompts=4, pass_k_prompts=2)
  cfg.tasks.update(**tasks)
  return cfg


def _spy(monkeypatch):
  """Records (thread, start, end) of every collect and update, and the
  prompts of every batch the learner consumes."""
  spans, consumed = [], []

  def timed(name, fn):
    def wrapped(*args, **kwargs):
      t0 = time.monotonic()
      out = fn(*args, **kwargs)
      spans.append((name, threading.current_thread().name, t0, time.monotonic()))
      return out
    return wrapped

  original_iteration = rl.rl_iteration

  def iteration(run, stage, state, collected, controls):
    consumed.append(collected.sampled.prompt_ids.tolist())
    return original_iteration(run, stage, state, collected, controls)

  monkeypatch.setattr(rl, "collect", timed("collect", rl.collect))
  monkeypatch.setattr(rl, "update", timed("update", rl.update))
  monkeypatch.setattr(rl, "rl_iteration", iteration)
  return spans, consumed


def test_the_actor_overlaps_the_learner_within_the_staleness_bound(tmp_path, monkeypatch):
  spans, consumed = _spy(monkeypatch)
  cfg = _async_cfg(iterations=4, staleness=1)
  summary = loop.train(cfg, str(tmp_path))
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
  assert summary["steps"] == 4 and "rl_discarded_batches" not in summary
  collects = [s for s in spans if s[0] == "collect"]
  updates = [s for s in spans if s[0] == "update"]
  assert {s[1] for s in collects} == {"actor"} and {s[1] for s in updates} == {"MainThread"}
  assert len(collects) == 4 and len(updates) == 4
  # Both make progress in the same wall-clock window.
  assert any(c0 < u1 and u0 < c1 for _, _, c0, c1 in collects for _, _, u0, u1 in updates)
  for r in records:
    assert r["shift/staleness_max"] <= 1 and r["shift/stale_dropped_frac"] == 0
    assert 0 <= r["perf/actor_idle_frac"] <= 1
  assert max(r["shift/staleness_max"] for r in records) == 1  # it did run ahead
  P = cfg.rl.prompts_per_step
  assert consumed == [list(range(k * P, (k + 1) * P)) for k in range(4)]


def test_an_interrupted_async_run_resumes_without_losing_or_repeating_a_batch(
    tmp_path, monkeypatch):
  _, consumed = _spy(monkeypatch)
  cfg = _async_cfg(iterations=5, staleness=2)
  cfg.checkpoint.every = 100
  first = loop.train(cfg, str(tmp_path), stop_after=2)
  assert first["stopped"] == "stop_after"
  second = loop.train(cfg, str(tmp_path))
  assert second["steps"] == 5
  P = cfg.rl.prompts_per_step
  assert consumed == [list(range(k * P, (k + 1) * P)) for k in range(5)]
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
  assert [r["step"] for r in records] == list(range(5))


def test_the_async_actor_on_the_jitted_families(tmp_path):
  # The jitted engine continues running episodes under new weights in
  # chunks (engine.resume); partial_rollout decides what the learner does
  # with older segments.
  cfg = _async_cfg(iterations=2, staleness=1, source="jax")
  cfg.rl.shift.partial_rollout = "mask"
  summary = loop.train(cfg, str(tmp_path))
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
  assert summary["steps"] == 2
  assert all(r["shift/staleness_max"] <= 1 for r in records)
