"""Fingerprints of the sm_90a PTX of every attention kernel family, compiled without a GPU.

A refactor that must not change the generated code (helpers factored out, loops unrolled from one copy)
is checked by running this before and after and comparing the output: one line per configuration, the
configuration and a hash of its PTX with the debug sections and line markers removed (they move with
the source lines). Covers the Triton dense kernel (causal, sliding windows, e4m3 and bf16 inputs), the
Triton paged kernel (decode, prefill, windows, mixed varlen batches) and the Gluon TMA kernels (dense,
paged, varlen, V transposed in shared memory; with and without an LSE; head dims 64, 128, 256; the dense
kernel's three-consumer variant; at head dim 64 both K boxes, plain and key-permuted; qk 192 / v 128) and the
backward (the Triton kernels' launches of ``aot_backward_sm90.CASES``, the Gluon kernel's ``HOPPER`` cases).

Usage (repo root): ``python tools/ptx_fingerprints_sm90.py > before.txt``; change; again into
``after.txt``; ``diff before.txt after.txt``. ``--backward``: the backward kernels only; ``--backward --all``: both.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"
os.environ["FP8ATTN_NO_AUTOTUNE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aot_paged_sm90 as aot  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from fp8attn.kernels import dense, paged  # noqa: E402
from fp8attn.kernels.hopper import dense_launch  # noqa: E402

E4M3 = torch.float8_e4m3fn


def fingerprint(ptx: str) -> str:
    """Hash of the PTX without its DWARF sections, ``.loc`` / ``.file`` lines, comments and label names."""
    cut = ptx.find(".section\t.debug")
    ptx = ptx if cut < 0 else ptx[:cut]
    lines = (
        re.sub(r"\$L__\w+", "L", x)
        for x in ptx.splitlines()
        if not x.strip().startswith((".loc", ".file", "//")) and "$L__tmp" not in x
    )
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12]


def _compile_captured(fn, call) -> str:
    _, args, kwargs = call
    sig, consts, attrs, opts = aot._specialize(fn, args, kwargs)
    k = triton.compile(
        triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=opts,
    )
    return fingerprint(k.asm["ptx"])


def dense_case(causal, window, q_dtype, b=2, s=300, d=128):
    real = dense._dense_fwd_kernel
    cap = aot._Capture(real)
    dense._dense_fwd_kernel = cap
    try:
        q = torch.zeros(b, s, 8, d, dtype=q_dtype)
        k = torch.zeros(b, s, 2, d, dtype=q_dtype)
        out = torch.empty(b, s, 8, d, dtype=torch.bfloat16)
        ds = torch.ones(b, 2) if q_dtype == E4M3 else None
        dense.launch_dense_fwd(
            q,
            k,
            k.clone(),
            out,
            torch.empty(b, 8, s),
            softmax_scale=d**-0.5,
            causal=causal,
            window_size=window,
            softcap=0.0,
            q_descale=ds,
            k_descale=ds,
            v_descale=ds,
            v_kmajor=False,
        )
    finally:
        dense._dense_fwd_kernel = real
    return _compile_captured(real, cap.calls[0])


def paged_case(causal, window, q_dtype, qlen, page_size=64, varlen=False):
    real, real_combine = paged._paged_fwd_kernel, paged.launch_combine
    cap = aot._Capture(real)
    paged._paged_fwd_kernel, paged.launch_combine = cap, (lambda *a, **k: None)
    try:
        b, L, hq, hk, d = 2, 700, 8, 2, 128
        pages = -(-L // page_size)
        kc = torch.zeros(2 * pages, page_size, hk, d, dtype=E4M3)
        q = torch.zeros(b, qlen, hq, d, dtype=q_dtype)
        out = torch.empty(b, qlen, hq, d, dtype=torch.bfloat16)
        lse = torch.empty(b, hq, qlen)
        ds = torch.ones(b, hk)
        kw = dict(k_descale=ds, v_descale=ds, q_descale=ds if q_dtype == E4M3 else None)
        if varlen:  # a decode row and a prefill chunk: two tile classes in one launch
            q, out, lse = q.view(b * qlen, hq, d), out.view(b * qlen, hq, d), torch.empty(hq, b * qlen)
            kw["cu_seqlens_q"] = torch.tensor([0, 1, b * qlen], dtype=torch.int32)
        paged.launch_paged_fwd(
            q,
            kc,
            kc.clone(),
            torch.zeros(b, pages, dtype=torch.int32),
            torch.full((b,), L, dtype=torch.int32),
            out,
            lse,
            max_seqlen_q=qlen,
            softmax_scale=d**-0.5,
            causal=causal,
            window_size=window,
            num_splits=1,
            config={"tma": False},
            **kw,
        )
    finally:
        paged._paged_fwd_kernel, paged.launch_combine = real, real_combine
    return _compile_captured(real, cap.calls[0])


def backward_rows():
    """(name, fingerprint) of the backward kernels: the launches ``aot_backward_sm90`` captures, and the Hopper
    kernel's cases."""
    import aot_backward_sm90 as ab

    rows = []
    for case in ab.CASES:
        for i, (fn, call) in enumerate(ab.capture(case)):
            rows.append((f"backward {case['name']} launch {i} {fn.__name__}", _compile_captured(fn, call)))
    if dense_launch.HAS_GLUON:
        from fp8attn.kernels.hopper import backward_launch

        for d, causal, fp8, mode in ab.HOPPER:
            k = backward_launch._aot_compile(causal=causal, head_dim=d, fp8=fp8, v_seq_major=fp8, mode=mode)
            tag = "" if mode == "dequantized" else f" mode={mode}"  # (the dequantized kernel's names as before)
            rows.append((f"hopper backward d={d} causal={causal} fp8={fp8}{tag}", fingerprint(k.asm["ptx"])))
    return rows


def main():
    rows = backward_rows() if "--backward" in sys.argv else []
    if "--backward" in sys.argv and "--all" not in sys.argv:
        for name, h in rows:
            print(h, name, flush=True)
        return
    for causal, window in ((False, (-1, -1)), (True, (-1, 0)), (True, (64, 0)), (False, (64, 32))):
        for q_dtype in (E4M3, torch.bfloat16):
            rows.append((f"dense causal={causal} window={window} q={q_dtype}", dense_case(causal, window, q_dtype)))
    for causal, window in ((True, (-1, 0)), (True, (100, 0)), (False, (-1, -1))):
        for q_dtype in (E4M3, torch.bfloat16):
            for qlen in (1, 300):
                rows.append(
                    (
                        f"paged causal={causal} window={window} q={q_dtype} qlen={qlen}",
                        paged_case(causal, window, q_dtype, qlen),
                    )
                )
    rows.append(("paged varlen mixed", paged_case(True, (-1, 0), E4M3, 300, 64, True)))
    rows.append(("paged varlen mixed window bf16 page16", paged_case(True, (50, 0), torch.bfloat16, 300, 16, True)))
    if dense_launch.HAS_GLUON:
        tma = [
            dict(causal=c, write_lse=w, head_dim=d)
            for c in (False, True)
            for w in (False, True)
            for d in (64, 128, 256)
        ]
        tma += [dict(causal=False, write_lse=w, head_dim=128, mode=m) for w in (False, True) for m in (1, 2, 3)]
        tma += [
            dict(causal=False, write_lse=False, head_dim=128, mode=3, v_rows=True, box=16),
            dict(causal=False, write_lse=False, head_dim=64, mode=1, block_n=64),
            dict(causal=False, write_lse=False, head_dim=128, out_fp8=True),
        ]
        tma += [dict(causal=False, write_lse=w, head_dim=64, consumers=3) for w in (False, True)]
        # head dim 64 on the plain K box where the launcher's rule permutes it (the tests force it)
        tma += [
            dict(causal=c, write_lse=w, head_dim=64, kperm=False)
            for c, w in ((False, False), (True, False), (True, True))
        ]
        # MLA prefill's qk 192 / v 128 (Q and K in three 64-wide boxes)
        tma += [dict(causal=c, write_lse=w, head_dim=192, head_dim_v=128) for c in (False, True) for w in (False, True)]
        tma += [dict(causal=c, write_lse=c, head_dim=192, head_dim_v=128, mode=2) for c in (False, True)]
        for cfg in tma:
            rows.append((f"tma {cfg}", fingerprint(dense_launch._aot_compile(**cfg).asm["ptx"])))
    for name, h in rows:
        print(h, name, flush=True)


if __name__ == "__main__":
    main()
