"""The rollout engine: jitted multi-turn sampling, host-environment loop,
partial rollouts, and the train-inference consistency check."""

from agentic_rl.rollout.consistency import learner_logprobs
from agentic_rl.rollout.context import ContextConfig, scored_rows
from agentic_rl.rollout.engine import RolloutEngine
from agentic_rl.envs.gem import GemEnv
from agentic_rl.rollout.host_loop import Episode, HostLoop, TextEnv
from agentic_rl.rollout.sampling import (SamplingConfig, entropy_of,
                                         sample_tokens, sampling_log_probs)
from agentic_rl.rollout.types import (EPISODE_STATUS, FAILED_STATUS, Rollout, RolloutState,
                                      Segments, select_rows)
from agentic_rl.rollout.workers import EnvWorkers, Outcome

__all__ = [
    "ContextConfig",
    "EPISODE_STATUS",
    "EnvWorkers",
    "Episode",
    "FAILED_STATUS",
    "GemEnv",
    "HostLoop",
    "Outcome",
    "Rollout",
    "RolloutEngine",
    "RolloutState",
    "SamplingConfig",
    "Segments",
    "TextEnv",
    "entropy_of",
    "learner_logprobs",
    "sample_tokens",
    "sampling_log_probs",
    "scored_rows",
    "select_rows",
]
