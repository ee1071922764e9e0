"""GGUF checkpoints: architecture, weights, tokenizer and chat template read
from small files written as llama.cpp writes them (``tests/gguf_files.py``),
against the transformers model they came from and against transformers
loading the same file; the refusals; a GGUF policy trained through
``experiments.train``; the real SmolLM2 file (slow)."""

import os

import jax
import numpy as np
import pytest

from agentic_rl import model
from agentic_rl.model import gguf as gguf_lib
from agentic_rl.model import hf
from agentic_rl.text import load_codec
from agentic_rl.text.hf_tokenizer import HFTokenizer
from agentic_rl.train import loop
from experiments import get_model, tiny_checkpoint
from experiments.configs import default

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import gguf_files  # noqa: E402  (needs gguf)

TEXTS = ["Hello world!", "What is 12345 + 678? It is 13023.", "  two spaces\n\nand\ttabs",
         "<|im_start|>user\nHi<|im_end|>", "Ünïcödé 中文 🎉", "def f(x):\n    return x**2",
         '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>']
CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 12 + 30?"},
                {"role": "assistant", "content": "42"}]


@pytest.fixture(autouse=True)
def _full_precision():
  with jax.default_matmul_precision("float32"):
    yield


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("qwen2_tok"))
  tiny_checkpoint.write_tokenizer("qwen2", out)
  return out


def _net(arch: str, vocab: int, *, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=96):
  torch.manual_seed(0)
  kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, rms_norm_eps=1e-5, tie_word_embeddings=arch != "llama",
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
  if arch.startswith("gemma"):
    kwargs["hidden_activation"] = "gelu_pytorch_tanh"
  if arch in ("gemma2", "gemma3"):
    kwargs.update(sliding_window=4, query_pre_attn_scalar=head_dim, final_logit_softcapping=3.0)
  if arch == "gemma2":
    kwargs["attn_logit_softcapping"] = 5.0
  if arch == "gemma3":  # llama.cpp's Gemma 3: every sixth layer global, local RoPE base 1e4.
    kwargs.update(sliding_window_pattern=6, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
  classes = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
             "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
             "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
             "gemma": (transformers.GemmaForCausalLM, transformers.GemmaConfig),
             "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config),
             "gemma3": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig)}
  model_cls, config_cls = classes[arch]
  net = model_cls(config_cls(**kwargs))
  with torch.no_grad():  # Non-trivial norms and biases, so a mix-up shows.
    for p in net.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return net.eval()


def _vocab(tokenizer_dir) -> int:
  size = HFTokenizer.from_pretrained(tokenizer_dir).vocab_size
  return -(-size // 64) * 64


def _logits(config, params, tokens):
  return np.asarray(model.forward(params, tokens, config))


def _tokens(vocab, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, (2, 12))


@pytest.mark.parametrize("arch", gguf_lib.ARCHITECTURES)
def test_each_architecture_loads_as_the_checkpoint_it_was_written_from(arch, tokenizer_dir,
                                                                      tmp_path):
  vocab = _vocab(tokenizer_dir)
  net = _net(arch, vocab)
  path = str(tmp_path / f"{arch}.gguf")
  gguf_files.write_gguf(net, tokenizer_dir, path, arch=arch)
  config, params = gguf_lib.load_gguf(path)
  assert (config.n_layers, config.n_heads, config.n_kv_heads, config.vocab_size) == (2, 4, 2, vocab)
  assert config.tie_embeddings == (arch != "llama")
  tokens = _tokens(vocab)
  with torch.no_grad():
    want = net(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(_logits(config, params, tokens), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K",
                                   "Q6_K"])
def test_each_quant_type_dequantises_as_transformers_reads_the_same_file(qtype, tokenizer_dir,
                                                                         tmp_path):
  vocab = _vocab(tokenizer_dir)
  net = _net("llama", vocab, hidden=256, heads=4, kv_heads=2, head_dim=64, mlp=512)
  path = str(tmp_path / f"llama-{qtype}.gguf")
  gguf_files.write_gguf(net, tokenizer_dir, path, arch="llama", qtype=qtype)
  config, params = gguf_lib.load_gguf(path)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
  tokens = _tokens(vocab, seed=1)
  with torch.no_grad():
    want = theirs(torch.tensor(tokens)).logits.numpy()
  got = _logits(config, params, tokens)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "smollm", "default"])
def test_tokenizer_and_chat_template_match_transformers(pre, tokenizer_dir, tmp_path):
  vocab = _vocab(tokenizer_dir)
  path = str(tmp_path / "tok.gguf")
  gguf_files.write_gguf(_net("qwen2", vocab), tokenizer_dir, path, arch="qwen2", pre=pre)
  ours = HFTokenizer.from_pretrained(path)
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
  for text in TEXTS:
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    assert ours.decode(ours.encode(text)) == text
  assert ours.eos_id == theirs.eos_token_id
  codec = load_codec(path)
  assert codec.render(CONVERSATION) == theirs.apply_chat_template(CONVERSATION, tokenize=False)
  assert codec.ids.end == theirs.convert_tokens_to_ids("<|im_end|>")
  # Written back out (a GGUF run's export), transformers reads the same tokenizer.
  ours.save(str(tmp_path / "out"))
  saved = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  for text in TEXTS:
    assert saved.encode(text, add_special_tokens=False) == ours.encode(text)
  assert saved.apply_chat_template(CONVERSATION, tokenize=False) == codec.render(CONVERSATION)


def _minimal(path, arch="llama", tokenizer_model="gpt2", pre="qwen2", tensor_type=None):
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(1)
  w.add_embedding_length(32)
  w.add_feed_forward_length(64)
  w.add_head_count(2)
  w.add_vocab_size(4)
  w.add_tokenizer_model(tokenizer_model)
  w.add_tokenizer_pre(pre)
  w.add_token_list(["a", "b", "c", "d"])
  w.add_eos_token_id(0)
  if tensor_type is None:
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
  else:
    w.add_tensor("token_embd.weight", np.zeros((4, 40), np.uint8), raw_dtype=tensor_type)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def test_what_cannot_be_read_is_refused_naming_it(tmp_path):
  path = _minimal(str(tmp_path / "phi.gguf"), arch="phi3")
  with pytest.raises(ValueError, match="architecture 'phi3' is not supported"):
    gguf_lib.load_gguf(path)
  path = _minimal(str(tmp_path / "spm.gguf"), tokenizer_model="llama")
  with pytest.raises(ValueError, match="tokenizer model 'llama' is not supported"):
    HFTokenizer.from_pretrained(path)
  path = _minimal(str(tmp_path / "pre.gguf"), pre="mystery")
  with pytest.raises(ValueError, match="pre-tokenizer 'mystery' is not supported"):
    HFTokenizer.from_pretrained(path)
  path = _minimal(str(tmp_path / "q81.gguf"), tensor_type=gguf.GGMLQuantizationType.Q8_1)
  with pytest.raises(ValueError, match="type Q8_1, which this loader cannot dequantise"):
    gguf_lib.hf_tensors(path)
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
  with pytest.raises(ValueError, match="not a readable GGUF file"):
    gguf_lib.load_gguf(str(tmp_path / "junk.gguf"))


def test_the_smollm_variant_trains_a_gguf_policy_and_exports_what_transformers_serves(
    tokenizer_dir, tmp_path):
  """``--config=...:smollm --config.model.init_from=FILE.gguf`` with a tiny
  file: the architecture and codec are the file's, SFT and RL update it,
  and the exported checkpoint (weights and the rebuilt tokenizer) scores
  the policy's episodes in transformers as the learner does."""
  vocab = _vocab(tokenizer_dir)
  path = str(tmp_path / "tiny.gguf")
  gguf_files.write_gguf(_net("qwen2", vocab), tokenizer_dir, path, arch="qwen2")
  cfg = default.get_config("all,smollm")
  assert cfg.model.init_from == os.path.join(get_model.DEFAULT_OUT,
                                             os.path.basename(get_model.MODELS[
                                                 "smollm2-135m-instruct"][1]))
  cfg.model.init_from = path
  cfg.sft.update(steps=2, num_demos=16)
  cfg.rl.update(iterations=2, prompts_per_step=2, group_size=2)
  cfg.eval.update(every=2, num_prompts=2, pass_k_prompts=2, batch_rows=2)
  cfg.export.update(deploy_check="on", check_prompts=2)
  summary = loop.train(cfg, str(tmp_path / "run"))
  assert summary["steps"] == 4
  assert summary["shift/deploy_tokens"] > 0
  assert summary["shift/deploy_logprob_diff_max"] <= 1e-5


SMOLLM = os.environ.get("AGENTIC_RL_SMOLLM_GGUF", default.SMOLLM_GGUF)


@pytest.mark.slow
def test_the_smollm_variant_runs_on_the_real_file(tmp_path):
  """The README's command on the real SmolLM2 file, shortened to one step
  per stage: its demonstrations fill an SFT batch with the real tokenizer
  and chat template, and RL runs on them."""
  if not os.path.exists(SMOLLM):
    get_model.fetch("smollm2-135m-instruct", os.path.dirname(SMOLLM))
  cfg = default.get_config("all,smollm")
  cfg.model.init_from = SMOLLM
  cfg.sft.steps = 1
  cfg.rl.iterations = 1
  cfg.eval.update(num_prompts=2, pass_k_prompts=2, batch_rows=2)
  summary = loop.train(cfg, str(tmp_path / "run"))
  assert summary["steps"] == 2
  assert 0.0 <= summary["rl_success"] <= 1.0


@pytest.mark.slow
def test_the_real_smollm2_file_matches_transformers():
  if not os.path.exists(SMOLLM):
    get_model.fetch("smollm2-135m-instruct", os.path.dirname(SMOLLM))
  config, params = gguf_lib.load_gguf(SMOLLM)
  assert (config.n_layers, config.d_model, config.n_heads, config.n_kv_heads,
          config.vocab_size, config.tie_embeddings) == (30, 576, 9, 3, 49152, True)
  theirs = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(SMOLLM), gguf_file=os.path.basename(SMOLLM), dtype=torch.float32).eval()
  codec = load_codec(SMOLLM)
  tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(SMOLLM),
                                                   gguf_file=os.path.basename(SMOLLM))
  for text in TEXTS:
    assert codec.tokenizer.encode(text) == tok.encode(text, add_special_tokens=False)
  assert codec.render(CONVERSATION) == tok.apply_chat_template(CONVERSATION, tokenize=False)
  tokens = np.asarray([codec.tokenizer.encode(TEXTS[1] + " " + TEXTS[5])[:24]])
  with torch.no_grad():
    want = theirs(torch.tensor(tokens)).logits.numpy()
    exact = theirs.double()(torch.tensor(tokens)).logits.numpy()
  got = _logits(config, params, tokens)
  # Against transformers' float64 forward: within 1e-4, and no further
  # than transformers' own fp32 one (30 layers of fp32 rounding put the two
  # fp32 forwards up to about 1e-4 apart).
  assert np.abs(got - exact).max() <= max(1e-4, np.abs(want - exact).max())
  assert (got.argmax(-1) == want.argmax(-1)).all()
