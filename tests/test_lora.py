"""LoRA adapters: the adapted model, merging, the frozen base in the
learner step, and LoRA runs through ``loop.train`` (checkpoint, resume,
export)."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl.model import hf, lora
from agentic_rl.model.config import LORA_TARGETS
from agentic_rl.train import checkpoint, learner, loop, sharding, stages
from agentic_rl.train import config as config_lib
from agentic_rl.train import run as run_lib
from experiments import export
from experiments.configs import default

TINY = model_lib.TransformerConfig.tiny(lora_rank=4, lora_alpha=8.0)


def _random_adapters(params, key):
  """``params`` with every adapter (B included) random, so the adapters act."""
  adapters = lora.adapters(params)
  leaves, treedef = jax.tree.flatten(adapters)
  keys = jax.random.split(key, len(leaves))
  noisy = [0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  return lora.with_adapters(params, jax.tree.unflatten(treedef, noisy))


def _tokens(config, shape=(2, 12)):
  return np.random.default_rng(0).integers(0, config.vocab_size, shape)


def test_zero_b_gives_the_base_model_exactly():
  base_config = model_lib.TransformerConfig.tiny()
  base = model_lib.init_params(base_config, jax.random.key(0))
  params = model_lib.init_params(TINY, jax.random.key(0))
  # The same base as without LoRA, and fresh adapters from add_adapters too.
  jax.tree.map(np.testing.assert_array_equal, lora.base(params), base)
  added = lora.add_adapters(base, TINY, jax.random.key(1))
  assert all(np.all(np.asarray(b) == 0) for k, b in added["layers"].items()
             if k.endswith("_b"))
  assert any(np.any(np.asarray(a) != 0) for k, a in added["layers"].items()
             if k.endswith("_a"))
  tokens = _tokens(TINY)
  want = np.asarray(model_lib.forward(base, tokens, base_config))
  for p in (params, added):
    np.testing.assert_array_equal(np.asarray(model_lib.forward(p, tokens, TINY)), want)


@pytest.mark.parametrize("backward_recompute", [True, False])
def test_merge_equals_the_adapted_forward(backward_recompute):
  config = model_lib.TransformerConfig.tiny(lora_rank=4, lora_alpha=8.0, qkv_bias=True,
                                            backward_recompute=backward_recompute)
  params = _random_adapters(model_lib.init_params(config, jax.random.key(0)),
                            jax.random.key(2))
  merged_config, merged = lora.merge(params, config)
  assert merged_config.lora_rank == 0
  assert not lora.has_adapters(merged)
  tokens = _tokens(config)
  with jax.default_matmul_precision("float32"):
    adapted = np.asarray(model_lib.forward(params, tokens, config))
    want = np.asarray(model_lib.forward(merged, tokens, merged_config))
    base = np.asarray(model_lib.forward(lora.base(params), tokens, merged_config))
  # Merging changes float32 rounding (logits of about 1: ~1e-5 on some CPUs),
  # under 1/300 of the adapters' effect.
  np.testing.assert_allclose(adapted, want, atol=3e-5, rtol=0)
  assert np.abs(adapted - base).max() > 1e-2  # the adapters change the model


def test_the_kv_cache_decode_runs_the_adapters():
  params = _random_adapters(model_lib.init_params(TINY, jax.random.key(0)), jax.random.key(2))
  tokens = _tokens(TINY, (2, 8))
  with jax.default_matmul_precision("float32"):
    full = np.asarray(model_lib.forward(params, tokens, TINY))
    cache = model_lib.init_cache(TINY, batch=2, max_len=8)
    logits, _ = model_lib.prefill(params, tokens, cache, TINY)
  np.testing.assert_allclose(np.asarray(logits), full, atol=1e-5, rtol=0)


def test_only_the_targeted_projections_get_adapters():
  config = model_lib.TransformerConfig.tiny(lora_rank=3, lora_targets=("wq", "w_down"))
  layers = model_lib.init_params(config, jax.random.key(0))["layers"]
  assert sorted(k for k in layers if k.startswith("lora_")) == [
      "lora_w_down_a", "lora_w_down_b", "lora_wq_a", "lora_wq_b"]
  L, D, F, H, Dh = 2, 32, 64, 4, 8
  assert layers["lora_wq_a"].shape == (L, D, 3) and layers["lora_wq_b"].shape == (L, 3, H, Dh)
  assert layers["lora_w_down_a"].shape == (L, F, 3)
  assert layers["lora_w_down_b"].shape == (L, 3, D)
  assert layers["lora_wq_a"].dtype == jnp.float32
  full = model_lib.init_params(TINY, jax.random.key(0))["layers"]
  assert {k for k in full if k.startswith("lora_")} == {
      f"lora_{w}_{ab}" for w in LORA_TARGETS for ab in "ab"}
  assert full["lora_wo_a"].shape == (L, H, Dh, 4) and full["lora_wo_b"].shape == (L, 4, D)


def test_a_bfloat16_base_keeps_float32_adapters():
  config = model_lib.TransformerConfig.tiny(lora_rank=2, param_dtype="bfloat16")
  params = model_lib.init_params(config, jax.random.key(0))
  mask = lora.adapter_mask(params)
  for m, x in zip(jax.tree.leaves(mask), jax.tree.leaves(params)):
    assert x.dtype == (jnp.float32 if m else jnp.bfloat16)
  _, merged = lora.merge(params, config)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(merged))


def test_param_axes_and_shardings_cover_the_adapters():
  params = model_lib.init_params(TINY, jax.random.key(0))
  axes = model_lib.param_axes(TINY)
  assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == \
      jax.tree.structure(params)
  assert axes["layers"]["lora_wq_a"] == ("layers", "embed", "lora_rank")
  assert axes["layers"]["lora_wo_b"] == ("layers", "lora_rank", "embed")
  assert sharding.LOGICAL_RULES["lora_rank"] is None
  mesh = sharding.make_mesh(sharding.MeshConfig(data=-1, fsdp=1, tensor=1))
  shardings = learner.params_sharding(mesh, TINY, params)
  assert jax.tree.structure(shardings) == jax.tree.structure(params)


@pytest.mark.parametrize("fields, match", [
    (dict(lora_rank=-1), "lora_rank must be an int >= 0"),
    (dict(lora_rank=2, lora_targets=("wq", "w_in")), r"unknown projections \['w_in'\]"),
    (dict(lora_rank=2, lora_alpha=0.0), "lora_alpha must be a number > 0"),
    (dict(lora_rank=2, lora_targets=()), "lora_targets is empty"),
    (dict(lora_rank=2, lora_dtype="int8"), "lora_dtype must be a floating dtype"),
])
def test_bad_settings_are_refused(fields, match):
  with pytest.raises(ValueError, match=match):
    model_lib.TransformerConfig.tiny(**fields).validate()


@pytest.mark.parametrize("edit, match", [
    (lambda c: setattr(c.model, "lora_rank", -2), r"config\.model\.lora_rank must be"),
    (lambda c: c.model.update(lora_rank=2, lora_targets=("wq", "attn")),
     r"config\.model\.lora_targets has unknown projections \['attn'\]"),
    (lambda c: c.model.update(lora_rank=2, lora_alpha=-1.0), r"config\.model\.lora_alpha"),
    (lambda c: (c.model.update(lora_rank=2), c.rl.update(kl_coef=0.1, reference_from="/x")),
     r"config\.rl\.reference_from .* LoRA run"),
])
def test_the_trainer_refuses_bad_lora_settings_before_building(edit, match):
  cfg = default.get_config("tiny")
  edit(cfg)
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(cfg)


def _sft_batch(config, rows=4, T=10):
  tokens = _tokens(config, (rows, T))
  return {"tokens_BxT": jnp.asarray(tokens), "loss_mask_BxT": jnp.ones((rows, T), jnp.float32)}


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_learner_step_updates_only_the_adapters(micro_batches):
  params = model_lib.init_params(TINY, jax.random.key(0))
  optimizer = lora.freeze_base(
      objectives.make_optimizer(objectives.OptimizerConfig(learning_rate=1e-2)), params)
  state = learner.init_train_state(params, optimizer)
  # The optimiser state has leaves for the adapters and step counts only.
  adapter_shapes = {x.shape for x in jax.tree.leaves(lora.adapters(params))}
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert moments and {x.shape for x in moments} <= adapter_shapes
  n_adapters = len(jax.tree.leaves(lora.adapters(params)))
  assert len(moments) == 2 * n_adapters  # Adam's mu and nu
  step = jax.jit(learner.make_train_step(
      learner.sft_loss(TINY), optimizer, micro_batches=micro_batches,
      trainable=learner.trainable(TINY)))
  for _ in range(2):
    state, metrics, _ = step(state, _sft_batch(TINY))
  assert float(metrics["learner/skipped"]) == 0 and float(metrics["learner/grad_norm"]) > 0
  jax.tree.map(np.testing.assert_array_equal, lora.base(state.params), lora.base(params))
  changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
                         lora.adapters(state.params), lora.adapters(params))
  assert all(jax.tree.leaves(changed))


def test_micro_batches_give_the_full_batch_adapter_update():
  params = model_lib.init_params(TINY, jax.random.key(0))
  optimizer = lora.freeze_base(optax.sgd(1.0), params)
  out = []
  for m in (1, 2):
    step = jax.jit(learner.make_train_step(learner.sft_loss(TINY), optimizer, micro_batches=m,
                                           trainable=learner.trainable(TINY)))
    out.append(step(learner.init_train_state(params, optimizer), _sft_batch(TINY))[0].params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), *out)


# --- through the entry point ----------------------------------------------------


def _lora_rl(iterations=3):
  cfg = default.get_config("tiny")
  cfg.stages = ("rl",)
  cfg.rl.iterations = iterations
  cfg.rl.kl_coef = 0.05  # a reference policy in the state and checkpoints
  cfg.eval.every = 100
  cfg.model.update(lora_rank=4, lora_alpha=8.0)
  return cfg


def _train_seeing_params(cfg, workdir, monkeypatch, **kw):
  """``loop.train``, returning the summary and the params of each held-out
  evaluation (the last is the trained policy in memory)."""
  seen, original = [], loop.evaluate

  def spy(run, params, key):
    seen.append(jax.tree.map(np.asarray, params))
    return original(run, params, key)

  monkeypatch.setattr(loop, "evaluate", spy)
  monkeypatch.setattr(stages, "evaluate", spy)
  return loop.train(cfg, str(workdir), **kw), seen


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  mp = pytest.MonkeyPatch()
  try:
    workdir = tmp_path_factory.mktemp("lora_straight")
    _, seen = _train_seeing_params(_lora_rl(), workdir, mp)
  finally:
    mp.undo()
  return workdir, seen[-1]


def test_a_lora_run_trains_and_checkpoints_only_the_adapters(straight):
  workdir, trained = straight
  cfg = _lora_rl()
  run = run_lib.build(cfg)
  initial = jax.tree.map(np.asarray, checkpoint.initial_params(run, checkpoint.params_key(cfg)))
  # The base is bit for bit the initial one; every adapter B moved off zero.
  jax.tree.map(np.testing.assert_array_equal, lora.base(trained), lora.base(initial))
  for name, b in lora.adapters(trained)["layers"].items():
    if name.endswith("_b"):
      assert np.any(b != 0), name
  with checkpoint.Checkpointer(str(workdir)) as ckpt:
    assert ckpt.all_steps() == [2, 3]
    mid, _ = ckpt.restore(2)
    last, _ = ckpt.restore(3)
  adapter_names = set(lora.adapters(initial)["layers"])
  for tree in (mid["params"], mid["ref_params"], last["params"]):
    assert set(tree) == {"layers"} and set(tree["layers"]) == adapter_names
  # The reference policy is the stage's start: the initial adapters.
  jax.tree.map(np.testing.assert_array_equal, mid["ref_params"], lora.adapters(initial))
  # The optimiser state on disk: Adam's moments of the adapters, and counts.
  adapter_shapes = {x.shape for x in jax.tree.leaves(lora.adapters(initial))}
  moments = [x for x in jax.tree.leaves(mid["opt_state"]) if np.ndim(x)]
  assert len(moments) == 2 * len(adapter_names)
  assert {np.shape(x) for x in moments} <= adapter_shapes
  jax.tree.map(np.testing.assert_array_equal, last["params"], lora.adapters(trained))


@pytest.mark.slow
def test_a_resumed_lora_run_matches_the_uninterrupted_one(straight, tmp_path, monkeypatch):
  workdir, trained = straight
  first, _ = _train_seeing_params(_lora_rl(), tmp_path, monkeypatch, stop_after=1)
  assert first["stopped"] == "stop_after"
  _, seen = _train_seeing_params(_lora_rl(), tmp_path, monkeypatch)
  jax.tree.map(np.testing.assert_array_equal, lora.base(seen[-1]), lora.base(trained))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               lora.adapters(seen[-1]), lora.adapters(trained))


@pytest.mark.slow
def test_a_lora_run_exports_merged_weights(tmp_path, monkeypatch):
  cfg = default.get_config("tiny")
  cfg.stages = ("sft",)
  cfg.sft.steps = 2
  cfg.model.update(lora_rank=4, lora_alpha=8.0, lora_targets=("wq", "wo", "w_up"))
  workdir, out = tmp_path / "run", str(tmp_path / "hf")
  _, seen = _train_seeing_params(cfg, workdir, monkeypatch)
  trained = seen[-1]
  export.export(str(workdir), out)
  config, params = hf.load_hf_checkpoint(out)
  assert config.lora_rank == 0 and not lora.has_adapters(params)
  run_config = run_lib.build(cfg).model_config
  tokens = _tokens(run_config, (2, 16))
  with jax.default_matmul_precision("float32"):
    ours = np.asarray(model_lib.forward(trained, tokens, run_config))
    theirs = np.asarray(model_lib.forward(params, tokens, config))
    base = np.asarray(model_lib.forward(lora.base(trained), tokens, lora.merge(
        trained, run_config)[0]))
  np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)
  assert np.abs(ours - base).max() > 1e-4  # the trained adapters are in the export
  with pytest.raises(ValueError, match="lora.merge"):
    hf.save_hf_checkpoint(str(tmp_path / "unmerged"), run_config, trained)
  pytest.importorskip("transformers")
  pytest.importorskip("torch")
  check = export.deploy_check(str(workdir), out, num_prompts=4)
  assert check["shift/deploy_tokens"] > 0 and check["shift/deploy_logprob_diff_max"] <= 1e-5
