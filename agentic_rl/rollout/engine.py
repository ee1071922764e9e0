"""The jitted multi-turn rollout engine.

One ``lax.while_loop`` step moves every live row by exactly one token through
the model's :func:`~agentic_rl.model.decode_step`:

* the row feeds its last written token (position ``cur``) and gets the logits
  for position ``cur + 1``;
* the token written at ``cur + 1`` is, in order of priority, the next pending
  observation token (forced, loss mask 0), the next scripted policy token
  (forced, loss mask 1), or a draw from the sampling distribution (loss mask
  1); policy tokens record their log-prob and entropy under that distribution
  and the policy version;
* when a policy token is one of the codec's stop ids, the row's action
  segment is complete: the in-jit environment steps (vmapped, applied only to
  rows that stopped), its observation is framed by the codec and queued, and
  the episode ends on ``done``/``truncated``, a final stop id, or a limit.

Fresh episodes prefill each of the P prompts once and copy its KV cache to
its G rows (the cache the rows' own prefills write, computed for P rows
instead of B); with ``decode_shared_prefix`` the G rows instead decode from
one cache of the prompt's first positions, read once per group
(``model.decode_step(..., prefix=...)``; :meth:`RolloutEngine.rollout`).
The loop exits early when no row is live (with a ``row_sharding``, each
device runs its own loop on its share of the rows). The KV cache starts at
the prompt length and grows to the row capacity in up to ``cache_segments``
steps (one while loop per size), so attention reads about as many slots as
the rows hold. Episode limits (tokens per turn, turns, total tokens) truncate a row.
Randomness is per row and per position (``fold_in(row_key, position)``), so
an episode interrupted after any step and resumed
(:meth:`RolloutEngine.resume`) draws exactly what it would have.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from agentic_rl import model as model_lib
from agentic_rl.envs.base import JaxEnv
from agentic_rl.rollout import sampling as sampling_lib
from agentic_rl.rollout.sampling import SamplingConfig
from agentic_rl.rollout.types import Rollout, RolloutState, select_rows
from agentic_rl.text.codec import FormatIds, frame_observation

PyTree = Any
# on_stop(state, stopped_B, token_B) -> state: what happens when rows close an
# action (the state's cursor already includes the stop token).
OnStop = Callable[[RolloutState, jax.Array, jax.Array], RolloutState]

REQUIRED_INFO = ("call_hash", "tool_error")
MIN_CACHE_STEP = 64


def _check_int(name: str, value, low: int = 1):
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) \
      or value < low:
    raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def check_key(key) -> jax.Array:
  """ValueError unless ``key`` is one PRNG key (typed, or legacy uint32[2])."""
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  if not (typed and key.shape == ()) and not (
      key.dtype == jnp.uint32 and key.shape == (2,)):
    raise ValueError(f"key must be one PRNG key (jax.random.key or PRNGKey), "
                     f"got {key.dtype} {key.shape}")
  return key


def check_version(version) -> jax.Array:
  """The policy version as an int32 scalar; ValueError unless a Python int."""
  if not isinstance(version, (int, np.integer)) or isinstance(version, bool):
    raise ValueError(f"version must be an int, got {version!r}")
  return jnp.int32(version)


def _batch_size(tree: PyTree) -> set[int]:
  return {jnp.shape(x)[0] if jnp.ndim(x) else -1 for x in jax.tree.leaves(tree)}


class RolloutEngine:
  """Generates batches of (multi-turn) episodes with one jitted loop.

  Args:
    model_config: the policy's config.
    sampling: sampling settings and episode limits.
    ids: the codec's format ids (stop ids, framing). None disables stop
      tokens (plain generation: rows run to the per-turn token limit).
    env: an in-jit environment (see ``agentic_rl.envs.base``), or None for
      single-turn generation (a stop token ends the episode).
    batch_size: B rows per batch.
    group_size: G samples per prompt; the batch holds ``B / G`` prompts,
      each prefilled once for its G rows.
    cache_segments: the KV cache grows to T slots in up to this many steps
      (:func:`run_loop`), so attention reads about as many slots as the rows
      hold; each step is one more while loop to compile. 1 allocates all T
      slots up front.
    row_sharding: optional data-parallel rollout: a ``NamedSharding`` whose
      spec's first entry names the mesh axes that split the B rows (e.g.
      ``train.sharding.batch_sharding(mesh)``); rows are replicated over the
      mesh's other axes, and so are the params. Every row shard runs the
      loop on its rows alone and stops when they end. Randomness is per row,
      so the result equals the one-device rollout (log-probs to float
      rounding). Single-process meshes.
    decode_shared_prefix: the G rows of a prompt decode from one KV cache of
      its first ``Ls`` positions (``Ls`` the batch's shortest prompt length
      rounded down to a power of two), which their decode steps read once
      per group, and each row's own cache holds the positions after it:
      fewer cache reads per step with long prompts (BENCHMARKS.md, "Group
      prefix sharing"). The log-probs equal those without it to float
      rounding only, so a draw that falls within that rounding of the
      boundary between two tokens can take the other one (2 of 2048 tokens
      in ``experiments/bench_prefix.py`` at G = 16, a random model's
      near-uniform distribution over 1024 tokens); off by default.
  """

  def __init__(self, model_config: model_lib.TransformerConfig,
               sampling: SamplingConfig, ids: FormatIds | None, *,
               env: JaxEnv | None = None, batch_size: int, group_size: int = 1,
               cache_segments: int = 4,
               row_sharding: NamedSharding | None = None,
               decode_shared_prefix: bool = False):
    self.model_config = model_config.validate()
    self.sampling = sampling.validate()
    _check_int("batch_size", batch_size)
    _check_int("group_size", group_size)
    _check_int("cache_segments", cache_segments)
    if batch_size % group_size:
      raise ValueError(f"group size {group_size} does not divide the batch "
                       f"size {batch_size}")
    if env is not None and ids is None:
      raise ValueError("an environment needs the codec's format ids (ids=None)")
    if env is not None and sampling.max_new_tokens_per_turn > env.max_action_len:
      raise ValueError(
          f"max_new_tokens_per_turn ({sampling.max_new_tokens_per_turn}) "
          f"exceeds the environment's max_action_len ({env.max_action_len})")
    if ids is not None:
      bad = [i for i in ids.stop_ids if not 0 <= i < model_config.vocab_size]
      if bad:
        raise ValueError(f"stop ids {bad} are outside the model's vocabulary "
                         f"of {model_config.vocab_size}")
    self.ids = ids
    self.env = env
    self.batch_size = batch_size
    self.group_size = group_size
    self.num_prompts = batch_size // group_size
    self.cache_segments = cache_segments
    self.row_sharding = row_sharding
    self.decode_shared_prefix = bool(decode_shared_prefix)
    if row_sharding is not None:
      axes = row_sharding.spec[0] if row_sharding.spec else None
      axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
      shards = int(np.prod([row_sharding.mesh.shape[a] for a in axes]))
      if batch_size % shards:
        raise ValueError(f"batch size {batch_size} does not split into the "
                         f"{shards} row shards of row_sharding ({axes})")
    options = model_lib.compiler_options(
        None if row_sharding is None else row_sharding.mesh, self.model_config.compute_dtype)
    options = tuple(sorted(options.items())) if options else None
    # The engine is their static first argument: engines built alike share
    # what either compiled (see __eq__).
    self._rollout_jit = _jitted("_rollout", options)
    self._init_jit = _jitted("_init_state", options)
    self._advance_jit = _jitted("_advance", options)

  def _config(self) -> tuple:
    return (self.model_config, self.sampling, self.ids, self.env, self.batch_size,
            self.group_size, self.cache_segments, self.row_sharding,
            self.decode_shared_prefix)

  def __eq__(self, other):
    """Engines are equal when built with equal arguments (environments
    compare by value), so each run's and each evaluation's engine reuses
    the programs an equal one compiled."""
    return type(other) is type(self) and self._config() == other._config()

  def __hash__(self):
    return hash(self._config())

  # ------------------------------------------------------------- public API
  @property
  def max_len(self) -> int:
    """T: tokens per row and KV-cache length."""
    return self.sampling.max_total_tokens

  def rollout(self, params, prompts_PxL, prompt_len_P, instances_P, key,
              version, *, script_PxS=None, script_len_P=None,
              temperature: float | None = None) -> Rollout:
    """Whole episodes for P prompts, G samples each, in one ``jax.jit``.

    Args:
      params: the policy's parameters.
      prompts_PxL: int32 right-padded prompt ids (``Codec.encode_prompt``,
        ``pad_batch``), ``L < T``.
      prompt_len_P: int32 valid prompt lengths, in ``[1, L]``.
      instances_P: the environment's task instances, leading axis P (None
        without an environment).
      key: PRNG key.
      version: int policy version recorded on every policy token.
      script_PxS / script_len_P: optional policy tokens to force instead of
        sampling (a scripted policy: actions, stop ids included, back to
        back; sampling resumes after the script). Scripted tokens have loss
        mask 1 and record their log-prob under the sampling distribution
        (``-inf`` if top-k/top-p excludes them).
      temperature: overrides ``sampling.temperature`` for this call without
        recompiling (a temperature schedule; 0: greedy decoding); None keeps
        the config's.
    Returns:
      :class:`Rollout` with ``B = P * G`` rows, prompt-major.

    Each prompt is prefilled once (on each device's share of the rows with a
    ``row_sharding``) and its KV cache copied to its G rows: the same
    episodes as G = 1 with every prompt repeated G times (the log-probs to
    float rounding: the prefill's matmuls have P rows, not B). With
    ``decode_shared_prefix`` the first ``Ls`` positions (the shortest prompt
    length rounded down to a power of two) stay one cache per group that
    the G rows' decode steps read together: the log-probs to float rounding
    (the attention sums the shared and the own slots apart), and a batch
    whose shortest prompt length changes power of two compiles again.
    """
    args = self._check_inputs(prompts_PxL, prompt_len_P, instances_P,
                              script_PxS, script_len_P)
    return self._rollout_jit(self, params, *args, check_key(key),
                             check_version(version), self._temperature(temperature),
                             prefill_len=int(np.shape(prompts_PxL)[1]),
                             shared_len=self._shared_len(args[1]))

  def init_state(self, prompts_PxL, prompt_len_P, instances_P, key, *,
                 script_PxS=None, script_len_P=None) -> RolloutState:
    """Fresh episodes (prompts written, environments reset), not yet run."""
    args = self._check_inputs(prompts_PxL, prompt_len_P, instances_P,
                              script_PxS, script_len_P)
    return self._init_jit(self, *args, check_key(key))

  def resume(self, params, state: RolloutState, version, *,
             max_steps: int | None = None,
             temperature: float | None = None) -> RolloutState:
    """Continues in-progress episodes under ``params`` (partial rollouts).

    The KV cache is rebuilt from the state's tokens with ``params`` (so a
    parameter change takes effect on the whole context), then at most
    ``max_steps`` tokens per row are generated or forced (the per-iteration
    token budget; None: until every episode ends). Tokens written earlier
    keep their recorded versions and log-probs.
    """
    if max_steps is not None:
      _check_int("max_steps", max_steps, low=0)
    steps = self.max_len if max_steps is None else max_steps
    longest = int(np.max(np.asarray(state.cur_B))) + 1
    prefill_len = min(self.max_len, 1 << max(longest - 1, 1).bit_length())
    return self._advance_jit(self, params, state, check_version(version),
                             jnp.int32(steps), self._temperature(temperature),
                             prefill_len=prefill_len)

  def refill(self, state: RolloutState, fresh: RolloutState,
             replace_P: jax.Array) -> RolloutState:
    """Replaces the groups flagged in ``replace_P`` by ``fresh`` episodes.

    Use it between iterations of partial rollouts: finished groups make room
    for new prompts (from :meth:`init_state`), unfinished ones carry over.
    """
    replace_P = jnp.asarray(replace_P, bool)
    if replace_P.shape != (self.num_prompts,):
      raise ValueError(f"replace_P must have shape ({self.num_prompts},), got "
                       f"{replace_P.shape}")
    return select_rows(jnp.repeat(replace_P, self.group_size), fresh, state)

  # --------------------------------------------------------- input checks
  def _shared_len(self, prompt_len_P) -> int:
    """The prompt positions each group decodes from one shared cache
    (``decode_shared_prefix``): the shortest prompt length rounded down to a
    power of two (few values, so few compiles); 0 without it, for G = 1 or
    traced lengths."""
    lens = model_lib.transformer.concrete_or_none(prompt_len_P)
    if not self.decode_shared_prefix or self.group_size == 1 or lens is None \
        or not lens.size:
      return 0
    return 1 << (int(lens.min()).bit_length() - 1)

  def _temperature(self, temperature) -> jax.Array:
    if temperature is None:
      return jnp.float32(self.sampling.temperature)
    if isinstance(temperature, (int, float)) and not temperature >= 0.0:
      raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    return jnp.float32(temperature)

  def _check_inputs(self, prompts_PxL, prompt_len_P, instances_P, script_PxS,
                    script_len_P):
    P, T = self.num_prompts, self.max_len
    prompts_PxL = jnp.asarray(prompts_PxL)
    if prompts_PxL.ndim != 2 or not jnp.issubdtype(prompts_PxL.dtype, jnp.integer):
      raise ValueError(f"prompts must be an int [P, L] array, got "
                       f"{prompts_PxL.dtype} {prompts_PxL.shape}")
    if prompts_PxL.shape[0] != P:
      raise ValueError(
          f"got {prompts_PxL.shape[0]} prompts; batch size {self.batch_size} "
          f"with group size {self.group_size} takes {P}")
    L = prompts_PxL.shape[1]
    model_lib.transformer.check_tokens(prompts_PxL, self.model_config.vocab_size, 2)
    if L >= T:
      raise ValueError(f"prompts of {L} tokens do not fit in the KV cache of "
                       f"max_total_tokens={T} (need at least one free slot)")
    prompt_len_P = jnp.asarray(prompt_len_P, jnp.int32)
    if prompt_len_P.shape != (P,):
      raise ValueError(f"prompt_len must have shape ({P},), got {prompt_len_P.shape}")
    lens = model_lib.transformer.concrete_or_none(prompt_len_P)
    if lens is not None and (lens.min() < 1 or lens.max() > L):
      raise ValueError(f"prompt lengths must be in [1, {L}], got "
                       f"[{lens.min()}, {lens.max()}]")
    if (instances_P is None) != (self.env is None):
      raise ValueError("pass environment instances exactly when the engine "
                       "has an environment")
    if instances_P is not None and _batch_size(instances_P) != {P}:
      raise ValueError(f"every instance leaf needs a leading axis of {P} "
                       f"prompts, got sizes {_batch_size(instances_P)}")
    if (script_PxS is None) != (script_len_P is None):
      raise ValueError("pass script_PxS and script_len_P together")
    if script_PxS is None:
      script_PxS = jnp.zeros((P, 1), jnp.int32)
      script_len_P = jnp.zeros((P,), jnp.int32)
    script_PxS = jnp.asarray(script_PxS, jnp.int32)
    script_len_P = jnp.asarray(script_len_P, jnp.int32)
    if script_PxS.ndim != 2 or script_PxS.shape[0] != P \
        or script_len_P.shape != (P,):
      raise ValueError(f"script must be [{P}, S] with lengths [{P}], got "
                       f"{script_PxS.shape} and {script_len_P.shape}")
    model_lib.transformer.check_tokens(script_PxS, self.model_config.vocab_size, 2)
    return prompts_PxL.astype(jnp.int32), prompt_len_P, instances_P, \
        script_PxS, script_len_P

  # ------------------------------------------------------------ jitted core
  def _rollout(self, params, prompts_PxL, prompt_len_P, instances_P,
               script_PxS, script_len_P, key, version, temperature, *, prefill_len,
               shared_len=0):
    state = self._init_state(prompts_PxL, prompt_len_P, instances_P,
                             script_PxS, script_len_P, key)
    state = self._advance(params, state, version, jnp.int32(self.max_len),
                          temperature, prefill_len=prefill_len, shared_rows=self.group_size,
                          shared_len=shared_len)
    return state.to_rollout()

  def _advance(self, params, state, version, max_steps, temperature, *, prefill_len,
               shared_rows=1, shared_len=0):
    if self.row_sharding is None:
      return self._advance_rows(params, state, version, max_steps, temperature,
                                prefill_len=prefill_len, shared_rows=shared_rows,
                                shared_len=shared_len)
    rows, rep = PartitionSpec(*self.row_sharding.spec[:1]), PartitionSpec()
    # Rows never meet, so there are no collectives to type-check; without
    # check_vma, environments need no varying-axis casts in their loops.
    return jax.shard_map(
        functools.partial(self._advance_rows, prefill_len=prefill_len,
                          shared_rows=shared_rows, shared_len=shared_len),
        mesh=self.row_sharding.mesh, in_specs=(rep, rows, rep, rep, rep),
        out_specs=rows, check_vma=False)(params, state, version, max_steps, temperature)

  def _advance_rows(self, params, state, version, max_steps, temperature, *,
                    prefill_len, shared_rows=1, shared_len=0):
    """Runs the loop on ``state``'s rows (all of them, or one device's).

    ``shared_rows``: the rows come in runs of this many (a group's fresh
    episodes) with the same first ``prefill_len`` tokens; each run is
    prefilled once (runs split between devices share within each device's
    rows). Its first ``shared_len`` positions (at most every row's prompt)
    then stay one cache per run, the others are copied to each row's cache;
    ``shared_len=0`` copies all of them.
    """
    B = state.tokens_BxT.shape[0]
    g = math.gcd(shared_rows, B)
    cache_len = prefill_len if self.cache_segments > 1 else self.max_len
    shared = g > 1 and shared_len > 0
    # The shared cache keeps shared_len slots and each row's at least one.
    full_len = max(cache_len, shared_len + 1) if shared else cache_len
    cache = model_lib.init_cache(self.model_config, B // g, full_len)
    _, cache = model_lib.prefill(params, state.tokens_BxT[::g, :prefill_len],
                                 cache, self.model_config)
    prefix = None
    if shared:
      prefix, cache = model_lib.split_slots(cache, shared_len)
    cache = model_lib.repeat_rows(cache, g)
    on_stop = self._env_stop if self.env is not None else self._final_stop
    state, _ = run_loop(params, state, cache, version, max_steps,
                        model_config=self.model_config, sampling=self.sampling,
                        ids=self.ids, on_stop=on_stop, temperature=temperature,
                        cache_segments=self.cache_segments, prefix_cache=prefix)
    return state

  def _init_state(self, prompts_PxL, prompt_len_P, instances_P, script_PxS,
                  script_len_P, key):
    G = self.group_size
    rep = lambda x: jnp.repeat(x, G, axis=0)
    env_state, components, queue_width = None, {}, 1
    if self.env is not None:
      env_state = jax.vmap(self.env.reset)(jax.tree.map(rep, instances_P))
      out = self._step_output_shapes(env_state)
      components = {k: jnp.zeros((self.batch_size,), jnp.float32)
                    for k in out.reward_components}
      queue_width = self.env.max_obs_len + 2
    return new_state(
        rep(prompts_PxL), rep(prompt_len_P), key,
        max_len=self.max_len, max_turns=self.sampling.max_turns,
        pad_id=self.ids.pad if self.ids is not None else 0,
        queue_width=queue_width, script_BxS=rep(script_PxS),
        script_len_B=rep(script_len_P), reward_components=components,
        env_state=env_state)

  def _step_output_shapes(self, env_state):
    B, A = self.batch_size, self.env.max_action_len
    _, out = jax.eval_shape(jax.vmap(self.env.step), env_state,
                            jnp.zeros((B, A), jnp.int32), jnp.zeros((B,), jnp.int32))
    missing = [k for k in REQUIRED_INFO if k not in out.info]
    if missing:
      raise ValueError(f"environment {self.env.name!r} step info lacks {missing}")
    if out.obs_A.shape != (B, self.env.max_obs_len):
      raise ValueError(f"environment {self.env.name!r} returns obs_A of shape "
                       f"{out.obs_A.shape[1:]}, expected ({self.env.max_obs_len},)")
    return out

  def _final_stop(self, state, stop_B, token_B):
    """No environment: a stop token ends the episode."""
    del token_B
    return state.replace(done_B=state.done_B | stop_B,
                         num_actions_B=state.num_actions_B + stop_B)

  def _env_stop(self, state, stop_B, token_B):
    return jax.lax.cond(jnp.any(stop_B), self._env_step,
                        lambda s, *_: s, state, stop_B, token_B)

  def _env_step(self, state, stop_B, token_B):
    """Steps the environment for the rows in ``stop_B`` (others unchanged)."""
    ids, T = self.ids, self.max_len
    B, A = state.tokens_BxT.shape[0], self.env.max_action_len
    rows_Bx1 = jnp.arange(B)[:, None]
    seg_len = state.seg_len_B
    start_B = state.cur_B + 1 - seg_len
    offs_A = jnp.arange(A)
    action_BxA = jnp.where(
        offs_A < seg_len[:, None],
        state.tokens_BxT[rows_Bx1, jnp.clip(start_B[:, None] + offs_A, 0, T - 1)],
        ids.pad)
    env_state, out = jax.vmap(self.env.step)(state.env_state, action_BxA, seg_len)
    env_state = select_rows(stop_B, env_state, state.env_state)

    stopped = lambda x: jnp.where(stop_B, x, 0)
    num_actions = state.num_actions_B + stop_B
    at_step = (jnp.arange(B), state.num_actions_B)
    call_hashes = state.call_hashes_BxC.at[at_step].set(
        jnp.where(stop_B, out.info["call_hash"].astype(jnp.int32), -1),
        mode="drop")
    turn_rewards = state.turn_rewards_BxC.at[at_step].add(
        stopped(out.reward.astype(jnp.float32)), mode="drop")
    final = jnp.isin(token_B, jnp.asarray(ids.final_ids))
    ends_done = stop_B & (out.done | (final & ~out.truncated))
    ends_trunc = stop_B & ~ends_done & (
        out.truncated | (num_actions >= self.sampling.max_turns))
    framed_BxQ, framed_len = frame_observation(out.obs_A, out.obs_len, ids)
    # The observation and at least one more policy token must fit.
    fits = state.cur_B + framed_len + 1 <= T - 1
    cont = stop_B & ~ends_done & ~ends_trunc
    ends_trunc |= cont & ~fits
    cont &= fits
    return state.replace(
        env_state=env_state,
        reward_B=state.reward_B + stopped(out.reward),
        reward_components={
            k: v + stopped(out.reward_components[k].astype(jnp.float32))
            for k, v in state.reward_components.items()},
        num_actions_B=num_actions,
        call_hashes_BxC=call_hashes,
        turn_rewards_BxC=turn_rewards,
        num_tool_calls_B=state.num_tool_calls_B
        + (stop_B & (token_B == ids.tool_call_close)),
        num_tool_errors_B=state.num_tool_errors_B
        + (stop_B & (out.info["tool_error"] != 0)),
        # The environment's own running total, where it reports one.
        env_seconds_B=jnp.where(stop_B, out.info["env_seconds"].astype(jnp.float32),
                                state.env_seconds_B)
        if "env_seconds" in out.info else state.env_seconds_B,
        done_B=state.done_B | ends_done,
        truncated_B=state.truncated_B | ends_trunc,
        seg_len_B=jnp.where(stop_B, 0, seg_len),
        queue_BxQ=jnp.where(cont[:, None], framed_BxQ, state.queue_BxQ),
        queue_len_B=jnp.where(cont, framed_len, state.queue_len_B),
        queue_pos_B=jnp.where(cont, 0, state.queue_pos_B))


_STATIC_ARGNAMES = {"_rollout": ("prefill_len", "shared_len"), "_init_state": (),
                    "_advance": ("prefill_len",)}


@functools.cache
def _jitted(method: str, options: tuple | None):
  """``jax.jit`` of the engine's ``method`` with the engine as static argument
  0, one per set of compiler options (``model.compiler_options``)."""
  return jax.jit(getattr(RolloutEngine, method), static_argnums=0,
                 static_argnames=_STATIC_ARGNAMES[method],
                 compiler_options=dict(options) if options else None)


def prompt_group_size(ids_B) -> int:
  """The largest G such that ``ids_B`` is runs of G equal ids (rows
  ``p * G .. p * G + G - 1`` share id ``ids_B[p * G]``): the gcd of the
  lengths of its runs of equal ids. A batch of ``B`` rows whose prompts are
  ``ids_B`` is then an engine batch of ``B / G`` prompts with group size G
  (:meth:`RolloutEngine.rollout` prefills each once). 1 for no ids."""
  ids = np.asarray(ids_B).reshape(-1)
  if ids.size == 0:
    return 1
  starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1], [True]]))
  return math.gcd(*np.diff(starts).tolist())


def new_state(prompts_BxL, prompt_len_B, key, *, max_len: int, max_turns: int,
              pad_id: int, queue_width: int, script_BxS, script_len_B,
              reward_components: dict[str, jax.Array],
              env_state: PyTree) -> RolloutState:
  """A :class:`RolloutState` with the prompts written and nothing generated."""
  B, L = prompts_BxL.shape
  T = max_len
  zeros_i = jnp.zeros((B,), jnp.int32)
  zeros_b = jnp.zeros((B,), bool)
  tokens = jnp.full((B, T), pad_id, jnp.int32).at[:, :L].set(prompts_BxL)
  tokens = jnp.where(jnp.arange(T) < prompt_len_B[:, None], tokens, pad_id)
  return RolloutState(
      tokens_BxT=tokens,
      loss_mask_BxT=jnp.zeros((B, T), jnp.float32),
      logp_BxT=jnp.zeros((B, T), jnp.float32),
      entropy_BxT=jnp.zeros((B, T), jnp.float32),
      turn_BxT=jnp.zeros((B, T), jnp.int32),
      version_BxT=jnp.full((B, T), -1, jnp.int32),
      prompt_len_B=prompt_len_B,
      cur_B=prompt_len_B - 1,
      seg_len_B=zeros_i,
      queue_BxQ=jnp.full((B, queue_width), pad_id, jnp.int32),
      queue_len_B=zeros_i,
      queue_pos_B=zeros_i,
      script_BxS=script_BxS,
      script_len_B=script_len_B,
      script_pos_B=zeros_i,
      num_actions_B=zeros_i,
      reward_B=jnp.zeros((B,), jnp.float32),
      reward_components=reward_components,
      done_B=zeros_b,
      truncated_B=zeros_b,
      awaiting_B=zeros_b,
      num_tool_calls_B=zeros_i,
      num_tool_errors_B=zeros_i,
      env_seconds_B=jnp.zeros((B,), jnp.float32),
      call_hashes_BxC=jnp.full((B, max_turns), -1, jnp.int32),
      turn_rewards_BxC=jnp.zeros((B, max_turns), jnp.float32),
      status_B=zeros_i,
      obs_clipped_B=zeros_i,
      key_B=jax.random.key_data(jax.random.split(key, B)),
      env_state=env_state)


def cache_sizes(start: int, max_len: int, segments: int) -> tuple[int, ...]:
  """The KV-cache lengths a decode loop grows through, ending at ``max_len``.

  Up to ``segments`` equal steps of at least ``MIN_CACHE_STEP`` slots
  (multiples of 8), skipping those not above ``start`` (the prefilled
  length). Static: each length is its own while loop.
  """
  step = max(MIN_CACHE_STEP, -(-max_len // segments))
  step = -(-step // 8) * 8
  sizes = [s for s in range(step, max_len, step) if s > start]
  return (*sizes, max_len)


def run_loop(params, state: RolloutState, cache: model_lib.KVCache, version,
             max_steps, *, model_config, sampling: SamplingConfig,
             ids: FormatIds | None, on_stop: OnStop, temperature=None,
             cache_segments: int = 1, prefix_cache: model_lib.KVCache | None = None,
             ) -> tuple[RolloutState, model_lib.KVCache]:
  """Runs the token loop until no row is live or ``max_steps`` steps ran.

  A row is live while its episode has not ended and it does not await a host
  environment. ``cache`` must hold every row's tokens up to ``cur``; with
  ``cache_segments > 1`` it grows (:func:`cache_sizes`) from its length to
  the row capacity T as the longest unfinished row reaches its end, so the
  attention reads about as many slots as the rows hold rather than all T
  (one while loop per length; the returned cache has T slots).
  ``temperature`` (a float32 scalar, may be traced) overrides
  ``sampling.temperature``.

  ``prefix_cache``: the rows' groups' shared cache of positions ``0 ..
  Lp-1`` (``model.decode_step``'s ``prefix``); ``cache`` then holds the
  positions from ``Lp`` on (and grows to ``T - Lp`` slots).

  ``params=None`` and ``cache=None`` run no model: for rows whose every
  policy token is scripted (demonstrations), which then record the
  log-probs and entropy of a uniform policy.
  """
  T = state.tokens_BxT.shape[1]
  if params is not None:
    params = model_lib.unstack_layers(params)
  # Every row's draw at every position, hashed once rather than per step.
  u_BxT = sampling_lib.position_uniforms(
      jax.random.wrap_key_data(state.key_B), jnp.arange(T))
  step = lambda s, c: _token_step(params, s, c, version, u_BxT,
                                  model_config=model_config, sampling=sampling,
                                  ids=ids, on_stop=on_stop,
                                  temperature=temperature, prefix_cache=prefix_cache)

  def body(carry):
    s, c, n = carry
    s, c = step(s, c)
    return s, c, n + 1

  n = jnp.int32(0)
  offset = 0 if prefix_cache is None else prefix_cache.max_len
  for size in ([T] if cache is None else cache_sizes(offset + cache.max_len, T, cache_segments)):
    if cache is not None:
      cache = model_lib.grow_cache(cache, size - offset)

    def cond(carry, size=size):
      s, _, n = carry
      # Every unfinished row writes slot cur, which must exist.
      fits = jnp.max(jnp.where(s.ended_B, -1, s.cur_B)) < size
      return (n < max_steps) & jnp.any(~s.ended_B & ~s.awaiting_B) & fits

    state, cache, n = jax.lax.while_loop(cond, body, (state, cache, n))
  return state, cache


def _token_step(params, state: RolloutState, cache, version, u_BxT, *,
                model_config, sampling: SamplingConfig, ids: FormatIds | None,
                on_stop: OnStop, temperature=None, prefix_cache=None):
  """One token for every live row (see the module docstring); ``u_BxT`` are
  the rows' draws by position (:func:`sampling.position_uniforms`)."""
  B, T = state.tokens_BxT.shape
  rows = jnp.arange(B)
  live = ~state.ended_B & ~state.awaiting_B
  cur = state.cur_B
  if params is None:  # scripted rows without a model (run_loop's docstring)
    logits_BxV = jnp.zeros((B, model_config.vocab_size), jnp.float32)
  else:
    logits_BxV, cache = model_lib.decode_step(
        params, state.tokens_BxT[rows, cur], cur, cache, model_config, prefix=prefix_cache)
  w = jnp.minimum(cur + 1, T - 1)

  logp_BxV = sampling_lib.sampling_log_probs(logits_BxV, sampling, temperature)
  drawn = sampling_lib.sample_from_uniforms(u_BxT[rows, w], logp_BxV)
  from_queue = state.queue_pos_B < state.queue_len_B
  from_script = ~from_queue & (state.script_pos_B < state.script_len_B)
  policy = ~from_queue
  S, Q = state.script_BxS.shape[1], state.queue_BxQ.shape[1]
  token = jnp.where(
      from_queue, state.queue_BxQ[rows, jnp.minimum(state.queue_pos_B, Q - 1)],
      jnp.where(from_script,
                state.script_BxS[rows, jnp.minimum(state.script_pos_B, S - 1)],
                drawn))
  tok_logp = jnp.take_along_axis(logp_BxV, token[:, None], axis=1)[:, 0]

  def write(buf_BxT, value_B):
    return buf_BxT.at[rows, w].set(jnp.where(live, value_B, buf_BxT[rows, w]))

  state = state.replace(
      tokens_BxT=write(state.tokens_BxT, token),
      loss_mask_BxT=write(state.loss_mask_BxT, policy.astype(jnp.float32)),
      logp_BxT=write(state.logp_BxT, jnp.where(policy, tok_logp, 0.0)),
      entropy_BxT=write(state.entropy_BxT,
                        jnp.where(policy, sampling_lib.entropy_of(logp_BxV), 0.0)),
      turn_BxT=write(state.turn_BxT,
                     state.num_actions_B + policy.astype(jnp.int32)),
      version_BxT=write(state.version_BxT, jnp.where(policy, version, -1)),
      cur_B=cur + live,
      queue_pos_B=state.queue_pos_B + (live & from_queue),
      script_pos_B=state.script_pos_B + (live & from_script),
      seg_len_B=state.seg_len_B + (live & policy))

  if ids is not None:
    stop = live & policy & jnp.isin(token, jnp.asarray(ids.stop_ids))
    state = on_stop(state, stop, token)
  else:
    stop = jnp.zeros_like(live)
  over_turn = (live & policy & ~stop
               & (state.seg_len_B >= sampling.max_new_tokens_per_turn))
  full = live & (state.cur_B >= T - 1)
  ending = (over_turn | full) & ~state.ended_B & ~state.awaiting_B
  return state.replace(truncated_B=state.truncated_B | ending), cache
