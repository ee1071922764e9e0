r"""Benchmark: one GRPO learner update on the data-parallel and FSDP layouts,
against Tunix's actor train step, side by side.

  python -m experiments.bench_learner --out runs/bench_learner.json \
      [--batch 16] [--seq_len 128] [--prompt_len 32] [--repeats 10] \
      [--cpu_devices 2] [--tunix auto|off] [--attn_impl xla|xla_vjp]

One randomly initialised Llama-style model (by default 0.79M parameters:
hidden 128, 2 layers, 4 heads of 32 (MHA), SwiGLU width 512, vocab 1024,
untied unembedding, RoPE base 1e6 as Tunix's Llama 3 applies it; our
attention ``--attn_impl``, default ``"xla"`` as the model's) and one
rollout batch of ``--batch`` rows of ``--seq_len`` tokens, the first
``--prompt_len`` of each a prompt (loss mask 0), with random per-sequence
advantages (GRPO's are computed before the learner step) and old log-probs
from the initial weights. Each contender runs one jitted optimiser update
(PPO-clip, token-mean, AdamW with global-norm clipping) on every device, on
two layouts:

* ``data``: the batch split over ``data``, parameters replicated;
* ``fsdp``: the batch split over ``fsdp``, parameters' ``embed`` dimension
  sharded over it (ZeRO-3).

The contenders:

* ``ours``: ``learner.shard_train_step(learner.make_train_step(rl_loss))``
  on ``MeshConfig(data=N)`` and ``MeshConfig(data=1, fsdp=N)``;
* ``tunix``: where ``tunix`` imports (``google-tunix``, optional),
  ``tunix.rl.trainer.Trainer``'s jitted train step with ``grpo_loss_fn``
  (``beta=0``, ``token-mean``), as ``GRPOLearner`` sets up its actor, on
  Tunix's Llama 3 loaded with the same weights (checked: max |log-prob
  difference| on the batch's completion tokens), on a ``("fsdp", "tp")``
  mesh, its parameters replicated (``data``) or sharded by Tunix's default
  rules (``fsdp``). Skipped, with the reason in the JSON, elsewhere.

On CPU the devices are ``--cpu_devices`` XLA host devices. Compilation and
``--warmup`` steps are excluded; then ``--repeats`` interleaved rounds, each
timing every contender once, so a shared machine's changing speed affects all
alike. Writes JSON with ``ours_ms`` and ``tunix_ms`` (per layout ``min`` and
``median`` milliseconds per update), ``speedup_vs_tunix`` (Tunix's best
round over ours, per layout), ``ours_fsdp_over_data`` (best rounds),
``logp_max_abs_diff_vs_tunix_{layout}``, ``tunix_skipped`` (why, when Tunix
was not timed) and the ``config`` measured.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time

import jax
import numpy as np
from absl import app
from absl import flags

from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl.model.scoring import sequence_logprobs
from agentic_rl.train import learner
from agentic_rl.train import sharding
from experiments import common

LAYOUTS = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """What one run measures (the flags): the batch ``[batch, seq_len]``, the
  model (:meth:`model_config`), the rounds, and whether to time Tunix."""

  batch: int = 16
  seq_len: int = 128
  prompt_len: int = 32
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  mlp_dim: int = 512
  vocab: int = 1024
  repeats: int = 10
  warmup: int = 2
  seed: int = 0
  tunix: bool = True
  attn_impl: str = "xla"

  def model_config(self) -> model_lib.TransformerConfig:
    """MHA of ``d_model // n_heads`` per head, untied, RoPE base 1e6."""
    return model_lib.TransformerConfig(
        vocab_size=self.vocab, d_model=self.d_model, n_layers=self.n_layers,
        n_heads=self.n_heads, n_kv_heads=self.n_heads,
        head_dim=self.d_model // self.n_heads, mlp_dim=self.mlp_dim,
        rope_theta=1e6, attn_impl=self.attn_impl)


def make_batch(cfg: BenchConfig, model_config, params) -> dict[str, np.ndarray]:
  """A rollout batch as the learner takes it (numpy, ``B = cfg.batch``).

  ``tokens_BxT`` int32 in ``[1, V)`` (no pad id 0), ``loss_mask_BxT``
  float32 (0 on the prompt), ``advantages`` float32 ``[B]``,
  ``old_logp_BxT`` float32 (the initial weights' scores).
  """
  B, T, P = cfg.batch, cfg.seq_len, cfg.prompt_len
  rng = np.random.default_rng(cfg.seed)
  tokens_BxT = rng.integers(1, model_config.vocab_size, (B, T)).astype(np.int32)
  loss_mask_BxT = np.zeros((B, T), np.float32)
  loss_mask_BxT[:, P:] = 1.0
  old_logp_BxT, _ = sequence_logprobs(params, tokens_BxT, model_config)
  return {"tokens_BxT": tokens_BxT, "loss_mask_BxT": loss_mask_BxT,
          "advantages": rng.standard_normal(B).astype(np.float32),
          "old_logp_BxT": np.asarray(old_logp_BxT)}


def mesh_config(layout: str) -> sharding.MeshConfig:
  return {"data": sharding.MeshConfig(data=-1),
          "fsdp": sharding.MeshConfig(data=1, fsdp=-1)}[layout]


def ours(layout: str, model_config, params, batch, optimizer, micro_batches: int = 1):
  """``(run, compile_s)``: ``run()`` applies one update (its gradient
  accumulated over ``micro_batches`` parts of the batch) and waits for it."""
  mesh = sharding.make_mesh(mesh_config(layout))
  loss_fn = learner.rl_loss(model_config, objectives.ObjectiveConfig(loss="ppo"))
  step, state_sh = learner.shard_train_step(
      learner.make_train_step(loss_fn, optimizer, micro_batches=micro_batches), mesh,
      model_config, optimizer, params)
  box = [jax.device_put(learner.init_train_state(params, optimizer), state_sh)]
  batch = sharding.shard_batch(batch, mesh)

  def run():
    out = step(box[0], batch)
    box[0] = out[0]
    jax.block_until_ready(out)

  start = time.perf_counter()
  run()
  return run, time.perf_counter() - start


def _tunix_model(tunix_llama, nnx, layout: str, model_config, params):
  """Tunix's Llama 3 with ``params``' weights (ours: stacked layers)."""
  shd = tunix_llama.ShardingConfig.get_default_sharding()
  if layout == "data":
    shd = dataclasses.replace(shd, **{
        f.name: (None,) * len(getattr(shd, f.name)) for f in dataclasses.fields(shd)
        if not f.name.startswith("act_")})
  c = model_config
  net = tunix_llama.Llama3(tunix_llama.ModelConfig(
      num_layers=c.n_layers, vocab_size=c.vocab_size, embed_dim=c.d_model,
      hidden_dim=c.mlp_dim, num_heads=c.n_heads, head_dim=c.head_dim,
      num_kv_heads=c.n_kv_heads, rope_theta=int(c.rope_theta), norm_eps=c.norm_eps,
      shd_config=shd), rngs=nnx.Rngs(0))
  net.embedder.input_embedding.value = params["embed"]
  net.final_norm.w.value = params["final_norm"]
  net.lm_head.w.value = params["unembed"]
  for i, layer in enumerate(net.layers):
    p = {k: v[i] for k, v in params["layers"].items()}
    layer.input_layernorm.w.value = p["attn_norm"]
    layer.post_attention_layernorm.w.value = p["mlp_norm"]
    for name in ("q", "k", "v", "o"):
      getattr(layer.attn, f"{name}_proj").w.value = p[f"w{name}"]
    for name in ("gate", "up", "down"):
      getattr(layer.mlp, f"{name}_proj").kernel.value = p[f"w_{name}"]
  return net


def tunix(layout: str, model_config, params, batch, optimizer, prompt_len: int):
  """``(run, compile_s, logp_max_abs_diff)`` for Tunix's actor train step."""
  # pylint: disable=import-outside-toplevel
  from flax import nnx
  from tunix.models.llama3 import model as tunix_llama
  from tunix.rl import algo_core
  from tunix.rl import common as tunix_common
  from tunix.rl import trainer as tunix_trainer
  from tunix.rl.grpo import grpo_learner
  from tunix.sft import peft_trainer
  from tunix.sft import sharding_utils
  # pylint: enable=import-outside-toplevel
  n = len(jax.devices())
  mesh = jax.make_mesh((n, 1), ("fsdp", "tp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  P = prompt_len
  tokens_BxT = batch["tokens_BxT"]
  mask_BxC = batch["loss_mask_BxT"][:, P:].astype(np.int32)
  example = grpo_learner.TrainExample(
      prompt_ids=tokens_BxT[:, :P], prompt_mask=np.ones_like(tokens_BxT[:, :P]),
      completion_ids=tokens_BxT[:, P:], completion_mask=mask_BxC,
      advantages=batch["advantages"], ref_per_token_logps=None,
      old_per_token_logps=batch["old_logp_BxT"][:, P:])
  algo = grpo_learner.GRPOConfig(beta=0.0, loss_agg_mode="token-mean")
  algo.temperature = 1.0

  def loss_fn(model, train_example, algo_config):
    return algo_core.grpo_loss_fn(model, train_example, algo_config=algo_config,
                                  pad_id=0, eos_id=-1)

  with mesh:  # Tunix reads the mesh from this context.
    net = _tunix_model(tunix_llama, nnx, layout, model_config, params)
    state = nnx.state(net)
    nnx.update(net, jax.device_put(state, jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(mesh, spec), nnx.get_partition_spec(state))))
    logp_BxC = tunix_common.compute_per_token_logps(
        *nnx.split(net), prompt_tokens=example.prompt_ids,
        completion_tokens=example.completion_ids, pad_id=0, eos_id=-1)
    logp_diff = float(np.max(np.abs(np.asarray(logp_BxC) - example.old_per_token_logps)))
    trainer = tunix_trainer.Trainer(
        net, optimizer, peft_trainer.TrainingConfig(eval_every_n_steps=1 << 30),
        custom_checkpoint_metadata_fn=dict)
    trainer.with_loss_fn(loss_fn, has_aux=True)
    trainer.with_gen_model_input_fn(
        lambda x: {"train_example": x, "algo_config": algo})
    step, _ = trainer.jit_train_and_eval_step()
    example = sharding_utils.shard_input(example, ("fsdp",))

  def run():
    with mesh:
      out = step(example)
    jax.block_until_ready((out, jax.tree.leaves(nnx.state(net))))

  start = time.perf_counter()
  run()
  return run, time.perf_counter() - start, logp_diff


def _tunix_version() -> tuple[str | None, str | None]:
  """``(version, None)`` where ``tunix`` imports, else ``(None, why not)``."""
  try:
    import tunix  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    return None, f"tunix does not import: {e}"
  return getattr(tunix, "__version__", "unknown"), None


def _ms(times_s) -> dict[str, float]:
  return {"min": 1e3 * min(times_s), "median": 1e3 * float(np.median(times_s))}


def run(cfg: BenchConfig) -> dict:
  """Times every contender on every layout; returns the JSON record."""
  load_start = os.getloadavg()[0]
  model_config = cfg.model_config().validate()
  params = jax.tree.map(np.asarray, model_lib.init_params(model_config,
                                                          jax.random.key(cfg.seed)))
  num_params = sum(x.size for x in jax.tree.leaves(params))
  batch = make_batch(cfg, model_config, params)
  optimizer = objectives.make_optimizer(objectives.OptimizerConfig())
  contenders, compile_s = {}, {}
  for layout in LAYOUTS:
    contenders["ours", layout], compile_s[f"ours_{layout}"] = ours(
        layout, model_config, params, batch, optimizer)
  result = {}
  tunix_version, skipped = _tunix_version() if cfg.tunix else (None, "--tunix=off")
  if tunix_version is not None:
    try:
      for layout in LAYOUTS:
        contenders["tunix", layout], compile_s[f"tunix_{layout}"], diff = tunix(
            layout, model_config, params, batch, optimizer, cfg.prompt_len)
        result[f"logp_max_abs_diff_vs_tunix_{layout}"] = diff
    except Exception as e:  # pylint: disable=broad-except
      skipped = f"Tunix's step failed: {type(e).__name__}: {e}"
      for layout in LAYOUTS:
        contenders.pop(("tunix", layout), None)
  if skipped:
    result["tunix_skipped"] = skipped
  times = common.time_interleaved(contenders, warmup=cfg.warmup, repeats=cfg.repeats)

  for who in ("ours", "tunix"):
    if (who, LAYOUTS[0]) in times:
      result[f"{who}_ms"] = {layout: _ms(times[who, layout]) for layout in LAYOUTS}
  ours_ms = result["ours_ms"]
  result["ours_fsdp_over_data"] = ours_ms["fsdp"]["min"] / ours_ms["data"]["min"]
  if "tunix_ms" in result:
    result["speedup_vs_tunix"] = {
        layout: result["tunix_ms"][layout]["min"] / ours_ms[layout]["min"]
        for layout in LAYOUTS}
  result.update(
      compile_s=compile_s, model_params=int(num_params),
      config=dataclasses.asdict(cfg) | {"head_dim": model_config.head_dim},
      devices=len(jax.devices()), backend=jax.default_backend(),
      device=str(jax.devices()[0]), jax=jax.__version__, tunix=tunix_version,
      python=platform.python_version(), cpu_count=os.cpu_count(),
      machine=platform.machine(),
      # Other jobs on a shared CPU slow every contender (not equally).
      load_avg_1m=[load_start, os.getloadavg()[0]])
  return result


def print_table(result: dict) -> None:
  print(f"{result['model_params'] / 1e6:.2f}M params, batch "
        f"{result['config']['batch']}x{result['config']['seq_len']}, "
        f"{result['devices']} {result['backend']} devices (load average "
        f"{result['load_avg_1m'][0]:.1f} -> {result['load_avg_1m'][1]:.1f})")
  print(f"{'layout':<8}{'ours min/median ms':>22}{'tunix min/median ms':>24}"
        f"{'speedup':>10}")
  for layout in LAYOUTS:
    o = result["ours_ms"][layout]
    row = f"{layout:<8}{o['min']:>13.1f} /{o['median']:>7.1f}"
    if "tunix_ms" in result:
      t = result["tunix_ms"][layout]
      row += (f"{t['min']:>15.1f} /{t['median']:>7.1f}"
              f"{result['speedup_vs_tunix'][layout]:>9.2f}x")
    print(row)
  if "tunix_skipped" in result:
    print(f"tunix skipped: {result['tunix_skipped']}")


def main(argv):
  del argv
  # Before anything starts a JAX backend.
  jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  cfg = BenchConfig(
      batch=_BATCH.value, seq_len=_SEQ_LEN.value, prompt_len=_PROMPT_LEN.value,
      d_model=_D_MODEL.value, n_layers=_N_LAYERS.value, n_heads=_N_HEADS.value,
      mlp_dim=_MLP_DIM.value, vocab=_VOCAB.value, repeats=_REPEATS.value,
      warmup=_WARMUP.value, seed=_SEED.value, tunix=_TUNIX.value == "auto",
      attn_impl=_ATTN_IMPL.value)
  result = run(cfg)
  result["argv"] = sys.argv[1:]
  print_table(result)
  common.write_json(_OUT.value, result)
  print(f"wrote {_OUT.value}")


def _define_flags():
  """The command line (defined only when run as a script: the module's
  functions are imported beside other experiments)."""
  global _OUT, _BATCH, _SEQ_LEN, _PROMPT_LEN, _D_MODEL, _N_LAYERS, _N_HEADS, _MLP_DIM
  global _VOCAB, _REPEATS, _WARMUP, _SEED, _CPU_DEVICES, _TUNIX, _ATTN_IMPL
  _OUT = flags.DEFINE_string("out", "runs/bench_learner.json", "JSON output path.")
  _BATCH = flags.DEFINE_integer("batch", 16, "Rows per batch.")
  _SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Tokens per row.")
  _PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per row (no loss).")
  _D_MODEL = flags.DEFINE_integer("d_model", 128, "Model width.")
  _N_LAYERS = flags.DEFINE_integer("n_layers", 2, "Decoder layers.")
  _N_HEADS = flags.DEFINE_integer("n_heads", 4, "Attention heads (MHA).")
  _MLP_DIM = flags.DEFINE_integer("mlp_dim", 512, "SwiGLU hidden width.")
  _VOCAB = flags.DEFINE_integer("vocab", 1024, "Vocabulary size.")
  _REPEATS = flags.DEFINE_integer("repeats", 10, "Timed rounds (each times every contender once).")
  _WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps per contender after compiling.")
  _SEED = flags.DEFINE_integer("seed", 0, "Seed for weights and batch.")
  _CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 2, "XLA host devices on CPU.")
  _TUNIX = flags.DEFINE_enum("tunix", "auto", ["auto", "off"],
                             "auto: time Tunix's step where tunix imports.")
  _ATTN_IMPL = flags.DEFINE_enum("attn_impl", "xla", ["xla", "xla_vjp"],
                                 "Our model's attn_impl (TransformerConfig).")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
