"""The learner step: one optimiser update over a (micro-batched) batch.

``make_train_step(loss_fn, optimizer, micro_batches)`` turns a per-batch loss
into a pure ``step(state, batch) -> (state, metrics)`` that

* splits the batch into ``micro_batches`` equal parts along the leading axis
  and accumulates gradients with ``lax.scan``. Losses aggregate with the whole
  batch's normalisers (``objectives.batch_normalisers``), so the accumulated
  gradient equals the full-batch gradient (see ``tests/test_learner.py``);
* skips the update when the loss or the gradient is not finite (the
  parameters and optimiser state stay as they were, ``train/skipped`` is 1);
* reports ``signal/grad_norm`` and the loss's own metrics.

The SFT and RL losses below share the model's one scoring path,
:func:`sequence_logprobs`, which the rollout engine's consistency check uses
too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from agentic_rl import objectives
from agentic_rl.model.scoring import sequence_logprobs

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]
LossFn = Callable[[Any, Batch, Mapping[str, jax.Array]], tuple[jax.Array, Metrics]]


@struct.dataclass
class TrainState:
  """Parameters, optimiser state and the number of updates applied."""

  params: Any
  opt_state: Any
  step: jax.Array  # int32 []: optimiser updates applied (the policy version)


def init_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
  return TrainState(params=params, opt_state=optimizer.init(params),
                    step=jnp.zeros((), jnp.int32))


def sft_loss(model_config, *, logprob_impl: str = "xla") -> LossFn:
  """Negative log-likelihood of the loss-masked (policy) tokens.

  ``loss = -sum(mask * log pi(y_t | y_<t)) / num_tokens`` with the whole
  batch's token count, so micro-batches sum to the full-batch loss.
  """

  def loss_fn(params, batch, norm):
    logp_BxT, _ = sequence_logprobs(
        params, batch["tokens_BxT"], model_config, impl=logprob_impl)
    mask = batch["loss_mask_BxT"]
    nll = -jnp.sum(logp_BxT * mask) / norm["num_tokens"]
    return nll, {"sft/nll": nll}

  return loss_fn


def rl_loss(model_config, objective: objectives.ObjectiveConfig, *,
            temperature: float = 1.0, logprob_impl: str = "xla",
            adaptive_entropy: bool = False, scheduled_temperature: bool = False) -> LossFn:
  """The configured policy loss on a rollout batch.

  ``batch`` holds ``tokens_BxT``, ``loss_mask_BxT``, ``advantages`` (``[B]``
  per sequence, or ``[B, T]`` per token as REBN's), ``old_logp_BxT`` (the
  learner's scores at the iteration's start) and
  ``behaviour_logp_BxT`` (the sampler's), plus ``ref_logp_BxT`` when a KL
  penalty is on. The exploration controllers' values arrive as data, so they
  change without recompiling: with ``adaptive_entropy`` the entropy-bonus
  coefficient is ``entropy_coef_B[0]``, with ``scheduled_temperature`` the
  sampling temperature is ``temperature_B[0]`` (float32 ``[B]``, one value
  repeated per row so the batch still splits into micro-batches).
  """
  loss = objectives.make_policy_loss(objective)

  def loss_fn(params, batch, norm):
    tau = batch["temperature_B"][0] if scheduled_temperature else temperature
    logp_BxT, entropy_BxT = sequence_logprobs(
        params, batch["tokens_BxT"], model_config, temperature=tau, impl=logprob_impl)
    # Shift controls arrive as per-token weights; weight 0 leaves the token out.
    extra = {"token_weights_BxT": batch["loss_mask_BxT"]}
    if objective.correction is not None:
      extra["behaviour_logp_BxT"] = batch["behaviour_logp_BxT"]
    if objective.kl_coef:
      extra["ref_logp_BxT"] = batch["ref_logp_BxT"]
    if adaptive_entropy:
      extra["entropy_coef"] = batch["entropy_coef_B"][0]
    if objective.entropy_coef or adaptive_entropy:
      extra["entropy_BxT"] = entropy_BxT
    return loss(logp_BxT, batch["old_logp_BxT"], batch["advantages"],
                batch["loss_mask_BxT"], num_tokens=norm["num_tokens"],
                num_seqs=norm["num_seqs"], **extra)

  return loss_fn


def _split(batch: Batch, micro_batches: int) -> Batch:
  def split(x):
    if x.shape[0] % micro_batches:
      raise ValueError(f"batch of {x.shape[0]} rows does not split into "
                       f"{micro_batches} micro-batches; make the batch a "
                       "multiple of config.micro_batches")
    return x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:])
  return jax.tree.map(split, batch)


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation,
                    *, micro_batches: int = 1):
  """A pure ``step(state, batch) -> (state, metrics)`` (jit it with shardings)."""
  if micro_batches < 1:
    raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    norm = objectives.batch_normalisers(batch["loss_mask_BxT"])
    if micro_batches == 1:
      (loss, metrics), grads = grad_fn(state.params, batch, norm)
    else:
      def body(acc, micro):
        return jax.tree.map(jnp.add, acc, grad_fn(state.params, micro, norm)), None

      micro = _split(batch, micro_batches)
      shapes = jax.eval_shape(grad_fn, state.params,
                              jax.tree.map(lambda x: x[0], micro), norm)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      ((loss, metrics), grads), _ = jax.lax.scan(body, zeros, micro)
      # Losses and gradients add up across micro-batches; metrics are means.
      metrics = jax.tree.map(lambda m: m / micro_batches, metrics)
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    grads = jax.tree.map(lambda g: jnp.where(ok, g, 0.0), grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    new_state = TrainState(params=keep(params, state.params),
                           opt_state=keep(opt_state, state.opt_state),
                           step=state.step + ok.astype(jnp.int32))
    metrics = dict(metrics, loss=loss, **{"signal/grad_norm": grad_norm,
                                          "train/skipped": 1.0 - ok.astype(jnp.float32)})
    return new_state, metrics

  return step


def shard_train_step(step, mesh, model_config, optimizer, params):
  """``jax.jit`` of ``step`` with explicit shardings over ``mesh``.

  Parameters follow the model's logical axes through the one rule table
  (``sharding.LOGICAL_RULES``), optimiser moments follow their parameters,
  batch arrays split along their leading axis over ``("data", "fsdp")``, and
  the train state is donated. Returns ``(jitted_step, state_sharding)``; put
  the state on the mesh with ``jax.device_put(state, state_sharding)``.
  """
  from agentic_rl import model as model_lib  # pylint: disable=g-import-not-at-top
  from agentic_rl.train import sharding  # pylint: disable=g-import-not-at-top
  params_sh = sharding.logical_to_sharding(model_lib.param_axes(model_config), mesh,
                                           shapes=params)
  state_sh = TrainState(
      params=params_sh,
      opt_state=sharding.opt_state_sharding(optimizer, params, params_sh, mesh),
      step=sharding.replicated(mesh))
  jitted = sharding.jit_sharded(
      step, mesh, in_shardings=(state_sh, sharding.batch_sharding(mesh)),
      out_shardings=(state_sh, sharding.replicated(mesh)), donate_argnums=(0,))
  return jitted, state_sh
