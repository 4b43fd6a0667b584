"""The paged TMA kernel on one 2048-query FP8 chunk over a 10240-key paged cache (B1, 32 q / 8 kv heads,
d128, sequence-major V at pages 64 and 128): as a fixed-length launch (``MODE_PAGED``) and as a varlen batch
of that one sequence over a block list built once (``MODE_PAGED_VARLEN``), CUDA-graph replays, three
alternating medians each, outputs compared bit for bit (the source of
``results/h200/explore/varlen_mode.json``). A variant is the source tree on PYTHONPATH. Usage (repo root,
GPU machine): ``PYTHONPATH=<variant>/src python benchmarks/explore_varlen_mode_h200.py <name>``.

``--once fixed|varlen`` instead runs one of the two launches four times at page 64 and exits (the profiled
launch of ``results/h200/explore/varlen_ncu.json``: ``ncu --clock-control none --set full -k
regex:_bounded_fwd_tma_ws --launch-skip 3 --launch-count 1 python benchmarks/explore_varlen_mode_h200.py
--once varlen``).
"""
import json
import sys

import torch

from fp8attn.bench.common import graph_replay, time_ms
from fp8attn.bench.paged import D, E4M3, HK, HQ, _paged_pool
from fp8attn.kernels.hopper import dense_launch, paged_launch
from fp8attn.kernels.paged import launch_paged_fwd
from fp8attn.paged import to_v_seq_major

CHUNK, L = 2048, 10240


def launches(page):
    """(fixed-length launch, varlen launch, their outputs) of the chunk at ``page``."""
    kc, vc, pts = _paged_pool(1, L, page, 1)
    vs = to_v_seq_major(vc)
    pt = pts[0].view(1, -1).contiguous()
    sl = torch.tensor([L], dtype=torch.int32, device="cuda")
    q = torch.randn(1, CHUNK, HQ, D, device="cuda").to(E4M3)
    dd = torch.rand(1, HK, device="cuda") + 0.5
    ds = dict(q_descale=dd, k_descale=dd, v_descale=dd)
    oc = torch.empty(1, CHUNK, HQ, D, device="cuda", dtype=torch.bfloat16)
    ov = torch.empty(CHUNK, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, CHUNK], dtype=torch.int32, device="cuda")
    lst = dense_launch.varlen_block_list(cu, sl, False, CHUNK, 128)
    fns = {"fixed": lambda: launch_paged_fwd(q, kc, vs, pt, sl, oc, None, max_seqlen_q=CHUNK,
                                             softmax_scale=D ** -0.5, causal=True, **ds),
           "varlen": lambda: paged_launch.launch_paged_prefill_tma(q[0], kc, vs, pt, sl, ov, None, softmax_scale=D ** -0.5,
                                                                causal=True, cu_seqlens_q=cu, min_len_q=128,
                                                                block_list=lst, **ds)}
    return fns, oc, ov


def main(argv):
    torch.manual_seed(0)
    if argv[0] == "--once":
        fn = launches(64)[0][argv[1]]
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
        return
    res = {}
    for page in (64, 128):
        fns, oc, ov = launches(page)
        calls = {k: graph_replay([f])[0] for k, f in fns.items()}
        for rep in range(3):
            for k, c in calls.items():
                res.setdefault(f"p{page} {k}", []).append(round(time_ms(c) * 1000, 1))
        torch.cuda.synchronize()
        res[f"p{page} equal"] = bool(torch.equal(oc[0], ov))
    print("RESULT", argv[0], json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1:])
