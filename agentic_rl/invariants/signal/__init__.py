"""Invariant I2, a non-degenerate learning signal: monitors and controllers.

Groups whose rollouts all pass or all fail give no gradient. This package
measures that (``monitors``) and pulls it back:

- ``sampling``: the rollout allocators (uniform, DAPO dynamic sampling,
  Reinforce-Ada adaptive rounds, Knapsack budgets) behind ``allocate_rollouts``;
- ``knapsack``: Knapsack RL per-prompt rollout budgets (exact DP);
- ``prompts`` + ``history``: prioritised (1 - success rate) and curriculum
  prompt selection from per-prompt outcome history;
- ``truncation``: masking or punishing truncated responses.

Switches live in ``SignalConfig``; everything defaults to off.
"""

from agentic_rl.invariants.signal.config import SignalConfig
from agentic_rl.invariants.signal.history import (PromptHistory, init_history, success_rates,
                                                  update_history)
from agentic_rl.invariants.signal.knapsack import allocate_budget, knapsack_budgets, knapsack_value
from agentic_rl.invariants.signal.monitors import (group_outcome_counts, signal_metrics,
                                                   zero_variance_frac)
from agentic_rl.invariants.signal.prompts import (curriculum_range, prompt_probabilities,
                                                  select_prompts)
from agentic_rl.invariants.signal.sampling import (SampledBatch, adaptive_sampling,
                                                   allocate_rollouts, dynamic_sampling,
                                                   uniform_sampling)
from agentic_rl.invariants.signal.truncation import overlong_penalty, shape_truncated

__all__ = [
    "PromptHistory", "SampledBatch", "SignalConfig", "adaptive_sampling", "allocate_budget",
    "allocate_rollouts",
    "curriculum_range", "dynamic_sampling", "group_outcome_counts", "init_history",
    "knapsack_budgets", "knapsack_value", "overlong_penalty", "prompt_probabilities",
    "select_prompts", "shape_truncated", "signal_metrics", "success_rates", "update_history",
    "uniform_sampling", "zero_variance_frac",
]
