"""The distill stage and per-stage task families, through ``loop.train``; the
reverse-KL loss against a hand computation."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl.train import checkpoint, distill, learner, loop, rl
from agentic_rl.train import config as config_lib
from agentic_rl.train import metrics as metrics_lib
from agentic_rl.train import run as run_lib
from experiments.configs import default

import train_devices

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny():
  """The tiny config on two task families: the tests below give the boxes
  family a role of its own (a family without a teacher, one outside the run)."""
  cfg = default.get_config("all,tiny")
  cfg.tasks.update(families=("calc_chain", "multihop"), weights=(0.5, 0.5))
  return cfg


def test_reverse_kl_matches_a_hand_computation():
  rng = np.random.default_rng(0)
  s, t = rng.normal(size=(2, 2, 4, 5)).astype(np.float32)
  tokens = rng.integers(0, 5, (2, 4))
  weights = np.array([[0, 1, 1, 0], [0, 0, 1, 1]], np.float32)
  loss, m = objectives.distill.reverse_kl(s, t, tokens, weights, jnp.float32(4.0))
  p = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
  q = np.exp(t) / np.exp(t).sum(-1, keepdims=True)
  kl = (p * (np.log(p) - np.log(q))).sum(-1)  # [B, T]: position t - 1 predicts token t
  want = sum(kl[b, i - 1] for b, i in ((0, 1), (0, 2), (1, 2), (1, 3))) / 4
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(m["reverse_kl"], want, rtol=1e-5)
  same, _ = objectives.distill.reverse_kl(s, s, tokens, weights, jnp.float32(4.0))
  np.testing.assert_allclose(same, 0.0, atol=1e-6)
  # The teacher gets no gradient; the student's is the KL's.
  g_s, g_t = jax.grad(lambda a, b: objectives.distill.reverse_kl(
      a, b, tokens, weights, jnp.float32(4.0))[0], argnums=(0, 1))(s, t)
  assert np.abs(g_s).sum() > 0 and not np.abs(g_t).any()


def test_each_row_is_scored_by_its_own_teacher():
  """Two teachers, one of them the student itself: its rows have zero KL."""
  config = model_lib.TransformerConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2,
                                       n_kv_heads=1, head_dim=8, mlp_dim=32)
  student = model_lib.init_params(config, jax.random.key(0))
  other = model_lib.init_params(config, jax.random.key(1))
  tokens = jax.random.randint(jax.random.key(2), (4, 6), 0, 32)
  mask = jnp.ones((4, 6)).at[:, 0].set(0)
  loss_fn = learner.distill_loss(config)
  norm = objectives.batch_normalisers(mask)

  def kl_of(teacher_B, rows=(0, 1, 2, 3)):
    keep = jnp.zeros((4, 1)).at[jnp.asarray(rows)].set(1.0)
    batch = {"tokens_BxT": tokens, "loss_mask_BxT": mask * keep,
             "teacher_B": jnp.asarray(teacher_B)}
    return float(jax.jit(lambda r: loss_fn(student, batch, norm, reference=r)[0])(
        [student, other]))

  assert kl_of([0, 0, 0, 0]) == pytest.approx(0.0, abs=1e-6)
  both = kl_of([0, 1, 0, 1])
  assert both > 0 and both == pytest.approx(kl_of([1, 1, 1, 1], rows=(1, 3)), rel=1e-5)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
  """A tiny warm-started policy (SFT only), another seed than the students'."""
  cfg = _tiny()
  cfg.stages = ("sft",)
  cfg.sft.steps = 12
  cfg.seed = 7
  workdir = str(tmp_path_factory.mktemp("teacher"))
  loop.train(cfg, workdir)
  return workdir


def _distill_cfg(teacher, mode="on_policy", iterations=4):
  cfg = _tiny()
  cfg.stages = ("distill",)
  cfg.distill.update(mode=mode, iterations=iterations, learning_rate=1e-2)
  cfg.distill.teachers.all = teacher
  cfg.eval.every = 100
  return cfg


def test_on_policy_distillation_moves_the_student_to_its_teacher(teacher_dir, tmp_path):
  cfg = _distill_cfg(teacher_dir, iterations=6)
  summary = loop.train(cfg, str(tmp_path))
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
  kl = [r["distill/reverse_kl"] for r in records]
  assert kl[-1] < 0.7 * kl[0], kl
  assert {"distill_success/calc_chain", "distill_success/multihop"} <= set(summary)
  # Checkpoints hold the student, not the teachers.
  with checkpoint.Checkpointer(str(tmp_path)) as ckpt:
    restored, _ = ckpt.restore()
  assert restored.get("ref_params") is None


def test_teacher_sft_imitates_the_teachers_own_rollouts(teacher_dir, tmp_path, monkeypatch):
  sampled_with = []
  teacher_rollouts = distill.teacher_rollouts

  def spy(run, ds, ids, teacher_N, key, version):
    sampled_with.extend(ds.teachers[t] for t in np.unique(teacher_N))
    return teacher_rollouts(run, ds, ids, teacher_N, key, version)

  monkeypatch.setattr(distill, "teacher_rollouts", spy)
  cfg = _distill_cfg(teacher_dir, mode="teacher_sft", iterations=3)
  loop.train(cfg, str(tmp_path))
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
  assert all("sft/nll" in r and "distill/reverse_kl" not in r for r in records)
  teacher = checkpoint.load_params(teacher_dir, like=sampled_with[0])
  assert len(sampled_with) == 3
  for params in sampled_with:
    jax.tree.map(np.testing.assert_array_equal, params, teacher)


def test_per_family_teachers_score_their_own_families(teacher_dir, tmp_path, monkeypatch):
  """Two teacher directories: each row's teacher is its prompt's family's."""
  other = str(tmp_path / "other")
  os.symlink(teacher_dir, other)
  seen, collected = [], []
  make, collect = distill.make_distill_stage, rl.collect

  def spy_make(run, stage, optimizer, params):
    ds = make(run, stage, optimizer, params)
    seen.append(ds)
    step_fn = ds.rl.step_fn

    def step(state, batch):
      seen.append(np.asarray(batch["teacher_B"]))
      return step_fn(state, batch)

    ds.rl.step_fn = step
    return ds

  def spy_collect(run, *args, **kwargs):
    out = collect(run, *args, **kwargs)
    collected.append(run.families_of("train", out.prompt_B))
    return out

  monkeypatch.setattr(distill, "make_distill_stage", spy_make)
  monkeypatch.setattr(rl, "collect", spy_collect)
  cfg = _distill_cfg(teacher_dir, iterations=2)
  cfg.distill.teachers.update(all="", calc_chain=teacher_dir, multihop=other)
  loop.train(cfg, str(tmp_path / "run"))
  ds, *teacher_B = seen
  assert len(ds.teachers) == 2
  np.testing.assert_array_equal(ds.teacher_of_family, [0, 1])
  for rows, family in zip(teacher_B, collected):
    np.testing.assert_array_equal(rows[:len(family)], family)
  assert len(np.unique(np.concatenate(collected))) == 2  # both families were drawn


def test_a_stage_draws_only_its_families(tmp_path, monkeypatch):
  drawn = []
  rollout = run_lib.Run.rollout

  def spy(self, params, sampling, split, ids, *args, **kwargs):
    if split == "train":
      drawn.append((self, np.asarray(ids)))
    return rollout(self, params, sampling, split, ids, *args, **kwargs)

  monkeypatch.setattr(run_lib.Run, "rollout", spy)
  cfg = _tiny()
  cfg.stages = ("rl",)
  cfg.rl.update(iterations=2, families=("multihop",))
  cfg.rl.signal.allocation = "uniform"
  cfg.eval.every = 100
  loop.train(cfg, str(tmp_path))
  run, _ = drawn[0]
  ids = np.concatenate([i for _, i in drawn])
  assert len(ids) == 2 * 4 * 2
  np.testing.assert_array_equal(run.families_of("train", ids), 1)
  # Consecutive iterations walk the family's pool in data order.
  np.testing.assert_array_equal(np.unique(ids), run.prompt_pool(("multihop",))[:8])


@pytest.mark.parametrize("change, message", [
    (dict(mode="dagger"), "mode"),
    (dict(teachers={"all": ""}), "no teacher"),
    (dict(teachers={"boxes": "/x"}), "not task families"),
    (dict(teachers={"all": "/nonexistent"}), "not a run directory"),
    (dict(families=("boxes",)), "does not hold"),
])
def test_distill_configs_are_refused_before_building(change, message, tmp_path):
  (tmp_path / "checkpoints").mkdir()  # looks like a run directory
  cfg = _tiny()
  cfg.stages = ("distill",)
  cfg.distill.teachers.all = str(tmp_path)
  for key, value in change.items():
    if key == "teachers":
      cfg.distill.teachers.all = ""
      cfg.distill.teachers.update(value)
    else:
      cfg.distill[key] = value
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(cfg)


def test_lora_host_families_and_a_comma_list_of_stages_are_refused(tmp_path):
  (tmp_path / "checkpoints").mkdir()
  cfg = _tiny()
  cfg.stages = ("distill",)
  cfg.distill.teachers.all = str(tmp_path)
  cfg.model.lora_rank = 4
  with pytest.raises(config_lib.ConfigError, match="lora_rank=0"):
    config_lib.validate(cfg)
  cfg = _tiny()
  cfg.rl.families = ("calc_chain",)
  cfg.rl.signal.prompt_sampling = "prioritised"
  with pytest.raises(config_lib.ConfigError, match="prompt_sampling=uniform"):
    config_lib.validate(cfg)
  cfg = default.get_config("all,tiny,ledger")
  cfg.rl.families = ("calc_chain",)
  with pytest.raises(config_lib.ConfigError, match="one family"):
    config_lib.validate(cfg)
  cfg = _tiny()
  cfg.stages = ("sft,distill",)  # what --config.stages=sft,distill gives
  with pytest.raises(config_lib.ConfigError, match=r"\('sft', 'distill'\)"):
    config_lib.validate(cfg)


def test_a_teacher_of_another_architecture_is_refused(teacher_dir, tmp_path):
  cfg = _distill_cfg(teacher_dir)
  cfg.model.mlp_dim = 2 * cfg.model.mlp_dim
  with pytest.raises(config_lib.ConfigError, match="teacher"):
    loop.train(cfg, str(tmp_path))


def test_the_stagewise_variant_trains_family_after_family():
  cfg = default.get_config("all,tiny,stagewise")
  assert cfg.stages == ("sft", "rl_calc_chain", "rl_multihop", "rl_boxes")
  assert cfg.rl_calc_chain.families == ("calc_chain",)
  assert cfg.rl_multihop.families == ("multihop",)
  assert cfg.rl_multihop.iterations == cfg.rl.iterations
  config_lib.validate(cfg)


@pytest.mark.slow
def test_distillation_on_two_devices_matches_one_device(teacher_dir, tmp_path):
  """The teacher scored inside the FSDP-sharded step: the same metrics."""
  one = str(tmp_path / "one")
  loop.train(train_devices.config(teacher_dir), one)
  out = subprocess.run(
      [sys.executable, train_devices.__file__, str(tmp_path / "two"), "fsdp=2",
       "--teacher", teacher_dir],
      env=dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join([_ROOT, os.path.dirname(__file__)])),
      capture_output=True, text=True, timeout=900, cwd=_ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  two, = json.loads(out.stdout.strip().splitlines()[-1])
  got, want = (metrics_lib.read_metrics(os.path.join(d, "metrics.jsonl")) for d in (two, one))
  assert len(got) == len(want) == 3
  for g, w in zip(got, want):
    for k in ("distill/reverse_kl", "distill/teacher_logp", "learner/grad_norm"):
      np.testing.assert_allclose(g[k], w[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_distill_sampling_and_group_options_reach_the_rollouts(teacher_dir, tmp_path,
                                                               monkeypatch):
  seen = []
  collect = rl.collect

  def spy(run, stage, *args, **kwargs):
    out = collect(run, stage, *args, **kwargs)
    seen.append((stage.sampling, out.prompt_B))
    return out

  monkeypatch.setattr(rl, "collect", spy)
  cfg = _distill_cfg(teacher_dir, iterations=2)
  cfg.distill.update(group_size=2, prompts_per_step=2, temperature=0.5, top_k=3, top_p=0.9)
  loop.train(cfg, str(tmp_path))
  assert len(seen) == 2
  for sampling, prompt_B in seen:
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.5, 3, 0.9)
    assert len(prompt_B) == 4 and (prompt_B[0::2] == prompt_B[1::2]).all()  # groups of 2


@pytest.mark.slow  # three training runs
def test_a_resumed_distill_stage_matches_the_uninterrupted_one(teacher_dir, tmp_path):
  """The checkpoint holds the student; the resumed stage loads its teacher
  again and goes on with the same draws."""
  cfg = _distill_cfg(teacher_dir, iterations=3)
  loop.train(cfg, str(tmp_path / "straight"))
  loop.train(cfg, str(tmp_path / "resumed"), stop_after=1)
  loop.train(cfg, str(tmp_path / "resumed"))
  got, want = (metrics_lib.read_metrics(str(tmp_path / d / "metrics.jsonl"))
               for d in ("resumed", "straight"))
  assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2]
  for g, w in zip(got, want):
    for k in ("distill/reverse_kl", "distill/teacher_logp", "reward/mean"):
      np.testing.assert_allclose(g[k], w[k], rtol=1e-6, err_msg=k)
