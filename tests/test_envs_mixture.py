"""The task mix and the registry."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import envs as E
from agentic_rl.envs import scripted, tasks
from agentic_rl.text import default_codec

B = 64


@pytest.fixture(scope="module")
def codec():
  return default_codec()


@pytest.fixture(scope="module")
def mix(codec):
  return E.make_env("mixture", codec, members=("boxes", "multihop"), weights=(3.0, 1.0),
                    rewards=E.RewardConfig(format=0.2))


def test_registry(codec, mix):
  assert set(E.ENVS) == {"calc_chain", "multihop", "boxes", "composed"}
  for name, cls in E.ENVS.items():
    assert isinstance(E.make_env(name, codec.tokenizer), cls)  # a tokenizer also works
  assert isinstance(mix, E.MixtureEnv) and mix.names == ("boxes", "multihop")
  np.testing.assert_allclose(mix.weights, [0.75, 0.25])
  assert all(e.rewards.format == 0.2 for e in mix.envs)  # shared kwargs reach every member
  assert mix.max_action_len == 24 and mix.max_obs_len == 16
  assert mix.max_turns == max(e.max_turns for e in mix.envs)
  custom = E.make_env("mixture", codec, members=("calc_chain", "boxes"),
                      member_kwargs={"boxes": {"max_turns": 5}})
  assert custom.envs[1].max_turns == 5 and custom.max_action_len == 48
  with pytest.raises(ValueError, match="unknown environment 'chess'"):
    E.make_env("chess", codec)
  with pytest.raises(ValueError, match="members"):
    E.make_env("mixture", codec)
  with pytest.raises(ValueError, match="not in the mixture"):
    E.make_env("mixture", codec, members=("boxes",), member_kwargs={"multihop": {}})
  with pytest.raises(ValueError, match="weights"):
    E.MixtureEnv(mix.envs, (1.0,))
  with pytest.raises(ValueError, match="weights"):
    E.MixtureEnv(mix.envs, (1.0, -1.0))
  with pytest.raises(ValueError, match="at least one"):
    E.MixtureEnv([])
  with pytest.raises(ValueError, match="index"):
    mix.strategy_index("stepwise")
  with pytest.raises(ValueError, match="needs a tokenizer"):
    E.MixtureEnv([E.BoxesEnv(None)])


@pytest.fixture(scope="module")
def generate(mix):
  """4000 mixture instances; one difficulty per member."""
  fn = jax.jit(jax.vmap(lambda k, d0, d1: mix.generate(k, (d0, d1)), in_axes=(0, None, None)))
  keys = jax.random.split(jax.random.key(0), 4000)
  return lambda d0, d1: fn(keys, d0, d1)


def test_families_follow_the_weights(mix, generate):
  inst = generate(1, 1)
  assert abs(float(jnp.mean(inst.family == 0)) - 0.75) < 0.03
  inst = generate(0, 4)
  assert (inst.members[0].level == 0).all() and (inst.members[1].level == 4).all()
  with pytest.raises(ValueError, match="difficulties"):
    mix.generate(jax.random.key(1), (0, 1, 2))


def test_mixed_batch_dispatches_by_family(mix, codec, generate):
  insts = jax.tree.map(lambda x: x[:B], generate(1, 1))
  insts = insts.replace(family=jnp.arange(B, dtype=jnp.int32) % 2)  # both families
  keys = jax.random.split(jax.random.key(2), B)
  traj = scripted.batch_rollouts(mix, insts, keys, strategy=0)
  totals = scripted.episode_returns(traj)
  np.testing.assert_array_equal(totals["outcome"], 1.0)
  np.testing.assert_array_equal(totals["format"], 1.0)
  chex.assert_shape(traj.actions, (B, mix.max_turns, mix.max_action_len))
  chex.assert_shape(traj.obs, (B, mix.max_turns, mix.max_obs_len))
  # Level 1: opening boxes, or two lookups.
  tools = np.asarray(traj.outputs.info["tool_id"][:, 0])
  np.testing.assert_array_equal(tools[0::2], E.tokens.OPEN)
  np.testing.assert_array_equal(tools[1::2], E.tokens.LOOKUP)
  np.testing.assert_array_equal(np.asarray(traj.outputs.info["tool_calls"][1::2, -1]), 2)
  row = lambda tree, b: jax.tree.map(lambda x: x[b], tree)
  for b in range(4):
    messages = codec.decode(scripted.trajectory_ids(mix, row(insts, b), row(traj, b)))
    assert messages[1].content == mix.prompt_text(row(insts, b))
    assert messages[-1].content == f"<answer>{int(row(insts, b).answer)}</answer>"
  # The mixture's step is its member's step, row by row.
  for family, member in enumerate(mix.envs):
    b = family
    state = member.reset(row(insts, b).members[family])
    step = jax.jit(member.step)
    for t in range(3):
      state, out = step(state, traj.actions[b, t, :member.max_action_len],
                        traj.action_lens[b, t])
      mixed = row(jax.tree.map(lambda x: x[:, t], traj.outputs), b)
      np.testing.assert_array_equal(out.obs_A, mixed.obs_A[:member.max_obs_len])
      chex.assert_trees_all_equal(out.replace(obs_A=mixed.obs_A), mixed)


def test_environments_built_alike_are_equal_and_share_compiled_programs(codec):
  """Environments compare by value (jax.jit keys its static arguments by
  hash and equality): a second build reuses the scripted rollout compiled
  for the first; any difference in construction makes another program."""
  build = lambda **kw: E.make_env("mixture", default_codec(), members=("calc_chain", "boxes"),
                                  **kw)
  a, b = build(), build()
  assert a is not b and a == b and hash(a) == hash(b)
  assert a.envs[1] == E.BoxesEnv(codec) != E.BoxesEnv(codec, max_turns=5)
  assert E.BoxesEnv(codec) != E.BoxesEnv(codec, levels=(E.BoxLevel(4, 2),))
  assert E.BoxesEnv(codec) != E.BoxesEnv(codec, rewards=E.RewardConfig(format=0.2))
  assert a != build(weights=(2.0, 1.0)) and a != E.make_env(
      "mixture", codec, members=("calc_chain", "multihop"))
  keys = jax.random.split(jax.random.key(0), 8)
  inst = tasks.generate(a, keys, 1)
  first = scripted.batch_rollouts(a, inst, keys, 1, 0.2)
  compiled = scripted._rollouts._cache_size()
  second = scripted.batch_rollouts(b, inst, keys, 1, 0.2)
  assert scripted._rollouts._cache_size() == compiled
  chex.assert_trees_all_equal(first, second)
  scripted.batch_rollouts(build(weights=(2.0, 1.0)), inst, keys, 1, 0.2)
  assert scripted._rollouts._cache_size() == compiled + 1
