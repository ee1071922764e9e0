"""Small Python ("host") environments speaking the text protocol, with
demonstrations: the built-in examples of training your own environment.

Protocol (``agentic_rl.rollout.TextEnv``): ``reset(seed) -> observation``,
``step(action) -> (observation, reward, done)``; optionally
``demonstration(seed) -> list[str]``, the actions of a competent episode
(each ending with one stop piece, e.g. ``</answer>``), for the SFT stage; a
``demonstration(seed, noise)`` makes a share ``noise`` of them mistakes
(``sft.demo_noise``).
"""

from __future__ import annotations

import ast
import json
import operator
import re

import numpy as np

_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


class GuessNumber:
  """Guess a secret integer in ``[1, high]`` in at most ``max_guesses``
  guesses; each guess is answered "higher" or "lower".

  Reward 1 for the right number (the episode ends), 0 otherwise; an action
  without ``<answer>n</answer>`` costs a guess and is told the format. The
  secret is a function of the seed. The demonstration is binary search,
  which needs ``ceil(log2(high + 1))`` guesses at most; in a fraction
  ``verbose`` of the demonstrations (by the seed) each guess first states
  the interval left ("from 9 to 16: <answer>12</answer>"), which costs
  tokens and changes nothing: solutions with slack, for length controls
  such as Toggle to remove.
  """

  def __init__(self, high: int = 16, max_guesses: int = 6, verbose: float = 0.0):
    if high < 1 or max_guesses < 1 or not 0.0 <= verbose <= 1.0:
      raise ValueError(f"high and max_guesses must be >= 1 and verbose in [0, 1], got {high}, "
                       f"{max_guesses}, {verbose}")
    self.high, self.max_guesses, self.verbose = high, max_guesses, verbose
    self.secret, self.guesses = 1, 0

  def reset(self, seed: int) -> str:
    self.secret = int(np.random.default_rng(seed).integers(1, self.high + 1))
    self.guesses = 0
    return (f"I am thinking of a number from 1 to {self.high}. You have "
            f"{self.max_guesses} guesses; answer <answer>n</answer>.")

  def step(self, action: str) -> tuple[str, float, bool]:
    self.guesses += 1
    found = _ANSWER.findall(action)
    last = self.guesses >= self.max_guesses
    if not found:
      return "Answer with <answer>n</answer>.", 0.0, last
    guess = int(found[-1])
    if guess == self.secret:
      return "Correct.", 1.0, True
    return ("Higher." if guess < self.secret else "Lower."), 0.0, last

  def demonstration(self, seed: int, noise: float = 0.0) -> list[str]:
    """Binary search; with ``noise`` > 0 each guess is, with that
    probability, a random number from 1 to ``high`` instead (the search
    goes on from its answer), so a demonstration may run out of guesses."""
    self.reset(seed)
    verbose = np.random.default_rng([seed, 1]).random() < self.verbose
    rng = np.random.default_rng([seed, 2])
    lo, hi, actions = 1, self.high, []
    while True:
      guess = (lo + hi) // 2
      if rng.random() < noise:
        guess = int(rng.integers(1, self.high + 1))
      actions.append((f"from {lo} to {hi}: " if verbose else "") + f"<answer>{guess}</answer>")
      if guess == self.secret:
        return actions
      lo, hi = (max(lo, guess + 1), hi) if guess < self.secret else (lo, min(hi, guess - 1))


_NEXT = re.compile(r"next\s+(-?\d+)")


class Ledger:
  """A long-horizon task: keep the last digit of a running sum over a ledger
  read one entry at a time.

  Each ``next T`` action (``T``: the policy's running total so far, its last
  digit) reveals the next entry, in a record that echoes ``T`` (and
  ``filler`` extra words); after the last entry, ``<answer>T</answer>`` with the
  last digit of the sum of all entries earns 1. A ledger has from
  ``min_entries`` to ``entries`` entries (by the seed), and an episode takes
  ``entries + 2`` actions: the tool results of a long one outgrow a small
  context, and without context management it is truncated before the end. The state to
  keep is one digit, and the latest observation carries it, so any of the
  context policies (:mod:`agentic_rl.rollout.context`) can finish.

  ``demonstration(seed)`` gives the competent actions; ``summary`` the
  summary a competent policy writes when asked (the running total).
  """

  def __init__(self, entries: int = 8, min_entries: int | None = None, filler: int = 0):
    min_entries = entries if min_entries is None else min_entries
    if not 1 <= min_entries <= entries or filler < 0:
      raise ValueError(f"need 1 <= min_entries <= entries and filler >= 0, got {min_entries}, "
                       f"{entries}, {filler}")
    self.max_entries, self.min_entries, self.filler = entries, min_entries, filler
    self.values, self.shown, self.steps, self.entries = [], 0, 0, entries

  def reset(self, seed: int) -> str:
    rng = np.random.default_rng(seed)
    self.entries = int(rng.integers(self.min_entries, self.max_entries + 1))
    self.values = [int(v) for v in rng.integers(0, 10, self.entries)]
    self.shown, self.steps = 0, 0
    return "Add up a ledger. Say next T (T: last digit of your total) for each entry, then answer T."

  def _record(self, total: int) -> str:
    if self.shown == self.entries:
      return f"total {total}, no more entries."
    value = self.values[self.shown]
    self.shown += 1
    return " ".join([f"total {total}, entry {self.shown} is {value}."] + ["ok"] * self.filler)

  def step(self, action: str) -> tuple[str, float, bool]:
    self.steps += 1
    last = self.steps >= self.entries + 4
    if (answer := _ANSWER.findall(action)):
      right = self.shown == self.entries and int(answer[-1]) == sum(self.values) % 10
      return ("Correct." if right else "Wrong."), float(right), True
    if not (total := _NEXT.findall(action)):
      return "Say next T or answer <answer>T</answer>.", 0.0, last
    return self._record(int(total[-1]) % 10), 0.0, last

  def demonstration(self, seed: int) -> list[str]:
    self.reset(seed)
    totals = np.cumsum([0] + self.values) % 10
    return [f"<tool_call>next {t}</tool_call>" for t in totals] + [
        f"<answer>{totals[-1]}</answer>"]

  def summary(self, observations: list[str]) -> str:
    """The running total after the entries the observations showed."""
    shown = [int(v) for obs in observations for v in re.findall(r"entry \d+ is (\d+)", obs)]
    return f"running total {sum(shown) % 10}"


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
CALCULATOR = {"name": "calculator",
              "description": "Evaluates an arithmetic expression of integers with + - * and "
                             "parentheses.",
              "parameters": {"type": "object",
                             "properties": {"expression": {"type": "string"}},
                             "required": ["expression"]}}


def evaluate(expression: str) -> int:
  """The value of an integer expression of ``+ - *`` and parentheses;
  ValueError for anything else (names, division, powers, calls)."""
  def value(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
      return -value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      return _OPS[type(node.op)](value(node.left), value(node.right))
    raise ValueError(f"not an integer expression of + - * and parentheses: {expression!r}")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError:
    raise ValueError(f"not an expression: {expression!r}") from None
  return value(tree.body)


class Calculator:
  """Multi-digit arithmetic with a calculator tool: the task a small model
  cannot do in its head.

  The question is ``a op b`` (``op`` from ``ops``; ``a``, ``b`` with
  ``digits`` digits, by the seed). The environment offers one tool,
  ``calculator(expression)`` (:data:`CALCULATOR`), which answers the
  expression's value; ``<answer>n</answer>`` ends the episode with reward 1
  when ``n`` is the value, else 0. An action with neither is told the
  format; the episode ends after ``max_turns`` actions. The demonstration
  calls the tool with the question's expression, then answers its result.
  """

  tools = [CALCULATOR]

  def __init__(self, digits: int = 3, ops: str = "+-*", max_turns: int = 3):
    if digits < 1 or not ops or set(ops) - set("+-*") or max_turns < 1:
      raise ValueError(f"need digits >= 1, ops from '+-*' and max_turns >= 1, got {digits}, "
                       f"{ops!r}, {max_turns}")
    self.digits, self.ops, self.max_turns = digits, ops, max_turns
    self.expression, self.answer, self.turns = "", 0, 0

  def reset(self, seed: int) -> str:
    rng = np.random.default_rng(seed)
    a, b = (int(v) for v in rng.integers(10 ** (self.digits - 1), 10 ** self.digits, 2))
    self.expression = f"{a} {self.ops[int(rng.integers(len(self.ops)))]} {b}"
    self.answer, self.turns = evaluate(self.expression), 0
    return (f"What is {self.expression}? Use the calculator tool, then give the result as "
            "<answer>n</answer>.")

  def call_tool(self, name: str, arguments: dict) -> tuple[str, float, bool]:
    del name  # the only tool
    self.turns += 1
    try:
      result = str(evaluate(str(arguments["expression"])))
    except ValueError as e:
      result = f"error: {e}"
    return result, 0.0, self.turns >= self.max_turns

  def step(self, action: str) -> tuple[str, float, bool]:
    self.turns += 1
    if not (found := _ANSWER.findall(action)):
      return ("Call the calculator or answer <answer>n</answer>.", 0.0,
              self.turns >= self.max_turns)
    right = int(found[-1]) == self.answer
    return ("Correct." if right else "Wrong."), float(right), True

  def demonstration(self, seed: int) -> list[str]:
    self.reset(seed)
    call = json.dumps({"name": "calculator", "arguments": {"expression": self.expression}})
    return [f"<tool_call>\n{call}\n</tool_call>", f"<answer>{self.answer}</answer>"]
