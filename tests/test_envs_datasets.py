"""Task datasets (tfds array_record, no TensorFlow) and the tokenizer corpus."""

import jax
import numpy as np
import pytest

from agentic_rl.envs import corpus
from agentic_rl.envs import datasets
from agentic_rl.envs import prompts
from agentic_rl.envs import registry
from agentic_rl.envs import splits

SIZES = dict(num_train=300, num_validation=40, num_test=60)


def _records(split):
  return [split.source[i] for i in range(len(split))]


@pytest.fixture(scope="module")
def boxes_splits(tmp_path_factory):
  root = tmp_path_factory.mktemp("tfds")
  return {s: datasets.load_split("boxes", 0, s, data_dir=str(root), **SIZES)
          for s in splits.SPLITS}


def test_splits_read_back_with_random_access(boxes_splits):
  train, test = boxes_splits["train"], boxes_splits["test"]
  assert (len(train), len(boxes_splits["validation"]), len(test)) == (300, 40, 60)
  env = train.builder.env
  inst, prompt, index = test[7]
  assert prompt == env.prompt_text(inst) and prompt.startswith("Boxes 1-4")
  # The record is the instance of its stream index, as the trainer draws it.
  key = splits.instance_keys(0, "test", [index])[0]
  jax.tree.map(np.testing.assert_array_equal, inst,
               jax.tree.map(np.asarray, env.generate(key, 0)))
  batch = test.instances([0, 5, 7])
  np.testing.assert_array_equal(batch.answer[2], inst.answer)


def test_splits_are_disjoint(boxes_splits):
  content = lambda r: b"".join(np.asarray(v).tobytes() for k, v in sorted(r.items())
                               if k not in ("index", "prompt"))
  seen = {}
  for name in splits.SPLITS:
    rows = {content(r) for r in _records(boxes_splits[name])}
    for other, prev in seen.items():
      assert not rows & prev, (name, other)
    seen[name] = rows
  # The key streams differ too.
  keys = {s: set(map(tuple, np.asarray(jax.random.key_data(
      splits.instance_keys(0, s, np.arange(300)))).tolist())) for s in splits.SPLITS}
  assert not keys["train"] & keys["test"] and not keys["train"] & keys["validation"]


def test_builds_are_deterministic(tmp_path, boxes_splits):
  again = datasets.load_split("boxes", 0, "test", data_dir=str(tmp_path), **SIZES)
  for a, b in zip(_records(again), _records(boxes_splits["test"])):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  other = datasets.load_split("boxes", 0, "test", data_dir=str(tmp_path), seed=1, **SIZES)
  assert [r["prompt"] for r in _records(other)] != [r["prompt"] for r in _records(again)]


def test_dataset_errors(tmp_path):
  with pytest.raises(ValueError, match="split sizes"):
    datasets.TaskInstances(env_name="boxes", num_test=0, data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="difficulty"):
    datasets.TaskInstances(env_name="boxes", difficulty=9, data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="unknown split"):
    datasets.load_split("boxes", 0, "dev", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="unknown environment"):
    datasets.TaskInstances(env_name="chess", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="indices"):
    splits.instance_keys(0, "train", [-1])


def test_text_corpus():
  lines = list(corpus.text_corpus(seed=3, lines=600))
  assert len(lines) == 600 and lines == list(corpus.text_corpus(seed=3, lines=600))
  assert lines != list(corpus.text_corpus(seed=4, lines=600))
  assert prompts.SYSTEM_PROMPT in lines
  for start in ("Compute ", "Start at ", "Boxes 1-"):
    assert any(l.startswith(start) for l in lines), start
  # The corpus needs no tokenizer: environments build without one.
  assert registry.make_env("multihop", None).codec is None
