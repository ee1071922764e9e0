"""Mesh construction, logical sharding rules and sharded-step parity."""

import functools
import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import sharding_toy as toy
from agentic_rl import model
from agentic_rl.train import sharding as sh

MESH_222 = {"data": 2, "fsdp": 2, "tensor": 2}


# --- MeshConfig / make_mesh ---------------------------------------------------


@pytest.mark.parametrize("cfg, n, want", [
    (sh.MeshConfig(), 8, (8, 1, 1)),
    (sh.MeshConfig(data=-1, fsdp=2, tensor=2), 8, (2, 2, 2)),
    (sh.MeshConfig(data=1, fsdp=-1, tensor=4), 8, (1, 2, 4)),
    (sh.MeshConfig(data=2, fsdp=2, tensor=2), 8, (2, 2, 2)),
    (sh.MeshConfig(1, 1, 1), 1, (1, 1, 1)),
])
def test_mesh_config_resolves_fill_axis(cfg, n, want):
  assert cfg.resolve(n) == want


@pytest.mark.parametrize("cfg, n, match", [
    (sh.MeshConfig(data=2, fsdp=2, tensor=1), 8, "multiplies to 4 devices"),
    (sh.MeshConfig(data=-1, fsdp=3), 8, "does not divide the 8 devices"),
    (sh.MeshConfig(data=-1, fsdp=-1), 8, "at most one"),
    (sh.MeshConfig(data=0), 8, "MeshConfig.data"),
    (sh.MeshConfig(tensor=2.0), 8, "MeshConfig.tensor"),
])
def test_mesh_config_rejects_bad_sizes(cfg, n, match):
  with pytest.raises(ValueError, match=match):
    cfg.resolve(n)


def test_make_mesh_axes_and_types():
  mesh = sh.make_mesh(sh.MeshConfig())
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert dict(mesh.shape) == {"data": jax.device_count(), "fsdp": 1,
                              "tensor": 1}
  assert tuple(mesh.axis_types) == (AxisType.Auto,) * 3
  with pytest.raises(ValueError, match="multiplies to"):
    sh.make_mesh(sh.MeshConfig(data=2 * jax.device_count()))


# --- logical rules --------------------------------------------------------------


@pytest.mark.parametrize("axes, shape, want", [
    (("embed", "mlp"), (8, 12), P("fsdp", "tensor")),
    (("layers", "embed", "heads", "head_dim"), (3, 8, 4, 6),
     P(None, "fsdp", "tensor", None)),
    # 5 rows do not divide fsdp=2: dropped, the array is replicated there.
    (("vocab", "embed"), (6, 5), P("tensor", None)),
    # A mesh axis shards one dimension only: the second "tensor" is dropped.
    (("heads", "mlp"), (4, 4), P("tensor", None)),
    # batch -> (data, fsdp): 2 rows keep data only; then embed may use fsdp.
    (("batch", "embed"), (2, 8), P("data", "fsdp")),
    (("batch", "embed"), (8, 8), P(("data", "fsdp"), None)),
    ((None, "embed"), (3, 8), P(None, "fsdp")),
    ((), (), P()),
])
def test_logical_to_spec_hand_computed(axes, shape, want):
  assert sh.logical_to_spec(axes, shape, MESH_222) == want


def test_logical_to_spec_without_shape_applies_rules_verbatim():
  assert sh.logical_to_spec(("vocab", "embed"), None, MESH_222) == P(
      "tensor", "fsdp")


@pytest.mark.parametrize("axes, shape, rules, match", [
    (("embed", "typo"), (2, 2), sh.LOGICAL_RULES, "'typo' has no sharding"),
    (("embed",), (2, 2), sh.LOGICAL_RULES, "name 1 dimensions"),
    (("embed",), (2,), {"embed": "pipeline"}, "mesh axis 'pipeline'"),
])
def test_logical_to_spec_errors(axes, shape, rules, match):
  with pytest.raises(ValueError, match=match):
    sh.logical_to_spec(axes, shape, MESH_222, rules)


def test_every_model_axis_has_a_rule_and_shards_the_big_matrices():
  cfg = model.TransformerConfig(vocab_size=32, d_model=8, n_layers=2,
                                n_heads=4, n_kv_heads=2, head_dim=4,
                                mlp_dim=16, qkv_bias=True, qk_norm=True)
  axes = model.param_axes(cfg)
  shapes = jax.eval_shape(lambda k: model.init_params(cfg, k),
                          jax.random.key(0))
  specs = jax.tree.map(
      lambda a, s: sh.logical_to_spec(a, s.shape, MESH_222), axes, shapes,
      is_leaf=lambda x: isinstance(x, tuple))
  assert specs["embed"] == P("tensor", "fsdp")
  assert specs["unembed"] == P("fsdp", "tensor")
  assert specs["layers"]["wq"] == P(None, "fsdp", "tensor", None)
  assert specs["layers"]["w_down"] == P(None, "tensor", "fsdp")
  assert specs["final_norm"] == P("fsdp")


def test_logical_to_sharding_tree():
  mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1), jax.devices()[:1])
  axes = {"w": ("embed", "mlp"), "whole": None, "list": [("vocab",)]}
  shapes = {"w": jnp.zeros((4, 6)), "whole": np.zeros(3),
            "list": [jax.ShapeDtypeStruct((5,), jnp.float32)]}
  out = sh.logical_to_sharding(axes, mesh, shapes=shapes)
  chex.assert_trees_all_equal_structs(out, shapes)
  assert all(isinstance(s, NamedSharding) and s.mesh == mesh
             for s in jax.tree.leaves(out))
  assert out["w"].spec == P("fsdp", "tensor")
  assert out["whole"].spec == P()
  assert out["list"][0].spec == P("tensor")
  with pytest.raises(ValueError, match="same tree structure"):
    sh.logical_to_sharding(axes, mesh, shapes={**shapes, "list": (
        jnp.zeros(5),)})
  with pytest.raises(ValueError, match=r"\['w'\].*name 2 dimensions"):
    sh.logical_to_sharding(axes, mesh, shapes={**shapes, "w": jnp.zeros(4)})
  with pytest.raises(ValueError, match="mesh axis 'model'"):
    sh.logical_to_sharding(axes, mesh, {**sh.LOGICAL_RULES, "mlp": "model"})


# --- batches ----------------------------------------------------------------------


def test_batch_sharding_and_divisibility():
  mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1), jax.devices()[:1])
  assert sh.batch_sharding(mesh).spec == P(("data", "fsdp"))
  assert sh.batch_shards(mesh) == 1
  sh.check_batch_divides(3, mesh)
  with pytest.raises(ValueError, match="positive multiple"):
    sh.check_batch_divides(0, mesh)


def test_check_batch_divides_names_the_fix():
  mesh = jax.sharding.AbstractMesh((2, 2, 2), sh.MESH_AXES)
  assert sh.batch_shards(mesh) == 4
  with pytest.raises(ValueError, match=r"batch size 6 .* 4 batch shards "
                     r"\(data=2 \* fsdp=2\).*multiple of 4"):
    sh.check_batch_divides(6, mesh)
  sh.check_batch_divides(8, mesh)
  assert sh.batch_shards(mesh, {**sh.LOGICAL_RULES, "batch": "data"}) == 2


def test_shard_batch_places_and_validates():
  mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1), jax.devices()[:1])
  batch = {"x": np.arange(12.0, dtype=np.float32).reshape(4, 3),
           "y": np.arange(4, dtype=np.int32)}
  for local in (False, True):
    out = sh.shard_batch(batch, mesh, process_local=local)
    chex.assert_trees_all_equal(out, batch)
    assert all(a.sharding.spec == P(("data", "fsdp")) for a in
               jax.tree.leaves(out))
  with pytest.raises(ValueError, match="same leading batch dimension"):
    sh.shard_batch({"x": np.zeros((4, 3)), "y": np.zeros(5)}, mesh)
  with pytest.raises(ValueError, match="same leading batch dimension"):
    sh.shard_batch({"x": np.zeros((4, 3)), "s": np.float32(1)}, mesh)
  with pytest.raises(ValueError, match="empty"):
    sh.shard_batch({}, mesh)


# --- optimiser state and the jitted step ----------------------------------------


def test_opt_state_sharding_mirrors_params():
  mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1), jax.devices()[:1])
  host = toy.init_params()
  params_sh = sh.logical_to_sharding(toy.AXES, mesh, shapes=host)
  opt = optax.adam(1e-3)
  opt_sh = sh.opt_state_sharding(opt, host, params_sh, mesh)
  adam = opt_sh[0]
  assert adam.count.spec == P()
  assert adam.mu == params_sh and adam.nu == params_sh
  state = jax.jit(opt.init, out_shardings=opt_sh)(jax.device_put(host,
                                                                 params_sh))
  assert state[0].mu["w1"].sharding.spec == P("fsdp", "tensor")


def test_gathered_drops_only_the_batch_axes():
  mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1), jax.devices()[:1])
  specs = {"w": P("fsdp", "tensor"), "u": P(("tensor", "fsdp"), None),
           "b": P(("data", "fsdp")), "r": P()}
  got = sh.gathered({k: NamedSharding(mesh, s) for k, s in specs.items()})
  assert {k: s.spec for k, s in got.items()} == {
      "w": P(None, "tensor"), "u": P("tensor", None), "b": P(None), "r": P()}
  assert all(s.mesh == mesh for s in got.values())


def test_jit_sharded_validates_before_tracing():
  mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1), jax.devices()[:1])
  other = sh.make_mesh(sh.MeshConfig(1, 1, 1), jax.devices()[:1][::-1])
  rep = sh.replicated(mesh)
  f = lambda a, b: a + b
  with pytest.raises(ValueError, match=r"in_shardings\[1\] is P"):
    sh.jit_sharded(f, mesh, in_shardings=(rep, P()), out_shardings=rep)
  with pytest.raises(ValueError, match="donate_argnums entry 2"):
    sh.jit_sharded(f, mesh, in_shardings=(rep, rep), out_shardings=rep,
                   donate_argnums=(2,))
  bad_mesh = NamedSharding(
      jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,),
                    devices=jax.devices()[:1]), P())
  with pytest.raises(ValueError, match="different mesh"):
    sh.jit_sharded(f, mesh, in_shardings=(rep, rep), out_shardings=bad_mesh)
  g = sh.jit_sharded(f, other, in_shardings=(rep, rep), out_shardings=rep)
  with pytest.raises(ValueError, match="given 1 positional"):
    g(1.0)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU options")
def test_jit_sharded_compiles_with_the_model_options():
  mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1), jax.devices()[:1])
  rep = sh.replicated(mesh)
  g = sh.jit_sharded(lambda a, b: jnp.tanh(a @ b), mesh, in_shardings=(rep, rep),
                     out_shardings=rep)
  x = jnp.ones((64, 64))
  assert "ynn_fusion" not in g.lower(x, x).compile().as_text()


def test_jit_sharded_mesh_context_allows_bare_partition_specs():
  mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1), jax.devices()[:1])
  rep = sh.replicated(mesh)

  def f(x):
    return jax.lax.with_sharding_constraint(x * 2, P("data"))

  g = sh.jit_sharded(f, mesh, in_shardings=(rep,), out_shardings=rep)
  np.testing.assert_array_equal(g(jnp.arange(4.0)), 2 * np.arange(4.0))
  assert g.lower(jnp.arange(4.0)).compile().cost_analysis() is not None


@functools.lru_cache
def _reference_losses(n_steps):
  """The toy run without jit, sharding or meshes (computed once)."""
  params = jax.tree.map(jnp.asarray, toy.init_params())
  opt_state = toy.OPTIMIZER.init(params)
  losses = []
  with jax.disable_jit():
    for batch in toy.batches(n_steps):
      params, opt_state, loss = toy.train_step(params, opt_state, batch)
      losses.append(float(loss))
  return losses, params


def test_sharded_step_matches_unjitted_reference():
  mesh = sh.make_mesh(sh.MeshConfig(1, 1, 1), jax.devices()[:1])
  losses, params = toy.run(mesh, 3)
  ref_losses, ref_params = _reference_losses(3)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  chex.assert_trees_all_close(jax.device_get(params), ref_params, rtol=1e-5,
                              atol=1e-6)
  assert losses[2] < losses[0]  # the toy actually trains


def test_eight_simulated_devices_match_one_device():
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"}
  proc = subprocess.run(
      [sys.executable, toy.__file__, "parity"], env=env, capture_output=True,
      text=True, timeout=240, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  ref_losses, _ = _reference_losses(3)
  single = out["single"]
  np.testing.assert_allclose(single["losses"], ref_losses, rtol=1e-5)
  for name in ("d2f2t2", "d8"):
    assert out[name]["devices"] == 8
    np.testing.assert_allclose(out[name]["losses"], single["losses"],
                               rtol=1e-5, err_msg=name)
    for k in single["params"]:
      np.testing.assert_allclose(out[name]["params"][k], single["params"][k],
                                 rtol=1e-5, atol=1e-6, err_msg=f"{name}/{k}")
  specs = out["d2f2t2"]["specs"]
  assert specs["w1"] == str(P("fsdp", "tensor"))
  assert specs["w_odd"] == str(P("fsdp", None))  # 3 columns: tensor dropped
  assert specs["embed"] == str(P("tensor", "fsdp"))


@pytest.mark.slow
def test_real_transformer_on_eight_devices_matches_one_device():
  """The policy model sharded by its own param_axes (GQA heads on tensor,
  embed on fsdp) trains like the unsharded one (two compiles: slow)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"}
  proc = subprocess.run(
      [sys.executable, toy.__file__, "model"], env=env, capture_output=True,
      text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["single"][1] < out["single"][0]
  np.testing.assert_allclose(out["d2f2t2"], out["single"], rtol=1e-5)
