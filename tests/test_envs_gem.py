"""GEM's experts: they win the games they script, from the text alone, and
give the games their demonstrations; a game without one offers none."""

import pytest

from agentic_rl.envs import gem
from agentic_rl.train import config as config_lib
from experiments.configs import default

pytest.importorskip("gem", reason="GEM (pip install gem-llm==0.1.0) is optional")


def _play(env, actions, seed):
  observation, reward, done = env.reset(seed), 0.0, False
  for action in actions:
    assert not done, "the episode ended before the demonstration did"
    observation, reward, done = env.step(action)
  return observation, reward, done


@pytest.mark.parametrize("env_id", ["game:GuessTheNumber-v0-easy", "game:GuessTheNumber-v0-hard",
                                    "game:GuessTheNumber-v0-random", "game:Mastermind-v0-easy",
                                    "game:Mastermind-v0-hard", "game:Mastermind-v0-random"])
def test_the_expert_wins_every_game_it_demonstrates(env_id):
  env = gem.GemEnv(env_id)
  for seed in range(40):
    actions = env.demonstration(seed)
    observation, reward, done = _play(env, actions, seed)
    assert done and observation.startswith("Congratulations"), (seed, actions, observation)
    if "GuessTheNumber" in env_id:
      assert reward == 1.0


def test_binary_search_reads_the_range_and_the_hints():
  rules = "You have to guess the number between 11 and 20 (inclusive) within 4 turns."
  assert gem.guess_the_number([rules]) == "\\boxed{15}"
  hints = [rules, "At turn 1, you guessed 15, and the target number is higher than 15.",
           "At turn 2, you guessed 18, and the target number is lower than 18."]
  assert gem.guess_the_number(hints) == "\\boxed{16}"


def test_mastermind_guesses_the_first_consistent_code():
  rules = ("You have to guess the secret 2 digit code within 10 turns.\nThe code consists of "
           "digits from 1 to 4 (inclusive). Duplicate numbers are not allowed.")
  assert gem.mastermind([rules]) == "\\boxed{1 2}"
  # (1, 2) scored one white peg: one of 1, 2 is in the code, in the other place.
  answer = "At turn 1, you guessed [1, 2]. This guess receives 0 black peg(s) and 1 white peg(s)."
  assert gem.mastermind([rules, answer]) == "\\boxed{2 3}"


def test_a_demonstration_does_not_depend_on_earlier_episodes():
  env = gem.GemEnv("game:Mastermind-v0-easy")
  first = env.demonstration(7)
  env.demonstration(3)
  env.reset(11)
  env.step("\\boxed{1 2}")
  assert env.demonstration(7) == first


def test_only_games_with_an_expert_offer_demonstrations():
  assert callable(getattr(gem.GemEnv("game:GuessTheNumber-v0-easy"), "demonstration", None))
  assert getattr(gem.GemEnv("game:Minesweeper-v0-easy"), "demonstration", None) is None
  cfg = default.get_config("gem,tiny")
  config_lib.validate(cfg)  # the expert's game warm-starts
  cfg.tasks.host_env = "gem:game:Minesweeper-v0-easy"
  with pytest.raises(ValueError, match="stages=rl"):
    config_lib.validate(cfg)


def test_noisy_demonstrations_play_random_moves_among_the_experts():
  env = gem.GemEnv("game:GuessTheNumber-v0-easy")
  clean = [env.demonstration(seed) for seed in range(40)]
  noisy = [env.demonstration(seed, 0.5) for seed in range(40)]
  assert noisy == [env.demonstration(seed, 0.5) for seed in range(40)]  # a function of the seed
  assert env.demonstration(3, 0.0) == clean[3]
  wins = 0
  for seed, actions in enumerate(noisy):
    observation, _, done = _play(env, actions, seed)
    assert done  # every demonstration plays to the episode's end
    wins += observation.startswith("Congratulations")
  assert sum(a != c for a, c in zip(noisy, clean)) > 10 and 0 < wins < 40
  with pytest.raises(ValueError, match="noise"):
    env.demonstration(0, 1.5)
