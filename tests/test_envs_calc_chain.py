"""Arithmetic chains: generator, exact answers, scripted strategies, demos."""

import re

import jax
import numpy as np
import pytest

import envs_scripted_check as check
from agentic_rl.envs import calc_chain
from agentic_rl.text import default_codec


@pytest.fixture(scope="module")
def env():
  return calc_chain.CalcChainEnv(default_codec())


def _python_value(prompt: str) -> int:
  expr = re.fullmatch(r"Compute (.*)\.", prompt).group(1)
  assert re.fullmatch(r"[0-9+\-*/()]+", expr), expr
  return eval(expr.replace("/", "//"))  # pylint: disable=eval-used


def test_instances_are_exact_and_in_range(env):
  for level, spec in enumerate(env.levels):
    insts = jax.tree.map(np.asarray, check.instances(env, 50 + level, level))
    assert (insts.num_ops == spec.num_ops).all() and (insts.level == level).all()
    first = insts.operands[:, 0]
    assert (first >= 10 ** (spec.first_digits - 1)).all() and (first < 10 ** spec.first_digits).all()
    for i in range(0, check.B, 5):
      inst = jax.tree.map(lambda x, i=i: x[i], insts)
      prompt = env.prompt_text(inst)
      assert _python_value(prompt) == int(inst.answer), prompt
      # Every intermediate stays in [1, 10**9): the chain, replayed.
      value = int(inst.operands[0])
      for op, b in zip(inst.ops[:spec.num_ops].tolist(),
                       inst.operands[1:spec.num_ops + 1].tolist()):
        value = [value + b, value - b, value * b, value // b][op]
        assert 1 <= value < 10**9
      assert set("+-*/"[o] for o in inst.ops[:spec.num_ops]) <= set(spec.ops)


def test_generate_is_deterministic_with_and_without_jit(env):
  key = jax.random.split(jax.random.key(5), check.B)[0]
  a = env.generate(key, 3)  # eager, Python level
  b = jax.tree.map(lambda x: x[0], check.instances(env, 5, 3))  # jit(vmap), traced level
  jax.tree.map(np.testing.assert_array_equal, a, b)
  c = jax.tree.map(lambda x: x[1], check.instances(env, 5, 3))
  assert int(a.answer) != int(c.answer)


def test_reference_policies_score_one_everywhere(env):
  calls = check.check_reference_policies(env)
  for level, spec in enumerate(env.levels):
    assert calls[level, "stepwise"] == spec.num_ops
    assert calls[level, "oneshot"] == 1
    assert calls[level, "memo"] == 2 * spec.num_ops + 1


def test_strategies_are_distinct_and_noise_makes_mistakes(env):
  insts = check.instances(env, 11, 1)
  hashes = [check.play(env, insts, 3, s)["strategy_hash"] for s in range(3)]
  assert all((hashes[i] != hashes[j]).all() for i in range(3) for j in range(i))
  noisy = check.play(env, insts, 3, "stepwise", noise=0.3)
  assert 0.3 < noisy["outcome"].mean() < 0.9
  assert noisy["tool_errors"].sum() > 0 and noisy["ended"].all()
  assert (check.play(env, insts, 3, "stepwise", noise=1.0)["outcome"] == 0).mean() > 0.9


def test_demonstrations_match_rollouts_and_fit_the_budget(env):
  lengths = check.check_demonstrations(env, 0, noise=0.2)
  assert lengths["stepwise"].max() <= 160 and lengths["oneshot"].max() <= 160
  assert 64 <= np.median(lengths["stepwise"]) <= 120
  assert lengths["memo"].max() <= 200
