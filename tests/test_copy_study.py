"""experiments.copy_study: copying a tool's number into the answer, alone."""

import json

import numpy as np
import pytest

from agentic_rl import text
from experiments import copy_study
from experiments.configs import default


def test_copy_rows_mask_the_answer_and_move_the_tool_result():
  tokenizer = text.load_tokenizer()
  rows = copy_study.copy_rows(tokenizer, np.random.default_rng(0), 64, lengths=(1, 5, 9))
  assert set(rows["length_B"]) == {1, 5, 9}
  assert len(set(rows["answer_start_B"])) > 3  # the filler moves the copy's position
  for tokens, mask, start, n in zip(rows["tokens_BxT"], rows["loss_mask_BxT"],
                                    rows["answer_start_B"], rows["length_B"]):
    full = tokenizer.decode(tokens)
    number = full.split("<tool_result>")[1].split("</tool_result>")[0]
    assert len(number) == n and full.endswith(f"<answer>{number}</answer>")
    assert tokenizer.decode(tokens[mask > 0]) == f"{number}</answer>"
    assert tokenizer.decode(tokens[start:start + n]) == number


def test_copy_rates_count_whole_answers_per_length():
  rows = copy_study.copy_rows(text.load_tokenizer(), np.random.default_rng(1), 32,
                              lengths=(2, 6))
  right = np.roll(rows["tokens_BxT"], -1, axis=1)  # position t predicts token t + 1
  assert copy_study.copy_rates(right, rows) == {2: 1.0, 6: 1.0}
  wrong = right.copy()
  wrong[0, rows["answer_start_B"][0] + rows["length_B"][0] - 2] += 1  # the last digit
  rates = copy_study.copy_rates(wrong, rows)
  n0 = int(rows["length_B"][0])
  assert rates[n0] == 1.0 - 1.0 / np.sum(rows["length_B"] == n0)


def test_the_default_model_learns_one_length_of_copy_in_a_few_steps():
  # One length is a fixed offset between the tool result and the answer:
  # learnt within 50 steps (docs/default_run). Broken rows or masks fail it.
  curve = copy_study.study(default.get_config("all"), 0, steps=50, every=25, eval_rows=64,
                           lengths=(4,))
  assert curve[0]["copied"][4] < 0.5 and curve[-1]["copied"][4] >= 0.9


def test_run_writes_each_seeds_curve_and_refuses_lengths_beyond_nine(tmp_path):
  out = tmp_path / "copy.json"
  copy_study.run(default.get_config("all,tiny"), [0, 1], steps=2, every=1, eval_rows=8,
                 lengths=["3"], out=str(out))
  result = json.loads(out.read_text())
  assert list(result["curves"]) == ["0", "1"] and result["lengths"] == [3]
  assert [p["step"] for p in result["curves"]["0"]] == [1, 2]
  assert set(result["curves"]["1"][-1]["copied"]) == {"3"}
  with pytest.raises(ValueError, match="lengths must be digit counts in 1-9"):
    copy_study.run(default.get_config("all,tiny"), [0], steps=1, every=1, eval_rows=8,
                   lengths=[10])
