"""A small multi-turn batch shared by the rollout tests and their workers.

The tiny policy on calc-chain tasks (three-operation chains), ``P`` prompts,
a script of two tool calls after which the policy samples, and the sampling
limits the tests run them under.
"""

import jax
import numpy as np

from agentic_rl import envs
from agentic_rl import model as model_lib
from agentic_rl import rollout
from agentic_rl.envs import prompts as prompts_lib
from agentic_rl.envs.calc_chain import CalcLevel
from agentic_rl.text import default_codec, pad_batch

SAMPLING = rollout.SamplingConfig(max_new_tokens_per_turn=32, max_turns=8,
                                  max_total_tokens=128)


def calc_chain_batch(P: int) -> dict:
  """``codec``, ``env``, ``config``, ``params``, ``instances`` (leading axis
  P), ``inputs`` (prompts, lengths, instances: the engine's arguments) and
  ``script`` (``script_PxS`` and ``script_len_P`` keyword arguments)."""
  codec = default_codec()
  env = envs.make_env("calc_chain", codec, max_action_len=32,
                      levels=(CalcLevel(3, 2, 1),))
  config = model_lib.TransformerConfig.tiny(vocab_size=codec.tokenizer.vocab_size)
  instances = jax.jit(jax.vmap(lambda k: env.generate(k, 0)))(
      jax.random.split(jax.random.key(1), P))
  prompts = [codec.encode_prompt(prompts_lib.prompt_messages(
      env, jax.tree.map(lambda x: x[i], instances))) for i in range(P)]
  call_ids = codec.tokenizer.encode(
      "<tool_call>calc 12+3</tool_call><tool_call>calc 4*5</tool_call>")
  return dict(
      codec=codec, env=env, config=config,
      params=model_lib.init_params(config, jax.random.key(0)),
      instances=instances,
      inputs=(pad_batch(prompts, max(map(len, prompts))),
              np.array([len(p) for p in prompts], np.int32), instances),
      script=dict(script_PxS=np.tile(np.asarray(call_ids, np.int32), (P, 1)),
                  script_len_P=np.full((P,), len(call_ids), np.int32)))
