"""Teacher-forced scoring: each token's log-prob and each position's entropy.

The one scoring path: the learner's losses, its ``old_logp`` recompute and the
rollout engine's train/inference consistency check all call
:func:`sequence_logprobs`, so sampling and learning run the same model code.
Given a group size and a shared prefix length, it runs each group's prefix
once (:mod:`agentic_rl.model.prefix`) and returns the same values to float
rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentic_rl import kernels
from agentic_rl.kernels import backends
from agentic_rl.model import prefix
from agentic_rl.model.config import TransformerConfig
from agentic_rl.model.transformer import forward, unembedding


def sequence_logprobs(params, tokens_BxT: jax.Array, config: TransformerConfig, *,
                      temperature: float | jax.Array = 1.0, impl: str = "xla",
                      layer_params_constraint=None, group_size: int = 1,
                      prefix_len: int = 0, positions_BxT: jax.Array | None = None,
                      segment_ids_BxT: jax.Array | None = None
                      ) -> tuple[jax.Array, jax.Array]:
  """``log pi(tokens[t] | tokens[:t])`` and the entropy of that distribution.

  ``pi = softmax(softcap(h_{t-1} @ W) / temperature)``, computed from the
  final hidden states with the fused ``kernels.token_logprobs`` op, so
  ``[B, T, V]`` logits are never needed (inside ``jit`` the unused logits of
  ``forward`` are dropped). ``impl`` is a ``logprob_impl``: ``"auto"``,
  ``"xla"``, ``"xla_chunked"``, ``"triton"``, ``"mosaic_tpu"`` or
  ``"pallas"`` (:mod:`agentic_rl.kernels.backends`, which resolves it for the
  platform being lowered for).

  ``temperature`` is a Python float (static), or a float scalar array (may be
  traced, for a temperature schedule that must not recompile): then the
  hidden states are divided by it, ``(h / tau) @ W = (h @ W) / tau``, which
  is exact only without a logit soft-cap.

  ``layer_params_constraint``: :func:`forward`'s (applied to each layer's
  weights where the layer uses them).

  ``group_size`` G and ``prefix_len`` Lp (static Python ints): with
  ``Lp > 0`` the rows come in groups of G consecutive rows that agree on
  their first Lp tokens (:func:`prefix.shared_prefix_len` finds an Lp that
  holds), and each group's prefix runs once (:func:`prefix.forward_hidden`):
  the log-probs of positions ``1 .. Lp-1`` are computed once per group, those
  of ``Lp .. T-1`` per row from the prefix's last state and the row's suffix.
  The same values to float rounding, gradients included; ``Lp = 0`` is the
  plain forward.

  ``positions_BxT``, ``segment_ids_BxT``: :func:`forward`'s, for rows that
  pack several sequences (``codec.pack_rows``); not with ``prefix_len``.

  Returns:
    float32 ``(logp_BxT, entropy_BxT)``; entry 0 (no prefix) is 0 in both.
  """
  tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
  B, T = tokens_BxT.shape
  if not isinstance(temperature, (int, float)) and config.final_logit_softcap is not None:
    raise ValueError("an array temperature needs final_logit_softcap=None (the soft-cap "
                     "comes before the temperature); pass a Python float")

  def scaled(hidden):  # an array temperature divides the hidden states
    if isinstance(temperature, (int, float)):
      return hidden
    return hidden / jnp.asarray(temperature, hidden.dtype)

  def logprobs(hidden_NxD, targets_N):
    return kernels.token_logprobs(
        scaled(hidden_NxD), unembedding(params, config), targets_N,
        temperature=temperature if isinstance(temperature, (int, float)) else 1.0,
        softcap=config.final_logit_softcap,
        **backends.logprob_kwargs(backends.resolve(backends.LOGPROBS, impl)))

  if prefix_len:
    if positions_BxT is not None or segment_ids_BxT is not None:
      raise ValueError("prefix_len shares each group's prompt, and packed rows "
                       "(positions_BxT, segment_ids_BxT) have none to share")
    return _shared_prefix_logprobs(params, tokens_BxT, config, logprobs, group_size,
                                   prefix_len, layer_params_constraint)
  _, hidden_BxTxD = forward(params, tokens_BxT, config, return_hidden=True,
                            positions_BxT=positions_BxT, segment_ids_BxT=segment_ids_BxT,
                            layer_params_constraint=layer_params_constraint)
  D = hidden_BxTxD.shape[-1]
  logp_N, entropy_N = logprobs(hidden_BxTxD[:, :-1].reshape(-1, D),
                               tokens_BxT[:, 1:].reshape(-1))
  pad = lambda x: jnp.pad(x.reshape(B, T - 1), ((0, 0), (1, 0)))  # noqa: E731
  return pad(logp_N), pad(entropy_N)


def _shared_prefix_logprobs(params, tokens_BxT, config, logprobs, group_size: int,
                            prefix_len: int, layer_params_constraint):
  """:func:`sequence_logprobs` with each group's prefix run once.

  Targets ``1 .. Lp-1`` are read from the prefix's states ``[P, Lp-1]`` and
  repeated over the group's G rows; targets ``Lp .. T-1`` from the prefix's
  last state (repeated) followed by the row's suffix states
  ``[B, S-1]``. One ``token_logprobs`` call over both.
  """
  B, T = tokens_BxT.shape
  G, Lp = group_size, prefix_len
  hidden_PxLpxD, hidden_BxSxD = prefix.forward_hidden(
      params, tokens_BxT, config, group_size=G, prefix_len=Lp,
      layer_params_constraint=layer_params_constraint)
  P, D, S = B // G, hidden_BxSxD.shape[-1], T - Lp
  prefix_targets_N = tokens_BxT.reshape(P, G, T)[:, 0, 1:Lp].reshape(-1)
  last_Bx1xD = jnp.repeat(hidden_PxLpxD[:, Lp - 1:], G, axis=0)
  suffix_hidden_BxSxD = jnp.concatenate([last_Bx1xD, hidden_BxSxD[:, :-1]], axis=1)
  n = P * (Lp - 1)
  hidden_NxD = jnp.concatenate([hidden_PxLpxD[:, :Lp - 1].reshape(n, D),
                                suffix_hidden_BxSxD.reshape(B * S, D)])
  targets_N = jnp.concatenate([prefix_targets_N, tokens_BxT[:, Lp:].reshape(-1)])
  outs = logprobs(hidden_NxD, targets_N)

  def rows(x_N):
    prefix_BxLpm1 = jnp.broadcast_to(x_N[:n].reshape(P, 1, Lp - 1),
                                     (P, G, Lp - 1)).reshape(B, Lp - 1)
    return jnp.concatenate([jnp.zeros((B, 1), x_N.dtype), prefix_BxLpm1,
                            x_N[n:].reshape(B, S)], axis=1)

  return tuple(rows(x) for x in outs)
