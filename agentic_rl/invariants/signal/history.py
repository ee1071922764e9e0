"""Per-prompt outcome history and success-rate estimates (host-side numpy).

The Knapsack allocation and prioritised sampling need each prompt's success
rate p_i. ``PromptHistory`` keeps (possibly decayed) success and attempt counts
per dataset index; the estimate is the posterior mean under a Beta(a, b) prior,

    p_i = (successes_i + a) / (attempts_i + a + b),

so unseen prompts get the prior mean a / (a + b) and no estimate is exactly 0
or 1. Every function returns new arrays; a history is never modified in place.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from agentic_rl.invariants.checks import check_float, check_int


@dataclasses.dataclass(frozen=True)
class PromptHistory:
  """Outcome counts per prompt id (dataset index).

  Attributes:
    successes: float64 ``[num_prompts]`` (decayed) number of successes.
    attempts: float64 ``[num_prompts]`` (decayed) number of rollouts.
  """

  successes: np.ndarray
  attempts: np.ndarray

  @property
  def num_prompts(self) -> int:
    return self.successes.shape[0]


def init_history(num_prompts: int) -> PromptHistory:
  """An empty history for a dataset of ``num_prompts`` prompts."""
  check_int("num_prompts", num_prompts, minimum=1)
  return PromptHistory(np.zeros(num_prompts), np.zeros(num_prompts))


def check_prompt_ids(prompt_ids: np.ndarray, num_prompts: int) -> np.ndarray:
  """Returns ``prompt_ids`` as int64 ``[N]``; ValueError if any is out of range."""
  ids = np.asarray(prompt_ids)
  if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"prompt ids must be a 1-D integer array, got {ids.dtype}{ids.shape}")
  if ids.size and (ids.min() < 0 or ids.max() >= num_prompts):
    raise ValueError(f"prompt ids must lie in [0, {num_prompts}), got min {ids.min()} "
                     f"max {ids.max()}")
  return ids.astype(np.int64)


def update_history(history: PromptHistory, prompt_ids: np.ndarray, successes: np.ndarray,
                   attempts: np.ndarray | int = 1, decay: float = 1.0) -> PromptHistory:
  """Adds new outcomes.

  Args:
    history: the current counts.
    prompt_ids: int ``[N]`` prompt of each entry; repeats are summed.
    successes: ``[N]`` successes per entry (a count, or a bool per rollout).
    attempts: ``[N]`` rollouts per entry, or one int for all entries (1: one
      entry per rollout, ``successes`` its bool outcome).
    decay: in (0, 1]; the old counts of every prompt in ``prompt_ids`` are
      multiplied by it (once) before the new ones are added.

  Returns:
    The new history.

  Raises:
    ValueError: on out-of-range ids, mismatched shapes, negative counts or
      more successes than attempts.
  """
  ids = check_prompt_ids(prompt_ids, history.num_prompts)
  wins = np.asarray(successes, np.float64)
  tries = np.broadcast_to(np.asarray(attempts, np.float64), ids.shape)
  if wins.shape != ids.shape:
    raise ValueError(f"successes has shape {wins.shape}, prompt_ids {ids.shape}")
  if np.any(wins < 0) or np.any(wins > tries):
    raise ValueError("successes must lie in [0, attempts]")
  check_float("decay", decay, low=0.0, high=1.0, low_open=True)
  seen = np.unique(ids)
  new_successes = history.successes.copy()
  new_attempts = history.attempts.copy()
  new_successes[seen] *= decay
  new_attempts[seen] *= decay
  np.add.at(new_successes, ids, wins)
  np.add.at(new_attempts, ids, tries)
  return PromptHistory(new_successes, new_attempts)


def success_rates(history: PromptHistory, prompt_ids: np.ndarray | None = None,
                  prior_successes: float = 1.0, prior_failures: float = 1.0) -> np.ndarray:
  """Posterior-mean success rates, float64 ``[N]`` (all prompts when ids is None)."""
  check_float("prior_successes", prior_successes, low=0.0, low_open=True)
  check_float("prior_failures", prior_failures, low=0.0, low_open=True)
  if prompt_ids is None:
    wins, tries = history.successes, history.attempts
  else:
    ids = check_prompt_ids(prompt_ids, history.num_prompts)
    wins, tries = history.successes[ids], history.attempts[ids]
  return (wins + prior_successes) / (tries + prior_successes + prior_failures)
