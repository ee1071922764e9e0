r"""The default experiment: staged SFT then RL on a mix of multi-turn tool tasks.

  python -m experiments.train                                  # this config
  python -m experiments.train --config=experiments/configs/default.py:tiny
  python -m experiments.train --config.rl.loss=cispo --config.rl.group_size=8
  python -m experiments.train --config=experiments/configs/default.py:rl.signal \
      --config.rl.signal.allocation=ada --config.rl.signal.ada_max_rounds=2

The config sets the keys a run usually changes (``SHOWN``); every other key
of every section has its default in ``agentic_rl/train/settings.py``, which
says what each does. A variant naming a section by its dotted path
(``rl.signal``, ``rl.loss_kwargs``, ``tasks``, ``parl``, ``distill``, ...)
adds all of that section's keys at their defaults, so the command line can
set them; ``all`` adds every section's.

Stages run in the order of ``stages``; each names a section of this config
whose ``kind`` is ``sft``, ``rl`` or ``distill``. Add an RL stage by copying
``rl`` under a new name and listing it (``families`` picks its task
families); ``distill`` (add it with the ``distill`` variant) merges a teacher
per family into one student.

Named variants (comma-separated, with the sections): ``tiny`` (seconds, for
tests), ``calc`` (calculator chains only), ``offpolicy`` (``max_staleness=2``
with truncated importance sampling), ``ledger`` (the long-horizon host
family whose tool results outgrow the context: ``--config.context.policy``),
``stagewise`` (one RL stage per task family, ``rl_<family>``, in order),
``composed`` (the synthesised family of ``experiments/tasks/composed.json``),
``gem`` (a GEM game), ``smollm`` (SmolLM2-135M-Instruct from
``experiments.get_model`` on the guess-the-number game).
"""

import copy
import dataclasses
import os

import ml_collections

from agentic_rl.train import settings
from agentic_rl.train.settings import config_dict


# Where ``python -m experiments.get_model smollm2-135m-instruct`` puts the model.
SMOLLM_GGUF = "/tmp/agentic_rl_models/SmolLM2-135M-Instruct.Q4_1.gguf"


# The keys this config sets; every other key has its default in
# agentic_rl/train/settings.py, and a variant naming its section
# ("rl.signal", "tasks", "parl", ... or "all") adds them for the command line.
SHOWN = {
    "model": ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "dtype",
              "param_dtype", "init_from"),
    "tasks": ("source", "host_env", "host_kwargs", "families", "weights", "difficulty",
              "programs", "train_size", "test_size", "rewards"),
    "sampling": None, "eval": None, "mesh": None, "checkpoint": None,
    "sft": ("kind", "steps", "batch_size", "learning_rate", "warmup_steps", "demo_noise",
            "num_demos", "pack"),
    "rl": ("kind", "iterations", "prompts_per_step", "group_size", "advantage",
           "advantage_kwargs", "loss", "loss_kwargs", "correction", "correction_kwargs",
           "learning_rate", "optimizer", "updates_per_batch", "entropy_coef", "kl_coef",
           "kl_estimator", "actor", "max_staleness", "temperature", "share_prefix", "families",
           "signal", "shift", "exploration"),
}
# Of the nested sections SHOWN names, the keys shown (the rest are empty,
# for code to fill).
SHOWN_NESTED = {"rl.signal": ("allocation",)}
# The variants that are not a section.
VARIANTS = ("tiny", "calc", "offpolicy", "ledger", "stagewise", "composed", "gem", "smollm",
            "calculator")
# Every section "all" fills: the shown ones, the rest, and the optional
# mechanisms (a stage section of another name is filled when it is a stage).
SHOWN_ALL = (*SHOWN, "context", "export", "guards", "parl", "reward_hooks", "distill")


def _shown(name: str, instance, keys) -> ml_collections.ConfigDict:
  out = ml_collections.ConfigDict()
  for key in keys or [f.name for f in dataclasses.fields(instance)]:
    value = getattr(instance, key)
    nested = f"{name}.{key}"
    if key in settings.KWARGS_TABLES:  # the chosen estimator's (loss's, ...) table
      chosen = getattr(instance, settings.KWARGS_TABLES[key])
      out[key] = config_dict({chosen: value[chosen]} if chosen in value else {})
    elif isinstance(value, dict):
      out[key] = config_dict(value)
    elif dataclasses.is_dataclass(value):
      out[key] = (_shown(nested, value, SHOWN_NESTED[nested]) if nested in SHOWN_NESTED
                  else _empty(value))
    else:
      out[key] = config_dict({key: value})[key]
  return out


def _section(c: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  """``c[name]``, added empty when ``c`` has no such section."""
  if name not in c:
    c[name] = ml_collections.ConfigDict()
  return c[name]


def _empty(value) -> ml_collections.ConfigDict:
  """A section with no keys set, its nested sections as empty sections."""
  out = ml_collections.ConfigDict()
  if dataclasses.is_dataclass(value):
    for f in dataclasses.fields(value):
      if dataclasses.is_dataclass(getattr(value, f.name)):
        out[f.name] = _empty(getattr(value, f.name))
  return out


def add_section(c: ml_collections.ConfigDict, path: str) -> None:
  """Sets every key of the section at the dotted ``path`` of ``c`` that ``c``
  does not set, at its default, so the command line can set it."""
  top = path.split(".")[0]
  kind = c[top].get("kind") if top in c and top not in settings.Settings.__dataclass_fields__ \
      else None
  full = config_dict(settings.section_default(path, kind))
  node = c
  for name in path.split("."):
    if name not in node:
      node[name] = ml_collections.ConfigDict()
    node = node[name]
  _merge_missing(node, full)


def _merge_missing(node: ml_collections.ConfigDict, full: ml_collections.ConfigDict) -> None:
  for key, value in full.items():
    if key not in node:
      node[key] = value
    elif isinstance(value, ml_collections.ConfigDict) and isinstance(
        node[key], ml_collections.ConfigDict):
      _merge_missing(node[key], value)


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  """The default run, with the comma-separated variants of ``arg``: each a
  named variant (``VARIANTS``), a section's dotted path (every key of it at
  its default, e.g. ``rl.signal`` for ``--config.rl.signal.ada_max_rounds``)
  or ``all`` (every section)."""
  items = [a for a in arg.split(",") if a]
  variants = {a for a in items if a in VARIANTS}
  sections = [a for a in items if a not in VARIANTS]
  c = ml_collections.ConfigDict()
  c.seed = 0
  defaults = settings.Settings()
  for name, keys in SHOWN.items():
    instance = defaults[name] if name in defaults else getattr(defaults, name)
    c[name] = _shown(name, instance, keys)
  c.micro_batches = 1
  c.stages = ("sft", "rl")
  for path in sections:
    for each in (SHOWN_ALL + tuple(n for n in c.stages if n not in SHOWN_ALL)
                 if path == "all" else (path,)):
      try:
        add_section(c, each)
      except ValueError as e:
        raise ValueError(f"unknown config variant {path!r} ({e}); valid: "
                         f"{', '.join(VARIANTS)}, a section's dotted path, or all") from None

  if "calc" in variants:
    c.tasks.families, c.tasks.weights = ("calc_chain",), (1.0,)
  if "ledger" in variants:
    # The long-horizon family (agentic_rl/envs/text_games.py: Ledger): ten
    # actions whose tool results outgrow the context; pick a context policy
    # with --config.context.policy.
    c.tasks.update(source="host", host_env="ledger", max_obs_tokens=24,
                   host_kwargs='{"entries": 10, "min_entries": 2}')
    c.sampling.update(max_turns=12, max_new_tokens_per_turn=12, max_total_tokens=224)
    add_section(c, "context")
    c.context.max_resets = 6
    c.sft.demo_noise = 0.0  # Ledger's demonstrations have no mistakes to make
  if "gem" in variants:
    # A GEM game through the host path (pip install -e ".[gem]"): guess a
    # number from 1 to 10 in 4 turns from "higher"/"lower" hints, warm-started
    # on binary search with random guesses among its moves (sft.demo_noise;
    # agentic_rl/envs/gem.py: EXPERTS). GEM pays 1 for the number and
    # 1 - distance / 9 for a wrong last guess; RL is paid for finding it
    # alone (host_reward="success"). The game's rules take 367 tokens of the
    # prompt. Episodes are ~600 tokens (4x the built-in families'): smaller
    # SFT batches, the learner runs each group's rules once
    # (rl.share_prefix), and RL steps at 5e-4 on 16 prompts x 8 rollouts.
    c.tasks.update(source="host", host_env="gem:game:GuessTheNumber-v0-easy",
                   success_threshold=0.9, host_reward="success")
    c.sampling.update(max_turns=4, max_new_tokens_per_turn=12, max_total_tokens=640)
    c.sft.update(steps=30, batch_size=16, num_demos=1024, pack=False)
    c.rl.update(iterations=20, prompts_per_step=16, share_prefix=True, learning_rate=5e-4)
    c.eval.update(every=5, num_prompts=64, pass_k_prompts=16)
  if "smollm" in variants:
    # SmolLM2-135M-Instruct (python -m experiments.get_model
    # smollm2-135m-instruct writes it where init_from points) on the built-in
    # guess-the-number game, through its own chat template, sized for a
    # 2-core CPU: a short warm start on binary-search demonstrations teaches
    # the game's <answer>n</answer> format, then RL at a pretrained model's
    # learning rate.
    c.model.init_from = SMOLLM_GGUF
    c.tasks.update(source="host", host_env="guess_number",
                   host_kwargs='{"high": 8, "max_guesses": 4}', max_obs_tokens=32,
                   train_size=4096, test_size=64)
    c.sampling.update(max_turns=4, max_new_tokens_per_turn=16, max_total_tokens=192)
    # Unpacked: the 64 demonstrations are 64 rows (packed they fill only 7
    # rows of max_total_tokens, fewer than a batch).
    c.sft.update(steps=16, batch_size=8, num_demos=64, learning_rate=3e-5, warmup_steps=2,
                 demo_noise=0.2, pack=False)
    c.rl.update(iterations=6, prompts_per_step=4, group_size=4, learning_rate=2e-6,
                share_prefix=True)
    c.eval.update(every=3, num_prompts=16, pass_k=2, pass_k_prompts=8, batch_rows=16)
    c.checkpoint.every = 3
  if "calculator" in variants:
    # Three-digit arithmetic with the calculator tool offered in the chat
    # template (agentic_rl.envs.text_games.Calculator): with :smollm, the
    # multi-turn tool task a 135M model cannot do in its head.
    c.tasks.update(source="host", host_env="calculator", host_kwargs='{"digits": 3}',
                   max_obs_tokens=32, train_size=4096, test_size=64)
    c.sampling.update(max_turns=3, max_new_tokens_per_turn=48, max_total_tokens=512)
    c.sft.demo_noise = 0.0
  if "composed" in variants:
    # A synthesised family (experiments/tasks/composed.json, written by
    # experiments.synthesize): programs over the built-in tools.
    c.tasks.update(families=("composed",), weights=(1.0,), programs=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tasks", "composed.json"))
  if "offpolicy" in variants:
    c.rl.max_staleness = 2
    c.rl.correction = "tis"
  if "tiny" in variants:
    c.model.update(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                   head_dim=16, mlp_dim=64)
    c.sft.update(steps=4, batch_size=8, num_demos=64, pack=False)
    c.rl.update(iterations=3, prompts_per_step=4, group_size=2)
    if "distill" in c:
      c.distill.update(iterations=3, prompts_per_step=4)
    # The tiny policy rarely succeeds: an efficiency reward that does not
    # wait for success makes the rewards of a group differ, so every RL
    # update moves the parameters.
    c.tasks.rewards.efficiency_needs_success = False
    c.tasks.update(train_size=256, test_size=16)
    c.eval.update(every=2, num_prompts=8, pass_k=2, pass_k_prompts=4, batch_rows=8)
    c.checkpoint.every = 2
    # Loading torch for the deployment check takes seconds: tiny runs skip it
    # unless asked (--config.export.deploy_check=auto).
    _section(c, "export").update(deploy_check="off", check_prompts=4)
  if "stagewise" in variants:
    # One RL stage per task family, in tasks.families order (rl_<family>,
    # each a copy of rl): one policy trained family by family.
    per_family = [f"rl_{f}" for f in c.tasks.families]
    for name, family in zip(per_family, c.tasks.families):
      c[name] = copy.deepcopy(c.rl)
      c[name].families = (family,)
    c.stages = ("sft", *per_family)
  return c
