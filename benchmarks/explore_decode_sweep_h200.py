"""Split counts and tile configs of split-KV decode around the committed heuristic, on one H200 (the source of
``results/h200/explore/decode_sweep.json``): B1/L128k and B64/L4096 (32 q / 8 kv heads, d128, e4m3 cache in
pages of 64 with sequence-major V; bf16 and e4m3 Q), the launcher with an LSE output, CUDA-graph replays (best
of two medians), plus the per-kernel GPU time of the default. Usage (repo root, GPU machine):
``PYTHONPATH=src python benchmarks/explore_decode_sweep_h200.py``.

``--waves`` (``results/h200/explore/decode_waves.json``): split counts at B16/L32k, B8/L32k and B64/L4096 that
give the grid whole waves of resident decode blocks (or many small ones), default tiles only, timed as one-call
replays and per call in an 8-call captured step (``graph_step_ms``).
"""
import json
import sys

import torch

from fp8attn.bench.common import graph_replay, graph_step_ms, kernel_times_us, time_ms
from fp8attn.bench.paged import D, E4M3, HK, HQ, _paged_pool
from fp8attn.kernels.paged import launch_paged_fwd
from fp8attn.kernels.planning import choose_num_splits
from fp8attn.paged import split_workspace, to_v_seq_major

PAGE = 64
CONFIGS = {
    "default": None,
    "w2": {"num_warps": 2},
    "s2": {"num_stages": 2},
    "s4": {"num_stages": 4},
    "w2 s4": {"num_warps": 2, "num_stages": 4},
    "w2 s5": {"num_warps": 2, "num_stages": 5},
    "w8": {"num_warps": 8, "maxnreg": None},
}


SWEEP_CASES = ((1, 131072, (0, 48, 56, 60, 64, 72, 88)), (64, 4096, (0, 2)))
WAVE_CASES = ((16, 32768, (0, 6, 8, 12, 16, 24, 33, 66)), (8, 32768, (0, 12, 16, 33, 66)), (64, 4096, (0, 3, 4, 8)))


def main(waves=False):
    torch.manual_seed(0)
    rows = {}
    cases, configs = (WAVE_CASES, {"default": None}) if waves else (SWEEP_CASES, CONFIGS)
    for batch, ctx, splits_list in cases:
        kc, vc, pts = _paged_pool(batch, ctx, PAGE, 1)
        vs = to_v_seq_major(vc)
        pt = pts[0]
        sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        dd = torch.rand(batch, HK, device="cuda") + 0.5
        for qn, qdt in (("bf16", torch.bfloat16), ("e4m3", E4M3)):
            q = torch.randn(batch, 1, HQ, D, device="cuda").to(qdt)
            qd = dd if qdt == E4M3 else None
            out = torch.empty(batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(batch, HQ, 1, device="cuda")
            ref = None
            for cname, cfg in configs.items():
                for ns in splits_list:
                    if cname != "default" and ns not in (0,):
                        continue
                    n = ns or choose_num_splits(batch, HK, pt.shape[1] * PAGE, 132)
                    op, lp = split_workspace(q, n, D, HQ) if n > 1 else (None, None)

                    def fn(n=n, op=op, lp=lp, cfg=cfg):
                        launch_paged_fwd(q, kc, vs, pt, sl, out, lse, max_seqlen_q=1, softmax_scale=D ** -0.5,
                                         causal=True, q_descale=qd, k_descale=dd, v_descale=dd, num_splits=n,
                                         out_partial=op, lse_partial=lp, config=cfg)
                    try:
                        call = graph_replay([fn])[0]
                        us = min(time_ms(call) for _ in range(2)) * 1000
                    except Exception as e:  # a config that does not compile or fit
                        rows[f"B{batch} L{ctx} {qn} {cname} splits={n}"] = str(e)[:120]
                        continue
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = out.float().clone()
                    key = f"B{batch} L{ctx} {qn} {cname} splits={n}"
                    rows[key] = {"us": round(us, 2), "gbps": round(2 * batch * ctx * HK * D / us / 1e3),
                                 "diff": float((out.float() - ref).abs().max())}
                    if waves:
                        rows[key]["us_step"] = round(min(graph_step_ms([fn]) for _ in range(2)) * 1000, 2)
                    if cname == "default" and ns == 0:
                        rows[key]["kernels_us"] = kernel_times_us(fn)
                    print(key, rows[key], flush=True)
        torch.cuda.empty_cache()
    print("RESULT", json.dumps(rows))


if __name__ == "__main__":
    main(waves="--waves" in sys.argv[1:])
