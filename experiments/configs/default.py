r"""The default experiment: staged SFT then RL on a mix of multi-turn tool tasks.

  python -m experiments.train                                  # this config
  python -m experiments.train --config=experiments/configs/default.py:tiny
  python -m experiments.train --config.rl.loss=cispo --config.rl.group_size=8

Stages run in the order of ``stages``; each names a section of this config
whose ``kind`` is ``sft``, ``rl`` or ``distill``. Add an RL stage by copying
``rl`` under a new name and listing it (``families`` picks its task
families); ``distill`` merges a teacher per family into one student.

Variants (the ``:arg`` suffix, comma-separated): ``tiny`` (seconds, for tests),
``calc`` (calculator chains only), ``offpolicy`` (``max_staleness=2`` with
truncated importance sampling), ``ledger`` (the long-horizon host family
whose tool results outgrow the context: ``--config.context.policy``),
``stagewise`` (one RL stage per task family, ``rl_<family>``, in order),
``composed`` (the synthesised family of ``experiments/tasks/composed.json``),
``smollm`` (SmolLM2-135M-Instruct from ``experiments.get_model`` on the
guess-the-number game).
"""

import copy
import dataclasses
import os

import ml_collections
from ml_collections.config_dict import placeholder

from agentic_rl import objectives
from agentic_rl.envs import registry
from agentic_rl.invariants import shift, signal
from agentic_rl.rollout import context


def _fields(cls, exclude=(), **overrides) -> ml_collections.ConfigDict:
  """Every field of the controller config ``cls`` with its default (None as a
  typed placeholder), so each can be set from the command line."""
  values = {f.name: f.default for f in dataclasses.fields(cls) if f.name not in exclude}
  values.update(overrides)
  return ml_collections.ConfigDict(
      {k: placeholder(object) if v is None else v for k, v in values.items()})


def _keyed(kind: str, **overrides) -> ml_collections.ConfigDict:
  """Every estimator's (``kind='advantage'``), loss's or correction's
  hyper-parameters with their defaults, keyed by its name; only the chosen
  one's are used (``--config.rl.loss_kwargs.cispo.eps_high=5``). None
  defaults are typed placeholders, so the command line can set them."""
  table = objectives.hyperparameter_defaults()[kind]
  for name, values in overrides.items():
    table[name].update(values)
  return ml_collections.ConfigDict({
      name: {k: placeholder(object) if v is None else v for k, v in kwargs.items()}
      for name, kwargs in table.items()})


def _sft_stage() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      kind="sft",
      # Long enough that every task family leaves the warm start with some
      # successes under sampling (RL cannot improve a family it never
      # solves), and no longer, so that RL has something left to teach.
      steps=250,
      batch_size=32,
      learning_rate=3e-3,
      warmup_steps=20,
      # constant (after the warm-up) or warmup_cosine (decays to 0 at the
      # stage's last step).
      schedule="",
      weight_decay=0.0,
      # Demonstrations from the scripted policies: several strategies, and
      # noise (wrong intermediate steps, early answers) so the warm-started
      # policy is competent but imperfect.
      demo_noise=0.35,
      num_demos=8192,
      # Pack several demonstrations into each row of max_total_tokens (each
      # attends only to itself), so a step spends no compute on padding:
      # batch_size rows then hold about twice as many demonstrations.
      pack=True,
      # Per task family, the share of each of its scripted strategies (in the
      # order of the family's `strategies`) among its demonstrations, e.g.
      # "--config.sft.strategy_weights.boxes=(0.6, 0.2, 0.2)"; empty: equal.
      strategy_weights=ml_collections.ConfigDict({name: () for name in registry.ENVS}),
  ))


def _rl_stage() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      kind="rl",
      iterations=30,
      # > 0: the stage ends once it has generated this many episodes
      # (signal/stage_rollouts; groups dynamic sampling drops included), or
      # after `iterations`, whichever comes first: arms whose allocation
      # spends rollouts differently then compare at equal sampling cost.
      rollout_budget=0,
      prompts_per_step=16,
      group_size=8,
      advantage="grpo",
      advantage_kwargs=_keyed("advantage", grpo=dict(ddof=0)),
      loss="ppo",
      loss_kwargs=_keyed("loss", ppo=dict(eps_high=0.28)),  # DAPO's clip-higher
      agg="token_mean",
      correction="none",  # behaviour/learner: none, tis, mis, icepop, opsm, decoupled
      correction_kwargs=_keyed("correction"),
      entropy_coef=0.0,
      # A KL penalty to a frozen reference policy, estimated by k1, k2 or k3
      # (logged as shift/kl_reference): the parameters the stage starts from,
      # or those of the latest checkpoint of the run directory reference_from.
      kl_coef=0.0,
      kl_estimator="k3",
      reference_from="",
      learning_rate=1e-3,
      warmup_steps=0,
      weight_decay=0.0,
      updates_per_batch=1,  # optimiser steps per rollout batch
      # The learner runs the prompt that a group's rollouts share once per
      # group, not once per rollout (agentic_rl.model.prefix): the same
      # losses to float rounding, a faster step for long prompts.
      share_prefix=False,
      # adamw, or mirror_descent (Kimi k1.5: the optimiser state restarts each
      # iteration; with loss='kimi', whose tau weighs the KL to its start).
      optimizer="adamw",
      # The actor: "sync" collects in the learner's thread; "async" in its
      # own, while the learner updates. max_staleness bounds the lag of every
      # token behind the learner, in updates (0: on-policy; the async actor
      # then waits for every update). actor_rows: episodes the async actor
      # keeps in flight on host environments (0: one batch, P * G); more
      # rows hide slow environments.
      actor="sync",
      actor_rows=0,
      # Toggle (Kimi K2.5, agentic_rl.objectives.toggle): every other block of
      # phase_iterations iterations (0: off) penalises by `penalty` a rollout
      # longer than its prompt's budget (the percentile of the policy's first
      # successful lengths) when the prompt's group succeeds above
      # accuracy_threshold.
      toggle=ml_collections.ConfigDict(dict(
          phase_iterations=0, accuracy_threshold=0.5, percentile=50.0, penalty=0.5)),
      max_staleness=0,
      # Invariant controllers (agentic_rl.invariants): signal.allocation is
      # uniform, dynamic (DAPO), ada (Reinforce-Ada) or knapsack; see
      # SignalConfig and ShiftConfig for every field. Dynamic sampling is the
      # default: with uniform allocation most groups of these tasks have
      # all-equal outcomes and carry no gradient. It redraws at most one
      # batch's worth of episodes per iteration.
      signal=_fields(signal.SignalConfig, exclude=("bands",), allocation="dynamic",
                     max_extra_rollout_frac=1.0),
      shift=_fields(shift.ShiftConfig, exclude=("bands", "max_staleness")),
      # Exploration controllers (ExplorationConfig): entropy_band=(low, high)
      # adapts the entropy bonus (starting at entropy_coef, which must then be
      # in [entropy_coef_min, entropy_coef_max]); temperature_schedule decays
      # the sampling temperature from `temperature` to temperature_final.
      exploration=ml_collections.ConfigDict(dict(
          entropy_band=(), entropy_coef_factor=1.1, entropy_coef_min=1e-5,
          entropy_coef_max=0.1, temperature_schedule="constant", temperature_final=1.0,
          temperature_steps=0)),
      temperature=1.0,
      top_k=0,
      top_p=1.0,
      # The task families (of tasks.families) this stage draws its prompts
      # from, in data order; () for all. Stages on different families train
      # one policy family by family.
      families=(),
  ))


def _distill_stage() -> ml_collections.ConfigDict:
  """One student from a teacher per task family (agentic_rl/train/distill.py).
  List it in ``stages`` and set the teachers' run directories:
  ``"--config.stages=('sft', 'distill')" --config.distill.teachers.calc_chain=DIR``."""
  return ml_collections.ConfigDict(dict(
      kind="distill",
      # on_policy: the student samples, the loss is the per-token reverse KL
      # to its prompt's teacher; teacher_sft: the teachers sample, the
      # student imitates their tokens.
      mode="on_policy",
      # The latest checkpoint of a run directory of this model per family;
      # "all" serves every family without its own.
      teachers=ml_collections.ConfigDict(
          {name: "" for name in (*registry.ENVS, "host", "all")}),
      iterations=40,
      prompts_per_step=16,
      group_size=1,
      learning_rate=1e-3,
      warmup_steps=0,
      weight_decay=0.0,
      temperature=1.0,
      top_k=0,
      top_p=1.0,
      families=(),
  ))


# Where ``python -m experiments.get_model smollm2-135m-instruct`` puts the model.
SMOLLM_GGUF = "/tmp/agentic_rl_models/SmolLM2-135M-Instruct.Q4_1.gguf"


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  variants = {a for a in arg.split(",") if a}
  valid = ("tiny", "calc", "offpolicy", "ledger", "stagewise", "composed", "gem", "smollm")
  unknown = variants - set(valid)
  if unknown:
    raise ValueError(f"unknown config variant(s) {sorted(unknown)}; valid: {', '.join(valid)}")
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.model = ml_collections.ConfigDict(dict(
      d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32,
      mlp_dim=384, rope_theta=10_000.0, tie_embeddings=True,
      dtype="float32", param_dtype="float32",
      # Kernel backends (agentic_rl.kernels.backends); "auto" is the
      # platform's choice: the XLA references on CPU (the same program as
      # "xla"), the Triton kernels on GPU, the Mosaic TPU kernels on TPU.
      attn_impl="auto", logprob_impl="auto", remat=False,
      # LoRA (agentic_rl.model.lora): rank > 0 trains low-rank adapters on
      # lora_targets only, scaled by lora_alpha / rank and stored in
      # lora_dtype; the base stays frozen in param_dtype, checkpoints hold
      # the adapters, experiments.export writes them merged.
      lora_rank=0, lora_alpha=16.0,
      lora_targets=("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"),
      lora_dtype="float32",
      # A local Hugging Face checkpoint directory (Llama, Qwen2/2.5, Qwen3,
      # Gemma 1/2/3) or GGUF file (pip install -e ".[gguf]") to start from:
      # its config.json (a GGUF's metadata) gives the architecture
      # (of the keys above only dtype, param_dtype, attn_impl, remat and the
      # lora_* ones apply), its weights the parameters, its tokenizer and chat
      # template the codec. Its tokenizer lacks the reserved tokens the jitted
      # families read, so it trains on host environments (tasks.source).
      init_from=""))
  c.tasks = ml_collections.ConfigDict(dict(
      # "jax": the built-in families below, stepped inside the jitted
      # rollout; "host": a Python environment (host_env: "MODULE:FACTORY",
      # "gem:<id>" or "guess_number"; host_kwargs: its keyword arguments, a
      # JSON object on the command line). env_pool: where each environment
      # runs, "threads" (here), "processes" (one each) or "ray" (actors).
      source="jax",
      host_env="",
      host_kwargs="",
      env_pool="threads",
      env_workers=8,
      env_timeout_s=60.0,
      max_obs_tokens=64,
      obs_overflow="end",
      success_threshold=0.5,
      # A host environment's reward: "env", its own (plus the efficiency
      # term below); "success", rewards.outcome when its summed reward is
      # above success_threshold, else 0: no partial credit.
      host_reward="env",
      families=("calc_chain", "multihop", "boxes"),
      # The programs of the "composed" family: a task dataset written by
      # experiments.synthesize (agentic_rl/envs/synthesis.py); empty: the
      # family's shipped set.
      programs="",
      weights=(0.34, 0.33, 0.33),
      # Difficulty levels of the task pool: prompt i has difficulty[i % len].
      difficulty=(1,),
      # Reward weights (agentic_rl/envs/rewards.py). efficiency counts the
      # share of the episode's budgets left unused: tool calls (max_turns),
      # policy tokens (max_turns times the tokens an action may have) and
      # seconds in the environment (time_budget_s; measured for host
      # environments, the tools' declared latencies for the built-in
      # families), each by its efficiency_weights entry. Both sources
      # default to calls and tokens only: time weighs 0, so the built-in
      # families keep their rewards and a host run's rewards stay
      # reproducible (measured time varies with the machine's load). A host
      # environment's reward is its own plus the efficiency term.
      rewards=ml_collections.ConfigDict(dict(
          outcome=1.0, format=0.1, efficiency=0.1, efficiency_needs_success=True,
          efficiency_weights=ml_collections.ConfigDict(dict(calls=0.5, tokens=0.5, time=0.0)),
          time_budget_s=1.0)),
      train_size=20_000,
      test_size=256,
  ))
  # Reward components beyond the environment's rules
  # (agentic_rl/train/reward_hooks.py), added to its reward with these
  # weights (0: off) and logged as reward/judge, reward/function. judge: a
  # rubric scored yes/no by a frozen judge, the latest checkpoint of the run
  # directory `run` (this tokenizer; any architecture), from `samples`
  # verdicts, their mean or majority. function: "MODULE:NAME", called as
  # NAME(rollout) -> [B] floats.
  c.reward_hooks = ml_collections.ConfigDict(dict(
      judge=ml_collections.ConfigDict(dict(
          weight=0.0, run="", samples=1, aggregate="mean",
          rubric="\nDid the assistant answer the question correctly? Answer yes or no: ")),
      function=ml_collections.ConfigDict(dict(weight=0.0, fn="")),
  ))
  # PARL (agentic_rl/train/parl.py): frozen sub-agents a host environment's
  # steps may spawn (agentic_rl/envs/swarm.py: Spawn; the built-in task
  # host_env="parallel_hops"). agents: {name: run directory}, a JSON object
  # on the command line; empty: off. rows: sub-episodes per engine call;
  # max_width: tasks per spawn; max_critical_steps: an episode reaching it
  # is truncated (0: none). charge: what the efficiency reward's calls part
  # counts, "critical" (sum over steps of 1 + the longest sub-episode) or
  # "total" steps. parallel_bonus, finish_bonus: weights of r_parallel
  # (parallel width / max_width) and r_finish (share of sub-episodes done),
  # annealed to 0 over anneal_iterations RL iterations (0: constant).
  c.parl = ml_collections.ConfigDict(dict(
      agents="", rows=16, max_width=4, max_critical_steps=0, charge="critical",
      parallel_bonus=0.0, finish_bonus=0.0, anneal_iterations=0))
  # share_prefill: the G rollouts of a prompt share one prefill of it (less
  # compute for long prompts); False prefills each row on its own, on the
  # compiled program evaluation already uses: the same episodes, and one
  # compilation fewer.
  # decode_shared_prefix: a group's rollouts also decode from one copy of
  # its cache (agentic_rl/model/prefix.py), faster for long prompts; the
  # same tokens up to float rounding, which can flip a near-tie draw.
  c.sampling = ml_collections.ConfigDict(dict(
      max_turns=6, max_new_tokens_per_turn=24, max_total_tokens=160,
      share_prefill=False, decode_shared_prefix=False))
  # What an episode does when its context (max_total_tokens) is full
  # (agentic_rl/rollout/context.py; host environments): "none" truncates it;
  # "drop_tool_results" keeps only the last keep_tool_results observations,
  # "summary" has the policy summarise (after summary_request), "discard_all"
  # restarts from the task and the last turn. Each rewrite starts a new
  # segment the learner scores as the policy saw it; at most max_resets.
  c.context = ml_collections.ConfigDict(dict(
      policy="none", keep_tool_results=2, max_resets=4,
      summary_request=context.SUMMARY_REQUEST))
  # Held-out evaluation every `every` RL iterations and at each stage's end:
  # greedy success on num_prompts test prompts, and pass_k samples at
  # temperature 1 on each of pass_k_prompts (eval/pass_at_1: the sampling
  # policy's success; eval/pass_at_k).
  c.eval = ml_collections.ConfigDict(dict(
      every=15, num_prompts=128, pass_k=4, pass_k_prompts=128, batch_rows=128))
  # After the last step: export the policy and score held-out episodes with
  # it in transformers (shift/deploy_logprob_diff_max in the summary): "auto"
  # where torch and transformers are installed, "on" (required) or "off".
  c.export = ml_collections.ConfigDict(dict(deploy_check="auto", check_prompts=8))
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  c.micro_batches = 1
  c.checkpoint = ml_collections.ConfigDict(dict(every=20, keep=2))
  # The run stops (with a checkpoint and a message) after this many steps in a
  # row whose loss or gradient was not finite (each such update is skipped).
  c.guards = ml_collections.ConfigDict(dict(max_consecutive_skips=20))
  c.stages = ("sft", "rl")
  c.sft = _sft_stage()
  c.rl = _rl_stage()
  c.distill = _distill_stage()  # not in stages unless listed

  if "calc" in variants:
    c.tasks.families, c.tasks.weights = ("calc_chain",), (1.0,)
  if "ledger" in variants:
    # The long-horizon family (agentic_rl/envs/text_games.py: Ledger): ten
    # actions whose tool results outgrow the context; pick a context policy
    # with --config.context.policy.
    c.tasks.update(source="host", host_env="ledger", max_obs_tokens=24,
                   host_kwargs='{"entries": 10, "min_entries": 2}')
    c.sampling.update(max_turns=12, max_new_tokens_per_turn=12, max_total_tokens=224)
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
    c.export.update(deploy_check="off", check_prompts=4)
  if "stagewise" in variants:
    # One RL stage per task family, in tasks.families order (rl_<family>,
    # each a copy of rl): one policy trained family by family.
    per_family = [f"rl_{f}" for f in c.tasks.families]
    for name, family in zip(per_family, c.tasks.families):
      c[name] = copy.deepcopy(c.rl)
      c[name].families = (family,)
    c.stages = ("sft", *per_family)
  return c
