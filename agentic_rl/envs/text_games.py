"""A small Python ("host") environment speaking the text protocol, with
demonstrations: the built-in example of training your own environment.

Protocol (``agentic_rl.rollout.TextEnv``): ``reset(seed) -> observation``,
``step(action) -> (observation, reward, done)``; optionally
``demonstration(seed) -> list[str]``, the actions of a competent episode
(each ending with one stop piece, e.g. ``</answer>``), for the SFT stage.
"""

from __future__ import annotations

import re

import numpy as np

_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


class GuessNumber:
  """Guess a secret integer in ``[1, high]`` in at most ``max_guesses``
  guesses; each guess is answered "higher" or "lower".

  Reward 1 for the right number (the episode ends), 0 otherwise; an action
  without ``<answer>n</answer>`` costs a guess and is told the format. The
  secret is a function of the seed. The demonstration is binary search,
  which needs ``ceil(log2(high + 1))`` guesses at most.
  """

  def __init__(self, high: int = 16, max_guesses: int = 6):
    if high < 1 or max_guesses < 1:
      raise ValueError(f"high and max_guesses must be >= 1, got {high}, {max_guesses}")
    self.high, self.max_guesses = high, max_guesses
    self.secret, self.guesses = 1, 0

  def reset(self, seed: int) -> str:
    self.secret = int(np.random.default_rng(seed).integers(1, self.high + 1))
    self.guesses = 0
    return (f"I am thinking of a number from 1 to {self.high}. You have "
            f"{self.max_guesses} guesses; answer <answer>n</answer>.")

  def step(self, action: str) -> tuple[str, float, bool]:
    self.guesses += 1
    found = _ANSWER.findall(action)
    last = self.guesses >= self.max_guesses
    if not found:
      return "Answer with <answer>n</answer>.", 0.0, last
    guess = int(found[-1])
    if guess == self.secret:
      return "Correct.", 1.0, True
    return ("Higher." if guess < self.secret else "Lower."), 0.0, last

  def demonstration(self, seed: int) -> list[str]:
    self.reset(seed)
    lo, hi, actions = 1, self.high, []
    while True:
      guess = (lo + hi) // 2
      actions.append(f"<answer>{guess}</answer>")
      if guess == self.secret:
        return actions
      lo, hi = (guess + 1, hi) if guess < self.secret else (lo, guess - 1)
