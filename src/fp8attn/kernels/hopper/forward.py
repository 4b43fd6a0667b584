"""The warp-specialized ping-pong kernels (FA3's schedule) and their producers.

``_dense_fwd_tma_ws_kernel``: a 1-warp TMA producer (``_ws_loader``) fills a double-buffered Q and a K/V
ring guarded by ready/empty mbarriers for two consumers (``consumer``), persistent over the query
blocks (``scheduler``). ``_bounded_fwd_tma_ws_kernel``: the same partitions with per-sequence
bounds (``MODE``: a paged cache, varlen queries and keys, varlen queries over a paged cache), and with V
read in K's layout and transposed in shared memory by a 4-warp producer (``V_ROWS``). ``dense_launch`` and
``paged_launch`` launch them.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .consumer import _ws_consumer
from .pipeline import _tile_keys, _ws_smem, box_keys, kperm_box_on
from .scheduler import _ws_block, _ws_num_blocks, _ws_round_robin
from .signature import _BOUNDED_INT_ARGS, _BOUNDED_PTR_ARGS, _INT_ARGS, _PTR_ARGS
from .softmax import _rowsum_mma

# -----------------------------------------------------------------------------------------
# Warp-specialized ping-pong, persistent (``_dense_fwd_tma_ws_kernel``), every head dim
# -----------------------------------------------------------------------------------------
_WS_CONSUMER_REGS = gl.constexpr(240)  # 2 x 128 threads x 240 + 32 x 24 <= 64K registers per SM
_WS_LOADER_REGS = gl.constexpr(24)
_WS3_CONSUMER_REGS = gl.constexpr(160)  # three consumers: 3 x 128 x 160 + 32 x 24 <= 64K

@gluon.jit
def _ws_loader(q_desc, k_desc, v_desc, ring, seqlen_q, seqlen_k, nheads_q, nheads_k, batch, HEAD_DIM: gl.constexpr,
               CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, PageTable, SeqlensK, BlockList,
               stride_pt, page_size, MODE: gl.constexpr, v_raw=None, v_raw_ready=None,
               V_ROWS: gl.constexpr = False, ones_desc=None, ones=None, ones_ready=None,
               WRITE_LSE: gl.constexpr = True, KPERM: gl.constexpr = False, OUT_FP8: gl.constexpr = False,
               HEAD_DIM_V: gl.constexpr = 0):
    """Producer warp (``ring``: the consumers' ``_ws_consumer`` bundle): per query block, both consumers' Q
    rows into the free Q buffer, then its K/V tiles
    through the ring (one ring for all of the CTA's blocks, so the next block's first tiles load
    while the consumers finish the current one). A stage / Q buffer is refilled once its consumers
    arrived on its empty barrier. Boxes narrower than the head dim (256: Q/K halves, V quarters)
    land in consecutive buffers under one barrier. Paged (MODE 1): a tile's keys lie in one page
    (page_size is a multiple of the tile), found through ``PageTable`` (read before the wait for the
    stage, so the load's latency hides under it); K as (num_blocks * page_size, nheads_k * D) rows, V
    sequence-major as (num_blocks * nheads_k * D, page_size). Varlen K/V (MODE 2): K as (total_k,
    nheads_k * D) rows, V sequence-contiguous as (nheads_k * D, columns) with each sequence from a
    16-byte aligned column (``dense.varlen_v_kmajor``). Varlen Q (MODE 2): rows
    of the (total_q, nheads_q * D) view.

    V_ROWS (4 warps): V in K's layout (rows of keys, FA3's cache layout), loaded by TMA at K's
    coordinates into ``v_raw`` and transposed into ``v_smem`` by this partition one tile behind the
    loads (``_ws_transpose_v``), so that tile g's K and V are in flight while tile g - 1 is
    transposed; its tiles are 128 keys for every page size, in boxes of up to one page (16, 32 or
    64 keys: ``_tile_keys``).

    First, once, where the consumers take their row sums from the tensor core (``_rowsum_mma``): their
    tile of e4m3 ones (``ones_desc``) into ``ones`` (written by TMA: a tile stored from registers did not
    read back correctly in the wgmma, see docs/decisions.md). The consumers wait for it
    before their first block, so it has landed before the CTA exits.

    HEAD_DIM_V: V's and O's head dim where it differs from Q's and K's ``HEAD_DIM`` (0: the same; the
    dense kernel's qk 192 / v 128, ``_dense_fwd_tma_ws_kernel``)."""
    q_smem, k_smem, v_smem, _o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, _turn = ring
    DHV: gl.constexpr = HEAD_DIM if HEAD_DIM_V == 0 else HEAD_DIM_V
    MH: gl.constexpr = q_desc.block_type.shape[0]
    KB: gl.constexpr = box_keys(k_desc.block_type.shape)
    TN: gl.constexpr = _tile_keys(KB, V_ROWS)
    NQK: gl.constexpr = HEAD_DIM // q_desc.block_type.shape[1]
    NV: gl.constexpr = 1 if V_ROWS else DHV // v_desc.block_type.shape[0]
    DQK: gl.constexpr = q_desc.block_type.shape[1]
    DV: gl.constexpr = v_desc.block_type.shape[0]
    NC: gl.constexpr = q_ready.shape[0] // 2  # consumers
    g = 0
    it = 0
    lim = 0  # V_ROWS: keys holding data in the tile loaded last (>= TN: all)
    if _rowsum_mma(CAUSAL, WRITE_LSE, DHV, MODE, OUT_FP8):
        mbarrier.expect(ones_ready, ones_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(ones_desc, [0, 0], ones_ready, ones)
    n_blocks = _ws_num_blocks(seqlen_q, batch, nheads_q, NC * MH, BlockList, MODE)
    for r in range(0, gl.cdiv(n_blocks, gl.num_programs(0))):
        t = _ws_round_robin(r)
        if t < n_blocks:
            b, h, hk, m0, shift, n_tiles, sk, q_row, k_row0, len_q = _ws_block(
                t, n_blocks, seqlen_q, seqlen_k, batch, nheads_q, nheads_k, NC * MH, TN, CAUSAL, SeqlensK,
                BlockList, MODE)
            qb = it % 2
            qph = ((it // 2) & 1) ^ 1  # the first two blocks' waits pass on fresh barriers
            for w in gl.static_range(NC):
                mbarrier.wait(q_empty.index(NC * qb + w), qph)
                mbarrier.expect(q_ready.index(NC * qb + w), NQK * q_desc.block_type.nbytes)
                for hh in gl.static_range(NQK):
                    tma.async_copy_global_to_shared(q_desc, [q_row + m0 + w * MH, h * HEAD_DIM + hh * DQK],
                                                    q_ready.index(NC * qb + w),
                                                    q_smem.index(NQK * (NC * qb + w) + hh))
            if KB < TN:  # the first tile's box rows (the next tiles' are loaded one tile ahead)
                rows = _box_rows(PageTable, b, stride_pt, 0, sk, page_size, TN, KB)
            for tt in range(n_tiles):
                if KB == TN:  # one box per tile: its K row and sequence-major V's coordinates
                    if MODE % 2 == 1:
                        n = tt * TN
                        pg = gl.maximum(gl.load(PageTable + b.to(gl.int64) * stride_pt + n // page_size), 0)
                        k_row = pg * page_size + n % page_size
                        v_row = (pg * nheads_k + hk) * DHV
                        v_col = n % page_size
                    elif MODE == 2:
                        k_row = k_row0 + tt * TN
                        v_row = hk * DHV
                        v_col = _varlen_v_start(k_row0, b) + tt * TN
                    else:
                        k_row = k_row0 + tt * TN
                        v_row = (b * nheads_k + hk) * DHV
                        v_col = tt * TN
                st = g % NUM_STAGES
                eph = ((g // NUM_STAGES) & 1) ^ 1  # the first NUM_STAGES waits pass on fresh barriers
                mbarrier.wait(k_empty.index(st), eph)
                if KB < TN:
                    # boxes smaller than the tile (V_ROWS, pages that 128 keys would straddle): one K and
                    # one V box per KB keys, each within a page (``_box_rows``); raw slot st was last
                    # read by tile g - NUM_STAGES's transpose, done below
                    mbarrier.expect(k_ready.index(st), (TN // KB) * k_desc.block_type.nbytes)
                    mbarrier.expect(v_raw_ready.index(st), (TN // KB) * v_desc.block_type.nbytes)
                    box = gl.arange(0, TN // KB, layout=rows.type.layout)
                    for i in gl.static_range(TN // KB):
                        row = gl.sum(gl.where(box == i, rows, 0), axis=0)  # in-thread: rows is replicated
                        tma.async_copy_global_to_shared(k_desc, [row, hk * HEAD_DIM], k_ready.index(st),
                                                        k_smem.index(st).slice(i * KB, KB))
                        tma.async_copy_global_to_shared(v_desc, [row, hk * HEAD_DIM], v_raw_ready.index(st),
                                                        v_raw.index(st).slice(i * KB, KB))
                    # the next tile's rows: the page-table loads are in flight during the transpose below
                    rows = _box_rows(PageTable, b, stride_pt, tt + 1, sk, page_size, TN, KB)
                elif KPERM:  # a 5-D box: 16-key groups in the consumers' column order (``kperm_box_on``)
                    mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(
                        k_desc, [k_row // 16, 0, 0, 0, hk * HEAD_DIM], k_ready.index(st),
                        k_smem.index(st)._reinterpret(k_desc.dtype, k_desc.block_type.shape, k_desc.layout))
                else:
                    mbarrier.expect(k_ready.index(st), NQK * k_desc.block_type.nbytes)
                    for hh in gl.static_range(NQK):
                        tma.async_copy_global_to_shared(k_desc, [k_row, hk * HEAD_DIM + hh * DQK],
                                                        k_ready.index(st), k_smem.index(NQK * st + hh))
                    if V_ROWS:
                        # raw slot st was last read by tile g - NUM_STAGES's transpose, done below
                        mbarrier.expect(v_raw_ready.index(st), v_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(v_desc, [k_row, hk * HEAD_DIM], v_raw_ready.index(st),
                                                        v_raw.index(st))
                if V_ROWS:
                    if g > 0:
                        _ws_transpose_v(v_raw, v_smem, v_raw_ready, v_ready, v_empty, g - 1, lim, NUM_STAGES)
                    lim = sk - tt * TN
                else:
                    mbarrier.wait(v_empty.index(st), eph)
                    mbarrier.expect(v_ready.index(st), NV * v_desc.block_type.nbytes)
                    for qq in gl.static_range(NV):
                        tma.async_copy_global_to_shared(v_desc, [v_row + qq * DV, v_col], v_ready.index(st),
                                                        v_smem.index(NV * st + qq))
                g += 1
            it += 1
    if V_ROWS:
        if g > 0:
            _ws_transpose_v(v_raw, v_smem, v_raw_ready, v_ready, v_empty, g - 1, lim, NUM_STAGES)

@gluon.constexpr_function
def _transpose_layout(D, num_warps):
    """``_ws_transpose_v``'s register layout of a (keys, D) chunk: 4 keys x 8 head-dim bytes per thread
    (8-byte loads, byte permutes, 4-byte stores), 8 x 4 threads per warp, warps along the head dim
    first: the transpose's cost over sequence-major V measured lowest on the H200 with this layout, against
    4 x 4 bytes per thread (ldmatrix loads) or 8 x 4 (8-byte stores) (docs/decisions.md)."""
    wd = min(num_warps, D // 32)
    return gl.BlockedLayout([4, 8], [8, 4], [num_warps // wd, wd], [1, 0])

@gluon.constexpr_function
def _transpose_chunk(layout):
    """Keys per chunk of ``_ws_transpose_v``: one layout tile, at least 32."""
    return max(32, layout.size_per_thread[0] * layout.threads_per_warp[0] * layout.warps_per_cta[0])

@gluon.jit
def _box_rows(PageTable, b, stride_pt, tt, seqlen_k, page_size, TN: gl.constexpr, KB: gl.constexpr):
    """Rows of the K/V view where the KB-key boxes of sequence b's tile ``tt`` start, as a (TN // KB,)
    tensor that every thread holds whole. Boxes past the sequence's end (the page table may end before
    them) read page 0, never used."""
    layout: gl.constexpr = gl.BlockedLayout([TN // KB], [32], [gl.num_warps()], [0])
    n = tt * TN + gl.arange(0, TN // KB, layout=layout) * KB
    if KB < 64:
        # pages of 16 or 32 keys are their box (``paged_launch.box_rows``): constant shifts instead of
        # divisions by the run-time page size, whose reciprocals took registers the producer lacks
        pg = gl.load(PageTable + b.to(gl.int64) * stride_pt + n // KB, mask=n < seqlen_k, other=0)
        return gl.maximum(pg, 0) * KB
    else:
        pg = gl.load(PageTable + b.to(gl.int64) * stride_pt + n // page_size, mask=n < seqlen_k, other=0)
        return gl.maximum(pg, 0) * page_size + n % page_size

@gluon.jit
def _ws_transpose_v(v_raw, v_smem, v_raw_ready, v_ready, v_empty, g, lim, NUM_STAGES: gl.constexpr):
    """V_ROWS producer: ring tile g's V from key rows (``v_raw``, (TN, D) as K) into the sequence-major
    (D, TN) buffer that P V reads (Hopper's FP8 wgmma takes V only K-major), in chunks of 32 or more
    keys (``_transpose_layout``). Keys from ``lim`` on hold no data (NaN in a poisoned cache) and are
    written as 0: P is 0 there, but 0 * NaN is NaN."""
    TN: gl.constexpr = v_raw.shape[1]
    layout: gl.constexpr = _transpose_layout(v_raw.shape[2], gl.num_warps())
    KC: gl.constexpr = _transpose_chunk(layout)
    s = g % NUM_STAGES
    ph = (g // NUM_STAGES) & 1
    src = v_raw.index(s)
    dst = v_smem.index(s)
    mbarrier.wait(v_raw_ready.index(s), ph)
    mbarrier.wait(v_empty.index(s), ph ^ 1)  # the first NUM_STAGES waits pass on fresh barriers
    if lim >= TN:
        for c in gl.static_range(TN // KC):
            x = src.slice(c * KC, KC, dim=0).load(layout)
            dst.slice(c * KC, KC, dim=1).store(gl.permute(x, (1, 0)))
    else:
        for c in gl.static_range(TN // KC):
            x = src.slice(c * KC, KC, dim=0).load(layout)
            keys = c * KC + gl.arange(0, KC, layout=gl.SliceLayout(1, layout))
            x = gl.where(gl.expand_dims(keys < lim, 1), x, gl.zeros_like(x))
            dst.slice(c * KC, KC, dim=1).store(gl.permute(x, (1, 0)))
    fence_async_shared()  # for P V's wgmma (async proxy) and the next TMA into v_raw
    gl.thread_barrier()  # every warp's stores (and reads of v_raw) are done
    mbarrier.arrive(v_ready.index(s))

@gluon.jit
def _varlen_v_start(k_start, b):
    """Column of sequence b's first key in ``dense.varlen_v_kmajor``'s V: 16-byte aligned, as the inner
    coordinate of a swizzled TMA box must be (an unaligned one stops the kernel with an illegal
    instruction on the H200). ``16 * (k_start // 16 + b)`` grows by more than each sequence's length."""
    return 16 * (k_start // 16 + b)

@gluon.constexpr_function
def _v_rows_loader_regs(box_rows):
    """Registers of the V_ROWS kernel's 4-warp producer (see ``_bounded_fwd_tma_ws_kernel``)."""
    return 24 if box_rows >= 64 else 32


@gluon.jit(do_not_specialize=_INT_ARGS, do_not_specialize_on_alignment=_PTR_ARGS)
def _dense_fwd_tma_ws_kernel(
    q_desc, k_desc, v_desc, o_desc, ones_desc, Lse, QDs, KDs, VDs, OutScale,
    stride_lb, stride_lh, stride_lm,
    stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
    seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2,
    CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, OUT_FP8: gl.constexpr, NUM_STAGES: gl.constexpr,
    HEAD_DIM: gl.constexpr, CONSUMERS: gl.constexpr, HEAD_DIM_V: gl.constexpr,
):
    """Head dims 64, 128 and 256 (``_WS_HEAD_DIMS``), warp-specialized as in FA3, and persistent: a
    grid of one CTA per SM walks the query blocks in rounds (``_ws_round_robin``, ``_ws_block_of``); a
    grid of one CTA per block (long causal inputs) runs one each. A 1-warp TMA producer fills a
    double-buffered Q and a K/V ring shared by all of the CTA's blocks (ready / empty mbarriers, no
    CTA-wide barrier in the loop); CONSUMERS 4-warp consumers own 64 query rows each and take turns issuing
    their MMAs (S_j and P_{j-1} V_{j-1} together; at head dim 256 S_j and P V's first quarter), so one
    consumer's softmax runs while the others' MMAs use the tensor cores, and a block's epilogue overlaps
    the next block's first loads. Two consumers run at 240 registers. Three (``dense_launch.ws_config``; head
    dim 64, non-causal, 64-key tiles: 192-row blocks, the last of a sequence partly past its end and those
    rows not stored) run at ``_WS3_CONSUMER_REGS``, each softmax having two other consumers' MMAs to hide
    under. The producer runs at 24. Same softmax step, accumulation and epilogues as the other kernels (with
    two consumers the same bits, but for the LSE's row sums under KPERM, below), except that calls without an
    LSE (non-causal, or causal at head dim 64: ``_rowsum_mma``) take their row sums from the tensor
    core (``ones_desc``, a (16, keys) tile of e4m3 ones; ``consumer._ws_attend``). A 5-D ``k_desc``
    box (KPERM, ``dense_launch.kperm_on``: head dim 64, two consumers) loads each 16 keys' rows in the
    consumers' S column order, so that their P needs no cross-lane exchange to become P V's operand; fp32
    row sums (calls with an LSE) then add in another order. HEAD_DIM_V: V's and O's head dim, HEAD_DIM
    (64, 128, 256) or 128 with HEAD_DIM 192 (MLA's qk 192 / v 128: Q and K in three 64-wide boxes whose
    S MMAs chain into one accumulator, then ``_ws_attend`` as at head dim 128)."""
    gl.static_assert(CONSUMERS == 2 or (CONSUMERS == 3 and HEAD_DIM == 64 and not CAUSAL))
    gl.static_assert(HEAD_DIM_V == HEAD_DIM or (HEAD_DIM == 192 and HEAD_DIM_V == 128))
    KPERM: gl.constexpr = kperm_box_on(k_desc.block_type.shape)
    gl.static_assert(not KPERM or (HEAD_DIM == 64 and CONSUMERS == 2))
    q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, turn, k_ready, v_ready, k_empty, v_empty, _, _, ones, \
        ones_ready, _ = _ws_smem(q_desc, k_desc, v_desc, o_desc, ones_desc, NUM_STAGES, HEAD_DIM, CONSUMERS, False,
                                 False, HEAD_DIM_V)

    ring = (q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn)
    io = (o_desc, Lse, QDs, KDs, VDs, OutScale, stride_lb, stride_lh, stride_lm, stride_qds_b, stride_qds_h,
          stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h)
    # (the shared-memory ring and the output's pointers and strides travel as bundles; the constexprs and
    # the literal placeholders stay written out: a constexpr inside a tuple held in a variable loses its flag)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_ws_consumer, (0, ring, io, seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2,
                            CAUSAL, WRITE_LSE, OUT_FP8, NUM_STAGES, HEAD_DIM, Lse, Lse, Lse, 0, 0, turn, 0, False, ones,
                            ones_ready)),
            (_ws_consumer, (1, ring, io, seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2,
                            CAUSAL, WRITE_LSE, OUT_FP8, NUM_STAGES, HEAD_DIM, Lse, Lse, Lse, 0, 0, turn, 0, False, ones,
                            ones_ready)),
            (_ws_consumer, (2, ring, io, seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2,
                            CAUSAL, WRITE_LSE, OUT_FP8, NUM_STAGES, HEAD_DIM, Lse, Lse, Lse, 0, 0, turn, 0, False, ones,
                            ones_ready)),
            (_ws_loader, (q_desc, k_desc, v_desc, ring, seqlen_q, seqlen_k, nheads_q, nheads_k, batch, HEAD_DIM, CAUSAL,
                          NUM_STAGES, Lse, Lse, Lse, 0, 1, 0, None, None, False, ones_desc, ones, ones_ready,
                          WRITE_LSE, False, OUT_FP8)),
        ], [4, 4, 1], [_WS3_CONSUMER_REGS, _WS3_CONSUMER_REGS, _WS_LOADER_REGS])
    else:
        gl.warp_specialize([
            (_ws_consumer, (0, ring, io, seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2,
                            CAUSAL, WRITE_LSE, OUT_FP8, NUM_STAGES, HEAD_DIM, Lse, Lse, Lse, 0, 0, turn, 0, False, ones,
                            ones_ready, KPERM, HEAD_DIM_V)),
            (_ws_consumer, (1, ring, io, seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2,
                            CAUSAL, WRITE_LSE, OUT_FP8, NUM_STAGES, HEAD_DIM, Lse, Lse, Lse, 0, 0, turn, 0, False, ones,
                            ones_ready, KPERM, HEAD_DIM_V)),
            (_ws_loader, (q_desc, k_desc, v_desc, ring, seqlen_q, seqlen_k, nheads_q, nheads_k, batch, HEAD_DIM, CAUSAL,
                          NUM_STAGES, Lse, Lse, Lse, 0, 1, 0, None, None, False, ones_desc, ones, ones_ready,
                          WRITE_LSE, KPERM, OUT_FP8, HEAD_DIM_V)),
        ], [4, 1], [_WS_CONSUMER_REGS, _WS_LOADER_REGS])

@gluon.jit(do_not_specialize=_BOUNDED_INT_ARGS, do_not_specialize_on_alignment=_BOUNDED_PTR_ARGS)
def _bounded_fwd_tma_ws_kernel(
    q_desc, k_desc, v_desc, o_desc, ones_desc, Lse, QDs, KDs, VDs, OutScale, PageTable, SeqlensK, BlockList, Out,
    stride_lb, stride_lh, stride_lm,
    stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
    stride_pt, page_size, stride_om, stride_oh, seqlen_q, nheads_q, nheads_k, batch, softmax_scale_log2,
    CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, OUT_FP8: gl.constexpr, NUM_STAGES: gl.constexpr,
    HEAD_DIM: gl.constexpr, MODE: gl.constexpr, V_ROWS: gl.constexpr, HEAD_DIM_V: gl.constexpr,
):
    """``_dense_fwd_tma_ws_kernel`` with per-sequence bounds, MODE (``MODE_*``): a paged FP8 KV cache
    (chunked prefill; key counts from ``SeqlensK``, a tile's page from ``PageTable``, read by the
    producer), varlen queries (the blocks of ``BlockList``, each with its sequence's bounds; ``seqlen_q``
    is then the total, a sequence's last rows stored through ``Out`` with a mask) over varlen K/V or over
    a paged cache. Sequences of any length (queries are
    the last keys): the tiles that cross the diagonal or a sequence's end run masked, and the slots
    of the last V tile past the end are zeroed in shared memory before P V reads them
    (``_ws_clean_v_tail``). Head dims 64 and 128. V sequence-major within each page (pages a multiple of
    the tile, 64 or 128 keys), or (V_ROWS) in K's layout, FA3's, in pages of 16, 32 or a multiple of 64
    keys (``_tile_keys``), transposed in shared memory by a 4-warp producer (``_ws_transpose_v``; at
    32 registers for boxes under 64 keys, else 24). HEAD_DIM_V: V's and O's head dim, HEAD_DIM or, varlen
    (MODE 2) with V sequence-major, 128 with HEAD_DIM 192 (``_dense_fwd_tma_ws_kernel``'s qk 192 / v 128)."""
    gl.static_assert(HEAD_DIM != 256)
    gl.static_assert(HEAD_DIM_V == HEAD_DIM or (HEAD_DIM == 192 and HEAD_DIM_V == 128 and MODE == 2 and not V_ROWS))
    gl.static_assert(not kperm_box_on(k_desc.block_type.shape))  # (a dense-kernel box only)
    q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, turn, k_ready, v_ready, k_empty, v_empty, v_raw, \
        v_raw_ready, ones, ones_ready, v_clean = _ws_smem(q_desc, k_desc, v_desc, o_desc, ones_desc, NUM_STAGES,
                                                          HEAD_DIM, 2, True, V_ROWS, HEAD_DIM_V)
    LOADER_WARPS: gl.constexpr = 4 if V_ROWS else 1
    # A 12-warp CTA's register pool is 168 x 384 = 64512: a 24-register producer leaves both consumers
    # their 240. Boxes under 64 keys (pages of 16, 32) keep 32: their producer holds more page-table
    # rows and spilled at 24 (slower on the H200 there; pages of 64+ ran faster at 24).
    LOADER_REGS: gl.constexpr = _v_rows_loader_regs(k_desc.block_type.shape[0]) if V_ROWS else _WS_LOADER_REGS

    ring = (q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn)
    io = (o_desc, Lse, QDs, KDs, VDs, OutScale, stride_lb, stride_lh, stride_lm, stride_qds_b, stride_qds_h,
          stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h)
    gl.warp_specialize([
        (_ws_consumer, (0, ring, io, seqlen_q, 0, nheads_q, nheads_k, batch, softmax_scale_log2, CAUSAL, WRITE_LSE,
                        OUT_FP8, NUM_STAGES, HEAD_DIM, SeqlensK, BlockList, Out, stride_om, stride_oh,
                        v_clean, MODE, V_ROWS, ones, ones_ready, False, HEAD_DIM_V)),
        (_ws_consumer, (1, ring, io, seqlen_q, 0, nheads_q, nheads_k, batch, softmax_scale_log2, CAUSAL, WRITE_LSE,
                        OUT_FP8, NUM_STAGES, HEAD_DIM, SeqlensK, BlockList, Out, stride_om, stride_oh,
                        v_clean, MODE, V_ROWS, ones, ones_ready, False, HEAD_DIM_V)),
        (_ws_loader, (q_desc, k_desc, v_desc, ring, seqlen_q, 0, nheads_q, nheads_k, batch, HEAD_DIM, CAUSAL,
                      NUM_STAGES, PageTable, SeqlensK, BlockList, stride_pt, page_size, MODE, v_raw, v_raw_ready,
                      V_ROWS, ones_desc, ones, ones_ready, WRITE_LSE, False, OUT_FP8, HEAD_DIM_V)),
    ], [4, LOADER_WARPS], [_WS_CONSUMER_REGS, LOADER_REGS])
