"""Dense FP8 attention forward for Hopper with TMA loads and asynchronous wgmma (Gluon).

The fast path of ``dense.launch_dense_fwd`` for the common prefill case: e4m3 Q/K/V, head dim 64,
128 or 256 (the same for q/k and v), sequence lengths that are multiples of 128, per-(batch, kv head)
descales, optional bottom-right causal mask and LSE; bf16 output, or e4m3 output with the fused
static per-tensor scale ``out_scale``. Everything else stays on the Triton kernel (``supported``).
Three kernels share one softmax step (``_softmax_tile_f32``), one finalization and one output
epilogue; head dim, output dtype (``OUT_FP8``), causal and LSE are compile-time constants:

* ``_dense_fwd_tma_ws_kernel`` (every head dim), warp-specialized like FA3: a 1-warp TMA producer
  fills a double-buffered Q and a K/V ring guarded by ready/empty mbarriers, and two 4-warp consumers
  (64 query rows each, 240 registers) take turns issuing their MMAs -- S_j = Q K_j^T together with
  P_{j-1} V_{j-1} -- so one consumer's softmax overlaps the other's tensor-core work ("ping-pong").
  Persistent: one CTA per SM walks the query blocks in rounds, and a block's epilogue overlaps the
  next block's loads (causal inputs longer than 8k run one block per CTA). Head dim 256 splits the
  operands as the d256 kernel below (``_ws_attend_d256``).
* ``_bounded_fwd_tma_ws_kernel``: the warp-specialized kernel's partitions with per-sequence bounds
  (``MODE``): over a paged FP8 KV cache (chunked prefill, ``paged_tma``: the producer reads each
  tile's page from the page table), with varlen queries and keys (``cu_seqlens``), or varlen queries
  over a paged cache (mixed batches); lengths come from the device, varlen query blocks from a list
  built on the device (``varlen_block_list``), and the tiles at the diagonal or a sequence's end run
  masked (head dims 64, 128).
* ``_dense_fwd_tma_kernel``: the same math in 8 warps (2 warpgroups of 64 rows in lockstep); in the
  loop over KV tiles ``S_{j+1}`` is issued asynchronously before the softmax of tile ``j``, then
  ``P_j V_j``, the accumulator is rescaled while it runs, and one wait retires both MMAs. Runs head
  dim 64 causal inputs longer than 8k (``_use_ws``); the tests hold the warp-specialized kernel to
  its bits.
* ``_dense_fwd_tma_d256_kernel``: head dim 256 in 8 warps, operands in 128/64-wide pieces of the head
  dim, 64-key tiles, no next-tile QK^T under the softmax. Not dispatched since the warp-specialized
  kernel took head dim 256 (+1-22% on the H200, the same bits); kept as the independent schedule the
  tests compare that kernel's bits with.

Except in the persistent kernel, one CTA covers one 128-row query block of one (batch, q head); K/V
tiles stream through a ``NUM_STAGES``-deep ring of shared-memory buffers filled by TMA.

Operands as 2-D TMA views (no copies), D the head dim:

* q, out: (batch * seqlen_q, nheads_q * D); tile [b * seqlen_q + m0, h * D]
* k:      (batch * seqlen_k, nheads_k * D); tile [b * seqlen_k + n0, hk * D]
* v:      sequence-contiguous (``dense.transpose_v_kmajor``), (batch * nheads_k * D, seqlen_k);
  tile [(b * nheads_k + hk) * D, n0] -- the K-major B operand FP8 wgmma needs for P @ V.

Because seqlen_q and seqlen_k are multiples of 128, no tile crosses into the next sequence's rows.

Numerics match the Triton kernel (``common``): base-2 online softmax with
``q_descale * k_descale * softmax_scale * log2(e)`` folded into the logit scale, P computed as
``exp2(s - m + 8)`` (in [0, 256]) and cast to e4m3, the row sum taken over the fp32 P, each tile's
P @ V started from a zero accumulator and added to the fp32 accumulator (two-level accumulation),
``v_descale`` folded into the final 1 / rowsum. The FP8 output is ``common.output_epilogue``'s
``clamp(o * (1 / out_scale), -448, 448)`` cast to e4m3fn, with ``out_scale`` loaded in the kernel.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # triton without Gluon: the fast path is simply unavailable
    HAS_GLUON = False

from ..launch_rules import tma_options_reason, window_flags
from .common import fill_varlen_block_list

__all__ = ["supported", "unsupported_reason", "launch_dense_fwd_tma", "HAS_GLUON"]

HEAD_DIMS = (64, 128, 256)
BLOCK_M = 128
BLOCK_N = 128
NUM_STAGES = 2
NUM_WARPS = 8
_LOG2E = 1.4426950408889634
_PTR_ARGS = ("Lse", "QDs", "KDs", "VDs", "OutScale")
_INT_ARGS = ("stride_lb", "stride_lh", "stride_lm", "stride_qds_b", "stride_qds_h", "stride_kds_b",
             "stride_kds_h", "stride_vds_b", "stride_vds_h", "seqlen_q", "seqlen_k", "nheads_q", "nheads_k",
             "batch")
_BOUNDED_PTR_ARGS = _PTR_ARGS + ("PageTable", "SeqlensK", "BlockList", "Out")
_BOUNDED_INT_ARGS = tuple(a for a in _INT_ARGS if a != "seqlen_k") + ("stride_pt", "page_size", "stride_om",
                                                                      "stride_oh")
# Where the warp-specialized kernel's sequences come from (its MODE): fixed lengths (dense); a paged cache
# (key counts per sequence, fixed query count); varlen queries and keys (cu_seqlens_q / cu_seqlens_k);
# varlen queries over a paged cache. Bit 0: keys from pages; bit 1: varlen queries (a block list).
MODE_DENSE, MODE_PAGED, MODE_VARLEN, MODE_PAGED_VARLEN = 0, 1, 2, 3


# A varlen block list entry: (sequence, query block, first query row, query count, first key row, key count),
# padded to 8 int32 (one 32-byte sector); the header (the block count) takes the first 8 slots.
ENTRY = 8


@triton.jit
def _block_list_kernel(CuQ, KSrc, Blocks, batch, min_len_q, BM: tl.constexpr, BLOCK_B: tl.constexpr,
                       KEYS_CU: tl.constexpr, ENTRY: tl.constexpr):
    """``varlen_block_list`` in one program (``common.fill_varlen_block_list``; a mixed paged batch builds
    the list inside one of its Triton launches instead)."""
    fill_varlen_block_list(CuQ, KSrc, Blocks, batch, min_len_q, BM, BLOCK_B, KEYS_CU, ENTRY)


if HAS_GLUON:
    # Globals read inside Gluon code must be constexpr.
    _ENTRY_G = gl.constexpr(ENTRY)
    _P_OFFSET = gl.constexpr(8.0)  # P = exp2(s - m + 8) lands in [0, 256] < 448 (e4m3 max)
    _LN2 = gl.constexpr(0.6931471805599453)
    _E4M3_MAX = gl.constexpr(448.0)

    @gluon.jit
    def _softmax_tile_f32(s, m_i, l_i, qk_scale, m0, n0, shift, row_o: gl.constexpr, MASKED: gl.constexpr,
                          n_lim=0, KEY_LIMIT: gl.constexpr = False):
        """One online-softmax step on a raw fp32 S tile (wgmma accumulator layout).

        MASKED applies the bottom-right causal mask (key n visible to query m iff
        n <= m + shift) as -inf on the raw logits; only the diagonal tile needs it. KEY_LIMIT (paged
        caches) also hides keys n >= n_lim, the slots past the sequence's end, whatever they hold.
        Returns P in fp32 (S's layout; ``_p_operand`` makes the e4m3 A operand of P V), alpha in
        the O row layout, new m and l.
        """
        s_layout: gl.constexpr = s.type.layout
        if MASKED:
            offs_m = m0 + gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s_layout))
            offs_n = n0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout))
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
        l_new = l_i * alpha + gl.sum(p, axis=1)  # fp32 sum before the cast; 2^8 cancels in acc / l
        return p, gl.convert_layout(alpha, row_o), m_new, l_new

    @gluon.jit
    def _p_operand(p, p_layout: gl.constexpr):
        """fp32 P in [0, 256] -> the e4m3 register A operand of P V."""
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

    # Integers and pointers are not specialized (values, divisibility, alignment): the compiled kernel
    # depends only on the constexprs and the descriptors' block types, which lets ``_launch`` reuse it.
    @gluon.jit(do_not_specialize=_INT_ARGS, do_not_specialize_on_alignment=_PTR_ARGS)
    def _dense_fwd_tma_kernel(
        q_desc, k_desc, v_desc, o_desc, Lse, QDs, KDs, VDs, OutScale,
        stride_lb, stride_lh, stride_lm,
        stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
        seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2,
        CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, OUT_FP8: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):
        BM: gl.constexpr = q_desc.block_type.shape[0]
        D: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        NW: gl.constexpr = gl.num_warps()
        gl.static_assert(NW == 8)
        gl.static_assert(BM == 128)
        gl.static_assert((D == 64) or (D == 128))
        gl.static_assert(k_desc.block_type.shape[1] == D)
        gl.static_assert(v_desc.block_type.shape[0] == D)
        gl.static_assert(o_desc.block_type.shape[1] == D)
        out_inv = _out_scale_inv(OutScale, OUT_FP8)  # before the main loop
        # BN == BM and 128-aligned lengths: a causal query block has exactly one masked (diagonal)
        # KV tile, the last one.
        gl.static_assert(BN == BM)

        b, h, hk, m0, shift, n_tiles, qk_scale, v_descale = _query_block_setup(
            QDs, KDs, VDs, stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
            seqlen_q, seqlen_k, nheads_q, nheads_k, softmax_scale_log2, BM, BN, CAUSAL)
        q_row = b * seqlen_q + m0
        kv_row = b * seqlen_k
        vt_row = (b * nheads_k + hk) * D
        q_col = h * D
        k_col = hk * D

        # 8 warps stacked along M: each warpgroup owns 64 rows, row reductions stay in a quad.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, BN, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, D, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [BM, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, D, BN], v_desc.layout)
        q_bar, k_bars, v_bars = _init_barriers(NUM_STAGES)

        # Prologue: Q and the first NUM_STAGES K/V tiles. All expects first, then one barrier,
        # then the copies (one membar barrier instead of one per copy).
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.expect(k_bars.index(i), k_desc.block_type.nbytes, pred=i < n_tiles)
            mbarrier.expect(v_bars.index(i), v_desc.block_type.nbytes, pred=i < n_tiles)
        gl.thread_barrier()
        tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem)
        for i in gl.static_range(NUM_STAGES):
            tma.async_copy_global_to_shared(k_desc, [kv_row + i * BN, k_col], k_bars.index(i),
                                            k_smem.index(i), pred=i < n_tiles)
            tma.async_copy_global_to_shared(v_desc, [vt_row, i * BN], v_bars.index(i),
                                            v_smem.index(i), pred=i < n_tiles)

        zero_s = gl.zeros([BM, BN], gl.float32, s_layout)
        zero_o = gl.zeros([BM, D], gl.float32, o_layout)
        m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([BM], gl.float32, row_s)
        acc = gl.zeros([BM, D], gl.float32, o_layout)

        # S_0 = Q K_0^T, then refill K stage 0 (both warpgroups retired it: barrier first)
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_bars.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
        gl.thread_barrier()
        mbarrier.expect(k_bars.index(0), k_desc.block_type.nbytes, pred=NUM_STAGES < n_tiles)
        tma.async_copy_global_to_shared(k_desc, [kv_row + NUM_STAGES * BN, k_col], k_bars.index(0),
                                        k_smem.index(0), pred=NUM_STAGES < n_tiles)

        # Fully visible tiles 0 .. n_tiles - 2: QK_{j+1} runs under softmax_j.
        for j in range(n_tiles - 1):
            kn = (j + 1) % NUM_STAGES
            mbarrier.wait(k_bars.index(kn), ((j + 1) // NUM_STAGES) & 1)
            sn_tok = warpgroup_mma(q_smem, k_smem.index(kn).permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
            p8, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, qk_scale, m0, j * BN, shift,
                                                p_layout, row_o, False)
            vs = j % NUM_STAGES
            mbarrier.wait(v_bars.index(vs), (j // NUM_STAGES) & 1)
            # fresh accumulator per tile, added in fp32 below (two-level accumulation)
            pv_tok = warpgroup_mma(p8, v_smem.index(vs).permute((1, 0)), zero_o, use_acc=False, is_async=True)
            acc = acc * gl.expand_dims(alpha, 1)
            s, pv = warpgroup_mma_wait(num_outstanding=0, deps=[sn_tok, pv_tok])
            acc = acc + pv
            tk = j + 1 + NUM_STAGES
            tv = j + NUM_STAGES
            _refill(k_desc, kv_row + tk * BN, k_col, k_bars.index(kn), k_smem.index(kn), tk < n_tiles,
                    v_desc, vt_row, tv * BN, v_bars.index(vs), v_smem.index(vs), tv < n_tiles)

        # Last tile: the diagonal one when causal (the only tile that needs the mask).
        jl = n_tiles - 1
        p8, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, qk_scale, m0, jl * BN, shift,
                                            p_layout, row_o, CAUSAL)
        vs = jl % NUM_STAGES
        mbarrier.wait(v_bars.index(vs), (jl // NUM_STAGES) & 1)
        pv_tok = warpgroup_mma(p8, v_smem.index(vs).permute((1, 0)), zero_o, use_acc=False, is_async=True)
        acc = acc * gl.expand_dims(alpha, 1)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
        acc = acc + pv

        _invalidate_barriers(q_bar, k_bars, v_bars, NUM_STAGES)

        # Epilogue: normalize (v_descale folded), bf16 or scaled e4m3 via shared memory and a TMA store.
        out, lse = _finalize_rows(acc, gl.convert_layout(m_i, row_o), gl.convert_layout(l_i, row_o), v_descale)
        if WRITE_LSE:
            _store_lse(lse, Lse, b, h, m0, stride_lb, stride_lh, stride_lm, row_o)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, o_desc.block_type.shape, o_desc.layout)
        _store_rows(out, o_smem, o_desc, q_row, q_col, out_inv, OUT_FP8)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _pv_quarter(acc, p8, v_buf, alpha, o_layout: gl.constexpr):
        """acc * alpha + P @ V_quarter, the product from a zero accumulator (two-level accumulation)."""
        zero_o = gl.zeros(acc.shape, gl.float32, o_layout)
        pv_tok = warpgroup_mma(p8, v_buf.permute((1, 0)), zero_o, use_acc=False, is_async=True)
        acc = acc * gl.expand_dims(alpha, 1)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
        return acc + pv

    @gluon.jit
    def _tile_step_d256(j, m_i, l_i, acc0, acc1, acc2, acc3, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc,
                        v_desc, kv_row, k_col, vt_row, n_tiles, qk_scale, m0, shift, s_layout: gl.constexpr,
                        o_layout: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr,
                        NUM_STAGES: gl.constexpr, MASKED: gl.constexpr):
        """One KV tile of the head-dim-256 kernel. Q and K come in two 128-wide halves of the head dim:
        S = Q_0 K_0^T + Q_1 K_1^T (one fp32 accumulator over the 256-long dot). V and O come in four
        64-wide quarters: each P V_q starts from a zero accumulator and is added to its fp32 quarter
        of O (two-level accumulation), so only one 64-wide product is live next to O's 128 registers
        per thread. The stage's K and V buffers are refilled once both warpgroups retired them."""
        BN: gl.constexpr = k_desc.block_type.shape[0]
        DH: gl.constexpr = k_desc.block_type.shape[1]
        DQ: gl.constexpr = v_desc.block_type.shape[0]
        BM: gl.constexpr = q_smem.shape[1]
        st = j % NUM_STAGES
        ph = (j // NUM_STAGES) & 1
        mbarrier.wait(k_bars.index(st), ph)
        zero_s = gl.zeros([BM, BN], gl.float32, s_layout)
        s_tok = warpgroup_mma(q_smem.index(0), k_smem.index(2 * st).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        s_tok = warpgroup_mma(q_smem.index(1), k_smem.index(2 * st + 1).permute((1, 0)), s_tok, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
        p8, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, qk_scale, m0, j * BN, shift, p_layout, row_o, MASKED)
        mbarrier.wait(v_bars.index(st), ph)
        acc0 = _pv_quarter(acc0, p8, v_smem.index(4 * st), alpha, o_layout)
        acc1 = _pv_quarter(acc1, p8, v_smem.index(4 * st + 1), alpha, o_layout)
        acc2 = _pv_quarter(acc2, p8, v_smem.index(4 * st + 2), alpha, o_layout)
        acc3 = _pv_quarter(acc3, p8, v_smem.index(4 * st + 3), alpha, o_layout)
        # refill this stage with tile j + NUM_STAGES
        t = j + NUM_STAGES
        pred = t < n_tiles
        mbarrier.expect(k_bars.index(st), 2 * k_desc.block_type.nbytes, pred=pred)
        mbarrier.expect(v_bars.index(st), 4 * v_desc.block_type.nbytes, pred=pred)
        gl.thread_barrier()
        for hh in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [kv_row + t * BN, k_col + hh * DH], k_bars.index(st),
                                            k_smem.index(2 * st + hh), pred=pred)
        for qq in gl.static_range(4):
            tma.async_copy_global_to_shared(v_desc, [vt_row + qq * DQ, t * BN], v_bars.index(st),
                                            v_smem.index(4 * st + qq), pred=pred)
        return m_i, l_i, acc0, acc1, acc2, acc3

    # Integers and pointers are not specialized (values, divisibility, alignment): the compiled kernel
    # depends only on the constexprs and the descriptors' block types, which lets ``_launch`` reuse it.
    @gluon.jit(do_not_specialize=_INT_ARGS, do_not_specialize_on_alignment=_PTR_ARGS)
    def _dense_fwd_tma_d256_kernel(
        q_desc, k_desc, v_desc, o_desc, Lse, QDs, KDs, VDs, OutScale,
        stride_lb, stride_lh, stride_lm,
        stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
        seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2,
        CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, OUT_FP8: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):
        """Head dim 256: the numerics of ``_dense_fwd_tma_kernel`` with Q/K in two 128-wide halves of
        the head dim, V/O in four 64-wide quarters (``_tile_step_d256``) and 64-key tiles, so that O's
        fp32 accumulator (128 registers per thread), one quarter's P V product and the S tile fit the
        register file. No QK^T of the next tile runs under the softmax (its S would not fit)."""
        BM: gl.constexpr = q_desc.block_type.shape[0]
        DH: gl.constexpr = q_desc.block_type.shape[1]
        BN: gl.constexpr = k_desc.block_type.shape[0]
        DQ: gl.constexpr = v_desc.block_type.shape[0]
        NW: gl.constexpr = gl.num_warps()
        gl.static_assert(NW == 8)
        gl.static_assert(DH == 128)
        gl.static_assert(DQ == 64)
        gl.static_assert(o_desc.block_type.shape[1] == DQ)
        gl.static_assert(BM % BN == 0)
        out_inv = _out_scale_inv(OutScale, OUT_FP8)  # before the main loop

        b, h, hk, m0, shift, n_tiles, qk_scale, v_descale = _query_block_setup(
            QDs, KDs, VDs, stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
            seqlen_q, seqlen_k, nheads_q, nheads_k, softmax_scale_log2, BM, BN, CAUSAL)
        q_row = b * seqlen_q + m0
        kv_row = b * seqlen_k
        vt_row = (b * nheads_k + hk) * (4 * DQ)
        q_col = h * (2 * DH)
        k_col = hk * (2 * DH)

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, BN, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                           instr_shape=[16, DQ, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BM, DH], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2 * NUM_STAGES, BN, DH], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [4 * NUM_STAGES, DQ, BN], v_desc.layout)
        q_bar, k_bars, v_bars = _init_barriers(NUM_STAGES)

        # Prologue: Q and the first NUM_STAGES K/V tiles, in pieces.
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.expect(k_bars.index(i), 2 * k_desc.block_type.nbytes, pred=i < n_tiles)
            mbarrier.expect(v_bars.index(i), 4 * v_desc.block_type.nbytes, pred=i < n_tiles)
        gl.thread_barrier()
        for hh in gl.static_range(2):
            tma.async_copy_global_to_shared(q_desc, [q_row, q_col + hh * DH], q_bar, q_smem.index(hh))
        for i in gl.static_range(NUM_STAGES):
            for hh in gl.static_range(2):
                tma.async_copy_global_to_shared(k_desc, [kv_row + i * BN, k_col + hh * DH], k_bars.index(i),
                                                k_smem.index(2 * i + hh), pred=i < n_tiles)
            for qq in gl.static_range(4):
                tma.async_copy_global_to_shared(v_desc, [vt_row + qq * DQ, i * BN], v_bars.index(i),
                                                v_smem.index(4 * i + qq), pred=i < n_tiles)

        m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([BM], gl.float32, row_s)
        acc0 = gl.zeros([BM, DQ], gl.float32, o_layout)
        acc1 = gl.zeros([BM, DQ], gl.float32, o_layout)
        acc2 = gl.zeros([BM, DQ], gl.float32, o_layout)
        acc3 = gl.zeros([BM, DQ], gl.float32, o_layout)
        mbarrier.wait(q_bar, 0)

        # One loop body: causal runs the mask on every tile (a no-op before the diagonal's BM // BN tiles);
        # a second, masked copy of the loop for those tiles pushed the register count into spills.
        for j in range(n_tiles):
            m_i, l_i, acc0, acc1, acc2, acc3 = _tile_step_d256(
                j, m_i, l_i, acc0, acc1, acc2, acc3, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc,
                kv_row, k_col, vt_row, n_tiles, qk_scale, m0, shift, s_layout, o_layout, p_layout, row_o,
                NUM_STAGES, CAUSAL)

        _invalidate_barriers(q_bar, k_bars, v_bars, NUM_STAGES)

        # Epilogue: each quarter normalized (v_descale folded), cast, staged in shared memory and stored by TMA.
        m_o = gl.convert_layout(m_i, row_o)
        l_o = gl.convert_layout(l_i, row_o)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [4, BM, DQ], o_desc.layout)
        out, lse = _finalize_rows(acc0, m_o, l_o, v_descale)
        o_smem.index(0).store(_output_epilogue(out, out_inv, OUT_FP8))
        out = _normalize_rows(acc1, l_o, v_descale)
        o_smem.index(1).store(_output_epilogue(out, out_inv, OUT_FP8))
        out = _normalize_rows(acc2, l_o, v_descale)
        o_smem.index(2).store(_output_epilogue(out, out_inv, OUT_FP8))
        out = _normalize_rows(acc3, l_o, v_descale)
        o_smem.index(3).store(_output_epilogue(out, out_inv, OUT_FP8))
        if WRITE_LSE:
            _store_lse(lse, Lse, b, h, m0, stride_lb, stride_lh, stride_lm, row_o)
        fence_async_shared()
        for qq in gl.static_range(4):
            tma.async_copy_shared_to_global(o_desc, [q_row, h * (4 * DQ) + qq * DQ], o_smem.index(qq))
        tma.store_wait(pendings=0)

    # -----------------------------------------------------------------------------------------
    # Warp-specialized ping-pong, persistent (``_dense_fwd_tma_ws_kernel``), every head dim
    # -----------------------------------------------------------------------------------------
    _WS_CONSUMER_REGS = gl.constexpr(240)  # 2 x 128 threads x 240 + 32 x 24 <= 64K registers per SM
    _WS_LOADER_REGS = gl.constexpr(24)

    @gluon.jit
    def _ws_turn_wait(turn, WG: gl.constexpr, k):
        """Wait for this consumer's k-th turn to issue MMAs. Consumer 0 goes first (its wait on the
        fresh barrier's parity 1 passes); consumer 1's k-th turn is consumer 0's k-th pass."""
        mbarrier.wait(turn.index(WG), (k + 1 - WG) & 1)

    @gluon.jit
    def _ws_turn_pass(turn, WG: gl.constexpr):
        mbarrier.arrive(turn.index(1 - WG))

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
                      KEY_LIMIT: gl.constexpr = False):
        """KV tile j >= 1 of one consumer's query block (``g``: the same tile's index in this CTA's K/V
        ring, ``k``: this consumer's turn count): in its turn, issue S_j = Q K_j^T and P_{j-1} V_{j-1}
        (fresh accumulator), pass the turn, then softmax_j while P_{j-1} V_{j-1} runs, then add it to acc.
        ``n_lim`` / KEY_LIMIT: as ``_softmax_tile_f32``."""
        TN: gl.constexpr = k_smem.shape[1]
        p8 = _p_operand(p, p_layout)
        ks = g % NUM_STAGES
        vp = (g - 1) % NUM_STAGES
        _ws_turn_wait(turn, WG, k)
        mbarrier.wait(k_ready.index(ks), (g // NUM_STAGES) & 1)
        s_tok = _ws_qk(q_smem, qi, k_smem, ks, zero_s, 1)
        mbarrier.wait(v_ready.index(vp), ((g - 1) // NUM_STAGES) & 1)
        pv_tok = warpgroup_mma(p8, v_smem.index(vp).permute((1, 0)), zero_o, use_acc=False, is_async=True)
        _ws_turn_pass(turn, WG)
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
        mbarrier.arrive(k_empty.index(ks))
        p, alpha, m_i, l_i = _softmax_tile_f32(s, m_i, l_i, qk_scale, mw, j * TN, shift, row_o, MASKED, n_lim,
                                               KEY_LIMIT)
        acc = acc * gl.expand_dims(alpha_prev, 1)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
        mbarrier.arrive(v_empty.index(vp))
        return p, alpha, m_i, l_i, acc + pv

    @gluon.jit
    def _ws_block_begin(t, n_blocks, it, WG: gl.constexpr, QDs, KDs, VDs, stride_qds_b, stride_qds_h, stride_kds_b,
                        stride_kds_h, stride_vds_b, stride_vds_h, seqlen_q, seqlen_k, nheads_q, nheads_k, batch,
                        softmax_scale_log2, MH: gl.constexpr, TN: gl.constexpr, CAUSAL: gl.constexpr, SeqlensK,
                        BlockList, MODE: gl.constexpr):
        """A consumer's view of block t: ``(b, h, mw, shift, n_tiles, qk_scale, v_descale, qb, seqlen_k,
        q_row, len_q)``, ``mw`` its first query row, ``qb`` the Q buffer (the block's parity in this CTA's
        order ``it``), the rest as ``_ws_block``. Per-sequence bounds (MODE != dense), non-causal: ``shift =
        seqlen_k``, which leaves only the key limit in the masked tiles' bound ``n <= min(m + shift,
        seqlen_k - 1)``."""
        b, h, hk, m0, shift, n_tiles, seqlen_k, q_row, k_row, len_q = _ws_block(
            t, n_blocks, seqlen_q, seqlen_k, batch, nheads_q, nheads_k, 2 * MH, TN, CAUSAL, SeqlensK, BlockList, MODE)
        if MODE != 0:
            if not CAUSAL:
                shift = seqlen_k
        qk_scale, v_descale = _block_scales(b, hk, QDs, KDs, VDs, stride_qds_b, stride_qds_h, stride_kds_b,
                                            stride_kds_h, stride_vds_b, stride_vds_h, softmax_scale_log2)
        return b, h, m0 + WG * MH, shift, n_tiles, qk_scale, v_descale, it % 2, seqlen_k, q_row, len_q

    @gluon.jit
    def _ws_first_tile(q_smem, qi, k_smem, q_ready, k_ready, k_empty, turn, WG: gl.constexpr, g0, k0, it, zero_s,
                       qk_scale, mw, shift, row_o: gl.constexpr, NQK: gl.constexpr, NUM_STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr, n_lim=0, KEY_LIMIT: gl.constexpr = False):
        """KV tile 0 of a block: S_0 in this consumer's turn, then its softmax (masked under CAUSAL, where
        tile 0 may be on the diagonal, or KEY_LIMIT). Returns ``(p, alpha, m_i, l_i)`` as
        ``_softmax_tile_f32``."""
        m_i = gl.full([zero_s.shape[0]], float("-inf"), gl.float32, gl.SliceLayout(1, zero_s.type.layout))
        l_i = gl.zeros([zero_s.shape[0]], gl.float32, gl.SliceLayout(1, zero_s.type.layout))
        mbarrier.wait(q_ready.index(qi // NQK), (it // 2) & 1)
        ks0 = g0 % NUM_STAGES
        _ws_turn_wait(turn, WG, k0)
        mbarrier.wait(k_ready.index(ks0), (g0 // NUM_STAGES) & 1)
        s_tok = _ws_qk(q_smem, qi, k_smem, ks0, zero_s, NQK)
        _ws_turn_pass(turn, WG)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(ks0))
        return _softmax_tile_f32(s, m_i, l_i, qk_scale, mw, 0, shift, row_o, CAUSAL or KEY_LIMIT, n_lim, KEY_LIMIT)

    @gluon.constexpr_function
    def _ws_mma_layouts(NW, TN, DO):
        """``(s_layout, o_layout, p_layout)`` of a consumer warpgroup: the wgmma accumulator layouts of S
        (TN keys wide) and of one O part (DO wide), and P's e4m3 register operand of P V."""
        s_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, TN, 32])
        o_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, DO, 32])
        return s_layout, o_layout, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)

    @gluon.jit
    def _ws_consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready,
                     k_empty, v_empty, turn, o_desc, Lse, QDs, KDs, VDs, OutScale, stride_lb, stride_lh, stride_lm,
                     stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
                     seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2, CAUSAL: gl.constexpr,
                     WRITE_LSE: gl.constexpr, OUT_FP8: gl.constexpr, NUM_STAGES: gl.constexpr,
                     HEAD_DIM: gl.constexpr, SeqlensK, BlockList, Out, stride_om, stride_oh, v_clean,
                     MODE: gl.constexpr, V_ROWS: gl.constexpr = False):
        """Consumer WG (4 warps): rows 64 WG .. 64 WG + 63 of each of this CTA's query blocks, walked in the
        producer's order; each block runs ``_ws_attend`` (head dims 64, 128) or ``_ws_attend_d256``.
        MODE != dense (head dims 64, 128): per-sequence bounds (``_ws_block``), the V tail barrier
        ``v_clean`` (``_ws_clean_v_tail``); varlen rows are stored through ``Out`` (row stride
        ``stride_om``, head stride ``stride_oh``) with a row mask."""
        gl.static_assert(gl.num_warps() == 4)
        MH: gl.constexpr = q_smem.shape[1]
        TN: gl.constexpr = k_smem.shape[1]
        DO: gl.constexpr = v_smem.shape[1]  # head-dim width of one O part (the whole head below 256)
        s_layout: gl.constexpr = _ws_mma_layouts(4, TN, DO)[0]
        o_layout: gl.constexpr = _ws_mma_layouts(4, TN, DO)[1]
        p_layout: gl.constexpr = _ws_mma_layouts(4, TN, DO)[2]
        zero_s = gl.zeros([MH, TN], gl.float32, s_layout)
        zero_o = gl.zeros([MH, DO], gl.float32, o_layout)

        g0 = 0  # K/V tiles consumed by this CTA before the current query block (ring position)
        k0 = 0  # this consumer's turns before the current query block
        it = 0  # query blocks done by this CTA (Q double buffer)
        nc = 0  # per-sequence bounds: blocks whose last V tile was cleaned (``v_clean``'s phase)
        n_blocks = _ws_num_blocks(seqlen_q, batch, nheads_q, 2 * MH, BlockList, MODE)
        out_inv = _out_scale_inv(OutScale, OUT_FP8)
        for r in range(0, gl.cdiv(n_blocks, gl.num_programs(0))):
            t = _ws_round_robin(r)
            if t < n_blocks:
                b, h, mw, shift, n_tiles, qk_scale, v_descale, qb, sk, q_row, len_q = _ws_block_begin(
                    t, n_blocks, it, WG, QDs, KDs, VDs, stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h,
                    stride_vds_b, stride_vds_h, seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2, MH,
                    TN, CAUSAL, SeqlensK, BlockList, MODE)
                if HEAD_DIM == 256:
                    _ws_attend_d256(WG, 2 * qb + WG, g0, k0, it, b, h, mw, shift, n_tiles, qk_scale, v_descale, q_smem,
                                    k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
                                    o_desc, Lse, out_inv, stride_lb, stride_lh, stride_lm, seqlen_q, zero_s, zero_o,
                                    o_layout, p_layout, CAUSAL, WRITE_LSE, OUT_FP8, NUM_STAGES)
                else:
                    _ws_attend(WG, 2 * qb + WG, g0, k0, it, b, h, mw, shift, n_tiles, qk_scale, v_descale, q_smem,
                               k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
                               o_desc, Lse, out_inv, stride_lb, stride_lh, stride_lm, seqlen_q, zero_s, zero_o,
                               o_layout, p_layout, CAUSAL, WRITE_LSE, OUT_FP8, NUM_STAGES, sk, v_clean, nc & 1, q_row,
                               len_q, Out, stride_om, stride_oh, MODE, V_ROWS)
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
                   stride_om=0, stride_oh=0, MODE: gl.constexpr = 0, V_ROWS: gl.constexpr = False):
        """One consumer's 64 rows of one query block, head dims 64 and 128: Q in buffer ``qi``, KV tiles
        from ring position ``g0``, turns from ``k0``; normalized rows stored by TMA, LSE by plain stores.
        Per-sequence bounds (MODE != dense): ``seqlen_k`` keys of any count; tiles that every row of this
        consumer sees whole run unmasked, the others (tile 0, the diagonal, the sequence's end) masked,
        and the last V tile is cleaned past the end (``_ws_clean_v_tail``, phase ``clean_phase``). Varlen:
        the sequence's ``len_q`` queries start at row ``q_row``; rows past them are not stored."""
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        TN: gl.constexpr = k_smem.shape[1]
        acc = gl.zeros(zero_o.shape, gl.float32, o_layout)
        p, alpha, m_i, l_i = _ws_first_tile(q_smem, qi, k_smem, q_ready, k_ready, k_empty, turn, WG, g0, k0, it,
                                            zero_s, qk_scale, mw, shift, row_o, 1, NUM_STAGES, CAUSAL, seqlen_k,
                                            MODE != 0)

        if MODE != 0:
            n_plain = gl.minimum(gl.maximum(gl.minimum(mw + shift + 1, seqlen_k) // TN, 1), n_tiles)
            for j in range(1, n_plain):
                p, alpha, m_i, l_i, acc = _ws_tile_step(
                    j, g0 + j, k0 + j, p, alpha, m_i, l_i, acc, q_smem, qi, k_smem, v_smem, k_ready, v_ready,
                    k_empty, v_empty, turn, WG, zero_s, zero_o, qk_scale, mw, shift, p_layout, row_o, NUM_STAGES,
                    False)
            for j in range(n_plain, n_tiles):
                p, alpha, m_i, l_i, acc = _ws_tile_step(
                    j, g0 + j, k0 + j, p, alpha, m_i, l_i, acc, q_smem, qi, k_smem, v_smem, k_ready, v_ready,
                    k_empty, v_empty, turn, WG, zero_s, zero_o, qk_scale, mw, shift, p_layout, row_o, NUM_STAGES,
                    True, seqlen_k, True)
        else:
            # fully visible tiles; with CAUSAL the last tile is the diagonal one, masked
            n_plain = n_tiles - 1 if CAUSAL else n_tiles
            for j in range(1, n_plain):
                p, alpha, m_i, l_i, acc = _ws_tile_step(
                    j, g0 + j, k0 + j, p, alpha, m_i, l_i, acc, q_smem, qi, k_smem, v_smem, k_ready, v_ready,
                    k_empty, v_empty, turn, WG, zero_s, zero_o, qk_scale, mw, shift, p_layout, row_o, NUM_STAGES,
                    False)
            if CAUSAL:
                if n_tiles > 1:
                    jm = n_tiles - 1
                    p, alpha, m_i, l_i, acc = _ws_tile_step(
                        jm, g0 + jm, k0 + jm, p, alpha, m_i, l_i, acc, q_smem, qi, k_smem, v_smem, k_ready, v_ready,
                        k_empty, v_empty, turn, WG, zero_s, zero_o, qk_scale, mw, shift, p_layout, row_o,
                        NUM_STAGES, True)

        # The row max and sum are final: the LSE is stored before the last tile's P V, where the output
        # accumulator and that product peak the registers (stored after it, m_i lived through the peak
        # and the row sum spilled once per KV tile in the V_ROWS kernel).
        if WRITE_LSE:
            lse = _row_lse(gl.convert_layout(m_i, row_o), gl.convert_layout(l_i, row_o))
            if MODE >= 2:  # varlen: rows past the sequence's queries (the next sequence's) are not stored
                _store_lse(lse, Lse, b, h, q_row + mw, stride_lb, stride_lh, stride_lm, row_o, len_q - mw, True)
            else:
                _store_lse(lse, Lse, b, h, mw, stride_lb, stride_lh, stride_lm, row_o)

        # the last tile's P V
        gl_ = g0 + n_tiles - 1
        vs = gl_ % NUM_STAGES
        p8 = _p_operand(p, p_layout)
        if MODE != 0 and not V_ROWS:  # (V_ROWS: the producer zeroed them while transposing)
            mbarrier.wait(v_ready.index(vs), (gl_ // NUM_STAGES) & 1)
            _ws_clean_v_tail(v_smem.index(vs), (n_tiles - 1) * TN, seqlen_k, v_clean, clean_phase, WG)
        _ws_turn_wait(turn, WG, k0 + n_tiles)
        mbarrier.wait(v_ready.index(vs), (gl_ // NUM_STAGES) & 1)
        pv_tok = warpgroup_mma(p8, v_smem.index(vs).permute((1, 0)), zero_o, use_acc=False, is_async=True)
        _ws_turn_pass(turn, WG)
        acc = acc * gl.expand_dims(alpha, 1)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
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
        else:
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
        _ws_turn_pass(turn, WG)
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
        operand runs at the start of the step that uses it when non-causal (the loop's P relabelling:
        16 PRMT per tile instead of 95, +8-13% on the H200), at the end of the step that computes it when
        causal (there the early conversion spilled more and ran 2-8% slower)."""
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
        _ws_turn_pass(turn, WG)
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

    @gluon.jit
    def _ws_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                   v_empty, seqlen_q, seqlen_k, nheads_q, nheads_k, batch, HEAD_DIM: gl.constexpr,
                   CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, PageTable, SeqlensK, BlockList,
                   stride_pt, page_size, MODE: gl.constexpr, v_raw=None, v_raw_ready=None,
                   V_ROWS: gl.constexpr = False):
        """Producer warp: per query block, both consumers' Q rows into the free Q buffer, then its K/V tiles
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
        64 keys: ``_tile_keys``)."""
        MH: gl.constexpr = q_desc.block_type.shape[0]
        KB: gl.constexpr = k_desc.block_type.shape[0]
        TN: gl.constexpr = _tile_keys(KB, V_ROWS)
        NQK: gl.constexpr = HEAD_DIM // q_desc.block_type.shape[1]
        NV: gl.constexpr = 1 if V_ROWS else HEAD_DIM // v_desc.block_type.shape[0]
        DQK: gl.constexpr = q_desc.block_type.shape[1]
        DV: gl.constexpr = v_desc.block_type.shape[0]
        g = 0
        it = 0
        lim = 0  # V_ROWS: keys holding data in the tile loaded last (>= TN: all)
        n_blocks = _ws_num_blocks(seqlen_q, batch, nheads_q, 2 * MH, BlockList, MODE)
        for r in range(0, gl.cdiv(n_blocks, gl.num_programs(0))):
            t = _ws_round_robin(r)
            if t < n_blocks:
                b, h, hk, m0, shift, n_tiles, sk, q_row, k_row0, len_q = _ws_block(
                    t, n_blocks, seqlen_q, seqlen_k, batch, nheads_q, nheads_k, 2 * MH, TN, CAUSAL, SeqlensK,
                    BlockList, MODE)
                qb = it % 2
                qph = ((it // 2) & 1) ^ 1  # the first two blocks' waits pass on fresh barriers
                for w in gl.static_range(2):
                    mbarrier.wait(q_empty.index(2 * qb + w), qph)
                    mbarrier.expect(q_ready.index(2 * qb + w), NQK * q_desc.block_type.nbytes)
                    for hh in gl.static_range(NQK):
                        tma.async_copy_global_to_shared(q_desc, [q_row + m0 + w * MH, h * HEAD_DIM + hh * DQK],
                                                        q_ready.index(2 * qb + w),
                                                        q_smem.index(NQK * (2 * qb + w) + hh))
                if KB < TN:  # the first tile's box rows (the next tiles' are loaded one tile ahead)
                    rows = _box_rows(PageTable, b, stride_pt, 0, sk, page_size, TN, KB)
                for tt in range(n_tiles):
                    if KB == TN:  # one box per tile: its K row and sequence-major V's coordinates
                        if MODE % 2 == 1:
                            n = tt * TN
                            pg = gl.maximum(gl.load(PageTable + b.to(gl.int64) * stride_pt + n // page_size), 0)
                            k_row = pg * page_size + n % page_size
                            v_row = (pg * nheads_k + hk) * HEAD_DIM
                            v_col = n % page_size
                        elif MODE == 2:
                            k_row = k_row0 + tt * TN
                            v_row = hk * HEAD_DIM
                            v_col = _varlen_v_start(k_row0, b) + tt * TN
                        else:
                            k_row = k_row0 + tt * TN
                            v_row = (b * nheads_k + hk) * HEAD_DIM
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
        first. H200, 2k chunk over 8k, page 128: 15% over sequence-major V with it, 20-23% with 4 x 4
        bytes per thread (ldmatrix loads) or 8 x 4 (8-byte stores) (docs/perf-notes.md)."""
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
            # pages of 16 or 32 keys are their box (``paged_tma.box_rows``): constant shifts instead of
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
            pid_m, pid_bh = _ws_block_of(t, seqlen_q // BM, batch * nheads_q, CAUSAL)
            if MODE == 1:
                seqlen_k = gl.load(SeqlensK + pid_bh // nheads_q)
            b, h, hk, m0, shift, n_tiles = _query_block(pid_m, pid_bh, seqlen_q, seqlen_k, nheads_q, nheads_k, BM,
                                                        BN, CAUSAL, MODE == 1)
            q_row = b * seqlen_q
            k_row = b * seqlen_k
            len_q = seqlen_q
        return b, h, hk, m0, shift, n_tiles, seqlen_k, q_row, k_row, len_q

    @gluon.jit
    def _varlen_v_start(k_start, b):
        """Column of sequence b's first key in ``dense.varlen_v_kmajor``'s V: 16-byte aligned, as the inner
        coordinate of a swizzled TMA box must be (an unaligned one stops the kernel with an illegal
        instruction on the H200). ``16 * (k_start // 16 + b)`` grows by more than each sequence's length."""
        return 16 * (k_start // 16 + b)

    @gluon.jit
    def _ws_num_blocks(seqlen_q, batch, nheads_q, BM: gl.constexpr, BlockList, MODE: gl.constexpr):
        """Query blocks of the persistent schedule (varlen: those of ``BlockList``, see ``_ws_block``)."""
        if MODE >= 2:
            return gl.load(BlockList) * nheads_q
        else:
            return (seqlen_q // BM) * batch * nheads_q

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

    @gluon.constexpr_function
    def _v_rows_loader_regs(box_rows):
        """Registers of the V_ROWS kernel's 4-warp producer (see ``_bounded_fwd_tma_ws_kernel``)."""
        return 24 if box_rows >= 64 else 32

    @gluon.constexpr_function
    def _tile_keys(box_rows, v_rows):
        """Keys per KV tile for K boxes of ``box_rows`` rows: 128 with V in K's layout (V_ROWS: boxes of
        16, 32, 64 or 128 keys, as many per tile as fit), else the box (a V box, sequence-major, is the
        tile: 64 keys for 64-slot pages)."""
        return 128 if v_rows else box_rows

    @gluon.jit
    def _ws_smem(q_desc, k_desc, v_desc, o_desc, NUM_STAGES: gl.constexpr, HEAD_DIM: gl.constexpr,
                 N_TURN: gl.constexpr, V_ROWS: gl.constexpr = False):
        """The warp-specialized kernels' shared memory, mbarriers initialized: ``(q_smem, k_smem, v_smem,
        o_smem, q_ready, q_empty, turn, k_ready, v_ready, k_empty, v_empty, v_raw, v_raw_ready)``. ``turn``
        holds N_TURN single-arrival barriers: the consumers' two turns (the paged kernel, N_TURN = 3, adds
        its V tail barrier). V_ROWS (``v_desc`` a box of key rows, as K's): ``v_raw`` is a ring of such
        boxes with TMA barriers ``v_raw_ready``, ``v_smem`` their transposes (else both alias V's)."""
        MH: gl.constexpr = q_desc.block_type.shape[0]
        DQK: gl.constexpr = q_desc.block_type.shape[1]
        TN: gl.constexpr = _tile_keys(k_desc.block_type.shape[0], V_ROWS)
        DV: gl.constexpr = HEAD_DIM if V_ROWS else v_desc.block_type.shape[0]
        NQK: gl.constexpr = HEAD_DIM // DQK  # Q/K boxes per head (256: two 128-wide halves)
        NV: gl.constexpr = HEAD_DIM // DV  # V/O boxes per head (256: four 64-wide quarters)
        gl.static_assert(MH == 64)
        gl.static_assert(o_desc.block_type.shape[1] == DV)
        if HEAD_DIM == 256:
            gl.static_assert((NQK == 2) and (NV == 4) and (TN == 64))
        else:
            gl.static_assert((NQK == 1) and (NV == 1) and (HEAD_DIM == 64 or HEAD_DIM == 128))
            # one 128-row block = one KV tile: the diagonal tile is the last (the paged kernel masks by
            # bounds and also runs 64-key tiles, for 64-slot pages)
            gl.static_assert(TN == 2 * MH or (N_TURN == 3 and TN == MH))

        # Q: (Q buffer, consumer, box); K: (stage, box); V: (stage, box); O: (consumer, box)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [4 * NQK, MH, DQK], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES * NQK, TN, DQK], k_desc.layout)
        if V_ROWS:
            gl.static_assert(NV == 1)
            v_raw = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, TN, DV], v_desc.layout)
            v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, DV, TN],
                                               gl.NVMMASharedLayout(swizzle_byte_width=TN, element_bitwidth=8,
                                                                    rank=2))
        else:
            v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES * NV, DV, TN], v_desc.layout)
            v_raw = v_smem
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [2 * NV, MH, DV], o_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [N_TURN, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        if V_ROWS:
            v_raw_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(NUM_STAGES):
                mbarrier.init(v_raw_ready.index(i), count=1)
        else:
            v_raw_ready = v_ready
        for w in gl.static_range(4):  # (Q buffer, consumer)
            mbarrier.init(q_ready.index(w), count=1)
            mbarrier.init(q_empty.index(w), count=1)
        for w in gl.static_range(N_TURN):
            mbarrier.init(turn.index(w), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # one arrive per consumer
            mbarrier.init(v_empty.index(i), count=2)
        fence_async_shared()
        gl.thread_barrier()
        return q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, turn, k_ready, v_ready, k_empty, v_empty, v_raw, \
            v_raw_ready

    @gluon.jit(do_not_specialize=_INT_ARGS, do_not_specialize_on_alignment=_PTR_ARGS)
    def _dense_fwd_tma_ws_kernel(
        q_desc, k_desc, v_desc, o_desc, Lse, QDs, KDs, VDs, OutScale,
        stride_lb, stride_lh, stride_lm,
        stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
        seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2,
        CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, OUT_FP8: gl.constexpr, NUM_STAGES: gl.constexpr,
        HEAD_DIM: gl.constexpr,
    ):
        """Head dims 64, 128 and 256 (``_WS_HEAD_DIMS``), warp-specialized as in FA3, and persistent: a
        grid of one CTA per SM walks the query blocks in rounds (``_ws_round_robin``, ``_ws_block_of``); a
        grid of one CTA per block (long causal inputs) runs one each. A 1-warp TMA producer fills a
        double-buffered Q and a K/V ring shared by all of the CTA's blocks (ready / empty mbarriers, no
        CTA-wide barrier in the loop); two 4-warp consumers own 64 query rows each and take turns issuing
        their MMAs (S_j and P_{j-1} V_{j-1} together; at head dim 256 S_j and P V's first quarter), so one
        consumer's softmax runs while the other's MMAs use the tensor cores, and a block's epilogue
        overlaps the next block's first loads. Consumers run at 240 registers, the producer at 24. Same
        softmax step, accumulation and epilogues as the other kernels (the same bits)."""
        q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, turn, k_ready, v_ready, k_empty, v_empty, _, _ = _ws_smem(
            q_desc, k_desc, v_desc, o_desc, NUM_STAGES, HEAD_DIM, 2)

        # (the argument tuples are written out: a tuple held in a variable loses the constexpr flags)
        gl.warp_specialize([
            (_ws_consumer, (0, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                            v_empty, turn, o_desc, Lse, QDs, KDs, VDs, OutScale, stride_lb, stride_lh, stride_lm,
                            stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
                            seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2, CAUSAL, WRITE_LSE,
                            OUT_FP8, NUM_STAGES, HEAD_DIM, Lse, Lse, Lse, 0, 0, turn, 0)),
            (_ws_consumer, (1, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                            v_empty, turn, o_desc, Lse, QDs, KDs, VDs, OutScale, stride_lb, stride_lh, stride_lm,
                            stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
                            seqlen_q, seqlen_k, nheads_q, nheads_k, batch, softmax_scale_log2, CAUSAL, WRITE_LSE,
                            OUT_FP8, NUM_STAGES, HEAD_DIM, Lse, Lse, Lse, 0, 0, turn, 0)),
            (_ws_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                          k_empty, v_empty, seqlen_q, seqlen_k, nheads_q, nheads_k, batch, HEAD_DIM, CAUSAL,
                          NUM_STAGES, Lse, Lse, Lse, 0, 1, 0)),
        ], [4, 1], [_WS_CONSUMER_REGS, _WS_LOADER_REGS])

    @gluon.jit(do_not_specialize=_BOUNDED_INT_ARGS, do_not_specialize_on_alignment=_BOUNDED_PTR_ARGS)
    def _bounded_fwd_tma_ws_kernel(
        q_desc, k_desc, v_desc, o_desc, Lse, QDs, KDs, VDs, OutScale, PageTable, SeqlensK, BlockList, Out,
        stride_lb, stride_lh, stride_lm,
        stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
        stride_pt, page_size, stride_om, stride_oh, seqlen_q, nheads_q, nheads_k, batch, softmax_scale_log2,
        CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, OUT_FP8: gl.constexpr, NUM_STAGES: gl.constexpr,
        HEAD_DIM: gl.constexpr, MODE: gl.constexpr, V_ROWS: gl.constexpr,
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
        32 registers for boxes under 64 keys, else 24)."""
        gl.static_assert(HEAD_DIM != 256)
        q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, turn, k_ready, v_ready, k_empty, v_empty, v_raw, \
            v_raw_ready = _ws_smem(q_desc, k_desc, v_desc, o_desc, NUM_STAGES, HEAD_DIM, 3, V_ROWS)
        v_clean = turn.index(2)
        LOADER_WARPS: gl.constexpr = 4 if V_ROWS else 1
        # A 12-warp CTA's register pool is 168 x 384 = 64512: a 24-register producer leaves both consumers
        # their 240. Boxes under 64 keys (pages of 16, 32) keep 32: their producer holds more page-table
        # rows and spilled 49-114 times at 24 (H200: 5-6% slower there; pages of 64+ 1-5% faster).
        LOADER_REGS: gl.constexpr = _v_rows_loader_regs(k_desc.block_type.shape[0]) if V_ROWS else _WS_LOADER_REGS

        gl.warp_specialize([
            (_ws_consumer, (0, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                            v_empty, turn, o_desc, Lse, QDs, KDs, VDs, OutScale, stride_lb, stride_lh, stride_lm,
                            stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
                            seqlen_q, 0, nheads_q, nheads_k, batch, softmax_scale_log2, CAUSAL, WRITE_LSE,
                            OUT_FP8, NUM_STAGES, HEAD_DIM, SeqlensK, BlockList, Out, stride_om, stride_oh,
                            v_clean, MODE, V_ROWS)),
            (_ws_consumer, (1, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                            v_empty, turn, o_desc, Lse, QDs, KDs, VDs, OutScale, stride_lb, stride_lh, stride_lm,
                            stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
                            seqlen_q, 0, nheads_q, nheads_k, batch, softmax_scale_log2, CAUSAL, WRITE_LSE,
                            OUT_FP8, NUM_STAGES, HEAD_DIM, SeqlensK, BlockList, Out, stride_om, stride_oh,
                            v_clean, MODE, V_ROWS)),
            (_ws_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                          k_empty, v_empty, seqlen_q, 0, nheads_q, nheads_k, batch, HEAD_DIM, CAUSAL,
                          NUM_STAGES, PageTable, SeqlensK, BlockList, stride_pt, page_size, MODE, v_raw, v_raw_ready,
                          V_ROWS)),
        ], [4, LOADER_WARPS], [_WS_CONSUMER_REGS, LOADER_REGS])

# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _capability(index):
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _num_sms(index):
    """The persistent kernel's grid: one CTA per SM (its shared memory and registers allow one)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


# Head dims on the warp-specialized kernel (H200, against the 8-warp kernels, the same bits: d128 +5-9% from
# S2k and, persistent, S512 +34% / S1k +19% non-causal, +5-6% causal; d64 +2-6%, see ``_use_ws``; d256
# +11-15% non-causal, +1% causal S512, +9-22% causal S1k-S16k).
_WS_HEAD_DIMS = (64, 128, 256)
_VARLEN_HEAD_DIMS = (64, 128)  # the bounded kernel's
# The warp-specialized kernel runs persistent (one CTA per SM walking the query blocks; a block's epilogue
# overlaps the next one's loads) except for causal inputs longer than this (H200, causal S16k: -2% to -6%
# persistent; S8k and shorter: even or faster). A load model puts the alternating schedule within 0.2% of
# perfect balance there, so the likelier cause is its order: every head's K/V is live at once, where one
# block per CTA in the hardware's order works through about one head at a time (not measured).
_WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q = 8192


def varlen_preferred(head_dim, max_seqlen_q):
    """Whether varlen inputs that the TMA kernel supports go to it by default (``FP8ATTN_DENSE_BACKEND``
    unset): head dims 64 and 128 with sequences up to at least 1024 queries. Measured on the H200 (eager
    calls, V laid out by ``dense.varlen_v_kmajor`` in each call; ``explore/dense_varlen_tma.json``): d128
    1.48-2.26x the Triton kernel, d64 1.22-1.77x, over 8 random lengths 512-4096, 4 x 4096 and 16 x 1024,
    causal or not; shorter batches were not measured."""
    return head_dim in _VARLEN_HEAD_DIMS and max_seqlen_q is not None and int(max_seqlen_q) >= 1024


def ws_grid(n_blocks, causal, seqlen_q, device_index):
    """The warp-specialized kernels' grid for ``n_blocks`` query blocks: one CTA per SM (persistent), or
    one per block for causal inputs longer than ``_WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q``."""
    persistent = not causal or seqlen_q <= _WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q
    return (min(n_blocks, _num_sms(device_index)) if persistent else n_blocks, 1)


def _use_ws(head_dim, causal, seqlen_q):
    """The warp-specialized kernel, except head dim 64 causal beyond the persistent range, which ran
    4-5% slower there on a one-block-per-CTA grid than the 8-warp kernel (H200, S16k)."""
    return head_dim in _WS_HEAD_DIMS and not (
        head_dim == 64 and causal and seqlen_q > _WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q)


def _tiles(head_dim, ws):
    """(rows of a Q/O box, head-dim width of a Q/K box, of a V/O box, keys per KV tile). The
    warp-specialized kernel loads Q and stores O per 64-row consumer; head dim 256 runs Q/K in two
    128-wide halves, V/O in four 64-wide quarters, with 64-key tiles (``_ws_attend_d256``, and the 8-warp
    ``_dense_fwd_tma_d256_kernel``)."""
    if head_dim == 256:
        return (BLOCK_M // 2 if ws else BLOCK_M, 128, 64, 64)
    return (BLOCK_M // 2 if ws else BLOCK_M, head_dim, head_dim, BLOCK_N)


@functools.lru_cache(maxsize=None)
def _layouts(tiles, out_fp8, v_rows=False, k_rows=None):
    """Shared-memory layouts of the Q, K, V and output boxes of ``_tiles(...)`` (``v_rows``: V's box is
    K's, rows of keys; ``k_rows``: rows of K's box when fewer than the tile's keys, up to one page)."""
    f8 = gl.float8e4nv
    rows, dh, dv, bn = tiles
    kb = k_rows or bn
    return (gl.NVMMASharedLayout.get_default_for([rows, dh], f8),
            gl.NVMMASharedLayout.get_default_for([kb, dh], f8),
            gl.NVMMASharedLayout.get_default_for([kb, dh] if v_rows else [dv, bn], f8),
            gl.NVMMASharedLayout.get_default_for([rows, dv], f8 if out_fp8 else gl.bfloat16))


def _kernel_for(head_dim, ws):
    """(kernel, num_warps) (the warp-specialized kernel adds 5 worker warps)."""
    if ws:
        return _dense_fwd_tma_ws_kernel, 4
    if head_dim == 256:
        return _dense_fwd_tma_d256_kernel, NUM_WARPS
    return _dense_fwd_tma_kernel, NUM_WARPS


def _rows_2d(x):
    """Shape and strides of the (batch * seqlen, nheads * d) TMA view of a contiguous
    (batch, seqlen, nheads, d) tensor."""
    b, s, h, d = x.shape
    return [b * s, h * d], [h * d, 1]


def _vt_2d(v):
    """Shape and strides of the (batch * nheads_k * d, seqlen_k) TMA view of a sequence-contiguous V
    (batch, seqlen_k, nheads_k, d), memory order (batch, nheads_k, d, seqlen_k)."""
    b, s, h, d = v.shape
    return [b * h * d, s], [s, 1]


def unsupported_reason(q, k, v, out, *, causal, window_size, softcap, q_descale, k_descale, v_descale,
                       out_scale, cu_seqlens_q, descale_block_q, descale_block_k, lse, cu_seqlens_k=None):
    """Why the TMA fast path cannot run these inputs, or None when it can (see ``supported``)."""
    if not HAS_GLUON:
        return "triton.experimental.gluon is not available"
    why = tma_options_reason(q.dtype, k.dtype, v.dtype, out.dtype, window_size=window_size, softcap=softcap,
                             out_scale=out_scale, per_block=descale_block_q is not None or descale_block_k is not None)
    if why:
        return why
    if cu_seqlens_q is not None:
        return _varlen_unsupported_reason(q, k, v, out, q_descale=q_descale, k_descale=k_descale,
                                          v_descale=v_descale, out_scale=out_scale, cu_seqlens_q=cu_seqlens_q,
                                          cu_seqlens_k=cu_seqlens_k, lse=lse)
    causal = window_flags(causal, window_size)[0]
    ts = (q, k, v, out)
    if any(t.dim() != 4 for t in ts):
        return "q, k, v, out must be 4-d (batch, seqlen, nheads, headdim)"
    batch, sq, hq, d = q.shape
    _, sk, hk, _ = k.shape
    if d not in HEAD_DIMS or k.shape[-1] != d or v.shape[-1] != d:
        return (f"head dim must be 64, 128 or 256 and equal for q, k and v (other head dims are not "
                f"supported), got {d}, {k.shape[-1]}, {v.shape[-1]}")
    if k.shape[0] != batch or tuple(v.shape) != tuple(k.shape) or tuple(out.shape) != tuple(q.shape):
        return "shape mismatch between q, k, v, out"
    if batch == 0 or hq == 0:
        return "empty batch or no heads (nothing to launch)"
    if hk == 0 or hq % hk != 0:
        return f"nheads_q ({hq}) must be a multiple of nheads_k ({hk})"
    if sq % BLOCK_M != 0 or sk % BLOCK_N != 0 or sq == 0 or sk == 0:
        return f"seqlen_q ({sq}) and seqlen_k ({sk}) must be positive multiples of 128"
    if causal and sq > sk:
        return f"causal with seqlen_q ({sq}) > seqlen_k ({sk}) is not supported"
    if max(batch * sq, batch * sk, batch * hk * d) >= 2 ** 31:
        return "too many rows for 32-bit TMA coordinates"
    if not (q.is_contiguous() and k.is_contiguous() and out.is_contiguous()):
        return "q, k, out must be contiguous (batch, seqlen, nheads, headdim)"
    if not v.permute(0, 2, 3, 1).is_contiguous():
        return "v must be sequence-contiguous (memory order (batch, nheads_k, headdim, seqlen_k))"
    return _common_unsupported_reason(ts, batch, hq, hk, q_descale, k_descale, v_descale, out_scale, lse,
                                      (batch, hq, sq), "(batch, nheads_q, seqlen_q)")


def _common_unsupported_reason(ts, batch, hq, hk, q_descale, k_descale, v_descale, out_scale, lse, lse_shape,
                               lse_name, extra=()):
    """The alignment, descale, LSE and device rules of the dense and varlen paths."""
    if any(t.data_ptr() % 16 for t in ts):
        return "q, k, v, out must be 16-byte aligned"
    for name, ds in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if ds is None:
            return f"{name} is required"
        if ds.dtype != torch.float32 or tuple(ds.shape) != (batch, hk):
            return f"{name} must be float32 (batch, nheads_k)"
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != lse_shape):
        return f"lse must be float32 {lse_name}"
    # device checks last: the shape rules above hold (and are testable) without CUDA
    return device_reason(ts, tuple(extra) + (q_descale, k_descale, v_descale, lse, out_scale))


def device_reason(ts, extra=()):
    """The device rules of every TMA kernel: ``ts`` (q, k, v, out) CUDA tensors on one sm90 device with the
    tensors of ``extra`` (None entries skipped). None when they hold."""
    dev = ts[0].device
    if not all(t.is_cuda for t in ts):
        return "inputs must be CUDA tensors"
    if any(t.device != dev for t in tuple(ts) + tuple(t for t in extra if t is not None)):
        return "all tensors must be on one device"
    if _capability(dev.index if dev.index is not None else torch.cuda.current_device()) != (9, 0):
        return "needs an sm90 (Hopper) GPU"
    return None


def _varlen_unsupported_reason(q, k, v, out, *, q_descale, k_descale, v_descale, out_scale, cu_seqlens_q,
                               cu_seqlens_k, lse):
    """``unsupported_reason`` for varlen inputs (``_bounded_fwd_tma_ws_kernel`` in ``MODE_VARLEN``), after
    ``launch_rules.tma_options_reason``."""
    if cu_seqlens_k is None:
        return "varlen needs cu_seqlens_k"
    if out_scale is not None:  # compiled for sm90, not yet run on a GPU: the Triton kernel serves it
        return "varlen with the fused FP8 output (out_scale) runs on the Triton kernel"
    ts = (q, k, v, out)
    if any(t.dim() != 3 for t in ts):
        return "varlen q, k, v, out must be 3-d (total, nheads, headdim)"
    total_q, hq, d = q.shape
    total_k, hk, _ = k.shape
    if d not in _VARLEN_HEAD_DIMS or k.shape[-1] != d or v.shape[-1] != d:
        return f"varlen head dim must be 64 or 128 for q, k and v, got {d}, {k.shape[-1]}, {v.shape[-1]}"
    if tuple(v.shape) != tuple(k.shape) or tuple(out.shape) != tuple(q.shape):
        return "shape mismatch between q/out or k/v"
    if total_q == 0 or hq == 0 or hk == 0 or hq % hk != 0:
        return f"nheads_q ({hq}) must be a positive multiple of nheads_k ({hk}), total_q positive"
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.stride(0) != 1:
            return f"{name} must be contiguous int32 (batch + 1,)"
    batch = cu_seqlens_q.numel() - 1
    if cu_seqlens_k.numel() != batch + 1 or batch < 1:
        return "cu_seqlens_q and cu_seqlens_k must have batch + 1 entries (batch >= 1)"
    if not (q.is_contiguous() and k.is_contiguous() and out.is_contiguous()):
        return "varlen q, k, out must be contiguous (total, nheads, headdim)"
    if max(total_q + 128 * (batch + 1), 16 * (total_k // 16 + batch + 1) + 128, hk * d) >= 2 ** 31:
        return "too many rows for 32-bit TMA coordinates"
    return _common_unsupported_reason(ts, batch, hq, hk, q_descale, k_descale, v_descale, out_scale, lse,
                                      (hq, total_q), "(nheads_q, total_q)", extra=(cu_seqlens_q, cu_seqlens_k))


def supported(q, k, v, out, *, causal, window_size, softcap, q_descale, k_descale, v_descale,
              out_scale, cu_seqlens_q, descale_block_q, descale_block_k, lse, cu_seqlens_k=None) -> bool:
    """Whether ``launch_dense_fwd_tma`` handles these inputs.

    Parameters
    ----------
    q, k, v, out : torch.Tensor
        As for ``dense.launch_dense_fwd``; ``v`` already sequence-contiguous.
    causal, window_size, softcap, q_descale, k_descale, v_descale, out_scale, cu_seqlens_q,
    descale_block_q, descale_block_k, lse, cu_seqlens_k
        As for ``dense.launch_dense_fwd``.

    Returns
    -------
    bool
        True for: CUDA tensors on an sm90 device; q, k, v float8_e4m3fn; out bfloat16, or
        float8_e4m3fn together with ``out_scale`` (a float32 tensor with one element, on the same
        device); head dim 64, 128 or 256, the same for q, k and v; contiguous q,
        k, out (batch, seqlen, nheads, d) and V in memory order (batch, nheads_k, d, seqlen_k);
        seqlen_q and seqlen_k multiples of 128; nheads_q a multiple of nheads_k; causal only with
        seqlen_q <= seqlen_k; float32 (batch, nheads_k) descales (broadcast views allowed); no
        sliding window (``(-1, 0)`` is the causal mask), softcap or per-block descales; lse None or
        float32 (batch, nheads_q, seqlen_q). Varlen (``cu_seqlens_q`` and ``cu_seqlens_k``, int32): head
        dims 64 and 128, bf16 out, contiguous q/k/out (total, nheads, d), V in any layout, lse None or
        (nheads_q, total_q). ``unsupported_reason`` says why not.
    """
    return unsupported_reason(q, k, v, out, causal=causal, window_size=window_size, softcap=softcap,
                              q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                              out_scale=out_scale, cu_seqlens_q=cu_seqlens_q,
                              descale_block_q=descale_block_q, descale_block_k=descale_block_k,
                              lse=lse, cu_seqlens_k=cu_seqlens_k) is None


def launch_dense_fwd_tma(q, k, v_kmajor, out, lse, *, softmax_scale, causal, q_descale, k_descale, v_descale,
                         out_scale=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """Launch the TMA/wgmma dense forward. No validation: call only when ``supported`` is True.

    Parameters
    ----------
    q : torch.Tensor
        float8_e4m3fn (batch, seqlen_q, nheads_q, d), contiguous; d is 64, 128 or 256.
    k : torch.Tensor
        float8_e4m3fn (batch, seqlen_k, nheads_k, d), contiguous.
    v_kmajor : torch.Tensor
        float8_e4m3fn (batch, seqlen_k, nheads_k, d) with memory order
        (batch, nheads_k, d, seqlen_k) (``dense.transpose_v_kmajor``).
    out : torch.Tensor
        (batch, seqlen_q, nheads_q, d), contiguous: bfloat16, or float8_e4m3fn with ``out_scale``.
        Written in place.
    lse : torch.Tensor or None
        float32 (batch, nheads_q, seqlen_q), any strides; natural-log LSE written when given.
    softmax_scale : float
    causal : bool
        Bottom-right aligned causal mask (seqlen_q <= seqlen_k).
    q_descale, k_descale, v_descale : torch.Tensor
        float32 (batch, nheads_k); stride-0 broadcast views allowed.
    out_scale : torch.Tensor or None
        float32, one element: the output is ``clamp(o / out_scale, -448, 448)`` in e4m3fn (read on
        the device; no host synchronization).
    cu_seqlens_q, cu_seqlens_k : torch.Tensor or None
        int32 (batch + 1,): varlen inputs (head dims 64, 128), q/out (total_q, nheads_q, d), k
        (total_k, nheads_k, d), v_kmajor (total_k, nheads_k, d) in any layout (laid out again by
        ``dense.varlen_v_kmajor``), lse (nheads_q, total_q).

    Returns
    -------
    tuple
        ``(out, lse)``.
    """
    if cu_seqlens_q is not None:
        return _launch_varlen(q, k, v_kmajor, out, lse, softmax_scale=softmax_scale, causal=causal,
                              q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_scale=out_scale,
                              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    batch, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out_fp8 = out_scale is not None
    ws = _use_ws(d, causal, sq)
    rows, dh, dv, bn = _tiles(d, ws)
    descs = ((q, *_rows_2d(q), [rows, dh]), (k, *_rows_2d(k), [bn, dh]),
             (v_kmajor, *_vt_2d(v_kmajor), [dv, bn]), (out, *_rows_2d(out), [rows, dv]))
    ls = lse.stride() if lse is not None else (0, 0, 0)
    args = (lse if lse is not None else q_descale, q_descale, k_descale, v_descale,
            out_scale if out_fp8 else q_descale, *ls, *q_descale.stride(), *k_descale.stride(),
            *v_descale.stride(), sq, sk, hq, hk, batch, float(softmax_scale) * _LOG2E)
    blocks = (sq // BLOCK_M, batch * hq)
    if ws:
        grid = ws_grid(blocks[0] * blocks[1], causal, sq, q.device.index)
    else:
        grid = blocks
    _launch(d, ws, grid, descs, args, (bool(causal), lse is not None, out_fp8, NUM_STAGES) + ((d,) if ws else ()))
    return out, lse


def _launch_varlen(q, k, v_kmajor, out, lse, *, softmax_scale, causal, q_descale, k_descale, v_descale, out_scale,
                   cu_seqlens_q, cu_seqlens_k):
    """``launch_dense_fwd_tma`` for varlen inputs: the bounded kernel in ``MODE_VARLEN``, persistent over the
    query blocks of ``varlen_block_list`` (the grid from their capacity, ``total_q // 128 + batch`` per head)."""
    total_q, hq, d = q.shape
    total_k, hk, _ = k.shape
    batch = cu_seqlens_q.numel() - 1
    rows, dh, dv, bn = tiles = _tiles(d, True)
    from .dense import varlen_v_kmajor  # (dense imports this module)

    vt = varlen_v_kmajor(v_kmajor, cu_seqlens_k)
    blocks, ls, row_strides, grid = varlen_schedule(cu_seqlens_q, cu_seqlens_k, True, total_q, hq, lse, out)
    descs = ((q, [total_q, hq * d], [hq * d, 1], [rows, dh]), (k, [total_k, hk * d], [hk * d, 1], [bn, dh]),
             (vt, [hk * d, vt.shape[-1]], [vt.shape[-1], 1], [dv, bn]),
             (out, [total_q, hq * d], [hq * d, 1], [rows, dv]))
    out_fp8 = out_scale is not None
    args = (lse if lse is not None else q_descale, q_descale, k_descale, v_descale,
            out_scale if out_fp8 else q_descale, cu_seqlens_q, cu_seqlens_q, blocks, out, *ls, *q_descale.stride(),
            *k_descale.stride(), *v_descale.stride(), 0, 1, *row_strides, total_q, hq, hk, batch,
            float(softmax_scale) * _LOG2E)
    _launch(d, True, grid, descs, args, (bool(causal), lse is not None, out_fp8, NUM_STAGES, d, MODE_VARLEN, False),
            bounded=True, tiles=tiles)
    return out, lse


def empty_block_list(cu_seqlens_q, total_q):
    """An unfilled ``varlen_block_list`` of capacity ``total_q // 128 + batch`` blocks (for a kernel that
    fills it with ``common.fill_varlen_block_list``)."""
    capacity = total_q // BLOCK_M + cu_seqlens_q.numel() - 1
    return torch.empty(ENTRY * (1 + capacity), device=cu_seqlens_q.device, dtype=torch.int32)


def varlen_block_list(cu_seqlens_q, keys, keys_cumulative, total_q, min_len_q=1):
    """The query blocks of a varlen launch of the bounded kernel (MODE >= 2), built on the device (one
    Triton program, no host synchronization): sequence b's ``ceil(len_q / 128)`` blocks, in sequence
    order, for the sequences with at least ``min_len_q`` queries (the others are left to another kernel).

    Parameters
    ----------
    cu_seqlens_q : torch.Tensor
        int32 (batch + 1,) query offsets.
    keys : torch.Tensor
        int32: (batch + 1,) key offsets (``keys_cumulative``, varlen K/V), or (batch,) key counts (a paged
        cache, whose keys start at row 0 of each sequence's pages).
    keys_cumulative : bool
    total_q : int
        The number of queries (sets the list's capacity, ``total_q // 128 + batch``).
    min_len_q : int

    Returns
    -------
    torch.Tensor
        int32 (8 * (1 + capacity),): the block count, then (from slot 8) one entry of 8 slots per block:
        its sequence, query block within the sequence, the sequence's first query row, query count, first
        key row and key count (two slots of padding: an entry is one 32-byte sector, so that the kernel
        reads a block's bounds in one round of independent loads). Entries past the count are not written.
    """
    batch = cu_seqlens_q.numel() - 1
    blocks = empty_block_list(cu_seqlens_q, total_q)
    _block_list_kernel[(1,)](cu_seqlens_q, keys, blocks, batch, int(min_len_q), BM=BLOCK_M, BLOCK_B=256,
                             KEYS_CU=bool(keys_cumulative), ENTRY=ENTRY, num_warps=4)
    return blocks


def varlen_schedule(cu_seqlens_q, keys, keys_cumulative, total_q, nheads_q, lse, out, min_len_q=1, blocks=None):
    """What a varlen launch of the bounded kernel (MODE >= 2, dense or paged) passes besides its tensors:
    ``(block_list, lse_strides, out_row_strides, grid)``: the ``varlen_block_list`` (``keys`` and
    ``keys_cumulative`` as there; ``blocks``: one already filled on the stream, from ``empty_block_list``),
    the (0, head, row) strides of an (nheads_q, total_q) LSE (zeros without one), ``out``'s (row, head)
    strides for the masked row stores, and the persistent grid (one CTA per SM, at most one per block of
    the list's capacity)."""
    if blocks is None:
        blocks = varlen_block_list(cu_seqlens_q, keys, keys_cumulative, total_q, min_len_q)
    ls = (0, lse.stride(0), lse.stride(1)) if lse is not None else (0, 0, 0)
    grid = (min((blocks.numel() // ENTRY - 1) * nheads_q, _num_sms(out.device.index)), 1)
    return blocks, ls, (out.stride(0), out.stride(1)), grid


class _HostDesc:
    """The fields triton 3.6's launcher reads from a host tensor descriptor (it encodes the CUtensorMap
    from them on every launch); ``TensorDescriptor`` adds only checks that ``supported`` already made."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base, shape, strides):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, "zero"


# (device, head dim, kernel, constexprs) -> triton's compiled kernel. The kernels specialize on nothing
# else (``_INT_ARGS`` / ``_PTR_ARGS``; the descriptors' block types follow from head dim and output dtype).
_COMPILED: dict = {}
_CONST_NAMES = ("CAUSAL", "WRITE_LSE", "OUT_FP8", "NUM_STAGES", "HEAD_DIM")
_DIRECT_LAUNCH = HAS_GLUON and triton.__version__.startswith("3.6.")


def _launch_hooks_set():
    rt = triton.knobs.runtime
    return any(getattr(h, "calls", h) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


def _launch(d, ws, grid, descs, args, consts, bounded=False, tiles=None):
    """Launch the head-dim-``d`` kernel (``ws``: the warp-specialized one; ``bounded``: its variant with
    per-sequence bounds, ``_bounded_fwd_tma_ws_kernel``, whose ``tiles`` may differ from ``_tiles(d, ws)``)
    on the current device and stream.

    The first launch per (device, head dim, constexprs) goes through triton's JIT (compile, bind,
    specialize) and keeps the compiled kernel; later launches call it directly with the same argument
    list and lightweight descriptors: 38 -> 13 us of host time per launch, plus ~13 us of descriptor
    construction, on the H200's host (docs/perf-notes.md). Triton's own path is used whenever launch
    hooks are installed (profilers) or an integer argument needs 64 bits (a different signature).

    Parameters
    ----------
    descs : four (tensor, shape, strides, block_shape) tuples: the Q, K, V and output TMA views.
    args : the kernel's remaining run-time arguments in signature order.
    consts : the constexprs in ``_CONST_NAMES`` order: (CAUSAL, WRITE_LSE, OUT_FP8, NUM_STAGES), and HEAD_DIM
        for the warp-specialized kernel, and MODE and V_ROWS for the bounded one.
    """
    drv = triton.runtime.driver.active  # the device and stream triton's own launch would use
    dev = drv.get_current_device()
    kernel, num_warps = (_bounded_fwd_tma_ws_kernel, 4) if bounded else _kernel_for(d, ws)
    n_ptr = len(_BOUNDED_PTR_ARGS if bounded else _PTR_ARGS)
    tiles = tiles or _tiles(d, ws)
    k_rows = descs[1][3][0]  # K's box: the tile's keys, or up to one page of them
    key = (dev, d, kernel, tiles, k_rows) + consts
    ck = _COMPILED.get(key)
    if ck is None or _launch_hooks_set() or max(args[n_ptr:-1]) >= 2 ** 31:
        layouts = _layouts(tiles, consts[2], bounded and consts[6], k_rows)
        tds = [TensorDescriptor(t, shape, strides, block, layout)
               for (t, shape, strides, block), layout in zip(descs, layouts)]
        ck = kernel[grid](*tds, *args, **dict(zip(_CONST_NAMES + ("MODE", "V_ROWS"), consts)), num_warps=num_warps)
        if _DIRECT_LAUNCH and not hasattr(ck, "result"):
            _COMPILED[key] = ck
        return
    ck.run(grid[0], grid[1], 1, drv.get_current_stream(dev), ck.function, ck.packed_metadata,
           None, None, None, *[_HostDesc(t, shape, strides) for t, shape, strides, _ in descs], *args, *consts)


# ---------------------------------------------------------------------------------------------
# ahead-of-time compile (inspection without a GPU)
# ---------------------------------------------------------------------------------------------
def _aot_compile(causal, write_lse=True, arch=90, head_dim=128, out_fp8=False, ws=None, mode=None, block_n=None,
                 v_rows=False, box=None):
    """Compile the kernel for ``sm_{arch}`` without a GPU; returns triton's compiled kernel.

    Arguments get the specializations of a launch: none (the jit decorator turns them off).
    ``ws``: the warp-specialized kernel (default: whenever the head dim has it). ``mode``: the kernel
    with per-sequence bounds (``_bounded_fwd_tma_ws_kernel``, ``MODE_*``; head dims 64 and 128),
    ``block_n`` its keys per tile, ``v_rows`` its V in K's layout (``V_ROWS``), ``box`` the rows of its K and
    V boxes when fewer than the tile's keys (16, 32, 64, with ``v_rows``: ``paged_tma.box_rows``).
    """
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bounded = mode is not None
    ws = (head_dim in _WS_HEAD_DIMS if ws is None else ws) or bounded
    tiles = _tiles(head_dim, ws)
    if block_n:
        tiles = (*tiles[:3], block_n)
    rows, dh, dv, bn = tiles
    if v_rows:
        tiles = (*tiles[:3], BLOCK_N)  # V_ROWS tiles are 128 keys (``_tile_keys``)
        rows, dh, dv, bn = tiles
    ql, kl, vl, ol = _layouts(tiles, out_fp8, v_rows, box)
    kb = box or bn
    kernel, num_warps = (_bounded_fwd_tma_ws_kernel, 4) if bounded else _kernel_for(head_dim, ws)

    def desc(shape, layout, dtype="fp8e4nv"):
        return f"tensordesc<{dtype}[{shape[0]}, {shape[1]}],{layout!r}>"

    # in the kernels' parameter order
    ptrs = _BOUNDED_PTR_ARGS if bounded else _PTR_ARGS
    ints = ("stride_lb", "stride_lh", "stride_lm", "stride_qds_b", "stride_qds_h", "stride_kds_b",
            "stride_kds_h", "stride_vds_b", "stride_vds_h") + \
        (("stride_pt", "page_size", "stride_om", "stride_oh", "seqlen_q") if bounded else ("seqlen_q", "seqlen_k")) + \
        ("nheads_q", "nheads_k", "batch")
    sig = {
        "q_desc": desc([rows, dh], ql), "k_desc": desc([kb, dh], kl),
        "v_desc": desc([kb, dh] if v_rows else [dv, bn], vl),
        "o_desc": desc([rows, dv], ol, "fp8e4nv" if out_fp8 else "bf16"),
        **{n: "*i32" if n in ("PageTable", "SeqlensK", "BlockList") else
           ("*fp8e4nv" if out_fp8 else "*bf16") if n == "Out" else "*fp32" for n in ptrs},
        **{n: "i32" for n in ints},
        "softmax_scale_log2": "fp32",
        "CAUSAL": "constexpr", "WRITE_LSE": "constexpr", "OUT_FP8": "constexpr", "NUM_STAGES": "constexpr",
    }
    consts = {"CAUSAL": bool(causal), "WRITE_LSE": bool(write_lse), "OUT_FP8": bool(out_fp8),
              "NUM_STAGES": NUM_STAGES}
    if ws:
        sig["HEAD_DIM"] = "constexpr"
        consts["HEAD_DIM"] = head_dim
    if bounded:
        sig["MODE"] = sig["V_ROWS"] = "constexpr"
        consts["MODE"] = int(mode)
        consts["V_ROWS"] = bool(v_rows)
    # no attributes: a launch specializes no integer or pointer argument (_INT_ARGS, _PTR_ARGS)
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs={})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
