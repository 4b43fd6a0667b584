"""Chunked prefill (2k FP8 queries over an 8k prefix, sequence-major V) on one H200: the TMA paged kernel
at pages 64 and 128 with K/V rings of 2-4 stages vs the Triton paged kernel and the dense TMA kernel (the
source of ``results/h200/explore/paged_tma_pages.json``). Usage (repo root, GPU machine):
``OUT=<dir> PYTHONPATH=src python benchmarks/explore_paged_tma_pages_h200.py``.
"""
import json
import os

import torch

from fp8attn.bench.common import time_ms
from fp8attn.bench.paged import D, E4M3, HK, HQ, _chunk_inputs
from fp8attn.kernels.hopper import paged_launch
from fp8attn.kernels.dense import launch_dense_fwd, transpose_v_kmajor
from fp8attn.kernels.paged import launch_paged_fwd
from fp8attn.paged import to_v_seq_major
from fp8attn.reference import gather_paged


def main():
    rows = []
    for batch in (1, 4):
        for page in (64, 128):
            kc, vc, pt, q8, seqlens = _chunk_inputs(batch, 8192, 2048, page, E4M3)
            vs = to_v_seq_major(vc)
            ds = torch.rand(batch, HK, device="cuda") + 0.5
            out = torch.empty(batch, 2048, HQ, D, device="cuda", dtype=torch.bfloat16)
            row = dict(B=batch, page=page)

            def triton_kernel():
                launch_paged_fwd(q8, kc, vs, pt, seqlens, out, None, max_seqlen_q=2048, softmax_scale=D ** -0.5,
                                 causal=True, q_descale=ds, k_descale=ds, v_descale=ds, config={"tma": False})
            triton_kernel()
            torch.cuda.synchronize()
            ref = out.clone()
            row["triton_ms"] = time_ms(triton_kernel)
            for stages in (2, 3, 4):
                def tma(st=stages):
                    paged_launch.launch_paged_prefill_tma(q8, kc, vs, pt, seqlens, out, None, softmax_scale=D ** -0.5,
                                                       causal=True, q_descale=ds, k_descale=ds, v_descale=ds,
                                                       num_stages=st)
                tma()
                torch.cuda.synchronize()
                row[f"tma_s{stages}_ms"] = time_ms(tma)
                row[f"tma_s{stages}_maxdiff_vs_triton"] = (out.float() - ref.float()).abs().max().item()
            if page == 128:
                kg, _ = gather_paged(kc, pt, seqlens, 10240)
                vg, _ = gather_paged(vc, pt, seqlens, 10240)
                vg = transpose_v_kmajor(vg)
                od = torch.empty_like(out)

                def dense():
                    launch_dense_fwd(q8, kg, vg, od, None, softmax_scale=D ** -0.5, causal=True,
                                     window_size=(-1, -1), softcap=0.0, q_descale=ds, k_descale=ds, v_descale=ds)
                dense()
                torch.cuda.synchronize()
                row["dense_ms"] = time_ms(dense)
            rows.append(row)
            print(row, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "paged_tma_pages.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
