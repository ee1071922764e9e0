"""Pure-JAX agentic environments: tools, task families, a task mix, task pools
(``Tasks``), scripted reference policies and task datasets (see ``base.py`` for the protocol)."""

from agentic_rl.envs.base import JaxEnv, StepOutput
from agentic_rl.envs.boxes import BoxesEnv, BoxLevel
from agentic_rl.envs.calc_chain import CalcChainEnv, CalcLevel
from agentic_rl.envs.episode import EpisodeState, ToolEnv
from agentic_rl.envs.mixture import MixtureEnv
from agentic_rl.envs.multihop import HopLevel, MultiHopEnv
from agentic_rl.envs.prompts import SYSTEM_PROMPT, prompt_messages
from agentic_rl.envs.registry import ENVS, make_env
from agentic_rl.envs.rewards import RewardConfig
from agentic_rl.envs.scripted import (Trajectory, batch_rollouts, demonstration,
                                      demonstration_batch, demonstrations, episode_returns,
                                      scripted_rollout)
from agentic_rl.envs.tasks import Tasks
