"""SentencePiece tokenizer with the project's reserved tokens.

Every reserved piece below is a SentencePiece ``user_defined_symbol``: it always
encodes as exactly one id, wherever it appears. Digits and the calculator's
operators are reserved too, so in-jit tools can read numbers from token ids
with a lookup table (no detokenisation inside ``jax.jit``).

The model file is trained by ``python -m experiments.train_tokenizer`` and
shipped in ``agentic_rl/text/assets/``; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm

DEFAULT_MODEL_PATH = os.path.join(os.path.dirname(__file__), "assets", "tokenizer.model")

# Ids fixed by the trainer options (see ``train_sentencepiece``).
PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# Conversation framing: role markers, end of turn, tool and answer tags.
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESULT_OPEN, TOOL_RESULT_CLOSE = "<tool_result>", "</tool_result>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
NEWLINE = "\n"
FRAMING = (SYSTEM, USER, ASSISTANT, END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE,
           TOOL_RESULT_OPEN, TOOL_RESULT_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)

# Single-id symbols that in-jit tools parse.
DIGITS = tuple("0123456789")
OPERATORS = ("+", "-", "*", "/", "=", ":", ",", "(", ")")
# Tool names are single ids, so a call's name is one token to compare.
TOOL_NAMES = ("calc", "store", "recall", "lookup", "open")

USER_DEFINED_SYMBOLS = FRAMING + (NEWLINE,) + DIGITS + OPERATORS + TOOL_NAMES
SPACE_PIECE = "\u2581"  # SentencePiece's visible space.


def train_sentencepiece(corpus: Iterable[str], model_prefix: str, *,
                        vocab_size: int = 512) -> str:
  """Trains a BPE SentencePiece model; returns the ``.model`` path.

  Identity normalisation and no dummy prefix keep spaces and newlines intact on
  a round trip; ``split_digits`` and reserved digits give one id per digit;
  ``byte_fallback`` keeps any text encodable.
  """
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(corpus),
      model_prefix=model_prefix,
      model_type="bpe",
      vocab_size=vocab_size,
      character_coverage=1.0,
      byte_fallback=True,
      split_digits=True,
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      add_dummy_prefix=False,
      allow_whitespace_only_pieces=True,
      user_defined_symbols=list(USER_DEFINED_SYMBOLS),
      pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
      pad_piece=PAD, unk_piece=UNK, bos_piece=BOS, eos_piece=EOS,
      hard_vocab_limit=False,
      num_threads=2,
      minloglevel=2,
  )
  return model_prefix + ".model"


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """A loaded SentencePiece model. Create with :func:`load_tokenizer`."""

  sp: spm.SentencePieceProcessor

  @property
  def vocab_size(self) -> int:
    return self.sp.get_piece_size()

  pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

  def encode(self, text: str) -> list[int]:
    """Text to ids; reserved pieces become their single id."""
    return self.sp.encode(text, out_type=int)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Ids to text. pad/bos/eos decode to nothing."""
    return self.sp.decode([int(i) for i in ids])

  def piece_id(self, piece: str) -> int:
    """The id of a piece that must exist as one token."""
    i = self.sp.piece_to_id(piece)
    if i == UNK_ID and piece != UNK:
      raise ValueError(f"piece {piece!r} is not in the tokenizer's vocabulary")
    return i

  def id_to_piece(self, i: int) -> str:
    return self.sp.id_to_piece(int(i))

  def require(self, pieces: Iterable[str]) -> None:
    """Raises ValueError naming every reserved piece the model lacks."""
    missing = [p for p in pieces
               if self.sp.piece_to_id(p) == UNK_ID or
               self.sp.encode(p, out_type=int) != [self.sp.piece_to_id(p)]]
    if missing:
      raise ValueError(
          f"tokenizer lacks single-id pieces {missing}; retrain it with "
          "`python -m experiments.train_tokenizer` (it reserves "
          "agentic_rl.text.tokenizer.USER_DEFINED_SYMBOLS)")


def load_tokenizer(path: str = DEFAULT_MODEL_PATH) -> Tokenizer:
  """Loads a model file and checks it has every reserved piece."""
  if not os.path.exists(path):
    raise ValueError(f"no tokenizer model at {path!r}; train one with "
                     "`python -m experiments.train_tokenizer`")
  tok = Tokenizer(spm.SentencePieceProcessor(model_file=path))
  tok.require(USER_DEFINED_SYMBOLS)
  return tok
