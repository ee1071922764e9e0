"""Episode limits, greedy and truncated sampling, plain generation, no-jit."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import model as model_lib
from agentic_rl import rollout
from agentic_rl.envs.base import StepOutput
from agentic_rl.text import default_codec, pad_batch


class EchoEnv:
  """A minimal in-jit environment: a tool call returns ``[len, 7]``, an answer
  ends the episode with reward 1."""

  name = "echo"
  max_obs_len = 2
  max_action_len = 4

  def __init__(self, ids):
    self.ids = ids

  def reset(self, instance):
    return {"steps": jnp.zeros((), jnp.int32), "target": instance}

  def step(self, state, action_A, action_len):
    last = action_A[jnp.maximum(action_len - 1, 0)]
    answer = last == self.ids.answer_close
    call = last == self.ids.tool_call_close
    out = StepOutput(
        obs_A=jnp.stack([action_len, jnp.int32(7)]).astype(jnp.int32) + 20,
        obs_len=jnp.where(call, 2, 0).astype(jnp.int32),
        reward=answer.astype(jnp.float32),
        reward_components={"outcome": answer.astype(jnp.float32)},
        done=answer | ~call, truncated=jnp.zeros((), bool),
        info={"call_hash": jnp.where(call, action_len, -1).astype(jnp.int32),
              "tool_error": jnp.zeros((), bool)})
    return {"steps": state["steps"] + 1, "target": state["target"]}, out


@pytest.fixture(scope="module")
def setup():
  codec = default_codec()
  config = model_lib.TransformerConfig.tiny(vocab_size=codec.tokenizer.vocab_size)
  return codec, config, model_lib.init_params(config, jax.random.key(0))


def _ids(codec, text):
  return codec.tokenizer.encode(text)


def test_turn_token_and_total_limits(setup):
  codec, config, params = setup
  sampling = rollout.SamplingConfig(max_new_tokens_per_turn=4, max_turns=2,
                                    max_total_tokens=24)
  engine = rollout.RolloutEngine(config, sampling, codec.ids,
                                 env=EchoEnv(codec.ids), batch_size=4)
  x = codec.ids
  call = [x.tool_call_open, 30, x.tool_call_close]
  scripts = [
      [30, 31, 32, 33, 34],                   # no stop: 4 tokens, then cut
      call * 3,                               # a third call is over max_turns
      call * 2,                               # the observation will not fit
      [x.answer_open, 30, x.answer_close],    # answers: done, reward 1
  ]
  prompt_lens = [3, 3, 17, 3]
  prompts = pad_batch([np.full((n,), 40, np.int32) for n in prompt_lens], 17)
  out = engine.rollout(params, prompts, prompt_lens, jnp.zeros((4,)),
                       jax.random.key(0), 0,
                       script_PxS=pad_batch([np.array(s) for s in scripts], 9),
                       script_len_P=[len(s) for s in scripts])
  chex.assert_shape([out.tokens_BxT, out.loss_mask_BxT, out.turn_BxT], (4, 24))
  chex.assert_shape(out.call_hashes_BxC, (4, 2))
  np.testing.assert_array_equal(out.truncated_B, [True, True, True, False])
  np.testing.assert_array_equal(out.done_B, [False, False, False, True])
  np.testing.assert_array_equal(out.reward_B, [0, 0, 0, 1])
  np.testing.assert_array_equal(out.reward_components["outcome"], [0, 0, 0, 1])
  tokens = np.asarray(out.tokens_BxT)
  framed = [x.tool_result_open, 23, 27, x.tool_result_close]
  # Row 1's second call is its last allowed turn: no observation follows.
  np.testing.assert_array_equal(out.length_B, [3 + 4, 3 + 3 + 4 + 3, 17 + 3, 3 + 3])
  np.testing.assert_array_equal(tokens[0, 3:7], scripts[0][:4])
  np.testing.assert_array_equal(tokens[1, 3:13], call + framed + call)
  np.testing.assert_array_equal(out.num_turns_B, [1, 2, 1, 1])
  np.testing.assert_array_equal(out.num_tool_calls_B, [0, 2, 1, 0])
  np.testing.assert_array_equal(out.call_hashes_BxC, [[-1, -1], [3, 3], [3, -1], [-1, -1]])
  np.testing.assert_array_equal(
      out.turn_BxT[1, :13], [0] * 3 + [1] * 3 + [1] * 4 + [2] * 3)
  assert int(np.max(np.asarray(out.length_B))) <= sampling.max_total_tokens


def test_truncated_sampling_records_the_truncated_distribution(setup):
  codec, config, params = setup
  sampling = rollout.SamplingConfig(temperature=0.7, top_k=20, top_p=0.8,
                                    max_new_tokens_per_turn=12, max_total_tokens=16)
  engine = rollout.RolloutEngine(config, sampling, codec.ids, batch_size=4,
                                 group_size=2)
  prompts = np.array([[2, 5, 40, 41], [2, 5, 42, 0]], np.int32)
  out = engine.rollout(params, prompts, [4, 3], None, jax.random.key(3), 0)
  mask = np.asarray(out.loss_mask_BxT) > 0
  logp = np.asarray(out.behaviour_logp_BxT)
  truncated = np.asarray(rollout.learner_logprobs(params, out.tokens_BxT, config,
                                                  sampling))
  np.testing.assert_allclose(logp[mask], truncated[mask], atol=1e-5)
  jitted = jax.jit(rollout.learner_logprobs, static_argnums=(2, 3))(
      params, out.tokens_BxT, config, sampling)
  np.testing.assert_allclose(jitted, truncated, atol=1e-6)
  full = np.asarray(rollout.learner_logprobs(
      params, out.tokens_BxT, config, rollout.SamplingConfig(temperature=0.7)))
  # Renormalising over the kept tokens raises every log-prob.
  assert np.all(logp[mask] >= full[mask] - 1e-6)
  assert np.max(logp[mask] - full[mask]) > 0.05
  assert np.all(np.isfinite(logp))


def test_greedy_plain_generation(setup):
  """ids=None: no stop tokens, every row writes max_new_tokens_per_turn."""
  codec, config, params = setup
  sampling = rollout.SamplingConfig(greedy=True, max_new_tokens_per_turn=5,
                                    max_total_tokens=10)
  engine = rollout.RolloutEngine(config, sampling, None, batch_size=4, group_size=2)
  prompts = np.array([[2, 5, 40, 41], [2, 5, 42, 0]], np.int32)
  out = engine.rollout(params, prompts, [4, 3], None, jax.random.key(3), 2)
  np.testing.assert_array_equal(out.length_B, [9, 9, 8, 8])
  np.testing.assert_array_equal(out.truncated_B, [True] * 4)
  tokens = np.asarray(out.tokens_BxT)
  np.testing.assert_array_equal(tokens[0], tokens[1])  # greedy: one answer
  np.testing.assert_array_equal(tokens[2], tokens[3])
  mask = np.asarray(out.loss_mask_BxT)
  np.testing.assert_array_equal(mask.sum(1), [5, 5, 5, 5])
  np.testing.assert_array_equal(np.asarray(out.behaviour_logp_BxT), 0.0)
  np.testing.assert_array_equal(np.asarray(out.entropy_BxT), 0.0)
  np.testing.assert_array_equal(np.asarray(out.version_BxT)[mask > 0], 2)
  # Greedy tokens are the argmax of a teacher-forced pass.
  logits = model_lib.forward(params, out.tokens_BxT, config)
  argmax = np.asarray(jnp.argmax(logits[:, :-1], -1))
  np.testing.assert_array_equal(tokens[:, 1:][mask[:, 1:] > 0],
                                argmax[mask[:, 1:] > 0])


def test_sampled_stop_ends_a_single_turn_episode(setup):
  """Without an environment a stop id ends the episode as done."""
  codec, config, params = setup
  sampling = rollout.SamplingConfig(max_new_tokens_per_turn=2, max_total_tokens=8)
  engine = rollout.RolloutEngine(config, sampling, codec.ids, batch_size=2)
  x = codec.ids
  out = engine.rollout(params, np.array([[2, 5], [2, 5]]), [2, 2], None,
                       jax.random.key(0), 0, script_PxS=[[30, x.end], [30, 31]],
                       script_len_P=[2, 2])
  np.testing.assert_array_equal(out.done_B, [True, False])
  np.testing.assert_array_equal(out.truncated_B, [False, True])
  np.testing.assert_array_equal(out.length_B, [4, 4])


def test_engine_config_errors(setup):
  codec, config, params = setup
  sampling = rollout.SamplingConfig()
  with pytest.raises(ValueError, match="group size 3 does not divide the batch size 4"):
    rollout.RolloutEngine(config, sampling, codec.ids, batch_size=4, group_size=3)
  with pytest.raises(ValueError, match="batch_size"):
    rollout.RolloutEngine(config, sampling, codec.ids, batch_size=0)
  with pytest.raises(ValueError, match="temperature"):
    rollout.RolloutEngine(config, rollout.SamplingConfig(temperature=0.0),
                          codec.ids, batch_size=1)
  with pytest.raises(ValueError, match="format ids"):
    rollout.RolloutEngine(config, sampling, None, env=EchoEnv(codec.ids),
                          batch_size=1)
  engine = rollout.RolloutEngine(config, rollout.SamplingConfig(max_total_tokens=8),
                                 codec.ids, batch_size=1)
  prompt = (np.array([[2, 5]]), [2], None)
  with pytest.raises(ValueError, match="key must be one PRNG key"):
    engine.rollout(params, *prompt, 0, 0)
  with pytest.raises(ValueError, match="version must be an int"):
    engine.rollout(params, *prompt, jax.random.key(0), 0.5)
  with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
    engine.rollout(params, np.array([[2, 600]]), [2], None, jax.random.key(0), 0)
  small = model_lib.TransformerConfig.tiny(vocab_size=8)
  with pytest.raises(ValueError, match="outside the model's vocabulary"):
    rollout.RolloutEngine(small, sampling, codec.ids, batch_size=1)
