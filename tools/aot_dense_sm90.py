"""Ahead-of-time sm90 compile of the dense kernel on a machine without a GPU (evidence for perf notes).

Captures the arguments ``launch_dense_fwd`` would pass (default config, as with FP8ATTN_NO_AUTOTUNE=1),
specializes them like Triton's launcher (helpers from aot_paged_sm90.py), compiles for sm90 with the
bundled ptxas and prints async copies in the TTGIR, QGMMA count in the SASS, and cuobjdump's resource
usage (registers, stack = spills). Usage: ``python tools/aot_dense_sm90.py`` from the repo root.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
os.environ["FP8ATTN_NO_AUTOTUNE"] = "1"
sys.path.insert(0, "tools")
import aot_paged_sm90 as A
import torch
import triton
from triton.backends.compiler import GPUTarget

from fp8attn.kernels import dense

E4M3 = torch.float8_e4m3fn


def capture(case):
    real = dense._dense_fwd_kernel
    cap = A._Capture(real)
    dense._dense_fwd_kernel = cap
    try:
        b, s, hq, hk, d = case["b"], case["s"], 16, case.get("hk", 16), case.get("d", 128)
        varlen = case.get("varlen", False)
        if varlen:
            q = torch.zeros(b * s, hq, d, dtype=E4M3)
            k = torch.zeros(b * s, hk, d, dtype=E4M3)
            v = k.clone()
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
            out = torch.empty(b * s, hq, d, dtype=torch.bfloat16)
            lse = torch.empty(hq, b * s)
            kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s)
        else:
            q = torch.zeros(b, s, hq, d, dtype=E4M3)
            k = torch.zeros(b, s, hk, d, dtype=E4M3)
            v = k.clone()
            out = torch.empty(b, s, hq, d, dtype=torch.bfloat16)
            lse = torch.empty(b, hq, s)
            kw = {}
        if case.get("block"):
            qd = torch.ones(1 if varlen else b, hq, -(-(b * s if varlen else s) // 64))
            kd = torch.ones(qd.shape[0], hk, qd.shape[-1])
            vd = torch.ones(b, hk)
            kw.update(descale_block_q=64, descale_block_k=64)
        else:
            qd = kd = vd = torch.ones(b, hk)
        dense.launch_dense_fwd(
            q,
            k,
            v,
            out,
            lse,
            softmax_scale=d**-0.5,
            causal=case["causal"],
            window_size=(-1, 0) if case["causal"] else (-1, -1),
            softcap=0.0,
            q_descale=qd,
            k_descale=kd,
            v_descale=vd,
            v_kmajor=True,
            **kw,
        )
    finally:
        dense._dense_fwd_kernel = real
    return real, cap.calls[0]


for case in (
    {"b": 4, "s": 4096, "causal": False},
    {"b": 4, "s": 4096, "causal": True},
    {"b": 4, "s": 1024, "causal": True, "varlen": True, "block": True},
    {"b": 2, "s": 1024, "causal": False, "block": True},
):
    fn, (grid, args, kwargs) = capture(case)
    sig, consts, attrs, opts = A._specialize(fn, args, kwargs)
    k = triton.compile(
        triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=opts,
    )
    ttgir = k.asm["ttgir"]
    res, sass = A._res_usage(k.asm["cubin"])
    print(case, "async_copy", ttgir.count("async_copy_global_to_local"), "QGMMA", sass.count("QGMMA"), res)
