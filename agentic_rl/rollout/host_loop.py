"""Multi-turn episodes with Python ("host") environments that cannot run in jit.

Text protocol: an environment has ``reset(seed) -> observation`` and
``step(action_text) -> (observation, reward, done)``. The loop:

1. resets every environment; the first observation becomes the user message
   of the prompt (``Codec.encode_prompt``), optionally after a system prompt;
2. runs the engine's jitted token loop until every live row has closed an
   action (any codec stop id) or ended; the KV cache stays on the device;
3. on the host, decodes each closed action to text, steps its environment,
   and queues the next observation, framed by the codec as a tool result,
   to be forced into the context (loss mask 0) by the next jitted segment.

The cache is kept across turns, so the history is never re-prefilled: each
turn only feeds the new observation tokens and the policy's new tokens.
The environment alone decides when an episode is over; turn, per-turn and
total token limits truncate it.

:meth:`HostLoop.run` plays one episode per row; :meth:`HostLoop.play`
batches continuously: a stream of episodes on the B rows, each row taking
the next episode as soon as its own ends, environment calls running while
the other rows decode (``chunk_steps`` tokens per jitted segment).

Environments step concurrently (``env_workers`` threads, each call limited
to ``env_timeout_s``; :mod:`agentic_rl.rollout.workers`); the wall time of
a row's ``reset``, ``step`` and ``call_tool`` calls adds up in
``env_seconds_B``. One that
misbehaves ends only its own episode, truncated with a reason in
``Rollout.status_B``: an exception or a malformed return from ``reset`` or
``step`` ("env_error"), a call past the time limit ("env_timeout"), a
non-finite reward ("nonfinite_reward"). What went wrong is counted by
message in ``HostLoop.env_failures``, and the first few distinct messages
are logged as warnings. Observation text that contains the
codec's framing strings reaches the policy as plain text
(``Codec.encode_text``). An observation longer than ``max_obs_tokens`` is
clipped to it (``obs_overflow="clip"``, counted in ``obs_clipped_B``) or
ends the episode ("obs_overflow", the default).

An environment may offer tools: ``tools``, a list of JSON schemas, and
``call_tool(name, arguments) -> (observation, reward, done)``. They are
offered in the prompt (``Codec.encode_prompt(tools=)``), and an action that
calls one is parsed by the codec (``Codec.parse_tool_call``) and run by
``call_tool``; a malformed call (not JSON, an unknown tool, arguments that
do not match the schema) is answered with an error observation, counted
in ``num_tool_errors_B``, without calling the environment. Other actions
go to ``step``.

An environment may delegate: a ``step`` returning a :class:`~agentic_rl.
envs.swarm.Spawn` has its sub-tasks played by the frozen sub-agents of the
loop's ``swarm`` (:mod:`agentic_rl.rollout.swarm`), together with the other
rows' spawns of the moment, and ``spawn.then(results)`` is the step's
outcome; each row's delegation counts are in ``Rollout.info``.

An optional ``actor(tag, observation) -> action_text`` scripts the policy:
its actions are forced as policy tokens (loss mask 1, log-probs recorded)
instead of sampled. An action may hold a stop id only at its end; one
that ends without gets the codec's end of turn (``Codec.turn_end_id``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl import model as model_lib
from agentic_rl.envs.swarm import Spawn
from agentic_rl.rollout.engine import check_key, check_version, new_state, run_loop
from agentic_rl.rollout import context as context_lib
from agentic_rl.rollout.context import ContextConfig, Piece, Turn
from agentic_rl.rollout.sampling import SamplingConfig
from agentic_rl.rollout.types import EPISODE_STATUS, Rollout, RolloutState, Segments
from agentic_rl.rollout.workers import EnvWorkers, Outcome
from agentic_rl.text.codec import Codec, Message, ToolCallError, pad_batch

OBS_OVERFLOW = ("end", "clip")
_STATUS = {name: i for i, name in enumerate(EPISODE_STATUS)}
_LOG = logging.getLogger(__name__)
_LOGGED_FAILURES = 5  # distinct environment failures logged per loop
_COUNTED_FAILURES = 100  # and counted apart; the rest count together

Actor = Callable[[int, str], str]


class TextEnv(Protocol):
  """A Python environment speaking text."""

  def reset(self, seed: int) -> str:
    ...

  def step(self, action: str) -> tuple[str, float, bool]:
    ...


@dataclasses.dataclass(frozen=True)
class Episode:
  """One episode for :meth:`HostLoop.play`: ``env.reset(seed)`` starts it,
  ``key`` (a typed PRNG key) draws its tokens, ``tag`` is the caller's name
  for it."""

  env: TextEnv
  seed: int
  key: jax.Array
  tag: Any = None


@dataclasses.dataclass
class _RowContext:
  """Host-side record of one row's context (context management): its turns
  in the current context, the segments its rewrites closed, and, while the
  policy writes a summary, the observation waiting for the new context."""

  turns: list[Turn] = dataclasses.field(default_factory=list)
  segments: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
  pending: tuple[list[int], str] | None = None  # (framed ids, text)
  summary_from: int = -1  # where the kept part of a summary's context starts


class HostLoop:
  """Runs :class:`TextEnv` episodes with jitted generation between steps.

  Args:
    model_config: the policy's config.
    sampling: sampling settings and episode limits.
    codec: the conversation codec.
    batch_size: B environments per call.
    max_obs_tokens: longest observation (in tokens) after the first.
    obs_overflow: what a longer one does: "end" the episode (status
      "obs_overflow") or "clip" it to ``max_obs_tokens``.
    system_prompt: optional system message before the first observation.
    env_workers: environment calls running at once (threads).
    env_timeout_s: time limit of one ``reset`` or ``step`` call, or None.
    context: what an episode does when its context is full
      (:mod:`agentic_rl.rollout.context`); None truncates it.
    swarm: the frozen sub-agents spawns run on
      (:class:`agentic_rl.rollout.swarm.Swarm`); None: a spawn is an error.
  """

  def __init__(self, model_config: model_lib.TransformerConfig,
               sampling: SamplingConfig, codec: Codec, *, batch_size: int,
               max_obs_tokens: int = 128, system_prompt: str | None = None,
               obs_overflow: str = "end", env_workers: int = 1,
               env_timeout_s: float | None = None, context: ContextConfig | None = None,
               swarm=None):
    self.model_config = model_config.validate()
    self.sampling = sampling.validate()
    if batch_size < 1 or max_obs_tokens < 1:
      raise ValueError(f"batch_size and max_obs_tokens must be >= 1, got "
                       f"{batch_size}, {max_obs_tokens}")
    if obs_overflow not in OBS_OVERFLOW:
      raise ValueError(f"obs_overflow must be one of {OBS_OVERFLOW}, got {obs_overflow!r}")
    self.codec = codec
    self.ids = codec.ids
    # Tokens the codec puts around an observation, at most.
    self._framing = max(len(codec.frame_observation_ids([], tool=t)) for t in (True, False))
    self.batch_size = batch_size
    self.max_obs_tokens = max_obs_tokens
    self.obs_overflow = obs_overflow
    self.system_prompt = system_prompt
    self.workers = EnvWorkers(env_workers, env_timeout_s)
    self.context = (context or ContextConfig()).validate()
    self._request = codec.frame_observation_ids(
        codec.encode_text(self.context.summary_request), tool=False)
    self._omitted = {t: codec.frame_observation_ids(codec.encode_text(context_lib.OMITTED),
                                                    tool=t) for t in (True, False)}
    self._contexts = [_RowContext() for _ in range(batch_size)]
    self.swarm = swarm
    self._tally = swarm.tally(batch_size) if swarm is not None else None
    if self.context.policy == "summary" and len(self._request) > max_obs_tokens + self._framing:
      raise ValueError(f"the summary request is {len(self._request)} tokens framed, more than "
                       f"an observation may be (max_obs_tokens={max_obs_tokens}); shorten "
                       "context.summary_request or raise max_obs_tokens")
    self._blank = None
    # The longest first prompt (tokens) that did not fit in max_total_tokens.
    self.longest_unfit_prompt = 0
    # Episodes ended by their environment, by what went wrong (a message).
    self.env_failures: collections.Counter[str] = collections.Counter()
    options = model_lib.compiler_options(None, self.model_config.compute_dtype)
    self._prefill = jax.jit(self._prefill_impl, donate_argnums=(3,),
                            compiler_options=options)
    self._segment = jax.jit(self._segment_impl, donate_argnums=(2,),
                            compiler_options=options)

  def run(self, params, envs: Sequence[TextEnv], seeds: Sequence[int], key,
          version, *, actor: Actor | None = None,
          weights: Callable[[], tuple] | None = None,
          stale: Callable[[Any, int], bool] | None = None) -> Rollout:
    """Plays one episode per environment; returns the batch as a Rollout.

    ``weights() -> (params, version)``, when given, is asked before every
    jitted segment: when the version changed, the KV cache is rebuilt from
    the tokens so far under the new parameters and the episodes continue
    under them (partial rollouts; each token records its version), or are
    replayed from their start where ``stale`` says so (see :meth:`play`).

    ``params=None`` runs no model: every action must come from ``actor``
    (its rows record a uniform policy's log-probs); for demonstrations,
    whose tokens and loss masks are all that is kept.

    ``reward_B`` sums the environment's step rewards; ``reward_components``
    is empty (the text protocol has none) and ``call_hashes_BxC`` holds a
    hash of each step's action (its token ids), so the exploration monitors
    count distinct action sequences.
    """
    B = self.batch_size
    if params is None and actor is None:
      raise ValueError("params=None runs no model: pass an actor that scripts every action")
    if len(envs) != B or len(seeds) != B:
      raise ValueError(f"need {B} environments and seeds, got {len(envs)} and "
                       f"{len(seeds)}")
    keys = jax.random.split(check_key(key), B)
    todo = collections.deque(Episode(env, int(seed), keys[b], b)
                             for b, (env, seed) in enumerate(zip(envs, seeds)))
    rows: dict[int, Rollout] = {}
    check_version(version)
    fixed = (params, int(version))
    self.play(weights or (lambda: fixed), lambda: todo.popleft() if todo else None,
              rows.__setitem__, actor=actor, stale=stale)
    return jax.tree.map(lambda *xs: np.concatenate(xs), *(rows[b] for b in range(B)))

  def play(self, weights: Callable[[], tuple], next_episode: Callable[[], Episode | None],
           finished: Callable[[Any, Rollout], None], *, actor: Actor | None = None,
           chunk_steps: int | None = None,
           stale: Callable[[Any, int], bool] | None = None,
           stop: Callable[[], bool] | None = None) -> None:
    """Plays episodes on the loop's B rows with continuous batching.

    A row whose episode ends hands it to ``finished(tag, rollout)`` (a
    one-row :class:`Rollout` of numpy arrays) and takes ``next_episode()``
    at once, without waiting for the other rows; environment calls run on
    the workers while the other rows decode. Returns when every row is
    free and ``next_episode`` gives None, or when ``stop()`` says so (the
    episodes in flight are dropped). A row's tokens depend only on its
    episode (seed, key, environment) and the weights, not on the other rows
    or on when its environment answered.

    Args:
      weights: ``() -> (params, version)``, asked before every jitted
        segment; on a new version the KV cache is rebuilt under the new
        parameters and the episodes continue (partial rollouts). It may
        block (an asynchronous actor waits for fresh weights there).
      next_episode: the next :class:`Episode` to play, or None for none now.
      finished: receives each ended episode.
      actor: scripts the policy: ``actor(tag, observation) -> action``.
      chunk_steps: token steps per jitted segment, after which finished
        environment calls are applied and ended rows refilled; None runs a
        segment until every live row awaits its environment.
      stale: ``stale(tag, oldest_version) -> bool``, asked before every
        segment (after ``weights``) for each running episode with policy
        tokens (the version of its oldest one): True replays it from its
        reset (same seed and key) under the current weights.
      stop: ``() -> bool``, asked before every segment.
    """
    B = self.batch_size
    if self.workers.pending:
      raise RuntimeError("a HostLoop plays one set of episodes at a time")
    params, version = weights()
    version = check_version(version)
    host = self._new_rows([[self.ids.pad]] * B, jax.random.split(jax.random.key(0), B))
    host.truncated_B[:] = True  # a free row is an ended one
    episodes: list[Episode | None] = [None] * B
    calling_B = np.zeros(B, bool)  # an environment call of the row is running
    prefill_B = np.zeros(B, bool)  # the row's cache must be rebuilt
    cache = (None if params is None  # scripted: no model to run (run's docstring)
             else model_lib.init_cache(self.model_config, B, self.sampling.max_total_tokens))

    def submit(b, kind, fn):
      calling_B[b] = True
      self.workers.submit((b, kind), fn)

    def begin(b, episode):
      host.awaiting_B[b], host.truncated_B[b], host.done_B[b] = True, False, False
      episodes[b] = episode
      submit(b, "reset", lambda env=episode.env, seed=episode.seed: env.reset(int(seed)))

    def act(b, episode):
      """Hands row b's closed action to its environment (or, when it is a
      summary the context asked for, rewrites the context with it)."""
      action = self._action_ids(host, b)
      if self._contexts[b].pending is not None:
        prefill_B[b] |= self._summarised(host, b, actor, episode.tag)
        return
      tools = getattr(episode.env, "tools", None)
      try:
        tool_call = self.codec.parse_tool_call(action, tools) if tools else None
      except ToolCallError as e:  # the policy is told; the environment never sees it
        host.num_tool_errors_B[b] += 1
        prefill_B[b] |= self._env_step(host, b, action,
                                       Outcome(value=(f"error: {e}", 0.0, False)), actor,
                                       episode.tag)
        return
      if tool_call is None:
        text = self.codec.action_text(action)
        submit(b, "step", lambda env=episode.env, text=text: env.step(text))
        return
      submit(b, "step", lambda env=episode.env, c=tool_call: env.call_tool(c.name, c.arguments))

    try:
      while stop is None or not stop():
        for b in np.flatnonzero(host.ended_B & ~calling_B):
          if episodes[b] is not None:
            finished(episodes[b].tag, self._row(host, b))
            episodes[b] = None
        for b in np.flatnonzero(host.ended_B & ~calling_B):
          if (episode := next_episode()) is None:
            break
          begin(b, episode)
        if not calling_B.any() and host.ended_B.all():
          return
        live = ~host.ended_B & ~host.awaiting_B
        spawns = []
        for (b, kind), out in self.workers.results(block=not live.any()):
          calling_B[b] = False
          if kind == "reset":
            prefill_B[b] = self._start(host, b, episodes[b], out, actor)
          elif out.ok and isinstance(out.value, Spawn):
            spawns.append((b, out))
          else:
            prefill_B[b] |= self._env_step(host, b, self._action_ids(host, b),
                                           _checked_step(out), actor, episodes[b].tag)
        if spawns:
          for b, outcome in self._spawn(host, spawns, episodes):
            if callable(outcome):
              submit(b, "step", outcome)
            else:
              prefill_B[b] |= self._env_step(host, b, self._action_ids(host, b), outcome,
                                             actor, episodes[b].tag)
        live = ~host.ended_B & ~host.awaiting_B
        if not live.any():
          continue
        new_params, new_version = weights()
        if int(new_version) != int(version):
          params, version = new_params, check_version(new_version)
          prefill_B[:] = True
        if stale is not None:  # asked under the weights the next segment uses
          for b in np.flatnonzero(live & (host.loss_mask_BxT.max(axis=1) > 0)):
            if stale(episodes[b].tag, int(host.version_BxT[b][host.loss_mask_BxT[b] > 0].min())):
              begin(b, episodes[b])
          if not (~host.ended_B & ~host.awaiting_B).any():
            continue
        if prefill_B.any() and params is not None:
          cache = self._prefill_rows(params, host, cache, np.flatnonzero(prefill_B))
          prefill_B[:] = False
        state = jax.tree.map(jnp.asarray, host)
        steps = self.sampling.max_total_tokens if chunk_steps is None else chunk_steps
        state, cache = self._segment(params, state, cache, version, jnp.int32(steps))
        host = jax.tree.map(np.array, state)
        for b in np.flatnonzero(host.awaiting_B & ~calling_B):
          act(b, episodes[b])
    finally:
      self.workers.abandon()

  def _spawn(self, s: RolloutState, spawns: list[tuple[int, Outcome]], episodes):
    """Runs the rows' spawns on the swarm, all at once; yields ``(b,
    outcome)``: the step's outcome (an error observation), or a call that
    gives it (``spawn.then`` of the results, run on the workers). The
    sub-agents' wall time counts as each spawning row's environment time."""
    ready = []
    for b, out in spawns:
      s.env_seconds_B[b] += out.seconds
      error = ("error: this loop has no sub-agents" if self.swarm is None
               else self.swarm.check(out.value))
      if error is None:
        ready.append((b, out.value))
      else:
        yield b, Outcome(value=(error, 0.0, False))
    if not ready:
      return
    t0 = time.perf_counter()
    key = jax.random.fold_in(episodes[ready[0][0]].key, int(s.num_actions_B[ready[0][0]]))
    results = self.swarm.run([spawn for _, spawn in ready], key)
    seconds = time.perf_counter() - t0
    for (b, spawn), result in zip(ready, results):
      s.env_seconds_B[b] += seconds
      self._tally.add(b, result)
      yield b, (lambda then=spawn.then, result=result: then(result))

  # ------------------------------------------------------------------ device
  def _prefill_rows(self, params, s: RolloutState, cache, rows: np.ndarray):
    """``cache`` with rows ``rows`` rebuilt from their tokens so far, in one
    prefill of a bucketed shape (rows and tokens rounded up to powers of
    two; the padding repeats a row)."""
    n = 1 << (len(rows) - 1).bit_length()
    length = int(s.cur_B[rows].max()) + 1
    length = min(1 << (length - 1).bit_length(), self.sampling.max_total_tokens)
    rows_N = np.resize(rows, n).astype(np.int32)
    return self._prefill(params, jnp.asarray(s.tokens_BxT[rows_N, :length]),
                         jnp.asarray(rows_N), cache)

  def _prefill_impl(self, params, tokens_NxL, rows_N, cache):
    N, L = tokens_NxL.shape
    new = model_lib.init_cache(self.model_config, N, L)
    _, new = model_lib.prefill(params, tokens_NxL, new, self.model_config)
    write = lambda old, row_cache: old.at[rows_N, :, :L].set(row_cache)
    return jax.tree.map(write, cache, new)

  def _segment_impl(self, params, state, cache, version, max_steps):
    def await_env(s, stop_B, token_B):
      del token_B
      return s.replace(awaiting_B=s.awaiting_B | stop_B)
    return run_loop(params, state, cache, version, max_steps,
                    model_config=self.model_config, sampling=self.sampling,
                    ids=self.ids, on_stop=await_env)

  # -------------------------------------------------------------------- host
  def _new_rows(self, prompts: Sequence[Sequence[int]], keys) -> RolloutState:
    """numpy state of ``len(prompts)`` rows with their prompts written and
    PRNG keys ``keys`` (typed, ``[n]``)."""
    T, n = self.sampling.max_total_tokens, len(prompts)
    state = new_state(
        jnp.asarray(pad_batch(prompts, T, self.ids.pad)),
        jnp.asarray([len(p) for p in prompts], jnp.int32), jax.random.key(0), max_len=T,
        max_turns=self.sampling.max_turns, pad_id=self.ids.pad,
        queue_width=self.max_obs_tokens + self._framing,
        script_BxS=jnp.zeros((n, self.sampling.max_new_tokens_per_turn), jnp.int32),
        script_len_B=jnp.zeros((n,), jnp.int32), reward_components={}, env_state=None)
    return jax.tree.map(np.array, state.replace(key_B=jax.random.key_data(keys)))

  def _start(self, s: RolloutState, b: int, episode: Episode, out: Outcome,
             actor: Actor | None) -> bool:
    """Writes row b's new episode after its ``reset`` (numpy state, in
    place); True when it runs (its cache must be built)."""
    if out.ok and not isinstance(out.value, str):
      out = Outcome(error=TypeError(f"reset must return str, got {type(out.value).__name__}"),
                    seconds=out.seconds)
    status = self._failure(out, "reset")
    obs = "" if status else out.value
    tools = getattr(episode.env, "tools", None)
    prompt = self.codec.encode_prompt(self._prompt_messages(obs), tools=tools, escape=True)
    T = self.sampling.max_total_tokens
    if len(prompt) >= T:  # no room to act: the episode ends before it starts
      status = _STATUS["obs_overflow"]
      self.longest_unfit_prompt = max(self.longest_unfit_prompt, len(prompt))
      prompt = self.codec.encode_prompt(self._prompt_messages(""), tools=tools, escape=True)
      if len(prompt) >= T:
        raise ValueError(f"a prompt of {len(prompt)} tokens (the system prompt and "
                         f"framing) does not fit in the KV cache of max_total_tokens={T}")
    if self._blank is None:  # one row of a fresh state, the template of every start
      self._blank = self._new_rows([[self.ids.pad]], jax.random.split(jax.random.key(0), 1))
    for name, value in vars(self._blank).items():
      if isinstance(value, np.ndarray):
        getattr(s, name)[b] = value[0]
    s.tokens_BxT[b, :len(prompt)] = prompt
    s.prompt_len_B[b], s.cur_B[b] = len(prompt), len(prompt) - 1
    s.key_B[b] = np.asarray(jax.random.key_data(episode.key))
    s.env_seconds_B[b] = out.seconds
    s.status_B[b], s.truncated_B[b] = status, status != 0
    self._contexts[b] = _RowContext()
    if self._tally is not None:
      self._tally.reset(b)
    if status:
      return False
    if actor is not None:
      self._script(s, b, actor(episode.tag, obs))
    return True

  def _row(self, s: RolloutState, b: int) -> Rollout:
    row = jax.tree.map(np.asarray, jax.tree.map(lambda x: x[b:b + 1].copy(), s).to_rollout())
    if self._tally is not None:
      row = row.replace(info=self._tally.info(b, int(s.num_actions_B[b])))
    if not self.context.enabled:
      return row
    K, T = self.context.max_resets, s.tokens_BxT.shape[1]
    closed = self._contexts[b].segments
    blank = {"tokens": np.full(T, self.ids.pad, np.int32), "loss_mask": np.zeros(T, np.float32),
             "behaviour_logp": np.zeros(T, np.float32), "entropy": np.zeros(T, np.float32),
             "version": np.full(T, -1, np.int32)}
    stack = lambda name: np.stack(  # noqa: E731
        [seg[name] for seg in closed] + [blank[name]] * (K - len(closed)))[None]
    return row.replace(segments=Segments(
        **{f"{name}_BxKxT": stack(name) for name in blank},
        length_BxK=np.array([[seg["length"] for seg in closed] + [0] * (K - len(closed))],
                            np.int32),
        count_B=np.array([len(closed)], np.int32)))

  def _prompt_messages(self, observation: str) -> list[Message]:
    """The system prompt, if any, and the first observation."""
    system = [Message("system", self.system_prompt)] if self.system_prompt else []
    return system + [Message("user", observation)]

  def _action_ids(self, s: RolloutState, b: int) -> np.ndarray:
    cur, seg = int(s.cur_B[b]), int(s.seg_len_B[b])
    return s.tokens_BxT[b, cur + 1 - seg:cur + 1]

  def _env_step(self, s: RolloutState, b: int, action_ids: np.ndarray, out: Outcome,
                actor: Actor | None, tag: Any) -> bool:
    """Applies row b's environment step ``out`` (numpy state, in place);
    True when its context was rewritten (its cache must be rebuilt)."""
    T = s.tokens_BxT.shape[1]
    cur = int(s.cur_B[b])
    s.seg_len_B[b] = 0
    s.awaiting_B[b] = False
    if s.num_actions_B[b] < s.call_hashes_BxC.shape[1]:  # the behaviour path: what was done
      s.call_hashes_BxC[b, s.num_actions_B[b]] = zlib.crc32(action_ids.tobytes()) & 0x7FFFFFFF
    s.num_actions_B[b] += 1
    called = self.codec.calls_tool(action_ids)
    s.num_tool_calls_B[b] += int(called)
    s.env_seconds_B[b] += out.seconds
    if failure := self._failure(out, "call_tool" if called else "step"):
      s.status_B[b], s.truncated_B[b] = failure, True
      return False
    obs, reward, done = out.value
    s.reward_B[b] += reward
    if s.num_actions_B[b] - 1 < s.turn_rewards_BxC.shape[1]:
      s.turn_rewards_BxC[b, s.num_actions_B[b] - 1] += reward
    if done:
      s.done_B[b] = True
      return False
    obs_ids = self.codec.encode_text(obs)
    if len(obs_ids) > self.max_obs_tokens:
      if self.obs_overflow == "end":
        s.status_B[b], s.truncated_B[b] = _STATUS["obs_overflow"], True
        return False
      obs_ids = obs_ids[:self.max_obs_tokens]
      s.obs_clipped_B[b] += 1
    framed = self.codec.frame_observation_ids(obs_ids, tool=called)
    if len(framed) > s.queue_BxQ.shape[1]:  # re-tokenised with its framing, it grew
      s.status_B[b], s.truncated_B[b] = _STATUS["obs_overflow"], True
      return False
    if s.num_actions_B[b] >= self.sampling.max_turns or self._over_critical_steps(s, b):
      s.truncated_B[b] = True
      return False
    turn = Turn(cur + 1 - len(action_ids), cur + 1, cur + 1, called)
    if cur + len(framed) + self._reserve(b) > T - 1:  # the context is full
      return self._overflow(s, b, turn, framed, obs, actor, tag)
    self._observe(s, b, turn, framed, obs, actor, tag)
    return False

  def _over_critical_steps(self, s: RolloutState, b: int) -> bool:
    """Row b has used its swarm's critical-step budget."""
    limit = self.swarm.max_critical_steps if self.swarm is not None else 0
    return bool(limit) and self._tally.critical_steps(b, int(s.num_actions_B[b])) >= limit

  def _reserve(self, b: int) -> int:
    """Room a queued observation must leave: one policy token, and with the
    summary policy (while rewrites remain) the next action, the request and
    the summary."""
    c = self.context
    if c.policy != "summary" or len(self._contexts[b].segments) >= c.max_resets:
      return 1
    return 2 * self.sampling.max_new_tokens_per_turn + len(self._request)

  def _observe(self, s: RolloutState, b: int, turn: Turn, framed: Sequence[int], obs: str,
               actor: Actor | None, tag: Any):
    """Queues row b's framed observation, answer to ``turn``'s action."""
    s.queue_BxQ[b] = self.ids.pad
    s.queue_BxQ[b, :len(framed)] = framed
    s.queue_len_B[b] = len(framed)
    s.queue_pos_B[b] = 0
    self._contexts[b].turns.append(dataclasses.replace(turn, obs_end=turn.obs_start + len(framed)))
    if actor is not None:
      self._script(s, b, actor(tag, obs))

  def _overflow(self, s: RolloutState, b: int, turn: Turn, framed: list[int], obs: str,
                actor: Actor | None, tag: Any) -> bool:
    """Row b's observation does not fit: truncates the episode, asks for a
    summary, or rewrites the context; True when its cache must be rebuilt."""
    c, ctx, T = self.context, self._contexts[b], s.tokens_BxT.shape[1]
    cur = int(s.cur_B[b])
    if not c.enabled or len(ctx.segments) >= c.max_resets:
      s.truncated_B[b] = True
      return False
    if c.policy == "summary":
      if cur + len(self._request) + 1 > T - 1:
        s.truncated_B[b] = True
        return False
      ctx.pending, ctx.summary_from = (framed, obs), turn.action_start
      self._observe(s, b, turn, self._request, c.summary_request, actor, tag)
      return False
    pieces = context_lib.kept_pieces(c, int(s.prompt_len_B[b]), ctx.turns + [turn])
    return self._rewrite(s, b, pieces, framed, obs, actor, tag)

  def _summarised(self, s: RolloutState, b: int, actor: Actor | None, tag: Any) -> bool:
    """Row b's policy closed its summary: the new context keeps the task and
    everything from the last action on (the request and the summary), then
    the observation that did not fit."""
    ctx = self._contexts[b]
    (framed, obs), start = ctx.pending, ctx.summary_from
    ctx.pending = None
    s.seg_len_B[b], s.awaiting_B[b] = 0, False
    pieces = [Piece(0, int(s.prompt_len_B[b]), "task"),
              Piece(start, int(s.cur_B[b]) + 1, "action")]
    return self._rewrite(s, b, pieces, framed, obs, actor, tag)

  def _rewrite(self, s: RolloutState, b: int, pieces: Sequence[Piece], framed: list[int],
               obs: str, actor: Actor | None, tag: Any) -> bool:
    """Closes row b's segment and starts a new context from ``pieces``, then
    the observation ``framed``; True (the cache must be rebuilt), or False
    with the episode truncated when even that does not fit."""
    T, ctx = s.tokens_BxT.shape[1], self._contexts[b]
    ids, turn_ids, turns = [], [], []
    for piece in pieces:
      if piece.role == "action":
        end = len(ids) + piece.end - piece.start
        turns.append(Turn(len(ids), end, end))
      if piece.role == "omitted":
        part = self._omitted[piece.tool]
        turn_ids += [int(s.turn_BxT[b, piece.start])] * len(part)
      else:
        part = s.tokens_BxT[b, piece.start:piece.end].tolist()
        turn_ids += s.turn_BxT[b, piece.start:piece.end].tolist()
      ids += list(part)
      if piece.role in ("obs", "omitted"):
        turns[-1] = dataclasses.replace(turns[-1], obs_end=len(ids), tool=piece.tool)
    if len(ids) + len(framed) + 1 > T - 1:
      s.truncated_B[b] = True
      return False
    cur = int(s.cur_B[b])
    ctx.segments.append({
        "tokens": s.tokens_BxT[b].copy(), "loss_mask": s.loss_mask_BxT[b].copy(),
        "behaviour_logp": s.logp_BxT[b].copy(), "entropy": s.entropy_BxT[b].copy(),
        "version": s.version_BxT[b].copy(), "length": cur + 1})
    n = len(ids)
    s.tokens_BxT[b] = self.ids.pad
    s.tokens_BxT[b, :n] = ids
    s.turn_BxT[b] = 0
    s.turn_BxT[b, :n] = turn_ids
    s.loss_mask_BxT[b], s.logp_BxT[b], s.entropy_BxT[b], s.version_BxT[b] = 0, 0, 0, -1
    s.cur_B[b] = n - 1
    ctx.turns = turns[:-1]  # the last one's observation is queued next
    last = turns[-1] if turns else Turn(n, n, n)
    self._observe(s, b, Turn(last.action_start, n, n, last.tool), framed, obs, actor, tag)
    return True

  def _script(self, s: RolloutState, b: int, action: str):
    ids = self.codec.tokenizer.encode(action)
    if ids and ids[-1] not in self.ids.stop_ids:  # the codec's end of turn closes it
      ids.append(self.codec.turn_end_id)
    stops = [i for i, t in enumerate(ids) if t in self.ids.stop_ids]
    if stops != [len(ids) - 1]:
      raise ValueError(f"a scripted action must be text with no stop token "
                       f"{self.ids.stop_ids} but at its end, got {action!r}")
    if len(ids) > s.script_BxS.shape[1]:
      raise ScriptTooLong(len(ids), s.script_BxS.shape[1], action)
    s.script_BxS[b, :len(ids)] = ids
    s.script_len_B[b] = len(ids)
    s.script_pos_B[b] = 0

  def _failure(self, out: Outcome, call: str) -> int:
    """The ``status_B`` code of a failed ``call`` (0 for a good one),
    counted in ``env_failures``; each of the first few distinct messages is
    logged once."""
    if out.ok:
      return 0
    if out.timed_out:
      message = f"{call} ran past its time limit"
    else:
      message = f"{call}: {type(out.error).__name__}: {out.error}"[:300]
    if message not in self.env_failures:
      if len(self.env_failures) < _LOGGED_FAILURES:
        _LOG.warning("an environment's %s; its episode ends (episode/env_errors, "
                     "episode/env_timeouts, episode/nonfinite_rewards count them)", message)
      if len(self.env_failures) >= _COUNTED_FAILURES:
        message = "other failures"
    self.env_failures[message] += 1
    if out.timed_out:
      return _STATUS["env_timeout"]
    return _STATUS["nonfinite_reward" if isinstance(out.error, NonFiniteReward) else "env_error"]


class NonFiniteReward(ValueError):
  """A ``step`` or ``call_tool`` reward that is NaN or infinite."""


class ScriptTooLong(ValueError):
  """A scripted action of ``tokens`` tokens, more than the ``limit`` a
  turn may hold (``SamplingConfig.max_new_tokens_per_turn``)."""

  def __init__(self, tokens: int, limit: int, action: str):
    super().__init__(f"scripted action of {tokens} tokens exceeds "
                     f"max_new_tokens_per_turn={limit}: {action!r:.200}")
    self.tokens, self.limit, self.action = tokens, limit, action


def _checked_step(out: Outcome) -> Outcome:
  """``step``'s return as ``(str, float, bool)``, or a failed outcome; the
  call's ``seconds`` either way."""
  if not out.ok:
    return out
  return dataclasses.replace(_checked_value(out.value), seconds=out.seconds)


def _checked_value(value) -> Outcome:
  if not (isinstance(value, tuple) and len(value) == 3):
    return Outcome(error=TypeError("step must return (observation, reward, done), got "
                                   f"{type(value).__name__} {value!r:.80}"))
  obs, reward, done = value
  if not isinstance(obs, str):
    return Outcome(error=TypeError(f"step's observation must be str, got {type(obs).__name__}"))
  try:
    reward = float(reward)
  except (TypeError, ValueError):
    return Outcome(error=TypeError(f"step's reward must be a number, got {reward!r:.80}"))
  if not math.isfinite(reward):
    return Outcome(error=NonFiniteReward(f"step's reward is {reward}"))
  return Outcome(value=(obs, reward, bool(done)))
