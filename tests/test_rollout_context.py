"""Context management in the host loop: each policy rewrites a full context
into a new segment; every segment is scored as the policy saw it."""

import jax
import numpy as np
import pytest

from agentic_rl import model as model_lib
from agentic_rl import rollout
from agentic_rl.envs.text_games import Ledger
from agentic_rl.rollout import context as context_lib
from agentic_rl.text import default_codec

SAMPLING = rollout.SamplingConfig(max_new_tokens_per_turn=12, max_turns=16,
                                  max_total_tokens=224)
POLICIES = ("drop_tool_results", "summary", "discard_all")
_learner_logprobs = jax.jit(rollout.learner_logprobs, static_argnums=(2, 3))


@pytest.fixture(scope="module")
def codec():
  return default_codec()


@pytest.fixture(scope="module")
def model(codec):
  config = model_lib.TransformerConfig.tiny(vocab_size=codec.tokenizer.vocab_size)
  return config, model_lib.init_params(config, jax.random.key(0))


def _demo_actor(seeds, request, entries):
  """The ledger's competent actions, and its summary when asked for one."""
  scripts = {b: list(Ledger(entries).demonstration(int(s))) for b, s in enumerate(seeds)}
  seen = {b: [] for b in scripts}
  written = {b: [] for b in scripts}

  def actor(b, obs):
    if obs == request:
      action = Ledger().summary(seen[b])
    else:
      seen[b].append(obs)
      action = scripts[b].pop(0)
    written[b].append(action)
    return action
  return actor, written


def _play(codec, model, policy, seeds=(1, 2), entries=8, **kwargs):
  config, params = model
  ctx = rollout.ContextConfig(policy=policy, **kwargs)
  loop = rollout.HostLoop(config, SAMPLING, codec, batch_size=len(seeds), max_obs_tokens=32,
                          context=ctx)
  actor, written = _demo_actor(seeds, ctx.summary_request, entries)
  out = loop.run(params, [Ledger(entries) for _ in seeds], list(seeds), jax.random.key(0), 3,
                 actor=actor)
  return out, written


def test_without_context_management_the_ledger_is_truncated(codec, model):
  out, _ = _play(codec, model, "none")
  assert out.segments is None
  np.testing.assert_array_equal(out.truncated_B, [True, True])
  np.testing.assert_array_equal(out.reward_B, [0.0, 0.0])


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_finishes_and_segments_are_what_was_sampled(codec, model, policy):
  config, params = model
  out, written = _play(codec, model, policy)
  np.testing.assert_array_equal(out.done_B, [True, True])
  np.testing.assert_array_equal(out.reward_B, [1.0, 1.0])
  count = np.asarray(out.segments.count_B)
  assert np.all(count >= 1), count
  rows = rollout.scored_rows(out)
  B = 2
  assert rows.num_rows % B == 0 and rows.num_rows >= B + count.sum()
  np.testing.assert_array_equal(rows.episode_R[:B], [0, 1])
  # Scored rows: the final context, then each earlier segment in order.
  for b in range(B):
    order = [b] + [B + int(count[:b].sum()) + k for k in range(int(count[b]))]
    order = order[1:] + order[:1]  # earlier segments first, the final context last
    policy_ids = np.concatenate([rows["tokens_RxT"][r][rows["loss_mask_RxT"][r] > 0]
                                 for r in order])
    expected = []
    for action in written[b]:
      ids = codec.tokenizer.encode(action)
      expected += ids if ids[-1] in codec.ids.stop_ids else ids + [codec.turn_end_id]
    # Every policy token is scored exactly once, in the segment it was written in.
    np.testing.assert_array_equal(policy_ids, expected)
    for r in order:
      assert np.all(rows["version_RxT"][r][rows["loss_mask_RxT"][r] > 0] == 3)
  # What the policy saw when it wrote each token is what the learner scores.
  learner = _learner_logprobs(params, rows["tokens_RxT"], config, SAMPLING)
  mask = rows["loss_mask_RxT"] > 0
  diff = np.abs(np.asarray(learner) - rows["behaviour_logp_RxT"])[mask]
  assert diff.max() < 1e-4, diff.max()
  assert np.all(rows["loss_mask_RxT"][rows.episode_R < 0] == 0)
  metrics = context_lib.context_metrics(out)
  assert metrics["episode/context_resets"] == count.mean()
  assert metrics["episode/peak_context_tokens"] <= SAMPLING.max_total_tokens


def test_the_new_contexts(codec, model):
  """What each policy keeps, read off the final context before its first
  policy token: the task always; drop every action and the last k
  observations; discard the last turn; summary the request and the summary."""
  text = lambda ids: codec.tokenizer.decode([int(i) for i in ids if i != codec.ids.pad])  # noqa: E731
  head, whole = {}, {}
  for policy in POLICIES:
    out, _ = _play(codec, model, policy, seeds=(1,))
    tokens, mask = np.asarray(out.tokens_BxT[0]), np.asarray(out.loss_mask_BxT[0])
    head[policy] = text(tokens[:np.flatnonzero(mask)[0]])
    whole[policy] = text(tokens)
    task = text(out.segments.tokens_BxKxT[0, 0])[:60]
    assert head[policy].startswith(task)
  drop = head["drop_tool_results"]
  n_calls = drop.count("<tool_call>next")
  assert n_calls >= 6 and drop.count("(omitted)") == n_calls - 2
  assert drop.count("entry") == 2  # keep_tool_results=2
  assert head["discard_all"].count("<tool_call>next") == 1
  assert head["discard_all"].count("<tool_result>") == 1
  summary = head["summary"]
  assert summary.count("<tool_call>next") == 1 and summary.count("running total") == 1
  assert summary.index("Context full: summarize.") < summary.index("running total")


def test_max_resets_bounds_the_rewrites(codec, model):
  out, _ = _play(codec, model, "discard_all", entries=10, max_resets=1)
  np.testing.assert_array_equal(out.segments.count_B, [1, 1])
  np.testing.assert_array_equal(out.truncated_B, [True, True])


def test_bad_configs_are_refused(codec, model):
  with pytest.raises(ValueError, match="context.policy"):
    rollout.ContextConfig(policy="compress").validate()
  with pytest.raises(ValueError, match="keep_tool_results"):
    rollout.ContextConfig(policy="drop_tool_results", keep_tool_results=0).validate()
  with pytest.raises(ValueError, match="summary request"):
    rollout.HostLoop(model[0], SAMPLING, codec, batch_size=1, max_obs_tokens=2,
                     context=rollout.ContextConfig(policy="summary"))


def test_scored_rows_of_a_synthetic_batch():
  """Rows: final contexts first, then earlier segments in episode order, then
  padding to a multiple of B; per-episode values reach every row."""
  B, K, T = 2, 3, 4
  final = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], np.float32)
  seg_mask = np.zeros((B, K, T), np.float32)
  seg_mask[0, 0, :2] = 1  # episode 0 has two earlier segments, episode 1 one
  seg_mask[0, 1, :1] = 1
  seg_mask[1, 0, :3] = 1
  version = np.where(seg_mask > 0, np.array([[[5], [6], [0]], [[7], [0], [0]]]), -1)
  ro = rollout.Rollout(
      tokens_BxT=np.ones((B, T), np.int32), loss_mask_BxT=final,
      behaviour_logp_BxT=np.zeros((B, T), np.float32), entropy_BxT=np.zeros((B, T), np.float32),
      turn_BxT=np.zeros((B, T), np.int32),
      version_BxT=np.where(final > 0, np.array([[8], [7]]), -1).astype(np.int32),
      **{k: None for k in ("prompt_len_B", "length_B", "reward_B", "done_B", "truncated_B",
                           "num_turns_B", "num_tool_calls_B", "num_tool_errors_B",
                           "env_seconds_B", "call_hashes_BxC", "turn_rewards_BxC",
                           "finished_B", "status_B", "obs_clipped_B")},
      reward_components={},
      segments=rollout.Segments(
          tokens_BxKxT=np.full((B, K, T), 2, np.int32), loss_mask_BxKxT=seg_mask,
          behaviour_logp_BxKxT=np.zeros((B, K, T), np.float32),
          entropy_BxKxT=np.zeros((B, K, T), np.float32), version_BxKxT=version.astype(np.int32),
          length_BxK=np.array([[2, 1, 0], [3, 0, 0]], np.int32), count_B=np.array([2, 1])))
  rows = rollout.scored_rows(ro)
  np.testing.assert_array_equal(rows.episode_R, [0, 1, 0, 0, 1, -1])
  np.testing.assert_array_equal(rows["loss_mask_RxT"].sum(axis=1), [2, 1, 2, 1, 3, 0])
  np.testing.assert_array_equal(rows.per_row(np.array([10.0, 20.0])), [10, 20, 10, 10, 20, 0])
  newest = rows.episode_max(rows["version_RxT"], rows["loss_mask_RxT"] > 0)
  np.testing.assert_array_equal(newest, [8, 7])
  np.testing.assert_array_equal(context_lib.policy_tokens(ro), [5, 4])
  # Partial-rollout masking keeps an episode's newest version in all its rows.
  from agentic_rl.invariants import shift
  weights, _ = shift.shift_weights(shift.ShiftConfig(partial_rollout="mask"),
                                   rows["loss_mask_RxT"], rows["version_RxT"], 8,
                                   newest_B=rows.per_row(newest))
  np.testing.assert_array_equal(np.asarray(weights).sum(axis=1), [2, 1, 0, 0, 3, 0])
