"""The learner with group prefix sharing: the step, its reference scores and
the scoring pass give the unshared values, and run each group's prefix once."""

import chex
import jax
import numpy as np
import optax
import pytest

from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl.model import prefix
from agentic_rl.train import learner
from agentic_rl.train import sharding

CFG = model_lib.TransformerConfig.tiny(vocab_size=64)
P, G, T, SHARED = 4, 2, 16, 9  # groups share 9 tokens: the bucket is 8


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  head = np.repeat(rng.integers(1, CFG.vocab_size, (P, 1, SHARED)), G, axis=1)
  tail = rng.integers(1, CFG.vocab_size, (P, G, T - SHARED))
  tokens = np.concatenate([head, tail], axis=2).reshape(P * G, T).astype(np.int32)
  mask = (rng.uniform(size=(P * G, T)) < 0.7).astype(np.float32)
  mask[:, :SHARED] = 0.0
  return {"tokens_BxT": tokens, "loss_mask_BxT": mask,
          "advantages": rng.standard_normal(P * G).astype(np.float32),
          "behaviour_logp_BxT": -rng.uniform(size=(P * G, T)).astype(np.float32)}


@pytest.fixture
def prefix_lens(monkeypatch):
  """The prefix lengths the model's shared forward is traced with."""
  seen = []
  forward_hidden = prefix.forward_hidden

  def spy(*args, prefix_len, **kwargs):
    seen.append(prefix_len)
    return forward_hidden(*args, prefix_len=prefix_len, **kwargs)

  monkeypatch.setattr(prefix, "forward_hidden", spy)
  return seen


@pytest.mark.parametrize("micro_batches", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_the_step_with_a_group_size_updates_as_without(micro_batches, prefix_lens):
  """A PPO step with a KL penalty scored inside it (``reference_inputs``)."""
  mesh = sharding.make_mesh(sharding.MeshConfig(data=-1))
  # Host copies: the step donates its state.
  params = jax.tree.map(np.asarray, model_lib.init_params(CFG, jax.random.key(0)))
  ref = jax.tree.map(np.asarray, model_lib.init_params(CFG, jax.random.key(1)))
  opt = optax.sgd(0.5)  # Adam would magnify the rounding of near-zero gradients
  obj = objectives.ObjectiveConfig(loss="ppo", kl_coef=0.1)
  results = []
  for group_size in (1, G):
    step, state_sh = learner.shard_train_step(
        learner.make_train_step(
            learner.rl_loss(CFG, obj, group_size=group_size), opt,
            micro_batches=micro_batches,
            prepare=learner.reference_inputs(CFG, group_size=group_size)),
        mesh, CFG, opt, params, with_reference=True, group_size=group_size)
    state = jax.device_put(learner.init_train_state(params, opt, ref), state_sh)
    batch = sharding.shard_batch(_batch(), mesh)
    state, metrics, outputs = step(state, batch)
    state, metrics2, _ = step(state, batch)  # the length is found once per batch
    results.append((state.params, metrics, metrics2, outputs))
  # The policy and the reference ran the shared forward, at the bucket.
  assert len(prefix_lens) >= 2 and set(prefix_lens) == {8}
  (params_a, m_a, m2_a, out_a), (params_b, m_b, m2_b, out_b) = results
  for m, n in ((m_a, m_b), (m2_a, m2_b)):
    for k in ("learner/loss", "learner/pg_loss", "shift/kl_reference", "learner/grad_norm"):
      np.testing.assert_allclose(n[k], m[k], rtol=1e-5, atol=1e-7, err_msg=k)
  chex.assert_trees_all_close(out_b, out_a, atol=1e-5)
  chex.assert_trees_all_close(params_b, params_a, atol=1e-5)
  assert float(m2_a["shift/kl_reference"]) > 0


def test_the_scoring_pass_with_a_group_size_scores_as_without(prefix_lens):
  mesh = sharding.make_mesh(sharding.MeshConfig(data=-1))
  params = model_lib.init_params(CFG, jax.random.key(0))
  ref = model_lib.init_params(CFG, jax.random.key(1))
  tokens = sharding.shard_batch(_batch()["tokens_BxT"], mesh)
  scores = [learner.shard_score(mesh, CFG, params, temperature=0.8, with_reference=True,
                                group_size=g)(params, ref, tokens, np.float32(1.0))
            for g in (1, G)]
  assert prefix_lens == [8, 8]
  chex.assert_trees_all_close(scores[1], scores[0], atol=1e-5)


def test_shared_prefix_len_of_a_batch():
  tokens = _batch()["tokens_BxT"]
  assert learner.shared_prefix_len(tokens, G) == 8
  assert learner.shared_prefix_len(tokens, 1) == 0  # no groups: nothing shared
  assert learner.shared_prefix_len(tokens, 3) == 0  # 8 rows are not groups of 3
  assert learner.shared_prefix_len(tokens, 2 * G) == 0  # two prompts per group
  mesh = sharding.make_mesh(sharding.MeshConfig(data=-1))
  assert learner.shared_prefix_len(sharding.shard_batch(tokens, mesh), G) == 8
