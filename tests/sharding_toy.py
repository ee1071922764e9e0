"""A tiny language-model-shaped network trained with sharded jitted SGD.

Shared by ``test_sharding.py`` and ``test_multiprocess.py``; run as a script
it is the subprocess worker of those tests (JAX must see its device count
and distributed setup before it is imported, hence the separate processes)::

    python tests/sharding_toy.py parity            # prints JSON, 8 devices
    python tests/sharding_toy.py model             # the real transformer
    python tests/sharding_toy.py worker PID NPROC PORT STEPS WORKDIR

The network is ``logits = tanh(E[tok] @ W1 + b1) @ W2 @ U`` with a squared
side branch ``0.01 * mean((E[tok] @ W_odd)^2)`` whose 3 columns (named
"mlp") do not divide ``tensor=2``, exercising the drop-the-axis rule.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from agentic_rl.train import distributed
from agentic_rl.train import sharding as sh
from agentic_rl.train.checkpoint import Checkpointer

VOCAB, EMBED, MLP, ODD = 16, 8, 12, 3
BATCH, LENGTH = 16, 4

AXES = {
    "embed": ("vocab", "embed"),
    "w1": ("embed", "mlp"),
    "b1": ("mlp",),
    "w2": ("mlp", "embed"),
    "unembed": ("embed", "vocab"),
    "w_odd": ("embed", "mlp"),
}


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
  """Host (numpy) float32 parameters, identical on every process."""
  rng = np.random.default_rng(seed)
  shapes = {"embed": (VOCAB, EMBED), "w1": (EMBED, MLP), "b1": (MLP,),
            "w2": (MLP, EMBED), "unembed": (EMBED, VOCAB),
            "w_odd": (EMBED, ODD)}
  return {k: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)
          for k, s in shapes.items()}


def batches(n: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
  """``n`` global batches of int32 ``tokens`` / ``targets``, [BATCH, LENGTH]."""
  rng = np.random.default_rng(seed)
  return [{"tokens": rng.integers(0, VOCAB, (BATCH, LENGTH), dtype=np.int32),
           "targets": rng.integers(0, VOCAB, (BATCH, LENGTH), dtype=np.int32)}
          for _ in range(n)]


def loss_fn(params, batch):
  x_BxTxD = params["embed"][batch["tokens"]]
  h_BxTxF = jnp.tanh(x_BxTxD @ params["w1"] + params["b1"])
  logits_BxTxV = (h_BxTxF @ params["w2"]) @ params["unembed"]
  xent = optax.softmax_cross_entropy_with_integer_labels(
      logits_BxTxV, batch["targets"]).mean()
  return xent + 0.01 * jnp.mean((x_BxTxD @ params["w_odd"]) ** 2)


OPTIMIZER = optax.sgd(0.5, momentum=0.9)


def train_step(params, opt_state, batch):
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def setup(mesh):
  """Sharded params, optimiser state and the jitted step on ``mesh``."""
  host = init_params()
  params_sh = sh.logical_to_sharding(AXES, mesh, shapes=host)
  opt_sh = sh.opt_state_sharding(OPTIMIZER, host, params_sh, mesh)
  params = jax.device_put(host, params_sh)
  opt_state = jax.jit(OPTIMIZER.init, out_shardings=opt_sh)(params)
  step = sh.jit_sharded(
      train_step, mesh,
      in_shardings=(params_sh, opt_sh, sh.batch_sharding(mesh)),
      out_shardings=(params_sh, opt_sh, sh.replicated(mesh)),
      donate_argnums=(0, 1))
  return params, opt_state, step


def run(mesh, n_steps: int):
  """Losses of ``n_steps`` steps and the final params gathered to host."""
  params, opt_state, step = setup(mesh)
  losses = []
  for batch in batches(n_steps):
    params, opt_state, loss = step(params, opt_state,
                                   sh.shard_batch(batch, mesh))
    losses.append(float(loss))
  return losses, params


def model_losses(mesh, n_steps: int = 2) -> list[float]:
  """SGD on the real policy transformer (tiny GQA config), sharded by its
  ``param_axes`` through the rules: losses of ``n_steps`` steps."""
  from agentic_rl import model
  cfg = model.TransformerConfig(vocab_size=32, d_model=16, n_layers=2,
                                n_heads=4, n_kv_heads=2, head_dim=8,
                                mlp_dim=32)
  host = jax.device_get(model.init_params(cfg, jax.random.key(0)))
  params_sh = sh.logical_to_sharding(model.param_axes(cfg), mesh, shapes=host)
  optimizer = optax.sgd(0.1)

  def step(params, opt_state, tokens_BxT):
    def loss_fn(p):
      logits_BxTxV = model.forward(p, tokens_BxT[:, :-1], cfg)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits_BxTxV, tokens_BxT[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_sh = sh.opt_state_sharding(optimizer, host, params_sh, mesh)
  jitted = sh.jit_sharded(
      step, mesh, in_shardings=(params_sh, opt_sh, sh.batch_sharding(mesh)),
      out_shardings=(params_sh, opt_sh, sh.replicated(mesh)))
  params = jax.device_put(host, params_sh)
  opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
  tokens = np.random.default_rng(2).integers(0, 32, (8, 9), dtype=np.int32)
  losses = []
  for _ in range(n_steps):
    params, opt_state, loss = jitted(params, opt_state,
                                     sh.shard_batch(tokens, mesh))
    losses.append(float(loss))
  return losses


def _parity() -> None:
  """Print {mesh name: {losses, params, specs}} for 1 and 8 devices."""
  out = {}
  for name, cfg, n in [("single", sh.MeshConfig(1, 1, 1), 1),
                       ("d2f2t2", sh.MeshConfig(2, 2, 2), 8),
                       ("d8", sh.MeshConfig(data=8), 8)]:
    mesh = sh.make_mesh(cfg, jax.devices()[:n])
    losses, params = run(mesh, 3)
    out[name] = {
        "losses": losses,
        "params": {k: np.asarray(v).tolist() for k, v in params.items()},
        "specs": {k: str(v.sharding.spec) for k, v in params.items()},
        "devices": len(mesh.devices.flat),
    }

  print(json.dumps(out))


def _worker(pid: int, nproc: int, port: int, n_steps: int,
            workdir: str) -> None:
  """One process of a loopback multi-process run: trains, checkpoints to the
  shared ``workdir`` and restores; prints its losses and parameter norms."""
  distributed.maybe_initialize(f"127.0.0.1:{port}", nproc, pid,
                               initialization_timeout=60)
  mesh = sh.make_mesh(sh.MeshConfig(data=1, fsdp=2, tensor=2))
  params, opt_state, step = setup(mesh)
  losses = []
  per_process = BATCH // nproc
  for i, batch in enumerate(batches(n_steps)):
    if i % 2:  # odd steps: each process feeds only its own rows
      rows = slice(pid * per_process, (pid + 1) * per_process)
      batch = sh.shard_batch({k: v[rows] for k, v in batch.items()}, mesh,
                             process_local=True)
    else:  # even steps: the same global batch everywhere, as device arrays
      batch = sh.shard_batch(jax.tree.map(jnp.asarray, batch), mesh)
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  sq_norm = jax.jit(
      lambda p: sum(jnp.sum(x ** 2) for x in jax.tree.leaves(p)),
      out_shardings=sh.replicated(mesh))
  state = {"params": params, "opt_state": opt_state,
           "rng": jax.jit(lambda: jax.random.key(5),
                          out_shardings=sh.replicated(mesh))()}
  with Checkpointer(workdir) as ckpt:  # every process writes its shards
    ckpt.save(n_steps, state, {"losses": losses})
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        state)
    restored, meta = ckpt.restore(target=target)
  print(json.dumps({"pid": pid, "process_count": jax.process_count(),
                    "devices": jax.device_count(), "losses": losses,
                    "param_sq_norm": float(sq_norm(params)),
                    "restored_sq_norm": float(sq_norm(restored["params"])),
                    "restored_losses": meta["losses"]}), flush=True)


if __name__ == "__main__":
  if sys.argv[1] == "parity":
    _parity()
  elif sys.argv[1] == "worker":
    _worker(*map(int, sys.argv[2:6]), sys.argv[6])
  elif sys.argv[1] == "model":
    print(json.dumps({
        name: model_losses(sh.make_mesh(cfg, jax.devices()[:n]))
        for name, cfg, n in [("single", sh.MeshConfig(1, 1, 1), 1),
                             ("d2f2t2", sh.MeshConfig(2, 2, 2), 8)]}))
  else:
    raise SystemExit(f"unknown mode {sys.argv[1]!r}")
