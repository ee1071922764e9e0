"""A run's policy as a Hugging Face checkpoint, and the deployed distribution
measured.

:func:`export_policy` writes a directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads: the weights
(``agentic_rl.model.hf.save_hf_checkpoint``) and, for a policy that started
from a checkpoint (``config.model.init_from``), that checkpoint's tokenizer
files and chat template (a GGUF file's rebuilt as ``tokenizer.json``), so a server puts the same tokens around each turn
as the rollouts did.

:func:`deploy_check` is invariant 3's third distribution: the exported model
in transformers scores episodes the policy plays, and
``shift/deploy_logprob_diff_max`` is the largest per-token log-prob
difference from the learner's (fp32) over the policy's tokens. The trainer
runs it at the end of training (``config.export.deploy_check``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil

import jax
import numpy as np

from agentic_rl import model as model_lib
from agentic_rl.model import hf, lora, pretrained
from agentic_rl.rollout.context import scored_rows
from agentic_rl.text.hf_tokenizer import HFTokenizer

DEPLOY_CHECK = ("auto", "on", "off")
# What a checkpoint directory holds besides its weights and config.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model",
                   "generation_config.json")
# config.json entries of the source checkpoint that serving reads.
_CONFIG_EXTRAS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


def export_policy(cfg, config: model_lib.TransformerConfig, params, out: str) -> str:
  """Writes ``params`` (of model ``config``; LoRA adapters merged into the
  base, :func:`agentic_rl.model.lora.merge`) to the directory ``out`` as a
  Hugging Face checkpoint; returns the architecture written. ValueError
  when no supported architecture expresses ``config``."""
  config, params = lora.merge(params, config)
  hf.save_hf_checkpoint(out, config, params)
  source = cfg.model.init_from
  if source and pretrained.is_gguf(source):
    HFTokenizer.from_pretrained(source).save(out)
  elif source:
    for name in TOKENIZER_FILES:
      if os.path.exists(os.path.join(source, name)):
        shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
    extras = {k: v for k, v in pretrained.read_config(source).items() if k in _CONFIG_EXTRAS}
    written = hf.read_config(out)
    with open(os.path.join(out, "config.json"), "w") as f:
      json.dump({**written, **extras}, f, indent=1)
  return hf.architecture_of(config)


def transformers_available() -> bool:
  return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def wants_deploy_check(cfg, config: model_lib.TransformerConfig) -> bool:
  """Whether the run ends with :func:`deploy_check`: ``"on"``, or
  ``"auto"`` where torch and transformers are installed and the model
  exports. ``"on"`` without them is a ValueError naming the fix."""
  mode = cfg.export.deploy_check
  if mode not in DEPLOY_CHECK:
    raise ValueError(f"config.export.deploy_check is {mode!r}; valid: {', '.join(DEPLOY_CHECK)}")
  if mode == "off":
    return False
  if not transformers_available():
    if mode == "on":
      raise ValueError("config.export.deploy_check='on' needs torch and transformers: "
                       'pip install -e ".[test]" (or set it to auto)')
    return False
  try:
    hf.architecture_of(dataclasses.replace(config, lora_rank=0))  # exported merged
  except ValueError as e:
    if mode == "on":
      raise ValueError(f"config.export.deploy_check='on': the model does not export: {e}")
    return False
  return True


def deploy_check(run, params, out: str, num_prompts: int, sampling) -> dict[str, float]:
  """``shift/deploy_logprob_diff_max`` and ``..._mean`` of the checkpoint in
  ``out`` (written by :func:`export_policy` from ``params``) against the
  learner on ``num_prompts`` held-out episodes the policy plays with
  ``sampling`` (a ``SamplingConfig``), and the number of policy tokens
  compared (``shift/deploy_tokens``)."""
  import torch  # pylint: disable=g-import-not-at-top  (optional: the test extra)
  import transformers  # pylint: disable=g-import-not-at-top

  cfg, config = run.cfg, run.model_config
  ro = run.rollout(params, sampling, "test", np.arange(num_prompts),
                   jax.random.key(cfg.seed), 0, cfg.eval.batch_rows)
  rows = scored_rows(ro)  # every context an episode was played in
  tokens, mask = rows["tokens_RxT"], rows["loss_mask_RxT"][:, 1:] > 0
  full = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(params))
  fp32 = dataclasses.replace(config, dtype="float32", param_dtype="float32")
  with jax.default_matmul_precision("float32"):
    logits = model_lib.forward(full, tokens, fp32)
  ours = np.asarray(jax.nn.log_softmax(logits[:, :-1], axis=-1))
  net = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = torch.log_softmax(net(torch.tensor(tokens)).logits[:, :-1].float(), -1).numpy()
  targets = tokens[:, 1:, None]
  diff = np.abs(np.take_along_axis(ours, targets, -1) - np.take_along_axis(theirs, targets, -1))
  diff = diff[..., 0][mask]
  return {"shift/deploy_logprob_diff_max": float(diff.max(initial=0.0)),
          "shift/deploy_logprob_diff_mean": float(diff.mean()) if diff.size else 0.0,
          "shift/deploy_tokens": int(diff.size)}
