"""Training with FP8 attention: ``attention`` (16-bit tensors in, FP8 inside, gradients out) and the
process default of the backward's precision (``set_fp8_backward``).

``attention`` quantizes Q, K and V dynamically (``quantize_qkv``), runs the FP8 forward and, in the
backward, the attention backward on the saved FP8 tensors (``fp8attn::dense_bwd``). The quantizer is
straight-through: the gradients are those with respect to the real values the FP8 tensors represent,
rotated back when Q and K were Hadamard-rotated. See docs/api.md "Training (backward)".
"""

from __future__ import annotations

import torch

from . import _checks as C
from . import hadamard as _had
from . import ops
from .interface import _resolve_window
from .qkv import GRANULARITIES, quantize_qkv
from .quant import expand_descale

__all__ = ["attention", "set_fp8_backward", "get_fp8_backward"]

_BLOCK = 128  # tokens per scale block of granularity="per_block"


@torch.compiler.assume_constant_result
def _rotation(d, device):
    """The (d, d) float32 rotation ``quantize_qkv(hadamard=True)`` applies (a constant to torch.compile: it is
    built from a seeded CPU generator, which graphs cannot hold)."""
    return _had.rotation_matrix(d, _had.DEFAULT_SEED, device=device)


def set_fp8_backward(mode: str) -> None:
    """Set the process default precision of the attention backward.

    Parameters
    ----------
    mode : {"dequantized", "fp8"}
        "dequantized" (the default): the backward products run in 16/32-bit on the real values (FP8 inputs
        dequantized in registers). "fp8": dO, P and dS are scaled into e4m3 with per-block scales for the
        backward matmuls (fp32 accumulation): faster, with a larger gradient error (docs/numerics.md).
        A call's ``fp8_backward=`` overrides it.
    """
    ops.set_fp8_backward(mode)


def get_fp8_backward() -> str:
    """The process default of the attention backward ("dequantized" or "fp8")."""
    return ops.fp8_backward_mode()


def _validate(q, k, v, granularity, hadamard, fp8_backward, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        C.check_tensor(name, t, ndim=3 if varlen else 4)
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(
                f"{name}: expected bf16/fp16/fp32 (attention quantizes to FP8 itself), got {t.dtype}. "
                "Pass the unquantized tensors, or call flash_attn_func with FP8 tensors and descales."
            )
    C.check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    C.check_heads(q, k, v)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"k: expected headdim {q.shape[-1]} (q's), got {k.shape[-1]}. Give q and k one head dim.")
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"granularity: expected one of {GRANULARITIES}, got {granularity!r}. "
            "Pick per_head (FA3's descales), per_tensor or per_block."
        )
    if not isinstance(hadamard, bool):
        raise TypeError(f"hadamard: expected a bool, got {type(hadamard).__name__}. Pass True or False.")
    if fp8_backward is not None:
        ops.check_bwd_mode("fp8_backward", fp8_backward)
    if not varlen:
        b = q.shape[0]
        if k.shape[0] != b or v.shape[0] != b or v.shape[1] != k.shape[1]:
            raise ValueError(
                f"k/v: expected batch {b} and matching seqlen_k, got k {tuple(k.shape)} v "
                f"{tuple(v.shape)}. Give q, k and v the same batch and k, v the same seqlen."
            )
        for name, val in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if val is not None:
                raise ValueError(
                    f"{name}: expected None without cu_seqlens_q/cu_seqlens_k, got {val!r}. "
                    "Pass cu_seqlens for varlen inputs, or drop it."
                )
        return None
    if cu_seqlens_q is None or cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
        raise ValueError(
            "cu_seqlens_q/cu_seqlens_k/max_seqlen_q/max_seqlen_k: expected all four for varlen "
            "(total, heads, dim) inputs, got some None. Pass all of them."
        )
    C.check_leading_dims("k", k, "v", v, 1, "token count (total_k)")
    C.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total=q.shape[0], total_name="q")
    b = cu_seqlens_q.numel() - 1
    C.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch=b, total=k.shape[0], total_name="k")
    C.check_max_seqlen("max_seqlen_q", max_seqlen_q, "cu_seqlens_q", cu_seqlens_q, False)
    C.check_max_seqlen("max_seqlen_k", max_seqlen_k, "cu_seqlens_k", cu_seqlens_k, False)
    return b


def attention(
    q,
    k,
    v,
    *,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    softcap=0.0,
    granularity="per_head",
    hadamard=False,
    fp8_backward=None,
    deterministic=False,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    return_lse=False,
):
    """FP8 attention of 16-bit tensors, differentiable: the training entry.

    Dynamic quantization (``quantize_qkv``) -> FP8 forward -> (in the backward) the attention backward on the
    saved FP8 tensors. Gradients flow to q, k, v straight-through the quantizer: they are the gradients
    with respect to the real values the FP8 tensors represent, rotated back when ``hadamard=True``.

    Parameters
    ----------
    q : (batch, seqlen_q, nheads_q, headdim), or varlen (total_q, nheads_q, headdim) with cu_seqlens; bf16 /
        fp16 / fp32.
    k : (batch, seqlen_k, nheads_k, headdim) / (total_k, nheads_k, headdim), q's dtype; nheads_q % nheads_k == 0.
    v : (batch, seqlen_k, nheads_k, headdim_v) / (total_k, nheads_k, headdim_v).
    causal, softmax_scale, window_size, softcap : as :func:`fp8attn.flash_attn_func` (bottom-right aligned).
    granularity : "per_head" (default), "per_tensor" or "per_block" (128-token blocks for Q and K), as
        :func:`fp8attn.quantize_qkv`.
    hadamard : rotate Q and K by a random-sign Hadamard matrix before quantizing (``Q K^T`` unchanged).
    fp8_backward : "dequantized" / "fp8", or None for the process default (:func:`set_fp8_backward`).
    deterministic : bit-identical gradients on reruns (FA3's ``deterministic``).
    cu_seqlens_q, cu_seqlens_k : (batch + 1,) int32 offsets (varlen) with max_seqlen_q / max_seqlen_k ints.
    return_lse : also return the natural-log LSE.

    Returns
    -------
    out : q's shape with headdim_v, q's dtype.
    lse : float32 (batch, nheads_q, seqlen_q) / varlen (nheads_q, total_q), only with return_lse (no
        gradient flows through it).
    """
    b = _validate(q, k, v, granularity, hadamard, fp8_backward, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    window = _resolve_window(causal, window_size)
    mode = fp8_backward if fp8_backward is not None else ops.fp8_backward_mode()
    with torch.no_grad():  # (not differentiated: the Function below is straight-through)
        q8, k8, v8, qd, kd, vd = quantize_qkv(q.detach(), k.detach(), v.detach(), granularity, hadamard, _BLOCK)
    if b is not None and granularity != "per_block":  # varlen descales come as batch 1: one row per sequence
        qd, kd = (expand_descale(x, b, k.shape[-2], q.device) for x in (qd, kd))
    if b is not None:
        vd = expand_descale(vd, b, k.shape[-2], q.device)
    rotation = _rotation(q.shape[-1], q.device) if hadamard else None
    attn = (
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        C.check_softmax_scale(softmax_scale, q.shape[-1]),
        bool(causal),
        window[0],
        window[1],
        float(softcap),
        _BLOCK if granularity == "per_block" else 0,
        mode,
        bool(deterministic),
    )
    o, lse = ops.QuantizedAttention.apply(q, k, v, q8, k8, v8, qd, kd, vd, rotation, attn)
    return (o, lse) if return_lse else o
