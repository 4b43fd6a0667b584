"""Gluon device code shared by the Hopper TMA attention kernels (``tma_lockstep``, ``tma_ws``).

One online-softmax step on a wgmma accumulator tile (``_softmax_tile_f32``; P = exp2(s - m + 8) cast to
e4m3), the row finalization, the LSE store, the output epilogue (bf16, or e4m3 through the fused static
``out_scale``) with its TMA and masked stores, the K/V refill and barrier set-up, a query block's
bounds and descales, the two-level P V product of a 64-wide head-dim quarter, and the warp-specialized
kernel's persistent schedule. Launchers and numerics: ``dense_tma``.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .tma_signature import ENTRY


# Globals read inside Gluon code must be constexpr.
_ENTRY_G = gl.constexpr(ENTRY)
_P_OFFSET = gl.constexpr(8.0)  # P = exp2(s - m + 8) lands in [0, 256] < 448 (e4m3 max)
_LN2 = gl.constexpr(0.6931471805599453)
_E4M3_MAX = gl.constexpr(448.0)


@gluon.constexpr_function
def kperm_box_on(k_box_shape):
    """Whether K's TMA box is key-permuted (``dense_tma.kperm_on``): 5-D, (keys / 16, 2, 4, 2, head dim).
    Also called on the host."""
    return len(k_box_shape) == 5

@gluon.constexpr_function
def box_keys(k_box_shape):
    """Keys in a K box: its rows, or the rows of a key-permuted 5-D box (``kperm_box_on``)."""
    n = 1
    for x in list(k_box_shape)[:-1]:
        n *= int(x)
    return n

@gluon.constexpr_function
def k_smem_layout(k_desc_layout, k_box_shape):
    """The layout of the K ring: the descriptor's, or for a key-permuted box the rank-2 layout of the same
    swizzle (the producer writes each stage through a 5-D view of it)."""
    if kperm_box_on(k_box_shape):
        return gl.NVMMASharedLayout(swizzle_byte_width=k_desc_layout.swizzle_byte_width, element_bitwidth=8,
                                    rank=2)
    return k_desc_layout

@gluon.jit
def _kperm_keys(c):
    """Key of S column ``c`` under a key-permuted K box (``kperm_box_on``): shared-memory row 16a + 8g + 2q + e
    of K holds key 16a + 4q + 2g + e."""
    return (c // 16) * 16 + ((c // 2) % 4) * 4 + ((c // 8) % 2) * 2 + c % 2


@gluon.jit
def _softmax_tile_f32(s, m_i, l_i, qk_scale, m0, n0, shift, row_o: gl.constexpr, MASKED: gl.constexpr,
                      n_lim=0, KEY_LIMIT: gl.constexpr = False, ROW_SUM: gl.constexpr = True,
                      KPERM: gl.constexpr = False):
    """One online-softmax step on a raw fp32 S tile (wgmma accumulator layout).

    MASKED applies the bottom-right causal mask (key n visible to query m iff
    n <= m + shift) as -inf on the raw logits; only the diagonal tile needs it. KEY_LIMIT (paged
    caches) also hides keys n >= n_lim, the slots past the sequence's end, whatever they hold.
    Returns P in fp32 (S's layout; ``_p_operand`` makes the e4m3 A operand of P V), alpha in
    the O row layout, new m and l. Without ROW_SUM, l is returned as given: the caller sums the
    tile's e4m3 P on the tensor core instead (``_row_sum_issue``).
    """
    s_layout: gl.constexpr = s.type.layout
    if MASKED:
        offs_m = m0 + gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s_layout))
        offs_n = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout))
        if KPERM:
            offs_n = _kperm_keys(offs_n)
        offs_n = n0 + offs_n
        if KEY_LIMIT:
            keep = gl.expand_dims(offs_n, 0) <= gl.minimum(gl.expand_dims(offs_m, 1) + shift, n_lim - 1)
        else:
            keep = gl.expand_dims(offs_n, 0) <= gl.expand_dims(offs_m, 1) + shift
        s = gl.where(keep, s, float("-inf"))
    # qk_scale > 0 (descales are floored), so max(s) * scale == max(s * scale).
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    if MASKED:
        # a row with no visible key so far keeps m = -inf; exp2(-inf - -inf) would be NaN
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = gl.exp2(m_i - m_use)
    # one FFMA per element: s * scale - (m - 8)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use - _P_OFFSET, 1))
    if ROW_SUM:
        l_new = l_i * alpha + gl.sum(p, axis=1)  # fp32 sum before the cast; 2^8 cancels in acc / l
    else:
        l_new = l_i
    return p, gl.convert_layout(alpha, row_o), m_new, l_new

@gluon.constexpr_function
def _rowsum_mma(causal, write_lse, head_dim, mode, out_fp8):
    """Whether a warp-specialized call takes its row sums from the tensor core (``_row_sum_issue``): calls
    without an LSE at head dims 64 and 128, non-causal, or causal at head dim 64 in the dense kernel (``mode``
    0), except the fused e4m3 output at head dim 128; the others sum in fp32, so an LSE is exact. Causal at
    head dim 128 the sums from the tensor core ran even to 1% slower on the H200 (more spills), at 64 +3-9%
    (docs/perf-notes.md, dense rounds 15-16); with the e4m3 output at head dim 128 5.5% slower (B4 S4096
    non-causal: 722-734 us against 683-701 with fp32 sums; perf-notes, the fused output and the row sums)."""
    return (not write_lse and head_dim != 256 and (not causal or (head_dim == 64 and mode == 0))
            and not (out_fp8 and head_dim == 128))

@gluon.jit
def _row_sum_issue(p8, ones):
    """Issue P @ ones on the tensor core (async): ``p8`` the e4m3 A operand of P V (64 rows x keys), ``ones``
    a (16, keys) e4m3 tile of ones in shared memory (loaded by TMA). Every column of the (64, 16) fp32
    result is the row's sum of the P that P V multiplies (``_row_sum``)."""
    NO: gl.constexpr = ones.shape[0]
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, NO, 32])
    a = gl.convert_layout(p8, gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=4))
    return warpgroup_mma(a, ones.permute((1, 0)), gl.zeros([p8.shape[0], NO], gl.float32, l_layout),
                         use_acc=False, is_async=True)

@gluon.jit
def _row_sum(ls, row_o: gl.constexpr):
    """The row sums of a retired ``_row_sum_issue`` in the O row layout (its columns are equal)."""
    return gl.convert_layout(gl.max(ls, axis=1), row_o)

@gluon.jit
def _p_operand(p, p_layout: gl.constexpr, KPERM: gl.constexpr = False):
    """fp32 P in [0, 256] -> the e4m3 register A operand of P V. KPERM (``kperm_box_on``): P's columns are in
    ``_kperm_keys`` order; relabelled to key order, the accumulator layout is the operand layout (no
    cross-lane exchange; asserted)."""
    if KPERM:
        M: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        p = gl.reshape(gl.permute(gl.reshape(p, [M, N // 16, 2, 4, 2]), (0, 1, 3, 2, 4)), [M, N])
        return gl.convert_layout(p.to(gl.float8e4nv), p_layout, assert_trivial=True)
    return gl.convert_layout(p.to(gl.float8e4nv), p_layout)

@gluon.jit
def _softmax_tile(s, m_i, l_i, qk_scale, m0, n0, shift,
                  p_layout: gl.constexpr, row_o: gl.constexpr, MASKED: gl.constexpr):
    """``_softmax_tile_f32`` returning P as the e4m3 A operand."""
    p, alpha, m_new, l_new = _softmax_tile_f32(s, m_i, l_i, qk_scale, m0, n0, shift, row_o, MASKED)
    return _p_operand(p, p_layout), alpha, m_new, l_new

@gluon.jit
def _refill(k_desc, k_row, k_col, k_bar, k_buf, k_pred, v_desc, v_row, v_col, v_bar, v_buf, v_pred):
    """Refill one K stage and one V stage once both warpgroups have retired the MMAs reading them.

    Every thread calls this after its own warpgroup_mma_wait; the CTA-wide barrier between
    the expects and the copies makes sure the other warpgroup is done too, and is the only
    barrier the membar analysis needs (otherwise it adds one between each expect and copy).
    Arriving with expect_tx early is harmless: the phase cannot complete before its copy.
    """
    mbarrier.expect(k_bar, k_desc.block_type.nbytes, pred=k_pred)
    mbarrier.expect(v_bar, v_desc.block_type.nbytes, pred=v_pred)
    gl.thread_barrier()
    tma.async_copy_global_to_shared(k_desc, [k_row, k_col], k_bar, k_buf, pred=k_pred)
    tma.async_copy_global_to_shared(v_desc, [v_row, v_col], v_bar, v_buf, pred=v_pred)

@gluon.jit
def _finalize_rows(acc, m_i, l_i, v_descale):
    """Normalize the accumulator and compute the natural-log LSE.

    Replicates ``common.finalize_rows`` (P_FP8 branch) exactly: that helper is written for
    Triton's layout-free tensors and cannot be called from Gluon code. Rows with l == 0
    give out = 0 and lse = -inf. m_i and l_i must be in acc's row layout.
    """
    return _normalize_rows(acc, l_i, v_descale), _row_lse(m_i, l_i)

@gluon.jit
def _normalize_rows(acc, l_i, v_descale):
    """The output of ``_finalize_rows``: acc * v_descale / l (0 where l == 0)."""
    empty = l_i == 0.0
    inv = gl.where(empty, 0.0, v_descale / gl.where(empty, 1.0, l_i))
    return acc * gl.expand_dims(inv, 1)

@gluon.jit
def _row_lse(m_i, l_i):
    """The natural-log LSE of ``_finalize_rows`` from the final row max and sum (-inf where l == 0)."""
    empty = l_i == 0.0
    lse2 = m_i + gl.log2(gl.where(empty, 1.0, l_i)) - _P_OFFSET
    return gl.where(empty, float("-inf"), lse2 * _LN2)

@gluon.jit
def _store_lse(lse, Lse, b, h, m0, stride_lb, stride_lh, stride_lm, row_o: gl.constexpr, n_rows=0,
               MASKED: gl.constexpr = False):
    """Store the LSE of query rows m0 .. m0 + len(lse) - 1 of (batch b, head h) (int64 offsets); MASKED:
    only the first ``n_rows`` of them."""
    rows = gl.arange(0, lse.shape[0], layout=row_o)
    ptrs = Lse + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + (m0 + rows).to(gl.int64) * stride_lm
    if MASKED:
        gl.store(ptrs, lse, mask=rows < n_rows)
    else:
        gl.store(ptrs, lse)

@gluon.constexpr_function
def _fp8_store_layout(shape, layout):
    """Where an e4m3 output tile in the wgmma accumulator layout goes before its shared-memory store:
    the lanes of a quad hold 4 consecutive columns of a row (one 32-bit word, two of stmatrix's 16-bit
    elements) instead of byte pairs 8 columns apart, so the store is stmatrix instead of 2-byte stores
    (64 ``STS.U16`` per thread at 64 x 128 before). Rows stay in their lanes and warps, so Triton
    converts with shuffles, not through shared memory (a 16-column grouping went through shared
    memory). Other layouts are returned unchanged."""
    if not isinstance(layout, gl.NVMMADistributedLayout) or layout.warps_per_cta[1] != 1:
        return layout
    rows, cols = int(shape[0]), int(shape[1])
    warps = layout.warps_per_cta[0]
    if rows != 16 * warps or cols % 64 != 0:
        return layout
    reg = [[0, 1], [0, 2], [8, 0], [0, 16], [0, 32]] + [[0, c] for c in (64, 128) if c < cols]
    lane = [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]]
    warp = [[16 << i, 0] for i in range(warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [rows, cols])

@gluon.jit
def _out_scale_inv(OutScale, OUT_FP8: gl.constexpr):
    """``1 / out_scale`` for the fused FP8 output (1.0 without it), loaded once per program, before
    its main loop, so that no epilogue waits on a global load."""
    if OUT_FP8:
        return 1.0 / gl.load(OutScale)
    else:
        return 1.0

@gluon.jit
def _output_epilogue(out, out_inv, OUT_FP8: gl.constexpr):
    """Cast the normalized fp32 output for storage: bf16, or with OUT_FP8 the fused static
    per-tensor quantization clamp(out * out_inv, -448, 448) cast to e4m3fn (``out_inv`` from
    ``_out_scale_inv``).

    Replicates ``common.output_epilogue`` and its caller's ``1.0 / load(OutScale)`` exactly
    (same operations in the same order, so the same roundings).
    """
    if OUT_FP8:
        y = gl.minimum(gl.maximum(out * out_inv, -_E4M3_MAX), _E4M3_MAX)
        return gl.convert_layout(y.to(gl.float8e4nv), _fp8_store_layout(out.type.shape, out.type.layout))
    else:
        return out.to(gl.bfloat16)

@gluon.jit
def _store_rows(out, ob, o_desc, row, col, out_inv, OUT_FP8: gl.constexpr):
    """Cast a normalized output tile, stage it in the shared buffer ``ob`` and start its TMA store to
    [row, col] (``ob``'s previous store must have completed: ``tma.store_wait`` first)."""
    ob.store(_output_epilogue(out, out_inv, OUT_FP8))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row, col], ob)

@gluon.jit
def _store_rows_masked(out, ob, Out, row, n_rows, col_off, stride_om, out_inv, OUT_FP8: gl.constexpr):
    """Varlen: cast a normalized output tile, stage it in the shared buffer ``ob`` and copy its first
    ``n_rows`` rows to ``Out`` at rows ``row ..``, element offset ``col_off`` (int64), with 16-byte
    plain stores (a TMA store would also write the rows past the sequence, which belong to the
    next one; storing from the MMA layout would need a 64-bit address per element)."""
    ob.store(_output_epilogue(out, out_inv, OUT_FP8))
    gl.thread_barrier()
    VEC: gl.constexpr = 16 // ob.dtype.primitive_bitwidth * 8
    TC: gl.constexpr = min(32, ob.shape[1] // VEC)
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TC, TC], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, ob.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, ob.shape[1], layout=gl.SliceLayout(0, layout))
    offs = gl.expand_dims((row + rows).to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(rows < n_rows, 1) & gl.expand_dims(cols < ob.shape[1], 0)
    gl.store(Out + col_off + offs, ob.load(layout), mask=mask)
    gl.thread_barrier()  # the buffer is free again

@gluon.jit
def _init_barriers(NUM_STAGES: gl.constexpr):
    """mbarriers of the Q load and of each K and V stage, initialized and fenced for TMA."""
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()
    return q_bar, k_bars, v_bars

@gluon.jit
def _invalidate_barriers(q_bar, k_bars, v_bars, NUM_STAGES: gl.constexpr):
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

@gluon.jit
def _query_block(pid_m, pid_bh, seqlen_q, seqlen_k, nheads_q, nheads_k,
                 BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr, BOUNDED: gl.constexpr = False):
    """Query block ``pid_m`` of head ``pid_bh``: ``(b, h, hk, m0, shift, n_tiles)``. ``n_tiles`` counts
    the KV tiles the block sees (keys < m0 + BM + shift under the bottom-right causal mask). BOUNDED:
    any ``seqlen_k`` (the last tile may run past it), at least one tile (masked when nothing is
    visible, so rows that see no key get out = 0 and lse = -inf)."""
    b = pid_bh // nheads_q
    h = pid_bh % nheads_q
    hk = h // (nheads_q // nheads_k)
    m0 = pid_m * BM
    shift = seqlen_k - seqlen_q
    if BOUNDED:
        if CAUSAL:
            n_end = gl.minimum(m0 + BM + shift, seqlen_k)
        else:
            n_end = seqlen_k
        n_tiles = gl.maximum((gl.maximum(n_end, 0) + BN - 1) // BN, 1)
    elif CAUSAL:
        n_tiles = (m0 + BM + shift) // BN
    else:
        n_tiles = seqlen_k // BN
    return b, h, hk, m0, shift, n_tiles

@gluon.jit
def _block_scales(b, hk, QDs, KDs, VDs, stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h,
                  stride_vds_b, stride_vds_h, softmax_scale_log2):
    """``(qk_scale, v_descale)``: the descales are per (batch, kv head), read with their strides
    (stride-0 broadcast views allowed); the Q/K ones are folded into the log2-domain logit scale."""
    b64 = b.to(gl.int64)
    hk64 = hk.to(gl.int64)
    qd = gl.load(QDs + b64 * stride_qds_b + hk64 * stride_qds_h)
    kd = gl.load(KDs + b64 * stride_kds_b + hk64 * stride_kds_h)
    v_descale = gl.load(VDs + b64 * stride_vds_b + hk64 * stride_vds_h)
    return softmax_scale_log2 * qd * kd, v_descale

@gluon.jit
def _query_block_setup(QDs, KDs, VDs, stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h,
                       stride_vds_b, stride_vds_h, seqlen_q, seqlen_k, nheads_q, nheads_k, softmax_scale_log2,
                       BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr):
    """This CTA's query block (grid: query blocks x batch * heads): ``(b, h, hk, m0, shift, n_tiles,
    qk_scale, v_descale)``. Causal grids run the longest query blocks (most keys) first."""
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    b, h, hk, m0, shift, n_tiles = _query_block(pid_m, gl.program_id(1), seqlen_q, seqlen_k, nheads_q,
                                                nheads_k, BM, BN, CAUSAL)
    qk_scale, v_descale = _block_scales(b, hk, QDs, KDs, VDs, stride_qds_b, stride_qds_h, stride_kds_b,
                                        stride_kds_h, stride_vds_b, stride_vds_h, softmax_scale_log2)
    return b, h, hk, m0, shift, n_tiles, qk_scale, v_descale

@gluon.jit
def _pv_quarter(acc, p8, v_buf, alpha, o_layout: gl.constexpr):
    """acc * alpha + P @ V_quarter, the product from a zero accumulator (two-level accumulation)."""
    zero_o = gl.zeros(acc.shape, gl.float32, o_layout)
    pv_tok = warpgroup_mma(p8, v_buf.permute((1, 0)), zero_o, use_acc=False, is_async=True)
    acc = acc * gl.expand_dims(alpha, 1)
    pv = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
    return acc + pv


# ---------------------------------------------------------------------------------------------
# The persistent schedule: block index -> (sequence, head, query block), shared by the producer
# and both consumers of the warp-specialized kernel
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _ws_round_robin(r):
    """This CTA's block of round r: blocks r * grid .. r * grid + grid - 1 go one per CTA, in CTA
    order on even rounds and in reverse order on odd ones. Causal blocks shrink along the order, and
    alternating pairs a longer block with a shorter one (H200, causal S16k: a plain round robin
    ran 6% behind the one-block-per-CTA grid, the alternating one 2%)."""
    g = gl.num_programs(0)
    c = gl.program_id(0)
    return r * g + gl.where(r % 2 == 0, c, g - 1 - c)

@gluon.jit
def _ws_block(t, n_blocks, seqlen_q, seqlen_k, batch, nheads_q, nheads_k, BM: gl.constexpr, BN: gl.constexpr,
              CAUSAL: gl.constexpr, SeqlensK, BlockList, MODE: gl.constexpr):
    """Block t of the persistent schedule -> ``(b, h, hk, m0, shift, n_tiles, seqlen_k, q_row, k_row,
    len_q)``: ``_query_block``'s values, the sequence's key count, the rows of its first query and key
    in the Q and K views, and its query count; the producer and both consumers walk the blocks through
    this one mapping (``n_blocks``: ``_ws_num_blocks``). MODE (``MODE_*``): dense; paged (key counts
    from ``SeqlensK``); varlen (MODE >= 2): the entries of ``BlockList`` (``varlen_block_list``: each
    block's sequence, query block, first query row, query count, first key row and key count)."""
    if MODE >= 2:
        # One entry holds the block's bounds (independent loads from one sector; the block count
        # comes from the caller's n_blocks, loaded once per CTA).
        pid_m, h = _ws_block_of(t, n_blocks // nheads_q, nheads_q, CAUSAL)
        e = BlockList + _ENTRY_G * (1 + pid_m)
        b = gl.load(e)
        qblk = gl.load(e + 1)
        q_row = gl.load(e + 2)
        len_q = gl.load(e + 3)
        k_row = gl.load(e + 4)
        seqlen_k = gl.load(e + 5)
        _, _, hk, m0, shift, n_tiles = _query_block(qblk, b * nheads_q + h, len_q, seqlen_k, nheads_q, nheads_k,
                                                    BM, BN, CAUSAL, True)
    else:
        pid_m, pid_bh = _ws_block_of(t, _ws_query_blocks(seqlen_q, BM), batch * nheads_q, CAUSAL)
        if MODE == 1:
            seqlen_k = gl.load(SeqlensK + pid_bh // nheads_q)
        b, h, hk, m0, shift, n_tiles = _query_block(pid_m, pid_bh, seqlen_q, seqlen_k, nheads_q, nheads_k, BM,
                                                    BN, CAUSAL, MODE == 1)
        q_row = b * seqlen_q
        k_row = b * seqlen_k
        len_q = seqlen_q
    return b, h, hk, m0, shift, n_tiles, seqlen_k, q_row, k_row, len_q

@gluon.jit
def _ws_num_blocks(seqlen_q, batch, nheads_q, BM: gl.constexpr, BlockList, MODE: gl.constexpr):
    """Query blocks of the persistent schedule (varlen: those of ``BlockList``, see ``_ws_block``)."""
    if MODE >= 2:
        return gl.load(BlockList) * nheads_q
    else:
        return _ws_query_blocks(seqlen_q, BM) * batch * nheads_q

@gluon.jit
def _ws_query_blocks(seqlen_q, BM: gl.constexpr):
    """Query blocks per sequence of fixed length: ``seqlen_q`` is a multiple of 128 (``dense_tma.supported``),
    so 128-row blocks divide it; 192-row blocks (three consumers) may end past it."""
    if BM == 128:
        return seqlen_q // BM
    else:
        return gl.cdiv(seqlen_q, BM)

@gluon.jit
def _ws_block_of(t, n_mb, n_bh, CAUSAL: gl.constexpr):
    """Block index t -> (query block, batch * head). Non-causal: the query blocks of one head are
    adjacent (concurrent CTAs share its K/V in L2). Causal on a persistent grid: the longest query
    blocks (most keys) of every head first, so that the alternating round robin (``_ws_round_robin``)
    balances the CTAs; causal on a full grid (one block per CTA, balanced by the hardware's dynamic
    scheduling): per head, longest first, as the other kernels' grids."""
    if CAUSAL:
        if gl.num_programs(0) < n_mb * n_bh:
            return n_mb - 1 - t // n_bh, t % n_bh
        else:
            return n_mb - 1 - t % n_mb, t // n_mb
    else:
        return t % n_mb, t // n_mb
