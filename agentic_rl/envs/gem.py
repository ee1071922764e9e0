"""Adapter from GEM environments (PyPI ``gem-llm``, optional) to :class:`TextEnv`.

GEM (Liu et al. 2025, "GEM: a Gym for agentic LLMs") environments follow the
Gymnasium API over text: ``reset(seed) -> (observation, info)`` and
``step(action) -> (observation, reward, terminated, truncated, info)``; game
moves are read from the last ``\\boxed{...}`` of the action. Install with
``pip install gem-llm==0.1.0`` (the ``gem`` extra). Offline game ids include
``game:GuessTheNumber-v0-easy`` and ``game:Mastermind-v0-easy``.

Note: GEM's ``reset(seed)`` reseeds Python's and NumPy's global RNGs.
"""

from __future__ import annotations


class GemEnv:
  """A GEM environment as a ``TextEnv`` (``done = terminated or truncated``).

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

  def reset(self, seed: int) -> str:
    observation, _ = self.env.reset(seed=seed)
    return observation

  def step(self, action: str) -> tuple[str, float, bool]:
    observation, reward, terminated, truncated, _ = self.env.step(action)
    return observation, float(reward), bool(terminated or truncated)
