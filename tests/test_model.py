"""Tests for agentic_rl.model: forward, KV-cache decoding, config, params."""

import dataclasses
import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import model
from agentic_rl.kernels import reference
from agentic_rl.model import attention as attention_lib
from agentic_rl.model import transformer

V = 64
BASE = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, head_dim=8,
            mlp_dim=48, rope_theta=500.0)
# Every non-default feature at once (Gemma 2/3-like, plus Qwen2 biases).
FEATURES = dict(mlp_activation="gelu", norm_plus_one=True, qk_norm=True,
                qkv_bias=True, tie_embeddings=True, embed_scale=True,
                attn_logit_softcap=5.0, final_logit_softcap=3.0,
                sliding_windows=(3, None), post_norms=True,
                query_pre_attn_scalar=12.0, local_rope_theta=50.0,
                rope_scaling_factor=2.0)

CONFIGS = {
    "mha": model.TransformerConfig(**BASE, n_kv_heads=4),
    "gqa": model.TransformerConfig(**BASE, n_kv_heads=2),
    "mqa": model.TransformerConfig(**BASE, n_kv_heads=1),
    "mha_window": model.TransformerConfig(**BASE, n_kv_heads=4,
                                          sliding_windows=(3, 3)),
    "mqa_window": model.TransformerConfig(**BASE, n_kv_heads=1,
                                          sliding_windows=(None, 4)),
    # GQA with a local and a global layer, and every other feature.
    "gqa_window_features": model.TransformerConfig(**BASE, n_kv_heads=2,
                                                   **FEATURES),
}
FEAT = "gqa_window_features"

_jit_forward = jax.jit(model.forward,
                       static_argnames=("config", "return_hidden"))
jit_prefill = jax.jit(model.prefill, static_argnames="config",
                      donate_argnames="cache")
jit_extend = jax.jit(model.extend, static_argnames=("config", "return_hidden"),
                     donate_argnames="cache")
jit_decode = jax.jit(model.decode_step, static_argnames="config",
                     donate_argnames="cache")
B, T = 3, 14  # One forward shape everywhere, so jit compiles are shared.


@pytest.fixture(autouse=True)
def _full_precision():
  with jax.default_matmul_precision("float32"):
    yield


def fwd(params, tokens, config, **kwargs):
  """Jitted forward -> numpy (logits, hidden)."""
  logits, hidden = _jit_forward(params, tokens, config, return_hidden=True,
                                **kwargs)
  return np.asarray(logits), np.asarray(hidden.astype(jnp.float32))


@functools.lru_cache(maxsize=None)
def _params(config, seed=0):
  """Random params, norm scales and biases non-trivial, made in numpy.

  (Shapes from ``init_params`` via eval_shape: compiling it for every config
  would cost a second of CPU each.)
  """
  shapes = jax.eval_shape(functools.partial(model.init_params, config),
                          jax.random.key(0))
  rng = np.random.default_rng(seed)

  def make(path, leaf):
    noise = rng.standard_normal(leaf.shape)
    if "norm" in jax.tree_util.keystr(path):
      x = (0.0 if config.norm_plus_one else 1.0) + 0.1 * noise
    else:
      x = 0.2 * noise
    return jnp.asarray(x, leaf.dtype)

  return jax.tree_util.tree_map_with_path(make, shapes)


def _tokens(shape, seed=0):
  return np.random.default_rng(seed).integers(0, V, shape).astype(np.int32)


# --- KV cache == full forward -------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_extend_decode_match_forward(name):
  """Right-padded prompts of lengths 5/3/7, a chunk, then token by token.

  Covers both parameter layouts (stacked for the prefill, per-layer for the
  rest) and a cache grown between prefill and decoding.

  The 2-token chunk (``extend`` at per-row starts) runs on the windowed
  configs, where a chunk straddling the window edge is the tricky case; the
  others go straight to decoding (each jit compile costs a CPU second).
  """
  config = CONFIGS[name]
  params = _params(config)
  S, P, C = 16, 7, (2 if config.has_sliding_windows else 0)
  tokens = _tokens((B, T))
  want, want_hidden = fwd(params, tokens, config)

  lengths = np.array([5, 3, 7])
  junk = _tokens((B, P), seed=1)  # Pads differ from the true continuation.
  prompt = np.where(np.arange(P) < lengths[:, None], tokens[:, :P], junk)
  # Prefill a cache just long enough with the stacked params, grow it, then
  # extend and decode with the per-layer params of the rollout engine.
  logits, cache = jit_prefill(params, prompt, model.init_cache(config, B, P),
                              config)
  cache = model.grow_cache(cache, S)
  params = model.unstack_layers(params)
  chex.assert_shape(logits, (B, P, V))
  chex.assert_type(logits, jnp.float32)
  logits = np.asarray(logits)
  got = {(b, t): logits[b, t] for b in range(B) for t in range(lengths[b])}

  if C:
    chunk = np.stack([tokens[b, lengths[b]:lengths[b] + C] for b in range(B)])
    logits, hidden, cache = jit_extend(params, chunk, lengths, cache, config,
                                       return_hidden=True)
    chex.assert_shape(logits, (B, C, V))
    logits, hidden = np.asarray(logits), np.asarray(hidden)
    for b in range(B):
      for i in range(C):
        got[b, lengths[b] + i] = logits[b, i]
        np.testing.assert_allclose(hidden[b, i],
                                   want_hidden[b, lengths[b] + i], atol=1e-5)

  for pos in lengths + C + np.arange(T - C - lengths.max())[:, None]:
    logits, cache = jit_decode(params, tokens[np.arange(B), pos], pos, cache,
                               config)
    chex.assert_shape(logits, (B, V))
    logits = np.asarray(logits)
    got.update({(b, pos[b]): logits[b] for b in range(B)})

  # Every real (non-pad) position of each row was scored exactly once.
  assert sorted(got) == sorted((b, t) for b in range(B)
                               for t in range(lengths[b] + T - lengths.max()))
  diff = max(np.abs(v - want[b, t]).max() for (b, t), v in got.items())
  assert diff <= 1e-5, diff


def test_eager_forward_matches_jit():
  config = CONFIGS[FEAT]
  params = _params(config)
  tokens = _tokens((B, T))
  eager = model.forward(params, tokens, config, return_hidden=True)
  # fp32 rounding only: XLA fuses (and so orders) jitted ops differently
  # (jax 0.12 differs by 1.7e-6 on one logit of 2688).
  chex.assert_trees_all_close(eager, fwd(params, tokens, config), atol=1e-5, rtol=1e-5)


def test_pallas_decode_reads_the_head_major_cache():
  """attn_impl="pallas" (interpret mode here) decodes like the reference."""
  config = CONFIGS["gqa"]
  params = model.unstack_layers(_params(config))
  tokens = _tokens((B, 6))
  got = {}
  for impl in ("xla", "pallas"):
    cfg = dataclasses.replace(config, attn_impl=impl)
    _, cache = model.prefill(params, tokens[:, :5], model.init_cache(cfg, B, 8), cfg)
    got[impl], _ = model.decode_step(params, tokens[:, 5], jnp.full((B,), 5), cache, cfg)
  np.testing.assert_allclose(got["pallas"], got["xla"], atol=1e-5)


def test_extend_writes_only_its_slots():
  config = CONFIGS[FEAT]
  params = _params(config)
  tokens = _tokens((B, T))
  chunk, start = tokens[:, :2], np.array([0, 5, 14])
  *_, cache = jit_extend(params, chunk, start, model.init_cache(config, B, 16),
                         config, return_hidden=True)
  written = np.any(np.asarray(cache.k) != 0, axis=(0, 2, 4))  # [B, S]
  for b in range(B):
    np.testing.assert_array_equal(np.flatnonzero(written[b]),
                                  start[b] + np.arange(2))


def test_grow_cache_appends_zero_slots_and_unstack_layers_splits():
  config = CONFIGS[FEAT]
  cache = jax.tree.map(lambda x: x + 1.0, model.init_cache(config, B, 4))
  grown = model.grow_cache(cache, 6)
  assert grown.max_len == 6 and len(grown.k) == config.n_layers
  for old, new in zip(cache.k + cache.v, grown.k + grown.v):
    np.testing.assert_array_equal(new[:, :, :4], old)
    np.testing.assert_array_equal(new[:, :, 4:], 0.0)
  assert model.grow_cache(cache, 4) is cache
  with pytest.raises(ValueError, match="cannot grow a KV cache of 4 slots to 3"):
    model.grow_cache(cache, 3)

  params = _params(config)
  split = model.unstack_layers(params)
  assert model.unstack_layers(split) is split
  assert len(split["layers"]) == config.n_layers
  for i, p in enumerate(split["layers"]):
    for name, w in p.items():
      np.testing.assert_array_equal(w, params["layers"][name][i])


# --- forward properties ------------------------------------------------------


@pytest.mark.parametrize("name", ["mha", FEAT])
def test_causality(name):
  config = CONFIGS[name]
  params = _params(config)
  tokens = _tokens((B, T))
  t = 6
  perturbed = tokens.copy()
  perturbed[:, t] = (tokens[:, t] + 1) % V
  a, _ = fwd(params, tokens, config)
  b, _ = fwd(params, perturbed, config)
  np.testing.assert_array_equal(a[:, :t], b[:, :t])
  assert np.all(np.abs(a[:, t:] - b[:, t:]).max(axis=-1) > 0)


@pytest.mark.parametrize("name", ["mha_window", FEAT])
def test_segment_ids_isolate_packed_sequences(name):
  """Row 0 packs a (4 tokens) + b (5) + padding; rows 1, 2 hold a, b alone."""
  config = CONFIGS[name]
  params = _params(config)
  tokens = _tokens((B, T), seed=2)
  a, b = tokens[1, :4], tokens[2, :5]
  tokens[0] = np.concatenate([a, b, np.zeros(5, np.int32)])
  segments = np.array([[1] * 4 + [2] * 5 + [0] * 5] + [[1] * T] * 2)
  positions = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4],
                        np.arange(T), np.arange(T)])
  packed, _ = fwd(params, tokens, config, positions_BxT=positions,
                  segment_ids_BxT=segments)
  alone, _ = fwd(params, tokens, config)  # Causal: trailing tokens don't matter.
  np.testing.assert_allclose(packed[0, :4], alone[1, :4], atol=1e-5)
  np.testing.assert_allclose(packed[0, 4:9], alone[2, :5], atol=1e-5)
  np.testing.assert_allclose(packed[1:], alone[1:], atol=1e-5)
  # Without segment ids, b's logits see a and change.
  mixed, _ = fwd(params, tokens, config, positions_BxT=positions,
                 segment_ids_BxT=np.ones((B, T), np.int32))
  assert np.abs(mixed[0, 4:9] - packed[0, 4:9]).max() > 1e-3


def test_bf16_compute_with_fp32_params_is_close_to_fp32():
  config = CONFIGS[FEAT]
  bf16 = dataclasses.replace(config, dtype="bfloat16")
  params = _params(config)
  tokens = _tokens((B, T))
  want, _ = fwd(params, tokens, config)
  logits, hidden = _jit_forward(params, tokens, bf16, return_hidden=True)
  chex.assert_type(logits, jnp.float32)
  chex.assert_type(hidden, jnp.bfloat16)
  err = np.abs(np.asarray(logits) - want).max()
  assert 0 < err < 0.05 * np.abs(want).max(), err
  cache = model.init_cache(bf16, B, 16)
  chex.assert_type(cache.k, jnp.bfloat16)
  chex.assert_type(cache.v, jnp.bfloat16)


def test_features_match_numpy_reference():
  """All non-default features against an independent float64 numpy model."""
  config = CONFIGS[FEAT]
  params = _params(config)
  tokens = _tokens((B, T))
  logits, hidden = fwd(params, tokens, config)
  want_logits, want_hidden = _numpy_forward(params, tokens, config)
  np.testing.assert_allclose(logits, want_logits, atol=1e-4)
  np.testing.assert_allclose(hidden, want_hidden, atol=1e-4)
  assert np.abs(logits).max() < config.final_logit_softcap


@pytest.mark.parametrize("change", [
    dict(post_norms=False), dict(query_pre_attn_scalar=None),
    dict(local_rope_theta=None), dict(rope_scaling_factor=1.0)])
def test_gemma_fields_each_change_the_output(change):
  """Each of post_norms, query_pre_attn_scalar, local_rope_theta and
  rope_scaling_factor moves the logits of the forward and of the KV-cache
  path alike (neither may ignore one)."""
  config = CONFIGS[FEAT]
  other = dataclasses.replace(config, **change)
  params = _params(config)
  if not other.post_norms:
    params = {**params, "layers": {k: v for k, v in params["layers"].items()
                                   if not k.startswith("post_")}}
  tokens = _tokens((B, T))
  want, _ = fwd(_params(config), tokens, config)
  got, _ = fwd(params, tokens, other)
  assert np.abs(got - want).max() > 1e-3
  cached, _ = jit_prefill(params, tokens, model.init_cache(other, B, T), other)
  np.testing.assert_allclose(cached, got, atol=1e-5)


def test_query_pre_attn_scalar_equal_to_head_dim_is_the_plain_scale():
  config = CONFIGS["gqa"]
  same = dataclasses.replace(config, query_pre_attn_scalar=config.head_dim)
  assert same.query_scale is None
  assert dataclasses.replace(config, query_pre_attn_scalar=2.0).query_scale == 2.0
  # No local RoPE without sliding windows (no layer would use it).
  assert not dataclasses.replace(config, local_rope_theta=5.0).has_local_rope


@pytest.mark.parametrize("name", ["gqa", FEAT])
def test_unembedding_reproduces_logits_and_logprobs(name):
  config = CONFIGS[name]
  params = _params(config)
  tokens = _tokens((B, T))
  logits, hidden = fwd(params, tokens, config)
  w = model.unembedding(params, config)
  chex.assert_shape(w, (config.d_model, V))
  expected_w = params["embed"].T if config.tie_embeddings else params["unembed"]
  np.testing.assert_array_equal(w, expected_w)
  targets = tokens.reshape(-1)
  logp, _ = reference.token_logprobs(
      jnp.asarray(hidden.reshape(-1, config.d_model)), w, targets,
      softcap=config.final_logit_softcap)
  want = np.take_along_axis(jax.nn.log_softmax(logits.reshape(-1, V)),
                            targets[:, None], axis=-1)[:, 0]
  np.testing.assert_allclose(logp, want, atol=1e-5)


def test_remat_checkpoints_the_layer_body():
  """remat wraps the scanned layer in jax.checkpoint; values are unchanged."""
  config = CONFIGS["mha"]
  params = _params(config)
  tokens = _tokens((B, T))

  def rematted(cfg):
    loss = lambda p: jnp.sum(model.forward(p, tokens, cfg)[..., 0])
    text = str(jax.make_jaxpr(jax.grad(loss))(params))
    return "remat" in text or "checkpoint" in text

  assert not rematted(config)
  remat = dataclasses.replace(config, remat=True)
  assert rematted(remat)
  np.testing.assert_allclose(fwd(params, tokens, remat)[0],
                             fwd(params, tokens, config)[0], atol=1e-6)


def test_scan_unroll_changes_the_loop_not_the_values():
  """scan_unroll=None (the default) leaves no loop in the forward; 1 (one
  loop iteration per layer) gives the same logits and gradients."""
  config = CONFIGS[FEAT]
  params = _params(config)
  tokens = _tokens((B, T))

  def loss(p, cfg):
    return jnp.sum(jnp.sin(model.forward(p, tokens, cfg)))

  looped = dataclasses.replace(config, scan_unroll=1)
  lower = jax.jit(model.forward, static_argnums=2).lower
  assert config.scan_unroll is None and "while" not in lower(params, tokens, config).as_text()
  assert "while" in lower(params, tokens, looped).as_text()
  grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  chex.assert_trees_all_close(grad(params, looped), grad(params, config), rtol=1e-4, atol=1e-4)


def test_layer_params_constraint_applies_to_each_layer_where_it_is_used():
  config = CONFIGS["gqa"]
  params = _params(config)
  tokens = _tokens((B, T))
  seen = []

  def silence_attention(p):  # One layer's weights: no layers axis.
    seen.append(p["wo"].shape)
    return dict(p, wo=jnp.zeros_like(p["wo"]))

  got = model.forward(params, tokens, dataclasses.replace(config, scan_unroll=1),
                      layer_params_constraint=silence_attention)
  assert seen == [params["layers"]["wo"].shape[1:]]  # traced once, in the scan
  silenced = dict(params, layers=dict(params["layers"],
                                      wo=jnp.zeros_like(params["layers"]["wo"])))
  np.testing.assert_allclose(got, fwd(silenced, tokens, config)[0], atol=1e-5)
  assert not np.allclose(got, fwd(params, tokens, config)[0], atol=1e-3)


def test_rope_depends_only_on_relative_position():
  rng = np.random.default_rng(0)
  q, k = rng.standard_normal((2, 1, 1, 1, 8), np.float32)

  def score(pq, pk):
    rq = transformer.apply_rope(q, np.array([[pq]]), 100.0)
    rk = transformer.apply_rope(k, np.array([[pk]]), 100.0)
    return float(jnp.sum(rq * rk))

  assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5)
  assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)
  np.testing.assert_allclose(transformer.apply_rope(q, np.zeros((1, 1)), 1.0),
                             q, atol=1e-7)


@pytest.mark.parametrize("jit", [False, True])
def test_rope_table_lookup_equals_direct_tables(jit):
  # The KV cache gathers RoPE rows from a table of its slots; the values
  # must be the direct ones exactly (same tokens in rollouts), and positions
  # past the table clip to its last row.
  pos = np.array([[0, 5, 271], [3, 100, 7]])
  tables = functools.partial(transformer.rope_tables, head_dim=64,
                             theta=10000.0)
  lookup = functools.partial(tables, table_len=272)
  if jit:
    tables, lookup = jax.jit(tables), jax.jit(lookup)
  for direct, looked_up in zip(tables(pos), lookup(pos)):
    chex.assert_shape(looked_up, (2, 3, 1, 32))
    np.testing.assert_array_equal(looked_up, direct)
  np.testing.assert_array_equal(lookup(np.array([[300]]))[0],
                                tables(np.array([[271]]))[0])


def test_rms_norm_hand_computed():
  x = jnp.array([3.0, 4.0])  # rms = sqrt(12.5)
  want = np.array([3.0, 8.0]) / math.sqrt(12.5)
  np.testing.assert_allclose(
      transformer.rms_norm(x, jnp.array([1.0, 2.0]), eps=0.0, plus_one=False),
      want, rtol=1e-6)
  np.testing.assert_allclose(
      transformer.rms_norm(x, jnp.array([0.0, 1.0]), eps=0.0, plus_one=True),
      want, rtol=1e-6)


# --- params, config ------------------------------------------------------------


@pytest.mark.parametrize("name", ["mha", FEAT])
def test_param_axes_match_params(name):
  config = CONFIGS[name]
  params = _params(config)
  axes = model.param_axes(config)
  is_axes = lambda x: isinstance(x, tuple)
  assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(params)
  allowed = {"layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab",
             None}
  for ax, leaf in zip(jax.tree.leaves(axes, is_leaf=is_axes),
                      jax.tree.leaves(params)):
    assert len(ax) == leaf.ndim and set(ax) <= allowed, (ax, leaf.shape)
  for leaf in jax.tree.leaves(params["layers"]):
    assert leaf.shape[0] == config.n_layers
  assert ("unembed" in params) == (not config.tie_embeddings)


def test_init_params_dtypes_and_norm_init():
  config = dataclasses.replace(CONFIGS[FEAT], param_dtype="bfloat16")
  params = model.init_params(config, jax.random.key(0))
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}
  assert not np.any(np.asarray(params["final_norm"], np.float32))  # 1 + w
  config = CONFIGS["mha"]
  plain = model.init_params(config, jax.random.key(0))
  np.testing.assert_array_equal(plain["layers"]["attn_norm"], 1.0)
  for name, fan_in in (("wq", 32), ("wo", 32), ("w_down", 48)):
    std = np.asarray(plain["layers"][name]).std()
    assert abs(std * math.sqrt(fan_in) - 1) < 0.1, (name, std)
  other = model.init_params(config, jax.random.key(1))
  assert np.abs(np.asarray(other["embed"] - plain["embed"])).max() > 0.1


def test_presets_and_window_helper():
  assert model.alternating_windows(4, 3) == (3, None, 3, None)
  assert model.alternating_windows(6, 8, global_every=6) == (8,) * 5 + (None,)
  tiny = model.TransformerConfig.tiny().validate()
  big = model.TransformerConfig.llama_10m()
  n = sum(x.size for x in jax.tree.leaves(
      jax.eval_shape(functools.partial(model.init_params, big),
                     jax.random.key(0))))
  assert 9.5e6 < n < 10.5e6 and big.d_model == 320 and big.vocab_size == 1024
  gqa = model.TransformerConfig.llama_10m_gqa().validate()
  n = sum(x.size for x in jax.tree.leaves(
      jax.eval_shape(functools.partial(model.init_params, gqa),
                     jax.random.key(0))))
  assert 9.5e6 < n < 10.5e6 and gqa.n_heads == 3 * gqa.n_kv_heads
  assert tiny.n_heads % tiny.n_kv_heads == 0
  np.testing.assert_array_equal(
      CONFIGS[FEAT].layer_windows(), [3, reference.NO_WINDOW])


@pytest.mark.parametrize("overrides, match", [
    (dict(n_heads=6, n_kv_heads=4), r"n_heads \(6\).*n_kv_heads \(4\)"),
    (dict(head_dim=7), "head_dim"),
    (dict(sliding_windows=(3,)), "sliding_windows"),
    (dict(sliding_windows=(0, None)), "sliding_windows"),
    (dict(mlp_activation="relu"), "mlp_activation"),
    (dict(attn_impl="cuda"), "attn_impl"),
    (dict(dtype="int8"), "floating"),
    (dict(final_logit_softcap=0.0), "final_logit_softcap"),
    (dict(scan_unroll=0), "scan_unroll"),
    (dict(scan_unroll=True), "scan_unroll"),
    (dict(local_rope_theta=0.0), "local_rope_theta"),
    (dict(query_pre_attn_scalar=-1.0), "query_pre_attn_scalar"),
    (dict(query_pre_attn_scalar=True), "query_pre_attn_scalar"),
    (dict(rope_scaling_factor=0.0), "rope_scaling_factor"),
])
def test_bad_config_raises(overrides, match):
  config = model.TransformerConfig.tiny(**overrides)
  with pytest.raises(ValueError, match=match):
    model.init_params(config, jax.random.key(0))
  with pytest.raises(ValueError, match=match):
    model.forward({}, jnp.zeros((1, 2), jnp.int32), config)


# --- bad input -----------------------------------------------------------------


def test_tokens_outside_vocab_raise():
  config = CONFIGS["gqa"]
  params = _params(config)
  cache = model.init_cache(config, 2, 8)
  for bad in (jnp.array([[1, V]]), jnp.array([[-1, 2]])):
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
      model.forward(params, bad, config)
  with pytest.raises(ValueError, match="token ids"):
    model.prefill(params, jnp.array([[1, 2], [3, V + 5]]), cache, config)
  with pytest.raises(ValueError, match="token ids"):
    model.decode_step(params, jnp.array([1, V]), jnp.array([0, 0]), cache,
                      config)
  with pytest.raises(ValueError, match="integers"):
    model.forward(params, jnp.zeros((1, 2)), config)


def test_chunks_past_the_cache_and_bad_caches_raise():
  config = CONFIGS["gqa"]
  params = _params(config)
  cache = model.init_cache(config, 2, 4)
  with pytest.raises(ValueError, match="do not fit in a KV cache of 4"):
    model.prefill(params, _tokens((2, 5)), cache, config)
  with pytest.raises(ValueError, match="runs past the KV cache of 4"):
    model.extend(params, _tokens((2, 2)), jnp.array([0, 3]), cache, config)
  with pytest.raises(ValueError, match="runs past the KV cache of 4"):
    model.decode_step(params, _tokens((2,)), jnp.array([4, 0]), cache, config)
  with pytest.raises(ValueError, match="starts below 0"):
    model.decode_step(params, _tokens((2,)), jnp.array([-1, 0]), cache, config)
  with pytest.raises(ValueError, match="cache.k has shape"):
    model.prefill(params, _tokens((3, 2)), cache, config)
  with pytest.raises(ValueError, match="cache.k holds 1 layers, expected 2"):
    model.prefill(params, _tokens((2, 2)), cache.replace(k=cache.k[:1]), config)
  with pytest.raises(ValueError, match="start_B must have shape"):
    model.extend(params, _tokens((2, 2)), jnp.array([0]), cache, config)
  with pytest.raises(ValueError, match="cache.k has dtype float32"):
    model.prefill(params, _tokens((2, 2)), cache,
                  dataclasses.replace(config, dtype="bfloat16"))


def test_head_major_cache_attention_equals_the_sequence_major_reference():
  """The KV cache is head-major; the reference reads either layout alike."""
  q = jax.random.normal(jax.random.key(0), (2, 3, 4, 8))
  k, v = jax.random.normal(jax.random.key(1), (2, 2, 10, 2, 8))
  pos = jnp.array([[4, 5, 6], [7, 8, 9]])
  kv_pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
  want = reference.attention(q, k, v, q_positions=pos, kv_positions=kv_pos, sliding_window=4)
  got = attention_lib.attention(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
                                q_positions_BxT=pos, sliding_window=4)
  np.testing.assert_allclose(got, want, atol=1e-6)
  with pytest.raises(ValueError, match="kv_layout"):
    reference.attention(q, k, v, kv_layout="SBKD")


@pytest.mark.parametrize("name, dtype", [("mha", "float32"), ("mqa_window", "float32"),
                                         (FEAT, "float32"), ("gqa", "bfloat16")])
def test_self_attention_backward_matches_the_reference(name, dtype):
  """attn_impl="xla_vjp": the reference forward (bit for bit) with a
  hand-written backward; gradients as autodiff of the reference."""
  c = CONFIGS[name]
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, T, c.n_heads, c.head_dim), dtype)
  k, v = (jax.random.normal(key, (B, T, c.n_kv_heads, c.head_dim), dtype)
          for key in keys[1:3])
  w = jax.random.normal(keys[3], q.shape)
  segments = jnp.asarray(np.repeat([[1] * 9 + [2] * (T - 9)], B, axis=0))
  window = c.layer_windows()[0] if c.has_sliding_windows else None
  kw = dict(sliding_window=window, softcap=c.attn_logit_softcap)

  def ref(q, k, v):
    return reference.attention(q, k, v, segment_ids=segments, **kw)

  def ours(q, k, v):
    return attention_lib.attention(q, k, v, impl="xla_vjp", segment_ids_BxT=segments, **kw)

  np.testing.assert_array_equal(jax.jit(ours)(q, k, v), jax.jit(ref)(q, k, v))
  loss = lambda f: lambda *a: jnp.sum(w * f(*a).astype(jnp.float32))  # noqa: E731
  want = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
  got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
  atol = 2e-2 if dtype == "bfloat16" else 1e-5
  for g, r in zip(got, want):
    assert g.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(g.astype(jnp.float32), r.astype(jnp.float32), atol=atol)


def test_attention_rejects_bad_arguments():
  q = jnp.zeros((1, 2, 4, 8))
  kv = jnp.zeros((1, 2, 2, 8))
  with pytest.raises(ValueError, match="impl"):
    attention_lib.attention(q, kv, kv, impl="triton")
  with pytest.raises(ValueError, match="segment ids"):
    attention_lib.attention(q, kv, kv, q_positions_BxT=jnp.zeros((1, 2), int),
                            segment_ids_BxT=jnp.zeros((1, 2), int))
  with pytest.raises(ValueError, match="as many keys as queries"):
    attention_lib.attention(q, jnp.zeros((1, 3, 2, 8)), jnp.zeros((1, 3, 2, 8)))


# --- an independent float64 numpy model ------------------------------------------


def _numpy_forward(params, tokens, c):
  """Naive float64 model from the formulas in the config docstring."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  B, T = tokens.shape
  H, K, Dh, half = c.n_heads, c.n_kv_heads, c.head_dim, c.head_dim // 2

  def norm(x, w):
    scale = 1 + w if c.norm_plus_one else w
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.norm_eps) * scale

  def rope(x, local):  # Pairs (i, i + half): pos / factor / theta ** (2i / Dh).
    theta, factor = ((c.local_rope_theta, 1.0) if local
                     else (c.rope_theta, c.rope_scaling_factor))
    out = np.empty_like(x)
    for i in range(half):
      a = np.arange(T)[None, :, None] / factor / theta ** (2 * i / Dh)
      x1, x2 = x[..., i], x[..., i + half]
      out[..., i] = x1 * np.cos(a) - x2 * np.sin(a)
      out[..., i + half] = x2 * np.cos(a) + x1 * np.sin(a)
    return out

  def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

  x = p["embed"][tokens] * (math.sqrt(c.d_model) if c.embed_scale else 1.0)
  for layer in range(c.n_layers):
    lp = {k: v[layer] for k, v in p["layers"].items()}
    h = norm(x, lp["attn_norm"])
    q = np.einsum("btd,dhk->bthk", h, lp["wq"]) + lp["bq"]
    k = np.einsum("btd,dhk->bthk", h, lp["wk"]) + lp["bk"]
    v = np.einsum("btd,dhk->bthk", h, lp["wv"]) + lp["bv"]
    local = c.sliding_windows[layer] is not None
    q, k = rope(norm(q, lp["q_norm"]), local), rope(norm(k, lp["k_norm"]), local)
    k, v = np.repeat(k, H // K, axis=2), np.repeat(v, H // K, axis=2)
    s = np.einsum("bthk,bshk->bhts", q, k) / math.sqrt(c.query_pre_attn_scalar)
    s = c.attn_logit_softcap * np.tanh(s / c.attn_logit_softcap)
    t_idx, s_idx = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = s_idx <= t_idx
    if c.sliding_windows[layer] is not None:
      visible &= t_idx - s_idx < c.sliding_windows[layer]
    s = np.where(visible, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshk->bthk", w, v)
    x = x + norm(np.einsum("bthk,hkd->btd", o, lp["wo"]), lp["post_attn_norm"])
    h = norm(x, lp["mlp_norm"])
    act = gelu_tanh(h @ lp["w_gate"]) * (h @ lp["w_up"])
    x = x + norm(act @ lp["w_down"], lp["post_mlp_norm"])
  hidden = norm(x, p["final_norm"])
  logits = hidden @ p["embed"].T
  return c.final_logit_softcap * np.tanh(logits / c.final_logit_softcap), hidden


def test_compiler_options_per_platform():
  assert model.compiler_options("cpu") == {
      "xla_cpu_experimental_ynn_fusion_type": "",
      "xla_cpu_prefer_vector_width": "512"}
  assert model.compiler_options("cpu", jnp.float32) == model.compiler_options("cpu")
  # 16-bit compute keeps YNNPACK, whose matmuls use the CPU's bfloat16 units.
  for low in (jnp.bfloat16, "bfloat16", jnp.float16):
    assert model.compiler_options("cpu", low) == {"xla_cpu_prefer_vector_width": "512"}
  assert model.compiler_options("gpu") is None
  assert model.compiler_options("gpu", jnp.bfloat16) is None
  assert model.compiler_options("tpu") is None
  assert model.compiler_options() == model.compiler_options(jax.default_backend())
  mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,))
  assert model.mesh_platform(mesh) == jax.devices()[0].platform
  abstract = jax.sharding.AbstractMesh((2,), ("x",))
  assert model.mesh_platform(abstract) == jax.default_backend()


@pytest.mark.parametrize("use_jit", [False, True])
def test_bf16_matmul_matches_float32_accumulation_and_its_gradients(use_jit):
  # _matmul_low: x @ w with bfloat16 operands, float32 accumulation, a
  # bfloat16 result; its backward takes bfloat16 operands too, and the
  # float32 weight gets a float32 gradient.
  from agentic_rl.model import transformer  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((6, 8)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((8, 5)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((6, 5)), jnp.bfloat16)
  fn = jax.jit(transformer._matmul_low) if use_jit else transformer._matmul_low
  y, vjp = jax.vjp(fn, x, w)
  dx, dw = vjp(dy)
  chex.assert_trees_all_equal_dtypes((y, dx, dw), (x, x, w))
  x32, w16, dy32 = (np.asarray(x, np.float32), np.asarray(w.astype(jnp.bfloat16), np.float32),
                    np.asarray(dy, np.float32))
  np.testing.assert_allclose(np.asarray(y, np.float32), x32 @ w16, rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(np.asarray(dx, np.float32), dy32 @ w16.T, rtol=1e-2, atol=1e-2)
  # dw is accumulated and returned in float32 from bfloat16 operands: exact
  # up to float32 summation order.
  np.testing.assert_allclose(dw, x32.T @ dy32, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU options")
def test_bf16_model_matmuls_run_in_bf16_on_cpu():
  # With bfloat16 compute the projections' forward and backward matmuls
  # take bfloat16 operands in the compiled learner gradient (not float32
  # after a conversion), and YNNPACK is on.
  cfg = dataclasses.replace(model.TransformerConfig.tiny(), dtype="bfloat16")
  params = model.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)

  def loss(p):
    return model.forward(p, tokens, config=cfg)[0].astype(jnp.float32).mean()

  hlo = jax.jit(jax.grad(loss), compiler_options=model.compiler_options(
      None, cfg.compute_dtype)).lower(params).compile().as_text()
  assert "ynn_fusion" in hlo
  # Fused matmuls of two bfloat16 operands into float32: at least the
  # forward and the input gradient of each layer's seven projections.
  low = re.findall(r"\(param_[\d.]+: bf16\[[\d,]+\], param_[\d.]+: bf16\[[\d,]+\]\) -> f32\[",
                   hlo)
  assert len(low) >= 2 * 7 * cfg.n_layers, len(low)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU options")
def test_compiler_options_compile_matmuls_without_ynn_and_agree():
  # The CPU options take the dots away from YNNPACK (Eigen is faster on the
  # model's shapes, see model.xla_options); results agree to rounding.
  cfg = model.TransformerConfig.tiny()
  params = model.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  f = functools.partial(model.forward, config=cfg)
  ours = jax.jit(f, compiler_options=model.compiler_options())
  assert "ynn_fusion" not in ours.lower(params, tokens).compile().as_text()
  np.testing.assert_allclose(ours(params, tokens), jax.jit(f)(params, tokens),
                             rtol=1e-5, atol=1e-5)
