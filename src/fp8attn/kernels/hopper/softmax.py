"""The online-softmax step of the Hopper TMA kernels on a wgmma accumulator tile, and the P V product.

``_softmax_tile_f32`` is one step on a raw fp32 S tile; P = exp2(s - m + 8) lies in [0, 256], inside
e4m3's range (max 448), so ``_p_operand`` casts it to the e4m3 A operand of P V without a clamp. Row sums
are taken in fp32, or on the tensor core from the e4m3 P that P V multiplies (``_rowsum_mma`` says when,
``_row_sum_issue`` / ``_row_sum``). ``_pv_quarter`` is the two-level P V product of one head-dim part.
The numerics are those of the Triton kernels (``kernels.common``); ``dense_launch`` describes them.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

__all__ = ["_P_OFFSET", "_kperm_keys", "_softmax_tile_f32", "_rowsum_mma", "_row_sum_issue", "_row_sum", "_p_operand",
           "_pv_quarter"]

# Globals read inside Gluon code must be constexpr.
_P_OFFSET = gl.constexpr(8.0)  # P = exp2(s - m + 8) lands in [0, 256] < 448 (e4m3 max)


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
    0), except the fused e4m3 output at head dim 128; the others sum in fp32, so an LSE is exact. Measured on
    the H200: causal at head dim 128 the sums from the tensor core ran even or slower (more spills), at 64
    faster; with the e4m3 output at head dim 128 slower than fp32 sums (docs/decisions.md)."""
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
def _pv_quarter(acc, p8, v_buf, alpha, o_layout: gl.constexpr):
    """acc * alpha + P @ V_quarter, the product from a zero accumulator (two-level accumulation)."""
    zero_o = gl.zeros(acc.shape, gl.float32, o_layout)
    pv_tok = warpgroup_mma(p8, v_buf.permute((1, 0)), zero_o, use_acc=False, is_async=True)
    acc = acc * gl.expand_dims(alpha, 1)
    pv = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
    return acc + pv
