#!/usr/bin/env bash
# The GPU check for the Pallas kernels, sized to finish in under 10 minutes
# on one H200:
#
#   bash experiments/gpu_session.sh
#
# No install and no network: the image's jax, chex, hypothesis and pytest are
# enough for the kernels, which are copied into an importable package tree.
# Steps, each under its own time limit (seconds, overridable; 0 skips the
# step, and TUNE_S skips under 31; TEST_FILES, BENCH_OPS and TUNE_OPS narrow
# steps 1-3):
#   1. TESTS_S:  the kernel tests (and the model's pallas decode) with the
#                compiled Triton kernels against the XLA references, IEEE
#                fp32 on both sides (the kernels follow
#                jax_default_matmul_precision; Triton's default is TF32);
#   2. BENCH_S:  python -m experiments.bench_kernels (every impl side by side);
#   3. TUNE_S:   python -m experiments.bench_kernels --tune (tile search over
#                the attention and log-prob kernels);
#   4. AB:       (empty by default) space-separated FIELD=V1,V2 specs, each
#                run as python -m experiments.bench_kernels --ab SPEC over
#                AB_OPS, under AB_S seconds each (writes ab_FIELD.json);
#                AB_BASE (a JSON object, e.g. '{"bwd": "mosaic_gpu"}') holds
#                other tile fields fixed (--ab_base).
# Writes env.txt, tests.log, bench.log, bench_h200.json, tune.log,
# tune_h200.json (and ab.log, ab_*.json) under $OUT
# (default runs/gpu). The JSON files are rewritten after every case, so a step
# cut short still returns what it measured.
set -uo pipefail
OUT=${OUT:-runs/gpu}
TESTS_S=${TESTS_S:-150}  # 65 tests took about 100 s on the H200
BENCH_S=${BENCH_S:-130}
TUNE_S=${TUNE_S:-270}  # 0: no tile search
TEST_FILES=${TEST_FILES:-"tests/test_kernels_attention.py \
tests/test_kernels_decode.py tests/test_kernels_logprobs.py \
tests/test_kernels_properties.py tests/test_kernels_bench.py \
tests/test_model.py::test_pallas_decode_reads_the_head_major_cache"}
BENCH_OPS=${BENCH_OPS:-flash_attention,token_logprobs,decode_attention}
TUNE_OPS=${TUNE_OPS:-flash_attention,token_logprobs}
AB=${AB:-}
AB_OPS=${AB_OPS:-flash_attention}
AB_S=${AB_S:-120}
AB_BASE=${AB_BASE:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

# Everything runs inside a copy of the package, the tests and the
# benchmark (experiments/bench_kernels.py).
OUT=$(realpath "$OUT")
pkg=$(mktemp -d)
cp -r agentic_rl experiments tests pytest.ini "$pkg/"
cd "$pkg" || exit 1

{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm \
    --format=csv,noheader
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, \
jaxlib.__version__, jax.devices())"; } 2>&1 | tee "$OUT/env.txt"

if [ "$TESTS_S" -gt 0 ]; then
  echo "== 1. kernel tests (compiled Triton, fp32 at highest precision)"
  # shellcheck disable=SC2086  # TEST_FILES is a list
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$TESTS_S" python3 -m pytest \
    -q -p no:cacheprovider -n 4 -k "not tpu and not mosaic" $TEST_FILES \
    2>&1 | tee "$OUT/tests.log" | tail -25
fi

if [ "$BENCH_S" -gt 0 ]; then
  echo "== 2. benchmark"
  timeout "$BENCH_S" python3 -m experiments.bench_kernels --ops "$BENCH_OPS" \
    --out "$OUT/bench_h200.json" 2>&1 | tee "$OUT/bench.log" | tail -45
fi

if [ "$TUNE_S" -gt 30 ]; then
  echo "== 3. tile search"
  timeout "$TUNE_S" python3 -m experiments.bench_kernels --tune \
    --ops "$TUNE_OPS" --max_seconds $((TUNE_S - 30)) \
    --out "$OUT/tune_h200.json" 2>&1 | tee "$OUT/tune.log" | tail -12
fi

for spec in $AB; do
  echo "== 4. A/B $spec"
  timeout "$AB_S" python3 -m experiments.bench_kernels --ops "$AB_OPS" \
    --ab "$spec" ${AB_BASE:+--ab_base "$AB_BASE"} \
    --out "$OUT/ab_${spec%%=*}.json" 2>&1 | tee -a "$OUT/ab.log"
done
