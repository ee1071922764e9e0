"""Behaviour/learner mismatch corrections: TIS, MIS/IcePop, OPSM, decoupled PPO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.objectives import CORRECTIONS, get_correction, get_policy_loss

# One on-policy sequence (logp == old_logp) with A = +1, so the REINFORCE term
# per token is -logp = (1, 2, 0.5) and only the correction weight varies.
LOGP = jnp.array([[-1.0, -2.0, -0.5]])
MASK = jnp.ones((1, 3))
ADV = jnp.array([1.0])
MISMATCH = np.array([[0.2, 1.0, -0.5]], np.float32)       # old_logp - behaviour_logp
BEHAVIOUR = LOGP - MISMATCH


def _reinforce(correction, behaviour=BEHAVIOUR, mask=MASK, **correction_kwargs):
  def loss(lp):
    return get_policy_loss("reinforce")(
        lp, LOGP, ADV, mask, behaviour_logp_BxT=behaviour, correction=correction,
        correction_kwargs={correction: correction_kwargs} if correction_kwargs else None)
  (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(LOGP)
  return value, grad, metrics


def test_registry():
  assert set(CORRECTIONS) == {"tis", "mis", "icepop", "opsm", "decoupled"}
  assert get_correction("icepop") is get_correction("mis")
  with pytest.raises(ValueError, match="unknown correction 'is'.*tis.*opsm"):
    get_correction("is")


def test_token_tis_truncates_at_cap():
  value, grad, metrics = _reinforce("tis", cap=2.0)
  w = np.array([1.2214028, 2.0, 0.6065307])        # min(exp(0.2, 1.0, -0.5), 2)
  np.testing.assert_allclose(value, (w * [1.0, 2.0, 0.5]).sum() / 3, rtol=1e-6)
  np.testing.assert_allclose(value, 1.8415560, rtol=1e-6)
  np.testing.assert_allclose(grad, [-w / 3], rtol=1e-6)
  np.testing.assert_allclose(metrics["tis/weight_mean"], w.mean(), rtol=1e-6)
  np.testing.assert_allclose(metrics["tis/weight_max"], 2.0)
  np.testing.assert_allclose(metrics["tis/trunc_frac"], 1 / 3)


@pytest.mark.parametrize("level, cap, weight", [
    ("sequence", 2.0, 2.0),              # exp(0.7) = 2.0137527 -> 2
    ("sequence", 3.0, 2.0137527),
    ("geometric", 2.0, 1.2628023),       # exp(0.7 / 3)
])
def test_sequence_level_tis(level, cap, weight):
  _, grad, _ = _reinforce("tis", level=level, cap=cap)
  np.testing.assert_allclose(grad, [[-weight / 3] * 3], rtol=1e-6)


def test_sequence_ratio_ignores_padding():
  mask = jnp.array([[1.0, 1.0, 0.0]])
  _, grad, _ = _reinforce("tis", mask=mask, level="sequence", cap=10.0)
  np.testing.assert_allclose(grad, [[-3.3201169 / 2] * 2 + [0.0]], rtol=1e-6)   # exp(1.2)
  _, grad, _ = _reinforce("tis", mask=mask, level="geometric", cap=10.0)
  np.testing.assert_allclose(grad, [[-1.8221188 / 2] * 2 + [0.0]], rtol=1e-6)   # exp(0.6)


@pytest.mark.parametrize("name", ["mis", "icepop"])
def test_token_mis_zeroes_outside_the_band(name):
  mismatch = np.array([[-1.0, 0.2, 1.7]], np.float32)   # rho = 0.368, 1.221, 5.474
  value, grad, metrics = _reinforce(name, behaviour=LOGP - mismatch, low=0.5, high=5.0)
  np.testing.assert_allclose(grad, [[0.0, -1.2214028 / 3, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(value, 1.2214028 * 2.0 / 3, rtol=1e-6)
  np.testing.assert_allclose(metrics[f"{name}/masked_frac"], 2 / 3)


def test_sequence_mis_rejects_whole_sequences():
  logp = jnp.array([[-1.0, -1.0], [-1.0, -1.0]])
  behaviour = logp - jnp.array([[0.2, 0.3], [0.5, 0.5]])     # rho_seq = e^0.5, e^1.0

  def loss(lp):
    return get_policy_loss("reinforce")(
        lp, logp, jnp.array([1.0, 1.0]), jnp.ones((2, 2)), behaviour_logp_BxT=behaviour,
        correction="mis", correction_kwargs={"mis": {"level": "sequence", "low": 0.0, "high": 2.0}})
  grad = jax.grad(lambda lp: loss(lp)[0])(logp)
  np.testing.assert_allclose(grad, [[-1.6487213 / 4] * 2, [0.0, 0.0]], rtol=1e-6)


def test_opsm_masks_drifted_negative_sequences_only():
  logp = jnp.full((3, 2), -1.0)
  # Mean of behaviour - current per sequence: 0.1 (A < 0, dropped), 0.02
  # (A < 0, under delta, kept), 0.2 (A > 0, kept).
  behaviour = logp + jnp.array([[0.1, 0.1], [0.01, 0.03], [0.2, 0.2]])
  adv = jnp.array([-1.0, -1.0, 1.0])

  def run(advantages):
    def loss(lp):
      return get_policy_loss("reinforce")(
          lp, logp, advantages, jnp.ones((3, 2)), behaviour_logp_BxT=behaviour,
          correction="opsm", correction_kwargs={"opsm": {"delta": 0.05}})
    (_, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
    return grad, metrics

  grad, metrics = run(adv)
  np.testing.assert_allclose(grad, [[0.0, 0.0], [1 / 6, 1 / 6], [-1 / 6, -1 / 6]], rtol=1e-6)
  np.testing.assert_allclose(metrics["opsm/masked_frac"], 2 / 6)
  np.testing.assert_allclose(metrics["opsm/seq_kl_mean"], (0.1 + 0.02 + 0.2) / 3, rtol=1e-5)
  # Per-token advantages: only the negative token of the drifted sequence goes.
  grad, _ = run(jnp.array([[-1.0, 1.0], [-1.0, -1.0], [1.0, 1.0]]))
  np.testing.assert_allclose(grad, [[0.0, -1 / 6], [1 / 6, 1 / 6], [-1 / 6, -1 / 6]], rtol=1e-6)


def test_decoupled_ppo():
  """PPO ratio to the proximal policy times min(pi_prox / pi_behav, C)."""
  old = LOGP - jnp.array([[0.1, 0.5, 0.0]])          # r = 1.105, 1.649 (clipped), 1

  def loss(lp):
    return get_policy_loss("ppo")(lp, old, ADV, MASK, behaviour_logp_BxT=old - MISMATCH,
                                  correction="decoupled")
  (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(LOGP)
  w = np.array([1.2214028, 2.0, 0.6065307])
  np.testing.assert_allclose(value, (-1.1051709 * w[0] - 1.2 * w[1] - 1.0 * w[2]) / 3, rtol=1e-6)
  np.testing.assert_allclose(value, -1.4521298, rtol=1e-6)
  # pi_theta / pi_behav = exp(0.3) on the first token: 1.3498588.
  np.testing.assert_allclose(grad, [[-1.3498588 / 3, 0.0, -w[2] / 3]], rtol=1e-6)
  np.testing.assert_allclose(metrics["clip_frac"], 1 / 3)
  np.testing.assert_allclose(metrics["decoupled/weight_max"], 2.0)
  with pytest.raises(ValueError, match="decoupled correction needs a loss built on"):
    get_policy_loss("reinforce")(LOGP, LOGP, ADV, MASK, behaviour_logp_BxT=BEHAVIOUR,
                                 correction="decoupled")


def test_corrections_compose_and_mismatch_metrics():
  logp = jnp.full((2, 3), -1.0)
  behaviour = logp - jnp.array([[0.2, 1.0, -0.5], [0.1, 0.1, 0.1]])

  def loss(lp):
    return get_policy_loss("reinforce")(
        lp, logp, jnp.array([-1.0, 1.0]), jnp.ones((2, 3)), behaviour_logp_BxT=behaviour,
        correction=("tis", "opsm"), correction_kwargs={"opsm": {"delta": -1.0}})
  (_, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
  # opsm with delta -1 drops the negative sequence; tis weights the other.
  np.testing.assert_allclose(grad, [[0.0] * 3, [-1.1051709 / 6] * 3], rtol=1e-6)
  rho = np.exp(np.array([0.2, 1.0, -0.5, 0.1, 0.1, 0.1]))
  np.testing.assert_allclose(metrics["mismatch_k3_kl"], (rho - np.log(rho) - 1).mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["mismatch_ratio_max"], np.e, rtol=1e-6)
  assert "tis/weight_mean" in metrics and "opsm/masked_frac" in metrics


def test_behaviour_logp_alone_only_adds_metrics():
  plain = _reinforce(None, behaviour=None)
  with_behaviour = _reinforce(None)
  np.testing.assert_allclose(with_behaviour[0], plain[0])
  assert "mismatch_k3_kl" in with_behaviour[2] and "mismatch_k3_kl" not in plain[2]


def test_bad_corrections_raise_clear_errors():
  loss = get_policy_loss("ppo")
  with pytest.raises(ValueError, match="needs behaviour_logp_BxT"):
    loss(LOGP, LOGP, ADV, MASK, correction="tis")
  with pytest.raises(ValueError, match="unknown correction 'ttis'"):
    loss(LOGP, LOGP, ADV, MASK, behaviour_logp_BxT=BEHAVIOUR, correction="ttis")
  with pytest.raises(ValueError, match=r"correction_kwargs for \['mis'\]"):
    loss(LOGP, LOGP, ADV, MASK, behaviour_logp_BxT=BEHAVIOUR, correction="tis",
         correction_kwargs={"mis": {"low": 0.1}})
  with pytest.raises(ValueError, match=r"'tis' got unknown hyper-parameter\(s\) \['C'\]"):
    loss(LOGP, LOGP, ADV, MASK, behaviour_logp_BxT=BEHAVIOUR, correction="tis",
         correction_kwargs={"tis": {"C": 2.0}})
  with pytest.raises(ValueError, match="cap C must be > 0"):
    _reinforce("tis", cap=0.0)
  with pytest.raises(ValueError, match="0 <= low < high"):
    _reinforce("mis", low=2.0, high=1.0)
  with pytest.raises(ValueError, match="unknown importance-sampling level 'batch'"):
    _reinforce("tis", level="batch")
