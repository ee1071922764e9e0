"""Packed SFT rows: every demonstration once and intact, scored as if alone."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_rl.model import scoring, transformer
from agentic_rl.text import codec
from agentic_rl.train import learner, loop
from agentic_rl.train import metrics as metrics_lib
from agentic_rl.train import run as run_lib
from experiments.configs import default

PAD = 0


def _padded(lengths, T, seed=0):
  rng = np.random.default_rng(seed)
  tokens = np.full((len(lengths), T), PAD, np.int32)
  mask = np.zeros((len(lengths), T), np.float32)
  for i, n in enumerate(lengths):
    tokens[i, :n] = rng.integers(1, 50, n)
    mask[i, n // 2:n] = 1.0
  return tokens, mask


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 16), min_size=1, max_size=30))
def test_every_sequence_is_packed_once_and_intact(lengths):
  T = 16
  tokens, mask = _padded(lengths, T)
  p = codec.pack_rows(tokens, mask, PAD)
  found = []
  for r in range(p["tokens_BxT"].shape[0]):
    seg = p["segment_ids_BxT"][r]
    ids = [s for s in np.unique(seg) if s]
    assert ids == list(range(1, len(ids) + 1))
    # Sequences sit back to back from the row's start, then pad.
    assert np.all(np.diff((seg > 0).astype(int)) <= 0)
    for s in ids:
      at = np.flatnonzero(seg == s)
      np.testing.assert_array_equal(p["positions_BxT"][r, at], np.arange(len(at)))
      found.append((tuple(p["tokens_BxT"][r, at]), tuple(p["loss_mask_BxT"][r, at])))
    assert np.all(p["tokens_BxT"][r, seg == 0] == PAD)
    assert np.all(p["loss_mask_BxT"][r, seg == 0] == 0)
  want = [(tuple(tokens[i, :n]), tuple(mask[i, :n])) for i, n in enumerate(lengths)]
  assert sorted(found) == sorted(want)
  # Best fit never needs more rows than sequences, nor fewer than the tokens need.
  assert -(-sum(lengths) // T) <= p["tokens_BxT"].shape[0] <= len(lengths)


@pytest.mark.parametrize("jit", [pytest.param(False, marks=pytest.mark.slow), True])
def test_packed_rows_score_each_sequence_as_alone(jit):
  cfg = default.get_config("all,tiny")
  run = run_lib.build(cfg)
  data = run.demonstrations(None, cfg.sft, jax.random.key(0))
  packed = codec.pack_rows(data["tokens_BxT"], data["loss_mask_BxT"], run.codec.ids.pad)
  assert packed["tokens_BxT"].shape[0] < 0.7 * data["tokens_BxT"].shape[0]
  params = transformer.init_params(run.model_config, jax.random.key(1))
  def score(**kw):
    return scoring.sequence_logprobs(params, config=run.model_config, **kw)[0]

  score = jax.jit(score) if jit else score
  alone = np.asarray(score(tokens_BxT=data["tokens_BxT"]))
  together = np.asarray(score(tokens_BxT=packed["tokens_BxT"],
                              positions_BxT=packed["positions_BxT"],
                              segment_ids_BxT=packed["segment_ids_BxT"]))
  # The same multiset of masked log-probs, and the same SFT loss.
  np.testing.assert_allclose(np.sort(alone[data["loss_mask_BxT"] > 0]),
                             np.sort(together[packed["loss_mask_BxT"] > 0]), atol=2e-5)
  loss = learner.sft_loss(run.model_config)
  n = {"num_tokens": float(data["loss_mask_BxT"].sum())}
  np.testing.assert_allclose(loss(params, data, n)[0], loss(params, packed, n)[0], rtol=1e-5)


def test_packing_and_the_schedule_through_the_trainer(tmp_path):
  # Packed: the same rows a step hold about twice the demonstrations; the
  # learning rate warms up for a step, then the cosine decays it to 0 at the
  # stage's end.
  cfg = default.get_config("all,tiny")
  cfg.stages = ("sft",)
  cfg.sft.update(steps=4, pack=True, warmup_steps=1, learning_rate=1e-3,
                 schedule="warmup_cosine")
  loop.train(cfg, str(tmp_path / "packed"))
  records = metrics_lib.read_metrics(str(tmp_path / "packed" / "metrics.jsonl"))
  assert all(r["sft/demos"] > cfg.sft.batch_size for r in records)
  assert np.mean([r["sft/demos"] for r in records]) > 1.4 * cfg.sft.batch_size
  assert all(np.isfinite(r["sft/nll"]) for r in records)
  np.testing.assert_allclose([r["learner/lr"] for r in records],
                             [0.0, 1e-3, 7.5e-4, 2.5e-4], rtol=1e-5)
  # Unpacked, with the default constant rate after the warm-up.
  cfg.sft.update(pack=False, schedule="")
  loop.train(cfg, str(tmp_path / "plain"))
  plain = metrics_lib.read_metrics(str(tmp_path / "plain" / "metrics.jsonl"))
  assert [r["sft/demos"] for r in plain] == [cfg.sft.batch_size] * 4
  np.testing.assert_allclose([r["learner/lr"] for r in plain], [0.0, 1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("weights, first_boxes", [((1.0, 0.0, 0.0), {"1"}),
                                                  ((0.0, 1.0, 0.0), {"8", "6", "4"}),
                                                  ((), None)])
def test_strategy_weights_pick_the_demonstrated_strategies(weights, first_boxes):
  # The boxes family's strategies: linear opens box 1 first, reverse the
  # last box, binary one in the middle.
  cfg = default.get_config("all,tiny")
  cfg.tasks.update(families=("boxes",), weights=(1.0,), difficulty=(0, 1, 2))
  cfg.sft.update(demo_noise=0.0, num_demos=60)
  cfg.sft.strategy_weights.boxes = weights
  run = run_lib.build(cfg)
  data = run.demonstrations(None, cfg.sft, jax.random.key(0))
  opened = set()
  for row in data["tokens_BxT"]:
    text = run.codec.tokenizer.decode(row.tolist())
    opened.add(text.split("<tool_call>open ", 1)[1].split("<", 1)[0])
  if first_boxes:
    assert opened == first_boxes
  else:  # equal shares: every strategy's first box
    assert {"1", "8"} <= opened and len(opened) > 3
