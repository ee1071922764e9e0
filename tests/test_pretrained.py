"""A pretrained policy end to end: a checkpoint built locally with
transformers, ``config.model.init_from``, SFT and RL on a host environment
with a tool, export, and the exported model and tokenizer back in
transformers (the deployment check)."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from agentic_rl.model import hf
from agentic_rl.train import checkpoint, loop
from agentic_rl.train import config as config_lib
from agentic_rl.train import metrics as metrics_lib
from agentic_rl.train import run as run_lib
from experiments import export as export_cli
from experiments import tiny_checkpoint
from experiments.configs import default

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

_ADD = {"name": "add", "description": "the sum of two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}


class AddWithTool:
  """``a + b`` for small a, b: the tool adds, the answer ends the episode."""

  tools = [_ADD]

  def reset(self, seed: int) -> str:
    self.a, self.b = seed % 7, (seed // 7) % 5
    return f"What is {self.a} + {self.b}? Answer <answer>n</answer>."

  def call_tool(self, name, arguments):
    return str(arguments["a"] + arguments["b"]), 0.0, False

  def step(self, action: str):
    found = re.search(r"<answer>\s*(-?\d+)\s*</answer>", action)
    return "", float(bool(found) and int(found.group(1)) == self.a + self.b), True

  def demonstration(self, seed: int) -> list[str]:
    self.reset(seed)
    call = json.dumps({"name": "add", "arguments": {"a": self.a, "b": self.b}})
    return [f"<tool_call>\n{call}\n</tool_call>", f"<answer>{self.a + self.b}</answer>"]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("tiny_qwen2"))
  size = tiny_checkpoint.write_tokenizer("qwen2", out)
  tiny_checkpoint.write_model("qwen2", out, size)
  return out


def _cfg(init_from):
  cfg = default.get_config("tiny")
  cfg.model.init_from = init_from
  cfg.tasks.update(source="host", host_env=f"{__name__}:AddWithTool", train_size=64,
                   test_size=8, max_obs_tokens=16)
  cfg.sampling.update(max_total_tokens=512, max_new_tokens_per_turn=32, max_turns=3)
  cfg.sft.update(steps=1, num_demos=8, batch_size=8, warmup_steps=0, demo_noise=0.0)
  cfg.rl.update(iterations=2, prompts_per_step=2, group_size=2)
  cfg.eval.update(num_prompts=2, pass_k=2, pass_k_prompts=1, batch_rows=2)
  cfg.export.update(deploy_check="on", check_prompts=2)
  return cfg


@pytest.mark.slow
def test_a_checkpoint_trains_exports_and_serves_the_same_distribution(checkpoint_dir, tmp_path):
  cfg = _cfg(checkpoint_dir)
  run = run_lib.build(cfg)
  assert run.model_config.qkv_bias and run.model_config.vocab_size == 704  # the checkpoint's
  # The demonstrations are episodes the host loop plays in the chat template:
  # an episode's tokens are exactly apply_chat_template of its conversation.
  start = hf.load_hf_params(checkpoint_dir, run.model_config)
  demos = run.demonstrations(start, cfg.sft, jax.random.key(0))
  hf_tok = transformers.AutoTokenizer.from_pretrained(checkpoint_dir)
  env = AddWithTool()
  seed = int(run.tasks.seeds("demo", np.arange(1))[0])
  obs = env.reset(seed)
  call, answer = env.demonstration(seed)
  conversation = [
      {"role": "user", "content": obs},
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
          "name": "add", "arguments": {"a": env.a, "b": env.b}}}]},
      {"role": "tool", "content": str(env.a + env.b)},
      {"role": "assistant", "content": answer}]
  want = hf_tok.apply_chat_template(conversation, tools=[{"type": "function", "function": _ADD}],
                                    tokenize=True, return_dict=False)
  want = want[:len(want) - list(reversed(want)).index(run.codec.ids.end)]  # up to its last <|im_end|>
  got = demos["tokens_BxT"][0][:len(want)].tolist()
  assert got == list(want)
  assert demos["loss_mask_BxT"][0][len(want):].sum() == 0  # the episode ends there

  workdir, out = str(tmp_path / "run"), str(tmp_path / "hf")
  summary = loop.train(cfg, workdir)
  assert summary["steps"] == 3  # one SFT step, two RL iterations
  assert 0 < summary["shift/deploy_tokens"] and summary["shift/deploy_logprob_diff_max"] <= 1e-5
  like = jax.eval_shape(lambda: jax.tree.map(np.asarray, start))
  trained = checkpoint.load_params(workdir, like=like)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(start),
                                                      jax.tree.leaves(trained)))

  assert export_cli.export(workdir, out) == "Qwen2ForCausalLM"
  net = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  served = transformers.AutoTokenizer.from_pretrained(out)
  assert served.apply_chat_template(conversation, tokenize=True, return_dict=False) == \
      hf_tok.apply_chat_template(conversation, tokenize=True, return_dict=False)
  assert net.config.eos_token_id == hf.read_config(checkpoint_dir)["eos_token_id"]
  check = export_cli.deploy_check(workdir, out, num_prompts=2)
  assert check["shift/deploy_tokens"] > 0 and check["shift/deploy_logprob_diff_max"] <= 1e-5


def test_init_from_is_refused_with_jitted_families_and_a_missing_directory(checkpoint_dir,
                                                                           tmp_path):
  cfg = _cfg(checkpoint_dir)
  cfg.tasks.source = "jax"
  with pytest.raises(config_lib.ConfigError, match="set --config.tasks.source=host"):
    config_lib.validate(cfg)
  cfg = _cfg(str(tmp_path / "nowhere"))
  with pytest.raises(config_lib.ConfigError, match="is not a directory"):
    config_lib.validate(cfg)
  os.makedirs(tmp_path / "empty")
  cfg = _cfg(str(tmp_path / "empty"))
  with pytest.raises(config_lib.ConfigError, match="no config.json|tokenizer"):
    config_lib.validate(cfg)


def test_lora_on_a_checkpoint_trains_adapters_and_exports_them_merged(checkpoint_dir, tmp_path):
  cfg = _cfg(checkpoint_dir)
  cfg.stages = ("sft",)  # every step moves the adapters (an untrained policy's RL groups may not)
  cfg.model.update(lora_rank=4, lora_targets=("wq", "wv", "w_up"))
  summary = loop.train(cfg, str(tmp_path / "run"))
  # The deployment check scores the merged export against the adapted policy.
  assert summary["shift/deploy_logprob_diff_max"] <= 1e-5
  run = run_lib.build(cfg)
  start = hf.load_hf_params(checkpoint_dir, run.model_config)
  params = export_cli._load(str(tmp_path / "run"))[2]  # pylint: disable=protected-access
  for name, value in start["layers"].items():
    np.testing.assert_array_equal(np.asarray(params["layers"][name]), value)  # frozen
  assert any(np.abs(np.asarray(params["layers"][f"lora_{w}_b"])).max() > 0
             for w in ("wq", "wv", "w_up"))
  assert "lora_wk_a" not in params["layers"]


@pytest.mark.slow
def test_a_checkpoint_trains_on_two_devices_as_on_one(checkpoint_dir, tmp_path):
  """The checkpoint's weights placed FSDP-sharded over 2 simulated devices
  give the one-device run's SFT losses."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  code = ("import sys, json; import test_pretrained as t; from agentic_rl.train import loop; "
          "cfg = t._cfg(sys.argv[1]); cfg.stages = ('sft',); cfg.sft.steps = 2; "
          "cfg.export.deploy_check = 'off'; cfg.mesh.update(data=1, fsdp=2); "
          "import jax; assert jax.device_count() == 2; loop.train(cfg, sys.argv[2])")
  two = str(tmp_path / "two")
  done = subprocess.run(
      [sys.executable, "-c", code, checkpoint_dir, two], cwd=root, capture_output=True,
      text=True, timeout=900, env=dict(
          os.environ, JAX_PLATFORMS="cpu",
          XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
          PYTHONPATH=os.pathsep.join([root, os.path.dirname(os.path.abspath(__file__))])))
  assert done.returncode == 0, done.stderr[-3000:]
  cfg = _cfg(checkpoint_dir)
  cfg.stages, cfg.sft.steps, cfg.export.deploy_check = ("sft",), 2, "off"
  one = str(tmp_path / "one")
  loop.train(cfg, one)
  got, want = (metrics_lib.read_metrics(os.path.join(d, "metrics.jsonl")) for d in (two, one))
  np.testing.assert_allclose([r["sft/nll"] for r in got], [r["sft/nll"] for r in want],
                             rtol=1e-5)
