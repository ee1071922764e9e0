"""The episode machinery every tool-using task family shares.

A family (``calc_chain``, ``multihop``, ``boxes``) subclasses :class:`ToolEnv`
and supplies only an instance generator, the prompt text and a scripted
policy; parsing actions, running the tools, limits and rewards live here once.

Actions. ``step`` reads the completed action segment (``base.py``):

* ending with ``</tool_call>``: a tool call. The content after the last
  ``<tool_call>`` is ``TOOL ARGS`` (spaces skipped, text before the open tag
  ignored). No open tag or no content is a malformed call, a first token that
  is not a tool name an unknown tool; both return an error observation, count
  as a format error, and the episode goes on.
* ending with ``</answer>``: the final answer. The content after the last
  ``<answer>`` must be one integer (spaces around allowed).
* ending with ``<|end|>`` or ``</s>``: the policy stopped without answering:
  ``done``, outcome 0.
* ending otherwise (the policy hit its token limit, or an empty action):
  ``truncated``, outcome 0.

A tool call on turn ``max_turns`` (turns count actions) is run, but it ends
the episode as ``truncated``. Steps after the episode ended change nothing and
report zero rewards.

A call that names a known tool adds that tool's nominal latency
(``tools.LATENCY_S``) to the episode's ``env_seconds`` (also in the step's
``info``): the environment time the efficiency reward counts (``rewards.py``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from agentic_rl.envs import rewards as rewards_lib
from agentic_rl.envs import tokens as T
from agentic_rl.envs import tools
from agentic_rl.envs.base import EqualByValue, StepOutput
from agentic_rl.text import codec as codec_lib
from agentic_rl.text import tokenizer as tok_lib

PyTree = Any

# Action kinds.
CALL, ANSWER, STOP, CUT = range(4)


def uniform_ints(u: jax.Array, low, high) -> jax.Array:
  """int32 uniform in ``[low, high)`` from float ``u`` uniform in ``[0, 1)``.

  Generators and scripts draw one ``jax.random.uniform`` vector and map it
  with this: one PRNG call per function keeps its compiled program small.
  """
  low = jnp.asarray(low, jnp.int32)
  span = jnp.asarray(high, jnp.int32) - low
  return low + jnp.minimum((u * span).astype(jnp.int32), span - 1)


def as_codec(tokenizer_or_codec) -> codec_lib.Codec:
  if isinstance(tokenizer_or_codec, codec_lib.Codec):
    return tokenizer_or_codec
  if isinstance(tokenizer_or_codec, tok_lib.Tokenizer):
    return codec_lib.Codec(tokenizer_or_codec)
  raise ValueError(f"expected a Tokenizer or a Codec, got {type(tokenizer_or_codec).__name__}")


@struct.dataclass
class EpisodeState:
  """One episode (vmap adds a leading batch axis to every leaf).

  Attributes:
    instance: the task instance (has ``world`` and ``answer``).
    memory: the key-value memory.
    opened: bool ``[M]`` boxes opened so far.
    turn: int32 actions taken.
    tool_calls, malformed_calls, tool_errors, policy_tokens: int32 counters.
    tool_successes: int32 ``[len(TOOLS)]`` successful calls per tool.
    env_seconds: float32 the nominal latencies (``tools.LATENCY_S``) of the
      calls naming a known tool, summed: the episode's environment time.
    last_value: int32 the last numeric tool result (0 before any).
    strategy_hash: int32 running hash of the sequence of valid calls.
    done, truncated: bool.
  """

  instance: PyTree
  memory: tools.Memory
  opened: jax.Array
  turn: jax.Array
  tool_calls: jax.Array
  malformed_calls: jax.Array
  tool_errors: jax.Array
  policy_tokens: jax.Array
  tool_successes: jax.Array
  env_seconds: jax.Array
  last_value: jax.Array
  strategy_hash: jax.Array
  done: jax.Array
  truncated: jax.Array


@struct.dataclass
class ParsedAction:
  """An action segment, parsed. Token arrays are ``[A]``, shifted to index 0."""

  kind: jax.Array        # CALL, ANSWER, STOP or CUT
  tagged: jax.Array      # the matching open tag exists
  tool: jax.Array        # index into TOOLS, -1 if the first token is not one
  has_name: jax.Array    # the content has a non-space token
  args: tools.Args       # a call: the tokens after the tool name; an answer:
                         # the whole content


def _shift(tokens, start, length, pad):
  pos = jnp.arange(tokens.shape[0])
  src = jnp.clip(pos + start, 0, tokens.shape[0] - 1)
  return jnp.where(pos < length, tokens[src], pad)


def parse_action(vocab: T.Vocab, action_A: jax.Array, action_len: jax.Array) -> ParsedAction:
  """Splits an action into its kind, tool name and argument tokens."""
  ids = vocab.ids
  A = action_A.shape[0]
  pos = jnp.arange(A)
  n = jnp.clip(jnp.asarray(action_len, jnp.int32), 0, A)
  tokens = jnp.where(pos < n, action_A.astype(jnp.int32), ids.pad)
  last = jnp.where(n > 0, tokens[jnp.maximum(n - 1, 0)], ids.pad)
  kind = jnp.select([last == ids.tool_call_close, last == ids.answer_close,
                     (last == ids.end) | (last == ids.eos)], [CALL, ANSWER, STOP], CUT)
  opener = jnp.where(kind == CALL, ids.tool_call_open, ids.answer_open)
  open_pos = jnp.max(jnp.where((tokens == opener) & (pos < n - 1), pos, -1))
  tagged = (open_pos >= 0) & (kind <= ANSWER)
  start = open_pos + 1
  content_len = jnp.where(tagged, n - 1 - start, 0)
  content = _shift(tokens, start, content_len, ids.pad)
  cls, _ = vocab.classes(content)
  word = (cls != T.SPACE) & (pos < content_len)
  first = jnp.argmax(word)
  has_name = word.any()
  tool = jnp.where(has_name, vocab.tool_of(content[first]), -1)
  skip = jnp.where(kind == CALL, first + 1, 0)
  args_len = jnp.where(has_name | (kind != CALL), content_len - skip, 0)
  args = _shift(content, skip, args_len, ids.pad)
  args_cls, args_digit = vocab.classes(args)
  args_cls = jnp.where(pos < args_len, args_cls, T.PAD)
  return ParsedAction(kind=kind, tagged=tagged, tool=tool, has_name=has_name,
                      args=tools.read_args(args, args_cls, args_digit))


def parse_answer(parsed: ParsedAction) -> tuple[jax.Array, jax.Array]:
  """``(value, well_formed)`` of an ANSWER action's content: one integer."""
  a = parsed.args
  ok = (parsed.kind == ANSWER) & parsed.tagged & (a.number_status == T.OK) & (a.count == 1)
  return a.numbers[0], ok


class ToolEnv(EqualByValue):
  """Base of the tool-using task families (implements ``base.JaxEnv``).

  Built with ``tokenizer_or_codec=None``, an environment only generates
  instances and prompts (e.g. to build a tokenizer corpus before a tokenizer
  exists).

  Subclasses set ``name``, ``strategies`` and ``num_levels`` and implement
  ``_generate(key, level)`` (``level`` an int32 scalar, possibly traced),
  ``prompt_text(instance)`` and ``_script(state, u, strategy, mistake)``
  (``u``: two uniforms in ``[0, 1)`` for the script's random choices;
  ``mistake``: one of the mistake kinds below).
  Instances must have fields ``world`` (``tools.World``), ``answer`` and
  ``level`` (int32 scalars).
  """

  name: str = ""
  strategies: tuple[str, ...] = ()
  num_levels: int = 0

  def __init__(self, tokenizer_or_codec, *, max_turns: int, max_action_len: int,
               max_obs_len: int = 16, memory_slots: int = 8,
               rewards: rewards_lib.RewardConfig = rewards_lib.RewardConfig()):
    for what, value, low in (("max_turns", max_turns, 1), ("max_action_len", max_action_len, 4),
                             ("max_obs_len", max_obs_len, 1), ("memory_slots", memory_slots, 1)):
      if not isinstance(value, int) or value < low:
        raise ValueError(f"{type(self).__name__}: {what} must be an int >= {low}, got {value!r}")
    if not isinstance(rewards, rewards_lib.RewardConfig):
      raise ValueError(f"rewards must be a RewardConfig, got {type(rewards).__name__}")
    if tokenizer_or_codec is None:
      self.codec, self._vocab = None, None
    else:
      self.codec = as_codec(tokenizer_or_codec)
      self._vocab = T.build_vocab(self.codec)
      needed = max(T.NUMBER_LEN, self._vocab.max_message_len)
      if max_obs_len < needed:
        raise ValueError(f"max_obs_len={max_obs_len} cannot hold a tool result; "
                         f"need >= {needed}")
    self.max_turns = max_turns
    self.max_action_len = max_action_len
    self.max_obs_len = max_obs_len
    self.memory_slots = memory_slots
    self.rewards = rewards

  @property
  def vocab(self) -> T.Vocab:
    if self._vocab is None:
      raise ValueError(f"{self.name} was built without a tokenizer: it can generate "
                       "instances and prompts, but not step or act")
    return self._vocab

  def __repr__(self):
    return (f"{type(self).__name__}(max_turns={self.max_turns}, max_action_len="
            f"{self.max_action_len}, max_obs_len={self.max_obs_len})")

  # ------------------------------------------------------------ protocol
  def check_level(self, difficulty) -> jax.Array:
    """An int32 level: Python ints are range-checked, traced ones clipped."""
    if isinstance(difficulty, (int, np.integer)):
      if not 0 <= difficulty < self.num_levels:
        raise ValueError(f"{self.name}: difficulty must be in [0, {self.num_levels}), "
                         f"got {difficulty}")
    return jnp.clip(jnp.asarray(difficulty, jnp.int32), 0, self.num_levels - 1)

  def generate(self, key: jax.Array, difficulty) -> PyTree:
    """A seeded task instance at a difficulty level (int, or a traced int32)."""
    return self._generate(key, self.check_level(difficulty))

  def reset(self, instance: PyTree) -> EpisodeState:
    z = jnp.zeros((), jnp.int32)
    f = jnp.zeros((), bool)
    return EpisodeState(
        instance=instance, memory=tools.empty_memory(self.memory_slots),
        opened=jnp.zeros(instance.world.boxes.shape, bool), turn=z, tool_calls=z,
        malformed_calls=z, tool_errors=z, policy_tokens=z,
        tool_successes=jnp.zeros((len(T.TOOLS),), jnp.int32),
        env_seconds=jnp.zeros((), jnp.float32), last_value=z,
        strategy_hash=z, done=f, truncated=f)

  def step(self, state: EpisodeState, action_A: jax.Array, action_len: jax.Array,
           ) -> tuple[EpisodeState, StepOutput]:
    """One action of one episode; see the module docstring."""
    v = self.vocab
    p = parse_action(v, action_A, action_len)
    live = ~(state.done | state.truncated)
    is_call = p.kind == CALL
    known = is_call & p.tagged & (p.tool >= 0)
    res = tools.run_tool(jnp.maximum(p.tool, 0), p.args, state.instance.world, state.memory)
    status = jnp.where(known, res.status,
                       jnp.where(is_call & p.tagged & p.has_name, T.UNKNOWN_TOOL, T.MALFORMED))
    call_ok = known & (status == T.OK)
    malformed = is_call & ((status == T.MALFORMED) | (status == T.UNKNOWN_TOOL))
    tool_error = is_call & (status != T.OK)
    answer, answered = parse_answer(p)
    correct = answered & (answer == state.instance.answer)

    turn = state.turn + 1
    done = (p.kind == ANSWER) | (p.kind == STOP)
    truncated = (p.kind == CUT) | (is_call & (turn >= self.max_turns))
    valid = known & ~malformed  # well formed; the tool itself may still fail
    call_hash = jnp.where(valid, tools.hash_ints(jnp.stack([p.tool, res.args_hash]),
                                                 jnp.ones((2,), bool)), -1)
    has_value = call_ok & res.has_value
    new = state.replace(
        memory=res.memory,
        opened=jnp.where(res.opened_box >= 0, state.opened.at[res.opened_box].set(True),
                         state.opened),
        turn=turn,
        tool_calls=state.tool_calls + is_call,
        malformed_calls=state.malformed_calls + malformed,
        tool_errors=state.tool_errors + tool_error,
        policy_tokens=state.policy_tokens + jnp.clip(action_len, 0, action_A.shape[0]),
        tool_successes=state.tool_successes.at[jnp.maximum(p.tool, 0)].add(
            call_ok.astype(jnp.int32)),
        env_seconds=state.env_seconds + jnp.where(
            known, jnp.asarray(tools.latencies())[jnp.maximum(p.tool, 0)], 0.0),
        last_value=jnp.where(has_value, res.value, state.last_value),
        strategy_hash=jnp.where(valid, tools.hash_ints(
            jnp.stack([state.strategy_hash, call_hash]), jnp.ones((2,), bool)),
                                state.strategy_hash),
        done=done, truncated=truncated)
    new = jax.tree.map(lambda a, b: jnp.where(live, a, b), new, state)

    final = live & (done | truncated)
    comps = rewards_lib.episode_components(
        correct=correct, answered=answered, calls=new.tool_calls,
        malformed_calls=new.malformed_calls, tokens=new.policy_tokens,
        seconds=new.env_seconds, max_turns=self.max_turns,
        max_action_len=self.max_action_len, config=self.rewards)
    comps = {k: jnp.where(final, c, 0.0) for k, c in comps.items()}
    num, num_len = T.render_int(res.value, v)
    msg, msg_len = T.message(status, v)
    obs = jnp.where(has_value, _fit(num, self.max_obs_len, v.ids.pad),
                    _fit(msg, self.max_obs_len, v.ids.pad))
    obs_len = jnp.where(live & is_call, jnp.where(has_value, num_len, msg_len), 0)
    obs = jnp.where(jnp.arange(self.max_obs_len) < obs_len, obs, v.ids.pad)
    info = {
        "tool_id": jnp.where(live & valid, p.tool, -1).astype(jnp.int32),
        "call_hash": jnp.where(live, call_hash, -1).astype(jnp.int32),
        "tool_status": jnp.where(live & is_call, status, T.OK).astype(jnp.int32),
        "tool_error": live & tool_error,
        "format_error": live & (malformed | ((done | truncated) & ~answered)),
        "answered": live & answered,
        "tool_calls": new.tool_calls,
        "tool_errors": new.tool_errors,
        "malformed_calls": new.malformed_calls,
        "policy_tokens": new.policy_tokens,
        "env_seconds": new.env_seconds,
        "turn": new.turn,
        "strategy_hash": new.strategy_hash,
    }
    out = StepOutput(obs_A=obs.astype(jnp.int32), obs_len=obs_len.astype(jnp.int32),
                     reward=rewards_lib.combine(comps, self.rewards), reward_components=comps,
                     done=new.done, truncated=new.truncated, info=info)
    return new, out

  # ------------------------------------------------------------ scripted
  def strategy_index(self, strategy) -> jax.Array:
    """A strategy name or index (traced ints are taken modulo the count)."""
    if isinstance(strategy, str):
      if strategy not in self.strategies:
        raise ValueError(f"{self.name}: unknown strategy {strategy!r}; "
                         f"expected one of {self.strategies}")
      return jnp.asarray(self.strategies.index(strategy), jnp.int32)
    return jnp.asarray(strategy, jnp.int32) % len(self.strategies)

  def reference_action(self, state: EpisodeState, key: jax.Array, strategy=0,
                       noise=0.0) -> tuple[jax.Array, jax.Array]:
    """The scripted policy's next action: ``(action_[max_action_len], length_[])``.

    Jittable and vmappable. The script reads the hidden instance (it is an
    oracle) but acts on what the episode has shown so far (``last_value``,
    ``opened``, the tool counters), so its mistakes propagate. With
    probability ``noise`` per action it makes one mistake: a wrong argument,
    a malformed call (no tool name), or an early answer with its current
    guess. It always answers on the last turn.

    Args:
      state: the episode state.
      key: PRNG key for this action.
      strategy: a name from ``self.strategies`` or an index (may be traced).
      noise: mistake probability in ``[0, 1]`` (may be traced).
    """
    if isinstance(noise, (int, float)) and not 0.0 <= noise <= 1.0:
      raise ValueError(f"noise must be in [0, 1], got {noise}")
    u = jax.random.uniform(key, (4,))
    kind = jnp.where(u[0] < noise, uniform_ints(u[1], 1, 4), 0)
    return self._script(state, u[2:], self.strategy_index(strategy), kind)

  # Mistake kinds passed to ``_script``.
  NO_MISTAKE, WRONG_ARGUMENT, MALFORMED_CALL, EARLY_ANSWER = range(4)

  def _finish(self, state: EpisodeState, call: tuple[jax.Array, jax.Array],
              answer_value: jax.Array, answer_now: jax.Array, guess: jax.Array,
              mistake: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Chooses between a scripted call and an answer, applying the rules every
    script shares: an early answer (a mistake) or the last turn answers
    ``guess``; ``answer_now`` answers ``answer_value``."""
    last_turn = state.turn >= self.max_turns - 1
    early = mistake == self.EARLY_ANSWER
    value = jnp.where(answer_now, answer_value, guess)
    ans = T.answer_action(value, self.vocab, self.max_action_len)
    use_answer = answer_now | early | last_turn
    return (jnp.where(use_answer, ans[0], call[0]), jnp.where(use_answer, ans[1], call[1]))

  def _call(self, tool: int, args, mistake) -> tuple[jax.Array, jax.Array]:
    return T.call_action(tool, args, self.vocab, self.max_action_len,
                         with_name=mistake != self.MALFORMED_CALL)

  def _chain_script(self, state: EpisodeState, u: jax.Array, *, tool: int, steps,
                    main_call: tuple[jax.Array, jax.Array], memo, mistake,
                    ) -> tuple[jax.Array, jax.Array]:
    """A script that makes ``steps`` successful calls of ``tool`` and answers
    the last result. With ``memo`` it stores every result (``store j:value``)
    and recalls the last one before answering."""
    done_steps = state.tool_successes[tool]
    stores = state.tool_successes[T.STORE]
    recalls = state.tool_successes[T.RECALL]
    store_now = memo & (stores < done_steps)
    recall_now = memo & (done_steps >= steps) & (recalls == 0) & ~store_now
    answer_now = (done_steps >= steps) & ~store_now & ~recall_now
    delta = jnp.where(mistake == self.WRONG_ARGUMENT, uniform_ints(u, 1, 10), 0)
    num = lambda x: T.render_int(x, self.vocab)
    store = self._call(T.STORE, [num(done_steps), (self.vocab.colon, None),
                                 num(state.last_value + delta)], mistake)
    recall = self._call(T.RECALL, [num(steps + delta)], mistake)
    call = tuple(jnp.where(store_now, s, jnp.where(recall_now, r, m))
                 for s, r, m in zip(store, recall, main_call))
    return self._finish(state, call, state.last_value, answer_now, state.last_value, mistake)


def _fit(x: jax.Array, size: int, pad: int) -> jax.Array:
  n = x.shape[0]
  if n >= size:
    return x[:size]
  return jnp.concatenate([x, jnp.full((size - n,), pad, x.dtype)])
