"""Train-inference consistency: the learner's recompute of behaviour log-probs.

The rollout engine samples through ``model.decode_step`` and records each
policy token's log-prob under the sampling distribution; the learner scores
the same tokens teacher-forced with ``model.scoring.sequence_logprobs``. Both
run the same model code, so at temperature 1 without truncation they agree
to fp32 rounding. ``invariants.shift.mismatch_metrics``
reports how far apart they are: the I3 train/inference mismatch monitor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentic_rl import model as model_lib
from agentic_rl.model import scoring
from agentic_rl.rollout import sampling as sampling_lib
from agentic_rl.rollout.sampling import SamplingConfig


def learner_logprobs(params, tokens_BxT: jax.Array, model_config,
                     sampling: SamplingConfig, *,
                     logprob_impl: str = "xla") -> jax.Array:
  """Teacher-forced log-prob of every token given its prefix.

  Untruncated sampling (temperature only) is scored by the learner's own
  path, ``model.scoring.sequence_logprobs`` (``forward`` hidden states and the
  fused ``kernels.token_logprobs`` op). With top-k/top-p/greedy the log-probs
  are those of the same truncated distribution the sampler used
  (:func:`sampling_log_probs` on the learner's logits); tokens outside it get
  ``-inf``.

  Args:
    params: policy parameters.
    tokens_BxT: int32 token ids.
    model_config: the policy's config.
    sampling: the sampling settings the tokens were drawn with.
    logprob_impl: a ``logprob_impl`` (:mod:`agentic_rl.kernels.backends`:
      "auto", "xla", "xla_chunked", "triton", ...); unused for truncated
      sampling.
  Returns:
    float32 ``[B, T]``: entry t is ``log pi(tokens[t] | tokens[:t])``; entry
    0 (no prefix) is 0.
  """
  tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
  if not sampling.truncated:
    logp_BxT, _ = scoring.sequence_logprobs(
        params, tokens_BxT, model_config, temperature=sampling.temperature,
        impl=logprob_impl)
    return logp_BxT
  logits_BxTxV = model_lib.forward(params, tokens_BxT, model_config)
  logp_BxT1xV = sampling_lib.sampling_log_probs(logits_BxTxV[:, :-1], sampling)
  logp_BxT1 = jnp.take_along_axis(logp_BxT1xV, tokens_BxT[:, 1:, None],
                                  axis=-1)[..., 0]
  return jnp.pad(logp_BxT1, ((0, 0), (1, 0)))
