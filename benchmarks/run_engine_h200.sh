#!/usr/bin/env bash
# Engine decode throughput on one H200: bf16 vs FP8 paged KV cache, RANDOM-weight Llama-3-8B shape,
# batch 64 at 4k context (+ FP8 at batch 128 in the same KV bytes; page 64 in both V layouts), after GPU
# correctness checks. The defaults side by side: --cases bf16,bf16_p64,fp8_p64_vseq,fp8_2x_p64_vseq.
# Usage (repo root, GPU machine): bash benchmarks/run_engine_h200.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-${OUT:-benchmarks/results/h200}}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
python -m fp8attn.engine.bench --check --batch 64 --context 4096 --steps 20 \
    --cases bf16,fp8,fp8_seq_head,fp8_2x,fp8_p64,fp8_p64_vseq --out "$OUT" 2>&1 | tee "$OUT/engine.log"
