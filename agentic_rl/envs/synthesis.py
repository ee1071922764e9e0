"""Agentic task synthesis: new tool tasks composed from the built-in tools,
filtered, written as a dataset the trainer reads.

1. **Propose** (:func:`propose`): ``candidates`` distinct programs of
   ``min_ops`` to ``max_ops`` operations drawn from the spec's ``ops``
   (:mod:`agentic_rl.envs.composed`: each operation is a tool, its
   template phrase and its part of the verifier's answer), i.e. new
   combinations and orders of the tools.
2. **Solvable** (:func:`solver_success`): the scripted solver plays
   ``samples`` instances of every candidate; a candidate whose success is
   under ``min_solvable`` is dropped (its tools cannot reach its answers:
   a box numbered in the hundreds, an overflow, a key seen twice).
3. **Not solved yet**: a caller-given ``policy_success(programs) -> [C]``
   (the current policy's greedy success, :func:`agentic_rl.train.synthesis.
   policy_success`); a candidate at or above ``max_policy_success`` is
   dropped, having nothing left to teach.
4. **Write** (:func:`write`): JSON with the spec, every candidate's scores
   and verdict, and the kept ``programs``; ``config.tasks.programs`` names
   such a file, and the ``composed`` family then trains on its programs.

Kimi K2 synthesises tools, tasks and rubrics at scale with models and
filters them by rollouts; here the pieces are the project's tools and the
filters are its scripted solver and policy, so every step is exact and
repeatable from the spec's seed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.envs import scripted
from agentic_rl.envs.composed import MAX_OPS, OPS, ComposedEnv, check_programs
from agentic_rl.text import default_codec

Program = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Spec:
  """What to synthesise (module docstring)."""

  ops: tuple[str, ...] = OPS
  min_ops: int = 2
  max_ops: int = 4
  candidates: int = 32
  samples: int = 32
  min_solvable: float = 0.95
  max_policy_success: float = 0.5
  seed: int = 0

  def __post_init__(self):
    if not self.ops or any(op not in OPS for op in self.ops):
      raise ValueError(f"Spec.ops must be a non-empty subset of {OPS}, got {self.ops!r}")
    if not 1 <= self.min_ops <= self.max_ops <= MAX_OPS:
      raise ValueError(f"Spec needs 1 <= min_ops <= max_ops <= {MAX_OPS}, got "
                       f"{self.min_ops}, {self.max_ops}")
    if self.candidates < 1 or self.samples < 1:
      raise ValueError("Spec.candidates and Spec.samples must be >= 1")
    for name in ("min_solvable", "max_policy_success"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"Spec.{name} must be in [0, 1], got {getattr(self, name)}")

  @classmethod
  def from_mapping(cls, values: Mapping) -> Spec:
    valid = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(values) - valid):
      raise ValueError(f"unknown spec keys {unknown}; valid: {sorted(valid)}")
    values = dict(values)
    if "ops" in values:
      values["ops"] = tuple(values["ops"])
    return cls(**values)


def propose(spec: Spec) -> list[Program]:
  """Up to ``spec.candidates`` distinct programs, in draw order."""
  rng = np.random.default_rng(spec.seed)
  possible = sum(len(spec.ops) ** n for n in range(spec.min_ops, spec.max_ops + 1))
  out: dict[Program, None] = {}
  while len(out) < min(spec.candidates, possible):
    n = int(rng.integers(spec.min_ops, spec.max_ops + 1))
    out[tuple(spec.ops[i] for i in rng.integers(0, len(spec.ops), n))] = None
  return list(out)


def solver_success(programs: Sequence[Program], samples: int, seed: int = 0,
                   codec=None) -> np.ndarray:
  """float ``[C]``: the scripted solver's success on ``samples`` instances
  of each program (one jitted batch)."""
  env = ComposedEnv(codec or default_codec(), programs=programs)
  C = len(programs)
  program_N = np.repeat(np.arange(C), samples)
  keys = jax.random.split(jax.random.key(seed), C * samples)
  instances = jax.jit(jax.vmap(env.instance_of))(keys, jnp.asarray(program_N))
  outcome = scripted.episode_returns(scripted.batch_rollouts(env, instances, keys))["outcome"]
  return np.asarray(outcome).reshape(C, samples).mean(axis=1)


def synthesize(spec: Spec, policy_success: Callable[[list[Program]], np.ndarray] | None = None,
               codec=None) -> dict:
  """Proposes, filters and returns the dataset (:func:`write`'s content).
  Without ``policy_success`` only the solvability filter runs."""
  candidates = propose(spec)
  solver = solver_success(candidates, spec.samples, spec.seed, codec)
  solvable = [p for p, s in zip(candidates, solver) if s >= spec.min_solvable]
  policy = dict(zip(solvable, policy_success(solvable))) if policy_success and solvable else {}
  rows, kept = [], []
  for program, s in zip(candidates, solver):
    p = policy.get(program)
    verdict = ("unsolvable" if s < spec.min_solvable else
               "solved" if p is not None and p >= spec.max_policy_success else "kept")
    rows.append({"program": list(program), "solver_success": float(s),
                 "policy_success": None if p is None else float(p), "verdict": verdict})
    if verdict == "kept":
      kept.append(list(program))
  return {"spec": dataclasses.asdict(spec), "programs": kept, "candidates": rows}


def write(path: str, dataset: Mapping) -> None:
  with open(path, "w") as f:
    json.dump(dataset, f, indent=1)
    f.write("\n")


def load_programs(path: str) -> tuple[Program, ...]:
  """The kept programs of a dataset :func:`write` wrote; ValueError saying
  what is wrong."""
  try:
    with open(path) as f:
      dataset = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read the task dataset {path!r}: {e}") from None
  if not isinstance(dataset, dict) or not dataset.get("programs"):
    raise ValueError(f"the task dataset {path!r} keeps no programs")
  return check_programs(dataset["programs"])
