"""The rollout engine: jitted multi-turn sampling, host-environment loop,
partial rollouts, and the train-inference consistency check."""

from agentic_rl.invariants.shift.monitors import mismatch_metrics
from agentic_rl.rollout.consistency import learner_logprobs
from agentic_rl.rollout.engine import RolloutEngine
from agentic_rl.rollout.gem_adapter import GemEnv
from agentic_rl.rollout.host import HostLoop, TextEnv
from agentic_rl.rollout.sampling import (SamplingConfig, entropy_of,
                                         sample_tokens, sampling_log_probs)
from agentic_rl.rollout.types import Rollout, RolloutState, select_rows, to_groups

__all__ = [
    "GemEnv",
    "HostLoop",
    "Rollout",
    "RolloutEngine",
    "RolloutState",
    "SamplingConfig",
    "TextEnv",
    "entropy_of",
    "learner_logprobs",
    "mismatch_metrics",
    "sample_tokens",
    "sampling_log_probs",
    "select_rows",
    "to_groups",
]
