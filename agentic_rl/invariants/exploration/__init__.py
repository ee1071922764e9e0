"""Invariant I1, exploration: strategy-level monitors and the controllers that act on them.

- ``monitors``: token entropy, distinct (successful) tool-call sequences per
  group, tool-call n-gram entropy, pairwise edit distance, pass@k;
- ``controllers``: the adaptive entropy-bonus coefficient and the temperature
  schedule.

Loss-side controls (clip-higher, Clip-Cov / KL-Cov, the pass@k advantage) are
in ``agentic_rl.objectives``. Switches live in ``ExplorationConfig``.
"""

from agentic_rl.invariants.exploration.config import ExplorationConfig
from agentic_rl.invariants.exploration.controllers import (EntropyCoefState, init_entropy_coef,
                                                           temperature_at, update_entropy_coef)
from agentic_rl.invariants.exploration.monitors import (compact_calls, distinct_sequences,
                                                        exploration_metrics,
                                                        ngram_entropy, pairwise_edit_distance,
                                                        pass_at_k, pass_at_k_metrics,
                                                        token_entropy_mean)

__all__ = [
    "EntropyCoefState", "ExplorationConfig", "compact_calls", "distinct_sequences", "exploration_metrics",
    "init_entropy_coef", "ngram_entropy", "pairwise_edit_distance", "pass_at_k",
    "pass_at_k_metrics", "temperature_at", "token_entropy_mean", "update_entropy_coef",
]
