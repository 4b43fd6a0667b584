"""Paged-KV attention forward: decode, chunked prefill, mixed batches and split-KV, in one kernel.

One program handles one (query block, kv head, split). The query block packs the ``G = nheads_q /
nheads_k`` query heads that share a kv head into the M dimension (row ``r`` is token ``r // G``, head
``kv_head * G + r % G``), so each KV tile is read once per kv head. With ``cu_seqlens_q`` a batch
mixes decode rows (one query) and prefill chunks (many queries) in ONE launch: the grid is
``total_q // BLOCK_Q + batch`` programs (a capacity, never live data) and each program finds its
sequence by counting the query-block starts ``cu_seqlens_q[i] // BLOCK_Q + i`` at or below its index
(``common.find_seq``, vector loads); surplus programs exit at once. Programs are visited in reverse
order so the last (typically longest, prefill) sequences and the heavier causal blocks start first; in
mixed batches the decode rows' small-tile programs come before all of them (memory-bound rows beside
compute-bound tiles).

Keys: ``cache_seqlens[b]`` valid tokens, queries being the last ``seqlen_q`` of them (bottom-right
causal/window alignment). When ``page_size`` is a multiple of BLOCK_N (TILE_IN_PAGE) each KV tile
lies in one page and reads one page id; otherwise page ids are looked up per key row
(``page_table[b, j // page_size]``). Page ids are read one tile ahead and carried through the loop,
which keeps the K/V async copies of later tiles in flight (docs/decisions.md).
Every K/V load is masked to ``j < kv_hi <= cache_seqlens[b]`` and page-table reads stay on the row's
live pages (an empty range reads entry 0 and never uses it), so ``-1`` page entries and NaN-poisoned
slots past the length are never used as addresses or read.

Numerics (``common``): descales are folded (``q_descale * k_descale`` into the logit scale,
``v_descale`` into the final 1/rowsum); per-token-head cache scales multiply the logits' columns
(K) and the dequantized V rows. Two MMA paths:

* ``MMA_FP8``: Q, K and V all e4m3fn without per-token-head scales -> FP8 QK^T, and FP8 P@V (P scaled
  into e4m3's range by ``common.online_softmax_step``; ``P_FP8``) over sequence-major V, which arrives
  K-major as FP8 wgmma wants it. Over V in FA3's layout P@V runs in fp16 (V upcast in registers, exact;
  P rounded to fp16), and decode and small tiles there run the whole 16-bit path below
  (``paged.paged_precision``; a varlen launch's decode rows take their own ``MMA_FP8_S`` / ``CDT_S`` /
  ``P_FP8_S``). Benchmarks can ask for ``config={"pv_fp16": True}``: the fp16 P@V over sequence-major V.
* otherwise (16-bit Q over an FP8 cache, e5m2 caches, per-token-head scales, 16-bit caches): K/V
  are upcast in registers to a 16-bit compute dtype and the dots run in 16 bits with fp32
  accumulation. Over an FP8 cache that dtype is fp16 (e4m3/e5m2 are exact in fp16 and the upcast
  is one cvt per pair; Q is cast to fp16 clamped to +-65504, P is rounded to fp16), except bf16 Q
  with per-token-head V scales (bf16, as scaled V rows may leave fp16's range). A 16-bit cache uses
  its own dtype.

Split-KV: ``num_splits > 1`` divides each program's KV tiles evenly over the splits; each split
writes a normalized fp32 partial and its LSE (an empty split writes 0 and -inf), and
``combine.launch_combine`` merges them.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .combine import launch_combine
from .common import (
    INTERPRET,
    causal_window_mask,
    fill_varlen_block_list,
    finalize_rows,
    find_seq,
    full_tile_range,
    kv_range,
    next_pow2,
    online_softmax_step,
    output_epilogue,
    scale_logits,
    upcast_fp8_in_place,
)
from .hopper import dense_launch, paged_launch
from .planning import CPU_NUM_SMS, is_v_seq_major, paged_grid, paged_precisions, split_partials, window_flags
from .replay import launch

__all__ = ["launch_paged_fwd", "tma_reason", "launch_grid"]

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
       torch.float8_e4m3fn: tl.float8e4nv}
_LOG2E = math.log2(math.e)


@triton.jit
def _page_ids(pt_row, start_n, end, last_pg, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
              TILE_IN_PAGE: tl.constexpr):
    """Page ids of the KV tile starting at ``start_n`` (int32).

    TILE_IN_PAGE: one scalar id (the tile lies in one page), read at ``min(start_n // PAGE_SIZE, last_pg)``
    so that a prefetch past the split's last tile stays on a live entry. Otherwise one id per key row,
    masked to ``offs_n < end`` (-1 entries past the length are never read).
    """
    if TILE_IN_PAGE:
        return tl.load(pt_row + tl.minimum(start_n // PAGE_SIZE, last_pg))
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        return tl.load(pt_row + offs_n // PAGE_SIZE, mask=offs_n < end, other=0)


@triton.jit
def _kv_tile(start_n, end, blk, q, tok, qlen, kv_len, kvh, K, V, KS, VS, m_i, l_i, acc, scale, softcap,
             window_left, window_right, s_kb, s_kp, s_kh, s_vb, s_vp, s_vh, s_ksb, s_ksp, s_ksh,
             s_vsb, s_vsp, s_vsh, offs_d, offs_dv, dmask, dvmask,
             BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
             SOFTCAP: tl.constexpr, HAS_KS: tl.constexpr, HAS_VS: tl.constexpr, MMA_FP8: tl.constexpr,
             CDT: tl.constexpr, TILE_IN_PAGE: tl.constexpr, P_FP8: tl.constexpr, V_SEQ_MAJOR: tl.constexpr,
             MASKED: tl.constexpr):
    """One KV tile [start_n, start_n + BLOCK_N) of a program: QK^T, masks, softmax step.

    ``blk``: the tile's page ids from ``_page_ids`` (loaded one tile ahead by the caller). With
    TILE_IN_PAGE (PAGE_SIZE % BLOCK_N == 0, start_n a multiple of BLOCK_N) it is one scalar and the
    tile is a plain 2-D block of BLOCK_N consecutive slots of one page; otherwise one id per key row.
    MASKED=False: every key of the tile is below ``end`` and visible to every query row (no causal or
    window cut), so the length and logit masks are skipped.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kv_ok = offs_n < end
    blk = blk.to(tl.int64)
    if TILE_IN_PAGE:
        slot = tl.multiple_of(start_n % PAGE_SIZE, BLOCK_N) + tl.arange(0, BLOCK_N)
    else:
        slot = offs_n % PAGE_SIZE
    k_row = blk * s_kb + slot * s_kp + kvh * s_kh
    k_mask = dmask[:, None]
    if MASKED:
        k_mask = k_mask & kv_ok[None, :]
    k = tl.load(K + k_row[None, :] + offs_d[:, None], mask=k_mask, other=0.0)
    if MMA_FP8:
        qk = tl.dot(q, k)
    else:
        qk = tl.dot(q, k.to(CDT))
    if HAS_KS:
        ks = tl.load(KS + blk * s_ksb + slot * s_ksp + kvh * s_ksh, mask=kv_ok, other=0.0).to(tl.float32)
        qk = qk * ks[None, :]
    s = scale_logits(qk, scale, softcap, SOFTCAP)
    if MASKED:
        s = causal_window_mask(s, tok, offs_n, qlen, kv_len, CAUSAL, window_left, window_right, HAS_WINDOW)
    v_row = blk * s_vb + slot * s_vp + kvh * s_vh
    if V_SEQ_MAJOR:
        # Sequence-major V pages (slots contiguous, head dim strided by PAGE_SIZE): the tile arrives
        # K-major, as the FP8 P@V wants it, with no transpose. The load is not masked along the slots
        # (a per-slot mask there would forbid vector loads and async copies): every slot it touches
        # lies in a live page or page 0 (``_page_ids`` gives 0 past the length), and slots past the
        # length are replaced by zeros before use (a select, so NaN-poisoned slots cannot leak).
        v = tl.load(V + v_row[:, None] + offs_dv[None, :] * PAGE_SIZE, mask=dvmask[None, :], other=0.0)
        if MASKED:
            v = tl.where(kv_ok[:, None], v, tl.zeros_like(v))
    else:
        v = tl.load(V + v_row[:, None] + offs_dv[None, :], mask=kv_ok[:, None] & dvmask[None, :], other=0.0)
    if HAS_VS:
        vs = tl.load(VS + blk * s_vsb + slot * s_vsp + kvh * s_vsh, mask=kv_ok, other=0.0).to(tl.float32)
        v = (v.to(tl.float32) * vs[:, None]).to(CDT)
    elif not P_FP8 and not V_SEQ_MAJOR and V.dtype.element_ty != CDT and CDT == tl.float16:
        # FA3's layout, P@V in fp16 (after a 16-bit or an FP8 QK^T): V's transposed operand is read as
        # 16-bit values, not byte-wise
        v = upcast_fp8_in_place(v)
    elif not MMA_FP8:
        v = v.to(CDT)
    elif not P_FP8:
        v = v.to(tl.float16)  # exact; FP8 QK^T, then P@V in fp16 (P rounded to fp16, not e4m3)
    # (an FP8 P@V reads sequence-major V: K-major as loaded, as FP8 wgmma wants it)
    return online_softmax_step(s, m_i, l_i, acc, v, P_FP8)


@triton.jit
def _kv_loop(lo, hi, MASKED: tl.constexpr, end, last_pg, pt_row, q, tok, qlen, kv_len, kvh, K, V, KS, VS,
             m_i, l_i, acc, scale, softcap, window_left, window_right, s_kb, s_kp, s_kh, s_vb, s_vp, s_vh,
             s_ksb, s_ksp, s_ksh, s_vsb, s_vsp, s_vsh, offs_d, offs_dv, dmask, dvmask,
             BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
             SOFTCAP: tl.constexpr, HAS_KS: tl.constexpr, HAS_VS: tl.constexpr, MMA_FP8: tl.constexpr,
             CDT: tl.constexpr, TILE_IN_PAGE: tl.constexpr, P_FP8: tl.constexpr, V_SEQ_MAJOR: tl.constexpr):
    """KV tiles [lo, hi) (lo a multiple of BLOCK_N) of one program, masked or not.

    Page ids are read one tile ahead and carried through the loop: a page-id load in the same
    iteration as the K/V loads it addresses makes the pipeliner wait for every copy in flight
    (async_wait num = 0: no overlap of loads with MMAs, docs/decisions.md); carried, the K/V copies
    of later tiles stay in flight.
    """
    nxt = _page_ids(pt_row, lo, end, last_pg, BLOCK_N, PAGE_SIZE, TILE_IN_PAGE)
    for start_n in range(lo, hi, BLOCK_N):
        blk = nxt
        nxt = _page_ids(pt_row, start_n + BLOCK_N, end, last_pg, BLOCK_N, PAGE_SIZE, TILE_IN_PAGE)
        m_i, l_i, acc = _kv_tile(
            start_n, end, blk, q, tok, qlen, kv_len, kvh, K, V, KS, VS, m_i, l_i, acc, scale, softcap,
            window_left, window_right, s_kb, s_kp, s_kh, s_vb, s_vp, s_vh, s_ksb, s_ksp, s_ksh,
            s_vsb, s_vsp, s_vsh, offs_d, offs_dv, dmask, dvmask, BLOCK_N, PAGE_SIZE, CAUSAL, HAS_WINDOW,
            SOFTCAP, HAS_KS, HAS_VS, MMA_FP8, CDT, TILE_IN_PAGE, P_FP8, V_SEQ_MAJOR, MASKED)
    return m_i, l_i, acc


# The constexpr bundles of ``_paged_fwd_kernel``, field by field (in order)
PAGED_CFG = ("QG", "HEAD_DIM", "HEAD_DIM_V", "BLOCK_D", "BLOCK_DV", "PAGE_SIZE", "CAUSAL", "HAS_WINDOW", "SOFTCAP",
             "HAS_QD", "HAS_KD", "HAS_VD", "HAS_KS", "HAS_VS", "STORE_LSE", "SPLIT", "OUT_FP8", "OUT_DTYPE",
             "V_SEQ_MAJOR", "UNMASKED_TILES")
PAGED_TILE = ("MMA_FP8", "CDT", "P_FP8", "BLOCK_M", "BLOCK_N", "BLOCK_Q", "TILE_IN_PAGE")
PAGED_SCHED = ("VARLEN", "NUM_KV_HEADS", "HEADS_INNER", "TWO_CLASS", "BIG_CLASS", "DECODE_FIRST", "BLOCK_LIST",
               "LIST_BM", "LIST_ENTRY")


@triton.jit
def _query_block(seq, q_start, qlen, qblk, kvh, split, ptrs, strides, scalars, CFG: tl.constexpr,
                 TILE: tl.constexpr):
    """One program's work: query block ``qblk`` (BLOCK_Q tokens x QG heads) of sequence ``seq`` against
    kv head ``kvh``, KV split ``split``. The kernel's bundles (``_paged_fwd_kernel``); the tile class
    ``TILE`` is an argument so that one launch can hold two classes (see the kernel)."""
    Q, K, V, PT, SEQLENS, _cu_q, O, LSE, QD, KD, VD, KS, VS, OUT_SCALE, _blocks = ptrs
    s_qb, s_qt, s_qh = strides[0:3]
    s_kb, s_kp, s_kh = strides[3:6]
    s_vb, s_vp, s_vh = strides[6:9]
    s_ptb = strides[9]
    s_ob, s_ot, s_oh, s_osp = strides[10:14]
    s_lb, s_lt, s_lh, s_lsp = strides[14:18]
    s_qdb, s_qdh = strides[18:20]
    s_kdb, s_kdh = strides[20:22]
    s_vdb, s_vdh = strides[22:24]
    s_ksb, s_ksp, s_ksh = strides[24:27]
    s_vsb, s_vsp, s_vsh = strides[27:30]
    qk_scale, softcap, window_left, window_right, num_splits, _lo, _hi = scalars
    QG: tl.constexpr = CFG[0]
    HEAD_DIM: tl.constexpr = CFG[1]
    HEAD_DIM_V: tl.constexpr = CFG[2]
    BLOCK_D: tl.constexpr = CFG[3]
    BLOCK_DV: tl.constexpr = CFG[4]
    PAGE_SIZE: tl.constexpr = CFG[5]
    CAUSAL: tl.constexpr = CFG[6]
    HAS_WINDOW: tl.constexpr = CFG[7]
    SOFTCAP: tl.constexpr = CFG[8]
    HAS_QD: tl.constexpr = CFG[9]
    HAS_KD: tl.constexpr = CFG[10]
    HAS_VD: tl.constexpr = CFG[11]
    HAS_KS: tl.constexpr = CFG[12]
    HAS_VS: tl.constexpr = CFG[13]
    STORE_LSE: tl.constexpr = CFG[14]
    SPLIT: tl.constexpr = CFG[15]
    OUT_FP8: tl.constexpr = CFG[16]
    OUT_DTYPE: tl.constexpr = CFG[17]
    V_SEQ_MAJOR: tl.constexpr = CFG[18]
    UNMASKED_TILES: tl.constexpr = CFG[19]
    MMA_FP8: tl.constexpr = TILE[0]
    CDT: tl.constexpr = TILE[1]
    P_FP8: tl.constexpr = TILE[2]
    BLOCK_M: tl.constexpr = TILE[3]
    BLOCK_N: tl.constexpr = TILE[4]
    BLOCK_Q: tl.constexpr = TILE[5]
    TILE_IN_PAGE: tl.constexpr = TILE[6]
    if qblk * BLOCK_Q < qlen:
        seq64 = seq.to(tl.int64)
        kv_len = tl.load(SEQLENS + seq)

        # ---- query rows: (token, head) pairs of this kv head's group ----
        offs_m = tl.arange(0, BLOCK_M)
        tok = qblk * BLOCK_Q + offs_m // QG
        hq = kvh * QG + offs_m % QG
        row_ok = (offs_m < BLOCK_Q * QG) & (tok < qlen)
        tok_g = (q_start + tok).to(tl.int64)  # token index in the q/out tensors
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        dmask = offs_d < HEAD_DIM
        dvmask = offs_dv < HEAD_DIM_V
        q = tl.load(Q + seq64 * s_qb + tok_g[:, None] * s_qt + hq[:, None] * s_qh + offs_d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        if not MMA_FP8:
            if CDT == tl.float16:
                q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
            q = q.to(CDT)

        # ---- folded descales (per (sequence, kv head)) ----
        scale = qk_scale
        if HAS_QD:
            scale = scale * tl.load(QD + seq64 * s_qdb + kvh * s_qdh)
        if HAS_KD:
            scale = scale * tl.load(KD + seq64 * s_kdb + kvh * s_kdh)
        if HAS_VD:
            v_descale = tl.load(VD + seq64 * s_vdb + kvh * s_vdh)
        else:
            v_descale = 1.0

        # ---- key range of this block and split ----
        tok_lo = qblk * BLOCK_Q
        tok_hi = tl.minimum(tok_lo + BLOCK_Q, qlen) - 1
        kv_lo, kv_hi = kv_range(tok_lo, tok_hi, qlen, kv_len, window_left, window_right, CAUSAL, HAS_WINDOW, BLOCK_N)
        n_tiles = tl.cdiv(kv_hi - kv_lo, BLOCK_N)
        per_split = tl.cdiv(n_tiles, num_splits)
        start = tl.multiple_of(kv_lo + split * per_split * BLOCK_N, BLOCK_N)
        end = tl.minimum(kv_hi, start + per_split * BLOCK_N)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        pt_row = PT + seq64 * s_ptb
        last_pg = tl.maximum(end - 1, 0) // PAGE_SIZE
        # UNMASKED_TILES: tiles [full_lo, full_hi) are below the length and visible to every row of
        # the block; they run without masks, the tiles before (window) and after (causal diagonal,
        # partial last tile) run masked. All bounds are multiples of BLOCK_N inside [start, end]. Each
        # loop holds its own shared-memory ring, so launches whose ring would not fit twice (16-bit
        # caches) run one masked loop over every tile.
        full_lo = start
        full_hi = start
        if UNMASKED_TILES:
            full_lo, full_hi = full_tile_range(tok_lo, tok_hi, qlen, kv_len, window_left, window_right,
                                               CAUSAL, HAS_WINDOW, BLOCK_N, start, end)
        # Up to three loops, unrolled: masked tiles left of the fully visible ones (a left window: without
        # one full_lo == start), the fully visible ones, the masked rest; one masked loop without UNMASKED_TILES.
        FIRST_RUN: tl.constexpr = (0 if HAS_WINDOW else 1) if UNMASKED_TILES else 2
        for run in tl.static_range(FIRST_RUN, 3):
            m_i, l_i, acc = _kv_loop(
                start if run == 0 else full_lo if run == 1 else full_hi, full_lo if run == 0 else full_hi if run == 1
                else end, run != 1, end, last_pg, pt_row, q, tok, qlen, kv_len, kvh, K, V, KS, VS, m_i, l_i, acc,
                scale, softcap, window_left, window_right, s_kb, s_kp, s_kh, s_vb, s_vp, s_vh, s_ksb, s_ksp, s_ksh,
                s_vsb, s_vsp, s_vsh, offs_d, offs_dv, dmask, dvmask, BLOCK_N, PAGE_SIZE, CAUSAL, HAS_WINDOW,
                SOFTCAP, HAS_KS, HAS_VS, MMA_FP8, CDT, TILE_IN_PAGE, P_FP8, V_SEQ_MAJOR)

        out, lse = finalize_rows(acc, m_i, l_i, v_descale, P_FP8)
        o_ptrs = O + seq64 * s_ob + tok_g[:, None] * s_ot + hq[:, None] * s_oh + offs_dv[None, :]
        l_ptrs = LSE + seq64 * s_lb + tok_g * s_lt + hq * s_lh
        if SPLIT:
            o_ptrs += split.to(tl.int64) * s_osp
            l_ptrs += split.to(tl.int64) * s_lsp
            tl.store(o_ptrs, out, mask=row_ok[:, None] & dvmask[None, :])
            tl.store(l_ptrs, lse, mask=row_ok)
        else:
            if OUT_FP8:
                out_scale_inv = 1.0 / tl.load(OUT_SCALE)
            else:
                out_scale_inv = 1.0
            tl.store(o_ptrs, output_epilogue(out, out_scale_inv, OUT_FP8, OUT_DTYPE),
                     mask=row_ok[:, None] & dvmask[None, :])
            if STORE_LSE:
                tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit
def _paged_fwd_kernel(ptrs, batch, seqlen_q, list_min_q, strides, scalars,
                      CFG: tl.constexpr, TILE: tl.constexpr, TILE_S: tl.constexpr, SCHED: tl.constexpr):
    """The paged forward. Its arguments are bundles (``paged_args`` builds them), flattened by triton into
    the same kernel parameters in the same order as separate arguments would be:

    ptrs : (Q, K, V, PT, SEQLENS, CU_Q, O, LSE, QD, KD, VD, KS, VS, OUT_SCALE, BLOCKS)
    strides : 30 ints, flat: q (batch, token, head), k (page, row, head), v (page, row, head), the page table
        row, out (batch, token, head, split), lse (batch, token, head, split), q descale (batch, head),
        k descale, v descale, k cache scales (page, row, head), v cache scales
    scalars : (qk_scale, softcap, window_left, window_right, num_splits, len_q_lo, len_q_hi)
    CFG : ``_query_block``'s constants (``PAGED_CFG`` names them); TILE / TILE_S : the large and small tile
        classes (``PAGED_TILE``); SCHED : the launch's schedule (``PAGED_SCHED``).
    """
    CU_Q = ptrs[5]
    SEQLENS = ptrs[4]
    BLOCKS = ptrs[14]
    len_q_lo = scalars[5]
    len_q_hi = scalars[6]
    QG: tl.constexpr = CFG[0]
    BLOCK_Q: tl.constexpr = TILE[5]
    BLOCK_M_S: tl.constexpr = TILE_S[3]
    VARLEN: tl.constexpr = SCHED[0]
    NUM_KV_HEADS: tl.constexpr = SCHED[1]
    HEADS_INNER: tl.constexpr = SCHED[2]
    TWO_CLASS: tl.constexpr = SCHED[3]
    BIG_CLASS: tl.constexpr = SCHED[4]
    DECODE_FIRST: tl.constexpr = SCHED[5]
    BLOCK_LIST: tl.constexpr = SCHED[6]
    LIST_BM: tl.constexpr = SCHED[7]
    LIST_ENTRY: tl.constexpr = SCHED[8]
    # BLOCK_LIST (a mixed batch's launch before its TMA kernel): one extra program, the last of axis 0,
    # writes the TMA kernel's query-block list (sequences of ``list_min_q`` queries or more) into BLOCKS
    # instead of a launch of its own.
    n_prog = tl.num_programs(0)
    if BLOCK_LIST:
        n_prog -= 1
        if (tl.program_id(0) == n_prog) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
            fill_varlen_block_list(CU_Q, SEQLENS, BLOCKS, batch, list_min_q, LIST_BM, 256, False, LIST_ENTRY)
    if HEADS_INNER:
        # The kv heads of one query block are neighbouring programs: they run together and read the
        # same pages (heads are interleaved inside a page), which keeps DRAM accesses local.
        raw = tl.program_id(0) // NUM_KV_HEADS
        kvh = tl.program_id(0) % NUM_KV_HEADS
        num_pid = n_prog // NUM_KV_HEADS
    else:
        raw = tl.program_id(0)
        kvh = tl.program_id(1)
        num_pid = n_prog
    split = tl.program_id(2)
    if VARLEN:
        # TWO_CLASS (mixed batches): the last ``batch`` programs serve, one each, the sequences with at
        # most BLOCK_M_S // QG queries (decode rows) with small (BLOCK_M_S, BLOCK_N_S) tiles and their own
        # precision (MMA_FP8_S, CDT_S, P_FP8_S: a decode row multiplies as in a decode call); the others
        # serve the longer sequences with the large tiles. A sequence is skipped by the other class. The
        # large tiles take only sequences of ``len_q_lo`` .. ``len_q_hi`` queries (the others are served
        # by other launches: hopper.paged_launch, or a small-class-only launch, ``BIG_CLASS`` False, grid ``batch``).
        n_big = num_pid - batch if TWO_CLASS else num_pid
        small_q = BLOCK_M_S // QG if TWO_CLASS else 0
        # DECODE_FIRST: the small class takes the first ``batch`` program ids instead of the last, so
        # the memory-bound decode rows stream beside the compute-bound prefill tiles instead of after
        # them (faster on the H200 for decode rows beside a prefill chunk, bf16 and e4m3 Q; docs/decisions.md)
        big_off = batch if (TWO_CLASS and DECODE_FIRST) else 0
        small_off = 0 if DECODE_FIRST else n_big
        if BIG_CLASS:  # (a constexpr test: a small-class-only launch compiles no large-tile code)
            if raw - big_off >= 0 and raw - big_off < n_big:
                pid = n_big - 1 - (raw - big_off)  # reversed: the last (typically longest) sequences start first
                seq = find_seq(CU_Q, pid, batch, BLOCK_Q)
                q_start = tl.load(CU_Q + seq)
                qlen = tl.load(CU_Q + seq + 1) - q_start
                qblk = pid - (q_start // BLOCK_Q + seq)
                if (qlen > small_q) & (qlen >= len_q_lo) & (qlen <= len_q_hi):
                    _query_block(seq, q_start, qlen, qblk, kvh, split, ptrs, strides, scalars, CFG, TILE)
        if TWO_CLASS:  # compiled only with two classes: each _query_block instance holds its own rings
            if raw - small_off >= 0 and raw - small_off < batch:
                seq = raw - small_off
                q_start = tl.load(CU_Q + seq)
                qlen = tl.load(CU_Q + seq + 1) - q_start
                if qlen <= small_q:
                    _query_block(seq, q_start, qlen, 0, kvh, split, ptrs, strides, scalars, CFG, TILE_S)
    else:
        nqb = tl.cdiv(seqlen_q, BLOCK_Q)
        _query_block(raw // nqb, 0, seqlen_q, raw % nqb, kvh, split, ptrs, strides, scalars, CFG, TILE)


def tma_reason(q, k_cache, v_cache, page_table, cache_seqlens, out, lse, *, cu_seqlens_q, max_seqlen_q, causal,
               window_size, softcap, q_descale, k_descale, v_descale, k_cache_scales, v_cache_scales, out_scale,
               num_splits, config=None, capability=None):
    """Why ``launch_paged_fwd`` keeps a call's FP8 prefill chunks on this module's Triton kernel, or None when
    ``hopper.paged_launch`` takes them (varlen: its sequences of ``paged_launch.VARLEN_MIN_Q`` queries or more, unless
    the launch splits the keys, ``launch_grid``): THE rule of the paged dispatch
    (``fp8attn.capability.supports`` asks it too). Arguments are ``launch_paged_fwd``'s; ``capability``:
    as ``paged_launch.unsupported_reason``."""
    if INTERPRET:
        return "the Triton interpreter (TRITON_INTERPRET=1) runs the Triton kernel"
    if not (config or {}).get("tma", True):
        return "config tma=False"
    # (no further check when no sequence fills one query block: decode calls skip its host cost)
    if (max_seqlen_q if cu_seqlens_q is not None else q.shape[1]) < paged_launch.VARLEN_MIN_Q:
        return f"fewer than {paged_launch.VARLEN_MIN_Q} queries per sequence (decode, short chunks)"
    return paged_launch.unsupported_reason(
        q, k_cache, v_cache, page_table, cache_seqlens, out, lse, cu_seqlens_q=cu_seqlens_q, causal=causal,
        window_size=window_size, softcap=softcap, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
        k_cache_scales=k_cache_scales, v_cache_scales=v_cache_scales, out_scale=out_scale, num_splits=num_splits,
        capability=capability)


def launch_grid(q, k_cache, v_cache, page_table, *, cu_seqlens_q, max_seqlen_q, precisions=None, k_token_scales,
                v_token_scales, num_splits, num_sms, config=None):
    """``planning.paged_grid`` of a launch: ``(tiles, small_tiles, block_q, two_class, grid0, num_splits)``.
    ``precisions``: ``planning.paged_precisions`` of the call (computed here when None)."""
    varlen = cu_seqlens_q is not None
    hq, d = q.shape[-2], q.shape[-1]
    hk, page_size = k_cache.shape[2], k_cache.shape[1]
    v_seq_major = is_v_seq_major(v_cache)
    if precisions is None:
        precisions = paged_precisions(q.dtype, k_cache.dtype, v_cache.dtype, k_token_scales, v_token_scales,
                                      max_seqlen_q, hq // hk, v_seq_major)
    return paged_grid(
        batch=cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0], nheads_k=hk, qg=hq // hk, headdim=d,
        max_seqlen_q=max_seqlen_q, q_rows=q.shape[0] if varlen else q.shape[1], varlen=varlen, page_size=page_size,
        capacity=page_table.shape[1] * page_size, mma_fp8=precisions[0][0], mma_fp8_s=precisions[1][0],
        v_seq_major=v_seq_major, fp8_cache=k_cache.element_size() == 1,
        token_scales=k_token_scales or v_token_scales, num_splits=num_splits, num_sms=num_sms, config=config)


@functools.lru_cache(None)
def _num_sms(device) -> int:
    if device.type != "cuda":
        return CPU_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


# Launch order: all kv heads of a query block as neighbouring programs (see the kernel).
HEADS_INNER_DEFAULT = True  # decode measured faster on the H200, never slower beyond noise


def launch_paged_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None, *,
                     cu_seqlens_q: torch.Tensor | None = None, max_seqlen_q: int, softmax_scale: float,
                     causal: bool, window_size=(-1, -1), softcap: float = 0.0,
                     q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
                     v_descale: torch.Tensor | None = None, k_cache_scales: torch.Tensor | None = None,
                     v_cache_scales: torch.Tensor | None = None, out_scale: torch.Tensor | None = None,
                     num_splits: int = 1, out_partial: torch.Tensor | None = None,
                     lse_partial: torch.Tensor | None = None, config: dict | None = None) -> None:
    """Attention of ``q`` over a paged KV cache; writes ``out`` (and ``lse``) in place.

    Parameters
    ----------
    q : (batch, seqlen_q, nheads_q, headdim) or varlen (total_q, nheads_q, headdim) with
        ``cu_seqlens_q``; bf16/fp16, or float8_e4m3fn/e5m2 (with ``q_descale``). Last dim contiguous.
    k_cache : (num_blocks, page_size, nheads_k, headdim) float8_e4m3fn/e5m2 or bf16/fp16.
    v_cache : (num_blocks, page_size, nheads_k, headdim_v), same dtype as ``k_cache``.
    page_table : (batch, max_pages) int32; entries past a row's pages are never read (may be -1).
    cache_seqlens : (batch,) int32 valid cache tokens per row, the queries' own tokens included
        (queries are the last tokens; causal/window masks align bottom-right).
    out : (batch, seqlen_q, nheads_q, headdim_v) or varlen (total_q, nheads_q, headdim_v); bf16/fp16,
        or float8_e4m3fn with ``out_scale``.
    lse : optional float32 (batch, nheads_q, seqlen_q) (varlen: (nheads_q, total_q)), natural log;
        rows that see no key get -inf (and out = 0).
    cu_seqlens_q : (batch + 1,) int32 query offsets (varlen / mixed decode + prefill batches).
    max_seqlen_q : capacity bound on queries per sequence (chooses the tile shape; not read from data).
    q_descale, k_descale, v_descale : float32 per-tensor (0-d/(1,)/(1, 1)), (batch, 1) or
        (batch, nheads_k) descales (folded in-kernel).
    k_cache_scales, v_cache_scales : optional (num_blocks, page_size, nheads_k) float32 per-token-head
        descales of the cache.
    out_scale : optional 0-d/(1,) float32 static output scale (fused e4m3fn output).
    num_splits : split-KV factor, fixed by the caller (``planning.choose_num_splits``); > 1 writes partials
        into ``out_partial`` / ``lse_partial`` (``split_workspace``; allocated here when None) and merges
        them with ``launch_combine``. A workspace with more splits than the call's is used in part.
    config : optional override {block_m, block_n, num_warps, num_stages, maxnreg, compute_dtype, pv_fp16,
        heads_inner, two_class, decode_first, unmasked_tiles, tma, split_at, block_list}
        (benchmarks). ``pv_fp16`` (FP8 Q and cache only): FP8 QK^T, then P@V in fp16 with V upcast in
        registers and P rounded to fp16 instead of e4m3, over sequence-major V too (the default over
        FA3's layout). ``tma=False``
        keeps FP8 prefill chunks that ``hopper.paged_launch`` accepts on this kernel; ``split_at`` (varlen, tests) runs
        this kernel's part of a split with the TMA kernel without it: sequences of ``split_at`` queries
        or more are left as they are; with it, ``block_list`` (a ``dense_launch.empty_block_list``) is
        filled as the TMA kernel's launch would need it (for ``VARLEN_MIN_Q``).

    Notes
    -----
    FP8 prefill chunks run on the warp-specialized TMA kernel of ``hopper.paged_launch`` when it accepts the inputs
    (``paged_launch.unsupported_reason``; its P@V is FP8 in both V layouts).
    Varlen (mixed) batches are then split by query count on the device: this kernel runs the sequences
    below ``paged_launch.VARLEN_MIN_Q`` queries (a decode-tile launch for the decode rows, a large-tile launch
    for the others), the TMA kernel the rest (unsplit calls with ``max_seqlen_q >= VARLEN_MIN_Q`` only;
    an explicit ``num_splits`` > 1 keeps the whole batch here).
    """
    cfg = config or {}  # benchmark overrides
    varlen = cu_seqlens_q is not None
    # FP8 prefill chunks the TMA kernel takes (varlen: those of VARLEN_MIN_Q queries or more)
    tma_ok = tma_reason(q, k_cache, v_cache, page_table, cache_seqlens, out, lse, cu_seqlens_q=cu_seqlens_q,
                        max_seqlen_q=max_seqlen_q, causal=causal, window_size=window_size, softcap=softcap,
                        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, k_cache_scales=k_cache_scales,
                        v_cache_scales=v_cache_scales, out_scale=out_scale, num_splits=num_splits, config=cfg) is None
    tma_args = dict(softmax_scale=softmax_scale, causal=window_flags(causal, window_size)[0], q_descale=q_descale,
                    k_descale=k_descale, v_descale=v_descale, out_scale=out_scale) if tma_ok else None
    if tma_ok and not varlen:
        paged_launch.launch_paged_prefill_tma(q, k_cache, v_cache, page_table, cache_seqlens, out, lse, **tma_args)
        return
    if varlen:
        total_q, hq, d = q.shape
        batch = cu_seqlens_q.shape[0] - 1
        seqlen_q = max_seqlen_q
    else:
        batch, seqlen_q, hq, d = q.shape
    hk = k_cache.shape[2]
    dv = v_cache.shape[-1]
    page_size = k_cache.shape[1]
    qg = hq // hk
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and out.stride(-1) == 1
    assert v_cache.stride(-1) == 1 or is_v_seq_major(v_cache)
    has_ks = k_cache_scales is not None
    has_vs = v_cache_scales is not None
    v_seq_major = is_v_seq_major(v_cache)
    # the launch's precision, and its decode rows' (its small tile class), as a decode call of their own
    (mma_fp8, p_fp8, cdt), (mma_fp8_s, p_fp8_s, cdt_s) = paged_precisions(
        q.dtype, k_cache.dtype, v_cache.dtype, has_ks, has_vs, max_seqlen_q, qg, v_seq_major)
    if cfg.get("compute_dtype") is not None:
        cdt = cfg["compute_dtype"] if not mma_fp8 else cdt  # benchmarks: the 16-bit dtype of the upcast
        cdt_s = cfg["compute_dtype"] if not mma_fp8_s else cdt_s
    if INTERPRET:  # the interpreter's bf16 dot multiplies raw uint16 storage
        cdt, cdt_s = (torch.float32 if c == torch.bfloat16 else c for c in (cdt, cdt_s))
    fp8_cache = k_cache.element_size() == 1
    if cfg.get("pv_fp16"):  # benchmarks: the fp16 P@V after FP8 QK^T over sequence-major V too
        p_fp8 = p_fp8_s = False
    # Mixed batches: decode rows get their own small-tile programs (one per sequence) instead of
    # riding in the large prefill tiles (docs/decisions.md, paged mixed batches).
    (bm, bn, nw, ns, maxnreg), small_cfg, block_q, two_class, grid0, num_splits = launch_grid(
        q, k_cache, v_cache, page_table, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
        precisions=((mma_fp8, p_fp8, cdt), (mma_fp8_s, p_fp8_s, cdt_s)), k_token_scales=has_ks, v_token_scales=has_vs,
        num_splits=num_splits, num_sms=_num_sms(q.device), config=config)
    if grid0 == 0:
        return
    bm_s, bn_s = small_cfg[:2]
    split = num_splits > 1
    if split and (out_partial is None or lse_partial is None):
        out_partial, lse_partial = split_partials(q, num_splits, dv, hq)
    elif split:  # a caller's workspace (``split_workspace``) may hold more splits than this call uses
        if out_partial.shape[0] < num_splits or lse_partial.shape[0] < num_splits:
            raise ValueError(f"split_workspace: expected room for {num_splits} splits, got {out_partial.shape[0]} "
                             f"and {lse_partial.shape[0]}. Allocate it with split_workspace(q, {num_splits}, ...).")
        out_partial, lse_partial = out_partial[:num_splits], lse_partial[:num_splits]
    # The launches of this kernel: (tiles (bm, bn, num_warps, stages, maxnreg), two classes, big class,
    # grid0, the big class's query-count range, whether it also writes the TMA kernel's block list).
    launches = [((bm, bn, nw, ns, maxnreg), two_class, True, grid0, (0, 2 ** 31 - 1), False)]
    # Varlen batches on the TMA kernel too (never with splits: the combine writes every row): sequences of
    # VARLEN_MIN_Q queries or more go to it (launched last); here, the decode rows alone with the decode
    # tiles (one program per sequence, as fast as a decode-only launch), and the sequences between them
    # in the large tiles (a launch whose programs exit at once when there are none; one more program of
    # it writes the TMA kernel's block list, which saves that list its own launch).
    tma_varlen = tma_ok and not split  # (a fixed-length tma_ok call has returned above)
    split_at = paged_launch.VARLEN_MIN_Q if tma_varlen else cfg.get("split_at")
    block_list = dense_launch.empty_block_list(cu_seqlens_q, total_q) if tma_varlen else cfg.get("block_list")
    if varlen and split_at is not None:
        small_q = bm_s // qg if bm > bm_s else 0
        launches = [(small_cfg, True, False, batch, (0, 0), False)] if small_q else []
        launches.append(((bm, bn, nw, ns, maxnreg), False, True, total_q // block_q + batch,
                         (small_q + 1, int(split_at) - 1), block_list is not None))

    # strides of q / out / lse / partials as (batch, token, head[, split]) (one stride() call per tensor:
    # host time)
    sq, so = q.stride(), out.stride()
    sl = lse.stride() if lse is not None else None
    if varlen:
        s_q = (0, sq[0], sq[1])
        s_o_final = (0, so[0], so[1])
        s_l_final = (0, sl[1], sl[0]) if sl is not None else (0, 0, 0)
    else:
        s_q = sq[:3]
        s_o_final = so[:3]
        s_l_final = (sl[0], sl[2], sl[1]) if sl is not None else (0, 0, 0)
    if split:
        o_t, l_t = out_partial, lse_partial
        sop, slp = o_t.stride(), l_t.stride()
        s_o = (0, *sop[1:3], sop[0]) if varlen else (*sop[1:4], sop[0])
        s_l = (0, *slp[1:3], slp[0]) if varlen else (*slp[1:4], slp[0])
    else:
        o_t = out
        l_t = lse if lse is not None else out
        s_o = (*s_o_final, 0)
        s_l = (*s_l_final, 0)

    dummy = cache_seqlens
    has_qd = q_descale is not None
    has_kd = k_descale is not None
    has_vd = v_descale is not None
    if softcap and softcap > 0:
        qk_scale = softmax_scale / softcap
    else:
        qk_scale = softmax_scale * _LOG2E
    causal, wl, wr, has_window = window_flags(causal, window_size)
    kss = k_cache_scales.stride() if has_ks else (0, 0, 0)
    vss = v_cache_scales.stride() if has_vs else (0, 0, 0)
    out_fp8 = out_scale is not None and not split
    heads_inner = bool(cfg.get("heads_inner", HEADS_INNER_DEFAULT))
    # unmasked full tiles need a second shared-memory ring: FP8 caches only (a 16-bit cache's
    # (16, 128, 4, 3) decode ring needed 264 KB of the 227 KB per block with both loops)
    unmasked_tiles = bool(cfg.get("unmasked_tiles", fp8_cache))
    # the kernel's bundles (``_paged_fwd_kernel``): the same for every launch of the call but the tile class,
    # the schedule, the query-count range and the block list
    ptrs = (q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q if varlen else dummy, o_t, l_t,
            q_descale if has_qd else dummy, k_descale if has_kd else dummy, v_descale if has_vd else dummy,
            k_cache_scales if has_ks else dummy, v_cache_scales if has_vs else dummy, out_scale if out_fp8 else dummy)
    # (one flat tuple: triton 3.6 drops the constexpr elements -- strides of 1 -- of a tuple nested in a kernel
    # argument once a run-time ``if`` has run, and the kernel calls ``_query_block`` after its schedule's)
    strides = (*s_q, *k_cache.stride()[:3], *v_cache.stride()[:3], page_table.stride(0), *s_o, *s_l,
               *paged_launch.descale_strides(q_descale), *paged_launch.descale_strides(k_descale),
               *paged_launch.descale_strides(v_descale), *kss, *vss)
    scalars = (float(qk_scale), float(softcap or 0.0), wl, wr, num_splits)
    call_cfg = (qg, d, dv, next_pow2(d), next_pow2(dv), page_size, bool(causal), has_window,
                bool(softcap and softcap > 0), has_qd, has_kd, has_vd, has_ks, has_vs, lse is not None, split, out_fp8,
                _TL.get(out.dtype, tl.bfloat16), v_seq_major, unmasked_tiles)
    tile_s = (mma_fp8_s, _TL[cdt_s], p_fp8_s, bm_s, bn_s, bm_s // qg, page_size % bn_s == 0)
    decode_first = bool(cfg.get("decode_first", True))
    for (bm_l, bn_l, nw_l, ns_l, maxnreg_l), two_class_l, big_class, grid0_l, (lo, hi), with_list in launches:
        grid0_l = grid0_l * hk if heads_inner else grid0_l
        grid = (grid0_l + with_list, 1 if heads_inner else hk, num_splits)
        tile = (mma_fp8, _TL[cdt], p_fp8, bm_l, bn_l, max(1, bm_l // qg), page_size % bn_l == 0)
        sched = (varlen, hk, heads_inner, two_class_l, big_class, decode_first, with_list, dense_launch.BLOCK_M,
                 dense_launch.ENTRY)
        launch(_paged_fwd_kernel, grid, (*ptrs, block_list if with_list else dummy), batch, seqlen_q,
               paged_launch.VARLEN_MIN_Q, strides, (*scalars, lo, hi), CFG=call_cfg, TILE=tile, TILE_S=tile_s,
               SCHED=sched, num_warps=nw_l,
               num_stages=1 if INTERPRET else ns_l, maxnreg=maxnreg_l)  # (the interpreter runs one stage)
    if split:
        if varlen:
            lse_view = lse.t() if lse is not None else None
        else:
            lse_view = lse.transpose(1, 2) if lse is not None else None
        launch_combine(out_partial, lse_partial, out, lse_view, out_scale=out_scale)
    if tma_varlen:
        paged_launch.launch_paged_prefill_tma(q, k_cache, v_cache, page_table, cache_seqlens, out, lse,
                                           cu_seqlens_q=cu_seqlens_q, min_len_q=paged_launch.VARLEN_MIN_Q,
                                           block_list=block_list, **tma_args)
