"""Aggregation modes: hand-computed values and micro-batch invariance of gradients."""

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.objectives import AGG_MODES, aggregate, batch_normalisers, get_policy_loss

# Two sequences: lengths 2 and 3, padding holds garbage that must not leak.
VALUES = jnp.array([[1.0, 2.0, jnp.nan], [3.0, 4.0, 5.0]])
MASK = jnp.array([[1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize("mode, expected", [
    ("token_mean", (1 + 2 + 3 + 4 + 5) / 5),              # 3.0
    ("seq_mean_token_mean", ((1 + 2) / 2 + (3 + 4 + 5) / 3) / 2),   # 2.75
    ("seq_mean_token_sum", (3 + 12) / 2),                  # 7.5
    ("seq_mean_token_sum_norm", (3 + 12) / (2 * 3)),       # 2.5, horizon T = 3
])
def test_hand_values(mode, expected):
  out = aggregate(VALUES, MASK, mode)
  chex.assert_shape(out, ())
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, expected, rtol=1e-7)


def test_explicit_normalisers_and_horizon():
  np.testing.assert_allclose(aggregate(VALUES, MASK, "token_mean", num_tokens=10), 15 / 10)
  np.testing.assert_allclose(aggregate(VALUES, MASK, "seq_mean_token_sum", num_seqs=5), 15 / 5)
  np.testing.assert_allclose(
      aggregate(VALUES, MASK, "seq_mean_token_sum_norm", horizon=100), 15 / (2 * 100))


def test_batch_normalisers_skip_empty_rows():
  mask = jnp.array([[1, 0, 1], [0, 0, 0], [1, 1, 1]])
  counts = batch_normalisers(mask)
  assert float(counts["num_tokens"]) == 5.0
  assert float(counts["num_seqs"]) == 2.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_masked_is_zero_not_nan(mode):
  out = aggregate(jnp.full((2, 3), jnp.nan), jnp.zeros((2, 3)), mode)
  assert float(out) == 0.0


def test_bad_input_raises():
  with pytest.raises(ValueError, match="unknown aggregation mode 'mean'.*token_mean"):
    aggregate(VALUES, MASK, "mean")
  with pytest.raises(ValueError, match="same shape"):
    aggregate(VALUES, MASK[:, :2])
  with pytest.raises(ValueError, match="horizon"):
    aggregate(VALUES, MASK, "seq_mean_token_sum_norm", horizon=0)


# --- micro-batch invariance -------------------------------------------------
# A toy "model": logp = -softplus(x . theta) per token and entropy = sigmoid(x .
# phi). The loss's gradient w.r.t. the per-token inputs (logp, entropy) must be
# the same whether the batch is whole or split into 4 micro-batches that get
# the whole batch's normalisers; the parameter gradient is then the sum of the
# micro-batch gradients.
B, T, D, N_MICRO = 8, 5, 3, 4
PARAMS = {"theta": jnp.array([0.35, -0.25, 0.05]), "phi": jnp.array([0.1, 0.2, -0.3])}


def _make_batch(seed):
  rng = np.random.default_rng(seed)
  feats = rng.normal(size=(B, T, D)).astype(np.float32)
  old_logp = -np.log1p(np.exp(feats @ np.array([0.3, -0.2, 0.1], np.float32)))
  old_logp = old_logp + rng.normal(scale=0.05, size=(B, T)).astype(np.float32)
  mask = rng.random((B, T)) < 0.7
  mask[rng.integers(B)] = False            # an empty row
  adv = rng.normal(size=(B,)).astype(np.float32)
  behaviour = old_logp + rng.normal(scale=0.1, size=(B, T)).astype(np.float32)
  ref = old_logp + rng.normal(scale=0.1, size=(B, T)).astype(np.float32)
  return dict(feats=feats, old_logp=old_logp, mask=mask, adv=adv, behaviour=behaviour, ref=ref)


def _loss(params, batch, *, loss_name, mode, num_tokens, num_seqs, extras):
  logp = -jax.nn.softplus(batch["feats"] @ params["theta"])
  entropy = jax.nn.sigmoid(batch["feats"] @ params["phi"])
  return _loss_of_tokens(logp, entropy, batch, loss_name=loss_name, mode=mode,
                         num_tokens=num_tokens, num_seqs=num_seqs, extras=extras)


def _loss_of_tokens(logp, entropy, batch, *, loss_name, mode, num_tokens, num_seqs, extras):
  kwargs = {}
  if extras:
    kwargs = dict(behaviour_logp_BxT=batch["behaviour"], ref_logp_BxT=batch["ref"],
                  entropy_BxT=entropy, correction=("tis", "opsm"),
                  correction_kwargs={"tis": {"level": "sequence"}}, entropy_coef=0.01,
                  kl_coef=0.05)
  loss, _ = get_policy_loss(loss_name)(
      logp, batch["old_logp"], batch["adv"], batch["mask"], agg=mode, num_tokens=num_tokens,
      num_seqs=num_seqs, horizon=7, **kwargs)
  return loss


@functools.partial(jax.jit, static_argnames=("loss_name", "extras"))
def _full_and_micro_grads(params, batch, *, loss_name, extras):
  """Per aggregation mode: (whole-batch, micro-batched) gradients, and a scale.

  Gradients are w.r.t. the tokens (logp, entropy) and the parameters. The
  micro-batched token gradients are the 4 pieces' concatenated, the parameter
  gradients the pieces' sum; the scale is the sum of the pieces' norms.
  """
  logp = -jax.nn.softplus(batch["feats"] @ params["theta"])
  entropy = jax.nn.sigmoid(batch["feats"] @ params["phi"])
  split = lambda x: x.reshape(N_MICRO, B // N_MICRO, *x.shape[1:])
  micro = jax.tree.map(split, batch)
  out = {}
  for mode in AGG_MODES:
    static = dict(loss_name=loss_name, mode=mode, extras=extras,
                  **batch_normalisers(batch["mask"]))
    token_grad = functools.partial(jax.grad(_loss_of_tokens, argnums=(0, 1)), **static)
    param_grad = functools.partial(jax.grad(_loss), **static)
    micro_tokens = jax.vmap(token_grad)(split(logp), split(entropy), micro)
    micro_params = jax.vmap(param_grad, in_axes=(None, 0))(params, micro)
    full = (token_grad(logp, entropy, batch), param_grad(params, batch))
    summed = (jax.tree.map(lambda g: g.reshape(B, T), micro_tokens),
              jax.tree.map(lambda g: g.sum(axis=0), micro_params))
    norms = jax.tree.map(lambda g: jnp.linalg.norm(g, axis=-1).sum(), micro_params)
    out[mode] = (full, summed, norms)
  return out


def _assert_same_update(grads):
  (full_tok, full_par), (micro_tok, micro_par), norms = grads
  assert np.abs(np.asarray(full_tok[0])).max() > 0
  for full, micro in zip(full_tok, micro_tok):
    np.testing.assert_allclose(np.asarray(micro), np.asarray(full), rtol=1e-6, atol=0)
  for name in full_par:
    # fp32 sums in a different order: the error is relative to what is summed.
    err = np.linalg.norm(np.asarray(full_par[name]) - np.asarray(micro_par[name]))
    assert err <= 1e-6 * float(norms[name]) + 1e-12, (name, err, norms[name])


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_micro_batch_invariance_random_masks(seed):
  """PPO + sequence TIS + OPSM + entropy + KL, every mode: 4 micro-batches == whole."""
  grads = _full_and_micro_grads(PARAMS, _make_batch(seed), loss_name="ppo", extras=True)
  for mode in AGG_MODES:
    _assert_same_update(grads[mode])


@pytest.mark.parametrize("loss_name", ["reinforce", "gspo", "cispo", "kimi", "kimi_token_mask"])
def test_micro_batch_invariance_every_loss(loss_name):
  grads = _full_and_micro_grads(PARAMS, _make_batch(7), loss_name=loss_name, extras=False)
  for mode in AGG_MODES:
    _assert_same_update(grads[mode])
