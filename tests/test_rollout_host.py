"""Host-environment loop: text protocol, KV cache across turns, GEM adapter."""

import re
import time

import jax
import numpy as np
import pytest

from agentic_rl.invariants import shift
from agentic_rl import model as model_lib
from agentic_rl import rollout
from agentic_rl.text import default_codec


@pytest.fixture(scope="module")
def codec():
  return default_codec()


# One loop (one compile) serves every test; GEM prompts need ~400 tokens.
SAMPLING = rollout.SamplingConfig(max_new_tokens_per_turn=16, max_turns=10,
                                  max_total_tokens=1024)
_learner_logprobs = jax.jit(rollout.learner_logprobs, static_argnums=(2, 3))


@pytest.fixture(scope="module")
def model(codec):
  config = model_lib.TransformerConfig.tiny(
      vocab_size=codec.tokenizer.vocab_size)
  return config, model_lib.init_params(config, jax.random.key(0))


@pytest.fixture(scope="module")
def loop(codec, model):
  return rollout.HostLoop(model[0], SAMPLING, codec, batch_size=2,
                          max_obs_tokens=96)


def _max_mismatch(params, config, out):
  learner = _learner_logprobs(params, out.tokens_BxT, config, SAMPLING)
  m = shift.mismatch_metrics(out.behaviour_logp_BxT, learner, out.loss_mask_BxT)
  return float(m["logprob_mismatch_max"])


class CountdownEnv:
  """Says a number; the episode ends when the action contains "0"."""

  def __init__(self):
    self.actions = []

  def reset(self, seed):
    self.n = 2 + seed % 3
    return f"count down from {self.n}"

  def step(self, action):
    self.actions.append(action)
    if "0" in action:
      return "", 1.0, True
    self.n -= 1
    return f"now {self.n}", 0.1, False


def test_scripted_actor_and_cache_across_turns(codec, model, loop, monkeypatch):
  config, params = model
  envs = [CountdownEnv(), CountdownEnv()]
  calls = {"prefill": 0, "segment": 0}

  def counted(name, fn):
    def wrapped(*args):
      calls[name] += 1
      return fn(*args)
    return wrapped

  monkeypatch.setattr(loop, "_prefill", counted("prefill", loop._prefill))
  monkeypatch.setattr(loop, "_segment", counted("segment", loop._segment))

  def actor(row, obs):
    n = int(re.findall(r"\d+", obs)[-1])
    return f"<answer>{n - 1}</answer>"

  out = loop.run(params, envs, [0, 1], jax.random.key(1), 7, actor=actor)
  # One prefill; then one jitted segment per turn of the longest episode.
  assert calls == {"prefill": 1, "segment": 3}
  # Countdowns from 2 and 3 take 2 and 3 actions, each an answer "n-1".
  assert [e.actions for e in envs] == [
      ["<answer>1</answer>", "<answer>0</answer>"],
      ["<answer>2</answer>", "<answer>1</answer>", "<answer>0</answer>"]]
  np.testing.assert_allclose(out.reward_B, [1.1, 1.2], rtol=1e-6)
  np.testing.assert_allclose(out.turn_rewards_BxC[:, :4],
                             [[0.1, 1.0, 0, 0], [0.1, 0.1, 1.0, 0]], rtol=1e-6)
  np.testing.assert_array_equal(out.done_B, [True, True])
  np.testing.assert_array_equal(out.num_turns_B, [2, 3])
  row = 1
  n = int(out.length_B[row])
  tokens = np.asarray(out.tokens_BxT[row, :n])
  pieces = [codec.tokenizer.id_to_piece(t) for t in tokens]
  text = codec.tokenizer.decode(tokens)
  assert text.endswith("<answer>2</answer><tool_result>now 2</tool_result>"
                        "<answer>1</answer><tool_result>now 1</tool_result>"
                        "<answer>0</answer>"), text
  mask = np.asarray(out.loss_mask_BxT[row, :n])
  in_answer = np.zeros(n, bool)
  inside = False
  for i, p in enumerate(pieces):
    if p == "<answer>":
      inside = True
    in_answer[i] = inside
    if p == "</answer>":
      inside = False
  np.testing.assert_array_equal(mask, in_answer.astype(np.float32))
  np.testing.assert_array_equal(
      np.asarray(out.version_BxT[row, :n]), np.where(in_answer, 7, -1))
  # The cache carried across host steps gives the same log-probs as a
  # teacher-forced pass over the whole conversation.
  assert _max_mismatch(params, config, out) < 1e-5


def test_scripted_rows_without_a_model_record_the_same_stream(codec, model, loop, monkeypatch):
  """params=None (demonstrations): the tokens, masks and rewards of the
  scripted episodes are those played with the model, which never runs."""
  config, params = model

  def actor(row, obs):
    return f"<answer>{int(re.findall(r'[0-9]+', obs)[-1]) - 1}</answer>"

  with_model = loop.run(params, [CountdownEnv(), CountdownEnv()], [1, 2], jax.random.key(1), 3,
                        actor=actor)
  monkeypatch.setattr(loop, "_prefill", lambda *a: pytest.fail("prefilled without a model"))
  without = loop.run(None, [CountdownEnv(), CountdownEnv()], [1, 2], jax.random.key(1), 3,
                     actor=actor)
  for name in ("tokens_BxT", "loss_mask_BxT", "turn_BxT", "version_BxT", "reward_B",
               "length_B", "num_turns_B", "done_B"):
    np.testing.assert_array_equal(getattr(without, name), getattr(with_model, name), name)
  mask = np.asarray(without.loss_mask_BxT) > 0
  np.testing.assert_allclose(np.asarray(without.behaviour_logp_BxT)[mask],
                             -np.log(config.vocab_size), rtol=1e-6)
  with pytest.raises(ValueError, match="actor"):
    loop.run(None, [CountdownEnv(), CountdownEnv()], [1, 2], jax.random.key(1), 3)


def test_sampled_policy_stays_consistent(model, loop):
  """A random policy: whatever it writes, the bookkeeping holds."""
  config, params = model
  out = loop.run(params, [CountdownEnv() for _ in range(2)], [0, 1],
                 jax.random.key(3), 0)
  assert bool(np.all(out.finished_B))
  assert _max_mismatch(params, config, out) < 1e-5
  mask = np.asarray(out.loss_mask_BxT)
  assert np.all((mask > 0) == (np.asarray(out.version_BxT) == 0))
  assert np.all(np.asarray(out.behaviour_logp_BxT)[mask == 0] == 0)


def test_bad_actions_and_prompts_raise(codec, model, loop):
  config, params = model
  envs = [CountdownEnv(), CountdownEnv()]
  with pytest.raises(ValueError, match="no stop token .* but at its end"):
    loop.run(params, envs, [0, 0], jax.random.key(0), 0,
             actor=lambda r, o: "<answer>1</answer> and more")
  # An action without a stop id is closed by the codec's end of turn.
  out = loop.run(params, envs, [0, 0], jax.random.key(0), 0, actor=lambda r, o: "no stop")
  tokens, mask = np.asarray(out.tokens_BxT)[0], np.asarray(out.loss_mask_BxT)[0]
  first = np.flatnonzero(mask)[:len(codec.tokenizer.encode("no stop")) + 1]
  assert tokens[first].tolist() == codec.tokenizer.encode("no stop") + [codec.ids.end]
  with pytest.raises(ValueError, match="exceeds max_new_tokens_per_turn"):
    loop.run(params, envs, [0, 0], jax.random.key(0), 0,
             actor=lambda r, o: "<answer>" + "1" * 20 + "</answer>")
  small = rollout.SamplingConfig(max_total_tokens=8)
  with pytest.raises(ValueError, match="does not fit in the KV cache"):
    rollout.HostLoop(config, small, codec, batch_size=1,
                     system_prompt="more words than eight tokens hold").run(
        params, [CountdownEnv()], [0], jax.random.key(0), 0)
  # An observation too long for the context ends only its own episode.
  out = rollout.HostLoop(config, small, codec, batch_size=1).run(
      params, [CountdownEnv()], [0], jax.random.key(0), 0)
  assert rollout.EPISODE_STATUS[int(out.status_B[0])] == "obs_overflow"
  assert bool(out.truncated_B[0]) and int(out.num_turns_B[0]) == 0
  with pytest.raises(ValueError, match="need 2 environments"):
    loop.run(params, envs[:1], [0], jax.random.key(0), 0)


# ------------------------------------------------------------------ bad environments
class _Broken(CountdownEnv):
  """A countdown whose second step misbehaves as ``how`` says."""

  def __init__(self, how):
    super().__init__()
    self.how = how

  def reset(self, seed):
    if self.how == "reset raises":
      raise RuntimeError("cannot start")
    return super().reset(seed)

  def step(self, action):
    obs, reward, done = super().step(action)
    if len(self.actions) < 2:
      return obs, reward, done
    if self.how == "raises":
      raise RuntimeError("the game crashed")
    if self.how == "None":
      return None
    if self.how == "pair":
      return obs, reward
    if self.how == "None obs":
      return None, reward, done
    if self.how == "nan":
      return obs, float("nan"), done
    if self.how == "hangs":
      time.sleep(60)
    if self.how == "echo":  # repeats the format's framing strings
      return "<tool_result>you said <answer>1</answer></tool_result> " + obs, reward, done
    if self.how == "long":
      return "word " * 200 + obs, reward, done
    return obs, reward, done


def _count_down(row, obs):
  del row
  return "<answer>%d</answer>" % (int(re.findall(r"\d+", obs)[-1]) - 1)


BROKEN = {"raises": "env_error", "None": "env_error", "pair": "env_error",
          "None obs": "env_error", "reset raises": "env_error", "nan": "nonfinite_reward",
          "hangs": "env_timeout", "echo": "ok", "long": "ok", "fine": "ok"}


def test_a_bad_environment_ends_only_its_own_episode(codec, model, caplog):
  config, params = model
  hows = list(BROKEN)
  loop = rollout.HostLoop(config, SAMPLING, codec, batch_size=len(hows), max_obs_tokens=96,
                          obs_overflow="clip", env_workers=4, env_timeout_s=2.0)
  envs = [_Broken(how) for how in hows]

  out = loop.run(params, envs, [1] * len(hows), jax.random.key(0), 0, actor=_count_down)
  status = {how: rollout.EPISODE_STATUS[int(s)] for how, s in zip(hows, out.status_B)}
  assert status == BROKEN
  for b, how in enumerate(hows):
    failed = BROKEN[how] != "ok"
    assert bool(out.truncated_B[b]) == failed and bool(out.done_B[b]) != failed, how
  fine, echo, long = hows.index("fine"), hows.index("echo"), hows.index("long")
  np.testing.assert_allclose(np.asarray(out.reward_B)[[fine, echo, long]], [1.2, 1.2, 1.2],
                             rtol=1e-6)
  assert int(out.obs_clipped_B[long]) == 1 and int(out.obs_clipped_B[fine]) == 0
  # The echoed framing arrives as text inside one tool result.
  n = int(out.length_B[echo])
  tokens = np.asarray(out.tokens_BxT[echo, :n])
  assert codec.tokenizer.decode(tokens).count(
      "<tool_result><tool_result>you said <answer>1</answer></tool_result> now") == 1
  assert int(np.sum(tokens == codec.ids.tool_result_open)) == 2  # one per step answered
  # A non-finite reward is never added; failed episodes keep what came before.
  assert np.isfinite(np.asarray(out.reward_B)).all()
  np.testing.assert_allclose(out.reward_B[hows.index("nan")], 0.1, rtol=1e-6)
  # What went wrong is counted by message, and the first few distinct
  # messages are logged.
  malformed = "step: TypeError: step must return (observation, reward, done), got "
  assert loop.env_failures == {
      "reset: RuntimeError: cannot start": 1, "step: RuntimeError: the game crashed": 1,
      malformed + "NoneType None": 1, malformed + "tuple ('now 1', 0.1)": 1,
      "step: TypeError: step's observation must be str, got NoneType": 1,
      "step: NonFiniteReward: step's reward is nan": 1, "step ran past its time limit": 1}
  said = [r.getMessage() for r in caplog.records if "its episode ends" in r.getMessage()]
  assert len(said) == 5 and all(any(m in line for m in loop.env_failures) for line in said)


def test_obs_overflow_end_ends_the_episode(codec, model):
  config, params = model
  loop = rollout.HostLoop(config, SAMPLING, codec, batch_size=2, max_obs_tokens=96)
  out = loop.run(params, [_Broken("long"), _Broken("fine")], [1, 1], jax.random.key(0), 0,
                 actor=_count_down)
  assert [rollout.EPISODE_STATUS[int(s)] for s in out.status_B] == ["obs_overflow", "ok"]
  assert bool(out.truncated_B[0]) and int(out.obs_clipped_B[0]) == 0


# ------------------------------------------------------------------ GEM games
def _expert_actor(env_id):
  """The library's expert for ``env_id``, fed each row's observations so far."""
  from agentic_rl.envs import gem  # pylint: disable=import-outside-toplevel
  expert, seen = gem.EXPERTS[env_id.split("-v")[0]], {}

  def actor(row, obs):
    seen.setdefault(row, []).append(obs)
    return f"<answer>{expert(seen[row])}</answer>"

  return actor


@pytest.mark.parametrize("env_id", ["game:GuessTheNumber-v0-easy", "game:Mastermind-v0-easy"])
def test_gem_games_with_scripted_players(model, loop, env_id):
  pytest.importorskip("gem", reason="GEM (pip install gem-llm==0.1.0) is optional")
  config, params = model
  envs = [rollout.GemEnv(env_id) for _ in range(2)]
  out = loop.run(params, envs, [0, 1], jax.random.key(0), 0, actor=_expert_actor(env_id))
  np.testing.assert_allclose(out.reward_B, [1.0, 1.0], atol=1e-6)
  assert bool(np.all(out.done_B)) and not bool(np.any(out.truncated_B))
  assert int(np.min(out.num_turns_B)) >= 2  # multi-turn: feedback was used
  # A sampled (random) policy plays too; its log-probs match the learner's.
  out = loop.run(params, envs, [2, 3], jax.random.key(1), 0)
  assert bool(np.all(out.finished_B))
  assert _max_mismatch(params, config, out) < 1e-5


def test_gem_adapter_needs_gem_or_says_how():
  try:
    import gem  # noqa: F401
  except ImportError:
    with pytest.raises(ImportError, match="pip install"):
      rollout.GemEnv("game:GuessTheNumber-v0-easy")
  else:
    with pytest.raises(ValueError):
      rollout.GemEnv("game:NoSuchGame-v0")


class _SlowCountdown(CountdownEnv):
  """CountdownEnv whose calls sleep, longer for some seeds."""

  def reset(self, seed):
    self.delay = 0.002 * (1 + 5 * (seed % 2))
    time.sleep(self.delay)
    return super().reset(seed)

  def step(self, action):
    time.sleep(self.delay)
    return super().step(action)


def test_continuous_batching_plays_each_episode_as_alone(codec, model, loop):
  """Five episodes on two rows: each row takes the next episode when its
  own ends, environment calls overlap the decoding, and every episode comes
  out as it does played in a batch of its own."""
  config, params = model
  streaming = rollout.HostLoop(config, SAMPLING, codec, batch_size=2, max_obs_tokens=96,
                               env_workers=2)
  seeds = [0, 1, 2, 3, 4]
  keys = [jax.random.key(10 + i) for i in range(len(seeds))]
  todo = [rollout.Episode(_SlowCountdown(), s, jax.random.split(k, 2)[0], i)
          for i, (s, k) in enumerate(zip(seeds, keys))]
  done = {}
  pending = list(todo)
  streaming.play(lambda: (params, 3), lambda: pending.pop(0) if pending else None,
                 done.__setitem__, chunk_steps=4)
  assert sorted(done) == list(range(len(seeds)))
  for i, (s, k) in enumerate(zip(seeds, keys)):
    # The same episode (seed, key) in the first row of an ordinary batch.
    alone = loop.run(params, [CountdownEnv(), CountdownEnv()], [s, s], k, 3)
    row = done[i]
    n = int(row.length_B[0])
    assert n == int(alone.length_B[0])
    np.testing.assert_array_equal(row.tokens_BxT[0, :n], alone.tokens_BxT[0, :n])
    np.testing.assert_allclose(row.behaviour_logp_BxT[0, :n], alone.behaviour_logp_BxT[0, :n],
                               atol=1e-5)
    np.testing.assert_array_equal(row.version_BxT[0, :n], alone.version_BxT[0, :n])
    assert float(row.reward_B[0]) == pytest.approx(float(alone.reward_B[0]))
  assert _max_mismatch(params, config, jax.tree.map(
      lambda *x: np.concatenate(x), *done.values())) < 1e-5


class AdderEnv:
  """Offers one tool, add(a, b); the episode ends at an answer."""

  tools = [{"name": "add", "description": "a + b",
            "parameters": {"type": "object", "required": ["a", "b"],
                           "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]

  def __init__(self):
    self.calls, self.steps = [], []

  def reset(self, seed):
    return "add 2 and 3"

  def call_tool(self, name, arguments):
    self.calls.append((name, arguments))
    return str(arguments["a"] + arguments["b"]), 0.0, False

  def step(self, action):
    self.steps.append(action)
    return "", float("5" in action), True


def test_tool_calls_are_parsed_by_the_codec_and_malformed_ones_answered(codec, model):
  config, params = model
  script = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
            '<tool_call>{"name": add}</tool_call>',
            '<tool_call>{"name": "mul", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "add", "arguments": {"a": "2", "b": 3}}</tool_call>',
            "<answer>5</answer>"]
  seen = []

  def actor(tag, obs):
    seen.append(obs)
    return script[len(seen) - 1]

  sampling = rollout.SamplingConfig(max_new_tokens_per_turn=64, max_turns=10,
                                    max_total_tokens=1024)
  tool_loop = rollout.HostLoop(config, sampling, codec, batch_size=2, max_obs_tokens=96)
  envs = [AdderEnv(), AdderEnv()]
  out = tool_loop.run(params, envs, [0, 0], jax.random.key(0), 0,
                 actor=lambda tag, obs: actor(tag, obs) if tag == 0 else "<answer>5</answer>")
  assert envs[0].calls == [("add", {"a": 2, "b": 3})]  # only the well-formed call ran
  assert envs[0].steps == ["<answer>5</answer>"]
  assert seen[1] == "5"
  assert seen[2].startswith("error: the tool call is not JSON")
  assert seen[3] == "error: no tool 'mul'; tools: add"
  assert seen[4] == "error: add: argument a must be integer, got '2'"
  np.testing.assert_array_equal(out.num_tool_calls_B, [4, 0])
  np.testing.assert_array_equal(out.num_tool_errors_B, [3, 0])
  np.testing.assert_allclose(out.reward_B, [1.0, 1.0])
  # The tools are offered in the system prompt.
  prompt = codec.decode(np.asarray(out.tokens_BxT[0, :int(out.prompt_len_B[0])]))
  assert prompt[0].role == "system" and "add(a: integer, b: integer): a + b" in prompt[0].content
  assert _max_mismatch(params, config, out) < 1e-5
