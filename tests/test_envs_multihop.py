"""Multi-hop lookup: hidden graph, k hops need k calls, scripted strategies."""

import jax
import numpy as np
import pytest

import envs_scripted_check as check
from agentic_rl.envs import multihop
from agentic_rl.text import default_codec


@pytest.fixture(scope="module")
def env():
  return multihop.MultiHopEnv(default_codec())


def test_instances_are_paths_through_a_hidden_table(env):
  for level, spec in enumerate(env.levels):
    insts = jax.tree.map(np.asarray, check.instances(env, 70 + level, level))
    for i in range(0, check.B, 10):
      inst = jax.tree.map(lambda x, i=i: x[i], insts)
      n = int(inst.world.table_size)
      assert n == spec.entries and int(inst.hops) == spec.hops
      keys = inst.world.table_keys[:n].tolist()
      table = dict(zip(keys, inst.world.table_values[:n].tolist()))
      assert len(table) == n and all(100 <= k <= 999 for k in keys)
      node, seen = int(inst.start), []
      for _ in range(spec.hops):
        seen.append(node)
        node = table[node]
      assert node == int(inst.answer) and node not in seen  # a simple path
      assert node in table and table[node] != node  # the end points onwards
      assert env.prompt_text(inst) == (
          f"Start at {int(inst.start)}; follow {spec.hops} hop"
          + ("s" if spec.hops > 1 else "") + ".")


def test_reference_policies_score_one_everywhere(env):
  calls = check.check_reference_policies(env)
  for level, spec in enumerate(env.levels):
    assert calls[level, "direct"] == spec.hops  # k hops, k calls
    assert calls[level, "memo"] == 2 * spec.hops + 1


def test_noise_and_strategies(env):
  insts = check.instances(env, 12, 2)
  direct, memo = (check.play(env, insts, 4, s) for s in ("direct", "memo"))
  assert (direct["strategy_hash"] != memo["strategy_hash"]).all()
  noisy = check.play(env, insts, 4, "direct", noise=0.3)
  assert 0.3 < noisy["outcome"].mean() < 0.9 and noisy["ended"].all()


def test_demonstrations_match_rollouts_and_fit_the_budget(env):
  lengths = check.check_demonstrations(env, 0, noise=0.2)
  assert 40 <= np.median(lengths["direct"]) and lengths["direct"].max() <= 160
  assert lengths["memo"].max() <= 160
