r"""Benchmark: environment steps per second, jitted and vmapped.

  python -m experiments.bench_envs [--batch 1024] [--difficulty 0] \
      [--envs calc_chain,multihop,boxes,mixture] [--out runs/bench_envs.json]

For each environment, a batch of instances is generated once, then played
by the scripted reference policy inside one ``jit(vmap(...))`` (a
``lax.scan`` over ``max_turns`` steps of ``reference_action`` then
``step``); only the play is timed (the policy's action is included). Reported per
environment: compile time, wall time per batch (best of ``--repeats``),
``env_steps_per_s`` (steps taken by live episodes per second) and
``step_calls_per_s`` (every batched step call, finished episodes included),
plus the mean outcome as a sanity check. Printed and written as JSON.
"""

import json
import os
import time

import jax
from absl import app
from absl import flags

from agentic_rl.envs import registry
from agentic_rl.envs import scripted
from agentic_rl.text import default_codec
from experiments import common

_BATCH = flags.DEFINE_integer("batch", 1024, "Episodes per batch.")
_DIFFICULTY = flags.DEFINE_integer("difficulty", 0, "Difficulty level.")
_ENVS = flags.DEFINE_list("envs", ["calc_chain", "multihop", "boxes", "mixture"],
                          "Environments; 'mixture' mixes calc_chain and boxes.")
_STRATEGY = flags.DEFINE_integer("strategy", 0, "Scripted strategy index.")
_NOISE = flags.DEFINE_float("noise", 0.0, "Scripted mistake probability.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats (best is reported).")
_OUT = flags.DEFINE_string("out", "runs/bench_envs.json", "JSON output path.")


def bench(env, batch: int, difficulty: int, strategy: int, noise: float, repeats: int) -> dict:
  keys = jax.random.split(jax.random.key(0), batch)
  instances = jax.jit(jax.vmap(env.generate, in_axes=(0, None)), static_argnums=1)(
      keys, difficulty)

  @jax.jit
  def play(instances, key):
    traj = jax.vmap(lambda i, k: scripted.scripted_rollout(env, i, k, strategy, noise))(
        instances, jax.random.split(key, batch))
    return traj.live.sum(), scripted.episode_returns(traj)["outcome"].mean()

  start = time.perf_counter()
  jax.block_until_ready(play(instances, jax.random.key(0)))
  compile_s = time.perf_counter() - start
  times = []
  for r in range(repeats):
    start = time.perf_counter()
    steps, outcome = jax.block_until_ready(play(instances, jax.random.key(r + 1)))
    times.append(time.perf_counter() - start)
  best = min(times)
  return {
      "env": repr(env), "batch": batch, "difficulty": difficulty, "max_turns": env.max_turns,
      "compile_s": round(compile_s, 3), "batch_s": round(best, 4),
      "env_steps": int(steps), "env_steps_per_s": round(int(steps) / best, 1),
      "step_calls_per_s": round(batch * env.max_turns / best, 1),
      "mean_outcome": round(float(outcome), 4),
  }


def main(argv):
  del argv
  codec = default_codec()
  results = {}
  for name in _ENVS.value:
    if name == "mixture":
      env = registry.make_env("mixture", codec, members=("calc_chain", "boxes"))
    else:
      env = registry.make_env(name, codec)
    results[name] = bench(env, _BATCH.value, _DIFFICULTY.value, _STRATEGY.value,
                          _NOISE.value, _REPEATS.value)
    print(json.dumps({name: results[name]}), flush=True)
  report = {"device": str(jax.devices()[0]), "jax": jax.__version__,
            "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
            "results": results}
  common.write_json(_OUT.value, report)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
