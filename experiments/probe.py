r"""Held-out success of a run's latest checkpoint, per task family and level.

  python -m experiments.probe --workdir=/tmp/agentic_rl_default
  python -m experiments.probe --workdir=DIR --levels=0,1,2 --show=4

For each difficulty level (``--levels``; default: the run's own) it plays
``--prompts`` held-out test prompts greedily and the first ``--sampled``
of them ``--samples`` times each at the run's sampling temperature, and
prints per family: greedy success, sampled success (the mean over samples),
pass@k (a prompt with any success) and the share of prompts with none.
Greedy success on the run's levels over the first ``eval.num_prompts``
prompts is the run's ``eval/success``; the sampled columns show what
greedy decoding hides (a policy whose mistakes greedy decoding strips).
``--show`` prints that many greedy failures as text; under one whose answer
differs from the tool result just before it, the policy's probability of
each token of that result in the answer's place. Where the answer should
copy the result (a calculator chain), near 0 is a confident miscopy, which
sampling, and so RL, rarely corrects. ``--copies=FAMILY,...`` prints how often
the greedy policy copies a number a tool returned into its next action, by
the number's length.
"""

from __future__ import annotations

import collections
import re

import jax
import numpy as np
from absl import app
from absl import flags
from absl import logging

from agentic_rl.envs import tasks as tasks_lib
from agentic_rl.model import scoring
from agentic_rl.train import config as config_lib
from agentic_rl.train import run as run_lib
from experiments import export

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/agentic_rl_default", "The run's directory.")
_LEVELS = flags.DEFINE_list("levels", [], "Difficulty levels (default: the run's).")
_PROMPTS = flags.DEFINE_integer("prompts", 192, "Held-out prompts played greedily.")
_SAMPLED = flags.DEFINE_integer("sampled", 64, "Of them, prompts sampled --samples times.")
_SAMPLES = flags.DEFINE_integer("samples", 8, "Samples per sampled prompt.")
_SHOW = flags.DEFINE_integer("show", 0, "Greedy failures to print as text.")
_COPIES = flags.DEFINE_list("copies", [], "Families whose greedy copy rates to print "
                            "by number length (e.g. calc_chain,multihop).")

# A tool result that is one number, then the next action's first number: an
# answer, or a call's first argument (``calc 1385486+12``, ``store 2:913``).
_COPY = re.compile(r"<tool_result>(-?\d+)</tool_result><(?:answer|tool_call)>"
                   r"(?:[a-z]+ )?(?:\d+:)?(-?\d+)")


def copy_probs(params, config, ids, tokens_T) -> np.ndarray | None:
  """float ``[len(R)]``: ``pi(R_i | episode before the answer, R_<i)`` for an
  episode ending ``<tool_result>R</tool_result><answer>A</answer>`` with
  ``A != R`` (an answer that should have copied R miscopies it); None for
  any other episode (and for a chat template's codec, which has no such tags).
  ``ids``: the codec's ``ids``; ``tokens_T``: the episode's tokens, without
  padding."""
  t = [int(x) for x in tokens_T]
  if not hasattr(ids, "answer_open") or ids.answer_open not in t:
    return None
  a = len(t) - 1 - t[::-1].index(ids.answer_open)
  if a < 2 or t[a - 1] != ids.tool_result_close or ids.tool_result_open not in t[:a]:
    return None
  o = a - 1 - t[a - 1::-1].index(ids.tool_result_open)
  result = t[o + 1:a - 1]
  answer = t[a + 1:t.index(ids.answer_close, a) if ids.answer_close in t[a:] else len(t)]
  if not result or answer == result:
    return None
  logp_T, _ = scoring.sequence_logprobs(params, np.asarray([t[:a + 1] + result]), config)
  return np.exp(np.asarray(logp_T[0, a + 1:]))


def copy_rates(texts, families) -> dict[tuple[str, int], tuple[int, int]]:
  """``{(family, digits): (copied right, copies)}`` over episodes ``texts``
  (decoded) of ``families``: each tool result that is one number, against
  the first number of the action after it. Only for families whose next
  action carries the result on (a lookup chain, a calculator chain)."""
  out = collections.defaultdict(lambda: [0, 0])
  for text, family in zip(texts, families):
    for result, copy in _COPY.findall(text):
      n = out[family, len(result.lstrip("-"))]
      n[0] += result == copy
      n[1] += 1
  return {k: tuple(v) for k, v in sorted(out.items())}


def probe(workdir: str, levels=None, *, prompts: int = 192, sampled: int = 64,
          samples: int = 8, show: int = 0, copies_of=()) -> dict[str, dict[str, float]]:
  """``{"<level>/<family>": {prompts, greedy, sampled, pass_at_k, none}}`` for the
  latest checkpoint of ``workdir`` (see the module docstring); ``levels``
  None: each of the run's levels alone. ``copies_of``: families whose
  greedy :func:`copy_rates` to print."""
  cfg, config, params = export._load(workdir)  # pylint: disable=protected-access
  levels = list(levels) if levels else list(tasks_lib.difficulty_levels(cfg.tasks.difficulty))
  sampled = min(sampled, prompts)
  rows, key, out = cfg.eval.batch_rows, jax.random.key(0), {}
  for level in levels:
    cfg.tasks.difficulty = (int(level),)
    run = run_lib.build(cfg)
    if set(copies_of) - set(run.family_names):
      raise ValueError(f"--copies={','.join(copies_of)}: this run's families are "
                       f"{', '.join(run.family_names)}")
    greedy = run.rollout(params, config_lib.sampling_config(run.cfg, greedy=True), "test",
                         np.arange(prompts), key, 0, rows)
    ok_N = np.asarray(greedy.reward_components["outcome"]) > 0.5
    drawn = run.rollout(params, config_lib.sampling_config(run.cfg), "test",
                        np.repeat(np.arange(sampled), samples), key, 0, rows, group_size=1)
    ok_PxK = (np.asarray(drawn.reward_components["outcome"]) > 0.5).reshape(sampled, samples)
    family_N = run.families_of("test", np.arange(prompts))
    for f, name in enumerate(run.family_names):
      mine, mine_P = family_N == f, family_N[:sampled] == f
      if not mine.any():
        continue
      out[f"{level}/{name}"] = {
          "prompts": int(mine.sum()), "greedy": float(ok_N[mine].mean()),
          "sampled": float(ok_PxK[mine_P].mean()) if mine_P.any() else float("nan"),
          "pass_at_k": float(ok_PxK[mine_P].any(1).mean()) if mine_P.any() else float("nan"),
          "none": float((~ok_PxK[mine_P].any(1)).mean()) if mine_P.any() else float("nan")}
    episode = lambda b: np.asarray(greedy.tokens_BxT[b])[:int(greedy.length_B[b])]  # noqa: E731
    if copies_of:
      names = [run.family_names[f] for f in family_N]
      mine = [b for b in range(prompts) if names[b] in copies_of]
      texts = [run.codec.tokenizer.decode(episode(b)) for b in mine]
      for (family, digits), (right, total) in copy_rates(texts, [names[b] for b in mine]).items():
        print(f"level {level}, {family}: {digits}-digit results copied {right}/{total}")
    for b in np.flatnonzero(~ok_N)[:show]:
      tokens = episode(b)
      print(f"--- level {level}, {run.family_names[family_N[b]]}:\n"
            f"{run.codec.tokenizer.decode(tokens)}")
      probs = copy_probs(params, config, run.codec.ids, tokens)
      if probs is not None:
        print("p(answering the last tool result instead):", " ".join(f"{p:.2f}" for p in probs))
  return out


def table(results: dict[str, dict[str, float]], samples: int) -> str:
  lines = [f"| level | family | prompts | greedy | sampled | pass@{samples} | none of {samples} |",
           "|---|---|---:|---:|---:|---:|---:|"]
  for name, r in results.items():
    level, family = name.split("/", 1)
    lines.append(f"| {level} | {family} | {r['prompts']} | {r['greedy']:.0%} | {r['sampled']:.0%} | "
                 f"{r['pass_at_k']:.0%} | {r['none']:.0%} |")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  results = probe(_WORKDIR.value, _LEVELS.value or None, prompts=_PROMPTS.value,
                  sampled=_SAMPLED.value, samples=_SAMPLES.value, show=_SHOW.value,
                  copies_of=tuple(_COPIES.value))
  print(table(results, _SAMPLES.value))


if __name__ == "__main__":
  app.run(main)
