"""Parity of agentic_rl.model with Hugging Face Llama / Qwen2 / Qwen3 / Gemma /
Gemma 2 / Gemma 3 (torch, CPU, fp32), both ways: checkpoints imported and
exported."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from agentic_rl import model
from agentic_rl.model import hf

VOCAB, SEQ = 128, 12
WINDOW = 4  # Gemma 2 / 3 sliding window, shorter than SEQ.
# Gemma 2 / 3: every feature away from its default, so that ignoring one shows.
GEMMA23 = dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
               final_logit_softcapping=3.0)
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 70.0}}


LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}


@pytest.fixture(autouse=True)
def _full_precision():
  with jax.default_matmul_precision("float32"):
    yield


def _tiny_hf_model(arch: str, tie: bool, **extra):
  torch = pytest.importorskip("torch", reason="torch is needed for HF parity")
  transformers = pytest.importorskip(
      "transformers", reason="transformers is needed for HF parity")
  torch.manual_seed(0)
  kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                tie_word_embeddings=tie,
                eos_token_id=None)  # generate would suppress it under min_new_tokens.
  if arch.startswith("gemma"):
    kwargs["hidden_activation"] = "gelu_pytorch_tanh"
  if arch == "llama31":  # Llama 3.1's RoPE: all three frequency bands at head_dim 16.
    kwargs["rope_parameters"] = LLAMA31_ROPE
  if arch == "gemma2":  # Layers: local, global.
    kwargs.update(GEMMA23, attn_logit_softcapping=5.0)
  if arch == "gemma3":  # Layers: local, local, global.
    kwargs.update(GEMMA23, num_hidden_layers=3, sliding_window_pattern=3,
                  rope_parameters=GEMMA3_ROPE)
  kwargs.update(extra)
  model_cls, config_cls = {
      "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
      "llama31": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
      "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
      "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
      "gemma": (transformers.GemmaForCausalLM, transformers.GemmaConfig),
      "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config),
      "gemma3": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig)}[arch]
  net = model_cls(config_cls(**kwargs))
  with torch.no_grad():  # Non-trivial norms and biases, so a mix-up shows.
    for p in net.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return torch, net.eval()


def _torch_logits(torch, net, tokens):
  with torch.no_grad():
    return net(torch.tensor(tokens)).logits.numpy()


def _tokens(seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (2, SEQ))


ARCHS = ["llama", "llama31", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_torch(arch, tie, tmp_path):
  torch, net = _tiny_hf_model(arch, tie)
  net.save_pretrained(tmp_path, safe_serialization=True)
  config, params = hf.load_hf_checkpoint(str(tmp_path))
  assert config.tie_embeddings == tie
  assert config.qkv_bias == (arch == "qwen2")
  assert config.qk_norm == (arch in ("qwen3", "gemma3"))
  assert config.norm_plus_one == config.embed_scale == arch.startswith("gemma")
  assert config.post_norms == (arch in ("gemma2", "gemma3"))
  assert config.rope_theta == 5000.0 and config.norm_eps == 1e-5
  assert (config.n_heads, config.n_kv_heads, config.head_dim) == (4, 2, 16)
  assert ("unembed" in params) == (not tie)
  tokens = _tokens()
  ours = np.asarray(model.forward(params, tokens, config))
  theirs = _torch_logits(torch, net, tokens)
  assert ours.dtype == np.float32
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def _greedy(params, config, prompt, n):
  """Greedy continuation by full forwards over a fixed-length buffer (causal:
  what follows position t does not change its logits)."""
  B, L = prompt.shape
  tokens = np.zeros((B, L + n), np.int64)
  tokens[:, :L] = prompt
  forward = jax.jit(model.forward, static_argnums=2)
  for t in range(L, L + n):
    tokens[:, t] = np.asarray(forward(params, tokens, config))[:, t - 1].argmax(-1)
  return tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_exported_checkpoint_loads_in_transformers_and_generates_the_same(arch, tmp_path):
  torch, net = _tiny_hf_model(arch, tie=arch.startswith("gemma"))
  net.save_pretrained(tmp_path / "in", safe_serialization=True)
  config, params = hf.load_hf_checkpoint(str(tmp_path / "in"))
  hf.save_hf_checkpoint(str(tmp_path / "out"), config, params)
  assert hf.load_hf_checkpoint(str(tmp_path / "out"))[0] == config
  transformers = pytest.importorskip("transformers")
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  assert type(back).__name__ == type(net).__name__
  tokens = _tokens(3)
  np.testing.assert_array_equal(_torch_logits(torch, back, tokens),
                                _torch_logits(torch, net, tokens))
  prompt = tokens[:, :4]
  with torch.no_grad():
    theirs = back.generate(torch.tensor(prompt), max_new_tokens=32, do_sample=False,
                           min_new_tokens=32).numpy()
  np.testing.assert_array_equal(_greedy(params, config, prompt, 32), theirs)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])
def test_kv_cache_decoding_matches_torch_generate(arch, tmp_path):
  """Our prefill + decode_step greedy loop against HF generate, 32 tokens past
  a 4-token prompt (far past the Gemma window), and its logits against HF's
  full forward over the generated sequence."""
  torch, net = _tiny_hf_model(arch, tie=True)
  net.save_pretrained(tmp_path, safe_serialization=True)
  config, params = hf.load_hf_checkpoint(str(tmp_path))
  prompt, n = _tokens(5)[:, :4], 32
  with torch.no_grad():
    want = net.generate(torch.tensor(prompt), max_new_tokens=n, do_sample=False,
                        min_new_tokens=n).numpy()
  B, P = prompt.shape
  prefill = jax.jit(model.prefill, static_argnames="config")
  decode = jax.jit(model.decode_step, static_argnames="config")
  logits, cache = prefill(params, prompt, model.init_cache(config, B, P + n), config)
  params = model.unstack_layers(params)
  got, steps = [np.asarray(logits)], []
  tokens = np.asarray(logits)[:, -1].argmax(-1)
  for t in range(P, P + n):
    steps.append(tokens)
    if t + 1 < P + n:
      logits, cache = decode(params, tokens, np.full((B,), t), cache, config)
      got.append(np.asarray(logits)[:, None])
      tokens = np.asarray(logits).argmax(-1)
  np.testing.assert_array_equal(np.concatenate([prompt, np.stack(steps, 1)], 1), want)
  np.testing.assert_allclose(np.concatenate(got, 1), _torch_logits(torch, net, want[:, :-1]),
                             atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_features_are_read_and_each_matters(arch, tmp_path):
  """The config carries every Gemma 2 / 3 feature, and each one changes the
  logits (so the parity tests above would catch it being dropped); the window
  is HF's exactly: a query at p sees keys j with p - j < window, not one more
  or one less."""
  torch, net = _tiny_hf_model(arch, tie=True)
  net.save_pretrained(tmp_path, safe_serialization=True)
  config, params = hf.load_hf_checkpoint(str(tmp_path))
  gemma3 = arch == "gemma3"
  assert config.sliding_windows == ((WINDOW, WINDOW, None) if gemma3 else (WINDOW, None))
  assert config.query_pre_attn_scalar == 24 and config.final_logit_softcap == 3.0
  assert config.attn_logit_softcap == (None if gemma3 else 5.0)
  assert (config.rope_theta, config.local_rope_theta, config.rope_scaling_factor) == (
      (5000.0, 70.0, 8.0) if gemma3 else (5000.0, None, 1.0))
  tokens = _tokens(6)
  theirs = _torch_logits(torch, net, tokens)
  np.testing.assert_allclose(np.asarray(model.forward(params, tokens, config)), theirs,
                             atol=1e-4, rtol=0)
  changes = [dict(sliding_windows=tuple(w and w + 1 for w in config.sliding_windows)),
             dict(sliding_windows=tuple(w and w - 1 for w in config.sliding_windows)),
             dict(query_pre_attn_scalar=None), dict(final_logit_softcap=None)]
  if gemma3:
    changes += [dict(local_rope_theta=None), dict(rope_scaling_factor=1.0)]
  else:
    changes += [dict(attn_logit_softcap=None)]
  for change in changes:
    other = np.asarray(model.forward(params, tokens, dataclasses.replace(config, **change)))
    assert np.abs(other - theirs).max() > 1e-3, change
  no_post = dataclasses.replace(config, post_norms=False)
  other = model.forward({**params, "layers": {k: v for k, v in params["layers"].items()
                                              if not k.startswith("post_")}},
                        tokens, no_post)
  assert np.abs(np.asarray(other) - theirs).max() > 1e-3


# config.json of google/gemma-2-2b (abridged) and google/gemma-3-1b-pt, as
# published: no layer_types, Gemma 3's RoPE bases as rope_theta and
# rope_local_base_freq.
_GEMMA2_JSON = dict(
    architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000,
    hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
    query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=10000.0,
    sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    cache_implementation="hybrid")
_GEMMA3_JSON = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144,
    hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
    rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
    rope_scaling=None, sliding_window=512, sliding_window_pattern=6,
    attn_logit_softcapping=None, final_logit_softcapping=None)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gemma3_linear"])
def test_published_gemma_configs_read_as_transformers_reads_them(name):
  transformers = pytest.importorskip("transformers")
  hf_json = {"gemma2": _GEMMA2_JSON, "gemma3": _GEMMA3_JSON,
             "gemma3_linear": {**_GEMMA3_JSON, "rope_scaling": {
                 "rope_type": "linear", "factor": 8.0}}}[name]
  config = hf.config_from_hf(hf_json)
  theirs = transformers.AutoConfig.for_model(**{k: v for k, v in hf_json.items()
                                                if k != "architectures"})
  assert config.sliding_windows == tuple(
      theirs.sliding_window if t == "sliding_attention" else None
      for t in theirs.layer_types)
  assert config.post_norms and config.tie_embeddings
  assert config.query_pre_attn_scalar is None  # == head_dim: the plain scale
  if name == "gemma2":
    assert config.sliding_windows[:2] == (4096, None)
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert (config.rope_theta, config.local_rope_theta) == (10000.0, None)
    assert not config.qk_norm
  else:
    assert config.sliding_windows[:6] == (512,) * 5 + (None,)
    assert config.qk_norm and config.attn_logit_softcap is None
    rope = theirs.rope_parameters
    assert config.rope_theta == rope["full_attention"]["rope_theta"] == 1e6
    assert config.local_rope_theta == rope["sliding_attention"]["rope_theta"] == 1e4
    assert config.rope_scaling_factor == rope["full_attention"].get("factor", 1.0)
    assert config.rope_scaling_factor == (8.0 if name == "gemma3_linear" else 1.0)
  assert hf.config_from_hf(hf.config_to_hf(config)) == config


def test_multimodal_gemma3_is_refused_with_a_pointer_to_the_text_model():
  multimodal = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3",
                    text_config=dict(_GEMMA3_JSON, model_type="gemma3_text"))
  with pytest.raises(ValueError, match="multimodal.*Gemma3ForCausalLM"):
    hf.config_from_hf(multimodal)
  with pytest.raises(ValueError, match="bidirectional"):
    hf.config_from_hf({**_GEMMA3_JSON, "use_bidirectional_attention": True})
  with pytest.raises(ValueError, match="yarn"):
    hf.config_from_hf({**_GEMMA3_JSON, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_the_projects_own_model_exports_as_llama(tmp_path):
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  config = model.TransformerConfig.tiny(vocab_size=VOCAB)
  params = model.init_params(config, jax.random.key(0))
  hf.save_hf_checkpoint(str(tmp_path), config, params)
  net = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  assert type(net).__name__ == "LlamaForCausalLM"
  tokens = _tokens(4)
  np.testing.assert_allclose(_torch_logits(torch, net, tokens),
                             np.asarray(model.forward(params, tokens, config)), atol=1e-4)
  reloaded, again = hf.load_hf_checkpoint(str(tmp_path))
  assert reloaded == config
  chex_equal = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                            params, again)
  assert all(jax.tree.leaves(chex_equal))


def test_configs_no_architecture_expresses_are_refused():
  base = model.TransformerConfig.tiny(vocab_size=VOCAB)
  for change, match in [(dict(qkv_bias=True, qk_norm=True), "both"),
                        (dict(norm_plus_one=True), "Gemma"),
                        (dict(final_logit_softcap=30.0), "soft-capping"),
                        (dict(post_norms=True), "post_norms"),
                        (dict(query_pre_attn_scalar=12), "query_pre_attn_scalar"),
                        (dict(rope_scaling_factor=2.0), "Gemma 3 only")]:
    with pytest.raises(ValueError, match=match):
      hf.config_to_hf(dataclasses.replace(base, **change))
  gemma2 = dataclasses.replace(base, norm_plus_one=True, embed_scale=True,
                               mlp_activation="gelu", post_norms=True)
  assert hf.architecture_of(gemma2) == "Gemma2ForCausalLM"
  gemma3 = dataclasses.replace(gemma2, qk_norm=True)
  assert hf.architecture_of(gemma3) == "Gemma3ForCausalLM"
  for config, change, match in [
      (gemma2, dict(local_rope_theta=50.0, sliding_windows=(2, None)), "Gemma 3 only"),
      (gemma3, dict(attn_logit_softcap=50.0), "Gemma 2 only"),
      (gemma3, dict(sliding_windows=(2, 3)), "one sliding window")]:
    with pytest.raises(ValueError, match=match):
      hf.config_to_hf(dataclasses.replace(config, **change))


def test_sharded_checkpoint_and_bf16_compute(tmp_path):
  torch, net = _tiny_hf_model("llama", tie=False)
  net.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  assert len(list(tmp_path.glob("*.safetensors"))) > 1
  config, params = hf.load_hf_checkpoint(str(tmp_path), dtype="bfloat16")
  assert config.dtype == "bfloat16"
  assert params["embed"].dtype == np.float32
  tokens = _tokens(1)
  ours = np.asarray(model.forward(params, tokens, config))
  theirs = _torch_logits(torch, net, tokens)
  assert np.abs(ours - theirs).max() < 0.1  # bf16 compute, fp32 params.


def test_qwen2_sliding_window_matches_torch(tmp_path):
  torch, net = _tiny_hf_model("qwen2", tie=False, use_sliding_window=True,
                              sliding_window=3, max_window_layers=1)
  net.save_pretrained(tmp_path, safe_serialization=True)
  config, params = hf.load_hf_checkpoint(str(tmp_path))
  assert config.sliding_windows == (None, 3)
  tokens = _tokens(2)
  ours = np.asarray(model.forward(params, tokens, config))
  np.testing.assert_allclose(ours, _torch_logits(torch, net, tokens),
                             atol=1e-4, rtol=0)
  # The window matters: the same weights with global attention differ.
  glob = model.forward(params, tokens,
                       dataclasses.replace(config, sliding_windows=None))
  assert np.abs(np.asarray(glob) - ours).max() > 1e-3
  # Exported, the windows come back in transformers and in our loader.
  hf.save_hf_checkpoint(str(tmp_path / "out"), config, params)
  assert hf.load_hf_checkpoint(str(tmp_path / "out"))[0] == config
  transformers = pytest.importorskip("transformers")
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  np.testing.assert_allclose(_torch_logits(torch, back, tokens), ours, atol=1e-4, rtol=0)


_LLAMA_JSON = dict(architectures=["LlamaForCausalLM"], model_type="llama",
                   vocab_size=32, hidden_size=16, intermediate_size=32,
                   num_hidden_layers=1, num_attention_heads=2)


def test_llama31_rope_is_read_both_ways_and_matters(tmp_path):
  _, net = _tiny_hf_model("llama31", tie=False)
  net.save_pretrained(tmp_path, safe_serialization=True)
  config, params = hf.load_hf_checkpoint(str(tmp_path))
  assert config.rope_llama3 == (8.0, 1.0, 4.0, 64)
  old_style = {**_LLAMA_JSON, "rope_theta": 5e5, "rope_scaling": {
      "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}}  # Llama 3.2's config.json
  assert hf.config_from_hf(old_style).rope_llama3 == (32.0, 1.0, 4.0, 8192)
  tokens = _tokens()
  plain = dataclasses.replace(config, rope_llama3=None)
  assert np.abs(model.forward(params, tokens, config)
                - model.forward(params, tokens, plain)).max() > 1e-3
  with pytest.raises(ValueError, match="two RoPE scalings"):
    dataclasses.replace(config, rope_scaling_factor=2.0).validate()


def test_config_from_hf_defaults_and_old_style_rope():
  config = hf.config_from_hf({**_LLAMA_JSON, "rope_theta": 123.0,
                              "rope_scaling": None})
  assert config.rope_theta == 123.0
  assert (config.n_kv_heads, config.head_dim) == (2, 8)
  assert not config.tie_embeddings and not config.qkv_bias


@pytest.mark.parametrize("bad, match", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
     "LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM.*GemmaForCausalLM"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}),
     "yarn"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "linear"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="relu"), "relu"),
])
def test_config_from_hf_rejects_unsupported(bad, match):
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf({**_LLAMA_JSON, **bad})


def test_unsupported_architecture_checkpoint_raises(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(
      {**_LLAMA_JSON, "architectures": ["MistralForCausalLM"],
       "model_type": "mistral"}))
  with pytest.raises(ValueError, match="supported.*LlamaForCausalLM"):
    hf.load_hf_checkpoint(str(tmp_path))


def test_unexpected_tensor_raises(tmp_path):
  _, net = _tiny_hf_model("llama", tie=False)
  net.save_pretrained(tmp_path, safe_serialization=True)
  path = tmp_path / "model.safetensors"
  tensors = load_file(path)
  tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
  save_file(tensors, path)
  with pytest.raises(ValueError, match="o_proj.bias"):
    hf.load_hf_checkpoint(str(tmp_path))


# config.json of published checkpoints, every entry as shipped but the sizes.
_PUBLISHED = {
    "Qwen2.5-0.5B-Instruct": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", attention_dropout=0.0,
        bos_token_id=151643, eos_token_id=151645, hidden_act="silu", hidden_size=896,
        intermediate_size=4864, max_position_embeddings=32768, max_window_layers=21,
        num_attention_heads=14, num_hidden_layers=24, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=32768,
        tie_word_embeddings=True, torch_dtype="bfloat16", use_cache=True,
        use_sliding_window=False, vocab_size=151936),
    "Qwen3-0.6B": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
        attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645, head_dim=128,
        hidden_act="silu", hidden_size=1024, intermediate_size=3072,
        max_position_embeddings=40960, max_window_layers=28, num_attention_heads=16,
        num_hidden_layers=28, num_key_value_heads=8, rms_norm_eps=1e-6, rope_scaling=None,
        rope_theta=1000000, sliding_window=None, tie_word_embeddings=True,
        torch_dtype="bfloat16", use_cache=True, use_sliding_window=False, vocab_size=151936),
    "Llama-3.2-1B-Instruct": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
        attention_dropout=0.0, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
        head_dim=64, hidden_act="silu", hidden_size=2048, intermediate_size=8192,
        max_position_embeddings=131072, mlp_bias=False, num_attention_heads=32,
        num_hidden_layers=16, num_key_value_heads=8, pretraining_tp=1, rms_norm_eps=1e-5,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        rope_theta=500000.0, tie_word_embeddings=True, torch_dtype="bfloat16",
        use_cache=True, vocab_size=128256),
    "gemma-2-2b-it": _GEMMA2_JSON,
    "gemma-3-1b-it": _GEMMA3_JSON,
}


@pytest.mark.parametrize("name", sorted(_PUBLISHED))
def test_published_configs_scaled_down_match_transformers(name, tmp_path):
  """Each published config.json, with its sizes shrunk (and, for Llama 3.2,
  its RoPE context, so every frequency band is hit): transformers builds
  the model from it, and ours loads it with the same logits."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               query_pre_attn_scalar=16, sliding_window=4, max_window_layers=3)
  hf_json = {**_PUBLISHED[name], **{k: v for k, v in small.items()
                                     if k in _PUBLISHED[name] and v is not None}}
  if name.startswith("Llama"):
    hf_json["rope_scaling"] = {**hf_json["rope_scaling"], "original_max_position_embeddings": 64}
  hf_json.pop("bos_token_id", None), hf_json.pop("eos_token_id", None)
  theirs_config = transformers.AutoConfig.for_model(
      **{k: v for k, v in hf_json.items() if k != "architectures"})
  torch.manual_seed(0)
  net = transformers.AutoModelForCausalLM.from_config(theirs_config, dtype=torch.float32)
  with torch.no_grad():
    for p in net.parameters():
      p.add_(0.1 * torch.randn_like(p))
  net.eval().save_pretrained(tmp_path, safe_serialization=True)
  config, params = hf.load_hf_checkpoint(str(tmp_path))
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
  np.testing.assert_allclose(np.asarray(model.forward(params, tokens, config)),
                             _torch_logits(torch, net, tokens), atol=1e-4, rtol=0)
