"""Quantize new K/V tokens into a paged cache (one launch for K and V).

``launch_write_kv_cache`` takes explicit slots: ``slot_mapping[t] = block_id * page_size + offset``; a
negative slot (padding) is skipped. ``launch_append_kv_cache`` (the append of ``flash_attn_with_kvcache``)
derives each token's slot in the kernel from the page table, the cached lengths and the new-token layout,
and writes the lengths after the append, so the append is one launch with no slot arithmetic around it.
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

from .common import INTERPRET, cdiv, next_pow2
from .planning import DESCALE_FLOOR, is_v_seq_major, scale_storage_pad
from .replay import launch

__all__ = ["launch_write_kv_cache", "launch_append_kv_cache"]

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
                 D: tl.constexpr, BLOCK_D: tl.constexpr, MODE: tl.constexpr, HAS_DS: tl.constexpr,
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
            if HAS_DS:
                ds = tl.load(DS + seq * s_db + heads * s_dh, mask=hmask, other=1.0)
            else:  # no descale: x / 1 (exact), without a tensor of ones per call
                ds = tl.where(hmask, 1.0, 1.0)
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
def _write_kv_kernel(ptrs, sizes, strides,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK_H: tl.constexpr, MODE: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
                     HAS_KD: tl.constexpr, HAS_VD: tl.constexpr,
                     FP8_MAX: tl.constexpr, FLOOR: tl.constexpr, INTERP: tl.constexpr,
                     K_SCALE_PAD: tl.constexpr, V_SCALE_PAD: tl.constexpr):
    """One token (program 0) x BLOCK_H heads (program 1) to its slot. Run-time arguments in bundles (triton
    flattens them into the same parameters in the same order): ptrs (K, V, KC, VC, SLOTS, SEQ_IDX, KD, VD,
    KS, VS); sizes (nheads, page_size, num_slots, num_seqs); strides ((k: token, head), (v), then
    ``_scale_args``'s cache, scale and descale strides)."""
    K, V, KC, VC, SLOTS, SEQ_IDX, KD, VD, KS, VS = ptrs
    nheads, page_size, num_slots, num_seqs = sizes
    s_kt, s_kh = strides[0]
    s_vt, s_vh = strides[1]
    s_kcb, s_kcp, s_kch, s_kcd = strides[2]
    s_vcb, s_vcp, s_vch, s_vcd = strides[3]
    s_ksb, s_ksp, s_ksh = strides[4]
    s_vsb, s_vsp, s_vsh = strides[5]
    s_kdb, s_kdh = strides[6]
    s_vdb, s_vdh = strides[7]
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
                 D, BLOCK_D, MODE, HAS_KD, FP8_MAX, FLOOR, INTERP, K_SCALE_PAD)
    _quant_store(V, VC, VS, VD, t, seq, blk, off, heads, hmask,
                 s_vt, s_vh, s_vcb, s_vcp, s_vch, s_vcd, s_vsb, s_vsp, s_vsh, s_vdb, s_vdh,
                 DV, BLOCK_DV, MODE, HAS_VD, FP8_MAX, FLOOR, INTERP, V_SCALE_PAD)


@triton.jit
def _append_kv_kernel(ptrs, sizes, strides,
                      D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_B: tl.constexpr, MODE: tl.constexpr, VARLEN: tl.constexpr,
                      HAS_KD: tl.constexpr, HAS_VD: tl.constexpr,
                      FP8_MAX: tl.constexpr, FLOOR: tl.constexpr, INTERP: tl.constexpr,
                      K_SCALE_PAD: tl.constexpr, V_SCALE_PAD: tl.constexpr):
    """One new token (program 0) x BLOCK_H heads (program 1). Token t of sequence b (its i-th new token)
    goes to position ``SEQLENS[b] + i``: page ``PT[b, pos // page_size]``, offset ``pos % page_size``.
    Program (0, 0) also writes ``TOTAL[b] = SEQLENS[b] + new tokens of b``. Run-time arguments in bundles
    (triton flattens them into the same parameters in the same order): ptrs (K, V, KC, VC, PT, SEQLENS, CU,
    TOTAL, KD, VD, KS, VS); sizes (batch, nheads, page_size, max_pages, num_blocks, seqlen_new, num_tokens);
    strides ((k: batch, token, head), (v), (page table: row, column), lengths, cu, then ``_scale_args``'s
    cache, scale and descale strides)."""
    K, V, KC, VC, PT, SEQLENS, CU, TOTAL, KD, VD, KS, VS = ptrs
    batch, nheads, page_size, max_pages, num_blocks, seqlen_new, num_tokens = sizes
    s_kb, s_kt, s_kh = strides[0]
    s_vb, s_vt, s_vh = strides[1]
    s_ptb, s_ptc = strides[2]
    s_len = strides[3]
    s_cu = strides[4]
    s_kcb, s_kcp, s_kch, s_kcd = strides[5]
    s_vcb, s_vcp, s_vch, s_vcd = strides[6]
    s_ksb, s_ksp, s_ksh = strides[7]
    s_vsb, s_vsp, s_vsh = strides[8]
    s_kdb, s_kdh = strides[9]
    s_vdb, s_vdh = strides[10]
    t = tl.program_id(0).to(tl.int64)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        for b0 in range(0, batch, BLOCK_B):
            bs = b0 + tl.arange(0, BLOCK_B)
            bm = bs < batch
            n = tl.load(SEQLENS + bs * s_len, mask=bm, other=0)
            if VARLEN:
                n += tl.load(CU + (bs + 1) * s_cu, mask=bm, other=0) - tl.load(CU + bs * s_cu, mask=bm, other=0)
            else:
                n += seqlen_new
            tl.store(TOTAL + bs, n, mask=bm)
    if VARLEN:
        # sequence = number of sequences that end at or before t (searchsorted(cu[1:], t, right=True)); a
        # token past cu[batch] (padding) gets the sequence ``batch`` and is skipped
        seq = tl.zeros((), tl.int64)
        for b0 in range(0, batch, BLOCK_B):
            bs = b0 + tl.arange(0, BLOCK_B)
            ends = tl.load(CU + (bs + 1) * s_cu, mask=bs < batch, other=2147483647)
            seq += tl.sum((ends <= t).to(tl.int64), 0)
        ok = (t < num_tokens) & (seq < batch)
        seq = tl.minimum(seq, batch - 1)
        i = t - tl.load(CU + seq * s_cu, mask=ok, other=0).to(tl.int64)
        k_row = t * s_kt
        v_row = t * s_vt
    else:
        ok = t < num_tokens
        seq = t // tl.maximum(seqlen_new, 1)  # (no token when seqlen_new == 0: ok is False)
        i = t % tl.maximum(seqlen_new, 1)
        k_row = seq * s_kb + i * s_kt
        v_row = seq * s_vb + i * s_vt
    pos = tl.load(SEQLENS + seq * s_len, mask=ok, other=0).to(tl.int64) + i
    col = pos // page_size
    # positions outside the row's pages (lengths the API checks only on the CPU or with validate=True) and
    # page ids outside the cache (e.g. the -1 of an unused table entry) are skipped: never a write elsewhere
    ok = ok & (pos >= 0) & (col < max_pages)
    blk = tl.load(PT + seq * s_ptb + col * s_ptc, mask=ok, other=-1).to(tl.int64)
    ok = ok & (blk >= 0) & (blk < num_blocks)
    if ok:
        off = pos % page_size
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < nheads
        _quant_store(K, KC, KS, KD, k_row, seq, blk, off, heads, hmask,
                     1, s_kh, s_kcb, s_kcp, s_kch, s_kcd, s_ksb, s_ksp, s_ksh, s_kdb, s_kdh,
                     D, BLOCK_D, MODE, HAS_KD, FP8_MAX, FLOOR, INTERP, K_SCALE_PAD)
        _quant_store(V, VC, VS, VD, v_row, seq, blk, off, heads, hmask,
                     1, s_vh, s_vcb, s_vcp, s_vch, s_vcd, s_vsb, s_vsp, s_vsh, s_vdb, s_vdh,
                     DV, BLOCK_DV, MODE, HAS_VD, FP8_MAX, FLOOR, INTERP, V_SCALE_PAD)


def _descale_strides(d: torch.Tensor | None):
    """(stride over sequences, stride over heads) of a per-tensor or (batch, nheads_k|1) descale."""
    if d is None or d.numel() == 1:
        return 0, 0
    if d.dim() == 1:  # (batch,) per sequence
        return d.stride(0), 0
    return (d.stride(0) if d.shape[0] > 1 else 0), (d.stride(1) if d.shape[1] > 1 else 0)


def _scale_args(k, v, k_cache, v_cache, k_descale, v_descale, k_cache_scales, v_cache_scales, dummy):
    """The arguments both kernels share past their token operands: the caches, descales, scale tensors,
    their strides and the mode constexprs (kwargs). A missing static descale is 1 (no tensor of ones)."""
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert v_cache.stride(-1) == 1 or is_v_seq_major(v_cache)
    if k_cache.dtype not in _FP8_MAX:
        mode = MODE_COPY
    elif k_cache_scales is not None:
        mode = MODE_DYNAMIC
    else:
        mode = MODE_STATIC
    static = mode == MODE_STATIC
    kd = k_descale if static and k_descale is not None else None
    vd = v_descale if static and v_descale is not None else None
    dyn = mode == MODE_DYNAMIC
    d, dv = k.shape[-1], v.shape[-1]
    nheads_k = k.shape[-2]
    block_h = min(next_pow2(nheads_k), 16)
    tensors = (k_cache, v_cache)
    scales = (kd if kd is not None else dummy, vd if vd is not None else dummy,
              k_cache_scales if dyn else dummy, v_cache_scales if dyn else dummy)
    strides = (tuple(k_cache.stride()), tuple(v_cache.stride()),
               tuple(k_cache_scales.stride()) if dyn else (0, 0, 0), tuple(v_cache_scales.stride()) if dyn else (0, 0, 0),
               tuple(_descale_strides(kd)), tuple(_descale_strides(vd)))
    meta = dict(D=d, DV=dv, BLOCK_D=next_pow2(d), BLOCK_DV=next_pow2(dv), BLOCK_H=block_h, MODE=mode,
                HAS_KD=kd is not None, HAS_VD=vd is not None,
                FP8_MAX=_FP8_MAX.get(k_cache.dtype, 1.0), FLOOR=DESCALE_FLOOR, INTERP=INTERPRET,
                K_SCALE_PAD=scale_storage_pad(k_cache_scales.dtype) if dyn else 1.0,
                V_SCALE_PAD=scale_storage_pad(v_cache_scales.dtype) if dyn else 1.0, num_warps=4)
    return tensors, scales, strides, meta, cdiv(nheads_k, block_h)


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
        Ignored for a 16-bit cache. Used when the cache scales are None; None means 1.
    token_seq_idx : (num_tokens,) int32, the batch row of each token (per-(sequence, head) descales); a token
        whose row is outside the descales' rows is skipped.
    k_cache_scales, v_cache_scales : (num_blocks, page_size, nheads_k) float32 or bfloat16. When given
        (both), the per-token-head descale is computed dynamically from each (token, head), rounded to
        the storage dtype (padded up, ``quant.scale_storage_pad``) and stored there; the cache holds
        the values quantized with exactly the stored descale.
    """
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    caches, scales, strides, meta, head_blocks = _scale_args(k, v, k_cache, v_cache, k_descale, v_descale,
                                                             k_cache_scales, v_cache_scales, slot_mapping)
    s_kdb, s_vdb = strides[-2][0], strides[-1][0]
    has_seq = meta["MODE"] == MODE_STATIC and (s_kdb != 0 or s_vdb != 0)
    used = (d for d, on in ((k_descale, meta["HAS_KD"]), (v_descale, meta["HAS_VD"])) if on)
    seq_rows = [d.shape[0] for d in used if d.numel() != 1]
    page_size = k_cache.shape[1]
    launch(_write_kv_kernel, (num_tokens, head_blocks),
        (k, v, *caches, slot_mapping, token_seq_idx if has_seq else slot_mapping, *scales),
        (k.shape[1], page_size, k_cache.shape[0] * page_size, min(seq_rows) if seq_rows else 1),
        ((k.stride(0), k.stride(1)), (v.stride(0), v.stride(1)), *strides), HAS_SEQ_IDX=has_seq, **meta)


def launch_append_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, cache_seqlens: torch.Tensor,
                           cu_seqlens_k_new: torch.Tensor | None = None, *, k_descale: torch.Tensor | None = None,
                           v_descale: torch.Tensor | None = None, k_cache_scales: torch.Tensor | None = None,
                           v_cache_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Append new K/V tokens after each sequence's cached ones (quantizing as ``launch_write_kv_cache``), in
    place, in one launch; returns the lengths after the append.

    Parameters
    ----------
    k : (batch, seqlen_new, nheads_k, headdim), or varlen (total_new, nheads_k, headdim) with
        ``cu_seqlens_k_new``; bf16/fp16/fp32, last dim contiguous.
    v : as ``k`` with headdim_v.
    k_cache, v_cache : (num_blocks, page_size, nheads_k, headdim[_v]) as in ``launch_write_kv_cache``.
    page_table : (batch, max_pages) int32 (any strides): sequence b's position p lives in page
        ``page_table[b, p // page_size]`` at offset ``p % page_size``.
    cache_seqlens : (batch,) int32, tokens already cached; sequence b's i-th new token goes to position
        ``cache_seqlens[b] + i``.
    cu_seqlens_k_new : (batch + 1,) int32 offsets of the sequences' new tokens in a varlen ``k``; tokens past
        ``cu_seqlens_k_new[batch]`` are skipped.
    k_descale, v_descale : float32 per-tensor, (batch, nheads_k) or (batch, 1) static descales (row b for
        sequence b); None means 1. k_cache_scales, v_cache_scales : dynamic per-token-head scales, as in
        ``launch_write_kv_cache``.

    A token whose position is negative or at or past ``max_pages * page_size``, or whose page id is outside
    ``[0, num_blocks)``, is not written (its lengths are still counted in the result).

    Returns
    -------
    (batch,) int32: ``cache_seqlens[b]`` + the new tokens of sequence b.
    """
    batch = page_table.shape[0]
    varlen = cu_seqlens_k_new is not None
    num_tokens = k.shape[0] if varlen else k.shape[0] * k.shape[1]
    seqlen_new = 0 if varlen else k.shape[1]
    total = torch.empty(batch, dtype=torch.int32, device=k.device)
    caches, scales, strides, meta, head_blocks = _scale_args(k, v, k_cache, v_cache, k_descale, v_descale,
                                                             k_cache_scales, v_cache_scales, total)
    if varlen:
        kst, vst = (0, k.stride(0), k.stride(1)), (0, v.stride(0), v.stride(1))
    else:
        kst, vst = (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2))
    if batch == 0:
        return total
    launch(_append_kv_kernel, (max(num_tokens, 1), head_blocks),
        (k, v, *caches, page_table, cache_seqlens, cu_seqlens_k_new if varlen else total, total, *scales),
        (batch, k.shape[-2], k_cache.shape[1], page_table.shape[1], k_cache.shape[0], seqlen_new, num_tokens),
        (kst, vst, (page_table.stride(0), page_table.stride(1)), cache_seqlens.stride(0),
         cu_seqlens_k_new.stride(0) if varlen else 0, *strides),
        BLOCK_B=min(next_pow2(batch), 256), VARLEN=varlen, **meta)
    return total
