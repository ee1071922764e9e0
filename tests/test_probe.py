"""experiments.probe: per family and level, greedy and sampled held-out success."""

import numpy as np
import pytest

from agentic_rl.train import loop
from experiments import probe
from experiments.configs import default


@pytest.mark.slow  # a training run and three evaluation builds: 100 s on 2 cores
def test_probe_reproduces_the_runs_greedy_success_and_adds_sampled(tmp_path, capsys):
  cfg = default.get_config("tiny")
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
  md = probe.table({**results, **other}, 3)
  assert md.splitlines()[0] == "| level | family | prompts | greedy | sampled | pass@3 | none of 3 |"
  assert len(md.splitlines()) == 2 + len(results) + len(other)
