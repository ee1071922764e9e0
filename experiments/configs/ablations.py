r"""Ablations of the invariant controllers, at small scale on a 2-core CPU.

  python -m experiments.ablate                       # every study, seeds 0,1,2
  python -m experiments.train --config=experiments/configs/ablations.py:knapsack

An arm is the default config (``default.py``) with its study's settings and
its own overrides. ``get_config("ARM")`` builds one (``"ARM,tiny"`` at the
test scale); ``"sft"``, ``"sft_boxes"`` and ``"sft_gem"`` are the warm
starts the arms share: each study's arms start their RL stage from the same
SFT checkpoint per seed, so they differ only in the ablated controller.

- ``signal`` (I2): uniform allocation, DAPO dynamic sampling (the default),
  Reinforce-Ada rounds and Knapsack budgets on a 64-prompt pool that recurs
  every four iterations, with the outcome as the only reward, each arm
  stopped at the same number of generated episodes (``rl.rollout_budget``:
  20 uniform iterations' worth), so they compare per rollout, not per
  iteration. Read the share of generated episodes that carry a gradient,
  the all-correct group fraction and final success.
- ``exploration`` (I1): hidden boxes with a three-turn limit, warm-started
  on demonstrations that are 60% ``linear`` search (open boxes upwards),
  which runs out of turns whenever the number is in the upper half, and 20%
  each ``reverse`` (fails on the lower half) and ``binary`` (always in
  time). Arms: no controls; an entropy band with a temperature decay;
  clip-higher with four updates per batch (against symmetric clipping with
  the same updates); Clip-Cov; KL-Cov; pass@k advantages. Read distinct
  successful strategies, pass@k and final success.
- ``shift`` (I3): the asynchronous actor at staleness 0, 1, 2, 4 and 8
  without correction; at 8 (the largest shift) with TIS, MIS and IcePop,
  and the adaptive staleness controller under 8 (with TIS). Read
  KL(behaviour ‖ learner), success and the RL stage's wall time.
- ``host``: GEM's GuessTheNumber (``pip install -e ".[gem]"``) through the
  host path: SFT on the game's scripted expert (binary search) with random
  guesses among its moves, then RL paid for finding the number. Read
  success after SFT and after RL.

Scale: 20 RL iterations of 16 prompts x 8 rollouts (the signal study: until
2560 episodes), evaluation every 5 iterations.
"""

from __future__ import annotations

import ml_collections

from experiments import common
from experiments.configs import default

STUDIES = {
    "signal": ("uniform", "dynamic", "ada", "knapsack"),
    "exploration": ("boxes_none", "boxes_entropy", "boxes_clip_sym", "boxes_clip_higher",
                    "boxes_clip_cov", "boxes_kl_cov", "boxes_pass_at_k"),
    "shift": ("async0", "async1", "async2", "async4", "async8", "async8_tis", "async8_mis",
              "async8_icepop", "async8_adaptive"),
    "host": ("gem",),
}
# Settings every arm of a study shares, its warm start's included.
_SIGNAL = {"tasks.train_size": 64, "rl.iterations": 60, "rl.rollout_budget": 2560,
           # The outcome alone (as in the papers): a group's rewards then
           # differ exactly when its outcomes do.
           "tasks.rewards.format": 0.0, "tasks.rewards.efficiency": 0.0}
_BOXES = {"tasks.families": ("boxes",), "tasks.weights": (1.0,), "tasks.difficulty": (0,),
          "sampling.max_turns": 3, "sft.strategy_weights.boxes": (0.6, 0.2, 0.2)}
# The gem variant (a GEM game through the host path) and its warm start: 30
# steps on noisy demonstrations (clean ones already win 89% greedily).
_GEM = {"sft.steps": 30}
# The settings that size a study; the tiny variant keeps its own.
_SCALE = ("tasks.train_size", "sft.steps", "sft.batch_size", "rl.iterations",
          "rl.prompts_per_step", "eval.num_prompts", "eval.pass_k_prompts")
STUDY_SETTINGS = {"signal": _SIGNAL, "exploration": _BOXES, "shift": {}, "host": _GEM}
# The config variant (default.py) a study starts from.
STUDY_VARIANTS = {"host": "gem"}
# The warm start of each study (an SFT-only config of its settings).
WARM_STARTS = {"signal": "sft", "exploration": "sft_boxes", "shift": "sft", "host": "sft_gem"}


def _async(staleness: int, **overrides) -> dict:
  return {"rl.actor": "async", "rl.max_staleness": staleness, **overrides}


_UPDATES = {"rl.updates_per_batch": 4}
ARMS: dict[str, dict] = {
    "uniform": {"rl.signal.allocation": "uniform"},
    "dynamic": {},
    "ada": {"rl.signal.allocation": "ada"},
    "knapsack": {"rl.signal.allocation": "knapsack"},
    "boxes_none": {},
    "boxes_entropy": {
        "rl.entropy_coef": 1e-3, "rl.temperature": 1.2,
        "rl.exploration.entropy_band": (0.3, 1.0), "rl.exploration.entropy_coef_factor": 1.5,
        "rl.exploration.entropy_coef_max": 0.05, "rl.exploration.temperature_schedule": "linear",
        "rl.exploration.temperature_final": 1.0, "rl.exploration.temperature_steps": 20},
    "boxes_clip_sym": {**_UPDATES, "rl.loss_kwargs.ppo.eps_high": 0.2},
    "boxes_clip_higher": {**_UPDATES, "rl.loss_kwargs.ppo.eps_high": 0.28},
    "boxes_clip_cov": {"rl.loss": "clip_cov"},
    "boxes_kl_cov": {"rl.loss": "kl_cov"},
    "boxes_pass_at_k": {"rl.advantage": "pass_at_k", "rl.advantage_kwargs.pass_at_k.k": 4},
    **{f"async{s}": _async(s) for s in (0, 1, 2, 4, 8)},
    "async8_tis": _async(8, **{"rl.correction": "tis"}),
    "async8_mis": _async(8, **{"rl.correction": "mis"}),
    "async8_icepop": _async(8, **{"rl.correction": "icepop"}),
    "async8_adaptive": _async(8, **{"rl.correction": "tis",
                                    "rl.shift.adaptive_staleness": True}),
    "gem": {},
}
LABELS = {
    "uniform": "uniform", "dynamic": "dynamic (DAPO)", "ada": "Reinforce-Ada",
    "knapsack": "Knapsack",
    "boxes_none": "no controls", "boxes_entropy": "entropy band + temperature decay",
    "boxes_clip_sym": "4 updates/batch, clip 0.2/0.2",
    "boxes_clip_higher": "4 updates/batch, clip-higher 0.2/0.28",
    "boxes_clip_cov": "Clip-Cov", "boxes_kl_cov": "KL-Cov", "boxes_pass_at_k": "pass@k advantages",
    "async0": "staleness 0", "async1": "staleness 1", "async2": "staleness 2",
    "async4": "staleness 4", "async8": "staleness 8", "async8_tis": "staleness 8 + TIS",
    "async8_mis": "staleness 8 + MIS", "async8_icepop": "staleness 8 + IcePop",
    "async8_adaptive": "adaptive bound ≤ 8 + TIS",
    "gem": "GEM GuessTheNumber-v0-easy",
}
STUDY_OF = {arm: study for study, arms in STUDIES.items() for arm in arms}


def label(study: str, arm: str) -> str:
  del study
  return LABELS[arm]


def warm_start(arm: str) -> str:
  """The name of the SFT run ``arm`` starts from."""
  return WARM_STARTS[STUDY_OF[arm]]


def get_config(arg: str = "dynamic") -> ml_collections.ConfigDict:
  parts = [a for a in arg.split(",") if a]
  arm, variants = parts[0], set(parts[1:])
  warm_starts = {name: study for study, name in WARM_STARTS.items()}
  if arm not in warm_starts and arm not in ARMS:
    raise ValueError(f"unknown ablation arm {arm!r}; valid: {', '.join(warm_starts)}, "
                     f"{', '.join(ARMS)}")
  if variants - {"tiny"}:
    raise ValueError(f"unknown variant(s) {sorted(variants - {'tiny'})}; valid: tiny")
  tiny = "tiny" in variants
  study = warm_starts.get(arm) or STUDY_OF[arm]
  base = {STUDY_VARIANTS[study]} if study in STUDY_VARIANTS else set()
  cfg = default.get_config(",".join(sorted(variants | base | {"all"})))
  for dotted, value in common.STUDY_BASE.items():
    if not (tiny and dotted in _SCALE):
      common.set_dotted(cfg, dotted, value)
  cfg.rl.iterations = 4 if tiny else 20
  cfg.eval.every = 2 if tiny else 5
  cfg.tasks.train_size = 16 if tiny else 128
  cfg.checkpoint.every = 1_000_000  # only at stage ends: arms restart from SFT's
  cfg.export.deploy_check = "off"  # a minute per run; the studies do not read it
  settings = dict(STUDY_SETTINGS[study])
  if arm == "sft":  # the signal study's pool is not part of the warm start
    settings = {}
  if tiny:  # a tiny pool, and a budget the tiny stage reaches
    settings = {k: v for k, v in settings.items() if k not in _SCALE}
    if "rl.rollout_budget" in settings:
      settings.update({"rl.iterations": 8, "rl.rollout_budget": 4 * 8})
  for dotted, value in settings.items():
    common.set_dotted(cfg, dotted, value)
  if arm.startswith("sft"):
    cfg.stages = ("sft",)
    return cfg
  for dotted, value in ARMS[arm].items():
    common.set_dotted(cfg, dotted, value)
  if tiny and cfg.rl.exploration.temperature_schedule != "constant":
    cfg.rl.exploration.temperature_steps = cfg.rl.iterations
  if tiny and cfg.rl.advantage == "pass_at_k":
    cfg.rl.advantage_kwargs.pass_at_k.k = cfg.rl.group_size
  return cfg
