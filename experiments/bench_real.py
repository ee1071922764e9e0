r"""Benchmark at the size of a real model, side by side with torch,
transformers and TRL.

  python -m experiments.bench_real --model=PATH --out=runs/bench_real.json \
      [--rounds=3] [--only=peak,rollout,learner,e2e] [sizes, below]

``--model`` is a GGUF file or a Hugging Face checkpoint directory; the
reference model is SmolLM2-135M-Instruct (Llama: 30 layers, hidden 576, 9
query / 3 key-value heads of 64, SwiGLU width 1536, vocab 49152, tied
embeddings, RoPE base 1e5; 134.5M parameters). It is read twice from the
same file: by transformers (``AutoModelForCausalLM.from_pretrained``, a GGUF
dequantised to float32) for the torch contenders, and by :func:`_load` for
ours (``agentic_rl.model.pretrained.load``). Same weights:
``logits_max_abs_diff_vs_torch`` is the max |logit difference| on the
rollout prompts (the first rows).

Every figure runs its contenders in this process, compiled and warmed up
first, then timed in ``--rounds`` interleaved rounds (each round times each
contender once, in an order reversed every round: ``common.time_interleaved``),
and reports each contender's best round, so that a shared machine's changing
speed affects all alike.

1. ``peak``: ``peak_gflops`` = {"xla_f32", "torch_f32", "xla_bf16",
   "torch_bf16"}: a ``--matmul_size`` square matmul (``jax.jit`` of
   ``jnp.matmul`` with float32 accumulation and result, as the model
   multiplies, and the project's XLA options for the dtype,
   ``model.compiler_options``; ``torch.mm``), ``2 n^3`` flops per call;
   bfloat16 only where the CPU has
   ``avx512_bf16`` or ``amx_bf16`` (``/proc/cpuinfo``), else null.
2. ``rollout``: for each of ``--rollout_batches`` rows of random
   ``--rollout_prompt_len``-token prompts, ``--rollout_new_tokens`` tokens
   sampled per row at temperature 1 with no stop token: ``RolloutEngine``
   (rows split over the XLA devices, as ``experiments.bench_rollout``'s
   ``engine``) against transformers ``generate`` (``do_sample``,
   ``min_new_tokens = max_new_tokens``), both in ``--rollout_dtype``
   (bfloat16: ours computes in it from float32 weights, transformers runs
   the model cast to it). ``rollout_vs_generate`` = {batch: generate's
   seconds / the engine's}; ``rollout`` holds each one's tokens/s.
3. ``learner``: one PPO-clip (token-mean) update with AdamW and global-norm
   clipping on ``--learner_batch`` rows of ``--learner_seq_len`` tokens (the
   first ``--learner_prompt_len`` of each a prompt, loss mask 0; random
   advantages; old log-probs from the initial weights):
   ``experiments.bench_learner``'s batch and step (data-parallel over the
   XLA devices) against the same update in torch (:func:`torch_learner`:
   the transformers model's logits, log-probs, the same clipped surrogate
   and entropies, ``clip_grad_norm_``, fused ``torch.optim.AdamW``). Both
   accumulate the gradient over ``--learner_micro_batches`` parts of the
   batch (the library's ``micro_batches``; torch's backward part by part):
   the same update in less memory: at 16 x 512 tokens torch's stored
   activations alone take 12 GB in one part, and a run in one part was
   killed for memory on a 23 GB machine (peaks measured alone at 16 x 512,
   SmolLM2-135M: torch 22 GB in one part, 14 GB in two; ours 9 GB in two).
   ``learner_vs_torch``: torch's seconds / ours, float32;
   ``learner_vs_torch_bf16``: the same with bfloat16 compute on float32
   master weights (ours ``dtype="bfloat16"``, torch under
   ``torch.autocast("cpu", torch.bfloat16)``), where the CPU has bfloat16.
   ``learner_peak_frac`` (``_bf16``): our step's achieved GFLOP/s over the
   XLA peak of figure 1 in the same precision, with the step's flops counted
   as ``6 * N * B * T + 12 * n_layers * n_heads * head_dim * B * T^2``: N
   the parameters that multiply activations (all of them, the input
   embedding excepted where it is not tied to the unembedding), 2 flops per
   multiply-add, forward plus a backward of twice its cost; the second term
   is attention's ``q k^T`` and ``p v`` over the full ``T x T`` square (no
   causal discount). Optimiser, norms and softmax are not counted.
4. ``e2e``: one whole GRPO iteration, ``--e2e_prompts`` prompts (of about
   ``--e2e_prompt_len`` tokens of text, tokenized by the model's tokenizer)
   x ``--e2e_samples`` samples x ``--e2e_new_tokens`` new tokens, one
   update, with a trivial reward (the share of even token ids among a
   completion's tokens). Ours (:func:`ours_iteration`) is the trainer's
   path, ``agentic_rl.train.rl``'s stages 1 to 5 with the library's
   default objective, signal, shift and optimiser configs: the rollout
   engine sampling the groups through ``signal.allocate_rollouts``,
   ``rl.shape_rewards``, ``rl.compute_advantages``,
   ``context.scored_rows``, ``rl.score_and_weight`` and ``rl.update`` (with
   ``--e2e_share_prefix``, a group's prompt is prefilled once in the rollout
   and run once in the update: ``sampling.share_prefill`` and
   ``rl.share_prefix``). The iteration's invariant metrics and controller
   updates (stage 6) are not included. TRL's is ``trl.GRPOTrainer`` with
   its defaults (gradient checkpointing, DAPO loss, beta 0, fused AdamW,
   learning rate 1e-6, ...) except what sets the same work: float32
   (``bf16=False``; ours runs float32 too), ``use_cpu``,
   ``per_device_train_batch_size = prompts * samples``,
   ``num_generations = samples``, ``max_completion_length = new tokens``
   and ``min_new_tokens`` of as many (no early stop), on its own copy of the
   same model. A TRL step is timed from ``on_step_begin`` to ``on_step_end``
   (generation, rewards, one optimiser update), and each TRL step is
   followed by one of our iterations, timed alike; the first of each is a
   warm-up. ``e2e_vs_trl`` = TRL's seconds / ours; null, with ``e2e_error``
   saying why, where TRL cannot run (not installed, no tokenizer, failed).
   ``e2e`` holds both's seconds and our fastest iteration's split into
   rollout and update.
5. ``trainer``: ``trainer_overhead``, the cost of an RL iteration inside
   ``experiments.train`` (the ``smollm`` config variant on ``--model``, RL
   only, one-turn episodes of the e2e figure's sizes on the
   guess-the-number host environment) over its engine rollout plus its
   learner step timed alone on the same batch (:func:`trainer_figure`);
   ``trainer`` holds the iterations' seconds, the fastest one's rollout and
   learner phases as the trainer times them (``perf/rollout_s``,
   ``perf/learner_s``) and the two timed alone.

Keys of the figures not run (``--only``) are null. The JSON also holds the
machine (CPU model, cores, bfloat16 flags), the date, the jax, torch,
transformers and trl versions, the command, the seconds each figure took
(``figure_seconds``, compilation and warm-up included) and the sizes
(``config``). On CPU the XLA devices are ``--cpu_devices`` host devices;
the engine splits its rows and the learner its batch over all of them. The
default is one device, which runs each program on every core: at this
model's size it was the faster layout on 2 cores (SmolLM2-135M, 8 rows of a
64-token prompt and 16 new tokens: engine 1.9 s on one device against 6.0 s
on two; learner step on 4 x 128 tokens: 149 against 100 GFLOP/s), unlike
``experiments.bench_rollout``'s 10M-parameter model.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import gc
import json
import os
import platform
import sys
import tempfile
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags
from absl import logging

from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl import rollout
from agentic_rl.invariants import exploration, shift, signal
from agentic_rl.objectives import GroupLayout
from agentic_rl.rollout import context
from agentic_rl.train import learner
from agentic_rl.train import rl as rl_lib
from agentic_rl.train import sharding
from experiments import bench_learner
from experiments import bench_rollout
from experiments import common

FIGURES = ("peak", "rollout", "learner", "e2e", "trainer")
# The goals the figures are read against (printed with the table).
GOALS = {"rollout_vs_generate": 2.0, "learner_vs_torch": 1.0, "learner_vs_torch_bf16": 1.2,
         "learner_peak_frac": 0.6, "e2e_vs_trl": 2.5, "trainer_overhead": 1.3}
_WORDS = ("the", "model", "answers", "a", "question", "about", "numbers", "and", "tools",
          "then", "checks", "each", "step", "of", "its", "work", "before", "it", "writes",
          "result", "42", "7", "plus", "times", "city", "weather", "file", "lines")


@dataclasses.dataclass(frozen=True)
class Config:
  """What one run measures (the flags; defaults are the full sizes)."""

  model: str
  rounds: int = 3
  only: tuple[str, ...] = FIGURES
  matmul_size: int = 2048
  rollout_batches: tuple[int, ...] = (16, 64)
  rollout_prompt_len: int = 256
  rollout_new_tokens: int = 128
  rollout_dtype: str = "float32"  # both contenders' compute dtype: float32 or bfloat16
  learner_batch: int = 16
  learner_seq_len: int = 512
  learner_prompt_len: int = 256
  learner_micro_batches: int = 4
  e2e_prompts: int = 8
  e2e_samples: int = 4
  e2e_new_tokens: int = 64
  e2e_prompt_len: int = 64
  e2e_share_prefix: bool = True
  bf16: str = "auto"  # "auto": where the CPU has bfloat16 instructions; "off"
  trl: str = "auto"  # "auto": time TRL where it imports; "off"
  seed: int = 0

  def validate(self) -> Config:
    unknown = [f for f in self.only if f not in FIGURES]
    if unknown:
      raise ValueError(f"unknown figures {unknown}; choose from {FIGURES}")
    if self.rounds < 1:
      raise ValueError(f"rounds must be >= 1, got {self.rounds}")
    if self.learner_micro_batches < 1 or self.learner_batch % self.learner_micro_batches:
      raise ValueError("learner_micro_batches must divide learner_batch")
    if not 0 <= self.learner_prompt_len < self.learner_seq_len:
      raise ValueError("learner_prompt_len must be in [0, learner_seq_len)")
    if self.rollout_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"rollout_dtype is float32 or bfloat16, got {self.rollout_dtype!r}")
    if self.bf16 not in ("auto", "off") or self.trl not in ("auto", "off"):
      raise ValueError("bf16 and trl are 'auto' or 'off'")
    return self


# ------------------------------------------------------------------ loading
def _split_gguf(path: str) -> tuple[str, dict]:
  """``(directory, from_pretrained kwargs)`` of a GGUF file or HF directory."""
  if path.endswith(".gguf"):
    return os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
  return path, {}


def _torch_model(path: str):
  """The transformers model of ``path`` (GGUF file or HF dir), float32, eval.

  A GGUF file's model comes back as a plain model holding the dequantised
  weights: transformers marks a model it read from GGUF as quantised, and
  then neither trains it (TRL) nor saves it."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  where, kw = _split_gguf(path)
  hf = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw)
  if kw:
    hf_config = copy.deepcopy(hf.config)
    if hasattr(hf_config, "quantization_config"):
      delattr(hf_config, "quantization_config")
    plain = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    plain.load_state_dict(hf.state_dict())
    plain.generation_config = hf.generation_config
    hf = plain
  return hf.eval()


def _load(path: str):
  """``(TransformerConfig, params)`` of a GGUF file or an HF directory."""
  return model_lib.pretrained.load(path)


def _tokenizer(path: str):
  """``(tokenizer, None)``, or ``(None, why not)``: the model's tokenizer,
  padding on the left as TRL's."""
  import transformers  # pylint: disable=import-outside-toplevel
  where, kw = _split_gguf(path)
  try:
    return transformers.AutoTokenizer.from_pretrained(where, padding_side="left", **kw), None
  except Exception as e:  # pylint: disable=broad-except
    return None, f"no tokenizer for {path}: {type(e).__name__}: {e}"


def cpu_info() -> dict:
  """The CPU's model name, cores and bfloat16 flags (``/proc/cpuinfo``)."""
  name, flags_ = None, set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name is None:
          name = value.strip()
        elif key.strip() == "flags" and not flags_:
          flags_ = set(value.split())
  except OSError:  # not Linux
    pass
  name = name or platform.processor() or platform.machine()
  bf16 = sorted(flags_ & {"avx512_bf16", "amx_bf16"})
  return {"cpu": name, "cores": os.cpu_count(), "bf16_flags": bf16,
          "machine": platform.machine()}


def _best(times) -> float:
  return float(min(times))


def _ratio(num, den):
  return None if num is None or den is None else num / den


# ------------------------------------------------------------------ 1. peak
def peak_gflops(n: int, rounds: int, bf16: bool) -> dict:
  """GFLOP/s of an ``n x n`` matmul in XLA and torch (``2 n^3`` flops a
  call, the mean of 5 calls in a row, best round); the bf16 entries null
  unless ``bf16``."""
  import torch  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  a_np, b_np = (rng.standard_normal((n, n), np.float32) for _ in range(2))
  contenders = {}
  for dtype in ("f32", "bf16") if bf16 else ("f32",):
    jdt, tdt = {"f32": (jnp.float32, torch.float32),
                "bf16": (jnp.bfloat16, torch.bfloat16)}[dtype]
    # As the model multiplies: float32 accumulation and result.
    matmul = jax.jit(functools.partial(jnp.matmul, preferred_element_type=jnp.float32),
                     compiler_options=model_lib.compiler_options(None, jdt))
    a, b = jnp.asarray(a_np, jdt), jnp.asarray(b_np, jdt)
    ta, tb = torch.from_numpy(a_np).to(tdt), torch.from_numpy(b_np).to(tdt)
    contenders[f"xla_{dtype}"] = functools.partial(
        lambda a, b: jax.block_until_ready(matmul(a, b)), a, b)
    contenders[f"torch_{dtype}"] = functools.partial(torch.mm, ta, tb)
  times = common.time_interleaved(contenders, warmup=1, repeats=rounds, calls=5)
  out = {k: None for k in ("xla_f32", "torch_f32", "xla_bf16", "torch_bf16")}
  out.update({k: 2 * n ** 3 / _best(t) / 1e9 for k, t in times.items()})
  return out


# ------------------------------------------------------------------ 2. rollout
def _row_sharding(rows: int):
  """A row sharding over every device where there are several and they
  split ``rows``, else None (as ``experiments.bench_rollout``)."""
  devices = jax.devices()
  if len(devices) < 2 or rows % len(devices):
    return None
  mesh = jax.make_mesh((len(devices),), ("rows",), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))


def rollout_figure(cfg: Config, config, params, hf, prompts_BxL: np.ndarray) -> dict:
  """Engine against ``generate`` at each batch size, interleaved."""
  L, N = cfg.rollout_prompt_len, cfg.rollout_new_tokens
  sampling = rollout.SamplingConfig(max_new_tokens_per_turn=N, max_turns=1,
                                    max_total_tokens=L + N)
  if cfg.rollout_dtype == "bfloat16":
    import torch  # pylint: disable=import-outside-toplevel
    config = dataclasses.replace(config, dtype="bfloat16")
    hf = copy.deepcopy(hf).to(torch.bfloat16)
  key = jax.random.key(cfg.seed)
  contenders, compile_s = {}, {}
  for B in cfg.rollout_batches:
    prompts = prompts_BxL[:B]
    engine = rollout.RolloutEngine(config, sampling, None, batch_size=B,
                                   row_sharding=_row_sharding(B))
    contenders["engine", B], compile_s[B] = bench_rollout.engine_contender(
        engine, params, prompts, np.full((B,), L, np.int32), key, name=f"engine_{B}")
    contenders["generate", B] = bench_rollout.hf_generate_contender(hf, prompts, N)
  times = common.time_interleaved(contenders, warmup=0, repeats=cfg.rounds)
  per_batch = {}
  for B in cfg.rollout_batches:
    engine_s, generate_s = _best(times["engine", B]), _best(times["generate", B])
    per_batch[str(B)] = {"engine_tokens_per_s": B * N / engine_s,
                         "generate_tokens_per_s": B * N / generate_s,
                         "engine_s": engine_s, "generate_s": generate_s,
                         "engine_compile_s": compile_s[B],
                         "engine_row_shards": len(jax.devices())
                         if _row_sharding(B) is not None else 1}
  return {"rollout_vs_generate": {b: v["generate_s"] / v["engine_s"]
                                  for b, v in per_batch.items()},
          "rollout": per_batch}


# ------------------------------------------------------------------ 3. learner
def learner_flops(config: model_lib.TransformerConfig, num_params: int, rows: int,
                  seq_len: int) -> float:
  """Flops of one update on ``rows x seq_len`` tokens (the module docstring's
  formula)."""
  matmul_params = num_params - (0 if config.tie_embeddings
                                else config.vocab_size * config.d_model)
  tokens = rows * seq_len
  attention = 12 * config.n_layers * config.n_heads * config.head_dim * tokens * seq_len
  return float(6 * matmul_params * tokens + attention)


def torch_learner(hf, batch: dict, optimizer_config: objectives.OptimizerConfig, *,
                  bf16: bool, micro_batches: int = 1, eps_low: float = 0.2,
                  eps_high: float = 0.2):
  """``(run, logp_BxT)``: ``run()`` applies to ``hf`` (trained in place) the
  update ``learner.rl_loss(objective=ppo)`` makes: per-token log-probs
  (``z_y - logsumexp(z)``) and entropies from the float32 logits
  (``hf.lm_head`` on ``hf.model``'s last hidden states), the PPO-clip
  surrogate over the loss-masked tokens divided by their count,
  ``clip_grad_norm_``, and ``torch.optim.AdamW`` (fused) with the optimiser
  config's settings; ``bf16`` runs the model under ``torch.autocast("cpu",
  bfloat16)``; the gradient is accumulated over ``micro_batches`` equal
  parts of the rows (forward and backward one part at a time).
  ``logp_BxT`` (numpy, entry 0 of each row 0, as ``sequence_logprobs``) is
  the first call's, at the weights before it."""
  import torch  # pylint: disable=import-outside-toplevel
  from agentic_rl.objectives.losses import MAX_LOG_RATIO  # pylint: disable=import-outside-toplevel
  tokens = torch.from_numpy(np.array(batch["tokens_BxT"])).long()
  targets = tokens[:, 1:]
  mask = torch.from_numpy(np.array(batch["loss_mask_BxT"], np.float32))[:, 1:]
  adv = torch.from_numpy(np.array(batch["advantages"], np.float32))[:, None]
  old_logp = torch.from_numpy(np.array(batch["old_logp_BxT"], np.float32))[:, 1:]
  num_tokens = mask.sum().clamp(min=1.0)
  lo, hi = 1.0 - eps_low, 1.0 + eps_high
  hf.train()
  kw = dict(lr=optimizer_config.learning_rate, betas=(optimizer_config.b1, optimizer_config.b2),
            eps=optimizer_config.eps, weight_decay=optimizer_config.weight_decay)
  try:
    opt = torch.optim.AdamW(hf.parameters(), fused=True, **kw)
  except (RuntimeError, TypeError):
    opt = torch.optim.AdamW(hf.parameters(), **kw)

  def micro_step(rows):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
      hidden = hf.model(tokens[rows]).last_hidden_state[:, :-1]
      logits = hf.lm_head(hidden).float()
    # log pi(y) = z_y - logsumexp(z), without a [B, T, V] log-softmax (as TRL's
    # selective_log_softmax in float32).
    logp = (logits.gather(-1, targets[rows][..., None])[..., 0]
            - torch.logsumexp(logits, dim=-1))
    with torch.no_grad():  # row by row: no second [B, T, V] temporary
      entropy = torch.stack([-(lp.exp() * lp).sum(-1)
                             for lp in map(functools.partial(torch.log_softmax, dim=-1),
                                           logits)])
    del hidden, logits
    ratio = torch.exp(torch.clamp(logp - old_logp[rows], -MAX_LOG_RATIO, MAX_LOG_RATIO))
    a = adv[rows]
    clipped = ((a > 0) & (ratio > hi)) | ((a < 0) & (ratio < lo))
    per_token = torch.where(clipped, -a * ratio.detach().clamp(lo, hi), -a * ratio)
    # Divided by the whole batch's token count, so the parts' gradients add
    # up to the batch's (as the learner's micro-batches).
    ((per_token * mask[rows]).sum() / num_tokens).backward()
    return logp.detach(), entropy

  def step():
    opt.zero_grad(set_to_none=True)  # last step's gradients go before the forward
    outs = [micro_step(rows) for rows in torch.arange(len(tokens)).chunk(micro_batches)]
    if optimizer_config.grad_clip_norm is not None:
      torch.nn.utils.clip_grad_norm_(hf.parameters(), optimizer_config.grad_clip_norm)
    opt.step()
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

  logp, _ = step()
  logp_BxT = np.pad(logp.float().numpy(), ((0, 0), (1, 0)))

  def run():
    step()

  return run, logp_BxT


def learner_figure(cfg: Config, config, params, hf, bf16: bool, peak: dict | None) -> dict:
  """Our learner step against torch's, float32 (and bfloat16), interleaved."""
  bench = bench_learner.BenchConfig(batch=cfg.learner_batch, seq_len=cfg.learner_seq_len,
                                    prompt_len=cfg.learner_prompt_len, seed=cfg.seed)
  host_params = jax.tree.map(np.asarray, params)  # the step donates its state
  batch = bench_learner.make_batch(bench, config, host_params)
  opt_config = objectives.OptimizerConfig()
  optimizer = objectives.make_optimizer(opt_config)
  compile_s, logp_diff, times = {}, {}, {}
  precisions = ("f32", "bf16") if bf16 else ("f32",)
  mask = batch["loss_mask_BxT"] > 0
  # One precision at a time (ours and torch's interleaved), so that only one
  # pair of optimiser states and activations is held at once.
  for precision in precisions:
    ours_config = config if precision == "f32" else dataclasses.replace(config,
                                                                        dtype="bfloat16")
    contenders = {}
    contenders["ours", precision], compile_s[f"ours_{precision}"] = bench_learner.ours(
        "data", ours_config, host_params, batch, optimizer,
        micro_batches=cfg.learner_micro_batches)
    start = time.perf_counter()
    hf_train = copy.deepcopy(hf)  # trained in place: each precision from the same weights
    contenders["torch", precision], torch_logp = torch_learner(
        hf_train, batch, opt_config, bf16=precision == "bf16",
        micro_batches=cfg.learner_micro_batches)
    compile_s[f"torch_{precision}_first_step"] = time.perf_counter() - start
    logp_diff[precision] = float(np.max(np.abs(torch_logp - batch["old_logp_BxT"])[mask]))
    times.update(common.time_interleaved(contenders, warmup=0, repeats=cfg.rounds))
    del contenders, hf_train
    gc.collect()
  num_params = sum(int(x.size) for x in jax.tree.leaves(host_params))
  flops = learner_flops(config, num_params, cfg.learner_batch, cfg.learner_seq_len)
  detail = {"flops_per_step": flops, "model_params": num_params, "compile_s": compile_s,
            "logp_max_abs_diff_vs_torch": logp_diff}
  out = {"learner_vs_torch": None, "learner_vs_torch_bf16": None,
         "learner_peak_frac": None, "learner_peak_frac_bf16": None}
  for precision in precisions:
    ours_s, torch_s = _best(times["ours", precision]), _best(times["torch", precision])
    gflops = flops / ours_s / 1e9
    detail.update({f"ours_{precision}_s": ours_s, f"torch_{precision}_s": torch_s,
                   f"ours_{precision}_gflops": gflops,
                   f"torch_{precision}_gflops": flops / torch_s / 1e9})
    suffix = "" if precision == "f32" else "_bf16"
    out[f"learner_vs_torch{suffix}"] = torch_s / ours_s
    if peak is not None and peak.get(f"xla_{precision}"):
      out[f"learner_peak_frac{suffix}"] = gflops / peak[f"xla_{precision}"]
  out["learner"] = detail
  return out


# ------------------------------------------------------------------ 4. e2e
def trivial_reward(completion_ids) -> float:
  """The share of even token ids among a completion's tokens."""
  ids = np.asarray(completion_ids)
  return float(np.mean(ids % 2 == 0)) if ids.size else 0.0


def e2e_prompts(tokenizer, num: int, approx_len: int, vocab: int, seed: int):
  """``(texts or None, token id lists)``: ``num`` prompts of about
  ``approx_len`` tokens, words drawn at random, tokenized as TRL tokenizes
  a plain-text prompt (``tokenizer(text=...)``); random ids without a
  tokenizer."""
  rng = np.random.default_rng(seed)
  if tokenizer is None:
    return None, [rng.integers(3, vocab, approx_len).tolist() for _ in range(num)]
  texts = []
  for i in range(num):
    words = [f"Prompt {i}:"]
    while len(tokenizer(text=" ".join(words))["input_ids"]) < approx_len:
      words.append(str(rng.choice(_WORDS)))
    texts.append(" ".join(words))
  return texts, [list(ids) for ids in tokenizer(text=texts)["input_ids"]]


def ours_iteration(config, params, prompt_ids: list[list[int]], samples: int,
                   new_tokens: int, *, share_prefix: bool, seed: int):
  """``(iterate, compile_s)``: ``iterate()`` runs one GRPO iteration on the
  prompts (the module docstring's stages) and waits for its update;
  ``iterate.parts`` lists each call's seconds: ``total_s``, ``rollout_s``
  (the sampling, as ``rl.collect`` times it) and ``update_s``."""
  P, G = len(prompt_ids), samples
  L = max(len(p) for p in prompt_ids)
  prompts_PxL = np.zeros((P, L), np.int32)
  for i, ids in enumerate(prompt_ids):
    prompts_PxL[i, :len(ids)] = ids
  lens_P = np.array([len(p) for p in prompt_ids], np.int32)
  sampling = rollout.SamplingConfig(max_new_tokens_per_turn=new_tokens, max_turns=1,
                                    max_total_tokens=L + new_tokens)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=-1))
  shards = sharding.batch_shards(mesh)
  rows = P * G
  group = G if share_prefix else 1
  engine = rollout.RolloutEngine(
      config, sampling, None, batch_size=rows, group_size=group,
      row_sharding=sharding.batch_sharding(mesh) if shards > 1 and rows % shards == 0
      else None)
  objective = objectives.ObjectiveConfig()
  optimizer = objectives.make_optimizer(objectives.OptimizerConfig())
  host_params = jax.tree.map(np.asarray, params)
  step_fn, state_sh = learner.shard_train_step(
      learner.make_train_step(learner.rl_loss(config, objective, group_size=group),
                              optimizer),
      mesh, config, optimizer, host_params, group_size=group)
  stage = rl_lib.RLStage(P, G, 1, sampling, objective, objectives.required_inputs(objective),
                         signal.SignalConfig(), shift.ShiftConfig(),
                         exploration.ExplorationConfig(), step_fn, state_sh)
  run_view = types.SimpleNamespace(mesh=mesh)  # what score_and_weight reads of a Run
  box = [jax.device_put(learner.init_train_state(host_params, optimizer), state_sh)]
  key = jax.random.key(seed)
  calls = [0]

  def iterate():
    state, i = box[0], calls[0]
    calls[0] += 1
    version = int(state.step)

    def sample_fn(ids_N, n, k):
      ids_N = np.asarray(ids_N)
      if n == G and group == G:  # each prompt prefilled once for its G rows
        prompts, lens = prompts_PxL[ids_N], lens_P[ids_N]
      else:
        prompts, lens = np.repeat(prompts_PxL[ids_N], n, 0), np.repeat(lens_P[ids_N], n)
      ro = jax.tree.map(np.asarray, engine.rollout(state.params, prompts, lens, None, k,
                                                    version))
      mask = ro.loss_mask_BxT > 0
      reward_B = np.array([trivial_reward(t[m]) for t, m in zip(ro.tokens_BxT, mask)],
                          np.float32)
      outcome_B = (reward_B > 0.5).astype(np.float32)
      ro = ro.replace(reward_B=reward_B, reward_components={"outcome": outcome_B})
      return (outcome_B > 0.5).reshape(len(ids_N), n), ro

    t0 = time.perf_counter()
    k = jax.random.fold_in(key, i)
    sampled = signal.allocate_rollouts(stage.signal_cfg, sample_fn, np.arange(P), G, k)
    collected = rl_lib.Collected(sampled.rollouts,
                                 GroupLayout.of(sampled.group, sampled.num_groups), sampled,
                                 None, time.perf_counter() - t0, 1.0, step=i)
    shaped = rl_lib.shape_rewards(stage, collected)
    advantages = rl_lib.compute_advantages(stage, collected, shaped)
    scored = context.scored_rows(collected.batch)
    learn_batch, _ = rl_lib.score_and_weight(run_view, stage, state, scored, shaped,
                                             advantages, 0.0, 1.0)
    box[0], learned = rl_lib.update(stage, state, learn_batch)
    iterate.parts.append({"total_s": time.perf_counter() - t0,
                          "rollout_s": collected.seconds, "update_s": learned.seconds})

  iterate.parts = []
  start = time.perf_counter()
  iterate()
  return iterate, time.perf_counter() - start


def trl_e2e(hf, tokenizer, texts: list[str], samples: int, new_tokens: int, rounds: int,
            ours, seed: int) -> tuple[list[float], list[float], dict]:
  """TRL's ``GRPOTrainer`` for ``rounds + 1`` steps, each followed by one
  call of ``ours``; returns both's seconds per step (the first, a warm-up,
  dropped) and TRL's settings."""
  # pylint: disable=import-outside-toplevel
  import datasets
  import transformers
  import trl
  # pylint: enable=import-outside-toplevel
  trl_s, ours_s = [], []

  class Interleave(transformers.TrainerCallback):
    """Times each TRL step, then one of ours."""

    def on_step_begin(self, args, state, control, **kwargs):
      self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
      trl_s.append(time.perf_counter() - self.start)
      start = time.perf_counter()
      ours()
      ours_s.append(time.perf_counter() - start)

  def reward(completions, completion_ids, **kwargs):
    del completions, kwargs
    return [trivial_reward(ids) for ids in completion_ids]

  settings = dict(use_cpu=True, bf16=False, per_device_train_batch_size=len(texts) * samples,
                  num_generations=samples, max_completion_length=new_tokens,
                  generation_kwargs={"min_new_tokens": new_tokens}, max_steps=rounds + 1,
                  save_strategy="no", report_to=[], disable_tqdm=True, seed=seed)
  with tempfile.TemporaryDirectory() as tmp:
    args = trl.GRPOConfig(output_dir=tmp, **settings)
    trainer = trl.GRPOTrainer(model=hf, reward_funcs=reward, args=args,
                              train_dataset=datasets.Dataset.from_dict({"prompt": texts}),
                              processing_class=tokenizer, callbacks=[Interleave()])
    trainer.train()
    info = {"trl": trl.__version__, "settings": settings,
            "gradient_checkpointing": bool(args.gradient_checkpointing),
            "loss_type": args.loss_type, "beta": args.beta, "optim": str(args.optim)}
  if len(trl_s) < 2:
    raise RuntimeError(f"TRL ran {len(trl_s)} steps, expected {rounds + 1}")
  return trl_s[1:], ours_s[1:], info


def e2e_figure(cfg: Config, config, params, hf) -> dict:
  """A GRPO iteration of ours against TRL's (interleaved), or ours alone."""
  tokenizer, why = _tokenizer(cfg.model)
  texts, prompt_ids = e2e_prompts(tokenizer, cfg.e2e_prompts, cfg.e2e_prompt_len,
                                  config.vocab_size, cfg.seed)
  iterate, compile_s = ours_iteration(config, params, prompt_ids, cfg.e2e_samples,
                                      cfg.e2e_new_tokens, share_prefix=cfg.e2e_share_prefix,
                                      seed=cfg.seed)
  detail = {"ours_compile_s": compile_s, "prompt_tokens": [len(p) for p in prompt_ids],
            "share_prefix": cfg.e2e_share_prefix}
  error = None
  if cfg.trl == "off":
    error = "--trl=off"
  elif tokenizer is None:
    error = why
  else:
    try:
      import trl  # pylint: disable=import-outside-toplevel,unused-import
    except ImportError as e:
      error = f"trl does not import: {e} (pip install -e .[bench])"
  trl_s = None
  if error is None:
    try:
      trl_s, ours_s, info = trl_e2e(copy.deepcopy(hf), tokenizer, texts, cfg.e2e_samples,
                                    cfg.e2e_new_tokens, cfg.rounds, iterate, cfg.seed)
      detail.update(trl_s=_best(trl_s), trl_info=info)
    except Exception as e:  # pylint: disable=broad-except
      error = f"TRL failed: {type(e).__name__}: {e}"
      trl_s = None
  if trl_s is None:
    ours_s = common.time_interleaved({"ours": iterate}, warmup=1, repeats=cfg.rounds)["ours"]
  detail["ours_s"] = _best(ours_s)
  detail["ours_fastest_parts"] = min(iterate.parts[1:], key=lambda p: p["total_s"])
  return {"e2e_vs_trl": None if trl_s is None else detail["trl_s"] / detail["ours_s"],
          "e2e_error": error, "e2e": detail}


# ------------------------------------------------------------------ 5. trainer
def trainer_config(cfg: Config):
  """The ``smollm`` config variant on ``cfg.model``, RL only: ``cfg.rounds +
  2`` iterations of ``e2e_prompts`` x ``e2e_samples`` one-turn episodes of
  at most ``e2e_new_tokens`` tokens, uniform allocation (no dynamic
  resampling: a fixed amount of work), no checkpoint, evaluation or deploy
  check before the last iteration."""
  from experiments.configs import default as default_config  # pylint: disable=import-outside-toplevel
  c = default_config.get_config("all,smollm")
  c.model.init_from = cfg.model
  c.stages = ("rl",)
  c.sampling.update(max_turns=1, max_new_tokens_per_turn=cfg.e2e_new_tokens)
  c.rl.update(iterations=cfg.rounds + 2, prompts_per_step=cfg.e2e_prompts,
              group_size=cfg.e2e_samples)
  c.rl.signal.allocation = "uniform"
  c.eval.update(every=10**6, num_prompts=4, pass_k=1, batch_rows=4)
  c.checkpoint.every = 10**6
  c.export.deploy_check = "off"
  c.seed = cfg.seed
  return c


def trainer_figure(cfg: Config) -> dict:
  """``experiments.train``'s RL iterations against the same work alone.

  The trainer (``train.loop.train`` on :func:`trainer_config`) runs ``rounds
  + 2`` iterations: the first compiles, the last evaluates, and the
  iterations between are timed (``perf/step_s``: collection on the host
  environment, rewards, advantages, scoring, the update, the invariants'
  metrics and controllers, logging). The last iteration's rollouts and
  learner batch are kept, and then timed alone, interleaved, for
  ``rounds``: the trainer's ``RolloutEngine`` (its sampling, codec and stop
  tokens, no environment) on the same first prompts, and the stage's
  compiled learner step on the same batch. ``trainer_overhead`` = the
  trainer's fastest iteration / (the fastest rollout alone + the fastest
  step alone)."""
  from agentic_rl.train import loop  # pylint: disable=import-outside-toplevel
  kept = {}
  build, shape_rewards, update = loop.build, rl_lib.shape_rewards, rl_lib.update
  last = cfg.rounds + 1

  def keep_run(c):
    kept["run"] = build(c)
    return kept["run"]

  def keep_collected(stage, collected, budget=None):  # the iteration's first use of it
    if collected.step == last:
      kept.update(stage=stage, collected=collected)
    return shape_rewards(stage, collected, budget)

  def keep_batch(stage, state, learn_batch):
    if "stage" in kept and "batch" not in kept:  # the last iteration's update
      kept.update(batch=learn_batch, state=jax.tree.map(jnp.copy, state))
    return update(stage, state, learn_batch)

  with tempfile.TemporaryDirectory() as workdir:
    loop.build, rl_lib.shape_rewards, rl_lib.update = keep_run, keep_collected, keep_batch
    try:
      start = time.perf_counter()
      loop.train(trainer_config(cfg), workdir)
      train_s = time.perf_counter() - start
    finally:
      loop.build, rl_lib.shape_rewards, rl_lib.update = build, shape_rewards, update
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      records = [r for r in map(json.loads, f) if "perf/rollout_s" in r]  # RL iterations
  timed = records[1:-1]
  run, stage, collected = kept["run"], kept["stage"], kept["collected"]
  ro = collected.batch
  rows = ro.tokens_BxT.shape[0]
  L = int(np.max(ro.prompt_len_B))
  # The batch's prompts decoded alone, without the environment in the loop.
  engine = rollout.RolloutEngine(run.model_config, stage.sampling, run.codec.ids,
                                 batch_size=rows)
  params = jax.tree.map(jnp.copy, kept["state"].params)  # the step donates the state
  box = [kept["state"]]
  key = jax.random.key(cfg.seed)

  def rollout_alone():
    out = engine.rollout(params, np.asarray(ro.tokens_BxT[:, :L]), np.asarray(ro.prompt_len_B),
                         None, key, 0)
    jax.block_until_ready(out.tokens_BxT)

  def step_alone():
    box[0], m, _ = stage.step_fn(box[0], kept["batch"])
    jax.block_until_ready(m)

  start = time.perf_counter()
  rollout_alone()
  step_alone()
  compile_s = time.perf_counter() - start
  times = common.time_interleaved({"rollout": rollout_alone, "step": step_alone}, warmup=0,
                                  repeats=cfg.rounds)
  best = min(timed, key=lambda r: r["perf/step_s"])
  alone = _best(times["rollout"]) + _best(times["step"])
  detail = {"iteration_s": [r["perf/step_s"] for r in timed],
            "fastest": {k: best[k] for k in ("perf/step_s", "perf/rollout_s", "perf/learner_s")},
            "rollout_alone_s": _best(times["rollout"]), "step_alone_s": _best(times["step"]),
            "alone_compile_s": compile_s, "train_s": train_s, "rows": rows,
            "policy_tokens": int(np.sum(ro.loss_mask_BxT)),
            "tokens_per_row": int(ro.tokens_BxT.shape[1])}
  return {"trainer_overhead": best["perf/step_s"] / alone, "trainer": detail}


# ------------------------------------------------------------------ the run
def run(cfg: Config, progress=None) -> dict:
  """Runs the figures of ``cfg.only``; returns the JSON record.
  ``progress(name, result)``, when given, is called after loading and after
  each figure with the record so far (``figure_seconds`` updated)."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  cfg = cfg.validate()
  load_start = os.getloadavg()[0]
  machine = cpu_info()
  bf16 = cfg.bf16 == "auto" and bool(machine["bf16_flags"])
  t0 = time.perf_counter()
  hf = _torch_model(cfg.model)
  config, params = _load(cfg.model)
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  rng = np.random.default_rng(cfg.seed)
  prompts_BxL = rng.integers(3, config.vocab_size,
                             (max(cfg.rollout_batches), cfg.rollout_prompt_len)).astype(np.int32)
  logit_diff = bench_rollout.logits_max_abs_diff(hf, params, config, prompts_BxL[:4])
  seconds = {"load": time.perf_counter() - t0}
  result = {"figure_seconds": seconds, "peak_gflops": None, "rollout_vs_generate": None,
            "rollout": None,
            "learner_vs_torch": None, "learner_vs_torch_bf16": None,
            "learner_peak_frac": None, "learner_peak_frac_bf16": None, "learner": None,
            "e2e_vs_trl": None, "e2e_error": None, "e2e": None,
            "trainer_overhead": None, "trainer": None,
            "logits_max_abs_diff_vs_torch": logit_diff}
  figures = {
      "peak": lambda: {"peak_gflops": peak_gflops(cfg.matmul_size, cfg.rounds, bf16)},
      "rollout": lambda: rollout_figure(cfg, config, params, hf, prompts_BxL),
      "learner": lambda: learner_figure(cfg, config, params, hf, bf16, result["peak_gflops"]),
      "e2e": lambda: e2e_figure(cfg, config, params, hf),
      "trainer": lambda: trainer_figure(cfg),
  }
  if progress is not None:
    progress("load", result)
  for name in FIGURES:
    if name in cfg.only:
      start = time.perf_counter()
      result.update(figures[name]())
      seconds[name] = time.perf_counter() - start
      gc.collect()
      if progress is not None:
        progress(name, result)
  try:
    import trl  # pylint: disable=import-outside-toplevel
    trl_version = trl.__version__
  except ImportError:
    trl_version = None
  result.update(
      machine=machine, bf16=bf16, date=datetime.datetime.now().astimezone().isoformat(),
      jax=jax.__version__, torch=torch.__version__, transformers=transformers.__version__,
      trl=trl_version, backend=jax.default_backend(), devices=len(jax.devices()),
      torch_threads=torch.get_num_threads(), model=cfg.model, model_params=num_params,
      model_config={k: getattr(config, k) for k in (
          "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
          "mlp_dim", "tie_embeddings", "rope_theta")},
      config=dataclasses.asdict(cfg), goals=GOALS,
      command="python -m experiments.bench_real " + " ".join(sys.argv[1:]),
      # Other jobs on a shared CPU slow every contender (not equally).
      load_avg_1m=[load_start, os.getloadavg()[0]])
  return result


def _fmt(x, spec=".2f") -> str:
  return "-" if x is None else format(x, spec)


def print_table(result: dict) -> None:
  m = result["machine"]
  print(f"{result['model']}: {result['model_params'] / 1e6:.1f}M params; {m['cpu']}, "
        f"{m['cores']} cores, {result['devices']} XLA devices (load average "
        f"{result['load_avg_1m'][0]:.1f} -> {result['load_avg_1m'][1]:.1f}); max |logit "
        f"diff| vs torch {result['logits_max_abs_diff_vs_torch']:.1e}")
  print(f"{'figure':<26}{'ours':>12}{'theirs':>12}{'ratio':>8}{'goal':>7}")
  peak = result["peak_gflops"]
  if peak:
    for p in ("f32", "bf16"):
      print(f"{'peak GFLOP/s ' + p:<26}{_fmt(peak[f'xla_{p}'], '.0f'):>12}"
            f"{_fmt(peak[f'torch_{p}'], '.0f'):>12}"
            f"{_fmt(_ratio(peak[f'xla_{p}'], peak[f'torch_{p}'])):>8}")
  for b, r in (result["rollout"] or {}).items():
    print(f"{'rollout ' + b + ' rows tok/s':<26}{r['engine_tokens_per_s']:>12.0f}"
          f"{r['generate_tokens_per_s']:>12.0f}{result['rollout_vs_generate'][b]:>8.2f}"
          f"{GOALS['rollout_vs_generate']:>7.1f}")
  lr = result["learner"]
  if lr:
    for p, suffix in (("f32", ""), ("bf16", "_bf16")):
      if f"ours_{p}_s" in lr:
        print(f"{'learner step s ' + p:<26}{lr[f'ours_{p}_s']:>12.2f}{lr[f'torch_{p}_s']:>12.2f}"
              f"{result['learner_vs_torch' + suffix]:>8.2f}"
              f"{GOALS['learner_vs_torch' + suffix]:>7.1f}")
        print(f"{'  GFLOP/s, peak frac ' + p:<26}{lr[f'ours_{p}_gflops']:>12.0f}"
              f"{lr[f'torch_{p}_gflops']:>12.0f}"
              f"{_fmt(result['learner_peak_frac' + suffix]):>8}"
              f"{GOALS['learner_peak_frac']:>7.1f}")
  e2e = result["e2e"]
  if e2e:
    print(f"{'GRPO iteration s':<26}{e2e['ours_s']:>12.2f}{_fmt(e2e.get('trl_s')):>12}"
          f"{_fmt(result['e2e_vs_trl']):>8}{GOALS['e2e_vs_trl']:>7.1f}")
    if result["e2e_error"]:
      print(f"  TRL not timed: {result['e2e_error']}")
  if result["trainer"]:
    t = result["trainer"]
    print(f"{'trainer iteration s':<26}{t['fastest']['perf/step_s']:>12.2f}"
          f"{t['rollout_alone_s'] + t['step_alone_s']:>12.2f}"
          f"{result['trainer_overhead']:>8.2f}{GOALS['trainer_overhead']:>7.1f}")
  print("seconds per figure: " + ", ".join(
      f"{k} {v:.0f}" for k, v in result["figure_seconds"].items()))


# ------------------------------------------------------------------ flags
def _define_flags():
  """The command line (defined only when run as a script, so that tests and
  other experiments import the module beside the benchmarks it reuses)."""
  global _MODEL, _OUT, _ROUNDS, _ONLY, _MATMUL, _ROLLOUT_BATCHES, _ROLLOUT_PROMPT
  global _ROLLOUT_NEW, _ROLLOUT_DTYPE, _LEARNER_BATCH, _LEARNER_SEQ, _LEARNER_PROMPT
  global _LEARNER_MICRO
  global _E2E_PROMPTS, _E2E_SAMPLES, _E2E_NEW, _E2E_PROMPT, _E2E_SHARE, _BF16, _TRL
  global _SEED, _CPU_DEVICES
  _MODEL = flags.DEFINE_string("model", None, "A GGUF file or a Hugging Face checkpoint dir.")
  _OUT = flags.DEFINE_string("out", "runs/bench_real.json", "JSON output path.")
  _ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved timed rounds; best of them.")
  _ONLY = flags.DEFINE_list("only", [], f"Figures to run, of {', '.join(FIGURES)} (default all).")
  _MATMUL = flags.DEFINE_integer("matmul_size", 2048, "Peak matmul size (square).")
  _ROLLOUT_BATCHES = flags.DEFINE_list("rollout_batches", ["16", "64"], "Rollout batch sizes.")
  _ROLLOUT_PROMPT = flags.DEFINE_integer("rollout_prompt_len", 256, "Rollout prompt tokens.")
  _ROLLOUT_NEW = flags.DEFINE_integer("rollout_new_tokens", 128, "Rollout tokens per row.")
  _ROLLOUT_DTYPE = flags.DEFINE_enum(
      "rollout_dtype", "float32", ["float32", "bfloat16"],
      "Rollout: both contenders' compute dtype (ours: weights float32, computed in it; "
      "transformers: the model cast to it).")
  _LEARNER_BATCH = flags.DEFINE_integer("learner_batch", 16, "Learner rows.")
  _LEARNER_SEQ = flags.DEFINE_integer("learner_seq_len", 512, "Learner tokens per row.")
  _LEARNER_PROMPT = flags.DEFINE_integer("learner_prompt_len", 256,
                                         "Learner prompt tokens per row (loss mask 0).")
  _LEARNER_MICRO = flags.DEFINE_integer(
      "learner_micro_batches", 4, "Learner: gradient accumulated over this many parts of "
      "the batch, on both sides.")
  _E2E_PROMPTS = flags.DEFINE_integer("e2e_prompts", 8, "GRPO iteration: prompts.")
  _E2E_SAMPLES = flags.DEFINE_integer("e2e_samples", 4, "GRPO iteration: samples per prompt.")
  _E2E_NEW = flags.DEFINE_integer("e2e_new_tokens", 64, "GRPO iteration: tokens per sample.")
  _E2E_PROMPT = flags.DEFINE_integer("e2e_prompt_len", 64,
                                     "GRPO iteration: about this many prompt tokens.")
  _E2E_SHARE = flags.DEFINE_bool("e2e_share_prefix", True,
                                 "Ours: a group's prompt prefilled and trained on once.")
  _BF16 = flags.DEFINE_enum("bf16", "auto", ["auto", "off"],
                            "auto: bfloat16 figures where the CPU has bfloat16 instructions.")
  _TRL = flags.DEFINE_enum("trl", "auto", ["auto", "off"], "auto: time TRL where it imports.")
  _SEED = flags.DEFINE_integer("seed", 0, "Seed for prompts, batches and sampling.")
  _CPU_DEVICES = flags.DEFINE_integer(
      "cpu_devices", 1, "XLA host devices on CPU (rows and batches split over them).")


def config_from_flags() -> Config:
  return Config(
      model=_MODEL.value, rounds=_ROUNDS.value, only=tuple(_ONLY.value) or FIGURES,
      matmul_size=_MATMUL.value,
      rollout_batches=tuple(int(b) for b in _ROLLOUT_BATCHES.value),
      rollout_prompt_len=_ROLLOUT_PROMPT.value, rollout_new_tokens=_ROLLOUT_NEW.value,
      rollout_dtype=_ROLLOUT_DTYPE.value,
      learner_batch=_LEARNER_BATCH.value, learner_seq_len=_LEARNER_SEQ.value,
      learner_prompt_len=_LEARNER_PROMPT.value,
      learner_micro_batches=_LEARNER_MICRO.value, e2e_prompts=_E2E_PROMPTS.value,
      e2e_samples=_E2E_SAMPLES.value, e2e_new_tokens=_E2E_NEW.value,
      e2e_prompt_len=_E2E_PROMPT.value, e2e_share_prefix=_E2E_SHARE.value,
      bf16=_BF16.value, trl=_TRL.value, seed=_SEED.value).validate()


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # the trainer figure's checkpoints log at INFO
  cfg = config_from_flags()
  # Before anything starts a JAX backend.
  jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)

  def progress(name, partial):
    print(f"[{datetime.datetime.now():%H:%M:%S}] {name} done in "
          f"{partial['figure_seconds'][name]:.0f} s", flush=True)
    common.write_json(_OUT.value + ".partial", partial)  # kept if a later figure fails

  result = run(cfg, progress)
  print_table(result)
  common.write_json(_OUT.value, result)
  if os.path.exists(_OUT.value + ".partial"):
    os.remove(_OUT.value + ".partial")
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  _define_flags()
  flags.mark_flag_as_required("model")
  app.run(main)
