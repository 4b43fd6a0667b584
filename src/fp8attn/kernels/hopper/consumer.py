"""The consumers of the warp-specialized ping-pong kernels (``forward``): two (or, in the dense kernel's
three-consumer variant, three) 4-warp warpgroups of 64 query rows that take turns issuing their MMAs --
S_j = Q K_j^T together with P_{j-1} V_{j-1} -- so that one consumer's softmax runs under the others'
tensor-core work. ``_ws_attend`` serves head dims 64 and 128,
``_ws_attend_d256`` head dim 256 (operands in 128/64-wide pieces, P V in four quarters).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .epilogue import (
    _finalize_rows,
    _normalize_rows,
    _out_scale_inv,
    _row_lse,
    _store_lse,
    _store_rows,
    _store_rows_masked,
)
from .pipeline import _block_scales
from .scheduler import _ws_block, _ws_num_blocks, _ws_round_robin
from .softmax import _p_operand, _pv_quarter, _row_sum, _row_sum_issue, _rowsum_mma, _softmax_tile_f32


@gluon.jit
def _ws_turn_wait(turn, WG: gl.constexpr, k):
    """Wait for this consumer's k-th turn to issue MMAs. The turn goes round the consumers (``turn``
    starts with one barrier per consumer): consumer 0 goes first (its wait on the fresh barrier's parity 1
    passes) and its k-th turn follows the last consumer's (k - 1)-th pass; consumer WG > 0's k-th turn is
    consumer WG - 1's k-th pass."""
    mbarrier.wait(turn.index(WG), (k + (WG == 0)) & 1)

@gluon.jit
def _ws_turn_pass(turn, WG: gl.constexpr, NC: gl.constexpr):
    mbarrier.arrive(turn.index((WG + 1) % NC))

@gluon.jit
def _ws_qk(q_smem, qi, k_smem, ks, zero_s, NQK: gl.constexpr):
    """Issue S = Q K^T of K/V stage ``ks`` for the Q buffer starting at ``qi``: one wgmma, or with the
    head dim in NQK parts (head dim 256: two 128-wide halves) a chain into one fp32 accumulator."""
    tok = warpgroup_mma(q_smem.index(qi), k_smem.index(NQK * ks).permute((1, 0)), zero_s, use_acc=False,
                        is_async=True)
    for hh in gl.static_range(1, NQK):
        tok = warpgroup_mma(q_smem.index(qi + hh), k_smem.index(NQK * ks + hh).permute((1, 0)), tok,
                            is_async=True)
    return tok

@gluon.jit
def _ws_tile_step(j, g, k, p, alpha_prev, m_i, l_i, acc, q_smem, qi, k_smem, v_smem, k_ready, v_ready, k_empty,
                  v_empty, turn, WG: gl.constexpr, zero_s, zero_o, qk_scale, mw, shift, p_layout: gl.constexpr,
                  row_o: gl.constexpr, NUM_STAGES: gl.constexpr, MASKED: gl.constexpr, n_lim=0,
                  KEY_LIMIT: gl.constexpr = False, ones=None, ROWSUM_MMA: gl.constexpr = False,
                  NC: gl.constexpr = 2, KPERM: gl.constexpr = False, NQK: gl.constexpr = 1):
    """KV tile j >= 1 of one consumer's query block (``g``: the same tile's index in this CTA's K/V
    ring, ``k``: this consumer's turn count): in its turn, issue S_j = Q K_j^T and P_{j-1} V_{j-1}
    (fresh accumulator), pass the turn, then softmax_j while P_{j-1} V_{j-1} runs, then add it to acc.
    ROWSUM_MMA: P_{j-1}'s row sums are issued with P_{j-1} V_{j-1} (``_row_sum_issue`` on ``ones``) and
    added to l as P V is to acc (l then lags the softmax by one tile, as acc does; l is in O's row
    layout). ``n_lim`` / KEY_LIMIT: as ``_softmax_tile_f32``. NC: the consumers taking turns. NQK: Q/K boxes
    per head (``_ws_qk``; qk 192: three)."""
    TN: gl.constexpr = k_smem.shape[1]
    p8 = _p_operand(p, p_layout, KPERM)
    ks = g % NUM_STAGES
    vp = (g - 1) % NUM_STAGES
    _ws_turn_wait(turn, WG, k)
    mbarrier.wait(k_ready.index(ks), (g // NUM_STAGES) & 1)
    s_tok = _ws_qk(q_smem, qi, k_smem, ks, zero_s, NQK)
    mbarrier.wait(v_ready.index(vp), ((g - 1) // NUM_STAGES) & 1)
    pv_tok, ls_tok = _ws_pv_issue(p8, v_smem.index(vp), ones, zero_o, ROWSUM_MMA)
    _ws_turn_pass(turn, WG, NC)
    s = warpgroup_mma_wait(num_outstanding=2 if ROWSUM_MMA else 1, deps=[s_tok])
    mbarrier.arrive(k_empty.index(ks))
    p, alpha, m_i, l_new = _softmax_tile_f32(s, m_i, l_i, qk_scale, mw, j * TN, shift, row_o, MASKED, n_lim,
                                             KEY_LIMIT, not ROWSUM_MMA, KPERM)
    acc = acc * gl.expand_dims(alpha_prev, 1)
    pv, l_prev = _ws_pv_retire(pv_tok, ls_tok, l_i, alpha_prev, row_o, ROWSUM_MMA)
    mbarrier.arrive(v_empty.index(vp))
    return p, alpha, m_i, l_prev if ROWSUM_MMA else l_new, acc + pv

@gluon.jit
def _ws_pv_issue(p8, v_buf, ones, zero_o, ROWSUM_MMA: gl.constexpr):
    """Issue P V (fresh accumulator) from V buffer ``v_buf`` and, with ROWSUM_MMA, P's row sums
    (``_row_sum_issue``): ``(pv_tok, ls_tok)`` (without ROWSUM_MMA ``ls_tok`` repeats ``pv_tok``, unused)."""
    pv_tok = warpgroup_mma(p8, v_buf.permute((1, 0)), zero_o, use_acc=False, is_async=True)
    if ROWSUM_MMA:
        return pv_tok, _row_sum_issue(p8, ones)
    else:
        return pv_tok, pv_tok

@gluon.jit
def _ws_pv_retire(pv_tok, ls_tok, l_i, alpha, row_o: gl.constexpr, ROWSUM_MMA: gl.constexpr):
    """Wait for ``_ws_pv_issue``'s MMAs: ``(pv, l)``, with ROWSUM_MMA ``l = l_i * alpha + rowsum`` (else l_i)."""
    if ROWSUM_MMA:
        pv, ls = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok, ls_tok])
        l_i = l_i * alpha + _row_sum(ls, row_o)
    else:
        pv = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
    return pv, l_i

@gluon.jit
def _ws_block_begin(t, n_blocks, it, WG: gl.constexpr, QDs, KDs, VDs, stride_qds_b, stride_qds_h, stride_kds_b,
                    stride_kds_h, stride_vds_b, stride_vds_h, seqlen_q, seqlen_k, nheads_q, nheads_k, batch,
                    softmax_scale_log2, MH: gl.constexpr, TN: gl.constexpr, CAUSAL: gl.constexpr, SeqlensK,
                    BlockList, MODE: gl.constexpr, NC: gl.constexpr):
    """Consumer WG's view of block t (NC consumers, blocks of NC * MH rows): ``(b, h, mw, shift, n_tiles,
    qk_scale, v_descale, qb, seqlen_k, q_row, len_q)``, ``mw`` its first query row, ``qb`` the Q buffer (the
    block's parity in this CTA's order ``it``), the rest as ``_ws_block``. Per-sequence bounds (MODE !=
    dense), non-causal: ``shift = seqlen_k``, which leaves only the key limit in the masked tiles' bound
    ``n <= min(m + shift, seqlen_k - 1)``."""
    b, h, hk, m0, shift, n_tiles, seqlen_k, q_row, k_row, len_q = _ws_block(
        t, n_blocks, seqlen_q, seqlen_k, batch, nheads_q, nheads_k, NC * MH, TN, CAUSAL, SeqlensK, BlockList, MODE)
    if MODE != 0:
        if not CAUSAL:
            shift = seqlen_k
    qk_scale, v_descale = _block_scales(b, hk, QDs, KDs, VDs, stride_qds_b, stride_qds_h, stride_kds_b,
                                        stride_kds_h, stride_vds_b, stride_vds_h, softmax_scale_log2)
    return b, h, m0 + WG * MH, shift, n_tiles, qk_scale, v_descale, it % 2, seqlen_k, q_row, len_q

@gluon.jit
def _ws_first_tile(q_smem, qi, k_smem, q_ready, k_ready, k_empty, turn, WG: gl.constexpr, g0, k0, it, zero_s,
                   qk_scale, mw, shift, row_o: gl.constexpr, NQK: gl.constexpr, NUM_STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, n_lim=0, KEY_LIMIT: gl.constexpr = False,
                   ROWSUM_MMA: gl.constexpr = False, KPERM: gl.constexpr = False):
    """KV tile 0 of a block: S_0 in this consumer's turn, then its softmax (masked under CAUSAL, where
    tile 0 may be on the diagonal, or KEY_LIMIT). Returns ``(p, alpha, m_i, l_i)`` as
    ``_softmax_tile_f32``; ROWSUM_MMA: l_i zero in O's row layout (``_ws_tile_step``)."""
    m_i = gl.full([zero_s.shape[0]], float("-inf"), gl.float32, gl.SliceLayout(1, zero_s.type.layout))
    l_i = gl.zeros([zero_s.shape[0]], gl.float32, gl.SliceLayout(1, zero_s.type.layout))
    mbarrier.wait(q_ready.index(qi // NQK), (it // 2) & 1)
    ks0 = g0 % NUM_STAGES
    _ws_turn_wait(turn, WG, k0)
    mbarrier.wait(k_ready.index(ks0), (g0 // NUM_STAGES) & 1)
    s_tok = _ws_qk(q_smem, qi, k_smem, ks0, zero_s, NQK)
    _ws_turn_pass(turn, WG, q_ready.shape[0] // 2)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
    mbarrier.arrive(k_empty.index(ks0))
    p, alpha, m_i, l_i = _softmax_tile_f32(s, m_i, l_i, qk_scale, mw, 0, shift, row_o, CAUSAL or KEY_LIMIT, n_lim,
                                           KEY_LIMIT, not ROWSUM_MMA, KPERM)
    if ROWSUM_MMA:
        l_i = gl.convert_layout(l_i, row_o)
    return p, alpha, m_i, l_i

@gluon.constexpr_function
def _ws_mma_layouts(NW, TN, DO):
    """``(s_layout, o_layout, p_layout)`` of a consumer warpgroup: the wgmma accumulator layouts of S
    (TN keys wide) and of one O part (DO wide), and P's e4m3 register operand of P V."""
    s_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, TN, 32])
    o_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, DO, 32])
    return s_layout, o_layout, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)

@gluon.jit
def _ws_consumer(WG: gl.constexpr, ring, io, seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2,
                 CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, OUT_FP8: gl.constexpr, NUM_STAGES: gl.constexpr,
                 HEAD_DIM: gl.constexpr, SeqlensK, BlockList, Out, stride_om, stride_oh, v_clean,
                 MODE: gl.constexpr, V_ROWS: gl.constexpr = False, ones=None, ones_ready=None,
                 KPERM: gl.constexpr = False, HEAD_DIM_V: gl.constexpr = 0):
    """Consumer WG (4 warps) of ``q_ready.shape[0] // 2``: rows 64 WG .. 64 WG + 63 of each of this CTA's
    query blocks, walked in the producer's order; each block runs ``_ws_attend`` (head dims 64, 128) or
    ``_ws_attend_d256``. ``ring``: the kernel's shared-memory buffers and barriers (q, k, v, o buffers; q
    ready / empty, k ready, v ready, k empty, v empty; the MMA turn); ``io``: the output descriptor, the LSE,
    descale and out-scale pointers and their strides (the kernel's, in its order).
    MODE != dense (head dims 64, 128; varlen also qk 192 / v 128): per-sequence bounds (``_ws_block``), the V
    tail barrier ``v_clean`` (``_ws_clean_v_tail``); varlen rows are stored through ``Out`` (row stride
    ``stride_om``, head stride ``stride_oh``) with a row mask. ``ones`` (ready on ``ones_ready``, loaded
    once by the producer): the e4m3 ones tile of the row sums of calls without an LSE (``_rowsum_mma``,
    ``_ws_attend``). HEAD_DIM_V: V's and O's head dim where it differs from ``HEAD_DIM`` (0: the same; qk 192 /
    v 128 runs ``_ws_attend`` with Q and K in three boxes)."""
    gl.static_assert(gl.num_warps() == 4)
    q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn = ring
    o_desc, Lse, QDs, KDs, VDs, OutScale, stride_lb, stride_lh, stride_lm, stride_qds_b, stride_qds_h, stride_kds_b, \
        stride_kds_h, stride_vds_b, stride_vds_h = io
    DHV: gl.constexpr = HEAD_DIM if HEAD_DIM_V == 0 else HEAD_DIM_V
    MH: gl.constexpr = q_smem.shape[1]
    TN: gl.constexpr = k_smem.shape[1]
    DO: gl.constexpr = v_smem.shape[1]  # head-dim width of one O part (the whole head below 256)
    NC: gl.constexpr = q_ready.shape[0] // 2  # consumers (two Q buffers each)
    s_layout: gl.constexpr = _ws_mma_layouts(4, TN, DO)[0]
    o_layout: gl.constexpr = _ws_mma_layouts(4, TN, DO)[1]
    p_layout: gl.constexpr = _ws_mma_layouts(4, TN, DO)[2]
    zero_s = gl.zeros([MH, TN], gl.float32, s_layout)
    zero_o = gl.zeros([MH, DO], gl.float32, o_layout)

    g0 = 0  # K/V tiles consumed by this CTA before the current query block (ring position)
    k0 = 0  # this consumer's turns before the current query block
    it = 0  # query blocks done by this CTA (Q double buffer)
    nc = 0  # per-sequence bounds: blocks whose last V tile was cleaned (``v_clean``'s phase)
    n_blocks = _ws_num_blocks(seqlen_q, batch, nheads_q, NC * MH, BlockList, MODE)
    out_inv = _out_scale_inv(OutScale, OUT_FP8)
    if _rowsum_mma(CAUSAL, WRITE_LSE, DHV, MODE, OUT_FP8):  # (``_ws_attend``'s row sums on the tensor core)
        mbarrier.wait(ones_ready, 0)
    for r in range(0, gl.cdiv(n_blocks, gl.num_programs(0))):
        t = _ws_round_robin(r)
        if t < n_blocks:
            b, h, mw, shift, n_tiles, qk_scale, v_descale, qb, sk, q_row, len_q = _ws_block_begin(
                t, n_blocks, it, WG, QDs, KDs, VDs, stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h,
                stride_vds_b, stride_vds_h, seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2, MH,
                TN, CAUSAL, SeqlensK, BlockList, MODE, NC)
            if HEAD_DIM == 256:
                _ws_attend_d256(WG, NC * qb + WG, g0, k0, it, b, h, mw, shift, n_tiles, qk_scale, v_descale, q_smem,
                                k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
                                o_desc, Lse, out_inv, stride_lb, stride_lh, stride_lm, seqlen_q, zero_s, zero_o,
                                o_layout, p_layout, CAUSAL, WRITE_LSE, OUT_FP8, NUM_STAGES)
            else:
                _ws_attend(WG, NC * qb + WG, g0, k0, it, b, h, mw, shift, n_tiles, qk_scale, v_descale, q_smem,
                           k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
                           o_desc, Lse, out_inv, stride_lb, stride_lh, stride_lm, seqlen_q, zero_s, zero_o,
                           o_layout, p_layout, CAUSAL, WRITE_LSE, OUT_FP8, NUM_STAGES, sk, v_clean, nc & 1, q_row,
                           len_q, Out, stride_om, stride_oh, MODE, V_ROWS, ones, KPERM)
                if MODE != 0:
                    nc += (n_tiles * TN > sk).to(gl.int32)
            g0 += n_tiles
            k0 += n_tiles + 1
            it += 1
    tma.store_wait(pendings=0)

@gluon.jit
def _ws_attend(WG: gl.constexpr, qi, g0, k0, it, b, h, mw, shift, n_tiles, qk_scale, v_descale, q_smem, k_smem,
               v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, o_desc, Lse, out_inv,
               stride_lb, stride_lh, stride_lm, seqlen_q, zero_s, zero_o, o_layout: gl.constexpr,
               p_layout: gl.constexpr, CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, OUT_FP8: gl.constexpr,
               NUM_STAGES: gl.constexpr, seqlen_k=0, v_clean=None, clean_phase=0, q_row=0, len_q=0, Out=None,
               stride_om=0, stride_oh=0, MODE: gl.constexpr = 0, V_ROWS: gl.constexpr = False, ones=None,
               KPERM: gl.constexpr = False):
    """One consumer's 64 rows of one query block, head dims 64 and 128: Q in buffer ``qi``, KV tiles
    from ring position ``g0``, turns from ``k0``; normalized rows stored by TMA, LSE by plain stores.
    Per-sequence bounds (MODE != dense): ``seqlen_k`` keys of any count; tiles that every row of this
    consumer sees whole run unmasked, the others (tile 0, the diagonal, the sequence's end) masked,
    and the last V tile is cleaned past the end (``_ws_clean_v_tail``, phase ``clean_phase``). Varlen:
    the sequence's ``len_q`` queries start at row ``q_row``; rows past them are not stored.
    Without an LSE (non-causal; causal at head dim 64, dense: ``_rowsum_mma``) the row sums come from the
    tensor core (``_row_sum_issue`` on the ``ones`` tile, issued with each P V): the output is normalized by
    the sum of the e4m3 P that P V multiplied, and the softmax step has no fp32 sum chain (faster on the
    H200). With an LSE the sum is the fp32 one of the unrounded P, so the LSE is exact (and final
    before the last P V, where it is stored); the other causal calls keep it too (docs/decisions.md).
    KPERM: K's rows were loaded key-permuted (``kperm_box_on``): masks use the
    permuted key index and P is relabelled to key order, not exchanged across lanes (``_p_operand``).
    Q and K may come in NQK boxes per head (the ring's buffers per stage; qk 192: three 64-wide boxes,
    Q buffer ``qi`` then their first at NQK qi), whose S MMAs chain (``_ws_qk``)."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    TN: gl.constexpr = k_smem.shape[1]
    NQK: gl.constexpr = k_smem.shape[0] // NUM_STAGES
    RS: gl.constexpr = _rowsum_mma(CAUSAL, WRITE_LSE, zero_o.shape[1], MODE, OUT_FP8)
    NC: gl.constexpr = q_ready.shape[0] // 2  # consumers
    gl.static_assert(not KPERM or MODE == 0)  # (the bounded tiles below do not relabel P)
    qs = qi  # the Q buffer's first box
    if NQK > 1:
        qs = NQK * qi
    acc = gl.zeros(zero_o.shape, gl.float32, o_layout)
    p, alpha, m_i, l_i = _ws_first_tile(q_smem, qs, k_smem, q_ready, k_ready, k_empty, turn, WG, g0, k0, it,
                                        zero_s, qk_scale, mw, shift, row_o, NQK, NUM_STAGES, CAUSAL, seqlen_k,
                                        MODE != 0, RS, KPERM)

    if MODE != 0:
        n_plain = gl.minimum(gl.maximum(gl.minimum(mw + shift + 1, seqlen_k) // TN, 1), n_tiles)
        for j in range(1, n_plain):
            p, alpha, m_i, l_i, acc = _ws_tile_step(
                j, g0 + j, k0 + j, p, alpha, m_i, l_i, acc, q_smem, qs, k_smem, v_smem, k_ready, v_ready,
                k_empty, v_empty, turn, WG, zero_s, zero_o, qk_scale, mw, shift, p_layout, row_o, NUM_STAGES,
                False, ones=ones, ROWSUM_MMA=RS, NC=NC, NQK=NQK)
        for j in range(n_plain, n_tiles):
            p, alpha, m_i, l_i, acc = _ws_tile_step(
                j, g0 + j, k0 + j, p, alpha, m_i, l_i, acc, q_smem, qs, k_smem, v_smem, k_ready, v_ready,
                k_empty, v_empty, turn, WG, zero_s, zero_o, qk_scale, mw, shift, p_layout, row_o, NUM_STAGES,
                True, seqlen_k, True, ones, RS, NC, NQK=NQK)
    else:
        # fully visible tiles; with CAUSAL the last tile is the diagonal one, masked
        n_plain = n_tiles - 1 if CAUSAL else n_tiles
        for j in range(1, n_plain):
            p, alpha, m_i, l_i, acc = _ws_tile_step(
                j, g0 + j, k0 + j, p, alpha, m_i, l_i, acc, q_smem, qs, k_smem, v_smem, k_ready, v_ready,
                k_empty, v_empty, turn, WG, zero_s, zero_o, qk_scale, mw, shift, p_layout, row_o, NUM_STAGES,
                False, ones=ones, ROWSUM_MMA=RS, NC=NC, KPERM=KPERM, NQK=NQK)
        if CAUSAL:
            if n_tiles > 1:
                jm = n_tiles - 1
                p, alpha, m_i, l_i, acc = _ws_tile_step(
                    jm, g0 + jm, k0 + jm, p, alpha, m_i, l_i, acc, q_smem, qs, k_smem, v_smem, k_ready, v_ready,
                    k_empty, v_empty, turn, WG, zero_s, zero_o, qk_scale, mw, shift, p_layout, row_o,
                    NUM_STAGES, True, ones=ones, ROWSUM_MMA=RS, NC=NC, KPERM=KPERM, NQK=NQK)

    # The row max and sum are final: the LSE is stored before the last tile's P V, where the output
    # accumulator and that product peak the registers (stored after it, m_i lived through the peak
    # and the row sum spilled once per KV tile in the V_ROWS kernel).
    if WRITE_LSE:
        lse = _row_lse(gl.convert_layout(m_i, row_o), gl.convert_layout(l_i, row_o))
        if MODE >= 2:  # varlen: rows past the sequence's queries (the next sequence's) are not stored
            _store_lse(lse, Lse, b, h, q_row + mw, stride_lb, stride_lh, stride_lm, row_o, len_q - mw, True)
        elif (NC == 2) or (mw < seqlen_q):  # (three consumers: see below)
            _store_lse(lse, Lse, b, h, mw, stride_lb, stride_lh, stride_lm, row_o)

    # the last tile's P V
    gl_ = g0 + n_tiles - 1
    vs = gl_ % NUM_STAGES
    p8 = _p_operand(p, p_layout, KPERM)
    if MODE != 0 and not V_ROWS:  # (V_ROWS: the producer zeroed them while transposing)
        mbarrier.wait(v_ready.index(vs), (gl_ // NUM_STAGES) & 1)
        _ws_clean_v_tail(v_smem.index(vs), (n_tiles - 1) * TN, seqlen_k, v_clean, clean_phase, WG)
    _ws_turn_wait(turn, WG, k0 + n_tiles)
    mbarrier.wait(v_ready.index(vs), (gl_ // NUM_STAGES) & 1)
    pv_tok, ls_tok = _ws_pv_issue(p8, v_smem.index(vs), ones, zero_o, RS)
    _ws_turn_pass(turn, WG, NC)
    acc = acc * gl.expand_dims(alpha, 1)
    pv, l_i = _ws_pv_retire(pv_tok, ls_tok, l_i, alpha, row_o, RS)
    mbarrier.arrive(v_empty.index(vs))
    mbarrier.arrive(q_empty.index(qi))  # every S MMA of this block has completed
    acc = acc + pv

    out = _normalize_rows(acc, gl.convert_layout(l_i, row_o), v_descale)
    if MODE >= 2:  # varlen: rows past the sequence's queries (the next sequence's) are not stored
        tma.store_wait(pendings=0)  # the previous block's output has left the buffer
        if len_q - mw >= zero_o.shape[0]:  # all 64 rows are the sequence's: a TMA store, as dense
            _store_rows(out, o_smem.index(WG), o_desc, q_row + mw, h * zero_o.shape[1], out_inv, OUT_FP8)
        else:
            _store_rows_masked(out, o_smem.index(WG), Out, q_row + mw, len_q - mw, h.to(gl.int64) * stride_oh,
                               stride_om, out_inv, OUT_FP8)
    elif (NC == 2) or (mw < seqlen_q):  # three consumers: a sequence's last block may end past it
        tma.store_wait(pendings=0)  # the previous block's output has left the buffer
        _store_rows(out, o_smem.index(WG), o_desc, b * seqlen_q + mw, h * zero_o.shape[1], out_inv, OUT_FP8)

@gluon.jit
def _ws_clean_v_tail(v_buf, n0, seqlen_k, v_clean, phase, WG: gl.constexpr):
    """Paged caches: when a block's last V tile (keys n0 .. n0 + TN - 1) runs past the sequence's end,
    its slots there hold no data (NaN in a poisoned cache); P is 0 for them, but 0 * NaN is NaN in
    P V. Consumer 0 zeroes those key columns in shared memory, then signals ``v_clean``; consumer 1
    waits for it (it reaches this tile after consumer 0, so the wait costs it nothing)."""
    TN: gl.constexpr = v_buf.shape[1]
    if n0 + TN > seqlen_k:
        if WG == 0:
            layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (TN // 16), TN // 16], [gl.num_warps(), 1],
                                                    [1, 0])
            x = v_buf.load(layout)
            keys = n0 + gl.arange(0, TN, layout=gl.SliceLayout(0, layout))
            v_buf.store(gl.where(gl.expand_dims(keys < seqlen_k, 0), x, gl.zeros_like(x)))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(v_clean)
        else:
            mbarrier.wait(v_clean, phase)

@gluon.jit
def _ws_pv_quarters(acc0, acc1, acc2, acc3, pv0, p8, v_smem, vi, alpha, o_layout: gl.constexpr):
    """Head dim 256: add P V to O's four 64-wide quarters, O rescaled by ``alpha``. Quarter 0's product
    ``pv0`` was issued in the consumer's turn; quarters 1-3 run here, each from a zero accumulator
    (two-level accumulation with one 32-register product live at a time)."""
    acc0 = acc0 * gl.expand_dims(alpha, 1) + pv0
    acc1 = _pv_quarter(acc1, p8, v_smem.index(vi + 1), alpha, o_layout)
    acc2 = _pv_quarter(acc2, p8, v_smem.index(vi + 2), alpha, o_layout)
    acc3 = _pv_quarter(acc3, p8, v_smem.index(vi + 3), alpha, o_layout)
    return acc0, acc1, acc2, acc3

@gluon.jit
def _ws_tile_step_d256(j, g, k, p, alpha_prev, m_i, l_i, acc0, acc1, acc2, acc3, q_smem, qi, k_smem, v_smem,
                       k_ready, v_ready, k_empty, v_empty, turn, WG: gl.constexpr, zero_s, zero_o, qk_scale, mw,
                       shift, o_layout: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr,
                       NUM_STAGES: gl.constexpr, MASKED: gl.constexpr, P_EARLY: gl.constexpr):
    """``_ws_tile_step`` for head dim 256: in the turn, S_j (two head-dim halves) and the first quarter
    of P_{j-1} V_{j-1}; softmax_j under them; then the other three quarters (``_ws_pv_quarters``).
    ``p`` (and the P returned) is fp32 with P_EARLY, converted to the e4m3 operand here before the
    turn, else already the operand (converted at the end of the previous step)."""
    TN: gl.constexpr = k_smem.shape[1]
    if P_EARLY:
        p8 = _p_operand(p, p_layout)
    else:
        p8 = p
    ks = g % NUM_STAGES
    vp = (g - 1) % NUM_STAGES
    _ws_turn_wait(turn, WG, k)
    mbarrier.wait(k_ready.index(ks), (g // NUM_STAGES) & 1)
    s_tok = _ws_qk(q_smem, qi, k_smem, ks, zero_s, 2)
    mbarrier.wait(v_ready.index(vp), ((g - 1) // NUM_STAGES) & 1)
    pv_tok = warpgroup_mma(p8, v_smem.index(4 * vp).permute((1, 0)), zero_o, use_acc=False, is_async=True)
    _ws_turn_pass(turn, WG, 2)
    s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
    mbarrier.arrive(k_empty.index(ks))
    p, alpha, m_i, l_i = _softmax_tile_f32(s, m_i, l_i, qk_scale, mw, j * TN, shift, row_o, MASKED)
    pv0 = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
    acc0, acc1, acc2, acc3 = _ws_pv_quarters(acc0, acc1, acc2, acc3, pv0, p8, v_smem, 4 * vp, alpha_prev,
                                             o_layout)
    mbarrier.arrive(v_empty.index(vp))
    if not P_EARLY:
        p = _p_operand(p, p_layout)
    return p, alpha, m_i, l_i, acc0, acc1, acc2, acc3

@gluon.jit
def _ws_attend_d256(WG: gl.constexpr, qb, g0, k0, it, b, h, mw, shift, n_tiles, qk_scale, v_descale, q_smem,
                    k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, o_desc,
                    Lse, out_inv, stride_lb, stride_lh, stride_lm, seqlen_q, zero_s, zero_o,
                    o_layout: gl.constexpr, p_layout: gl.constexpr, CAUSAL: gl.constexpr,
                    WRITE_LSE: gl.constexpr, OUT_FP8: gl.constexpr, NUM_STAGES: gl.constexpr):
    """``_ws_attend`` for head dim 256 (Q buffer ``qb``: boxes 2 qb and 2 qb + 1): Q/K in two 128-wide
    halves of the head dim, V/O in four 64-wide quarters and 64-key tiles, so that O's 128 fp32
    registers per thread, the S tile and one quarter's product fit 240 registers. A 128-row block
    spans two KV tiles of the diagonal: under CAUSAL both run masked. P's conversion to the e4m3
    operand runs at the start of the step that uses it when non-causal (the loop's P relabelling then
    takes far fewer byte permutes per tile, faster on the H200), at the end of the step that computes it
    when causal (there the early conversion spilled more and ran slower)."""
    P_EARLY: gl.constexpr = not CAUSAL
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    MH: gl.constexpr = zero_o.shape[0]
    DQ: gl.constexpr = zero_o.shape[1]
    N_DIAG: gl.constexpr = 2 * MH // k_smem.shape[1]  # KV tiles that cross a block's diagonal
    qi = 2 * qb
    acc0 = gl.zeros([MH, DQ], gl.float32, o_layout)
    acc1 = gl.zeros([MH, DQ], gl.float32, o_layout)
    acc2 = gl.zeros([MH, DQ], gl.float32, o_layout)
    acc3 = gl.zeros([MH, DQ], gl.float32, o_layout)
    p, alpha, m_i, l_i = _ws_first_tile(q_smem, qi, k_smem, q_ready, k_ready, k_empty, turn, WG, g0, k0, it,
                                        zero_s, qk_scale, mw, shift, row_o, 2, NUM_STAGES, CAUSAL)
    if not P_EARLY:
        p = _p_operand(p, p_layout)
    n_plain = n_tiles - N_DIAG if CAUSAL else n_tiles
    for j in range(1, n_plain):
        p, alpha, m_i, l_i, acc0, acc1, acc2, acc3 = _ws_tile_step_d256(
            j, g0 + j, k0 + j, p, alpha, m_i, l_i, acc0, acc1, acc2, acc3, q_smem, qi, k_smem, v_smem, k_ready,
            v_ready, k_empty, v_empty, turn, WG, zero_s, zero_o, qk_scale, mw, shift, o_layout, p_layout, row_o,
            NUM_STAGES, False, P_EARLY)
    if CAUSAL:
        for j in range(gl.maximum(n_plain, 1), n_tiles):
            p, alpha, m_i, l_i, acc0, acc1, acc2, acc3 = _ws_tile_step_d256(
                j, g0 + j, k0 + j, p, alpha, m_i, l_i, acc0, acc1, acc2, acc3, q_smem, qi, k_smem, v_smem,
                k_ready, v_ready, k_empty, v_empty, turn, WG, zero_s, zero_o, qk_scale, mw, shift, o_layout,
                p_layout, row_o, NUM_STAGES, True, P_EARLY)

    # the last tile's P V
    gl_ = g0 + n_tiles - 1
    vs = gl_ % NUM_STAGES
    if P_EARLY:
        p8 = _p_operand(p, p_layout)
    else:
        p8 = p
    _ws_turn_wait(turn, WG, k0 + n_tiles)
    mbarrier.wait(v_ready.index(vs), (gl_ // NUM_STAGES) & 1)
    pv_tok = warpgroup_mma(p8, v_smem.index(4 * vs).permute((1, 0)), zero_o, use_acc=False, is_async=True)
    _ws_turn_pass(turn, WG, 2)
    pv0 = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
    acc0, acc1, acc2, acc3 = _ws_pv_quarters(acc0, acc1, acc2, acc3, pv0, p8, v_smem, 4 * vs, alpha, o_layout)
    mbarrier.arrive(v_empty.index(vs))
    mbarrier.arrive(q_empty.index(qb))

    m_o = gl.convert_layout(m_i, row_o)
    l_o = gl.convert_layout(l_i, row_o)
    row = b * seqlen_q + mw
    col = h * (4 * DQ)
    tma.store_wait(pendings=0)  # the previous block's output has left the buffers
    out, lse = _finalize_rows(acc0, m_o, l_o, v_descale)
    _store_rows(out, o_smem.index(4 * WG), o_desc, row, col, out_inv, OUT_FP8)
    out = _normalize_rows(acc1, l_o, v_descale)
    _store_rows(out, o_smem.index(4 * WG + 1), o_desc, row, col + DQ, out_inv, OUT_FP8)
    out = _normalize_rows(acc2, l_o, v_descale)
    _store_rows(out, o_smem.index(4 * WG + 2), o_desc, row, col + 2 * DQ, out_inv, OUT_FP8)
    out = _normalize_rows(acc3, l_o, v_descale)
    _store_rows(out, o_smem.index(4 * WG + 3), o_desc, row, col + 3 * DQ, out_inv, OUT_FP8)
    if WRITE_LSE:
        _store_lse(lse, Lse, b, h, mw, stride_lb, stride_lh, stride_lm, row_o)
