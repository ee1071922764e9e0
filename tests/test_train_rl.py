"""The RL iteration's stages on their own: the prompt source, and collection
through the signal controller's allocators (a coin-flip rollout stands in
for the engine)."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import struct

from agentic_rl.invariants import exploration, shift, signal
from agentic_rl.invariants.rng import host_rng
from agentic_rl.train import reward_hooks, rl, settings


@struct.dataclass
class _Rollout:
  prompt: np.ndarray
  version: np.ndarray
  reward_components: dict


class _Run:
  """``Run.rollout`` with P(success) = p_true[prompt]; records the calls."""

  hooks = reward_hooks.Hooks()  # none
  cfg = settings.Settings()  # no sub-agents

  def __init__(self, p_true):
    self.p_true, self.calls = p_true, []

  def rollout(self, params, sampling, split, ids, key, version, rows, temperature=None,
              weights=None, restart=False):
    self.calls.append((split, len(ids), rows, temperature, restart))
    outcome = host_rng(key).random(len(ids)) < self.p_true[ids]
    return _Rollout(np.asarray(ids), np.full(len(ids), version),
                    {"outcome": outcome.astype(np.float32)})


def _stage(allocation, P=4, G=3, **signal_kw):
  return rl.RLStage(P, G, 1, sampling=None, objective=None, needs=frozenset(),
                    signal_cfg=signal.SignalConfig(allocation=allocation, **signal_kw),
                    shift_cfg=shift.ShiftConfig(), explore_cfg=exploration.ExplorationConfig(),
                    step_fn=None, state_sharding=None)


def test_prompt_source_owns_the_data_position():
  source = rl.PromptSource(signal.SignalConfig(), np.zeros(10, int), position=8)
  history = signal.init_history(10)
  np.testing.assert_array_equal(source.draw(4, None, history=history, step=0), [8, 9, 0, 1])
  assert source.position == 12
  prioritised = rl.PromptSource(signal.SignalConfig(prompt_sampling="prioritised"),
                                np.zeros(10, int), position=3)
  ids = prioritised.draw(4, jax.random.key(0), history=history, step=0)
  assert len(set(ids.tolist())) == 4 and prioritised.position == 3


@pytest.mark.parametrize("allocation", ["uniform", "dynamic", "ada", "knapsack"])
def test_collect_keeps_the_allocated_rollouts_group_by_group(allocation):
  p_true = np.tile([0.0, 0.5, 1.0, 0.2], 10)
  run = _Run(p_true)
  stage = _stage(allocation)
  prompts = rl.PromptSource(stage.signal_cfg, np.zeros(40, int), position=10)
  history = signal.update_history(signal.init_history(40), np.arange(40), p_true * 8, 8)
  got = rl.collect(run, stage, ({}, 7), prompts, history, jax.random.key(1), step=0)
  sampled, batch, layout = got.sampled, got.batch, got.layout
  assert sampled.num_groups == layout.num_groups == 4
  # Every kept row is its group's prompt, with the outcome the allocator kept.
  np.testing.assert_array_equal(batch.prompt, sampled.prompt_ids[layout.group_B])
  np.testing.assert_array_equal(batch.reward_components["outcome"] > 0.5, sampled.success)
  assert (batch.version == 7).all()
  assert len(sampled.generated.prompt) == sampled.metrics["signal/rollouts"]
  assert all(rows == 12 and split == "train" and not restart
             for split, _, rows, _, restart in run.calls)
  if allocation == "knapsack":
    assert layout.size is None and layout.sizes.sum() == 12
  else:
    assert layout.size == 3
  if allocation == "dynamic":  # refills draw on from the data position
    assert prompts.position == 10 + len(sampled.generated_ids) // 3 > 14
  else:
    assert prompts.position == 14


@struct.dataclass
class _Episodes:
  reward_B: np.ndarray
  truncated_B: np.ndarray
  length_B: np.ndarray
  status_B: np.ndarray


def test_failed_episodes_leave_the_advantages_and_the_loss():
  from agentic_rl import objectives  # pylint: disable=g-import-not-at-top
  # Three groups of three; row 1 failed (env_error), and group 2 keeps one
  # episode (rows 6, 7 failed), which is too few to compare: it leaves too.
  rewards = np.array([1, 0, 0, 1, 1, 0, 1, 0, 0], np.float32)
  status = np.array([0, 1, 0, 0, 0, 0, 2, 3, 0], np.int32)
  batch = _Episodes(rewards, np.zeros(9, bool), np.full(9, 10), status)
  layout = objectives.GroupLayout.of(np.repeat([0, 1, 2], 3), 3)
  collected = rl.Collected(batch, layout, sampled=None, greedy=None, seconds=0.0)
  stage = dataclasses.replace(_stage("uniform"),
                              objective=objectives.ObjectiveConfig(advantage="grpo"))
  shaped = rl.shape_rewards(stage, collected)
  np.testing.assert_array_equal(shaped.valid_B, [1, 0, 1, 1, 1, 1, 0, 0, 0])
  adv = rl.compute_advantages(stage, collected, shaped)
  grpo = objectives.make_advantage_fn(stage.objective)
  np.testing.assert_allclose(adv[[0, 2]], np.asarray(grpo(rewards[None, [0, 2]]))[0])
  np.testing.assert_allclose(adv[3:6], np.asarray(grpo(rewards[None, 3:6]))[0])
  assert (adv[[1, 6, 7, 8]] == 0).all()
