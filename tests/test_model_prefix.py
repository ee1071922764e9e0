"""Group prefix sharing (agentic_rl.model.prefix): each group's shared prefix
runs once, with the log-probs, entropies and gradients of the plain forward."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import model
from agentic_rl.model import prefix
from agentic_rl.model import scoring

V = 64
BASE = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, head_dim=8, mlp_dim=48,
            rope_theta=500.0)
# Every non-default feature at once, as tests/test_model.py's.
FEATURES = dict(mlp_activation="gelu", norm_plus_one=True, qk_norm=True, qkv_bias=True,
                tie_embeddings=True, embed_scale=True, attn_logit_softcap=5.0,
                final_logit_softcap=3.0, sliding_windows=(3, None), post_norms=True,
                query_pre_attn_scalar=12.0, local_rope_theta=50.0, rope_scaling_factor=2.0)
CONFIGS = {
    "gqa_window_features": model.TransformerConfig(**BASE, n_kv_heads=2, **FEATURES),
    # LoRA, autodiff's attention backward, a rematerialised layer loop.
    "mqa_lora": model.TransformerConfig(
        **BASE, n_kv_heads=1, lora_rank=4, backward_recompute=False, remat=True,
        scan_unroll=1, sliding_windows=(None, 4)),
}
P, G, T, LP = 3, 4, 14, 6


@pytest.fixture(autouse=True)
def _full_precision():
  with jax.default_matmul_precision("float32"):
    yield


def _params(config):
  params = model.init_params(config, jax.random.key(0))
  # LoRA's B starts at zero: move every weight so the adapters matter.
  noise = jax.random.normal(jax.random.key(1), (len(jax.tree.leaves(params)),))
  return jax.tree.map(lambda x, n: x + 0.05 * n * jnp.ones_like(x),
                      params, jax.tree.unflatten(jax.tree.structure(params), list(noise)))


def _tokens(shared=LP, seed=0):
  """``[P * G, T]`` rows; each group of G agrees on its first ``shared`` tokens."""
  rng = np.random.default_rng(seed)
  head = np.repeat(rng.integers(1, V, (P, 1, shared)), G, axis=1)
  tail = rng.integers(1, V, (P, G, T - shared))
  return np.concatenate([head, tail], axis=2).reshape(P * G, T).astype(np.int32)


def _objective(params, tokens, config, **kw):
  """A loss of both outputs, every position weighted differently."""
  logp, entropy = scoring.sequence_logprobs(params, tokens, config, **kw)
  w = jnp.linspace(0.5, 1.5, T)
  return jnp.sum(logp * w) + 0.1 * jnp.sum(entropy * w[::-1])


def _check_grads(g_got, g_want):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_want), jax.tree.leaves(g_got)):
    scale = float(jnp.max(jnp.abs(a)))
    assert scale > 0, path
    np.testing.assert_allclose(b, a, atol=2e-5 * scale, rtol=1e-4,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logprobs_entropies_and_gradients_equal_the_plain_forward(name):
  config = CONFIGS[name]
  params, tokens = _params(config), _tokens()
  score = jax.jit(scoring.sequence_logprobs,
                  static_argnames=("config", "group_size", "prefix_len"))
  want = score(params, tokens, config)
  got = score(params, tokens, config, group_size=G, prefix_len=LP)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=1e-5)
  assert float(jnp.max(jnp.abs(want[0][:, 1:]))) > 1.0  # not trivially zero
  grad = jax.jit(jax.grad(_objective), static_argnames=("config", "group_size", "prefix_len"))
  _check_grads(grad(params, tokens, config, group_size=G, prefix_len=LP),
               grad(params, tokens, config))


def test_without_jit():
  config = CONFIGS["gqa_window_features"]
  params, tokens = _params(config), _tokens()
  want = jax.jit(scoring.sequence_logprobs, static_argnames="config")(params, tokens, config)
  got = scoring.sequence_logprobs(params, tokens, config, group_size=G, prefix_len=LP)
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("prefix_len", [1, T - 1])
def test_any_shared_length_and_a_temperature(prefix_len):
  """One token up to all but one, of rows that share all of theirs; a Python
  float and an array temperature."""
  tokens = _tokens(shared=T)
  score = jax.jit(scoring.sequence_logprobs,
                  static_argnames=("config", "temperature", "group_size", "prefix_len"))
  for name, tau in (("gqa_window_features", 0.7), ("mqa_lora", jnp.float32(0.7))):
    config = CONFIGS[name]  # an array temperature scales the hidden states: no soft-cap
    params = _params(config)
    kw = dict(temperature=tau) if isinstance(tau, float) else {}
    call = lambda **k: (score(params, tokens, config, **kw, **k) if kw  # noqa: E731
                        else jax.jit(functools.partial(
                            scoring.sequence_logprobs, config=config, **k))(
                                params, tokens, temperature=tau))
    chex.assert_trees_all_close(call(group_size=G, prefix_len=prefix_len), call(),
                                atol=2e-5, rtol=1e-5)


def test_the_prefix_runs_once_per_group():
  """The hidden states come as ``[P, Lp]`` and ``[B, T - Lp]``, equal to the
  plain forward's; the compiled scoring does fewer flops than the plain one;
  rows that do not share the prefix get the group's first row's prefix."""
  config = CONFIGS["gqa_window_features"]
  params, tokens = _params(config), _tokens()
  hidden_P, hidden_B = prefix.forward_hidden(params, tokens, config, group_size=G,
                                             prefix_len=LP)
  chex.assert_shape([hidden_P, hidden_B], [(P, LP, 32), (P * G, T - LP, 32)])
  _, want = model.forward(params, tokens, config, return_hidden=True)
  np.testing.assert_allclose(np.repeat(hidden_P, G, axis=0), want[:, :LP], atol=1e-5)
  np.testing.assert_allclose(hidden_B, want[:, LP:], atol=1e-5)

  def flops(**kw):
    fn = jax.jit(functools.partial(scoring.sequence_logprobs, config=config, **kw))
    return fn.lower(params, tokens).compile().cost_analysis()["flops"]

  assert flops(group_size=G, prefix_len=LP) < 0.8 * flops()
  # A row whose prefix differs from its group's first row scores as if it
  # had the first row's prefix: callers pass a prefix that holds.
  other = tokens.copy()
  other[1, 0] = (other[1, 0] % (V - 1)) + 1
  got = scoring.sequence_logprobs(params, other, config, group_size=G, prefix_len=LP)
  want = scoring.sequence_logprobs(params, tokens, config, group_size=G, prefix_len=LP)
  np.testing.assert_allclose(got[0][1, LP + 1:], want[0][1, LP + 1:], atol=1e-6)


def test_shared_prefix_len_on_the_host():
  tokens = _tokens(shared=LP)
  assert prefix.common_prefix_len(tokens, G) >= LP
  assert prefix.common_prefix_len(tokens, 1) == T - 1  # a row shares with itself
  same = np.tile(tokens[:1], (P * G, 1))
  assert prefix.common_prefix_len(same, G) == T - 1  # a suffix keeps one token
  other = tokens.copy()
  other[G + 2, 3] = (other[G, 3] % (V - 1)) + 1  # group 1's third row differs at 3
  assert prefix.common_prefix_len(other, G) == 3
  other[1, 0] = (other[0, 0] % (V - 1)) + 1
  assert prefix.common_prefix_len(other, G) == 0
  assert [prefix.prefix_bucket(n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 100)] == \
      [0, 1, 2, 3, 4, 4, 6, 6, 8, 8, 12, 12, 96]
  assert prefix.shared_prefix_len(other, G) == 0
  assert prefix.shared_prefix_len(tokens[:, :13], G) in (LP, 8)
  with pytest.raises(ValueError, match="divide"):
    prefix.common_prefix_len(tokens, 5)


def test_bad_arguments_raise():
  config = CONFIGS["mqa_lora"]
  params, tokens = _params(config), _tokens()
  for kw, match in ((dict(group_size=5, prefix_len=LP), "divide"),
                    (dict(group_size=G, prefix_len=T), "prefix_len must be in"),
                    (dict(group_size=G, prefix_len=np.float32(2.0)), "Python int")):
    with pytest.raises(ValueError, match=match):
      prefix.forward_hidden(params, tokens, config, **kw)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decoding_from_a_shared_prefix_cache_equals_the_whole_cache(name):
  """Each group's prompt prefilled once; its first Lp slots kept as one
  cache per group, the rest copied to the rows' own caches (slot j =
  position Lp + j): the decode steps' logits equal those of every row
  decoding from a copy of the whole cache."""
  config = CONFIGS[name]
  params = _params(config)
  step = jax.jit(model.decode_step, static_argnames="config")
  L, Lp, S = 7, 4, 12  # prompt, shared slots, positions after the prompt
  rng = np.random.default_rng(3)
  prompts = rng.integers(1, V, (P, L)).astype(np.int32)
  _, full = model.prefill(params, prompts, model.init_cache(config, P, L), config)
  whole = model.grow_cache(model.repeat_rows(full, G), L + S)
  prefix_cache, own = model.split_slots(full, Lp)
  chex.assert_shape(prefix_cache.k, [(P, config.n_kv_heads, Lp, config.head_dim)] * 2)
  own = model.grow_cache(model.repeat_rows(own, G), L + S - Lp)
  # As the rollout engine: the last prompt token again, then new tokens.
  tokens = np.concatenate([np.repeat(prompts[:, -1:], G, axis=0),
                           rng.integers(1, V, (P * G, S))], axis=1)
  for t in range(S + 1):
    positions = np.full((P * G,), L - 1 + t, np.int32)
    want, whole = step(params, tokens[:, t], positions, whole, config)
    got, own = step(params, tokens[:, t], positions, own, config, prefix=prefix_cache)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"step {t}")
  # The rows' own caches hold the positions after the prefix.
  np.testing.assert_allclose(own.k[0], whole.k[0][:, :, Lp:], atol=1e-6)


def test_shared_prefix_cache_errors():
  config = CONFIGS["mqa_lora"]
  cache = model.init_cache(config, P * G, 8)
  with pytest.raises(ValueError, match="cannot split"):
    model.split_slots(cache, 8)
  with pytest.raises(ValueError, match="does not split"):
    model.decode_step(_params(config), np.zeros((P * G,), np.int32), np.full((P * G,), 9),
                      cache, config, prefix=model.init_cache(config, 5, 4))
