"""Ahead-of-time sm90 compile of the backward kernels on a machine without a GPU (evidence for perf notes).

Captures the launches ``launch_attention_bwd`` makes (each main kernel's configurations of its head-dim
class, as with FP8ATTN_NO_AUTOTUNE=1 for the first, or all with ``--all``), specializes them like Triton's
launcher (helpers of aot_paged_sm90.py), compiles for sm90 with the bundled ptxas and prints per case:
wgmma ops in the TTGIR, QGMMA (FP8) / HGMMA (16-bit) in the SASS, pipelined async copies, shared memory,
atomic reductions (RED), TMA reductions (TMA_RED), barriers (BAR), shared-memory stores (STS), float min/max
(FMNMX: the amax reductions), fp32 -> e4m3 conversions in the PTX (CVT_E4M3; CVT_SAT those that saturate), the
largest register count a warp-specialized kernel's partitions raise theirs to (MAXNREG; 0: not warp-specialized) and
cuobjdump's resource usage (registers; LDL/STL = spills). A compile error
prints `` FAILED ``.
Usage: ``python tools/aot_backward_sm90.py [--all] [--quick]`` from the repo root (``--quick``: the
cases the CPU test compiles).
"""

import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"
os.environ["FP8ATTN_NO_AUTOTUNE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aot_paged_sm90 as A  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from fp8attn.kernels import backward as B  # noqa: E402

E4M3 = torch.float8_e4m3fn


def capture(case):
    """The (kernel, grid, args, kwargs) of the three launches of one backward call."""
    names = ("_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")
    real = {n: getattr(B, n) for n in names}
    caps = {n: A._Capture(real[n]) for n in names}
    for n in names:
        setattr(B, n, caps[n])
    try:
        b, s, hq, hk = case.get("b", 2), case["s"], case.get("hq", 16), case.get("hk", 16)
        d, dv = case["d"], case.get("dv", case["d"])
        dt = case.get("dtype", E4M3)
        varlen = case.get("varlen", False)
        lead = (b * s,) if varlen else (b, s)
        q = torch.zeros(*lead, hq, d, dtype=dt)
        k = torch.zeros(*lead, hk, d, dtype=dt)
        v = torch.zeros(b, hk, dv, s, dtype=dt).permute(0, 3, 1, 2)  # sequence-major V
        if varlen:
            v = v.reshape(b * s, hk, dv)
        do = torch.zeros(*lead, hq, dv, dtype=torch.bfloat16)
        out = torch.zeros_like(do)
        lse = torch.zeros(hq, b * s) if varlen else torch.zeros(b, hq, s)
        grads = [torch.zeros(x.shape) for x in (q, k, v)]
        desc = torch.ones(b, hk) if dt == E4M3 else None
        kw = {}
        if varlen:
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
            kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s)
        B.launch_attention_bwd(
            do,
            q,
            k,
            v,
            out,
            lse,
            *grads,
            q_descale=desc,
            k_descale=desc,
            v_descale=desc,
            softmax_scale=d**-0.5,
            causal=case["causal"],
            window_left=-1,
            window_right=-1,
            softcap=case.get("softcap", 0.0),
            mode=case["mode"],
            deterministic=case.get("deterministic", False),
            **kw,
        )
    finally:
        for n in names:
            setattr(B, n, real[n])
    return [(real[n], call) for n in names[1:] for call in caps[n].calls]


def compile_one(fn, args, kwargs):
    sig, consts, attrs, opts = A._specialize(fn, args, kwargs)
    k = triton.compile(
        triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=opts,
    )
    return stats(k)


def stats(k):
    """The counts printed per compiled kernel ``k`` (module docstring)."""
    ttgir = k.asm["ttgir"]
    res, sass = A._res_usage(k.asm["cubin"])
    return dict(
        wgmma=ttgir.count("warp_group_dot "),
        QGMMA=sass.count("QGMMA"),
        HGMMA=sass.count("HGMMA"),
        async_copy=ttgir.count("async_copy_global_to_local"),
        smem=k.metadata.shared,
        RED=len(re.findall(r"\bRED", sass)) + len(re.findall(r"\bATOMG?\b", sass)),
        TMA_RED=len(re.findall(r"\bUTMAREDG", sass)),
        BAR=len(re.findall(r"\bBAR\b", sass)),
        STS=len(re.findall(r"\bSTS", sass)),
        FMNMX=len(re.findall(r"\bFMNMX", sass)),
        CVT_E4M3=len(re.findall(r"cvt\.rn(?:\.satfinite)?\.e4m3x2\.f32", k.asm["ptx"])),
        CVT_SAT=len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", k.asm["ptx"])),
        MAXNREG=max(map(int, re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])), default=0),
        LDL=len(re.findall(r"\bLDL\b", sass)),
        STL=len(re.findall(r"\bSTL\b", sass)),
        res=res,
    )


CASES = [
    {"name": "e4m3 d64 causal deq", "s": 4096, "d": 64, "causal": True, "mode": "dequantized"},
    {"name": "e4m3 d128 causal deq", "s": 4096, "d": 128, "causal": True, "mode": "dequantized"},
    {
        "name": "e4m3 d64 causal deq det",
        "s": 4096,
        "d": 64,
        "causal": True,
        "mode": "dequantized",
        "deterministic": True,
    },
    {"name": "e4m3 d128 noncausal fp8", "s": 4096, "d": 128, "causal": False, "mode": "fp8"},
    {"name": "e4m3 d128 noncausal fp8 det", "s": 4096, "d": 128, "causal": False, "mode": "fp8", "deterministic": True},
    {"name": "e4m3 d256 causal deq", "s": 4096, "d": 256, "causal": True, "mode": "dequantized"},
    {"name": "e4m3 d256 causal fp8", "s": 4096, "d": 256, "causal": True, "mode": "fp8"},
    {"name": "e4m3 d192/128 causal deq", "s": 2048, "d": 192, "dv": 128, "causal": True, "mode": "dequantized"},
    {
        "name": "bf16 d128 causal deq",
        "s": 4096,
        "d": 128,
        "causal": True,
        "mode": "dequantized",
        "dtype": torch.bfloat16,
    },
    {"name": "e4m3 d128 varlen causal fp8", "s": 1024, "d": 128, "causal": True, "mode": "fp8", "varlen": True},
]

# compiled by tests/kernels/test_sm90_compile.py (one case per mode, with the atomic dQ and with the dQ pass;
# the default configurations)
QUICK = [c for c in CASES if c["name"].startswith(("e4m3 d64 causal deq", "e4m3 d128 noncausal fp8"))]


# the Hopper kernels (kernels/hopper/backward.py): (head dim, causal, e4m3 inputs, mode)
HOPPER = [
    (128, False, True, "dequantized"),
    (128, True, True, "dequantized"),
    (64, True, True, "dequantized"),
    (128, True, False, "dequantized"),
    (128, False, True, "fp8"),
    (128, True, True, "fp8"),
    (64, True, True, "fp8"),
]


def hopper_rows():
    """Compile the Hopper backward kernel's cases; (label, stats or the exception) per case."""
    from fp8attn.kernels.hopper import backward_launch as H

    rows = []
    for d, causal, fp8, mode in HOPPER:
        tag = "deq" if mode == "dequantized" else mode
        label = f"hopper {'e4m3' if fp8 else 'bf16'} d{d} {'causal' if causal else 'noncausal'} {tag} bwd_tma"
        try:
            k = H._aot_compile(causal=causal, head_dim=d, fp8=fp8, v_seq_major=fp8, mode=mode)
            rows.append((label, stats(k)))
        except Exception as e:  # noqa: BLE001  (reported by main)
            rows.append((label, e))
    return rows


def main():
    every = "--all" in sys.argv
    failed = 0
    cfg = (64, 128, 8, 2)  # (query rows, keys, warps, stages) of the Hopper kernel, printed as the others'
    for label, row in hopper_rows():
        if isinstance(row, Exception):
            failed += 1
            print(f"{label} FAILED cfg={cfg} {type(row).__name__}: {str(row)[:300]}")
        else:
            print(f"{label} cfg={cfg} " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    for case in QUICK if "--quick" in sys.argv else CASES:
        for fn, (_grid, args, kwargs) in capture(case):
            table = B._CFGS_DKDV if fn is B._bwd_dkdv_kernel else B._CFGS_DQ
            cfgs = B.table_configs(table, kwargs["BLOCK_D"], kwargs["BLOCK_DV"], kwargs["MODE_FP8"])
            for bm, bn, w, st in cfgs if every else cfgs[:1]:
                kw = dict(kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
                part = {(True, False): " dk", (False, True): " dv"}.get((kwargs.get("DO_DK"), kwargs.get("DO_DV")), "")
                label = f"{case['name']} {fn.__name__[5:]}{part}"
                try:
                    row = compile_one(fn, args, kw)
                except Exception as e:  # noqa: BLE001  (reported, counted, the script exits non-zero)
                    failed += 1
                    print(f"{label} FAILED cfg={(bm, bn, w, st)} {type(e).__name__}: {str(e)[:300]}")
                    continue
                print(f"{label} cfg={(bm, bn, w, st)} " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
