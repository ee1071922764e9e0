"""The learner step: one optimiser update over a (micro-batched) batch.

``make_train_step(loss_fn, optimizer, micro_batches)`` turns a per-batch loss
into a pure ``step(state, batch) -> (state, metrics, outputs)`` that

* splits the batch into ``micro_batches`` equal parts along the leading axis
  and accumulates gradients with ``lax.scan``. Losses aggregate with the whole
  batch's normalisers (``objectives.batch_normalisers``), so the accumulated
  gradient equals the full-batch gradient (see ``tests/test_learner.py``);
* skips the update when the loss or the gradient is not finite (the
  parameters and optimiser state stay as they were, ``learner/skipped`` is 1);
* reports ``learner/grad_norm``, ``learner/loss`` and the loss's own metrics,
  and returns the loss's per-row ``outputs`` (the RL loss: the log-probs and
  entropies of its forward, at the parameters before the update).

The SFT and RL losses below share the model's one scoring path,
:func:`sequence_logprobs`, which the rollout engine's consistency check uses
too. With a group size (``rl_loss(group_size=G)``, ``shard_train_step(...,
group_size=G)``) the RL step, its reference scores and the scoring pass run
the prefix that each group of G consecutive rows shares once
(:mod:`agentic_rl.model.prefix`): the step finds the shared length on the host
(:func:`shared_prefix_len`) and compiles once per length bucket.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

import numpy as np

from agentic_rl import objectives
from agentic_rl.model import lora
from agentic_rl.model import prefix
from agentic_rl.model.scoring import sequence_logprobs
from agentic_rl.model.transformer import forward

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]
# loss_fn(params, batch, norm) -> (loss, (metrics, outputs)); outputs hold
# per-row arrays ``[b, ...]`` (no gradient) that the step returns whole. The
# losses below also take ``layer_params_constraint=`` (the model forward's,
# passed on by the step where the layout needs it: :func:`shard_train_step`)
# and the RL loss ``prefix_len=`` (static; the step passes it when not 0).
LossFn = Callable[..., tuple[jax.Array, tuple[Metrics, Batch]]]


@struct.dataclass
class TrainState:
  """Parameters, optimiser state, the number of updates applied and, for a
  KL penalty, the frozen reference policy's parameters (else None)."""

  params: Any
  opt_state: Any
  step: jax.Array  # int32 []: optimiser updates applied (the policy version)
  ref_params: Any = None


def init_train_state(params, optimizer: optax.GradientTransformation,
                     ref_params: Any = None, restored: Mapping[str, Any] | None = None,
                     ) -> TrainState:
  """A fresh state, or the one of a checkpoint's ``restored`` tree (its
  ``opt_state`` leaves and ``step``; ``ref_params`` where ``ref_params`` is
  not None)."""
  if restored is None:
    return TrainState(params=params, opt_state=optimizer.init(params),
                      step=jnp.zeros((), jnp.int32), ref_params=ref_params)
  like = jax.tree.structure(jax.eval_shape(optimizer.init, params))
  return TrainState(params, jax.tree.unflatten(like, jax.tree.leaves(restored["opt_state"])),
                    jnp.asarray(restored["step"], jnp.int32),
                    restored.get("ref_params") if ref_params is not None else None)


def trainable(model_config) -> Callable[[Any], Any] | None:
  """:func:`make_train_step`'s ``trainable`` for the model: the LoRA adapters
  alone with ``lora_rank > 0`` (``lora.adapter_mask``), else None (all)."""
  return lora.adapter_mask if model_config.lora_rank else None


def sft_loss(model_config, *, logprob_impl: str = "xla") -> LossFn:
  """Negative log-likelihood of the loss-masked (policy) tokens.

  ``loss = -sum(mask * log pi(y_t | y_<t)) / num_tokens`` with the whole
  batch's token count, so micro-batches sum to the full-batch loss. A batch
  of packed rows (``codec.pack_rows``) also holds ``positions_BxT`` and
  ``segment_ids_BxT``.
  """

  def loss_fn(params, batch, norm, *, layer_params_constraint=None):
    logp_BxT, _ = sequence_logprobs(
        params, batch["tokens_BxT"], model_config, impl=logprob_impl,
        positions_BxT=batch.get("positions_BxT"),
        segment_ids_BxT=batch.get("segment_ids_BxT"),
        layer_params_constraint=layer_params_constraint)
    mask = batch["loss_mask_BxT"]
    nll = -jnp.sum(logp_BxT * mask) / norm["num_tokens"]
    return nll, ({"sft/nll": nll}, {})

  return loss_fn


# Where the policy loss's metrics go in the run's metrics. The loss's
# mismatch_* repeat the shift monitors (``shift/kl_behaviour_learner``, ...)
# and its entropy the forward's output (``learner/entropy`` in the trainer).
_LOSS_METRIC_NAMES = {"pg_loss": "learner/pg_loss", "is_ratio_mean": "learner/ratio_mean",
                      "is_ratio_max": "learner/ratio_max", "approx_kl": "learner/kl_old_new",
                      "kl_ref": "shift/kl_reference"}


def _metric_name(key: str) -> str | None:
  if key.startswith("mismatch_") or key == "entropy":
    return None
  return _LOSS_METRIC_NAMES.get(key, f"learner/{key}")


def rl_loss(model_config, objective: objectives.ObjectiveConfig, *,
            temperature: float = 1.0, logprob_impl: str = "xla",
            adaptive_entropy: bool = False, scheduled_temperature: bool = False,
            group_size: int = 1) -> LossFn:
  """The configured policy loss on a rollout batch.

  ``batch`` holds ``tokens_BxT``, ``loss_mask_BxT`` (the per-token loss
  weights), ``advantages`` (``[B]`` per sequence, or ``[B, T]`` per token as
  REBN's) and the inputs ``objectives.required_inputs(objective)`` names
  (``behaviour_logp_BxT``, ``ref_logp_BxT``). ``old_logp_BxT``, the learner's
  scores at the iteration's start, is optional: without it the proximal
  policy is this forward's own (stop-gradient) log-probs, exact for the first
  update of an iteration, so one update per batch needs no scoring pass. The
  exploration controllers' values arrive as data, so they change without
  recompiling: with ``adaptive_entropy`` the entropy-bonus coefficient is
  ``entropy_coef_B[0]``, with ``scheduled_temperature`` the sampling
  temperature is ``temperature_B[0]`` (float32 ``[B]``, one value repeated
  per row so the batch still splits into micro-batches).

  ``group_size`` G: with the loss's keyword ``prefix_len`` Lp > 0 (static),
  the batch's rows come in groups of G consecutive rows that agree on their
  first Lp tokens, and the forward runs each group's prefix once
  (``sequence_logprobs(group_size=G, prefix_len=Lp)``): the same loss and
  gradients to float rounding.

  Outputs: ``logp_BxT`` and ``entropy_BxT`` of the forward (float32).
  """
  loss = objectives.make_policy_loss(objective)
  needs = objectives.required_inputs(objective)

  def loss_fn(params, batch, norm, *, layer_params_constraint=None, prefix_len: int = 0):
    tau = batch["temperature_B"][0] if scheduled_temperature else temperature
    logp_BxT, entropy_BxT = sequence_logprobs(
        params, batch["tokens_BxT"], model_config, temperature=tau, impl=logprob_impl,
        layer_params_constraint=layer_params_constraint, group_size=group_size,
        prefix_len=prefix_len)
    old_logp_BxT = batch.get("old_logp_BxT", jax.lax.stop_gradient(logp_BxT))
    # Shift controls arrive as per-token weights; weight 0 leaves the token out.
    extra = {"token_weights_BxT": batch["loss_mask_BxT"]}
    extra.update({k: batch[k] for k in ("behaviour_logp_BxT", "ref_logp_BxT") if k in needs})
    if adaptive_entropy:
      extra["entropy_coef"] = batch["entropy_coef_B"][0]
    if "entropy_BxT" in needs or adaptive_entropy:
      extra["entropy_BxT"] = entropy_BxT
    value, metrics = loss(logp_BxT, old_logp_BxT, batch["advantages"],
                          batch["loss_mask_BxT"], num_tokens=norm["num_tokens"],
                          num_seqs=norm["num_seqs"], **extra)
    metrics = {name: v for k, v in metrics.items() if (name := _metric_name(k))}
    outputs = {"logp_BxT": jax.lax.stop_gradient(logp_BxT),
               "entropy_BxT": jax.lax.stop_gradient(entropy_BxT)}
    return value, (metrics, outputs)

  return loss_fn


def distill_loss(model_config) -> LossFn:
  """On-policy distillation (:mod:`agentic_rl.objectives.distill`): the
  per-token reverse KL from the policy to each row's teacher, over the whole
  vocabulary, at temperature 1 (the models' own distributions; the sampling
  temperature only chooses which contexts are visited).

  ``batch`` holds ``tokens_BxT``, ``loss_mask_BxT`` (the per-token weights)
  and ``teacher_B`` (int ``[B]``: which teacher scores the row). The loss's
  keyword ``reference`` is the list of the teachers' parameters (the train
  state's ``ref_params``, :func:`make_train_step` with
  ``reference_in_loss``), each taken without gradient. Every teacher runs on
  every row and each row keeps its own teacher's logits: F forwards for F
  teachers.
  """

  def loss_fn(params, batch, norm, *, reference, layer_params_constraint=None):
    kw = dict(layer_params_constraint=layer_params_constraint)
    tokens_BxT = batch["tokens_BxT"]
    student_BxTxV = forward(params, tokens_BxT, model_config, **kw)
    teacher_BxTxV = None
    for f, teacher_params in enumerate(reference):
      logits_BxTxV = forward(jax.lax.stop_gradient(teacher_params), tokens_BxT,
                             model_config, **kw)
      teacher_BxTxV = logits_BxTxV if teacher_BxTxV is None else jnp.where(
          (batch["teacher_B"] == f)[:, None, None], logits_BxTxV, teacher_BxTxV)
    loss, metrics = objectives.distill.reverse_kl(
        student_BxTxV, teacher_BxTxV, tokens_BxT, batch["loss_mask_BxT"],
        norm["num_tokens"])
    return loss, ({f"distill/{k}": v for k, v in metrics.items()}, {})

  return loss_fn


def reference_inputs(model_config, *, temperature: float = 1.0, logprob_impl: str = "xla",
                     scheduled_temperature: bool = False, group_size: int = 1):
  """``prepare(state, batch) -> batch`` adding ``ref_logp_BxT``: the frozen
  reference policy (``state.ref_params``) scored on the batch, without
  gradient, inside the learner step (the same pass as the update's forward);
  with ``prefix_len`` > 0, each group of ``group_size`` rows' prefix once,
  as :func:`rl_loss`."""

  def prepare(state: TrainState, batch: Batch, *, layer_params_constraint=None,
              prefix_len: int = 0) -> Batch:
    if "ref_logp_BxT" in batch:
      return batch
    tau = batch["temperature_B"][0] if scheduled_temperature else temperature
    ref_logp_BxT, _ = sequence_logprobs(jax.lax.stop_gradient(state.ref_params),
                                        batch["tokens_BxT"], model_config, temperature=tau,
                                        impl=logprob_impl,
                                        layer_params_constraint=layer_params_constraint,
                                        group_size=group_size, prefix_len=prefix_len)
    return dict(batch, ref_logp_BxT=ref_logp_BxT)

  return prepare


def _split(batch: Batch, micro_batches: int) -> Batch:
  def split(x):
    if x.shape[0] % micro_batches:
      raise ValueError(f"batch of {x.shape[0]} rows does not split into "
                       f"{micro_batches} micro-batches; make the batch a "
                       "multiple of config.micro_batches")
    return x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:])
  return jax.tree.map(split, batch)


def _combine_micro(name: str, values_M: jax.Array) -> jax.Array:
  """One metric of the whole batch from its micro-batches' values ``[M]``.

  Losses are aggregated with the whole batch's normalisers, so they add up
  (``*loss``, ``*/nll``); maxima take the maximum; every other metric (a
  masked mean of its micro-batch) is averaged, exact for equal token counts.
  """
  if name.endswith(("loss", "/nll")):
    return values_M.sum(0)
  if name.endswith("_max"):
    return values_M.max(0)
  return values_M.mean(0)


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation,
                    *, micro_batches: int = 1,
                    prepare: Callable[[TrainState, Batch], Batch] | None = None,
                    trainable: Callable[[Any], Any] | None = None,
                    reference_in_loss: bool = False):
  """A pure ``step(state, batch) -> (state, metrics, outputs)`` (jit it with
  shardings). ``prepare(state, batch)`` first adds inputs computed without
  gradient from the state (:func:`reference_inputs`). The step's keywords
  ``layer_params_constraint`` (default None) and ``prefix_len`` (static,
  default 0) go on to ``loss_fn`` and ``prepare`` when given
  (:func:`shard_train_step` gives the first on FSDP, the second with a group
  size); a micro-batch then holds whole groups (``config.micro_batches``
  divides the number of groups).

  ``trainable(params)`` (None: every parameter) is a tree of bools over the
  parameters, e.g. ``lora.adapter_mask``: the loss sees the others through
  ``stop_gradient`` (no gradient is computed for them), their gradients are
  ``optax.MaskedNode``s (so ``optimizer`` must be masked alike:
  ``lora.freeze_base``) and the update leaves them as they are, bit for bit.

  ``reference_in_loss``: the loss also gets ``reference=state.ref_params``
  (:func:`distill_loss`'s teachers).
  """
  if micro_batches < 1:
    raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(state: TrainState, batch: Batch, *, layer_params_constraint=None,
           prefix_len: int = 0) -> tuple[TrainState, Metrics, Batch]:
    model_kw = ({} if layer_params_constraint is None
                else {"layer_params_constraint": layer_params_constraint})
    if prefix_len:
      model_kw["prefix_len"] = prefix_len
    loss_kw = dict(model_kw, reference=state.ref_params) if reference_in_loss else model_kw
    mask = None if trainable is None else trainable(state.params)

    def grads_of(params, batch, norm):
      if mask is None:
        return grad_fn(params, batch, norm, **loss_kw)
      frozen = jax.tree.map(lambda m, p: p if m else jax.lax.stop_gradient(p), mask, params)
      value, grads = grad_fn(frozen, batch, norm, **loss_kw)
      return value, jax.tree.map(lambda m, g: g if m else optax.MaskedNode(), mask, grads)

    if prepare is not None:
      batch = prepare(state, batch, **model_kw)
    norm = objectives.batch_normalisers(batch["loss_mask_BxT"])
    if micro_batches == 1:
      (loss, (metrics, outputs)), grads = grads_of(state.params, batch, norm)
    else:
      def body(acc, micro):
        (loss, (metrics, outputs)), grads = grads_of(state.params, micro, norm)
        acc = jax.tree.map(jnp.add, acc, (loss, grads))
        return acc, (metrics, outputs)

      micro = _split(batch, micro_batches)
      _, grads_shape = jax.eval_shape(grads_of, state.params,
                                      jax.tree.map(lambda x: x[0], micro), norm)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           (jax.ShapeDtypeStruct((), jnp.float32), grads_shape))
      (loss, grads), (metrics_M, outputs) = jax.lax.scan(body, zeros, micro)
      outputs = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), outputs)
      metrics = {k: _combine_micro(k, v) for k, v in metrics_M.items()}
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(args):
      grads, opt_state, params = args
      updates, opt_state = optimizer.update(grads, opt_state, params)
      if mask is None:
        return optax.apply_updates(params, updates), opt_state
      return jax.tree.map(lambda m, p, u: optax.apply_updates(p, u) if m else p,
                          mask, params, updates), opt_state

    # A conditional, not jnp.where(ok, new, old) on every leaf: that select
    # reads the old optimiser moments after the update wrote the new ones in
    # place, so XLA:CPU copies all of them first (BENCHMARKS.md).
    params, opt_state = jax.lax.cond(ok, update, lambda args: (args[2], args[1]),
                                     (grads, state.opt_state, state.params))
    new_state = state.replace(params=params, opt_state=opt_state,
                              step=state.step + ok.astype(jnp.int32))
    metrics = dict(metrics, **{"learner/loss": loss, "learner/grad_norm": grad_norm,
                               "learner/skipped": 1.0 - ok.astype(jnp.float32)})
    return new_state, metrics, outputs

  return step


def params_sharding(mesh, model_config, params):
  """The parameters' shardings: the model's logical axes through the one rule
  table (``sharding.LOGICAL_RULES``)."""
  from agentic_rl import model as model_lib  # pylint: disable=g-import-not-at-top
  from agentic_rl.train import sharding  # pylint: disable=g-import-not-at-top
  return sharding.logical_to_sharding(model_lib.param_axes(model_config), mesh, shapes=params)


def gathered_params(params_sh):
  """How a step computes with parameters stored in ``params_sh`` (from
  :func:`params_sharding`): ``(gather, model_kw)``.

  ``gather(params)`` (None passes through) constrains the parameters outside
  ``layers`` to their gathered layout (``sharding.gathered``: without the
  mesh axes that split the batch). ``model_kw`` is ``{}``, or, where a
  layer's weights are split over a batch axis (FSDP),
  ``{"layer_params_constraint": c}`` for the model's forward, ``c`` gathering
  one layer's weights: each layer's are gathered where it uses them, not all
  at once before the first layer.

  Left to XLA's sharding propagation, an ``embed`` dimension split over the
  axis that also splits the batch wins over the batch: the activations
  split over ``embed``, every device runs the whole batch, the batch is
  all-gathered and every projection's partial sums all-reduced, in each
  layer of the forward and the backward.
  """
  from agentic_rl.train import sharding  # pylint: disable=g-import-not-at-top
  compute_sh = sharding.gathered(params_sh)
  model_kw = {}
  if compute_sh["layers"] != params_sh["layers"]:
    # One layer's weights: the stacked weights' shardings less the layers axis.
    layer_sh = jax.tree.map(
        lambda s: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:])),
        compute_sh["layers"])
    model_kw["layer_params_constraint"] = functools.partial(
        jax.lax.with_sharding_constraint, shardings=layer_sh)
    compute_sh = dict(compute_sh, layers=params_sh["layers"])

  def gather(params):
    return params if params is None else jax.lax.with_sharding_constraint(params, compute_sh)

  return gather, model_kw


def shared_prefix_len(tokens_BxT, group_size: int) -> int:
  """The static ``prefix_len`` of a batch: the length on which every group of
  ``group_size`` consecutive rows agrees, rounded down to a bucket
  (:func:`agentic_rl.model.prefix.shared_prefix_len`); 0 (no sharing) where
  ``group_size`` is 1 or does not divide the rows. ``tokens_BxT`` is a host
  or (global) device array, read on every process (a collective where it
  spans processes)."""
  from agentic_rl.train import sharding  # pylint: disable=g-import-not-at-top
  if group_size <= 1:
    return 0
  tokens = sharding.to_host(tokens_BxT)
  if np.shape(tokens)[0] % group_size:
    return 0
  return prefix.shared_prefix_len(tokens, group_size)


def used_length(mask_BxT, *, minimum: int = 128) -> int:
  """The positions a batch needs: one past the last position any row of
  ``mask_BxT`` (host ``[B, T]``) weighs, rounded up to the next of
  ``minimum * {1, 1.5, 2, 3, 4, 6, ...}`` (a bucket: one compiled step per
  length; waste under a half), at most T. The model is causal, so the
  positions after it change no loss, gradient or weighted metric."""
  T = np.shape(mask_BxT)[1]
  weighted = np.flatnonzero(np.asarray(mask_BxT).any(axis=0))
  n = int(weighted[-1]) + 1 if weighted.size else 1
  bucket = minimum
  while bucket < n:
    bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
  return min(bucket, T)


def trim_time(batch: Mapping[str, Any], length: int) -> dict[str, Any]:
  """``batch`` with every per-token array (``[B, T, ...]``, T the width of
  ``tokens_BxT``: per-token advantages too) cut to its first ``length``
  positions."""
  T = batch["tokens_BxT"].shape[1]
  return {k: v[:, :length] if np.ndim(v) >= 2 and np.shape(v)[1] == T else v
          for k, v in batch.items()}


def pad_time(x_BxL, length: int):
  """``x_BxL`` (host) zero-padded along axis 1 to ``length`` positions:
  a :func:`trim_time` batch's per-token outputs back at the batch's width."""
  x_BxL = np.asarray(x_BxL)
  return np.pad(x_BxL, [(0, 0), (0, length - x_BxL.shape[1])] + [(0, 0)] * (x_BxL.ndim - 2))


def _per_prefix_len(jit_for: Callable[[int], Any], group_size: int,
                    tokens_of: Callable[..., Any]):
  """A callable that runs ``jit_for(prefix_len)`` (built once per length) on
  its arguments, with the batch's :func:`shared_prefix_len` (computed once
  per tokens array: the updates of one batch reuse it); ``jit_for(0)`` alone
  when ``group_size`` is 1."""
  if group_size <= 1:
    return jit_for(0)
  jitted: dict[int, Any] = {}
  last: list[Any] = [None, 0]

  def for_args(args):
    tokens = tokens_of(*args)
    if last[0] is not tokens:
      last[:] = [tokens, shared_prefix_len(tokens, group_size)]
    if last[1] not in jitted:
      jitted[last[1]] = jit_for(last[1])
    return jitted[last[1]]

  def call(*args):
    return for_args(args)(*args)

  call.lower = lambda *args: for_args(args).lower(*args)
  return call


def shard_train_step(step, mesh, model_config, optimizer, params, *,
                     with_reference: bool = False, group_size: int = 1, teachers: int = 0):
  """``jax.jit`` of ``step`` with explicit shardings over ``mesh``.

  ``step`` is :func:`make_train_step`'s. Parameters (and the reference
  policy's, ``with_reference``) follow :func:`params_sharding`, optimiser
  moments follow their parameters, batch arrays and outputs split along
  their leading axis over ``("data", "fsdp")``, and the train state is
  donated. Parameters split over ``fsdp`` are gathered for the forward and
  backward (:func:`gathered_params`): the embedding, unembedding and final
  norm when the step starts, each layer's weights where the layer uses them
  (ZeRO-3); the activations then split over the batch as on the
  data-parallel layout. Returns ``(jitted_step, state_sharding)``; put the
  state on the mesh with ``jax.device_put(state, state_sharding)``. With
  ``teachers`` F > 0 the state's ``ref_params`` is a list of F parameter
  trees of the model (:func:`distill_loss`), each laid out as the policy.

  With ``group_size`` G > 1, ``jitted_step(state, batch)`` reads the batch's
  tokens on the host, finds the prefix its groups of G rows share
  (:func:`shared_prefix_len`) and runs ``step`` with it as the static
  ``prefix_len``: one jit per length bucket, the plain step for 0.
  """
  from agentic_rl.train import sharding  # pylint: disable=g-import-not-at-top
  params_sh = params_sharding(mesh, model_config, params)
  state_sh = TrainState(
      params=params_sh,
      opt_state=sharding.opt_state_sharding(optimizer, params, params_sh, mesh),
      step=sharding.replicated(mesh),
      ref_params=[params_sh] * teachers if teachers else params_sh if with_reference else None)
  gather, model_kw = gathered_params(params_sh)

  def gather_reference(ref):
    return [gather(t) for t in ref] if teachers else gather(ref)

  def jit_for(prefix_len: int):
    shared = {"prefix_len": prefix_len} if prefix_len else {}

    @functools.wraps(step)
    def gathered_step(state: TrainState, batch: Batch):
      return step(state.replace(params=gather(state.params),
                                ref_params=gather_reference(state.ref_params)), batch,
                  **model_kw, **shared)

    return sharding.jit_sharded(
        gathered_step, mesh, in_shardings=(state_sh, sharding.batch_sharding(mesh)),
        out_shardings=(state_sh, sharding.replicated(mesh), sharding.batch_sharding(mesh)),
        donate_argnums=(0,), compute_dtype=model_config.compute_dtype)

  jitted = _per_prefix_len(jit_for, group_size, lambda state, batch: batch["tokens_BxT"])
  return jitted, state_sh


def shard_score(mesh, model_config, params, *, temperature: float = 1.0,
                logprob_impl: str = "xla", scheduled_temperature: bool = False,
                with_reference: bool = False, group_size: int = 1):
  """The learner's scoring pass, jitted over ``mesh``: ``score(params,
  ref_params, tokens_BxT, tau) -> {"old_logp_BxT", ["ref_logp_BxT"]}``, float32
  ``[B, T]`` split over the batch axes as the train step takes them.

  The old log-probs (and the reference policy's, ``with_reference``) of one
  batch in one call; ``tau`` is used when ``scheduled_temperature``. With
  ``group_size`` G > 1, each group's shared prefix runs once, as in
  :func:`shard_train_step`.
  """
  from agentic_rl.train import sharding  # pylint: disable=g-import-not-at-top
  params_sh = params_sharding(mesh, model_config, params)
  gather, model_kw = gathered_params(params_sh)  # as the train step (shard_train_step)

  def jit_for(prefix_len: int):
    def score(params, ref_params, tokens_BxT, tau):
      t = tau if scheduled_temperature else temperature
      kw = dict(temperature=t, impl=logprob_impl, group_size=group_size,
                prefix_len=prefix_len, **model_kw)
      out = {"old_logp_BxT": sequence_logprobs(gather(params), tokens_BxT, model_config,
                                               **kw)[0]}
      if with_reference:
        out["ref_logp_BxT"] = sequence_logprobs(gather(ref_params), tokens_BxT,
                                                model_config, **kw)[0]
      return out

    return sharding.jit_sharded(
        score, mesh, in_shardings=(params_sh, params_sh if with_reference else None,
                                   sharding.batch_sharding(mesh), sharding.replicated(mesh)),
        out_shardings=sharding.batch_sharding(mesh), compute_dtype=model_config.compute_dtype)

  return _per_prefix_len(jit_for, group_size, lambda p, r, tokens_BxT, tau: tokens_BxT)
