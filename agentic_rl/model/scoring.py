"""Teacher-forced scoring: each token's log-prob and each position's entropy.

The one scoring path: the learner's losses, its ``old_logp`` recompute and the
rollout engine's train/inference consistency check all call
:func:`sequence_logprobs`, so sampling and learning run the same model code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentic_rl import kernels
from agentic_rl.kernels import backends
from agentic_rl.model.config import TransformerConfig
from agentic_rl.model.transformer import forward, unembedding


def sequence_logprobs(params, tokens_BxT: jax.Array, config: TransformerConfig, *,
                      temperature: float | jax.Array = 1.0, impl: str = "xla",
                      layer_params_constraint=None) -> tuple[jax.Array, jax.Array]:
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

  Returns:
    float32 ``(logp_BxT, entropy_BxT)``; entry 0 (no prefix) is 0 in both.
  """
  tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
  B, T = tokens_BxT.shape
  _, hidden_BxTxD = forward(params, tokens_BxT, config, return_hidden=True,
                            layer_params_constraint=layer_params_constraint)
  D = hidden_BxTxD.shape[-1]
  if not isinstance(temperature, (int, float)):
    if config.final_logit_softcap is not None:
      raise ValueError("an array temperature needs final_logit_softcap=None (the soft-cap "
                       "comes before the temperature); pass a Python float")
    hidden_BxTxD = hidden_BxTxD / jnp.asarray(temperature, hidden_BxTxD.dtype)
    temperature = 1.0
  logp_N, entropy_N = kernels.token_logprobs(
      hidden_BxTxD[:, :-1].reshape(-1, D), unembedding(params, config),
      tokens_BxT[:, 1:].reshape(-1), temperature=temperature,
      softcap=config.final_logit_softcap,
      **backends.logprob_kwargs(backends.resolve(backends.LOGPROBS, impl)))
  pad = lambda x: jnp.pad(x.reshape(B, T - 1), ((0, 0), (1, 0)))  # noqa: E731
  return pad(logp_N), pad(entropy_N)
