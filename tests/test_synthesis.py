"""Agentic task synthesis: composed programs over the built-in tools, the
solver and policy filters, the dataset file, and training on it."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from agentic_rl.envs import scripted, synthesis
from agentic_rl.envs.composed import ComposedEnv
from agentic_rl.text import default_codec
from agentic_rl.train import config as config_lib
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from agentic_rl.train import run as run_lib
from agentic_rl.train import synthesis as train_synthesis
from experiments.configs import default

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def codec():
  return default_codec()


def _instances(env, program, n, seed=0):
  keys = jax.random.split(jax.random.key(seed), n)
  return jax.vmap(lambda k: env.instance_of(k, program))(keys), keys


@pytest.mark.parametrize("jit", [False, True])
def test_an_instance_follows_its_program(codec, jit):
  env = ComposedEnv(codec, programs=(("lookup", "add", "mul"),))
  make = jax.jit(env.instance_of) if jit else env.instance_of
  inst = jax.tree.map(np.asarray, make(jax.random.key(3), 0))
  w = inst.world
  table = dict(zip(w.table_keys.tolist(), w.table_values.tolist()))
  x = int(inst.start)
  assert 100 <= x <= 999
  # The program's row comes before any distractor with the same key.
  x = w.table_values[np.flatnonzero(w.table_keys == x)[0]]
  x = (x + int(inst.consts[1])) * int(inst.consts[2])
  assert x == int(inst.answer) and bool(inst.valid) and int(inst.num_ops) == 3
  assert table  # the table holds the lookup
  text = env.prompt_text(inst)
  assert text == (f"Start with {int(inst.start)}; look it up, add {int(inst.consts[1])}, "
                  f"multiply by {int(inst.consts[2])}. Answer the result.")


@pytest.mark.parametrize("program, solvable", [
    (("lookup", "add"), True), (("open", "mul", "lookup"), True),
    (("lookup", "open"), False),  # a box numbered in the hundreds
    (("add", "sub", "open"), False)])
def test_the_scripted_solver_solves_exactly_the_valid_instances(codec, program, solvable):
  env = ComposedEnv(codec, programs=(program,))
  inst, keys = _instances(env, 0, 16)
  assert bool(np.all(np.asarray(inst.valid))) == solvable
  outcome = scripted.episode_returns(scripted.batch_rollouts(env, inst, keys))["outcome"]
  np.testing.assert_array_equal(np.asarray(outcome) > 0.5, np.asarray(inst.valid))


def test_levels_draw_programs_up_to_their_length(codec):
  env = ComposedEnv(codec, programs=(("add", "add"), ("add", "add", "add", "add")))
  keys = jax.random.split(jax.random.key(0), 64)
  low = jax.vmap(lambda k: env.generate(k, 0))(keys)
  high = jax.vmap(lambda k: env.generate(k, 2))(keys)
  assert set(np.asarray(low.program).tolist()) == {0}
  assert set(np.asarray(high.program).tolist()) == {0, 1}


def test_bad_programs_are_refused(codec):
  for programs, message in (((), "empty"), ((("fly",),), "fly"), ((("add",) * 7,), "1 to 6")):
    with pytest.raises(ValueError, match=message):
      ComposedEnv(codec, programs=programs)


def test_propose_draws_distinct_programs_within_the_spec():
  spec = synthesis.Spec(ops=("add", "lookup"), min_ops=2, max_ops=3, candidates=100, seed=1)
  programs = synthesis.propose(spec)
  assert len(programs) == 4 + 8 == len(set(programs))  # every possible one, no more
  assert all(2 <= len(p) <= 3 and set(p) <= {"add", "lookup"} for p in programs)
  assert programs == synthesis.propose(spec)


def test_synthesize_filters_unsolvable_and_solved_candidates(codec, tmp_path):
  spec = synthesis.Spec(ops=("lookup", "open", "add"), min_ops=2, max_ops=2, candidates=9,
                        samples=8, max_policy_success=0.5)
  asked = []

  def policy(programs):  # the current policy solves the programs starting with add
    asked.append(list(programs))
    return np.array([1.0 if p[0] == "add" else 0.25 for p in programs])

  dataset = synthesis.synthesize(spec, policy, codec=codec)
  verdicts = {tuple(r["program"]): r["verdict"] for r in dataset["candidates"]}
  assert len(verdicts) == 9
  assert verdicts[("lookup", "open")] == verdicts[("add", "open")] == "unsolvable"
  assert verdicts[("add", "lookup")] == verdicts[("add", "add")] == "solved"
  assert verdicts[("lookup", "add")] == verdicts[("open", "add")] == "kept"
  # Only solvable candidates reach the policy.
  assert ("lookup", "open") not in asked[0] and ("open", "add") in asked[0]
  kept = [tuple(p) for p in dataset["programs"]]
  assert kept == [p for p, v in verdicts.items() if v == "kept"]
  path = str(tmp_path / "tasks.json")
  synthesis.write(path, dataset)
  assert synthesis.load_programs(path) == tuple(kept)


def test_load_programs_says_what_is_wrong(tmp_path):
  with pytest.raises(ValueError, match="cannot read"):
    synthesis.load_programs(str(tmp_path / "missing.json"))
  (tmp_path / "empty.json").write_text(json.dumps({"programs": []}))
  with pytest.raises(ValueError, match="keeps no programs"):
    synthesis.load_programs(str(tmp_path / "empty.json"))


@pytest.fixture(scope="module")
def tasks_file(tmp_path_factory):
  """A synthesised dataset written by the command line."""
  path = str(tmp_path_factory.mktemp("synth") / "tasks.json")
  spec = json.dumps({"ops": ["lookup", "add", "mul", "open"], "max_ops": 2, "candidates": 8,
                     "samples": 4})
  subprocess.run([sys.executable, "-m", "experiments.synthesize", f"--out={path}",
                  f"--spec={spec}"], check=True, cwd=ROOT, capture_output=True)
  return path


def _composed_cfg(tasks_file):
  cfg = default.get_config("tiny")
  cfg.tasks.update(families=("composed",), weights=(1.0,), programs=tasks_file)
  return cfg


def test_the_trainer_trains_on_a_synthesised_family(tasks_file, tmp_path):
  programs = synthesis.load_programs(tasks_file)
  cfg = _composed_cfg(tasks_file)
  run = run_lib.build(cfg)
  assert run.collector.env.envs[0].programs == programs
  inst = run.tasks.instances("train", np.arange(64))
  # Every prompt is one of the file's programs.
  assert set(np.asarray(inst.members[0].program).tolist()) <= set(range(len(programs)))
  loop.train(cfg, str(tmp_path))
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
  sft = [r["sft/nll"] for r in records if "sft/nll" in r]
  assert sft[-1] < sft[0]
  assert any("reward/outcome" in r for r in records) and "eval/success" in records[-1]


def test_the_shipped_synthesised_family_loads():
  cfg = default.get_config("tiny,composed")
  config_lib.validate(cfg)
  assert len(synthesis.load_programs(cfg.tasks.programs)) >= 8


@pytest.mark.parametrize("change, message", [
    (lambda c: c.tasks.update(families=("calc_chain",)), "not in config.tasks.families"),
    (lambda c: c.tasks.update(programs="/nonexistent.json"), "experiments.synthesize"),
])
def test_bad_task_datasets_are_refused(change, message, tasks_file):
  cfg = _composed_cfg(tasks_file)
  change(cfg)
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(cfg)


def test_policy_success_scores_a_run_on_each_program(tmp_path):
  cfg = default.get_config("tiny")
  cfg.stages = ("sft",)
  cfg.sft.steps = 2
  loop.train(cfg, str(tmp_path))
  programs = [("add", "add"), ("lookup", "mul")]
  first = train_synthesis.policy_success(str(tmp_path), programs, samples=3, rows=4)
  assert first.shape == (2,) and np.all((first >= 0) & (first <= 1))
  np.testing.assert_array_equal(
      first, train_synthesis.policy_success(str(tmp_path), programs, samples=3, rows=4))
