"""Device mesh, logical-to-mesh sharding rules and sharded ``jax.jit``.

The mesh has three axes, always in this order:

* ``data``   - pure data parallelism: the batch is split, parameters are
  replicated.
* ``fsdp``   - fully sharded data parallelism: the batch is split *and* the
  parameters' ``embed`` dimension is sharded (ZeRO-3 style): they are stored
  sharded, a step all-gathers them for its forward and backward
  (:func:`gathered`; each layer's weights where the layer uses them) and XLA
  reduces the gradients back onto the shards.
* ``tensor`` - tensor (model) parallelism over heads / MLP / vocabulary.

Model code names the dimensions of every parameter with *logical* axis names
(``param_axes(config)`` in ``agentic_rl.model``); :data:`LOGICAL_RULES` is the
one place that maps those names onto mesh axes.  The mesh is built with
``AxisType.Auto`` axes: shardings are given on the inputs and outputs of the
jitted step and XLA's propagation (GSPMD / Shardy) decides the rest, so model
code needs no sharding annotations (``jax.make_mesh`` defaults to ``Explicit``
axes in current JAX, which would make every ambiguous matmul an error).

Typical use in a learner::

    mesh = make_mesh(MeshConfig(data=-1, fsdp=2, tensor=1))
    params_sh = logical_to_sharding(param_axes(cfg), mesh, shapes=abstract_params)
    opt_sh = opt_state_sharding(optimizer, abstract_params, params_sh, mesh)
    step = jit_sharded(train_step, mesh,
                       in_shardings=(params_sh, opt_sh, batch_sharding(mesh)),
                       out_shardings=(params_sh, opt_sh, replicated(mesh)),
                       donate_argnums=(0, 1))
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from agentic_rl import model as model_lib

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None

# The ONE place that maps logical axis names to mesh axes.  A value is a mesh
# axis, a tuple of mesh axes (the dimension is split over their product, in
# that order) or None (replicated).  ``batch`` is the leading dimension of
# every batch array; the parameter names are those of ``param_axes(config)``.
LOGICAL_RULES: Mapping[str, MeshAxes] = types.MappingProxyType({
    "batch": ("data", "fsdp"),
    "layers": None,
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "lora_rank": None,  # LoRA adapters' rank: small, replicated
})


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the ``(data, fsdp, tensor)`` mesh axes.

  At most one size may be -1: it is filled with the devices left over by the
  others (``MeshConfig(data=-1)`` is pure data parallelism on all devices).
  """
  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  def validate(self) -> None:
    sizes = dataclasses.astuple(self)
    for name, size in zip(MESH_AXES, sizes):
      if not isinstance(size, int) or isinstance(size, bool) or (
          size < 1 and size != -1):
        raise ValueError(
            f"MeshConfig.{name} must be a positive int or -1 (fill), got "
            f"{size!r}")
    if sizes.count(-1) > 1:
      raise ValueError(
          f"at most one MeshConfig size may be -1 (fill), got {self}")

  def resolve(self, num_devices: int) -> tuple[int, int, int]:
    """The concrete ``(data, fsdp, tensor)`` sizes for ``num_devices``."""
    self.validate()
    sizes = dataclasses.astuple(self)
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if num_devices % known:
        raise ValueError(
            f"cannot fill the -1 axis of {self}: the fixed sizes multiply to "
            f"{known}, which does not divide the {num_devices} devices")
      sizes = tuple(num_devices // known if s == -1 else s for s in sizes)
    if math.prod(sizes) != num_devices:
      raise ValueError(
          f"{self} multiplies to {math.prod(sizes)} devices but "
          f"{num_devices} are available; make data*fsdp*tensor equal "
          f"{num_devices} or set one size to -1")
    return sizes


def make_mesh(mesh_config: MeshConfig,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``("data", "fsdp", "tensor")`` mesh with ``AxisType.Auto`` axes.

  Args:
    mesh_config: the axis sizes (one may be -1).
    devices: the devices to use; default ``jax.devices()`` (all devices of
      all processes, so in a multi-process run this is the global mesh).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_config.resolve(len(devices))
  return jax.make_mesh(shape, MESH_AXES,
                       axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def _rule_axes(name: str, rules: Mapping[str, MeshAxes]) -> tuple[str, ...]:
  if name not in rules:
    raise ValueError(
        f"logical axis {name!r} has no sharding rule; known names: "
        f"{sorted(rules)}")
  axes = rules[name]
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _check_rules(rules: Mapping[str, MeshAxes],
                 mesh_shape: Mapping[str, int]) -> None:
  for name in rules:
    for axis in _rule_axes(name, rules):
      if axis not in mesh_shape:
        raise ValueError(
            f"rule {name!r} -> {rules[name]!r} names mesh axis {axis!r}, "
            f"which is not one of the mesh axes {tuple(mesh_shape)}")


def logical_to_spec(logical_axes: Sequence[str | None],
                    shape: Sequence[int] | None,
                    mesh_shape: Mapping[str, int],
                    rules: Mapping[str, MeshAxes] = LOGICAL_RULES,
                    ) -> PartitionSpec:
  """The ``PartitionSpec`` of one array from its logical axis names.

  Each dimension takes the mesh axes of its rule, in order, skipping a mesh
  axis when

  * it was already used by an earlier dimension of the same array (a mesh
    axis can shard only one dimension), or
  * ``shape`` is given and the dimension is not divisible by the product of
    the kept axes times this axis (for example a vocabulary of 1000 rows on
    ``tensor=3``): that dimension is then replicated over the axis instead
    of failing at compile time.

  Args:
    logical_axes: one name (or None = replicated) per dimension.
    shape: the array's shape, or None to skip the divisibility check.
    mesh_shape: mesh axis name -> size (``mesh.shape``).
    rules: logical name -> mesh axes; default :data:`LOGICAL_RULES`.
  """
  if shape is not None and len(shape) != len(logical_axes):
    raise ValueError(
        f"logical axes {tuple(logical_axes)} name {len(logical_axes)} "
        f"dimensions but the array has shape {tuple(shape)}")
  _check_rules(rules, mesh_shape)
  used: set[str] = set()
  entries = []
  for dim, name in enumerate(logical_axes):
    if name is None:
      entries.append(None)
      continue
    kept: list[str] = []
    for axis in _rule_axes(name, rules):
      split = math.prod(mesh_shape[a] for a in kept) * mesh_shape[axis]
      if axis in used or (shape is not None and shape[dim] % split):
        continue
      kept.append(axis)
      used.add(axis)
    entries.append(None if not kept else kept[0] if len(kept) == 1
                   else tuple(kept))
  return PartitionSpec(*entries)


def _is_axes_leaf(x: Any) -> bool:
  """A leaf of a logical-axes tree: a tuple of names / None, or None."""
  return x is None or (isinstance(x, tuple) and all(
      e is None or isinstance(e, str) for e in x))


def logical_to_sharding(axes_pytree: Any, mesh: Mesh,
                        rules: Mapping[str, MeshAxes] = LOGICAL_RULES, *,
                        shapes: Any = None) -> Any:
  """Pytree of ``NamedSharding`` from a pytree of logical axis tuples.

  Args:
    axes_pytree: leaves are tuples of logical names (None inside a tuple =
      that dimension is replicated; a None leaf = the whole array is
      replicated), e.g. ``param_axes(config)``.
    mesh: the device mesh.
    rules: logical name -> mesh axes; default :data:`LOGICAL_RULES`.
    shapes: optional pytree with the same structure whose leaves have a
      ``.shape`` (arrays or ``jax.ShapeDtypeStruct``, e.g. from
      ``jax.eval_shape(init_params, ...)``).  With it, a mesh axis that does
      not divide a dimension is dropped for that dimension (see
      :func:`logical_to_spec`); without it, every rule is applied as is and
      a non-dividing dimension fails when the step is compiled.

  Raises:
    ValueError: an unknown logical name, a rule naming an axis not in the
      mesh, a rank mismatch, or ``shapes`` not matching ``axes_pytree``.
  """
  _check_rules(rules, mesh.shape)

  def one(path, axes, like=None):
    if axes is None:
      return NamedSharding(mesh, PartitionSpec())
    shape = None if like is None else like.shape
    try:
      spec = logical_to_spec(axes, shape, mesh.shape, rules)
    except ValueError as e:
      raise ValueError(f"{jax.tree_util.keystr(path)}: {e}") from None
    return NamedSharding(mesh, spec)

  if shapes is None:
    return jax.tree_util.tree_map_with_path(one, axes_pytree,
                                            is_leaf=_is_axes_leaf)
  axes_def = jax.tree.structure(axes_pytree, is_leaf=_is_axes_leaf)
  shapes_def = jax.tree.structure(shapes)
  if axes_def != shapes_def:
    raise ValueError(
        "shapes must have the same tree structure as axes_pytree; got "
        f"{shapes_def} for axes {axes_def}")
  return jax.tree_util.tree_map_with_path(one, axes_pytree, shapes,
                                          is_leaf=_is_axes_leaf)


def replicated(mesh: Mesh) -> NamedSharding:
  """Sharding of an array copied whole on every device (scalars, keys)."""
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh,
                   rules: Mapping[str, MeshAxes] = LOGICAL_RULES
                   ) -> NamedSharding:
  """Sharding of a ``[B, ...]`` array: B split over the ``batch`` rule's axes
  (``("data", "fsdp")``), every other dimension replicated."""
  _check_rules(rules, mesh.shape)
  return NamedSharding(mesh, PartitionSpec(_rule_axes("batch", rules) or None))


def batch_shards(mesh: Mesh,
                 rules: Mapping[str, MeshAxes] = LOGICAL_RULES) -> int:
  """Number of pieces the batch dimension is split into (``data * fsdp``)."""
  _check_rules(rules, mesh.shape)
  return math.prod(mesh.shape[a] for a in _rule_axes("batch", rules))


def check_batch_divides(batch_size: int, mesh: Mesh,
                        rules: Mapping[str, MeshAxes] = LOGICAL_RULES) -> None:
  """Raise a ValueError naming the fix if ``batch_size`` cannot be split."""
  shards = batch_shards(mesh, rules)
  if batch_size < 1 or batch_size % shards:
    axes = " * ".join(f"{a}={mesh.shape[a]}" for a in _rule_axes("batch", rules))
    raise ValueError(
        f"batch size {batch_size} is not a positive multiple of the "
        f"{shards} batch shards ({axes}); use a batch size that is a "
        f"multiple of {shards}, or change MeshConfig so that data*fsdp "
        f"divides {batch_size}")


def shard_batch(batch_pytree: Any, mesh: Mesh,
                rules: Mapping[str, MeshAxes] = LOGICAL_RULES, *,
                process_local: bool = False) -> Any:
  """Place a pytree of ``[B, ...]`` host arrays with :func:`batch_sharding`.

  Args:
    batch_pytree: numpy or JAX arrays (local or global), all with the same
      leading size.
    mesh: the device mesh.
    rules: logical rules (the ``batch`` rule is used).
    process_local: False: every process passes the same *global* batch and
      each keeps its own rows.  True: each process passes only its own
      ``B / jax.process_count()`` rows (its data loader's shard), assembled
      with ``jax.make_array_from_process_local_data``.  Identical in a
      single-process run.

  Returns:
    The same pytree of global ``jax.Array``s of leading size B.
  """
  leaves = jax.tree.leaves(batch_pytree)
  if not leaves:
    raise ValueError("shard_batch got an empty batch pytree")
  sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
  if None in sizes or len(sizes) != 1:
    raise ValueError(
        "every batch array needs the same leading batch dimension; got "
        f"shapes {[np.shape(x) for x in leaves]}")
  size = sizes.pop() * (jax.process_count() if process_local else 1)
  check_batch_divides(size, mesh, rules)
  sharding = batch_sharding(mesh, rules)
  if process_local:
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            sharding, np.asarray(x), (size, *np.shape(x)[1:])),
        batch_pytree)
  if jax.process_count() > 1:
    # device_put onto other processes' devices takes host data (or global
    # arrays), not an array on this process's devices.
    batch_pytree = jax.tree.map(
        lambda x: np.asarray(x) if isinstance(x, jax.Array)
        and x.is_fully_addressable else x, batch_pytree)
  return jax.device_put(batch_pytree, sharding)


def to_host(tree: Any) -> Any:
  """numpy copies of a pytree of (global) arrays, on every process.

  An array that spans other processes' devices is gathered first
  (``multihost_utils.process_allgather``), so host-side code such as the
  metrics reads the same values in a single- and a multi-process run.
  """
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)

  return jax.tree.map(one, tree)


def agree(flag: bool) -> bool:
  """True on every process when ``flag`` is True on any of them (a
  collective: every process must call it at the same point)."""
  if jax.process_count() == 1:
    return bool(flag)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


def opt_state_sharding(optimizer: optax.GradientTransformation,
                       abstract_params: Any, params_sharding: Any,
                       mesh: Mesh) -> Any:
  """Shardings of ``optimizer.init(params)``: parameter-shaped leaves (Adam's
  moments, ...) take their parameter's sharding, the rest (step counts) are
  replicated; an ``optax.masked`` optimiser's skipped parameters have none.

  Args:
    optimizer: the optax transformation.
    abstract_params: params or ``jax.ShapeDtypeStruct``s.
    params_sharding: the matching pytree of shardings.
    mesh: the mesh, for the replicated leaves.
  """
  abstract_state = jax.eval_shape(optimizer.init, abstract_params)
  # optax.masked (a frozen LoRA base) leaves MaskedNodes for what it skips.
  masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  return optax.tree_map_params(
      optimizer, lambda x, sharding: x if masked(x) else sharding, abstract_state,
      params_sharding, transform_non_params=lambda _: replicated(mesh), is_leaf=masked)


def gathered(shardings: Any,
             rules: Mapping[str, MeshAxes] = LOGICAL_RULES) -> Any:
  """The layout parameters are computed in: ``shardings`` (a pytree of
  ``NamedSharding``) without the mesh axes that split the batch (the
  ``batch`` rule's, ``("data", "fsdp")``); the other axes (``tensor``) stay.

  FSDP keeps the parameters sharded over ``fsdp`` between steps, and a step
  constrains them to this layout where it computes with them
  (``jax.lax.with_sharding_constraint``; ``learner.gathered_params``: each
  layer's weights inside the layer). Left to XLA's sharding propagation, an
  ``embed`` dimension sharded over the axis that also splits the batch wins
  over the batch: the activations shard over ``embed``, so every device
  runs the whole batch, the batch arrays are all-gathered and every
  projection's partial sums are all-reduced, in each layer of the forward
  and the backward.
  """
  batch_axes = set(_rule_axes("batch", rules))

  def one(s: NamedSharding) -> NamedSharding:
    entries = []
    for entry in s.spec:
      axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
      kept = tuple(a for a in axes if a not in batch_axes)
      entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return NamedSharding(s.mesh, PartitionSpec(*entries))

  return jax.tree.map(one, shardings)


def _check_shardings(what: str, shardings: Any, mesh: Mesh) -> None:
  for path, s in jax.tree_util.tree_leaves_with_path(shardings):
    if not isinstance(s, jax.sharding.Sharding):
      raise ValueError(f"{what}{jax.tree_util.keystr(path)} is {s!r}, "
                       "not a jax.sharding.Sharding")
    if isinstance(s, NamedSharding) and s.mesh != mesh:
      raise ValueError(f"{what}{jax.tree_util.keystr(path)} is on a "
                       f"different mesh ({s.mesh}) than {mesh}")


def jit_sharded(fn: Callable[..., Any], mesh: Mesh, *,
                in_shardings: Sequence[Any], out_shardings: Any,
                donate_argnums: Sequence[int] = (),
                static_argnames: Sequence[str] = (),
                compute_dtype=None) -> Callable[..., Any]:
  """``jax.jit(fn, in_shardings=..., out_shardings=..., donate_argnums=...)``
  that runs under ``jax.set_mesh(mesh)``, with the model's XLA options for
  the mesh's platform and ``compute_dtype`` (``model.compiler_options``;
  None: float32).

  The mesh context lets code inside ``fn`` use bare ``PartitionSpec``s (for
  ``jax.lax.with_sharding_constraint``) and makes the mesh explicit to
  ``jax.random`` and friends.  Shardings are checked before anything is
  traced: every leaf must be a ``Sharding`` on ``mesh``, ``in_shardings``
  has one entry per positional argument, and ``donate_argnums`` index them.

  Returns:
    A callable with ``fn``'s signature, and a ``.lower(*args)`` method (also
    under the mesh) for ``.compile()`` / ``.cost_analysis()``.
  """
  in_shardings = tuple(in_shardings)
  _check_shardings("in_shardings", in_shardings, mesh)
  _check_shardings("out_shardings", out_shardings, mesh)
  for i in donate_argnums:
    if not 0 <= i < len(in_shardings):
      raise ValueError(
          f"donate_argnums entry {i} is not the index of one of the "
          f"{len(in_shardings)} positional arguments in in_shardings")
  jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                   donate_argnums=tuple(donate_argnums),
                   static_argnames=tuple(static_argnames),
                   compiler_options=model_lib.compiler_options(mesh, compute_dtype))

  def under_mesh(method):
    def run(*args, **kwargs):
      if len(args) != len(in_shardings):
        raise ValueError(f"{fn.__name__} was given {len(args)} positional "
                         f"arguments but in_shardings has "
                         f"{len(in_shardings)}")
      with jax.set_mesh(mesh):
        return method(*args, **kwargs)
    return run

  call = functools.wraps(fn)(under_mesh(jitted))
  call.lower = under_mesh(jitted.lower)
  return call
