#!/usr/bin/env bash
# Paged-KV kernels on an H200: GPU tests, then the decode / prefill_chunked / mixed routines.
# Usage: OUT=<results dir> bash benchmarks/run_paged_h200.sh [tests|bench|all]
set -o pipefail
OUT=${OUT:-benchmarks/results/h200}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
what=${1:-all}
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_paged.py tests/test_kernel_combine.py \
    tests/test_kernel_cache.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ $what == bench || $what == all ]]; then
  python3 - <<'PY' 2>&1 | tee "$OUT/bench.log"
import json, os
from fp8attn.bench.paged import run_decode, run_prefill_chunked, run_mixed
out = os.environ["OUT"]
import torch
dec = [{"q_fp8": True}, {"block_n": 64, "num_stages": 2}, {"block_n": 64, "num_stages": 2, "compute_dtype": torch.bfloat16}]
run_decode(out_dir=out, configs=dec)
run_prefill_chunked(out_dir=out)
run_mixed(out_dir=out)
print("\n== summary ==")
for r in ("decode", "prefill_chunked", "mixed"):
    d = json.load(open(f"{out}/{r}.json"))
    for c in d["cases"]:
        o = c["ours"]
        peers = " ".join(f"{k}={v['ms']:.4f}" for k, v in c["peers"].items() if v and v.get("ms"))
        extra = f" sweep={c['config_sweep_ms']}" if "config_sweep_ms" in c else ""
        print(f"{r:8s} {c['case']:58s} {o['ms']:.4f} ms gbps={o['gbps'] and round(o['gbps'])} "
              f"tf={o['tflops'] and round(o['tflops'])} err={o['err'] and round(o['err'], 4)} | {peers}{extra}")
PY
fi
