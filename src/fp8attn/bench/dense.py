"""`fp8attn bench dense`: dense FP8 forward vs peers in one process (DESIGN §6).

FA3's setup: 16 heads, batch * seqlen = 16k, seqlen 512..16k, head dims 64/128/256, causal on/off.
``ours`` times the public path (FP8 Q/K/V in (batch, seqlen, heads, dim), V's K-major copy included);
``ms_v_pretransposed`` is the kernel alone with V already stored sequence-contiguous, and
``ms_v_inkernel`` reads the (batch, seqlen, heads, dim) V directly (the transpose is left to Triton);
``ms_graph`` / ``ms_v_pretransposed_graph`` replay the first two from CUDA graphs (no host time in
them, where the eager short cases may have some). These calls write no LSE, as the cuDNN peer runs
(``is_inference``); ``ms_v_pretransposed_lse_graph`` is the kernel alone writing the LSE too (the fp32 row
sums, where the calls without one sum the e4m3 P on the tensor core when non-causal).
Peers: cudnn_fp8 (cuDNN FP8 SDPA through the cudnn-frontend wheel), sdpa_cudnn_bf16,
sdpa_flash_bf16 (torch SDPA backends), flex_bf16 (FlexAttention, compiled; d128 only to bound compile
time).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from .common import attn_flops, graph_replay, results_header, time_ms, write_results

__all__ = ["run", "cudnn_fp8_sdpa"]

E4M3 = torch.float8_e4m3fn


def cudnn_fp8_sdpa(batch, nheads, seqlen, headdim, causal, descales=None):
    """Build a cuDNN FP8 SDPA forward for (batch, seqlen, nheads, headdim) e4m3 tensors.

    Returns ``fn(q8, k8, v8) -> out`` (e4m3, (batch, seqlen, nheads, headdim)); q8/k8/v8 are
    contiguous (batch, seqlen, nheads, headdim) e4m3 tensors. ``descales``: optional dict of float32
    (1, 1, 1, 1) tensors named descale_q/k/v (per-tensor, cuDNN's FP8 granularity); ones otherwise.
    """
    import cudnn

    dev = "cuda"
    handle = cudnn.create_handle()
    dims = [batch, nheads, seqlen, headdim]
    strides = [seqlen * nheads * headdim, headdim, nheads * headdim, 1]  # BSHD memory as BHSD
    f8 = cudnn.data_type.FP8_E4M3
    f32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=f8, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    tq = graph.tensor(name="q", dim=dims, stride=strides, data_type=f8)
    tk = graph.tensor(name="k", dim=dims, stride=strides, data_type=f8)
    tv = graph.tensor(name="v", dim=dims, stride=strides, data_type=f8)
    scal = {}
    for nm in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
        scal[nm] = graph.tensor(name=nm, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
    o, _, amax_s, amax_o = graph.sdpa_fp8(q=tq, k=tk, v=tv, **scal, is_inference=True,
                                          attn_scale=1.0 / math.sqrt(headdim), use_causal_mask=causal)
    o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(f8)
    for t in (amax_s, amax_o):
        t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), device=dev, dtype=torch.uint8)
    vals = {nm: torch.ones(1, 1, 1, 1, device=dev) for nm in scal}
    if descales:
        vals.update({nm: t.reshape(1, 1, 1, 1).float() for nm, t in descales.items()})
    amax_bufs = [torch.zeros(1, 1, 1, 1, device=dev) for _ in range(2)]
    out = torch.empty(batch, seqlen, nheads, headdim, device=dev, dtype=E4M3)

    def fn(q8, k8, v8):
        pack = {tq: q8, tk: k8, tv: v8, o: out, amax_s: amax_bufs[0], amax_o: amax_bufs[1]}
        pack.update({scal[nm]: vals[nm] for nm in scal})
        graph.execute(pack, workspace, handle=handle)
        return out

    return fn


def _peer(name, fn, flops, peers, errors):
    try:
        fn()
        ms = time_ms(fn)
        peers[name] = {"ms": ms, "tflops": flops / ms / 1e9}
    except Exception as e:  # a missing peer is recorded, not fatal
        errors[name] = f"{type(e).__name__}: {str(e)[:200]}"


def dense_inputs(batch, seqlen, nheads, headdim):
    """The sweep's inputs on the GPU: ``(q8, k8, v8, q_descale, k_descale, v_descale)``, e4m3 (batch, seqlen,
    nheads, headdim) tensors of 2 N(0, 1) and (batch, nheads) float32 descales (Q/K in [0.05, 0.15), V in
    [0.5, 1.5)), drawn in that order from the current generator."""
    q8, k8, v8 = ((torch.randn(batch, seqlen, nheads, headdim, device="cuda") * 2).to(E4M3) for _ in range(3))
    qd, kd = (torch.rand(batch, nheads, device="cuda") * 0.1 + 0.05 for _ in range(2))
    vd = torch.rand(batch, nheads, device="cuda") + 0.5
    return q8, k8, v8, qd, kd, vd


def _rel_err(out, q8, k8, v8, qd, kd, vd, causal):
    """Relative L2 error of batch 0, head 0 vs the fp32 reference from the dequantized inputs."""
    from ..reference import attention_ref

    sl = slice(0, 1)
    ref = attention_ref(q8[sl, :, sl], k8[sl, :, sl], v8[sl, :, sl], causal=causal, q_descale=qd[sl, sl],
                        k_descale=kd[sl, sl], v_descale=vd[sl, sl], out_dtype=torch.float32)
    o = out[sl, :, sl].float()
    return float((o - ref).norm() / ref.norm())


def run(out_dir=None, quick=False):
    """Run the sweep; write dense_fwd.json (+ dense_fwd.png) into ``out_dir``
    (default benchmarks/results/<gpu>/). Returns the results dict."""
    from ..kernels.dense import launch_dense_fwd, transpose_v_kmajor

    torch.manual_seed(0)
    doc = results_header("dense_fwd")
    nheads, tokens = 16, 16384
    seqlens = [4096, 16384] if quick else [512, 1024, 2048, 4096, 8192, 16384]
    hdims = [128] if quick else [64, 128, 256]
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:  # pragma: no cover
        sdpa_kernel = None
    flex = None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception:
        pass
    for d in hdims:
        for causal in (False, True):
            for s in seqlens:
                b = tokens // s
                q8, k8, v8, qd, kd, vd = dense_inputs(b, s, nheads, d)
                out = torch.empty(b, s, nheads, d, device="cuda", dtype=torch.bfloat16)
                lse = torch.empty(b, nheads, s, device="cuda", dtype=torch.float32)
                flops = attn_flops(b, nheads, s, s, d, causal=causal)
                kw = dict(softmax_scale=d ** -0.5, causal=causal, window_size=(-1, -1), softcap=0.0,
                          q_descale=qd, k_descale=kd, v_descale=vd)
                vt = transpose_v_kmajor(v8)
                ours_fn = lambda: launch_dense_fwd(q8, k8, v8, out, None, **kw)  # noqa: E731
                pre_fn = lambda: launch_dense_fwd(q8, k8, vt, out, None, **kw, v_kmajor=False)  # noqa: E731
                ink_fn = lambda: launch_dense_fwd(q8, k8, v8, out, None, **kw, v_kmajor=False)  # noqa: E731
                pre_lse_fn = lambda: launch_dense_fwd(q8, k8, vt, out, lse, **kw, v_kmajor=False)  # noqa: E731
                ours_fn()
                ms = time_ms(ours_fn)
                ours = {"ms": ms, "tflops": flops / ms / 1e9, "gbps": None}
                ours["err"] = _rel_err(out, q8, k8, v8, qd, kd, vd, causal)
                for key, fn in (("v_pretransposed", pre_fn), ("v_inkernel", ink_fn)):
                    try:
                        fn()
                        t = time_ms(fn)
                        ours[f"ms_{key}"] = t
                        ours[f"tflops_{key}"] = flops / t / 1e9
                    except Exception as e:
                        ours[f"ms_{key}"] = None
                        ours[f"error_{key}"] = f"{type(e).__name__}: {str(e)[:200]}"
                # The same calls replayed from CUDA graphs: at short lengths the eager times can include
                # host time (the row-major path launches a V transpose and allocates per call).
                for key, fn in (("graph", ours_fn), ("v_pretransposed_graph", pre_fn),
                                ("v_pretransposed_lse_graph", pre_lse_fn)):
                    call, graphed = graph_replay([fn])
                    if graphed:
                        t = time_ms(call)
                        ours[f"ms_{key}"] = t
                        ours[f"tflops_{key}"] = flops / t / 1e9
                peers, errors = {}, {}
                try:
                    cfn = cudnn_fp8_sdpa(b, nheads, s, d, causal)
                    _peer("cudnn_fp8", lambda: cfn(q8, k8, v8), flops, peers, errors)
                except Exception as e:
                    errors["cudnn_fp8"] = f"{type(e).__name__}: {str(e)[:200]}"
                qb, kb, vb = (x.to(torch.bfloat16).transpose(1, 2) for x in (q8, k8, v8))
                if sdpa_kernel is not None:
                    for name, be in (("sdpa_cudnn_bf16", SDPBackend.CUDNN_ATTENTION),
                                     ("sdpa_flash_bf16", SDPBackend.FLASH_ATTENTION)):
                        def sd(be=be):
                            with sdpa_kernel(be):
                                return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)
                        _peer(name, sd, flops, peers, errors)
                if flex is not None and d == 128 and (quick or s in (4096, 16384)):
                    try:
                        bm = None
                        if causal:
                            bm = create_block_mask(lambda b_, h_, i, j: j <= i, None, None, s, s, device="cuda")
                        _peer("flex_bf16", lambda: flex(qb, kb, vb, block_mask=bm), flops, peers, errors)
                    except Exception as e:
                        errors["flex_bf16"] = f"{type(e).__name__}: {str(e)[:200]}"
                case = {"case": f"d{d} S{s} causal={int(causal)}",
                        "params": {"batch": b, "seqlen_q": s, "seqlen_k": s, "nheads_q": nheads, "nheads_k": nheads,
                                   "headdim": d, "causal": causal, "dtype": "float8_e4m3fn", "out_dtype": "bfloat16"},
                        "ours": ours, "peers": peers}
                if errors:
                    case["peer_errors"] = errors
                doc["cases"].append(case)
                del q8, k8, v8, vt, qb, kb, vb, out, lse
                torch.cuda.empty_cache()
    path = write_results(doc, out_dir)
    try:
        _plot(doc, Path(path).with_suffix(".png"))
    except Exception as e:  # plotting is optional
        print(f"plot skipped: {e}")
    _print_table(doc)
    return doc


def _plot(doc, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(c["params"]["headdim"], c["params"]["causal"]) for c in doc["cases"]})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, (d, causal) in zip(axes[0], keys):
        cs = [c for c in doc["cases"] if c["params"]["headdim"] == d and c["params"]["causal"] == causal]
        xs = [c["params"]["seqlen_q"] for c in cs]
        ax.plot(xs, [c["ours"]["tflops"] for c in cs], "o-", label="fp8attn (fp8)", lw=2)
        names = sorted({n for c in cs for n in c["peers"]})
        for n in names:
            ys = [c["peers"].get(n, {}).get("tflops", float("nan")) for c in cs]
            ax.plot(xs, ys, ".--", label=n)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d{d} causal={int(causal)}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"dense forward, 16 heads, batch*seqlen=16k ({doc['gpu']})")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _print_table(doc):
    print(f"{'case':26s} {'ours':>7s} {'preT':>7s} {'inK':>7s} {'cudnn8':>7s} {'cudnn16':>7s} {'flash16':>7s} "
          f"{'flex16':>7s} {'err':>8s}")
    for c in doc["cases"]:
        o, p = c["ours"], c["peers"]
        f = lambda x: f"{x:7.0f}" if isinstance(x, (int, float)) else "      -"  # noqa: E731
        print(f"{c['case']:26s} {f(o['tflops'])} {f(o.get('tflops_v_pretransposed'))} {f(o.get('tflops_v_inkernel'))} "
              f"{f(p.get('cudnn_fp8', {}).get('tflops'))} {f(p.get('sdpa_cudnn_bf16', {}).get('tflops'))} "
              f"{f(p.get('sdpa_flash_bf16', {}).get('tflops'))} {f(p.get('flex_bf16', {}).get('tflops'))} "
              f"{o['err']:8.2e}")


if __name__ == "__main__":
    run(os.environ.get("OUT"), quick=os.environ.get("QUICK") == "1")
