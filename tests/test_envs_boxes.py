"""Hidden sorted boxes: strategies that all succeed, at different cost."""

import jax
import numpy as np
import pytest

import envs_scripted_check as check
from agentic_rl.envs import boxes
from agentic_rl.text import default_codec


@pytest.fixture(scope="module")
def env():
  return boxes.BoxesEnv(default_codec())


def test_instances_hold_sorted_distinct_numbers(env):
  for level, spec in enumerate(env.levels):
    insts = jax.tree.map(np.asarray, check.instances(env, 90 + level, level))
    n = spec.boxes
    assert (insts.world.num_boxes == n).all()
    contents = insts.world.boxes[:, :n]
    assert (np.diff(contents, axis=1) > 0).all()
    assert (contents >= 10 ** (spec.digits - 1)).all() and (contents < 10 ** spec.digits).all()
    assert (insts.world.boxes[:, n:] == 0).all()
    rows = np.arange(check.B)
    np.testing.assert_array_equal(contents[rows, insts.answer - 1], insts.target)
    # The target box is spread over all boxes.
    assert len(np.unique(insts.answer)) == n
    inst = jax.tree.map(lambda x: x[0], insts)
    assert env.prompt_text(inst) == (
        f"Boxes 1-{n} hold sorted numbers. Which box holds {int(inst.target)}?")


def test_reference_policies_score_one_everywhere_at_different_costs(env):
  calls = check.check_reference_policies(env)
  for level, spec in enumerate(env.levels):
    n = spec.boxes
    # Bisection needs at most ceil(log2(n + 1)) calls; the scans more on average.
    assert calls[level, "binary"] <= np.ceil(np.log2(n + 1))
    assert calls[level, "binary"] < min(calls[level, "linear"], calls[level, "reverse"])
    # A scan opens boxes up to the target (the last one it can infer).
    assert (n - 1) / 2 <= calls[level, "linear"] <= (n + 1) / 2


def test_strategies_differ_per_instance(env):
  insts = check.instances(env, 13, 2)
  runs = [check.play(env, insts, 5, s) for s in range(len(env.strategies))]
  distinct = np.stack([r["strategy_hash"] for r in runs], 1)
  assert np.mean([len(set(row)) for row in distinct]) > 2.5
  noisy = check.play(env, insts, 5, "binary", noise=0.3)
  assert 0.4 < noisy["outcome"].mean() < 0.95 and noisy["ended"].all()


def test_demonstrations_match_rollouts_and_fit_the_budget(env):
  lengths = check.check_demonstrations(env, 0, noise=0.2)
  for name in env.strategies:
    assert lengths[name].max() <= 160, name
