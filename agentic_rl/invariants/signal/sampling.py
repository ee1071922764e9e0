"""Host-side rollout allocation that keeps groups informative.

Every allocator drives a user-supplied ``sample_fn(prompt_ids_N, n, key) ->
(success_Nxn, rollouts)``: it generates n rollouts of each listed prompt (a
prompt may be listed more than once) and returns their binary outcomes as a
bool numpy array, prompt-major, with the rollouts themselves: any pytree of
arrays with leading axis ``N * n`` in the same order (or None). Allocators
never look inside the rollouts, so they are testable with a coin-flip
sampler, and they are deterministic given the key. A call asks for at most
``P * max(G, round_size)`` rollouts (P prompts, group size G), so a trainer
compiled for a fixed batch can pad.

The result, ``SampledBatch``, holds the kept rollouts group by group (kept
rollout b belongs to group ``group[b]``) and everything generated on the way.

- ``uniform``: G rollouts per prompt, one call.
- ``dynamic_sampling`` (DAPO, arXiv 2503.14476): keep groups whose
  outcomes are mixed, refill with new prompts until P groups are kept or the
  cap on extra rollouts is reached; remaining slots are filled with the first
  dropped groups (reported in the metrics).
- ``adaptive_sampling`` (Reinforce-Ada, arXiv 2510.04996): sample each
  prompt in rounds until it holds ``min_pos`` successes and ``min_neg``
  failures (or ``max_rounds`` is reached), then down-sample to G keeping the
  observed success ratio, clipped so that at least ``min_pos`` / ``min_neg`` of
  each survive where available.
- ``knapsack``: per-prompt budgets from ``knapsack.knapsack_budgets``; the
  groups are ragged (sizes differ, total P * G).

``allocate_rollouts`` picks one by ``SignalConfig.allocation``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from agentic_rl.invariants.checks import check_int
from agentic_rl.invariants.rng import host_rng
from agentic_rl.invariants.signal.config import SignalConfig
from agentic_rl.invariants.signal.history import PromptHistory
from agentic_rl.invariants.signal.knapsack import knapsack_budgets

PyTree = Any
SampleFn = Callable[[np.ndarray, int, jax.Array], tuple[np.ndarray, PyTree]]
DrawPromptsFn = Callable[[int, jax.Array], np.ndarray]
# One generated rollout: (outcome, call index, row in that call's output).
_Sample = tuple[bool, int, int]


@dataclasses.dataclass(frozen=True)
class SampledBatch:
  """P groups of rollouts chosen from one or more ``sample_fn`` calls (ragged layout).

  Attributes:
    prompt_ids: int64 ``[P]`` the prompt of each group.
    group: int64 ``[B]`` group of each kept rollout, non-decreasing (the
      ``group_B`` of the monitors, with ``num_groups = P``).
    success: bool ``[B]`` outcome of each kept rollout.
    rollouts: the kept rollouts (``sample_fn``'s pytrees, rows gathered in
      ``group`` order; leading axis B), or None if it returned None.
    generated: every rollout generated, kept or not, concatenated in call
      order (leading axis R = ``signal/rollouts``), or None.
    generated_ids: int64 ``[R]`` the prompt of each generated rollout.
    group_successes: int64 ``[P]`` successes among *all* rollouts generated for
      the group's prompt here, kept or not (Reinforce-Ada's global baseline).
    group_attempts: int64 ``[P]`` all rollouts generated for it.
    num_calls: how many times ``sample_fn`` was called.
    metrics: float scalars describing the sampling: ``signal/rollouts`` (all
      generated), ``signal/extra_rollouts`` (beyond P * G), ``signal/sampler_calls``
      and allocator-specific ones.
  """

  prompt_ids: np.ndarray
  group: np.ndarray
  success: np.ndarray
  rollouts: PyTree
  generated: PyTree
  generated_ids: np.ndarray
  group_successes: np.ndarray
  group_attempts: np.ndarray
  num_calls: int
  metrics: dict[str, float]

  @property
  def num_groups(self) -> int:
    return self.prompt_ids.shape[0]

  def success_PxG(self) -> np.ndarray:
    """``success`` as ``[P, G]``; ValueError if the groups are ragged."""
    sizes = np.bincount(self.group, minlength=self.num_groups)
    if np.any(sizes != sizes[0]):
      raise ValueError(f"groups are ragged (sizes {sizes.tolist()}); use group and success")
    return self.success.reshape(self.num_groups, -1)


class _Calls:
  """The ``sample_fn`` calls of one allocation: their outputs, checked."""

  def __init__(self, sample_fn: SampleFn):
    self.sample_fn = sample_fn
    self.ids: list[np.ndarray] = []
    self.rollouts: list[PyTree] = []

  def __call__(self, prompt_ids: np.ndarray, n: int, key: jax.Array) -> np.ndarray:
    out = self.sample_fn(prompt_ids, n, key)
    if not (isinstance(out, tuple) and len(out) == 2):
      raise ValueError("sample_fn must return (success, rollouts), got "
                       f"{type(out).__name__}")
    success, rollouts = np.asarray(out[0]), out[1]
    if success.shape != (len(prompt_ids), n) or success.dtype != np.bool_:
      raise ValueError(f"sample_fn must return bool [{len(prompt_ids)}, {n}], got "
                       f"{success.dtype}{success.shape}")
    self.ids.append(np.repeat(np.asarray(prompt_ids, np.int64), n))
    self.rollouts.append(rollouts)
    return success

  def __len__(self) -> int:
    return len(self.ids)

  def gather(self, samples: list[_Sample]) -> tuple[PyTree, PyTree]:
    """``(kept, generated)``: the rows of ``samples`` and all rows, each the
    calls' rollouts concatenated (None when ``sample_fn`` gave None)."""
    if any(r is None for r in self.rollouts):
      return None, None
    generated = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]),
                             *self.rollouts)
    offsets = np.cumsum([0] + [len(ids) for ids in self.ids])
    flat = np.array([offsets[c] + r for _, c, r in samples], np.int64)
    return jax.tree.map(lambda x: x[flat], generated), generated


def _batch(prompt_ids: np.ndarray, groups: list[list[_Sample]], successes: np.ndarray,
           attempts: np.ndarray, calls: _Calls, group_size: int, metrics: dict[str, float],
           rollouts: int | None = None) -> SampledBatch:
  """Flattens kept groups; ``rollouts`` (all generated) defaults to ``attempts.sum()``."""
  flat = [s for g in groups for s in g]
  rollouts = int(np.sum(attempts)) if rollouts is None else rollouts
  metrics = {"signal/rollouts": float(rollouts),
             "signal/extra_rollouts": float(rollouts - len(groups) * group_size),
             "signal/sampler_calls": float(len(calls)), **metrics}
  kept, generated = calls.gather(flat)
  return SampledBatch(
      prompt_ids=np.asarray(prompt_ids, np.int64),
      group=np.repeat(np.arange(len(groups)), [len(g) for g in groups]).astype(np.int64),
      success=np.array([s[0] for s in flat], bool),
      rollouts=kept, generated=generated, generated_ids=np.concatenate(calls.ids),
      group_successes=np.asarray(successes, np.int64),
      group_attempts=np.asarray(attempts, np.int64),
      num_calls=len(calls),
      metrics=metrics)


def _check_prompts(prompt_ids_P: np.ndarray) -> np.ndarray:
  ids = np.asarray(prompt_ids_P)
  if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"prompt_ids_P must be a non-empty 1-D integer array, got "
                     f"{ids.dtype}{ids.shape}")
  return ids.astype(np.int64)


def uniform_sampling(sample_fn: SampleFn, prompt_ids_P: np.ndarray, group_size: int,
                     key: jax.Array) -> SampledBatch:
  """G rollouts for each prompt, in one call."""
  ids = _check_prompts(prompt_ids_P)
  check_int("group_size", group_size, minimum=1)
  calls = _Calls(sample_fn)
  success = calls(ids, group_size, key)
  groups = [[(bool(s), 0, i * group_size + k) for k, s in enumerate(success[i])]
            for i in range(ids.size)]
  return _batch(ids, groups, success.sum(axis=1), np.full(ids.size, group_size), calls,
                group_size, {})


def dynamic_sampling(sample_fn: SampleFn, draw_prompts: DrawPromptsFn, prompt_ids_P: np.ndarray,
                     group_size: int, max_extra_rollouts: int, key: jax.Array) -> SampledBatch:
  """DAPO dynamic sampling: keep only mixed-outcome groups, refill, cap the extra cost.

  Args:
    sample_fn: ``(prompt_ids_N, n, key) -> (bool [N, n], rollouts)``.
    draw_prompts: ``(num, key) -> int [num]`` fresh prompts for a refill (for
      example ``prompts.select_prompts`` bound to the config and history).
    prompt_ids_P: int ``[P]`` the batch's first prompts.
    group_size: G.
    max_extra_rollouts: at most this many rollouts beyond ``P * G``.
    key: PRNG key.

  Returns:
    A ``SampledBatch`` of P groups of G. No group has all-equal outcomes unless
    the cap stopped the refill (``signal/ds_filled_degenerate`` > 0). Each
    refill asks for ``ceil(missing / keep_rate)`` prompts (the keep rate
    observed so far; as many as the cap allows while it is 0), at most P.
    ``signal/sampled_zero_variance_frac`` is the fraction of all sampled groups
    that were all-equal (what uniform allocation would have trained on).
  """
  ids = _check_prompts(prompt_ids_P)
  check_int("group_size", group_size, minimum=1)
  check_int("max_extra_rollouts", max_extra_rollouts, minimum=0)
  num_groups = ids.size
  budget = num_groups * group_size + max_extra_rollouts

  kept, dropped = [], []  # (prompt id, samples)
  used = drawn = 0
  calls = _Calls(sample_fn)
  batch_ids = ids
  while True:
    key, sub = jax.random.split(key)
    success = calls(batch_ids, group_size, sub)
    for i, prompt in enumerate(batch_ids):
      samples = [(bool(s), len(calls) - 1, i * group_size + k) for k, s in enumerate(success[i])]
      (dropped if success[i].all() or not success[i].any() else kept).append((prompt, samples))
    used += batch_ids.size * group_size
    drawn += batch_ids.size
    missing = num_groups - len(kept)
    affordable = (budget - used) // group_size
    if missing <= 0 or affordable == 0:
      break
    keep_rate = len(kept) / drawn
    want = affordable if keep_rate == 0 else math.ceil(missing / keep_rate)
    key, sub = jax.random.split(key)
    batch_ids = _check_prompts(draw_prompts(min(want, affordable, num_groups), sub))

  filled = max(num_groups - len(kept), 0)
  chosen = kept[:num_groups] + dropped[:filled]
  successes = np.array([sum(s[0] for s in g) for _, g in chosen])
  return _batch(np.array([p for p, _ in chosen]), [g for _, g in chosen], successes,
                np.full(num_groups, group_size), calls, group_size, {
                    "signal/ds_filled_degenerate": float(filled),
                    "signal/sampled_zero_variance_frac": len(dropped) / drawn,
                }, rollouts=used)


def _keep_count(num_pos: int, num_neg: int, group_size: int, min_pos: int, min_neg: int) -> int:
  """How many successes a down-sampled group of G keeps.

  The observed ratio ``round(G * pos / (pos + neg))``, clipped to keep at least
  ``min(min_pos, pos)`` successes and ``min(min_neg, neg)`` failures, and to
  what is available. Needs ``pos + neg >= G`` and ``min_pos + min_neg <= G``.
  """
  k = round(group_size * num_pos / (num_pos + num_neg))
  low = max(min(min_pos, num_pos), group_size - num_neg)
  high = min(group_size - min(min_neg, num_neg), num_pos)
  return int(np.clip(k, low, high))


def adaptive_sampling(sample_fn: SampleFn, prompt_ids_P: np.ndarray, group_size: int,
                      round_size: int, max_rounds: int, min_pos: int, min_neg: int,
                      key: jax.Array) -> SampledBatch:
  """Reinforce-Ada: sample in rounds until each group is mixed, then down-sample to G.

  Args:
    sample_fn: ``(prompt_ids_N, n, key) -> (bool [N, n], rollouts)``.
    prompt_ids_P: int ``[P]`` the batch's prompts.
    group_size: G, the size of the kept groups.
    round_size: rollouts per active prompt per round, ``>= G``.
    max_rounds: rounds before an unfinished prompt is down-sampled as it is.
    min_pos, min_neg: the exit condition (``pos >= min_pos and neg >= min_neg``),
      with ``min_pos + min_neg <= G``.
    key: PRNG key (rounds and the down-sampling draw).

  Returns:
    A ``SampledBatch`` of P groups of G; ``group_successes`` and
    ``group_attempts`` count all the rollouts generated for each prompt.
    ``signal/ada_unresolved_frac``: prompts that never met the exit condition.
  """
  ids = _check_prompts(prompt_ids_P)
  check_int("group_size", group_size, minimum=1)
  check_int("round_size", round_size, minimum=group_size)
  check_int("max_rounds", max_rounds, minimum=1)
  check_int("min_pos", min_pos, minimum=0)
  check_int("min_neg", min_neg, minimum=0)
  if min_pos + min_neg > group_size:
    raise ValueError(f"min_pos + min_neg = {min_pos + min_neg} exceeds the group size {group_size}")
  num_groups = ids.size
  collected: list[list[_Sample]] = [[] for _ in range(num_groups)]
  active = np.arange(num_groups)
  calls = _Calls(sample_fn)
  for _ in range(max_rounds):
    key, sub = jax.random.split(key)
    success = calls(ids[active], round_size, sub)
    for i, slot in enumerate(active):
      collected[slot].extend((bool(s), len(calls) - 1, i * round_size + k)
                             for k, s in enumerate(success[i]))
    pos = np.array([sum(s[0] for s in collected[slot]) for slot in active])
    neg = np.array([len(collected[slot]) for slot in active]) - pos
    active = active[(pos < min_pos) | (neg < min_neg)]
    if active.size == 0:
      break

  rng = host_rng(key)
  groups = []
  for samples in collected:
    pos_idx = np.array([j for j, s in enumerate(samples) if s[0]], np.int64)
    neg_idx = np.array([j for j, s in enumerate(samples) if not s[0]], np.int64)
    k = _keep_count(pos_idx.size, neg_idx.size, group_size, min_pos, min_neg)
    keep = np.concatenate([rng.choice(pos_idx, k, replace=False),
                           rng.choice(neg_idx, group_size - k, replace=False)])
    groups.append([samples[j] for j in np.sort(keep)])

  attempts = np.array([len(c) for c in collected])
  successes = np.array([sum(s[0] for s in c) for c in collected])
  resolved = (successes >= min_pos) & (attempts - successes >= min_neg)
  return _batch(ids, groups, successes, attempts, calls, group_size,
                {"signal/ada_unresolved_frac": float(np.mean(~resolved))})


def allocate_rollouts(config: SignalConfig, sample_fn: SampleFn, prompt_ids_P: np.ndarray,
                      group_size: int, key: jax.Array, draw_prompts: DrawPromptsFn | None = None,
                      history: PromptHistory | None = None) -> SampledBatch:
  """Generates a batch's rollouts with the allocator chosen by ``config.allocation``.

  Args:
    config: the signal config.
    sample_fn: ``(prompt_ids_N, n, key) -> (bool [N, n], rollouts)``.
    prompt_ids_P: int ``[P]`` the batch's prompts.
    group_size: G; every allocator spends ``P * G`` rollouts on the batch
      (dynamic sampling and Reinforce-Ada may spend extra).
    key: PRNG key.
    draw_prompts: ``(num, key) -> prompt ids``, required by ``dynamic``.
    history: outcome history, required by ``knapsack``.

  Returns:
    A ``SampledBatch`` (ragged under ``knapsack``, P groups of G otherwise).
  """
  config.validate_group_size(group_size)
  ids = _check_prompts(prompt_ids_P)
  if config.allocation == "uniform":
    return uniform_sampling(sample_fn, ids, group_size, key)
  if config.allocation == "dynamic":
    if draw_prompts is None:
      raise ValueError("allocation='dynamic' needs draw_prompts to refill the batch")
    extra = math.floor(config.max_extra_rollout_frac * ids.size * group_size)
    return dynamic_sampling(sample_fn, draw_prompts, ids, group_size, extra, key)
  if config.allocation == "ada":
    round_size = config.ada_round_size or group_size
    return adaptive_sampling(sample_fn, ids, group_size, round_size, config.ada_max_rounds,
                             config.ada_min_pos, config.ada_min_neg, key)
  if history is None:
    raise ValueError("allocation='knapsack' needs the prompt history")
  budgets = knapsack_budgets(config, history, ids, group_size)
  calls = _Calls(sample_fn)
  success = calls(np.repeat(ids, budgets), 1, key)[:, 0]
  bounds = np.concatenate([[0], np.cumsum(budgets)])
  groups = [[(bool(success[r]), 0, r) for r in range(bounds[i], bounds[i + 1])]
            for i in range(ids.size)]
  successes = np.array([sum(s[0] for s in g) for g in groups])
  return _batch(ids, groups, successes, budgets, calls, group_size,
                {"signal/knapsack_budget_max": float(budgets.max()),
                 "signal/knapsack_budget_min": float(budgets.min())})
