"""Adapter from reasoning-gym datasets (PyPI ``reasoning-gym``, optional) to
the text protocol: ``config.tasks.host_env="reasoning_gym:<dataset>"``.

reasoning-gym (Stojanovski et al. 2025) generates verifiable reasoning
problems procedurally: ``create_dataset(name, seed, size, **config)[i]`` is a
``{"question", "answer", "metadata"}`` entry and
``dataset.score_answer(answer, entry)`` grades an answer in ``[0, 1]``.
Install with ``pip install reasoning-gym`` (the ``reasoning`` extra).
"""

from __future__ import annotations

import functools
import json
import re

import numpy as np

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Entry i of a dataset exists for any i below its (virtual) size: the host
# path's seeds (agentic_rl.envs.python_tasks.SPLIT_OFFSETS) are below 2**30.
_SIZE = 1 << 31


@functools.lru_cache(maxsize=16)
def _dataset(name: str, seed: int, config_json: str):
  try:
    import reasoning_gym  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("ReasoningGymEnv needs the optional reasoning-gym package: "
                      "pip install -e '.[hubs]'") from e
  return reasoning_gym.create_dataset(name, seed=seed, size=_SIZE, **json.loads(config_json))


class ReasoningGymEnv:
  """One reasoning-gym dataset as a ``TextEnv``, answered in up to
  ``max_attempts`` turns.

  ``reset(seed)`` poses entry ``seed`` of the dataset (generated from
  ``dataset_seed``). Each action's last ``<answer>...</answer>`` is graded by
  the dataset's ``score_answer``; the episode ends with that score as reward
  when it is 1 or no attempt is left, and a lower score is told "Wrong, try
  again." with reward 0 (the reward is the last attempt's grade, so a return
  never exceeds 1). An action without an answer is told the format and costs
  an attempt. The demonstration answers the dataset's reference answer
  (after mistakes, with ``noise``).

  Args:
    name: a reasoning-gym dataset name, e.g. ``"spell_backward"``.
    max_attempts: answers allowed per episode (>= 1).
    dataset_seed: the seed the dataset is generated from.
    **config: the dataset's own options (e.g. ``min_word_len=3``).
  Raises:
    ImportError: when reasoning-gym is not installed, with the install command.
    ValueError: for an unknown dataset or option (from reasoning-gym), or
      ``max_attempts`` < 1.
  """

  def __init__(self, name: str, max_attempts: int = 1, dataset_seed: int = 0, **config):
    if max_attempts < 1:
      raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    self.name, self.max_attempts = name, max_attempts
    self.dataset = _dataset(name, dataset_seed, json.dumps(config, sort_keys=True))
    self.entry, self.attempts = None, 0

  def reset(self, seed: int) -> str:
    self.entry, self.attempts = self.dataset[int(seed)], 0
    return f"{self.entry['question']}\nGive your final answer as <answer>...</answer>."

  def step(self, action: str) -> tuple[str, float, bool]:
    if self.entry is None:
      raise RuntimeError("step before reset")
    self.attempts += 1
    last = self.attempts >= self.max_attempts
    if not (found := _ANSWER.findall(action)):
      return "Give your final answer as <answer>...</answer>.", 0.0, last
    score = float(self.dataset.score_answer(found[-1].strip(), self.entry))
    if score >= 1.0 or last:
      return ("Correct." if score >= 1.0 else "Wrong."), score, True
    return "Wrong, try again.", 0.0, False

  def demonstration(self, seed: int, noise: float = 0.0) -> list[str]:
    """The reference answer; with ``noise`` > 0 each attempt is, with that
    probability (drawn from the seed), another entry's answer instead, and
    the next attempt tries again (an episode that may run out of attempts)."""
    if not 0.0 <= noise <= 1.0:
      raise ValueError(f"noise must be in [0, 1], got {noise}")
    rng = np.random.default_rng([seed, 3])
    answer = self.dataset[int(seed)]["answer"]
    actions = []
    for _ in range(self.max_attempts):
      wrong = self.dataset[int(rng.integers(1 << 30))]["answer"] if rng.random() < noise else answer
      actions.append(f"<answer>{wrong}</answer>")
      if wrong == answer:
        break
    self.reset(seed)
    return actions
