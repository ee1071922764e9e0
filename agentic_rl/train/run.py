"""What a run builds once from its config: the codec, the model config, the
mesh, the collector of its task source (:mod:`agentic_rl.train.collectors`)
and the reward hooks; and the held-out evaluation that every stage ends
with.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from agentic_rl import model as model_lib
from agentic_rl.invariants import exploration
from agentic_rl.rollout.engine import prompt_group_size
from agentic_rl.rollout.sampling import SamplingConfig
from agentic_rl.rollout.types import Rollout
from agentic_rl.text import load_codec
from agentic_rl.train import config as config_lib
from agentic_rl.train import reward_hooks, sharding
from agentic_rl.train.collectors import Collector, make_collector
from agentic_rl.train.settings import Settings


@dataclasses.dataclass
class Run:
  """Everything built once from the config; ``cfg`` is the run's
  :class:`~agentic_rl.train.settings.Settings`."""

  cfg: Settings
  codec: Any  # agentic_rl.text.Codec, or a checkpoint's ChatCodec (init_from)
  model_config: model_lib.TransformerConfig
  mesh: Any
  collector: Collector
  hooks: reward_hooks.Hooks = dataclasses.field(default_factory=reward_hooks.Hooks)

  @property
  def tasks(self):
    """The collector's prompts (``difficulty_of(ids)``, ``seeds`` ...)."""
    return self.collector.tasks

  @property
  def family_names(self) -> tuple[str, ...]:
    """The task families, in the order of :meth:`families_of`'s indices: a
    host environment is one family, ``"host"``."""
    return self.collector.family_names

  def families_of(self, split: str, ids) -> np.ndarray:
    """int ``[N]``: the family (index into :attr:`family_names`) of prompts
    ``ids`` of ``split``."""
    return self.collector.families_of(split, ids)

  def prompt_pool(self, families) -> np.ndarray | None:
    """int: the training prompts of the named ``families`` (a stage's
    ``families``), in data order; None (every prompt) when empty."""
    if not families:
      return None
    ids = np.arange(self.cfg.tasks.train_size)
    wanted = [self.family_names.index(f) for f in families]
    return ids[np.isin(self.families_of("train", ids), wanted)]

  def rollout(self, params, sampling: SamplingConfig, split: str, ids: np.ndarray, key,
              version: int, rows: int, temperature: float | None = None,
              weights=None, restart: bool = False, group_size: int | None = None,
              ) -> Rollout:
    """Episodes for prompts ``ids`` (repeats allowed), in calls of ``rows``
    rows; ``temperature`` overrides ``sampling.temperature`` without
    recompiling. Runs of equal ids share their prompt's prefill, in groups
    of at most ``group_size`` rows (None: no limit); 1, or
    ``sampling.share_prefill`` False, runs them on the engine of distinct
    prompts (evaluation's samples: one compiled program fewer). This is the
    one place a batch's group layout for the engine is decided.

    ``weights() -> (params, version)`` (an asynchronous actor's latest
    weights), when given, is asked again every turn's worth of tokens, and
    running episodes continue under newer weights (partial rollouts), or
    with ``restart`` start again under them."""
    parts = []
    group = math.gcd(prompt_group_size(ids), group_size or 0, rows)
    if not self.cfg.sampling.share_prefill:
      group = 1
    for start in range(0, len(ids), rows):
      chunk = ids[start:start + rows]
      ro = self.collector.rows(params, sampling, split, np.resize(chunk, rows),
                               jax.random.fold_in(key, start), version,
                               temperature=temperature, weights=weights, restart=restart,
                               group_size=group)
      parts.append(jax.tree.map(lambda x: np.asarray(x)[:len(chunk)], ro))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)

  def demonstrations(self, params, stage, key) -> dict[str, np.ndarray]:
    """The SFT stage's batch: ``tokens_BxT`` and ``loss_mask_BxT``, ``[N, T]``
    (the collector's: scripted policies for built-in families, each
    environment's ``demonstration(seed)`` for host ones)."""
    return self.collector.demonstrations(params, stage, key)


def build(cfg) -> Run:
  """The run of the experiment config ``cfg`` (a ConfigDict, parsed into
  :class:`~agentic_rl.train.settings.Settings` and validated here: the one
  place the ConfigDict is read)."""
  cfg = config_lib.validate(cfg)
  codec = load_codec(cfg.model.init_from or None)
  model_config = config_lib.model_config(cfg)
  mesh = sharding.make_mesh(cfg.mesh)
  hooks = reward_hooks.make_hooks(cfg, codec, config_lib.model_config)
  return Run(cfg, codec, model_config, mesh, make_collector(cfg, codec, model_config, mesh),
             hooks=hooks)


def evaluate(run: Run, params, key) -> dict[str, float]:
  """Held-out success of the policy on the test split.

  ``eval/success``: greedy decoding on the first ``num_prompts`` test
  prompts; ``eval/pass_at_1`` and ``eval/pass_at_k``: from ``pass_k``
  samples at temperature 1 of each of the first ``pass_k_prompts`` (pass@1
  is their mean success: the sampling policy's, which RL optimises); with
  several task families, each family's ``eval/success/<family>`` and
  ``eval/pass_at_1/<family>``."""
  cfg = run.cfg
  n, k, n_k, rows = (cfg.eval.num_prompts, cfg.eval.pass_k, cfg.eval.pass_k_prompts,
                     cfg.eval.batch_rows)
  greedy = run.rollout(params, config_lib.sampling_config(cfg, greedy=True), "test",
                       np.arange(n), key, 0, rows)
  success = np.asarray(greedy.reward_components["outcome"]) > 0.5
  sampled = run.rollout(params, config_lib.sampling_config(cfg), "test",
                        np.repeat(np.arange(n_k), k), key, 0, rows, group_size=1)
  success_PxK = np.asarray(sampled.reward_components["outcome"]).reshape(n_k, k) > 0.5
  out = {"eval/success": float(success.mean())}
  if len(run.family_names) > 1:  # and each family's share of it
    family = run.families_of("test", np.arange(max(n, n_k)))
    for f, name in enumerate(run.family_names):
      if np.any(family[:n] == f):
        out[f"eval/success/{name}"] = float(success[family[:n] == f].mean())
      if np.any(family[:n_k] == f):
        out[f"eval/pass_at_1/{name}"] = float(success_PxK[family[:n_k] == f].mean())
  out.update({k_: float(v) for k_, v in
              exploration.pass_at_k_metrics(success_PxK, k).items()})
  out.update({f"eval/{k_}": float(np.mean(v)) for k_, v in greedy.info.items()})  # parl/*
  return out
