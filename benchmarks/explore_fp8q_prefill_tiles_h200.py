"""FP8-Q prefill tiles over an e4m3 paged cache in FA3's layout on the paged Triton kernel, on one H200 (the
source of ``results/h200/explore/fp8q_prefill_tiles.json``): the variant on PYTHONPATH decides how the kernel
multiplies (FP8 MMAs with P in e4m3 and V transposed byte by byte in registers, or Q, K and V upcast to fp16
with P in fp16). Calls the TMA kernel does not take run there: query counts that are not multiples of 128,
or the Triton kernel forced (``config={"tma": False}``). Cases (batch x cached keys x queries, the queries the
last of the keys, causal): a 2k chunk over 8k, a 2000-query chunk, 100 and 24 queries per sequence; pages 64
and 16, 32 q / 8 kv heads, d128, per-(sequence, head) descales, LSE out. Reports CUDA-graph replays (best of
two medians, us), TF/s of the attended pairs, the relative L2 error against the float reference (first
sequences), and the same call with bf16 Q as a yardstick; the heuristic split count. Environment ``CONFIG``: a
JSON object of tile overrides for both calls (``block_m``, ``num_warps``, ...); ``HEADDIM``: the head dim (128).
Usage (repo root, GPU machine):
``PYTHONPATH=<variant>/src python benchmarks/explore_fp8q_prefill_tiles_h200.py <name> [BxLxQ,...]``.
"""
import json
import os
import sys

import torch

from fp8attn.bench.common import graph_replay, time_ms
from fp8attn.kernels.paged import launch_paged_fwd
from fp8attn.reference import paged_attention_ref

E4M3 = torch.float8_e4m3fn
HQ, HK = 32, 8
D = int(os.environ.get("HEADDIM", "128"))


def causal_pairs(batch, ctx, qlen):
    prefix = ctx - qlen
    return batch * (qlen * prefix + qlen * (qlen + 1) // 2)


def main(name):
    torch.manual_seed(0)
    res = {}
    config = {"tma": False, **json.loads(os.environ.get("CONFIG", "{}"))}
    shapes = ((1, 10240, 2048), (1, 10240, 2000), (4, 4096, 100), (8, 4096, 24))
    if len(sys.argv) > 2:
        shapes = [tuple(int(v) for v in x.split("x")) for x in sys.argv[2].split(",")]
    for batch, ctx, qlen in shapes:
        for page in (64, 16):
            npg = -(-ctx // page)
            pool = batch * npg + 16
            kc = torch.randn(pool, page, HK, D, device="cuda").to(E4M3)
            vc = torch.randn(pool, page, HK, D, device="cuda").to(E4M3)
            pt = torch.randperm(pool, device="cuda")[:batch * npg].int().view(batch, npg)
            sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            qf = torch.randn(batch, qlen, HQ, D, device="cuda") * 2
            qd, kd, vd = (torch.rand(batch, HK, device="cuda") + 0.5 for _ in range(3))
            out = torch.empty(batch, qlen, HQ, D, device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(batch, HQ, qlen, device="cuda")
            row = {}
            for qname, q, qdesc in (("e4m3", qf.to(E4M3), qd), ("bf16", qf.bfloat16(), None)):
                def fn():
                    launch_paged_fwd(q, kc, vc, pt, sl, out, lse, max_seqlen_q=qlen, softmax_scale=D ** -0.5,
                                     causal=True, q_descale=qdesc, k_descale=kd, v_descale=vd, num_splits=0,
                                     config=config)
                us = min(time_ms(graph_replay([fn])[0]) for _ in range(2)) * 1000
                torch.cuda.synchronize()
                nb = min(batch, 2)
                ref = paged_attention_ref(q[:nb], kc, vc, pt[:nb], sl[:nb], softmax_scale=D ** -0.5, causal=True,
                                          q_descale=None if qdesc is None else qdesc[:nb], k_descale=kd[:nb],
                                          v_descale=vd[:nb], out_dtype=torch.float32)
                err = float((out[:nb].float() - ref).norm() / ref.norm())
                flops = 4 * D * HQ * causal_pairs(batch, ctx, qlen)
                row[qname] = {"us": round(us, 2), "tflops": round(flops / us / 1e6, 1), "err": round(err, 5)}
            key = f"B{batch} L{ctx} q{qlen} p{page}"
            res[key] = row
            print(name, key, row, flush=True)
            torch.cuda.empty_cache()
    print("RESULT", name, json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "variant")
