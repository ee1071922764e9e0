"""The backward's recomputation (model.remat, TransformerConfig.backward_recompute)
and the log-prob backward without a scatter: autodiff's values bit for bit."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import model
from agentic_rl.kernels import reference
from agentic_rl.model import attention as attention_lib
from agentic_rl.model import transformer
from agentic_rl.model.remat import recompute_in_backward

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, head_dim=8, mlp_dim=48,
            rope_theta=500.0)
CONFIGS = {
    "mha": model.TransformerConfig(**BASE, n_kv_heads=4),
    "gqa_window": model.TransformerConfig(**BASE, n_kv_heads=2, sliding_windows=(3, None)),
    "features": model.TransformerConfig(
        **BASE, n_kv_heads=2, mlp_activation="gelu", norm_plus_one=True, qk_norm=True,
        qkv_bias=True, tie_embeddings=True, embed_scale=True, attn_logit_softcap=5.0,
        final_logit_softcap=3.0, sliding_windows=(3, None)),
}
B, T = 3, 14


def assert_bitwise_equal(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape and g.dtype == w.dtype
    assert g.tobytes() == w.tobytes(), np.max(np.abs(g.astype(np.float64) - w))


def _grads(fn, *args, argnums):
  w = jax.random.normal(jax.random.key(7), jax.eval_shape(fn, *args).shape)
  loss = lambda *a: jnp.sum(w * jnp.sin(fn(*a)))  # noqa: E731
  return jax.jit(jax.value_and_grad(loss, argnums=argnums))(*args)


def test_recompute_in_backward_is_autodiff_bit_for_bit():
  """Values and gradients of a function with a mask and a static argument,
  through recompute_in_backward, equal autodiff's; the integer and None
  arguments pass through."""
  keys = jax.random.split(jax.random.key(0), 3)
  a = jax.random.normal(keys[0], (B, 5, 6))
  a = a.at[0, 0, 0].set(-0.0).at[1, 0, 0].set(0.0)  # signed zeros survive
  b = jax.random.normal(keys[1], (B, 5, 6))
  w = jax.random.normal(keys[2], (6, 4))
  mask = jnp.arange(B * 5 * 6).reshape(B, 5, 6) % 3 != 0

  def fn(a, b, w, mask, none, scale):
    assert none is None and scale == 2.0
    return jnp.where(mask, jax.nn.silu(a) * b, 0.0) @ w * scale

  plain = lambda a, b, w: fn(a, b, w, mask, None, 2.0)  # noqa: E731
  ours = lambda a, b, w: recompute_in_backward(fn, a, b, w, mask, None, 2.0)  # noqa: E731
  assert_bitwise_equal(jax.jit(ours)(a, b, w), jax.jit(plain)(a, b, w))
  assert_bitwise_equal(_grads(ours, a, b, w, argnums=(0, 1, 2)),
                       _grads(plain, a, b, w, argnums=(0, 1, 2)))


def test_backward_recompute_keeps_fewer_temporaries():
  """A model gradient compiled with backward_recompute keeps less than
  autodiff's residuals (no common-subexpression pass merges the
  recomputation back into the forward)."""
  on = model.TransformerConfig(**dict(BASE, mlp_dim=128), n_kv_heads=4)
  params = model.init_params(on, jax.random.key(0))
  tokens = jnp.zeros((4, 64), jnp.int32)

  def temp_bytes(cfg):
    loss = lambda p: jnp.sum(jnp.sin(model.forward(p, tokens, cfg)))  # noqa: E731
    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes(on) < 0.8 * temp_bytes(dataclasses.replace(on, backward_recompute=False))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_attention_core_recompute_equals_the_reference(name):
  c = CONFIGS[name]
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (B, T, c.n_heads, c.head_dim))
  k, v = (jax.random.normal(key, (B, T, c.n_kv_heads, c.head_dim)) for key in keys[1:])
  segments = jnp.asarray(np.repeat([[1] * 9 + [2] * (T - 9)], B, axis=0))
  window = c.layer_windows()[0] if c.has_sliding_windows else None
  kw = dict(segment_ids_BxT=segments, sliding_window=window, softcap=c.attn_logit_softcap)
  ref = functools.partial(attention_lib.attention, recompute=False, **kw)
  ours = functools.partial(attention_lib.attention, recompute=True, **kw)
  assert_bitwise_equal(jax.jit(ours)(q, k, v), jax.jit(ref)(q, k, v))
  assert_bitwise_equal(_grads(ours, q, k, v, argnums=(0, 1, 2)),
                       _grads(ref, q, k, v, argnums=(0, 1, 2)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_backward_recompute_leaves_forward_and_gradients_bit_for_bit(name):
  """The model with and without backward_recompute: the same logits and the
  same parameter gradients, bit for bit."""
  on = CONFIGS[name]
  off = dataclasses.replace(on, backward_recompute=False)
  assert on.backward_recompute
  params = model.init_params(on, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (B, T), 0, on.vocab_size)
  segments = jnp.asarray(np.repeat([[1] * 9 + [2] * (T - 9)], B, axis=0))

  def loss(p, cfg):
    logits = model.forward(p, tokens, cfg, segment_ids_BxT=segments)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * jnp.cos(logits[..., 0]))

  grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  forward = jax.jit(model.forward, static_argnums=2)
  assert_bitwise_equal(forward(params, tokens, on), forward(params, tokens, off))
  assert_bitwise_equal(grad(params, on), grad(params, off))


def test_gated_unit_and_down_projection():
  x = jnp.linspace(-3, 3, 12).reshape(1, 2, 6)
  up = jnp.full((1, 2, 6), 2.0)
  np.testing.assert_allclose(transformer.gated_unit(x, up, activation="silu"),
                             2 * x / (1 + np.exp(-x)), rtol=1e-6)
  np.testing.assert_allclose(transformer.gated_unit(x, up, activation="gelu"),
                             2 * jax.nn.gelu(x, approximate=True), rtol=1e-6)


def _plain_token_logprobs(h, w, t, *, temperature=1.0, softcap=None):
  """reference.token_logprobs as plain autodiff sees it (no custom_vjp)."""
  logits = jnp.dot(h, w, preferred_element_type=jnp.float32)
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  logits = logits / temperature
  logp_NxV = jax.nn.log_softmax(logits, axis=-1)
  logp_N = jnp.take_along_axis(logp_NxV, t[:, None], axis=-1)[:, 0]
  return logp_N, -jnp.sum(jnp.exp(logp_NxV) * logp_NxV, axis=-1)


@pytest.mark.parametrize("cotangents", ["logp", "entropy", "both"])
@pytest.mark.parametrize("temperature, softcap", [(1.0, None), (0.7, 3.0)])
def test_token_logprobs_backward_is_autodiff_bit_for_bit(cotangents, temperature, softcap):
  """Gradients of the reference log-probs (and entropies) equal plain
  autodiff's, bit for bit, whichever outputs get a cotangent; zero
  cotangents (masked tokens) included."""
  N, D, V = 37, 16, 300
  keys = jax.random.split(jax.random.key(3), 4)
  h = jax.random.normal(keys[0], (N, D))
  w = jax.random.normal(keys[1], (D, V)) * 0.5
  t = jax.random.randint(keys[2], (N,), 0, V)
  a = jax.random.normal(keys[3], (N,)).at[::4].set(0.0).at[1::8].set(-0.0)
  kw = dict(temperature=temperature, softcap=softcap)

  def loss(f):
    def fn(h, w):
      logp, ent = f(h, w, t, **kw)
      return {"logp": jnp.sum(a * logp), "entropy": jnp.sum(a * ent),
              "both": jnp.sum(a * logp) + 0.3 * jnp.sum(ent)}[cotangents]
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))

  assert_bitwise_equal(jax.jit(functools.partial(reference.token_logprobs, **kw))(h, w, t),
                       jax.jit(functools.partial(_plain_token_logprobs, **kw))(h, w, t))
  assert_bitwise_equal(loss(reference.token_logprobs)(h, w), loss(_plain_token_logprobs)(h, w))
