"""Subprocess worker: the rollout engine with its rows split over devices.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 \
      python tests/rollout_devices.py

Multi-turn calc-chain episodes (two scripted tool calls, then sampling) for 4
prompts x 2 samples on the tiny transformer, produced three ways: on one
device; split over 4 devices as a partial rollout, stopped after 40 tokens
and resumed; in one call by the training loop's engine on a ``data=2,
tensor=2`` mesh (rows split over ``data``, replicated over ``tensor``),
which has group size 1 and takes every prompt repeated. Then the first 2
prompts x 4 samples: with group size 4 split over 4 devices (each group's
prefill shared by its 2 rows on each device; and with the decode steps
reading the shared prompt cache, ``decode_shared_prefix``), and by the
loop's engine.
Prints each rollout's arrays (and how many devices hold them) as one JSON
line.
"""

import json

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from agentic_rl import rollout
from agentic_rl.train import run as train_run
from agentic_rl.train import sharding
from calc_batch import SAMPLING, calc_chain_batch

NUM_PROMPTS, G = 4, 2
FIELDS = ("tokens_BxT", "loss_mask_BxT", "behaviour_logp_BxT", "version_BxT",
          "reward_B", "done_B", "truncated_B", "num_tool_calls_B")


def main():
  s = calc_chain_batch(NUM_PROMPTS)
  codec, env, config, params = s["codec"], s["env"], s["config"], s["params"]
  inputs, script, instances = s["inputs"], s["script"], s["instances"]
  key = jax.random.key(7)

  def engine(row_sharding, group_size=G, **kwargs):
    return rollout.RolloutEngine(config, SAMPLING, codec.ids, env=env,
                                 batch_size=NUM_PROMPTS * G, group_size=group_size,
                                 row_sharding=row_sharding, **kwargs)

  mesh = jax.make_mesh((4,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
  split = engine(NamedSharding(mesh, P("rows")))
  out = {"one_device": engine(None).rollout(params, *inputs, key, 0, **script)}
  state = split.resume(params, split.init_state(*inputs, key, **script), 0,
                       max_steps=40)
  unfinished = int(np.sum(~np.asarray(state.ended_B)))
  out["partial_four_devices"] = split.resume(params, state, 0).to_rollout()

  # The training loop splits its rows over the batch axes of its mesh.
  cfg = ml_collections.ConfigDict({"sampling": {"decode_shared_prefix": False}})
  run = train_run.Run(cfg=cfg, codec=codec, env=env, tasks=None, model_config=config,
                 mesh=sharding.make_mesh(sharding.MeshConfig(data=2, tensor=2)))
  loop_engine = run.collector.engine(SAMPLING, NUM_PROMPTS * G)
  rep = lambda x: np.repeat(x, G, axis=0)
  out["loop_engine"] = loop_engine.rollout(
      params, rep(inputs[0]), rep(inputs[1]), jax.tree.map(rep, instances), key, 0,
      **{k: rep(v) for k, v in script.items()})

  first2 = lambda x: np.asarray(x)[:2]  # noqa: E731
  inputs2, script2 = jax.tree.map(first2, (inputs, script))
  out["group_split_four_devices"] = engine(NamedSharding(mesh, P("rows")), 4).rollout(
      params, *inputs2, key, 0, **script2)
  out["group_split_shared_decode"] = engine(
      NamedSharding(mesh, P("rows")), 4, decode_shared_prefix=True).rollout(
          params, *inputs2, key, 0, **script2)
  rep4 = lambda x: np.repeat(x, 4, axis=0)  # noqa: E731
  out["loop_engine_groups_of_4"] = loop_engine.rollout(
      params, *jax.tree.map(rep4, inputs2), key, 0, **jax.tree.map(rep4, script2))

  result = {name: {"devices": len(ro.tokens_BxT.sharding.device_set),
                   **{f: np.asarray(getattr(ro, f)).tolist() for f in FIELDS}}
            for name, ro in out.items()}
  result["unfinished_after_40"] = unfinished
  result["loop_row_sharding"] = str(loop_engine.row_sharding.spec)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
