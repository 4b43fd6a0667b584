"""The output epilogues of the Hopper TMA kernels: row normalization, the LSE, the cast for storage
(bf16, or e4m3 through the fused static ``out_scale``) and the TMA or masked row stores.

``_output_epilogue`` and ``_finalize_rows`` replicate the Triton kernels' ``common.output_epilogue`` and
``common.finalize_rows`` operation for operation (same roundings): those helpers are written for
Triton's layout-free tensors and cannot be called from Gluon code.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

from .softmax import _P_OFFSET

__all__ = ["_finalize_rows", "_normalize_rows", "_row_lse", "_store_lse", "_out_scale_inv", "_output_epilogue",
           "_store_rows", "_store_rows_masked"]

# Globals read inside Gluon code must be constexpr.
_LN2 = gl.constexpr(0.6931471805599453)
_E4M3_MAX = gl.constexpr(448.0)


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
