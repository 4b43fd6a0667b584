"""`fp8attn bench host`: the per-call host cost of every public entry point, called eagerly.

Most users call attention once per layer per step without CUDA graphs, so a call's host path
(validation, dispatch, launch planning, argument packing, small torch ops around the kernels) is paid
on every call. Method (docs/benchmarks.md): tiny inputs keep the GPU idle, so the time per call is the
host's; 20 warm-up calls (the first call is reported separately as ``cold_ms``: compile, autotuning),
then ``calls`` back-to-back calls and one final synchronize. Kernel launches and device-to-host copies
per call come from the torch profiler. The peer is torch SDPA on bf16 tensors of the same shape
(``sdpa_bf16``: torch's default backend choice; ``sdpa_flash_bf16``: the flash backend).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch

from .common import results_header, write_results

__all__ = ["run", "per_call_ms", "interleaved_ms", "profile_counts"]

WARMUP = 20
ROUNDS = 7  # timed rounds per entry, interleaved with the peers' and the other entries' (medians reported)


def per_call_ms(fn, calls: int = 300) -> tuple[float, float, float]:
    """(cold_ms, per_call_ms, issue_ms): the first call; then ``calls`` calls after warm-up and one
    synchronize, per call; and the same calls' time before that synchronize (the host's own time when the
    GPU keeps up: 300 calls of a few launches never fill the launch queue)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    cold = (time.perf_counter() - t0) * 1e3
    for _ in range(WARMUP):
        fn()
    return (cold, *_timed(fn, calls))


def _timed(fn, calls: int) -> tuple[float, float]:
    """(per_call_ms, issue_ms) of ``calls`` back-to-back calls and one synchronize (``per_call_ms``)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t2 - t0) * 1e3 / calls, (t1 - t0) * 1e3 / calls


def interleaved_ms(fns: dict, calls: int = 300, rounds: int = ROUNDS, grad: frozenset = frozenset()) -> dict:
    """name -> (per_call_ms, issue_ms): the median over ``rounds`` rounds, each timing every function of
    ``fns`` once in turn (warmed up before), so that the host's speed drifting during a run (a clock ramp, a
    neighbour's load) reaches every entry and its peers alike rather than whichever ran first. Names in
    ``grad`` run with grad mode on."""
    runs: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            with torch.enable_grad() if name in grad else torch.no_grad():
                runs[name].append(_timed(fn, calls))
    return {
        name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for name, rs in runs.items()
    }


def profile_counts(fn, reps: int = 10) -> dict:
    """Kernel launches and device-to-host copies per call, from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    launches = d2h = 0
    gpu_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    for e in prof.events():
        name = e.name
        if name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"):
            launches += 1
        elif "Memcpy DtoH" in name or name == "cudaMemcpyDtoH":
            d2h += 1
    return {"launches": launches / reps, "d2h_copies": d2h / reps, "gpu_us": round(gpu_us / reps, 2)}


def _python_profile(fn, calls: int = 200, top: int = 25) -> str:
    """The cProfile table (cumulative time) of ``calls`` calls: where the host time goes."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(top)
    return s.getvalue()


def _entries(shape: str, d: int):
    """{entry name: (callable, params)} for one shape class and head dim; peers under 'peer:'."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fp8attn
    from fp8attn import ops
    from fp8attn.paged_cache import alloc_paged_cache, make_page_table

    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    if shape == "tiny":
        b, s, hq, hk = 1, 128, 4, 4
        db, dl, dhq, dhk = 8, 500, 4, 4
    else:
        b, s, hq, hk = 1, 4096, 32, 8
        db, dl, dhq, dhk = 64, 4096, 32, 8
    qb, kb, vb = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) for h in (hq, hk, hk))
    q8, k8, v8, qd, kd, vd = fp8attn.quantize_qkv(qb, kb, vb)
    out = torch.empty(b, s, hq, d, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(0, (b + 1) * s, s, device=dev, dtype=torch.int32)
    q8v, k8v, v8v = q8.reshape(b * s, hq, d), k8.reshape(b * s, hk, d), v8.reshape(b * s, hk, d)
    ps = 64
    pages = (dl + ps - 1) // ps + 1
    nblk = db * pages * 2
    kc, vc = alloc_paged_cache(nblk, ps, dhk, d, device=dev, v_seq_major=True)
    pt = make_page_table([dl + 1] * db, ps, nblk, generator=g).to(dev)
    seqlens = torch.full((db,), dl, dtype=torch.int32, device=dev)
    qdec = torch.randn(db, 1, dhq, d, device=dev, dtype=torch.bfloat16)
    knew = torch.randn(db, 1, dhk, d, device=dev, dtype=torch.bfloat16)
    vnew = torch.randn(db, 1, dhk, d, device=dev, dtype=torch.bfloat16)
    cdesc = torch.full((db, dhk), 0.05, device=dev)
    slots = pt[:, dl // ps].long() * ps + dl % ps
    seq_rows = torch.arange(db, device=dev, dtype=torch.int32)
    splits = 4
    op_ = torch.randn(splits, b, s, hq, d, device=dev)
    lp_ = torch.randn(splits, b, s, hq, device=dev)

    fa = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    e = {
        "flash_attn_func": lambda: fp8attn.flash_attn_func(q8, k8, v8, **fa),
        "flash_attn_func out=": lambda: fp8attn.flash_attn_func(q8, k8, v8, **fa, out=out),
        "flash_attn_varlen_func": lambda: fp8attn.flash_attn_varlen_func(q8v, k8v, v8v, cu, cu, s, s, **fa),
        "flash_attn_with_kvcache decode": lambda: fp8attn.flash_attn_with_kvcache(
            qdec, kc, vc, cache_seqlens=seqlens, page_table=pt, k_descale=cdesc, v_descale=cdesc
        ),
        "flash_attn_with_kvcache decode+append": lambda: fp8attn.flash_attn_with_kvcache(
            qdec, kc, vc, k=knew, v=vnew, cache_seqlens=seqlens, page_table=pt, k_descale=cdesc, v_descale=cdesc
        ),
        "write_kv_cache": lambda: fp8attn.write_kv_cache(
            knew[:, 0], vnew[:, 0], kc, vc, slots, k_descale=cdesc, v_descale=cdesc, token_seq_idx=seq_rows
        ),
        "quantize_qkv": lambda: fp8attn.quantize_qkv(qb, kb, vb),
        "flash_attn_combine": lambda: fp8attn.flash_attn_combine(op_, lp_),
        "op dense_fwd": lambda: torch.ops.fp8attn.dense_fwd(
            q8,
            k8,
            v8,
            None,
            None,
            None,
            None,
            None,
            None,
            d**-0.5,
            True,
            -1,
            0,
            0.0,
            qd,
            kd,
            vd,
            None,
            None,
            False,
            0,
            False,
        ),
        "op paged_fwd": lambda: ops.paged_fwd(
            qdec,
            kc,
            vc,
            pt,
            seqlens,
            softmax_scale=d**-0.5,
            causal=True,
            window_size=(-1, 0),
            softcap=0.0,
            q_descale=None,
            k_descale=cdesc,
            v_descale=cdesc,
        ),
    }

    def with_grad():
        with torch.enable_grad():
            return fp8attn.flash_attn_func(q8, k8, v8, **fa)

    e["flash_attn_func grad-mode"] = with_grad
    # the part of a planned flash_attn_func call before its allocation and launch: the signature, its lookup
    # and the eager check (plan.cached), with the call's own tensors and arguments
    from fp8attn import plan

    tensors = (q8, k8, v8, qd, kd, vd, None, None)
    sig_args = (None, True, (-1, -1), 0.0, 1, None, False, 0, False, None, None)
    e["floor plan signature"] = lambda: plan.cached(plan.call_key("dense", tensors, sig_args), tensors)
    peers = {}
    for key, dims in (("dense", (b, s, hq, hk)), ("decode", (db, 1, dhq, dhk))):
        bb, ss, h1, h2 = dims
        sk = ss if key == "dense" else dl
        qp = torch.randn(bb, h1, ss, d, device=dev, dtype=torch.bfloat16)
        kp = torch.randn(bb, h2, sk, d, device=dev, dtype=torch.bfloat16)
        vp = torch.randn(bb, h2, sk, d, device=dev, dtype=torch.bfloat16)
        causal = key == "dense"
        peers[f"sdpa_bf16 {key}"] = lambda qp=qp, kp=kp, vp=vp, c=causal: F.scaled_dot_product_attention(
            qp, kp, vp, is_causal=c, enable_gqa=True
        )

        def flash(qp=qp, kp=kp, vp=vp, c=causal, h1=h1, h2=h2):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                kk = kp.repeat_interleave(h1 // h2, 1) if h1 != h2 else kp
                vv = vp.repeat_interleave(h1 // h2, 1) if h1 != h2 else vp
                return F.scaled_dot_product_attention(qp, kk, vv, is_causal=c)

        peers[f"sdpa_flash_bf16 {key}"] = flash
    params = {
        "dense": {"batch": b, "seqlen_q": s, "seqlen_k": s, "nheads_q": hq, "nheads_k": hk, "headdim": d},
        "decode": {"batch": db, "seqlen_q": 1, "seqlen_k": dl, "nheads_q": dhq, "nheads_k": dhk, "headdim": d},
    }
    return e, peers, params


def _floor_kernel(nargs: int):
    """A do-nothing @triton.jit kernel of one pointer and ``nargs`` integer arguments."""
    from . import _floor_kernels

    return getattr(_floor_kernels, f"floor_{nargs}")


def _floors(d: int) -> dict:
    """The costs under every entry point: a torch.empty, a Triton JIT launch of a do-nothing kernel with 1
    and 64 integer arguments, the same kernels' compiled launcher called directly, and torch SDPA."""
    x = torch.empty(16, device="cuda")
    out = {"floor torch.empty": lambda: torch.empty((1, 128, 4, d), device="cuda", dtype=torch.bfloat16)}
    for n in (1, 64):
        k = _floor_kernel(n)
        args = (x, *range(3, 3 + n))
        out[f"floor triton jit launch {n} args"] = lambda k=k, args=args: k[(1,)](*args)
        ck = k[(1,)](*args)
        drv = __import__("triton").runtime.driver.active
        dev = drv.get_current_device()
        stream = drv.get_current_stream(dev)
        out[f"floor triton compiled run {n} args"] = lambda ck=ck, args=args, stream=stream: ck.run(
            1, 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, *args
        )
    return out


def _peer_key(entry: str) -> str:
    return "decode" if ("kvcache" in entry or "paged" in entry or "write_kv" in entry) else "dense"


def run(out_dir=None, quick: bool = False, calls: int = 300, profile_dir: str | None = None):
    doc = results_header("host")
    doc["method"] = (
        f"{WARMUP} warm-up calls, then {calls} back-to-back eager calls and one synchronize, timed in {ROUNDS} rounds "
        "that take every entry and peer of a shape in turn; ms per call, the median over the rounds; cold_ms is "
        "the first call; launches / d2h_copies per call from the profiler"
    )
    shapes = ("tiny",) if quick else ("tiny", "real")
    dims = (64,) if quick else (64, 128)
    table = []
    with torch.no_grad():
        for shape in shapes:
            for d in dims:
                entries, peers, params = _entries(shape, d)
                if shape == "tiny":
                    entries.update(_floors(d))
                grad = frozenset(name for name in entries if "grad-mode" in name)
                cold, counts = {}, {}
                for name, fn in {**peers, **entries}.items():  # first calls, warm-up, profiler counts
                    with torch.enable_grad() if name in grad else torch.no_grad():
                        cold[name] = per_call_ms(fn, WARMUP)[0]
                        if name in entries:
                            counts[name] = profile_counts(fn)
                            if profile_dir:
                                Path(profile_dir).mkdir(parents=True, exist_ok=True)
                                fname = f"{shape}_d{d}_{name.replace(' ', '_').replace('=', '').replace('+', '_')}.txt"
                                (Path(profile_dir) / fname).write_text(_python_profile(fn))
                timed = interleaved_ms({**peers, **entries}, calls, grad=grad)
                peer_ms = {name: timed[name] for name in peers}
                for name in entries:
                    ms, issue = timed[name]
                    pk = _peer_key(name)
                    case = {
                        "case": f"{name} {shape} d{d}",
                        "params": {"entry": name, "shape": shape, **params[pk]},
                        "ours": {
                            "ms": round(ms, 5),
                            "tflops": None,
                            "gbps": None,
                            "err": None,
                            "issue_ms": round(issue, 5),
                            "cold_ms": round(cold[name], 3),
                            **counts[name],
                        },
                        "peers": {
                            p: {"ms": round(peer_ms[f"{p} {pk}"][0], 5), "issue_ms": round(peer_ms[f"{p} {pk}"][1], 5)}
                            for p in ("sdpa_bf16", "sdpa_flash_bf16")
                        },
                    }
                    doc["cases"].append(case)
                    table.append(
                        (
                            case["case"],
                            ms * 1e3,
                            issue * 1e3,
                            peer_ms[f"sdpa_bf16 {pk}"][0] * 1e3,
                            counts[name]["gpu_us"],
                            counts[name]["launches"],
                            counts[name]["d2h_copies"],
                        )
                    )
    path = write_results(doc, out_dir)
    _plot(doc, path.with_suffix(".png"))
    print(
        f"{'case':48s} {'us/call':>8s} {'issue':>7s} {'sdpa us':>8s} {'ratio':>6s} {'gpu us':>7s} {'launch':>6s} "
        f"{'d2h':>4s}"
    )
    for c, us, iss, pus, gus, la, dh in table:
        print(f"{c:48s} {us:8.1f} {iss:7.1f} {pus:8.1f} {us / pus:6.2f} {gus:7.1f} {la:6.1f} {dh:4.1f}")
    return path


def _plot(doc, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    cases = [c for c in doc["cases"] if c["params"]["shape"] == "tiny"]
    if not cases:
        return
    names = [c["case"] for c in cases]
    ours = [c["ours"]["ms"] * 1e3 for c in cases]
    peer = [c["peers"]["sdpa_bf16"]["ms"] * 1e3 for c in cases]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(names) + 1.5))
    y = range(len(names))
    ax.barh([i + 0.2 for i in y], ours, height=0.4, label="fp8attn (eager)")
    ax.barh([i - 0.2 for i in y], peer, height=0.4, label="torch SDPA bf16 (same shape class)")
    ax.set_yticks(list(y))
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlabel("host time per call (us), tiny inputs")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
