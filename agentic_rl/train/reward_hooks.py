"""Reward components beyond the environment's rules: a judge model and a
user function (``config.reward_hooks``).

An episode's reward is the environment's (its rule verifiers: ``outcome``,
``format``, ``efficiency``, :mod:`agentic_rl.envs.rewards`) plus weighted
hook components, each logged as ``reward/<name>``::

  r = r_env + w_judge * judge + w_function * function

``judge``: a rubric scored by a frozen judge model: the latest checkpoint
of a run directory of this project, a Hugging Face model directory or a
GGUF file, with its own tokenizer and chat template. Each episode is
decoded to text by the policy's tokenizer (its chat markup included), and
the judge reads it, then the rubric, as one user message rendered by the
judge's own chat template, up to where its answer starts. Its verdict is
its next-token distribution restricted to the first tokens of ``yes`` and
``Yes`` against those of ``no`` and ``No``: ``p(yes) = sum softmax(l_yes) /
(sum softmax(l_yes) + sum softmax(l_no))``. ``samples`` verdicts are drawn
from it, and the component is their mean (``aggregate="mean"``) or their
majority (``"majority"``, 1 when more than half say yes): the majority of k
draws is more often the judge's likelier verdict than one draw is, so a
judge that is right more often than not becomes more reliable (Kimi K2's
rubric rewards; robustness to judge noise). One jitted forward of the judge
over the batch (padded to a multiple of 64 tokens), on the default device.

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
from agentic_rl.model import pretrained
from agentic_rl.rollout.types import Rollout
from agentic_rl.text import Message, load_codec
from agentic_rl.train import checkpoint as checkpoint_lib

AGGREGATES = ("mean", "majority")


@dataclasses.dataclass
class Judge:
  """A loaded judge: its parameters, model config and codec, the policy's
  ``transcript(ids) -> str``, the rubric and the verdict token ids (the
  judge's first tokens of ``yes`` / ``Yes`` and of ``no`` / ``No``)."""

  params: Any
  model_config: model_lib.TransformerConfig
  codec: Any
  transcript: Callable[[np.ndarray], str]
  rubric: str
  yes_ids: tuple[int, ...]
  no_ids: tuple[int, ...]
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
    params, config, judge_codec = load_judge(j.checkpoint, model_config_of)
    yes_ids, no_ids = (tuple(sorted({judge_codec.encode_text(w)[0] for w in words}))
                       for words in (("yes", "Yes"), ("no", "No")))
    if set(yes_ids) & set(no_ids) or max(yes_ids + no_ids) >= config.vocab_size:
      raise ValueError(f"reward_hooks.judge.checkpoint={j.checkpoint!r}: its tokenizer gives "
                       f"yes {yes_ids} and no {no_ids} as first tokens, which must differ "
                       f"and lie in its vocabulary of {config.vocab_size}")
    hooks.judge = Judge(params, config, judge_codec, codec.tokenizer.decode, j.rubric,
                        yes_ids, no_ids, float(j.weight), int(j.samples), j.aggregate)
  return hooks


def load_judge(checkpoint: str, model_config_of) -> tuple[Any, model_lib.TransformerConfig, Any]:
  """``(params, model_config, codec)`` of a judge: the latest checkpoint of
  a run directory of this project (its architecture and tokenizer from its
  ``config.json``, through ``model_config_of``), or a Hugging Face
  directory or GGUF file."""
  if checkpoint_lib.is_run_dir(checkpoint):
    params, config, run_cfg = checkpoint_lib.load_frozen(checkpoint, model_config_of)
    return params, config, load_codec(run_cfg.model.init_from or None)
  config = model_lib.hf.config_from_hf(pretrained.read_config(checkpoint)).resolved()
  return pretrained.load_params(checkpoint, config), config, load_codec(checkpoint)


def judge_inputs(ro: Rollout, judge: Judge, pad_id: int = 0, multiple: int = 64,
                 ) -> tuple[np.ndarray, np.ndarray]:
  """``(tokens_BxL, last_B)``: each episode as the judge reads it (its
  transcript, then the rubric, one user message in the judge's chat
  template, up to where the judge's answer starts), right-padded to a
  multiple of ``multiple`` tokens; ``last_B`` the position of each row's
  last token, whose next-token distribution is the verdict."""
  tokens_BxT, length_B = np.asarray(ro.tokens_BxT), np.asarray(ro.length_B)
  rows = [np.asarray(judge.codec.encode_prompt(
      [Message("user", judge.transcript(tokens_BxT[b, :int(n)]) + judge.rubric)], escape=True),
      np.int32) for b, n in enumerate(length_B)]
  L = -(-max(len(r) for r in rows) // multiple) * multiple
  out_BxL = np.full((len(rows), L), pad_id, np.int32)
  for b, r in enumerate(rows):
    out_BxL[b, :len(r)] = r
  return out_BxL, np.asarray([len(r) - 1 for r in rows], np.int32)


@functools.partial(jax.jit, static_argnums=(0, 4))
def yes_probability(model_config, params, tokens_BxL: jax.Array, last_B: jax.Array,
                    num_yes: int, verdict_ids: jax.Array) -> jax.Array:
  """float32 ``[B]``: the probability of the first ``num_yes`` of
  ``verdict_ids`` among all of them, at position ``last_B``."""
  logits_BxLxV = model_lib.forward(params, tokens_BxL, model_config)
  logits_BxV = jnp.take_along_axis(logits_BxLxV, last_B[:, None, None], axis=1)[:, 0]
  p_BxK = jax.nn.softmax(logits_BxV[:, verdict_ids].astype(jnp.float32), axis=-1)
  return p_BxK[:, :num_yes].sum(axis=-1)


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
    tokens_BxL, last_B = judge_inputs(ro, j)
    p_B = yes_probability(j.model_config, j.params, jnp.asarray(tokens_BxL),
                          jnp.asarray(last_B), len(j.yes_ids),
                          jnp.asarray(j.yes_ids + j.no_ids))
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
