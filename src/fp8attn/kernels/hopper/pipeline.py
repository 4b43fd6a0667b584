"""The load pipeline of the Hopper TMA kernels: TMA box geometry, the shared-memory rings and their
mbarriers, and a query block's bounds and descales.

K boxes may be key-permuted (``kperm_box_on``: 5-D, each 16 keys' rows in the order of the wgmma
accumulator's columns, so that P needs no cross-lane exchange to become the A operand of P V) or hold
fewer keys than a tile (``box_keys``: up to one page). ``_ws_smem`` allocates the warp-specialized
kernels' rings and initializes their ready / empty barriers.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

__all__ = ["kperm_box_on", "box_keys", "k_smem_layout", "_tile_keys", "_query_block", "_block_scales", "_ws_smem"]


@gluon.constexpr_function
def kperm_box_on(k_box_shape):
    """Whether K's TMA box is key-permuted (``dense_launch.kperm_on``): 5-D, (keys / 16, 2, 4, 2, head dim).
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


@gluon.constexpr_function
def _tile_keys(box_rows, v_rows):
    """Keys per KV tile for K boxes of ``box_rows`` rows: 128 with V in K's layout (V_ROWS: boxes of
    16, 32, 64 or 128 keys, as many per tile as fit), else the box (a V box, sequence-major, is the
    tile: 64 keys for 64-slot pages)."""
    return 128 if v_rows else box_rows


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
def _ws_smem(q_desc, k_desc, v_desc, o_desc, ones_desc, NUM_STAGES: gl.constexpr, HEAD_DIM: gl.constexpr,
             NC: gl.constexpr, BOUNDED: gl.constexpr, V_ROWS: gl.constexpr = False,
             HEAD_DIM_V: gl.constexpr = 0):
    """The warp-specialized kernels' shared memory for NC consumers, mbarriers initialized: ``(q_smem,
    k_smem, v_smem, o_smem, q_ready, q_empty, turn, k_ready, v_ready, k_empty, v_empty, v_raw, v_raw_ready,
    ones, ones_ready, v_clean)``, ``ones`` the tile of ``ones_desc`` (16 x the tile's keys). ``turn`` holds
    the consumers' NC single-arrival turn barriers and, BOUNDED, the V tail barrier ``v_clean`` after them
    (else ``v_clean`` aliases a turn barrier, unused). The partitions read NC from ``q_ready`` (2 NC). Q and its
    barriers: (Q buffer, consumer). V_ROWS (``v_desc`` a box of key rows, as K's): ``v_raw`` is a ring of
    such boxes with TMA barriers ``v_raw_ready``, ``v_smem`` their transposes (else both alias V's).
    HEAD_DIM_V: as ``_ws_loader``'s (qk 192 / v 128: Q and K in three 64-wide boxes, V and O whole)."""
    DHV: gl.constexpr = HEAD_DIM if HEAD_DIM_V == 0 else HEAD_DIM_V
    MH: gl.constexpr = q_desc.block_type.shape[0]
    DQK: gl.constexpr = q_desc.block_type.shape[1]
    TN: gl.constexpr = _tile_keys(box_keys(k_desc.block_type.shape), V_ROWS)
    DV: gl.constexpr = HEAD_DIM if V_ROWS else v_desc.block_type.shape[0]
    NQK: gl.constexpr = HEAD_DIM // DQK  # Q/K boxes per head (256: two 128-wide halves)
    NV: gl.constexpr = DHV // DV  # V/O boxes per head (256: four 64-wide quarters)
    gl.static_assert(MH == 64)
    gl.static_assert(o_desc.block_type.shape[1] == DV)
    if HEAD_DIM == 256:
        gl.static_assert((NQK == 2) and (NV == 4) and (TN == 64))
    elif HEAD_DIM != DHV:
        # qk 192 / v 128: a 192-byte row is no swizzle width, so Q and K go in 64-wide boxes (64-byte swizzle)
        gl.static_assert((HEAD_DIM == 192) and (DHV == 128) and (NQK == 3) and (NV == 1) and (TN == 2 * MH))
        gl.static_assert((not V_ROWS) and (NC == 2))
    else:
        gl.static_assert((NQK == 1) and (NV == 1) and (HEAD_DIM == 64 or HEAD_DIM == 128))
        # one 128-row block = one KV tile: the diagonal tile is the last (the paged kernel masks by
        # bounds and also runs 64-key tiles, for 64-slot pages)
        gl.static_assert(TN == 2 * MH or (BOUNDED and TN == MH) or (NC == 3 and TN == MH))

    # Q: (Q buffer, consumer, box); K: (stage, box); V: (stage, box); O: (consumer, box)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * NC * NQK, MH, DQK], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES * NQK, TN, DQK],
                                       k_smem_layout(k_desc.layout, k_desc.block_type.shape))
    if V_ROWS:
        gl.static_assert(NV == 1)
        v_raw = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, TN, DV], v_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, DV, TN],
                                           gl.NVMMASharedLayout(swizzle_byte_width=TN, element_bitwidth=8,
                                                                rank=2))
    else:
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES * NV, DV, TN], v_desc.layout)
        v_raw = v_smem
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [NC * NV, MH, DV], o_desc.layout)
    ones = gl.allocate_shared_memory(ones_desc.dtype, ones_desc.block_type.shape, ones_desc.layout)
    ones_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [2 * NC, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2 * NC, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NC + BOUNDED, 1], mbarrier.MBarrierLayout())
    v_clean = turn.index(NC + BOUNDED - 1)  # (without BOUNDED a turn barrier, unused)
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
    mbarrier.init(ones_ready, count=1)
    for w in gl.static_range(2 * NC):  # (Q buffer, consumer)
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(q_empty.index(w), count=1)
    for w in gl.static_range(NC + BOUNDED):
        mbarrier.init(turn.index(w), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NC)  # one arrive per consumer
        mbarrier.init(v_empty.index(i), count=NC)
    fence_async_shared()
    gl.thread_barrier()
    return q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, turn, k_ready, v_ready, k_empty, v_empty, v_raw, \
        v_raw_ready, ones, ones_ready, v_clean
