"""Time FP8 attention at MLA prefill's head dims (qk 192 / v 128) on one GPU against torch SDPA (cuDNN, bf16).

For B1 x 8k tokens, 128 and 16 heads, causal and not: this library's dense forward on the warp-specialized TMA
kernel (its default for these head dims; also with an LSE, and as explorations with a 3-stage K/V ring and,
causal, with one CTA per query block instead of the persistent grid), the same call forced onto the Triton
kernel (``FP8ATTN_DENSE_BACKEND=triton``), and ``scaled_dot_product_attention`` under ``SDPBackend.CUDNN_ATTENTION`` on the dequantized bf16 inputs (q/k 192,
v 128). Prints one line per kernel: milliseconds, TF/s counted as 2 x visible (query, key) pairs x (192 + 128)
per head, the speed-up over cuDNN bf16, and the error against the float32 reference from the dequantized FP8
inputs on the first heads (max |out - ref| / max |ref|). Checks that the TMA rows really ran the TMA kernel.

Usage (repo root, on an sm90 GPU): ``PYTHONPATH=src python tools/time_mla_attention.py [--seqlen 8192]
[--heads 128 16]``.
"""
from __future__ import annotations

import argparse
import contextlib
import os

import torch

from fp8attn.bench.common import time_ms
from fp8attn.kernels.hopper import dense_launch
from fp8attn.kernels.dense import launch_dense_fwd, transpose_v_kmajor
from fp8attn.reference import attention_ref

DQK, DV = 192, 128
E4M3 = torch.float8_e4m3fn
REF_HEADS = 2  # heads of the error check (the float32 reference materializes S x S scores per head)


def _quantize(x):
    """bf16 (b, s, h, d) -> e4m3 with per-(batch, head) descales ``amax / 448``: ``(x8, descale (b, h))``."""
    ds = x.float().abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    return (x.float() / ds[:, None, :, None]).clamp(-448, 448).to(E4M3), ds.contiguous()


def _inputs(s, h):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, s, h, DQK, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, s, h, DV, device="cuda", generator=g, dtype=torch.bfloat16)
    (q8, qd), (k8, kd), (v8, vd) = _quantize(q), _quantize(k), _quantize(v)
    return q8, k8, v8, qd, kd, vd


@contextlib.contextmanager
def _env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: v for k, v in kv.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _stages(n):
    """The warp-specialized kernel with an ``n``-stage K/V ring (exploration; the default is ``ws_config``'s)."""
    real = dense_launch.ws_config

    def cfg(d, causal, consumers=None, head_dim_v=None):
        nc, bn, _ = real(d, causal, consumers, head_dim_v)
        return nc, bn, n

    dense_launch.ws_config = cfg
    try:
        yield
    finally:
        dense_launch.ws_config = real


@contextlib.contextmanager
def _grid_per_block():
    """Causal calls on one CTA per query block instead of the persistent grid (exploration)."""
    real = dense_launch._WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q
    dense_launch._WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q = 0
    try:
        yield
    finally:
        dense_launch._WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q = real


def _err(out, ref):
    o = out[:, :, :REF_HEADS].float()
    return float((o - ref).abs().max() / ref.abs().max())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'case':<24} {'kernel':<22} {'ms':>8} {'TF/s':>8} {'x cuDNN':>8} {'max err':>9}")
    s = args.seqlen
    scale = DQK ** -0.5
    calls = []
    real_tma = dense_launch.launch_dense_fwd_tma

    def spy(*a, **kw):
        calls.append(1)
        return real_tma(*a, **kw)

    dense_launch.launch_dense_fwd_tma = spy
    for h in args.heads:
        q8, k8, v8, qd, kd, vd = _inputs(s, h)
        vt = transpose_v_kmajor(v8)
        qb, kb, vb = (x.float().mul(d[:, None, :, None]).to(torch.bfloat16).transpose(1, 2).contiguous()
                      for x, d in ((q8, qd), (k8, kd), (v8, vd)))
        for causal in (True, False):
            pairs = s * (s + 1) // 2 if causal else s * s
            flops = 2 * pairs * (DQK + DV) * h
            ref = attention_ref(q8[:, :, :REF_HEADS], k8[:, :, :REF_HEADS], v8[:, :, :REF_HEADS], softmax_scale=scale,
                                causal=causal, q_descale=qd[:, :REF_HEADS], k_descale=kd[:, :REF_HEADS],
                                v_descale=vd[:, :REF_HEADS], out_dtype=torch.float32)
            out = torch.empty(1, s, h, DV, device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(1, h, s, device="cuda", dtype=torch.float32)
            kw = dict(softmax_scale=scale, causal=causal, window_size=(-1, -1), softcap=0.0, q_descale=qd,
                      k_descale=kd, v_descale=vd, v_kmajor=False)
            rows = []

            def ours(lse_=None, kw=kw, out=out):
                return launch_dense_fwd(q8, k8, vt, out, lse_, **kw)

            variants = [("fp8 tma", contextlib.nullcontext(), ours, True),
                        ("fp8 tma +lse", contextlib.nullcontext(), lambda: ours(lse), True),
                        ("fp8 tma 3-stage", _stages(3), ours, True)]
            if causal:
                variants.append(("fp8 tma per-block grid", _grid_per_block(), ours, True))
            variants.append(("fp8 triton", _env(FP8ATTN_DENSE_BACKEND="triton"), ours, False))
            for name, ctx, fn, tma in variants:
                with ctx:
                    calls.clear()
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    if bool(calls) != tma:
                        raise RuntimeError(f"{name}: the TMA kernel was {'not ' if tma else ''}called")
                    err = _err(out, ref)
                    rows.append((name, time_ms(fn), err))

            def cudnn(causal=causal):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal,
                                                                            scale=scale)

            oc = cudnn()
            rows.append(("bf16 sdpa cudnn", time_ms(cudnn), _err(oc.transpose(1, 2), ref)))
            base = rows[-1][1]
            for name, ms, err in rows:
                case = f"B1 S{s} H{h} causal={int(causal)}"
                print(f"{case:<24} {name:<22} {ms:8.3f} {flops / ms / 1e9:8.1f} {base / ms:8.3f} {err:9.2e}",
                      flush=True)
            del out, lse, ref, oc
        del q8, k8, v8, vt, qb, kb, vb
        torch.cuda.empty_cache()
    dense_launch.launch_dense_fwd_tma = real_tma


if __name__ == "__main__":
    main()
