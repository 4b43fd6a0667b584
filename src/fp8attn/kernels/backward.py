"""Attention backward (FP8 e4m3 or 16-bit Q/K/V) for Hopper: FlashAttention-2's form in Triton.

``launch_attention_bwd`` hands the dense calls with ``deterministic=False`` at head dims 64 and 128 (in the fp8
mode, those with e4m3 Q/K/V) to the Gluon kernels of ``hopper.backward_launch`` (K/V in shared memory, dQ added by
TMA reductions) after the preprocess below (and, in the fp8 mode, ``_fp8_operands_kernel``);
``FP8ATTN_BWD_BACKEND`` (``bwd_backend``) overrides that. The Triton kernels:

1. ``_bwd_preprocess_kernel``: per query row, ``Delta = rowsum(dO * O)`` in fp32 and the LSE moved to
   the log2 domain (``lse * log2(e)``; ``+inf`` for a row that saw no key, so ``exp2(s - lse2) = 0``
   there and the row contributes nothing), into one fp32 workspace; for the Hopper kernel it also zeroes that
   kernel's fp32 dQ accumulator, which ``_dq_convert_kernel`` converts into dq afterwards.
2. ``_bwd_dkdv_kernel``: one program per (key block, batch, kv head); it loops over the query heads of
   the group and their query blocks, so dK/dV are summed over the group in registers. At head dim 256
   (and 192) it runs twice, once per gradient, as both fp32 accumulators do not fit in registers; in the
   ``"fp8"`` mode too (the launcher says why). With ``DO_DQ`` (``_fuse_dq`` says where) it also adds each
   tile's ``dS K`` atomically into fp32 dQ rows: no dQ pass, but the additions come in a varying order.
3. ``_bwd_dq_kernel``: one program per (query block, batch, query head), looping over key blocks; no
   atomics, so its dQ is bit-identical on every rerun (``deterministic=True`` always takes it).

Both main kernels recompute ``P = exp2(s * scale * log2(e) - lse2)`` from Q, K and the saved LSE.

Scales (gradients are with respect to the real values the FP8 tensors represent): with
``s = (q8 . k8) * qd * kd * softmax_scale`` (``qd``, ``kd``, ``vd`` the per-(batch, kv head) descales),
``dP = dO @ V^T = vd * (dO @ v8^T)``, ``dV = P^T @ dO``, ``dK = softmax_scale * qd * (dS^T @ q8)``,
``dQ = softmax_scale * kd * (dS @ k8)``; every descale is a scalar folded into a tile product, so no
dequantized copy of Q/K/V exists anywhere. With softcap (``score = c * tanh(s / c)``) ``dS`` carries the
tanh derivative ``1 - tanh^2``.

Modes (``mode``):

* ``"dequantized"``: ``QK^T`` runs on the e4m3 tiles (exact products, fp32 accumulation); every other
  product upcasts its FP8 operand in registers (e4m3 -> bf16 is exact) and multiplies P with dO in dO's
  dtype and dS with Q/K in bf16 (16-bit inputs: their dtype).
* ``"fp8"``: dO, P and dS are scaled into e4m3 for the four backward GEMMs, with one scale per tile:
  dO per (query block, head) tile, ``448 / amax``; P (in [0, 1]) times ``2**8``, as the forward does,
  so it spans e4m3's normal range down to 2**-6 * 2**-8; dS per (query block x key block) tile,
  ``448 / amax`` (an all-zero tile keeps a finite scale: the amax is floored at 1e-30). All three are
  clamped to +-448 before the cast (``_to_e4m3``): P recomputed from the saved LSE is not bounded by 1
  when the forward's logits or LSE differ from the recomputed ones, and an amax scale can round the
  largest element just past 448. Each tile
  product is a fresh dot multiplied by its scalar scales and added to the fp32 accumulator (two-level
  accumulation: Hopper's reduced-precision FP8 accumulator never spans more than one tile). With
  16-bit Q/K/V (no e4m3 x bf16 MMA) the e4m3 dO/dS are upcast to multiply the 16-bit operands, which
  keeps the same rounding. The Hopper kernel of this mode scales differently (its docstring): dO per (64-row
  query tile, head) as here, P times 2**8, dS per key row of each tile for dK, and dQ's product in bf16.

Layouts (Hopper FP8 wgmma wants its B operand K-major, i.e. contiguous along the contraction):
``K @ Q^T`` (dK/dV pass) and ``Q @ K^T`` (dQ pass) read Q and K with the head dim contiguous, which is
K-major as loaded; ``V @ dO^T`` takes dO's rows (head dim contiguous) K-major too. The other products
contract over the sequence (``P^T @ dO``, ``dS^T @ Q``, ``dS @ K``) and ``dO @ V^T`` with a
sequence-major V: there the compiler stages the operand through shared memory transposed (an e4m3
tile produced in registers, dO8, is written in the order the MMA needs at no extra cost).

Varlen: ``cu_seqlens`` give each sequence's rows; rows past a sequence's end are never read unmasked
(they may hold NaN). Rows of dq/dk/dv that belong to no sequence (after ``cu_seqlens[-1]``) are zeroed
by the launcher (``zero_()`` on the varlen outputs, as the end is not known on the host without a sync).

All offsets are int64.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .common import INTERPRET, LOG2E, causal_window_mask, cdiv, full_tile_range, kv_range, next_pow2, seq_bounds
from .hopper import backward_launch
from .planning import backend_env, window_flags
from .replay import launch

__all__ = ["launch_attention_bwd", "bwd_configs", "table_configs", "MODES", "bwd_backend"]

MODES = ("dequantized", "fp8")
E4M3_MAX = tl.constexpr(448.0)
P_SCALE_FP8 = tl.constexpr(256.0)  # P in [0, 1] -> [0, 256] for the e4m3 cast (the forward's 2**8)
AMAX_FLOOR = tl.constexpr(1e-30)  # an all-zero dO/dS tile keeps a finite scale (zeros stay zeros)

# ---------------------------------------------------------------------------------------------
# Launch configurations: (BLOCK_M, BLOCK_N, num_warps, num_stages) per (head-dim class, fp8 mode), the first
# the untuned default, chosen from sm90 AOT compiles (tools/aot_backward_sm90.py: registers and
# spills). dK/dV holds two (BLOCK_N x d) fp32 accumulators plus the K and V tiles (V upcast to 16 bits in
# the dequantized mode), so its key block shrinks with d; at d256 both together spilled hundreds of words in
# every configuration, so there it runs once per gradient: the dV part and the fp8-mode dK part at
# (32, 64, 8, 1) do not spill, the dequantized dK part still does (its 16-bit V and Q operands). The fp8 mode
# at d256 keeps (64, 64, 8, 2) alone: on an H200 (32, 64, 8, 1) with dQ fused put 2.6x the mode's emulated
# error into dQ (the interpreter did not reproduce it) and was slower (docs/decisions.md). dQ holds one
# (BLOCK_M x d) accumulator. FP8 wgmma needs its K dimension (BLOCK_M in P^T dO and dS^T Q, BLOCK_N in
# dS K) a multiple of 32, and an M of 64 per warpgroup (BLOCK_N for dK/dV).
# ---------------------------------------------------------------------------------------------
_CFGS_DKDV = {
    (64, False): [(64, 64, 4, 3), (64, 128, 8, 2), (32, 128, 4, 3)],
    (64, True): [(64, 64, 4, 3), (64, 128, 8, 2), (32, 128, 4, 3)],
    (128, False): [(32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 2), (64, 64, 8, 2), (64, 128, 8, 2)],
    (128, True): [(64, 64, 8, 2), (32, 128, 8, 2), (64, 128, 8, 2)],
    (256, False): [(32, 64, 8, 1), (64, 64, 8, 2)],
    (256, True): [(64, 64, 8, 2)],
}
_CFGS_DQ = {
    (dcls, fp8): cfgs for fp8 in (False, True) for dcls, cfgs in (
        (64, [(128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)]),
        (128, [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2)]),
        (256, [(64, 32, 4, 2), (64, 64, 8, 1), (64, 64, 8, 2)]))
}
_INTERPRET_CFG = (16, 16, 4, 1)
PRE_BLOCK_M = 64


def _dclass(block_d, block_dv):
    if max(block_d, block_dv) > 128:
        return 256
    return 64 if max(block_d, block_dv) <= 64 else 128


def _cfg(bm, bn, w, s):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)


def bwd_configs(table):
    """Autotune search space of one kernel (union over the table; pruned per launch)."""
    if INTERPRET:
        return [_cfg(*_INTERPRET_CFG)]
    seen = []
    for lst in table.values():
        seen += [c for c in lst if c not in seen]
    return [_cfg(*c) for c in seen]


def table_configs(table, block_d, block_dv, mode_fp8):
    """The configurations of one launch class, default first."""
    return table[(_dclass(block_d, block_dv), bool(mode_fp8))]


def _pruner(table):
    def prune(configs, named_args, **kwargs):
        if INTERPRET:
            return configs[:1]
        want = table_configs(table, kwargs["BLOCK_D"], kwargs["BLOCK_DV"], kwargs["MODE_FP8"])
        out = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in want]
        return out or configs[:1]
    return prune


_AUTOTUNE_KEY = ["BLOCK_D", "BLOCK_DV", "IS_FP8", "MODE_FP8", "CAUSAL", "HAS_WINDOW", "SOFTCAP", "IS_VARLEN",
                 "DO_DK", "DO_DV", "DO_DQ", "seqlen_bucket"]


# ---------------------------------------------------------------------------------------------
# @triton.jit pieces
# ---------------------------------------------------------------------------------------------
@triton.jit
def _load_tile(ptrs, rows, n_rows, cols, n_cols, MASKED: tl.constexpr, EVEN: tl.constexpr):
    """A (rows x cols) tile: MASKED bounds the rows by n_rows, a padded width (not EVEN) the columns by
    n_cols; zeros outside (rows past a sequence may hold NaN, and 0 * NaN = NaN)."""
    if MASKED:
        if EVEN:
            return tl.load(ptrs, mask=(rows < n_rows)[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=(rows < n_rows)[:, None] & (cols[None, :] < n_cols), other=0.0)
    else:
        if EVEN:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)


@triton.jit
def _folded_scales(QDs, KDs, VDs, b64, hk64, stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h,
                   stride_vds_b, stride_vds_h, softmax_scale, softcap, IS_FP8: tl.constexpr, SOFTCAP: tl.constexpr):
    """(logit scale, q descale, k descale, v descale). The logit scale takes raw dot products to log2-domain
    logits; with softcap it stops before the tanh (``qd * kd * softmax_scale / softcap``), see ``_logits``."""
    if IS_FP8:
        qd = tl.load(QDs + b64 * stride_qds_b + hk64 * stride_qds_h)
        kd = tl.load(KDs + b64 * stride_kds_b + hk64 * stride_kds_h)
        vd = tl.load(VDs + b64 * stride_vds_b + hk64 * stride_vds_h)
    else:
        qd = 1.0
        kd = 1.0
        vd = 1.0
    if SOFTCAP:
        qk_scale = softmax_scale / softcap * qd * kd
    else:
        qk_scale = softmax_scale * LOG2E * qd * kd
    return qk_scale, qd, kd, vd


@triton.jit
def _logits(qk, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """(log2-domain logits, tanh factor). With softcap: ``c * tanh(x) * log2(e)`` and ``t = tanh(x)``
    (whose derivative ``1 - t^2`` dS needs); without, ``t`` is an unused 0-d placeholder."""
    if SOFTCAP:
        x = qk * qk_scale
        t = 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)  # tanh(x), stable for large |x|
        return t * (softcap * LOG2E), t
    else:
        return qk * qk_scale, 0.0


@triton.jit
def _to_e4m3(x, inv_scale):
    """Saturating cast of ``x * inv_scale`` to e4m3: every e4m3 operand of the backward goes through here
    (FP8 casts saturate, docs/design.md), so no cast relies on how a backend's conversion treats values
    past 448 (sm90's cvt saturates, a non-saturating conversion gives NaN). NaN stays NaN: the default
    min/max compile to PTX's NaN-dropping ``min.f32``/``max.f32``, which would turn a NaN into -448
    on the GPU only (a bogus finite gradient where the interpreter shows NaN)."""
    y = x * inv_scale
    y = tl.maximum(y, -E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(y, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)


@triton.jit
def _tile_inv_scale(x):
    """``448 / amax(|x|)`` of a tile (amax floored at AMAX_FLOOR)."""
    return E4M3_MAX / tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), AMAX_FLOOR)


@triton.jit
def _mask_t(sT, offs_n, offs_m, seqlen_q, seqlen_k, CAUSAL: tl.constexpr, window_left, window_right,
            HAS_WINDOW: tl.constexpr):
    """``causal_window_mask`` for a transposed (keys x queries) tile; query rows past seqlen_q are left to
    the caller (their lse2 is +inf, so P = 0)."""
    shift = seqlen_k - seqlen_q
    keep = tl.broadcast_to(offs_n[:, None] < seqlen_k, sT.shape)
    if CAUSAL:
        keep = keep & (offs_n[:, None] <= offs_m[None, :] + shift)
    if HAS_WINDOW:
        if window_left >= 0:
            keep = keep & (offs_n[:, None] >= offs_m[None, :] + shift - window_left)
        if window_right >= 0:
            keep = keep & (offs_n[:, None] <= offs_m[None, :] + shift + window_right)
    return tl.where(keep, sT, float("-inf"))


@triton.jit
def _q_range(n0, seqlen_q, seqlen_k, window_left, window_right, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For key block [n0, n0 + BLOCK_N): query rows [lo, hi) that see any of its keys, and the query blocks
    [full_lo, full_hi) that need no mask (all rows valid, every key valid and visible to every row).
    lo, full_lo, full_hi are multiples of BLOCK_M with lo <= full_lo <= full_hi <= ceil(hi / BLOCK_M) * BLOCK_M;
    [lo, full_lo) is the diagonal, [full_hi, hi) the end of the queries / the left window's edge."""
    shift = seqlen_k - seqlen_q
    n_last = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
    lo = 0
    hi = seqlen_q
    full_lo_lim = 0
    full_hi_lim = seqlen_q
    if CAUSAL:
        lo = tl.maximum(lo, n0 - shift)
        full_lo_lim = tl.maximum(full_lo_lim, n0 + BLOCK_N - 1 - shift)
    if HAS_WINDOW:
        if window_right >= 0:
            lo = tl.maximum(lo, n0 - shift - window_right)
            full_lo_lim = tl.maximum(full_lo_lim, n0 + BLOCK_N - 1 - shift - window_right)
        if window_left >= 0:
            hi = tl.minimum(hi, n_last - shift + window_left + 1)
            full_hi_lim = tl.minimum(full_hi_lim, n0 - shift + window_left + 1)
    lo = (tl.minimum(lo, seqlen_q) // BLOCK_M) * BLOCK_M
    hi = tl.maximum(hi, lo)
    hi_ceil = ((hi + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(((tl.maximum(full_lo_lim, lo) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, hi_ceil)
    full_hi = (tl.maximum(full_hi_lim, 0) // BLOCK_M) * BLOCK_M
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi_ceil)
    if n0 + BLOCK_N > seqlen_k:  # a partial key block masks every tile
        full_lo = lo
        full_hi = lo
    return tl.multiple_of(lo, BLOCK_M), hi, tl.multiple_of(full_lo, BLOCK_M), tl.multiple_of(full_hi, BLOCK_M)


@triton.jit
def _bwd_preprocess_kernel(Out, DO, Ws, Lse, cu_seqlens_q,
                           stride_ob, stride_om, stride_oh, stride_od,
                           stride_dob, stride_dom, stride_doh, stride_dod,
                           stride_lb, stride_lh, stride_lm,
                           stride_wb, stride_wh, ws_lse_off,
                           seqlen_q_static, head_dim_v, DQA, stride_ab, stride_am, stride_ah, acc_rows, head_dim,
                           IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
                           ZERO_DQ: tl.constexpr, BLOCK_D: tl.constexpr):
    """Ws[0, row] = rowsum(dO * O) (fp32); Ws[1, row] = lse * log2(e), +inf where lse = -inf. With ZERO_DQ (the
    Hopper kernel's calls) also zeroes rows ``< acc_rows`` of the fp32 dQ accumulator DQA (batch, acc_rows, heads,
    head_dim; unit last stride), which the grid then covers: the backward issues no fill of its own (a torch
    fill would keep its launches from being recorded for replay, ``kernels.replay``)."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    b64 = b.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if ZERO_DQ:
        offs_d = tl.arange(0, BLOCK_D)
        tl.store(DQA + b64 * stride_ab + offs_m.to(tl.int64)[:, None] * stride_am + h * stride_ah + offs_d[None, :],
                 tl.zeros((BLOCK_M, BLOCK_D), tl.float32),
                 mask=(offs_m < acc_rows)[:, None] & (offs_d < head_dim)[None, :])
    q_start, _k, seqlen_q, _s = seq_bounds(cu_seqlens_q, cu_seqlens_q, b, seqlen_q_static, 0, IS_VARLEN)
    if pid_m * BLOCK_M >= seqlen_q:
        return
    m_ok = offs_m < seqlen_q
    tok = q_start + offs_m.to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    msk = m_ok[:, None] & (offs_dv[None, :] < head_dim_v)
    o = tl.load(Out + b64 * stride_ob + tok[:, None] * stride_om + h * stride_oh + offs_dv[None, :] * stride_od,
                mask=msk, other=0.0).to(tl.float32)
    do = tl.load(DO + b64 * stride_dob + tok[:, None] * stride_dom + h * stride_doh + offs_dv[None, :] * stride_dod,
                 mask=msk, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    lse = tl.load(Lse + b64 * stride_lb + h * stride_lh + tok * stride_lm, mask=m_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    w = Ws + b64 * stride_wb + h * stride_wh + tok
    tl.store(w, delta, mask=m_ok)
    tl.store(w + ws_lse_off, lse2, mask=m_ok)


@triton.jit
def _dq_convert_kernel(SRC, DST, stride_sb, stride_sm, stride_sh, stride_db, stride_dm, stride_dh, stride_dd,
                       seqlen_q, head_dim, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """DST[b, m, h, :] = SRC[b, m, h, :] (fp32, unit last stride) in DST's dtype for rows ``m < seqlen_q``: the
    Hopper kernel's dQ accumulator into a dq of another dtype or row count (a torch copy would keep the backward's
    launches from being recorded for replay)."""
    pid_m = tl.program_id(0)
    b64 = tl.program_id(1).to(tl.int64)
    h64 = tl.program_id(2).to(tl.int64)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    msk = (offs_m < seqlen_q)[:, None] & (offs_d < head_dim)[None, :]
    x = tl.load(SRC + b64 * stride_sb + h64 * stride_sh + offs_m[:, None] * stride_sm + offs_d[None, :], mask=msk)
    tl.store(DST + b64 * stride_db + h64 * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :] * stride_dd,
             x.to(DST.dtype.element_ty), mask=msk)


@triton.jit
def _fp8_operands_kernel(DO, Q, DO8, DOT8, QT8, DOs,
                         stride_dob, stride_dom, stride_doh, stride_qb, stride_qm, stride_qh,
                         seqlen_q, seqlen_t, nheads_q,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """The e4m3 operands of the Hopper kernel's FP8-matmul mode, per (query tile, batch, head): dO scaled by one
    ``amax / 448`` per tile (``DOs[b, h, tile]``, amax floored at AMAX_FLOOR) into DO8 (batch, seqlen_q, nheads_q,
    d) and its transpose DOT8 (batch, nheads_q, d, seqlen_t); QT8 the same transpose of Q's e4m3 values. Columns
    ``seqlen_q <= m < seqlen_t`` of the transposes are written as zeros (a TMA box reads them; 0 * NaN = NaN)."""
    pid_m = tl.program_id(0)
    b64 = tl.program_id(1).to(tl.int64)
    h64 = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = (offs_m < seqlen_q)[:, None]
    do = tl.load(DO + b64 * stride_dob + h64 * stride_doh + offs_m[:, None].to(tl.int64) * stride_dom
                 + offs_d[None, :], mask=m_ok, other=0.0).to(tl.float32)
    q = tl.load(Q + b64 * stride_qb + h64 * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
                mask=m_ok, other=0.0)
    amax = tl.maximum(tl.max(tl.max(tl.abs(do), 1), 0), AMAX_FLOOR)
    tl.store(DOs + (b64 * nheads_q + h64) * tl.cdiv(seqlen_q, BLOCK_M) + pid_m, amax / E4M3_MAX)
    do8 = _to_e4m3(do, E4M3_MAX / amax)
    row = (b64 * seqlen_q + offs_m[:, None]) * nheads_q + h64
    tl.store(DO8 + row * HEAD_DIM + offs_d[None, :], do8, mask=m_ok)
    t_ptr = (b64 * nheads_q + h64) * HEAD_DIM * seqlen_t + offs_d[None, :] * seqlen_t + offs_m[:, None]
    t_ok = (offs_m < seqlen_t)[:, None]
    tl.store(DOT8 + t_ptr, do8, mask=t_ok)
    tl.store(QT8 + t_ptr, q, mask=t_ok)


@triton.jit
def _dp_tile(do, do8, do_inv, v, vd, DO_FIRST: tl.constexpr, IS_FP8: tl.constexpr, MODE_FP8: tl.constexpr):
    """dP = dO V^T (DO_FIRST; the dQ pass) or its transpose V dO^T (the dK pass), times the V descale: from
    the e4m3 dO tile ``do8`` (scaled by ``do_inv``) in MODE_FP8, else from the 16-bit ``do``."""
    # (one return: the two orientations have different shapes)
    if MODE_FP8:
        if IS_FP8:
            a = do8
        else:
            a = do8.to(v.dtype)
        if DO_FIRST:
            dp = tl.dot(a, tl.trans(v)) * (vd / do_inv)
        else:
            dp = tl.dot(v, tl.trans(a)) * (vd / do_inv)
    else:
        if DO_FIRST:
            dp = tl.dot(do, tl.trans(v.to(do.dtype))) * vd
        else:
            dp = tl.dot(v.to(do.dtype), tl.trans(do)) * vd
    return dp


@triton.jit
def _ds_tile(p, dp, delta, t, SOFTCAP: tl.constexpr):
    """dS = P * (dP - Delta) (``delta`` broadcast along the key axis), times the softcap's derivative."""
    ds = p * (dp - delta)
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit
def _ds_accumulate(acc, ds, x, DS_DTYPE: tl.constexpr, IS_FP8: tl.constexpr, MODE_FP8: tl.constexpr):
    """acc + dS X (dK += dS^T Q, dQ += dS K): in MODE_FP8 with dS scaled into e4m3 per tile."""
    if MODE_FP8:
        ds_inv = _tile_inv_scale(ds)
        ds8 = _to_e4m3(ds, ds_inv)
        if IS_FP8:
            acc += tl.dot(ds8, x) * (1.0 / ds_inv)
        else:
            acc += tl.dot(ds8.to(x.dtype), x) * (1.0 / ds_inv)
    else:
        acc = tl.dot(ds.to(DS_DTYPE), x.to(DS_DTYPE), acc)
    return acc


@triton.jit
def _ds_accumulate_both(dk, dsT, q, k, DS_DTYPE: tl.constexpr, IS_FP8: tl.constexpr, MODE_FP8: tl.constexpr):
    """(dk + dS^T Q, dS K) from one transposed dS tile ((BLOCK_N, BLOCK_M)), rounded once for both
    products (in MODE_FP8 to e4m3 with one scale per tile); the second is this tile's dQ part, unscaled."""
    if MODE_FP8:
        ds_inv = _tile_inv_scale(dsT)
        ds8 = _to_e4m3(dsT, ds_inv)
        if IS_FP8:
            dk += tl.dot(ds8, q) * (1.0 / ds_inv)
            dq = tl.dot(tl.trans(ds8), k) * (1.0 / ds_inv)
        else:
            dk += tl.dot(ds8.to(q.dtype), q) * (1.0 / ds_inv)
            dq = tl.dot(tl.trans(ds8.to(k.dtype)), k) * (1.0 / ds_inv)
    else:
        ds16 = dsT.to(DS_DTYPE)
        dk = tl.dot(ds16, q.to(DS_DTYPE), dk)
        dq = tl.dot(tl.trans(ds16), k.to(DS_DTYPE))
    return dk, dq


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, w_base, dq_base, ws_lse_off, stride_qm, stride_qd, stride_dom,
                stride_dod, stride_dqm, stride_dqd, offs_n, offs_d, offs_dv, lo, hi, seqlen_q, seqlen_k, head_dim,
                head_dim_v, qk_scale, vd, dq_scale, softcap, window_left, window_right,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                IS_FP8: tl.constexpr, MODE_FP8: tl.constexpr, DS_DTYPE: tl.constexpr,
                EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                DO_DK: tl.constexpr, DO_DV: tl.constexpr, DO_DQ: tl.constexpr):
    """Accumulate one query head's query blocks [lo, hi) into dk, dv ((BLOCK_N, d) fp32, unscaled:
    dk needs ``softmax_scale * qd`` after the loops). MASKED adds the row-bound loads and logit masks.
    DO_DQ (with DO_DK): each tile's ``dS K`` times ``dq_scale`` is added atomically to the fp32 rows at
    ``dq_base``."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        tok = offs_m.to(tl.int64)
        q_ptrs = q_base + tok[:, None] * stride_qm + offs_d[None, :] * stride_qd
        do_ptrs = do_base + tok[:, None] * stride_dom + offs_dv[None, :] * stride_dod
        q = _load_tile(q_ptrs, offs_m, seqlen_q, offs_d, head_dim, MASKED, EVEN_D)
        do = _load_tile(do_ptrs, offs_m, seqlen_q, offs_dv, head_dim_v, MASKED, EVEN_DV)
        if MASKED:
            delta = tl.load(w_base + tok, mask=offs_m < seqlen_q, other=0.0)
            lse2 = tl.load(w_base + ws_lse_off + tok, mask=offs_m < seqlen_q, other=float("inf"))
        else:
            delta = tl.load(w_base + tok)
            lse2 = tl.load(w_base + ws_lse_off + tok)
        # S^T = K Q^T: B = Q^T, contiguous along d (the contraction): K-major as FP8 wgmma needs
        sT, t = _logits(tl.dot(k, tl.trans(q)), qk_scale, softcap, SOFTCAP)
        if MASKED:
            sT = _mask_t(sT, offs_n, offs_m, seqlen_q, seqlen_k, CAUSAL, window_left, window_right, HAS_WINDOW)
        pT = tl.exp2(sT - lse2[None, :])  # (BLOCK_N, BLOCK_M); 0 where masked or lse = -inf
        do8, do_inv = do, 1.0  # (read only in MODE_FP8)
        if MODE_FP8:
            do_inv = _tile_inv_scale(do.to(tl.float32))
            do8 = _to_e4m3(do.to(tl.float32), do_inv)
        if DO_DV:
            if MODE_FP8:
                # dV += P^T dO (contraction over queries: the compiler stores do8 K-major in shared memory)
                # P recomputed from the saved LSE exceeds 1 where the forward's logits or LSE differ
                # from these (another kernel, rounding), so P * 2**8 is clamped like every e4m3 operand
                dv += tl.dot(_to_e4m3(pT, P_SCALE_FP8), do8) * (1.0 / (P_SCALE_FP8 * do_inv))
            else:
                dv = tl.dot(pT.to(do.dtype), do, dv)
        if DO_DK:
            dpT = _dp_tile(do, do8, do_inv, v, vd, False, IS_FP8, MODE_FP8)
            dsT = _ds_tile(pT, dpT, delta[None, :], t, SOFTCAP)
            if DO_DQ:
                dk, dq = _ds_accumulate_both(dk, dsT, q, k, DS_DTYPE, IS_FP8, MODE_FP8)
                dq_ptrs = dq_base + tok[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
                if MASKED:
                    if EVEN_D:
                        dq_mask = (offs_m < seqlen_q)[:, None]
                    else:
                        dq_mask = (offs_m < seqlen_q)[:, None] & (offs_d[None, :] < head_dim)
                    tl.atomic_add(dq_ptrs, dq * dq_scale, mask=dq_mask, sem="relaxed")
                elif EVEN_D:
                    tl.atomic_add(dq_ptrs, dq * dq_scale, sem="relaxed")
                else:
                    tl.atomic_add(dq_ptrs, dq * dq_scale, mask=offs_d[None, :] < head_dim, sem="relaxed")
            else:
                dk = _ds_accumulate(dk, dsT, q, DS_DTYPE, IS_FP8, MODE_FP8)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    ptrs, strides, sizes, scalars, seqlen_bucket,
    IS_FP8: tl.constexpr, MODE_FP8: tl.constexpr, IS_VARLEN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DS_DTYPE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    DO_DK: tl.constexpr, DO_DV: tl.constexpr, DO_DQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The dK/dV pass (with DO_DQ also dQ, added atomically into fp32 rows). Run-time arguments in bundles
    (``launch_attention_bwd`` builds them; triton flattens them into the same parameters in the same order):
    ptrs (Q, K, V, DO, Ws, DK, DV, DQ, QDs, KDs, VDs, cu_seqlens_q, cu_seqlens_k); strides ((q: batch, token,
    head, dim), (k), (v), (do), (workspace: batch, head, LSE offset), (dk), (dv), (dq, fp32; read only with
    DO_DQ), (descales: q batch, q head, k batch, k head, v batch, v head)); sizes (seqlen_q, seqlen_k,
    head_dim, head_dim_v, qgroup); scalars (softmax_scale, softcap, window_left, window_right).
    ``seqlen_bucket`` and the constexprs stay separate: the tuning keys on them."""
    Q, K, V, DO, Ws, DK, DV, DQ, QDs, KDs, VDs, cu_seqlens_q, cu_seqlens_k = ptrs
    stride_qb, stride_qm, stride_qh, stride_qd = strides[0]
    stride_kb, stride_kn, stride_kh, stride_kd = strides[1]
    stride_vb, stride_vn, stride_vh, stride_vd = strides[2]
    stride_dob, stride_dom, stride_doh, stride_dod = strides[3]
    stride_wb, stride_wh, ws_lse_off = strides[4]
    stride_dkb, stride_dkn, stride_dkh, stride_dkd = strides[5]
    stride_dvb, stride_dvn, stride_dvh, stride_dvd = strides[6]
    stride_dqb, stride_dqm, stride_dqh, stride_dqd = strides[7]
    stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h = strides[8]
    seqlen_q_static, seqlen_k_static, head_dim, head_dim_v, qgroup = sizes
    softmax_scale, softcap, window_left, window_right = scalars
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    hk = tl.program_id(2)
    q_start, k_start, seqlen_q, seqlen_k = seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q_static,
                                                       seqlen_k_static, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen_k:
        return
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < seqlen_k
    tok_k = k_start + offs_n.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d[None, :] < head_dim
    dv_ok = offs_dv[None, :] < head_dim_v
    k = tl.load(K + b64 * stride_kb + hk64 * stride_kh + tok_k[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=n_ok[:, None] & d_ok, other=0.0)
    v = tl.load(V + b64 * stride_vb + hk64 * stride_vh + tok_k[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=n_ok[:, None] & dv_ok, other=0.0)
    qk_scale, qd, kd, vd = _folded_scales(QDs, KDs, VDs, b64, hk64, stride_qds_b, stride_qds_h, stride_kds_b,
                                          stride_kds_h, stride_vds_b, stride_vds_h, softmax_scale, softcap,
                                          IS_FP8, SOFTCAP)
    lo, hi, full_lo, full_hi = _q_range(n0, seqlen_q, seqlen_k, window_left, window_right, CAUSAL, HAS_WINDOW,
                                        BLOCK_M, BLOCK_N)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    for g in range(0, qgroup):
        hq64 = hk64 * qgroup + g
        q_base = Q + b64 * stride_qb + hq64 * stride_qh + q_start * stride_qm
        do_base = DO + b64 * stride_dob + hq64 * stride_doh + q_start * stride_dom
        w_base = Ws + b64 * stride_wb + hq64 * stride_wh + q_start
        dq_base = DQ + b64 * stride_dqb + hq64 * stride_dqh + q_start * stride_dqm
        # the diagonal (masked), the fully visible blocks (no masks), the rest (masked): one call each
        for run in tl.static_range(3):
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, w_base, dq_base, ws_lse_off, stride_qm, stride_qd, stride_dom,
                stride_dod, stride_dqm, stride_dqd, offs_n, offs_d, offs_dv,
                lo if run == 0 else full_lo if run == 1 else full_hi,
                full_lo if run == 0 else full_hi if run == 1 else hi,
                seqlen_q, seqlen_k, head_dim, head_dim_v, qk_scale, vd, softmax_scale * kd, softcap, window_left,
                window_right, run != 1, CAUSAL, HAS_WINDOW, SOFTCAP, IS_FP8, MODE_FP8, DS_DTYPE, EVEN_D, EVEN_DV,
                BLOCK_M, DO_DK, DO_DV, DO_DQ)
    if DO_DK:
        dk = dk * (softmax_scale * qd)
        tl.store(DK + b64 * stride_dkb + hk64 * stride_dkh + tok_k[:, None] * stride_dkn
                 + offs_d[None, :] * stride_dkd,
                 dk.to(DK.dtype.element_ty), mask=n_ok[:, None] & d_ok)
    if DO_DV:
        tl.store(DV + b64 * stride_dvb + hk64 * stride_dvh + tok_k[:, None] * stride_dvn
                 + offs_dv[None, :] * stride_dvd,
                 dv.to(DV.dtype.element_ty), mask=n_ok[:, None] & dv_ok)


@triton.jit
def _dq_inner(dq, q, do, do8, do_inv, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
              offs_m, offs_d, offs_dv, lo, hi, seqlen_q, seqlen_k, head_dim, head_dim_v,
              qk_scale, vd, softcap, window_left, window_right,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
              IS_FP8: tl.constexpr, MODE_FP8: tl.constexpr, DS_DTYPE: tl.constexpr,
              EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """Accumulate key blocks [lo, hi) into dq ((BLOCK_M, d) fp32; ``softmax_scale * kd`` applied after)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        tok = offs_n.to(tl.int64)
        k_ptrs = k_base + tok[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + tok[:, None] * stride_vn + offs_dv[None, :] * stride_vd
        k = _load_tile(k_ptrs, offs_n, seqlen_k, offs_d, head_dim, MASKED, EVEN_D)
        v = _load_tile(v_ptrs, offs_n, seqlen_k, offs_dv, head_dim_v, MASKED, EVEN_DV)
        # S = Q K^T: B = K^T, contiguous along d (the contraction): K-major as FP8 wgmma needs
        s, t = _logits(tl.dot(q, tl.trans(k)), qk_scale, softcap, SOFTCAP)
        if MASKED:
            s = causal_window_mask(s, offs_m, offs_n, seqlen_q, seqlen_k, CAUSAL, window_left, window_right,
                                   HAS_WINDOW)
        p = tl.exp2(s - lse2[:, None])
        # dP = dO V^T: B = V^T is K-major when V's head dim is contiguous; a sequence-major V is staged
        # through shared memory transposed by the compiler
        dp = _dp_tile(do, do8, do_inv, v, vd, True, IS_FP8, MODE_FP8)
        ds = _ds_tile(p, dp, delta[:, None], t, SOFTCAP)
        dq = _ds_accumulate(dq, ds, k, DS_DTYPE, IS_FP8, MODE_FP8)
    return dq


@triton.jit
def _bwd_dq_kernel(
    ptrs, strides, sizes, scalars, seqlen_bucket,
    IS_FP8: tl.constexpr, MODE_FP8: tl.constexpr, IS_VARLEN: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, DS_DTYPE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The dQ pass; bundles as ``_bwd_dkdv_kernel``'s with DQ and its strides in place of DK, DV and
    theirs: ptrs (Q, K, V, DO, Ws, DQ, QDs, KDs, VDs, cu_seqlens_q, cu_seqlens_k)."""
    Q, K, V, DO, Ws, DQ, QDs, KDs, VDs, cu_seqlens_q, cu_seqlens_k = ptrs
    stride_qb, stride_qm, stride_qh, stride_qd = strides[0]
    stride_kb, stride_kn, stride_kh, stride_kd = strides[1]
    stride_vb, stride_vn, stride_vh, stride_vd = strides[2]
    stride_dob, stride_dom, stride_doh, stride_dod = strides[3]
    stride_wb, stride_wh, ws_lse_off = strides[4]
    stride_dqb, stride_dqm, stride_dqh, stride_dqd = strides[5]
    stride_qds_b, stride_qds_h, stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h = strides[6]
    seqlen_q_static, seqlen_k_static, head_dim, head_dim_v, qgroup = sizes
    softmax_scale, softcap, window_left, window_right = scalars
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks see the most keys: start them first (less tail at the end)
        pid_m = tl.num_programs(0) - 1 - pid_m
    b = tl.program_id(1)
    hq = tl.program_id(2)
    q_start, k_start, seqlen_q, seqlen_k = seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q_static,
                                                       seqlen_k_static, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    hq64 = hq.to(tl.int64)
    hk64 = hq64 // qgroup
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < seqlen_q
    tok = q_start + offs_m.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d[None, :] < head_dim
    q = tl.load(Q + b64 * stride_qb + hq64 * stride_qh + tok[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=m_ok[:, None] & d_ok, other=0.0)
    do = tl.load(DO + b64 * stride_dob + hq64 * stride_doh + tok[:, None] * stride_dom
                 + offs_dv[None, :] * stride_dod, mask=m_ok[:, None] & (offs_dv[None, :] < head_dim_v), other=0.0)
    w = Ws + b64 * stride_wb + hq64 * stride_wh + tok
    delta = tl.load(w, mask=m_ok, other=0.0)
    lse2 = tl.load(w + ws_lse_off, mask=m_ok, other=float("inf"))
    if MODE_FP8:
        do_inv = _tile_inv_scale(do.to(tl.float32))
        do8 = _to_e4m3(do.to(tl.float32), do_inv)
    else:
        do_inv = 1.0
        do8 = do
    qk_scale, qd, kd, vd = _folded_scales(QDs, KDs, VDs, b64, hk64, stride_qds_b, stride_qds_h, stride_kds_b,
                                          stride_kds_h, stride_vds_b, stride_vds_h, softmax_scale, softcap,
                                          IS_FP8, SOFTCAP)
    tok_hi = tl.minimum(m0 + BLOCK_M - 1, seqlen_q - 1)
    lo, hi = kv_range(m0, tok_hi, seqlen_q, seqlen_k, window_left, window_right, CAUSAL, HAS_WINDOW, BLOCK_N)
    full_lo, full_hi = full_tile_range(m0, tok_hi, seqlen_q, seqlen_k, window_left, window_right,
                                       CAUSAL, HAS_WINDOW, BLOCK_N, lo, hi)
    lo = tl.multiple_of(lo, BLOCK_N)
    k_base = K + b64 * stride_kb + hk64 * stride_kh + k_start * stride_kn
    v_base = V + b64 * stride_vb + hk64 * stride_vh + k_start * stride_vn
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # masked tiles left of the visible ones (left window), the fully visible ones, the masked rest
    for run in tl.static_range(0 if HAS_WINDOW else 1, 3):
        dq = _dq_inner(dq, q, do, do8, do_inv, lse2, delta, k_base, v_base, stride_kn, stride_kd,
                       stride_vn, stride_vd, offs_m, offs_d, offs_dv,
                       lo if run == 0 else full_lo if run == 1 else full_hi,
                       full_lo if run == 0 else full_hi if run == 1 else hi,
                       seqlen_q, seqlen_k, head_dim, head_dim_v, qk_scale, vd, softcap, window_left, window_right,
                       run != 1, CAUSAL, HAS_WINDOW, SOFTCAP, IS_FP8, MODE_FP8, DS_DTYPE, EVEN_D, EVEN_DV, BLOCK_N)
    dq = dq * (softmax_scale * kd)
    tl.store(DQ + b64 * stride_dqb + hq64 * stride_dqh + tok[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok)


def _zero_dq(nargs, reset_only=False):
    """Autotuning reruns a launch: the atomically accumulated dQ starts from zero before every run and
    after the last."""
    if nargs.get("DO_DQ"):
        nargs["ptrs"][7].zero_()


_dkdv_tuned = triton.autotune(configs=bwd_configs(_CFGS_DKDV), key=_AUTOTUNE_KEY, pre_hook=_zero_dq,
                              prune_configs_by={"early_config_prune": _pruner(_CFGS_DKDV)})(_bwd_dkdv_kernel)
_dq_tuned = triton.autotune(configs=bwd_configs(_CFGS_DQ), key=_AUTOTUNE_KEY,
                            prune_configs_by={"early_config_prune": _pruner(_CFGS_DQ)})(_bwd_dq_kernel)

# Best config per (kernel, autotune key) seen by an eager launch: a launch during CUDA-graph capture uses it
# (or the table's default), as autotuning there would time kernels inside the graph.
_TUNED: dict = {}

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------
def _bucket(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length()) if n > 1 else 1


def _launch(plain, tuned, table, grid, args, kwargs):
    """One main-kernel launch: autotuned when eager on a GPU; the cached best or default config during
    CUDA-graph capture, under the interpreter and with FP8ATTN_NO_AUTOTUNE=1."""
    key = (id(table),) + tuple(kwargs[k] for k in _AUTOTUNE_KEY if k in kwargs) + (args[-1],)
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if INTERPRET or capturing or os.environ.get("FP8ATTN_NO_AUTOTUNE", "0") == "1":
        cfg = _INTERPRET_CFG if INTERPRET else _TUNED.get(
            key, table_configs(table, kwargs["BLOCK_D"], kwargs["BLOCK_DV"], kwargs["MODE_FP8"])[0])
        bm, bn, w, st = cfg
        plain[grid](*args, **kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
        return
    tuned[grid](*args, **kwargs)
    best = tuned.best_config
    _TUNED[key] = (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)


def _fuse_dq(dclass, mode, causal):
    """Whether dQ is added atomically in the dK/dV kernel (``deterministic=False``) instead of its own pass.

    Fused, each key block adds its ``dS K`` tiles into fp32 rows, which saves the dQ pass's recomputation
    of S, P and dP; the order of the additions varies, so ``deterministic`` takes the separate pass. Where
    the fused form won in a one-process A/B on an H200 (docs/decisions.md, Backward): the fp8 mode (its dK
    launch computes dS anyway: six products instead of nine) and the dequantized mode at head dim 64 with a
    causal mask. At head dims 128/256 the dequantized dK/dV kernel already holds 255 registers; the dQ
    accumulator and its atomics add spills that cost more than the dQ pass."""
    return mode == "fp8" or (dclass == 64 and causal)


def bwd_backend() -> str:
    """``FP8ATTN_BWD_BACKEND``: ``auto`` (unset: the Hopper kernel where ``hopper.backward_launch`` takes the
    call, else the Triton kernels), ``triton`` (always the Triton kernels) or ``tma`` (the Hopper kernel;
    ValueError naming the reason when it cannot take the call)."""
    return backend_env("FP8ATTN_BWD_BACKEND")


def _fp32_acc(dq, rows=None, zero=True):
    """dQ's fp32 accumulator, zeroed (uninitialized with ``zero=False``: the caller zeroes it): dq itself when it
    is fp32 with its head dim contiguous. ``rows``: the accumulator a TMA view needs instead, (batch, rows,
    nheads, d) contiguous (dq itself only when it is that)."""
    if (rows is None and dq.dtype == torch.float32 and dq.stride(-1) == 1) or (
            rows == dq.shape[1] and dq.dtype == torch.float32 and dq.is_contiguous()):
        return dq.zero_() if zero else dq
    shape = dq.shape if rows is None else (dq.shape[0], rows, *dq.shape[2:])
    return (torch.zeros if zero else torch.empty)(shape, device=dq.device, dtype=torch.float32)


def _fp8_operands(do, q):
    """The Hopper kernel's e4m3 operands in the fp8 mode (``_fp8_operands_kernel``): dO scaled per (query tile,
    head), its transpose, Q's transpose and the scales, for a dense contiguous q and dO of head dim 64 or 128."""
    batch, sq, hq, d = q.shape
    n_mt = cdiv(sq, backward_launch.BLOCK_M)
    st = backward_launch.transposed_len(sq)
    do8 = torch.empty(do.shape, device=do.device, dtype=torch.float8_e4m3fn)
    dot8 = torch.empty(batch, hq, d, st, device=do.device, dtype=torch.float8_e4m3fn)
    qt8 = torch.empty(dot8.shape, device=do.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty(batch, hq, n_mt, device=do.device, dtype=torch.float32)
    launch(_fp8_operands_kernel, (n_mt, batch, hq),
        do, q, do8, dot8, qt8, scales, do.stride(0), do.stride(1), do.stride(2), q.stride(0), q.stride(1),
        q.stride(2), sq, st, hq, HEAD_DIM=d, BLOCK_M=backward_launch.BLOCK_M, num_warps=4)
    return do8, dot8, qt8, scales


def _strides4(t, varlen):
    return (0,) + tuple(t.stride()) if varlen else tuple(t.stride())


def launch_attention_bwd(do, q, k, v, out, lse, dq, dk, dv, *, q_descale, k_descale, v_descale,
                         softmax_scale, causal, window_left, window_right, softcap,
                         cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                         mode="dequantized", deterministic=False) -> None:
    """Attention backward: write dq, dk, dv in place. No validation beyond ``mode`` (the API does that).

    Parameters
    ----------
    do : torch.Tensor
        (batch, seqlen_q, nheads_q, headdim_v) or varlen (total_q, nheads_q, headdim_v); bf16 or fp16.
    q : torch.Tensor
        (batch, seqlen_q, nheads_q, headdim) or varlen (total_q, nheads_q, headdim); float8_e4m3fn,
        bfloat16 or float16; any strides.
    k : torch.Tensor
        (batch, seqlen_k, nheads_k, headdim) or varlen (total_k, nheads_k, headdim); q's dtype;
        nheads_q % nheads_k == 0.
    v : torch.Tensor
        (batch, seqlen_k, nheads_k, headdim_v) or varlen (total_k, nheads_k, headdim_v); q's dtype; any
        strides (sequence-major as ``quantize_qkv`` returns it included).
    out : torch.Tensor
        The forward's output, shape of ``do``, 16-bit.
    lse : torch.Tensor
        float32 natural-log LSE of the forward, (batch, nheads_q, seqlen_q) or varlen (nheads_q, total_q);
        -inf for a row that saw no key (it gets zero gradient).
    dq, dk, dv : torch.Tensor
        Outputs, shapes of q, k, v; float32, bfloat16 or float16. dk/dv are summed over the query heads
        of each group (GQA/MQA). Varlen: zeroed first (rows after ``cu_seqlens[-1]`` stay zero).
    q_descale, k_descale, v_descale : torch.Tensor or None
        float32 (batch, nheads_k) (stride-0 broadcast views allowed) for FP8 inputs; None for 16-bit.
    softmax_scale : float
    causal : bool
        Bottom-right aligned (query i sees keys up to i + seqlen_k - seqlen_q).
    window_left, window_right : int
        Sliding window, bottom-right aligned; -1 is unbounded.
    softcap : float
        0.0 disables; otherwise scores are ``softcap * tanh(s / softcap)``.
    cu_seqlens_q, cu_seqlens_k : torch.Tensor or None
        int32 (batch + 1,): varlen mode when given.
    max_seqlen_q, max_seqlen_k : int or None
        Varlen grid capacity.
    mode : str
        ``"dequantized"`` or ``"fp8"`` (module docstring: which products run in e4m3 and their scales).
    deterministic : bool
        False (default): dQ is added atomically in the dK/dV kernel (fp32, the order of additions varies,
        so reruns may differ in the last bits). True: a separate dQ pass, no atomics, bit-identical reruns.

    Notes
    -----
    No query or no key rows: zero gradients and no launch. Otherwise two launches (preprocess, dK/dV/dQ; three
    at head dim 192/256 and in the fp8 mode, one per gradient for dK and dV), a zeroing of the fp32 dQ
    accumulator and, for a 16-bit dq, its copy; with ``deterministic`` the dQ pass is a launch of its own.
    Where the Hopper kernel takes the call (module docstring): the preprocess (which also zeroes that kernel's dQ
    accumulator), that kernel (no autotuning) and, unless dq is the accumulator, the conversion of dQ into dq
    (``_dq_convert_kernel``); in the fp8 mode ``_fp8_operands_kernel`` before it. Those calls launch through
    ``replay.launch`` and run no torch operation but allocations, so a plan may record and replay them.
    The Triton main kernels autotune per (head dims, dtype, mode, masks, varlen, seqlen bucket) on the first eager
    call; during CUDA-graph capture they use the config an eager call picked, else the table's default
    (``FP8ATTN_NO_AUTOTUNE=1``: always the default).
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}; pass 'dequantized' or 'fp8'")
    if q.numel() == 0 or k.numel() == 0:  # no query or no key rows: every gradient is zero, nothing to launch
        for t in (dq, dk, dv):
            t.zero_()
        return
    varlen = cu_seqlens_q is not None
    is_fp8 = q.dtype == torch.float8_e4m3fn
    d, dv_dim = q.shape[-1], v.shape[-1]
    nheads_q, nheads_k = q.shape[-2], k.shape[-2]
    causal, wl, wr, has_window = window_flags(causal, (window_left, window_right))
    why = "FP8ATTN_BWD_BACKEND=triton"
    backend = bwd_backend()
    if backend != "triton":
        why = backward_launch.bwd_unsupported_reason(do, q, k, v, dq, dk, dv, varlen=varlen, mode=mode,
                                                     deterministic=deterministic, window=has_window,
                                                     softcap=float(softcap) != 0.0)
        if why is not None and backend == "tma":
            raise ValueError(f"FP8ATTN_BWD_BACKEND=tma: the Hopper backward kernel does not take this call: {why}")
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        total_q = q.shape[0]
        sq, sk = int(max_seqlen_q), int(max_seqlen_k)
        ws = torch.empty(2, nheads_q * total_q, device=q.device, dtype=torch.float32)
        w_strides = (0, total_q)
        ls = (0, lse.stride(0), lse.stride(1))
        for t in (dq, dk, dv):
            t.zero_()
    else:
        batch, sq, _, _ = q.shape
        sk = k.shape[1]
        # the Hopper kernel reads each head's rows by TMA from 16-byte aligned starts: rows padded to 4
        sq_ws = backward_launch.ws_row_len(sq) if why is None else sq
        ws = torch.empty(2, batch * nheads_q * sq_ws, device=q.device, dtype=torch.float32)
        w_strides = (nheads_q * sq_ws, sq_ws)
        ls = tuple(lse.stride())
    lse_off = ws.stride(0)
    block_d, block_dv = max(16, next_pow2(d)), max(16, next_pow2(dv_dim))
    dummy = ws
    cu_q = cu_seqlens_q if varlen else dummy
    cu_k = cu_seqlens_k if varlen else dummy

    if why is None:  # the Hopper kernel's fp32 dQ accumulator: rows of whole query tiles (its TMA reductions)
        acc_rows = backward_launch.dq_acc_rows(sq)
        dq_acc = _fp32_acc(dq, acc_rows, zero=False)  # (zeroed by the preprocess)
        zero = (dq_acc, *dq_acc.stride()[:3], acc_rows, d)
    else:
        acc_rows, zero = sq, (dummy, 0, 0, 0, 0, d)
    launch(_bwd_preprocess_kernel, (cdiv(acc_rows, PRE_BLOCK_M), batch, nheads_q),
           out, do, ws, lse, cu_q, *_strides4(out, varlen), *_strides4(do, varlen), *ls, *w_strides, lse_off,
           sq, dv_dim, *zero, IS_VARLEN=varlen, BLOCK_M=PRE_BLOCK_M, BLOCK_DV=block_dv, ZERO_DQ=why is None,
           BLOCK_D=block_d, num_warps=4)
    if why is None:
        scales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, softmax_scale=softmax_scale,
                      causal=causal)
        if mode == "fp8":
            backward_launch.launch_bwd_tma_fp8(*_fp8_operands(do, q), q, k, v, ws, dq_acc, dk, dv, **scales)
        else:
            backward_launch.launch_bwd_tma(do, q, k, v, ws, dq_acc, dk, dv, **scales)
        if dq_acc is not dq:
            launch(_dq_convert_kernel, (cdiv(sq, PRE_BLOCK_M), batch, nheads_q), dq_acc, dq, *dq_acc.stride()[:3],
                   *dq.stride(), sq, d, BLOCK_M=PRE_BLOCK_M, BLOCK_D=block_d, num_warps=4)
        return

    if is_fp8:
        descs = (q_descale, k_descale, v_descale)
        ds_strides = (*q_descale.stride(), *k_descale.stride(), *v_descale.stride())
    else:
        descs = (dummy, dummy, dummy)
        ds_strides = (0,) * 6
    # the kernels' bundles (``_bwd_dkdv_kernel``)
    common_in = (tuple(_strides4(q, varlen)), tuple(_strides4(k, varlen)), tuple(_strides4(v, varlen)),
                 tuple(_strides4(do, varlen)), (*w_strides, lse_off))
    tail = ((sq, sk, d, dv_dim, nheads_q // nheads_k), (float(softmax_scale), float(softcap), wl, wr),
            _bucket(max(sq, sk)))
    kwargs = dict(IS_FP8=is_fp8, MODE_FP8=mode == "fp8", IS_VARLEN=varlen, CAUSAL=bool(causal),
                  HAS_WINDOW=has_window, SOFTCAP=float(softcap) != 0.0,
                  DS_DTYPE=tl.bfloat16 if is_fp8 else _TL_DTYPE[q.dtype],
                  BLOCK_D=block_d, BLOCK_DV=block_dv, EVEN_D=block_d == d, EVEN_DV=block_dv == dv_dim)

    fused = not deterministic and _fuse_dq(_dclass(block_d, block_dv), mode, bool(causal))
    dq_acc = dummy
    if fused:
        dq_acc = dq if varlen and dq.dtype == torch.float32 else _fp32_acc(dq)
    args = ((q, k, v, do, ws, dk, dv, dq_acc, *descs, cu_q, cu_k),
            (*common_in, tuple(_strides4(dk, varlen)), tuple(_strides4(dv, varlen)),
             tuple(_strides4(dq_acc, varlen)) if fused else (0, 0, 0, 0), tuple(ds_strides)), *tail)
    # One launch per gradient, each recomputing P (five GEMMs instead of four): at d256, where the dK and dV
    # accumulators together outgrow the register file (hundreds of spilled words in every configuration),
    # and in the fp8 mode, where the sm90 code of the fused form fed garbage e4m3 operands into dV (NaN or
    # large errors in every configuration at d64/d128 on an H200) while each gradient's own launch is
    # correct (docs/decisions.md, Backward; the GPU grid of tests/kernels/test_kernel_backward.py).
    split = _dclass(block_d, block_dv) == 256 or mode == "fp8"
    for do_dk, do_dv in ((True, False), (False, True)) if split else ((True, True),):
        _launch(_bwd_dkdv_kernel, _dkdv_tuned, _CFGS_DKDV,
                lambda meta: (cdiv(sk, meta["BLOCK_N"]), batch, nheads_k), args,
                dict(kwargs, DO_DK=do_dk, DO_DV=do_dv, DO_DQ=fused and do_dk))
    if fused:
        if dq_acc is not dq:
            dq.copy_(dq_acc)
        return
    args = ((q, k, v, do, ws, dq, *descs, cu_q, cu_k), (*common_in, tuple(_strides4(dq, varlen)), tuple(ds_strides)),
            *tail)
    _launch(_bwd_dq_kernel, _dq_tuned, _CFGS_DQ,
            lambda meta: (cdiv(sq, meta["BLOCK_M"]), batch, nheads_q), args, kwargs)
