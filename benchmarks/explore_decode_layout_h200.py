"""Decode over FP8 paged caches in four memory orders on one H200 (the source of
``results/h200/explore/decode_layouts.json``).

The paged kernel takes the cache's strides, so one kernel reads every order of the same
(num_blocks, page_size, nheads_k, headdim) tensors:

* ``nhd``: FA3's layout, memory order (block, slot, head, dim) for K and V;
* ``nhd_vseq``: K as FA3's, V sequence-major (block, head, dim, slot);
* ``hnd``: head-major pages, memory order (block, head, slot, dim) for K and V, so one page of one head
  is a contiguous page_size x headdim block;
* ``hnd_vseq``: K head-major, V sequence-major.

Each case runs the launcher with an LSE output and the heuristic split count, as CUDA-graph replays (best of
two medians); ``gbps`` = K/V bytes read / time. ``diff`` is the largest |out - out(nhd)| (the same values in
another order). Usage (repo root, GPU machine): ``PYTHONPATH=src python benchmarks/explore_decode_layout_h200.py
[layouts [shapes]]``, both comma-separated, e.g. ``nhd,nhd_vseq 64x4096,1x131072`` (batch x context).
"""
import json
import sys

import torch

from fp8attn.bench.common import graph_replay, time_ms
from fp8attn.kernels.paged import launch_paged_fwd

E4M3 = torch.float8_e4m3fn
HQ, HK, D = 32, 8, 128
ORDERS = {"nhd": (0, 1, 2, 3), "hnd": (0, 2, 1, 3), "vseq": (0, 2, 3, 1)}


def _in_order(t, order):
    """``t`` (num_blocks, page, heads, dim) copied into memory order ``order`` (same shape and values)."""
    inv = [order.index(i) for i in range(4)]
    return t.permute(*order).contiguous().permute(*inv)


def _case(batch, ctx, page, q_dtype, layouts):
    npg = ctx // page
    pool = batch * npg + 16
    k = torch.randn(pool, page, HK, D, device="cuda").to(E4M3)
    v = torch.randn(pool, page, HK, D, device="cuda").to(E4M3)
    pt = (torch.randperm(pool, device="cuda")[:batch * npg].int().view(batch, npg))
    sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, 1, HQ, D, device="cuda").to(q_dtype)
    dd = torch.rand(batch, HK, device="cuda") + 0.5
    qd = dd if q_dtype == E4M3 else None
    res, ref = {}, None
    for name in layouts:
        ko, vo = (name.split("_") + [None])[:2]
        kc = _in_order(k, ORDERS[ko])
        vc = _in_order(v, ORDERS[vo or ko])
        out = torch.empty(batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(batch, HQ, 1, device="cuda")

        def fn(kc=kc, vc=vc, out=out, lse=lse):
            launch_paged_fwd(q, kc, vc, pt, sl, out, lse, max_seqlen_q=1, softmax_scale=D ** -0.5, causal=True,
                             q_descale=qd, k_descale=dd, v_descale=dd, num_splits=0)
        call = graph_replay([fn])[0]
        us = min(time_ms(call) for _ in range(2)) * 1000
        torch.cuda.synchronize()
        if ref is None:
            ref = out.float().clone()
        res[name] = {"us": round(us, 2), "gbps": round(2 * batch * ctx * HK * D / us / 1e3, 0),
                     "diff": float((out.float() - ref).abs().max())}
        del kc, vc
    torch.cuda.empty_cache()
    return res


def main():
    torch.manual_seed(0)
    layouts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["nhd", "nhd_vseq", "hnd", "hnd_vseq"]
    rows = {}
    shapes = ((64, 4096), (16, 32768), (1, 131072), (8, 32768), (64, 1024))
    if len(sys.argv) > 2:  # e.g. "64x4096,1x131072"
        shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[2].split(",")]
    for batch, ctx in shapes:
        for page in (64, 16):
            for qn, qdt in (("bf16", torch.bfloat16), ("e4m3", E4M3)):
                lay = layouts if page >= 64 else [x for x in layouts if "vseq" not in x]
                key = f"B{batch} L{ctx} p{page} {qn}"
                rows[key] = _case(batch, ctx, page, qdt, lay)
                print(key, " ".join(f"{n}={r['us']}us/{r['gbps']:.0f}GB/s/d{r['diff']:.0e}"
                                    for n, r in rows[key].items()), flush=True)
    print("RESULT", json.dumps(rows))


if __name__ == "__main__":
    main()
