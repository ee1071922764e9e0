"""The policy filter of task synthesis (:mod:`agentic_rl.envs.synthesis`):
the greedy success of a run's latest checkpoint on candidate programs."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.envs import tasks as tasks_lib
from agentic_rl.envs.composed import ComposedEnv
from agentic_rl.rollout.engine import RolloutEngine
from agentic_rl.text import load_codec
from agentic_rl.train import checkpoint as checkpoint_lib
from agentic_rl.train import config as config_lib


def policy_success(run_dir: str, programs: Sequence[tuple[str, ...]], *, samples: int,
                   seed: int = 0, rows: int = 64) -> np.ndarray:
  """float ``[C]``: the greedy success of the policy of the run in
  ``run_dir`` (its architecture and sampling limits) on ``samples``
  instances of each program, ``rows`` episodes per engine call."""
  params, model_config, cfg = checkpoint_lib.load_frozen(run_dir, config_lib.model_config)
  codec = load_codec(None)
  env = ComposedEnv(codec, programs=programs)
  sampling = config_lib.sampling_config(cfg, greedy=True)
  engine = RolloutEngine(model_config, sampling, codec.ids, env=env, batch_size=rows)
  C = len(programs)
  program_N = np.repeat(np.arange(C), samples)
  keys = jax.random.split(jax.random.key(seed + 1), C * samples)
  instances = jax.jit(jax.vmap(env.instance_of))(keys, jnp.asarray(program_N))
  success = []
  for start in range(0, C * samples, rows):
    rows_R = np.resize(np.arange(start, min(start + rows, C * samples)), rows)
    chunk = jax.tree.map(lambda x: np.asarray(x)[rows_R], instances)
    prompts, lens = tasks_lib.encode_prompts(env, chunk, sampling.max_total_tokens // 2)
    ro = engine.rollout(params, prompts, lens, chunk, jax.random.key(start), 0)
    n = min(rows, C * samples - start)
    success.append(np.asarray(ro.reward_components["outcome"])[:n] > 0.5)
  return np.concatenate(success).reshape(C, samples).mean(axis=1)
