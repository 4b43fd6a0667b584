"""Triton kernel behind MLA prefill's FP8 quantization (``fp8attn.mla.quantize_mla``).

One (token block, head) tile per program. It reads the two parts of Q (NoPE, RoPE) and of K (NoPE per
head, RoPE one per token and broadcast over the heads through a zero head stride) and V, and writes
the FP8 Q and K with the parts concatenated along the head dim (the 16-bit concatenation is never
materialized) and V through its output strides (sequence-major for the FP8 P @ V). Passes, chosen by
constexprs:

* ``AMAX``: each program stores the amax of its Q, K and V tiles at ``Amax[i, pid]`` (i = 0, 1, 2):
  every slot is written, so the workspace needs no initialization and no atomics are used. A NaN or
  Inf element makes its tile's amax +inf (the descale built from it is then NaN, so the damage is
  visible downstream instead of being scaled away).
* ``QUANT``: ``saturate(x * Inv[i])`` cast to e4m3fn, NaN propagating (``Inv`` holds the reciprocal
  descales, computed by the caller with IEEE division: the kernel's own fp32 division would compile to
  the approximate ``div.full.f32`` and round differently from the torch form); ``COUNT`` stores at ``Sat[pid]``
  how many of the program's K and V elements fell outside +-448 before the clamp.

The descales between the passes are reduced by the caller with device ops (no host synchronization).
"""
from __future__ import annotations

try:  # the package must import on machines without triton
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["launch_mla_quant", "HAS_TRITON", "BLOCK_T"]

BLOCK_T = 32  # tokens per tile: a (32, 128) fp32 tile per part keeps the 4 warps' registers light

if HAS_TRITON:
    from .common import cdiv  # (also applies the interpreter fixes under TRITON_INTERPRET=1, once)

    _E4M3_MAX = tl.constexpr(448.0)

    @triton.jit
    def _load(X, t64, offs_d, ok, h, stride_t, stride_h, stride_d):
        return tl.load(X + t64[:, None] * stride_t + h * stride_h + offs_d[None, :] * stride_d,
                       mask=ok[:, None], other=0.0).to(tl.float32)

    @triton.jit
    def _amax(x):
        """Largest magnitude of the tile; +inf when any element is NaN or Inf."""
        return tl.max(tl.max(tl.where(x == x, tl.abs(x), float("inf")), 1), 0)

    @triton.jit
    def _store_q(Y, y_f32, inv, t64, offs_d, ok, h, stride_t, stride_h, col0):
        """``saturate(x * inv)`` in e4m3fn at columns ``col0 + offs_d``; returns how many elements clipped."""
        y = y_f32 * inv
        over = tl.sum(tl.sum((tl.abs(y) > _E4M3_MAX).to(tl.int32), 1), 0)
        y = tl.clamp(y, -_E4M3_MAX, _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(Y + t64[:, None] * stride_t + h * stride_h + (col0 + offs_d[None, :]), y.to(tl.float8e4nv),
                 mask=ok[:, None])
        return over

    @triton.jit
    def _mla_quant_kernel(QN, QP, KN, KP, V, Q8, K8, V8, Amax, Inv, Sat,
                          T, H,
                          s_qn_t, s_qn_h, s_qn_d, s_qp_t, s_qp_h, s_qp_d,
                          s_kn_t, s_kn_h, s_kn_d, s_kp_t, s_kp_h, s_kp_d,
                          s_v_t, s_v_h, s_v_d,
                          s_q8_t, s_q8_h, s_k8_t, s_k8_h, s_v8_t, s_v8_h, s_v8_d,
                          s_amax,
                          DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, HAS_Q: tl.constexpr,
                          AMAX: tl.constexpr, QUANT: tl.constexpr, COUNT: tl.constexpr, BLOCK_T: tl.constexpr):
        blk = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        pid = blk * H + tl.program_id(1)
        offs_t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = offs_t < T
        t64 = offs_t.to(tl.int64)
        dn = tl.arange(0, DN)
        dr = tl.arange(0, DR)
        dv = tl.arange(0, DV)
        kn = _load(KN, t64, dn, ok, h, s_kn_t, s_kn_h, s_kn_d)
        kp = _load(KP, t64, dr, ok, h, s_kp_t, s_kp_h, s_kp_d)
        vv = _load(V, t64, dv, ok, h, s_v_t, s_v_h, s_v_d)
        if HAS_Q:
            qn = _load(QN, t64, dn, ok, h, s_qn_t, s_qn_h, s_qn_d)
            qp = _load(QP, t64, dr, ok, h, s_qp_t, s_qp_h, s_qp_d)
        if AMAX:
            if HAS_Q:
                tl.store(Amax + pid, tl.maximum(_amax(qn), _amax(qp)))
            tl.store(Amax + s_amax + pid, tl.maximum(_amax(kn), _amax(kp)))
            tl.store(Amax + 2 * s_amax + pid, _amax(vv))
        if QUANT:
            if HAS_Q:
                qinv = tl.load(Inv)
                _store_q(Q8, qn, qinv, t64, dn, ok, h, s_q8_t, s_q8_h, 0)
                _store_q(Q8, qp, qinv, t64, dr, ok, h, s_q8_t, s_q8_h, DN)
            kinv = tl.load(Inv + 1)
            vinv = tl.load(Inv + 2)
            over = _store_q(K8, kn, kinv, t64, dn, ok, h, s_k8_t, s_k8_h, 0)
            over += _store_q(K8, kp, kinv, t64, dr, ok, h, s_k8_t, s_k8_h, DN)
            # V through three strides: its memory order is the caller's (sequence-major for P @ V)
            y = vv * vinv
            over += tl.sum(tl.sum((tl.abs(y) > _E4M3_MAX).to(tl.int32), 1), 0)
            y = tl.clamp(y, -_E4M3_MAX, _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
            tl.store(V8 + t64[:, None] * s_v8_t + h * s_v8_h + dv[None, :] * s_v8_d, y.to(tl.float8e4nv),
                     mask=ok[:, None])
            if COUNT:
                tl.store(Sat + pid, over)


def launch_mla_quant(qn, qp, kn, kp, v, q8, k8, v8, amax, inv, sat, *, has_q, amax_pass, quant, count):
    """One pass of ``_mla_quant_kernel`` over T tokens and H heads (grid ``(cdiv(T, BLOCK_T), H)``).

    Parameters
    ----------
    qn, qp : (T, H, DN) / (T, H, DR) 16/32-bit, any strides (ignored without ``has_q``: pass kn, kp).
    kn : (T, H, DN). kp : (T, H, DR), a zero head stride for a RoPE part shared by the heads. v : (T, H, DV).
    q8, k8 : float8_e4m3fn (T, H, DN + DR), last dim contiguous. v8 : float8_e4m3fn (T, H, DV), any strides.
    amax : float32 (3, n) with n >= programs, written by ``amax_pass`` (row 0 only with ``has_q``).
    inv : float32 (3,) reciprocal descales ``1 / descale`` of Q, K, V, read by ``quant``.
    sat : int32 (programs,), written with ``count``.
    """
    T, H, DN = kn.shape
    grid = (cdiv(T, BLOCK_T), H)
    _mla_quant_kernel[grid](qn, qp, kn, kp, v, q8, k8, v8, amax, inv, sat, T, H,
                            *qn.stride(), *qp.stride(), *kn.stride(), *kp.stride(), *v.stride(),
                            q8.stride(0), q8.stride(1), k8.stride(0), k8.stride(1), *v8.stride(), amax.stride(0),
                            DN=DN, DR=kp.shape[-1], DV=v.shape[-1], HAS_Q=has_q, AMAX=amax_pass, QUANT=quant,
                            COUNT=count, BLOCK_T=BLOCK_T, num_warps=4)
