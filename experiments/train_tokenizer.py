r"""Trains the project's SentencePiece tokenizer from the task corpus.

  python -m experiments.train_tokenizer [--out agentic_rl/text/assets/tokenizer]

The corpus is every task family's prompts and scripted demonstrations, rendered
through the conversation codec's text form, plus a little general text, so the
BPE merges fit what the policy reads and writes. Deterministic for a seed.
"""

import random

from absl import app
from absl import flags

from agentic_rl.text import tokenizer as tokenizer_lib

_OUT = flags.DEFINE_string(
    "out", "agentic_rl/text/assets/tokenizer", "Model prefix to write.")
_VOCAB = flags.DEFINE_integer("vocab_size", 512, "Vocabulary size.")
_SEED = flags.DEFINE_integer("seed", 0, "Corpus seed.")
_LINES = flags.DEFINE_integer("lines", 20000, "Corpus lines.")

_WORDS = ("the", "a", "of", "to", "and", "is", "what", "value", "result",
          "compute", "find", "answer", "number", "key", "box", "item", "error",
          "step", "then", "first", "next", "use", "tool", "call", "start",
          "from", "follow", "hops", "memory", "hidden", "which", "contains",
          "empty", "not", "found", "division", "by", "zero", "overflow",
          "malformed", "unknown", "you", "can", "are", "in", "with", "each",
          "give", "final", "only", "true", "false", "ok", "stored", "missing")


def corpus(seed: int, lines: int):
  """Yields corpus lines: task text from the environments, then a quarter as
  many filler lines."""
  rng = random.Random(seed)
  try:
    from agentic_rl.envs import corpus as env_corpus  # pylint: disable=g-import-not-at-top
    yield from env_corpus.text_corpus(seed=seed, lines=lines)
  except ImportError:
    pass
  tools = tokenizer_lib.TOOL_NAMES
  for _ in range(lines // 4):
    words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
    num = str(rng.randint(0, 10**rng.randint(1, 12)))
    call = f"{rng.choice(tools)} {num}{rng.choice('+-*/')}{rng.randint(0, 999)}"
    yield (f"{' '.join(words).capitalize()} {num}.\n"
           f"<tool_call>{call}</tool_call><tool_result>{num}</tool_result>"
           f"<answer>{num}</answer>")


def main(argv):
  del argv
  path = tokenizer_lib.train_sentencepiece(
      corpus(_SEED.value, _LINES.value), _OUT.value, vocab_size=_VOCAB.value)
  tok = tokenizer_lib.load_tokenizer(path)
  print(f"wrote {path}: vocab {tok.vocab_size}")


if __name__ == "__main__":
  app.run(main)
