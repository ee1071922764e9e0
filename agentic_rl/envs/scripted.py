"""Scripted episodes: jittable rollouts of the reference policies, and
demonstrations built from them for SFT warm starts (conversations, or token
streams with loss masks).

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
from agentic_rl.envs import tasks as tasks_lib
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


def demonstration_batch(tasks: tasks_lib.Tasks, num_demos: int, key: jax.Array, *,
                        noise: float, max_len: int, max_action_len: int | None = None,
                        strategy_weights: dict[str, tuple[float, ...]] | None = None,
                        ) -> dict[str, np.ndarray]:
  """Scripted demonstrations of ``tasks``' environment as token streams with
  loss masks: ``tokens_BxT`` int32 and ``loss_mask_BxT`` float32, ``[N, T]``
  with ``T = max_len``.

  Each member of a mixture contributes in proportion to its weight (about
  ``num_demos`` in all), with its scripted strategies in equal shares (or in
  the shares ``strategy_weights[member.name]`` gives, one weight per entry of
  ``member.strategies``) and ``noise`` (wrong steps, early answers), so a
  policy trained on them is competent but imperfect. A demonstration is
  exactly the stream the rollout engine would record for the scripted
  actions: prompt (mask 0), actions (mask 1) and framed observations (mask
  0); streams longer than ``max_len``, or with an action longer than
  ``max_action_len`` (the policy's tokens per turn; None: the
  environment's), are left out: the engine could not record them. Instances
  come from ``key``'s own stream, at the pool's difficulty levels
  (``tasks.difficulty_of``).
  """
  env = tasks.env
  ids = env.codec.ids
  rows, masks, played = [], [], 0
  members = getattr(env, "envs", (env,))
  weights = getattr(env, "weights", (1.0,))
  strategy_weights = strategy_weights or {}
  for f, (member, w) in enumerate(zip(members, weights)):
    shares = np.asarray(strategy_weights.get(member.name) or [1.0] * len(member.strategies),
                        np.float64)
    if shares.shape != (len(member.strategies),) or np.any(shares < 0) or not shares.sum():
      raise ValueError(f"strategy weights of {member.name} must be {len(member.strategies)} "
                       f"non-negative numbers, one per strategy {member.strategies}, not all "
                       f"0; got {tuple(shares)}")
    shares = shares / shares.sum()
    for s in range(len(member.strategies)):
      per_strategy = int(np.ceil(round(num_demos * w) * shares[s] - 1e-9))
      if not per_strategy:
        continue
      played += per_strategy
      k_inst, k_play = jax.random.split(jax.random.fold_in(jax.random.fold_in(key, f), s))
      inst = tasks_lib.generate_levels(member, jax.random.split(k_inst, per_strategy),
                                       tasks.difficulty_of(np.arange(per_strategy)))
      prompt_ids, plens = tasks_lib.encode_prompts(member, inst, max_len)
      traj = batch_rollouts(member, inst, jax.random.split(k_play, per_strategy),
                            strategy=s, noise=noise)
      framed, framed_len = codec_lib.frame_observation(traj.obs, traj.obs_lens, ids)
      traj, framed, framed_len = jax.tree.map(np.asarray, (traj, framed, framed_len))
      for i in range(per_strategy):
        seg_ids, seg_mask = [prompt_ids[i, :plens[i]]], [np.zeros(plens[i], np.float32)]
        for t in np.flatnonzero(traj.live[i]):
          n_act, n_obs = traj.action_lens[i, t], framed_len[i, t] if traj.obs_lens[i, t] else 0
          seg_ids += [traj.actions[i, t, :n_act], framed[i, t, :n_obs]]
          seg_mask += [np.ones(n_act, np.float32), np.zeros(n_obs, np.float32)]
        row = np.concatenate(seg_ids)
        longest_action = traj.action_lens[i][traj.live[i]].max(initial=0)
        if len(row) <= max_len and (max_action_len is None or longest_action <= max_action_len):
          rows.append(row)
          masks.append(np.concatenate(seg_mask))
  if not played:
    raise ValueError(f"num_demos={num_demos} gives no task family a demonstration (a family "
                     f"plays round(num_demos * its weight)); raise num_demos")
  if not rows:
    limit = "" if max_action_len is None else f" with actions of at most {max_action_len} tokens"
    raise ValueError(f"no demonstration fits in max_len={max_len}{limit}")
  return {"tokens_BxT": codec_lib.pad_batch(rows, max_len, ids.pad),
          "loss_mask_BxT": codec_lib.pad_batch(masks, max_len, 0.0)}
