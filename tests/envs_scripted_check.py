"""Shared checks for the task-family tests: scripted rollouts in batches.

Every batch has the same shape, so each family compiles its rollout once
(``scripted.batch_rollouts`` caches on the environment and shapes) and the
demonstrations reuse it.
"""

import jax
import numpy as np

from agentic_rl.envs import prompts
from agentic_rl.envs import scripted

B = 256  # episodes per batch (a power of two: demonstrations() pads to one)
N = 1024  # instances per level and strategy


def instances(env, seed: int, level: int, n: int = B):
  keys = jax.random.split(jax.random.key(seed), n)
  return _generate(env, keys, level)


_generate = jax.jit(lambda env, keys, level: jax.vmap(lambda k: env.generate(k, level))(keys),
                    static_argnames="env")


def play(env, insts, seed: int, strategy=0, noise=0.0) -> dict[str, np.ndarray]:
  """Per-episode totals of one batch played by the scripted policy."""
  traj = scripted.batch_rollouts(env, insts, jax.random.split(jax.random.key(seed), B),
                                 strategy, noise)
  out = {k: np.asarray(v) for k, v in scripted.episode_returns(traj).items()}
  final = jax.tree.map(lambda x: np.asarray(x), traj.final_state)
  out.update(calls=final.tool_calls, tokens=final.policy_tokens,
             strategy_hash=final.strategy_hash, ended=final.done | final.truncated,
             truncated=final.truncated, tool_errors=final.tool_errors)
  return out


def check_reference_policies(env) -> dict[tuple[int, str], float]:
  """Every strategy scores outcome 1 and format 1 on ``N`` instances of every
  level; returns the mean number of tool calls per (level, strategy)."""
  calls = {}
  for level in range(env.num_levels):
    for s, name in enumerate(env.strategies):
      got = []
      for chunk in range(N // B):
        seed = 1000 * level + chunk
        r = play(env, instances(env, seed, level), seed, s)
        bad = np.flatnonzero(r["outcome"] < 1)
        assert not len(bad), f"{env.name} level {level} {name}: {len(bad)} failures"
        assert (r["format"] == 1).all() and r["ended"].all() and not r["truncated"].any()
        got.append(r["calls"])
      calls[level, name] = float(np.concatenate(got).mean())
  return calls


def check_demonstrations(env, level: int, noise: float):
  """Demonstrations are exactly the rollout's token stream, and well formed.

  Returns, per strategy, the total token counts (prompt included).
  """
  insts = instances(env, 7, level)
  lengths = {}
  for s, name in enumerate(env.strategies):
    key = jax.random.key(s)
    demos = scripted.demonstrations(env, insts, key, strategy=s, noise=noise)
    traj = scripted.batch_rollouts(env, insts, jax.random.split(key, B), s, noise)
    for i in range(0, B, 25):
      inst = jax.tree.map(lambda x: x[i], insts)
      row = jax.tree.map(lambda x: x[i], traj)
      ids = scripted.trajectory_ids(env, inst, row)
      enc = env.codec.encode(demos[i])
      np.testing.assert_array_equal(enc.ids, ids)
      assert demos[i][:2] == prompts.prompt_messages(env, inst)
      assert demos[i][-1].role == "assistant" and demos[i][-1].content.startswith("<answer>")
      roles = [m.role for m in demos[i][2:]]
      for a, b in zip(roles, roles[1:]):
        assert (a == "tool_call") == (b == "tool_result"), roles
      lengths.setdefault(name, []).append(len(ids))
  return {k: np.asarray(v) for k, v in lengths.items()}
