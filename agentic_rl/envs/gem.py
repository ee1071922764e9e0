"""Adapter from GEM environments (PyPI ``gem-llm``, optional) to :class:`TextEnv`.

GEM (Liu et al. 2025, "GEM: a Gym for agentic LLMs") environments follow the
Gymnasium API over text: ``reset(seed) -> (observation, info)`` and
``step(action) -> (observation, reward, terminated, truncated, info)``; game
moves are read from the last ``\\boxed{...}`` of the action. Install with
``pip install gem-llm==0.1.0`` (the ``gem`` extra). Offline game ids include
``game:GuessTheNumber-v0-easy`` and ``game:Mastermind-v0-easy``.

The games in :data:`EXPERTS` also have demonstrations (for an SFT warm
start): a scripted expert plays the game itself, reading only the text the
policy reads, and :meth:`GemEnv.demonstration` returns its moves.

Note: GEM's ``reset(seed)`` reseeds Python's and NumPy's global RNGs.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence

import numpy as np

_RANGE = re.compile(r"between (\d+) and (\d+)")
_HINT = re.compile(r"you guessed (\d+), and the target number is (higher|lower)")


def guess_the_number(observations: Sequence[str]) -> str:
  """Binary search: the middle of the interval the hints so far leave
  (``observations[0]`` states the range); wins whenever the game allows
  ``ceil(log2(size + 1))`` turns."""
  lo, hi = map(int, _RANGE.search(observations[0]).groups())
  for obs in observations[1:]:
    if m := _HINT.search(obs):
      guess = int(m[1])
      lo, hi = (guess + 1, hi) if m[2] == "higher" else (lo, guess - 1)
  return f"\\boxed{{{(lo + hi) // 2}}}"


_CODE = re.compile(r"secret (\d+) digit code")
_DIGITS = re.compile(r"digits from (\d+) to (\d+)")
_PEGS = re.compile(r"you guessed \[([\d, ]+)\]\. This guess receives (\d+) black peg\(s\) "
                   r"and (\d+) white peg\(s\)")


def _pegs(guess: Sequence[int], code: Sequence[int]) -> tuple[int, int]:
  black = sum(g == c for g, c in zip(guess, code))
  common = sum(min(guess.count(d), code.count(d)) for d in set(guess))
  return black, common - black


def mastermind(observations: Sequence[str]) -> str:
  """The first code (in lexicographic order) consistent with every answer
  so far: ``(black, white)`` pegs of each earlier guess."""
  length = int(_CODE.search(observations[0])[1])
  low, high = map(int, _DIGITS.search(observations[0]).groups())
  digits = range(low, high + 1)
  codes = (itertools.permutations(digits, length) if "not allowed" in observations[0]
           else itertools.product(digits, repeat=length))
  answers = [(tuple(int(d) for d in m[1].split(",")), (int(m[2]), int(m[3])))
             for obs in observations[1:] if (m := _PEGS.search(obs))]
  code = next(c for c in codes if all(_pegs(list(g), list(c)) == a for g, a in answers))
  return "\\boxed{" + " ".join(map(str, code)) + "}"


# GEM game name (the id's part before "-v") -> its expert: the observations
# so far -> the next action.
EXPERTS: dict[str, Callable[[Sequence[str]], str]] = {
    "game:GuessTheNumber": guess_the_number, "game:Mastermind": mastermind}


class GemEnv:
  """A GEM environment as a ``TextEnv`` (``done = terminated or truncated``).

  Games with an expert in :data:`EXPERTS` also have
  ``demonstration(seed, noise=0.0) -> list[str]``: the expert's moves in the
  episode ``reset(seed)`` starts, a share ``noise`` of them random moves.

  Args:
    env_id: a registered GEM id, e.g. ``"game:GuessTheNumber-v0-easy"``.
    **kwargs: passed to ``gem.make``.
  Raises:
    ImportError: when ``gem-llm`` is not installed, with the install command.
    ValueError: for an unknown id (from GEM).
  """

  def __init__(self, env_id: str, **kwargs):
    try:
      import gem  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise ImportError("GemEnv needs the optional GEM suite: "
                        "pip install 'gem-llm==0.1.0'") from e
    self.env_id = env_id
    self.env = gem.make(env_id, **kwargs)
    self.expert = EXPERTS.get(env_id.split("-v")[0])
    if self.expert is not None:  # only games with an expert offer demonstrations
      self.demonstration = self._demonstration

  def reset(self, seed: int) -> str:
    observation, _ = self.env.reset(seed=seed)
    return observation

  def step(self, action: str) -> tuple[str, float, bool]:
    observation, reward, terminated, truncated, _ = self.env.step(action)
    return observation, float(reward), bool(terminated or truncated)

  def _demonstration(self, seed: int, noise: float = 0.0, max_moves: int = 1000) -> list[str]:
    """The expert's moves from ``reset(seed)``; with ``noise`` > 0 each move
    is, with that probability (drawn from the seed), the game's
    ``sample_random_action()`` instead, and the expert plays on from what it
    shows: an episode that may run out of turns before the end."""
    if not 0.0 <= noise <= 1.0:
      raise ValueError(f"noise must be in [0, 1], got {noise}")
    rng = np.random.default_rng([seed, 2])
    observations, actions = [self.reset(seed)], []
    for _ in range(max_moves):
      mistake = rng.random() < noise
      actions.append(self.env.sample_random_action() if mistake else self.expert(observations))
      observation, _, done = self.step(actions[-1])
      if done:
        return actions
      observations.append(observation)
    raise RuntimeError(f"{self.env_id}: the expert did not finish in {max_moves} moves")
