"""Dense + varlen attention forward (FP8 e4m3 or 16-bit Q/K/V) for Hopper: one Triton kernel family.

The kernel is built from the shared helpers in ``kernels/common.py`` (logit scaling, masks, the
online-softmax step, row finalization, output epilogue) and varies by constexpr flags only:
varlen (cu_seqlens), causal, sliding window, softcap, packed GQA, per-block Q/K descales, fused
FP8 output.

Layout of V: Hopper's FP8 ``wgmma`` needs its B operand K-major,
and for ``P @ V`` the contraction runs over the key sequence, so V's tile must have the sequence
dimension contiguous. The kernel reads V through plain pointer loads with arbitrary strides, so it
accepts either layout; ``launch_dense_fwd`` makes a sequence-contiguous copy of an FP8 V whose last
dim is contiguous (``v_kmajor=None``, the default, on CUDA) before the launch. A caller that stores
V that way already (``quantize_qkv``'s v8, or a cache written transposed) passes the view and no copy
is made (the public API accepts V with a contiguous sequence dim). The cost
of the copy and of the in-kernel alternative are measured in ``fp8attn bench dense`` and recorded in
docs/decisions.md.

All offsets are computed in int64.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .common import (
    INTERPRET,
    LOG2E,
    causal_window_mask,
    cdiv,
    finalize_rows,
    full_tile_range,
    kv_range,
    next_pow2,
    online_softmax_step,
    output_epilogue,
    scale_logits,
    seq_bounds,
)
from .hopper import dense_launch
from .planning import backend_env, window_flags
from .replay import launch

__all__ = ["launch_dense_fwd", "dense_fwd_configs", "transpose_v_kmajor", "tma_reason", "dense_backend",
           "wants_kmajor_copy"]


# descale modes (constexpr DESCALE_MODE)
DESCALE_NONE = 0  # 16-bit inputs: no descales
DESCALE_HEAD = 1  # (batch, nheads_k) for q, k, v (stride-0 broadcast views allowed)
DESCALE_BLOCK = 2  # q: (batch, nheads_q, nblocks_q), k: (batch, nheads_k, nblocks_k); v per (batch, nheads_k)


# ---------------------------------------------------------------------------------------------
# Autotune configurations (kept next to the kernel).
# ---------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head-dim class. Chosen from sm90 AOT compiles
# (registers / spills, see docs/decisions.md): at d256 only BLOCK_M=64 with 8 warps avoids
# spilling the (BLOCK_M x 256) fp32 accumulator; the first entry is the untuned default.
_CFGS_FP8 = {
    64: [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3)],
    128: [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3)],
    256: [(64, 64, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2)],
}
_CFGS_16 = {
    64: [(128, 128, 8, 2), (128, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 2)],
    256: [(64, 64, 8, 2), (64, 64, 4, 2)],
}


def _cfg(bm, bn, w, s):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)


def dense_fwd_configs():
    """The autotune search space (union over head dims; ``_prune_configs`` picks per launch)."""
    if INTERPRET:
        return [_cfg(16, 16, 4, 1)]
    seen = []
    for table in (_CFGS_FP8, _CFGS_16):
        for lst in table.values():
            for c in lst:
                if c not in seen:
                    seen.append(c)
    return [_cfg(*c) for c in seen]


def _dclass(block_d, block_dv):
    if block_dv > 128:
        return 256
    return 64 if max(block_d, block_dv) <= 64 else 128


def default_config(block_d, block_dv, is_fp8):
    """The untuned config (used under FP8ATTN_NO_AUTOTUNE=1 and the interpreter)."""
    if INTERPRET:
        return (16, 16, 4, 1)
    table = _CFGS_FP8 if is_fp8 else _CFGS_16
    return table[_dclass(block_d, block_dv)][0]


def _prune_configs(configs, named_args, **kwargs):
    if INTERPRET:
        return configs[:1]
    table = _CFGS_FP8 if kwargs["IS_FP8"] else _CFGS_16
    want = table[_dclass(kwargs["BLOCK_D"], kwargs["BLOCK_DV"])]
    out = [c for c in configs
           if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in want]
    return out or configs[:1]


_AUTOTUNE_KEY = ["BLOCK_D", "BLOCK_DV", "IS_FP8", "CAUSAL", "HAS_WINDOW", "IS_VARLEN", "PACK_GQA",
                 "DESCALE_MODE", "SOFTCAP", "OUT_FP8", "max_seqlen_q_bucket"]


@triton.jit
def _attn_inner(acc, m_i, l_i, q, qrow_scale, k_base, v_base, kds_base,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_kds_blk,
                offs_m, offs_d, offs_dv, lo, hi, seqlen_q, seqlen_k, head_dim, head_dim_v,
                qk_scale, softcap, window_left, window_right, kds_block, kds_tok0,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                SOFTCAP: tl.constexpr, P_FP8: tl.constexpr, DESCALE_MODE: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr):
    """Loop over KV tiles [lo, hi) (multiples of BLOCK_N from lo); MASKED adds load + logit masks."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_n64 = offs_n.to(tl.int64)
        k_ptrs = k_base + offs_n64[None, :] * stride_kn + offs_d[:, None] * stride_kd  # (D, N)
        v_ptrs = v_base + offs_n64[:, None] * stride_vn + offs_dv[None, :] * stride_vd  # (N, DV)
        if MASKED:
            n_ok = offs_n < seqlen_k
            if EVEN_D:
                kt = tl.load(k_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                kt = tl.load(k_ptrs, mask=n_ok[None, :] & (offs_d[:, None] < head_dim), other=0.0)
            if EVEN_DV:
                v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs, mask=n_ok[:, None] & (offs_dv[None, :] < head_dim_v), other=0.0)
        else:
            if EVEN_D:
                kt = tl.load(k_ptrs)
            else:
                kt = tl.load(k_ptrs, mask=offs_d[:, None] < head_dim, other=0.0)
            if EVEN_DV:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=offs_dv[None, :] < head_dim_v, other=0.0)
        qk = tl.dot(q, kt)
        if DESCALE_MODE == 2:
            kblk = (kds_tok0 + offs_n.to(tl.int64)) // kds_block  # varlen: blocks over packed tokens
            if MASKED:
                kcol = tl.load(kds_base + kblk * stride_kds_blk, mask=offs_n < seqlen_k, other=1.0)
            else:
                kcol = tl.load(kds_base + kblk * stride_kds_blk)
            s = scale_logits(qk, qrow_scale[:, None] * kcol[None, :], softcap, SOFTCAP)
        else:
            s = scale_logits(qk, qk_scale, softcap, SOFTCAP)
        if MASKED:
            s = causal_window_mask(s, offs_m, offs_n, seqlen_q, seqlen_k, CAUSAL,
                                   window_left, window_right, HAS_WINDOW)
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v, P_FP8)
    return acc, m_i, l_i


@triton.jit
def _dense_fwd_kernel(
    ptrs, strides, sizes, scalars, max_seqlen_q_bucket,
    IS_FP8: tl.constexpr, P_FP8: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_SEQUSED_Q: tl.constexpr, HAS_SEQUSED_K: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    PACK_GQA: tl.constexpr, DESCALE_MODE: tl.constexpr, OUT_FP8: tl.constexpr,
    OUT_DTYPE: tl.constexpr, WRITE_LSE: tl.constexpr, REVERSE_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The dense / varlen forward. Run-time arguments come in bundles (``_build_launch`` builds them),
    flattened by triton into the same kernel parameters in the same order as separate arguments:
    ptrs (Q, K, V, Out, Lse, QDs, KDs, VDs, OutScale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k);
    strides ((q: batch, token, head, dim), (k), (v), (out), (lse: batch, head, token), (q descale: batch,
    head, block), (k descale), (v descale: batch, head)); sizes (seqlen_q, seqlen_k, nheads_q, nheads_k,
    head_dim, head_dim_v, qgroup); scalars (softmax_scale, softcap, window_left, window_right, qds_block,
    kds_block). ``max_seqlen_q_bucket`` and the constexprs stay separate: the autotuner keys on them."""
    Q, K, V, Out, Lse, QDs, KDs, VDs, OutScale, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = ptrs
    stride_qb, stride_qm, stride_qh, stride_qd = strides[0]
    stride_kb, stride_kn, stride_kh, stride_kd = strides[1]
    stride_vb, stride_vn, stride_vh, stride_vd = strides[2]
    stride_ob, stride_om, stride_oh, stride_od = strides[3]
    stride_lb, stride_lh, stride_lm = strides[4]
    stride_qds_b, stride_qds_h, stride_qds_blk = strides[5]
    stride_kds_b, stride_kds_h, stride_kds_blk = strides[6]
    stride_vds_b, stride_vds_h = strides[7]
    seqlen_q_static, seqlen_k_static, nheads_q, nheads_k, head_dim, head_dim_v, qgroup = sizes
    softmax_scale, softcap, window_left, window_right, qds_block, kds_block = scalars
    pid_m = tl.program_id(0)
    if REVERSE_M:
        pid_m = tl.num_programs(0) - 1 - pid_m
    b = tl.program_id(1)
    h_prog = tl.program_id(2)  # q head, or kv head with PACK_GQA

    # ---- sequence bounds -------------------------------------------------------------------
    q_start, k_start, seqlen_q, seqlen_k = seq_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q_static,
                                                      seqlen_k_static, IS_VARLEN)
    # seqused within [0, the sequence's length] (checked only on the CPU or with validate=True): clamped, as the
    # reference does, so an unchecked value never reaches rows of another sequence
    if HAS_SEQUSED_Q:
        seqlen_q = tl.maximum(tl.minimum(tl.load(seqused_q + b).to(tl.int32), seqlen_q), 0)
    if HAS_SEQUSED_K:
        seqlen_k = tl.maximum(tl.minimum(tl.load(seqused_k + b).to(tl.int32), seqlen_k), 0)

    if PACK_GQA:
        n_rows = seqlen_q * qgroup
        hk = h_prog
    else:
        n_rows = seqlen_q
        hk = h_prog // qgroup
    if pid_m * BLOCK_M >= n_rows:
        return

    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row index inside this (b, head) problem
    if PACK_GQA:
        offs_m = offs_r // qgroup  # query token
        hq = hk * qgroup + offs_r % qgroup  # (BLOCK_M,) query head per row
        tok_lo = (pid_m * BLOCK_M) // qgroup
        tok_hi = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // qgroup, seqlen_q - 1)
    else:
        offs_m = offs_r
        hq = tl.zeros((BLOCK_M,), tl.int32) + h_prog
        tok_lo = pid_m * BLOCK_M
        tok_hi = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, seqlen_q - 1)
    row_ok = offs_r < n_rows
    hq64 = hq.to(tl.int64)
    tok64 = q_start + offs_m.to(tl.int64)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    # ---- Q tile ----------------------------------------------------------------------------
    q_ptrs = Q + b64 * stride_qb + tok64[:, None] * stride_qm + hq64[:, None] * stride_qh \
        + offs_d[None, :] * stride_qd
    if EVEN_D:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)

    # ---- folded scales (the descales enter the logit scale, never applied after the kernel) ----
    if SOFTCAP:
        base_scale = softmax_scale / softcap
    else:
        base_scale = softmax_scale * LOG2E
    v_descale = 1.0
    qrow_scale = tl.zeros((BLOCK_M,), tl.float32) + base_scale
    kds_base = KDs
    if DESCALE_MODE == 1:
        qd = tl.load(QDs + b64 * stride_qds_b + hk64 * stride_qds_h)
        kd = tl.load(KDs + b64 * stride_kds_b + hk64 * stride_kds_h)
        v_descale = tl.load(VDs + b64 * stride_vds_b + hk64 * stride_vds_h)
        qk_scale = base_scale * qd * kd
    elif DESCALE_MODE == 2:
        qblk = (q_start + offs_m.to(tl.int64)) // qds_block  # varlen: blocks over packed tokens
        qrow = tl.load(QDs + b64 * stride_qds_b + hq64 * stride_qds_h + qblk * stride_qds_blk,
                       mask=row_ok, other=1.0)
        qrow_scale = qrow * base_scale
        kds_base = KDs + b64 * stride_kds_b + hk64 * stride_kds_h
        v_descale = tl.load(VDs + b64 * stride_vds_b + hk64 * stride_vds_h)
        qk_scale = base_scale
    else:
        qk_scale = base_scale

    # ---- KV range for this tile (bottom-right aligned masks) -------------------------------
    lo, hi = kv_range(tok_lo, tok_hi, seqlen_q, seqlen_k, window_left, window_right, CAUSAL, HAS_WINDOW, BLOCK_N)
    # fully visible tiles [full_lo, full_hi): no load or logit masks. Every loop start is a multiple
    # of BLOCK_N (the hints let the pipeliner issue aligned async copies of the sequence-contiguous V
    # tile; without them V's loads are not pipelined)
    full_lo, full_hi = full_tile_range(tok_lo, tok_hi, seqlen_q, seqlen_k, window_left, window_right,
                                       CAUSAL, HAS_WINDOW, BLOCK_N, lo, hi)
    lo = tl.multiple_of(lo, BLOCK_N)

    k_base = K + b64 * stride_kb + k_start * stride_kn + hk64 * stride_kh
    v_base = V + b64 * stride_vb + k_start * stride_vn + hk64 * stride_vh

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)

    # Three runs of KV tiles: masked ones left of the fully visible tiles (only with a left window), the
    # fully visible ones (no masks), the masked rest (the diagonal, the keys' end); unrolled, one call each.
    for run in tl.static_range(0 if HAS_WINDOW else 1, 3):
        acc, m_i, l_i = _attn_inner(
            acc, m_i, l_i, q, qrow_scale, k_base, v_base, kds_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_kds_blk, offs_m, offs_d, offs_dv,
            lo if run == 0 else full_lo if run == 1 else full_hi, full_lo if run == 0 else full_hi if run == 1 else hi,
            seqlen_q, seqlen_k, head_dim, head_dim_v, qk_scale, softcap, window_left, window_right, kds_block,
            k_start, run != 1, CAUSAL, HAS_WINDOW, SOFTCAP, P_FP8, DESCALE_MODE,
            BLOCK_N, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV)

    # ---- epilogue --------------------------------------------------------------------------
    out, lse = finalize_rows(acc, m_i, l_i, v_descale, P_FP8)
    if OUT_FP8:
        out_scale_inv = 1.0 / tl.load(OutScale)
    else:
        out_scale_inv = 1.0
    o = output_epilogue(out, out_scale_inv, OUT_FP8, OUT_DTYPE)
    o_ptrs = Out + b64 * stride_ob + tok64[:, None] * stride_om + hq64[:, None] * stride_oh \
        + offs_dv[None, :] * stride_od
    if EVEN_DV:
        tl.store(o_ptrs, o, mask=row_ok[:, None])
    else:
        tl.store(o_ptrs, o, mask=row_ok[:, None] & (offs_dv[None, :] < head_dim_v))
    if WRITE_LSE:
        l_ptrs = Lse + b64 * stride_lb + hq64 * stride_lh + tok64 * stride_lm
        tl.store(l_ptrs, lse, mask=row_ok)


_dense_fwd_tuned = triton.autotune(
    configs=dense_fwd_configs(), key=_AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": _prune_configs},
)(_dense_fwd_kernel)


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
             torch.float8_e4m3fn: tl.float8e4nv}


@triton.jit
def _transpose_sd_kernel(X, Y, seqlen, head_dim, stride_xb, stride_xs, stride_xh, stride_yb, stride_yh,
                         stride_yd, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Y[b, h, d, s] = X[b, s, h, d] for one (BLOCK_S x BLOCK_D) tile."""
    pid_s = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    offs_s = (pid_s * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    m = (offs_s[:, None] < seqlen) & (offs_d[None, :] < head_dim)
    x = tl.load(X + b * stride_xb + offs_s[:, None] * stride_xs + h * stride_xh + offs_d[None, :], mask=m)
    tl.store(Y + b * stride_yb + h * stride_yh + offs_d[None, :] * stride_yd + offs_s[:, None], x, mask=m)


def transpose_v_kmajor(v: torch.Tensor) -> torch.Tensor:
    """Copy V so that its sequence dimension is contiguous; return a view with V's logical shape.

    One Triton pass on CUDA (a torch permute-copy elsewhere).

    Parameters
    ----------
    v : torch.Tensor
        (batch, seqlen_k, nheads_k, headdim_v) or varlen (total_k, nheads_k, headdim_v), any dtype,
        last dim contiguous.

    Returns
    -------
    torch.Tensor
        Same shape and values as ``v``; memory order (batch, nheads_k, headdim_v, seqlen_k)
        (varlen: (nheads_k, headdim_v, total_k)), i.e. ``stride(-3) == 1``.
    """
    v4 = v.unsqueeze(0) if v.dim() == 3 else v
    if not v.is_cuda or v4.stride(-1) != 1:
        y = v4.permute(0, 2, 3, 1).contiguous()
    else:
        b, s, h, d = v4.shape
        y = torch.empty(b, h, d, s, device=v.device, dtype=v.dtype)
        bd = max(16, next_pow2(d))
        bs = 64 if bd <= 128 else 32
        grid = (cdiv(s, bs), b, h)
        launch(_transpose_sd_kernel, grid, v4.view(torch.uint8) if v.element_size() == 1 else v4,
                                   y.view(torch.uint8) if v.element_size() == 1 else y,
                                   s, d, v4.stride(0), v4.stride(1), v4.stride(2),
                                   y.stride(0), y.stride(1), y.stride(2), BLOCK_S=bs, BLOCK_D=bd, num_warps=4)
    out = y.permute(0, 3, 1, 2)
    return out.squeeze(0) if v.dim() == 3 else out


def _bucket(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length()) if n > 1 else 1


def launch_dense_fwd(q, k, v, out, lse, *, softmax_scale, causal, window_size, softcap,
                     q_descale, k_descale, v_descale, out_scale=None,
                     cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                     max_seqlen_q=None, max_seqlen_k=None, pack_gqa=False,
                     descale_block_q=None, descale_block_k=None, v_kmajor=None):
    """Launch the dense/varlen forward kernel. No validation, no defaults (the API does that).

    Parameters
    ----------
    q : torch.Tensor
        (batch, seqlen_q, nheads_q, headdim) or varlen (total_q, nheads_q, headdim); float8_e4m3fn,
        bfloat16 or float16; last dim contiguous (other strides arbitrary).
    k : torch.Tensor
        (batch, seqlen_k, nheads_k, headdim) or varlen (total_k, nheads_k, headdim), dtype of q.
        nheads_q % nheads_k == 0.
    v : torch.Tensor
        (batch, seqlen_k, nheads_k, headdim_v) or varlen (total_k, nheads_k, headdim_v), dtype of q.
        Either the last dim or the sequence dim is contiguous (see module docstring).
    out : torch.Tensor
        (batch, seqlen_q, nheads_q, headdim_v) or varlen (total_q, nheads_q, headdim_v); bf16, fp16,
        fp32, or float8_e4m3fn when ``out_scale`` is given. Written in place.
    lse : torch.Tensor or None
        float32 (batch, nheads_q, seqlen_q) or varlen (nheads_q, total_q); natural-log LSE, -inf for
        rows that see no key. Written in place when given.
    softmax_scale : float
    causal : bool
        Bottom-right aligned causal mask.
    window_size : tuple[int, int]
        (left, right) sliding window; -1 is unbounded.
    softcap : float
        0.0 disables; otherwise logits are ``softcap * tanh(logits / softcap)``.
    q_descale, k_descale, v_descale : torch.Tensor or None
        float32 (batch, nheads_k) (stride-0 broadcast views allowed); None for 16-bit inputs.
        Per-block mode (``descale_block_q``/``descale_block_k`` given): q_descale is float32
        (batch, nheads_q, cdiv(seqlen_q, descale_block_q)) and k_descale float32
        (batch, nheads_k, cdiv(seqlen_k, descale_block_k)); for varlen, batch is 1 and the block
        index counts packed tokens of the whole batch. v_descale stays (batch, nheads_k).
    out_scale : torch.Tensor or None
        float32 scalar tensor (numel 1): fused static FP8 output ``clamp(out / out_scale)`` to e4m3.
    cu_seqlens_q, cu_seqlens_k : torch.Tensor or None
        int32 (batch + 1,): varlen mode when given.
    seqused_q, seqused_k : torch.Tensor or None
        int32 (batch,): number of used tokens per sequence (overrides the cu_seqlens length).
    max_seqlen_q, max_seqlen_k : int or None
        Grid capacity in varlen mode.
    pack_gqa : bool
        Pack the query heads that share a KV head into the M dimension of one tile.
    descale_block_q, descale_block_k : int or None
        Token block sizes of per-block descales.
    v_kmajor : bool or None
        None: make a sequence-contiguous copy of FP8 V when needed (CUDA only). True: always make
        it. False: read V as given.

    Notes
    -----
    Autotuning runs on the first call per key (head dims, dtype, flags, seqlen bucket); set
    ``FP8ATTN_NO_AUTOTUNE=1`` to use the default config (e.g. before CUDA-graph capture without a
    warm-up call).

    Inputs that ``dense_launch.supported`` accepts (e4m3 in, bf16 out or e4m3 out with out_scale, head dim
    64, 128 or 256, or qk 192 / v 128 with bf16 out unless ``FP8ATTN_TMA_QK192=0``, lengths that are
    multiples of 128, per-(batch, kv head) descales, no window/softcap; varlen at head dims 64 and 128 and
    qk 192 / v 128, taken by default where ``dense_launch.varlen_preferred``; see there)
    run on the TMA/wgmma kernel of ``hopper.dense_launch`` instead. ``FP8ATTN_DENSE_BACKEND`` selects:
    unset or ``auto`` (that rule), ``triton`` (always this module's kernel), ``tma`` (the TMA kernel;
    ValueError naming the reason when the inputs are not supported).
    """
    backend = dense_backend()
    if backend != "triton":
        if cu_seqlens_q is None:  # (varlen: the TMA kernel lays V out itself, dense_launch.varlen_v_kmajor)
            v = _kmajor_v(v, q.dtype == torch.float8_e4m3fn, v_kmajor)  # _build_launch then leaves it as is
        why = tma_reason(q, k, v, out, lse, causal=causal, window_size=window_size, softcap=softcap,
                         q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_scale=out_scale,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                         seqused_k=seqused_k, max_seqlen_q=max_seqlen_q, descale_block_q=descale_block_q,
                         descale_block_k=descale_block_k, backend=backend)
        if why is None:
            return dense_launch.launch_dense_fwd_tma(
                q, k, v, out, lse, softmax_scale=softmax_scale, causal=window_flags(causal, window_size)[0],
                q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_scale=out_scale,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        if backend == "tma":
            raise ValueError(f"FP8ATTN_DENSE_BACKEND=tma: the TMA kernel does not support these inputs: {why}")
    args, kwargs, grid = _build_launch(
        q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
        out_scale=out_scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        seqused_q=seqused_q, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, pack_gqa=pack_gqa, descale_block_q=descale_block_q,
        descale_block_k=descale_block_k, v_kmajor=v_kmajor)
    if INTERPRET or os.environ.get("FP8ATTN_NO_AUTOTUNE", "0") == "1":
        bm, bn, w, st = default_config(kwargs["BLOCK_D"], kwargs["BLOCK_DV"], kwargs["IS_FP8"])
        launch(_dense_fwd_kernel, grid, *args, **kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
    else:
        launch(_dense_fwd_tuned, grid, *args, **kwargs)
    return out, lse


def dense_backend() -> str:
    """``FP8ATTN_DENSE_BACKEND``: auto (unset), triton or tma (see ``launch_dense_fwd``)."""
    return backend_env("FP8ATTN_DENSE_BACKEND")


def tma_reason(q, k, v, out, lse, *, causal, window_size, softcap, q_descale, k_descale, v_descale, out_scale,
               cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, descale_block_q, descale_block_k,
               backend, capability=None):
    """Why ``launch_dense_fwd`` keeps a call on this module's Triton kernel, or None when the TMA kernel of
    ``hopper.dense_launch`` takes it: THE rule of the dense dispatch (``fp8attn.capability.supports`` asks it too).

    Arguments are ``launch_dense_fwd``'s, with ``v`` as the kernels read it (after ``_kmajor_v``) and
    ``backend`` from ``dense_backend()``; ``capability``: as ``dense_launch.unsupported_reason``.
    """
    if backend == "triton":
        return "FP8ATTN_DENSE_BACKEND=triton"
    if seqused_q is not None or seqused_k is not None:
        return "seqused_q/seqused_k are not supported"
    if backend == "auto" and cu_seqlens_q is not None and not dense_launch.varlen_preferred(q.shape[-1], max_seqlen_q):
        return "varlen: the Triton kernel is the faster one for these shapes (dense_launch.varlen_preferred)"
    return dense_launch.unsupported_reason(
        q, k, v, out, causal=causal, window_size=window_size, softcap=softcap, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, out_scale=out_scale, cu_seqlens_q=cu_seqlens_q,
        descale_block_q=descale_block_q, descale_block_k=descale_block_k, lse=lse, cu_seqlens_k=cu_seqlens_k,
        capability=capability)


def wants_kmajor_copy(v, is_fp8, v_kmajor, on_cuda) -> bool:
    """Whether ``_kmajor_v`` copies ``v`` into the sequence-contiguous layout (``v_kmajor`` None: FP8 V on
    CUDA whose head dim is contiguous)."""
    if v_kmajor is None:
        v_kmajor = is_fp8 and on_cuda and v.stride(-1) == 1 and v.shape[-3] > 1
    return bool(v_kmajor) and v.stride(-3) != 1


def _kmajor_v(v, is_fp8, v_kmajor):
    """V as the kernels read it: a sequence-contiguous copy (``transpose_v_kmajor``) when ``v_kmajor``
    asks for one (None: for FP8 V on CUDA whose head dim is contiguous), else V as given."""
    return transpose_v_kmajor(v) if wants_kmajor_copy(v, is_fp8, v_kmajor, v.is_cuda) else v


def _build_launch(q, k, v, out, lse, *, softmax_scale, causal, window_size, softcap,
                  q_descale, k_descale, v_descale, out_scale, cu_seqlens_q, cu_seqlens_k,
                  seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, pack_gqa,
                  descale_block_q, descale_block_k, v_kmajor):
    """Positional args, constexpr kwargs and grid of one launch (also used for AOT inspection)."""
    varlen = cu_seqlens_q is not None
    is_fp8 = q.dtype == torch.float8_e4m3fn
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        total_q, nheads_q, d = q.shape
        nheads_k = k.shape[1]
        dv = v.shape[-1]
        sq_static = int(max_seqlen_q)
        sk_static = int(max_seqlen_k)
        qs = (0, q.stride(0), q.stride(1), q.stride(2))
        ks = (0, k.stride(0), k.stride(1), k.stride(2))
        os_ = (0, out.stride(0), out.stride(1), out.stride(2))
        ls = (0, lse.stride(0), lse.stride(1)) if lse is not None else (0, 0, 0)
    else:
        batch, sq_static, nheads_q, d = q.shape
        sk_static = k.shape[1]
        nheads_k = k.shape[2]
        dv = v.shape[-1]
        qs = q.stride()
        ks = k.stride()
        os_ = out.stride()
        ls = lse.stride() if lse is not None else (0, 0, 0)
    v = _kmajor_v(v, is_fp8, v_kmajor)
    vs = (0,) + tuple(v.stride()) if varlen else tuple(v.stride())

    qgroup = nheads_q // nheads_k
    pack = bool(pack_gqa) and qgroup > 1
    per_block = descale_block_q is not None or descale_block_k is not None
    if not is_fp8 and q_descale is None:
        mode = DESCALE_NONE
    else:
        mode = DESCALE_BLOCK if per_block else DESCALE_HEAD
    dummy = out  # never read when its flag is off
    if mode == DESCALE_NONE:
        QDs = KDs = VDs = dummy
        qds = kds = (0, 0, 0)
        vds = (0, 0)
    else:
        QDs, KDs, VDs = q_descale, k_descale, v_descale
        if mode == DESCALE_HEAD:
            qds = tuple(q_descale.stride()) + (0,)
            kds = tuple(k_descale.stride()) + (0,)
        else:
            qds = tuple(q_descale.stride())
            kds = tuple(k_descale.stride())
            if cu_seqlens_q is not None:  # varlen per-block descales are (1, heads, nblocks) over packed tokens
                qds, kds = (0,) + qds[1:], (0,) + kds[1:]
        vds = tuple(v_descale.stride())
    if out_scale is not None and not torch.is_tensor(out_scale):
        out_scale = torch.tensor([float(out_scale)], device=q.device, dtype=torch.float32)

    causal, wl, wr, has_window = window_flags(causal, window_size)
    block_d = max(16, next_pow2(d))
    block_dv = max(16, next_pow2(dv))
    rows = sq_static * (qgroup if pack else 1)
    heads_grid = nheads_k if pack else nheads_q

    def grid(meta):
        return (cdiv(rows, meta["BLOCK_M"]), batch, heads_grid)

    args = (
        (q, k, v, out, lse if lse is not None else dummy,
         QDs, KDs, VDs, out_scale if out_scale is not None else dummy,
         cu_seqlens_q if varlen else dummy, cu_seqlens_k if varlen else dummy,
         seqused_q if seqused_q is not None else dummy, seqused_k if seqused_k is not None else dummy),
        tuple(tuple(x) for x in (qs, ks, vs, os_, ls, qds, kds, vds)),
        (sq_static, sk_static, nheads_q, nheads_k, d, dv, qgroup),
        (float(softmax_scale), float(softcap), wl, wr, int(descale_block_q or 1), int(descale_block_k or 1)),
        _bucket(sq_static),
    )
    kwargs = dict(
        IS_FP8=is_fp8, P_FP8=is_fp8, IS_VARLEN=varlen,
        HAS_SEQUSED_Q=seqused_q is not None, HAS_SEQUSED_K=seqused_k is not None,
        CAUSAL=bool(causal), HAS_WINDOW=has_window, SOFTCAP=float(softcap) != 0.0,
        PACK_GQA=pack, DESCALE_MODE=mode, OUT_FP8=out.dtype == torch.float8_e4m3fn,
        OUT_DTYPE=_TL_DTYPE[out.dtype], WRITE_LSE=lse is not None, REVERSE_M=bool(causal),
        BLOCK_D=block_d, BLOCK_DV=block_dv, EVEN_D=block_d == d, EVEN_DV=block_dv == dv,
    )
    return args, kwargs, grid
