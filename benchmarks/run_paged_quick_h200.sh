#!/usr/bin/env bash
# Paged kernel, quick check on an H200: GPU tests of the paged kernel, then a short timing table
# (decode B64/L4096 page 64 with bf16 and FP8 Q, decode B1/L128k page 64, chunked prefill of a 2k
# chunk over an 8k prefix page 64) with a few tile configs, next to the committed results in
# benchmarks/results/h200/{decode,prefill_chunked}.json. Timing part: < 90 s including compiles.
# Usage (repo root): OUT=<dir> bash benchmarks/run_paged_quick_h200.sh [tests] [bench]
# Writes $OUT/gpu_tests_paged.log, $OUT/paged_quick.json, $OUT/paged_quick.log.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bench)
for step in "${steps[@]}"; do
  case "$step" in
    tests)
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernel_paged.py -x \
        2>&1 | tee "$OUT/gpu_tests_paged.log" | tail -8 ;;
    bench)
      timeout ${BENCH_TIMEOUT:-150} python3 - <<'PY' 2>&1 | tee "$OUT/paged_quick.log"
import json, math, os, time
import torch
from fp8attn.bench.common import attn_flops, results_header, time_ms, write_results
from fp8attn.bench.paged import HK, HQ, D, E4M3, _graphed, _paged_pool
from fp8attn.kernels.paged import choose_num_splits, launch_paged_fwd, paged_config, split_workspace

t0 = time.time()
BUDGET_S = float(os.environ.get("QUICK_BUDGET_S", 80))  # sweep entries past this are skipped
out_dir = os.environ["OUT"]
doc = results_header("paged_quick")
scale = D ** -0.5
rows = []


def before(routine, case):
    """The committed result for the same case (ms), if any."""
    try:
        d = json.load(open(f"benchmarks/results/h200/{routine}.json"))
    except OSError:
        return None, {}
    for c in d["cases"]:
        if c["case"] == case:
            return c["ours"]["ms"], c
    return None, {}


def decode(b, L, q_dtype, configs):
    page = 64
    kc, vc, pts = _paged_pool(b, L, page, 1)
    seqlens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    dsc = torch.rand(b, HK, device="cuda") + 0.5
    kw = dict(k_descale=dsc, v_descale=dsc)
    if q_dtype == E4M3:
        q = q.to(E4M3)
        kw["q_descale"] = dsc
    splits = choose_num_splits(b, HK, L, torch.cuda.get_device_properties(0).multi_processor_count)
    op, lp = split_workspace(q, splits, D) if splits > 1 else (None, None)
    out = torch.empty(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(b, HQ, 1, device="cuda")
    kv_bytes = 2 * b * L * HK * D
    name = f"d128 B{b} L{L} page{page}"
    prev, prev_case = before("decode", name)
    if q_dtype == E4M3:  # the committed run timed FP8 Q in its config sweep
        prev = prev_case.get("config_sweep_ms", {}).get("{'q_fp8': True}")
    for cfg in configs:
        if cfg is not None and time.time() - t0 > BUDGET_S:
            print(f"skip {name} {cfg}: time budget", flush=True)
            continue
        f = lambda cfg=cfg: launch_paged_fwd(q, kc, vc, pts[0], seqlens, out, lse, max_seqlen_q=1,
                                             softmax_scale=scale, causal=True, num_splits=splits,
                                             out_partial=op, lse_partial=lp, config=cfg, **kw)
        f()
        torch.cuda.synchronize()
        call, graphed = _graphed([f])
        ms = time_ms(call)
        tile = paged_config(1, HQ // HK, D, q_dtype == E4M3, cfg, page)
        label = f"decode {name} q={'e4m3' if q_dtype == E4M3 else 'bf16'} splits={splits}"
        rows.append((label, str(tile), ms, kv_bytes / ms / 1e6, None, prev))
        doc["cases"].append({"case": label, "params": {"batch": b, "seqlen_k": L, "page_size": page, "num_splits": splits,
                                                       "q_dtype": str(q_dtype), "config": cfg, "tile": tile},
                             "ours": {"ms": ms, "tflops": None, "gbps": kv_bytes / ms / 1e6, "cuda_graph": graphed},
                             "before_ms": prev, "peers": {}})
    del kc, vc, pts
    torch.cuda.empty_cache()


def prefill(q_dtype, configs, chunk=2048, prefix=8192):
    page = 64
    L = prefix + chunk
    kc, vc, pts = _paged_pool(1, L, page, 1)
    q = torch.randn(1, chunk, HQ, D, device="cuda")
    q = q.to(E4M3) if q_dtype == E4M3 else q.to(torch.bfloat16)
    seqlens = torch.full((1,), L, dtype=torch.int32, device="cuda")
    dsc = torch.rand(1, HK, device="cuda") + 0.5
    kw = dict(k_descale=dsc, v_descale=dsc)
    if q_dtype == E4M3:
        kw["q_descale"] = dsc
    out = torch.empty(1, chunk, HQ, D, device="cuda", dtype=torch.bfloat16)
    flops = attn_flops(1, HQ, chunk, L, D, visible_pairs=chunk * prefix + chunk * (chunk + 1) / 2)
    name = f"d128 B1 chunk{chunk} prefix{prefix} page{page}"
    prev, prev_case = before("prefill_chunked", name)
    if q_dtype != E4M3:
        prev = (prev_case.get("peers", {}).get("paged_bf16q") or {}).get("ms")
    dense_ms = (prev_case.get("peers", {}).get("dense_fp8") or {}).get("ms")
    ref = None
    for cfg in configs:
        if cfg is not None and time.time() - t0 > BUDGET_S:
            print(f"skip {name} {cfg}: time budget", flush=True)
            continue
        f = lambda cfg=cfg: launch_paged_fwd(q, kc, vc, pts[0], seqlens, out, None, max_seqlen_q=chunk,
                                             softmax_scale=scale, causal=True, config=cfg, **kw)
        f()
        torch.cuda.synchronize()
        if ref is None:
            ref = out.float().clone()  # default config first: the others must agree with it
        diff = (out.float() - ref).abs().max().item()
        ms = time_ms(f)
        tile = paged_config(chunk, HQ // HK, D, q_dtype == E4M3, cfg, page)
        label = f"prefill {name} q={'e4m3' if q_dtype == E4M3 else 'bf16'}"
        rows.append((label, str(tile) + (" pv_fp16" if cfg and cfg.get("pv_fp16") else ""), ms, None,
                     flops / ms / 1e9, prev, dense_ms, diff))
        doc["cases"].append({"case": label, "params": {"batch": 1, "seqlen_q": chunk, "seqlen_k": L, "page_size": page,
                                                       "q_dtype": str(q_dtype), "config": cfg, "tile": tile},
                             "ours": {"ms": ms, "tflops": flops / ms / 1e9, "gbps": None,
                                      "max_abs_diff_vs_default_config": diff},
                             "before_ms": prev, "peers": {"dense_fp8_committed": {"ms": dense_ms}}})
    del kc, vc, pts
    torch.cuda.empty_cache()


# default config first in each list (None), then a few alternatives
decode(64, 4096, torch.bfloat16, [None, {"block_n": 32, "num_stages": 6}, {"block_n": 128, "num_stages": 3}])
decode(64, 4096, E4M3, [None])
decode(1, 131072, torch.bfloat16, [None, {"block_n": 32, "num_stages": 6}])
prefill(E4M3, [None, {"pv_fp16": True}, {"num_stages": 4}])
prefill(torch.bfloat16, [None])
path = write_results(doc, out_dir)
print(f"\n== paged quick ({time.time() - t0:.0f} s) -> {path}")
print(f"{'case':58s} {'tile (bm,bn,warps,stages)':28s} {'ms':>8s} {'GB/s':>6s} {'TF/s':>5s} {'before':>7s} {'x before':>8s} note")
for r in rows:
    label, tile, ms, gbps, tf, prev = r[:6]
    note = ""
    if len(r) > 6:
        dense_ms, diff = r[6], r[7]
        note = f"vs dense FP8 {dense_ms / ms:.2f}x (dense {dense_ms:.3f} ms) diff {diff:.1e}" if dense_ms else f"diff {diff:.1e}"
    print(f"{label:58s} {tile:28s} {ms:8.4f} {gbps or 0:6.0f} {tf or 0:5.0f} {prev or 0:7.4f} "
          f"{(prev / ms) if prev else 0:8.2f} {note}")
PY
      ;;
  esac
done
