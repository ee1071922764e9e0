r"""SmolLM2-135M-Instruct on three agent tasks, and the invariant controllers
and turn-level credit on it (``python -m experiments.real_model`` runs them).

  python -m experiments.get_model smollm2-135m-instruct
  python -m experiments.train --config=experiments/configs/real_model.py:calculator_rl

A run is ``<task>_<arm>``: the instruct model scored zero-shot
(``eval.at_start``), a warm start (SFT on the environment's
demonstrations), then the arm's RL stage; ``<task>_sft`` stops after the
warm start, which ``experiments.real_model`` runs once per seed and task
and copies into each arm's directory. The tasks (:data:`TASKS`), each
through the host path with the model's own chat template:

- ``calculator``: three-digit arithmetic with a calculator tool offered in
  the template's tool-call format (``agentic_rl.envs.text_games.Calculator``).
- ``gem``: GEM's GuessTheNumber-v0-easy (``pip install -e ".[hubs]"``), warm
  started on binary search with random guesses among its moves.
- ``reasoning``: reasoning-gym's ``spell_backward`` (``pip install -e
  ".[hubs]"``) on words of up to five letters, two attempts.

Arms (:data:`ARMS`): ``rl`` (GRPO, uniform allocation, synchronous: the
base every study compares with), and on :data:`CONTROLLER_TASK` the
controllers' alternatives: ``dapo`` and ``knapsack`` (signal; every signal
arm stops at the same number of generated episodes), ``async2``,
``async2_tis``, ``async4``, ``async4_tis`` (shift), ``pass_at_k``
(exploration) and ``gigpo`` (turn-level credit). ``,tiny`` runs any of them
on a tiny model from scratch in seconds (tests).
"""

from __future__ import annotations

import ml_collections

from experiments import common
from experiments.configs import default

# Per task: the config keys of its warm start and RL stage (on top of
# default.py's smollm variant: SmolLM2-135M-Instruct, its chat template).
TASKS: dict[str, dict] = {
    "calculator": {
        "tasks.host_env": "calculator", "tasks.host_kwargs": '{"digits": 3}',
        "tasks.max_obs_tokens": 32, "sampling.max_turns": 3,
        "sampling.max_new_tokens_per_turn": 48, "sampling.max_total_tokens": 512,
        "sft.demo_noise": 0.0,
    },
    "gem": {
        "tasks.host_env": "gem:game:GuessTheNumber-v0-easy", "tasks.host_kwargs": "",
        "tasks.success_threshold": 0.9, "tasks.host_reward": "success",
        "tasks.max_obs_tokens": 128, "sampling.max_turns": 4,
        "sampling.max_new_tokens_per_turn": 16, "sampling.max_total_tokens": 640,
        "sft.demo_noise": 0.3,
    },
    "reasoning": {
        "tasks.host_env": "reasoning_gym:spell_backward",
        "tasks.host_kwargs": '{"max_attempts": 2, "max_word_len": 5}',
        "tasks.success_threshold": 0.99, "tasks.host_reward": "success",
        "tasks.max_obs_tokens": 48, "sampling.max_turns": 2,
        "sampling.max_new_tokens_per_turn": 24, "sampling.max_total_tokens": 256,
        "sft.demo_noise": 0.3,
    },
}
# The scale of every run on a 2-core CPU (a task's warm start and RL within
# 45 minutes): a short warm start, four small SFT steps that teach the
# format but leave the sampling policy unsure (a longer one wins every
# calculator episode, leaving RL nothing to improve), then 12 RL iterations
# of 8 prompts x 4 rollouts sampled at temperature 0.7 (at temperature 1 the
# warm-started policy rarely finishes an episode well, so a group's rollouts
# seldom differ); held-out success on 64 test prompts (greedy), and 16 x 2
# sampled at temperature 1, at the stages' ends.
SCALE = {
    "sft.steps": 4, "sft.batch_size": 8, "sft.num_demos": 64, "sft.learning_rate": 1.5e-5,
    "sft.warmup_steps": 0, "sft.pack": False,
    "rl.iterations": 12, "rl.prompts_per_step": 8, "rl.group_size": 4,
    "rl.learning_rate": 1e-5, "rl.temperature": 0.7, "rl.share_prefix": True,
    "rl.signal.allocation": "uniform",
    "eval.every": 1000, "eval.num_prompts": 64, "eval.pass_k": 2, "eval.pass_k_prompts": 16,
    "eval.batch_rows": 64, "tasks.train_size": 4096, "tasks.test_size": 64,
    "checkpoint.every": 2, "export.deploy_check": "off",
}
TINY_SCALE = {
    "sft.steps": 4, "sft.num_demos": 16, "sft.learning_rate": 1e-3, "rl.iterations": 3,
    "rl.prompts_per_step": 2, "rl.learning_rate": 1e-3, "eval.every": 3,
    "eval.num_prompts": 4, "eval.pass_k": 2, "eval.pass_k_prompts": 2, "eval.batch_rows": 4,
    "tasks.train_size": 64, "tasks.test_size": 8, "checkpoint.every": 2,
}
# The task the controller and credit studies run on.
CONTROLLER_TASK = "calculator"
_BUDGET = SCALE["rl.iterations"] * SCALE["rl.prompts_per_step"] * SCALE["rl.group_size"]


def _async(staleness: int, **overrides) -> dict:
  return {"rl.actor": "async", "rl.max_staleness": staleness, **overrides}


ARMS: dict[str, dict] = {
    "rl": {},
    "dapo": {"rl.signal.allocation": "dynamic", "rl.rollout_budget": _BUDGET,
             "rl.iterations": 3 * SCALE["rl.iterations"]},
    # Per-prompt group sizes: no shared prompt prefix in the learner.
    "knapsack": {"rl.signal.allocation": "knapsack", "rl.rollout_budget": _BUDGET,
                 "rl.iterations": 3 * SCALE["rl.iterations"], "rl.share_prefix": False},
    "async2": _async(2),
    "async2_tis": _async(2, **{"rl.correction": "tis"}),
    "async4": _async(4),
    "async4_tis": _async(4, **{"rl.correction": "tis"}),
    "pass_at_k": {"rl.advantage": "pass_at_k", "rl.advantage_kwargs.pass_at_k.k": 2},
    "gigpo": {"rl.advantage": "gigpo"},
}
LABELS = {"rl": "GRPO, uniform, synchronous", "dapo": "dynamic sampling (DAPO)",
          "knapsack": "Knapsack budgets", "async2": "staleness 2", "async2_tis": "staleness 2 + TIS",
          "async4": "staleness 4", "async4_tis": "staleness 4 + TIS",
          "pass_at_k": "pass@k advantages (k=2)", "gigpo": "GiGPO (turn-level groups)"}
# Study -> its arms (on CONTROLLER_TASK; "tasks": every task's base arm).
STUDIES: dict[str, tuple[str, ...]] = {
    "tasks": tuple(f"{task}_rl" for task in TASKS),
    "signal": ("rl", "dapo", "knapsack"),
    "shift": ("rl", "async2", "async2_tis", "async4", "async4_tis"),
    "exploration": ("rl", "pass_at_k"),
    "credit": ("rl", "gigpo"),
}


def runs_of(study: str) -> tuple[str, ...]:
  """The runs (``<task>_<arm>``) of ``study``."""
  if study == "tasks":
    return STUDIES["tasks"]
  return tuple(f"{CONTROLLER_TASK}_{arm}" for arm in STUDIES[study])


def warm_start(run: str) -> str:
  """The warm start run ``run`` starts from (its task's ``_sft``)."""
  return f"{run.split('_')[0]}_sft"


def get_config(arg: str = "calculator_sft") -> ml_collections.ConfigDict:
  name, *variants = [a for a in arg.split(",") if a]
  task, _, arm = name.partition("_")
  if task not in TASKS or (arm != "sft" and arm not in ARMS):
    raise ValueError(f"unknown run {name!r}: expected <task>_<arm> with a task of "
                     f"{', '.join(TASKS)} and an arm of sft, {', '.join(ARMS)}")
  if set(variants) - {"tiny"}:
    raise ValueError(f"unknown variant(s) {sorted(set(variants) - {'tiny'})}; valid: tiny")
  tiny = "tiny" in variants
  cfg = default.get_config("all,tiny" if tiny else "all,smollm")
  overrides = {"tasks.source": "host", **TASKS[task], **SCALE,
               **(TINY_SCALE if tiny else {})}
  if tiny:  # the tiny model's tokenizer takes more tokens for the same text
    overrides["sampling.max_total_tokens"] = max(overrides["sampling.max_total_tokens"], 768)
    overrides["sampling.max_new_tokens_per_turn"] = 64
  # Every run scores the instruct model first; an arm resumes from a copy of
  # its warm start's last checkpoint (experiments.real_model), at its RL stage.
  overrides["eval.at_start"] = True
  if arm == "sft":
    overrides["stages"] = ("sft",)
  else:
    overrides.update({"stages": ("sft", "rl"), **ARMS[arm]})
    if tiny and "rl.rollout_budget" in overrides:  # a budget the tiny stage reaches
      overrides.update({"rl.rollout_budget": 3 * 2 * 4, "rl.iterations": 6})
  for dotted, value in overrides.items():
    if dotted == "stages":
      cfg.stages = value
    else:
      common.set_dotted(cfg, dotted, value)
  return cfg
