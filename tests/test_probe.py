"""experiments.probe: per family and level, greedy and sampled held-out success."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl import text
from agentic_rl.model import transformer as model_lib
from agentic_rl.train import config as config_lib
from agentic_rl.train import loop
from experiments import probe
from experiments.configs import default


@pytest.mark.slow  # a training run and three evaluation builds: 100 s on 2 cores
def test_probe_reproduces_the_runs_greedy_success_and_adds_sampled(tmp_path, capsys):
  cfg = default.get_config("all,tiny")
  summary = loop.train(cfg, str(tmp_path))
  n = cfg.eval.num_prompts
  # On the run's level and evaluation prompts, greedy success is the run's.
  results = probe.probe(str(tmp_path), prompts=n, sampled=4, samples=3, show=n)
  assert {k.split("/")[0] for k in results} == {str(cfg.tasks.difficulty[0])}
  counts = np.array([r["prompts"] for r in results.values()])
  greedy = np.array([r["greedy"] for r in results.values()])
  assert counts.sum() == n
  np.testing.assert_allclose((counts * greedy).sum() / n, summary["rl_success"])
  failures = round(n - (counts * greedy).sum())
  assert capsys.readouterr().out.count("--- level") == failures
  for r in results.values():
    if not np.isnan(r["pass_at_k"]):
      assert r["none"] == 1.0 - r["pass_at_k"] and r["sampled"] <= r["pass_at_k"]
  # Another level on request; the table has a row per level and family.
  other = probe.probe(str(tmp_path), ["0"], prompts=n, sampled=4, samples=3)
  assert {k.split("/")[0] for k in other} == {"0"}
  with pytest.raises(ValueError, match="this run's families are calc_chain, multihop, boxes"):
    probe.probe(str(tmp_path), prompts=n, sampled=1, samples=1, copies_of=("calc",))
  md = probe.table({**results, **other}, 3)
  assert md.splitlines()[0] == "| level | family | prompts | greedy | sampled | pass@3 | none of 3 |"
  assert len(md.splitlines()) == 2 + len(results) + len(other)


def test_copy_probs_scores_the_tool_result_in_a_miscopied_answers_place():
  cfg = default.get_config("all,tiny")
  config = config_lib.model_config(config_lib.validate(cfg))
  params = model_lib.init_params(config, jax.random.key(0))
  codec = text.load_codec()
  ids, digits = codec.ids, codec.tokenizer.encode
  head = [ids.bos, ids.assistant, ids.tool_call_open, *digits("12"), ids.tool_call_close]
  result, wrong = digits("3700"), digits("3000")
  episode = [*head, ids.tool_result_open, *result, ids.tool_result_close, ids.answer_open]
  a = len(episode) - 1
  probs = probe.copy_probs(params, config, ids, [*episode, *wrong, ids.answer_close])
  logits = model_lib.forward(params, jnp.asarray([episode + result]), config)[0]
  want = jax.nn.softmax(logits[a:a + len(result)], -1)[np.arange(len(result)), result]
  chex.assert_shape(probs, (len(result),))
  np.testing.assert_allclose(probs, want, rtol=1e-4)
  # A right copy, an answer after no tool result, no answer: nothing to score.
  assert probe.copy_probs(params, config, ids, [*episode, *result, ids.answer_close]) is None
  assert probe.copy_probs(params, config, ids, [*head, ids.answer_open, *wrong]) is None
  assert probe.copy_probs(params, config, ids, episode[:-1]) is None


def test_copy_rates_count_each_numeric_tool_result_against_the_next_actions_first_number():
  calc = ("<tool_call>calc 12*34</tool_call><tool_result>408</tool_result>"
          "<tool_call>calc 408+1</tool_call><tool_result>409</tool_result>"
          "<tool_call>store 1:490</tool_call><tool_result>ok</tool_result>"
          "<tool_call>recall 1</tool_call><tool_result>490</tool_result><answer>490</answer>")
  hops = ("<tool_call>lookup 630</tool_call><tool_result>4251</tool_result>"
          "<tool_call>lookup 4215</tool_call><tool_result>error: not found</tool_result>"
          "<answer>-7</answer>")
  assert probe.copy_rates([calc, hops, calc], ["calc_chain", "multihop", "calc_chain"]) == {
      ("calc_chain", 3): (4, 6), ("multihop", 4): (0, 1)}
