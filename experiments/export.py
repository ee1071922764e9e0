r"""Export a run's policy as a Hugging Face checkpoint.

  python -m experiments.export --workdir=/tmp/run --out=/tmp/run/hf

Writes ``config.json`` and ``model.safetensors`` for the latest checkpoint
of the run in ``--workdir`` (its saved ``config.json`` says the model), and
for a run that started from a checkpoint (``config.model.init_from``) its
tokenizer files and chat template:
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads it, as
``LlamaForCausalLM`` for the project's own model, or as the architecture of
the checkpoint the run started from (``agentic_rl.model.hf``). A LoRA run's
adapters are merged into its base (``agentic_rl.model.lora.merge``): the
export is a plain checkpoint of the adapted model.

With ``--check`` (needs torch and transformers) it then measures the
deployed distribution: the policy plays ``--check_prompts`` held-out
episodes, the exported model scores their tokens in transformers, and
``shift/deploy_logprob_diff_max`` (the largest per-token log-prob
difference from the learner's, fp32, over the policy's tokens) is printed
and written to ``OUT/deploy_check.json``.
"""

import json
import os

import jax
from absl import app
from absl import flags
from absl import logging

from agentic_rl import model as model_lib
from agentic_rl.model import lora
from agentic_rl.train import checkpoint, resume
from agentic_rl.train import config as config_lib
from agentic_rl.train import export as export_lib
from agentic_rl.train import run as run_lib
from agentic_rl.train import settings


def _load(workdir: str):
  """``(cfg, model config, params)`` of the latest checkpoint of a run (a
  LoRA run's with its base rebuilt, as on resume, and its adapters)."""
  saved = resume.saved_config(workdir)
  if saved is None:
    raise ValueError(f"{workdir} has no config.json: is it a run directory?")
  cfg = settings.parse(saved)
  config = config_lib.model_config(cfg)
  like = jax.eval_shape(lambda: model_lib.init_params(config, jax.random.key(0)))
  if not config.lora_rank:
    return cfg, config, checkpoint.load_params(workdir, like=like)
  adapters = checkpoint.load_params(workdir, like=lora.adapters(like))
  return cfg, config, checkpoint.restored_params(run_lib.build(cfg), adapters)


def export(workdir: str, out: str) -> str:
  """Writes the latest checkpoint of ``workdir`` to ``out`` (LoRA adapters
  merged); returns the architecture written."""
  cfg, config, params = _load(workdir)
  return export_lib.export_policy(cfg, config, params, out)


def deploy_check(workdir: str, out: str, num_prompts: int = 8) -> dict[str, float]:
  """:func:`agentic_rl.train.export.deploy_check` of the latest checkpoint
  of ``workdir``, exported in ``out``."""
  cfg, _, params = _load(workdir)
  return export_lib.deploy_check(run_lib.build(cfg), params, out, num_prompts,
                                 config_lib.sampling_config(cfg))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  try:
    arch = export(_WORKDIR.value, _OUT.value)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  print(f"wrote {arch} to {os.path.abspath(_OUT.value)}")
  if _CHECK.value:
    result = deploy_check(_WORKDIR.value, _OUT.value, _CHECK_PROMPTS.value)
    with open(os.path.join(_OUT.value, "deploy_check.json"), "w") as f:
      json.dump(result, f, indent=1)
    print(json.dumps(result))


def _define_flags():
  """The command line (defined only when run as a script: the module's
  functions are imported beside other experiments)."""
  global _WORKDIR, _OUT, _CHECK, _CHECK_PROMPTS
  _WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (with checkpoints).",
                                 required=True)
  _OUT = flags.DEFINE_string("out", None, "Directory to write the checkpoint to.",
                             required=True)
  _CHECK = flags.DEFINE_bool("check", False, "Score the run's rollouts with the exported "
                             "model in transformers against the learner.")
  _CHECK_PROMPTS = flags.DEFINE_integer("check_prompts", 8, "Held-out episodes to score.")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
