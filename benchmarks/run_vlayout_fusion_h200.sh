#!/usr/bin/env bash
# Sequence-major V pages and fused FP8 output on an H200: GPU tests of the paged kernel, the cache
# writer and the TMA dense path, then `bench prefill-chunked` (peer paged_v_seq_major) and
# `bench output-quant` (fused vs unfused, CUDA-graph replays), quick decode with the seq-major V peer. ~6 min.
# Usage (repo root): OUT=<dir> bash benchmarks/run_vlayout_fusion_h200.sh
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
FP8ATTN_NO_AUTOTUNE=1 timeout -s KILL 240 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
  tests/test_kernel_paged.py tests/test_kernel_cache.py tests/test_kernel_dense_tma.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
timeout -s KILL 240 python3 -c "from fp8attn.bench.paged import run_prefill_chunked; run_prefill_chunked('$OUT')" 2>&1 \
  | tee "$OUT/prefill_chunked.log" | grep -v Warn | tail -6
timeout -s KILL 180 python3 -c "from fp8attn.bench import output_quant; output_quant.run('$OUT')" 2>&1 \
  | tee "$OUT/output_quant.log" | grep -v Warn | tail -8
mkdir -p "$OUT/decode_quick"
timeout -s KILL 200 python3 -c "from fp8attn.bench.paged import run_decode; run_decode('$OUT/decode_quick', quick=True)" 2>&1 \
  | tee "$OUT/decode_quick.log" | grep -v Warn | tail -9
