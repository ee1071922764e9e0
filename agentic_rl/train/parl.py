"""PARL in the trainer: an orchestrator trained with frozen sub-agents
(``config.parl``; :mod:`agentic_rl.rollout.swarm`, :mod:`agentic_rl.envs.
swarm`).

``parl.agents`` names the sub-agents: ``{name: run directory}``, each the
latest checkpoint of a run of this project (its own architecture and
sampling limits, from its ``config.json``; this run's tokenizer), played
greedily. The orchestrator is the run's host environment's policy; a step
of it returning a ``Spawn`` runs sub-agents, whose episodes are
observations, never trained.

Reward (Kimi K2.5, ``r = r_perf + l1 * r_parallel + l2 * r_finish``):

* ``charge``: the steps the efficiency reward's ``calls`` part counts:
  ``"critical"`` (``sum_t (1 + max_i sub-steps)``, the latency of the
  episode) or ``"total"`` (every step of the orchestrator and of its
  sub-agents: the compute).
* ``parallel_bonus`` (``l1``) times ``r_parallel = parallel_width /
  max_width`` (against serial collapse) and ``finish_bonus`` (``l2``) times
  ``r_finish``, the share of the episode's sub-episodes that ended done
  (against spawning without decomposing), annealed linearly to 0 over
  ``anneal_iterations`` RL iterations (0: not annealed).
* ``max_critical_steps``: an episode reaching it is truncated (0: none).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np

from agentic_rl.envs import prompts
from agentic_rl.rollout.swarm import SubAgent, Swarm
from agentic_rl.rollout.types import Rollout
from agentic_rl.train import checkpoint as checkpoint_lib

CHARGES = ("critical", "total")


def agents_of(value) -> dict[str, str]:
  """``config.parl.agents``: a mapping, or a JSON object as a string (for the
  command line: ``--config.parl.agents='{"hop": "/runs/hop"}'``)."""
  if isinstance(value, str):
    try:
      value = json.loads(value) if value.strip() else {}
    except json.JSONDecodeError as e:
      raise ValueError(f"config.parl.agents is not a JSON object ({e}): write "
                       "'{\"NAME\": \"RUN_DIR\"}'") from None
  if not isinstance(value, Mapping) or not all(
      isinstance(k, str) and k and isinstance(v, str) for k, v in value.items()):
    raise ValueError(f"config.parl.agents must map names to run directories, got {value!r}")
  return dict(value)


def enabled(cfg) -> bool:
  return cfg.parl is not None and bool(agents_of(cfg.parl.agents))


def make_swarm(cfg, codec, model_config_of, sampling_config_of) -> Swarm | None:
  """The sub-agents of ``cfg.parl`` (None when it names none);
  ``model_config_of`` and ``sampling_config_of`` are the trainer's
  ``config.model_config`` and ``config.sampling_config``."""
  if not enabled(cfg):
    return None
  p, agents = cfg.parl, {}
  for name, run_dir in agents_of(p.agents).items():
    params, model_config, sub_cfg = checkpoint_lib.load_frozen(run_dir, model_config_of)
    if codec.tokenizer.vocab_size > model_config.vocab_size:
      raise ValueError(f"config.parl.agents.{name}={run_dir!r} has a vocabulary of "
                       f"{model_config.vocab_size} tokens, fewer than this run's tokenizer; a "
                       "sub-agent must share the run's tokenizer")
    host = sub_cfg.tasks.source == "host"
    agents[name] = SubAgent(
        params, model_config, sampling_config_of(sub_cfg, greedy=True),
        source="host" if host else "jax",
        system_prompt=None if host else prompts.SYSTEM_PROMPT,
        host_kwargs=dict(max_obs_tokens=sub_cfg.tasks.max_obs_tokens,
                         obs_overflow=sub_cfg.tasks.obs_overflow) if host else {})
  return Swarm(agents, codec, rows=p.rows, max_width=p.max_width,
               max_critical_steps=p.max_critical_steps)


def charged_steps(cfg, ro: Rollout) -> np.ndarray:
  """``[B]``: what the efficiency reward's ``calls`` part counts: the tool
  calls, or with sub-agents the episode's critical or total steps."""
  if not enabled(cfg) or not ro.info:
    return np.asarray(ro.num_tool_calls_B)
  return np.asarray(ro.info[f"parl/{cfg.parl.charge}_steps"])


def with_bonus(cfg, ro: Rollout, step: int) -> Rollout:
  """``ro`` with ``l1 * r_parallel + l2 * r_finish`` at RL iteration
  ``step`` (annealed; module docstring) added to ``reward_B`` and reported
  as the component ``parl_bonus``; unchanged without sub-agents or
  bonuses."""
  if not enabled(cfg) or not ro.info or not (cfg.parl.parallel_bonus or cfg.parl.finish_bonus):
    return ro
  p = cfg.parl
  scale = 1.0 if not p.anneal_iterations else max(0.0, 1.0 - step / p.anneal_iterations)
  r_parallel = np.asarray(ro.info["parl/parallel_width"]) / p.max_width
  r_finish = np.asarray(ro.info["parl/finished"])
  bonus_B = (scale * (p.parallel_bonus * r_parallel + p.finish_bonus * r_finish)).astype(
      np.float32)
  return ro.replace(reward_B=np.asarray(ro.reward_B, np.float32) + bonus_B,
                    reward_components={**ro.reward_components, "parl_bonus": bonus_B})


def validate(cfg, err) -> None:
  """``config.parl``; ``err(message)`` raises."""
  p = cfg.parl
  if p is None:
    return
  try:
    agents = agents_of(p.agents)
  except ValueError as e:
    err(str(e))
  if not agents:
    return
  if cfg.tasks.source != "host":
    err("config.parl.agents: the orchestrator is a host environment whose step returns a "
        "Spawn (agentic_rl.envs.swarm); set --config.tasks.source=host and "
        "--config.tasks.host_env (e.g. parallel_hops)")
  for name, run_dir in agents.items():
    if not checkpoint_lib.is_run_dir(run_dir):
      err(f"config.parl.agents.{name}={run_dir!r} is not a run directory of this project "
          "(WORKDIR with checkpoints/ and config.json); train one with experiments.train")
  for key in ("rows", "max_width"):
    if not isinstance(getattr(p, key), int) or getattr(p, key) < 1:
      err(f"config.parl.{key} must be an int >= 1, got {getattr(p, key)!r}")
  for key in ("max_critical_steps", "anneal_iterations"):
    if not isinstance(getattr(p, key), int) or getattr(p, key) < 0:
      err(f"config.parl.{key} must be an int >= 0, got {getattr(p, key)!r}")
  if p.charge not in CHARGES:
    err(f"config.parl.charge is {p.charge!r}; valid: {', '.join(CHARGES)}")
  for key in ("parallel_bonus", "finish_bonus"):
    if not isinstance(getattr(p, key), (int, float)) or not np.isfinite(getattr(p, key)) or getattr(p, key) < 0:
      err(f"config.parl.{key} must be a finite weight >= 0, got {getattr(p, key)!r}")
