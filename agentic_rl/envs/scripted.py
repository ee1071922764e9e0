"""Scripted episodes: jittable rollouts of the reference policies, and
demonstrations (conversations) built from them for SFT warm starts.

A rollout steps the environment itself, so a demonstration is exactly
consistent with it: its messages are the codec's decoding of the very token
stream the rollout engine would build (prompt, actions, framed observations).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from agentic_rl.envs import prompts
from agentic_rl.text import codec as codec_lib

PyTree = Any


@struct.dataclass
class Trajectory:
  """A scripted episode, ``T = env.max_turns`` steps (vmap adds B in front).

  Attributes:
    actions: int32 ``[T, max_action_len]``; action_lens: int32 ``[T]``.
    obs: int32 ``[T, max_obs_len]``; obs_lens: int32 ``[T]``.
    live: bool ``[T]`` the episode was running when step t was taken.
    outputs: the ``StepOutput`` of every step (leaves ``[T, ...]``).
    final_state: the state after the last step.
  """

  actions: jax.Array
  action_lens: jax.Array
  obs: jax.Array
  obs_lens: jax.Array
  live: jax.Array
  outputs: PyTree
  final_state: PyTree


def scripted_rollout(env, instance: PyTree, key: jax.Array, strategy=0,
                     noise=0.0) -> Trajectory:
  """Plays one episode with ``env.reference_action``; jittable, vmappable.

  ``strategy`` and ``noise`` are forwarded to ``reference_action`` (traced
  values allowed). The scripts always answer by turn ``env.max_turns``.
  """
  def body(state, k):
    live = ~(state.done | state.truncated)
    action, length = env.reference_action(state, k, strategy, noise)
    state, out = env.step(state, action, length)
    return state, (action, length, out, live)

  state, (actions, lens, outs, live) = jax.lax.scan(
      body, env.reset(instance), jax.random.split(key, env.max_turns))
  return Trajectory(actions=actions, action_lens=lens, obs=outs.obs_A, obs_lens=outs.obs_len,
                    live=live, outputs=outs, final_state=state)


def episode_returns(traj: Trajectory) -> dict[str, jax.Array]:
  """``reward`` and every reward component summed over the steps."""
  out = {"reward": traj.outputs.reward.sum(-1)}
  out.update({k: v.sum(-1) for k, v in traj.outputs.reward_components.items()})
  return out


def _vmapped_rollout(env, instances, keys, strategy, noise):
  return jax.vmap(lambda i, k: scripted_rollout(env, i, k, strategy, noise))(instances, keys)


_rollout = jax.jit(scripted_rollout, static_argnames=("env",))
_rollouts = jax.jit(_vmapped_rollout, static_argnames=("env",))


def batch_rollouts(env, instances: PyTree, keys: jax.Array, strategy=0,
                   noise=0.0) -> Trajectory:
  """``jit(vmap(scripted_rollout))`` over instances and keys (leading B)."""
  return _rollouts(env, instances, keys, env.strategy_index(strategy),
                   jnp.asarray(noise, jnp.float32))


def trajectory_ids(env, instance: PyTree, traj: Trajectory) -> np.ndarray:
  """The token stream of one episode: prompt, then actions and framed
  observations, exactly as a rollout engine appends them."""
  codec = env.codec
  ids = [np.asarray(codec.encode_prompt(prompts.prompt_messages(env, instance)))]
  traj = jax.tree.map(np.asarray, traj)
  for t in np.flatnonzero(traj.live):
    ids.append(traj.actions[t, :traj.action_lens[t]])
    if traj.obs_lens[t]:
      framed, n = codec_lib.frame_observation(traj.obs[t], traj.obs_lens[t], codec.ids)
      ids.append(np.asarray(framed)[:int(n)])
  return np.concatenate(ids).astype(np.int32)


def demonstration(env, instance: PyTree, key: jax.Array, *, strategy=0,
                  noise: float = 0.0) -> list[codec_lib.Message]:
  """A full conversation (system, user, then the scripted assistant's text,
  tool calls and tool results, ending with its answer) for one instance."""
  traj = _rollout(env, instance, key, env.strategy_index(strategy),
                  jnp.asarray(noise, jnp.float32))
  return env.codec.decode(trajectory_ids(env, instance, traj))


def demonstrations(env, instances: PyTree, key: jax.Array, *, strategy=0,
                   noise: float = 0.0) -> list[list[codec_lib.Message]]:
  """:func:`demonstration` for a batch of instances (leading axis), in one
  jitted rollout. Episode ``i`` uses ``jax.random.split(key, n)[i]``; the
  batch is padded to a power of two, so nearby sizes share one compile."""
  n = jax.tree.leaves(instances)[0].shape[0]
  if n == 0:
    return []
  size = max(8, 1 << (n - 1).bit_length())
  padded = jax.tree.map(lambda x: np.concatenate([x, np.repeat(x[-1:], size - n, 0)]),
                        jax.tree.map(np.asarray, instances))
  keys = jnp.concatenate([jax.random.split(key, n), jax.random.split(key, size - n)])
  trajs = jax.tree.map(np.asarray, batch_rollouts(env, padded, keys, strategy, noise))
  pick = lambda tree, i: jax.tree.map(lambda x: x[i], tree)
  return [env.codec.decode(trajectory_ids(env, pick(instances, i), pick(trajs, i)))
          for i in range(n)]
