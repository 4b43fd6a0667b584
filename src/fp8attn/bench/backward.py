"""`fp8attn bench backward`: FP8 attention forward + backward for training vs torch SDPA bf16, one process.

Setup as the dense forward sweep: 16 heads, batch * seqlen = 16k tokens, seqlen 1k..16k, head dims
64/128/256, causal on/off, bf16 leaves that require grad. Per (head dim, seqlen, causal) and
``params.pass``:

* ``fwd_bwd`` -- ``fp8attn.attention`` forward (dynamic quantization inside the timed region) and
  ``torch.autograd.grad`` of its output; the peers the same with ``scaled_dot_product_attention``.
* ``bwd`` -- the backward alone (``torch.autograd.grad(..., retain_graph=True)`` over one forward);
  ``ours.ms_op`` is the ``fp8attn::dense_bwd`` op alone (without the straight-through casts), and
  ``ours.ms_op_deterministic`` the same op with ``deterministic=True`` (the dQ pass without atomics, where
  the default adds dQ atomically: the two forms side by side in one process), and ``ours.ms_op_triton`` the
  op with ``FP8ATTN_BWD_BACKEND=triton`` (the Triton kernels where the default takes the Hopper kernel: its
  A/B in the same process).

One case per ``params.mode`` ("dequantized" / "fp8" backward); the peers (``sdpa_cudnn_bf16``,
``sdpa_flash_bf16``) are measured once per (head dim, seqlen, causal, pass) and listed in both.
FLOPs: forward 4*B*H*Sq*Sk*D (halved for causal), backward 2.5x that (five matmuls to two),
forward + backward 3.5x. ``peak_mb`` (fwd_bwd): the peak allocated memory of one step above the
inputs; ``saved_mb``: the bytes autograd saves for the backward (FP8 Q/K/V, descales, O and LSE for
ours). ``err``: the largest relative L2 error of dQ, dK, dV (batch 0, head 0) vs float64 autograd of
exact attention on the same bf16 inputs, next to ``err_out`` (the forward output's) -- at seqlen <= 4k
(the float64 oracle's memory); peers carry their own ``err``. ``kernels_us`` / ``kernels_sum_us``
(fwd_bwd at ``KERNEL_SEQLENS``, ours and peers): each kernel's GPU time per step under the torch profiler
and their sum, so that a step's GPU time and its host-bound gaps read apart from ``ms``.
"""

from __future__ import annotations

import torch

from .common import attn_flops, kernel_times_us, results_header, time_ms, with_env, write_results

__all__ = ["run"]

MODES = ("dequantized", "fp8")
ERR_MAX_SEQLEN = 4096
KERNEL_REPS = 5  # profiled steps per fwd_bwd case (kernels_us)
KERNEL_SEQLENS = (1024, 4096)  # the cases profiled (a profile costs seconds): the host-bound length, the goal's
BWD_BACKEND_ENV = "FP8ATTN_BWD_BACKEND"  # the backward's kernel choice (docs/api.md)


def _saved_mb(fn):
    """MiB of the tensors autograd saves during ``fn()`` (distinct storages counted once)."""
    seen = {}

    def pack(t):
        try:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except Exception:
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values()) / 2**20


def _peak_mb(step):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _errors(fwd, leaves, do, causal):
    """(max gradient error, output error) of ``fwd`` on batch 0, head 0 vs float64 autograd of exact attention."""
    from ..reference import attention_ref

    sub = [x[:1, :, :1].detach().clone().requires_grad_(True) for x in leaves]
    o = fwd(*sub)
    grads = torch.autograd.grad(o, sub, do[:1, :, :1])
    ref_leaves = [x.detach().double().requires_grad_(True) for x in sub]
    ref = attention_ref(*ref_leaves, causal=causal, compute_dtype=torch.float64)
    want = torch.autograd.grad(ref, ref_leaves, do[:1, :, :1].double())
    return max(_rel(g, w) for g, w in zip(grads, want)), _rel(o, ref)


def _case(d, s, causal, pss, mode, b, nheads, ours, peers, errors):
    case = {
        "case": f"d{d} S{s} causal={int(causal)} {pss} {mode}",
        "params": {
            "batch": b,
            "seqlen_q": s,
            "seqlen_k": s,
            "nheads_q": nheads,
            "nheads_k": nheads,
            "headdim": d,
            "causal": causal,
            "pass": pss,
            "mode": mode,
            "dtype": "bfloat16",
            "granularity": "per_head",
        },
        "ours": ours,
        "peers": peers,
    }
    if errors:
        case["peer_errors"] = errors
    return case


def _timed(step, flops):
    step()
    ms = time_ms(step)
    return {"ms": ms, "tflops": flops / ms / 1e9, "gbps": None}


def _gpu_time(step) -> dict:
    """``kernels_us`` (each kernel's mean GPU microseconds per ``step()`` under the torch profiler) and
    ``kernels_sum_us`` (their sum: the step's GPU time, beside ``ms``, its wall time with the host's gaps)."""
    kt = kernel_times_us(step, reps=KERNEL_REPS)
    return {"kernels_us": kt, "kernels_sum_us": round(sum(kt.values()), 1)}


def run(out_dir=None, quick=False, headdims=None):
    """Run the sweep (``headdims``: instead of the grid's); write backward.json into ``out_dir`` (default
    benchmarks/results/<gpu>/)."""
    import fp8attn

    from .. import ops
    from ..capability import kernel_for

    if kernel_for(torch.empty(0, device="cuda"), "backward") is None:
        raise RuntimeError(
            "fp8attn bench backward: the Triton backward kernel (fp8attn.kernels.backward) is not "
            "available in this install; the reference backward would run instead (and run out of "
            "memory at these lengths)."
        )
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    doc = results_header("backward")
    nheads, tokens = 16, 16384
    seqlens = [4096, 16384] if quick else [1024, 2048, 4096, 8192, 16384]
    hdims = headdims or ([128] if quick else [64, 128, 256])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for d in hdims:
        for causal in (False, True):
            for s in seqlens:
                b = tokens // s
                leaves = [
                    torch.randn(b, s, nheads, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
                    for _ in range(3)
                ]
                do = torch.randn(b, s, nheads, d, device="cuda", dtype=torch.bfloat16)
                fl = attn_flops(b, nheads, s, s, d, causal=causal)
                flops = {"fwd_bwd": 3.5 * fl, "bwd": 2.5 * fl}
                peers = {"fwd_bwd": {}, "bwd": {}}
                errors = {}
                bl = [x.detach().transpose(1, 2).requires_grad_(True) for x in leaves]  # (b, h, s, d) views
                dot = do.transpose(1, 2)
                for name, be in (
                    ("sdpa_cudnn_bf16", SDPBackend.CUDNN_ATTENTION),
                    ("sdpa_flash_bf16", SDPBackend.FLASH_ATTENTION),
                ):

                    def fwd(*x, be=be):
                        with sdpa_kernel(be):
                            return sdpa(*x, is_causal=causal)

                    try:
                        step = lambda fwd=fwd: torch.autograd.grad(fwd(*bl), bl, dot)  # noqa: E731
                        peers["fwd_bwd"][name] = _timed(step, flops["fwd_bwd"])
                        if s in KERNEL_SEQLENS:
                            peers["fwd_bwd"][name].update(_gpu_time(step))
                        peers["fwd_bwd"][name]["peak_mb"] = _peak_mb(step)
                        peers["fwd_bwd"][name]["saved_mb"] = _saved_mb(lambda fwd=fwd: fwd(*bl))[1]
                        o = fwd(*bl)
                        peers["bwd"][name] = _timed(
                            lambda o=o: torch.autograd.grad(o, bl, dot, retain_graph=True), flops["bwd"]
                        )
                        o = None
                        if s <= ERR_MAX_SEQLEN:
                            tr = lambda *x, fwd=fwd: fwd(*(y.transpose(1, 2) for y in x)).transpose(1, 2)  # noqa: E731
                            peers["fwd_bwd"][name]["err"] = _errors(tr, leaves, do, causal)[0]
                    except Exception as e:  # a missing peer is recorded, not fatal
                        errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
                for mode in MODES:
                    fwd = lambda *x, mode=mode: fp8attn.attention(*x, causal=causal, fp8_backward=mode)  # noqa: E731
                    step = lambda fwd=fwd: torch.autograd.grad(fwd(*leaves), leaves, do)  # noqa: E731
                    ours = _timed(step, flops["fwd_bwd"])
                    if s in KERNEL_SEQLENS:
                        ours.update(_gpu_time(step))
                    ours["peak_mb"] = _peak_mb(step)
                    ours["saved_mb"] = _saved_mb(lambda fwd=fwd: fwd(*leaves))[1]
                    ours["err"], ours["err_out"] = (
                        _errors(fwd, leaves, do, causal) if s <= ERR_MAX_SEQLEN else (None, None)
                    )
                    doc["cases"].append(_case(d, s, causal, "fwd_bwd", mode, b, nheads, ours, peers["fwd_bwd"], errors))
                    o = fwd(*leaves)
                    ours_b = _timed(lambda o=o: torch.autograd.grad(o, leaves, do, retain_graph=True), flops["bwd"])
                    ours_b["ms_op"], ours_b["ms_op_deterministic"], ours_b["ms_op_triton"] = _bwd_op_ms(
                        fp8attn, ops, leaves, do, causal, mode
                    )
                    ours_b["tflops_op"] = flops["bwd"] / ours_b["ms_op"] / 1e9
                    o = None
                    doc["cases"].append(_case(d, s, causal, "bwd", mode, b, nheads, ours_b, peers["bwd"], errors))
                    print(
                        f"  d{d} S{s} causal={int(causal)} {mode}: fwd_bwd {doc['cases'][-2]['ours']['tflops']:.0f} "
                        f"TF/s",
                        flush=True,
                    )
                write_results(doc, out_dir)  # after every case, so a cut-short sweep keeps what it measured
                leaves = do = bl = dot = None
                torch.cuda.empty_cache()
    path = write_results(doc, out_dir)
    _print_table(doc)
    return path


def _bwd_op_ms(fp8attn, ops, leaves, do, causal, mode):
    """(ms, ms with ``deterministic=True``, ms with ``FP8ATTN_BWD_BACKEND=triton``) of the ``fp8attn::dense_bwd``
    op alone on the quantized inputs (bf16 gradients), all over the same quantization and forward."""
    with torch.no_grad():
        q8, k8, v8, qd, kd, vd = fp8attn.quantize_qkv(*leaves)
        o, lse = fp8attn.flash_attn_func(
            q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True
        )
    d = leaves[0].shape[-1]

    def ms(deterministic):
        args = (
            do,
            q8,
            k8,
            v8,
            o,
            lse,
            None,
            None,
            None,
            None,
            d**-0.5,
            causal,
            -1,
            0 if causal else -1,
            0.0,
            qd,
            kd,
            vd,
            0,
            mode,
            deterministic,
            torch.bfloat16,
        )
        fn = lambda: ops.OPS["dense_bwd"](*args)  # noqa: E731
        fn()
        return time_ms(fn)

    return ms(False), ms(True), with_env(BWD_BACKEND_ENV, "triton", lambda: ms(False))


def _print_table(doc):
    print(f"{'case':40s} {'ours':>7s} {'cudnn16':>7s} {'flash16':>7s} {'peak':>7s} {'peakC':>7s} {'err':>8s}")
    f = lambda x: f"{x:7.0f}" if isinstance(x, (int, float)) else "      -"  # noqa: E731
    for c in doc["cases"]:
        o, p = c["ours"], c["peers"]
        cu = p.get("sdpa_cudnn_bf16", {})
        err = o.get("err")
        print(
            f"{c['case']:40s} {f(o['tflops'])} {f(cu.get('tflops'))} {f(p.get('sdpa_flash_bf16', {}).get('tflops'))} "
            f"{f(o.get('peak_mb'))} {f(cu.get('peak_mb'))} {err if err is None else f'{err:8.2e}'}"
        )
