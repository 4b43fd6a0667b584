#!/usr/bin/env bash
# Dense forward on the H200: GPU tests, `bench dense`, `bench accuracy` in one call.
# Usage (repo root): bash benchmarks/run_dense_h200.sh [tests] [bench|bench-quick] [accuracy]
# Results go to $OUT (default ./out): gpu_tests.log, dense_fwd.json/.png, accuracy.json.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # cudnn-frontend for the cuDNN FP8 peer (no package index there)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
    && export PYTHONPATH="$PWD/.site"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bench accuracy)
for step in "${steps[@]}"; do
  case "$step" in
    tests)
      FP8ATTN_NO_AUTOTUNE=1 timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu \
        ${TESTS_K:+-k "$TESTS_K"} tests/test_kernel_dense.py tests/test_kernel_dense_tma.py tests/test_quantize_qkv.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    bench) python3 -c "from fp8attn.bench import dense; dense.run('$OUT')" 2>&1 | tee "$OUT/bench_dense.log" | tail -45 ;;
    bench-quick) python3 -c "from fp8attn.bench import dense; dense.run('$OUT', quick=True)" 2>&1 | tee "$OUT/bench_dense.log" | tail -12 ;;
    accuracy) python3 -c "from fp8attn.bench import accuracy; accuracy.run('$OUT')" 2>&1 | tee "$OUT/accuracy.log" | tail -25 ;;
  esac
done
