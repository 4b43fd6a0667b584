"""A/B of paged/dense kernel variants on one H200 (the source of ``results/h200/explore/small_page_producer.json``
and, for one variant, ``explore/lse_cost.json``): one 2048-query FP8 chunk over an 8192-key prefix (B1, 32 q / 8 kv
heads, d128, e4m3 paged cache in FA3's layout at pages 16/32/64/128 and sequence-major V at 64/128), with and
without an LSE output, and the dense kernel at B4 S4096 (16 heads, with LSE), all as CUDA-graph replays (best of
two medians, microseconds). A variant is the source tree on PYTHONPATH; run each in its own process, one after
another on the same machine, and compare the printed lines. Usage (repo root, GPU machine):
``PYTHONPATH=<variant>/src python benchmarks/explore_paged_variants_h200.py <name>``.
"""
import json
import sys

import torch

from fp8attn.bench.common import graph_replay, time_ms
from fp8attn.kernels.dense import launch_dense_fwd, transpose_v_kmajor
from fp8attn.kernels.paged import launch_paged_fwd
from fp8attn.paged import to_v_seq_major

E4M3 = torch.float8_e4m3fn
HQ, HK, D = 32, 8, 128
PREFIX, CHUNK = 8192, 2048


def _us(fn):
    call = graph_replay([fn])[0]
    return round(min(time_ms(call) for _ in range(2)) * 1000, 1)


def _chunked(res):
    L = PREFIX + CHUNK
    for ps in (16, 32, 64, 128):
        npg = L // ps
        kc = torch.randn(npg * 2, ps, HK, D, device="cuda").to(E4M3)
        vc = torch.randn(npg * 2, ps, HK, D, device="cuda").to(E4M3)
        pt = torch.randperm(npg * 2, device="cuda")[:npg].int().view(1, npg)
        sl = torch.tensor([L], device="cuda", dtype=torch.int32)
        q = torch.randn(1, CHUNK, HQ, D, device="cuda").to(E4M3)
        dd = torch.rand(1, HK, device="cuda") + 0.5
        out = torch.empty(1, CHUNK, HQ, D, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(1, HQ, CHUNK, device="cuda")
        for name, v in [("fa3", vc)] + ([("seq", to_v_seq_major(vc))] if ps >= 64 else []):
            for with_lse in (False, True):
                def fn(v=v, with_lse=with_lse):
                    launch_paged_fwd(q, kc, v, pt, sl, out, lse if with_lse else None, max_seqlen_q=CHUNK,
                                     softmax_scale=D ** -0.5, causal=True, q_descale=dd, k_descale=dd, v_descale=dd)
                res[f"chunk p{ps} {name} lse{int(with_lse)}"] = _us(fn)
        torch.cuda.empty_cache()


def _dense(res):
    b, s, h = 4, 4096, 16
    q, k, v = (torch.randn(b, s, h, D, device="cuda").to(E4M3) for _ in range(3))
    vt = transpose_v_kmajor(v)
    ds = torch.rand(b, h, device="cuda") + 0.5
    out = torch.empty(b, s, h, D, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(b, h, s, device="cuda")
    for causal in (False, True):
        def fn(causal=causal):
            launch_dense_fwd(q, k, vt, out, lse, softmax_scale=D ** -0.5, causal=causal, window_size=(-1, -1),
                             softcap=0.0, q_descale=ds, k_descale=ds, v_descale=ds, v_kmajor=False)
        res[f"dense S4k causal{int(causal)} lse1"] = _us(fn)


def main(name):
    torch.manual_seed(0)
    res = {}
    _chunked(res)
    _dense(res)
    print("RESULT", name, json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "variant")
