#!/usr/bin/env bash
# Engine decode throughput on one H200: bf16 vs FP8 paged KV cache, RANDOM-weight Llama-3-8B shape,
# batch 64 at 4k context (+ FP8 at batch 128 in the same KV bytes), after GPU correctness checks.
# Usage (repo root, GPU machine): bash benchmarks/run_engine_h200.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-${OUT:-benchmarks/results/h200}}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
python -m fp8attn.engine.bench --check --batch 64 --context 4096 --steps 20 \
    --cases bf16,fp8,fp8_seq_head,fp8_2x --out "$OUT" 2>&1 | tee "$OUT/engine.log"
