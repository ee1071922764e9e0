"""Which prompts a batch draws: prioritised and curriculum sampling (host-side).

- Prioritised sampling (Kimi k1.5, arXiv 2501.12599, §2.3.4): prompt i is
  drawn with probability proportional to ``1 - s_i``, s_i its estimated
  success rate (``history.success_rates``), so solved prompts fade out.
- Curriculum: a piecewise-constant difficulty schedule; at step t only prompts
  whose difficulty lies in the active stage's ``[min, max]`` are eligible
  (k1.5: uniform first, then hard problems only; GLM-4.5, arXiv 2508.06471:
  two stages).

Draws are without replacement and deterministic given the PRNG key.
"""

from __future__ import annotations

import jax
import numpy as np

from agentic_rl.invariants.checks import check_int
from agentic_rl.invariants.rng import host_rng
from agentic_rl.invariants.signal.config import SignalConfig
from agentic_rl.invariants.signal.history import PromptHistory, success_rates


def curriculum_range(curriculum: tuple[tuple[int, int, int], ...], step: int) -> tuple[int, int] | None:
  """``(min_difficulty, max_difficulty)`` of the stage active at ``step``, or None."""
  check_int("step", step, minimum=0)
  active = None
  for start, lo, hi in curriculum:
    if start <= step:
      active = (lo, hi)
  return active


def prompt_probabilities(config: SignalConfig, history: PromptHistory, step: int = 0,
                         difficulty_N: np.ndarray | None = None) -> np.ndarray:
  """Sampling probability of every prompt, float64 ``[num_prompts]`` summing to 1.

  Args:
    config: ``prompt_sampling``, ``curriculum`` and the prior are used.
    history: success counts per prompt.
    step: the training step (selects the curriculum stage).
    difficulty_N: int ``[num_prompts]`` difficulty label of every prompt;
      required when ``config.curriculum`` is set.

  Raises:
    ValueError: when the curriculum leaves no eligible prompt, or a difficulty
      array is missing or mis-shaped.
  """
  if config.prompt_sampling == "prioritised":
    weights = 1.0 - success_rates(history, None, config.prior_successes, config.prior_failures)
  else:
    weights = np.ones(history.num_prompts)
  stage = curriculum_range(config.curriculum, step)
  if stage is not None:
    if difficulty_N is None:
      raise ValueError("a curriculum needs the prompts' difficulty labels (difficulty_N)")
    difficulty = np.asarray(difficulty_N)
    if difficulty.shape != (history.num_prompts,):
      raise ValueError(f"difficulty_N must have shape ({history.num_prompts},), got {difficulty.shape}")
    weights = weights * ((difficulty >= stage[0]) & (difficulty <= stage[1]))
  total = weights.sum()
  if not total > 0:
    raise ValueError(f"no prompt is eligible at step {step} (curriculum stage {stage})")
  return weights / total


def select_prompts(config: SignalConfig, history: PromptHistory, num: int, key: jax.Array,
                   step: int = 0, difficulty_N: np.ndarray | None = None) -> np.ndarray:
  """Draws ``num`` distinct prompt ids, int64 ``[num]``, by ``prompt_probabilities``.

  Raises:
    ValueError: when fewer than ``num`` prompts have non-zero probability.
  """
  check_int("num", num, minimum=1)
  probs = prompt_probabilities(config, history, step, difficulty_N)
  eligible = int(np.count_nonzero(probs))
  if num > eligible:
    raise ValueError(f"cannot draw {num} distinct prompts: only {eligible} are eligible at step {step}")
  return host_rng(key).choice(history.num_prompts, size=num, replace=False, p=probs).astype(np.int64)
