"""On-policy distillation: the per-token reverse KL to a teacher.

The student samples; at each of its tokens the loss is the KL from the
student's next-token distribution to the teacher's, over the whole
vocabulary (exact, not estimated from the sampled token)::

  KL_t(pi || q) = sum_v pi(v | y_<t) (log pi(v | y_<t) - log q(v | y_<t))
  loss = sum_t w_t KL_t / num_tokens

with ``w_t`` the loss weight of token ``t`` (0 for prompt and observation
tokens). Reverse KL is mode-seeking: the student is pushed off the tokens
the teacher finds unlikely rather than spread over all the teacher's modes
(Agarwal et al. 2024, "On-policy distillation of language models"; GLM-4.5
merges its stage experts this way).

Pure array math: logits ``[B, T, V]`` whose position ``t - 1`` predicts
token ``t`` (the model's forward), weights ``[B, T]`` on the tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reverse_kl(student_logits_BxTxV: jax.Array, teacher_logits_BxTxV: jax.Array,
               tokens_BxT: jax.Array, weights_BxT: jax.Array, num_tokens: jax.Array,
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """``(loss, metrics)``: the module formula, the teacher taken without
  gradient.

  Args:
    student_logits_BxTxV, teacher_logits_BxTxV: float logits of the same
      tokens (any temperature already applied).
    tokens_BxT: int the sampled tokens (for the metrics' log-probs).
    weights_BxT: float per-token loss weights; entry 0 is never scored.
    num_tokens: the normaliser, the whole batch's weighted token count
      (``objectives.batch_normalisers``), so micro-batches sum to the batch.

  Metrics: ``reverse_kl`` (per weighted token), and the student's and
  teacher's mean log-probs of the sampled tokens ``student_logp``,
  ``teacher_logp``.
  """
  logp_BxTxV = jax.nn.log_softmax(student_logits_BxTxV[:, :-1].astype(jnp.float32))
  logq_BxTxV = jax.lax.stop_gradient(
      jax.nn.log_softmax(teacher_logits_BxTxV[:, :-1].astype(jnp.float32)))
  kl_BxT = jnp.sum(jnp.exp(logp_BxTxV) * (logp_BxTxV - logq_BxTxV), axis=-1)
  w_BxT = weights_BxT[:, 1:]
  loss = jnp.sum(kl_BxT * w_BxT) / num_tokens
  targets = tokens_BxT[:, 1:, None]
  taken = lambda x: jnp.take_along_axis(x, targets, axis=-1)[..., 0]  # noqa: E731
  mean = lambda x: jnp.sum(x * w_BxT) / jnp.maximum(jnp.sum(w_BxT), 1e-9)  # noqa: E731
  return loss, {"reverse_kl": mean(kl_BxT),
                "student_logp": mean(jax.lax.stop_gradient(taken(logp_BxTxV))),
                "teacher_logp": mean(taken(logq_BxTxV))}
