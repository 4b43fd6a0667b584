"""The H200's read ceiling in the decode benchmark's timing forms (the source of
``results/h200/explore/read_ceiling.json``): a streaming read of the KV bytes of B64/L4096, B16/L32k and
B1/L128k decode (32 q / 8 kv heads, d128, e4m3: 537 MB, 1074 MB, 268 MB) by a Triton kernel that sums
16-byte vectors (the best of a few grid shapes), timed like ``bench decode`` (a one-call CUDA-graph replay,
and per call of 8 calls captured in one graph), next to the decode kernel on sequence-major V pages of 64
over the same bytes in the same process. Usage (repo root, GPU machine):
``OUT=<dir> PYTHONPATH=src python benchmarks/explore_read_ceiling_h200.py``.
"""
import json
import os

import torch
import triton
import triton.language as tl

from fp8attn.bench.common import graph_replay, graph_step_ms, time_ms
from fp8attn.bench.paged import D, HK, HQ, _paged_pool
from fp8attn.kernels.paged import launch_paged_fwd
from fp8attn.kernels.planning import choose_num_splits
from fp8attn.paged import split_workspace, to_v_seq_major


@triton.jit
def _read_kernel(X, Out, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Sum of program ``pid``'s contiguous CHUNK int32 words of X (read once, BLOCK per step)."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for s in range(0, CHUNK, BLOCK):
        offs = base + s + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0, cache_modifier=".cg")
    tl.store(Out + pid, tl.sum(acc, 0))


def read_fn(x32, chunk, block, warps):
    n = x32.numel()
    grid = (triton.cdiv(n, chunk),)
    out = torch.empty(grid[0], dtype=torch.int32, device=x32.device)
    return lambda: _read_kernel[grid](x32, out, n, CHUNK=chunk, BLOCK=block, num_warps=warps)


def main():
    torch.manual_seed(0)
    rows = {}
    for batch, ctx in ((64, 4096), (16, 32768), (1, 131072)):
        kv_bytes = 2 * batch * ctx * HK * D
        kc, vc, pts = _paged_pool(batch, ctx, 64, 1)
        vs = to_v_seq_major(vc)
        # the same bytes as one flat buffer (K then V): the pool is one allocation per cache
        flat = [torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).view(torch.int32)
                for t in (kc, vs)]  # each cache's bytes (sequence-major V is a strided view of its buffer)
        best = None
        for chunk, block, warps in ((1 << 16, 2048, 4), (1 << 17, 4096, 8), (1 << 18, 4096, 8), (1 << 15, 2048, 4),
                                    (1 << 16, 4096, 8)):
            fns = [read_fn(f, chunk, block, warps) for f in flat]
            call = lambda fns=fns: (fns[0](), fns[1]())  # noqa: E731
            ms = min(time_ms(graph_replay([call])[0]) for _ in range(2))
            cfg = {"chunk_words": chunk, "block": block, "warps": warps, "one_call_us": round(ms * 1e3, 2)}
            if best is None or ms < best[0]:
                best = (ms, cfg, call)
            rows.setdefault(f"B{batch} L{ctx}", {}).setdefault("read_configs", []).append(cfg)
        ms_read, cfg, call = best
        step_read = graph_step_ms([call])
        pt = pts[0]
        sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        dd = torch.rand(batch, HK, device="cuda") + 0.5
        n = choose_num_splits(batch, HK, pt.shape[1] * 64, torch.cuda.get_device_properties(0).multi_processor_count)
        op, lp = split_workspace(q, n, D) if n > 1 else (None, None)
        out = torch.empty(batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(batch, HQ, 1, device="cuda")

        def dec():
            launch_paged_fwd(q, kc, vs, pt, sl, out, lse, max_seqlen_q=1, softmax_scale=D ** -0.5, causal=True,
                             k_descale=dd, v_descale=dd, num_splits=n, out_partial=op, lse_partial=lp)
        ms_dec = min(time_ms(graph_replay([dec])[0]) for _ in range(2))
        step_dec = graph_step_ms([dec])
        r = rows[f"B{batch} L{ctx}"]
        r.update({"kv_bytes": kv_bytes, "best_read": cfg,
                  "read_one_call_us": round(ms_read * 1e3, 2), "read_step_us": round(step_read * 1e3, 2),
                  "read_one_call_tbps": round(kv_bytes / ms_read / 1e9, 3),
                  "read_step_tbps": round(kv_bytes / step_read / 1e9, 3),
                  "decode_one_call_us": round(ms_dec * 1e3, 2), "decode_step_us": round(step_dec * 1e3, 2),
                  "decode_one_call_tbps": round(kv_bytes / ms_dec / 1e9, 3),
                  "decode_step_tbps": round(kv_bytes / step_dec / 1e9, 3),
                  "decode_fraction_one_call": round(ms_read / ms_dec, 3),
                  "decode_fraction_step": round(step_read / step_dec, 3), "splits": n})
        print(f"B{batch} L{ctx}", {k: v for k, v in r.items() if k != "read_configs"}, flush=True)
        del kc, vc, vs, flat, pts
        torch.cuda.empty_cache()
    os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "out"), "read_ceiling.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
