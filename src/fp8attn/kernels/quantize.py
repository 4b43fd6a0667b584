"""Triton tile kernel behind ``fp8attn.quantize_qkv`` (see fp8attn/qkv.py for the orchestration).

One (token block, batch, head) tile per program: optional Hadamard rotation, the tile's amax, and/or
the saturating e4m3 quantization with a given (or, per-block, its own) descale. A NaN or Inf in a tile
makes its amax NaN (and so the descale of its scale group), never a silently replaced value.

Descale convention (fp8attn.quant): ``descale = max(amax, DESCALE_FLOOR * 448) / 448`` and
``x8 = saturate(x / descale)``.
"""
from __future__ import annotations

from ..quant import DESCALE_FLOOR

try:  # the package must import on machines without triton
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["launch_quant_tile", "HAS_TRITON"]

E4M3_MAX = 448.0


if HAS_TRITON:
    from .common import cdiv  # (also applies the interpreter fixes under TRITON_INTERPRET=1, once)

    @triton.jit
    def _quant_tile_kernel(X, Y, R, Amax, Ds,
                           seqlen, nheads, head_dim, r_scale,
                           stride_xb, stride_xs, stride_xh, stride_xd,
                           stride_yb, stride_ys, stride_yh, stride_yd,
                           stride_ab, stride_ah, stride_an,
                           stride_db, stride_dh, stride_dn,
                           ROTATE: tl.constexpr, WRITE_AMAX: tl.constexpr, QUANT: tl.constexpr,
                           SELF_SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """One (token block, batch, head) tile: optional rotation x @ R, amax, FP8 quantization.

        SELF_SCALE: the descale comes from this tile's own amax (per-block granularity, one pass).
        Otherwise QUANT reads the descale at Ds[b, h, blk] (stride-0 views broadcast).
        """
        blk = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        h = tl.program_id(2).to(tl.int64)
        offs_t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, BLOCK_D)
        t_ok = offs_t < seqlen
        d_ok = offs_d < head_dim
        m = t_ok[:, None] & d_ok[None, :]
        t64 = offs_t.to(tl.int64)
        x = tl.load(X + b * stride_xb + t64[:, None] * stride_xs + h * stride_xh + offs_d[None, :] * stride_xd,
                    mask=m, other=0.0)
        if ROTATE:
            r = tl.load(R + offs_d[:, None] * BLOCK_D + offs_d[None, :])
            xf = tl.dot(x, r, input_precision="ieee") * r_scale
        else:
            xf = x.to(tl.float32)
        xf = tl.where(m, xf, 0.0)
        # A NaN or Inf makes the tile's amax NaN, so its group's descale is NaN: visible damage, never a value
        # replaced silently (|x| < inf is False for NaN and +-Inf; no max-with-NaN semantics are relied on).
        finite = tl.abs(xf) < float("inf")
        n_bad = tl.sum(tl.sum(tl.where(finite, 0, 1), 1), 0)
        amax = tl.max(tl.max(tl.where(finite, tl.abs(xf), 0.0), 1), 0)
        amax = tl.where(n_bad > 0, float("nan"), amax)
        if WRITE_AMAX:
            tl.store(Amax + b * stride_ab + h * stride_ah + blk * stride_an, amax)
        if QUANT:
            if SELF_SCALE:
                ds = tl.maximum(amax, DESCALE_FLOOR_C * E4M3_MAX_C) / E4M3_MAX_C
                ds = tl.where(amax != amax, amax, ds)  # (keep a NaN amax: tl.maximum need not propagate it)
                tl.store(Ds + b * stride_db + h * stride_dh + blk * stride_dn, ds)
            else:
                ds = tl.load(Ds + b * stride_db + h * stride_dh + blk * stride_dn)
            y = xf / ds
            y = tl.minimum(tl.maximum(y, -E4M3_MAX_C), E4M3_MAX_C)
            tl.store(Y + b * stride_yb + t64[:, None] * stride_ys + h * stride_yh + offs_d[None, :] * stride_yd,
                     y.to(tl.float8e4nv), mask=m)

    DESCALE_FLOOR_C = tl.constexpr(DESCALE_FLOOR)
    E4M3_MAX_C = tl.constexpr(E4M3_MAX)


def launch_quant_tile(x4, y, r, r_scale, amax, ds, *, rotate, write_amax, quant, self_scale, block_t, block_d):
    """One pass of the tile kernel over x4 (batch, seqlen, heads, dim).

    Parameters
    ----------
    x4 : (batch, seqlen, heads, dim) bf16/fp16/fp32 input. y : same shape, float8_e4m3fn output.
    r : (block_d, block_d) +-1 rotation (x4's dtype) when rotate, else any tensor; r_scale its norm.
    amax : float32 (batch, heads, nblocks) written when write_amax.
    ds : float32 descales read at [b, h, blk] (stride-0 views allowed), or written there when self_scale.
    """
    b, s, h, d = x4.shape
    grid = (cdiv(s, block_t), b, h)
    _quant_tile_kernel[grid](x4, y, r, amax, ds, s, h, d, r_scale, *x4.stride(), *y.stride(),
                             *amax.stride(), *ds.stride(), ROTATE=rotate, WRITE_AMAX=write_amax,
                             QUANT=quant, SELF_SCALE=self_scale, BLOCK_T=block_t, BLOCK_D=block_d,
                             num_warps=4)
