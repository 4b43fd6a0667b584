#!/usr/bin/env bash
# Paged kernel on an H200: GPU tests of the paged, dense, key-range and cache kernels, then
# `bench prefill-chunked` and `bench decode` (both time the sequence-major V layout as a peer). ~9 min.
# Usage (repo root): OUT=<dir> bash benchmarks/run_paged_h200.sh
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
FP8ATTN_NO_AUTOTUNE=1 timeout -s KILL 280 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
  tests/test_kernel_paged.py tests/test_kernel_common.py tests/test_kernel_cache.py tests/test_kernel_dense.py \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -3
timeout -s KILL 100 python3 -c "from fp8attn.bench.paged import run_prefill_chunked; run_prefill_chunked('$OUT')" 2>&1 \
  | tee "$OUT/prefill_chunked.log" | grep -v Warn | tail -6
timeout -s KILL 190 python3 -c "from fp8attn.bench.paged import run_decode; run_decode('$OUT')" 2>&1 \
  | tee "$OUT/decode.log" | grep -v Warn | tail -30
