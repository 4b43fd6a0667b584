"""FP8-Q decode over an e4m3 paged cache in FA3's layout on one H200 (the source of
``results/h200/explore/fp8q_decode_path.json``): the paged kernel's FP8 MMA path (P in e4m3, V transposed byte
by byte in registers) against its 16-bit path (Q, K and V upcast to fp16, exact; P in fp16). A variant is the
source tree on PYTHONPATH. Cases: decode (one query) at B64/L4096, B16/L32k and B1/L128k, and 8 queries per
sequence at B32/L4096 (speculative decoding), pages 64 and 16, 32 q / 8 kv heads, d128, per-(sequence, head)
descales, an LSE output, the heuristic split count; CUDA-graph replays (best of two medians, us) and the
relative L2 error against the float reference (first batch rows only at large batches). Usage (repo root,
GPU machine): ``PYTHONPATH=<variant>/src python benchmarks/explore_fp8q_decode_h200.py <name> [BxLxQ,...]``.
"""
import json
import sys

import torch

from fp8attn.bench.common import graph_replay, time_ms
from fp8attn.kernels.paged import launch_paged_fwd
from fp8attn.reference import paged_attention_ref

E4M3 = torch.float8_e4m3fn
HQ, HK, D = 32, 8, 128


def main(name):
    torch.manual_seed(0)
    res = {}
    shapes = ((64, 4096, 1), (16, 32768, 1), (1, 131072, 1), (32, 4096, 8))
    if len(sys.argv) > 2:  # e.g. "32x4096x1,8x32768x1" (batch x context x queries)
        shapes = [tuple(int(v) for v in x.split("x")) for x in sys.argv[2].split(",")]
    for batch, ctx, qlen in shapes:
        for page in (64, 16):
            npg = ctx // page
            pool = batch * npg + 16
            kc = torch.randn(pool, page, HK, D, device="cuda").to(E4M3)
            vc = torch.randn(pool, page, HK, D, device="cuda").to(E4M3)
            pt = torch.randperm(pool, device="cuda")[:batch * npg].int().view(batch, npg)
            sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            q = (torch.randn(batch, qlen, HQ, D, device="cuda") * 2).to(E4M3)
            qd, kd, vd = (torch.rand(batch, HK, device="cuda") + 0.5 for _ in range(3))
            out = torch.empty(batch, qlen, HQ, D, device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(batch, HQ, qlen, device="cuda")

            def fn():
                launch_paged_fwd(q, kc, vc, pt, sl, out, lse, max_seqlen_q=qlen, softmax_scale=D ** -0.5,
                                 causal=True, q_descale=qd, k_descale=kd, v_descale=vd, num_splits=0)
            us = min(time_ms(graph_replay([fn])[0]) for _ in range(2)) * 1000
            torch.cuda.synchronize()
            nb = min(batch, 4)
            ref = paged_attention_ref(q[:nb], kc, vc, pt[:nb], sl[:nb], softmax_scale=D ** -0.5, causal=True,
                                      q_descale=qd[:nb], k_descale=kd[:nb], v_descale=vd[:nb],
                                      out_dtype=torch.float32)
            err = float((out[:nb].float() - ref).norm() / ref.norm())
            key = f"B{batch} L{ctx} q{qlen} p{page}"
            res[key] = {"us": round(us, 2), "gbps": round(2 * batch * ctx * HK * D / us / 1e3), "err": round(err, 5)}
            print(name, key, res[key], flush=True)
            torch.cuda.empty_cache()
    print("RESULT", name, json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "variant")
