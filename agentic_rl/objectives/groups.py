"""Advantages over a batch laid out in groups, equal or ragged, and per turn.

A batch of B rollouts is grouped by prompt: :class:`GroupLayout` says which
group each row is in, once per batch, and the estimators and the invariant
monitors read it from there. Group estimators take ``[P, G]`` rewards; with
equal groups the batch goes through them as one array, with ragged groups
(per-prompt budgets) one group at a time as ``[1, n_i]``, which is exact for
every estimator that normalises within a group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from agentic_rl.objectives.advantages import broadcast_turn_advantages


@dataclasses.dataclass(frozen=True)
class GroupLayout:
  """The group of each row of a batch.

  Attributes:
    group_B: int64 ``[B]``, non-decreasing: row b belongs to group
      ``group_B[b]`` (rows of one group are contiguous).
    num_groups: P.
    size: G when every group holds G rows (the ``[P, G]`` layout), else None.
  """

  group_B: np.ndarray
  num_groups: int
  size: int | None

  @classmethod
  def of(cls, group_B, num_groups: int) -> GroupLayout:
    group_B = np.asarray(group_B, np.int64)
    if group_B.ndim != 1 or (group_B.size and (np.any(np.diff(group_B) < 0)
                                               or group_B[0] < 0 or group_B[-1] >= num_groups)):
      raise ValueError(f"group_B must be non-decreasing ids in [0, {num_groups}), got "
                       f"{group_B.tolist()}")
    sizes = np.bincount(group_B, minlength=num_groups)
    equal = bool(sizes.size) and bool(np.all(sizes == sizes[0])) and sizes[0] > 0
    return cls(group_B, int(num_groups), int(sizes[0]) if equal else None)

  @property
  def sizes(self) -> np.ndarray:
    """int ``[P]``: the rows of each group."""
    return np.bincount(self.group_B, minlength=self.num_groups)

  def monitor_kwargs(self) -> dict:
    """``group_B`` and ``num_groups`` as the monitors take them."""
    return {"group_B": jnp.asarray(self.group_B), "num_groups": self.num_groups}


def group_advantages(adv_fn: Callable, rewards_B: np.ndarray, layout: GroupLayout,
                     **per_group: np.ndarray) -> np.ndarray:
  """float32 ``[B]`` advantages from a group estimator ``adv_fn(rewards_PxG,
  **per_group)``.

  ``per_group`` arrays (leading axis ``[P]``, such as ReMax's
  ``greedy_rewards_P`` or Reinforce-Ada's ``all_rewards_PxN``) are passed
  along, sliced to match under ragged groups (where an empty group is
  skipped).
  """
  rewards_B = np.asarray(rewards_B, np.float32)
  if layout.size is not None:
    return np.asarray(adv_fn(jnp.asarray(rewards_B.reshape(layout.num_groups, layout.size)),
                             **per_group)).reshape(-1)
  bounds = np.concatenate([[0], np.cumsum(layout.sizes)])
  return np.concatenate([np.zeros(0, np.float32)] + [
      np.asarray(adv_fn(jnp.asarray(rewards_B[a:b][None]),
                        **{k: v[i:i + 1] for k, v in per_group.items()}))[0]
      for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a])


def turn_states(tokens_BxT, turn_BxT, loss_mask_BxT, length_B, num_turns_B, group_B,
                max_turns: int) -> np.ndarray:
  """int32 ``[B, max_turns]``: an id of the observation each turn starts
  from, equal for two turns of one group exactly when their observations'
  tokens are (GiGPO's anchor states); row b has ``num_turns_B[b]`` turns.

  Turn ``k`` (action segment ``k + 1``) starts from the tokens of segment
  ``k`` that the policy did not write: the prompt for turn 0, else the
  observation that answered action ``k``. Ids are numbered in order of
  first appearance, so a batch's ids are reproducible; turns past an
  episode's last get -1.
  """
  tokens_BxT, turn_BxT = np.asarray(tokens_BxT), np.asarray(turn_BxT)
  observed_BxT = np.asarray(loss_mask_BxT) == 0
  observed_BxT &= np.arange(tokens_BxT.shape[1])[None, :] < np.asarray(length_B)[:, None]
  ids: dict[tuple[int, bytes], int] = {}
  state_BxN = np.full((tokens_BxT.shape[0], max_turns), -1, np.int32)
  for b, (g, n) in enumerate(zip(np.asarray(group_B), np.asarray(num_turns_B))):
    for k in range(min(int(n), max_turns)):
      seen = tokens_BxT[b][observed_BxT[b] & (turn_BxT[b] == k)]
      state_BxN[b, k] = ids.setdefault((int(g), seen.tobytes()), len(ids))
  return state_BxN


def turn_advantages(adv_fn: Callable, turn_rewards_BxC: np.ndarray, num_turns_B: np.ndarray,
                    turn_BxT: np.ndarray, *, episode_bonus_B: np.ndarray | None = None,
                    valid_B: np.ndarray | None = None, **turn_inputs: np.ndarray,
                    ) -> np.ndarray:
  """float32 ``[B, T]`` turn-level advantages on the tokens of each turn.

  ``adv_fn(turn_rewards_BxC, turn_mask_BxC, **turn_inputs)`` is a turn
  estimator (REBN; GiGPO, with ``state_BxN`` and ``group_B``). Turns
  ``0 .. num_turns - 1`` of the ``valid_B`` rows (default: all) are real;
  ``episode_bonus_B`` (episode-level shaping, e.g. an over-long penalty)
  goes to each episode's last turn, so the turns still sum to the shaped
  episode reward. Tokens of action segment k (``turn_BxT == k``, k >= 1)
  get turn ``k - 1``'s advantage, others 0.
  """
  turn_rewards = np.array(turn_rewards_BxC, np.float32)
  B, C = turn_rewards.shape
  num_turns = np.asarray(num_turns_B)
  if episode_bonus_B is not None:
    turn_rewards[np.arange(B), np.clip(num_turns - 1, 0, C - 1)] += episode_bonus_B
  turn_mask = np.arange(C)[None, :] < num_turns[:, None]
  if valid_B is not None:
    turn_mask &= np.asarray(valid_B, bool)[:, None]
  adv_BxC = adv_fn(jnp.asarray(turn_rewards), jnp.asarray(turn_mask),
                   **{k: jnp.asarray(v) for k, v in turn_inputs.items()})
  return np.asarray(broadcast_turn_advantages(adv_BxC, jnp.asarray(turn_BxT) - 1))
