"""What a run builds once from its config: the codec, the task environment and
its pools, the model config, the mesh and the compiled rollout engines; and
the held-out evaluation that every stage ends with."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from agentic_rl import envs as envs_lib
from agentic_rl import model as model_lib
from agentic_rl.envs.tasks import Tasks
from agentic_rl.invariants import exploration
from agentic_rl.rollout.engine import RolloutEngine
from agentic_rl.rollout.sampling import SamplingConfig
from agentic_rl.rollout.types import Rollout
from agentic_rl.text import codec as codec_lib
from agentic_rl.text import load_tokenizer
from agentic_rl.train import config as config_lib
from agentic_rl.train import sharding


@dataclasses.dataclass
class Run:
  """Everything built once from the config."""

  cfg: Any
  codec: codec_lib.Codec
  env: Any
  tasks: Tasks
  model_config: model_lib.TransformerConfig
  mesh: Any
  engines: dict = dataclasses.field(default_factory=dict)

  def engine(self, sampling: SamplingConfig, rows: int) -> RolloutEngine:
    """One compiled engine per (sampling settings, batch rows), shared by
    the RL stages and evaluation. Rows are episodes (group size 1): groups
    are made by repeating prompts. On a single-process mesh with several
    batch shards the rows are split over them (a data-parallel rollout)
    when they divide evenly."""
    key = (sampling, rows)
    if key not in self.engines:
      shards = sharding.batch_shards(self.mesh)
      split = jax.process_count() == 1 and shards > 1 and rows % shards == 0
      self.engines[key] = RolloutEngine(
          self.model_config, sampling, self.codec.ids, env=self.env, batch_size=rows,
          row_sharding=sharding.batch_sharding(self.mesh) if split else None)
    return self.engines[key]

  def rollout(self, params, sampling: SamplingConfig, split: str, ids: np.ndarray, key,
              version: int, rows: int, temperature: float | None = None) -> Rollout:
    """Episodes for prompts ``ids`` (repeats allowed), in fixed-size calls;
    ``temperature`` overrides ``sampling.temperature`` without recompiling."""
    engine = self.engine(sampling, rows)
    parts = []
    for start in range(0, len(ids), rows):
      chunk = ids[start:start + rows]
      inst = self.tasks.instances(split, np.resize(chunk, rows))
      prompts, lens = self.tasks.prompts(inst)
      ro = engine.rollout(params, prompts, lens, inst, jax.random.fold_in(key, start), version,
                          temperature=temperature)
      parts.append(jax.tree.map(lambda x: np.asarray(x)[:len(chunk)], ro))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def build(cfg) -> Run:
  config_lib.validate(cfg)
  codec = codec_lib.Codec(load_tokenizer())
  env = envs_lib.make_env(
      "mixture", codec, members=tuple(cfg.tasks.families),
      weights=tuple(cfg.tasks.weights),
      rewards=envs_lib.RewardConfig(**cfg.tasks.rewards))
  model_config = config_lib.model_config(cfg, codec.tokenizer.vocab_size)
  mesh = sharding.make_mesh(sharding.MeshConfig(**cfg.mesh))
  tasks = Tasks(env, seed=cfg.seed, difficulty=cfg.tasks.difficulty,
                prompt_len=cfg.sampling.max_total_tokens // 2)
  return Run(cfg, codec, env, tasks, model_config, mesh)


def evaluate(run: Run, params, key) -> dict[str, float]:
  """Greedy success on ``num_prompts`` held-out test prompts, and pass@k from
  ``pass_k`` samples (temperature 1) on the first ``pass_k_prompts``."""
  cfg = run.cfg
  n, k, n_k, rows = (cfg.eval.num_prompts, cfg.eval.pass_k, cfg.eval.pass_k_prompts,
                     cfg.eval.batch_rows)
  greedy = run.rollout(params, config_lib.sampling_config(cfg, greedy=True), "test",
                       np.arange(n), key, 0, rows)
  success = np.asarray(greedy.reward_components["outcome"]) > 0.5
  sampled = run.rollout(params, config_lib.sampling_config(cfg), "test",
                        np.repeat(np.arange(n_k), k), key, 0, rows)
  success_PxK = np.asarray(sampled.reward_components["outcome"]).reshape(n_k, k) > 0.5
  out = {"eval/success": float(success.mean())}
  out.update({k_: float(v) for k_, v in
              exploration.pass_at_k_metrics(success_PxK, k).items()})
  return out
