"""Knapsack RL rollout-budget allocation, solved exactly by dynamic programming.

Knapsack RL (Li et al., arXiv 2509.25849) gives prompt i,
with estimated success rate p_i, a budget of N_i rollouts chosen to maximise

    sum_i Value(N_i, p_i),  Value(N, p) = (1 - p^N - (1 - p)^N) * p * (1 - p)^2,

subject to ``sum_i N_i = total`` and ``n_min <= N_i <= n_max``. The first factor
is the probability that a group of N has mixed outcomes (a non-zero GRPO
gradient), the second the expected gain of one step (peaks at p = 1/3).

The DP runs over prompts; the state is the budget spent so far above the
minimum, so it costs O(P * (total - P * n_min) * (n_max - n_min)) numpy work.
"""

from __future__ import annotations

import numpy as np

from agentic_rl.invariants.checks import check_int
from agentic_rl.invariants.signal.config import SignalConfig
from agentic_rl.invariants.signal.history import PromptHistory, success_rates


def knapsack_value(n: np.ndarray | int, p: np.ndarray | float) -> np.ndarray:
  """``Value(N, p) = (1 - p^N - (1 - p)^N) * p * (1 - p)^2`` (float64, broadcast).

  ``Value(1, p) = 0``: one rollout never has mixed outcomes.
  """
  n = np.asarray(n, np.float64)
  p = np.asarray(p, np.float64)
  return (1.0 - p**n - (1.0 - p)**n) * p * (1.0 - p)**2


def allocate_budget(success_rates_P: np.ndarray, total: int, n_min: int, n_max: int) -> np.ndarray:
  """Rollouts per prompt maximising the summed Knapsack value, exactly.

  Args:
    success_rates_P: float ``[P]`` estimated success rates, each in [0, 1].
    total: the total number of rollouts (for example P * G); must satisfy
      ``P * n_min <= total <= P * n_max``.
    n_min, n_max: bounds on each budget, ``1 <= n_min <= n_max``.

  Returns:
    int64 ``[P]`` budgets with ``sum == total`` and every entry in
    ``[n_min, n_max]``. Among equally valued allocations (for example prompts
    with p in {0, 1}, whose value is 0 for any N) the earlier prompts receive
    the larger budgets; the result is deterministic.

  Raises:
    ValueError: on rates outside [0, 1] or not finite, on bad bounds, or when
      ``total`` is infeasible for the bounds.
  """
  p = np.asarray(success_rates_P, np.float64)
  if p.ndim != 1 or p.shape[0] == 0:
    raise ValueError(f"success_rates_P must be a non-empty 1-D array, got shape {p.shape}")
  if not np.all(np.isfinite(p)) or np.any(p < 0.0) or np.any(p > 1.0):
    raise ValueError(f"success rates must be finite and in [0, 1], got {p}")
  check_int("total", total)
  check_int("n_min", n_min, minimum=1)
  check_int("n_max", n_max, minimum=n_min)
  num_prompts = p.shape[0]
  if not num_prompts * n_min <= total <= num_prompts * n_max:
    raise ValueError(f"total={total} is infeasible for {num_prompts} prompts with budgets in "
                     f"[{n_min}, {n_max}]: it must lie in [{num_prompts * n_min}, "
                     f"{num_prompts * n_max}]")

  spare = total - num_prompts * n_min  # budget above the minimum, to distribute
  span = min(n_max - n_min, spare)  # the most any prompt can take above n_min
  extra = np.arange(span + 1)
  values = knapsack_value(n_min + extra[None, :], p[:, None])  # [P, span+1]

  best = np.full(spare + 1, -np.inf)  # best[w]: max value of prompts so far using w extra
  best[0] = 0.0
  choice = np.zeros((num_prompts, spare + 1), np.int64)
  for i in range(num_prompts):
    new_best = np.full(spare + 1, -np.inf)
    for x in range(span + 1):
      candidate = np.full(spare + 1, -np.inf)
      candidate[x:] = best[:spare + 1 - x] + values[i, x]
      better = candidate > new_best  # strict: the smallest x wins a tie
      new_best[better] = candidate[better]
      choice[i, better] = x
    best = new_best

  budgets = np.empty(num_prompts, np.int64)
  w = spare
  for i in range(num_prompts - 1, -1, -1):
    budgets[i] = n_min + choice[i, w]
    w -= choice[i, w]
  assert w == 0 and budgets.sum() == total, (w, budgets)
  return budgets


def knapsack_budgets(config: SignalConfig, history: PromptHistory, prompt_ids: np.ndarray,
                     group_size: int) -> np.ndarray:
  """Budgets for a batch: ``allocate_budget`` on the history's estimates.

  Args:
    config: a ``SignalConfig`` (its prior and Knapsack bounds are used).
    history: a ``PromptHistory``.
    prompt_ids: int ``[P]`` the batch's prompts.
    group_size: G; the total is ``P * G``, the uniform budget.

  Returns:
    int64 ``[P]`` rollouts per prompt.
  """
  config.validate_group_size(group_size)
  rates = success_rates(history, prompt_ids, config.prior_successes, config.prior_failures)
  return allocate_budget(rates, len(rates) * group_size, config.knapsack_n_min,
                         config.knapsack_n_max)
