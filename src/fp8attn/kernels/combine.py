"""Split-KV combine: merge per-split partial outputs with their LSEs (FA3 ``flash_attn_combine``).

Each split ``s`` of a row produced a normalized partial output ``o_s`` and its natural-log LSE
``lse_s`` over a disjoint range of keys. The merged row is ``sum_s w_s * o_s`` with
``w_s = exp(lse_s - lse)`` and ``lse = log(sum_s exp(lse_s))``. An empty split is ``(anything, -inf)``
and gets weight exactly 0 (its partial is *selected* away, never multiplied, so a NaN partial of an
empty split cannot leak); a row whose splits are all empty gives ``out = 0`` and ``lse = -inf``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, LN2, LOG2E, cdiv, next_pow2, output_epilogue
from .replay import launch

__all__ = ["launch_combine", "combine_tiles"]

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
              torch.float8_e4m3fn: tl.float8e4nv}


@triton.jit
def _load_partials(op_base, offs_sp, smask, s_op_sp, offs_d, dmask):
    """Partials of the splits ``offs_sp`` (int64) for this program's head-dim slice, one 2D load."""
    return tl.load(op_base + offs_sp[:, None] * s_op_sp + offs_d[None, :], mask=smask[:, None] & dmask[None, :],
                   other=0.0)


@triton.jit
def _weighted_sum(l_sp, o, m_safe):
    """sum_s exp(lse_s - m) * o_s; an empty or out-of-range split (lse -inf) weighs exactly 0 and its
    partial is selected away, never multiplied (a NaN partial cannot leak)."""
    w = tl.exp2((l_sp - m_safe) * LOG2E)[:, None]
    return tl.sum(tl.where(w > 0.0, o * w, 0.0), 0)


@triton.jit
def _combine_chunk(acc, lp_base, op_base, sp0, num_splits, s_lp_sp, s_op_sp, m_safe, offs_d, dmask,
                   CHUNK: tl.constexpr):
    """Add CHUNK splits' weighted partials to ``acc`` with one 2D load (independent loads in flight,
    not one dependent round trip per split)."""
    offs_sp = sp0 + tl.arange(0, CHUNK)
    smask = offs_sp < num_splits
    offs_sp = offs_sp.to(tl.int64)
    l_sp = tl.load(lp_base + offs_sp * s_lp_sp, mask=smask, other=float("-inf"))
    o = _load_partials(op_base, offs_sp, smask, s_op_sp, offs_d, dmask)
    return acc + _weighted_sum(l_sp, o, m_safe)


@triton.jit
def _combine_kernel(OP, LP, O, LSE, OUT_SCALE,
                    num_splits, seqlen, nheads,
                    s_op_sp, s_op_b, s_op_s, s_op_h,
                    s_lp_sp, s_lp_b, s_lp_s, s_lp_h,
                    s_o_b, s_o_s, s_o_h,
                    s_l_b, s_l_s, s_l_h,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                    CHUNK: tl.constexpr, STORE_LSE: tl.constexpr, OUT_FP8: tl.constexpr, OUT_DTYPE: tl.constexpr,
                    INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d0 = tl.program_id(1) * BLOCK_D  # this program's slice of the head dim
    h = row % nheads
    bs = row // nheads
    s = bs % seqlen
    b = bs // seqlen

    offs_sp = tl.arange(0, BLOCK_SPLITS)
    smask = offs_sp < num_splits
    lp_base = LP + b * s_lp_b + s * s_lp_s + h * s_lp_h
    offs_d = d0 + tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    op_base = OP + b * s_op_b + s * s_op_s + h * s_op_h
    if CHUNK == BLOCK_SPLITS:
        # every split in one load, issued with the LSE load (before the max's reduction): one round trip
        o_all = _load_partials(op_base, offs_sp.to(tl.int64), smask, s_op_sp, offs_d, dmask)
    lses = tl.load(lp_base + offs_sp.to(tl.int64) * s_lp_sp, mask=smask, other=float("-inf"))
    m = tl.max(lses, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2((lses - m_safe) * LOG2E), 0)

    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if CHUNK == BLOCK_SPLITS:
        acc = _weighted_sum(lses, o_all, m_safe)
    elif INTERP:  # the interpreter's scalars are 1-element arrays that range() rejects
        sp0 = 0
        while sp0 < num_splits:
            acc = _combine_chunk(acc, lp_base, op_base, sp0, num_splits, s_lp_sp, s_op_sp, m_safe, offs_d, dmask,
                                 CHUNK)
            sp0 += CHUNK
    else:
        for sp0 in range(0, num_splits, CHUNK):
            acc = _combine_chunk(acc, lp_base, op_base, sp0, num_splits, s_lp_sp, s_op_sp, m_safe, offs_d, dmask,
                                 CHUNK)

    empty = total == 0.0
    out = acc * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    if OUT_FP8:
        out_scale_inv = 1.0 / tl.load(OUT_SCALE)
    else:
        out_scale_inv = 1.0
    y = output_epilogue(out, out_scale_inv, OUT_FP8, OUT_DTYPE)
    tl.store(O + b * s_o_b + s * s_o_s + h * s_o_h + offs_d, y, mask=dmask)
    if STORE_LSE:
        if d0 == 0:  # one program of the row writes its LSE
            lse = tl.where(empty, float("-inf"), (m_safe * LOG2E + tl.log2(tl.where(empty, 1.0, total))) * LN2)
            tl.store(LSE + b * s_l_b + s * s_l_s + h * s_l_h, lse)


def combine_tiles(num_splits: int, headdim: int):
    """(BLOCK_D, BLOCK_SPLITS, CHUNK, num_warps) of a combine launch.

    Up to 4096 partial elements per 2D load (32 fp32 registers per thread at 4 warps). Many splits
    narrow each program to a slice of the head dim (at least 32 wide) so that all splits of a slice
    arrive in one load and more programs share the rows: B1/L128k's 66 splits x 32 rows ran as 32
    programs with three dependent chunk loads each; as 128 programs of (128 splits x 32) it is one.
    """
    block_splits = next_pow2(max(num_splits, 1))
    block_d = next_pow2(headdim)
    block_d = min(block_d, max(32, 4096 // block_splits))
    chunk = max(1, min(block_splits, 4096 // block_d))
    nw = 1 if chunk * block_d <= 1024 else 4
    return block_d, block_splits, chunk, nw


def launch_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor | None = None, *, out_scale: torch.Tensor | None = None) -> None:
    """Merge split-KV partials into ``out`` (and ``lse``) in one launch.

    Parameters
    ----------
    out_partial : (num_splits, batch, seqlen, nheads, headdim), or varlen (num_splits, total, nheads, headdim);
        float32 or bfloat16. Any strides; the last dim contiguous.
    lse_partial : (num_splits, batch, seqlen, nheads) float32, or varlen (num_splits, total, nheads);
        natural-log LSE per split, ``-inf`` for an empty split. Any strides.
    out : (batch, seqlen, nheads, headdim) (varlen: (total, nheads, headdim)), any 16/32-bit dtype,
        or float8_e4m3fn with ``out_scale``. Written in place; last dim contiguous.
    lse : optional (batch, seqlen, nheads) (varlen: (total, nheads)) float32 view, any strides (pass
        ``lse.transpose(1, 2)`` of a (batch, nheads, seqlen) tensor). Written in place.
    out_scale : optional 0-d / (1,) float32 static output scale: ``out`` receives
        ``saturate(merged / out_scale)`` in e4m3fn (``common.output_epilogue``).
    """
    if out_partial.dim() == 4:  # varlen: add a unit batch dim
        out_partial = out_partial.unsqueeze(1)
        lse_partial = lse_partial.unsqueeze(1)
        out = out.unsqueeze(0)
        lse = lse.unsqueeze(0) if lse is not None else None
    num_splits, batch, seqlen, nheads, d = out_partial.shape
    assert out_partial.stride(-1) == 1 and out.stride(-1) == 1
    rows = batch * seqlen * nheads
    if rows == 0:
        return
    out_fp8 = out_scale is not None
    lse_t = lse if lse is not None else lse_partial[0]
    block_d, block_splits, chunk, nw = combine_tiles(num_splits, d)
    grid = (rows, cdiv(d, block_d))
    launch(_combine_kernel, grid,
        out_partial, lse_partial, out, lse_t, out_scale if out_fp8 else lse_partial,
        num_splits, seqlen, nheads,
        *out_partial.stride()[:4], *lse_partial.stride(), *out.stride()[:3], *lse_t.stride(),
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SPLITS=block_splits, CHUNK=chunk,
        STORE_LSE=lse is not None, OUT_FP8=out_fp8, OUT_DTYPE=_TL_DTYPES[out.dtype],
        INTERP=INTERPRET, num_warps=nw,
    )
