"""Quick timing of the attention backward kernels against torch SDPA's backward on one GPU (a developer
check, not a benchmark routine: ``fp8attn bench backward`` writes the results files).

Per (head dim, seqlen, causal): ``launch_attention_bwd`` on e4m3 Q/K/V (sequence-major V, as
``quantize_qkv`` returns it) in both modes, and torch SDPA's bf16 backward with the cuDNN and flash
backends (``torch.autograd.grad`` of a retained graph: the backward alone). Also the forward of each
(fp8attn's FP8 forward; SDPA bf16), so fwd+bwd can be read off. Times are medians of
``triton.testing.do_bench``; TFLOP/s count the backward as 2.5x the forward's 4*B*H*S*S*D (halved for
causal). The first call of each fp8attn shape autotunes (outside the timed region).

Usage: ``python tools/time_backward_h200.py [--d 64 128 256] [--s 4096 16384] [--heads 16] [--tokens 16384]``
"""
import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from fp8attn.kernels.backward import launch_attention_bwd  # noqa: E402
from fp8attn.kernels.dense import launch_dense_fwd  # noqa: E402

E4M3 = torch.float8_e4m3fn


def _ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _sdpa(q, k, v, do, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    try:
        with sdpa_kernel(be):
            def fwd():
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            out = fwd()
            dot = do.transpose(1, 2)

            def bwd():
                torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True)
            return _ms(fwd), _ms(bwd)
    except RuntimeError as e:  # a backend that does not take the shape
        print(f"  sdpa {backend}: {str(e).splitlines()[0][:100]}")
        return float("nan"), float("nan")


def run(d, s, causal, heads, tokens):
    b = max(1, tokens // s)
    dev = "cuda"
    q16 = torch.randn(b, s, heads, d, device=dev, dtype=torch.bfloat16)
    k16 = torch.randn(b, s, heads, d, device=dev, dtype=torch.bfloat16)
    v16 = torch.randn(b, s, heads, d, device=dev, dtype=torch.bfloat16)
    do = torch.randn(b, s, heads, d, device=dev, dtype=torch.bfloat16)
    q8, k8 = q16.to(E4M3), k16.to(E4M3)
    v8 = v16.permute(0, 2, 3, 1).contiguous().to(E4M3).permute(0, 3, 1, 2)  # sequence-major
    desc = torch.full((b, heads), 1.0, device=dev)
    out = torch.empty(b, s, heads, d, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(b, heads, s, device=dev)
    scale = d ** -0.5

    def fwd():
        launch_dense_fwd(q8, k8, v8, out, lse, softmax_scale=scale, causal=causal,
                         window_size=(-1, 0) if causal else (-1, -1), softcap=0.0,
                         q_descale=desc, k_descale=desc, v_descale=desc)
    fwd()
    grads = [torch.empty(x.shape, device=dev, dtype=torch.bfloat16) for x in (q8, k8, v8)]
    row = {"fwd_fp8": _ms(fwd)}
    for mode in ("dequantized", "fp8"):
        def bwd():
            launch_attention_bwd(do, q8, k8, v8, out, lse, *grads, q_descale=desc, k_descale=desc, v_descale=desc,
                                 softmax_scale=scale, causal=causal, window_left=-1, window_right=-1, softcap=0.0,
                                 mode=mode)
        bwd()  # autotune outside the timed region
        row[f"bwd_{mode}"] = _ms(bwd)
    for backend in ("cudnn", "flash"):
        row[f"fwd_sdpa_{backend}"], row[f"bwd_sdpa_{backend}"] = _sdpa(q16, k16, v16, do, causal, backend)
    flops_bwd = 2.5 * 4 * b * heads * s * s * d / (2 if causal else 1)
    return b, row, flops_bwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--s", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seqlen")
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    cols = ["fwd_fp8", "bwd_dequantized", "bwd_fp8", "fwd_sdpa_cudnn", "bwd_sdpa_cudnn", "fwd_sdpa_flash",
            "bwd_sdpa_flash"]
    print(f"{'d':>4} {'S':>6} {'B':>3} {'causal':>6} " + " ".join(f"{c:>16}" for c in cols)
          + f" {'bwd TF/s deq':>12} {'fp8':>6} {'cudnn':>6} {'fwd+bwd vs cudnn':>17}")
    for d in a.d:
        for s in a.s:
            for causal in (False, True):
                b, r, fl = run(d, s, causal, a.heads, a.tokens)
                tf = {k: fl / (r[k] * 1e-3) / 1e12 for k in ("bwd_dequantized", "bwd_fp8", "bwd_sdpa_cudnn")}
                ratio = (r["fwd_sdpa_cudnn"] + r["bwd_sdpa_cudnn"]) / (r["fwd_fp8"] + r["bwd_dequantized"])
                print(f"{d:>4} {s:>6} {b:>3} {str(causal):>6} " + " ".join(f"{r[c]:>14.3f}ms" for c in cols)
                      + f" {tf['bwd_dequantized']:>12.0f} {tf['bwd_fp8']:>6.0f} {tf['bwd_sdpa_cudnn']:>6.0f}"
                      + f" {ratio:>16.2f}x", flush=True)


if __name__ == "__main__":
    main()
