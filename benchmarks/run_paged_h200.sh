#!/usr/bin/env bash
# Paged kernel on an H200: GPU tests of the paged (Triton and TMA), key-range, cache, combine and dense kernels, then
# `bench prefill-chunked`, `bench decode` (both time the sequence-major V layout as a peer) and
# `bench mixed`. ~8 min for all steps.
# Usage (repo root): OUT=<dir> [STEPS="tests decode mixed"] bash benchmarks/run_paged_h200.sh
set -uo pipefail
OUT=${OUT:-out}
STEPS=${STEPS:-tests prefill decode mixed}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
has() { [[ " $STEPS " == *" $1 "* ]]; }
if has tests; then
  xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
  FP8ATTN_NO_AUTOTUNE=1 timeout -s KILL 280 python3 -m pytest -q -p no:cacheprovider $xdist -m "gpu or not gpu" \
    tests/test_kernel_paged.py tests/test_kernel_paged_tma.py tests/test_kernel_common.py tests/test_kernel_cache.py \
    tests/test_kernel_combine.py \
    tests/test_kernel_dense.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
fi
for step in prefill decode mixed; do
  has $step || continue
  fn=$([ $step = prefill ] && echo run_prefill_chunked || echo run_$step)
  timeout -s KILL 190 python3 -c "from fp8attn.bench.paged import $fn; $fn('$OUT')" 2>&1 \
    | tee "$OUT/$step.log" | grep -v Warn | tail -30
done
