"""``quantize_qkv``: 16-bit Q, K, V -> FP8 e4m3 with descales, optionally Hadamard-rotating Q and K.

On CUDA (or under TRITON_INTERPRET=1) it runs the Triton kernel of kernels/quantize.py: per input at
most two launches (amax partials, then the in-kernel reduction of each scale group and the quantization),
one where a tile or one program covers a whole scale group; no torch op runs between them (no host
sync). A pure-torch path computes the same thing elsewhere.

Descale convention (fp8attn.quant): ``descale = max(amax, DESCALE_FLOOR * 448) / 448`` and
``x8 = saturate(x / descale)``.

Non-finite inputs are never replaced silently: where values are checked (CPU tensors, or ``validate=True``)
they raise; elsewhere a NaN or Inf makes the amax of its scale group NaN, hence its descale NaN, so every
attention output that reads the group is NaN (no host sync on the way).
"""

from __future__ import annotations

import torch

from . import hadamard as _had
from . import ops, plan
from ._checks import check_finite, check_flag, check_same_device, describe
from .capability import has_triton, kernel_for
from .quant import descale_shape, empty_seq_major, quantize_one  # (re-exported: their home is fp8attn.quant)

__all__ = ["quantize_qkv", "GRANULARITIES", "V_LAYOUTS", "empty_seq_major", "quantize_one", "descale_shape"]

GRANULARITIES = ("per_tensor", "per_head", "per_block")
V_LAYOUTS = ("seq_major", "contiguous")


def _validate(q, k, v, granularity, hadamard, block_size, seed, backend, v_layout, validate):
    """Every check of ``quantize_qkv``; returns the token block of the scales."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}. Pass {name} as a tensor.")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"{name}: expected bf16/fp16/fp32, got {t.dtype}. quantize_qkv takes unquantized inputs.")
        if t.dim() not in (3, 4):
            raise ValueError(
                f"{name}: expected (batch, seqlen, heads, dim) or varlen (total, heads, dim), "
                f"got shape {tuple(t.shape)}. Reshape {name} to that layout."
            )
    check_same_device(q=q, k=k, v=v)
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(f"q/k/v: expected the same layout, got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D tensors.")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"q: expected nheads_q divisible by nheads_k = {k.shape[-2]}, got {q.shape[-2]}.")
    check_flag("hadamard", hadamard)
    check_flag("validate", validate)
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"granularity: expected one of {GRANULARITIES}, got {describe(granularity)}. "
            "Pick per_tensor, per_head (FA3's descales) or per_block."
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(
            f"block_size: expected an int (tokens per scale block), got {describe(block_size)}. "
            "Pass a power of two in [16, 256]."
        )
    if granularity == "per_block" and (block_size < 16 or block_size > 256 or block_size & (block_size - 1)):
        raise ValueError(f"block_size: expected a power of two in [16, 256], got {block_size}. Pass 64 or 128.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {describe(seed)}. Pass the rotation's seed as an int.")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(
            f"backend: expected 'auto', 'triton' or 'torch', got {describe(backend)}. "
            "Pass 'auto' (Triton on CUDA tensors, torch otherwise)."
        )
    if backend == "triton" and not has_triton():
        raise ValueError(
            "backend: expected 'auto' or 'torch' without triton installed, got 'triton'. "
            "Install triton or pass backend='torch'."
        )
    if v_layout not in V_LAYOUTS:
        raise ValueError(
            f"v_layout: expected one of {V_LAYOUTS}, got {describe(v_layout)}. seq_major feeds the FP8 "
            "kernels without a transpose; contiguous keeps V row-major."
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_finite(name, t, validate)
    return block_size if granularity == "per_block" else 64


def quantize_qkv(
    q,
    k,
    v,
    granularity="per_head",
    hadamard=False,
    block_size=128,
    *,
    seed=_had.DEFAULT_SEED,
    backend="auto",
    v_layout="seq_major",
    validate=False,
):
    """Quantize 16-bit Q, K, V to FP8 e4m3 with dynamic descales; optionally Hadamard-rotate Q and K.

    Parameters
    ----------
    q : torch.Tensor
        (batch, seqlen_q, nheads_q, headdim) or varlen (total_q, nheads_q, headdim); bf16/fp16/fp32.
    k : torch.Tensor
        (batch, seqlen_k, nheads_k, headdim) or varlen (total_k, nheads_k, headdim).
    v : torch.Tensor
        (batch, seqlen_k, nheads_k, headdim_v) or varlen (total_k, nheads_k, headdim_v).
    granularity : {"per_tensor", "per_head", "per_block"}
        per_tensor: one descale per tensor, returned as a stride-0 (batch, nheads_k) view.
        per_head: float32 (batch, nheads_k) (FA3's convention; Q's amax spans the query heads that
        share a KV head). per_block: q_descale float32 (batch, nheads_q, cdiv(seqlen_q, block_size)),
        k_descale float32 (batch, nheads_k, cdiv(seqlen_k, block_size)); V stays per-head (batch,
        nheads_k). Varlen inputs count as batch 1 (blocks run over the packed token index).
    hadamard : bool
        Rotate Q and K over the head dim by the same seeded random-sign Hadamard matrix before
        quantizing (``Q K^T`` is unchanged; see fp8attn.hadamard). V is not rotated.
    block_size : int
        Tokens per scale block (power of two, 16..256) for per_block.
    seed : int
        Seed of the rotation's signs.
    backend : {"auto", "triton", "torch"}
        auto: Triton on CUDA tensors where the kernels run (a CUDA call that cannot reports a fallback,
        ``fp8attn.capability``), torch otherwise.
    v_layout : {"seq_major", "contiguous"}
        Memory order of ``v8`` (its shape is v's either way). seq_major (default): the sequence
        dimension is contiguous, memory order (batch, nheads_k, headdim_v, seqlen_k) / varlen
        (nheads_k, headdim_v, total_k) -- the K-major operand Hopper's FP8 P @ V needs, written in the
        same pass, so flash_attn_func / flash_attn_varlen_func skip their V transpose pass (a full read
        and write of V). Use
        ``.reshape`` rather than ``.view`` on it. contiguous: row-major like the input.
    validate : bool
        Also check GPU inputs for NaN / Inf (a host sync). CPU inputs are always checked. A non-finite value
        raises ValueError naming the tensor and the count; unchecked (a GPU call without validate), it makes
        the descale of its scale group NaN (the group: the tensor for per_tensor, the (batch, KV head) for
        per_head, the (batch, head, token block) for per_block), so attention over it gives NaN, never a
        silently replaced value.

    Returns
    -------
    (q8, k8, v8, q_descale, k_descale, v_descale)
        FP8 e4m3fn tensors of the inputs' shapes (q8, k8 contiguous; v8 as ``v_layout``) and float32
        descales as above. With per_block, pass ``descale_block_size=block_size`` to flash_attn_func /
        flash_attn_varlen_func.
    """
    args = (granularity, hadamard, block_size, seed, backend, v_layout)
    key = None
    if validate is False and type(q) is torch.Tensor and q.is_cuda and type(hadamard) is bool:
        key, run = plan.find("quantize_qkv", (q, k, v), args)
        if run is not None:
            return run(q, k, v)
    bt = _validate(q, k, v, granularity, hadamard, block_size, seed, backend, v_layout, validate)
    hk = k.shape[-2]
    # auto: the Triton kernel on a CUDA device that can run it; a CUDA call that cannot reports the fallback
    use_triton = backend == "triton" or (backend == "auto" and kernel_for(q, "quantize") is not None)
    if key is not None and use_triton and plan.eager_ok(q, k, v):
        run = plan.quantize_plan(q, k, granularity, hk, hadamard, seed, bt, v_layout == "seq_major")
        plan.store(key, run)
        return run(q, k, v)
    op = ops.quantize_fp8  # one op per input: opaque to torch.compile, with an exact fake
    q8, qd = op(q, granularity, hk, bool(hadamard), int(seed), bt, False, use_triton)
    k8, kd = op(k, granularity, hk, bool(hadamard), int(seed), bt, False, use_triton)
    vg = "per_head" if granularity == "per_block" else granularity
    v8, vd = op(v, vg, hk, False, int(seed), 64, v_layout == "seq_major", use_triton)
    if granularity == "per_tensor":  # one descale, as a stride-0 (batch, nheads_k) view
        b = q.shape[0] if q.dim() == 4 else 1
        qd, kd, vd = (d.expand(b, hk) for d in (qd, kd, vd))
    return q8, k8, v8, qd, kd, vd
