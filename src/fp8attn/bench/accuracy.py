"""`fp8attn bench accuracy`: FP8 attention error vs a float64 oracle on FA3's outlier distribution.

Inputs: q, k, v ~ N(0, 1) + N(0, 100) * Bernoulli(0.001) (FA3's test: outliers of std 10 in 0.1% of
entries), bf16. The oracle is float64 attention of those bf16 inputs. Each variant quantizes with
``quantize_qkv`` (per-tensor, per-(batch, head), per-block, each with and without the Hadamard
rotation of Q and K) and runs the dense kernel; RMSE = sqrt(mean((out - oracle)^2)). A bf16 run of
the same kernel is the 16-bit baseline. Error growth: the same metric at 4k, 32k and 128k keys.

Error budget (``error_budget``): which quantized operand the per-block + Hadamard error comes from,
computed in float64 from the dequantized tensors with ``reference.attention_ref``: each of Q/K, V and
P quantized alone and together (no kernel involved, so it is the same on any device).

Runs on the GPU (the Triton kernels behind ``flash_attn_func``) or, without one, on the CPU through
the reference path (minutes at the default sizes), which rounds P as the kernels do (docs/numerics.md);
the two differ by rounding order and by the random draw (the generators differ between devices).
"""

from __future__ import annotations

import sys

import torch

from .common import results_header, write_results

__all__ = ["run", "outlier_inputs", "error_budget"]


def outlier_inputs(shape, device="cuda", dtype=torch.bfloat16, gen=None):
    """N(0,1) + N(0,100) * Bernoulli(0.001), as ``dtype``."""
    x = torch.randn(shape, device=device, generator=gen)
    x = x + torch.randn(shape, device=device, generator=gen) * 10.0 * (
        torch.rand(shape, device=device, generator=gen) < 0.001
    )
    return x.to(dtype)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _oracle(q, k, v):
    from ..reference import attention_ref

    return attention_ref(q.double(), k.double(), v.double(), compute_dtype=torch.float64, out_dtype=torch.float64)


def _run_variant(q, k, v, granularity, hadamard, block=128):
    """The public dense API on the variant's FP8 inputs (float32 output, no output rounding)."""
    from .. import flash_attn_func
    from ..qkv import quantize_qkv

    if granularity == "bf16":
        return flash_attn_func(q, k, v, out_dtype=torch.float32)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, granularity, hadamard=hadamard, block_size=block)
    return flash_attn_func(
        q8,
        k8,
        v8,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        out_dtype=torch.float32,
        descale_block_size=block if granularity == "per_block" else None,
    )


def error_budget(q, k, v, ref, granularity="per_block", hadamard=True, block=128):
    """RMSE vs ``ref`` with each operand quantized alone and together (float64, reference path).

    The reference dequantizes the FP8 operands with their descales; Q and K come rotated from
    ``quantize_qkv`` (the rotation leaves Q K^T unchanged); P is rounded to e4m3 as the kernels do."""
    from ..qkv import quantize_qkv
    from ..reference import attention_ref, block_descales_to_tokens

    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, granularity, hadamard=hadamard, block_size=block)
    qk_scales = dict(q_descale=qd, k_descale=kd)
    if granularity == "per_block":
        qk_scales = dict(
            q_token_descale=block_descales_to_tokens(qd, q.shape[1], block),
            k_token_descale=block_descales_to_tokens(kd, k.shape[1], block),
        )

    def rmse(qx, kx, vx, quantize_p, **scales):
        o = attention_ref(
            qx, kx, vx, compute_dtype=torch.float64, out_dtype=torch.float64, quantize_p=quantize_p, **scales
        )
        return _rmse(o, ref)

    return {
        "all": rmse(q8, k8, v8, True, v_descale=vd, **qk_scales),
        "qk_only": rmse(q8, k8, v, False, **qk_scales),
        "v_only": rmse(q, k, v8, False, v_descale=vd),
        "p_only": rmse(q, k, v, True),
        "qkv_p_exact": rmse(q8, k8, v8, False, v_descale=vd, **qk_scales),
    }


def _rmse(out, ref):
    return float(((out.double() - ref) ** 2).mean().sqrt())


VARIANTS = [
    ("bf16", False),
    ("per_tensor", False),
    ("per_head", False),
    ("per_block", False),
    ("per_tensor", True),
    ("per_head", True),
    ("per_block", True),
]


def _progress(i, total, case):
    """One line per case on stderr (the CPU run of the full routine takes minutes)."""
    print(f"accuracy [{i}/{total}] {case}", file=sys.stderr, flush=True)


def run(out_dir=None, quick=False, seqlen=4096, growth_lens=None, progress=_progress):
    """Write accuracy.json into ``out_dir`` (default benchmarks/results/<gpu or cpu>/); returns its path.
    ``progress(i, total, case)`` is called before each case (None: quiet)."""
    progress = progress or (lambda *a: None)
    dev = _device()
    gen = torch.Generator(device=dev).manual_seed(0)
    doc = results_header("accuracy")
    doc["device"] = dev
    b, h, d = 1, 8, 128
    # 1) granularity table at seqlen x seqlen
    s = seqlen
    q, k, v = (outlier_inputs((b, s, h, d), device=dev, gen=gen) for _ in range(3))
    ref = _oracle(q, k, v)
    lens = growth_lens or ([4096, 32768] if quick else [4096, 32768, 131072])
    total = len(VARIANTS) + 4 * len(lens)
    for i, (gran, had) in enumerate(VARIANTS, 1):
        name = gran + ("+hadamard" if had else "")
        progress(i, total, f"{name} S{s}")
        out = _run_variant(q, k, v, gran, had)
        doc["cases"].append(
            {
                "case": f"{name} S{s}",
                "params": {
                    "batch": b,
                    "seqlen_q": s,
                    "seqlen_k": s,
                    "nheads_q": h,
                    "nheads_k": h,
                    "headdim": d,
                    "granularity": gran,
                    "hadamard": had,
                    "block_size": 128 if gran == "per_block" else None,
                },
                "ours": {
                    "ms": None,
                    "tflops": None,
                    "gbps": None,
                    "rmse": _rmse(out, ref),
                    "err": float((out.double() - ref).norm() / ref.norm()),
                },
                "peers": {},
            }
        )
    doc["error_budget"] = {"case": f"per_block+hadamard S{s}", "rmse": error_budget(q, k, v, ref)}
    q = k = v = ref = None
    # 2) error growth with the key length (queries: the last 256 positions, non-causal)
    sq, hh = min(256, seqlen), 4
    for j, sk in enumerate(lens):
        q = outlier_inputs((b, sq, hh, d), device=dev, gen=gen)
        k, v = (outlier_inputs((b, sk, hh, d), device=dev, gen=gen) for _ in range(2))
        ref = _oracle(q, k, v)
        for i, (gran, had) in enumerate(
            [("bf16", False), ("per_tensor", False), ("per_head", False), ("per_block", True)],
            len(VARIANTS) + 4 * j + 1,
        ):
            name = gran + ("+hadamard" if had else "")
            progress(i, total, f"growth {name} Sk{sk}")
            out = _run_variant(q, k, v, gran, had)
            doc["cases"].append(
                {
                    "case": f"growth {name} Sk{sk}",
                    "params": {
                        "batch": b,
                        "seqlen_q": sq,
                        "seqlen_k": sk,
                        "nheads_q": hh,
                        "nheads_k": hh,
                        "headdim": d,
                        "granularity": gran,
                        "hadamard": had,
                    },
                    "ours": {
                        "ms": None,
                        "tflops": None,
                        "gbps": None,
                        "rmse": _rmse(out, ref),
                        "err": float((out.double() - ref).norm() / ref.norm()),
                    },
                    "peers": {},
                }
            )
        q = k = v = ref = None
        if dev == "cuda":
            torch.cuda.empty_cache()
    # growth ratios (largest / 4k) per variant
    growth = {}
    for c in doc["cases"]:
        if c["case"].startswith("growth"):
            name = c["case"].split()[1]
            growth.setdefault(name, {})[c["params"]["seqlen_k"]] = c["ours"]["rmse"]
    doc["growth_ratio"] = {n: v[max(v)] / v[min(v)] for n, v in growth.items()}
    path = write_results(doc, out_dir)
    print(f"{'case':36s} {'rmse':>10s} {'rel':>10s}")
    for c in doc["cases"]:
        print(f"{c['case']:36s} {c['ours']['rmse']:10.3e} {c['ours']['err']:10.3e}")
    print("growth ratio (max keys / 4k):", {n: round(r, 3) for n, r in doc["growth_ratio"].items()})
    print("error budget,", doc["error_budget"]["case"], {n: f"{r:.2e}" for n, r in doc["error_budget"]["rmse"].items()})
    return path
