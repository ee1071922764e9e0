"""Subprocess worker: the trainer's RL learner step on a mesh, printing losses.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python tests/learner_devices.py DATA FSDP TENSOR [collectives]

Three steps of ``learner.shard_train_step(make_train_step(rl_loss(...)))`` on
the tiny transformer with two micro-batches; prints the losses as JSON. With
``collectives``: compiles one step (one micro-batch, the layer scan kept as a
loop: ``scan_unroll=1``) instead and prints the number of collectives of
each kind inside its loops as JSON.
"""

import collections
import json
import re
import sys

import jax
import jax.numpy as jnp

from agentic_rl import model as model_lib
from agentic_rl import objectives
from agentic_rl.train import learner
from agentic_rl.train import sharding


def main(data, fsdp, tensor, mode="losses"):
  jax.config.update("jax_default_matmul_precision", "highest")
  cfg = model_lib.TransformerConfig.tiny(vocab_size=64,
                                        scan_unroll=1 if mode == "collectives" else None)
  params = model_lib.init_params(cfg, jax.random.key(0))
  opt = objectives.make_optimizer(objectives.OptimizerConfig(learning_rate=1e-2))
  mesh = sharding.make_mesh(sharding.MeshConfig(data=data, fsdp=fsdp, tensor=tensor),
                            devices=jax.devices()[:data * fsdp * tensor])
  loss = learner.rl_loss(cfg, objectives.ObjectiveConfig(loss="ppo", correction="tis"))
  micro_batches = 1 if mode == "collectives" else 2
  step, state_sh = learner.shard_train_step(
      learner.make_train_step(loss, opt, micro_batches=micro_batches), mesh, cfg, opt, params)
  state = jax.device_put(learner.init_train_state(params, opt), state_sh)
  k = jax.random.split(jax.random.key(1), 4)
  B, T = 8, 12
  batch = {"tokens_BxT": jax.random.randint(k[0], (B, T), 0, cfg.vocab_size),
           "loss_mask_BxT": (jax.random.uniform(k[1], (B, T)) < 0.7).astype(jnp.float32),
           "advantages": jax.random.normal(k[2], (B,)),
           "old_logp_BxT": -jax.random.uniform(k[3], (B, T)),
           "behaviour_logp_BxT": -jax.random.uniform(k[3], (B, T)) - 0.01}
  if mode == "collectives":
    hlo = step.lower(state, batch).compile().as_text()
    collectives = re.findall(
        r" (all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute)"
        r"(?:-start)?\(.*/while/body/", hlo)
    print(json.dumps({"loop_collectives": dict(collections.Counter(collectives))}))
    return
  losses = []
  for _ in range(3):
    state, metrics, _ = step(state, batch)
    losses.append(float(metrics["learner/loss"]))
  print(json.dumps({"losses": losses, "devices": len(mesh.devices.flat)}))


if __name__ == "__main__":
  main(*map(int, sys.argv[1:4]), *sys.argv[4:5])
