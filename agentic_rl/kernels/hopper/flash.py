"""Flash attention as Mosaic GPU (Hopper) kernels: forward and backward.

The same forward and backward as the Triton kernels
(:mod:`agentic_rl.kernels.triton.flash`), written for Hopper (sm_90a) with
Pallas' Mosaic GPU backend, after FlashAttention-3 (Shah et al., 2024,
arXiv:2407.08608): warpgroup matmuls (``wgmma``) reading swizzled shared
memory, and a warp-specialised pipeline in which a memory warpgroup streams
tiles by TMA into a ring of ``stages`` slots while ``warpgroups`` compute
warpgroups, each owning one tile of the program's, run the matmuls and the
softmax algebra on them (one's softmax can overlap another's matmuls):

    forward, per query tile i, over key tiles j (online softmax, base 2):
      S = Q K_j^T * scale * log2 e (masked),  m' = max(m, rowmax S)
      P = exp2(S - m'),  l = l exp2(m - m') + rowsum P
      acc = acc exp2(m - m') + P V_j;   out = acc / l,  lse = m + log2 l
    dQ kernel, per query tile i, over key tiles j:
      S = Q K_j^T,  dP = dO V_j^T,  P = exp2(S - lse),  dS = P (dP - delta)
      dQ += dS K_j                                   (dQ = scale * sum)
    dK/dV kernel, per key tile j, over query tiles i (and the G query heads
    of its key/value head):
      S^T = K Q_i^T,  dP^T = V dO_i^T,  P^T, dS^T as above
      dV += P^T dO_i,  dK += dS^T Q_i                (dK = scale * sum)
      (fused_dq: also dQ_i += dS K_j, added to dQ in memory)

With ``fused_dq`` (FlashAttention-3's backward) there is no dQ kernel: the
dK/dV kernel's warpgroups share their ``dS^T`` tiles each step, and each
adds ``dS K`` for a slice of dQ's columns into an fp32 buffer by TMA
reduce-add (:func:`_add_dq`), 5 tile matmuls per block pair instead of 7.

``lse`` is the base-2 log-sum-exp of the scaled logits (the Triton kernels'
convention, so either family's forward feeds either backward) and ``delta =
rowsum(O * dO)`` (:func:`agentic_rl.kernels.flash.row_delta`). The backward
keeps its dK/dV tiles key-major (``S^T``), so ``P^T`` and ``dS^T`` feed their
matmuls without a transpose. ``P`` (forward), ``dS`` (dQ) and ``P^T``/``dS^T``
(dK/dV) stay in registers as the left operand of their wgmma, and the forward
accumulates ``P V`` into its rescaled accumulator in place, as FlashAttention-3
does. Pallas' GPU interpreter (which runs these kernels on CPU) models wgmma on
shared-memory operands and fresh accumulators only, so there, or with
``register_operands=False``, those tiles go through shared-memory staging tiles
and ``P V`` is added after its matmul (:func:`_lhs`, :func:`_accumulate`); the
values are the same. Each streamed tile is released as soon as its last matmul
is done (the pipeline's consumed barriers), so its slot refills during the
step.

Scope (:func:`unsupported` says why a case is out of it, and
:func:`agentic_rl.kernels.flash.flash_attention` raises that): float16 or
bfloat16, self-attention (``T == S``) with the length a multiple of
``warpgroups`` tiles, head_dim a multiple of 64 up to 256, causal masking and
static sliding windows; no segment ids and no soft-cap (the Triton kernels
cover those). Masks follow :mod:`attention_rules`, and the streamed block range
is its ``key_blocks`` / ``query_blocks`` over the program's tiles, so tiles no
warpgroup sees are never loaded; tiles that see every pair skip the mask.

Status: tested in the GPU interpreter (jax >= 0.11), lowered for CUDA on
CPU (every jax this project supports) and compiled for an H200 by ptxas on
CPU (``experiments/aot_kernels.py``); not yet run on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from agentic_rl.kernels import _common
from agentic_rl.kernels import attention_rules as rules

DTYPES = (jnp.float16, jnp.bfloat16)
# Pallas' GPU interpreter (runs these kernels on CPU) arrived in jax 0.11.
CAN_INTERPRET = hasattr(plgpu, "InterpretGPUParams")
# plgpu.load's index: required in jax 0.10, optional in 0.11, gone in 0.12.
_LOAD_INDEX = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_ARGS = (() if _LOAD_INDEX is None
              or _LOAD_INDEX.default is not inspect.Parameter.empty else ((),))
# wgmma's M is 64 rows per warpgroup; a 128-byte swizzle holds 64 16-bit
# elements, so tiles and head_dim are multiples of 64.
TILE = 64
# wgmma's N (head_dim in P V, dS K and the dK/dV products) is at most 256.
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class Config:
  """What the Mosaic GPU backward specialises on (hashable)."""
  causal: bool
  window: int | None  # static sliding window
  scale: float
  T: int
  S: int
  Sp: int  # == S: lengths are tile multiples (attention_rules needs it)
  D: int
  groups: int
  bq: int
  bk: int
  stages: int
  warpgroups: int  # compute warpgroups per program, each with its own tile
  interpret: bool
  longest_first: bool = False  # query-major kernels: last query tiles first
  pingpong: bool = False  # forward: alternate the warpgroups' matmuls
  register_operands: bool = True  # P, dS feed wgmma from registers
  fused_dq: bool = False  # backward: dQ from the dK/dV kernel (TMA adds)
  softcap: None = None  # the fields attention_rules reads
  has_segments: bool = False

  @property
  def has_window(self) -> bool:
    return self.window is not None

  @property
  def in_registers(self) -> bool:
    """Whether ``P``/``dS`` stay in registers as wgmma's left operand (and
    the forward accumulates in place). The interpreter models wgmma on
    shared-memory operands only, so there they are staged in shared
    memory (same values: both round to the input dtype)."""
    return self.register_operands and not self.interpret


def unsupported(q_shape, k_shape, dtype, *, has_segments, softcap,
                bq: int, bk: int, warpgroups: int,
                fused_dq: bool = False) -> str | None:
  """Why the Mosaic GPU kernels cannot run this case, or None."""
  _, T, _, D = q_shape
  S = k_shape[1]
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
    return f"needs float16 or bfloat16 inputs, got {jnp.dtype(dtype)}"
  if has_segments:
    return "does not support segment_ids"
  if softcap is not None:
    return "does not support softcap"
  if T != S:
    return f"needs equal query and key lengths, got {T} and {S}"
  if D % TILE or D > MAX_HEAD_DIM:
    return (f"needs head_dim a multiple of {TILE} up to {MAX_HEAD_DIM}, "
            f"got {D}")
  for name, b in (("query", bq), ("key", bk)):
    if b % TILE or T % (b * warpgroups):
      return (f"needs the length {T} to be a multiple of {warpgroups} "
              f"(warpgroups) x the {name} tile {b}, a multiple of {TILE}")
  if fused_dq and D % (TILE * warpgroups):
    return (f"with fused dQ needs head_dim a multiple of {TILE} x "
            f"{warpgroups} (warpgroups: each adds a slice of dQ's columns), "
            f"got {D}")
  return None


def make_config(q_shape, k_shape, *, causal, window, bq, bk, stages,
                warpgroups, interpret, longest_first=False,
                pingpong=False, register_operands=True,
                fused_dq=False) -> Config:
  _, T, H, D = q_shape
  S, K = k_shape[1], k_shape[2]
  return Config(causal=causal, window=window, scale=float(D) ** -0.5,
                T=T, S=S, Sp=S, D=D, groups=H // K, bq=bq, bk=bk,
                stages=stages, warpgroups=warpgroups, interpret=interpret,
                longest_first=longest_first, pingpong=pingpong,
                register_operands=register_operands, fused_dq=fused_dq)


# --------------------------------------------------------------------------
# In-kernel helpers.

_TILED = (plgpu.TilingTransform((8, TILE)), plgpu.SwizzleTransform(128))


def _smem(shape, dtype):
  """A swizzled shared-memory tile (a wgmma operand)."""
  return plgpu.SMEM(shape, dtype, transforms=_TILED)


def _matmuls(shape, *operands):
  """``[a @ b for a, b in operands]``, fp32 ``shape``: every wgmma is issued
  before the first result is read (one wait for all)."""
  def run(*acc_refs):
    for acc_ref, (a, b) in zip(acc_refs, operands):
      plgpu.wgmma(acc_ref, a, b)
    return [acc_ref[...] for acc_ref in acc_refs]
  return pl.run_scoped(run, *[plgpu.ACC(shape, jnp.float32)] * len(operands))


def _staging(cfg: Config, shape, dtype):
  """Scratch for :func:`_lhs`: ``(tiles,)``, one ``shape`` tile per compute
  warpgroup, or ``()`` when the operands stay in registers."""
  return () if cfg.in_registers else (
      _smem((cfg.warpgroups, *shape), dtype),)


def _lhs(x, staging):
  """``x`` (16-bit, WGMMA layout) as a wgmma's left operand: the value
  itself (registers), or written to this warpgroup's tile of ``staging``
  (:func:`_staging`)."""
  if not staging:
    return x
  tile = staging[0].at[lax.axis_index("wg")]
  tile[...] = x
  plgpu.commit_smem()
  return tile


def _accumulate(cfg: Config, acc, a, b):
  """``acc + a @ b`` by wgmma (``acc`` an fp32 WGMMA-layout value), waited
  for: in place from registers (``pl.run_state`` on an initialised
  accumulator), or, for the interpreter, into a fresh one and added."""
  if cfg.in_registers:
    return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b))(
        plgpu.ACC.init(acc))
  ab, = _matmuls(acc.shape, (a, b))
  return acc + ab


def _where_visible(cfg: Config, x, offset, key_major, fill):
  """``x`` with the pairs a tile cannot see set to ``fill`` (the rules of
  :func:`attention_rules.visible`: causal ``s <= t``, window ``t - s <
  window``). The tile is ``[rows, cols]``, query-major (``[bq, bk]``) or
  ``key_major`` (``[bk, bq]``), and its corner has ``t - s = offset``. Tiles
  that see every pair skip the mask arithmetic (a ``lax.cond``)."""
  if not cfg.causal and cfg.window is None:
    return x
  rows, cols = x.shape
  q_span, k_span = (cols, rows) if key_major else (rows, cols)
  lowest, highest = offset - (k_span - 1), offset + (q_span - 1)  # of t - s
  full = jnp.bool_(True)
  if cfg.causal:
    full = full & (lowest >= 0)
  if cfg.window is not None:
    full = full & (highest < cfg.window)

  def mask(x):
    def iota(dim):
      return plgpu.broadcasted_iota(jnp.int32, (rows, cols), dim,
                                    layout=plgpu.Layout.WGMMA)
    t_minus_s = offset + (iota(1) - iota(0) if key_major else
                          iota(0) - iota(1))
    visible = t_minus_s >= 0 if cfg.causal else None
    if cfg.window is not None:
      inside = t_minus_s < cfg.window
      visible = inside if visible is None else visible & inside
    return jnp.where(visible, x, fill)
  return lax.cond(full, lambda x: x, mask, x)


def _probs_and_dlogits(cfg, s, dp, lse, delta, offset, key_major):
  """``P = exp2(S * scale * log2 e - lse)`` (masked to 0,
  :func:`_where_visible`) and ``dS = P * (dP - delta)``; ``lse``/``delta``
  broadcast by the caller."""
  p = _where_visible(cfg, jnp.exp2(s * (cfg.scale * _common.LOG2E) - lse),
                     offset, key_major, 0.0)
  return p, p * (dp - delta)


def _query_program(cfg: Config):
  """The program's query-tile group; with ``longest_first``, last first:
  under a causal mask the last queries see the most keys, and starting the
  longest programs first can shorten the final wave (FlashAttention-3's
  longest-processing-time order; untimed, hence off by default)."""
  if not cfg.longest_first:
    return lax.axis_index("q")
  groups = cfg.T // (cfg.warpgroups * cfg.bq)
  return jnp.int32(groups - 1) - lax.axis_index("q")


def _stream_key_tiles(cfg: Config, step, compute, lo, hi, k_SxD, v_SxD):
  """Runs ``step(idx, k_tile, v_tile, k_consumed, v_consumed, carry)`` in
  the compute warpgroups over key/value tiles ``[lo, hi)`` of
  ``k_SxD``/``v_SxD``, which the memory warpgroup streams by TMA into
  ``cfg.stages`` slots; each warpgroup arrives on ``k_consumed`` and
  ``v_consumed`` once done with that tile (then its slot refills, before
  the step ends). ``compute`` is the compute warpgroups' context (it calls
  the pipeline with the initial carry). The forward's and the dQ kernel's
  loop."""
  spec = plgpu.BlockSpec((cfg.bk, cfg.D), lambda j: (lo + j, 0),
                         transforms=_TILED)
  plgpu.emit_pipeline_warp_specialized(
      step, grid=(hi - lo,), memory_registers=40, in_specs=[spec, spec],
      max_concurrent_steps=cfg.stages, wg_axis="wg",
      num_compute_wgs=cfg.warpgroups, manual_consumed_barriers=True,
      compute_context=compute)(k_SxD, v_SxD)


def _block_range(blocks, cfg, start, size, tile):
  lo, hi = blocks(cfg, start, size, tile, cfg.window)
  return jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)


# --------------------------------------------------------------------------
# Forward: one program per (W query tiles, query head, batch row). Compute
# warpgroup w owns query tile w and its online softmax; the memory warpgroup
# streams the key/value tiles any of them sees.


def _fwd_kernel(cfg: Config, q_ref, k_ref, v_ref, out_ref, lse_ref, q_smem,
                lse_smem, bar, turn, p_staging):
  bq, bk, D, W, dtype = cfg.bq, cfg.bk, cfg.D, cfg.warpgroups, q_ref.dtype
  i, h, b = _query_program(cfg), lax.axis_index("h"), lax.axis_index("b")
  kh = lax.div(h, jnp.int32(cfg.groups))
  lo, hi = _block_range(rules.key_blocks, cfg, i * W * bq, W * bq, bk)
  row_vec = plgpu.Layout.WGMMA.reduce(1)
  pingpong = cfg.pingpong and W == 2

  def take_turns():
    """With ``pingpong``, the two compute warpgroups meet here (every call
    of one pairs with the same-numbered call of the other). Each calls it
    after issuing ``Q K^T`` and after its softmax, and warpgroup 1 once
    more first, so one's softmax runs while the other's matmuls do
    (FlashAttention-3's ping-pong schedule)."""
    if pingpong:
      plgpu.barrier_arrive(turn)
      plgpu.barrier_wait(turn)

  def compute(pipeline):
    w = lax.axis_index("wg")
    rows = pl.ds((i * W + w) * bq, bq)
    q_tile, lse_tile = q_smem.at[w], lse_smem.at[w]
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_tile, bar.at[w])
    plgpu.barrier_wait(bar.at[w])
    m = plgpu.layout_cast(jnp.full((bq,), _common.MASKED, jnp.float32),
                          row_vec)
    l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_vec)
    acc = plgpu.layout_cast(jnp.zeros((bq, D), jnp.float32),
                            plgpu.Layout.WGMMA)
    if pingpong:
      pl.when(w == 1)(take_turns)
    m, l, acc = pipeline((m, l, acc))
    if pingpong:
      pl.when(w == 0)(take_turns)
    # Every row sees its own key (self-attention), so l >= 1.
    q_tile[...] = (acc / lax.broadcast_in_dim(l, (bq, D), [0])).astype(dtype)
    lse_tile[...] = m + jnp.log(l) * _common.LOG2E  # log2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_tile, out_ref.at[b, rows, h])
    plgpu.copy_smem_to_gmem(lse_tile, lse_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)

  def step(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
    m, l, acc = carry
    w = lax.axis_index("wg")

    def logits(acc_ref):
      plgpu.wgmma(acc_ref, q_smem.at[w], k_smem.transpose((1, 0)))
      take_turns()
      return acc_ref[...]
    s = pl.run_scoped(logits, plgpu.ACC((bq, bk), jnp.float32))
    plgpu.barrier_arrive(k_consumed)  # the next key tile can stream in
    offset = (i * W + w) * bq - (lo + idx[0]) * bk
    s = _where_visible(cfg, s * (cfg.scale * _common.LOG2E), offset,
                       key_major=False, fill=_common.MASKED)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, (bq, bk), [0]))
    alpha = jnp.exp2(m - m_new)
    # A row whose visible keys have not started yet holds m = MASKED and
    # sums exp2(0) = 1 per masked key; its first visible key wipes that
    # (alpha = exp2(MASKED - m_new) = 0), and every row has one.
    l = l * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, (bq, D), [0])
    p = _lhs(p.astype(dtype), p_staging)
    take_turns()
    acc = _accumulate(cfg, acc, p, v_smem)
    plgpu.barrier_arrive(v_consumed)
    return m_new, l, acc

  _stream_key_tiles(cfg, step, compute, lo, hi, k_ref.at[b, :, kh],
                    v_ref.at[b, :, kh])


def forward(cfg: Config, q, k, v):
  """``(out, lse_BxHxT)``: attention in q's dtype and its base-2
  log-sum-exp (fp32, the residual :func:`backward` and the Triton backward
  read)."""
  B, T, H, D = q.shape
  W, bq = cfg.warpgroups, cfg.bq
  scratch = [
      _smem((W, bq, D), q.dtype), plgpu.SMEM((W, bq), jnp.float32),
      plgpu.Barrier(num_barriers=W), plgpu.Barrier(num_arrivals=W),
      _staging(cfg, (bq, cfg.bk), q.dtype)]
  return _launch(
      cfg, "flash_attention_fwd_mgpu", _fwd_kernel,
      out_type=(q, jax.ShapeDtypeStruct((B, H, T), jnp.float32)),
      scratch=scratch, grid=(T // (W * bq), H, B), grid_names=("q", "h", "b"),
  )(q, k, v)


# --------------------------------------------------------------------------
# dQ: one program per (W query tiles, query head, batch row). Compute
# warpgroup w owns query tile w; the memory warpgroup streams the key/value
# tiles that any of them sees (a tile one of them does not see is masked
# out in full).


def _dq_kernel(cfg: Config, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               dq_ref, q_smem, do_smem, lse_smem, delta_smem, bar,
               ds_staging):
  bq, bk, D, W, dtype = cfg.bq, cfg.bk, cfg.D, cfg.warpgroups, q_ref.dtype
  i, h, b = _query_program(cfg), lax.axis_index("h"), lax.axis_index("b")
  kh = lax.div(h, jnp.int32(cfg.groups))
  lo, hi = _block_range(rules.key_blocks, cfg, i * W * bq, W * bq, bk)

  def compute(pipeline):
    w = lax.axis_index("wg")
    q0 = (i * W + w) * bq
    rows = pl.ds(q0, bq)
    mine = [q_smem.at[w], do_smem.at[w], lse_smem.at[w], delta_smem.at[w]]
    for n, (src, dst) in enumerate(zip(
        [q_ref.at[b, rows, h], do_ref.at[b, rows, h], lse_ref.at[b, h, rows],
         delta_ref.at[b, h, rows]], mine)):
      plgpu.copy_gmem_to_smem(src, dst, bar[n].at[w])
    for n in range(4):
      plgpu.barrier_wait(bar[n].at[w])
    row_vec = plgpu.Layout.WGMMA.reduce(1)
    lse = plgpu.load(mine[2], *_LOAD_ARGS, layout=row_vec)
    delta = plgpu.load(mine[3], *_LOAD_ARGS, layout=row_vec)

    def run(dq_acc):
      pipeline((lse, delta, dq_acc))
      return dq_acc[...]
    dq = pl.run_scoped(run, plgpu.ACC((bq, D), jnp.float32))
    mine[0][...] = (dq * cfg.scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(mine[0], dq_ref.at[b, rows, h])
    plgpu.wait_smem_to_gmem(0)

  def step(idx, k_smem, v_smem, k_consumed, v_consumed, carry):
    lse, delta, dq_acc = carry
    w = lax.axis_index("wg")
    s, dp = _matmuls((bq, bk), (q_smem.at[w], k_smem.transpose((1, 0))),
                     (do_smem.at[w], v_smem.transpose((1, 0))))
    plgpu.barrier_arrive(v_consumed)  # V's one use
    offset = (i * W + w) * bq - (lo + idx[0]) * bk
    _, ds = _probs_and_dlogits(
        cfg, s, dp, lax.broadcast_in_dim(lse, (bq, bk), [0]),
        lax.broadcast_in_dim(delta, (bq, bk), [0]), offset, key_major=False)
    plgpu.wgmma(dq_acc, _lhs(ds.astype(dtype), ds_staging), k_smem)
    plgpu.wgmma_wait(0)  # before k_smem (and a staging tile) is reused
    plgpu.barrier_arrive(k_consumed)
    return carry

  _stream_key_tiles(cfg, step, compute, lo, hi, k_ref.at[b, :, kh],
                    v_ref.at[b, :, kh])


def _dq_call(cfg: Config, q, k, v, do, lse, delta):
  B, T, H, D = q.shape
  W, bq = cfg.warpgroups, cfg.bq
  scratch = [
      _smem((W, bq, D), q.dtype), _smem((W, bq, D), q.dtype),
      plgpu.SMEM((W, bq), jnp.float32), plgpu.SMEM((W, bq), jnp.float32),
      (plgpu.Barrier(num_barriers=W),) * 4,
      _staging(cfg, (bq, cfg.bk), q.dtype)]
  return _launch(
      cfg, "flash_attention_dq_mgpu", _dq_kernel, out_type=q,
      scratch=scratch, grid=(T // (W * bq), H, B), grid_names=("q", "h", "b"),
  )(q, k, v, do, lse, delta)


# --------------------------------------------------------------------------
# dK/dV: one program per (W key tiles, key/value head, batch row), streaming
# the query tiles of each of the G query heads that share the key/value
# head. Compute warpgroup w owns key tile w.


def _dkdv_kernel(cfg: Config, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                 *refs):
  *dq_ref, dk_ref, dv_ref, k_smem, v_smem, bar, p_staging, ds_staging, \
      dq_scratch = refs
  bq, bk, D, G, W = cfg.bq, cfg.bk, cfg.D, cfg.groups, cfg.warpgroups
  dtype = k_ref.dtype
  j, kh, b = (lax.axis_index(n) for n in ("k", "kh", "b"))
  lo, hi = _block_range(rules.query_blocks, cfg, j * W * bk, W * bk, bq)
  n = hi - lo  # query tiles per head; the pipeline runs G * n steps

  def compute(pipeline):
    w = lax.axis_index("wg")
    keys = pl.ds((j * W + w) * bk, bk)
    k_tile, v_tile = k_smem.at[w], v_smem.at[w]
    plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kh], k_tile, bar[0].at[w])
    plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kh], v_tile, bar[1].at[w])
    plgpu.barrier_wait(bar[0].at[w])
    plgpu.barrier_wait(bar[1].at[w])

    def run(dk_acc, dv_acc):
      pipeline((dk_acc, dv_acc))
      return dk_acc[...], dv_acc[...]
    acc = plgpu.ACC((bk, D), jnp.float32)
    dk, dv = pl.run_scoped(run, acc, acc)
    if cfg.fused_dq:  # the others' last dQ matmuls read this key tile
      done = dq_scratch[-1]
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)
    k_tile[...] = (dk * cfg.scale).astype(dtype)
    v_tile[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[b, keys, kh])
    plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[b, keys, kh])
    plgpu.wait_smem_to_gmem(0)

  def step(idx, q_tile, do_tile, lse_smem, delta_smem, carry):
    dk_acc, dv_acc = carry
    w = lax.axis_index("wg")
    k_tile, v_tile = k_smem.at[w], v_smem.at[w]
    s_t, dp_t = _matmuls((bk, bq), (k_tile, q_tile.transpose((1, 0))),
                         (v_tile, do_tile.transpose((1, 0))))
    col_vec = plgpu.Layout.WGMMA.reduce(0)
    lse = plgpu.load(lse_smem, *_LOAD_ARGS, layout=col_vec)
    delta = plgpu.load(delta_smem, *_LOAD_ARGS, layout=col_vec)
    offset = _q_index(lo, n, idx[0])[0] * bq - (j * W + w) * bk
    p_t, ds_t = _probs_and_dlogits(
        cfg, s_t, dp_t, lax.broadcast_in_dim(lse, (bk, bq), [1]),
        lax.broadcast_in_dim(delta, (bk, bq), [1]), offset, key_major=True)
    plgpu.wgmma(dv_acc, _lhs(p_t.astype(dtype), p_staging), do_tile)
    ds_t = ds_t.astype(dtype)
    plgpu.wgmma(dk_acc, _lhs(ds_t, ds_staging), q_tile)
    if cfg.fused_dq:
      i, g = _q_index(lo, n, idx[0])
      part = j if cfg.interpret else 0  # backward(): one slot or one each
      _add_dq(cfg, ds_t, idx[0], k_smem, dq_scratch,
              dq_ref[0].at[part, b, pl.ds(i * bq, bq), kh * G + g])
    plgpu.wgmma_wait(0)  # the streamed (and staging) tiles are reused
    return carry

  q_spec = plgpu.BlockSpec((bq, None, D),
                           lambda m: (*_q_index(lo, n, m), 0),
                           transforms=_TILED)
  row_spec = plgpu.BlockSpec((None, bq), lambda m: _q_index(lo, n, m)[::-1])
  pipeline = plgpu.emit_pipeline_warp_specialized(
      step, grid=(G * n,), memory_registers=40,
      in_specs=[q_spec, q_spec, row_spec, row_spec],
      max_concurrent_steps=cfg.stages, wg_axis="wg", num_compute_wgs=W,
      compute_context=compute)
  heads = pl.ds(kh * G, G)
  pipeline(q_ref.at[b, :, heads], do_ref.at[b, :, heads],
           lse_ref.at[b, heads], delta_ref.at[b, heads])


def _add_dq(cfg: Config, ds_t, m, k_smem, scratch, dq_TxD):
  """Fused dQ (FlashAttention-3's): ``dq_TxD[:, cols_w] += dS K[:, cols_w]``
  for this step's query tile, over the program's ``W`` key tiles, by a TMA
  reduce-add from shared memory (fp32; the interpreter, which has no TMA
  reductions, writes a slot of its own per program instead, summed after).

  Every compute warpgroup puts its ``dS^T`` tile (``ds_t``, 16-bit
  ``[bk, bq]``) in slot ``m % 2`` of the shared ``ds_2xWxKxQ`` tiles, and
  they meet at a barrier; warpgroup ``w`` then multiplies all of them by
  its ``D / W`` columns of all ``W`` key tiles, so the warpgroups split the
  work and each adds a distinct slice. Two slots: a warpgroup writing step
  ``m + 2``'s tile has passed step ``m + 1``'s barrier, so every warpgroup
  has finished reading step ``m``'s. (For the same reason the kernel's
  epilogue meets at a last barrier before it overwrites its key tile.)"""
  ds_2xWxKxQ, dq_WxQxC, ready, _ = scratch
  W, D, bq = cfg.warpgroups, cfg.D, cfg.bq
  cols = D // W
  w, slot = lax.axis_index("wg"), lax.rem(m, 2)
  ds_2xWxKxQ.at[slot, w][...] = ds_t
  plgpu.commit_smem()
  plgpu.barrier_arrive(ready.at[slot])
  plgpu.barrier_wait(ready.at[slot])
  for c in range(W):  # static column slices of the swizzled key tiles
    @pl.when(w == c)
    def _():
      def part(acc_ref):
        for u in range(W):
          plgpu.wgmma(acc_ref, ds_2xWxKxQ.at[slot, u].transpose((1, 0)),
                      k_smem.at[u, :, pl.ds(c * cols, cols)])
        return acc_ref[...]
      dq = pl.run_scoped(part, plgpu.ACC((bq, cols), jnp.float32))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last step's is read
      dq_WxQxC.at[c][...] = dq
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          dq_WxQxC.at[c], dq_TxD.at[:, pl.ds(c * cols, cols)],
          reduction_op=None if cfg.interpret else "add")


def _q_index(lo, n, m):
  """dK/dV pipeline step ``m`` -> (query tile, query head in the group)."""
  return lo + lax.rem(m, n), lax.div(m, n)


def _dkdv_call(cfg: Config, q, k, v, do, lse, delta, *dq_ref):
  B, S, K, D = k.shape
  W, bk, bq = cfg.warpgroups, cfg.bk, cfg.bq
  dq_scratch = () if not cfg.fused_dq else (
      _smem((2, W, bk, bq), k.dtype),
      plgpu.SMEM((W, bq, D // W), jnp.float32,
                 transforms=(plgpu.TilingTransform((8, 32)),
                             plgpu.SwizzleTransform(128))),
      plgpu.Barrier(num_arrivals=W, num_barriers=2),
      plgpu.Barrier(num_arrivals=W))
  scratch = [
      _smem((W, bk, D), k.dtype), _smem((W, bk, D), k.dtype),
      (plgpu.Barrier(num_barriers=W),) * 2,
      _staging(cfg, (bk, bq), k.dtype),
      _staging(cfg, (bk, bq), k.dtype), dq_scratch]
  return _launch(
      cfg, "flash_attention_dkdv_mgpu", _dkdv_kernel, out_type=(k, v),
      scratch=scratch, grid=(S // (W * bk), K, B),
      grid_names=("k", "kh", "b"), takes_ref=cfg.fused_dq,
  )(q, k, v, do, lse, delta, *dq_ref)


def _launch(cfg: Config, name: str, kernel, *, out_type, scratch, grid,
            grid_names, takes_ref: bool = False):
  """``kernel(cfg, *inputs, *outputs, *scratch)`` as a Mosaic GPU kernel
  called ``name`` (ptxas, profilers and ``experiments/aot_kernels.py``
  report it) over
  ``grid``, with ``cfg.warpgroups`` compute warpgroups and a memory one
  (axis "wg") sharing the ``scratch`` allocations. ``plgpu.kernel`` does
  that (and batches under ``jax.vmap``); with ``takes_ref`` (a ``jax.Ref``
  input the kernel updates: fused dQ's buffer) ``pl.kernel`` does, because
  in jax 0.10 ``plgpu.kernel`` cannot take a Ref inside a custom_vjp
  (``pl.kernel`` does not batch: :func:`_fold_vmap`)."""
  body = functools.partial(kernel, cfg)
  body.__name__ = name  # plgpu.kernel names the kernel after its body
  # No shared memory is reserved for cross-warp reductions (2 KiB by
  # default, whenever a kernel reduces): the only reductions, the forward's
  # row max and sum, stay within each warp's rows of the WGMMA layout
  # (shuffles). The 2 KiB are what a third forward stage of 128-key tiles
  # lacked.
  common = dict(compiler_params=plgpu.CompilerParams(
                    approx_math=True, reduction_scratch_bytes=0),
                interpret=plgpu.InterpretGPUParams() if cfg.interpret else
                False)
  threads = dict(num_threads=cfg.warpgroups + 1, thread_name="wg")
  if not takes_ref:
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch,
                        grid=grid, grid_names=grid_names, **threads, **common)

  def shared_scratch(*refs):
    pl.run_scoped(functools.partial(body, *refs), *scratch,
                  collective_axes="wg")
  return pl.kernel(
      shared_scratch, out_type=out_type, name=name,
      mesh=plgpu.Mesh(grid=grid, grid_names=grid_names, **threads), **common)


def backward(cfg: Config, q, k, v, d_out, lse_BxHxT, delta_BxHxT):
  """``(dq, dk, dv)`` of attention; shapes and dtypes of ``q``, ``k``, ``v``.

  ``lse_BxHxT``: the forward's base-2 log-sum-exp (fp32, may be longer than
  T: the Triton forward pads it). ``delta_BxHxT``: ``rowsum(O * dO)`` fp32.
  """
  T = q.shape[1]
  lse = lse_BxHxT[:, :, :T]
  if not cfg.fused_dq:
    dq = _dq_call(cfg, q, k, v, d_out, lse, delta_BxHxT)
    dk, dv = _dkdv_call(cfg, q, k, v, d_out, lse, delta_BxHxT)
    return dq, dk, dv
  return _fold_vmap(functools.partial(_fused_backward, cfg))(
      q, k, v, d_out, lse, delta_BxHxT)


def _fused_backward(cfg: Config, q, k, v, d_out, lse, delta):
  # The dK/dV programs add their dQ terms into one fp32 buffer (a Ref, so
  # the kernel updates it in place; interpreted, each writes its own).
  # pl.run_state scopes the Refs, so the function stays pure: custom_vmap
  # (_fold_vmap) cannot hold a free jax.new_ref. XLA drops the dK/dV zeros.
  programs = cfg.S // (cfg.warpgroups * cfg.bk) if cfg.interpret else 1

  def run(refs):
    dq_ref, dk_ref, dv_ref = refs
    dk_ref[...], dv_ref[...] = _dkdv_call(cfg, q, k, v, d_out, lse, delta,
                                          dq_ref)
  dq, dk, dv = pl.run_state(run)((
      jnp.zeros((programs, *q.shape), jnp.float32), jnp.zeros_like(k),
      jnp.zeros_like(v)))
  return (dq.sum(axis=0) * cfg.scale).astype(q.dtype), dk, dv


def _fold_vmap(fn):
  """``fn`` (arrays with a leading batch axis to arrays with one), batched
  under ``jax.vmap`` by folding the mapped axis into that batch axis: for
  a kernel ``pl.kernel`` launches, whose ``mpmd_map`` batches only axes of
  size 1. Unmapped arguments are broadcast first."""
  fn_vmap = jax.custom_batching.custom_vmap(fn)

  @fn_vmap.def_vmap
  def _(axis_size, in_batched, *args):
    def fold(x, batched):
      x = x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
      return x.reshape(axis_size * x.shape[1], *x.shape[2:])
    outs = fn_vmap(*map(fold, args, in_batched))  # an outer vmap folds too
    return (tuple(y.reshape(axis_size, -1, *y.shape[1:]) for y in outs),
            (True,) * len(outs))
  return fn_vmap
