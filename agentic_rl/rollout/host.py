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

Environments step concurrently (``env_workers`` threads, each call limited
to ``env_timeout_s``; :mod:`agentic_rl.rollout.workers`), and one that
misbehaves ends only its own episode, truncated with a reason in
``Rollout.status_B``: an exception or a malformed return from ``reset`` or
``step`` ("env_error"), a call past the time limit ("env_timeout"), a
non-finite reward ("nonfinite_reward"). Observation text that contains the
codec's framing strings reaches the policy as plain text
(``Codec.encode_text``). An observation longer than ``max_obs_tokens`` is
clipped to it (``obs_overflow="clip"``, counted in ``obs_clipped_B``) or
ends the episode ("obs_overflow", the default).

An optional ``actor(row, observation) -> action_text`` scripts the policy:
its actions are forced as policy tokens (loss mask 1, log-probs recorded)
instead of sampled. Each action must end with exactly one stop id.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl import model as model_lib
from agentic_rl.rollout.engine import check_key, check_version, new_state, run_loop
from agentic_rl.rollout.sampling import SamplingConfig
from agentic_rl.rollout.types import EPISODE_STATUS, Rollout, RolloutState
from agentic_rl.rollout.workers import EnvWorkers, Outcome
from agentic_rl.text.codec import Codec, Message, frame_observation, pad_batch

OBS_OVERFLOW = ("end", "clip")
_STATUS = {name: i for i, name in enumerate(EPISODE_STATUS)}

Actor = Callable[[int, str], str]


class TextEnv(Protocol):
  """A Python environment speaking text."""

  def reset(self, seed: int) -> str:
    ...

  def step(self, action: str) -> tuple[str, float, bool]:
    ...


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
  """

  def __init__(self, model_config: model_lib.TransformerConfig,
               sampling: SamplingConfig, codec: Codec, *, batch_size: int,
               max_obs_tokens: int = 128, system_prompt: str | None = None,
               obs_overflow: str = "end", env_workers: int = 1,
               env_timeout_s: float | None = None):
    self.model_config = model_config.validate()
    self.sampling = sampling.validate()
    if batch_size < 1 or max_obs_tokens < 1:
      raise ValueError(f"batch_size and max_obs_tokens must be >= 1, got "
                       f"{batch_size}, {max_obs_tokens}")
    if obs_overflow not in OBS_OVERFLOW:
      raise ValueError(f"obs_overflow must be one of {OBS_OVERFLOW}, got {obs_overflow!r}")
    self.codec = codec
    self.ids = codec.ids
    self.batch_size = batch_size
    self.max_obs_tokens = max_obs_tokens
    self.obs_overflow = obs_overflow
    self.system_prompt = system_prompt
    self.workers = EnvWorkers(env_workers, env_timeout_s)
    options = model_lib.compiler_options()
    self._prefill = jax.jit(self._prefill_impl, compiler_options=options)
    self._segment = jax.jit(self._segment_impl, donate_argnums=(2,),
                            compiler_options=options)

  def run(self, params, envs: Sequence[TextEnv], seeds: Sequence[int], key,
          version, *, actor: Actor | None = None,
          weights: Callable[[], tuple] | None = None) -> Rollout:
    """Plays one episode per environment; returns the batch as a Rollout.

    ``weights() -> (params, version)``, when given, is asked before every
    jitted segment: when the version changed, the KV cache is rebuilt from
    the tokens so far under the new parameters and the episodes continue
    under them (partial rollouts; each token records its version).

    ``reward_B`` sums the environment's step rewards; ``reward_components``
    is empty (the text protocol has none) and ``call_hashes_BxC`` holds a
    hash of each step's action (its token ids), so the exploration monitors
    count distinct action sequences.
    """
    B, T = self.batch_size, self.sampling.max_total_tokens
    check_version(version)
    if len(envs) != B or len(seeds) != B:
      raise ValueError(f"need {B} environments and seeds, got {len(envs)} and "
                       f"{len(seeds)}")
    status = np.zeros(B, np.int32)
    first_obs = []
    for b, out in enumerate(self.workers.map(
        [lambda env=env, seed=seed: env.reset(int(seed)) for env, seed in zip(envs, seeds)])):
      if out.ok and not isinstance(out.value, str):
        out = Outcome(error=TypeError(f"reset must return str, got {type(out.value).__name__}"))
      status[b] = _failure(out)
      first_obs.append(out.value if not status[b] else "")
    prompts = []
    for b, obs in enumerate(first_obs):
      prompt = self.codec.encode_prompt(self._prompt_messages(obs), escape=True)
      if len(prompt) >= T:  # no room to act: the episode ends before it starts
        status[b] = _STATUS["obs_overflow"]
        prompt = self.codec.encode_prompt(self._prompt_messages(""))
        if len(prompt) >= T:
          raise ValueError(f"a prompt of {len(prompt)} tokens (the system prompt and "
                           f"framing) does not fit in the KV cache of max_total_tokens={T}")
      prompts.append(prompt)
    script_width = self.sampling.max_new_tokens_per_turn
    state = new_state(
        jnp.asarray(pad_batch(prompts, T, self.ids.pad)),
        jnp.asarray([len(p) for p in prompts], jnp.int32), check_key(key), max_len=T,
        max_turns=self.sampling.max_turns, pad_id=self.ids.pad,
        queue_width=self.max_obs_tokens + 2,
        script_BxS=jnp.zeros((B, script_width), jnp.int32),
        script_len_B=jnp.zeros((B,), jnp.int32), reward_components={},
        env_state=None)
    host = jax.tree.map(np.array, state)
    host.status_B[:] = status
    host.truncated_B[:] = status != 0
    if actor is not None:
      for b in np.flatnonzero(status == 0):
        self._script(host, b, actor(b, first_obs[b]))
    state = jax.tree.map(jnp.asarray, host)
    cache = self._prefill(params, state.tokens_BxT)
    version = check_version(version)
    while True:
      if weights is not None:
        new_params, new_version = weights()
        if int(new_version) != int(version):
          params, version = new_params, check_version(new_version)
          cache = self._prefill(params, state.tokens_BxT)
      state, cache = self._segment(params, state, cache, version)
      host = jax.tree.map(np.array, state)
      rows = np.flatnonzero(host.awaiting_B)
      actions = {b: self._action_ids(host, b) for b in rows}
      outcomes = self.workers.map(
          [lambda env=envs[b], text=self.codec.tokenizer.decode(actions[b]): env.step(text)
           for b in rows])
      for b, out in zip(rows, outcomes):
        self._env_step(host, b, actions[b], _checked_step(out), actor)
      state = jax.tree.map(jnp.asarray, host)
      if host.ended_B.all():
        return state.to_rollout()

  # ------------------------------------------------------------------ device
  def _prefill_impl(self, params, tokens_BxT):
    cache = model_lib.init_cache(self.model_config, self.batch_size,
                                 self.sampling.max_total_tokens)
    _, cache = model_lib.prefill(params, tokens_BxT, cache, self.model_config)
    return cache

  def _segment_impl(self, params, state, cache, version):
    def await_env(s, stop_B, token_B):
      del token_B
      return s.replace(awaiting_B=s.awaiting_B | stop_B)
    return run_loop(params, state, cache, version,
                    jnp.int32(self.sampling.max_total_tokens),
                    model_config=self.model_config, sampling=self.sampling,
                    ids=self.ids, on_stop=await_env)

  # -------------------------------------------------------------------- host
  def _prompt_messages(self, observation: str) -> list[Message]:
    system = [Message("system", self.system_prompt)] if self.system_prompt else []
    return system + [Message("user", observation)]

  def _action_ids(self, s: RolloutState, b: int) -> np.ndarray:
    cur, seg = int(s.cur_B[b]), int(s.seg_len_B[b])
    return s.tokens_BxT[b, cur + 1 - seg:cur + 1]

  def _env_step(self, s: RolloutState, b: int, action_ids: np.ndarray, out: Outcome,
                actor: Actor | None):
    """Applies row b's environment step ``out`` (numpy state, in place)."""
    T = s.tokens_BxT.shape[1]
    cur = int(s.cur_B[b])
    s.seg_len_B[b] = 0
    s.awaiting_B[b] = False
    if s.num_actions_B[b] < s.call_hashes_BxC.shape[1]:  # the behaviour path: what was done
      s.call_hashes_BxC[b, s.num_actions_B[b]] = zlib.crc32(action_ids.tobytes()) & 0x7FFFFFFF
    s.num_actions_B[b] += 1
    s.num_tool_calls_B[b] += int(action_ids[-1] == self.ids.tool_call_close)
    if failure := _failure(out):
      s.status_B[b], s.truncated_B[b] = failure, True
      return
    obs, reward, done = out.value
    s.reward_B[b] += reward
    if s.num_actions_B[b] - 1 < s.turn_rewards_BxC.shape[1]:
      s.turn_rewards_BxC[b, s.num_actions_B[b] - 1] += reward
    if done:
      s.done_B[b] = True
      return
    obs_ids = self.codec.encode_text(obs)
    if len(obs_ids) > self.max_obs_tokens:
      if self.obs_overflow == "end":
        s.status_B[b], s.truncated_B[b] = _STATUS["obs_overflow"], True
        return
      obs_ids = obs_ids[:self.max_obs_tokens]
      s.obs_clipped_B[b] += 1
    n = len(obs_ids)
    # The framed observation and one more policy token must fit.
    if s.num_actions_B[b] >= self.sampling.max_turns or cur + n + 2 + 1 > T - 1:
      s.truncated_B[b] = True
      return
    obs_A = np.full((self.max_obs_tokens,), self.ids.pad, np.int32)
    obs_A[:n] = obs_ids
    framed, framed_len = frame_observation(jnp.asarray(obs_A), jnp.int32(n),
                                           self.ids)
    s.queue_BxQ[b] = np.asarray(framed)
    s.queue_len_B[b] = int(framed_len)
    s.queue_pos_B[b] = 0
    if actor is not None:
      self._script(s, b, actor(b, obs))

  def _script(self, s: RolloutState, b: int, action: str):
    ids = self.codec.tokenizer.encode(action)
    stops = [i for i, t in enumerate(ids) if t in self.ids.stop_ids]
    if not ids or stops != [len(ids) - 1]:
      raise ValueError(f"a scripted action must end with exactly one stop "
                       f"token {self.ids.stop_ids}, got {action!r}")
    if len(ids) > s.script_BxS.shape[1]:
      raise ValueError(f"scripted action of {len(ids)} tokens exceeds "
                       f"max_new_tokens_per_turn={s.script_BxS.shape[1]}")
    s.script_BxS[b, :len(ids)] = ids
    s.script_len_B[b] = len(ids)
    s.script_pos_B[b] = 0


def _failure(out: Outcome) -> int:
  """The ``status_B`` code of a failed call, 0 for a good one."""
  if out.timed_out:
    return _STATUS["env_timeout"]
  if out.error is not None:
    return _STATUS["nonfinite_reward" if isinstance(out.error, _NonFinite) else "env_error"]
  return 0


class _NonFinite(ValueError):
  pass


def _checked_step(out: Outcome) -> Outcome:
  """``step``'s return as ``(str, float, bool)``, or a failed outcome."""
  if not out.ok:
    return out
  value = out.value
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
    return Outcome(error=_NonFinite(f"step's reward is {reward}"))
  return Outcome(value=(obs, reward, bool(done)))
