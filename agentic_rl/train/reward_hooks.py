"""Reward components beyond the environment's rules: a judge model and a
user function (``config.reward_hooks``).

An episode's reward is the environment's (its rule verifiers: ``outcome``,
``format``, ``efficiency``, :mod:`agentic_rl.envs.rewards`) plus weighted
hook components, each logged as ``reward/<name>``::

  r = r_env + w_judge * judge + w_function * function

``judge``: a rubric scored by a frozen judge model, the latest checkpoint of
a run directory of this project (its own architecture, from its
``config.json``; it must share the run's tokenizer). The judge reads the
whole episode as the policy saw it, then the rubric, and gives a verdict:
its next-token distribution restricted to the tokens of ``yes`` and ``no``,
``p = softmax(l_yes, l_no)[0]``. ``samples`` verdicts are drawn from it,
and the component is their mean (``aggregate="mean"``) or their majority
(``"majority"``, 1 when more than half say yes): the majority of k draws
is more often the judge's likelier verdict than one draw is, so a judge
that is right more often than not becomes more reliable (Kimi K2's
rubric rewards; robustness to judge noise). One jitted forward of the
judge over the batch, on the default device.

``function``: ``"MODULE:NAME"``, called as ``NAME(rollout) -> [B]`` floats
with the :class:`~agentic_rl.rollout.types.Rollout` of the batch.

The hooks run on the RL stages' rollouts (:func:`agentic_rl.train.rl.collect`),
not on evaluation, which scores held-out success by the rule outcome.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl import model as model_lib
from agentic_rl.envs import factories
from agentic_rl.rollout.types import Rollout
from agentic_rl.train import checkpoint as checkpoint_lib

AGGREGATES = ("mean", "majority")


@dataclasses.dataclass
class Judge:
  """A loaded judge: its parameters and model config, the rubric's token
  ids and the two verdict token ids ``(yes, no)``."""

  params: Any
  model_config: model_lib.TransformerConfig
  rubric_ids: np.ndarray
  verdict_ids: tuple[int, int]
  weight: float
  samples: int
  aggregate: str


@dataclasses.dataclass
class Hooks:
  """The run's hooks (``None``: off) and the function's weight."""

  judge: Judge | None = None
  function: Callable[[Rollout], Any] | None = None
  function_weight: float = 0.0

  @property
  def enabled(self) -> bool:
    return self.judge is not None or self.function is not None


def load_function(spec: str) -> Callable[[Rollout], Any]:
  """``"MODULE:NAME"``; ValueError saying what failed."""
  return factories.load_callable(spec, "reward_hooks.function.fn")


def make_hooks(cfg, codec, model_config_of) -> Hooks:
  """The hooks of ``cfg.reward_hooks`` (a weight of 0 turns one off);
  ``model_config_of`` is the trainer's ``config.model_config``."""
  hooks = Hooks()
  h = cfg.reward_hooks
  if h is None:
    return hooks
  if h.function.weight:
    hooks.function, hooks.function_weight = load_function(h.function.fn), float(
        h.function.weight)
  j = h.judge
  if j.weight:
    params, config, _ = checkpoint_lib.load_frozen(j.run, model_config_of)
    yes, no = (codec.encode_text(w)[0] for w in ("yes", "no"))
    rubric_ids = codec.encode_text(j.rubric)
    if max(rubric_ids + [yes, no]) >= config.vocab_size:
      raise ValueError(f"reward_hooks.judge.run={j.run!r} has a vocabulary of "
                       f"{config.vocab_size} tokens, fewer than this run's tokenizer; a "
                       "judge must share the run's tokenizer")
    hooks.judge = Judge(params, config,
                        np.asarray(rubric_ids, np.int32), (yes, no),
                        float(j.weight), int(j.samples), j.aggregate)
  return hooks


def judge_inputs(ro: Rollout, rubric_ids: np.ndarray, pad_id: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
  """``(tokens_BxL, last_B)``: each episode's valid tokens, then the
  rubric, right-padded (``L = T + R``); ``last_B`` the position of the
  rubric's last token, whose next-token distribution is the verdict."""
  tokens_BxT, length_B = np.asarray(ro.tokens_BxT), np.asarray(ro.length_B)
  B, T = tokens_BxT.shape
  R = len(rubric_ids)
  out_BxL = np.full((B, T + R), pad_id, np.int32)
  for b in range(B):
    n = int(length_B[b])
    out_BxL[b, :n] = tokens_BxT[b, :n]
    out_BxL[b, n:n + R] = rubric_ids
  return out_BxL, length_B.astype(np.int32) + R - 1


@functools.partial(jax.jit, static_argnums=(0,))
def yes_probability(model_config, params, tokens_BxL: jax.Array, last_B: jax.Array,
                    verdict_ids: jax.Array) -> jax.Array:
  """float32 ``[B]``: ``p = softmax(l_yes, l_no)[0]`` at position ``last_B``."""
  logits_BxLxV = model_lib.forward(params, tokens_BxL, model_config)
  logits_BxV = jnp.take_along_axis(logits_BxLxV, last_B[:, None, None], axis=1)[:, 0]
  return jax.nn.softmax(logits_BxV[:, verdict_ids].astype(jnp.float32), axis=-1)[:, 0]


def aggregate_verdicts(p_B: jax.Array, key, samples: int, aggregate: str) -> jax.Array:
  """float32 ``[B]``: ``samples`` verdicts per row drawn with probability
  ``p_B`` of yes, and their mean or majority (ties say no)."""
  yes_BxK = jax.random.bernoulli(key, p_B[:, None], (p_B.shape[0], samples))
  frac_B = jnp.mean(yes_BxK.astype(jnp.float32), axis=-1)
  return frac_B if aggregate == "mean" else (frac_B > 0.5).astype(jnp.float32)


def apply(hooks: Hooks, ro: Rollout, key) -> Rollout:
  """``ro`` with the hook components added to ``reward_components`` and,
  weighted, to ``reward_B``."""
  if not hooks.enabled:
    return ro
  components = dict(ro.reward_components)
  reward_B = np.asarray(ro.reward_B, np.float32).copy()
  if hooks.judge is not None:
    j = hooks.judge
    tokens_BxL, last_B = judge_inputs(ro, j.rubric_ids)
    if tokens_BxL.max() >= j.model_config.vocab_size:
      raise ValueError(f"an episode holds token {tokens_BxL.max()}, outside the judge's "
                       f"vocabulary of {j.model_config.vocab_size}: a judge must share the "
                       "run's tokenizer")
    p_B = yes_probability(j.model_config, j.params, jnp.asarray(tokens_BxL),
                          jnp.asarray(last_B), jnp.asarray(j.verdict_ids))
    score_B = np.asarray(aggregate_verdicts(p_B, key, j.samples, j.aggregate), np.float32)
    components["judge"] = score_B
    reward_B += j.weight * score_B
  if hooks.function is not None:
    value_B = np.asarray(hooks.function(ro), np.float32)
    if value_B.shape != reward_B.shape or not np.all(np.isfinite(value_B)):
      raise ValueError(f"reward_hooks.function returned {value_B.shape} values (finite: "
                       f"{bool(np.all(np.isfinite(value_B)))}); it must return {reward_B.shape} "
                       "finite floats, one per episode")
    components["function"] = value_B
    reward_B += hooks.function_weight * value_B
  return ro.replace(reward_B=reward_B, reward_components=components)
