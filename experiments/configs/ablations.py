r"""Ablations of the invariant controllers, on the default task at small scale.

  python -m experiments.ablate                       # every study, seeds 0,1,2
  python -m experiments.train --config=experiments/configs/ablations.py:knapsack

An arm is the default config (``default.py``) at the ablation scale below,
plus its overrides. ``get_config("ARM")`` builds one (``"ARM,tiny"`` at the
test scale, ``"sft"`` is the shared warm start). The three studies:

- ``signal`` (I2): uniform allocation, DAPO dynamic sampling (the default),
  Knapsack budgets. Read ``signal/zero_variance_frac`` and final success.
- ``exploration`` (I1): no controls (the default) against the adaptive
  entropy bonus (band 0.3 to 1 nats) with a temperature decay from 1.2 to 1.
  Read ``explore/distinct_success_seqs_solved``, distinct tool sequences and
  pass@k. (Clip-higher is not an arm: with one update per rollout batch the
  ratio is 1 and no clip binds.)
- ``shift`` (I3): ``max_staleness`` 0, 2 and 8, each without and with
  truncated importance sampling. Read ``shift/*`` and final success.

Scale: 20 RL iterations of 16 prompts x 8 rollouts from a shared SFT warm
start (the default's), evaluation every 5 iterations, and a 128-prompt
training pool so that prompts recur (2.5 epochs at uniform allocation) and Knapsack has a
success history to allocate from.
"""

from __future__ import annotations

import ml_collections

from experiments.configs import default

STUDIES = {
    "signal": ("uniform", "dynamic", "knapsack"),
    "exploration": ("dynamic", "explore_on"),
    "shift": ("dynamic", "stale0_tis", "stale2", "stale2_tis", "stale8", "stale8_tis"),
}

_TIS = {"rl.correction": "tis"}
ARMS: dict[str, dict] = {
    "uniform": {"rl.signal.allocation": "uniform"},
    "dynamic": {},
    "knapsack": {"rl.signal.allocation": "knapsack"},
    "explore_on": {
        "rl.entropy_coef": 1e-3, "rl.temperature": 1.2,
        "rl.exploration.entropy_band": (0.3, 1.0), "rl.exploration.entropy_coef_factor": 1.5,
        "rl.exploration.entropy_coef_max": 0.05, "rl.exploration.temperature_schedule": "linear",
        "rl.exploration.temperature_final": 1.0, "rl.exploration.temperature_steps": 20},
    "stale0_tis": _TIS,
    "stale2": {"rl.max_staleness": 2},
    "stale2_tis": {"rl.max_staleness": 2, **_TIS},
    "stale8": {"rl.max_staleness": 8},
    "stale8_tis": {"rl.max_staleness": 8, **_TIS},
}
LABELS = {
    "uniform": "uniform", "dynamic": "dynamic (DAPO)", "knapsack": "Knapsack",
    "explore_on": "entropy band + temperature decay",
    "stale0_tis": "staleness 0 + TIS", "stale2": "staleness 2", "stale2_tis": "staleness 2 + TIS",
    "stale8": "staleness 8", "stale8_tis": "staleness 8 + TIS",
}
# In the shift study the default arm is on-policy without a correction; in the
# exploration study it runs without exploration controls.
STUDY_LABELS = {("shift", "dynamic"): "staleness 0",
                ("exploration", "dynamic"): "no controls"}


def label(study: str, arm: str) -> str:
  return STUDY_LABELS.get((study, arm), LABELS[arm])


def _set(cfg: ml_collections.ConfigDict, dotted: str, value) -> None:
  *path, leaf = dotted.split(".")
  node = cfg
  for part in path:
    node = node[part]
  if leaf not in node:
    raise KeyError(f"ablation override {dotted!r}: config has no key {leaf!r}")
  node[leaf] = value


def get_config(arg: str = "dynamic") -> ml_collections.ConfigDict:
  parts = [a for a in arg.split(",") if a]
  arm, variants = parts[0], set(parts[1:])
  if arm != "sft" and arm not in ARMS:
    raise ValueError(f"unknown ablation arm {arm!r}; valid: sft, {', '.join(ARMS)}")
  if variants - {"tiny"}:
    raise ValueError(f"unknown variant(s) {sorted(variants - {'tiny'})}; valid: tiny")
  cfg = default.get_config(",".join(sorted(variants)))
  if "tiny" in variants:
    cfg.rl.iterations = 4
    cfg.eval.every = 2
    cfg.tasks.train_size = 16
  else:
    cfg.rl.iterations = 20
    cfg.eval.every = 5
    cfg.tasks.train_size = 128
  cfg.checkpoint.every = 1_000_000  # only at stage ends: arms restart from SFT's
  if arm == "sft":
    cfg.stages = ("sft",)
    return cfg
  for dotted, value in ARMS[arm].items():
    _set(cfg, dotted, value)
  if arm == "explore_on" and "tiny" in variants:
    cfg.rl.exploration.temperature_steps = cfg.rl.iterations
  return cfg
