"""Policy losses, selectable by name, composed with corrections, entropy and KL.

Inputs are per-token arrays ``[B, T]``: ``logp`` (current parameters, the only
differentiable input), ``old_logp`` (the proximal policy ``pi_old``: the
learner at the parameters that started this iteration), ``mask`` (nonzero on
the policy's own tokens) and ``advantages`` ``[B]`` (broadcast over tokens) or
``[B, T]``. ``r = pi_theta / pi_old = exp(logp - old_logp)`` is the token
ratio; ``sg`` is stop-gradient; the loss is minimised.

Each base loss builds a per-token term ``l[b, t]``; :func:`policy_loss`
multiplies it by the optional behaviour correction weight, reduces it with the
aggregation mode (global normalisers: see :mod:`.aggregation`), and adds
``- entropy_coef * H`` and ``+ kl_coef * KL(pi_theta || pi_ref)`` aggregated
the same way. Sequence-level losses (``gspo``, ``kimi``) write their
per-sequence terms as per-token terms whose aggregation gives the paper's
formula under the mode named in their docstring.

Masked positions never matter: inputs are zeroed there before use, so padding
with ``-inf`` or NaN log-probs is safe, and an all-masked batch gives loss 0
and finite metrics. Log-ratios are clamped to ``+-20`` before ``exp`` (as
verl), so no ratio overflows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from agentic_rl.objectives._checks import check_keywords
from agentic_rl.objectives.aggregation import aggregate, check_agg_mode, masked_max, masked_mean
from agentic_rl.objectives.corrections import get_correction

MAX_LOG_RATIO = 20.0
KL_ESTIMATORS = ("k1", "k2", "k3")

Metrics = dict[str, jax.Array]
_BASE_LOSSES: dict[str, Callable[..., tuple[jax.Array, Metrics]]] = {}
# Losses whose per-token term is built on r = pi_theta / pi_old: the ones a
# decoupled (proximal-ratio) correction makes sense for.
RATIO_LOSSES = frozenset({"ppo", "gspo", "cispo", "clip_cov", "kl_cov"})


def _register(name: str):
  def decorate(fn):
    _BASE_LOSSES[name] = fn
    return fn
  return decorate


def _ratio(log_ratio: jax.Array) -> jax.Array:
  return jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))


def _clipped_surrogate(ratio, adv, mask, eps_low: float, eps_high: float,
                       dual_clip: float | None) -> tuple[jax.Array, jax.Array, Metrics]:
  """``max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A)``, optionally dual-clipped.

  Written as a selection so that a clipped token's term is a constant (zero
  gradient) and an unclipped one is exactly ``-r A`` (even at the boundary).
  Returns the per-token term, the clipped tokens and the clip metrics.
  """
  lo, hi = 1.0 - eps_low, 1.0 + eps_high
  clip_high = (adv > 0) & (ratio > hi)
  clip_low = (adv < 0) & (ratio < lo)
  clipped = clip_high | clip_low
  loss = jnp.where(clipped, -adv * jax.lax.stop_gradient(jnp.clip(ratio, lo, hi)), -adv * ratio)
  metrics = {"clip_frac_low": masked_mean(clip_low, mask),
             "clip_frac_high": masked_mean(clip_high, mask)}
  if dual_clip is not None:
    dual = (adv < 0) & (ratio > dual_clip)
    loss = jnp.where(dual, -adv * dual_clip, loss)
    clipped = clipped | dual
    metrics["dual_clip_frac"] = masked_mean(dual, mask)
  metrics["clip_frac"] = masked_mean(clipped, mask)
  return loss, clipped, metrics


def _check_eps(name: str, eps_low: float, eps_high: float) -> None:
  if not 0.0 <= eps_low:
    raise ValueError(f"{name}: eps_low must be >= 0, got {eps_low}")
  if not 0.0 <= eps_high:
    raise ValueError(f"{name}: eps_high must be >= 0, got {eps_high}")


@_register("reinforce")
def reinforce(logp, old_logp, adv, mask):
  """REINFORCE (Williams 1992): ``l = -A * logp``.

  No ratio: on-policy (or corrected by a behaviour weight). The gradient is
  ``-A`` per token.
  """
  del old_logp
  return -adv * logp, {"clip_frac": jnp.float32(0.0)}


@_register("ppo")
def ppo(logp, old_logp, adv, mask, *, eps_low: float = 0.2, eps_high: float = 0.2,
        dual_clip: float | None = None):
  """PPO clip (Schulman et al., arXiv 1707.06347) with clip-higher and dual clip.

  ``l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``. Asymmetric bounds
  are DAPO's clip-higher (arXiv 2503.14476: ``eps_low = 0.2``, ``eps_high =
  0.28``). ``dual_clip = c > 1`` (Ye et al., arXiv 1912.09729) also bounds
  the loss of negative-advantage tokens at ``-c A``. Tokens with ``A > 0, r >
  1 + eps_high``, ``A < 0, r < 1 - eps_low`` or ``A < 0, r > c`` get exactly
  zero gradient (``clip_frac``); every other token gets ``-A r``.
  """
  _check_eps("ppo", eps_low, eps_high)
  if dual_clip is not None and dual_clip <= 1.0:
    raise ValueError(f"ppo: dual_clip must be > 1 (or None), got {dual_clip}")
  loss, _, metrics = _clipped_surrogate(_ratio(logp - old_logp), adv, mask, eps_low, eps_high,
                                        dual_clip)
  return loss, metrics


@_register("gspo")
def gspo(logp, old_logp, adv, mask, *, eps_low: float = 3e-4, eps_high: float = 4e-4):
  """GSPO (Zheng et al., arXiv 2507.18071): length-normalised sequence ratio.

  ``s_i = exp((1/|y_i|) sum_t (logp - old_logp))`` is clipped like PPO's
  ratio at ``[1 - eps_low, 1 + eps_high]`` (paper: 3e-4 / 4e-4). Built as
  GSPO-token, ``s_{i,t} = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t))``, whose
  value is ``s_i`` and whose gradient w.r.t. ``logp_t`` is ``s_i``. With
  ``agg='seq_mean_token_mean'`` (and per-sequence advantages) the loss is the
  paper's ``-(1/G) sum_i min(s_i A_i, clip(s_i) A_i)`` with gradient
  ``-(A_i s_i / (G |y_i|))`` per unclipped token; other modes weight the
  sequences differently.
  """
  _check_eps("gspo", eps_low, eps_high)
  valid = mask != 0
  lengths_B1 = jnp.maximum(valid.sum(axis=-1, keepdims=True), 1)
  seq_log_ratio_B1 = (logp - old_logp).sum(axis=-1, keepdims=True) / lengths_B1
  seq_log_ratio_B1 = jnp.clip(seq_log_ratio_B1, -MAX_LOG_RATIO, MAX_LOG_RATIO)
  sg = jax.lax.stop_gradient
  token_ratio = jnp.exp(sg(seq_log_ratio_B1) + logp - sg(logp))
  loss, _, metrics = _clipped_surrogate(token_ratio, adv, mask, eps_low, eps_high, None)
  seq_valid_B1 = valid.any(axis=-1, keepdims=True)
  metrics["seq_ratio_mean"] = masked_mean(jnp.exp(seq_log_ratio_B1), seq_valid_B1)
  metrics["seq_ratio_max"] = masked_max(jnp.exp(seq_log_ratio_B1), seq_valid_B1)
  return loss, metrics


@_register("cispo")
def cispo(logp, old_logp, adv, mask, *, eps_low: float = 1.0, eps_high: float = 4.0):
  """CISPO (MiniMax-M1, arXiv 2506.13585, §3.1).

  ``l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp``: the IS *weight*
  is clipped, not the update, so no token is ever dropped (gradient
  ``-sg(clipped r) A`` for every token). The paper sets ``eps_low`` large (no
  lower bound; ``eps_low = 1`` puts it at 0) and tunes only ``eps_high``,
  whose value it does not report; 4 (weights up to 5) follows slime/SkyRL
  practice. ``clip_frac`` counts tokens whose weight was clipped.
  """
  _check_eps("cispo", eps_low, eps_high)
  ratio = _ratio(logp - old_logp)
  lo, hi = max(1.0 - eps_low, 0.0), 1.0 + eps_high
  weight = jax.lax.stop_gradient(jnp.clip(ratio, lo, hi))
  clipped = (ratio < lo) | (ratio > hi)
  return -weight * adv * logp, {"clip_frac": masked_mean(clipped, mask)}


@_register("kimi")
def kimi(logp, old_logp, adv, mask, *, tau: float = 0.1):
  """Kimi k1.5 online mirror descent (arXiv 2501.12599, §2.3.2).

  Per sequence j: ``-(r_j - r_bar) log pi(y_j) + (tau / 2) (log pi(y_j) -
  log pi_old(y_j))^2`` with ``log pi(y) = sum_t logp_t``; ``pi_old`` is the
  previous iterate (the reference of the mirror-descent step). Its gradient
  is the paper's ``-(r_j - r_bar) grad log pi(y_j) + tau (log pi(y_j) - log
  pi_old(y_j)) grad log pi(y_j)``: ``-A_j + tau D_j`` per token, where
  ``D_j = sum_t (logp_t - old_logp_t)``. The squared term is spread evenly
  over the sequence's tokens, so ``agg='seq_mean_token_sum'`` gives exactly
  the paper's ``(1/k) sum_j``. Expects ``A = r - r_bar`` (the ``kimi``
  estimator). The paper does not report tau; 0.1 is ROLL's ``kimi15_tau``.
  """
  if tau < 0:
    raise ValueError(f"kimi: tau must be >= 0, got {tau}")
  valid = mask != 0
  lengths_B1 = jnp.maximum(valid.sum(axis=-1, keepdims=True), 1)
  seq_log_ratio_B1 = (logp - old_logp).sum(axis=-1, keepdims=True)
  penalty_B1 = 0.5 * tau * jnp.square(seq_log_ratio_B1) / lengths_B1
  seq_valid_B1 = valid.any(axis=-1, keepdims=True)
  metrics = {
      "clip_frac": jnp.float32(0.0),
      "seq_sq_log_ratio": masked_mean(jnp.square(seq_log_ratio_B1), seq_valid_B1),
  }
  return -adv * logp + penalty_B1, metrics


@_register("kimi_token_mask")
def kimi_token_mask(logp, old_logp, adv, mask, *, alpha: float = -math.log(2.0),
                    beta: float = math.log(2.0), tau: float = 1.0):
  """Kimi K2.5 token-level clipping (arXiv 2602.02276, "Policy Optimization").

  ``l_t = -1[alpha <= logp_t - old_logp_t <= beta] * (A / tau) * logp_t``:
  a masked policy gradient with mean baseline (``A = r - r_bar``) and
  ``agg='token_mean'`` (the paper's ``1/N``, N = all generated tokens).
  Tokens outside the log-ratio window get exactly zero gradient whatever the
  sign of ``A`` (``clip_frac`` counts them). The paper reports neither
  alpha, beta nor tau; ``[-log 2, log 2]`` (ratio in ``[0.5, 2]``, the usual
  MIS band) and ``tau = 1`` are ours. The window must contain 0 so that
  on-policy tokens pass.
  """
  if not alpha <= 0.0 <= beta:
    raise ValueError(f"kimi_token_mask: need alpha <= 0 <= beta, got alpha={alpha}, beta={beta}")
  if tau <= 0:
    raise ValueError(f"kimi_token_mask: tau must be > 0, got {tau}")
  log_ratio = logp - old_logp
  inside = (log_ratio >= alpha) & (log_ratio <= beta)
  loss = jnp.where(inside, -(adv / tau) * logp, 0.0)
  return loss, {"clip_frac": masked_mean(~inside, mask)}


def _covariance(logp, adv, mask) -> jax.Array:
  """Per-token ``(logp - mean logp) (A - mean A)`` over masked tokens (Cui et al.)."""
  logp = jax.lax.stop_gradient(logp)
  return (logp - masked_mean(logp, mask)) * (adv - masked_mean(adv, mask))


def _select(priority, candidates, mask, ratio: float) -> jax.Array:
  """The ``max(floor(ratio * n), 1)`` candidates of highest priority (n = masked tokens)."""
  k = jnp.maximum(jnp.floor(ratio * (mask != 0).sum()), 1.0)
  flat = jnp.where(candidates, priority, -jnp.inf).ravel()
  order = jnp.argsort(-flat, stable=True)
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size))
  return (rank.reshape(priority.shape) < k) & candidates


def _check_ratio(name: str, ratio: float) -> None:
  if not 0.0 < ratio <= 1.0:
    raise ValueError(f"{name}: the selected fraction must be in (0, 1], got {ratio}")


@_register("clip_cov")
def clip_cov(logp, old_logp, adv, mask, *, eps_low: float = 0.2, eps_high: float = 0.2,
             clip_ratio: float = 2e-4, cov_lb: float = 1.0, cov_ub: float = 5.0,
             key: jax.Array | None = None):
  """Clip-Cov (Cui et al., arXiv 2505.22617): detach high-covariance tokens.

  PPO clip as ``ppo``, then among the unclipped masked tokens whose
  ``Cov_t = (logp_t - mean logp)(A_t - mean A)`` lies strictly in ``(cov_lb,
  cov_ub)``, ``max(floor(clip_ratio * n), 1)`` tokens get their gradient
  detached: chosen uniformly at random with ``key`` (the paper and verl), or
  the highest-covariance ones without a key. Means and n are over this call's
  masked tokens (as verl, per micro-batch). Defaults are verl's.
  """
  _check_eps("clip_cov", eps_low, eps_high)
  _check_ratio("clip_cov", clip_ratio)
  loss, clipped, metrics = _clipped_surrogate(_ratio(logp - old_logp), adv, mask, eps_low,
                                              eps_high, None)
  cov = _covariance(logp, adv, mask)
  candidates = (mask != 0) & ~clipped & (cov > cov_lb) & (cov < cov_ub)
  priority = cov if key is None else jax.random.uniform(key, cov.shape)
  detached = _select(priority, candidates, mask, clip_ratio)
  metrics["cov_frac"] = masked_mean(detached, mask)
  return jnp.where(detached, jax.lax.stop_gradient(loss), loss), metrics


@_register("kl_cov")
def kl_cov(logp, old_logp, adv, mask, *, kl_ratio: float = 2e-4, cov_kl_coef: float = 0.1):
  """KL-Cov (Cui et al., arXiv 2505.22617): KL-penalise high-covariance tokens.

  ``l_t = -r A`` for every token, plus ``cov_kl_coef * |logp_t -
  old_logp_t|`` on the ``max(floor(kl_ratio * n), 1)`` masked tokens of
  highest ``Cov_t`` (see ``clip_cov``). No clipping. Defaults are verl's
  (``kl_cov_ratio``, ``ppo_kl_coef``).
  """
  _check_ratio("kl_cov", kl_ratio)
  if cov_kl_coef < 0:
    raise ValueError(f"kl_cov: cov_kl_coef must be >= 0, got {cov_kl_coef}")
  cov = _covariance(logp, adv, mask)
  penalised = _select(cov, mask != 0, mask, kl_ratio)
  loss = -adv * _ratio(logp - old_logp)
  loss = loss + jnp.where(penalised, cov_kl_coef * jnp.abs(logp - old_logp), 0.0)
  return loss, {"clip_frac": jnp.float32(0.0), "cov_frac": masked_mean(penalised, mask)}


def kl_penalty(logp_BxT: jax.Array, ref_logp_BxT: jax.Array, estimator: str = "k3") -> jax.Array:
  """Per-token estimate of ``KL(pi_theta || pi_ref)`` from samples of pi_theta.

  With ``d = logp - ref_logp`` (Schulman, "Approximating KL divergence",
  2020): ``k1 = d`` (unbiased, can be negative), ``k2 = d^2 / 2``, ``k3 =
  exp(-d) + d - 1`` (unbiased, >= 0; verl's ``low_var_kl``). Differentiated
  directly, as verl and slime do.
  """
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
  d = logp_BxT - ref_logp_BxT
  if estimator == "k1":
    return d
  if estimator == "k2":
    return 0.5 * jnp.square(d)
  neg_d = jnp.clip(-d, -MAX_LOG_RATIO, MAX_LOG_RATIO)
  return jnp.exp(neg_d) - neg_d - 1.0


def _k3_from_log_ratio(log_q_over_p: jax.Array) -> jax.Array:
  """k3 estimate of ``KL(p || q)`` from samples of p: ``q/p - log(q/p) - 1``."""
  x = jnp.clip(log_q_over_p, -MAX_LOG_RATIO, MAX_LOG_RATIO)
  return jnp.exp(x) - x - 1.0


POLICY_LOSSES = tuple(_BASE_LOSSES)


def _check_token_array(name: str, x: jax.Array | None, shape: tuple[int, ...]) -> None:
  if x is not None and jnp.shape(x) != shape:
    raise ValueError(f"{name} must have shape [B, T] = {shape}, got {jnp.shape(x)}")


def _as_names(correction: str | Sequence[str] | None) -> tuple[str, ...]:
  if correction is None:
    return ()
  return (correction,) if isinstance(correction, str) else tuple(correction)


def policy_loss(
    name: str,
    logp_BxT: jax.Array,
    old_logp_BxT: jax.Array,
    advantages: jax.Array,
    mask_BxT: jax.Array,
    *,
    agg: str = "token_mean",
    num_tokens: jax.Array | float | None = None,
    num_seqs: jax.Array | float | None = None,
    horizon: int | None = None,
    behaviour_logp_BxT: jax.Array | None = None,
    ref_logp_BxT: jax.Array | None = None,
    entropy_BxT: jax.Array | None = None,
    token_weights_BxT: jax.Array | None = None,
    correction: str | Sequence[str] | None = None,
    correction_kwargs: Mapping[str, Mapping[str, object]] | None = None,
    entropy_coef: float | jax.Array = 0.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    **loss_kwargs,
) -> tuple[jax.Array, Metrics]:
  """The loss named ``name`` with its correction, entropy bonus and KL penalty.

  ``loss = agg(u w l) - entropy_coef * agg(u H) + kl_coef * agg(u KL_ref)``, where
  ``l`` is the base loss's per-token term (hyper-parameters in
  ``loss_kwargs``), ``w`` the product of the weights of the named
  ``correction`` (one name or several; each one's hyper-parameters in
  ``correction_kwargs[name]``; needs ``behaviour_logp_BxT``), ``H`` the
  per-token entropy ``entropy_BxT`` (differentiable; needed when
  ``entropy_coef != 0``; ``entropy_coef`` may be a float scalar array, e.g. an
  adaptive coefficient under ``jit``), and ``KL_ref`` :func:`kl_penalty` to
  ``ref_logp_BxT`` (needed when ``kl_coef != 0``). ``u`` is the optional
  per-token loss weight ``token_weights_BxT`` (stop-gradient; 1 by default),
  e.g. the staleness down-weighting of ``agentic_rl.invariants.shift``; it
  does not change the normalisers. ``agg``, ``num_tokens``,
  ``num_seqs`` and ``horizon`` go to :func:`.aggregation.aggregate`; pass the
  whole batch's counts when calling on a micro-batch.

  ``old_logp``, ``behaviour_logp``, ``ref_logp`` and ``advantages`` are
  stop-gradient. Names, modes and hyper-parameters are Python values (static
  under ``jit``); bad ones raise ``ValueError`` before tracing.

  Metrics (float32 scalars, over masked tokens): ``pg_loss``, ``clip_frac``
  (tokens whose gradient the base loss clips or masks; for ``cispo`` whose
  weight it clips) plus the base loss's own, ``is_ratio_mean`` /
  ``is_ratio_max`` (``pi_theta / pi_old``), ``approx_kl`` (k3 estimate of
  ``KL(pi_old || pi_theta)``), and when given: ``mismatch_k3_kl`` (k3
  ``KL(pi_behav || pi_old)``) and ``mismatch_ratio_max``, ``<correction>/...``,
  ``entropy``, ``kl_ref``.
  """
  if name not in _BASE_LOSSES:
    raise ValueError(f"unknown policy loss {name!r}; valid losses: {', '.join(POLICY_LOSSES)}")
  check_agg_mode(agg)
  names = _as_names(correction)
  correction_kwargs = dict(correction_kwargs or {})
  correction_fns = [get_correction(c) for c in names]
  if stray := set(correction_kwargs) - set(names):
    raise ValueError(f"correction_kwargs for {sorted(stray)}, which are not in correction={names}")
  if "decoupled" in names and name not in RATIO_LOSSES:
    raise ValueError(
        f"the decoupled correction needs a loss built on pi_theta / pi_old "
        f"({', '.join(sorted(RATIO_LOSSES))}), not {name!r}")
  if kl_estimator not in KL_ESTIMATORS:
    raise ValueError(f"unknown KL estimator {kl_estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
  check_keywords(f"policy loss {name!r}", _BASE_LOSSES[name], loss_kwargs)
  for c, fn in zip(names, correction_fns):
    check_keywords(f"correction {c!r}", fn, correction_kwargs.get(c, {}))

  shape = jnp.shape(logp_BxT)
  if len(shape) != 2:
    raise ValueError(f"logp must have shape [B, T], got {shape}")
  for arg, x in (("old_logp", old_logp_BxT), ("mask", mask_BxT),
                 ("behaviour_logp", behaviour_logp_BxT), ("ref_logp", ref_logp_BxT),
                 ("entropy", entropy_BxT), ("token_weights", token_weights_BxT)):
    _check_token_array(arg, x, shape)
  if jnp.shape(advantages) not in (shape[:1], shape):
    raise ValueError(f"advantages must have shape [B] = {shape[:1]} or [B, T] = {shape}, got "
                     f"{jnp.shape(advantages)}")
  if names and behaviour_logp_BxT is None:
    raise ValueError(f"correction {names} needs behaviour_logp_BxT")
  # An array coefficient (an adaptive one, traced under jit) is always applied.
  use_entropy = not isinstance(entropy_coef, (int, float)) or entropy_coef != 0
  if use_entropy and entropy_BxT is None:
    raise ValueError("entropy_coef != 0 needs entropy_BxT")
  if kl_coef != 0 and ref_logp_BxT is None:
    raise ValueError("kl_coef != 0 needs ref_logp_BxT")
  if kl_coef < 0:
    raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")

  valid = jnp.asarray(mask_BxT) != 0

  def clean(x, differentiable=False):
    x = jnp.asarray(x).astype(jnp.float32)
    return jnp.where(valid, x if differentiable else jax.lax.stop_gradient(x), 0.0)

  logp = clean(logp_BxT, differentiable=True)
  old_logp = clean(old_logp_BxT)
  adv = jnp.asarray(advantages)
  adv = clean(adv if adv.ndim == 2 else jnp.broadcast_to(adv[:, None], shape))

  per_token, metrics = _BASE_LOSSES[name](logp, old_logp, adv, valid, **loss_kwargs)
  weight = jnp.ones(shape, jnp.float32)
  if behaviour_logp_BxT is not None:
    behaviour_logp = clean(behaviour_logp_BxT)
    mismatch = old_logp - behaviour_logp
    metrics["mismatch_k3_kl"] = masked_mean(_k3_from_log_ratio(mismatch), valid)
    metrics["mismatch_ratio_max"] = masked_max(_ratio(mismatch), valid)
    for c, fn in zip(names, correction_fns):
      w, c_metrics = fn(logp, old_logp, behaviour_logp, adv, valid, **correction_kwargs.get(c, {}))
      weight = weight * w
      metrics.update({f"{c}/{k}": v for k, v in c_metrics.items()})

  token_weights = 1.0 if token_weights_BxT is None else clean(token_weights_BxT)

  def reduce(values_BxT):
    return aggregate(values_BxT * token_weights, valid, agg, num_tokens=num_tokens,
                     num_seqs=num_seqs, horizon=horizon)

  pg_loss = reduce(per_token * weight)
  loss = pg_loss
  log_ratio = jax.lax.stop_gradient(logp - old_logp)
  metrics.update({
      "pg_loss": pg_loss,
      "is_ratio_mean": masked_mean(_ratio(log_ratio), valid),
      "is_ratio_max": masked_max(_ratio(log_ratio), valid),
      "approx_kl": masked_mean(_k3_from_log_ratio(log_ratio), valid),
  })
  if entropy_BxT is not None:
    entropy = clean(entropy_BxT, differentiable=True)
    metrics["entropy"] = masked_mean(jax.lax.stop_gradient(entropy), valid)
    if use_entropy:
      loss = loss - entropy_coef * reduce(entropy)
  if ref_logp_BxT is not None:
    kl = kl_penalty(logp, clean(ref_logp_BxT), kl_estimator)
    metrics["kl_ref"] = masked_mean(jax.lax.stop_gradient(kl), valid)
    if kl_coef != 0:
      loss = loss + kl_coef * reduce(kl)
  return loss, metrics


def get_policy_loss(name: str) -> Callable[..., tuple[jax.Array, Metrics]]:
  """``policy_loss`` bound to the loss named ``name`` (see :data:`POLICY_LOSSES`).

  Call it as ``fn(logp_BxT, old_logp_BxT, advantages, mask_BxT, **kwargs)``.
  """
  if name not in _BASE_LOSSES:
    raise ValueError(f"unknown policy loss {name!r}; valid losses: {', '.join(POLICY_LOSSES)}")
  return functools.partial(policy_loss, name)
