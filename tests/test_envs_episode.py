"""Episode semantics shared by every family: actions, limits, rewards, vmap."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import envs as E
from agentic_rl.envs import rewards as rewards_lib
from agentic_rl.envs import tokens as T
from agentic_rl.text import default_codec

MAX_TURNS = 3
A = 24  # the boxes environment's max_action_len


@pytest.fixture(scope="module")
def codec():
  return default_codec()


@pytest.fixture(scope="module")
def env(codec):
  return E.BoxesEnv(codec, max_turns=MAX_TURNS)


@pytest.fixture(scope="module")
def instance(env):
  """Boxes 10, 20, 30, 40; the target 30 is in box 3."""
  inst = env.generate(jax.random.key(0), 0)
  boxes = jnp.zeros_like(inst.world.boxes).at[:4].set(jnp.array([10, 20, 30, 40]))
  return inst.replace(world=inst.world.replace(boxes=boxes), target=jnp.int32(30),
                      answer=jnp.int32(3))


@pytest.fixture(scope="module")
def step(env):
  return jax.jit(env.step)


EOS = "<EOS>"  # stands for the eos id, which text never encodes to


def _action(codec, text):
  ids = codec.tokenizer.encode(text.replace(EOS, ""))
  if text.endswith(EOS):
    ids.append(codec.ids.eos)
  assert len(ids) <= A, text
  return jnp.asarray(np.pad(ids, (0, A - len(ids))), jnp.int32), jnp.int32(len(ids))


def _play(env, step, codec, instance, texts):
  state = env.reset(instance)
  outs = []
  for text in texts:
    state, out = step(state, *_action(codec, text))
    outs.append(out)
  return state, outs


def _obs(codec, out):
  return codec.tokenizer.decode(np.asarray(out.obs_A)[:int(out.obs_len)])


def test_step_output_structure(env, step, codec, instance):
  state, out = step(env.reset(instance), *_action(codec, "<tool_call>open 1</tool_call>"))
  chex.assert_shape(out.obs_A, (env.max_obs_len,))
  chex.assert_type(out.obs_A, jnp.int32)
  chex.assert_shape([out.obs_len, out.reward, out.done, out.truncated], ())
  chex.assert_type([out.obs_len, out.reward, out.done, out.truncated],
                   [jnp.int32, jnp.float32, bool, bool])
  assert set(out.reward_components) == set(rewards_lib.COMPONENTS)
  for key in ("tool_id", "call_hash", "tool_error", "format_error", "tool_calls",
              "tool_errors", "malformed_calls", "policy_tokens", "turn", "strategy_hash"):
    assert key in out.info, key
  chex.assert_type([out.info["tool_id"], out.info["call_hash"], out.info["tool_error"]],
                   [jnp.int32, jnp.int32, bool])
  # Every step reports the same structure.
  _, out2 = step(state, *_action(codec, "<answer>3</answer>"))
  chex.assert_trees_all_equal_shapes_and_dtypes(out, out2)


def test_calls_then_correct_answer(env, step, codec, instance):
  texts = ["<tool_call>open 2</tool_call>", "Next.<tool_call> open  3 </tool_call>",
           "<answer> 3 </answer>"]
  state, (o1, o2, o3) = _play(env, step, codec, instance, texts)
  assert _obs(codec, o1) == "20" and _obs(codec, o2) == "30"
  assert int(o1.info["tool_id"]) == T.OPEN and not bool(o1.info["tool_error"])
  assert int(o1.info["call_hash"]) >= 0
  assert int(o1.info["call_hash"]) != int(o2.info["call_hash"])
  for o in (o1, o2):  # intermediate steps: no reward, not done
    assert not bool(o.done | o.truncated) and float(o.reward) == 0.0
    assert all(float(v) == 0.0 for v in o.reward_components.values())
  assert bool(o3.done) and not bool(o3.truncated)
  assert int(o3.obs_len) == 0 and int(o3.info["tool_id"]) == -1
  assert int(o3.info["call_hash"]) == -1
  tokens = sum(len(codec.tokenizer.encode(t)) for t in texts)
  c = {k: float(v) for k, v in o3.reward_components.items()}
  assert c["outcome"] == 1.0 and c["format"] == 1.0
  expected_eff = 1 - 0.5 * 2 / MAX_TURNS - 0.5 * tokens / (MAX_TURNS * A)
  np.testing.assert_allclose(c["efficiency"], expected_eff, rtol=1e-6)
  cfg = env.rewards
  np.testing.assert_allclose(float(o3.reward), cfg.outcome + cfg.format + cfg.efficiency
                             * expected_eff, rtol=1e-6)
  assert int(state.policy_tokens) == tokens and int(state.tool_calls) == 2
  assert bool(state.opened[1]) and bool(state.opened[2]) and not bool(state.opened[0])


@pytest.mark.parametrize("text,message", [
    ("<tool_call>open</tool_call>", "error: malformed call"),
    ("<tool_call>open 2:3</tool_call>", "error: malformed call"),
    ("<tool_call></tool_call>", "error: malformed call"),
    ("open 2</tool_call>", "error: malformed call"),  # no open tag
    ("<tool_call>dance 2</tool_call>", "error: unknown tool"),
    ("<tool_call>2</tool_call>", "error: unknown tool"),
    ("<tool_call>open 9</tool_call>", "error: no such box"),
    ("<tool_call>calc 1/0</tool_call>", "error: division by zero"),
    ("<tool_call>recall 5</tool_call>", "error: not found"),
    ("<tool_call>open 99999999999</tool_call>", "error: overflow"),
])
def test_bad_calls_return_errors_and_continue(env, step, codec, instance, text, message):
  state, (o1, o2) = _play(env, step, codec, instance, [text, "<answer>3</answer>"])
  assert _obs(codec, o1) == message
  assert bool(o1.info["tool_error"]) and not bool(o1.done | o1.truncated)
  syntax = message in ("error: malformed call", "error: unknown tool")
  assert bool(o1.info["format_error"]) == syntax
  assert (int(o1.info["tool_id"]) == -1) == syntax
  # The episode goes on; the bad call costs format, not the outcome.
  assert bool(o2.done)
  assert float(o2.reward_components["outcome"]) == 1.0
  assert float(o2.reward_components["format"]) == (0.0 if syntax else 1.0)
  assert int(state.tool_errors) == 1 and int(state.malformed_calls) == int(syntax)


def test_out_of_vocabulary_ids_are_unknown_tools(env, step, codec, instance):
  ids = codec.ids
  for bad in (-1, codec.tokenizer.vocab_size, 10**6):
    action = jnp.zeros((A,), jnp.int32).at[:3].set(
        jnp.array([ids.tool_call_open, bad, ids.tool_call_close]))
    _, out = step(env.reset(instance), action, jnp.int32(3))
    assert _obs(codec, out) == "error: unknown tool" and bool(out.info["format_error"])


def test_other_tools_inside_an_episode(env, step, codec, instance):
  texts = ["<tool_call>calc 6*7</tool_call>", "<tool_call>store 1:42</tool_call>"]
  state, (o1, o2) = _play(env, step, codec, instance, texts)
  assert _obs(codec, o1) == "42" and _obs(codec, o2) == "ok"
  assert int(state.last_value) == 42
  np.testing.assert_array_equal(np.asarray(state.tool_successes)[[T.CALC, T.STORE]], [1, 1])


@pytest.mark.parametrize("text,done,truncated", [
    ("The answer is 3<|end|>", True, False),   # outside the answer tags
    ("3" + EOS, True, False),
    ("<answer>three</answer>", True, False),   # not an integer
    ("<answer>3 4</answer>", True, False),
    ("</answer>", True, False),                # no open tag
    ("<answer>2</answer>", True, False),       # wrong
    ("<answer>3", False, True),                # cut at the token limit
    ("", False, True),
])
def test_final_actions_that_score_zero(env, step, codec, instance, text, done, truncated):
  _, (out,) = _play(env, step, codec, instance, [text])
  assert (bool(out.done), bool(out.truncated)) == (done, truncated)
  assert float(out.reward_components["outcome"]) == 0.0
  assert bool(out.info["format_error"]) == (text != "<answer>2</answer>")
  assert np.isfinite(float(out.reward))


def test_turn_limit_truncates_and_later_steps_are_inert(env, step, codec, instance):
  call = "<tool_call>open 1</tool_call>"
  state, outs = _play(env, step, codec, instance, [call] * MAX_TURNS)
  assert [bool(o.truncated) for o in outs] == [False] * (MAX_TURNS - 1) + [True]
  assert _obs(codec, outs[-1]) == "10"  # the last call still ran
  assert float(outs[-1].reward_components["outcome"]) == 0.0
  assert float(outs[-1].reward_components["format"]) == 0.0  # no answer
  after, out = step(state, *_action(codec, "<answer>3</answer>"))
  chex.assert_trees_all_equal(after, state)
  assert bool(out.truncated) and not bool(out.done)
  assert float(out.reward) == 0.0 and int(out.obs_len) == 0
  assert int(out.info["tool_id"]) == -1 and not bool(out.info["tool_error"])


def test_reward_config(codec):
  with pytest.raises(ValueError, match="format"):
    rewards_lib.RewardConfig(format=-1.0)
  with pytest.raises(ValueError, match="outcome"):
    rewards_lib.RewardConfig(outcome=float("nan"))
  comps = {"outcome": jnp.array([1.0, 0.0]), "format": jnp.array([1.0, 0.5]),
           "efficiency": jnp.array([0.8, 0.9])}
  cfg = rewards_lib.RewardConfig(outcome=1.0, format=0.2, efficiency=0.5)
  np.testing.assert_allclose(rewards_lib.combine(comps, cfg), [1.6, 0.1], rtol=1e-6)
  ungated = rewards_lib.RewardConfig(outcome=1.0, format=0.2, efficiency=0.5,
                                     efficiency_needs_success=False)
  np.testing.assert_allclose(rewards_lib.combine(comps, ungated), [1.6, 0.55], rtol=1e-6)
  with pytest.raises(ValueError, match="RewardConfig"):
    E.BoxesEnv(codec, rewards={"outcome": 1.0})


def test_bad_construction_and_difficulty(env, codec):
  with pytest.raises(ValueError, match="max_turns"):
    E.BoxesEnv(codec, max_turns=0)
  with pytest.raises(ValueError, match="max_obs_len"):
    E.BoxesEnv(codec, max_obs_len=4)
  with pytest.raises(ValueError, match="too short"):
    E.CalcChainEnv(codec, max_action_len=20)
  with pytest.raises(ValueError, match="difficulty"):
    env.generate(jax.random.key(0), env.num_levels)
  with pytest.raises(ValueError, match="strategy"):
    env.reference_action(env.reset(env.generate(jax.random.key(0), 0)), jax.random.key(0),
                         strategy="psychic")
  with pytest.raises(ValueError, match="Tokenizer or a Codec"):
    E.BoxesEnv("tokenizer.model")
  bare = E.BoxesEnv(None)  # generates and renders prompts, cannot step
  inst = bare.generate(jax.random.key(0), 0)
  assert bare.prompt_text(inst).startswith("Boxes 1-4 hold sorted numbers.")
  with pytest.raises(ValueError, match="without a tokenizer"):
    bare.step(bare.reset(inst), jnp.zeros((A,), jnp.int32), jnp.int32(0))


B = 64  # batch of the vmapped tests (one compiled shape)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _random_actions(key, vocab_size, ids):
  """Uniformly random tokens (a few out of the vocabulary), random lengths;
  the last token usually a stop id."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  tokens = jax.random.randint(k1, (B, A), -4, vocab_size + 4)
  length = jax.random.randint(k2, (B,), 1, A + 1)
  stops = jnp.asarray([ids.tool_call_close, ids.answer_close, ids.end])
  last = stops[jax.random.randint(k3, (B,), 0, 3)]
  use_stop = jax.random.uniform(k4, (B,)) < 0.9
  tokens = jnp.where((jnp.arange(A) == length[:, None] - 1) & use_stop[:, None],
                     last[:, None], tokens)
  return tokens, length


@pytest.fixture(scope="module")
def batched(env):
  """Jitted, vmapped generate (level 1), reset, step and noisy scripted action."""
  generate = jax.jit(jax.vmap(lambda k: env.reset(env.generate(k, 1))))
  step = jax.jit(jax.vmap(env.step))
  act = jax.jit(jax.vmap(lambda s, k: env.reference_action(s, k, 2, 0.3)))
  return generate, step, act


def test_random_policy_scores_near_zero(env, codec, batched):
  reset, vstep, _ = batched
  outcome, episodes = 0.0, 0
  for r in range(8):
    state = reset(jax.random.split(jax.random.key(r), B))
    for t in range(MAX_TURNS):
      k = jax.random.fold_in(jax.random.key(100 + r), t)
      state, out = vstep(state, *_random_actions(k, codec.tokenizer.vocab_size, codec.ids))
      outcome += float(out.reward_components["outcome"].sum())
      for leaf in jax.tree.leaves(out):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
          assert bool(jnp.isfinite(leaf).all())
    # Every episode ended; bad calls were made, answered with errors, counted.
    assert bool((state.done | state.truncated).all())
    assert int(state.tool_errors.sum()) > 0
    episodes += B
  assert outcome / episodes < 0.02


def test_jit_vmap_step_equals_python_loop(env, codec, batched):
  reset, vstep, act = batched
  steps = MAX_TURNS + 1
  keys = jax.random.split(jax.random.key(3), B)
  state = reset(keys)
  first = state
  actions, batch_outs = [], []
  for t in range(steps):
    k = jax.random.fold_in(jax.random.key(4), t)
    scripted, scripted_len = act(state, jax.random.split(k, B))
    rand, rand_len = _random_actions(k, codec.tokenizer.vocab_size, codec.ids)
    use_rand = (jnp.arange(B) % 3 == 0)
    action = (jnp.where(use_rand[:, None], rand, scripted),
              jnp.where(use_rand, rand_len, scripted_len))
    state, out = vstep(state, *action)
    actions.append(action)
    batch_outs.append(out)
  row = lambda tree, b: jax.tree.map(lambda x: x[b], tree)
  step = jax.jit(env.step)
  for b in range(0, B, 4):
    single = row(first, b)
    for t in range(steps):
      single, out = step(single, actions[t][0][b], actions[t][1][b])
      chex.assert_trees_all_equal(out, row(batch_outs[t], b))
    chex.assert_trees_all_equal(single, row(state, b))
  # And without jit, for one episode's first step.
  single, out = env.step(row(first, 1), actions[0][0][1], actions[0][1][1])
  chex.assert_trees_all_equal(out, row(batch_outs[0], 1))
