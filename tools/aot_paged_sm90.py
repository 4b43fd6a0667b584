"""Ahead-of-time sm90 compile of the paged kernel on a machine without a GPU (evidence for perf notes).

Builds the launch arguments of ``launch_paged_fwd`` on CPU tensors (real strides, batch and
sequence counts; a small page pool, since the pool size only changes the addresses), specializes them
exactly as Triton's launcher does (16-divisible ints/pointers get ``tt.divisibility``, ints equal to 1
become constants), compiles for sm90 with the bundled ptxas and prints, per case: the number of
``async_copy_global_to_local`` ops in the TTGIR (pipelined cp.async loads), ``cp.async`` in the PTX,
registers, spill stores/loads and local memory (cuobjdump's resource usage). Usage:

    TRITON_INTERPRET=0 python tools/aot_paged_sm90.py [--dump DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402

from fp8attn.kernels import paged  # noqa: E402

E4M3 = torch.float8_e4m3fn
_CUOBJDUMP = shutil.which("cuobjdump") or os.path.join(
    os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"
)
HQ, HK, D = 32, 8, 128


class _Capture:
    """Stands in for the jit kernel: records the arguments of one launch."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))

        return launch


def _capture_launch(case):
    real = paged._paged_fwd_kernel
    cap = _Capture(real)
    real_combine = paged.launch_combine
    paged._paged_fwd_kernel = cap
    paged.launch_combine = lambda *a, **k: None
    try:
        batch, qlen, L, page_size, q_dtype = case["batch"], case["qlen"], case["ctx"], case["page_size"], case["q"]
        pages = -(-L // page_size)
        nb = 4  # pool size only changes addresses
        kv_dtype = case.get("kv", E4M3)
        kc = torch.zeros(nb, page_size, HK, D, dtype=kv_dtype)
        vc = torch.zeros(nb, page_size, HK, D, dtype=kv_dtype)
        if case.get("v_seq_major"):  # (nb, HK, D, page) memory order, viewed as (nb, page, HK, D)
            vc = torch.zeros(nb, HK, D, page_size, dtype=kv_dtype).permute(0, 3, 1, 2)
        pt = torch.zeros(batch, pages, dtype=torch.int32)
        seqlens = torch.full((batch,), L, dtype=torch.int32)
        q = torch.zeros(batch, qlen, HQ, D, dtype=q_dtype)
        out = torch.empty(batch, qlen, HQ, D, dtype=torch.bfloat16)
        lse = torch.empty(batch, HQ, qlen)
        dsc = torch.ones(batch, HK)
        kw = dict(k_descale=dsc, v_descale=dsc) if kv_dtype == E4M3 else {}
        if q_dtype == E4M3:
            kw["q_descale"] = dsc
        if case.get("varlen"):  # a varlen batch (mixed decode + prefill launches: two tile classes)
            q, out = q.view(batch * qlen, HQ, D), out.view(batch * qlen, HQ, D)
            lse = torch.empty(HQ, batch * qlen)
            kw["cu_seqlens_q"] = torch.arange(batch + 1, dtype=torch.int32) * qlen
        paged.launch_paged_fwd(
            q,
            kc,
            vc,
            pt,
            seqlens,
            out,
            lse,
            max_seqlen_q=qlen,
            softmax_scale=D**-0.5,
            causal=True,
            num_splits=case.get("splits", 1),
            config=case.get("config"),
            **kw,
        )
    finally:
        paged._paged_fwd_kernel = real
        paged.launch_combine = real_combine
    return real, cap.calls[0]


def _specialize(fn, args, kwargs):
    """(signature, constexprs, attrs, options) as the runtime launcher would build them."""
    params = fn.params
    opts = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if kwargs.get(k) is not None}
    bound = list(args) + [kwargs[p.name] for p in params[len(args) :]]
    signature, constexprs, attrs = {}, {}, {}
    for i, (p, v) in enumerate(zip(params, bound)):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = v
            continue
        ty, spec = native_specialize_impl(
            BaseBackend, v, False, not p.do_not_specialize, not p.do_not_specialize_on_alignment
        )
        if ty == "constexpr":
            signature[p.name] = "constexpr"
            constexprs[(i,)] = v
            continue
        signature[p.name] = ty
        _attrs_at((i,), v, ty, spec, constexprs, attrs)
    return signature, constexprs, attrs, opts


def _attrs_at(path, v, ty, spec, constexprs, attrs):
    """The constexprs and attributes of one argument at ``path``, a tuple's elements at their nested paths
    (a bundle of arguments specializes element by element, as separate arguments would)."""
    if isinstance(ty, tuple):
        for j, (vj, tj, sj) in enumerate(zip(v, ty, spec)):
            _attrs_at((*path, j), vj, tj, sj, constexprs, attrs)
    elif ty == "constexpr":
        constexprs[path] = v
    elif isinstance(spec, str) and spec:
        attrs[path] = BaseBackend.parse_attr(spec)


def _res_usage(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        r = subprocess.run([_CUOBJDUMP, "-res-usage", path], capture_output=True, text=True)
        line = [x for x in r.stdout.splitlines() if "REG" in x]
        sass = subprocess.run([_CUOBJDUMP, "-sass", path], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return "cuobjdump not found", ""
    finally:
        os.unlink(path)
    return (line[0].strip() if line else r.stdout.strip()), sass


def _loop_waits(ttgir: str) -> str:
    """``num`` of each async_wait inside the main scf.for (0 = nothing left in flight: no overlap)."""
    lines = ttgir.splitlines()
    start = next((i for i, x in enumerate(lines) if "scf.for" in x), None)
    if start is None:
        return "-"
    nums = []
    depth = 0
    for x in lines[start:]:
        depth += x.count("{") - x.count("}")
        m = re.search(r"async_wait .*\{num = (\d+)", x)
        if m:
            nums.append(m.group(1))
        if depth <= 0:
            break
    return ",".join(nums) or "-"


def compile_case(case, dump=None):
    fn, (grid, args, kwargs) = _capture_launch(case)
    sig, consts, attrs, opts = _specialize(fn, args, kwargs)
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    res, sass = _res_usage(k.asm["cubin"])
    m = re.search(r"REG:(\d+)", res)
    regs = int(m.group(1)) if m else 255
    nw = opts.get("num_warps", 4)
    per_warp = -(-regs * 32 // 256) * 256
    occ = min(65536 // (per_warp * nw), (228 * 1024) // max(1, k.metadata.shared + 1024), 64 // nw, 32)
    tile = dict(zip(paged.PAGED_TILE, kwargs["TILE"]))
    row = {
        "case": case["name"],
        "cfg": (tile["BLOCK_M"], tile["BLOCK_N"], opts.get("num_warps"), opts.get("num_stages")),
        "tile_in_page": tile["TILE_IN_PAGE"],
        "async_copy": ttgir.count("async_copy_global_to_local"),
        "cp.async": len(re.findall(r"cp\.async\.(?:cg|ca)", ptx)),
        "ld.global": len(re.findall(r"\bld\.global", ptx)),
        "wgmma": ttgir.count("warp_group_dot "),
        "mma": ttgir.count("tt.dot ") + ttgir.count("mma_v2"),
        "waits": _loop_waits(ttgir),
        "smem": k.metadata.shared,
        "ctas_per_sm": occ,
        "LDL/STL": (len(re.findall(r"\bLDL\b", sass)), len(re.findall(r"\bSTL\b", sass))),
        "STS.U8": len(re.findall(r"\bSTS\.U8\b", sass)),
        "LDS.U8": len(re.findall(r"\bLDS\.U8\b", sass)),
        "res": res,
    }
    if dump:
        os.makedirs(dump, exist_ok=True)
        base = os.path.join(dump, re.sub(r"[^A-Za-z0-9]+", "_", case["name"]))
        for ext in ("ttgir", "ptx"):
            with open(f"{base}.{ext}", "w") as f:
                f.write(k.asm[ext])
        with open(f"{base}.sass", "w") as f:
            f.write(sass)
    return row


CASES = [
    {"name": "decode bf16q B64 L4096 p64", "batch": 64, "qlen": 1, "ctx": 4096, "page_size": 64, "q": torch.bfloat16},
    {"name": "decode e4m3q B64 L4096 p64", "batch": 64, "qlen": 1, "ctx": 4096, "page_size": 64, "q": E4M3},
    {"name": "decode bf16q B64 L4096 p16", "batch": 64, "qlen": 1, "ctx": 4096, "page_size": 16, "q": torch.bfloat16},
    {
        "name": "decode bf16q B1 L128k p64 s33",
        "batch": 1,
        "qlen": 1,
        "ctx": 131072,
        "page_size": 64,
        "q": torch.bfloat16,
        "splits": 33,
    },
    {"name": "prefill e4m3q 2k/8k p64", "batch": 1, "qlen": 2048, "ctx": 10240, "page_size": 64, "q": E4M3},
    {"name": "prefill bf16q 2k/8k p64", "batch": 1, "qlen": 2048, "ctx": 10240, "page_size": 64, "q": torch.bfloat16},
    {
        "name": "prefill e4m3q 2k/8k p64 vseq",
        "batch": 1,
        "qlen": 2048,
        "ctx": 10240,
        "page_size": 64,
        "q": E4M3,
        "v_seq_major": True,
    },
    {
        "name": "decode e4m3q B64 L4096 p64 vseq",
        "batch": 64,
        "qlen": 1,
        "ctx": 4096,
        "page_size": 64,
        "q": E4M3,
        "v_seq_major": True,
    },
    {
        "name": "decode bf16q B64 L4096 p64 vseq",
        "batch": 64,
        "qlen": 1,
        "ctx": 4096,
        "page_size": 64,
        "q": torch.bfloat16,
        "v_seq_major": True,
    },
    {
        "name": "prefill e4m3q 2k/8k p128 vseq",
        "batch": 1,
        "qlen": 2048,
        "ctx": 10240,
        "page_size": 128,
        "q": E4M3,
        "v_seq_major": True,
    },
    {"name": "prefill e4m3q 2k/8k p16", "batch": 1, "qlen": 2048, "ctx": 10240, "page_size": 16, "q": E4M3},
    {"name": "small e4m3q B32 q8 L4096 p64", "batch": 32, "qlen": 8, "ctx": 4096, "page_size": 64, "q": E4M3},
    {
        "name": "decode bf16q bf16kv B64 L4096 p16",
        "batch": 64,
        "qlen": 1,
        "ctx": 4096,
        "page_size": 16,
        "q": torch.bfloat16,
        "kv": torch.bfloat16,
    },
    {
        "name": "prefill bf16q bf16kv 2k/8k p64",
        "batch": 1,
        "qlen": 2048,
        "ctx": 10240,
        "page_size": 64,
        "q": torch.bfloat16,
        "kv": torch.bfloat16,
    },
    {
        "name": "decode bf16q bf16kv varlen p16",
        "batch": 64,
        "qlen": 1,
        "ctx": 4121,
        "page_size": 16,
        "q": torch.bfloat16,
        "kv": torch.bfloat16,
        "varlen": True,
    },
    {
        "name": "decode bf16q varlen p16",
        "batch": 64,
        "qlen": 1,
        "ctx": 4121,
        "page_size": 16,
        "q": torch.bfloat16,
        "varlen": True,
    },
    {
        "name": "mixed e4m3q varlen 2k/8k p16",
        "batch": 2,
        "qlen": 2048,
        "ctx": 10240,
        "page_size": 16,
        "q": E4M3,
        "varlen": True,
    },
    {
        "name": "mixed bf16q bf16kv varlen p16",
        "batch": 2,
        "qlen": 256,
        "ctx": 4096,
        "page_size": 16,
        "q": torch.bfloat16,
        "kv": torch.bfloat16,
        "varlen": True,
    },
    {
        "name": "mixed bf16q varlen p64 vseq",
        "batch": 2,
        "qlen": 256,
        "ctx": 4096,
        "page_size": 64,
        "q": torch.bfloat16,
        "varlen": True,
        "v_seq_major": True,
    },
    {
        # one page per sequence: the page table's row stride is 1, which triton specializes to a constexpr
        "name": "mixed bf16q varlen p64 one page",
        "batch": 2,
        "qlen": 16,
        "ctx": 64,
        "page_size": 64,
        "q": torch.bfloat16,
        "varlen": True,
    },
    {"name": "decode bf16q B64 L4096 p1", "batch": 64, "qlen": 1, "ctx": 4096, "page_size": 1, "q": torch.bfloat16},
]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default=None, help="write ttgir/ptx/sass per case into this folder")
    ap.add_argument("--only", default=None, help="substring filter on case names")
    ap.add_argument("--config", default=None, help='JSON tile override, e.g. {"block_n": 64, "num_stages": 3}')
    a = ap.parse_args(argv)
    for case in CASES:
        if a.only and a.only not in case["name"]:
            continue
        if a.config:
            case = dict(case, config=json.loads(a.config))
        try:
            r = compile_case(case, a.dump)
        except Exception as e:  # report and go on
            print(f"{case['name']:32s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        print(
            f"{r['case']:32s} cfg={r['cfg']} tile={r['tile_in_page']} async_copy={r['async_copy']} "
            f"cp.async={r['cp.async']} waits={r['waits']} smem={r['smem']} ctas/SM={r['ctas_per_sm']} ld.global={r['ld.global']} wgmma={r['wgmma']} STS.U8={r['STS.U8']} LDS.U8={r['LDS.U8']} LDL/STL={r['LDL/STL']} "
            f"| {r['res']}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
