"""Test modules share a process (one pytest worker collects many), so every
``experiments`` module a test imports must import beside all the others:
absl refuses a flag defined twice, and such modules define their flags
only when run as programs."""

import ast
import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _experiments_imported_by_tests():
  names = set()
  for path in glob.glob(os.path.join(ROOT, "tests", "*.py")):
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module == "experiments":
        names.update(f"experiments.{a.name}" for a in node.names)
  return sorted(names)


def test_the_experiments_that_tests_import_load_in_one_process():
  modules = _experiments_imported_by_tests()
  assert "experiments.get_model" in modules and "experiments.copy_study" in modules
  proc = subprocess.run([sys.executable, "-c", "import " + ", ".join(modules)],
                        cwd=ROOT, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
