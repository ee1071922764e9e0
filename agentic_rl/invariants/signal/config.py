"""``SignalConfig``: the switches of the non-degenerate-signal controllers (I2).

Every controller defaults to off, so a run with ``SignalConfig()`` is the plain
uniform-allocation baseline of the ablations.
"""

from __future__ import annotations

import dataclasses

from agentic_rl.invariants.alarms import Band, validate_bands
from agentic_rl.invariants.checks import check_choice, check_float, check_int

ALLOCATIONS = ("uniform", "dynamic", "knapsack", "ada")
PROMPT_SAMPLINGS = ("uniform", "prioritised")
TRUNCATIONS = ("keep", "mask", "penalty")


@dataclasses.dataclass(frozen=True)
class SignalConfig:
  """How rollouts are allocated to prompts and how degenerate samples are treated.

  Attributes:
    allocation: ``uniform`` (G rollouts per prompt), ``dynamic`` (DAPO: drop
      groups whose binary outcomes are all equal and refill), ``knapsack``
      (Knapsack RL budgets, ragged groups) or ``ada`` (Reinforce-Ada rounds).
    max_extra_rollout_frac: dynamic sampling cap: at most
      ``floor(frac * P * G)`` rollouts beyond the batch.
    knapsack_n_min, knapsack_n_max: bounds on a prompt's Knapsack budget.
    ada_round_size: rollouts per active prompt per Reinforce-Ada round; None
      means the group size. Must be at least the group size.
    ada_max_rounds: rounds before a prompt is given up on.
    ada_min_pos, ada_min_neg: a prompt leaves the rounds once it has this many
      successes and failures (1, 1: "mixed"; G/2, G/2: Reinforce-Ada-balance);
      the down-sampled group keeps at least this many of each when available.
    ada_global_stats: Reinforce-Ada's global statistics: the advantage's group
      mean (and std) run over every rollout generated for the prompt, kept or
      not; False uses the down-sampling only (statistics of the kept group).
    prior_successes, prior_failures: Beta prior of a prompt's success rate,
      which is also the estimate for unseen prompts (posterior mean).
    history_decay: in (0, 1]; a prompt's past counts are multiplied by this each
      time new outcomes for it arrive (1 keeps all history).
    prompt_sampling: ``uniform``, or ``prioritised`` (Kimi k1.5: probability
      proportional to ``1 - success_rate``).
    curriculum: difficulty schedule, ``((start_step, min_difficulty,
      max_difficulty), ...)`` with increasing start steps, the first at 0; only
      prompts whose difficulty lies in the active stage's range are drawn.
      Empty: no curriculum.
    truncation: what happens to truncated (over-long) responses: ``keep``,
      ``mask`` (DAPO overlong filtering: weight 0 in the loss) or ``penalty``
      (DAPO soft overlong punishment added to the reward).
    overlong_max_len, overlong_cache_len: DAPO's L_max and L_cache for the
      soft punishment (None: only truncated responses are punished).
    overlong_penalty_coef: weight of the punishment in the reward.
    bands: alarm bands, ``(("signal/...", Band), ...)``.
  """

  allocation: str = "uniform"
  max_extra_rollout_frac: float = 2.0
  knapsack_n_min: int = 2
  knapsack_n_max: int = 64
  ada_round_size: int | None = None
  ada_max_rounds: int = 4
  ada_min_pos: int = 1
  ada_min_neg: int = 1
  ada_global_stats: bool = True
  prior_successes: float = 1.0
  prior_failures: float = 1.0
  history_decay: float = 1.0
  prompt_sampling: str = "uniform"
  curriculum: tuple[tuple[int, int, int], ...] = ()
  truncation: str = "keep"
  overlong_max_len: int | None = None
  overlong_cache_len: int = 0
  overlong_penalty_coef: float = 1.0
  bands: tuple[tuple[str, Band], ...] = (("signal/zero_variance_frac", Band(high=0.5)),)

  def __post_init__(self):
    check_choice("allocation", self.allocation, ALLOCATIONS)
    check_float("max_extra_rollout_frac", self.max_extra_rollout_frac, low=0.0)
    check_int("knapsack_n_min", self.knapsack_n_min, minimum=1)
    check_int("knapsack_n_max", self.knapsack_n_max, minimum=self.knapsack_n_min)
    if self.ada_round_size is not None:
      check_int("ada_round_size", self.ada_round_size, minimum=1)
    check_int("ada_max_rounds", self.ada_max_rounds, minimum=1)
    check_int("ada_min_pos", self.ada_min_pos, minimum=0)
    check_int("ada_min_neg", self.ada_min_neg, minimum=0)
    check_float("prior_successes", self.prior_successes, low=0.0, low_open=True)
    check_float("prior_failures", self.prior_failures, low=0.0, low_open=True)
    check_float("history_decay", self.history_decay, low=0.0, high=1.0, low_open=True)
    check_choice("prompt_sampling", self.prompt_sampling, PROMPT_SAMPLINGS)
    _check_curriculum(self.curriculum)
    check_choice("truncation", self.truncation, TRUNCATIONS)
    if self.overlong_max_len is not None:
      check_int("overlong_max_len", self.overlong_max_len, minimum=1)
      check_int("overlong_cache_len", self.overlong_cache_len, minimum=0)
      if self.overlong_cache_len > self.overlong_max_len:
        raise ValueError(f"overlong_cache_len={self.overlong_cache_len} exceeds "
                         f"overlong_max_len={self.overlong_max_len}")
    elif self.overlong_cache_len != 0:
      raise ValueError("overlong_cache_len needs overlong_max_len")
    check_float("overlong_penalty_coef", self.overlong_penalty_coef, low=0.0)
    validate_bands(self.bands, "signal")

  def validate_group_size(self, group_size: int) -> None:
    """Checks the settings that depend on the trainer's group size G."""
    check_int("group_size", group_size, minimum=1)
    if self.allocation == "ada":
      if self.ada_round_size is not None and self.ada_round_size < group_size:
        raise ValueError(f"ada_round_size={self.ada_round_size} is below the group size {group_size}")
      if self.ada_min_pos + self.ada_min_neg > group_size:
        raise ValueError(f"ada_min_pos + ada_min_neg = {self.ada_min_pos + self.ada_min_neg} "
                         f"exceeds the group size {group_size}")
    if self.allocation == "knapsack" and not (
        self.knapsack_n_min <= group_size <= self.knapsack_n_max):
      raise ValueError(f"group size {group_size} is outside [knapsack_n_min, knapsack_n_max] = "
                       f"[{self.knapsack_n_min}, {self.knapsack_n_max}]: the uniform budget "
                       "must be feasible")


def _check_curriculum(curriculum) -> None:
  if not isinstance(curriculum, tuple):
    raise ValueError(f"curriculum must be a tuple of (start_step, min_difficulty, "
                     f"max_difficulty), got {type(curriculum).__name__}")
  previous = -1
  for i, stage in enumerate(curriculum):
    if (not isinstance(stage, tuple) or len(stage) != 3
        or any(isinstance(v, bool) or not isinstance(v, int) for v in stage)):
      raise ValueError(f"curriculum[{i}]={stage!r} is not (start_step, min_difficulty, "
                       "max_difficulty) ints")
    start, lo, hi = stage
    if i == 0 and start != 0:
      raise ValueError(f"curriculum must start at step 0, got {start}")
    if start <= previous:
      raise ValueError(f"curriculum start steps must increase, got {start} after {previous}")
    if lo > hi:
      raise ValueError(f"curriculum[{i}] has min_difficulty {lo} > max_difficulty {hi}")
    previous = start
