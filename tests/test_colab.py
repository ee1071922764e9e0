"""The ablation notebook runs headless, so it cannot rot."""

import json
import os

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "colabs", "invariant_ablations.ipynb")
COMMITTED = os.path.join(REPO, "docs", "ablations", "results.json")


REAL_MODEL = os.path.join(REPO, "docs", "real_model", "results.json")


def _committed_studies() -> int:
  """Figures of the committed results: one per ablation study and one per
  real-model study (and one of its tasks)."""
  n = 0
  if os.path.exists(COMMITTED):
    with open(COMMITTED) as f:
      n += len(json.load(f)["studies"])
  if os.path.exists(REAL_MODEL):
    with open(REAL_MODEL) as f:
      real = json.load(f)
    n += len(real["studies"]) + bool(real["tasks"])
  return n


def _execute(tmp_path, monkeypatch, studies: str):
  monkeypatch.setenv("ABLATION_STUDIES", studies)
  monkeypatch.setenv("ABLATION_WORKDIR", str(tmp_path / "runs"))
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # The kernel inherits this environment; it starts in the notebook's folder
  # and finds the repository root itself, as it would on Colab after a clone.
  nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3",
                          resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  return nb, images


@pytest.mark.slow
def test_notebook_plots_the_committed_results_and_a_tiny_rerun(tmp_path, monkeypatch):
  # The signal study: its warm start, then four arms two at a time.
  nb, images = _execute(tmp_path, monkeypatch, "signal")
  # One figure per committed study, the default run's seeds, then the tiny
  # rerun's one.
  assert len(images) == _committed_studies() + 2
  assert "ok" in "".join(o.get("text", "") for o in nb.cells[-1].outputs)


@pytest.mark.slow
def test_notebook_tiny_rerun_of_every_study(tmp_path, monkeypatch):
  pytest.importorskip("gem", reason="the host study plays a GEM game (pip install gem-llm)")
  _, images = _execute(tmp_path, monkeypatch, "signal,exploration,shift,host")
  assert len(images) == _committed_studies() + 5
