"""Fused quantization of 16-bit Q, K, V to FP8 e4m3 with descales (+ optional Hadamard rotation).

``quantize_qkv`` runs two Triton kernels on CUDA (or under TRITON_INTERPRET=1): a tile pass that
computes the amax of every (batch, head, token block) — and, for per-block granularity, quantizes in
the same pass since a tile is exactly one scale block — and, for per-tensor / per-head granularity,
a second pass that quantizes with the reduced descale. The tiny amax reductions between the passes
are torch ops (no host sync). A pure-torch path computes the same thing on CPU and is used when
Triton is not importable.

Descale convention (fp8attn.quant): ``descale = max(amax, DESCALE_FLOOR * 448) / 448`` and
``x8 = saturate(x / descale)``.
"""
from __future__ import annotations

import math
import os

import torch

from .. import hadamard as _had
from ..quant import DESCALE_FLOOR

try:  # the package must import on machines without triton
    import triton
    import triton.language as tl
    _HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    _HAS_TRITON = False

__all__ = ["quantize_qkv", "GRANULARITIES"]

GRANULARITIES = ("per_tensor", "per_head", "per_block")
E4M3_MAX = 448.0
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


if _HAS_TRITON:
    if _INTERPRET:  # same interpreter fixes the dense kernel installs
        from ._interpret import _interpreter_compat
        _interpreter_compat()

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
        xf = tl.where(xf != xf, 0.0, xf)  # NaN carries no magnitude for the amax
        amax = tl.max(tl.max(tl.abs(xf), 1), 0)
        if WRITE_AMAX:
            tl.store(Amax + b * stride_ab + h * stride_ah + blk * stride_an, amax)
        if QUANT:
            if SELF_SCALE:
                ds = tl.maximum(amax, DESCALE_FLOOR_C * E4M3_MAX_C) / E4M3_MAX_C
                tl.store(Ds + b * stride_db + h * stride_dh + blk * stride_dn, ds)
            else:
                ds = tl.load(Ds + b * stride_db + h * stride_dh + blk * stride_dn)
            y = xf / ds
            y = tl.minimum(tl.maximum(y, -E4M3_MAX_C), E4M3_MAX_C)
            tl.store(Y + b * stride_yb + t64[:, None] * stride_ys + h * stride_yh + offs_d[None, :] * stride_yd,
                     y.to(tl.float8e4nv), mask=m)

    DESCALE_FLOOR_C = tl.constexpr(DESCALE_FLOOR)
    E4M3_MAX_C = tl.constexpr(E4M3_MAX)


def _as4d(x):
    """(batch, seqlen, heads, dim) view; varlen (total, heads, dim) becomes batch 1."""
    return x.unsqueeze(0) if x.dim() == 3 else x


def _descale_from_amax(amax):
    return (amax.float().clamp_min(DESCALE_FLOOR * E4M3_MAX) / E4M3_MAX).to(torch.float32)


def _reduce(amax_blocks, granularity, nheads_k):
    """(batch, heads, nblocks) block amaxes -> descale of the granularity, as a view the kernel reads
    at [b, h, blk] and the dense kernel reads at [b, h_k] (per-head / per-tensor) or [b, h, blk]."""
    b, h, nb = amax_blocks.shape
    if granularity == "per_tensor":
        d = _descale_from_amax(amax_blocks.amax()).reshape(1, 1)
        return d.expand(b, nheads_k), d.reshape(1, 1, 1).expand(b, h, nb)
    if granularity == "per_head":
        g = h // nheads_k
        a = amax_blocks.amax(dim=2).view(b, nheads_k, g).amax(dim=2)  # (b, h_k)
        d = _descale_from_amax(a)
        full = d.repeat_interleave(g, dim=1)[:, :, None].expand(b, h, nb)
        return d, full
    d = _descale_from_amax(amax_blocks)
    return d, d


def _torch_path(x, granularity, nheads_k, rotate, seed, block_t):
    x4 = _as4d(x)
    b, s, h, d = x4.shape
    xf = _had.rotate(x4, seed) if rotate else x4.float()
    xf = torch.nan_to_num(xf, nan=0.0) if not rotate else xf
    nb = max(1, math.ceil(s / block_t))
    a = torch.nn.functional.pad(xf.abs().nan_to_num(nan=0.0), (0, 0, 0, 0, 0, nb * block_t - s))
    amax_blocks = a.view(b, nb, block_t, h, d).amax(dim=(2, 4)).transpose(1, 2)  # (b, h, nb)
    ret, full = _reduce(amax_blocks, granularity, nheads_k)
    idx = torch.arange(s, device=x.device) // block_t
    dtok = full[:, :, idx].transpose(1, 2).unsqueeze(-1)  # (b, s, h, 1)
    y = (xf / dtok).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (y.squeeze(0) if x.dim() == 3 else y), ret


def _triton_path(x, granularity, nheads_k, rotate, seed, block_t):
    x4 = _as4d(x)
    b, s, h, d = x4.shape
    block_d = max(16, triton.next_power_of_2(d))
    nb = max(1, triton.cdiv(s, block_t))
    y = torch.empty(b, s, h, d, device=x.device, dtype=torch.float8_e4m3fn)
    if rotate:
        r = torch.zeros(block_d, block_d, device=x.device, dtype=x.dtype)  # ±1: exact in any dtype
        r[:d, :d] = _had.rotation_matrix(d, seed, device=x.device, dtype=x.dtype, normalized=False)
        r_scale = 1.0 / math.sqrt(_had.hadamard_block_size(d))
    else:
        r, r_scale = y, 1.0
    amax = torch.empty(b, h, nb, device=x.device, dtype=torch.float32)
    grid = (nb, b, h)
    common = (s, h, d, r_scale, *x4.stride(), *y.stride())
    if granularity == "per_block":
        ds = torch.empty(b, h, nb, device=x.device, dtype=torch.float32)
        _quant_tile_kernel[grid](x4, y, r, amax, ds, *common, *amax.stride(), *ds.stride(),
                                 ROTATE=rotate, WRITE_AMAX=False, QUANT=True, SELF_SCALE=True,
                                 BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
        ret = ds
    else:
        _quant_tile_kernel[grid](x4, y, r, amax, amax, *common, *amax.stride(), *amax.stride(),
                                 ROTATE=rotate, WRITE_AMAX=True, QUANT=False, SELF_SCALE=False,
                                 BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
        ret, full = _reduce(amax, granularity, nheads_k)
        _quant_tile_kernel[grid](x4, y, r, amax, full, *common, *amax.stride(), *full.stride(),
                                 ROTATE=rotate, WRITE_AMAX=False, QUANT=True, SELF_SCALE=False,
                                 BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
    return (y.squeeze(0) if x.dim() == 3 else y), ret


def quantize_qkv(q, k, v, granularity="per_head", hadamard=False, block_size=128, *,
                 seed=_had.DEFAULT_SEED, backend="auto"):
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
        auto: Triton on CUDA tensors, torch otherwise.

    Returns
    -------
    (q8, k8, v8, q_descale, k_descale, v_descale)
        FP8 e4m3fn tensors of the inputs' shapes (contiguous) and float32 descales as above. With
        per_block, pass ``descale_block_q=descale_block_k=block_size`` to the dense kernel.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    bt = int(block_size)
    if granularity == "per_block" and (bt < 16 or bt > 256 or bt & (bt - 1)):
        raise ValueError(f"block_size: expected a power of two in [16, 256], got {block_size}")
    if granularity != "per_block":
        bt = 64
    hk = k.shape[-2]
    use_triton = backend == "triton" or (backend == "auto" and _HAS_TRITON and q.is_cuda)
    if backend == "triton" and not _HAS_TRITON:
        raise RuntimeError("backend='triton' needs triton; use backend='torch'")
    fn = _triton_path if use_triton else _torch_path
    q8, qd = fn(q, granularity, hk, hadamard, seed, bt)
    k8, kd = fn(k, granularity, hk, hadamard, seed, bt)
    vg = "per_head" if granularity == "per_block" else granularity
    v8, vd = fn(v, vg, hk, False, seed, 64)
    return q8, k8, v8, qd, kd, vd
