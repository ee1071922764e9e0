"""The rollout engine's data: the output contract and the carried loop state.

Rows are prompt-major: a batch of ``B = P * G`` rows holds ``G`` consecutive
samples of each of ``P`` prompts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

PyTree = Any


@struct.dataclass
class Rollout:
  """A batch of episodes, token-in/token-out, ready for the learner.

  Attributes (B rows, T = ``SamplingConfig.max_total_tokens``, C = max turns):
    tokens_BxT: int32 prompt, policy tokens and framed observations, then pad.
    loss_mask_BxT: float32, 1 exactly on tokens the policy produced.
    behaviour_logp_BxT: float32 log-prob of each policy token under the exact
      sampling distribution it was drawn from (0 where the mask is 0).
    entropy_BxT: float32 entropy of that distribution (0 where the mask is 0).
    turn_BxT: int32 codec turn ids: 0 on the prompt, k on the k-th action
      segment and on the observation that answers it.
    version_BxT: int32 policy version that produced each policy token, -1
      elsewhere.
    prompt_len_B: int32 prompt tokens.
    length_B: int32 valid tokens (prompt included).
    reward_B: float32 sum of the environment's step rewards.
    reward_components: dict of float32 ``[B]``, each summed over steps.
    done_B: bool, the episode ended normally (answer, final stop token, or the
      environment said done).
    truncated_B: bool, the episode ended on a limit (turns, tokens per turn,
      total tokens, or the environment's own limit).
    num_turns_B: int32 action segments started.
    num_tool_calls_B: int32 actions that closed a tool call.
    num_tool_errors_B: int32 environment steps that reported a tool error.
    env_seconds_B: float32 the episode's time in its environment, in seconds:
      the measured wall time of a host environment's ``reset``, ``step`` and
      ``call_tool`` calls, or the nominal latencies of a jitted family's tool
      calls (``agentic_rl.envs.tools.LATENCY_S``).
    call_hashes_BxC: int32 canonical call hash of each environment step in
      order (-1 for non-calls and padding).
    turn_rewards_BxC: float32 reward of each environment step in order (0 on
      padding); a row sums to ``reward_B``. Step k answers action segment
      ``k + 1`` (``turn_BxT``), so these are per-turn rewards (REBN).
    finished_B: bool, ``done | truncated``; False for an episode carried over
      to the next iteration (partial rollouts).
    status_B: int32 index into :data:`EPISODE_STATUS`: 0 ("ok") for an
      episode the environment played to its end or to a limit; otherwise
      why a host environment ended it (the episode is truncated then).
    obs_clipped_B: int32 observations clipped to ``max_obs_tokens``.
    segments: the earlier contexts of episodes whose context was rewritten
      (:mod:`agentic_rl.rollout.context`), or None without context
      management; the fields above describe the final context.
    info: per-episode statistics of the rollout's source, float32 ``[B]``
      by name (a host loop with sub-agents: ``parl/*``,
      :mod:`agentic_rl.rollout.swarm`); empty otherwise.
  """

  tokens_BxT: jax.Array
  loss_mask_BxT: jax.Array
  behaviour_logp_BxT: jax.Array
  entropy_BxT: jax.Array
  turn_BxT: jax.Array
  version_BxT: jax.Array
  prompt_len_B: jax.Array
  length_B: jax.Array
  reward_B: jax.Array
  reward_components: dict[str, jax.Array]
  done_B: jax.Array
  truncated_B: jax.Array
  num_turns_B: jax.Array
  num_tool_calls_B: jax.Array
  num_tool_errors_B: jax.Array
  env_seconds_B: jax.Array
  call_hashes_BxC: jax.Array
  turn_rewards_BxC: jax.Array
  finished_B: jax.Array
  status_B: jax.Array
  obs_clipped_B: jax.Array
  segments: Segments | None = None
  info: dict[str, jax.Array] = dataclasses.field(default_factory=dict)


@struct.dataclass
class Segments:
  """The earlier contexts (segments) of each episode, K at most.

  Segment ``k < count_B`` of row b is the context the policy acted in
  before the ``k + 1``-th rewrite: its tokens, with the policy's tokens
  marked and their behaviour log-probs, entropies and versions, as the
  :class:`Rollout` fields of the same names hold them for the final
  context (``[B, K, T]``; unused segments are padding with mask 0).
  ``length_BxK`` is each segment's token count.
  """

  tokens_BxKxT: jax.Array
  loss_mask_BxKxT: jax.Array
  behaviour_logp_BxKxT: jax.Array
  entropy_BxKxT: jax.Array
  version_BxKxT: jax.Array
  length_BxK: jax.Array
  count_B: jax.Array


# Why an episode ended, beyond the environment's own decision and the limits
# (``Rollout.status_B``). The failures (env_error, env_timeout,
# nonfinite_reward) leave the episode out of the learner's batch;
# obs_overflow is a truncation like the turn and token limits.
EPISODE_STATUS = ("ok", "env_error", "env_timeout", "nonfinite_reward", "obs_overflow")
FAILED_STATUS = (1, 2, 3)


@struct.dataclass
class RolloutState:
  """Everything a batch of in-progress episodes needs to continue.

  The KV cache is not part of it: a resumed state is re-prefilled under the
  parameters it resumes with. All leaves have a leading batch axis B.

  Attributes (beyond the :class:`Rollout` fields of the same name):
    logp_BxT / entropy_BxT: behaviour log-probs and entropies so far.
    cur_B: int32 position of the last written token (``length - 1``); the
      next step feeds it to the policy and writes at ``cur + 1``.
    seg_len_B: int32 policy tokens in the open action segment.
    queue_BxQ / queue_len_B / queue_pos_B: observation tokens waiting to be
      forced into the context (loss mask 0), and how many are consumed.
    script_BxS / script_len_B / script_pos_B: policy tokens to force instead
      of sampling (scripted policies); empty when sampling.
    num_actions_B: int32 environment steps taken.
    awaiting_B: bool, the row closed an action and waits for a host
      environment (host loop only).
    status_B / obs_clipped_B: as :class:`Rollout`'s (host loop only).
    key_B: per-row PRNG keys; the draw at position t uses
      ``fold_in(key, t)``, so a resumed episode draws what it would have.
    env_state: the in-jit environment's state (leading axis B), or None.
  """

  tokens_BxT: jax.Array
  loss_mask_BxT: jax.Array
  logp_BxT: jax.Array
  entropy_BxT: jax.Array
  turn_BxT: jax.Array
  version_BxT: jax.Array
  prompt_len_B: jax.Array
  cur_B: jax.Array
  seg_len_B: jax.Array
  queue_BxQ: jax.Array
  queue_len_B: jax.Array
  queue_pos_B: jax.Array
  script_BxS: jax.Array
  script_len_B: jax.Array
  script_pos_B: jax.Array
  num_actions_B: jax.Array
  reward_B: jax.Array
  reward_components: dict[str, jax.Array]
  done_B: jax.Array
  truncated_B: jax.Array
  awaiting_B: jax.Array
  num_tool_calls_B: jax.Array
  num_tool_errors_B: jax.Array
  env_seconds_B: jax.Array
  call_hashes_BxC: jax.Array
  turn_rewards_BxC: jax.Array
  status_B: jax.Array
  obs_clipped_B: jax.Array
  key_B: jax.Array
  env_state: PyTree

  @property
  def ended_B(self) -> jax.Array:
    return self.done_B | self.truncated_B

  def to_rollout(self) -> Rollout:
    """The output contract for the rows as they stand."""
    return Rollout(
        tokens_BxT=self.tokens_BxT,
        loss_mask_BxT=self.loss_mask_BxT,
        behaviour_logp_BxT=self.logp_BxT,
        entropy_BxT=self.entropy_BxT,
        turn_BxT=self.turn_BxT,
        version_BxT=self.version_BxT,
        prompt_len_B=self.prompt_len_B,
        length_B=self.cur_B + 1,
        reward_B=self.reward_B,
        reward_components=self.reward_components,
        done_B=self.done_B,
        truncated_B=self.truncated_B,
        num_turns_B=jnp.max(self.turn_BxT, axis=1),
        num_tool_calls_B=self.num_tool_calls_B,
        num_tool_errors_B=self.num_tool_errors_B,
        env_seconds_B=self.env_seconds_B,
        call_hashes_BxC=self.call_hashes_BxC,
        turn_rewards_BxC=self.turn_rewards_BxC,
        finished_B=self.ended_B,
        status_B=self.status_B,
        obs_clipped_B=self.obs_clipped_B)


def select_rows(take_B: jax.Array, new: PyTree, old: PyTree) -> PyTree:
  """Row-wise ``where``: ``new`` rows where ``take_B``, else ``old`` rows.

  Both pytrees share structure and leading batch axis B.
  """
  def pick(n, o):
    mask = jnp.reshape(take_B, take_B.shape + (1,) * (n.ndim - 1))
    return jnp.where(mask, n, o)
  return jax.tree.map(pick, new, old)
