#!/usr/bin/env bash
# `bench decode` (and `bench prefill-chunked`) with FlashInfer as a peer, on a GPU machine without network access.
# FlashInfer is optional: both routines add it as a peer whenever `import flashinfer` works.
#
# Prepare a wheel folder elsewhere (for the GPU machine's Python, cp312 / manylinux x86_64):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d WHEELS flashinfer-python==0.7.2.post1 "apache-tvm-ffi>=0.1.11,<0.2" cuda-tile cuda-python
# (nvidia-ml-py, einops, tabulate, ninja and cuda-bindings came with the machine's image.) Its other
# declared needs (cutlass-dsl, nccl4py, nccl-extensions, cudnn-frontend) are not imported by the
# decode and prefill paths. FlashInfer's JIT then builds its modules for sm_90a with the machine's nvcc
# on first use (~30 s each on 16 cores); FLASHINFER_WORKSPACE_BASE keeps the build for later runs.
# Usage (repo root): WHEELS=<dir> OUT=<dir> [ROUTINES="decode prefill-chunked"] bash benchmarks/run_decode_flashinfer_h200.sh
set -uo pipefail
: "${WHEELS:?set WHEELS to the wheel folder}"
OUT=${OUT:-out}
SITE=${SITE:-/tmp/fp8attn-peers}
mkdir -p "$OUT" "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-jit}
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || exit 1
for r in ${ROUTINES:-decode}; do
  python3 -m fp8attn bench "$r" --out-dir "$OUT" 2>&1 | tee "$OUT/bench_$r.log" | tail -40
done
