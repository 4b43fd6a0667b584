"""FP8 varlen forward on one H200: the warp-specialized TMA kernel vs the Triton kernel, and the dense TMA
kernel on equal-length batches (the source of ``results/h200/explore/dense_varlen_tma.json``).

Eager calls timed with CUDA events (``bench.common.time_ms``), so each call's host work counts. V is
given sequence-contiguous (``tma_ms``, ``triton_ms``: the Triton kernel reads it as given) and as the
API's usual (total, heads, d) tensor (``*_vc``: the Triton call transposes it first); the TMA call lays V
out per sequence itself (``dense.varlen_v_kmajor``, also timed alone; ``tma_kernels_us``: the GPU time
of each kernel of one TMA call). ``*_graphed_ms``: CUDA-graph replays of the TMA call, V
sequence-contiguous, as (total, heads, d) (``_vc``) and as ``quantize_qkv`` returns it (``_qkv_v``). Usage (repo root, GPU
machine): ``OUT=<dir> [NAME=<file>.json] PYTHONPATH=src python benchmarks/explore_dense_varlen_h200.py``.
"""
import json
import os

import torch

from fp8attn.bench.common import graph_replay, kernel_times_us, time_ms
from fp8attn.kernels.dense import launch_dense_fwd, transpose_v_kmajor
from fp8attn.qkv import empty_seq_major

E4M3 = torch.float8_e4m3fn
H = HK = 16
CASES = (("8 random 512..4k", [3001, 517, 4096, 1200, 2222, 640, 3333, 1000]), ("4 x 4096", [4096] * 4),
         ("16 x 1024", [1024] * 16))


def _with_backend(name, fn):
    os.environ["FP8ATTN_DENSE_BACKEND"] = name
    try:
        fn()
        torch.cuda.synchronize()
        return time_ms(fn)
    finally:
        os.environ.pop("FP8ATTN_DENSE_BACKEND")


def _v_layout(v, cu):
    """The TMA call's V pass alone (``dense.varlen_v_kmajor``; the variant of explore/varlen_direct_v.json
    named it ``varlen_v_rows``)."""
    from fp8attn.kernels import dense
    if hasattr(dense, "varlen_v_rows"):
        return dense.varlen_v_rows(v)
    return dense.varlen_v_kmajor(v, cu)


def main():
    torch.manual_seed(0)
    rows = []
    for d in (128, 64):
        for name, lens in CASES:
            for causal in (False, True):
                cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
                total, b = int(cu[-1]), len(lens)
                q = torch.randn(total, H, d, device="cuda").to(E4M3)
                k = torch.randn(total, HK, d, device="cuda").to(E4M3)
                v_c = torch.randn(total, HK, d, device="cuda").to(E4M3)
                v = transpose_v_kmajor(v_c)
                ds = torch.rand(b, HK, device="cuda") + 0.5
                out = torch.empty(total, H, d, device="cuda", dtype=torch.bfloat16)
                flops = 4 * H * d * sum(L * (L + 1) / 2 if causal else L * L for L in lens)

                def call(v=v):
                    launch_dense_fwd(q, k, v, out, None, softmax_scale=d ** -0.5, causal=causal,
                                     window_size=(-1, -1), softcap=0.0, q_descale=ds, k_descale=ds, v_descale=ds,
                                     cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                                     max_seqlen_k=max(lens))
                ms_t = _with_backend("tma", call)
                o_tma = out.clone()
                ms_r = _with_backend("triton", call)
                row = dict(d=d, lens=name, causal=causal, tma_ms=ms_t, tma_tflops=flops / ms_t / 1e9,
                           triton_ms=ms_r, triton_tflops=flops / ms_r / 1e9, speedup=ms_r / ms_t,
                           max_diff=(o_tma.float() - out.float()).abs().max().item())
                if len(set(lens)) == 1:
                    L = lens[0]
                    od = torch.empty(b, L, H, d, device="cuda", dtype=torch.bfloat16)
                    vv = transpose_v_kmajor(v.view(b, L, HK, d).contiguous())

                    def dense():
                        launch_dense_fwd(q.view(b, L, H, d), k.view(b, L, HK, d), vv, od, None,
                                         softmax_scale=d ** -0.5, causal=causal, window_size=(-1, -1), softcap=0.0,
                                         q_descale=ds, k_descale=ds, v_descale=ds)
                    dense()
                    torch.cuda.synchronize()
                    row["dense_ms"] = time_ms(dense)
                    row["vs_dense"] = row["dense_ms"] / ms_t
                os.environ["FP8ATTN_DENSE_BACKEND"] = "tma"  # CUDA-graph replays: the GPU time alone
                v_q = empty_seq_major(tuple(v_c.shape), E4M3, "cuda").copy_(v_c)  # quantize_qkv's V layout
                for key, vv_ in (("tma_graphed_ms", v), ("tma_graphed_ms_vc", v_c), ("tma_graphed_ms_qkv_v", v_q)):
                    g, graphed = graph_replay([lambda vv_=vv_: call(vv_)])
                    row[key] = time_ms(g) if graphed else None
                os.environ.pop("FP8ATTN_DENSE_BACKEND")
                if "dense_ms" in row:
                    g, graphed = graph_replay([dense])
                    row["dense_graphed_ms"] = time_ms(g) if graphed else None
                row["tma_ms_vc"] = _with_backend("tma", lambda: call(v_c))
                row["triton_ms_vc"] = _with_backend("triton", lambda: call(v_c))
                row["speedup_vc"] = row["triton_ms_vc"] / row["tma_ms_vc"]
                row["v_layout_ms"] = time_ms(lambda: _v_layout(v, cu))
                row["v_layout_ms_vc"] = time_ms(lambda: _v_layout(v_c, cu))
                os.environ["FP8ATTN_DENSE_BACKEND"] = "tma"
                row["tma_kernels_us"] = kernel_times_us(lambda: call(v_c))
                os.environ.pop("FP8ATTN_DENSE_BACKEND")
                rows.append(row)
                print({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), os.environ.get("NAME", "dense_varlen_tma.json")), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
