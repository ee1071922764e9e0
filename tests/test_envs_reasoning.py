"""The reasoning-gym adapter: its demonstrations earn the dataset's full
score, answers are graded by the dataset, attempts are counted, and a run
trains on it through ``experiments.train``."""

import os

import pytest

from agentic_rl.envs import factories
from agentic_rl.envs import reasoning
from agentic_rl.train import loop
from agentic_rl.train import metrics as metrics_lib
from experiments.configs import default

pytest.importorskip("reasoning_gym", reason="reasoning-gym (pip install reasoning-gym) is optional")


@pytest.mark.parametrize("name,config", [("spell_backward", {}), ("leg_counting", {}),
                                         ("basic_arithmetic", {"max_terms": 3})])
def test_the_demonstration_earns_the_full_score(name, config):
  env = reasoning.ReasoningGymEnv(name, **config)
  for seed in (0, 5, 1 << 29):
    (action,) = env.demonstration(seed)
    assert env.reset(seed).endswith("Give your final answer as <answer>...</answer>.")
    assert env.step(action) == ("Correct.", 1.0, True)


def test_answers_are_graded_by_the_dataset_and_attempts_counted():
  env = reasoning.ReasoningGymEnv("spell_backward", max_attempts=3)
  question = env.reset(3)
  word = question.split(": ")[-1].split("\n")[0]
  assert env.step("I think it is olleh") == (
      "Give your final answer as <answer>...</answer>.", 0.0, False)
  assert env.step(f"<answer>{word}</answer>") == ("Wrong, try again.", 0.0, False)
  # The last attempt ends the episode with its grade; the reference is the
  # word backward.
  assert env.step(f"<answer>x</answer> <answer>{word[::-1]}</answer>") == ("Correct.", 1.0, True)
  env.reset(3)  # a new episode has all its attempts again
  assert env.step("<answer>x</answer>") == ("Wrong, try again.", 0.0, False)


def test_the_last_attempt_is_paid_its_partial_grade():
  env = reasoning.ReasoningGymEnv("spell_backward")
  env.reset(4)
  (answer,) = env.demonstration(4)
  answer = answer.removeprefix("<answer>").removesuffix("</answer>")
  graded = f"{answer} {answer[:2]}"
  observation, reward, done = env.step(f"<answer>{graded}</answer>")
  assert done and observation == "Wrong." and 0 < reward < 1
  assert reward == env.dataset.score_answer(graded, env.entry)


def test_noisy_demonstrations_retry_until_right_or_out_of_attempts():
  env = reasoning.ReasoningGymEnv("leg_counting", max_attempts=3)
  episodes = [env.demonstration(seed, noise=0.5) for seed in range(40)]
  assert env.demonstration(7, noise=0.5) == episodes[7]  # by the seed
  assert {len(e) for e in episodes} == {1, 2, 3}
  for seed, actions in enumerate(episodes):
    env.reset(seed)
    steps = [env.step(a) for a in actions]
    assert all(not done for _, _, done in steps[:-1]) and steps[-1][2]
    assert steps[-1][1] == 1.0 or len(actions) == 3
  with pytest.raises(ValueError, match="noise"):
    env.demonstration(0, noise=1.5)


def test_the_same_seed_poses_the_same_question_in_every_environment():
  a, b = reasoning.ReasoningGymEnv("leg_counting"), reasoning.ReasoningGymEnv("leg_counting")
  assert a.reset(17) == b.reset(17) and a.reset(17) != a.reset(18)
  assert reasoning.ReasoningGymEnv("leg_counting", dataset_seed=1).reset(17) != a.reset(17)


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match="max_attempts"):
    reasoning.ReasoningGymEnv("spell_backward", max_attempts=0)
  with pytest.raises(ValueError):
    reasoning.ReasoningGymEnv("no_such_dataset")
  with pytest.raises(RuntimeError, match="before reset"):
    reasoning.ReasoningGymEnv("spell_backward").step("<answer>x</answer>")


def test_reasoning_gym_names_a_dataset():
  env = factories.load_factory("reasoning_gym:spell_backward")(max_attempts=2)
  assert isinstance(env, reasoning.ReasoningGymEnv) and env.max_attempts == 2


def test_a_reasoning_gym_task_warm_starts_on_its_answers_then_trains(tmp_path):
  cfg = default.get_config("tiny")
  cfg.tasks.update(source="host", host_env="reasoning_gym:spell_backward",
                   host_kwargs='{"max_attempts": 2, "max_word_len": 5}')
  cfg.sampling.update(max_turns=2, max_total_tokens=192)
  summary = loop.train(cfg, str(tmp_path))
  records = metrics_lib.read_metrics(os.path.join(str(tmp_path), "metrics.jsonl"))
  assert summary["steps"] == cfg.sft.steps + cfg.rl.iterations
  sft, rl = records[:cfg.sft.steps], records[cfg.sft.steps:]
  assert sft[0]["sft/demos"] > 0 and sft[-1]["sft/nll"] < sft[0]["sft/nll"]
  assert all(r["episode/env_errors"] == 0 and r["episode/turns"] >= 1 for r in rl)
