"""Reading loss masks in tests: the actions of a demonstration stream."""

import numpy as np


def action_lengths(mask_T) -> np.ndarray:
  """Lengths of the runs of 1s in a ``[T]`` loss mask: the stream's actions."""
  edges = np.diff(np.concatenate([[0], np.asarray(mask_T), [0]]))
  return np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)


def longest_action(mask_NxT) -> int:
  """The longest action in a batch of loss masks."""
  return max(int(action_lengths(m).max(initial=0)) for m in mask_NxT)
