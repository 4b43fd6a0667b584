"""The Hopper attention backward (Gluon): dK, dV and a dQ added by TMA reductions in one kernel per mode.

``_bwd_tma_kernel``: one CTA (two 4-warp warpgroups, ``_bwd_consumer``, and a producer warp, ``_bwd_loader``) per
(key block of 128, batch, kv head). K and V are read once into shared memory (K as e4m3 for ``S^T = K Q^T`` and
upcast to bf16 for ``dQ = dS K``, V upcast to bf16 for ``dP^T = V dO^T``); the query tiles of 64 rows of every
query head of the group stream through a ``NUM_STAGES``-deep ring of Q / dO buffers that the producer warp fills
by TMA as the consumers release them. Per tile, each warpgroup holds 64 keys' rows of S^T, dP^T and the fp32
dK / dV accumulators (the wgmma accumulators; at head dim 128, 32 + 32 + 128 registers a thread); P^T and dS^T
are the register A operands of ``dV += P^T dO`` and ``dK += dS^T Q``; dS^T goes through shared memory once more
for ``dQ = dS K``, whose 64 x d tile the two warpgroups split by columns; the tile is staged in shared memory and
added to the fp32 dQ rows by one bulk TMA reduction (``cp.reduce.async.bulk.tensor ... add``), which runs while
the next tile computes. Two barriers of the consumer warps per tile: one once dS^T (and the upcast Q) is in
shared memory, one once the dQ tile is.

Numerics are the dequantized mode of ``kernels.backward`` (its module docstring): the e4m3 products of
``K Q^T`` (fp32 accumulation), P and dS rounded to bf16, the FP8 operands upcast exactly, descales folded
into the tile products and the final scaling.

``_bwd_tma_fp8_kernel``: the same CTA, producer warp, ring and dQ path in the FP8-matmul mode (e4m3 Q/K/V;
``_bwd_fp8_consumer``): four products on e4m3 operands, dV and dK added tile by tile into fp32 in column parts
of 32 (its docstring; docs/decisions.md has the layouts, the scales and the registers behind them).
"""
from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

_LOG2E = gl.constexpr(1.4426950408889634)
_LOADER_REGS = gl.constexpr(24)  # the producer warp's registers (the 8 consumer warps run at 240)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Start the bulk tensor reduction ``global[coord : coord + box] += src`` (shared memory, fp32) by TMA, in
    the bulk group that ``tma.store_wait`` waits on. Gluon's hopper ``tma`` module has the copies but not this
    reduction, whose op the Gluon builder has."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.constexpr_function
def _smem_layout(cols, bits):
    """The wgmma shared-memory layout of a row-major tile whose rows hold ``cols`` elements of ``bits``."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, cols * bits // 8), element_bitwidth=bits, rank=2)


@gluon.constexpr_function
def _acc_layout(warps_m, warps_n, n, k=16):
    """A wgmma accumulator layout; ``k`` the instruction's K (16 for 16-bit operands, 32 for e4m3)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, warps_n], instr_shape=[16, n, k])


@gluon.jit
def _upcast(x, dtype: gl.constexpr):
    """e4m3 ``x`` in ``dtype`` (16-bit), exact. To bf16 through fp32: the direct conversion goes through fp16 with
    one scalar conversion per element, the fp32 route packs pairs."""
    if x.dtype == dtype:
        return x
    if dtype == gl.bfloat16:
        return x.to(gl.float32).to(dtype)
    return x.to(dtype)


@gluon.jit
def _load_kv_tile(ptr, stride_n, stride_d, n_valid, ROWS: gl.constexpr, D: gl.constexpr, layout: gl.constexpr):
    """(ROWS, D) rows of K or V from ``ptr``; rows past ``n_valid`` read as zeros. ``layout`` reads along the
    contiguous axis (the head dim, or the keys of a sequence-major V)."""
    rows = gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, gl.SliceLayout(0, layout))
    offs = gl.expand_dims(rows.to(gl.int64) * stride_n, 1) + gl.expand_dims(cols.to(gl.int64) * stride_d, 0)
    return gl.load(ptr + offs, mask=gl.expand_dims(rows < n_valid, 1), other=0.0)


@gluon.constexpr_function
def _row_layout(rows, cols, bits, warps):
    """A blocked layout whose threads hold 16 contiguous bytes of a row-major (rows, cols) tile, a row's threads
    side by side: a warp's store covers whole 32-byte sectors."""
    per_thread = min(cols, 128 // bits)
    along = min(32, cols // per_thread)
    return gl.BlockedLayout([1, per_thread], [32 // along, along], [warps, 1], [1, 0])


@gluon.jit
def _store_rows(ptr, stride_n, n_valid, x, layout: gl.constexpr):
    """Store the (rows, cols) fp32 accumulator ``x`` (layout ``layout``, a wgmma accumulator's) cast to ``ptr``'s
    dtype, rows below ``n_valid`` only. A 16-bit output goes through ``_row_layout`` first: in the accumulator's
    layout a thread's store is 4 bytes of a row, which fills half of each 32-byte sector it touches (fp32 fills
    it: no conversion, which would need twice the scratch shared memory)."""
    out_dtype: gl.constexpr = ptr.dtype.element_ty
    if out_dtype.primitive_bitwidth == 16:
        row_layout: gl.constexpr = _row_layout(x.shape[0], x.shape[1], 16, gl.num_warps())
        y = gl.convert_layout(x.to(out_dtype), row_layout)
        rows = gl.arange(0, x.shape[0], gl.SliceLayout(1, row_layout))
        cols = gl.arange(0, x.shape[1], gl.SliceLayout(0, row_layout))
    else:
        y = x.to(out_dtype)
        rows = gl.arange(0, x.shape[0], gl.SliceLayout(1, layout))
        cols = gl.arange(0, x.shape[1], gl.SliceLayout(0, layout))
    offs = gl.expand_dims(rows.to(gl.int64) * stride_n, 1) + gl.expand_dims(cols, 0)
    gl.store(ptr + offs, y, mask=gl.expand_dims(rows < n_valid, 1))


@gluon.jit
def _query_tiles(n0, seqlen_q, seqlen_k, qgroup, CAUSAL: gl.constexpr, BM: gl.constexpr):
    """(shift, lo, n_m, total) of key block ``n0``: the bottom-right causal shift, the first query block that
    sees a key of the block (a multiple of BM), the query blocks from it per head, and the tiles of the group."""
    shift = seqlen_k - seqlen_q
    lo = 0
    if CAUSAL:
        lo = (gl.minimum(gl.maximum(n0 - shift, 0), seqlen_q) // BM) * BM
    n_m = gl.cdiv(seqlen_q - lo, BM)
    return shift, lo, n_m, qgroup * n_m


@gluon.jit
def _load_kv(K, V, b64, hk64, n0, n_valid, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
             stride_vd, BN: gl.constexpr, D: gl.constexpr, k_layout: gl.constexpr, v_layout: gl.constexpr):
    """The (BN, D) K and V rows of key block ``n0`` of (batch, kv head), rows past ``n_valid`` as zeros."""
    k = _load_kv_tile(K + b64 * stride_kb + hk64 * stride_kh + n0.to(gl.int64) * stride_kn, stride_kn, 1, n_valid,
                      BN, D, k_layout)
    v = _load_kv_tile(V + b64 * stride_vb + hk64 * stride_vh + n0.to(gl.int64) * stride_vn, stride_vn, stride_vd,
                      n_valid, BN, D, v_layout)
    return k, v


@gluon.jit
def _load_descales(QDs, KDs, VDs, b64, hk64, stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b,
                   stride_vds_h):
    """The (batch, kv head) descales of Q, K and V."""
    qd = gl.load(QDs + b64 * stride_qds_b + hk64 * stride_qds_h)
    kd = gl.load(KDs + b64 * stride_kds_b + hk64 * stride_kds_h)
    vd = gl.load(VDs + b64 * stride_vds_b + hk64 * stride_vds_h)
    return qd, kd, vd


@gluon.jit
def _tile_at(i, n_m, lo, hk, qgroup, BM: gl.constexpr, NUM_STAGES: gl.constexpr):
    """(ring stage, query head, first query row) of tile ``i``: query head ``i // n_m`` of the group, query block
    ``i % n_m`` from ``lo``."""
    return i % NUM_STAGES, hk * qgroup + i // n_m, lo + (i % n_m) * BM


@gluon.jit
def _masked_rows(w_smem, j, rows, seqlen_q, fill, layout: gl.constexpr):
    """Entry ``j`` of the ring's workspace tiles (Delta or the LSE) for query rows ``rows``, ``fill`` from seqlen_q
    on (those entries belong to the next head: ``where``, as 0 * NaN would be NaN)."""
    return gl.where(rows < seqlen_q, w_smem.index(j).load(layout), fill)


@gluon.jit
def _cta_coords(seqlen_k, nheads_k, group_chunk, BN: gl.constexpr, CAUSAL: gl.constexpr):
    """(key block, batch, kv head) of this CTA. Without a mask the grid is (key blocks, batch, kv heads). Under
    CAUSAL it is 1-D over the (batch, kv head) groups ``group_chunk`` at a time: within a chunk the key blocks in
    order (block 0, which the mask leaves the most query tiles, first), each over the chunk's groups, so that the
    heavy CTAs start early and the last ones are light (``backward_launch.group_chunk``)."""
    if CAUSAL:
        pid = gl.program_id(0)
        per_chunk = gl.cdiv(seqlen_k, BN) * group_chunk
        t = pid % per_chunk
        g = (pid // per_chunk) * group_chunk + t % group_chunk
        pid_n = t // group_chunk
        b = g // nheads_k
        hk = g % nheads_k
    else:
        pid_n = gl.program_id(0)
        b = gl.program_id(1)
        hk = gl.program_id(2)
    return pid_n, b, hk


@gluon.jit
def _p_tile(st, keys, rows, lse2, seqlen_k, shift, masked, CAUSAL: gl.constexpr):
    """P^T = exp2(S^T - LSE) of one (keys, query rows) tile (``lse2``: the rows' log2-domain LSE), S^T first set to
    -inf where ``masked`` (a run-time flag, or the constant True) for keys from seqlen_k on, query rows before 0
    and, under CAUSAL, keys past the bottom-right diagonal (``shift``)."""
    if masked:
        keep = gl.expand_dims(keys < seqlen_k, 1) & gl.expand_dims(rows >= 0, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(keys, 1) <= gl.expand_dims(rows + shift, 0))
        st = gl.where(keep, st, float("-inf"))
    return gl.exp2(st - gl.expand_dims(lse2, 0))


@gluon.jit
def _issue_tile(q_desc, do_desc, w_desc, ring, i, n_m, lo, hk, qgroup, b, nheads_q, seqlen_q, ws_lse_off, ws_row,
                BM: gl.constexpr, D: gl.constexpr, NUM_STAGES: gl.constexpr):
    """TMA loads of tile ``i`` (``_tile_at``) into its ring stage: Q, dO, and the rows' Delta and log2-domain LSE
    (``w_desc``: the flat workspace, (batch, head) rows of ``ws_row`` entries, the LSE ``ws_lse_off`` later;
    entries past seqlen_q are masked by the consumer)."""
    q_smem, do_smem, w_smem, ready = ring
    s, hq, m0 = _tile_at(i, n_m, lo, hk, qgroup, BM, NUM_STAGES)
    row = b * seqlen_q + m0
    w_row = (b * nheads_q + hq) * ws_row + m0
    bar = ready.index(s)
    mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, hq * D], bar, q_smem.index(s))
    tma.async_copy_global_to_shared(do_desc, [row, hq * D], bar, do_smem.index(s))
    tma.async_copy_global_to_shared(w_desc, [w_row], bar, w_smem.index(2 * s))
    tma.async_copy_global_to_shared(w_desc, [w_row + ws_lse_off], bar, w_smem.index(2 * s + 1))


@gluon.jit
def _ring_barriers(NUM_STAGES: gl.constexpr):
    """The ring's (ready, empty) mbarriers, one of each per stage, initialized for one arrival: ``ready`` completes
    when a stage's TMA loads landed, ``empty`` when the consumers released it (one arrive per partition)."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


@gluon.jit
def _bwd_loader(descs, ring, empty, n_m, lo, hk, qgroup, b, nheads_q, seqlen_q, ws_lse_off, ws_row, total,
                BM: gl.constexpr, D: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Producer warp of both kernels: tile ``i`` into ring stage ``i % NUM_STAGES`` once the consumers released the
    stage's last tile (its ``empty`` barrier; the first NUM_STAGES waits pass on fresh barriers). ``descs`` and
    ``ring`` are ``_issue_tile``'s, or with the transposed tiles ``_issue_tile_fp8``'s."""
    for i in range(total):
        mbarrier.wait(empty.index(i % NUM_STAGES), ((i // NUM_STAGES) & 1) ^ 1)
        if len(descs) == 3:
            q_desc, do_desc, w_desc = descs
            _issue_tile(q_desc, do_desc, w_desc, ring, i, n_m, lo, hk, qgroup, b, nheads_q, seqlen_q, ws_lse_off,
                        ws_row, BM, D, NUM_STAGES)
        else:
            _issue_tile_fp8(descs, ring, i, n_m, lo, hk, qgroup, b, nheads_q, seqlen_q, ws_lse_off, ws_row,
                            BM, D, NUM_STAGES)


@gluon.jit
def _bwd_consumer(smem, ring, empty, dq_desc, DK, DV, tiles, out_strides, seqlen_q, seqlen_k, dq_row, scales,
                  CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, IS_FP8: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The two warpgroups of ``_bwd_tma_kernel`` (8 warps): every query tile of the ring (``tiles``: b, hk, n0,
    n_valid, shift, lo, n_m, total, qgroup), then dK / dV (``out_strides``: DK's and DV's batch, row and head
    strides; ``scales``: S's log2-domain scale, dQ's, V's descale, dK's)."""
    BM: gl.constexpr = 64
    BN: gl.constexpr = 128
    D: gl.constexpr = HEAD_DIM
    k_smem, qg_smem, kg_smem, vg_smem, ds_smem, dq_smem = smem
    q_smem, do_smem, w_smem, ready = ring
    b, hk, n0, n_valid, shift, lo, n_m, total, qgroup = tiles
    stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh = out_strides
    qk_scale, dq_scale, vd, dk_scale = scales
    g_dtype: gl.constexpr = do_smem.dtype  # dO's 16-bit type: every product but K Q^T runs in it

    st_layout: gl.constexpr = _acc_layout(8, 1, BM)  # S^T, dP^T: (BN keys, BM queries)
    s8_layout: gl.constexpr = _acc_layout(8, 1, BM, 32 if IS_FP8 else 16)  # S^T from the e4m3 wgmma (same registers)
    kv_layout: gl.constexpr = _acc_layout(8, 1, D)  # dK, dV: (BN, D)
    dq_layout: gl.constexpr = _acc_layout(4, 2, D // 2)  # dQ: (BM, D), the warpgroups split the columns
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [8, 1], [1, 0])

    zero_st = gl.zeros([BN, BM], gl.float32, st_layout)
    zero_s8 = gl.zeros([BN, BM], gl.float32, s8_layout)
    zero_dq = gl.zeros([BM, D], gl.float32, dq_layout)
    dk = gl.zeros([BN, D], gl.float32, kv_layout)
    dv = gl.zeros([BN, D], gl.float32, kv_layout)
    keys = n0 + gl.arange(0, BN, gl.SliceLayout(1, st_layout))
    qcols = gl.arange(0, BM, gl.SliceLayout(0, st_layout))
    for i in range(total):
        s, hq, m0 = _tile_at(i, n_m, lo, hk, qgroup, BM, NUM_STAGES)
        mbarrier.wait(ready.index(s), (i // NUM_STAGES) & 1)
        q_buf = q_smem.index(s)
        do_buf = do_smem.index(s)
        st_tok = warpgroup_mma(k_smem, q_buf.permute((1, 0)), zero_s8, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(vg_smem, do_buf.permute((1, 0)), zero_st, use_acc=False, is_async=True)
        if IS_FP8:
            qg_smem.store(_upcast(q_buf.load(ld_layout), g_dtype))
        st = warpgroup_mma_wait(num_outstanding=1, deps=[st_tok])
        st = gl.convert_layout(st, st_layout) * qk_scale
        rows = m0 + qcols
        lse2 = _masked_rows(w_smem, 2 * s + 1, rows, seqlen_q, float("inf"), gl.SliceLayout(0, st_layout))
        need_mask = n0 + BN > seqlen_k
        if CAUSAL:
            need_mask = need_mask | (m0 < n0 + BN - 1 - shift)
        pt = _p_tile(st, keys, rows, lse2, seqlen_k, shift, need_mask, CAUSAL)
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=[dpt_tok])
        delta = _masked_rows(w_smem, 2 * s, rows, seqlen_q, 0.0, gl.SliceLayout(0, st_layout))
        # P^T and dS^T rounded to the 16-bit type before the MMAs (the fp32 tiles die here: fewer live registers
        # than overlapping dV's MMA with dS)
        dst = (pt * (dpt * vd - gl.expand_dims(delta, 0))).to(g_dtype)
        pt_op = gl.convert_layout(pt.to(g_dtype), a_layout)
        ds_smem.store(dst)
        fence_async_shared()
        dv_tok = warpgroup_mma(pt_op, do_buf, dv, is_async=True)
        # the last tile's dQ reduction has read dq_smem (each thread waits for the reductions it started)
        tma.store_wait(0)
        # every warpgroup's dS^T (and the upcast Q) is in shared memory (a barrier of these 8 warps)
        gl.thread_barrier()
        # dQ before dK, so that dK's product runs while dQ is staged and its reduction started
        dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), kg_smem, zero_dq, use_acc=False, is_async=True)
        if IS_FP8:
            dk_tok = warpgroup_mma(gl.convert_layout(dst, a_layout), qg_smem, dk, is_async=True)
        else:
            dk_tok = warpgroup_mma(gl.convert_layout(dst, a_layout), q_buf, dk, is_async=True)
        dv, dq = warpgroup_mma_wait(num_outstanding=1, deps=[dv_tok, dq_tok])
        dq_smem.store(dq * dq_scale)
        fence_async_shared()
        dk = warpgroup_mma_wait(num_outstanding=0, deps=[dk_tok])
        # dq_smem is whole, and every warpgroup is done with this tile's stage, qg and dS^T: the loader may
        # refill the stage, the next tile rewrite the rest
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s))
        _tma_reduce_add(dq_desc, [b * dq_row + m0, hq * D], dq_smem)
    tma.store_wait(0)

    b64 = b.to(gl.int64)
    hk64 = hk.to(gl.int64)
    _store_rows(DK + b64 * stride_dkb + hk64 * stride_dkh + n0.to(gl.int64) * stride_dkn, stride_dkn, n_valid,
                dk * dk_scale, kv_layout)
    _store_rows(DV + b64 * stride_dvb + hk64 * stride_dvh + n0.to(gl.int64) * stride_dvn, stride_dvn, n_valid,
                dv, kv_layout)


@gluon.jit
def _bwd_tma_kernel(q_desc, do_desc, w_desc, dq_desc, K, V, DK, DV, QDs, KDs, VDs,
                    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_vd,
                    stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                    stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
                    ws_lse_off, ws_row, dq_row, seqlen_q, seqlen_k, nheads_q, nheads_k, group_chunk, softmax_scale,
                    CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, IS_FP8: gl.constexpr, V_SEQ_MAJOR: gl.constexpr,
                    NUM_STAGES: gl.constexpr):
    """dK/dV of one key block of one (batch, kv head) (``_cta_coords``), summed over the group's query heads, and
    its dQ parts added by TMA reductions (``dq_desc``).

    ``q_desc`` / ``do_desc``: TMA views (batch * seqlen_q, nheads_q * HEAD_DIM) of Q and dO, boxes of
    (64, HEAD_DIM); ``w_desc``: 1-D view of ``kernels.backward``'s workspace (Delta in (batch, head) rows of
    ``ws_row`` entries, a multiple of 4, the log2-domain LSE ``ws_lse_off`` later), boxes of 64; ``dq_desc``:
    TMA view (batch * dq_row, nheads_q * HEAD_DIM) of the zeroed fp32 dQ accumulator, whose ``dq_row`` rows per
    batch are seqlen_q rounded up to 64 (a tile's box never reaches the next batch; the rows past seqlen_q
    are not read back); K, V, DK, DV: (batch, seqlen_k, nheads_k, HEAD_DIM) with the head dim
    contiguous (any other strides), but V sequence-major under V_SEQ_MAJOR (keys contiguous, ``stride_vd``
    between head-dim columns: the layout ``quantize_qkv`` returns).

    Warp-specialized: after K and V are in shared memory, the 8 warps run ``_bwd_consumer`` and one more warp
    (24 registers) ``_bwd_loader``; they hand the ring's stages over by mbarriers (``ready``: the loads
    landed; ``empty``: the consumers are done with the stage)."""
    gl.static_assert(gl.num_warps() == 8)
    BM: gl.constexpr = q_desc.block_type.shape[0]
    BN: gl.constexpr = 128
    D: gl.constexpr = HEAD_DIM
    gl.static_assert(BM == 64)
    in_dtype: gl.constexpr = q_desc.dtype
    g_dtype: gl.constexpr = do_desc.dtype
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [8, 1], [1, 0])
    if V_SEQ_MAJOR:
        v_layout: gl.constexpr = gl.BlockedLayout([8, 1], [BN // 8, 32 // (BN // 8)], [1, 8], [0, 1])
    else:
        v_layout: gl.constexpr = ld_layout

    pid_n, b, hk = _cta_coords(seqlen_k, nheads_k, group_chunk, BN, CAUSAL)
    n0 = pid_n * BN
    qgroup = nheads_q // nheads_k
    b64 = b.to(gl.int64)
    hk64 = hk.to(gl.int64)

    # --- shared memory: Q / dO ring, the bf16 Q of the current tile, K, V, dS^T, the dQ tile
    q_smem = gl.allocate_shared_memory(in_dtype, [NUM_STAGES, BM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(g_dtype, [NUM_STAGES, BM, D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(in_dtype, [BN, D], _smem_layout(D, in_dtype.primitive_bitwidth))
    if IS_FP8:
        qg_smem = gl.allocate_shared_memory(g_dtype, [BM, D], _smem_layout(D, 16))
        kg_smem = gl.allocate_shared_memory(g_dtype, [BN, D], _smem_layout(D, 16))
    else:
        qg_smem = q_smem.index(0)  # (unused: the 16-bit Q is read from its stage)
        kg_smem = k_smem
    if V_SEQ_MAJOR:
        # keys contiguous, as a sequence-major V arrives: a thread's 8 upcast keys are one 16-byte store (stored
        # key-major, they went one row apart, 16 rows of one swizzle phase, one bank, in each warp's store); the
        # product reads it transposed
        vg_t = gl.allocate_shared_memory(g_dtype, [D, BN], _smem_layout(BN, 16))
        vg_smem = vg_t.permute((1, 0))
    else:
        vg_smem = gl.allocate_shared_memory(g_dtype, [BN, D], _smem_layout(D, 16))
    ds_smem = gl.allocate_shared_memory(g_dtype, [BN, BM], _smem_layout(BM, 16))
    dq_smem = gl.allocate_shared_memory(gl.float32, [BM, D], dq_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.float32, [2 * NUM_STAGES, BM], w_desc.layout)  # (stage, Delta / LSE)
    ready, empty = _ring_barriers(NUM_STAGES)
    ring = (q_smem, do_smem, w_smem, ready)
    smem = (k_smem, qg_smem, kg_smem, vg_smem, ds_smem, dq_smem)

    # --- K and V once (rows past seqlen_k as zeros), upcast copies for the 16-bit products
    shift, lo, n_m, total = _query_tiles(n0, seqlen_q, seqlen_k, qgroup, CAUSAL, BM)
    n_valid = seqlen_k - n0
    k, v = _load_kv(K, V, b64, hk64, n0, n_valid, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                    stride_vd, BN, D, ld_layout, v_layout)
    k_smem.store(k)
    if IS_FP8:
        kg_smem.store(_upcast(k, g_dtype))
    if V_SEQ_MAJOR:
        vg_t.store(gl.permute(_upcast(v, g_dtype), (1, 0)))
    else:
        vg_smem.store(_upcast(v, g_dtype))
    if IS_FP8:
        qd, kd, vd = _load_descales(QDs, KDs, VDs, b64, hk64, stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h,
                                    stride_vds_b, stride_vds_h)
    else:
        qd = 1.0
        kd = 1.0
        vd = 1.0
    scales = (softmax_scale * _LOG2E * qd * kd, softmax_scale * kd, vd, softmax_scale * qd)
    tiles = (b, hk, n0, n_valid, shift, lo, n_m, total, qgroup)
    out_strides = (stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh)
    fence_async_shared()
    gl.thread_barrier()
    # (the constexprs stay written out: a constexpr inside a tuple held in a variable loses its flag)
    gl.warp_specialize([
        (_bwd_consumer, (smem, ring, empty, dq_desc, DK, DV, tiles, out_strides, seqlen_q, seqlen_k, dq_row, scales,
                         CAUSAL, HEAD_DIM, IS_FP8, NUM_STAGES)),
        (_bwd_loader, ((q_desc, do_desc, w_desc), ring, empty, n_m, lo, hk, qgroup, b, nheads_q, seqlen_q,
                       ws_lse_off, ws_row, total, BM, D, NUM_STAGES)),
    ], [1], [_LOADER_REGS])


@gluon.jit
def _issue_tile_fp8(descs, ring, i, n_m, lo, hk, qgroup, b, nheads_q, seqlen_q, ws_lse_off, ws_row,
                    BM: gl.constexpr, D: gl.constexpr, NUM_STAGES: gl.constexpr):
    """``_issue_tile`` of the FP8-matmul kernel: Q and dO as e4m3 row tiles (BM, D) and their transposes (D, BM)
    from ``kernels.backward``'s operand buffers ((batch, head) blocks of D rows), Delta and the LSE."""
    q_desc, qt_desc, do_desc, dot_desc, w_desc = descs
    q_smem, qt_smem, do_smem, dot_smem, w_smem, ready = ring
    s, hq, m0 = _tile_at(i, n_m, lo, hk, qgroup, BM, NUM_STAGES)
    row = b * seqlen_q + m0
    t_row = (b * nheads_q + hq) * D
    w_row = (b * nheads_q + hq) * ws_row + m0
    bar = ready.index(s)
    mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + 2 * qt_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, hq * D], bar, q_smem.index(s))
    tma.async_copy_global_to_shared(do_desc, [row, hq * D], bar, do_smem.index(s))
    tma.async_copy_global_to_shared(qt_desc, [t_row, m0], bar, qt_smem.index(s))
    tma.async_copy_global_to_shared(dot_desc, [t_row, m0], bar, dot_smem.index(s))
    tma.async_copy_global_to_shared(w_desc, [w_row], bar, w_smem.index(2 * s))
    tma.async_copy_global_to_shared(w_desc, [w_row + ws_lse_off], bar, w_smem.index(2 * s + 1))


@gluon.jit
def _e4m3(x, inv_scale):
    """``x * inv_scale`` cast to e4m3 by sm90's ``cvt.rn.satfinite``: it saturates at +-448 and keeps NaN, as
    ``kernels.backward._to_e4m3`` does with explicit min/max (which cost this kernel 1.03-1.11x, docs/decisions.md;
    tests/kernels/test_sm90_compile.py checks the instruction)."""
    return (x * inv_scale).to(gl.float8e4nv)


@gluon.jit
def _zero_parts(rows: gl.constexpr, cols: gl.constexpr, parts: gl.constexpr, layout: gl.constexpr):
    """A tuple of ``parts`` fp32 zero tiles (rows, cols)."""
    out = ()
    for _ in gl.static_range(parts):
        out = out + (gl.zeros([rows, cols], gl.float32, layout),)
    return out


@gluon.jit
def _product(a, buf, j: gl.constexpr, cols: gl.constexpr, layout: gl.constexpr):
    """Start the fresh e4m3 product ``a @ buf[j * cols : (j + 1) * cols]^T`` (``buf``: a transposed (d, rows) tile)."""
    zero = gl.zeros([a.shape[0], cols], gl.float32, layout)
    return warpgroup_mma(a, buf.slice(j * cols, cols).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _add_products(dv, dk, a_pt, a_ds, dot_buf, qt_buf, dv_scale, ds_scale, layout: gl.constexpr):
    """``dv[j] += (P^T dO)[:, part j] * dv_scale`` and ``dk[j] += (dS^T Q)[:, part j] * ds_scale`` for every column
    part j of the tuples ``dv`` / ``dk``: a fresh e4m3 product per part (its own accumulator, one tile deep), each
    started before the previous one's result is scaled and added, so that one product always runs behind the
    additions."""
    PARTS: gl.constexpr = len(dv)
    COLS: gl.constexpr = dv[0].shape[1]
    tok = _product(a_pt, dot_buf, 0, COLS, layout)
    new_dv = ()
    new_dk = ()
    for j in gl.static_range(1, 2 * PARTS):
        if j < PARTS:
            nxt = _product(a_pt, dot_buf, j, COLS, layout)
        else:
            nxt = _product(a_ds, qt_buf, j - PARTS, COLS, layout)
        done = warpgroup_mma_wait(num_outstanding=1, deps=[tok])
        if j - 1 < PARTS:
            new_dv = new_dv + (dv[j - 1] + done * dv_scale,)
        else:
            new_dk = new_dk + (dk[j - 1 - PARTS] + done * ds_scale,)
        tok = nxt
    new_dk = new_dk + (dk[PARTS - 1] + warpgroup_mma_wait(num_outstanding=0, deps=[tok]) * ds_scale,)
    return new_dv, new_dk


@gluon.jit
def _bwd_fp8_consumer(smem, ring, empty, dq_desc, DK, DV, DOs, tiles, out_strides, seqlen_q, seqlen_k, dq_row,
                      nheads_q, scales, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The two warpgroups of ``_bwd_tma_fp8_kernel`` (8 warps): ``_bwd_consumer``'s loop in the FP8-matmul mode
    (``tiles``, ``out_strides`` as there; ``scales``: S's log2-domain scale, dQ's, V's descale, dK's)."""
    BM: gl.constexpr = 64
    BN: gl.constexpr = 128
    D: gl.constexpr = HEAD_DIM
    DP: gl.constexpr = 32  # the columns of dK / dV one e4m3 product per tile covers (docs/decisions.md)
    g_dtype: gl.constexpr = gl.bfloat16
    k_smem, v_smem, kg_smem, ds_smem, dq_smem = smem
    q_smem, qt_smem, do_smem, dot_smem, w_smem, ready = ring
    b, hk, n0, n_valid, shift, lo, n_m, total, qgroup = tiles
    stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh = out_strides
    qk_scale, dq_scale, vd, dk_scale = scales
    st_layout: gl.constexpr = _acc_layout(8, 1, BM, 32)  # S^T, dP^T: (BN keys, BM queries), e4m3 products
    kv_layout: gl.constexpr = _acc_layout(8, 1, DP, 32)  # column parts of dK, dV and of each tile's products
    dq_layout: gl.constexpr = _acc_layout(4, 2, D // 2)  # dQ: (BM, D), the warpgroups split the columns
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=4)

    b64 = b.to(gl.int64)
    n_mt = gl.cdiv(seqlen_q, BM)
    zero_st = gl.zeros([BN, BM], gl.float32, st_layout)
    zero_dq = gl.zeros([BM, D], gl.float32, dq_layout)
    # dK and dV in column parts of DP: each tile's product is added through a temporary as large as one part
    dk = _zero_parts(BN, DP, D // DP, kv_layout)
    dv = _zero_parts(BN, DP, D // DP, kv_layout)
    keys = n0 + gl.arange(0, BN, gl.SliceLayout(1, st_layout))
    qcols = gl.arange(0, BM, gl.SliceLayout(0, st_layout))
    for i in range(total):
        s, hq, m0 = _tile_at(i, n_m, lo, hk, qgroup, BM, NUM_STAGES)
        mbarrier.wait(ready.index(s), (i // NUM_STAGES) & 1)
        st_tok = warpgroup_mma(k_smem, q_smem.index(s).permute((1, 0)), zero_st, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v_smem, do_smem.index(s).permute((1, 0)), zero_st, use_acc=False, is_async=True)
        do_scale = gl.load(DOs + (b64 * nheads_q + hq) * n_mt + m0 // BM)
        st = warpgroup_mma_wait(num_outstanding=1, deps=[st_tok]) * qk_scale
        rows = m0 + qcols
        lse2 = _masked_rows(w_smem, 2 * s + 1, rows, seqlen_q, float("inf"), gl.SliceLayout(0, st_layout))
        # masked on every tile: a branch around the mask keeps both paths' registers (sm90: spills)
        pt = _p_tile(st, keys, rows, lse2, seqlen_k, shift, True, CAUSAL)
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=[dpt_tok])
        delta = _masked_rows(w_smem, 2 * s, rows, seqlen_q, 0.0, gl.SliceLayout(0, st_layout))
        dst = pt * (dpt * (vd * do_scale) - gl.expand_dims(delta, 0))
        pt8 = _e4m3(pt, 256.0)
        ds_amax = gl.maximum(gl.max(gl.abs(dst), axis=1), 1e-30)  # per key row of the tile
        ds8 = _e4m3(dst, gl.expand_dims(448.0 / ds_amax, 1))
        ds_smem.store(dst.to(g_dtype))
        fence_async_shared()
        # the last tile's dQ reduction has read dq_smem; every warpgroup's dS^T is in shared memory
        tma.store_wait(0)
        gl.thread_barrier()
        a_pt = gl.convert_layout(pt8, a_layout)
        a_ds = gl.convert_layout(ds8, a_layout)
        dv_scale = do_scale / 256.0
        ds_scale = gl.expand_dims(gl.convert_layout(ds_amax * (1.0 / 448.0), gl.SliceLayout(1, kv_layout)), 1)
        dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), kg_smem, zero_dq, use_acc=False, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq_tok])
        dq_smem.store(dq * dq_scale)
        fence_async_shared()
        dv, dk = _add_products(dv, dk, a_pt, a_ds, dot_smem.index(s), qt_smem.index(s), dv_scale, ds_scale, kv_layout)
        # dq_smem is whole and every warpgroup is done with the stage and dS^T: the loader may refill the stage
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s))
        _tma_reduce_add(dq_desc, [b * dq_row + m0, hq * D], dq_smem)
    tma.store_wait(0)

    hk64 = hk.to(gl.int64)
    dk_ptr = DK + b64 * stride_dkb + hk64 * stride_dkh + n0.to(gl.int64) * stride_dkn
    dv_ptr = DV + b64 * stride_dvb + hk64 * stride_dvh + n0.to(gl.int64) * stride_dvn
    for j in gl.static_range(D // DP):
        _store_rows(dk_ptr + j * DP, stride_dkn, n_valid, dk[j] * dk_scale, kv_layout)
        _store_rows(dv_ptr + j * DP, stride_dvn, n_valid, dv[j], kv_layout)


@gluon.jit
def _bwd_tma_fp8_kernel(q_desc, qt_desc, do_desc, dot_desc, w_desc, dq_desc, K, V, DK, DV, QDs, KDs, VDs, DOs,
                        stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_vd,
                        stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                        stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
                        ws_lse_off, ws_row, dq_row, seqlen_q, seqlen_k, nheads_q, nheads_k, softmax_scale,
                        CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, V_SEQ_MAJOR: gl.constexpr,
                        NUM_STAGES: gl.constexpr):
    """``_bwd_tma_kernel`` in the FP8-matmul mode, e4m3 Q/K/V: four of the five products on e4m3 operands.

    ``S^T = K Q^T`` and ``dP^T = V dO^T`` read the e4m3 K, V and the row tiles of Q and of dO (scaled by one
    ``DOs`` factor per (batch, head, query tile)); ``dV += P^T dO`` and ``dK += dS^T Q`` take P^T (times 2**8)
    and dS^T (one ``amax / 448`` per key row of the tile) as e4m3 register operands against the transposed
    tiles of dO and Q. Each of those two is a fresh product per tile and column part of 32, scaled and added to
    the fp32 dK / dV in registers (``_add_products``): Hopper's e4m3 accumulator keeps fewer bits than fp32, so
    it never spans more than one tile, and the per-tile scales need it. ``dQ = dS K`` stays a 16-bit product
    (dS rounded to bf16, K upcast exactly): its contraction runs over the key rows, whose dS scales differ.

    ``qt_desc`` / ``dot_desc``: TMA views (batch * nheads_q * HEAD_DIM, seqlen_t) of the transposes (boxes
    (HEAD_DIM, 64); zeros from seqlen_q on); ``DOs``: fp32 (batch, nheads_q, cdiv(seqlen_q, 64)); the rest as in
    ``_bwd_tma_kernel``, warp-specialized the same way (``_bwd_fp8_consumer``, ``_bwd_loader``)."""
    gl.static_assert(gl.num_warps() == 8)
    BM: gl.constexpr = q_desc.block_type.shape[0]
    BN: gl.constexpr = 128
    D: gl.constexpr = HEAD_DIM
    gl.static_assert(BM == 64)
    e4m3: gl.constexpr = gl.float8e4nv
    g_dtype: gl.constexpr = gl.bfloat16
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D // 8), D // 8], [8, 1], [1, 0])
    if V_SEQ_MAJOR:
        # a thread reads 8 keys of one column and stores them one row of v_smem apart: a warp spans 16 columns
        # and 2 key groups, so that its stores hit 2 rows of one swizzle phase (16 key groups would put 16 rows of
        # the same phase, one bank, in each store)
        v_layout: gl.constexpr = gl.BlockedLayout([8, 1], [2, 16], [8, 1], [0, 1])
    else:
        v_layout: gl.constexpr = ld_layout

    pid_n = gl.program_id(0)
    b = gl.program_id(1)
    hk = gl.program_id(2)
    n0 = pid_n * BN
    qgroup = nheads_q // nheads_k
    b64 = b.to(gl.int64)
    hk64 = hk.to(gl.int64)

    q_smem = gl.allocate_shared_memory(e4m3, [NUM_STAGES, BM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(e4m3, [NUM_STAGES, BM, D], do_desc.layout)
    qt_smem = gl.allocate_shared_memory(e4m3, [NUM_STAGES, D, BM], qt_desc.layout)
    dot_smem = gl.allocate_shared_memory(e4m3, [NUM_STAGES, D, BM], dot_desc.layout)
    k_smem = gl.allocate_shared_memory(e4m3, [BN, D], _smem_layout(D, 8))
    v_smem = gl.allocate_shared_memory(e4m3, [BN, D], _smem_layout(D, 8))
    kg_smem = gl.allocate_shared_memory(g_dtype, [BN, D], _smem_layout(D, 16))
    ds_smem = gl.allocate_shared_memory(g_dtype, [BN, BM], _smem_layout(BM, 16))
    dq_smem = gl.allocate_shared_memory(gl.float32, [BM, D], dq_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.float32, [2 * NUM_STAGES, BM], w_desc.layout)
    ready, empty = _ring_barriers(NUM_STAGES)
    descs = (q_desc, qt_desc, do_desc, dot_desc, w_desc)
    ring = (q_smem, qt_smem, do_smem, dot_smem, w_smem, ready)
    smem = (k_smem, v_smem, kg_smem, ds_smem, dq_smem)

    shift, lo, n_m, total = _query_tiles(n0, seqlen_q, seqlen_k, qgroup, CAUSAL, BM)
    n_valid = seqlen_k - n0
    k, v = _load_kv(K, V, b64, hk64, n0, n_valid, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                    stride_vd, BN, D, ld_layout, v_layout)
    k_smem.store(k)
    kg_smem.store(_upcast(k, g_dtype))
    v_smem.store(v)
    qd, kd, vd = _load_descales(QDs, KDs, VDs, b64, hk64, stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h,
                                stride_vds_b, stride_vds_h)
    scales = (softmax_scale * _LOG2E * qd * kd, softmax_scale * kd, vd, softmax_scale * qd)
    tiles = (b, hk, n0, n_valid, shift, lo, n_m, total, qgroup)
    out_strides = (stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh)
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize([
        (_bwd_fp8_consumer, (smem, ring, empty, dq_desc, DK, DV, DOs, tiles, out_strides, seqlen_q, seqlen_k,
                             dq_row, nheads_q, scales, CAUSAL, HEAD_DIM, NUM_STAGES)),
        (_bwd_loader, (descs, ring, empty, n_m, lo, hk, qgroup, b, nheads_q, seqlen_q, ws_lse_off, ws_row, total,
                       BM, D, NUM_STAGES)),
    ], [1], [_LOADER_REGS])
