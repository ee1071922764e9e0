"""The jitted multi-turn engine on a real in-jit environment (calc chains)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.invariants import shift
from agentic_rl import model as model_lib
from agentic_rl import rollout
from agentic_rl.envs import scripted
from agentic_rl.model import scoring
from agentic_rl.text import pad_batch
from calc_batch import SAMPLING, calc_chain_batch

P, G = 2, 2


def _row(tree, i):
  return jax.tree.map(lambda x: x[i], tree)


@pytest.fixture(scope="module")
def setup():
  # Three-operation chains: the stepwise script makes three calls, then answers.
  s = calc_chain_batch(P)
  env, instances = s["env"], s["instances"]
  traj = scripted.batch_rollouts(env, instances, jax.random.split(jax.random.key(2), P))
  t = jax.tree.map(np.asarray, traj)
  actions = [[t.actions[i, s, :t.action_lens[i, s]] for s in np.flatnonzero(t.live[i])]
             for i in range(P)]
  engine = rollout.RolloutEngine(s["config"], SAMPLING, s["codec"].ids, env=env,
                                 batch_size=P * G, group_size=G)
  return dict(s, traj=traj, actions=actions, engine=engine, prompts=s["inputs"][0],
              prompt_len=s["inputs"][1])


def _script(actions, n_actions=None):
  rows = [np.concatenate(a[:n_actions]) for a in actions]
  return pad_batch(rows, max(map(len, rows))), np.array([len(r) for r in rows])


@pytest.fixture(scope="module")
def scripted_out(setup):
  s = setup
  script, script_len = _script(s["actions"])
  return s["engine"].rollout(s["params"], s["prompts"], s["prompt_len"],
                             s["instances"], jax.random.key(5), 3,
                             script_PxS=script, script_len_P=script_len)


def test_scripted_policy_reaches_the_reference_rewards(setup, scripted_out):
  s, out = setup, scripted_out
  B, T = P * G, SAMPLING.max_total_tokens
  chex.assert_shape(out.tokens_BxT, (B, T))
  chex.assert_type([out.tokens_BxT, out.turn_BxT, out.version_BxT], jnp.int32)
  chex.assert_type([out.loss_mask_BxT, out.behaviour_logp_BxT, out.reward_B],
                   jnp.float32)
  ref = jax.tree.map(np.asarray, scripted.episode_returns(s["traj"]))
  group = lambda x: np.asarray(x).reshape((P, G) + np.shape(x)[1:])
  for g in range(G):
    np.testing.assert_allclose(group(out.reward_B)[:, g], ref["reward"], rtol=1e-6)
    for k, v in out.reward_components.items():
      np.testing.assert_allclose(group(v)[:, g], ref[k], rtol=1e-6, atol=1e-7)
  assert bool(np.all(out.done_B)) and not bool(np.any(out.truncated_B))
  assert bool(np.all(out.finished_B))
  t = jax.tree.map(np.asarray, s["traj"])
  for i in range(P):
    live = np.flatnonzero(t.live[i])
    # The engine builds exactly the token stream the environment defines.
    ids = scripted.trajectory_ids(s["env"], _row(s["instances"], i), _row(s["traj"], i))
    for b in (i * G, i * G + 1):
      n = int(out.length_B[b])
      np.testing.assert_array_equal(np.asarray(out.tokens_BxT[b, :n]), ids)
      assert np.all(np.asarray(out.tokens_BxT[b, n:]) == s["codec"].ids.pad)
      assert int(out.num_turns_B[b]) == len(live) >= 4
      assert int(out.num_tool_calls_B[b]) == len(live) - 1
      assert int(out.num_tool_errors_B[b]) == 0
      hashes = t.outputs.info["call_hash"][i, live]
      np.testing.assert_array_equal(out.call_hashes_BxC[b, :len(live)], hashes)
      assert np.all(np.asarray(out.call_hashes_BxC[b, len(live):]) == -1)
      # Each environment step's reward, in order (the turn rewards of REBN).
      np.testing.assert_allclose(out.turn_rewards_BxC[b, :len(live)],
                                 t.outputs.reward[i, live], rtol=1e-6)
      assert np.all(np.asarray(out.turn_rewards_BxC[b, len(live):]) == 0)


def test_loss_mask_and_turns_agree_with_the_codec(setup, scripted_out):
  """Mask 1 exactly on policy tokens over 4 turns with 3 tool results."""
  codec, out = setup["codec"], scripted_out
  for b in range(P * G):
    n = int(out.length_B[b])
    ids = np.asarray(out.tokens_BxT[b, :n])
    assert int(np.sum(ids == codec.ids.tool_result_open)) == 3
    enc = codec.encode(codec.decode(ids))
    np.testing.assert_array_equal(enc.ids, ids)
    mask = np.asarray(out.loss_mask_BxT[b])
    np.testing.assert_array_equal(mask[:n], enc.loss_mask)
    assert not mask[n:].any()
    np.testing.assert_array_equal(np.asarray(out.turn_BxT[b, :n]), enc.turn_ids)
    np.testing.assert_array_equal(np.asarray(out.version_BxT[b]),
                                  np.where(mask > 0, 3, -1))
    logp = np.asarray(out.behaviour_logp_BxT[b])
    assert np.all(logp[mask == 0] == 0) and np.all(logp[mask > 0] < 0)


@jax.jit
def _learner_and_entropy(params, tokens_BxT):
  config = model_lib.TransformerConfig.tiny(vocab_size=512)
  logp = rollout.learner_logprobs(params, tokens_BxT, config, SAMPLING)
  return logp, scoring.sequence_logprobs(params, tokens_BxT, config)[1]


def test_behaviour_logprobs_equal_the_learner_recompute(setup):
  """Temperature 1, no truncation: two scripted calls, then sampling."""
  s = setup
  assert s["config"] == model_lib.TransformerConfig.tiny(vocab_size=512)
  out = s["engine"].rollout(s["params"], s["prompts"], s["prompt_len"],
                            s["instances"], jax.random.key(7), 0, **s["script"])
  learner, ent = _learner_and_entropy(s["params"], out.tokens_BxT)
  m = shift.mismatch_metrics(out.behaviour_logp_BxT, learner, out.loss_mask_BxT)
  assert float(m["logprob_mismatch_max"]) < 1e-5
  assert float(m["logprob_mismatch_mean"]) < 1e-6
  assert abs(float(m["kl_behaviour_learner"])) < 1e-9
  # Entropies are those of the learner's distributions too.
  mask = np.asarray(out.loss_mask_BxT) > 0
  np.testing.assert_allclose(np.asarray(out.entropy_BxT)[mask],
                             np.asarray(ent)[mask], atol=1e-4)
  # The two samples of a prompt share it and then differ.
  tokens = np.asarray(out.tokens_BxT)
  n = int(s["prompt_len"][0])
  np.testing.assert_array_equal(tokens[0, :n], tokens[1, :n])
  assert not np.array_equal(tokens[0], tokens[1])
  # Sampled tokens follow the scripted calls and their tool results.
  assert np.all(np.asarray(out.num_turns_B) >= 3)
  text = s["codec"].tokenizer.decode(tokens[0, :int(out.length_B[0])])
  assert "<tool_call>calc 12+3</tool_call><tool_result>15</tool_result>" \
         "<tool_call>calc 4*5</tool_call><tool_result>20</tool_result>" in text


def test_temperature_override_equals_an_engine_built_at_that_temperature(setup):
  """A temperature schedule passes the value per call, without recompiling."""
  s = setup
  args = (s["params"], s["prompts"], s["prompt_len"], s["instances"], jax.random.key(3), 0)
  got = s["engine"].rollout(*args, temperature=0.6)
  hot = rollout.RolloutEngine(s["config"], dataclasses.replace(SAMPLING, temperature=0.6),
                              s["codec"].ids, env=s["engine"].env,
                              batch_size=s["engine"].batch_size,
                              group_size=s["engine"].group_size)
  want = hot.rollout(*args)
  np.testing.assert_array_equal(got.tokens_BxT, want.tokens_BxT)
  np.testing.assert_allclose(got.behaviour_logp_BxT, want.behaviour_logp_BxT, atol=1e-6)
  base = s["engine"].rollout(*args)
  assert not np.array_equal(base.tokens_BxT, got.tokens_BxT)
  with pytest.raises(ValueError, match="temperature"):
    s["engine"].rollout(*args, temperature=-1.0)


def test_temperature_zero_decodes_as_an_engine_built_greedy(setup):
  """Greedy decoding is an argument of the sampling program: evaluation and
  RL share one compiled engine."""
  s = setup
  args = (s["params"], s["prompts"], s["prompt_len"], s["instances"], jax.random.key(3), 0)
  got = s["engine"].rollout(*args, temperature=0.0)
  greedy = rollout.RolloutEngine(s["config"], dataclasses.replace(SAMPLING, greedy=True),
                                 s["codec"].ids, env=s["engine"].env,
                                 batch_size=s["engine"].batch_size,
                                 group_size=s["engine"].group_size)
  want = greedy.rollout(*args)
  np.testing.assert_array_equal(got.tokens_BxT, want.tokens_BxT)
  np.testing.assert_array_equal(got.behaviour_logp_BxT, want.behaviour_logp_BxT)
  np.testing.assert_array_equal(got.entropy_BxT, want.entropy_BxT)
  # The G rows of a prompt decode alike, and differ when sampled.
  tokens = np.asarray(got.tokens_BxT).reshape(P, G, -1)
  np.testing.assert_array_equal(tokens, np.repeat(tokens[:, :1], G, axis=1))
  assert not np.array_equal(np.asarray(s["engine"].rollout(*args).tokens_BxT),
                            np.asarray(got.tokens_BxT))


def test_cache_sizes():
  sizes = rollout.engine.cache_sizes
  assert sizes(16, 272, 4) == (72, 144, 216, 272)
  assert sizes(16, 272, 1) == (272,)
  assert sizes(0, 128, 4) == (64, 128)  # Steps of at least 64 slots.
  assert sizes(64, 128, 4) == (128,)
  assert sizes(128, 128, 4) == (128,)


def test_growing_the_cache_changes_no_token(setup):
  """T = 128 in 4 segments: the cache starts at the prompt, grows to 64, then
  128 slots; sampled episodes cross both sizes."""
  s = setup
  assert s["engine"].cache_segments == 4
  args = (s["params"], s["prompts"], s["prompt_len"], s["instances"],
          jax.random.key(11), 0)
  grown = s["engine"].rollout(*args)
  full = rollout.RolloutEngine(
      s["config"], SAMPLING, s["codec"].ids, env=s["env"],
      batch_size=P * G, group_size=G, cache_segments=1).rollout(*args)
  assert int(np.max(grown.length_B)) > 64
  np.testing.assert_array_equal(grown.tokens_BxT, full.tokens_BxT)
  np.testing.assert_array_equal(grown.loss_mask_BxT, full.loss_mask_BxT)
  np.testing.assert_allclose(grown.behaviour_logp_BxT, full.behaviour_logp_BxT,
                             atol=1e-6)
  np.testing.assert_array_equal(grown.reward_B, full.reward_B)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU options")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_compiles_with_the_model_options(dtype):
  """Sampling compiles the model as the learner does (model.compiler_options:
  on CPU, float32 matmuls without YNNPACK, 16-bit ones with it)."""
  cfg = dataclasses.replace(model_lib.TransformerConfig.tiny(), dtype=dtype)
  sampling = rollout.SamplingConfig(max_new_tokens_per_turn=4, max_turns=1,
                                    max_total_tokens=8)
  engine = rollout.RolloutEngine(cfg, sampling, None, batch_size=2)
  args = engine._check_inputs(np.ones((2, 3), np.int32), np.array([3, 2]),
                              None, None, None)
  hlo = engine._rollout_jit.lower(
      engine, model_lib.init_params(cfg, jax.random.key(0)), *args, jax.random.key(1),
      jnp.int32(0), jnp.float32(1.0), prefill_len=3).compile().as_text()
  assert ("ynn_fusion" in hlo) == (dtype == "bfloat16")


def test_mismatch_metrics_hand_computed():
  b = jnp.array([[0.0, -1.0, -2.0]])
  l = jnp.array([[5.0, -1.5, -1.0]])
  mask = jnp.array([[0.0, 1.0, 1.0]])
  m = shift.mismatch_metrics(b, l, mask)
  d = np.array([-0.5, 1.0])
  np.testing.assert_allclose(m["logprob_mismatch_mean"], 0.75, rtol=1e-6)
  np.testing.assert_allclose(m["logprob_mismatch_max"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(m["kl_behaviour_learner"], np.mean(np.exp(d) - d - 1), rtol=1e-6)


def test_input_errors(setup):
  s, engine = setup, setup["engine"]
  args = (s["params"], s["prompts"], s["prompt_len"], s["instances"],
          jax.random.key(0), 0)
  with pytest.raises(ValueError, match="do not fit in the KV cache"):
    engine.rollout(s["params"], np.zeros((P, SAMPLING.max_total_tokens), np.int32),
                   s["prompt_len"], *args[3:])
  with pytest.raises(ValueError, match="group size 3 does not divide the batch size 4"):
    rollout.RolloutEngine(s["config"], SAMPLING, s["codec"].ids, env=s["env"],
                          batch_size=4, group_size=3)
  with pytest.raises(ValueError, match="got 1 prompts"):
    engine.rollout(s["params"], s["prompts"][:1], s["prompt_len"][:1], *args[3:])
  with pytest.raises(ValueError, match="prompt lengths"):
    engine.rollout(s["params"], s["prompts"], s["prompt_len"] * 0, *args[3:])
  with pytest.raises(ValueError, match="instances"):
    engine.rollout(*args[:3], None, *args[4:])
  with pytest.raises(ValueError, match="max_action_len"):
    rollout.RolloutEngine(s["config"], SAMPLING.__class__(max_new_tokens_per_turn=64),
                          s["codec"].ids, env=s["env"], batch_size=4)
  with pytest.raises(ValueError, match="script_PxS and script_len_P"):
    engine.rollout(*args, script_PxS=np.zeros((P, 3), np.int32))


ROWS = 4  # rows of the prefix-sharing tests: 4 prompts of 1, 2 of 2 or 1 of 4


def _engine(s, with_env, group_size, decode_shared_prefix=False):
  sampling = SAMPLING if with_env else dataclasses.replace(SAMPLING, max_turns=1)
  return rollout.RolloutEngine(
      s["config"], sampling, s["codec"].ids, env=s["env"] if with_env else None,
      batch_size=ROWS, group_size=group_size, decode_shared_prefix=decode_shared_prefix,
      cache_segments=1)  # one decode loop: a quicker compile


def _rows(s, with_env, order):
  """The engine's inputs for the prompts ``order`` (indices into setup's),
  with the environment: instances and two scripted tool calls."""
  take = lambda x: jax.tree.map(lambda a: np.asarray(a)[order], x)  # noqa: E731
  args = [take(s["prompts"]), take(s["prompt_len"]),
          take(s["instances"]) if with_env else None]
  return args, take(s["script"]) if with_env else {}


@pytest.fixture(scope="module")
def unshared(setup):
  """G = 1 engines, each row prefilled on its own, and their rollouts of the
  rows ``[0, 1, 0, 1]``, ``[0, 0, 1, 1]`` and ``[0, 0, 0, 0]``, by row order."""
  out = {}
  for with_env in (True, False):
    engine = _engine(setup, with_env, 1)
    for order in ((0, 1, 0, 1), (0, 0, 1, 1), (0, 0, 0, 0)):
      args, script = _rows(setup, with_env, list(order))
      out[with_env, order] = engine.rollout(setup["params"], *args, jax.random.key(13), 0,
                                            **script)
  return out


@pytest.mark.parametrize("group_size, with_env, shared_decode", [
    (g, env, False) for g in (1, 2, 4) for env in (True, False)]
    + [(2, True, True), (4, False, True)])
def test_each_prompt_is_prefilled_once_with_the_rollouts_of_repeated_prompts(
    setup, unshared, group_size, with_env, shared_decode, monkeypatch):
  """An engine of group size G prefills its P prompts once and copies each
  cache to its G rows, or (``decode_shared_prefix``) its G rows decode from
  one cache of the prompt: the same episodes as G = 1 on every prompt
  repeated G times (same key: the rows' draws do not depend on G)."""
  s = setup
  prefilled = []
  prefill = model_lib.prefill

  def spy(params, tokens_BxT, cache, config, **kwargs):
    prefilled.append(tokens_BxT.shape[0])
    return prefill(params, tokens_BxT, cache, config, **kwargs)

  decoded = []
  decode_step = model_lib.decode_step

  def decode_spy(*args, prefix=None, **kwargs):
    decoded.append(None if prefix is None else prefix.k[0].shape)
    return decode_step(*args, prefix=prefix, **kwargs)

  monkeypatch.setattr(model_lib, "prefill", spy)
  monkeypatch.setattr(model_lib, "decode_step", decode_spy)
  jax.clear_caches()  # an equal engine may have traced these programs: trace again, spied
  prompts = [0, 1, 0, 1][:ROWS // group_size] if group_size < ROWS else [0]
  args, script = _rows(s, with_env, prompts)
  shared = _engine(s, with_env, group_size, shared_decode).rollout(
      s["params"], *args, jax.random.key(13), 0, **script)
  assert prefilled == [ROWS // group_size]
  # With decode_shared_prefix the decode steps read one cache per prompt of
  # the shortest prompt length's power of two.
  shortest = int(np.min(args[1]))
  ls = 1 << (shortest.bit_length() - 1)
  c = s["config"]
  assert decoded == [(ROWS // group_size, c.n_kv_heads, ls, c.head_dim)
                     if shared_decode and group_size > 1 else None]
  assert ls > shortest // 2
  plain = unshared[with_env, tuple(np.repeat(prompts, group_size))]
  for field in ("tokens_BxT", "loss_mask_BxT", "turn_BxT", "version_BxT", "length_B",
                "reward_B", "done_B", "truncated_B", "num_tool_calls_B"):
    np.testing.assert_array_equal(getattr(shared, field), getattr(plain, field), err_msg=field)
  # The prefill's matmuls have P rows, not B; the shared decode sums the
  # shared and the own cache slots apart: float rounding (a few float32 ulps
  # of entropies near 6).
  np.testing.assert_allclose(shared.behaviour_logp_BxT, plain.behaviour_logp_BxT, atol=1e-5)
  np.testing.assert_allclose(shared.entropy_BxT, plain.entropy_BxT, atol=1e-5)
  assert (np.asarray(shared.loss_mask_BxT) > 0).sum(axis=1).min() > 0
  if group_size > 1:  # the samples of a prompt go their own ways after it
    tokens = np.asarray(shared.tokens_BxT).reshape(ROWS // group_size, group_size, -1)
    assert not np.all(tokens == tokens[:, :1])
  if with_env:
    assert np.all(np.asarray(shared.num_tool_calls_B) >= 2)


def test_prompt_group_size_is_the_gcd_of_the_runs():
  size = rollout.engine.prompt_group_size
  assert size([4, 4, 9, 9]) == 2
  assert size([4, 4, 4, 9, 9, 9]) == 3
  assert size([4, 4, 9, 9, 9, 9]) == 2  # runs of 4 hold two groups of 2
  assert size([4, 9, 9, 4]) == 1
  assert size([7, 7, 7, 7]) == 4
  assert size([]) == 1


def test_engines_built_alike_share_their_compiled_programs(setup):
  """An engine is its jitted programs' static argument, equal to any engine
  built with equal arguments (the environment by value): a run's second
  engine, or the next run's, rolls out without compiling again."""
  s = setup
  engine = s["engine"]
  again = rollout.RolloutEngine(s["config"], SAMPLING, s["codec"].ids,
                                env=calc_chain_batch(P)["env"], batch_size=P * G,
                                group_size=G)
  assert again is not engine and again == engine and hash(again) == hash(engine)
  assert engine != rollout.RolloutEngine(s["config"], SAMPLING, s["codec"].ids, env=s["env"],
                                         batch_size=P * G, group_size=G, cache_segments=1)
  args = (s["params"], s["prompts"], s["prompt_len"], s["instances"], jax.random.key(5), 0)
  first = engine.rollout(*args)
  compiled = engine._rollout_jit._cache_size()
  chex.assert_trees_all_equal(again.rollout(*args), first)
  assert again._rollout_jit._cache_size() == compiled
