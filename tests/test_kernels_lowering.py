"""The Pallas kernels lower to Triton for CUDA and to Mosaic for TPU, and
backend dispatch.

No GPU or TPU is needed: ``jax.export`` lowers for the ``cuda`` and ``tpu``
platforms on CPU. For CUDA that runs the Pallas -> Triton IR lowering (tile
shapes, supported primitives, scalar operands) but not Triton's compiler.
jax 0.11 asks for the target GPU's kind while lowering; an abstract mesh on
an abstract H200 supplies it. Jaxlibs that compile the Triton IR to PTX
while lowering (custom call ``triton_kernel_call_ffi``) check that too with
CUDA, and without it these tests skip. For TPU it runs the Pallas -> Mosaic
lowering, which checks the block shapes against the TPU's (8, 128) tiling,
the grid, scalar prefetch and the in-kernel primitives (on an abstract TPU
v5p); Mosaic's own compiler, in libtpu, is not run.
"""

import contextlib
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from agentic_rl import kernels
from agentic_rl.kernels import _common

# Custom calls of a Pallas Triton kernel: Triton IR (jaxlib <= 0.10.2) or
# PTX compiled during lowering (newer jaxlibs).
_TRITON_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")
# Custom call of a Pallas Mosaic GPU kernel (its module lowered in Python).
_MGPU_CALL = "mosaic_gpu_v2"


@pytest.fixture
def compiled_pallas(monkeypatch):
  """Makes impl='pallas' pick the compiled (Triton) kernels on this CPU, and
  verifies every Triton module they lower to (operand types, for one: an
  ill-typed module lowers fine and fails only in Triton's parser on a GPU).
  Returns the list the modules' text is appended to (None where this jax
  has no such hook)."""
  monkeypatch.setattr(_common, "pallas_backend",
                      lambda op, backend=None: ("triton", False))
  try:
    from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  lower = lowering.lower_jaxpr_to_triton_module
  modules = []

  def lower_and_verify(*args, **kwargs):
    result = lower(*args, **kwargs)
    result.module.operation.verify()  # raises on an invalid module
    modules.append(result.module.operation.get_asm())
    return result

  monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module",
                      lower_and_verify)
  return modules


@pytest.fixture
def compiled_mosaic(monkeypatch):
  """Makes impl='pallas' pick the compiled Mosaic TPU kernels on this CPU."""
  monkeypatch.setattr(_common, "pallas_backend",
                      lambda op, backend=None: ("mosaic_tpu", False))


def _mosaic_kernels(fn, *args, module_text=False):
  """Names of the Mosaic kernels in ``fn`` exported for an abstract TPU (and
  the exported module's text)."""
  v5p = jax.sharding.AbstractDevice(device_kind="TPU v5p", num_cores=1,
                                    platform="tpu")
  target = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=v5p)
  with jax.sharding.use_abstract_mesh(target):
    module = jax.export.export(jax.jit(fn), platforms=["tpu"])(
        *args).mlir_module()
  assert module.count("@tpu_custom_call(") == len(
      re.findall(r'kernel_name = "(\w+)"', module))
  names = sorted(re.findall(r'kernel_name = "(\w+)"', module))
  return (names, module) if module_text else names


def _cuda_calls(fn, *args):
  """``(Triton kernels, Mosaic GPU kernels)`` in ``fn`` exported for an
  abstract H200."""
  checks = [jax.export.DisabledSafetyCheck.custom_call(c)
            for c in (*_TRITON_CALLS, _MGPU_CALL)]
  h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                     platform="gpu")
  target = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
  try:
    with jax.sharding.use_abstract_mesh(target):
      exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                   disabled_checks=checks)(*args)
  except RuntimeError as e:
    if "Triton compilation handler" not in str(e):
      raise
    pytest.skip("this jaxlib compiles Triton while lowering and has no CUDA "
                "Triton compiler here")
  module = exported.mlir_module()
  return (sum(module.count(f"@{c}(") for c in _TRITON_CALLS),
          module.count(f"@{_MGPU_CALL}("))


def _triton_calls(fn, *args):
  return _cuda_calls(fn, *args)[0]


def _attention_grad(blocks, window=None):
  """The gradient of ``sum(flash_attention(q, k, v))`` with ``blocks``."""
  def loss(q, k, v):
    out = kernels.flash_attention(q, k, v, sliding_window=window,
                                  block_sizes=blocks)
    return jnp.sum(out.astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


def _spec(shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _flash_grads(opts):
  """``(grad fn of a flash-attention loss, its argument specs)`` at 4k (or
  ``T``)."""
  opts = dict(opts)
  B, T, H, K, D = 2, opts.pop("T", 4096), 8, 2, 128
  use_seg = opts.pop("segment_ids", False)
  use_window = opts.pop("sliding_window", False)

  def loss(q, k, v, seg, window):
    out = kernels.flash_attention(
        q, k, v, segment_ids=seg if use_seg else None,
        sliding_window=window if use_window else None, **opts)
    return jnp.sum(out.astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1, 2)), (
      _spec((B, T, H, D)), _spec((B, T, K, D)), _spec((B, T, K, D)),
      _spec((B, T), jnp.int32), _spec((), jnp.int32))


FLASH_OPTS = pytest.mark.parametrize("opts", [
    dict(),
    dict(segment_ids=True, sliding_window=True, softcap=30.0),
    dict(causal=False),
    dict(T=4000, sliding_window=True),  # padded keys: partial last blocks
], ids=["causal", "segments_window_softcap", "noncausal", "unaligned_window"])


@FLASH_OPTS
def test_flash_attention_fwd_and_bwd_lower_to_triton(compiled_pallas, opts):
  fn, specs = _flash_grads(opts)
  assert _triton_calls(fn, *specs) == 3  # forward, dQ, dK/dV


@pytest.mark.parametrize("sides, calls", [
    (dict(bwd="mosaic_gpu"), (1, 2)), (dict(fwd="mosaic_gpu"), (2, 1)),
    (dict(fwd="mosaic_gpu", bwd="mosaic_gpu"), (0, 3)),
    (dict(fwd="mosaic_gpu", bwd="mosaic_gpu", register_operands_mgpu=False),
     (0, 3)),
    (dict(fwd="mosaic_gpu", bwd="mosaic_gpu", fused_dq_mgpu=True), (0, 2))],
    ids=["bwd", "fwd", "both", "both_staged", "both_fused_dq"])
@pytest.mark.parametrize("window", [None, 1024])
def test_mgpu_kernels_lower_to_hopper_kernels(compiled_pallas, window, sides,
                                              calls):
  """fwd/bwd='mosaic_gpu' at the benchmark's shape: each side's Mosaic GPU
  kernels (the forward; dQ and dK/dV) beside the other side's Triton ones,
  lowered to Mosaic GPU's MLIR (:mod:`aot` compiles them further)."""
  B, T, H, K, D = 2, 4096, 8, 2, 128
  grads = _attention_grad(kernels.AttentionBlockSizes(**sides), window)
  assert _cuda_calls(grads, _spec((B, T, H, D)), _spec((B, T, K, D)),
                     _spec((B, T, K, D))) == calls


def test_mgpu_forward_fits_three_stages_of_128_key_tiles(compiled_pallas):
  """The forward's Q tiles, lse and three stages of 128-key K/V tiles fit
  an H200's shared memory (232,448 B; Mosaic GPU checks while lowering)
  because the kernels reserve no cross-warp reduction scratch: its default
  2 KiB made them 96 B too many. Four stages do not fit, and the error says
  so."""
  def forward(stages):
    blocks = kernels.AttentionBlockSizes(fwd="mosaic_gpu",
                                         stages_fwd_mgpu=stages)
    assert blocks.block_k_fwd_mgpu == 128
    return _cuda_calls(functools.partial(kernels.flash_attention,
                                         block_sizes=blocks),
                       _spec((2, 4096, 8, 128)), _spec((2, 4096, 2, 128)),
                       _spec((2, 4096, 2, 128)))
  assert forward(3) == (0, 1)
  with pytest.raises(ValueError, match="exceeds available shared memory"):
    forward(4)


@pytest.mark.parametrize("fused_dq, calls", [(False, (0, 3)), (True, (0, 2))])
def test_mgpu_kernels_lower_under_vmap(compiled_pallas, fused_dq, calls):
  """``jax.vmap`` over a leading axis batches the Hopper kernels, gradients
  included: ``plgpu.kernel``'s batching rule adds a grid axis, and the
  fused-dQ kernel (``pl.kernel``, which cannot batch) gets the mapped axis
  folded into its batch axis."""
  blocks = kernels.AttentionBlockSizes(fwd="mosaic_gpu", bwd="mosaic_gpu",
                                       fused_dq_mgpu=fused_dq)

  def loss(q, k, v):
    return jnp.sum(jax.vmap(functools.partial(
        kernels.flash_attention, block_sizes=blocks))(q, k, v).astype(
            jnp.float32))
  grads = jax.grad(loss, argnums=(0, 1, 2))
  assert _cuda_calls(grads, _spec((3, 1, 256, 4, 128)),
                     _spec((3, 1, 256, 2, 128)),
                     _spec((3, 1, 256, 2, 128))) == calls


@pytest.mark.parametrize("flag, value, fwd, bwd", [
    ("longest_first_mgpu", True, dict(longest_first=True),
     dict(longest_first=True)),
    ("pingpong_fwd_mgpu", True, dict(pingpong=True), {}),
    ("register_operands_mgpu", False, dict(register_operands=False),
     dict(register_operands=False)),
    ("fused_dq_mgpu", True, {}, dict(fused_dq=True))])
def test_mgpu_schedule_flags_reach_the_kernels(compiled_pallas, monkeypatch,
                                               flag, value, fwd, bwd):
  """AttentionBlockSizes' schedule switches (timed by the benchmark's A/Bs)
  reach the Hopper kernels' configs: longest-first and register operands
  both sides, ping-pong the forward only, fused dQ the backward only. (The
  lowered modules cannot tell: jax 0.11's Mosaic GPU kernel hash differs
  between identical lowerings.)"""
  from agentic_rl.kernels.hopper import flash as flash_mgpu  # pylint: disable=import-outside-toplevel
  seen = {}

  def record(side, kernel):
    def run(cfg, *args):
      seen[side] = cfg
      return kernel(cfg, *args)
    monkeypatch.setattr(flash_mgpu, kernel.__name__, run)
  record("fwd", flash_mgpu.forward)
  record("bwd", flash_mgpu.backward)
  q, kv = _spec((1, 256, 4, 128)), _spec((1, 256, 2, 128))

  def configs(**flags):
    blocks = kernels.AttentionBlockSizes(fwd="mosaic_gpu", bwd="mosaic_gpu",
                                         **flags)
    jax.eval_shape(_attention_grad(blocks), q, kv, kv)
    return dict(seen)
  plain = configs()
  assert not any(c.longest_first or c.pingpong or c.fused_dq
                 for c in plain.values())
  assert all(c.register_operands and c.in_registers for c in plain.values())
  changed = configs(**{flag: value})
  for side, fields in (("fwd", fwd), ("bwd", bwd)):
    assert changed[side] == dataclasses.replace(plain[side], **fields)


@pytest.mark.parametrize("kv_layout", ["BSKD", "BKSD"])
def test_decode_attention_lowers_to_triton(compiled_pallas, kv_layout):
  B, S, H, K, D = 8, 4000, 32, 8, 128
  cache = (B, S, K, D) if kv_layout == "BSKD" else (B, K, S, D)

  def fn(q, k, v, lengths, window):
    return kernels.decode_attention(q, k, v, lengths, sliding_window=window,
                                    softcap=50.0, kv_layout=kv_layout)

  assert _triton_calls(fn, _spec((B, H, D)), _spec(cache), _spec(cache),
                       _spec((B,), jnp.int32), _spec((), jnp.int32)) == 1


@pytest.mark.parametrize("pallas_bwd", [True, False])
def test_token_logprobs_fwd_and_bwd_lower_to_triton(compiled_pallas,
                                                     pallas_bwd):
  N, D, V = 8192, 2048, 128256  # Llama-3 vocabulary: not a tile multiple
  blocks = kernels.LogprobBlockSizes(pallas_bwd=pallas_bwd)

  def loss(h, w, targets):
    logp, ent = kernels.token_logprobs(h, w, targets, temperature=0.9,
                                       block_sizes=blocks)
    return jnp.sum(logp) + jnp.sum(ent)

  grads = jax.grad(loss, argnums=(0, 1))
  # The forward, and the logit-gradient kernel unless XLA recomputes them.
  assert _triton_calls(grads, _spec((N, D)), _spec((D, V)),
                       _spec((N,), jnp.int32)) == (2 if pallas_bwd else 1)
  # Each kernel tells Triton that a vocab tile's first column is a multiple
  # of gcd(V, block_v) = 256. Without it the W loads are not vectorised:
  # fwd+bwd took 1.6x as long on an H200 (BENCHMARKS.md).
  if compiled_pallas is not None:
    assert len(compiled_pallas) == (2 if pallas_bwd else 1)
    assert all("tt.divisibility = dense<256>" in m for m in compiled_pallas)


@FLASH_OPTS
def test_flash_attention_fwd_and_bwd_lower_to_mosaic(compiled_mosaic, opts):
  fn, specs = _flash_grads(opts)
  assert _mosaic_kernels(fn, *specs) == [
      "flash_attention_dkdv_tpu", "flash_attention_dq_tpu",
      "flash_attention_fwd_tpu"]


@pytest.mark.parametrize("S", [4000, 96])  # tiles past the end; one tile
def test_decode_attention_lowers_to_mosaic(compiled_mosaic, S):
  B, H, K, D = 8, 32, 8, 128
  cache = (B, K, S, D)

  def fn(q, k, v, lengths, window):
    return kernels.decode_attention(q, k, v, lengths, sliding_window=window,
                                    softcap=50.0, kv_layout="BKSD")

  assert _mosaic_kernels(fn, _spec((B, H, D)), _spec(cache), _spec(cache),
                         _spec((B,), jnp.int32), _spec((), jnp.int32)) == [
                             "decode_attention_tpu"]


@pytest.mark.parametrize("N, V", [(8192, 128256), (100, 50)])
def test_token_logprobs_fwd_and_bwd_lower_to_mosaic(compiled_mosaic, N, V):
  D = 2048

  limit = 48 * 2**20  # a raised scoped-VMEM limit reaches every kernel
  blocks = kernels.TpuLogprobBlockSizes(vmem_limit_bytes=limit)

  def loss(h, w, targets):
    logp, ent = kernels.token_logprobs(h, w, targets, temperature=0.9,
                                       softcap=30.0, block_sizes=blocks)
    return jnp.sum(logp) + jnp.sum(ent)

  names, module = _mosaic_kernels(
      jax.grad(loss, argnums=(0, 1)), _spec((N, D)), _spec((D, V)),
      _spec((N,), jnp.int32), module_text=True)
  assert names == ["token_logprobs_dh_tpu", "token_logprobs_dw_tpu",
                   "token_logprobs_fwd_tpu"]
  assert module.count(str(limit)) == 3


@pytest.mark.parametrize("platform, backend, expected", [
    ("cpu", None, ("triton", True)),
    ("cpu", "mosaic_tpu", ("mosaic_tpu", True)),
    ("gpu", None, ("triton", False)),
    ("cuda", "triton", ("triton", False)),
    ("cuda", "mosaic_tpu", ("mosaic_tpu", True)),  # debugging TPU kernels
    ("tpu", None, ("mosaic_tpu", False)),
    ("tpu", "triton", ("triton", True)),
])
def test_pallas_backend_follows_the_platform(monkeypatch, platform, backend,
                                             expected):
  monkeypatch.setattr(jax, "default_backend", lambda: platform)
  assert _common.pallas_backend("op", backend) == expected


@pytest.mark.parametrize("kind, platform, expected", [
    ("NVIDIA H200", "gpu", ("triton", False)),
    ("TPU v5p", "tpu", ("mosaic_tpu", False)),
])
def test_pallas_backend_follows_the_abstract_mesh(kind, platform, expected):
  """Lowering under an abstract mesh of another platform's devices picks
  that platform's kernels, compiled (how :mod:`aot` compiles for a GPU that
  is not attached); with no mesh, JAX's default backend decides."""
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1,
                                       platform=platform)
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    assert _common.target_platform() == platform
    assert _common.pallas_backend("op") == expected
  assert _common.target_platform() == jax.default_backend()


def test_pallas_backend_errors_are_clear(monkeypatch):
  q = jnp.zeros((1, 16, 2, 16))
  with pytest.raises(ValueError, match="unknown Pallas backend 'mosaic'"):
    kernels.flash_attention(q, q, q, backend="mosaic")
  monkeypatch.setattr(jax, "default_backend", lambda: "metal")
  with pytest.raises(ValueError, match="no kernels for platform.*impl='xla'"):
    kernels.token_logprobs(q[0, :, 0], q[0, :, 0], jnp.zeros((16,), jnp.int32))


@pytest.mark.parametrize("setting, expected", [
    (None, set()), ("highest", {"HIGHEST"}), ("float32", {"HIGHEST"}),
    ("tensorfloat32", {"HIGH"}), ("bfloat16", {"DEFAULT"})])
def test_kernel_dots_follow_default_matmul_precision(setting, expected):
  # Triton lowers a default-precision fp32 dot to TF32; the kernels must use
  # the precision the XLA reference gets from jax_default_matmul_precision.
  q = jnp.ones((1, 32, 2, 16))
  h, w, t = q[0, :, 0], jnp.ones((16, 64)), jnp.zeros((32,), jnp.int32)
  fns = {
      "flash": lambda: jax.grad(
          lambda q: kernels.flash_attention(q, q, q).sum())(q),
      "logprobs": lambda: jax.grad(
          lambda h: kernels.token_logprobs(h, w, t)[0].sum())(h),
      "decode": lambda: kernels.decode_attention(
          q[:, 0], q, q, jnp.array([5], jnp.int32)),
      "flash_tpu": lambda: jax.grad(lambda q: kernels.flash_attention(
          q, q, q, backend="mosaic_tpu").sum())(q),
      "logprobs_tpu": lambda: jax.grad(lambda h: kernels.token_logprobs(
          h, w, t, backend="mosaic_tpu")[0].sum())(h),
      "decode_tpu": lambda: kernels.decode_attention(
          q[:, 0], q, q, jnp.array([5], jnp.int32), backend="mosaic_tpu"),
  }
  for name, fn in fns.items():
    with (contextlib.nullcontext() if setting is None
          else jax.default_matmul_precision(setting)):
      jaxpr = str(jax.make_jaxpr(fn)())
    assert "pallas_call" in jaxpr, name
    found = set(re.findall(r"precision=\(Precision\.(\w+),", jaxpr))
    assert found == expected, (name, found)


def test_the_models_scoring_path_lowers_to_mosaic(compiled_mosaic):
  """With attn_impl="pallas" and the pallas log-prob path, the learner's
  scoring gradient on a TPU runs the Mosaic kernels (GQA, a sliding-window
  layer and soft-caps included; the layers are scanned, so each kernel
  appears once): the model selects them by config."""
  from agentic_rl import model  # pylint: disable=import-outside-toplevel
  from agentic_rl.model import scoring  # pylint: disable=import-outside-toplevel
  config = model.TransformerConfig(
      vocab_size=1000, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
      head_dim=64, mlp_dim=256, attn_impl="pallas", sliding_windows=(64, None),
      attn_logit_softcap=50.0, final_logit_softcap=30.0)
  params = jax.eval_shape(lambda: model.init_params(config, jax.random.key(0)))

  def loss(params, tokens):
    logp, entropy = scoring.sequence_logprobs(params, tokens, config,
                                              impl="pallas")
    return jnp.sum(logp) + jnp.sum(entropy)

  names = _mosaic_kernels(jax.grad(loss), params, _spec((2, 300), jnp.int32))
  assert sorted(set(names)) == [
      "flash_attention_dkdv_tpu", "flash_attention_dq_tpu",
      "flash_attention_fwd_tpu", "token_logprobs_dh_tpu",
      "token_logprobs_dw_tpu", "token_logprobs_fwd_tpu"]
