"""The trainer end to end: SFT then RL on a tiny config, resume, bad configs."""

import contextlib
import io
import json
import os
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl.train import config as config_lib
from agentic_rl.train import loop, stages
from agentic_rl.train import metrics as metrics_lib
from agentic_rl.rollout.engine import RolloutEngine
from agentic_rl.train import run as run_lib
from experiments.configs import default
from loss_masks import longest_action

REQUIRED = (
    "reward/mean", "reward/outcome", "reward/format", "reward/efficiency",
    "reward/efficiency_calls", "reward/efficiency_tokens", "reward/efficiency_time",
    "eval/success",
    "eval/pass_at_k", "explore/entropy", "explore/distinct_tool_seqs",
    "explore/distinct_success_seqs", "explore/tool_seq_edit_dist", "signal/zero_variance_frac", "signal/adv_std",
    "signal/effective_token_frac", "learner/grad_norm", "shift/staleness_mean",
    "shift/staleness_max", "shift/is_ratio_mean", "shift/is_ratio_max", "learner/clip_frac",
    "learner/loss", "learner/ratio_max", "learner/entropy", "shift/kl_reference",
    "shift/weight_zero_frac",
    "shift/logprob_mismatch_max", "shift/kl_behaviour_learner", "perf/rollout_tokens_per_s",
    "reward/greedy_baseline",
    "perf/learner_tokens_per_s", "perf/step_s")


def _cfg():
  cfg = default.get_config("all,tiny")
  # The off-policy path and its checkpointed actors: two updates per batch,
  # and the actor up to two updates behind.
  cfg.rl.update(max_staleness=2, updates_per_batch=2)
  # A KL penalty to the frozen reference policy (checkpointed with the run).
  cfg.rl.update(kl_coef=0.05, kl_estimator="k2")
  cfg.rl.signal.prompt_sampling = "prioritised"  # draws from the checkpointed history
  # Two difficulty levels, level 0 alone for the first two RL iterations.
  cfg.tasks.difficulty = (0, 1)
  cfg.rl.signal.curriculum = ((0, 0, 0), (2, 0, 1))
  # ReMax: each prompt's greedy rollout is its baseline (a path of its own).
  cfg.rl.advantage = "remax"
  # ... and the exploration controllers, whose state the resume must restore:
  # an entropy band above any reachable entropy, so the coefficient rises
  # every iteration, and a linear temperature decay.
  cfg.rl.entropy_coef = 1e-3
  cfg.rl.temperature = 1.2
  cfg.rl.exploration.update(entropy_band=(50.0, 60.0), entropy_coef_factor=2.0,
                            temperature_schedule="linear", temperature_final=0.8,
                            temperature_steps=2)
  return cfg


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("straight"))
  console = io.StringIO()
  with contextlib.redirect_stderr(console):
    summary = loop.train(_cfg(), workdir)
  return workdir, summary, console.getvalue()


def _comparable(records):
  return [{k: v for k, v in r.items() if not k.startswith("perf/") and k != "wall_time"}
          for r in records]


def test_sft_then_rl_end_to_end(straight):
  workdir, summary, console = straight
  cfg = _cfg()
  total = cfg.sft.steps + cfg.rl.iterations
  assert summary["steps"] == total
  assert "shift/deploy_tokens" not in summary  # the tiny config's deployment check is off
  for key in ("sft_success", "rl_success", "wall_s"):
    assert key in summary
  assert json.load(open(os.path.join(workdir, "summary.json")))["steps"] == total
  records = metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in records] == list(range(total))
  rl = [r for r in records if r["stage"] == 1]
  for key in REQUIRED:
    assert key in rl[-1], key
  for r in rl:
    assert np.isfinite(r["learner/loss"]) and r["learner/skipped"] == 0
    # Staleness counts learner updates: the actor lags by at most
    # max_staleness of them and no token is dropped for it.
    assert r["shift/staleness_max"] <= cfg.rl.max_staleness
    assert r["shift/weight_zero_frac"] == 0
  # On policy (the first batch), the learner's forward scores the behaviour
  # policy's own distribution: the same entropy.
  np.testing.assert_allclose(rl[0]["learner/entropy"], rl[0]["explore/entropy"], rtol=1e-4)
  # Snapshots are per batch of two updates: the lag is 0, then 2.
  assert [r["shift/staleness_max"] for r in rl] == [0, 2, 2]
  # The RL updates move the policy away from the reference (the metrics are
  # the second update's, so already after one update of the first batch).
  assert all(r["shift/kl_reference"] > 0 for r in rl)
  assert all(r["learner/grad_norm"] > 0 for r in rl[1:])
  # The adaptive entropy coefficient doubles each iteration (entropy below its
  # band); the sampling temperature follows the linear schedule, then holds.
  np.testing.assert_allclose([r["explore/entropy_coef"] for r in rl],
                             [1e-3 * 2**i for i in range(len(rl))], rtol=1e-6)
  np.testing.assert_allclose([r["explore/temperature"] for r in rl], [1.2, 1.0, 0.8], rtol=1e-6)
  assert [r["signal/prompt_difficulty"] for r in rl[:2]] == [0.0, 0.0]
  assert rl[2]["signal/prompt_difficulty"] > 0
  # The tiny policy solves nothing, so the strategy-collapse alarm fires from
  # the first iteration, in the metrics and on the console.
  assert all(r["alarm/explore/distinct_success_seqs_solved"] == 1.0 for r in rl)
  assert "[rl 0] ALARM " in console
  assert "explore/distinct_success_seqs_solved=0 not in [1.05, inf]" in console
  assert os.listdir(os.path.join(workdir, "tensorboard"))


def test_resume_gives_the_same_metrics(straight, tmp_path):
  workdir, _, _ = straight
  want = _comparable(metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl")))
  half = _cfg().sft.steps + 1  # stop inside the RL stage
  resumed = str(tmp_path)
  loop.train(_cfg(), resumed, stop_after=half)
  assert len(metrics_lib.read_metrics(os.path.join(resumed, "metrics.jsonl"))) == half
  loop.train(_cfg(), resumed)
  got = _comparable(metrics_lib.read_metrics(os.path.join(resumed, "metrics.jsonl")))
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.keys() == w.keys()
    for k in w:
      np.testing.assert_allclose(g[k], w[k], rtol=1e-5, atol=1e-6, err_msg=f"{k} at {w['step']}")


@pytest.mark.parametrize("edit, match", [
    (lambda c: setattr(c.rl, "group_size", 1), "group"),
    (lambda c: setattr(c.rl, "group_size", 0), r"config\.rl\.group_size must be an integer >= 1"),
    (lambda c: setattr(c.rl, "prompts_per_step", 0), r"config\.rl\.prompts_per_step must"),
    (lambda c: setattr(c.rl, "loss", "ppo2"), "ppo2"),
    (lambda c: setattr(c.rl, "advantage", "nope"), "nope"),
    (lambda c: setattr(c, "micro_batches", 3), "micro_batches"),
    (lambda c: setattr(c.tasks, "families", ("calc_chain", "chess")), "chess"),
    (lambda c: setattr(c, "stages", ("sft", "rl2")), "rl2"),
    (lambda c: setattr(c.mesh, "data", 3), "device"),
    (lambda c: c.rl.loss_kwargs.update(ppo2={}), r"loss_kwargs.*'ppo2'"),
    (lambda c: c.rl.loss_kwargs.ppo.update(eps_low=-1.0),
     r"config.rl: .*eps_low.*\(--config\.rl\.loss_kwargs\.ppo\.eps_low\)"),
    # A hyper-parameter's error names the flag that sets it.
    (lambda c: setattr(c.rl, "advantage", "pass_at_k"),
     r"k must be .* \(--config\.rl\.advantage_kwargs\.pass_at_k\.k\)"),
    (lambda c: (setattr(c.rl, "correction", "tis"), c.rl.correction_kwargs.tis.update(cap=0.0)),
     r"cap C must be > 0, got 0.0 \(--config\.rl\.correction_kwargs\.tis\.cap\)"),
    (lambda c: (c.rl.update(advantage="kimi", loss="kimi"), c.rl.loss_kwargs.kimi.update(tau=-1.0)),
     r"kimi: tau must be >= 0, got -1.0 \(--config\.rl\.loss_kwargs\.kimi\.tau\)$"),
    (lambda c: setattr(c.rl, "optimizer", "mirror_descent"), "loss=kimi"),
    (lambda c: setattr(c.rl, "kl_estimator", "k4"), "k4"),
    (lambda c: c.sft.update(schedule="warmup_cosine", steps=5, warmup_steps=10),
     r"warmup_cosine needs config\.sft\.steps > warmup_steps \(10\), got 5"),
    (lambda c: c.sft.update(num_demos=7, batch_size=8),
     r"config\.sft\.num_demos=7 demonstrations cannot fill a batch of config\.sft\.batch_size=8"),
    (lambda c: c.rl.shift.update(partial_rollout="mask"), "actor=async"),
    (lambda c: c.rl.shift.update(fifo_window_ratio=2.0), "windowed-FIFO"),
    (lambda c: setattr(c.rl, "actor", "threads"), "config.rl.actor"),
    (lambda c: setattr(c.rl, "actor_rows", 64), "actor_rows=64 sets how many episodes"),
    (lambda c: setattr(c.rl, "actor_rows", -1), "actor_rows must be an integer"),
    (lambda c: (setattr(c.rl, "advantage", "rloo"), c.rl.signal.update(allocation="ada")),
     "ada_global_stats=False"),
    (lambda c: setattr(c.sft, "steps", -1), "sft.steps"),
    (lambda c: setattr(c.sft.strategy_weights, "boxes", (1.0, 1.0)), r"strategy_weights\.boxes"),
    (lambda c: setattr(c.sft.strategy_weights, "composed", (1.0,)), "not one of this run's"),
    (lambda c: setattr(c.sft, "demo_noise", 1.5), r"demo_noise=1.5 is a probability"),
    (lambda c: setattr(c.sft, "schedule", "cosine"), "schedule"),
    (lambda c: setattr(c.rl, "iterations", 0), "rl.iterations"),
    (lambda c: setattr(c.rl, "updates_per_batch", 0), "updates_per_batch"),
    (lambda c: setattr(c.checkpoint, "every", 0), "checkpoint.every"),
    (lambda c: setattr(c.eval, "every", 0), "eval.every"),
    (lambda c: setattr(c.tasks, "test_size", 4), "test_size"),
    (lambda c: setattr(c.guards, "max_consecutive_skips", 0), "max_consecutive_skips"),
    (lambda c: setattr(c.rl, "reference_from", "/tmp"), "kl_coef"),
    (lambda c: (setattr(c.rl, "advantage", "reinforce_pp"),
                c.rl.signal.update(allocation="knapsack", knapsack_n_min=1)), "ragged"),
    (lambda c: c.rl.signal.update(curriculum=((0, 2, 3),)), "curriculum"),
    (lambda c: setattr(c.tasks, "difficulty", (1, -1)), "difficulty"),
    (lambda c: c.rl.exploration.update(entropy_band=(0.1,)), "entropy_band"),
    # An adaptive coefficient must start inside its bounds (here 0 < min).
    (lambda c: c.rl.exploration.update(entropy_band=(0.1, 0.5)), "entropy_coef"),
    (lambda c: c.rl.exploration.update(temperature_schedule="linear"), "temperature_steps"),
    (lambda c: (c.model.update(final_logit_softcap=30.0), c.rl.exploration.update(
        temperature_schedule="cosine", temperature_steps=5)), "softcap"),
])
def test_bad_configs_fail_before_compiling(edit, match):
  cfg = default.get_config("all,tiny")
  edit(cfg)
  with pytest.raises(ValueError, match=match):
    config_lib.validate(cfg)


@pytest.mark.parametrize("sampling, match", [
    # A context too short for the task prompts, with the size it needs.
    (dict(max_total_tokens=64), r"max_total_tokens=64: task prompts take up to (\d+) "
     r"tokens .* half the context \(32\); raise .* to at least"),
    # Actions longer than the task families read.
    (dict(max_new_tokens_per_turn=64), r"max_new_tokens_per_turn=64: the task families read "
     r"actions of at most (\d+) tokens"),
])
def test_sampling_limits_the_tasks_cannot_meet_are_refused_before_training(
    tmp_path, sampling, match):
  cfg = default.get_config("all,tiny")
  cfg.sampling.update(sampling)
  with pytest.raises(ValueError, match=match):
    loop.train(cfg, str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints")


def test_misspelt_override_lists_valid_keys():
  out = subprocess.run(
      [sys.executable, "-m", "experiments.train",
       "--config=experiments/configs/default.py:tiny", "--config.rl.group_sise=4"],
      capture_output=True, text=True, timeout=120,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert out.returncode != 0
  assert "config.rl.group_sise" in out.stderr and "'group_size'" in out.stderr
  with pytest.raises(ValueError, match="unknown config variant"):
    default.get_config("tiny,bogus")


@pytest.mark.parametrize("advantage", ["rebn", "gigpo"])
def test_turn_estimators_run_end_to_end(tmp_path, monkeypatch, advantage):
  # Token-level advantages [B, T] through the sharded, micro-batched step;
  # GiGPO also gets each turn's anchor state and each episode's group.
  cfg = default.get_config("all,tiny")
  cfg.stages = ("rl",)
  cfg.rl.update(iterations=1, advantage=advantage)
  cfg.micro_batches = 2
  cfg.eval.every = 100
  made, inputs, original = [], [], objectives.turn_advantages

  def spy(*args, **kwargs):
    made.append(original(*args, **kwargs))
    inputs.append(kwargs)
    return made[-1]

  monkeypatch.setattr(objectives, "turn_advantages", spy)
  summary = loop.train(cfg, str(tmp_path))
  [record] = metrics_lib.read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
  assert summary["steps"] == 1 and record["learner/skipped"] == 0
  assert np.isfinite(record["learner/loss"]) and np.isfinite(record["signal/adv_std"])
  rows = cfg.rl.prompts_per_step * cfg.rl.group_size
  assert [a.shape for a in made] == [(rows, cfg.sampling.max_total_tokens)]
  if advantage == "gigpo":
    [kw] = inputs
    G = cfg.rl.group_size
    np.testing.assert_array_equal(kw["group_B"], np.repeat(np.arange(rows // G), G))
    states = kw["state_BxN"].reshape(rows // G, G, -1)
    assert (states[:, :, 0] == states[:, :1, 0]).all()  # a group's turns 0 share the prompt
    assert len(np.unique(states[:, 0, 0])) == rows // G
  else:
    assert "state_BxN" not in inputs[0]


def test_rollout_budget_ends_the_stage_at_equal_sampling_cost(tmp_path):
  # Uniform allocation spends P * G = 8 episodes an iteration: a budget of 12
  # ends the stage after two of its ten iterations, evaluated at its end.
  cfg = default.get_config("all,tiny")
  cfg.stages = ("rl",)
  cfg.rl.update(iterations=10, rollout_budget=12)
  cfg.rl.signal.allocation = "uniform"
  cfg.eval.every = 100
  summary = loop.train(cfg, str(tmp_path))
  records = metrics_lib.read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
  assert [r["signal/stage_rollouts"] for r in records] == [8.0, 16.0]
  assert summary["steps"] == 2 and "eval/success" in records[-1]
  assert summary["rl_success"] == records[-1]["eval/success"]
  assert summary["rl_success_sampled"] == records[-1]["eval/pass_at_1"]
  sampled = {k.split("/")[-1]: v for k, v in records[-1].items() if k.startswith("eval/pass_at_1/")}
  assert sampled and sampled == {k.split("/")[-1]: v for k, v in summary.items()
                                 if k.startswith("rl_success_sampled/")}
  # A finished run resumed prints its summary: the budget still counts as done.
  assert loop.train(cfg, str(tmp_path))["steps"] == 2
  cfg.rl.rollout_budget = -1
  with pytest.raises(ValueError, match="rollout_budget"):
    config_lib.validate(cfg)


def test_sft_demonstrations_keep_to_the_policys_tokens_per_turn():
  """The SFT stage imitates only demonstrations whose every action fits in
  ``sampling.max_new_tokens_per_turn``: the rollout could never finish a
  longer one."""
  cfg = default.get_config("all,tiny")
  demos = run_lib.build(cfg).demonstrations(None, cfg.sft, jax.random.key(0))
  limit = longest_action(demos["loss_mask_BxT"]) - 2
  cfg.sampling.max_new_tokens_per_turn = limit
  short = run_lib.build(cfg).demonstrations(None, cfg.sft, jax.random.key(0))
  assert longest_action(short["loss_mask_BxT"]) <= limit
  assert 0 < len(short["tokens_BxT"]) < len(demos["tokens_BxT"])


def test_too_few_demonstrations_left_for_a_batch_are_refused_naming_the_limits(tmp_path):
  """Demonstrations the rollout could not record are left out; when fewer
  rows than an SFT batch remain, the run stops before compiling and says
  which limits left them out."""
  cfg = default.get_config("all,tiny")
  cfg.stages = ("sft",)
  demos = run_lib.build(cfg).demonstrations(None, cfg.sft, jax.random.key(0))
  longest_N = np.array([longest_action([m]) for m in demos["loss_mask_BxT"]])
  # The longest per-turn limit that leaves at least one demonstration and
  # fewer than a batch.
  limit = max(v for v in longest_N if 0 < (longest_N <= v).sum() < cfg.sft.batch_size)
  cfg.sampling.max_new_tokens_per_turn = int(limit)
  with pytest.raises(ValueError, match=r"config.sft.batch_size=8 is more than the \d rows of "
                     r"demonstrations: .*max_new_tokens_per_turn"):
    loop.train(cfg, str(tmp_path))


def test_evaluation_decodes_greedily_and_samples_with_one_compiled_engine():
  """Greedy decoding and the pass@k samples run one program (temperature 0
  is greedy), and its greedy episodes are a greedy engine's."""
  cfg = _cfg()
  run = run_lib.build(cfg)
  params = model_lib.init_params(run.model_config, jax.random.key(0))
  out = run_lib.evaluate(run, params, jax.random.key(1))
  assert len(run.collector.engines) == 1, list(run.collector.engines)
  assert {"eval/success", "eval/pass_at_k", "eval/pass_at_1"} <= set(out)
  sampling = config_lib.sampling_config(run.cfg, greedy=True)
  ids = np.arange(cfg.eval.num_prompts)
  shared = run.rollout(params, sampling, "test", ids, jax.random.key(1), 0, cfg.eval.batch_rows)
  inst = run.tasks.instances("test", ids)
  prompts, lens = run.tasks.prompts(inst)
  own = RolloutEngine(run.model_config, sampling, run.codec.ids, env=run.collector.env,
                              batch_size=cfg.eval.batch_rows).rollout(
                                  params, prompts, lens, inst, jax.random.key(2), 0)
  np.testing.assert_array_equal(shared.tokens_BxT, own.tokens_BxT)
  assert len(run.collector.engines) == 1


def test_evaluation_reports_greedy_and_sampled_success_per_family(monkeypatch):
  """Greedy success over the evaluation prompts, sampled success (pass@1)
  over the pass@k samples, each overall and per family; the summary takes
  both from a stage's last evaluation."""
  cfg = default.get_config("all,tiny")
  cfg.eval.update(num_prompts=12, pass_k=3, pass_k_prompts=6)
  run = run_lib.build(cfg)
  calls = []

  def rollout(params, sampling, split, ids, key, step, rows, group_size=None):
    # Greedy: prompts with an even id succeed; sampled: the first sample of
    # prompts whose id is a multiple of 3.
    del params, split, key, step, rows, group_size
    calls.append(sampling.greedy)
    ok = ids % 2 == 0 if sampling.greedy else (ids % 3 == 0) & (np.arange(len(ids)) % 3 == 0)
    return types.SimpleNamespace(reward_components={"outcome": ok.astype(np.float32)}, info={})

  monkeypatch.setattr(run, "rollout", rollout)
  out = run_lib.evaluate(run, None, jax.random.key(0))
  assert calls == [True, False]
  assert out["eval/success"] == 0.5 and out["eval/pass_at_1"] == pytest.approx(1 / 9)
  assert out["eval/pass_at_k"] == pytest.approx(1 / 3)
  family = run.families_of("test", np.arange(cfg.eval.num_prompts))
  assert len(set(family[:cfg.eval.pass_k_prompts])) > 1
  for f, name in enumerate(run.family_names):
    if np.any(family == f):
      assert out[f"eval/success/{name}"] == np.mean(np.arange(12)[family == f] % 2 == 0)
    if np.any(family[:6] == f):
      want = np.mean(np.arange(6)[family[:6] == f] % 3 == 0) / 3
      assert out[f"eval/pass_at_1/{name}"] == pytest.approx(want)
    else:
      assert f"eval/pass_at_1/{name}" not in out
  d = types.SimpleNamespace(summary={})
  stages.summarise_success(d, "rl", out, "rl_success")
  assert d.summary["rl_success"] == 0.5 and d.summary["rl_success_sampled"] == out["eval/pass_at_1"]
  assert {k for k in d.summary if "/" in k} == {
      k.replace("eval/success", "rl_success").replace("eval/pass_at_1", "rl_success_sampled")
      for k in out if k.startswith(("eval/success/", "eval/pass_at_1/"))}
