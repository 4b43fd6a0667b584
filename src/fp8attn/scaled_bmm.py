"""``fp8attn::scaled_bmm``: batched FP8 matmul with per-batch, per-row and per-column scales.

``out[b, m, n] = scale_a[b, m] * scale_b[b, n] * sum_k a[b, m, k] * b[b, k, n]`` accumulated in
float32 and cast to ``out_dtype``. It is the matmul an FP8 attention program needs where
``torch._scaled_mm`` only takes per-tensor scales (torch 2.11's CPU kernel asserts per-tensor);
it has its own name in the ``fp8attn::`` namespace and never touches ``aten::_scaled_mm``.

Accepted scale shapes (float32; broadcasts are stride-0 views, never copies):

==============  ===================================  ====================================
granularity     scale_a                              scale_b
==============  ===================================  ====================================
per-tensor      (), (1,), (1, 1), (1, 1, 1)          same
per-batch       (batch,), (batch, 1), (batch, 1, 1)  (batch,), (batch, 1), (batch, 1, 1)
per-row/token   (batch, M), (batch, M, 1)            --
per-column      --                                   (batch, 1, N)
==============  ===================================  ====================================

A 1-D scale of ``batch`` elements is per batch (also when ``batch == M``); pass (batch, M) for
per-row scales. Execution: CPU (and anything without the Triton path) upcasts to float32 and uses
``torch.bmm`` -- exact products (FP8 x FP8 fits in float32), float32 accumulation, scales applied
to the float32 result. CUDA (sm89+, e4m3fn/e5m2 with matching dtypes) runs a Triton kernel with FP8
``tl.dot`` tiles, one fresh dot per K tile added to a float32 accumulator (two-level accumulation),
and the scales applied in the epilogue.
"""

from __future__ import annotations

import functools

import torch

from .capability import kernel_for, launch_device

__all__ = ["scaled_bmm_impl", "normalize_scales", "launch_scaled_bmm"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_IN = _FP8 + (torch.bfloat16, torch.float16, torch.float32)
_OUT = (torch.bfloat16, torch.float16, torch.float32)


def _check(a, b, out_dtype):
    if a.dim() != 3 or b.dim() != 3:
        raise ValueError(
            f"a, b: expected 3-D (batch, M, K) and (batch, K, N), got {tuple(a.shape)} and "
            f"{tuple(b.shape)}. Add a batch dimension."
        )
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(
            f"b: expected ({a.shape[0]}, {a.shape[2]}, N) to match a {tuple(a.shape)}, got "
            f"{tuple(b.shape)}. Use the same batch and inner dimension."
        )
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in _IN:
            raise TypeError(f"{name}: expected float8_e4m3fn / float8_e5m2 (or 16/32-bit), got {t.dtype}.")
    if out_dtype not in _OUT:
        raise TypeError(f"out_dtype: expected bf16, fp16 or fp32, got {out_dtype}.")


def _norm(scale, batch, n, name, side):
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise TypeError(
            f"{name}: expected a float32 tensor, got {getattr(scale, 'dtype', type(scale))}. Pass {name}.float()."
        )
    s = scale
    if s.numel() == 1 and s.dim() <= 3:
        return s.reshape(1, 1).expand(batch, n)
    if s.dim() == 1 and s.shape[0] == batch:
        return s.reshape(batch, 1).expand(batch, n)
    if s.dim() == 3:
        s = (
            s.reshape(s.shape[0], s.shape[1] * s.shape[2])
            if (s.shape[2] == 1 if side == "a" else s.shape[1] == 1)
            else s
        )
    if s.dim() == 2 and s.shape[0] == batch and s.shape[1] in (1, n):
        return s.expand(batch, n)
    want = "(batch, M) / (batch, M, 1) per row" if side == "a" else "(batch, 1, N) per column"
    raise ValueError(
        f"{name}: expected per-tensor (), per-batch ({batch},) / ({batch}, 1, 1) or {want} with "
        f"batch={batch}, {'M' if side == 'a' else 'N'}={n}; got shape {tuple(scale.shape)}."
    )


def normalize_scales(a, b, scale_a, scale_b):
    """(batch, M) and (batch, N) float32 views of the scales (stride 0 where broadcast)."""
    return _norm(scale_a, a.shape[0], a.shape[1], "scale_a", "a"), _norm(
        scale_b, b.shape[0], b.shape[2], "scale_b", "b"
    )


def scaled_bmm_torch(a, b, sa, sb, out_dtype):
    """Upcast reference/CPU path. sa: (batch, M), sb: (batch, N) float32."""
    acc = torch.bmm(a.float(), b.float())
    return (acc * sa[:, :, None] * sb[:, None, :]).to(out_dtype)


def scaled_bmm_impl(a, b, scale_a, scale_b, out_dtype):
    """Implementation behind ``fp8attn::scaled_bmm`` (checks, then Triton on CUDA or torch)."""
    _check(a, b, out_dtype)
    sa, sb = normalize_scales(a, b, scale_a, scale_b)
    # (the kernel multiplies FP8 tiles of one dtype; other dtypes take the torch path by design, not a fallback)
    launch = kernel_for(a, "scaled_bmm", launch_scaled_bmm) if a.dtype in _FP8 and a.dtype == b.dtype else None
    out = torch.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=out_dtype, device=a.device)
    if launch is not None:
        with launch_device(a):
            launch(a, b, sa, sb, out)
        return out
    return out.copy_(scaled_bmm_torch(a, b, sa, sb, out_dtype))


@functools.lru_cache(None)
def launch_scaled_bmm():
    """The Triton launch function ``launch(a, b, sa, sb, out)`` (None without triton).

    a : (batch, M, K) e4m3fn/e5m2, b : (batch, K, N) same dtype, any strides; sa : (batch, M),
    sb : (batch, N) float32 (stride-0 views allowed); out : (batch, M, N) 16/32-bit, written in place.
    """
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    from .kernels.common import cdiv  # (also applies the interpreter fixes under TRITON_INTERPRET=1, once)

    @triton.jit
    def _scaled_bmm_kernel(
        A,
        B,
        SA,
        SB,
        O,
        M,
        N,
        K,
        s_ab,
        s_am,
        s_ak,
        s_bb,
        s_bk,
        s_bn,
        s_sab,
        s_sam,
        s_sbb,
        s_sbn,
        s_ob,
        s_om,
        s_on,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        bid = tl.program_id(2).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mm = offs_m < M
        nm = offs_n < N
        a_ptr = A + bid * s_ab + offs_m[:, None].to(tl.int64) * s_am
        b_ptr = B + bid * s_bb + offs_n[None, :].to(tl.int64) * s_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        num_k = (K + BLOCK_K - 1) // BLOCK_K  # (not tl.cdiv: a jit helper the interpreter may not wrap)
        for kt in range(0, num_k):
            kk = kt * BLOCK_K + offs_k
            km = kk < K
            at = tl.load(a_ptr + kk[None, :].to(tl.int64) * s_ak, mask=mm[:, None] & km[None, :], other=0.0)
            bt = tl.load(b_ptr + kk[:, None].to(tl.int64) * s_bk, mask=km[:, None] & nm[None, :], other=0.0)
            acc += tl.dot(at, bt)  # fresh dot per K tile: fp32 promotion (two-level accumulation)
        sa = tl.load(SA + bid * s_sab + offs_m * s_sam, mask=mm, other=0.0)
        sb = tl.load(SB + bid * s_sbb + offs_n * s_sbn, mask=nm, other=0.0)
        res = acc * sa[:, None] * sb[None, :]
        o_ptr = O + bid * s_ob + offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :].to(tl.int64) * s_on
        tl.store(o_ptr, res.to(O.dtype.element_ty), mask=mm[:, None] & nm[None, :])

    def launch(a, b, sa, sb, out):
        batch, m, k = a.shape
        n = b.shape[2]
        if out.numel() == 0:
            return
        if k == 0:
            out.zero_()
            return
        bm = 64 if m <= 64 else 128
        bn = 64 if n <= 64 else 128
        bk = 64 if k <= 64 else 128
        grid = (cdiv(m, bm), cdiv(n, bn), batch)
        _scaled_bmm_kernel[grid](
            a,
            b,
            sa,
            sb,
            out,
            m,
            n,
            k,
            a.stride(0),
            a.stride(1),
            a.stride(2),
            b.stride(0),
            b.stride(1),
            b.stride(2),
            sa.stride(0),
            sa.stride(1),
            sb.stride(0),
            sb.stride(1),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=4 if bm * bn <= 4096 else 8,
            num_stages=3,
        )

    return launch
