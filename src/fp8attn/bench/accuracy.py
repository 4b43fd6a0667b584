"""`fp8attn bench accuracy`: FP8 attention error vs a float64 oracle on FA3's outlier distribution.

Inputs: q, k, v ~ N(0, 1) + N(0, 100) * Bernoulli(0.001) (FA3's test: outliers of std 10 in 0.1% of
entries), bf16. The oracle is float64 attention of those bf16 inputs. Each variant quantizes with
``quantize_qkv`` (per-tensor, per-(batch, head), per-block, each with and without the Hadamard
rotation of Q and K) and runs the dense kernel; RMSE = sqrt(mean((out - oracle)^2)). A bf16 run of
the same kernel is the 16-bit baseline. Error growth: the same metric at 4k, 32k and 128k keys.
"""
from __future__ import annotations

import os

import torch

from .common import results_header, write_results

__all__ = ["run", "outlier_inputs"]


def outlier_inputs(shape, device="cuda", dtype=torch.bfloat16, gen=None):
    """N(0,1) + N(0,100) * Bernoulli(0.001), as ``dtype``."""
    x = torch.randn(shape, device=device, generator=gen)
    x = x + torch.randn(shape, device=device, generator=gen) * 10.0 * (
        torch.rand(shape, device=device, generator=gen) < 0.001)
    return x.to(dtype)


def _oracle(q, k, v):
    from ..reference import attention_ref

    return attention_ref(q.double(), k.double(), v.double(), compute_dtype=torch.float64,
                         out_dtype=torch.float64)


def _run_variant(q, k, v, granularity, hadamard, block=128):
    from ..kernels.dense import launch_dense_fwd
    from ..qkv import quantize_qkv

    b, sq, h, d = q.shape
    out = torch.empty(b, sq, h, d, device=q.device, dtype=torch.float32)
    kw = dict(softmax_scale=d ** -0.5, causal=False, window_size=(-1, -1), softcap=0.0)
    if granularity == "bf16":
        launch_dense_fwd(q, k, v, out, None, q_descale=None, k_descale=None, v_descale=None, **kw)
        return out
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, granularity, hadamard=hadamard, block_size=block)
    extra = {}
    if granularity == "per_block":
        extra = dict(descale_block_q=block, descale_block_k=block)
    launch_dense_fwd(q8, k8, v8, out, None, q_descale=qd, k_descale=kd, v_descale=vd, **kw, **extra)
    return out


def _rmse(out, ref):
    return float(((out.double() - ref) ** 2).mean().sqrt())


VARIANTS = [("bf16", False), ("per_tensor", False), ("per_head", False), ("per_block", False),
            ("per_tensor", True), ("per_head", True), ("per_block", True)]


def run(out_dir=None, quick=False):
    """Write accuracy.json into ``out_dir`` (default benchmarks/results/<gpu>/); returns the dict."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    doc = results_header("accuracy")
    b, h, d = 1, 8, 128
    # 1) granularity table at 4k x 4k
    s = 4096
    q, k, v = (outlier_inputs((b, s, h, d), gen=gen) for _ in range(3))
    ref = _oracle(q, k, v)
    for gran, had in VARIANTS:
        out = _run_variant(q, k, v, gran, had)
        name = gran + ("+hadamard" if had else "")
        doc["cases"].append({"case": f"{name} S{s}",
                             "params": {"batch": b, "seqlen_q": s, "seqlen_k": s, "nheads_q": h, "nheads_k": h,
                                        "headdim": d, "granularity": gran, "hadamard": had,
                                        "block_size": 128 if gran == "per_block" else None},
                             "ours": {"ms": None, "tflops": None, "gbps": None, "rmse": _rmse(out, ref),
                                      "err": float((out.double() - ref).norm() / ref.norm())},
                             "peers": {}})
    del q, k, v, ref
    # 2) error growth with the key length (queries: the last 256 positions, non-causal)
    sq, hh = 256, 4
    lens = [4096, 32768] if quick else [4096, 32768, 131072]
    for sk in lens:
        q = outlier_inputs((b, sq, hh, d), gen=gen)
        k, v = (outlier_inputs((b, sk, hh, d), gen=gen) for _ in range(2))
        ref = _oracle(q, k, v)
        for gran, had in [("bf16", False), ("per_tensor", False), ("per_head", False), ("per_block", True)]:
            out = _run_variant(q, k, v, gran, had)
            name = gran + ("+hadamard" if had else "")
            doc["cases"].append({"case": f"growth {name} Sk{sk}",
                                 "params": {"batch": b, "seqlen_q": sq, "seqlen_k": sk, "nheads_q": hh,
                                            "nheads_k": hh, "headdim": d, "granularity": gran, "hadamard": had},
                                 "ours": {"ms": None, "tflops": None, "gbps": None, "rmse": _rmse(out, ref),
                                          "err": float((out.double() - ref).norm() / ref.norm())},
                                 "peers": {}})
        del q, k, v, ref
        torch.cuda.empty_cache()
    # growth ratios (largest / 4k) per variant
    growth = {}
    for c in doc["cases"]:
        if c["case"].startswith("growth"):
            name = c["case"].split()[1]
            growth.setdefault(name, {})[c["params"]["seqlen_k"]] = c["ours"]["rmse"]
    doc["growth_ratio"] = {n: v[max(v)] / v[min(v)] for n, v in growth.items()}
    write_results(doc, out_dir)
    print(f"{'case':36s} {'rmse':>10s} {'rel':>10s}")
    for c in doc["cases"]:
        print(f"{c['case']:36s} {c['ours']['rmse']:10.3e} {c['ours']['err']:10.3e}")
    print("growth ratio (max keys / 4k):", {n: round(r, 3) for n, r in doc["growth_ratio"].items()})
    return doc


if __name__ == "__main__":
    run(os.environ.get("OUT"), quick=os.environ.get("QUICK") == "1")
