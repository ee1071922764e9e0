"""Advantage estimators, selectable by name.

Group estimators take rewards ``[P, G]`` (P prompts, G samples each) and return
advantages ``[P, G]`` in float32, one per sampled response; the loss broadcasts
them over the response's tokens. ``remax`` also takes the greedy rewards
``[P]``; ``rebn`` and ``gigpo`` work on per-turn rewards ``[B, N]`` of
multi-turn episodes (``gigpo`` also on each turn's starting observation and
each episode's group).
Every estimator is a pure function of its inputs; hyper-parameters are Python
keywords (static under ``jit``).

A group whose rewards are all equal carries no learning signal: every group
estimator returns exactly 0 for it (never NaN), whatever the floating-point
rounding of its mean.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp

_ESTIMATORS: dict[str, Callable[..., jax.Array]] = {}


def _register(name: str):
  def decorate(fn):
    _ESTIMATORS[name] = fn
    return fn
  return decorate


def _check_rewards(name: str, rewards_PxG: jax.Array, min_group: int) -> jax.Array:
  rewards_PxG = jnp.asarray(rewards_PxG)
  if rewards_PxG.ndim != 2:
    raise ValueError(f"{name} needs rewards shaped [prompts, group], got shape {rewards_PxG.shape}")
  if rewards_PxG.shape[1] < min_group:
    raise ValueError(
        f"{name} needs a group of at least {min_group} samples per prompt, got group size "
        f"{rewards_PxG.shape[1]} (rewards shape {rewards_PxG.shape})")
  return rewards_PxG.astype(jnp.float32)


def _check_ddof_eps(name: str, ddof: int, eps: float) -> None:
  if ddof not in (0, 1):
    raise ValueError(f"{name}: ddof must be 0 (population std) or 1 (sample std), got {ddof}")
  if eps < 0:
    raise ValueError(f"{name}: eps must be >= 0, got {eps}")


def _zero_constant_groups(adv_PxG: jax.Array, rewards_PxG: jax.Array) -> jax.Array:
  constant_P1 = rewards_PxG.max(axis=-1, keepdims=True) == rewards_PxG.min(axis=-1, keepdims=True)
  return jnp.where(constant_P1, 0.0, adv_PxG)


def _centred(rewards_PxG: jax.Array) -> jax.Array:
  return rewards_PxG - rewards_PxG.mean(axis=-1, keepdims=True)


def _all_rewards(name: str, rewards_PxG: jax.Array, all_rewards_PxN, all_mask_PxN):
  """The rewards the group statistics run over, ``([P, N], bool [P, N])``.

  Reinforce-Ada (arXiv 2510.04996) passes every rollout generated for each
  prompt, kept or not (``all_rewards_PxN`` with ``all_mask_PxN`` marking the
  real entries), so the baseline is the prompt's global mean rather than the
  kept group's.
  """
  all_rewards_PxN = jnp.asarray(all_rewards_PxN, jnp.float32)
  mask = (jnp.ones(all_rewards_PxN.shape, bool) if all_mask_PxN is None
          else jnp.asarray(all_mask_PxN) != 0)
  if all_rewards_PxN.ndim != 2 or all_rewards_PxN.shape[0] != rewards_PxG.shape[0] or (
      mask.shape != all_rewards_PxN.shape):
    raise ValueError(f"{name}: all_rewards_PxN / all_mask_PxN must be [P, N] with P = "
                     f"{rewards_PxG.shape[0]}, got {all_rewards_PxN.shape} / {mask.shape}")
  return all_rewards_PxN, mask


def _group_stats(r_PxN: jax.Array, mask_PxN: jax.Array, ddof: int):
  """Masked mean and std ``[P, 1]`` along the last axis, and whether the
  masked values of each row are all equal ``[P, 1]``."""
  count = jnp.maximum(mask_PxN.sum(-1, keepdims=True), 1).astype(jnp.float32)
  mean = jnp.where(mask_PxN, r_PxN, 0.0).sum(-1, keepdims=True) / count
  sq_dev = jnp.where(mask_PxN, jnp.square(r_PxN - mean), 0.0).sum(-1, keepdims=True)
  std = jnp.sqrt(sq_dev / jnp.maximum(count - ddof, 1.0))
  constant = (jnp.where(mask_PxN, r_PxN, jnp.inf).min(-1, keepdims=True)
              == jnp.where(mask_PxN, r_PxN, -jnp.inf).max(-1, keepdims=True))
  return mean, std, constant


# Estimators whose group statistics may run over all rollouts generated for a
# prompt (``all_rewards_PxN``): Reinforce-Ada's global baseline.
GLOBAL_STATS_ESTIMATORS = ("grpo", "dr_grpo", "kimi")


def _mean_baseline(name: str, rewards_PxG, all_rewards_PxN, all_mask_PxN, ddof: int = 0):
  """``(r, r - mean, std, constant)``: the group's own statistics, or those of
  ``all_rewards_PxN``; the centred rewards are exactly 0 (not rounding noise)
  where the statistics' rewards are all equal."""
  if all_rewards_PxN is None:
    r = _check_rewards(name, rewards_PxG, 2)
    mean, std = r.mean(-1, keepdims=True), r.std(-1, ddof=ddof, keepdims=True)
    constant = r.max(-1, keepdims=True) == r.min(-1, keepdims=True)
  else:
    r = _check_rewards(name, rewards_PxG, 1)
    mean, std, constant = _group_stats(*_all_rewards(name, r, all_rewards_PxN, all_mask_PxN),
                                       ddof)
  return r, jnp.where(constant, 0.0, r - mean), std, constant


@_register("grpo")
def grpo(rewards_PxG: jax.Array, all_rewards_PxN: jax.Array | None = None,
         all_mask_PxN: jax.Array | None = None, *, ddof: int = 1,
         eps: float = 1e-6) -> jax.Array:
  """GRPO group-normalised advantage (DeepSeekMath, arXiv 2402.03300).

  ``A_i = (r_i - mean(r)) / (std(r) + eps)`` over the G samples of a prompt.
  ``std`` is the *sample* std (``ddof=1``, Bessel-corrected) by default, as
  ``torch.std`` in verl, TRL and OpenRLHF; ``ddof=0`` gives the population std.
  Needs G >= 2. With ``all_rewards_PxN`` (and ``all_mask_PxN``) the mean and
  std run over those rewards instead (Reinforce-Ada's global statistics).
  """
  _check_ddof_eps("grpo", ddof, eps)
  _, centred, std, _ = _mean_baseline("grpo", rewards_PxG, all_rewards_PxN, all_mask_PxN, ddof)
  return centred / (std + eps)


@_register("dr_grpo")
def dr_grpo(rewards_PxG: jax.Array, all_rewards_PxN: jax.Array | None = None,
            all_mask_PxN: jax.Array | None = None) -> jax.Array:
  """Dr. GRPO advantage (Liu et al., arXiv 2503.20783): ``A_i = r_i - mean(r)``.

  GRPO without the std division (which biases towards too easy or too hard
  questions). Pair it with ``agg='seq_mean_token_sum_norm'`` for the paper's
  length-unbiased loss. Needs G >= 2. ``all_rewards_PxN``: as :func:`grpo`.
  """
  return _mean_baseline("dr_grpo", rewards_PxG, all_rewards_PxN, all_mask_PxN)[1]


@_register("rloo")
def rloo(rewards_PxG: jax.Array) -> jax.Array:
  """REINFORCE leave-one-out (Ahmadian et al., arXiv 2402.14740).

  ``A_i = r_i - (1 / (G - 1)) * sum_{j != i} r_j``: the baseline of each sample
  is the mean of the *other* G - 1 samples, so it is independent of the
  sample and the estimator is unbiased. Equals ``G / (G - 1) * (r_i -
  mean(r))``. Needs G >= 2.
  """
  r = _check_rewards("rloo", rewards_PxG, 2)
  group = r.shape[1]
  others_mean = (r.sum(axis=-1, keepdims=True) - r) / (group - 1)
  return _zero_constant_groups(r - others_mean, r)


@_register("kimi")
def kimi(rewards_PxG: jax.Array, all_rewards_PxN: jax.Array | None = None,
         all_mask_PxN: jax.Array | None = None) -> jax.Array:
  """Kimi k1.5 mean-of-k baseline (arXiv 2501.12599, §2.3.2): ``A_i = r_i - r_bar``.

  ``r_bar`` is the mean reward of the k samples of the prompt, the paper's
  approximation of ``tau * log Z``. This is the ``(r - r_bar)`` that the ``kimi``
  and ``kimi_token_mask`` losses expect (the latter divides by its ``tau``).
  Numerically the same as ``dr_grpo``. Needs G >= 2. ``all_rewards_PxN``:
  as :func:`grpo`.
  """
  return _mean_baseline("kimi", rewards_PxG, all_rewards_PxN, all_mask_PxN)[1]


@_register("remax")
def remax(rewards_PxG: jax.Array, greedy_rewards_P: jax.Array) -> jax.Array:
  """ReMax (Li et al., arXiv 2310.10505): ``A_i = r_i - r(greedy)``.

  The baseline is the reward of the greedy (argmax) decode of the same prompt
  ``greedy_rewards_P`` ``[P]``; it does not depend on the sampled response, so
  the estimator is unbiased. Works with any G >= 1.
  """
  r = _check_rewards("remax", rewards_PxG, 1)
  greedy_rewards_P = jnp.asarray(greedy_rewards_P)
  if greedy_rewards_P.shape != r.shape[:1]:
    raise ValueError(
        f"remax needs greedy rewards shaped [prompts] = {r.shape[:1]}, got "
        f"{greedy_rewards_P.shape}")
  return r - greedy_rewards_P.astype(jnp.float32)[:, None]


def _normalise(values: jax.Array, valid: jax.Array, ddof: int, eps: float,
               subtract_mean: bool = True) -> jax.Array:
  """``(x - mean) / (std + eps)`` over the valid entries of the whole array."""
  count = jnp.maximum(valid.sum(), 1).astype(jnp.float32)
  mean = jnp.where(valid, values, 0.0).sum() / count
  sq_dev = jnp.where(valid, jnp.square(values - mean), 0.0).sum()
  std = jnp.sqrt(sq_dev / jnp.maximum(count - ddof, 1.0))
  centred = values - mean if subtract_mean else values
  constant = jnp.where(valid, values, jnp.inf).min() == jnp.where(valid, values, -jnp.inf).max()
  return jnp.where(valid & ~constant, centred / (std + eps), 0.0)


@_register("reinforce_pp")
def reinforce_pp(rewards_PxG: jax.Array, *, group_baseline: bool = False, ddof: int = 1,
                 eps: float = 1e-6) -> jax.Array:
  """REINFORCE++ global batch normalisation (Hu, arXiv 2501.03262).

  ``A = (r - mean_batch(r)) / (std_batch(r) + eps)`` over all P * G rewards.
  With ``group_baseline=True`` (REINFORCE++-baseline) each reward first has its
  group mean subtracted, ``a = r - mean_group(r)``, then ``A = a /
  (std_batch(a) + eps)``: with equal group sizes ``mean_batch(a)`` is exactly
  0, so a constant group keeps advantage 0. ``ddof=1`` (sample std) as verl's
  ``masked_whiten``. Without the group baseline any G >= 1 works; with it
  G >= 2 is needed. The per-token KL shaping of the paper is the loss's
  ``kl_coef`` here.
  """
  _check_ddof_eps("reinforce_pp", ddof, eps)
  r = _check_rewards("reinforce_pp", rewards_PxG, 2 if group_baseline else 1)
  valid = jnp.ones(r.shape, bool)
  if group_baseline:
    centred = _zero_constant_groups(_centred(r), r)
    return _normalise(centred, valid, ddof, eps, subtract_mean=False)
  return _normalise(r, valid, ddof, eps)


@_register("rebn")
def rebn(turn_rewards_BxN: jax.Array, turn_mask_BxN: jax.Array, *, gamma: float = 0.9,
         ddof: int = 0, eps: float = 1e-6) -> jax.Array:
  """GEM return batch normalisation (ReBN; Liu et al., arXiv 2510.01051, §3).

  Each turn (a whole response) is one action with reward ``r_t``. Returns
  ``G_t = sum_{k >= t} gamma^(k - t) r_k`` (within an episode), then
  ``A_t = (G_t - mean(G)) / (std(G) + eps)`` where mean and std run over
  *every* valid transition of the batch (all episodes, all turns). Inputs
  ``[B, N]`` (N = max turns; ``turn_mask`` marks real turns, padding last).
  Returns ``[B, N]`` float32, 0 on padding turns. ``gamma = 0.9`` is GEM's
  value for games and QA (1.0 elsewhere); ``ddof=0`` as GEM's ``np.std``.
  Map per-turn advantages to tokens with :func:`broadcast_turn_advantages`.
  """
  _check_ddof_eps("rebn", ddof, eps)
  if not 0.0 <= gamma <= 1.0:
    raise ValueError(f"rebn: gamma must be in [0, 1], got {gamma}")
  turn_rewards_BxN = jnp.asarray(turn_rewards_BxN)
  if turn_rewards_BxN.ndim != 2 or turn_rewards_BxN.shape != jnp.shape(turn_mask_BxN):
    raise ValueError(
        f"rebn needs per-turn rewards and a turn mask of the same shape [episodes, turns], got "
        f"{turn_rewards_BxN.shape} and {jnp.shape(turn_mask_BxN)}")
  valid = jnp.asarray(turn_mask_BxN) != 0
  rewards = jnp.where(valid, turn_rewards_BxN.astype(jnp.float32), 0.0)

  return _normalise(_discounted_returns(rewards, gamma), valid, ddof, eps)


def _discounted_returns(rewards_BxN: jax.Array, gamma: float) -> jax.Array:
  """``G_t = sum_{k >= t} gamma^(k - t) r_k`` along each row."""
  def discount(later_return_B, reward_B):
    ret_B = reward_B + gamma * later_return_B
    return ret_B, ret_B

  _, returns_NxB = jax.lax.scan(discount, jnp.zeros(rewards_BxN.shape[0]), rewards_BxN.T,
                                reverse=True)
  return returns_NxB.T


def _within(values_K: jax.Array, same_KxK: jax.Array, normalise: bool, ddof: int,
            eps: float) -> jax.Array:
  """Each entry's deviation from the mean of the entries ``same_KxK`` puts
  with it (its row), divided by their std (``+ eps``) when ``normalise``;
  exactly 0 where those entries are all equal (one entry included)."""
  same = same_KxK.astype(jnp.float32)
  count_K = same.sum(axis=1)
  mean_K = same @ values_K / jnp.maximum(count_K, 1.0)
  dev_K = values_K - mean_K
  sq_dev_K = (same * jnp.square(values_K[None, :] - mean_K[:, None])).sum(axis=1)
  var_K = sq_dev_K / jnp.maximum(count_K - ddof, 1.0)
  hi_K = jnp.where(same_KxK, values_K[None, :], -jnp.inf).max(axis=1)
  lo_K = jnp.where(same_KxK, values_K[None, :], jnp.inf).min(axis=1)
  scale_K = jnp.sqrt(var_K) + eps if normalise else 1.0
  return jnp.where(hi_K > lo_K, dev_K / scale_K, 0.0)


@_register("gigpo")
def gigpo(turn_rewards_BxN: jax.Array, turn_mask_BxN: jax.Array, state_BxN: jax.Array,
          group_B: jax.Array, *, gamma: float = 0.95, step_weight: float = 1.0,
          normalise: bool = True, ddof: int = 1, eps: float = 1e-6) -> jax.Array:
  """Group-in-group advantages (GiGPO; Feng et al., arXiv 2505.10978, §4).

  Two levels of groups over a batch of multi-turn episodes:

  * episode groups, the rollouts of one prompt (``group_B``): with the
    episode's return ``R = sum_t r_t``,
    ``A^E = (R - mean_g R) / (std_g R + eps)``;
  * step groups, every turn of an episode group that starts from the same
    observation (``state_BxN``, the anchor state): with the discounted return
    ``G_t = sum_{k >= t} gamma^(k - t) r_k``,
    ``A^S = (G_t - mean_s G) / (std_s G + eps)``.

  Each turn's advantage is ``A^E + step_weight * A^S``; without
  ``normalise`` the deviations are not divided by the std (the paper's
  ``F_norm = 1``); ``std`` is the sample std (``ddof=1``) as GRPO's. A group
  (or step group) whose values are all equal, one member included,
  contributes exactly 0. With one turn per episode every step group is its
  episode group and ``G_0 = R``: GiGPO is ``(1 + step_weight)`` times GRPO.

  Args:
    turn_rewards_BxN: float ``[B, N]`` each turn's reward (N = max turns).
    turn_mask_BxN: bool ``[B, N]``, the real turns (an episode left out of
      the batch has none).
    state_BxN: int ``[B, N]`` an id of the observation each turn starts
      from (:func:`agentic_rl.objectives.turn_states`); equal ids within an
      episode group are one anchor state.
    group_B: int ``[B]`` the episode group of each row.

  Returns:
    float32 ``[B, N]``, 0 on padding turns; map it to tokens with
    :func:`broadcast_turn_advantages`.
  """
  _check_ddof_eps("gigpo", ddof, eps)
  if not 0.0 <= gamma <= 1.0:
    raise ValueError(f"gigpo: gamma must be in [0, 1], got {gamma}")
  if not isinstance(step_weight, numbers.Real) or step_weight < 0:
    raise ValueError(f"gigpo: step_weight must be a number >= 0, got {step_weight!r}")
  rewards = jnp.asarray(turn_rewards_BxN)
  B, N = rewards.shape if rewards.ndim == 2 else (None, None)
  if (rewards.ndim != 2 or jnp.shape(turn_mask_BxN) != rewards.shape
      or jnp.shape(state_BxN) != rewards.shape or jnp.shape(group_B) != (B,)):
    raise ValueError(
        f"gigpo needs turn rewards, a turn mask and turn states of one shape [episodes, "
        f"turns] and a group per episode, got {rewards.shape}, {jnp.shape(turn_mask_BxN)}, "
        f"{jnp.shape(state_BxN)} and {jnp.shape(group_B)}")
  valid_BxN = jnp.asarray(turn_mask_BxN) != 0
  rewards = jnp.where(valid_BxN, rewards.astype(jnp.float32), 0.0)
  group_B = jnp.asarray(group_B)
  live_B = valid_BxN.any(axis=1)
  same_group_BxB = (group_B[:, None] == group_B[None, :]) & live_B[:, None] & live_B[None, :]
  episode_B = _within(rewards.sum(axis=1), same_group_BxB, normalise, ddof, eps)
  group_K = jnp.repeat(group_B, N)
  state_K = jnp.asarray(state_BxN).reshape(-1)
  valid_K = valid_BxN.reshape(-1)
  same_step_KxK = ((group_K[:, None] == group_K[None, :]) & (state_K[:, None] == state_K[None, :])
                   & valid_K[:, None] & valid_K[None, :])
  step_K = _within(_discounted_returns(rewards, gamma).reshape(-1), same_step_KxK, normalise,
                   ddof, eps)
  adv_BxN = episode_B[:, None] + step_weight * step_K.reshape(B, N)
  return jnp.where(valid_BxN, adv_BxN, 0.0)


def broadcast_turn_advantages(turn_adv_BxN: jax.Array, turn_index_BxT: jax.Array) -> jax.Array:
  """Per-token advantages ``[B, T]`` from per-turn ones ``[B, N]``.

  ``turn_index_BxT[b, t]`` is the turn that produced token t (negative for
  tokens of no turn, e.g. prompt or padding, which get 0).
  """
  idx = jnp.asarray(turn_index_BxT)
  taken = jnp.take_along_axis(turn_adv_BxN, jnp.clip(idx, 0, turn_adv_BxN.shape[1] - 1), axis=1)
  return jnp.where(idx >= 0, taken, 0.0)


def _comb_ratio(n_top: jax.Array, n_bottom: jax.Array, k: int) -> jax.Array:
  """``C(n_top, k) / C(n_bottom, k) = prod_{i<k} (n_top - i) / (n_bottom - i)``.

  Exact 0 when ``0 <= n_top < k`` (a factor vanishes); needs ``n_bottom >= k``.
  """
  i = jnp.arange(int(k), dtype=jnp.float32)
  return jnp.prod((n_top[..., None] - i) / (n_bottom[..., None] - i), axis=-1)


@_register("pass_at_k")
def pass_at_k(rewards_PxG: jax.Array, *, k: int, threshold: float = 0.5) -> jax.Array:
  """Closed-form pass@k advantage (Chen et al., "Pass@k Training", RUCAIBox).

  With N = G samples of which ``N_neg`` fail (reward <= ``threshold``; a
  success is reward > ``threshold``, so 0/1 and -1/+1 rewards both work):
  ``R_bar = 1 - C(N_neg, k) / C(N, k)`` (the group's pass@k),
  ``sigma = sqrt(R_bar (1 - R_bar))``,
  ``A_pos = (1 - R_bar) / sigma``,
  ``A_neg = (1 - R_bar - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / sigma``.
  ``k`` (required, 1 <= k <= G) is the k of pass@k; ``k = 1`` gives GRPO with
  the population std. Needs G >= 2.
  """
  r = _check_rewards("pass_at_k", rewards_PxG, 2)
  group = r.shape[1]
  if not isinstance(k, numbers.Integral) or not 1 <= k <= group:
    raise ValueError(f"pass_at_k: k must be an integer in [1, group size {group}], got {k!r}")
  success = r > threshold
  n = jnp.float32(group)
  n_neg = (~success).sum(axis=-1).astype(jnp.float32)
  r_bar = 1.0 - _comb_ratio(n_neg, n, k)
  sigma = jnp.sqrt(r_bar * (1.0 - r_bar))
  safe_sigma = jnp.where(sigma > 0, sigma, 1.0)
  a_pos = (1.0 - r_bar) / safe_sigma
  a_neg = (1.0 - r_bar - _comb_ratio(n_neg - 1.0, n - 1.0, k - 1)) / safe_sigma
  adv = jnp.where(success, a_pos[:, None], a_neg[:, None])
  return jnp.where((sigma > 0)[:, None], adv, 0.0)


ADVANTAGE_ESTIMATORS = tuple(_ESTIMATORS)


def get_advantage_fn(name: str) -> Callable[..., jax.Array]:
  """The estimator registered as ``name`` (see :data:`ADVANTAGE_ESTIMATORS`)."""
  if name not in _ESTIMATORS:
    raise ValueError(
        f"unknown advantage estimator {name!r}; valid estimators: "
        f"{', '.join(ADVANTAGE_ESTIMATORS)}")
  return _ESTIMATORS[name]
