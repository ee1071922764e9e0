"""The learner step: micro-batch invariance, non-finite skipping, scoring path."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl.model.scoring import sequence_logprobs
from agentic_rl.train import learner

CFG = model_lib.TransformerConfig.tiny(vocab_size=64)


def _batch(key, B=8, T=12):
  k1, k2, k3, k4 = jax.random.split(key, 4)
  tokens = jax.random.randint(k1, (B, T), 0, CFG.vocab_size)
  mask = (jax.random.uniform(k2, (B, T)) < 0.6).astype(jnp.float32).at[:, 0].set(0.0)
  return {"tokens_BxT": tokens, "loss_mask_BxT": mask,
          "advantages": jax.random.normal(k3, (B,)),
          "old_logp_BxT": -jax.random.uniform(k4, (B, T)),
          "behaviour_logp_BxT": -jax.random.uniform(k4, (B, T))}


@pytest.mark.parametrize("impl", ["xla", "xla_chunked"])
def test_sequence_logprobs_match_log_softmax(impl):
  params = model_lib.init_params(CFG, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, CFG.vocab_size)
  logp, ent = sequence_logprobs(params, tokens, CFG, temperature=0.7, impl=impl)
  chex.assert_shape([logp, ent], (3, 9))
  full = jax.nn.log_softmax(model_lib.forward(params, tokens, CFG) / 0.7, axis=-1)
  want = jnp.take_along_axis(full[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
  np.testing.assert_allclose(logp[:, 1:], want, atol=1e-5)
  np.testing.assert_allclose(ent[:, 1:], -(jnp.exp(full) * full).sum(-1)[:, :-1], atol=1e-5)
  assert (logp[:, 0] == 0).all() and (ent[:, 0] == 0).all()


def test_array_temperature_scores_like_the_float():
  """A scheduled temperature is traced data; it must score as the static float."""
  params = model_lib.init_params(CFG, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, CFG.vocab_size)
  want = sequence_logprobs(params, tokens, CFG, temperature=0.7)
  got = jax.jit(lambda t: sequence_logprobs(params, tokens, CFG, temperature=t))(
      jnp.float32(0.7))
  np.testing.assert_allclose(got, want, atol=1e-5)
  capped = dataclasses.replace(CFG, final_logit_softcap=30.0)
  with pytest.raises(ValueError, match="softcap"):
    sequence_logprobs(params, tokens, capped, temperature=jnp.float32(0.7))


@pytest.mark.parametrize("agg", objectives.AGG_MODES)
def test_micro_batches_give_the_full_batch_update(agg):
  params = model_lib.init_params(CFG, jax.random.key(0))
  opt = optax.sgd(1.0)
  obj = objectives.ObjectiveConfig(loss="ppo", agg=agg, horizon=12 if "norm" in agg else None)
  loss = learner.rl_loss(CFG, obj)
  batch = _batch(jax.random.key(2))
  states = []
  for m in (1, 4):
    step = jax.jit(learner.make_train_step(loss, opt, micro_batches=m))
    st, metrics, outputs = step(learner.init_train_state(params, opt), batch)
    states.append((st, metrics, outputs))
  (a, ma, oa), (b, mb, ob) = states
  for k in ("learner/loss", "learner/pg_loss", "learner/ratio_max"):
    np.testing.assert_allclose(ma[k], mb[k], rtol=1e-6, atol=1e-7, err_msg=k)
  np.testing.assert_allclose(ma["learner/grad_norm"], mb["learner/grad_norm"], rtol=1e-5)
  # The forward's per-token outputs come back whole, in row order.
  want_logp, want_entropy = sequence_logprobs(params, batch["tokens_BxT"], CFG)
  for out in (oa, ob):
    np.testing.assert_allclose(out["logp_BxT"], want_logp, atol=1e-5)
    np.testing.assert_allclose(out["entropy_BxT"], want_entropy, atol=1e-5)
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  # The update moved the parameters.
  assert not np.allclose(jax.tree.leaves(a.params)[0], jax.tree.leaves(params)[0])


def test_used_length_rounds_the_last_weighted_position_up_to_a_bucket():
  def mask(last, T=2048):
    m = np.zeros((3, T), np.float32)
    m[1, last - 1] = 1.0
    return m
  got = [learner.used_length(mask(n)) for n in (1, 128, 129, 193, 257, 300, 385, 700, 1000)]
  assert got == [128, 128, 192, 256, 384, 384, 512, 768, 1024]
  assert learner.used_length(mask(300, T=320)) == 320  # at most T
  assert learner.used_length(np.zeros((2, 64)), minimum=8) == 8  # nothing weighed
  assert learner.used_length(mask(5, T=12), minimum=4) == 6


@pytest.mark.parametrize("agg", objectives.AGG_MODES)
def test_a_batch_cut_after_its_last_weighted_token_gives_the_same_update(agg):
  """What :func:`learner.trim_time` drops changes no loss, gradient or
  weighted output: the model is causal and the positions weigh nothing."""
  params = model_lib.init_params(CFG, jax.random.key(0))
  opt = optax.sgd(1.0)
  obj = objectives.ObjectiveConfig(loss="ppo", agg=agg, horizon=12)
  step = jax.jit(learner.make_train_step(learner.rl_loss(CFG, obj), opt))
  batch = _batch(jax.random.key(2))
  batch["loss_mask_BxT"] = batch["loss_mask_BxT"].at[:, 7:].set(0.0)
  length = learner.used_length(batch["loss_mask_BxT"], minimum=4)
  cut = learner.trim_time(batch, length)
  assert length == 8 and cut["tokens_BxT"].shape == (8, 8) and cut["advantages"].shape == (8,)
  per_token = learner.trim_time(dict(batch, advantages=jnp.ones((8, 12))), length)
  assert per_token["advantages"].shape == (8, 8)  # per-token advantages are cut too
  (a, ma, oa), (b, mb, ob) = (step(learner.init_train_state(params, opt), x)
                              for x in (batch, cut))
  for k in ("learner/loss", "learner/pg_loss", "learner/grad_norm"):
    np.testing.assert_allclose(ma[k], mb[k], rtol=1e-5, atol=1e-7, err_msg=k)
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  wide = learner.pad_time(ob["logp_BxT"], 12)
  np.testing.assert_allclose(wide[:, :length], oa["logp_BxT"][:, :length], atol=1e-5)
  assert wide.shape == (8, 12) and not wide[:, length:].any()


def test_sft_nll_of_micro_batches_is_the_whole_batchs():
  params = model_lib.init_params(CFG, jax.random.key(0))
  opt = optax.sgd(0.1)
  batch = _batch(jax.random.key(3))
  nll = [jax.jit(learner.make_train_step(learner.sft_loss(CFG), opt, micro_batches=m))(
      learner.init_train_state(params, opt), batch)[1]["sft/nll"] for m in (1, 4)]
  np.testing.assert_allclose(nll[1], nll[0], rtol=1e-6)


def test_sft_loss_is_masked_nll():
  params = model_lib.init_params(CFG, jax.random.key(0))
  batch = _batch(jax.random.key(3))
  loss_fn = learner.sft_loss(CFG)
  norm = objectives.batch_normalisers(batch["loss_mask_BxT"])
  loss, (metrics, outputs) = loss_fn(params, batch, norm)
  assert outputs == {} and metrics["sft/nll"] == loss
  logp, _ = sequence_logprobs(params, batch["tokens_BxT"], CFG)
  m = batch["loss_mask_BxT"]
  np.testing.assert_allclose(loss, -(logp * m).sum() / m.sum(), rtol=1e-6)


@pytest.mark.parametrize("use_jit", [False, True])
def test_non_finite_loss_skips_the_update(use_jit):
  params = model_lib.init_params(CFG, jax.random.key(0))
  opt = optax.adam(1e-2)
  batch = _batch(jax.random.key(4))
  batch["advantages"] = batch["advantages"].at[0].set(jnp.nan)
  step = learner.make_train_step(learner.rl_loss(CFG, objectives.ObjectiveConfig(loss="reinforce")), opt)
  step = jax.jit(step) if use_jit else step
  state = learner.init_train_state(params, opt)
  new, metrics, _ = step(state, batch)
  assert float(metrics["learner/skipped"]) == 1.0
  assert int(new.step) == 0
  chex.assert_trees_all_equal(new.params, params)
  chex.assert_trees_all_equal(new.opt_state, state.opt_state)
  # A finite batch afterwards trains normally.
  batch["advantages"] = jnp.ones_like(batch["advantages"])
  new, metrics, _ = step(new, batch)
  assert float(metrics["learner/skipped"]) == 0.0 and int(new.step) == 1


def test_bad_micro_batch_split():
  opt = optax.sgd(0.1)
  step = learner.make_train_step(learner.sft_loss(CFG), opt, micro_batches=3)
  params = model_lib.init_params(CFG, jax.random.key(0))
  with pytest.raises(ValueError, match="micro-batches"):
    step(learner.init_train_state(params, opt), _batch(jax.random.key(5), B=8))


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_without_old_logp_the_proximal_policy_is_the_forwards_own(micro_batches):
  """One update per batch needs no scoring pass: the loss and the update equal
  those with ``old_logp`` scored separately at the same parameters."""
  params = model_lib.init_params(CFG, jax.random.key(0))
  opt = optax.sgd(0.5)
  loss = learner.rl_loss(CFG, objectives.ObjectiveConfig(loss="ppo", correction="tis"))
  step = jax.jit(learner.make_train_step(loss, opt, micro_batches=micro_batches))
  batch = _batch(jax.random.key(6))
  batch["old_logp_BxT"] = sequence_logprobs(params, batch["tokens_BxT"], CFG)[0]
  scored, m_scored, _ = step(learner.init_train_state(params, opt), batch)
  own = {k: v for k, v in batch.items() if k != "old_logp_BxT"}
  fused, m_fused, out = step(learner.init_train_state(params, opt), own)
  np.testing.assert_allclose(out["logp_BxT"], batch["old_logp_BxT"], atol=1e-5)
  np.testing.assert_allclose(m_fused["learner/loss"], m_scored["learner/loss"], rtol=1e-5)
  assert float(m_fused["learner/ratio_max"]) == 1.0
  chex.assert_trees_all_close(fused.params, scored.params, atol=1e-6)


@pytest.mark.parametrize("estimator", objectives.KL_ESTIMATORS)
def test_reference_policy_is_scored_inside_the_step(estimator):
  params = model_lib.init_params(CFG, jax.random.key(0))
  ref = model_lib.init_params(CFG, jax.random.key(9))
  opt = optax.sgd(0.5)
  obj = objectives.ObjectiveConfig(loss="ppo", kl_coef=0.5, kl_estimator=estimator)
  batch = _batch(jax.random.key(7))
  step = jax.jit(learner.make_train_step(
      learner.rl_loss(CFG, obj), opt, prepare=learner.reference_inputs(CFG)))
  _, metrics, _ = step(learner.init_train_state(params, opt, ref), batch)
  logp = sequence_logprobs(params, batch["tokens_BxT"], CFG)[0]
  ref_logp = sequence_logprobs(ref, batch["tokens_BxT"], CFG)[0]
  mask = batch["loss_mask_BxT"] != 0
  want = objectives.kl_penalty(logp, ref_logp, estimator)
  np.testing.assert_allclose(metrics["shift/kl_reference"],
                             jnp.sum(jnp.where(mask, want, 0)) / mask.sum(), rtol=1e-4)
  # The same step with the reference log-probs given gives the same loss.
  given = dict(batch, ref_logp_BxT=ref_logp)
  _, m_given, _ = step(learner.init_train_state(params, opt, ref), given)
  np.testing.assert_allclose(m_given["learner/loss"], metrics["learner/loss"], rtol=1e-5)
  # At the reference itself the penalty is 0.
  _, m_self, _ = step(learner.init_train_state(params, opt, params), batch)
  np.testing.assert_allclose(m_self["shift/kl_reference"], 0.0, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU options")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_sharded_step_compiles_with_the_options_of_its_compute_dtype(dtype):
  # model.compiler_options by compute dtype: float32 steps keep their
  # matmuls off YNNPACK, 16-bit ones on it (the CPU's bfloat16 units).
  from agentic_rl.train import sharding  # pylint: disable=import-outside-toplevel
  cfg = dataclasses.replace(model_lib.TransformerConfig.tiny(), dtype=dtype)
  params = model_lib.init_params(cfg, jax.random.key(0))
  optimizer = optax.adamw(1e-3)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=-1))
  step, state_sh = learner.shard_train_step(
      learner.make_train_step(learner.rl_loss(cfg, objectives.ObjectiveConfig()), optimizer),
      mesh, cfg, optimizer, params)
  state = jax.device_put(learner.init_train_state(params, optimizer), state_sh)
  B, T = 2 * sharding.batch_shards(mesh), 8
  batch = sharding.shard_batch({
      "tokens_BxT": jnp.ones((B, T), jnp.int32), "loss_mask_BxT": jnp.ones((B, T)),
      "advantages": jnp.ones((B,))}, mesh)
  hlo = step.lower(state, batch).compile().as_text()
  assert ("ynn_fusion" in hlo) == (dtype == "bfloat16")
