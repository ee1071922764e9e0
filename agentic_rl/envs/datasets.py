"""Task-instance datasets through tensorflow-datasets, without TensorFlow.

:class:`TaskInstances` writes seeded train/validation/test splits of one
environment's instances at one difficulty in the ``array_record`` format;
:func:`load_split` reads a split back with ``tfds.data_source`` (random
access, numpy). Each record holds the instance's arrays (one feature per
pytree leaf), its prompt text and its stream index.

Seeds. A split holds the instances of its stream (``splits.py``: instance
``i`` of split ``s`` is generated from ``instance_keys(seed, s, [i])``, the same
stream ``agentic_rl.train`` draws from), in index order, each record with its
``index``. The streams' keys are disjoint, but instance *content* can still
coincide by chance on small levels, so validation instances equal to a train
instance, and test instances equal to a train or validation instance, are
left out (their indices are skipped). Builds are deterministic for a seed.

(The ``tfrecord`` format, ``tfds.load`` and ``as_dataset`` need TensorFlow;
this module uses none of them.)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
import tensorflow_datasets as tfds

from agentic_rl.envs import registry
from agentic_rl.envs.splits import SPLITS, instance_keys
from agentic_rl.text import default_codec

PyTree = Any

MAX_SPLIT_SIZE = 1 << 30
_BATCH = 256


def _leaf_names(instance: PyTree) -> list[str]:
  paths = jax.tree_util.tree_flatten_with_path(instance)[0]
  return [".".join(str(getattr(k, "name", getattr(k, "idx", k))) for k in path)
          for path, _ in paths]


@dataclasses.dataclass(frozen=True)
class _Spec:
  env_name: str
  difficulty: int
  seed: int
  sizes: tuple[int, int, int]

  @property
  def config_name(self) -> str:
    return (f"{self.env_name}_d{self.difficulty}_seed{self.seed}_"
            + "_".join(map(str, self.sizes)))


class TaskInstances(tfds.core.GeneratorBasedBuilder):
  """Seeded task-instance splits of one environment (default configuration)
  at one difficulty level."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):
    """None: nothing is downloaded, so there is no checksums file to find.

    (tfds looks for one next to the builder's module, and on a package path
    that lookup imports ``importlib_resources``, absent here.)
    """
    return None

  def __init__(self, *, env_name: str = "calc_chain", difficulty: int = 0, seed: int = 0,
               num_train: int = 1000, num_validation: int = 100, num_test: int = 100,
               **kwargs):
    sizes = (num_train, num_validation, num_test)
    if any(not isinstance(n, int) or not 0 < n <= MAX_SPLIT_SIZE for n in sizes):
      raise ValueError(f"split sizes must be ints in [1, {MAX_SPLIT_SIZE}], got {sizes}")
    if not isinstance(seed, int) or seed < 0:
      raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    self.env = registry.make_env(env_name, default_codec())
    self.env.check_level(difficulty)
    self.spec = _Spec(env_name, difficulty, seed, sizes)
    probe = jax.eval_shape(self.env.generate, jax.random.key(0), difficulty)
    self.treedef = jax.tree.structure(probe)
    self.names = _leaf_names(probe)
    self._probe = jax.tree.leaves(probe)
    config = tfds.core.BuilderConfig(name=self.spec.config_name,
                                     description=f"{env_name} instances, level {difficulty}")
    super().__init__(config=config, file_format="array_record", **kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    leaves = {n: tfds.features.Tensor(shape=x.shape, dtype=x.dtype)
              for n, x in zip(self.names, self._probe)}
    return tfds.core.DatasetInfo(
        builder=self, description=__doc__.split("\n\n")[0],
        features=tfds.features.FeaturesDict(
            {"index": tfds.features.Scalar(np.int64), "prompt": tfds.features.Text(),
             **leaves}),
        disable_shuffling=True)

  def _instances(self, counts) -> dict[str, tuple[np.ndarray, list[np.ndarray]]]:
    """Per split, ``(indices, leaves)`` of its first ``counts[i]`` instances,
    generated in fixed-size batches by one compiled function."""
    level = self.spec.difficulty
    generate = jax.jit(jax.vmap(lambda k: jax.tree.leaves(self.env.generate(k, level))))
    out = {}
    for split, count in zip(SPLITS, counts):
      indices = np.arange(count, dtype=np.int64)
      padded = np.pad(indices, (0, -count % _BATCH), mode="edge")
      parts = [generate(instance_keys(self.spec.seed, split, padded[i:i + _BATCH]))
               for i in range(0, len(padded), _BATCH)]
      out[split] = (indices, [np.concatenate(x)[:count] for x in zip(*parts)])
    return out

  def _split_generators(self, dl_manager):
    del dl_manager
    taken: set[bytes] = set()
    splits = {}
    counts = [size + (0 if split == "train" else size // 4 + 16)
              for split, size in zip(SPLITS, self.spec.sizes)]
    candidates = self._instances(counts)
    for split, size in zip(SPLITS, self.spec.sizes):
      indices, leaves = candidates[split]
      rows, digests = [], []
      for i in range(len(indices)):
        digest = b"".join(x[i].tobytes() for x in leaves)
        if digest in taken:
          continue
        rows.append(i)
        digests.append(digest)
        if len(rows) == size:
          break
      if len(rows) < size:
        raise ValueError(f"{self.spec.env_name} level {self.spec.difficulty} has too few "
                         f"distinct instances for a {split} split of {size}")
      taken.update(digests)
      splits[split] = self._generate_examples(indices[rows], [x[rows] for x in leaves])
    return splits

  def _generate_examples(self, indices, leaves):
    for i, index in enumerate(indices):
      row = [x[i] for x in leaves]
      instance = jax.tree.unflatten(self.treedef, row)
      record = {"index": int(index), "prompt": self.env.prompt_text(instance)}
      record.update(zip(self.names, row))
      yield i, record

  def to_instance(self, record: dict) -> PyTree:
    """A record back into an (unbatched, numpy) instance pytree."""
    return jax.tree.unflatten(self.treedef, [np.asarray(record[n]) for n in self.names])


def build(env_name: str, difficulty: int, *, data_dir: str, **kwargs) -> TaskInstances:
  """Builds (once; later calls reuse the files) and returns the builder."""
  builder = TaskInstances(env_name=env_name, difficulty=difficulty, data_dir=data_dir, **kwargs)
  builder.download_and_prepare()
  return builder


@dataclasses.dataclass(frozen=True)
class TaskSplit:
  """One split, random access: ``split[i]`` is ``(instance, prompt, index)``
  (``index``: the instance's position in its split's stream)."""

  builder: TaskInstances
  source: Any

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, i: int) -> tuple[PyTree, str, int]:
    record = self.source[i]
    return self.builder.to_instance(record), record["prompt"].decode(), int(record["index"])

  def instances(self, indices) -> PyTree:
    """A batch of instances (leading axis), e.g. for a vmapped rollout."""
    rows = [self.builder.to_instance(self.source[int(i)]) for i in indices]
    return jax.tree.map(lambda *x: np.stack(x), *rows)


def load_split(env_name: str, difficulty: int, split: str, *, data_dir: str,
               **kwargs) -> TaskSplit:
  """Builds the dataset if needed and opens one split with ``tfds.data_source``."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
  builder = build(env_name, difficulty, data_dir=data_dir, **kwargs)
  source = tfds.data_source(
      builder.name, split=split,
      data_dir=os.fspath(data_dir),
      builder_kwargs=dict(env_name=env_name, difficulty=difficulty, **kwargs))
  return TaskSplit(builder, source)
