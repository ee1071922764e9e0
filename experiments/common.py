"""Small helpers shared by the experiment scripts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from absl import app, flags


def write_json(path: str, obj: Any, **dump_kwargs) -> None:
  """Writes ``obj`` as JSON to ``path``, creating its folder (``indent=2`` by default)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(obj, f, **{"indent": 2, **dump_kwargs})


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The default run's settings the studies (ablations, distillation, PARL) were
# measured with, which they keep when the default run's change: a warm start
# of 400 SFT steps, 40 RL iterations (where a study sets no number of its
# own), dynamic sampling redrawing up to two batches per iteration, pass@k
# on 32 held-out prompts.
STUDY_BASE = {"sft.steps": 400, "rl.iterations": 40, "rl.signal.max_extra_rollout_frac": 2.0,
              "eval.pass_k_prompts": 32}


def set_dotted(cfg, dotted: str, value) -> None:
  """``cfg.<dotted> = value`` on a ConfigDict; KeyError naming the key when
  the config has none of that name (an override that would set nothing)."""
  *path, leaf = dotted.split(".")
  node = cfg
  for part in path:
    node = node[part]
  if leaf not in node:
    raise KeyError(f"override {dotted!r}: the config has no key {leaf!r}")
  node[leaf] = value


def train_command(workdir: str, variant: str, overrides: Mapping[str, Any]) -> list[str]:
  """``python -m experiments.train`` on ``default.py:<variant>`` with the
  dotted config keys ``overrides`` (a tuple written as its literal), every
  section's keys there to set (the ``all`` variant)."""
  return [sys.executable, "-m", "experiments.train", f"--workdir={workdir}",
          f"--config=experiments/configs/default.py:{','.join(filter(None, ('all', variant)))}"
          ] + [
              f"--config.{k}={v!r}" if isinstance(v, tuple) else f"--config.{k}={v}"
              for k, v in overrides.items()]


def train_once(workdir: str, variant: str, overrides: Mapping[str, Any], log: str) -> None:
  """Runs :func:`train_command` in its own process, its output into
  ``log``, unless ``workdir`` holds a finished run (a ``summary.json``);
  raises naming the log when it fails."""
  if os.path.exists(os.path.join(workdir, "summary.json")):
    return
  os.makedirs(os.path.dirname(log) or ".", exist_ok=True)
  with open(log, "w") as f:
    done = subprocess.run(train_command(workdir, variant, overrides), cwd=REPO, stdout=f,
                          stderr=subprocess.STDOUT)
  if done.returncode:
    raise RuntimeError(f"{workdir} failed; see {log}")


def train_config_run(config_arg: str, seed: int, workdir: str,
                     extra: Sequence[str] = ()) -> float:
  """``python -m experiments.train --config=CONFIG_ARG --config.seed=SEED``
  (and the flags ``extra``) in its own process, its output in
  ``WORKDIR/log.txt``, unless ``workdir``
  holds a finished run (a ``summary.json``); an unfinished one resumes.
  Runs share compiled programs through JAX's persistent compilation cache
  beside the runs' root (``WORKDIR/../../jax_cache``). Returns the seconds
  it took; raises naming the log when it fails."""
  if os.path.exists(os.path.join(workdir, "summary.json")):
    return 0.0
  os.makedirs(workdir, exist_ok=True)
  cmd = [sys.executable, "-m", "experiments.train", f"--config={config_arg}",
         f"--config.seed={seed}", f"--workdir={workdir}", *extra]
  env = dict(os.environ)
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(
      os.path.dirname(os.path.abspath(workdir))), "jax_cache"))
  t0 = time.perf_counter()
  with open(os.path.join(workdir, "log.txt"), "a") as log:
    done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                          check=False)
  if done.returncode:
    raise RuntimeError(f"{config_arg} seed {seed} failed ({done.returncode}); see "
                       f"{workdir}/log.txt")
  return time.perf_counter() - t0


def start_from(warm_dir: str, run_dir: str) -> None:
  """Copies the finished run ``warm_dir``'s last checkpoint into ``run_dir``
  (unless it has checkpoints already): a run of the same earlier stages
  there resumes after them."""
  if os.path.exists(os.path.join(run_dir, "checkpoints")):
    return
  src = os.path.join(warm_dir, "checkpoints")
  step = max((d for d in os.listdir(src) if d.isdigit()), key=int)
  shutil.copytree(os.path.join(src, step), os.path.join(run_dir, "checkpoints", step))


def time_interleaved(contenders: Mapping[Hashable, Callable[[], Any]], *, warmup: int,
                     repeats: int, calls: int = 1) -> dict[Hashable, list[float]]:
  """Seconds per call of each contender (each blocks until its work is done).

  ``warmup`` untimed calls each, then ``repeats`` rounds; a round times
  ``calls`` calls in a row of every contender, in an order reversed every
  round so that no contender always follows the same one. Returns the
  ``repeats`` mean seconds per call of each.
  """
  for fn in contenders.values():
    for _ in range(warmup):
      fn()
  times = {key: [] for key in contenders}
  order = list(contenders)
  for _ in range(repeats):
    for key in order:
      start = time.perf_counter()
      for _ in range(calls):
        contenders[key]()
      times[key].append((time.perf_counter() - start) / calls)
    order.reverse()
  return times


def run_study(name: str, *, out: str, workdir: str,
              run: Callable[..., None], collect: Callable[[str, Sequence[int]], dict],
              write: Callable[[dict, str, str], None]) -> None:
  """The command line of a seeded study ``python -m experiments.<name>``:
  ``--out``, ``--workdir``, ``--seeds``, ``--jobs``, ``--tiny``. Calls
  ``run(workdir, seeds, jobs=, tiny=)``, then ``write(collect(workdir,
  seeds), out, command)`` and prints ``OUT/results.md``."""
  out_ = flags.DEFINE_string("out", out, "Where the results go.")
  workdir_ = flags.DEFINE_string("workdir", workdir, "Run directories.")
  seeds_ = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
  jobs_ = flags.DEFINE_integer("jobs", 2, "Runs at a time.")
  tiny_ = flags.DEFINE_bool("tiny", False, "Test scale (tiny model, a few steps).")

  def main(argv):
    del argv
    seeds = [int(s) for s in seeds_.value]
    run(workdir_.value, seeds, jobs=jobs_.value, tiny=tiny_.value)
    write(collect(workdir_.value, seeds), out_.value,
          f"python -m experiments.{name} " + " ".join(sys.argv[1:]))
    with open(os.path.join(out_.value, "results.md")) as f:
      print(f.read())

  app.run(main)
