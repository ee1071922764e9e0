"""The package's layout: imports flow one way, with no circle.

experiments -> train -> rollout / objectives / invariants -> model / envs
-> text / kernels. The model knows nothing of RL, environments never import
the policy, and the library never imports ``experiments``. Every import
counts, those inside functions included.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The layer of each part: a module imports only from its own layer or lower
# ones (within a layer, only from its own part).
LAYERS = {"kernels": 0, "text": 0, "model": 1, "envs": 1, "rollout": 2, "objectives": 2,
          "invariants": 2, "train": 3}


def _modules() -> dict[str, str]:
  mods = {}
  for folder, _, files in os.walk(os.path.join(ROOT, "agentic_rl")):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        mods[module.removesuffix(".__init__")] = path
  return mods


def _imports(path: str, known) -> set[str]:
  """The modules of ``known`` (and the ``experiments`` package) that the
  file imports: ``from p import m`` of a module ``p.m`` imports ``p.m``,
  of a name defined in ``p``, ``p``."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        out.add(sub if sub in known else node.module)
  return {m for m in out if m in known or m.split(".")[0] == "experiments"}


def _part(module: str) -> str:
  parts = module.split(".")
  return parts[0] if parts[0] != "agentic_rl" else (parts[1] if len(parts) > 1 else "")


@pytest.fixture(scope="module")
def graph():
  mods = _modules()
  return {m: _imports(p, mods) for m, p in mods.items()}


def _cycles(graph) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in graph:
        continue
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_circle(graph):
  # A package's __init__ importing its own submodules is not a circle.
  pruned = {m: {i for i in imps if not m.startswith(i + ".") and not i.startswith(m + ".")}
            for m, imps in graph.items()}
  assert _cycles(pruned) == []


def test_the_detector_finds_a_circle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_flow_one_way(graph):
  wrong = []
  for module, imports in graph.items():
    part = _part(module)
    for imported in imports:
      other = _part(imported)
      if other == "experiments":
        wrong.append((module, imported))
      elif part in LAYERS and other in LAYERS and other != part and (
          LAYERS[other] >= LAYERS[part]):
        wrong.append((module, imported))
  assert wrong == []
