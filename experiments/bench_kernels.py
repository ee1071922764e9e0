"""Benchmark every implementation of each kernel op side by side.

    python -m experiments.bench_kernels --out FILE [--quick] [--ops a,b]
        [--backend triton|mosaic_tpu]
    python -m experiments.bench_kernels --tune --out FILE [--max_seconds S]
    python -m experiments.bench_kernels --ab FIELD=V1,V2 --out FILE [--rounds R]
        [--ab_base JSON]

For each op and shape, every implementation available on this backend is
compiled once (``jax.jit(f).lower(...).compile()``, whose
``memory_analysis()`` gives the temporary and peak memory), warmed up, then
timed as the median of ``--repeats`` calls ending in ``block_until_ready``.
Throughput is TFLOP/s for attention and log-probs (useful FLOPs: causal
attention counts visible pairs only, backward = 2.5x forward as in
FlashAttention-2; log-probs count ``2NDV`` per matmul, 3 for fwd+bwd) and
GB/s for decode (cache bytes read), reported against the device's spec peak
when known. A failing implementation is recorded with its error and the run
goes on. ``--quick`` uses tiny shapes (CPU: Pallas runs interpreted).
``impl="pallas"`` runs the platform's kernel family (Triton on GPU, Mosaic on
TPU), or ``--backend``'s on CPU.

``--ab FIELD=V1,V2`` checks one tile change against noise: the Pallas kernel
at the default tiles (with ``--ab_base``'s fields changed, a JSON object)
with ``FIELD`` set to each value, timed in interleaved rounds (:func:`ab`).
On a GPU the attention rows also time the Mosaic GPU (Hopper) kernels:
``pallas_mgpu`` (``fwd`` and ``bwd="mosaic_gpu"``) and, in fwd+bwd,
``pallas_mgpu_bwd`` (the Triton forward with the Mosaic GPU backward) and
``pallas_mgpu_fused_dq`` (both Mosaic GPU, dQ from the dK/dV kernel).

``--tune`` times the Pallas implementation alone over its tile sizes instead:
one pass of coordinate search per case over :data:`TUNE_GRIDS` (Triton) or
:data:`TPU_TUNE_GRIDS` (Mosaic) (each field
tried in turn with the others held at the best so far, starting from the
defaults; a fwd+bwd search starts from the same op's best forward tiles),
within ``--max_seconds``. The JSON is rewritten after every case, so a run cut
short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

from agentic_rl import kernels

# Spec peaks (dense bf16 FLOP/s, HBM bytes/s) by device_kind substring.
_PEAKS = {
    "H200": (989e12, 4.8e12),
    "H100": (989e12, 3.35e12),
    "A100": (312e12, 2.0e12),
}


@dataclasses.dataclass
class Case:
  """One op at one shape: per-impl callables over the same arguments."""
  op: str
  mode: str  # "fwd" or "fwd+bwd"
  shape: str
  dtype: str
  fns: dict[str, Callable]
  args: tuple
  flops: float | None = None  # useful FLOPs per call
  bytes: float | None = None  # bytes that must move per call
  # The Pallas fn with given tile sizes (an instance of ``blocks``), for --tune.
  pallas_with: Callable[[object], Callable] | None = None
  blocks: type | None = None
  backend: str = "triton"  # the Pallas kernel family (picks the tune grid)


# Tile sizes --tune tries, per (op, mode): field -> candidates, or a tuple of
# fields -> candidate tuples (tried jointly: one kernel's two tile edges).
# Whole backward configurations with narrow streamed tiles and 3-4 pipeline
# stages all lost on the H200 (BENCHMARKS.md, run 4), so they are not here.
TUNE_GRIDS = {
    ("flash_attention", "fwd"): {
        ("block_q", "block_k"): ((128, 32), (128, 64), (128, 128), (64, 64),
                                 (64, 128)),
        "num_stages_fwd": (2, 3, 4)},
    ("flash_attention", "fwd+bwd"): {
        ("block_q_dq", "block_k_dq"): ((64, 64), (128, 32), (128, 64),
                                       (128, 128), (64, 128)),
        ("block_q_dkv", "block_k_dkv"): ((32, 128), (64, 64), (64, 128),
                                         (128, 32), (128, 64), (128, 128)),
        "num_warps_bwd": (4, 8), "num_stages_bwd": (1, 2, 3)},
    ("token_logprobs", "fwd"): dict(
        block_n=(64, 128), block_v=(128, 256), block_d=(32, 64, 128),
        num_warps=(4, 8), num_stages=(2, 3, 4)),
    ("token_logprobs", "fwd+bwd"): dict(chunk_v=(8192, 16384),
                                        pallas_bwd=(True, False)),
    ("decode_attention", "fwd"): dict(
        block_k=(64, 128, 256), num_splits=(None, 4, 8, 16, 32),
        num_warps=(4, 8), num_stages=(2, 3)),
}
# The same for the Mosaic (TPU) kernels.
TPU_TUNE_GRIDS = {
    ("flash_attention", "fwd"): dict(block_q=(256, 512, 1024),
                                     block_k=(256, 512, 1024)),
    ("flash_attention", "fwd+bwd"): dict(
        block_q_dq=(128, 256, 512), block_k_dq=(256, 512, 1024),
        block_q_dkv=(128, 256, 512), block_k_dkv=(256, 512, 1024)),
    ("token_logprobs", "fwd"): dict(block_n=(128, 256, 512),
                                    block_v=(256, 512, 1024)),
    ("token_logprobs", "fwd+bwd"): dict(block_n=(128, 256, 512),
                                        block_v=(256, 512, 1024)),
    ("decode_attention", "fwd"): dict(block_k=(256, 512, 1024, 2048)),
}
# Each op's tile sizes, by Pallas kernel family.
_BLOCKS = {
    "triton": {"flash_attention": kernels.AttentionBlockSizes,
               "token_logprobs": kernels.LogprobBlockSizes,
               "decode_attention": kernels.DecodeBlockSizes},
    "mosaic_tpu": {"flash_attention": kernels.TpuAttentionBlockSizes,
                   "token_logprobs": kernels.TpuLogprobBlockSizes,
                   "decode_attention": kernels.TpuDecodeBlockSizes},
}


def _peaks():
  kind = jax.devices()[0].device_kind
  for key, peak in _PEAKS.items():
    if key in kind:
      return peak
  return None, None


def _available(op: str) -> tuple[str, ...]:
  impls = {"flash_attention": ("xla", "pallas", "cudnn"),
           "token_logprobs": ("xla", "xla_chunked", "pallas"),
           "decode_attention": ("xla", "pallas")}[op]
  if jax.default_backend() not in ("gpu", "cuda", "rocm"):
    impls = tuple(i for i in impls if i != "cudnn")
  return impls


def _fwd_and_bwd_cases(op, shape, dtype, args, backend, fwd, loss, argnums,
                       *, flops, bwd_flops) -> list[Case]:
  """The ``fwd`` and ``fwd+bwd`` cases of an op.

  ``fwd(impl, blocks)`` builds the call; the backward case is the gradient of
  ``loss(outputs)`` with respect to ``args[argnums]``.
  """
  def grad(impl, blocks=None):
    f = fwd(impl, blocks)
    return jax.grad(lambda *a: loss(f(*a)), argnums=argnums)

  impls = _available(op)

  def case(mode, make, n):
    return Case(op, mode, shape, jnp.dtype(dtype).name,
                {i: make(i) for i in impls}, args, flops=n,
                pallas_with=functools.partial(make, "pallas"),
                blocks=_BLOCKS[backend][op], backend=backend)
  return [case("fwd", fwd, flops), case("fwd+bwd", grad, bwd_flops)]


def _attention_cases(backend, B, T, H, K, D, window, dtype):
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (B, T, H, D), dtype)
  k = jax.random.normal(keys[1], (B, T, K, D), dtype)
  v = jax.random.normal(keys[2], (B, T, K, D), dtype)
  visible = T * (T + 1) / 2 if window is None else sum(
      min(t + 1, window) for t in range(T))
  fwd_flops = 4.0 * B * H * D * visible
  shape = f"B{B} T{T} H{H} K{K} D{D}" + (f" w{window}" if window else "")

  def attend(impl, blocks=None):
    return functools.partial(kernels.flash_attention, causal=True,
                             sliding_window=window, impl=impl,
                             block_sizes=blocks, backend=backend)

  fwd, fwd_bwd = _fwd_and_bwd_cases(
      "flash_attention", shape, dtype, (q, k, v), backend, attend,
      lambda out: jnp.sum(out.astype(jnp.float32)), (0, 1, 2),
      flops=fwd_flops, bwd_flops=3.5 * fwd_flops)
  if backend == "triton" and jax.default_backend() == "gpu":
    # The Hopper kernels beside the Triton ones: the Mosaic GPU forward, and
    # fwd+bwd with the Mosaic GPU backward after the Triton forward
    # (pallas_mgpu_bwd) or after its own (pallas_mgpu), and with fused dQ.
    mgpu = kernels.AttentionBlockSizes(fwd="mosaic_gpu", bwd="mosaic_gpu")
    fwd.fns["pallas_mgpu"] = fwd.pallas_with(mgpu)
    fwd_bwd.fns["pallas_mgpu_bwd"] = fwd_bwd.pallas_with(
        kernels.AttentionBlockSizes(bwd="mosaic_gpu"))
    fwd_bwd.fns["pallas_mgpu"] = fwd_bwd.pallas_with(mgpu)
    fwd_bwd.fns["pallas_mgpu_fused_dq"] = fwd_bwd.pallas_with(
        dataclasses.replace(mgpu, fused_dq_mgpu=True))
  return [fwd, fwd_bwd]


def _logprob_cases(backend, N, D, V, dtype):
  keys = jax.random.split(jax.random.key(1), 3)
  h = jax.random.normal(keys[0], (N, D), dtype)
  w = (jax.random.normal(keys[1], (D, V), jnp.float32) * D ** -0.5).astype(
      dtype)
  targets = jax.random.randint(keys[2], (N,), 0, V)

  def fwd(impl, blocks=None):
    return functools.partial(kernels.token_logprobs, impl=impl,
                             block_sizes=blocks, backend=backend)

  matmul = 2.0 * N * D * V
  return _fwd_and_bwd_cases(
      "token_logprobs", f"N{N} D{D} V{V}", dtype, (h, w, targets), backend,
      fwd,
      lambda out: jnp.sum(out[0]) + 0.01 * jnp.sum(out[1]), (0, 1),
      flops=matmul, bwd_flops=3 * matmul)


def _decode_cases(backend, B, S, H, K, D, dtype):
  keys = jax.random.split(jax.random.key(2), 4)
  q = jax.random.normal(keys[0], (B, H, D), dtype)
  # The model's head-major KV cache layout.
  k = jax.random.normal(keys[1], (B, K, S, D), dtype)
  v = jax.random.normal(keys[2], (B, K, S, D), dtype)
  lengths = jax.random.randint(keys[3], (B,), S // 2, S + 1)

  def decode(impl, blocks=None):
    return functools.partial(kernels.decode_attention, impl=impl,
                             kv_layout="BKSD", block_sizes=blocks,
                             backend=backend)

  read = 2.0 * float(jnp.sum(lengths)) * K * D * jnp.dtype(dtype).itemsize
  return [Case("decode_attention", "fwd", f"B{B} S{S} H{H} K{K} D{D}",
               jnp.dtype(dtype).name,
               {i: decode(i) for i in _available("decode_attention")},
               (q, k, v, lengths), bytes=read,
               pallas_with=functools.partial(decode, "pallas"),
               blocks=_BLOCKS[backend]["decode_attention"], backend=backend)]


# The full run's shapes (sized for ~5 min on one H200), and --quick's.
OPS = ("flash_attention", "token_logprobs", "decode_attention")
ATTENTION_SHAPES = ((4, 4096, 16, 16, 128, None), (4, 4096, 32, 8, 128, None),
                    (4, 4096, 16, 16, 128, 1024))  # (B, T, H, K, D, window)
LOGPROB_SHAPES = ((8192, 2048, 131072), (4096, 2048, 32768))  # (N, D, V)
DECODE_SHAPES = ((64, 8192, 32, 8, 128), (8, 32768, 32, 8, 128))
_QUICK_SHAPES = {"flash_attention": ((1, 128, 2, 1, 32, None),),
                 "token_logprobs": ((256, 32, 16384),),
                 "decode_attention": ((2, 200, 4, 2, 32),)}


def cases(quick: bool, ops: set[str], backend: str | None = None
          ) -> list[Case]:
  """The benchmark configuration (:data:`ATTENTION_SHAPES` etc.; fp32 tiny
  shapes with ``quick``). ``backend``: the Pallas kernel family (None: the
  platform's)."""
  backend = kernels.pallas_backend("bench", backend)[0]
  dtype = jnp.float32 if quick else jnp.bfloat16
  full = {"flash_attention": ATTENTION_SHAPES,
          "token_logprobs": LOGPROB_SHAPES, "decode_attention": DECODE_SHAPES}
  make = {"flash_attention": _attention_cases,
          "token_logprobs": _logprob_cases, "decode_attention": _decode_cases}
  out = []
  for op in OPS:
    if op in ops:
      for shape in (_QUICK_SHAPES if quick else full)[op]:
        out += make[op](backend, *shape, dtype)
  return out


def _memory(compiled) -> dict:
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  fields = ("temp_size_in_bytes", "peak_memory_in_bytes",
            "argument_size_in_bytes", "output_size_in_bytes")
  return {f: int(getattr(stats, f)) for f in fields if hasattr(stats, f)}


def error_text(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def measure(fn: Callable, args: tuple, repeats: int, warmup: int) -> dict:
  """Compiles ``fn`` once; ``compile_s``, memory stats and the median ``ms``."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  out = dict(compile_s=time.perf_counter() - t0, **_memory(compiled))
  out["ms"] = _median_ms(compiled, args, repeats, warmup)
  return out


def _median_ms(compiled, args: tuple, repeats: int, warmup: int) -> float:
  """``warmup`` calls, then the median of ``repeats`` timed calls, in ms."""
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def run_case(case: Case, repeats: int, warmup: int) -> list[dict]:
  """Times each implementation of ``case``; one result dict per impl."""
  peak_flops, peak_bw = _peaks()
  rows = []
  for impl, fn in case.fns.items():
    row = dict(op=case.op, mode=case.mode, shape=case.shape,
               dtype=case.dtype, impl=impl)
    try:
      row.update(measure(fn, case.args, repeats, warmup))
      seconds = row["ms"] / 1e3
      if case.flops:
        row["tflops"] = case.flops / seconds / 1e12
        if peak_flops and case.dtype == "bfloat16":
          row["pct_peak"] = 100 * case.flops / seconds / peak_flops
      if case.bytes:
        row["gbps"] = case.bytes / seconds / 1e9
        if peak_bw:
          row["pct_peak"] = 100 * case.bytes / seconds / peak_bw
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = error_text(e)
    rows.append(row)
  base = next((r for r in rows if r["impl"] == "xla" and "ms" in r), None)
  for r in rows:
    if base and "ms" in r:
      r["speedup_vs_xla"] = base["ms"] / r["ms"]
      if r.get("temp_size_in_bytes") and base.get("temp_size_in_bytes"):
        r["temp_vs_xla"] = r["temp_size_in_bytes"] / base["temp_size_in_bytes"]
  return rows


def tune(case: Case, repeats: int, warmup: int, *, deadline: float,
         start=None, grid: dict | None = None) -> dict:
  """Coordinate search over ``case``'s Pallas tile sizes (see module doc).

  ``start``: tile sizes to begin from when they beat the defaults;
  ``grid``: field (or tuple of fields) -> candidates (default:
  ``TUNE_GRIDS``). Stops trying new tiles once ``time.perf_counter()``
  passes ``deadline``. Returns the best tiles, their ``ms`` and the
  defaults' ``default_ms``, and every trial (a failing one, such as a tile
  needing more shared memory than the device has, records its error and
  scores infinity).
  """
  if grid is None:
    grids = TPU_TUNE_GRIDS if case.backend == "mosaic_tpu" else TUNE_GRIDS
    grid = grids[(case.op, case.mode)]
  scores, trials = {}, []

  def score(blocks) -> float:
    key = dataclasses.astuple(blocks)
    if key not in scores:
      trial = dict(blocks=dataclasses.asdict(blocks))
      try:
        trial.update(measure(case.pallas_with(blocks), case.args, repeats,
                             warmup))
      except Exception as e:  # pylint: disable=broad-except
        trial["error"] = error_text(e)
      trials.append(trial)
      scores[key] = trial.get("ms", float("inf"))
    return scores[key]

  best = case.blocks()
  best_ms = default_ms = score(best)
  if start is not None and score(start) < best_ms:
    best, best_ms = start, score(start)
  for field, values in grid.items():
    fields = field if isinstance(field, tuple) else (field,)
    for value in values:
      if time.perf_counter() > deadline:
        break
      value = value if isinstance(field, tuple) else (value,)
      candidate = dataclasses.replace(best, **dict(zip(fields, value)))
      ms = score(candidate)
      if ms < best_ms:
        best, best_ms = candidate, ms
  return dict(op=case.op, mode=case.mode, shape=case.shape, dtype=case.dtype,
              default_ms=default_ms, best_ms=best_ms,
              speedup_vs_default=default_ms / best_ms,
              best_blocks=dataclasses.asdict(best), trials=trials)


def ab(case: Case, field: str, values: tuple, repeats: int, warmup: int,
       rounds: int, base: dict | None = None) -> dict:
  """Times the Pallas kernel at the default tiles (with the fields of
  ``base`` changed) with ``field`` set to each of ``values``, interleaved
  over ``rounds`` rounds (A B A B ...), so that a drift of the machine hits
  every value alike. Each value is compiled once; a round records each
  value's median of ``repeats`` calls. Returns the per-round ``ms`` lists
  and each value's median over the rounds."""
  base = dict(base or {})
  names = [f.name for f in dataclasses.fields(case.blocks)]
  for name in (field, *base):
    if name not in names:
      raise ValueError(f"--ab: {case.blocks.__name__} has no field {name!r}; "
                       f"it has {names}")
  compiled, runs = {}, {}
  for value in values:
    blocks = dataclasses.replace(case.blocks(**base), **{field: value})
    try:
      compiled[value] = jax.jit(case.pallas_with(blocks)).lower(
          *case.args).compile()
    except Exception as e:  # pylint: disable=broad-except
      runs[value] = dict(error=error_text(e))
  for _ in range(rounds):
    for value, fn in compiled.items():
      runs.setdefault(value, dict(ms=[]))["ms"].append(
          _median_ms(fn, case.args, repeats, warmup))
  for run in runs.values():
    if "ms" in run:
      run["median_ms"] = statistics.median(run["ms"])
  return dict(op=case.op, mode=case.mode, shape=case.shape, dtype=case.dtype,
              field=field, base=base,
              runs=[dict(value=v, **r) for v, r in runs.items()])


def parse_ab(text: str) -> tuple[str, tuple]:
  """``"field=v1,v2"`` -> ``("field", (v1, v2))`` (values as JSON)."""
  field, sep, values = text.partition("=")
  if not sep or not field or not values:
    raise ValueError(f"--ab wants FIELD=V1,V2,..., got {text!r}")
  return field, tuple(json.loads(v) for v in values.split(","))


def format_table(rows: list[dict]) -> str:
  header = ["op", "mode", "shape", "dtype", "impl", "ms", "TFLOP/s|GB/s",
            "%peak", "temp MiB", "x vs xla", "temp/xla"]
  lines = [header]
  for r in rows:
    if "error" in r:
      lines.append([r["op"], r["mode"], r["shape"], r["dtype"], r["impl"],
                    "ERROR " + r["error"][:60], "", "", "", "", ""])
      continue
    rate = r.get("tflops", r.get("gbps"))
    temp = r.get("temp_size_in_bytes")
    lines.append([
        r["op"], r["mode"], r["shape"], r["dtype"], r["impl"],
        f"{r['ms']:.3f}", "" if rate is None else f"{rate:.3g}",
        f"{r['pct_peak']:.0f}" if "pct_peak" in r else "",
        "" if temp is None else f"{temp / 2**20:.1f}",
        f"{r['speedup_vs_xla']:.2f}" if "speedup_vs_xla" in r else "",
        f"{r['temp_vs_xla']:.3f}" if "temp_vs_xla" in r else ""])
  widths = [max(len(str(line[i])) for line in lines)
            for i in range(len(header))]
  text = [" | ".join(str(c).ljust(w) for c, w in zip(line, widths))
          for line in lines]
  text.insert(1, "-|-".join("-" * w for w in widths))
  return "\n".join(text)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--quick", action="store_true",
                      help="tiny shapes (CPU: Pallas interpreted)")
  parser.add_argument("--ops", default=",".join(OPS),
                      help="comma-separated ops")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--tune", action="store_true",
                      help="search the Pallas tile sizes instead")
  parser.add_argument("--ab", default=None, metavar="FIELD=V1,V2",
                      help="time the Pallas kernels with one tile field set "
                      "to each value, interleaved over --rounds rounds")
  parser.add_argument("--ab_base", default=None, metavar="JSON",
                      help="--ab: other tile fields to hold at these values, "
                      "e.g. '{\"bwd\": \"mosaic_gpu\"}'")
  parser.add_argument("--rounds", type=int, default=5, help="--ab rounds")
  parser.add_argument("--max_seconds", type=float, default=None,
                      help="--tune: stop trying new tiles after this long")
  parser.add_argument("--backend", choices=kernels.PALLAS_BACKENDS,
                      default=None, help="Pallas kernels (default: the "
                      "platform's; CPU runs either interpreted)")
  args = parser.parse_args(argv)
  ops = set(args.ops.split(","))
  unknown = ops - set(OPS)
  if unknown:
    parser.error(f"unknown ops {sorted(unknown)}")
  repeats = args.repeats or (3 if args.quick else 10 if args.tune else 20)
  warmup = 1 if args.quick else 3
  device = jax.devices()[0]
  backend = kernels.pallas_backend("bench", args.backend)[0]
  report = dict(pallas_backend=backend,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      backend=jax.default_backend(), device_kind=device.device_kind,
      num_cpus=os.cpu_count(), machine=platform.machine(),
      jax_version=jax.__version__, quick=args.quick, repeats=repeats,
      peak_bf16_flops=_peaks()[0], peak_hbm_bytes_per_s=_peaks()[1],
      rows=[])

  def save():
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1, default=float)

  if args.ab:
    field, values = parse_ab(args.ab)
    report["ab"] = []
    for case in cases(args.quick, ops, backend):
      if case.pallas_with is None:
        continue
      result = ab(case, field, values, repeats, warmup, args.rounds,
                  json.loads(args.ab_base) if args.ab_base else None)
      report["ab"].append(result)
      print(f"{case.op} {case.mode} [{case.shape}] {field}: " + ", ".join(
          f"{r['value']}: {r.get('median_ms', r.get('error'))}"
          for r in result["runs"]), flush=True)
      save()
    return report
  if args.tune:
    return _tune_all(report, cases(args.quick, ops, backend), repeats, warmup,
                     args.max_seconds, save)
  for case in cases(args.quick, ops, backend):
    for row in run_case(case, repeats, warmup):
      report["rows"].append(row)
      result = row.get("error") or f"{row['ms']:.3f} ms"
      print(f"{row['op']} {row['mode']} [{row['shape']}] {row['impl']}: "
            f"{result}", flush=True)
    save()
  print(format_table(report["rows"]))
  return report


def _tune_all(report, all_cases, repeats, warmup, max_seconds, save) -> dict:
  deadline = time.perf_counter() + (
      float("inf") if max_seconds is None else max_seconds)
  report["tuning"] = []
  best_fwd = {}  # (op, shape) -> the forward's best tiles
  for case in all_cases:
    if case.pallas_with is None or "pallas" not in case.fns:
      continue
    result = tune(case, repeats, warmup, deadline=deadline,
                  start=best_fwd.get((case.op, case.shape)))
    if case.mode == "fwd":
      best_fwd[(case.op, case.shape)] = case.blocks(**result["best_blocks"])
    report["tuning"].append(result)
    print(f"{case.op} {case.mode} [{case.shape}]: default "
          f"{result['default_ms']:.3f} ms, best {result['best_ms']:.3f} ms "
          f"with {result['best_blocks']} ({len(result['trials'])} tried)",
          flush=True)
    save()
  return report


if __name__ == "__main__":
  main()
