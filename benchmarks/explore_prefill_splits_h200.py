"""Split counts and warps per (128, 64) prefill tile of the paged Triton kernel (4 against 8) over a grid of chunk
shapes on one H200 (the source of ``results/h200/explore/prefill_splits.json``). The tile runs P@V in fp16 over an
e4m3 cache (bf16 Q, or e4m3 Q over FA3's layout) and takes 4 warps; a B2 x 300-query case ran faster at 8.
Question: does the grid's fill (programs per SM) decide which count wins? Cases (batch x cached keys x queries, the
queries the last of the keys, causal), pages 64 and 16, 32 q / 8 kv heads, d128, per-(sequence, head) descales, the
Triton kernel forced (``config={"tma": False}``), heuristic splits. Reports CUDA-graph replays (best of two
medians, us), the programs of the launch and whether the two outputs are bit-identical. Environment ``PAGES``: page
sizes (default 64,16); ``SPLITS``: split counts to time (default 0, the heuristic; ``same_bits`` compares the last
count's two outputs); ``VLAYOUT=seq``: V sequence-major instead of FA3's layout.
Usage (repo root, GPU machine): ``PYTHONPATH=src python benchmarks/explore_prefill_splits_h200.py [BxLxQ,...]``.
"""
import json
import os
import sys

import torch

from fp8attn.bench.common import graph_replay, time_ms
from fp8attn.kernels.paged import launch_paged_fwd
from fp8attn.kernels.planning import paged_grid

E4M3 = torch.float8_e4m3fn
HQ, HK, D = 32, 8, 128
PAGES = tuple(int(p) for p in os.environ.get("PAGES", "64,16").split(","))
SPLITS = tuple(int(p) for p in os.environ.get("SPLITS", "0").split(","))
SHAPES = ((1, 10240, 2048), (1, 10240, 2000), (1, 8192, 1000), (1, 4096, 512), (2, 8192, 300), (3, 8192, 500),
          (2, 4096, 1000), (4, 4096, 100), (8, 4096, 200), (16, 4096, 40), (8, 4096, 24), (1, 16384, 4000))


def main():
    torch.manual_seed(0)
    shapes = SHAPES
    if len(sys.argv) > 1:
        shapes = [tuple(int(v) for v in x.split("x")) for x in sys.argv[1].split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {}
    for batch, ctx, qlen in shapes:
        for page in PAGES:
            npg = -(-ctx // page)
            pool = batch * npg + 16
            kc = torch.randn(pool, page, HK, D, device="cuda").to(E4M3)
            if os.environ.get("VLAYOUT") == "seq":  # sequence-major V: memory order (block, head, dim, slot)
                vc = torch.randn(pool, HK, D, page, device="cuda").to(E4M3).permute(0, 3, 1, 2)
            else:
                vc = torch.randn(pool, page, HK, D, device="cuda").to(E4M3)
            pt = torch.randperm(pool, device="cuda")[:batch * npg].int().view(batch, npg)
            sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            qf = torch.randn(batch, qlen, HQ, D, device="cuda") * 2
            qd, kd, vd = (torch.rand(batch, HK, device="cuda") + 0.5 for _ in range(3))
            for qname, q, qdesc in (("e4m3", qf.to(E4M3), qd), ("bf16", qf.bfloat16(), None)):
                row, outs = {}, {}
                for ns, nw in ((ns, nw) for ns in SPLITS for nw in (4, 8)):
                    out = torch.empty(batch, qlen, HQ, D, device="cuda", dtype=torch.bfloat16)
                    config = {"tma": False, "num_warps": nw}

                    def fn():
                        launch_paged_fwd(q, kc, vc, pt, sl, out, None, max_seqlen_q=qlen, softmax_scale=D ** -0.5,
                                         causal=True, q_descale=qdesc, k_descale=kd, v_descale=vd, num_splits=ns,
                                         config=config)
                    us = min(time_ms(graph_replay([fn])[0]) for _ in range(2)) * 1000
                    fn()
                    torch.cuda.synchronize()
                    outs[nw] = out
                    row[f"w{nw}_us" if ns == 0 else f"s{ns}_w{nw}_us"] = round(us, 2)
                tiles, _, block_q, _, grid0, splits = paged_grid(
                    batch=batch, nheads_k=HK, qg=HQ // HK, headdim=D, max_seqlen_q=qlen, q_rows=qlen, varlen=False,
                    page_size=page, capacity=npg * page, mma_fp8=False, mma_fp8_s=False,
                    v_seq_major=os.environ.get("VLAYOUT") == "seq",
                    fp8_cache=True, token_scales=False, num_splits=0, num_sms=sms)
                row.update(programs=grid0 * HK * splits, splits=splits, tiles=list(tiles[:4]),
                           same_bits=bool(torch.equal(outs[4].view(torch.int16), outs[8].view(torch.int16))),
                           **({"w8_over_w4": round(row["w4_us"] / row["w8_us"], 3)} if "w4_us" in row else {}))
                key = f"B{batch} L{ctx} q{qlen} p{page} {qname}"
                res[key] = row
                print(key, row, flush=True)
            torch.cuda.empty_cache()
    print("RESULT", json.dumps(res))


if __name__ == "__main__":
    main()
