"""Context management: what an episode does when its context is full.

An episode's context is its row of ``sampling.max_total_tokens`` slots (the
policy's context window). When the next observation would not fit, the
episode is truncated (``policy="none"``), or the context is rewritten and the
episode goes on:

* ``"drop_tool_results"``: the observations of all but the last
  ``keep_tool_results`` turns (the one arriving counts) are replaced by a
  short placeholder; the task and every action stay.
* ``"summary"``: the policy is first asked to fold the history into a
  summary (``summary_request``, framed as a user turn, while there is still
  room to answer); its answer is an action like any other (sampled, scored,
  trained). The new context is the task, the last action, the request and
  the summary, then the observation that did not fit.
* ``"discard_all"``: the history is discarded; the new context is the task,
  the last action and its observation (Kimi K2.5's "discard-all").

Every new context is a well-formed conversation: observations keep the
codec's framing, so a chat template's turn headers stay in place.

A rewrite closes a *segment*: the row as it stood, every token the policy
wrote in it beside exactly the context it saw, is kept
(``Rollout.segments``), and the new context starts a new one. The learner
scores every segment as its own sequence (:func:`scored_rows`), so a token's
learner log-prob conditions on what the policy saw when it wrote it; all
segments of an episode share the episode's advantage. At most
``max_resets`` rewrites per episode; the next overflow truncates it.

Context management runs in the host loop (:mod:`agentic_rl.rollout.host_loop`),
where rows are rewritten and re-prefilled between jitted segments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

POLICIES = ("none", "drop_tool_results", "summary", "discard_all")
# The placeholder of a dropped observation, and the default summary request.
OMITTED = "(omitted)"
SUMMARY_REQUEST = "Context full: summarize."


@dataclasses.dataclass(frozen=True)
class ContextConfig:
  """How an episode manages a full context (see the module docstring)."""

  policy: str = "none"
  keep_tool_results: int = 2
  max_resets: int = 4
  summary_request: str = SUMMARY_REQUEST

  @property
  def enabled(self) -> bool:
    return self.policy != "none"

  def validate(self) -> ContextConfig:
    if self.policy not in POLICIES:
      raise ValueError(f"context.policy is {self.policy!r}; valid: {', '.join(POLICIES)}")
    for name, low in (("keep_tool_results", 1), ("max_resets", 1 if self.enabled else 0)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"context.{name} must be an int >= {low}, got {value!r}")
    if self.policy == "summary" and not self.summary_request.strip():
      raise ValueError("context.summary_request is empty: the summary policy asks the "
                       "policy for its summary with it")
    return self


@dataclasses.dataclass(frozen=True)
class Turn:
  """One turn of a row's context: the action ``[action_start, obs_start)``
  (``tool``: it called a tool) and the observation that answered it
  ``[obs_start, obs_end)``."""

  action_start: int
  obs_start: int
  obs_end: int
  tool: bool = False


@dataclasses.dataclass(frozen=True)
class Piece:
  """A part of a rewritten context: ``[start, end)`` of the current one, in
  the role ``"task"``, ``"action"`` or ``"obs"``; ``"omitted"`` stands for
  the observation ``[start, end)`` replaced by a placeholder (``tool``: it
  answered a tool call)."""

  start: int
  end: int
  role: str
  tool: bool = False


def kept_pieces(config: ContextConfig, prompt_len: int, turns: Sequence[Turn]) -> list[Piece]:
  """What the rewritten context holds, in order, for ``drop_tool_results``
  and ``discard_all``.

  ``turns`` ends with the action whose observation did not fit (its
  observation span empty); the task is ``[0, prompt_len)``.
  """
  pieces = [Piece(0, prompt_len, "task")]
  if config.policy == "discard_all":
    return pieces + [Piece(turns[-1].action_start, turns[-1].obs_start, "action")]
  if config.policy != "drop_tool_results":
    raise ValueError(f"kept_pieces is for drop_tool_results and discard_all, not "
                     f"{config.policy!r}")
  first_kept = len(turns) - config.keep_tool_results
  for i, turn in enumerate(turns):
    pieces.append(Piece(turn.action_start, turn.obs_start, "action"))
    if turn.obs_end > turn.obs_start:
      pieces.append(Piece(turn.obs_start, turn.obs_end,
                          "obs" if i >= first_kept else "omitted", turn.tool))
  return pieces


# ------------------------------------------------------------------ learner
# The per-token arrays of a scored sequence, as named in a Rollout.
TOKEN_FIELDS = ("tokens_BxT", "loss_mask_BxT", "behaviour_logp_BxT", "entropy_BxT",
                "version_BxT")


@dataclasses.dataclass(frozen=True)
class ScoredRows:
  """The sequences the learner scores: each episode's final context (rows
  ``[0, B)``, in batch order), then every earlier segment, then padding
  rows (no policy tokens) up to a multiple of B.

  ``arrays`` maps :data:`TOKEN_FIELDS` (with ``_RxT`` in place of ``_BxT``)
  to ``[R, T]`` numpy arrays; ``episode_R`` (int64) is each row's episode
  in the batch, -1 on padding.
  """

  arrays: dict[str, np.ndarray]
  episode_R: np.ndarray

  @property
  def num_rows(self) -> int:
    return len(self.episode_R)

  def __getitem__(self, name: str) -> np.ndarray:
    return self.arrays[name]

  def per_row(self, values_B: np.ndarray, fill=0) -> np.ndarray:
    """``values_B[episode_R]``, ``fill`` on padding rows."""
    values_B = np.asarray(values_B)
    out = values_B[np.maximum(self.episode_R, 0)]
    pad = (self.episode_R < 0).reshape((-1,) + (1,) * (out.ndim - 1))
    return np.where(pad, np.asarray(fill, out.dtype), out)


  def episode_max(self, values_RxT: np.ndarray, where_RxT: np.ndarray) -> np.ndarray:
    """``[B]``: each episode's largest value where ``where_RxT``, over all
    its rows (-1 where none)."""
    row_max = np.max(np.where(where_RxT, values_RxT, -1), axis=1)
    out = np.full(int(self.episode_R.max()) + 1, -1, row_max.dtype)
    real = self.episode_R >= 0
    np.maximum.at(out, self.episode_R[real], row_max[real])
    return out


def scored_rows(rollout) -> ScoredRows:
  """The rollout's sequences for the learner (:class:`ScoredRows`).

  Without context management (``rollout.segments`` None) these are the
  rollout's own rows. With it, an episode of ``k`` rewrites gives ``k + 1``
  sequences: the final context and the ``k`` earlier segments; the rows are
  padded to a multiple of B so the learner compiles for few shapes.
  """
  B = np.shape(rollout.tokens_BxT)[0]
  final = {name: np.asarray(getattr(rollout, name)) for name in TOKEN_FIELDS}
  segments = rollout.segments
  if segments is None:
    return ScoredRows({n.replace("_BxT", "_RxT"): v for n, v in final.items()},
                      np.arange(B))
  count_B = np.asarray(segments.count_B)
  K = np.shape(segments.tokens_BxKxT)[1]
  used_BxK = np.arange(K) < count_B[:, None]
  episode = np.concatenate([np.arange(B), np.nonzero(used_BxK)[0]])
  R = -(-len(episode) // B) * B
  arrays = {}
  for name, rows in final.items():
    earlier = np.asarray(getattr(segments, name.replace("_BxT", "_BxKxT")))[used_BxK]
    fill = -1 if name == "version_BxT" else 0
    pad = np.full((R - len(episode),) + rows.shape[1:], fill, rows.dtype)
    arrays[name.replace("_BxT", "_RxT")] = np.concatenate([rows, earlier.astype(rows.dtype), pad])
  return ScoredRows(arrays, np.concatenate([episode, np.full(R - len(episode), -1)]))


def policy_tokens(rollout) -> np.ndarray:
  """int ``[B]``: the tokens each episode's policy wrote, over all its
  segments."""
  tokens = (np.asarray(rollout.loss_mask_BxT) > 0).sum(axis=1)
  if getattr(rollout, "segments", None) is not None:
    tokens = tokens + (np.asarray(rollout.segments.loss_mask_BxKxT) > 0).sum(axis=(1, 2))
  return tokens


def context_metrics(rollout) -> dict[str, float]:
  """``episode/context_resets`` (rewrites per episode) and
  ``episode/peak_context_tokens`` (each episode's longest context, averaged)."""
  length = np.asarray(rollout.length_B)
  if rollout.segments is None:
    return {"episode/context_resets": 0.0, "episode/peak_context_tokens": float(length.mean())}
  seg = rollout.segments
  peak = np.maximum(length, np.asarray(seg.length_BxK).max(axis=1, initial=0))
  return {"episode/context_resets": float(np.mean(seg.count_B)),
          "episode/peak_context_tokens": float(peak.mean())}
