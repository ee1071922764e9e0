"""Objectives: advantage estimators, policy losses, corrections, aggregation, optimisers.

Pure array math over per-token ``[B, T]`` arrays and per-prompt rewards
``[P, G]``; selectable by name from an :class:`ObjectiveConfig`. See
``docs/objectives.md`` for the table of formulas, defaults and sources.
"""

from agentic_rl.objectives._checks import UnknownHyperParameterError
from agentic_rl.objectives.advantages import (
    ADVANTAGE_ESTIMATORS,
    GLOBAL_STATS_ESTIMATORS,
    broadcast_turn_advantages,
    get_advantage_fn,
)
from agentic_rl.objectives.aggregation import (
    AGG_MODES,
    aggregate,
    batch_normalisers,
    masked_max,
    masked_mean,
)
from agentic_rl.objectives.config import (
    INPUTS,
    ObjectiveConfig,
    OptimizerConfig,
    hyperparameter_defaults,
    make_advantage_fn,
    make_policy_loss,
    required_inputs,
    validate_objective_config,
    validate_optimizer_config,
)
from agentic_rl.objectives import distill, toggle
from agentic_rl.objectives.groups import (GroupLayout, group_advantages, turn_advantages,
                                         turn_states)
from agentic_rl.objectives.corrections import CORRECTIONS, IS_LEVELS, get_correction
from agentic_rl.objectives.losses import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    get_policy_loss,
    kl_penalty,
    policy_loss,
)
from agentic_rl.objectives.optim import (
    begin_iteration,
    make_optimizer,
    make_schedule,
    reset_optimizer_state,
)

__all__ = [
    "distill",
    "toggle",
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "CORRECTIONS",
    "GLOBAL_STATS_ESTIMATORS",
    "GroupLayout",
    "INPUTS",
    "IS_LEVELS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "ObjectiveConfig",
    "OptimizerConfig",
    "UnknownHyperParameterError",
    "aggregate",
    "batch_normalisers",
    "begin_iteration",
    "broadcast_turn_advantages",
    "get_advantage_fn",
    "get_correction",
    "get_policy_loss",
    "group_advantages",
    "hyperparameter_defaults",
    "kl_penalty",
    "make_advantage_fn",
    "make_optimizer",
    "make_policy_loss",
    "make_schedule",
    "masked_max",
    "masked_mean",
    "policy_loss",
    "required_inputs",
    "reset_optimizer_state",
    "turn_advantages",
    "turn_states",
    "validate_objective_config",
    "validate_optimizer_config",
]
