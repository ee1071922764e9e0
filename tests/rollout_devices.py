"""Subprocess worker: the rollout engine with its rows split over devices.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 \
      python tests/rollout_devices.py

Multi-turn calc-chain episodes (two scripted tool calls, then sampling) for 4
prompts x 2 samples on the tiny transformer, produced three ways: on one
device; split over 4 devices as a partial rollout, stopped after 40 tokens
and resumed; and in one call by the training loop's engine on a
``data=2, tensor=2`` mesh (rows split over ``data``, replicated over
``tensor``). Prints each rollout's arrays (and how many devices hold them) as
one JSON line.
"""

import json

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from agentic_rl import envs
from agentic_rl import model as model_lib
from agentic_rl import rollout
from agentic_rl.envs import prompts as prompts_lib
from agentic_rl.envs.calc_chain import CalcLevel
from agentic_rl.text import default_codec, pad_batch
from agentic_rl.train import loop
from agentic_rl.train import sharding

NUM_PROMPTS, G = 4, 2
SAMPLING = rollout.SamplingConfig(max_new_tokens_per_turn=32, max_turns=8,
                                  max_total_tokens=128)
FIELDS = ("tokens_BxT", "loss_mask_BxT", "behaviour_logp_BxT", "version_BxT",
          "reward_B", "done_B", "truncated_B", "num_tool_calls_B")


def main():
  codec = default_codec()
  env = envs.make_env("calc_chain", codec, max_action_len=32,
                      levels=(CalcLevel(3, 2, 1),))
  config = model_lib.TransformerConfig.tiny(vocab_size=codec.tokenizer.vocab_size)
  params = model_lib.init_params(config, jax.random.key(0))
  instances = jax.jit(jax.vmap(lambda k: env.generate(k, 0)))(
      jax.random.split(jax.random.key(1), NUM_PROMPTS))
  prompts = [codec.encode_prompt(prompts_lib.prompt_messages(
      env, jax.tree.map(lambda x: x[i], instances))) for i in range(NUM_PROMPTS)]
  inputs = (pad_batch(prompts, max(map(len, prompts))),
            np.array([len(p) for p in prompts], np.int32), instances)
  call_ids = codec.tokenizer.encode(
      "<tool_call>calc 12+3</tool_call><tool_call>calc 4*5</tool_call>")
  script = dict(script_PxS=np.tile(np.asarray(call_ids, np.int32), (NUM_PROMPTS, 1)),
                script_len_P=np.full((NUM_PROMPTS,), len(call_ids), np.int32))
  key = jax.random.key(7)

  def engine(row_sharding):
    return rollout.RolloutEngine(config, SAMPLING, codec.ids, env=env,
                                 batch_size=NUM_PROMPTS * G, group_size=G,
                                 row_sharding=row_sharding)

  mesh = jax.make_mesh((4,), ("rows",), axis_types=(jax.sharding.AxisType.Auto,))
  split = engine(NamedSharding(mesh, P("rows")))
  out = {"one_device": engine(None).rollout(params, *inputs, key, 0, **script)}
  state = split.resume(params, split.init_state(*inputs, key, **script), 0,
                       max_steps=40)
  unfinished = int(np.sum(~np.asarray(state.ended_B)))
  out["partial_four_devices"] = split.resume(params, state, 0).to_rollout()

  # The training loop splits its rows over the batch axes of its mesh.
  run = loop.Run(cfg=None, codec=codec, env=env, tasks=None, model_config=config,
                 mesh=sharding.make_mesh(sharding.MeshConfig(data=2, tensor=2)))
  loop_engine = run.engine(SAMPLING, NUM_PROMPTS * G)
  rep = lambda x: np.repeat(x, G, axis=0)
  out["loop_engine"] = loop_engine.rollout(
      params, rep(inputs[0]), rep(inputs[1]), jax.tree.map(rep, instances), key, 0,
      **{k: rep(v) for k, v in script.items()})

  result = {name: {"devices": len(ro.tokens_BxT.sharding.device_set),
                   **{f: np.asarray(getattr(ro, f)).tolist() for f in FIELDS}}
            for name, ro in out.items()}
  result["unfinished_after_40"] = unfinished
  result["loop_row_sharding"] = str(loop_engine.row_sharding.spec)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
