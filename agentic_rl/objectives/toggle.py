"""Toggle: token-efficient RL without length overfitting (Kimi K2.5).

Training alternates phases of ``m`` iterations (``phase_iterations``): in
the budget phase (``t mod 2m < m``) a rollout of a prompt the policy already
solves (its group's mean success above ``accuracy_threshold``) that
succeeds with more policy tokens than the prompt's budget loses ``penalty``::

  r_t(x, y) = r(x, y) - penalty * [y succeeds and |y| > B(x)]
                                      if t mod 2m < m and mean_G(success) > lambda
  r_t(x, y) = r(x, y)                 otherwise

Failures are not penalised: charging a long failure more than a short one
would reward giving up early.

The unconstrained phase lets lengths grow again, so the policy does not
overfit to the budget. The budget ``B(x)`` is the ``percentile``-th
percentile of the lengths of the policy's own successful rollouts of ``x``,
set the first time ``x`` has one and then fixed (the paper estimates each
budget once, at the start of training). A prompt without a budget of its
own (seen for the first time, as every prompt of a pool that does not recur
is) takes the shared budget: the percentile of the successful lengths of
the first batch that had any, fixed from then on. A percentile of each new
batch instead would penalise half of every batch's successes however short
they already are, and ratchet lengths down until success breaks. The paper
leaves the form of the budget term and the values of ``lambda``, ``m`` and
the percentile open; here it is a constant penalty.

Pure numpy over a batch: ``[B]`` arrays of one iteration's rollouts, and
``budget_N1`` the float32 budget of each of the N training prompts, then the
shared budget (-1 for none yet).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ToggleConfig:
  """``phase_iterations`` m (0: Toggle off), the accuracy threshold lambda,
  the budget's percentile of successful lengths and the penalty."""

  phase_iterations: int = 0
  accuracy_threshold: float = 0.5
  percentile: float = 50.0
  penalty: float = 0.5

  @property
  def enabled(self) -> bool:
    return self.phase_iterations > 0

  def validate(self) -> ToggleConfig:
    if not isinstance(self.phase_iterations, int) or self.phase_iterations < 0:
      raise ValueError(f"toggle.phase_iterations must be an int >= 0 (0: off), got "
                       f"{self.phase_iterations!r}")
    if not 0.0 <= self.accuracy_threshold < 1.0:
      raise ValueError(f"toggle.accuracy_threshold must be in [0, 1), got "
                       f"{self.accuracy_threshold}")
    if not 0.0 <= self.percentile <= 100.0:
      raise ValueError(f"toggle.percentile must be in [0, 100], got {self.percentile}")
    if not self.penalty > 0:
      raise ValueError(f"toggle.penalty must be > 0, got {self.penalty}")
    return self


def init_budgets(num_prompts: int) -> np.ndarray:
  """float32 ``[N + 1]``: the budget of each of the N training prompts, then
  the shared one, all unknown (-1)."""
  return np.full((num_prompts + 1,), -1.0, np.float32)


def prompt_budgets(budget_N1: np.ndarray, prompt_B: np.ndarray) -> np.ndarray:
  """float32 ``[B]``: the budget of each rollout's prompt, its own once set,
  else the shared one (-1: none yet)."""
  own_B = budget_N1[:-1][prompt_B]
  return np.where(own_B >= 0, own_B, budget_N1[-1]).astype(np.float32)


def budget_phase(config: ToggleConfig, step: int) -> bool:
  """Whether iteration ``step`` is in a budget phase (``t mod 2m < m``)."""
  return config.enabled and step % (2 * config.phase_iterations) < config.phase_iterations


def group_mean(values_B: np.ndarray, group_B: np.ndarray, num_groups: int) -> np.ndarray:
  """``[B]``: each row's group mean of ``values_B``."""
  sums = np.bincount(group_B, weights=values_B, minlength=num_groups)
  counts = np.maximum(np.bincount(group_B, minlength=num_groups), 1)
  return (sums / counts)[group_B]


def budget_rewards(config: ToggleConfig, rewards_B: np.ndarray, lengths_B: np.ndarray,
                   success_B: np.ndarray, group_B: np.ndarray, num_groups: int,
                   budget_B: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
  """``(rewards_B, over_B)``: the rewards of iteration ``step`` (the module
  formula) and where the penalty applied (bool ``[B]``).

  Args:
    rewards_B: float rewards.
    lengths_B: policy tokens of each rollout, ``|y|``.
    success_B: bool outcome of each rollout.
    group_B: int group (prompt) of each rollout, in ``[0, num_groups)``.
    budget_B: float32 budget of each rollout's prompt
      (:func:`prompt_budgets`), < 0 for none.
  """
  rewards_B = np.asarray(rewards_B, np.float32)
  if not budget_phase(config, step):
    return rewards_B, np.zeros(rewards_B.shape, bool)
  success_B = np.asarray(success_B, bool)
  solved_B = group_mean(success_B.astype(np.float64), group_B,
                        num_groups) > config.accuracy_threshold
  over_B = solved_B & success_B & (budget_B >= 0) & (lengths_B > budget_B)
  return rewards_B - config.penalty * over_B.astype(np.float32), over_B


def update_budgets(config: ToggleConfig, budget_N1: np.ndarray, prompt_B: np.ndarray,
                   lengths_B: np.ndarray, success_B: np.ndarray) -> np.ndarray:
  """``budget_N1`` with a budget for each prompt of the batch that had none
  and has successful rollouts (the percentile of their lengths), and the
  shared budget, once, from all the batch's successful rollouts."""
  budget_N1 = np.array(budget_N1, np.float32)
  for p in np.unique(prompt_B[success_B]):
    if budget_N1[p] < 0:
      budget_N1[p] = np.percentile(lengths_B[success_B & (prompt_B == p)], config.percentile)
  if budget_N1[-1] < 0 and success_B.any():
    budget_N1[-1] = np.percentile(lengths_B[success_B], config.percentile)
  return budget_N1


def tokens_per_success(lengths_B: np.ndarray, success_B: np.ndarray) -> float:
  """Mean policy tokens of the successful rollouts (0 with none)."""
  return float(lengths_B[success_B].mean()) if success_B.any() else 0.0
