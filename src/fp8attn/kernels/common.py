"""Shared @triton.jit building blocks: ONE copy of the softmax step, the masks and the epilogues.

Every attention kernel (dense, varlen, paged, split-KV, combine) is built from these helpers and
varies only by constexpr flags. Conventions (docs/numerics.md):

* Logits live in the log2 domain: ``s = (q . k) * qk_scale_log2`` where
  ``qk_scale_log2 = softmax_scale * q_descale * k_descale * log2(e)`` (descales folded, never
  applied in Python after the kernel). With softcap the scale is split: see ``scale_logits``.
* Masked logits are IEEE ``-inf``; a row that has seen no key keeps ``m = -inf`` and is guarded, so
  it produces ``out = 0`` and ``lse = -inf``, never NaN.
* With ``P_FP8`` the probabilities are computed as ``exp2(s - m + P_OFFSET)`` so that they land in
  ``[0, 2**P_OFFSET]`` (inside e4m3's range, max 448) before the cast to e4m3; the row sum carries the
  same factor, so it cancels in ``acc / l`` and is removed from the LSE.
* Two-level accumulation: each tile's ``P @ V`` is a fresh dot whose result is added to the fp32
  accumulator (``acc += dot(p, v)``), so Hopper's reduced-precision FP8 accumulator never spans more
  than one KV tile.
"""
import os

import triton
import triton.language as tl

from .planning import cdiv, next_pow2  # noqa: F401  (host helpers of every launcher)

# Read once at import, as the @triton.jit decorators choose the interpreter then; launchers pass it on
# (a per-call read could disagree with how their kernels were built).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if INTERPRET:  # every kernel module imports this one
    from ._interpret import _interpreter_compat

    _interpreter_compat()

# Globals read inside @triton.jit code must be tl.constexpr (the compiler rejects plain globals;
# only the interpreter accepts them). Use float(X) for host-side arithmetic.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
P_OFFSET_FP8 = tl.constexpr(8.0)  # exp2 offset that puts P in [0, 256] for the e4m3 cast
E4M3_MAX = tl.constexpr(448.0)
_CVT_ASM = tl.constexpr(not INTERPRET)  # the interpreter runs no PTX


@triton.jit
def upcast_fp8_in_place(x):
    """FP8 (e4m3fn / e5m2) tile -> fp16 (exact), converted in the tile's own register layout.

    ``x.to(tl.float16)`` feeding a dot lets the compiler move the cast after the shared-memory read of
    the dot operand. For a tile whose contiguous dim is the dot's N (V rows in FA3's cache layout),
    that read is byte-wise (one shared load per element: the mma fragment pairs elements along K).
    An opaque (non-pure) conversion keeps the cast here, so the operand is read as 16-bit values
    with ldmatrix.trans instead.
    """
    if _CVT_ASM:
        if x.dtype == tl.float8e4nv:
            asm: tl.constexpr = ("{ .reg .b16 a<2>; mov.b32 {a0, a1}, $2; "
                                 "cvt.rn.f16x2.e4m3x2 $0, a0; cvt.rn.f16x2.e4m3x2 $1, a1; }")
        else:
            asm: tl.constexpr = ("{ .reg .b16 a<2>; mov.b32 {a0, a1}, $2; "
                                 "cvt.rn.f16x2.e5m2x2 $0, a0; cvt.rn.f16x2.e5m2x2 $1, a1; }")
        return tl.inline_asm_elementwise(asm, "=r,=r,r", [x.to(tl.int8, bitcast=True)], dtype=tl.float16,
                                         is_pure=False, pack=4)
    else:
        return x.to(tl.float16)


@triton.jit
def scale_logits(qk, qk_scale_log2, softcap, SOFTCAP: tl.constexpr):
    """Raw fp32 dot products -> log2-domain logits.

    Without softcap ``qk_scale_log2`` is the full folded scale. With softcap it is the folded scale
    *without* log2(e) divided by ``softcap`` (i.e. ``scale / softcap``), and the result is
    ``softcap * tanh(qk * scale / softcap) * log2(e)``.
    """
    if SOFTCAP:
        x = qk * qk_scale_log2
        # tanh(x) = 1 - 2 / (exp(2x) + 1), stable for large |x|
        t = 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)
        return t * (softcap * LOG2E)
    else:
        return qk * qk_scale_log2


@triton.jit
def causal_window_mask(s, offs_m, offs_n, seqlen_q, seqlen_k,
                       CAUSAL: tl.constexpr, WINDOW_LEFT, WINDOW_RIGHT, HAS_WINDOW: tl.constexpr):
    """Apply key-length, causal and sliding-window masks (bottom-right aligned) with -inf.

    offs_m: query positions within the sequence's queries; offs_n: key positions. Query i sees keys
    j with j < seqlen_k and, when causal, j <= i + seqlen_k - seqlen_q; with a window, additionally
    i + shift - WINDOW_LEFT <= j <= i + shift + WINDOW_RIGHT (negative bounds mean unbounded).
    """
    shift = seqlen_k - seqlen_q
    # full tile shape from the start: the window bounds are runtime branches, which must not change it
    keep = tl.broadcast_to(offs_n[None, :] < seqlen_k, s.shape)
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= offs_m[:, None] + shift)
    if HAS_WINDOW:
        if WINDOW_LEFT >= 0:
            keep = keep & (offs_n[None, :] >= offs_m[:, None] + shift - WINDOW_LEFT)
        if WINDOW_RIGHT >= 0:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + shift + WINDOW_RIGHT)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q_static, seqlen_k_static, IS_VARLEN: tl.constexpr):
    """(first query row, first key row, seqlen_q, seqlen_k) of sequence b."""
    if IS_VARLEN:
        q_start = tl.load(cu_seqlens_q + b).to(tl.int64)
        k_start = tl.load(cu_seqlens_k + b).to(tl.int64)
        seqlen_q = (tl.load(cu_seqlens_q + b + 1) - tl.load(cu_seqlens_q + b)).to(tl.int32)
        seqlen_k = (tl.load(cu_seqlens_k + b + 1) - tl.load(cu_seqlens_k + b)).to(tl.int32)
    else:
        q_start = tl.zeros((), tl.int64)
        k_start = tl.zeros((), tl.int64)
        seqlen_q = seqlen_q_static
        seqlen_k = seqlen_k_static
    return q_start, k_start, seqlen_q, seqlen_k


@triton.jit
def kv_range(tok_lo, tok_hi, seqlen_q, seqlen_k, window_left, window_right,
             CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) that query rows tok_lo..tok_hi can see (bottom-right aligned causal/window).

    lo is rounded down to a multiple of BLOCK_N (tiles start on BLOCK_N boundaries); hi >= lo.
    Keys inside the range may still be masked per row (causal_window_mask)."""
    shift = seqlen_k - seqlen_q
    hi = seqlen_k
    if CAUSAL:
        hi = tl.minimum(hi, tok_hi + shift + 1)
    lo = 0
    if HAS_WINDOW:
        if window_right >= 0:
            hi = tl.minimum(hi, tok_hi + shift + window_right + 1)
        if window_left >= 0:
            lo = tl.maximum(tok_lo + shift - window_left, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    return lo, hi


@triton.jit
def full_tile_range(tok_lo, tok_hi, seqlen_q, seqlen_k, window_left, window_right,
                    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, lo, hi):
    """Tiles [full_lo, full_hi) of a loop over keys [lo, hi) that need no mask at all.

    Their keys are below seqlen_k and visible to every query row tok_lo..tok_hi (bottom-right
    causal/window). lo must be a multiple of BLOCK_N; the bounds returned are multiples of BLOCK_N with
    lo <= full_lo <= full_hi <= ceil(hi / BLOCK_N) * BLOCK_N, so [lo, full_lo) and [full_hi, hi) are
    the masked tiles.
    """
    shift = seqlen_k - seqlen_q
    full_hi_lim = seqlen_k
    if CAUSAL:
        full_hi_lim = tl.minimum(full_hi_lim, tok_lo + shift + 1)
    full_lo_lim = lo
    if HAS_WINDOW:
        if window_right >= 0:
            full_hi_lim = tl.minimum(full_hi_lim, tok_lo + shift + window_right + 1)
        if window_left >= 0:
            full_lo_lim = tl.maximum(tok_hi + shift - window_left, lo)
    hi_ceil = ((hi + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(((full_lo_lim + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, hi_ceil)
    full_hi = (tl.maximum(full_hi_lim, 0) // BLOCK_N) * BLOCK_N
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi_ceil)
    return tl.multiple_of(full_lo, BLOCK_N), tl.multiple_of(full_hi, BLOCK_N)


@triton.jit
def online_softmax_step(s, m_i, l_i, acc, v, P_FP8: tl.constexpr):
    """One KV tile of the online softmax.

    s: (BLOCK_M, BLOCK_N) fp32 log2-domain logits, -inf where masked.
    m_i, l_i: (BLOCK_M,) fp32 running max / running sum. acc: (BLOCK_M, D) fp32.
    v: (BLOCK_N, D) tile in its storage dtype (fp8 or 16-bit); rows that are masked must already be
    zeroed by the caller's load (other=0) or be finite, because p is exactly 0 there.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    if P_FP8:
        p = tl.exp2(s - m_safe[:, None] + P_OFFSET_FP8)
    else:
        p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if P_FP8:
        acc += tl.dot(p.to(tl.float8e4nv), v)
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def finalize_rows(acc, m_i, l_i, v_descale, P_FP8: tl.constexpr):
    """Normalize the accumulator and compute the natural-log LSE.

    v_descale is folded into the final 1/rowsum. Rows with l == 0 (no visible key) give out = 0 and
    lse = -inf.
    """
    empty = l_i == 0.0
    inv = tl.where(empty, 0.0, v_descale / tl.where(empty, 1.0, l_i))
    out = acc * inv[:, None]
    if P_FP8:
        lse2 = m_i + tl.log2(tl.where(empty, 1.0, l_i)) - P_OFFSET_FP8
    else:
        lse2 = m_i + tl.log2(tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), lse2 * LN2)
    return out, lse


@triton.jit
def output_epilogue(out, out_scale_inv, OUT_FP8: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Cast the fp32 output for storage; with OUT_FP8, the fused static per-tensor FP8 quantization:
    clamp(out / out_scale, -448, 448) cast to e4m3fn (no 16-bit round trip)."""
    if OUT_FP8:
        y = tl.minimum(tl.maximum(out * out_scale_inv, -E4M3_MAX), E4M3_MAX)
        return y.to(tl.float8e4nv)
    else:
        return out.to(OUT_DTYPE)


@triton.jit
def find_seq(CU_Q, target, batch, BLOCK_Q: tl.constexpr, CHUNK: tl.constexpr = 256):
    """Largest i with cu_seqlens[i] // BLOCK_Q + i <= target: the sequence of block ``target`` when sequence i's
    blocks of BLOCK_Q start at ``cu_seqlens[i] // BLOCK_Q + i``. Those starts strictly increase, so the
    answer is the number of starts <= target, minus one: counted CHUNK sequences per vector load, one round
    of independent loads per 256 sequences (a binary search is log2(batch) dependent loads: most of the
    time of a program that then finds nothing to do)."""
    count = 0
    for b0 in range(0, batch, CHUNK):
        i = b0 + tl.arange(0, CHUNK)
        live = i < batch
        start = tl.load(CU_Q + i, mask=live, other=0) // BLOCK_Q + i
        count += tl.sum((live & (start <= target)).to(tl.int32), 0)
    return count - 1


@triton.jit
def fill_varlen_block_list(CuQ, KSrc, Blocks, batch, min_len_q, BM: tl.constexpr, BLOCK_B: tl.constexpr,
                           KEYS_CU: tl.constexpr, ENTRY: tl.constexpr):
    """Writes the varlen block list of the warp-specialized TMA kernel (``dense_launch.varlen_block_list``, whose
    docstring gives the format) from one program: per chunk of BLOCK_B sequences, each one's first list slot
    (a running prefix sum of block counts), then its blocks' entries. Keys from ``KSrc``: cumulative
    offsets (KEYS_CU: varlen K/V) or per-sequence counts (a paged cache, first key row 0)."""
    total = 0
    for b0 in range(0, batch, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B)
        live = bs < batch
        q_row = tl.load(CuQ + bs, mask=live, other=0)
        len_q = tl.load(CuQ + bs + 1, mask=live, other=0) - q_row
        if KEYS_CU:
            k_row = tl.load(KSrc + bs, mask=live, other=0)
            len_k = tl.load(KSrc + bs + 1, mask=live, other=0) - k_row
        else:
            k_row = bs * 0
            len_k = tl.load(KSrc + bs, mask=live, other=0)
        nb = tl.where(live & (len_q >= min_len_q), (len_q + BM - 1) // BM, 0)
        first = total + tl.cumsum(nb, 0) - nb
        for j in range(0, tl.max(nb, 0)):
            e = Blocks + ENTRY * (1 + first + j)
            m = j < nb
            tl.store(e, bs, mask=m)
            tl.store(e + 1, bs * 0 + j, mask=m)
            tl.store(e + 2, q_row, mask=m)
            tl.store(e + 3, len_q, mask=m)
            tl.store(e + 4, k_row, mask=m)
            tl.store(e + 5, len_k, mask=m)
        total += tl.sum(nb, 0)
    tl.store(Blocks, total)
