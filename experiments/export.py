r"""Export a run's policy as a Hugging Face checkpoint.

  python -m experiments.export --workdir=/tmp/run --out=/tmp/run/hf

Writes ``config.json`` and ``model.safetensors`` for the latest checkpoint
of the run in ``--workdir`` (its saved ``config.json`` says the model):
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads it, as
``LlamaForCausalLM`` for the project's own model (or Qwen2, Qwen3, Gemma
where the config has their features; ``agentic_rl.model.hf``).
"""

import os

from absl import app
from absl import flags

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (with checkpoints).",
                               required=True)
_OUT = flags.DEFINE_string("out", None, "Directory to write the checkpoint to.",
                           required=True)


def export(workdir: str, out: str) -> str:
  """Writes the latest checkpoint of ``workdir`` to ``out``; returns the
  architecture written."""
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top

  from agentic_rl import model as model_lib  # pylint: disable=g-import-not-at-top
  from agentic_rl.model import hf  # pylint: disable=g-import-not-at-top
  from agentic_rl.text import load_tokenizer  # pylint: disable=g-import-not-at-top
  from agentic_rl.train import checkpoint, resume  # pylint: disable=g-import-not-at-top
  from agentic_rl.train import config as config_lib  # pylint: disable=g-import-not-at-top

  saved = resume.load_run_config(workdir)
  if saved is None:
    raise ValueError(f"{workdir} has no config.json: is it a run directory?")
  cfg = ml_collections.ConfigDict(saved)
  config = config_lib.model_config(cfg, load_tokenizer().vocab_size)
  like = jax.eval_shape(lambda: model_lib.init_params(config, jax.random.key(0)))
  params = checkpoint.load_params(workdir, like=like)
  hf.save_hf_checkpoint(out, config, params)
  return hf.architecture_of(config)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    arch = export(_WORKDIR.value, _OUT.value)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None
  print(f"wrote {arch} to {os.path.abspath(_OUT.value)}")


if __name__ == "__main__":
  app.run(main)
