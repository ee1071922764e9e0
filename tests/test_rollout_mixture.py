"""One jitted rollout over a batch that mixes task families (MixtureEnv)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.invariants import shift
from agentic_rl import envs
from agentic_rl import model as model_lib
from agentic_rl import rollout
from agentic_rl.envs import prompts as prompts_lib
from agentic_rl.envs import tokens as T
from agentic_rl.envs import tools
from agentic_rl.text import default_codec, pad_batch


@pytest.mark.slow
def test_mixed_families_in_one_batch():
  codec = default_codec()
  env = envs.make_env("mixture", codec, members=("calc_chain", "multihop", "boxes"))
  P, G = 3, 2
  instances = jax.jit(jax.vmap(lambda k: env.generate(k, 0)))(
      jax.random.split(jax.random.key(0), P))
  instances = instances.replace(family=jnp.arange(P, dtype=jnp.int32))
  rows = [jax.tree.map(lambda x: x[i], instances) for i in range(P)]
  prompts = [codec.encode_prompt(prompts_lib.prompt_messages(env, r)) for r in rows]
  config = model_lib.TransformerConfig.tiny(vocab_size=codec.tokenizer.vocab_size)
  params = model_lib.init_params(config, jax.random.key(1))
  sampling = rollout.SamplingConfig(max_new_tokens_per_turn=24, max_turns=4,
                                    max_total_tokens=128)
  engine = rollout.RolloutEngine(config, sampling, codec.ids, env=env,
                                 batch_size=P * G, group_size=G)
  # Every family has the calculator: one scripted call, then sampling.
  call = np.asarray(codec.tokenizer.encode("<tool_call>calc 6*7</tool_call>"), np.int32)
  out = engine.rollout(params, pad_batch(prompts, max(map(len, prompts))),
                       [len(p) for p in prompts], instances, jax.random.key(2), 0,
                       script_PxS=np.tile(call, (P, 1)),
                       script_len_P=np.full((P,), len(call)))
  assert bool(np.all(out.finished_B))
  hashes = np.asarray(out.call_hashes_BxC)
  assert np.all(hashes[:, 0] == hashes[0, 0]) and hashes[0, 0] != -1
  assert set(out.reward_components) >= {"outcome", "format"}
  # The environment's time: at least the scripted calculator call's declared
  # latency. An episode its environment ended carries the budget's unused
  # share as its time efficiency; one the engine's limits cut, no component.
  seconds = np.asarray(out.env_seconds_B)
  assert seconds.dtype == np.float32 and (seconds >= tools.latencies()[T.CALC]).all()
  share = 1 - seconds / env.envs[0].rewards.time_budget_s
  time_part = np.asarray(out.reward_components["efficiency_time"])
  ended_by_env = time_part > 0
  assert ended_by_env.any()
  np.testing.assert_allclose(time_part[ended_by_env], share[ended_by_env], rtol=1e-6)
  for b in range(P * G):
    n = int(out.length_B[b])
    text = codec.tokenizer.decode(np.asarray(out.tokens_BxT[b, :n]))
    assert "<tool_call>calc 6*7</tool_call><tool_result>42</tool_result>" in text
  learner = rollout.learner_logprobs(params, out.tokens_BxT, config, sampling)
  m = shift.mismatch_metrics(out.behaviour_logp_BxT, learner, out.loss_mask_BxT)
  assert float(m["logprob_mismatch_max"]) < 1e-5
