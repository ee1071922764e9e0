"""Task pools (``envs.Tasks``) and the SFT demonstration batch built from the
scripted policies (``envs.demonstration_batch``)."""

import chex
import jax
import numpy as np
import pytest

from agentic_rl import envs
from agentic_rl.envs import scripted
from agentic_rl.envs import tasks as tasks_lib
from agentic_rl.text import default_codec
from loss_masks import longest_action


@pytest.fixture(scope="module")
def mixture():
  return envs.make_env("mixture", default_codec(), members=("calc_chain", "multihop"),
                       weights=(0.25, 0.75))


def test_task_pool_levels_cycle_and_match_single_level_generation(mixture):
  tasks = envs.Tasks(mixture, seed=0, difficulty=(0, 2), prompt_len=80)
  ids = np.array([5, 0, 3, 2])
  np.testing.assert_array_equal(tasks.difficulty_of(ids), [2, 0, 2, 0])
  mixed = tasks.instances("train", ids)
  for level in (0, 2):
    alone = envs.Tasks(mixture, seed=0, difficulty=level, prompt_len=80)
    rows = np.flatnonzero(tasks.difficulty_of(ids) == level)
    want = alone.instances("train", ids[rows])
    for got_leaf, want_leaf in zip(jax.tree.leaves(mixed), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(got_leaf)[rows], want_leaf)
  prompts, lens = tasks.prompts(mixed)
  assert prompts.shape == (4, 80) and (lens > 0).all() and (lens <= 80).all()
  short = envs.Tasks(mixture, seed=0, difficulty=(0, 2), prompt_len=int(lens.max()) - 1)
  with pytest.raises(tasks_lib.PromptTooLong, match=f"prompt of {lens.max()} tokens") as e:
    short.prompts(mixed)
  assert (e.value.length, e.value.limit) == (lens.max(), lens.max() - 1)


def test_demonstration_batch_is_the_scripted_streams_with_action_masks(mixture):
  T = 200
  tasks = envs.Tasks(mixture, seed=0, difficulty=0, prompt_len=T)
  key = jax.random.key(3)
  data = envs.demonstration_batch(tasks, 16, key, noise=0.0, max_len=T)
  tokens, mask = data["tokens_BxT"], data["loss_mask_BxT"]
  assert tokens.shape == mask.shape and tokens.shape[1] == T
  # The streams of each member, strategy by strategy, in the mixture's
  # proportions (ceil(16 * w / strategies) per strategy).
  want_rows, want_masks = [], []
  for f, (member, w) in enumerate(zip(mixture.envs, mixture.weights)):
    n = -(-int(round(16 * w)) // len(member.strategies))
    for s in range(len(member.strategies)):
      k_inst, k_play = jax.random.split(jax.random.fold_in(jax.random.fold_in(key, f), s))
      inst = tasks_lib.generate_levels(member, jax.random.split(k_inst, n), np.zeros(n, int))
      traj = scripted.batch_rollouts(member, inst, jax.random.split(k_play, n), strategy=s)
      for i in range(n):
        pick = lambda tree, i=i: jax.tree.map(lambda x: np.asarray(x)[i], tree)  # noqa: E731
        one = pick(traj)
        ids = scripted.trajectory_ids(member, pick(inst), one)
        if len(ids) <= T:
          want_rows.append(ids)
          want_masks.append(int(one.action_lens[one.live].sum()))
  assert len(want_rows) == tokens.shape[0] >= 12
  for row, m, want, n_act in zip(tokens, mask, want_rows, want_masks):
    np.testing.assert_array_equal(row[:len(want)], want)
    assert (row[len(want):] == default_codec().ids.pad).all()
    assert m.sum() == n_act and (m[len(want):] == 0).all()
  # Masked tokens decode to the assistant's turns only.
  codec = default_codec()
  messages = codec.decode(tokens[0][:len(want_rows[0])])
  assert [msg.role for msg in messages][:2] == ["system", "user"]


def test_demonstrations_with_actions_longer_than_a_turn_allows_are_left_out(mixture):
  tasks = envs.Tasks(mixture, seed=0, difficulty=0, prompt_len=200)
  key = jax.random.key(3)
  every = envs.demonstration_batch(tasks, 32, key, noise=0.0, max_len=200)
  longest = longest_action(every["loss_mask_BxT"])
  same = envs.demonstration_batch(tasks, 32, key, noise=0.0, max_len=200,
                                  max_action_len=int(longest))
  chex.assert_trees_all_equal(same, every)
  limit = int(longest) - 1
  short = envs.demonstration_batch(tasks, 32, key, noise=0.0, max_len=200,
                                   max_action_len=limit)
  assert 0 < len(short["tokens_BxT"]) < len(every["tokens_BxT"])
  assert longest_action(short["loss_mask_BxT"]) <= limit
  with pytest.raises(ValueError, match="with actions of at most 2 tokens"):
    envs.demonstration_batch(tasks, 32, key, noise=0.0, max_len=200, max_action_len=2)


def test_demonstration_batch_refuses_a_budget_nothing_fits_in(mixture):
  # Room for every prompt but for no whole episode.
  longest = max(int(tasks_lib.encode_prompts(m, tasks_lib.generate_levels(
      m, jax.random.split(jax.random.key(0), 64), np.zeros(64, int)), 400)[1].max())
                for m in mixture.envs)
  tasks = envs.Tasks(mixture, seed=0, difficulty=0, prompt_len=400)
  with pytest.raises(ValueError, match=f"no demonstration fits in max_len={longest + 8}"):
    envs.demonstration_batch(tasks, 4, jax.random.key(0), noise=0.0, max_len=longest + 8)
  # Too few demonstrations for any family to get one (each plays round(n * w)).
  even = envs.make_env("mixture", default_codec(), members=("calc_chain", "multihop", "boxes"),
                       weights=(1 / 3, 1 / 3, 1 / 3))
  with pytest.raises(ValueError, match="num_demos=1 gives no task family a demonstration"):
    envs.demonstration_batch(envs.Tasks(even, seed=0, difficulty=0, prompt_len=400), 1,
                             jax.random.key(0), noise=0.0, max_len=400)
