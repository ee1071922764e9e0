"""The asynchronous actor through ``loop.train``: it overlaps the learner,
keeps every token within the staleness bound, carries episodes across
weight updates, and resumes without losing or repeating a batch."""

import os
import threading
import time

import jax
import numpy as np
import pytest

from agentic_rl import model as model_lib
from agentic_rl.envs import text_games
from agentic_rl.train import config as config_lib
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from agentic_rl.train import rl
from agentic_rl.train import run as run_lib
from agentic_rl.train import stream as stream_lib
from experiments.configs import default


SPANS = []  # (name, thread, start, end) of the spied calls


class SlowGuess(text_games.GuessNumber):
  """The example game with a slow start (0.1 s a reset): a batch of
  rollouts takes longer than an update of the tiny policy."""

  def reset(self, seed):
    t0 = time.monotonic()
    time.sleep(0.1)
    SPANS.append(("reset", threading.current_thread().name, t0, time.monotonic()))
    return super().reset(seed)


class SlowSteps(text_games.GuessNumber):
  """The example game whose every guess takes 0.05 s: episodes outlast an
  update of the tiny policy (partial rollouts)."""

  def step(self, action):
    time.sleep(0.05)
    return super().step(action)


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
  """Records (name, thread, start, end) of every update and environment
  reset, and every batch the learner consumes."""
  SPANS.clear()
  consumed = []

  def timed(name, fn):
    def wrapped(*args, **kwargs):
      t0 = time.monotonic()
      out = fn(*args, **kwargs)
      SPANS.append((name, threading.current_thread().name, t0, time.monotonic()))
      return out
    return wrapped

  original_shape = rl.shape_rewards

  def shape(stage, collected, budget=None):  # the first use of a consumed batch
    consumed.append(collected)
    return original_shape(stage, collected, budget)

  monkeypatch.setattr(rl, "update", timed("update", rl.update))
  monkeypatch.setattr(rl, "shape_rewards", shape)
  return SPANS, consumed


def _positions(consumed, train_size):
  """The data positions of the consumed groups (prompt ids are positions
  modulo the pool, which these runs do not wrap)."""
  ids = [p for c in consumed for p in c.sampled.prompt_ids.tolist()]
  assert max(ids) < train_size
  return ids


def test_the_actor_overlaps_the_learner_within_the_staleness_bound(tmp_path, monkeypatch):
  spans, consumed = _spy(monkeypatch)
  cfg = _async_cfg(iterations=4, staleness=1)
  summary = loop.train(cfg, str(tmp_path))
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
  assert summary["steps"] == 4 and "rl_discarded_batches" not in summary
  # The actor's environment calls (not the evaluation's, on the main thread).
  resets = [s for s in spans if s[0] == "reset" and s[1] != "MainThread"]
  updates = [s for s in spans if s[0] == "update"]
  assert resets and {s[1] for s in updates} == {"MainThread"}
  assert len(updates) == 4
  # Both make progress in the same wall-clock window.
  assert any(c0 < u1 and u0 < c1 for _, _, c0, c1 in resets for _, _, u0, u1 in updates)
  for r in records:
    assert r["shift/staleness_max"] <= 1 and r["shift/stale_dropped_frac"] == 0
    assert 0 <= r["perf/actor_idle_frac"] <= 1
    assert "shift/replayed_episodes" in r
  assert max(r["shift/staleness_max"] for r in records) == 1  # it did run ahead
  # Every token within the bound of the learner step that consumed it.
  for k, c in enumerate(consumed):
    mask = c.batch.loss_mask_BxT > 0
    assert c.batch.version_BxT[mask].min() >= k - 1
  ids = _positions(consumed, cfg.tasks.train_size)
  assert len(ids) == len(set(ids)) == 4 * cfg.rl.prompts_per_step


def test_windowed_fifo_takes_a_group_only_near_the_head_of_the_queue(tmp_path, monkeypatch):
  _, consumed = _spy(monkeypatch)
  rows = []
  original = stream_lib.HostStream.__init__

  def init(self, run, rl, *args, **kwargs):
    original(self, run, rl, *args, **kwargs)
    rows.append(self.loop.batch_size)

  monkeypatch.setattr(stream_lib.HostStream, "__init__", init)
  cfg = _async_cfg(iterations=3, staleness=2, env_workers=4)
  cfg.rl.shift.fifo_window_ratio = 1.0  # W = P
  cfg.rl.actor_rows = 3 * cfg.rl.prompts_per_step * cfg.rl.group_size // 2
  loop.train(cfg, str(tmp_path))
  assert rows == [cfg.rl.actor_rows]  # episodes in flight beyond one batch
  W = cfg.rl.prompts_per_step
  batches = [c.sampled.prompt_ids.tolist() for c in consumed]
  for k, batch in enumerate(batches):
    assert batch == sorted(batch)  # in launch order within a batch
    later = [p for b in batches[k + 1:] for p in b]
    for p in batch:  # taken while fewer than W older groups were still waiting
      assert sum(q < p for q in later) <= W - 1
  ids = _positions(consumed, cfg.tasks.train_size)
  assert len(ids) == len(set(ids))


def test_an_interrupted_async_run_resumes_without_losing_or_repeating_a_group(
    tmp_path, monkeypatch):
  _, consumed = _spy(monkeypatch)
  cfg = _async_cfg(iterations=5, staleness=2, env_workers=3)
  cfg.rl.shift.fifo_window_ratio = 2.0
  cfg.checkpoint.every = 100
  first = loop.train(cfg, str(tmp_path), stop_after=2)
  assert first["stopped"] == "stop_after"
  second = loop.train(cfg, str(tmp_path))
  assert second["steps"] == 5
  ids = _positions(consumed, cfg.tasks.train_size)
  P = cfg.rl.prompts_per_step
  assert len(ids) == len(set(ids)) == 5 * P  # none repeated
  # Out of order by at most the window: nothing older than it is skipped.
  assert set(range(max(ids) + 1 - 2 * 2 * P)) <= set(ids)
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
  assert [r["step"] for r in records] == list(range(5))


@pytest.mark.slow  # two runs with a warm start
def test_partial_rollouts_across_updates_are_kept_or_restarted(tmp_path, monkeypatch):
  """Slow guesses after a warm start: episodes outlast updates. With "keep"
  they continue under the new weights, each token recording its version;
  with "restart" each is replayed under the newest and made by one."""
  multi = {}
  for mode in ("keep", "restart"):
    _, consumed = _spy(monkeypatch)
    cfg = _async_cfg(iterations=6, staleness=1, env_workers=2,
                     host_env=f"{__name__}:SlowSteps")
    cfg.stages = ("sft", "rl")
    cfg.sft.update(steps=30, num_demos=64, batch_size=16)
    cfg.rl.shift.partial_rollout = mode
    workdir = os.path.join(str(tmp_path), mode)
    loop.train(cfg, workdir)
    multi[mode] = 0
    for k, c in enumerate(consumed):
      for mask, version in zip(c.batch.loss_mask_BxT > 0, c.batch.version_BxT):
        v = version[mask]
        assert (np.diff(v) >= 0).all() and (v >= k - 1).all()  # in order, within bound
        multi[mode] += len(set(v.tolist())) > 1
    records = metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl"))
    replayed = sum(r.get("shift/replayed_episodes", 0) for r in records)
  assert multi["keep"] > 0
  assert multi["restart"] == 0 and replayed > 0


@pytest.mark.slow
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


def _weights_that_change(params):
  """Weights whose version goes up by one at each call from the third to
  the sixth (four updates while the episodes run)."""
  calls = [0]

  def weights():
    calls[0] += 1
    return params, min(max(0, calls[0] - 2), 4)
  return weights


def test_restart_replays_episodes_that_new_weights_interrupt():
  """The actor's batch-by-batch collection on a host environment with
  weights updated mid-rollout: kept, episodes span versions; with restart,
  each is played again under the newest."""
  cfg = _async_cfg(host_env="guess_number")
  run = run_lib.build(cfg)
  params = model_lib.init_params(run.model_config, jax.random.key(0))
  sampling = config_lib.sampling_config(run.cfg)
  versions = {}
  for restart in (False, True):
    ro = run.rollout(params, sampling, "train", np.arange(8), jax.random.key(1), 0, 8,
                     weights=_weights_that_change(params), restart=restart)
    mask, version = np.asarray(ro.loss_mask_BxT) > 0, np.asarray(ro.version_BxT)
    versions[restart] = [set(v[m].tolist()) for m, v in zip(mask, version)]
  assert any(len(v) > 1 for v in versions[False])
  assert all(len(v) <= 1 for v in versions[True])


def test_restart_reaches_the_batch_by_batch_collection(tmp_path, monkeypatch):
  # Allocators other than uniform collect batch by batch through Run.rollout.
  seen = []
  original = run_lib.Run.rollout

  def rollout(self, *args, **kwargs):
    seen.append(kwargs.get("restart"))
    return original(self, *args, **kwargs)

  monkeypatch.setattr(run_lib.Run, "rollout", rollout)
  cfg = _async_cfg(iterations=1, staleness=1, host_env="guess_number")
  cfg.rl.signal.allocation = "dynamic"
  cfg.rl.shift.partial_rollout = "restart"
  loop.train(cfg, str(tmp_path))
  assert True in seen  # the actor's rollouts (evaluation's pass no restart)
