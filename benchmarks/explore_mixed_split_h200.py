"""Where a mixed batch's time goes on one H200 (32 decode rows at 4096 keys + one 2048-query FP8 chunk
over an 8192 prefix, 32 q / 8 kv heads, d128, sequence-major V, pages 64 and 128): the call's parts
(the Triton kernel's launches for the rows below 128 queries, the block list, the TMA kernel for the
chunk) alone and together, in both orders, against the fixed-length launches of the decode rows and of
the chunk, eager and (``*_graphed_ms``) as CUDA-graph replays, also with FA3's V layout (``*_fa3``), and
the GPU time of each kernel of one call in launch order (the source of
``results/h200/explore/mixed_split*.json``). Usage (repo root, GPU machine):
``OUT=<dir> [NAME=<file>.json] PYTHONPATH=src python benchmarks/explore_mixed_split_h200.py``.
"""
import json
import math
import os
from types import SimpleNamespace

import torch

from fp8attn.bench.common import graph_replay, kernel_times_us, time_ms
from fp8attn.bench.paged import D, E4M3, HK, HQ, _paged_pool
from fp8attn.kernels.hopper import dense_launch, paged_launch
from fp8attn.kernels.paged import launch_paged_fwd
from fp8attn.paged import to_v_seq_major

N_DEC, CTX, CHUNK, PREFIX = 32, 4096, 2048, 8192


def _block_list(cu, seqlens, total_q):
    try:
        return dense_launch.varlen_block_list(cu, seqlens, False, total_q, 128)
    except TypeError:  # the list before 8-slot entries (commits up to 4346390), for before/after runs
        return dense_launch.varlen_block_list(cu, total_q, 128)


def _kernel_sequence(fn, reps=20):
    """[(kernel name, mean GPU us)] of one ``fn()`` in launch order (the profiler's kernel events, which
    ``kernel_times_us`` would merge by name: two launches of one kernel stay apart here)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                 and e.device_time_total > 0 and "Memset" not in e.name and "Memcpy" not in e.name),
                key=lambda e: e.time_range.start)
    n = len(ev) // reps
    return [(ev[i].name[:40], round(sum(ev[r * n + i].device_time_total for r in range(reps)) / reps, 2))
            for i in range(n)]


def mixed_inputs(page):
    """The mixed batch at one page size: a namespace of its tensors (``vc`` FA3's V layout, ``vs`` the same V
    sequence-major), the call's keyword arguments ``base``, the decode rows' and the chunk's own views
    (``qd_`` / ``qc_``) and outputs (``od`` / ``oc``)."""
    b = N_DEC + 1
    L = PREFIX + CHUNK
    pd, pc = math.ceil(CTX / page), math.ceil(L / page)
    kc, vc, pts = _paged_pool(1, N_DEC * pd * page + pc * page, page, 1)
    flat = pts[0].view(-1)
    pt = torch.full((b, pc), -1, dtype=torch.int32, device="cuda")
    pt[:N_DEC, :pd] = flat[:N_DEC * pd].view(N_DEC, pd)
    pt[N_DEC] = flat[N_DEC * pd:N_DEC * pd + pc]
    seqlens = torch.tensor([CTX] * N_DEC + [L], dtype=torch.int32, device="cuda")
    qlens = [1] * N_DEC + [CHUNK]
    cu = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(qlens), HQ, D, device="cuda").to(E4M3)
    dd = torch.rand(b, HK, device="cuda") + 0.5
    ds = dict(q_descale=dd, k_descale=dd, v_descale=dd)
    return SimpleNamespace(
        kc=kc, vc=vc, vs=to_v_seq_major(vc), pt=pt, seqlens=seqlens, qlens=qlens, cu=cu, q=q, ds=ds,
        out=torch.empty(sum(qlens), HQ, D, device="cuda", dtype=torch.bfloat16),
        base=dict(cu_seqlens_q=cu, max_seqlen_q=CHUNK, softmax_scale=D ** -0.5, causal=True, **ds),
        od=torch.empty(N_DEC, 1, HQ, D, device="cuda", dtype=torch.bfloat16),
        oc=torch.empty(1, CHUNK, HQ, D, device="cuda", dtype=torch.bfloat16),
        qd_=q[:N_DEC].view(N_DEC, 1, HQ, D), qc_=q[N_DEC:].view(1, CHUNK, HQ, D))


def main():
    rows = []
    for page in (64, 128):
        m = mixed_inputs(page)
        kc, vc, vs, pt, seqlens, qlens, cu, q, ds, out, base, od, oc, qd_, qc_ = (
            m.kc, m.vc, m.vs, m.pt, m.seqlens, m.qlens, m.cu, m.q, m.ds, m.out, m.base, m.od, m.oc, m.qd_, m.qc_)
        sub = lambda s: {k: v[s] for k, v in ds.items()}  # noqa: E731

        fns = {
            "call": lambda: launch_paged_fwd(q, kc, vs, pt, seqlens, out, None, **base),
            "triton_one_launch": lambda: launch_paged_fwd(q, kc, vs, pt, seqlens, out, None, **base,
                                                          config={"tma": False}),
            "triton_part": lambda: launch_paged_fwd(q, kc, vs, pt, seqlens, out, None, **base,
                                                    config={"tma": False, "split_at": paged_launch.VARLEN_MIN_Q}),
            "tma_part": lambda: paged_launch.launch_paged_prefill_tma(
                q, kc, vs, pt, seqlens, out, None, softmax_scale=D ** -0.5, causal=True, cu_seqlens_q=cu,
                min_len_q=128, **ds),
            "block_list": lambda: _block_list(cu, seqlens, sum(qlens)),
            "decode_alone": lambda: launch_paged_fwd(qd_, kc, vs, pt[:N_DEC], seqlens[:N_DEC], od, None,
                                                     max_seqlen_q=1, softmax_scale=D ** -0.5, causal=True,
                                                     **sub(slice(0, N_DEC))),
            "chunk_alone": lambda: launch_paged_fwd(qc_, kc, vs, pt[N_DEC:], seqlens[N_DEC:], oc, None,
                                                    max_seqlen_q=CHUNK, softmax_scale=D ** -0.5, causal=True,
                                                    **sub(slice(N_DEC, None))),
        }
        fns["separate"] = lambda: (fns["decode_alone"](), fns["chunk_alone"]())
        # The TMA kernel alone over a list built once (no list launch in the timing): the mixed batch's
        # list, and the chunk as a varlen batch of one (q_row 0), against the fixed-length launch
        lists = {"mixed": _block_list(cu, seqlens, sum(qlens)),
                 "one": _block_list(cu[-2:] - cu[-2], seqlens[N_DEC:], CHUNK)}
        if "block_list" in paged_launch.launch_paged_prefill_tma.__code__.co_varnames:
            fns["tma_only"] = lambda: paged_launch.launch_paged_prefill_tma(
                q, kc, vs, pt, seqlens, out, None, softmax_scale=D ** -0.5, causal=True, cu_seqlens_q=cu,
                min_len_q=128, block_list=lists["mixed"], **ds)
            fns["tma_only_one_seq"] = lambda: paged_launch.launch_paged_prefill_tma(
                qc_[0], kc, vs, pt[N_DEC:], seqlens[N_DEC:], oc[0], None, softmax_scale=D ** -0.5, causal=True,
                cu_seqlens_q=cu[-2:] - cu[-2], min_len_q=128, block_list=lists["one"], **sub(slice(N_DEC, None)))
        # FA3's V layout (the cache flash_attn_with_kvcache takes)
        fns["call_fa3"] = lambda: launch_paged_fwd(q, kc, vc, pt, seqlens, out, None, **base)
        fns["separate_fa3"] = lambda: (
            launch_paged_fwd(qd_, kc, vc, pt[:N_DEC], seqlens[:N_DEC], od, None, max_seqlen_q=1,
                             softmax_scale=D ** -0.5, causal=True, **sub(slice(0, N_DEC))),
            launch_paged_fwd(qc_, kc, vc, pt[N_DEC:], seqlens[N_DEC:], oc, None, max_seqlen_q=CHUNK,
                             softmax_scale=D ** -0.5, causal=True, **sub(slice(N_DEC, None))))
        fns["tma_then_triton"] = lambda: (fns["tma_part"](), fns["triton_part"]())
        row = {"page": page}
        for name, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            row[name + "_ms"] = time_ms(fn)
        row["call_kernels_us"] = kernel_times_us(fns["call"])
        row["call_launches_us"] = _kernel_sequence(fns["call"])
        row["separate_launches_us"] = _kernel_sequence(fns["separate"])
        for name in ("call", "tma_part", "chunk_alone", "separate", "triton_part", "decode_alone", "call_fa3",
                     "separate_fa3", "tma_only", "tma_only_one_seq"):
            if name not in fns:
                continue  # CUDA-graph replays (no host gaps), best of two medians
            call, graphed = graph_replay([fns[name]])
            row[name + "_graphed_ms"] = min(time_ms(call) for _ in range(2)) if graphed else None
        rows.append(row)
        print(row, flush=True)
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "out"), os.environ.get("NAME", "mixed_split.json")), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{'page':>5} " + " ".join(f"{k[:-3]:>22}" for k in rows[0] if k.endswith("_ms")))
    for r in rows:
        print(f"{r['page']:>5} " + " ".join(f"{v or 0:22.4f}" for k, v in r.items() if k.endswith("_ms")))
        print("  kernels of one call (us):", r["call_launches_us"])
        print("  kernels of the separate launches (us):", r["separate_launches_us"])


if __name__ == "__main__":
    main()
