"""Policy losses: hand-computed values and gradients, zero-gradient sets, metrics, errors."""

import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.objectives import POLICY_LOSSES, get_policy_loss, kl_penalty

# The running example: two sequences (2 and 3 tokens), A = (+1, -2), N = 5.
LOGP = jnp.array([[-1.0, -0.5, -2.0], [-0.9, -1.5, -0.7]])
LOG_RATIO = np.array([[0.5, -0.1, 0.0], [-0.6, 0.1, 0.3]], np.float32)   # logp - old_logp
OLD = LOGP - LOG_RATIO
MASK = jnp.array([[1, 1, 0], [1, 1, 1]])
ADV = jnp.array([1.0, -2.0])
# exp(LOG_RATIO): the token ratios pi_theta / pi_old.
R = np.array([[1.6487213, 0.9048374, 1.0], [0.5488116, 1.1051709, 1.3498588]], np.float32)


def _value_and_grad(name, logp=LOGP, old=OLD, adv=ADV, mask=MASK, **kwargs):
  def loss(lp):
    return get_policy_loss(name)(lp, old, adv, mask, **kwargs)
  (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
  return value, grad, metrics


def test_registry_lists_every_loss():
  assert set(POLICY_LOSSES) == {"reinforce", "ppo", "gspo", "cispo", "kimi", "kimi_token_mask",
                                "clip_cov", "kl_cov"}
  with pytest.raises(ValueError, match="unknown policy loss 'grpo'.*ppo.*cispo"):
    get_policy_loss("grpo")


def test_reinforce():
  value, grad, metrics = _value_and_grad("reinforce")
  # -A logp: (1.0 + 0.5) + (-1.8 - 3.0 - 1.4) = -4.7, over 5 tokens.
  np.testing.assert_allclose(value, -0.94, rtol=1e-6)
  np.testing.assert_allclose(grad, [[-0.2, -0.2, 0.0], [0.4, 0.4, 0.4]], rtol=1e-6)
  assert float(metrics["clip_frac"]) == 0.0


def test_ppo_clip_values_gradient_and_clip_frac():
  value, grad, metrics = _value_and_grad("ppo", eps_low=0.2, eps_high=0.2)
  # Token (0,0): A > 0, r = 1.649 > 1.2 -> clipped, term -1.2.
  # Token (1,0): A < 0, r = 0.549 < 0.8 -> clipped, term -(-2)(0.8) = 1.6.
  # Token (1,2): A < 0, r = 1.350 > 1.2 -> not clipped (pessimistic side).
  terms = [-1.2, -0.9048374, 1.6, 2 * 1.1051709, 2 * 1.3498588]
  np.testing.assert_allclose(value, sum(terms) / 5, rtol=1e-6)
  np.testing.assert_allclose(value, 0.8810444, rtol=1e-6)
  expected = np.array([[0.0, -R[0, 1], 0.0], [0.0, 2 * R[1, 1], 2 * R[1, 2]]]) / 5
  np.testing.assert_allclose(grad, expected, rtol=1e-6)
  np.testing.assert_allclose(metrics["clip_frac"], 2 / 5)
  np.testing.assert_allclose(metrics["clip_frac_high"], 1 / 5)
  np.testing.assert_allclose(metrics["clip_frac_low"], 1 / 5)


def test_ppo_dual_clip():
  value, grad, metrics = _value_and_grad("ppo", dual_clip=1.3)
  # Token (1,2): A < 0 and r = 1.350 > c = 1.3 -> term -A c = 2.6, no gradient.
  np.testing.assert_allclose(value, (-1.2 - 0.9048374 + 1.6 + 2 * 1.1051709 + 2.6) / 5, rtol=1e-6)
  np.testing.assert_allclose(grad, np.array([[0.0, -R[0, 1], 0.0], [0.0, 2 * R[1, 1], 0.0]]) / 5,
                             rtol=1e-6)
  np.testing.assert_allclose(metrics["clip_frac"], 3 / 5)
  np.testing.assert_allclose(metrics["dual_clip_frac"], 1 / 5)


def test_ppo_per_token_advantages_match_broadcast():
  a = _value_and_grad("ppo", adv=ADV)
  b = _value_and_grad("ppo", adv=jnp.broadcast_to(ADV[:, None], (2, 3)))
  np.testing.assert_allclose(a[0], b[0])
  np.testing.assert_allclose(a[1], b[1])


def test_cispo_clips_the_weight_not_the_token():
  value, grad, metrics = _value_and_grad("cispo", eps_low=1.0, eps_high=0.2)
  w = np.array([[1.2, R[0, 1], 0.0], [R[1, 0], R[1, 1], 1.2]], np.float32)   # clip(r, 0, 1.2)
  a = np.array([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]], np.float32)
  mask = np.asarray(MASK, np.float32)
  np.testing.assert_allclose(value, (-(w * a * np.asarray(LOGP)) * mask).sum() / 5, rtol=1e-6)
  np.testing.assert_allclose(value, -0.866191, rtol=1e-5)
  # d/dlogp of -sg(w) A logp = -w A: nonzero for every token, clipped or not.
  np.testing.assert_allclose(grad, -w * a * mask / 5, rtol=1e-6)
  assert np.all(np.asarray(grad)[mask == 1] != 0)
  np.testing.assert_allclose(metrics["clip_frac"], 2 / 5)


def _gspo_reference(logp, old, adv, mask, eps_low, eps_high):
  """The GSPO paper's objective, written at the sequence level."""
  lengths = mask.sum(-1)
  s = jnp.exp(((logp - old) * mask).sum(-1) / lengths)
  return -jnp.mean(jnp.minimum(s * adv, jnp.clip(s, 1 - eps_low, 1 + eps_high) * adv))


def test_gspo_matches_the_sequence_level_formula():
  kw = dict(eps_low=0.25, eps_high=0.25)
  value, grad, _ = _value_and_grad("gspo", agg="seq_mean_token_mean", **kw)
  # s_0 = exp(0.4 / 2) = 1.2214028, s_1 = exp(-0.2 / 3) = 0.9355070, unclipped.
  np.testing.assert_allclose(value, 0.5 * (-1.2214028 + 2 * 0.9355070), rtol=1e-6)
  # Gradient per token: -A_i s_i / (G |y_i|): the stop-gradient composition.
  np.testing.assert_allclose(grad, [[-0.3053507, -0.3053507, 0.0], [0.3118357] * 3], rtol=1e-5)
  mask = jnp.asarray(MASK, jnp.float32)
  ref_value, ref_grad = jax.value_and_grad(_gspo_reference)(LOGP, OLD, ADV, mask, **kw)
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  np.testing.assert_allclose(grad, ref_grad * mask, rtol=1e-5)


def test_gspo_default_clip_is_tight():
  value, grad, metrics = _value_and_grad("gspo", agg="seq_mean_token_mean")
  # Both sequences leave [1 - 3e-4, 1 + 4e-4] on their clipped side.
  np.testing.assert_allclose(value, 0.5 * (-(1 + 4e-4) + 2 * (1 - 3e-4)), rtol=1e-6)
  np.testing.assert_array_equal(grad, 0.0)
  np.testing.assert_allclose(metrics["clip_frac"], 1.0)
  np.testing.assert_allclose(metrics["seq_ratio_max"], 1.2214028, rtol=1e-6)


def _kimi_reference(logp, old, adv, mask, tau):
  """Kimi k1.5: (1/k) sum_j [-(r_j - r_bar) log pi(y_j) + tau/2 (log pi(y_j)/pi_old(y_j))^2]."""
  seq_logp = (logp * mask).sum(-1)
  seq_old = (old * mask).sum(-1)
  return jnp.mean(-adv * seq_logp + 0.5 * tau * jnp.square(seq_logp - seq_old))


def test_kimi_loss_and_the_papers_gradient():
  value, grad, metrics = _value_and_grad("kimi", agg="seq_mean_token_sum", tau=0.1)
  # D = (0.4, -0.2); log pi(y) = (-1.5, -3.1):
  # ((1.5 + 0.05 * 0.16) + (-6.2 + 0.05 * 0.04)) / 2 = -2.345.
  np.testing.assert_allclose(value, -2.345, rtol=1e-6)
  # Paper: per token (-(r - r_bar) + tau * D_j) / k.
  np.testing.assert_allclose(grad, [[(-1 + 0.1 * 0.4) / 2] * 2 + [0.0],
                                    [(2 + 0.1 * -0.2) / 2] * 3], rtol=1e-6)
  mask = jnp.asarray(MASK, jnp.float32)
  ref_value, ref_grad = jax.value_and_grad(_kimi_reference)(LOGP, OLD, ADV, mask, 0.1)
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  np.testing.assert_allclose(grad, ref_grad * mask, rtol=1e-6)
  np.testing.assert_allclose(metrics["seq_sq_log_ratio"], (0.16 + 0.04) / 2, rtol=1e-5)


def test_kimi_token_mask_zeroes_exactly_the_tokens_outside_the_window():
  # Every sign combination: A > 0 and A < 0, each with a log-ratio above beta,
  # below alpha and inside the window.
  log_ratio = np.array([[0.5, -0.6, 0.1], [0.5, -0.6, 0.1]], np.float32)
  mask = jnp.ones((2, 3))
  value, grad, metrics = _value_and_grad("kimi_token_mask", old=LOGP - log_ratio, mask=mask,
                                         alpha=-0.5, beta=0.4, tau=2.0)
  # Only (0,2) and (1,2): -(A / tau) logp / 6 = (-(0.5)(-2.0) - (-1)(-0.7)) / 6.
  np.testing.assert_allclose(value, (1.0 - 0.7) / 6, rtol=1e-6)
  np.testing.assert_allclose(grad, [[0.0, 0.0, -0.5 / 6], [0.0, 0.0, 1.0 / 6]], rtol=1e-6)
  np.testing.assert_allclose(metrics["clip_frac"], 4 / 6)
  # PPO keeps two of those four tokens (its clip depends on the sign of A).
  _, ppo_grad, _ = _value_and_grad("ppo", old=LOGP - log_ratio, mask=mask, eps_low=0.2,
                                   eps_high=0.2)
  assert np.count_nonzero(np.asarray(ppo_grad)) == 4


# Clip-Cov / KL-Cov example: one on-policy sequence with per-token advantages.
# mean logp = -1.625, mean A = 0.125; Cov = (2.109, 2.922, 0.234, 0.047).
COV_LOGP = jnp.array([[-0.5, -3.0, -1.0, -2.0]])
COV_ADV = jnp.array([[2.0, -2.0, 0.5, 0.0]])
COV_MASK = jnp.ones((1, 4))


def test_clip_cov_detaches_the_highest_covariance_token():
  ppo_value, ppo_grad, _ = _value_and_grad("ppo", COV_LOGP, COV_LOGP, COV_ADV, COV_MASK)
  np.testing.assert_allclose(ppo_grad, [[-0.5, 0.5, -0.125, 0.0]], rtol=1e-6)
  value, grad, metrics = _value_and_grad("clip_cov", COV_LOGP, COV_LOGP, COV_ADV, COV_MASK)
  # max(floor(2e-4 * 4), 1) = 1 token: the highest Cov in (1, 5) is token 1.
  np.testing.assert_allclose(value, ppo_value)
  np.testing.assert_allclose(grad, [[-0.5, 0.0, -0.125, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(metrics["cov_frac"], 0.25)
  # An upper bound of 2.5 excludes token 1, so token 0 goes.
  _, grad, _ = _value_and_grad("clip_cov", COV_LOGP, COV_LOGP, COV_ADV, COV_MASK, cov_ub=2.5)
  np.testing.assert_allclose(grad, [[0.0, 0.5, -0.125, 0.0]], rtol=1e-6)
  # Half the tokens: both candidates, never the low-covariance ones.
  _, grad, _ = _value_and_grad("clip_cov", COV_LOGP, COV_LOGP, COV_ADV, COV_MASK, clip_ratio=0.5)
  np.testing.assert_allclose(grad, [[0.0, 0.0, -0.125, 0.0]], rtol=1e-6)


def test_clip_cov_random_selection_picks_among_candidates():
  chosen = set()
  for seed in range(8):
    _, grad, _ = _value_and_grad("clip_cov", COV_LOGP, COV_LOGP, COV_ADV, COV_MASK,
                                 key=jax.random.key(seed))
    zeroed = np.flatnonzero(np.asarray(grad)[0, :2] == 0)
    assert len(zeroed) == 1 and float(grad[0, 2]) == -0.125
    chosen.add(int(zeroed[0]))
  assert chosen == {0, 1}


def test_kl_cov_penalises_the_highest_covariance_token():
  old = COV_LOGP - 0.1   # r = exp(0.1) everywhere, |logp - old| = 0.1
  value, grad, metrics = _value_and_grad("kl_cov", COV_LOGP, old, COV_ADV, COV_MASK,
                                         cov_kl_coef=0.1)
  r = 1.1051709
  np.testing.assert_allclose(value, (-(2.0 - 2.0 + 0.5) * r + 0.1 * 0.1) / 4, rtol=1e-6)
  np.testing.assert_allclose(grad, [[-2 * r / 4, (2 * r + 0.1) / 4, -0.5 * r / 4, 0.0]],
                             rtol=1e-6)
  np.testing.assert_allclose(metrics["cov_frac"], 0.25)


@pytest.mark.parametrize("estimator, value, grad", [
    ("k1", 0.5, 1.0),
    ("k2", 0.125, 0.5),                           # d^2 / 2, d
    ("k3", 0.1065307, 0.3934693),                 # exp(-d) + d - 1, 1 - exp(-d)
])
def test_kl_estimators(estimator, value, grad):
  # d = logp - ref = 0.5.
  v, g = jax.value_and_grad(lambda lp: kl_penalty(lp, jnp.array([[-1.5]]), estimator).sum())(
      jnp.array([[-1.0]]))
  np.testing.assert_allclose(v, value, rtol=1e-6)
  np.testing.assert_allclose(g, [[grad]], rtol=1e-6)


def test_kl_penalty_and_entropy_bonus_in_the_loss():
  ref = LOGP - 0.5
  entropy = jnp.array([[1.0, 2.0, 9.0], [0.5, 0.5, 0.5]])

  def loss(lp, ent):
    return get_policy_loss("reinforce")(lp, OLD, ADV, MASK, ref_logp_BxT=ref, entropy_BxT=ent,
                                        kl_coef=0.2, kl_estimator="k2", entropy_coef=0.01)
  (value, metrics), (g_logp, g_ent) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      LOGP, entropy)
  # pg -0.94; k2 = 0.125 per token; mean entropy over the 5 tokens = 4.5 / 5.
  np.testing.assert_allclose(value, -0.94 + 0.2 * 0.125 - 0.01 * 0.9, rtol=1e-6)
  np.testing.assert_allclose(g_logp, (np.array([[-1, -1, 0], [2, 2, 2]]) + 0.2 * 0.5 * MASK) / 5,
                             rtol=1e-6)
  np.testing.assert_allclose(g_ent, -0.01 * np.asarray(MASK) / 5, rtol=1e-6)
  np.testing.assert_allclose(metrics["entropy"], 0.9, rtol=1e-6)
  np.testing.assert_allclose(metrics["kl_ref"], 0.125, rtol=1e-6)
  np.testing.assert_allclose(metrics["pg_loss"], -0.94, rtol=1e-6)


def test_array_entropy_coef_under_jit_equals_the_float():
  """An adaptive coefficient arrives as a traced scalar and changes nothing else."""
  entropy = jnp.array([[1.0, 2.0, 9.0], [0.5, 0.5, 0.5]])
  fn = get_policy_loss("ppo")
  want, _ = fn(LOGP, OLD, ADV, MASK, entropy_BxT=entropy, entropy_coef=0.03)
  got, _ = jax.jit(lambda c: fn(LOGP, OLD, ADV, MASK, entropy_BxT=entropy, entropy_coef=c))(
      jnp.float32(0.03))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  with pytest.raises(ValueError, match="entropy_coef != 0 needs entropy_BxT"):
    fn(LOGP, OLD, ADV, MASK, entropy_coef=jnp.float32(0.0))


def test_token_weights_scale_each_tokens_contribution():
  ref, entropy = LOGP - 0.5, jnp.ones((2, 3))
  weights = jnp.array([[0.5, 1.0, 7.0], [0.0, 1.0, 2.0]])   # padding weight is ignored

  def loss(lp, ent):
    return get_policy_loss("reinforce")(lp, OLD, ADV, MASK, ref_logp_BxT=ref, entropy_BxT=ent,
                                        kl_coef=0.2, kl_estimator="k1", entropy_coef=0.01,
                                        token_weights_BxT=weights)[0]
  value, (g_logp, g_ent) = jax.value_and_grad(loss, argnums=(0, 1))(LOGP, entropy)
  u = np.asarray(weights) * np.asarray(MASK)
  # Per token: -A logp + 0.2 * 0.5 - 0.01 * 1, weighted by u, over N = 5 tokens.
  per_token = -np.array([[1.0], [-2.0]]) * np.asarray(LOGP) + 0.2 * 0.5 - 0.01
  np.testing.assert_allclose(value, (u * per_token).sum() / 5, rtol=1e-6)
  np.testing.assert_allclose(g_logp, u * (np.array([[-1.0], [2.0]]) + 0.2) / 5, rtol=1e-6)
  np.testing.assert_allclose(g_ent, -0.01 * u / 5, rtol=1e-6)


def test_ratio_and_kl_metrics():
  _, _, metrics = _value_and_grad("ppo")
  r = R[np.asarray(MASK) == 1]
  lr = LOG_RATIO[np.asarray(MASK) == 1]
  np.testing.assert_allclose(metrics["is_ratio_mean"], r.mean(), rtol=1e-6)
  np.testing.assert_allclose(metrics["is_ratio_max"], 1.6487213, rtol=1e-6)
  np.testing.assert_allclose(metrics["approx_kl"], (r - lr - 1).mean(), rtol=1e-5)


ALL_LOSS_KWARGS = {"reinforce": {}, "ppo": {"dual_clip": 3.0}, "gspo": {}, "cispo": {},
                   "kimi": {}, "kimi_token_mask": {}, "clip_cov": {}, "kl_cov": {}}


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_all_masked_batch_and_garbage_padding(name):
  kwargs = dict(ALL_LOSS_KWARGS[name], behaviour_logp_BxT=jnp.full((2, 3), jnp.nan),
                ref_logp_BxT=jnp.full((2, 3), -jnp.inf), entropy_BxT=jnp.full((2, 3), jnp.nan),
                correction=("tis", "opsm"), entropy_coef=0.01, kl_coef=0.1)
  logp = jnp.full((2, 3), -jnp.inf)
  value, grad, metrics = _value_and_grad(name, logp=logp, old=jnp.full((2, 3), jnp.nan),
                                         mask=jnp.zeros((2, 3)), **kwargs)
  assert float(value) == 0.0
  np.testing.assert_array_equal(grad, 0.0)
  for key, m in metrics.items():
    assert np.isfinite(m), key


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_padding_does_not_change_the_loss(name):
  """-inf / NaN in masked positions give the same loss and gradient as zeros."""
  padded_logp = LOGP.at[0, 2].set(-jnp.inf)
  padded_old = OLD.at[0, 2].set(jnp.nan)
  clean = _value_and_grad(name, **ALL_LOSS_KWARGS[name])
  padded = _value_and_grad(name, logp=padded_logp, old=padded_old, **ALL_LOSS_KWARGS[name])
  np.testing.assert_allclose(padded[0], clean[0], rtol=1e-6)
  np.testing.assert_allclose(padded[1], clean[1], rtol=1e-6)


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_jit_matches_eager(name):
  fn = functools.partial(get_policy_loss(name), agg="seq_mean_token_mean", **ALL_LOSS_KWARGS[name])
  eager = jax.value_and_grad(lambda lp: fn(lp, OLD, ADV, MASK)[0])(LOGP)
  jitted = jax.jit(jax.value_and_grad(lambda lp: fn(lp, OLD, ADV, MASK)[0]))(LOGP)
  np.testing.assert_allclose(jitted[0], eager[0], rtol=1e-6)
  np.testing.assert_allclose(jitted[1], eager[1], rtol=1e-6, atol=1e-8)
  loss, metrics = jax.jit(fn)(LOGP, OLD, ADV, MASK)
  chex.assert_shape(loss, ())
  assert loss.dtype == jnp.float32 and all(m.shape == () for m in metrics.values())
  for key in ("clip_frac", "is_ratio_mean", "is_ratio_max", "approx_kl", "pg_loss"):
    assert key in metrics


def _random_case(seed):
  rng = np.random.default_rng(seed)
  log_ratio = rng.uniform(-0.6, 0.6, size=(4, 6)).astype(np.float32)
  logp = -rng.uniform(0.1, 3.0, size=(4, 6)).astype(np.float32)
  adv = rng.choice([-1.5, -0.3, 0.0, 0.4, 2.0], size=(4, 6)).astype(np.float32)
  mask = rng.random((4, 6)) < 0.8
  return jnp.asarray(logp), jnp.asarray(logp - log_ratio), adv, mask, log_ratio


@functools.partial(jax.jit, static_argnames=("name", "hyper_parameters"))
def _jit_grad(logp, old, adv, mask, name, hyper_parameters):
  fn = functools.partial(get_policy_loss(name), **dict(hyper_parameters))
  return jax.grad(lambda lp: fn(lp, old, adv, mask)[0])(logp)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_which_tokens_get_zero_gradient(seed):
  logp, old, adv, mask, lr = _random_case(seed)
  r = np.exp(lr)
  live = mask & (adv != 0)
  # PPO: zero exactly on the clipped tokens.
  g = _jit_grad(logp, old, adv, mask, "ppo",
                (("eps_low", 0.2), ("eps_high", 0.28), ("dual_clip", 1.5)))
  clipped = ((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8)) | ((adv < 0) & (r > 1.5))
  np.testing.assert_array_equal(np.asarray(g) != 0, live & ~clipped)
  # CISPO: never zero.
  g = _jit_grad(logp, old, adv, mask, "cispo", (("eps_high", 0.1),))
  np.testing.assert_array_equal(np.asarray(g) != 0, live)
  # K2.5 token mask: zero exactly outside [alpha, beta], whatever the sign of A.
  g = _jit_grad(logp, old, adv, mask, "kimi_token_mask", (("alpha", -0.3), ("beta", 0.2)))
  inside = (lr >= -0.3) & (lr <= 0.2)
  np.testing.assert_array_equal(np.asarray(g) != 0, live & inside)


def test_bad_inputs_raise_clear_errors():
  loss = get_policy_loss("ppo")
  with pytest.raises(ValueError, match=r"old_logp must have shape \[B, T\] = \(2, 3\)"):
    loss(LOGP, OLD[:, :2], ADV, MASK)
  with pytest.raises(ValueError, match=r"advantages must have shape \[B\]"):
    loss(LOGP, OLD, jnp.ones(3), MASK)
  with pytest.raises(ValueError, match=r"logp must have shape \[B, T\]"):
    loss(LOGP[0], OLD[0], ADV, MASK[0])
  with pytest.raises(ValueError, match="unknown aggregation mode"):
    loss(LOGP, OLD, ADV, MASK, agg="sum")
  with pytest.raises(ValueError, match=r"unknown hyper-parameter\(s\) \['eps_hgih'\]"):
    loss(LOGP, OLD, ADV, MASK, eps_hgih=0.28)
  with pytest.raises(ValueError, match="eps_low must be >= 0"):
    loss(LOGP, OLD, ADV, MASK, eps_low=-0.1)
  with pytest.raises(ValueError, match="dual_clip must be > 1"):
    loss(LOGP, OLD, ADV, MASK, dual_clip=0.9)
  with pytest.raises(ValueError, match="entropy_coef != 0 needs entropy_BxT"):
    loss(LOGP, OLD, ADV, MASK, entropy_coef=0.01)
  with pytest.raises(ValueError, match="kl_coef != 0 needs ref_logp_BxT"):
    loss(LOGP, OLD, ADV, MASK, kl_coef=0.01)
  with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
    loss(LOGP, OLD, ADV, MASK, kl_estimator="k4")
  with pytest.raises(ValueError, match="alpha <= 0 <= beta"):
    get_policy_loss("kimi_token_mask")(LOGP, OLD, ADV, MASK, alpha=0.1)
