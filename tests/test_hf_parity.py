"""Parity of agentic_rl.model with Hugging Face Llama / Qwen2 / Qwen3 / Gemma (torch,
CPU, fp32), both ways: checkpoints imported and exported."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from agentic_rl import model
from agentic_rl.model import hf

VOCAB, SEQ = 128, 12


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
                tie_word_embeddings=tie, **extra)
  if arch == "gemma":
    kwargs["hidden_activation"] = "gelu_pytorch_tanh"
  model_cls, config_cls = {
      "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
      "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
      "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
      "gemma": (transformers.GemmaForCausalLM, transformers.GemmaConfig)}[arch]
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


ARCHS = ["llama", "qwen2", "qwen3", "gemma"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_torch(arch, tie, tmp_path):
  torch, net = _tiny_hf_model(arch, tie)
  net.save_pretrained(tmp_path, safe_serialization=True)
  config, params = hf.load_hf_checkpoint(str(tmp_path))
  assert config.tie_embeddings == tie
  assert config.qkv_bias == (arch == "qwen2") and config.qk_norm == (arch == "qwen3")
  assert config.norm_plus_one == config.embed_scale == (arch == "gemma")
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
  torch, net = _tiny_hf_model(arch, tie=arch == "gemma")
  net.save_pretrained(tmp_path / "in", safe_serialization=True)
  config, params = hf.load_hf_checkpoint(str(tmp_path / "in"))
  hf.save_hf_checkpoint(str(tmp_path / "out"), config, params)
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
                        (dict(final_logit_softcap=30.0), "soft-capping")]:
    with pytest.raises(ValueError, match=match):
      hf.config_to_hf(dataclasses.replace(base, **change))


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


def test_config_from_hf_defaults_and_old_style_rope():
  config = hf.config_from_hf({**_LLAMA_JSON, "rope_theta": 123.0,
                              "rope_scaling": None})
  assert config.rope_theta == 123.0
  assert (config.n_kv_heads, config.head_dim) == (2, 8)
  assert not config.tie_embeddings and not config.qkv_bias


@pytest.mark.parametrize("bad, match", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
     "LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM.*GemmaForCausalLM"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}),
     "llama3"),
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
