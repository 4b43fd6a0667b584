"""write_kv_cache: quantize new K/V tokens into a paged cache (one launch for K and V).

Slots: ``slot_mapping[t] = block_id * page_size + offset``; a negative slot (padding) is skipped.
Scale modes (``quant`` conventions, ``x ~= x8 * descale``):

* 16-bit cache: plain copy (descales ignored).
* static per-tensor descale (0-d / (1,) / (1, 1)): ``x8 = saturate(x / descale)``.
* static per-(sequence, head) descale (batch, nheads_k) with ``token_seq_idx`` giving each token's
  batch row.
* per-token-head (dynamic): ``descale = max(amax, DESCALE_FLOOR * fp8_max) / fp8_max`` over the head
  dim of each (token, head) -- exactly ``quant.compute_descale(..., "per_token_head")`` -- stored into
  ``k_cache_scales`` / ``v_cache_scales`` (num_blocks, page_size, nheads_k) float32 at the same slot.

All cache offsets are int64 (an FP8 cache passes 2**31 elements at 2 GiB). The cast saturates
(explicit clamp to +-fp8_max before the conversion).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..paged import is_v_seq_major
from ..quant import DESCALE_FLOOR, scale_storage_pad
from .common import INTERPRET, cdiv, next_pow2

__all__ = ["launch_write_kv_cache"]

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

MODE_COPY, MODE_STATIC, MODE_DYNAMIC = 0, 1, 2


@triton.jit
def _round_to_grid(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round finite fp32 ``y`` to the FP8 grid (MANT mantissa bits, MIN_EXP smallest normal exponent)
    with round-half-even, in fp32 arithmetic. Used only under TRITON_INTERPRET, whose fp32->fp8 cast
    loses the carry into the exponent on some values (7.99 -> 4); the compiled cast is exact RNE."""
    a = tl.abs(y)
    e = tl.floor(tl.log2(tl.where(a > 0.0, a, 1.0)))
    e = tl.maximum(e, MIN_EXP * 1.0)
    ulp = tl.exp2(e - MANT)
    q = y / ulp
    q = (q + 12582912.0) - 12582912.0  # RNE to an integer (|q| < 2**(MANT + 2))
    return q * ulp


@triton.jit
def _quant_store(X, C, CS, DS, t, seq, blk, off, heads, hmask,
                 s_xt, s_xh, s_cb, s_cp, s_ch, s_cd, s_sb, s_sp, s_sh, s_db, s_dh,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr,
                 FP8_MAX: tl.constexpr, FLOOR: tl.constexpr, INTERP: tl.constexpr, SCALE_PAD: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    m2 = hmask[:, None] & (offs_d[None, :] < D)
    x = tl.load(X + t * s_xt + heads[:, None] * s_xh + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
    # s_cd: 1, or page_size for a sequence-major V cache
    c_ptrs = C + blk * s_cb + off * s_cp + heads[:, None] * s_ch + offs_d[None, :] * s_cd
    if MODE == 0:
        tl.store(c_ptrs, x.to(C.dtype.element_ty), mask=m2)
    else:
        if MODE == 1:
            ds = tl.load(DS + seq * s_db + heads * s_dh, mask=hmask, other=1.0)
        else:
            a = tl.abs(x)
            a = tl.where(a != a, 0.0, a)  # NaN has no magnitude
            a = tl.where(a == float("inf"), FP8_MAX, a)
            amax = tl.max(a, 1)
            ds = tl.maximum(amax, FLOOR * FP8_MAX) / FP8_MAX
            # quantize with the value that is stored (bf16 scales: padded up, see quant.scale_storage_pad)
            ds = (ds * SCALE_PAD).to(CS.dtype.element_ty).to(tl.float32)
            tl.store(CS + blk * s_sb + off * s_sp + heads * s_sh, ds, mask=hmask)
        y = x / ds[:, None]
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        if INTERP:
            if FP8_MAX == 448.0:
                y = _round_to_grid(y, 3, -6)
            else:
                y = _round_to_grid(y, 2, -14)
        tl.store(c_ptrs, y.to(C.dtype.element_ty), mask=m2)


@triton.jit
def _write_kv_kernel(K, V, KC, VC, SLOTS, SEQ_IDX, KD, VD, KS, VS,
                     nheads, page_size, num_slots, num_seqs,
                     s_kt, s_kh, s_vt, s_vh,
                     s_kcb, s_kcp, s_kch, s_kcd, s_vcb, s_vcp, s_vch, s_vcd,
                     s_ksb, s_ksp, s_ksh, s_vsb, s_vsp, s_vsh,
                     s_kdb, s_kdh, s_vdb, s_vdh,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK_H: tl.constexpr, MODE: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
                     FP8_MAX: tl.constexpr, FLOOR: tl.constexpr, INTERP: tl.constexpr,
                     K_SCALE_PAD: tl.constexpr, V_SCALE_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    # negative slots are padding; slots past the cache and sequence rows past the descales (values the API checks
    # only on the CPU or with validate=True) are skipped too: never an out-of-bounds write or read
    if (slot < 0) | (slot >= num_slots):
        return
    blk = slot // page_size
    off = slot % page_size
    if HAS_SEQ_IDX:
        seq = tl.load(SEQ_IDX + t).to(tl.int64)
        if (seq < 0) | (seq >= num_seqs):
            return
    else:
        seq = 0
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < nheads
    _quant_store(K, KC, KS, KD, t, seq, blk, off, heads, hmask,
                 s_kt, s_kh, s_kcb, s_kcp, s_kch, s_kcd, s_ksb, s_ksp, s_ksh, s_kdb, s_kdh,
                 D, BLOCK_D, MODE, FP8_MAX, FLOOR, INTERP, K_SCALE_PAD)
    _quant_store(V, VC, VS, VD, t, seq, blk, off, heads, hmask,
                 s_vt, s_vh, s_vcb, s_vcp, s_vch, s_vcd, s_vsb, s_vsp, s_vsh, s_vdb, s_vdh,
                 DV, BLOCK_DV, MODE, FP8_MAX, FLOOR, INTERP, V_SCALE_PAD)


def _descale_strides(d: torch.Tensor | None, nheads_k: int):
    """(stride over sequences, stride over heads) of a per-tensor or (batch, nheads_k|1) descale."""
    if d is None or d.numel() == 1:
        return 0, 0
    if d.dim() == 1:  # (batch,) per sequence
        return d.stride(0), 0
    return (d.stride(0) if d.shape[0] > 1 else 0), (d.stride(1) if d.shape[1] > 1 else 0)


def launch_write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, *, k_descale: torch.Tensor | None = None,
                          v_descale: torch.Tensor | None = None, token_seq_idx: torch.Tensor | None = None,
                          k_cache_scales: torch.Tensor | None = None,
                          v_cache_scales: torch.Tensor | None = None) -> None:
    """Write (and quantize) new K/V tokens into a paged cache, in place.

    Parameters
    ----------
    k : (num_tokens, nheads_k, headdim) bf16/fp16/fp32, last dim contiguous.
    v : (num_tokens, nheads_k, headdim_v), same dtype as ``k``.
    k_cache : (num_blocks, page_size, nheads_k, headdim) float8_e4m3fn / float8_e5m2, or bf16/fp16
        (plain copy). Last dim contiguous.
    v_cache : (num_blocks, page_size, nheads_k, headdim_v), same dtype as ``k_cache``; last dim
        contiguous, or sequence-major (memory order (num_blocks, nheads_k, headdim_v, page_size),
        ``fp8attn.paged.alloc_paged_cache(..., v_seq_major=True)``).
    slot_mapping : (num_tokens,) int64 (int32 accepted): ``block_id * page_size + offset``; negative
        entries, and entries >= num_blocks * page_size, are skipped.
    k_descale, v_descale : float32 static descales: per-tensor (0-d / (1,) / (1, 1)) or
        per-(sequence, head) (batch, nheads_k) / per-sequence (batch, 1) with ``token_seq_idx``.
        Ignored for a 16-bit cache. Used when the cache scales are None.
    token_seq_idx : (num_tokens,) int32, the batch row of each token (per-(sequence, head) descales); a token
        whose row is outside the descales' rows is skipped.
    k_cache_scales, v_cache_scales : (num_blocks, page_size, nheads_k) float32 or bfloat16. When given
        (both), the per-token-head descale is computed dynamically from each (token, head), rounded to
        the storage dtype (padded up, ``quant.scale_storage_pad``) and stored there; the cache holds
        the values quantized with exactly the stored descale.
    """
    num_tokens, nheads_k, d = k.shape
    dv = v.shape[-1]
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert v_cache.stride(-1) == 1 or is_v_seq_major(v_cache)
    page_size = k_cache.shape[1]
    is_fp8 = k_cache.dtype in _FP8_MAX
    if not is_fp8:
        mode = MODE_COPY
    elif k_cache_scales is not None:
        mode = MODE_DYNAMIC
    else:
        mode = MODE_STATIC
    fp8_max = _FP8_MAX.get(k_cache.dtype, 1.0)
    dummy = slot_mapping
    if mode == MODE_STATIC:
        if k_descale is None:
            k_descale = torch.ones((), dtype=torch.float32, device=k.device)
        if v_descale is None:
            v_descale = torch.ones((), dtype=torch.float32, device=k.device)
    kd = k_descale if mode == MODE_STATIC else dummy
    vd = v_descale if mode == MODE_STATIC else dummy
    kdb, kdh = _descale_strides(k_descale, nheads_k) if mode == MODE_STATIC else (0, 0)
    vdb, vdh = _descale_strides(v_descale, nheads_k) if mode == MODE_STATIC else (0, 0)
    has_seq = mode == MODE_STATIC and (kdb != 0 or vdb != 0)
    ks = k_cache_scales if mode == MODE_DYNAMIC else dummy
    vs = v_cache_scales if mode == MODE_DYNAMIC else dummy
    kss = k_cache_scales.stride() if mode == MODE_DYNAMIC else (0, 0, 0)
    vss = v_cache_scales.stride() if mode == MODE_DYNAMIC else (0, 0, 0)
    seq_rows = [d.shape[0] for d in (k_descale, v_descale) if d is not None and d.numel() != 1]
    block_h = min(next_pow2(nheads_k), 16)
    grid = (num_tokens, cdiv(nheads_k, block_h))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, token_seq_idx if has_seq else slot_mapping, kd, vd, ks, vs,
        nheads_k, page_size, k_cache.shape[0] * page_size, min(seq_rows) if seq_rows else 1,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        *kss, *vss, kdb, kdh, vdb, vdh,
        D=d, DV=dv, BLOCK_D=next_pow2(d), BLOCK_DV=next_pow2(dv),
        BLOCK_H=block_h, MODE=mode, HAS_SEQ_IDX=has_seq, FP8_MAX=fp8_max, FLOOR=DESCALE_FLOOR,
        INTERP=INTERPRET,
        K_SCALE_PAD=scale_storage_pad(k_cache_scales.dtype) if mode == MODE_DYNAMIC else 1.0,
        V_SCALE_PAD=scale_storage_pad(v_cache_scales.dtype) if mode == MODE_DYNAMIC else 1.0,
        num_warps=4,
    )
