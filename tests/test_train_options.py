"""Trainer options through ``loop.train``: each one changes what it should."""

import dataclasses
import os

import numpy as np
import pytest

from agentic_rl import objectives
from agentic_rl.train import learner
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from experiments.configs import default


def _rl_only(iterations=3):
  cfg = default.get_config("all,tiny")
  cfg.stages = ("rl",)
  cfg.rl.iterations = iterations
  cfg.eval.every = 100  # held-out evaluation at the end only
  return cfg


def _rl_records(cfg, workdir):
  loop.train(cfg, str(workdir))
  return metrics_lib.read_metrics(os.path.join(str(workdir), "metrics.jsonl"))


class _Built(Exception):
  """Raised by a spy once the RL stage's objective is known."""


@pytest.mark.parametrize("loss", objectives.POLICY_LOSSES)
def test_each_loss_runs_with_its_own_hyperparameters(loss, monkeypatch):
  seen = []

  def spy(model_config, objective, **kwargs):
    seen.append(objective)
    raise _Built

  monkeypatch.setattr(learner, "rl_loss", spy)
  cfg = _rl_only()
  cfg.rl.loss = loss
  with pytest.raises(_Built):
    loop.train(cfg, "/nonexistent-unused")
  [objective] = seen
  want = objectives.hyperparameter_defaults()["loss"][loss]
  if loss == "ppo":
    want = dict(want, eps_high=0.28)  # the default config's clip-higher
  assert dict(objective.loss_kwargs) == want
  # A keyword set for another loss never reaches this one.
  other = "cispo" if loss != "cispo" else "ppo"
  cfg.rl.loss_kwargs[other].update(eps_high=9.0)
  seen.clear()
  with pytest.raises(_Built):
    loop.train(cfg, "/nonexistent-unused")
  assert dict(seen[0].loss_kwargs) == want


def test_mirror_descent_resets_the_optimiser_and_changes_the_updates(tmp_path):
  runs = {}
  for optimizer in ("adamw", "mirror_descent"):
    cfg = _rl_only(iterations=5)
    # Two families, on which the tiny policy's batches carry a gradient.
    cfg.tasks.update(families=("calc_chain", "multihop"), weights=(0.5, 0.5))
    cfg.rl.update(loss="kimi", advantage="kimi", optimizer=optimizer)
    runs[optimizer] = _rl_records(cfg, tmp_path / optimizer)
  adamw, md = runs["adamw"], runs["mirror_descent"]
  # The first iteration's gradient is the same, and so is the first update
  # (Adam's first step either way); a reset Adam (bias correction from step 1
  # every iteration) then takes other steps, so later batches and losses
  # differ.
  np.testing.assert_allclose(adamw[0]["learner/grad_norm"], md[0]["learner/grad_norm"],
                             rtol=1e-5)
  assert any(a["learner/grad_norm"] > 0 for a in adamw[:-1])
  assert any(not np.isclose(a["learner/loss"], m["learner/loss"], rtol=1e-4)
             for a, m in zip(adamw[1:], md[1:]))


def test_reinforce_ada_baseline_runs_over_every_generated_rollout(tmp_path, monkeypatch):
  made, original = [], objectives.group_advantages

  def spy(adv_fn, rewards_B, layout, **per_group):
    made.append((rewards_B, layout.group_B, per_group))
    return original(adv_fn, rewards_B, layout, **per_group)

  monkeypatch.setattr(objectives, "group_advantages", spy)
  cfg = _rl_only(iterations=1)
  cfg.rl.update(advantage="dr_grpo")
  cfg.rl.signal.update(allocation="ada", ada_max_rounds=3)
  [record] = _rl_records(cfg, tmp_path)
  [(rewards_B, group_B, per_group)] = made
  all_PxN, mask_PxN = per_group["all_rewards_PxN"], per_group["all_mask_PxN"]
  P, G = cfg.rl.prompts_per_step, cfg.rl.group_size
  assert all_PxN.shape[0] == P and mask_PxN.sum() >= P * G
  assert mask_PxN.sum() == record["signal/rollouts"]
  # Each kept reward is among its prompt's generated ones.
  for b, g in enumerate(group_B):
    assert np.isclose(all_PxN[g][mask_PxN[g]], rewards_B[b]).any()


def test_kl_reference_is_the_stage_start_or_a_named_checkpoint(tmp_path):
  start = _rl_only(iterations=1)
  start.rl.kl_coef = 0.05
  [at_start] = _rl_records(start, tmp_path / "start")
  # The first update's forward is at the reference itself.
  assert at_start["shift/kl_reference"] < 1e-6
  other = _rl_only(iterations=1)
  other.seed = 3  # other initial parameters
  loop.train(other, str(tmp_path / "other"))
  named = _rl_only(iterations=1)
  named.rl.update(kl_coef=0.05, reference_from=str(tmp_path / "other"))
  [from_named] = _rl_records(named, tmp_path / "named")
  assert from_named["shift/kl_reference"] > 1e-3
  named.rl.reference_from = str(tmp_path / "missing")
  with pytest.raises(ValueError, match="reference_from"):
    loop.train(named, str(tmp_path / "refused"))


def test_adaptive_staleness_tightens_the_actors_bound(tmp_path, monkeypatch):
  from agentic_rl.invariants import shift  # pylint: disable=g-import-not-at-top
  from agentic_rl.invariants.alarms import Band  # pylint: disable=g-import-not-at-top
  from agentic_rl.train import config as config_lib  # pylint: disable=g-import-not-at-top
  original = config_lib.shift_config

  def tight_band(stage):  # any KL is out of this band
    return dataclasses.replace(original(stage),
                               bands=(("shift/kl_behaviour_learner", Band(high=-1.0)),))

  monkeypatch.setattr(config_lib, "shift_config", tight_band)
  cfg = _rl_only(iterations=4)
  cfg.rl.update(max_staleness=2)
  cfg.rl.shift.adaptive_staleness = True
  records = _rl_records(cfg, tmp_path)
  assert [r["shift/staleness_bound"] for r in records] == [1, 0, 0, 0]
  # The actor's lag follows the bound: at most 2, then 1, then on-policy.
  lags = [r["shift/staleness_max"] for r in records]
  assert lags[0] == 0 and lags[1] <= 1 and lags[2:] == [0, 0]
  assert isinstance(original(config_lib.validate(cfg)["rl"]), shift.ShiftConfig)


def test_share_prefix_gives_the_losses_of_the_plain_learner(tmp_path, monkeypatch):
  """Two updates per batch (the scoring pass and the step) with a KL
  reference: the shared-prefix learner runs the prompt once per group, and
  every loss, gradient norm and KL equals the plain learner's."""
  from agentic_rl.model import prefix  # pylint: disable=import-outside-toplevel
  seen, forward_hidden = [], prefix.forward_hidden

  def spy(*args, prefix_len, **kwargs):
    seen.append(prefix_len)
    return forward_hidden(*args, prefix_len=prefix_len, **kwargs)

  monkeypatch.setattr(prefix, "forward_hidden", spy)
  runs = {}
  for share in (False, True):
    cfg = _rl_only()
    cfg.rl.update(share_prefix=share, updates_per_batch=2, kl_coef=0.01)
    runs[share] = _rl_records(cfg, tmp_path / str(share))
    assert bool(seen) == share
  # The shared length is a bucket of the prompts (about 80 tokens of 160).
  assert min(seen) >= 32
  plain, shared = runs[False], runs[True]
  assert len(plain) == len(shared) == 3
  for p, s in zip(plain, shared):
    for k in ("learner/loss", "learner/pg_loss", "learner/grad_norm", "shift/kl_reference",
              "shift/kl_behaviour_learner", "learner/entropy"):
      np.testing.assert_allclose(s[k], p[k], rtol=1e-5, atol=1e-7, err_msg=f"{k} at {p['step']}")
    assert s["reward/mean"] == p["reward/mean"]  # the same rollouts
  assert any(r["learner/grad_norm"] > 0 for r in plain)


def test_share_prefill_prefills_groups_once_or_rows_on_the_evaluation_engine(tmp_path,
                                                                           monkeypatch):
  """``sampling.share_prefill``: True compiles an engine that prefills each
  group's prompt once for its G rows; False prefills every row on its own,
  on the engine evaluation's samples use (one engine fewer). The episodes
  and updates are the same."""
  from agentic_rl.rollout.engine import RolloutEngine  # pylint: disable=import-outside-toplevel
  built, init = [], RolloutEngine.__init__

  def spy(self, *args, **kwargs):
    init(self, *args, **kwargs)
    built.append((self.batch_size, self.group_size))

  monkeypatch.setattr(RolloutEngine, "__init__", spy)
  runs = {}
  for share in (True, False):
    built.clear()
    cfg = _rl_only(iterations=1)
    cfg.sampling.share_prefill = share
    runs[share] = (_rl_records(cfg, tmp_path / str(share)), list(built))
  (shared, engines_shared), (alone, engines_alone) = runs[True], runs[False]
  rows = cfg.rl.prompts_per_step * cfg.rl.group_size
  assert (rows, cfg.rl.group_size) in engines_shared, engines_shared
  assert all(g == 1 for _, g in engines_alone), engines_alone
  assert len(engines_alone) == len(engines_shared) - 1
  assert len(shared) == len(alone) == 1
  for s, a in zip(shared, alone):
    assert s["reward/mean"] == a["reward/mean"]
    np.testing.assert_allclose(a["learner/loss"], s["learner/loss"], rtol=1e-5, atol=1e-7)
  assert shared[-1]["eval/success"] == alone[-1]["eval/success"]


def test_decode_shared_prefix_decodes_groups_from_one_cache(tmp_path, monkeypatch):
  """``sampling.decode_shared_prefix``: the engine decodes each group from
  one copy of its prompt's cache, and the behaviour log-probs it records
  are the learner's."""
  from agentic_rl.rollout.engine import RolloutEngine  # pylint: disable=import-outside-toplevel
  shared, shared_len = [], RolloutEngine._shared_len  # pylint: disable=protected-access

  def spy(self, prompt_len_P):
    shared.append(shared_len(self, prompt_len_P))
    return shared[-1]

  monkeypatch.setattr(RolloutEngine, "_shared_len", spy)
  cfg = _rl_only(iterations=2)
  cfg.sampling.update(share_prefill=True, decode_shared_prefix=True)
  records = _rl_records(cfg, tmp_path)
  assert max(shared) >= 16, shared  # the training groups decoded from a shared prefix
  for r in records:
    if "shift/logprob_mismatch_max" in r:
      assert r["shift/logprob_mismatch_max"] < 1e-4, r
  assert any("shift/logprob_mismatch_max" in r for r in records)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.sampling.update(share_prefill=True, decode_shared_prefix=True), None),
    (lambda c: c.sampling.update(decode_shared_prefix=True), "set share_prefill True"),
    (lambda c: (c.sampling.update(share_prefill=True, decode_shared_prefix=True),
                c.rl.update(group_size=1)), "no RL stage has group_size >= 2"),
    (lambda c: (c.sampling.update(share_prefill=True, decode_shared_prefix=True),
                c.tasks.update(source="host", host_env="guess_number")), "host loop"),
    (lambda c: (c.sampling.update(share_prefill=True),
                c.tasks.update(source="host", host_env="guess_number")), "prefills each row"),
])
def test_decode_shared_prefix_refusals(edit, match):
  from agentic_rl.train import config as config_lib  # pylint: disable=import-outside-toplevel
  cfg = default.get_config("all,tiny")
  edit(cfg)
  if match is None:
    config_lib.validate(cfg)
  else:
    with pytest.raises(config_lib.ConfigError, match=match):
      config_lib.validate(cfg)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.rl.update(share_prefix=True, group_size=1, advantage="reinforce_pp"),
     "group_size=1 makes groups of one rollout"),
    (lambda c: (c.rl.update(share_prefix=True, advantage="rloo"),
                c.rl.signal.update(allocation="knapsack")), "allocation='knapsack'"),
    (lambda c: (c.rl.update(share_prefix=True, prompts_per_step=3),
                c.update(micro_batches=2)), "splits the 3 groups"),
])
def test_share_prefix_refuses_groups_it_cannot_share(edit, match):
  from agentic_rl.train import config as config_lib  # pylint: disable=import-outside-toplevel
  cfg = default.get_config("all,tiny")
  edit(cfg)
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(cfg)
