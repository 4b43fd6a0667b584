"""The reference attention: dense, varlen and paged, in torch. Also the CPU execution path.

Semantics (docs/numerics.md):

* Inputs may be FP8 (with descales) or 16/32-bit. FP8 inputs are dequantized exactly
  (``x8.float() * descale``) before any arithmetic, so tests that quantize first measure the kernel.
* Causal and window masks align bottom-right: query ``i`` of a sequence with ``sq`` queries and
  ``sk`` keys sees key ``j`` iff ``j <= i + sk - sq`` (causal) and
  ``i + sk - sq - left <= j <= i + sk - sq + right`` (window; -1 = unbounded).
* A row that sees no key outputs 0 with LSE ``-inf`` (never NaN). LSE is natural-log float32.
* ``quantize_p=True`` models the kernels' FP8 P: probabilities ``exp(s - m)`` are scaled by 2**8
  into e4m3's range, cast to e4m3 (saturating), and used for ``P @ V``; the row sum uses the
  unquantized probabilities, as the kernels do. ``p_dtype=torch.bfloat16 / float16`` models a
  16-bit P@V instead (P rounded to that dtype). The CPU execution path (ops.py) sets them the way
  the GPU kernel of the same call multiplies, so both round P alike (P relative to the row's final
  max here, to the running max of its tile in the kernels: the same rounding, not the same bits).
* ``out_scale`` gives the fused static FP8 output: ``saturate(out / out_scale)`` in e4m3fn.
* ``compute_dtype=torch.float64`` is the oracle.

Padding beyond ``seqlens_*`` (and unused paged slots) may hold NaN: it is selected away with
``torch.where`` before any product, never multiplied by zero.
"""

from __future__ import annotations

import math

import torch

from .quant import expand_descale, is_fp8, saturating_cast

__all__ = [
    "attention_ref",
    "varlen_attention_ref",
    "attention_bwd_ref",
    "BWD_MODES",
    "block_descales_to_tokens",
    "paged_attention_ref",
    "combine_ref",
    "gather_paged",
    "pad_varlen",
    "unpad_varlen",
]

P_SCALE = 256.0  # 2**8: P's offset into the e4m3 range (kernels use exp2(s - m + 8))


def _dq(
    x: torch.Tensor, descale: torch.Tensor | None, token_descale: torch.Tensor | None, cdt: torch.dtype
) -> torch.Tensor:
    """Dequantize (batch, seqlen, heads, dim) with a (batch, heads) and optional (batch, seqlen, heads) descale."""
    y = x.to(cdt)
    if descale is not None:
        y = y * descale.to(cdt)[:, None, :, None]
    if token_descale is not None:
        y = y * token_descale.to(cdt)[..., None]
    return y


def attention_ref(
    q,
    k,
    v,
    *,
    seqlens_q=None,
    seqlens_k=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    q_token_descale=None,
    k_token_descale=None,
    v_token_descale=None,
    quantize_p=False,
    out_scale=None,
    out_dtype=None,
    compute_dtype=torch.float32,
    return_lse=False,
    p_dtype=None,
):
    """Padded dense attention.

    Parameters
    ----------
    q : (batch, seqlen_q, nheads_q, headdim) fp8 / bf16 / fp16 / fp32 / fp64.
    k : (batch, seqlen_k, nheads_k, headdim), same dtype family as q.
    v : (batch, seqlen_k, nheads_k, headdim_v).
    seqlens_q, seqlens_k : (batch,) integer tensors of valid lengths (default: full).
    q_descale, k_descale, v_descale : float32 (batch, nheads_k) or broadcastable per-tensor.
    q_token_descale : float32 (batch, seqlen_q, nheads_q) per-token-head Q scales (per-block descales
        expanded to tokens: ``block_descales_to_tokens``).
    k_token_descale, v_token_descale : float32 (batch, seqlen_k, nheads_k) per-token-head scales.
    out_scale : static per-tensor output scale; the output is then e4m3fn.
    quantize_p, p_dtype : P@V with P in e4m3 (scaled by 2**8) or rounded to a 16-bit dtype; default
        exact (in ``compute_dtype``).

    Returns
    -------
    out : (batch, seqlen_q, nheads_q, headdim_v); rows beyond seqlens_q are 0.
    lse : (batch, nheads_q, seqlen_q) float32 (only with return_lse).
    """
    cdt = compute_dtype
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dev = q.device
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if out_dtype is None:
        out_dtype = torch.bfloat16 if is_fp8(q.dtype) else q.dtype
    fp8_in = is_fp8(q.dtype) or is_fp8(k.dtype)
    qd = expand_descale(q_descale, b, hk, dev) if (q_descale is not None or fp8_in) else None
    kd = expand_descale(k_descale, b, hk, dev) if (k_descale is not None or fp8_in) else None
    vd = expand_descale(v_descale, b, hk, dev) if (v_descale is not None or fp8_in) else None
    if seqlens_q is None:
        seqlens_q = torch.full((b,), sq, dtype=torch.int64, device=dev)
    if seqlens_k is None:
        seqlens_k = torch.full((b,), sk, dtype=torch.int64, device=dev)
    seqlens_q = seqlens_q.to(dev).long()
    seqlens_k = seqlens_k.to(dev).long()

    valid_q = torch.arange(sq, device=dev)[None, :] < seqlens_q[:, None]  # (b, sq)
    valid_k = torch.arange(sk, device=dev)[None, :] < seqlens_k[:, None]  # (b, sk)
    zero = torch.zeros((), dtype=cdt, device=dev)
    g = hq // hk
    qf = _dq(q, qd.repeat_interleave(g, dim=1) if qd is not None else None, q_token_descale, cdt)
    kf = _dq(k, kd, k_token_descale, cdt)
    vf = _dq(v, None, v_token_descale, cdt)  # v_descale is applied after P @ V, like the kernels
    qf = torch.where(valid_q[:, :, None, None], qf, zero)
    kf = torch.where(valid_k[:, :, None, None], kf, zero)
    vf = torch.where(valid_k[:, :, None, None], vf, zero)
    kf = kf.repeat_interleave(g, dim=2)
    vf = vf.repeat_interleave(g, dim=2)

    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * softmax_scale
    if softcap and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    keep = _keep_mask(valid_q, valid_k, seqlens_q, seqlens_k, causal, window_size)
    s = torch.where(keep[:, None], s, torch.tensor(float("-inf"), dtype=cdt, device=dev))

    m = s.amax(dim=-1, keepdim=True) if sk > 0 else s.new_full(s.shape[:-1] + (1,), float("-inf"))
    m_safe = torch.where(torch.isinf(m) & (m < 0), zero, m)
    p = torch.exp(s - m_safe)
    l = p.sum(dim=-1, keepdim=True)
    if quantize_p:
        pq = saturating_cast(p * P_SCALE).to(cdt)
        o = torch.einsum("bhqk,bkhd->bqhd", pq, vf) / P_SCALE
    elif p_dtype is not None:
        o = torch.einsum("bhqk,bkhd->bqhd", p.to(p_dtype).to(cdt), vf)
    else:
        o = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    empty = l == 0  # (b, h, q, 1)
    inv = torch.where(empty, zero, 1.0 / torch.where(empty, torch.ones_like(l), l))
    o = o * inv.permute(0, 2, 1, 3)
    if vd is not None:
        o = o * vd.to(cdt).repeat_interleave(g, dim=1)[:, None, :, None]
    if out_scale is not None:
        osc = out_scale.to(cdt) if torch.is_tensor(out_scale) else torch.tensor(out_scale, dtype=cdt)
        o = saturating_cast(o / osc.reshape(()).to(dev))
    else:
        o = o.to(out_dtype)
    if not return_lse:
        return o
    lse = torch.where(
        empty,
        torch.tensor(float("-inf"), dtype=cdt, device=dev),
        m_safe + torch.log(torch.where(empty, torch.ones_like(l), l)),
    )
    return o, lse.squeeze(-1).float()


def _keep_mask(valid_q, valid_k, seqlens_q, seqlens_k, causal, window_size):
    """(batch, seqlen_q, seqlen_k) bool: the (query, key) pairs a row attends to (bottom-right aligned)."""
    dev = valid_q.device
    i = torch.arange(valid_q.shape[1], device=dev)[None, :, None]
    j = torch.arange(valid_k.shape[1], device=dev)[None, None, :]
    shift = (seqlens_k - seqlens_q)[:, None, None]
    keep = valid_k[:, None, :] & valid_q[:, :, None]
    if causal:
        keep = keep & (j <= i + shift)
    left, right = window_size
    if left is not None and left >= 0:
        keep = keep & (j >= i + shift - left)
    if right is not None and right >= 0:
        keep = keep & (j <= i + shift + right)
    return keep


def block_descales_to_tokens(descale: torch.Tensor, seqlen: int, block_size: int) -> torch.Tensor:
    """Per-block descales (batch, heads, cdiv(seqlen, block_size)) -> per-token (batch, seqlen, heads)."""
    idx = torch.arange(seqlen, device=descale.device) // block_size
    return descale[:, :, idx].transpose(1, 2)


def pad_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """(total, heads, dim) + cu_seqlens (batch+1,) -> (batch, max_seqlen, heads, dim), zero padded."""
    b = cu_seqlens.numel() - 1
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    pos = torch.arange(max_seqlen, device=x.device)
    idx = (cu[:-1, None] + pos[None, :]).clamp(max=max(x.shape[0] - 1, 0))
    valid = pos[None, :] < lens[:, None]
    if x.shape[0] == 0:
        return x.new_zeros((b, max_seqlen) + tuple(x.shape[1:]))
    out = x[idx]  # (b, max_seqlen, ...)
    return (
        torch.where(valid[:, :, None, None], out, torch.zeros((), dtype=x.dtype, device=x.device))
        if not is_fp8(x.dtype)
        else _fp8_where(valid, out)
    )


def _fp8_where(valid, out):
    # torch.where has no fp8 kernel on every backend: select on the raw bytes instead.
    raw = out.view(torch.uint8)
    return torch.where(valid[:, :, None, None], raw, torch.zeros((), dtype=torch.uint8, device=raw.device)).view(
        out.dtype
    )


def unpad_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Inverse of pad_varlen for the first dim pair: (batch, max_seqlen, ...) -> (total, ...)."""
    cu = cu_seqlens.long()
    lens = (cu[1:] - cu[:-1]).tolist()
    parts = [x[i, :n] for i, n in enumerate(lens)]
    return torch.cat(parts, dim=0) if parts else x.new_zeros((total,) + tuple(x.shape[2:]))


def varlen_attention_ref(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    return_lse=False,
    **kw,
):
    """Varlen attention: q (total_q, nheads_q, d), k/v (total_k, nheads_k, d), cu_seqlens int32.

    ``seqused_*`` (batch,) limit the tokens used per sequence (the rest of its slot is ignored).
    ``q_token_descale`` / ``k_token_descale`` may be given per packed token, (total, heads).
    Returns out (total_q, nheads_q, dv) and, with return_lse, lse (nheads_q, total_q).
    """
    lq = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    lk = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    if seqused_q is not None:
        lq = torch.minimum(lq, seqused_q.long())
    if seqused_k is not None:
        lk = torch.minimum(lk, seqused_k.long())
    qp = pad_varlen(q, cu_seqlens_q, max(int(max_seqlen_q), 1))
    kp = pad_varlen(k, cu_seqlens_k, max(int(max_seqlen_k), 1))
    vp = pad_varlen(v, cu_seqlens_k, max(int(max_seqlen_k), 1))
    for name, cu, ms in (
        ("q_token_descale", cu_seqlens_q, max_seqlen_q),
        ("k_token_descale", cu_seqlens_k, max_seqlen_k),
    ):
        if kw.get(name) is not None:  # packed (total, heads) -> padded (batch, max_seqlen, heads)
            kw[name] = pad_varlen(kw[name][..., None], cu, max(int(ms), 1))[..., 0]
    res = attention_ref(qp, kp, vp, seqlens_q=lq, seqlens_k=lk, return_lse=return_lse, **kw)
    o, lse = res if return_lse else (res, None)
    total_q = q.shape[0]
    out = _scatter_rows(o, cu_seqlens_q, total_q)
    if not return_lse:
        return out
    lse_flat = _scatter_rows(lse.transpose(1, 2), cu_seqlens_q, total_q).transpose(0, 1)
    return out, lse_flat.contiguous()


def _scatter_rows(x: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(batch, max_seqlen, ...) -> (total, ...): row i of sequence b lands at cu_seqlens[b] + i."""
    b, s = x.shape[:2]
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    pos = torch.arange(s, device=x.device)
    valid = pos[None, :] < lens[:, None]
    dst = (cu[:-1, None] + pos[None, :])[valid]
    out = (
        torch.zeros((total,) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
        if not is_fp8(x.dtype)
        else torch.zeros((total,) + tuple(x.shape[2:]), dtype=torch.uint8, device=x.device).view(x.dtype)
    )
    if is_fp8(x.dtype):
        out.view(torch.uint8)[dst] = x.view(torch.uint8)[valid]
    else:
        out[dst] = x[valid]
    return out


def gather_paged(
    cache: torch.Tensor,
    page_table: torch.Tensor,
    seqlens: torch.Tensor,
    max_len: int,
    cache_scales: torch.Tensor | None = None,
):
    """Gather a paged cache into (batch, max_len, nheads_k, d) (+ (batch, max_len, nheads_k) scales).

    Only the first ceil(len / page_size) page ids of each row are dereferenced meaningfully; other
    positions read page 0 and are replaced by zeros (never multiplied), so -1 entries and NaN
    poisoned slots never leak.
    """
    ps = cache.shape[1]
    b = page_table.shape[0]
    max_len = max(int(max_len), 1)
    pos = torch.arange(max_len, device=cache.device)
    page_col = (pos // ps).clamp(max=page_table.shape[1] - 1)
    valid = pos[None, :] < seqlens.long()[:, None]
    pages = page_table.long()[:, page_col]  # (b, max_len)
    pages = torch.where(valid, pages, torch.zeros_like(pages)).clamp(min=0)
    slot_off = (pos % ps)[None, :].expand(b, -1)
    g = cache[pages, slot_off]  # (b, max_len, h, d)
    g = (
        _fp8_where(valid, g)
        if is_fp8(g.dtype)
        else torch.where(valid[:, :, None, None], g, torch.zeros((), dtype=g.dtype, device=g.device))
    )
    if cache_scales is None:
        return g, None
    sc = cache_scales[pages, slot_off]
    sc = torch.where(valid[:, :, None], sc, torch.ones((), dtype=sc.dtype, device=sc.device))
    return g, sc


def paged_attention_ref(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    *,
    cu_seqlens_q=None,
    max_seqlen_q=None,
    k_cache_scales=None,
    v_cache_scales=None,
    return_lse=False,
    **kw,
):
    """Attention of q over a paged cache.

    q : (batch, seqlen_q, nheads_q, d), or varlen (total_q, nheads_q, d) with cu_seqlens_q.
    k_cache, v_cache : (num_blocks, page_size, nheads_k, d / dv).
    page_table : (batch, max_pages) int32. cache_seqlens : (batch,) int, valid cache tokens per row,
        including the queries' own tokens (queries are the last tokens; bottom-right alignment).
    k_cache_scales, v_cache_scales : optional (num_blocks, page_size, nheads_k) float32.
    """
    max_len = int(cache_seqlens.max().item()) if cache_seqlens.numel() else 1
    kg, ks = gather_paged(k_cache, page_table, cache_seqlens, max_len, k_cache_scales)
    vg, vs = gather_paged(v_cache, page_table, cache_seqlens, max_len, v_cache_scales)
    if cu_seqlens_q is None:
        return attention_ref(
            q, kg, vg, seqlens_k=cache_seqlens, k_token_descale=ks, v_token_descale=vs, return_lse=return_lse, **kw
        )
    lq = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    msq = int(max_seqlen_q) if max_seqlen_q is not None else int(lq.max().item()) if lq.numel() else 1
    qp = pad_varlen(q, cu_seqlens_q, max(msq, 1))
    res = attention_ref(
        qp,
        kg,
        vg,
        seqlens_q=lq,
        seqlens_k=cache_seqlens,
        k_token_descale=ks,
        v_token_descale=vs,
        return_lse=return_lse,
        **kw,
    )
    o, lse = res if return_lse else (res, None)
    out = _scatter_rows(o, cu_seqlens_q, q.shape[0])
    if not return_lse:
        return out
    return out, _scatter_rows(lse.transpose(1, 2), cu_seqlens_q, q.shape[0]).transpose(0, 1).contiguous()


def combine_ref(out_partial: torch.Tensor, lse_partial: torch.Tensor, out_dtype=None, out_scale=None):
    """Merge split-KV partial results (FA3 flash_attn_combine semantics).

    out_partial : (num_splits, ..., headdim) float32 or bfloat16; lse_partial : (num_splits, ...) float32, where
    ``...`` is (batch, seqlen, nheads) or (total, nheads). An empty split is (anything finite, -inf).
    Returns (out, lse) with out (..., headdim) and lse (...); all-empty rows give 0 and -inf.
    """
    lse = lse_partial.float()
    m = lse.amax(dim=0)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_safe)  # 0 for empty splits
    s = w.sum(dim=0)
    empty = s == 0
    w = w / torch.where(empty, torch.ones_like(s), s)
    o = torch.where(w[..., None] > 0, out_partial.float(), torch.zeros((), device=out_partial.device))
    o = (o * w[..., None]).sum(dim=0)
    lse_out = torch.where(
        empty, torch.full_like(m, float("-inf")), m_safe + torch.log(torch.where(empty, torch.ones_like(s), s))
    )
    if out_scale is not None:
        osc = out_scale if torch.is_tensor(out_scale) else torch.tensor(out_scale)
        return saturating_cast(o / osc.float().reshape(()).to(o.device)), lse_out
    return o.to(out_dtype or out_partial.dtype), lse_out


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------

BWD_MODES = ("dequantized", "fp8")
BWD_TILE = 64  # the tile (rows x keys) of one e4m3 scale for dO, P and dS in the "fp8" backward emulation


def _e4m3_tiles(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x (..., R, C) rounded through e4m3 with one amax scale per (rows x cols) tile (fp32 accumulation
    follows in the caller): the value an FP8 backward GEMM reads for dO, P or dS."""
    from .quant import descale_from_amax

    *lead, r, c = x.shape
    if x.numel() == 0:
        return x
    rr, cc = -(-r // rows) * rows, -(-c // cols) * cols
    xp = torch.nn.functional.pad(x, (0, cc - c, 0, rr - r))
    t = xp.reshape(*lead, rr // rows, rows, cc // cols, cols)
    d = descale_from_amax(t.abs().amax(dim=(-3, -1), keepdim=True), 448.0).to(x.dtype)
    y = saturating_cast(t / d).to(x.dtype) * d
    return y.reshape(*lead, rr, cc)[..., :r, :c]


def _bwd_padded(do, qf, kf, vf, out, lse, seqlens_q, seqlens_k, softmax_scale, causal, window_size, softcap, mode, cdt):
    """The backward on padded, dequantized (real-valued) tensors.

    do, out : (b, sq, hq, dv); qf : (b, sq, hq, d); kf, vf : (b, sk, hk, d / dv), all in ``cdt``;
    lse : (b, hq, sq) float32. Returns (dq, dk, dv) in ``cdt``, dk / dv summed over each KV head's group.
    """
    b, sq, hq, _ = qf.shape
    sk, hk = kf.shape[1], kf.shape[2]
    g = hq // hk
    dev = qf.device
    valid_q = torch.arange(sq, device=dev)[None, :] < seqlens_q[:, None]
    valid_k = torch.arange(sk, device=dev)[None, :] < seqlens_k[:, None]
    keep = _keep_mask(valid_q, valid_k, seqlens_q, seqlens_k, causal, window_size)[:, None]  # (b, 1, sq, sk)
    kr, vr = kf.repeat_interleave(g, dim=2), vf.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kr) * softmax_scale
    t = None
    if softcap and softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    lse_c = lse.to(cdt)[..., None]
    live = keep & torch.isfinite(lse_c)  # a row that saw no key (lse = -inf) contributes nothing
    zero = torch.zeros((), dtype=cdt, device=dev)
    p = torch.where(live, torch.exp(torch.where(live, s - lse_c, zero)), zero)  # P recomputed from the LSE
    do_t = do.transpose(1, 2)  # (b, hq, sq, dv)
    delta = (do.to(cdt) * out.to(cdt)).sum(-1).transpose(1, 2)[..., None]  # (b, hq, sq, 1): rowsum(dO * O)
    do_mm, p_mm = do_t, p
    if mode == "fp8":
        do_mm = _e4m3_tiles(do_t, BWD_TILE, do_t.shape[-1])
        p_mm = _e4m3_tiles(p, BWD_TILE, BWD_TILE)
    dv = torch.einsum("bhqk,bhqd->bkhd", p_mm, do_mm)
    dp = torch.einsum("bhqd,bkhd->bhqk", do_mm, vr)
    ds = p * (dp - delta)
    if t is not None:
        ds = ds * (1 - t * t)
    if mode == "fp8":
        ds = _e4m3_tiles(ds, BWD_TILE, BWD_TILE)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kr) * softmax_scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * softmax_scale
    dk = dk.reshape(b, sk, hk, g, dk.shape[-1]).sum(3)
    dv = dv.reshape(b, sk, hk, g, dv.shape[-1]).sum(3)
    return dq, dk, dv


def _bwd_dequant(x, descale, token_descale, group, cdt):
    """(b, s, heads, d) real values: x * descale (a (b, nheads_k) descale, repeated over ``group`` heads)
    * token_descale ((b, s, heads), per-block scales expanded)."""
    y = x.to(cdt)
    if descale is not None:
        y = y * descale.to(cdt).repeat_interleave(group, dim=1)[:, None, :, None]
    if token_descale is not None:
        y = y * token_descale.to(cdt)[..., None]
    return y


def attention_bwd_ref(
    do,
    q,
    k,
    v,
    out,
    lse,
    *,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_left=-1,
    window_right=-1,
    softcap=0.0,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    mode="dequantized",
    deterministic=False,
    descale_block=0,
    grad_dtype=torch.float32,
    compute_dtype=torch.float32,
):
    """The attention backward: gradients with respect to the real values q, k, v represent.

    P is recomputed from Q, K and the forward's LSE (``exp(s - lse)``), ``Delta = rowsum(dO * O)``,
    ``dS = P * (dO V^T - Delta)`` (times ``1 - tanh^2`` under softcap), ``dQ = scale * dS K``,
    ``dK = scale * dS^T Q``, ``dV = P^T dO``; dK / dV are summed over the query heads of a KV head's group.

    Parameters
    ----------
    do : (batch, seqlen_q, nheads_q, headdim_v) / varlen (total_q, nheads_q, headdim_v), 16/32-bit: dL/dout.
    q, k, v : as the forward's (dense (batch, seqlen, heads, dim) or varlen (total, heads, dim)); all FP8 with
        the descales, or all 16/32-bit (descales None). Any strides.
    out : the forward's output, do's shape, 16/32-bit. lse : float32 natural-log (batch, nheads_q, seqlen_q) /
        varlen (nheads_q, total_q); a row with lse = -inf contributes no gradient.
    q_descale, k_descale, v_descale : float32 (batch, nheads_k) (broadcast views allowed) or None (= 1). With
        ``descale_block > 0``: q_descale (batch, nheads_q, cdiv(seqlen_q, block)), k_descale (batch, nheads_k,
        cdiv(seqlen_k, block)) per-block (varlen: batch 1 over packed tokens); v_descale stays (batch, nheads_k).
    softmax_scale : the model's scale (default 1/sqrt(headdim)). causal, window_left, window_right, softcap :
        as the forward (bottom-right aligned; -1 unbounded).
    cu_seqlens_q, cu_seqlens_k : (batch + 1,) int32 (varlen) with max_seqlen_q / max_seqlen_k.
    mode : "dequantized" (exact products in ``compute_dtype``) or "fp8" (dO, P and dS rounded through e4m3
        with one scale per ``BWD_TILE`` x ``BWD_TILE`` tile -- dO per ``BWD_TILE`` rows -- before the
        backward products, as FP8 GEMMs with fp32 accumulation read them).
    deterministic : accepted (this path is deterministic).
    grad_dtype : dtype of the returned gradients. compute_dtype : float32, or float64 for an oracle.

    Returns
    -------
    (dq, dk, dv) : contiguous, shapes of q, k, v, ``grad_dtype``.
    """
    if mode not in BWD_MODES:
        raise ValueError(f"mode: expected one of {BWD_MODES}, got {mode!r}. Pick 'dequantized' or 'fp8'.")
    cdt = compute_dtype
    varlen = cu_seqlens_q is not None
    hq, hk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    g = hq // hk
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    blk = int(descale_block or 0)
    qtok = ktok = None
    if blk:  # per-block Q/K descales -> per-token (b, s, heads) (varlen: packed tokens, batch 1)
        qtok = block_descales_to_tokens(q_descale, q.shape[-3], blk)
        ktok = block_descales_to_tokens(k_descale, k.shape[-3], blk)
        q_descale = k_descale = None
    if varlen:
        b = cu_seqlens_q.numel() - 1
        msq, msk = max(int(max_seqlen_q), 1), max(int(max_seqlen_k), 1)
        lq = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        lk = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
        pq = lambda x: pad_varlen(x, cu_seqlens_q, msq)  # noqa: E731
        pk = lambda x: pad_varlen(x, cu_seqlens_k, msk)  # noqa: E731
        qp, kp, vp, dop, op = pq(q), pk(k), pk(v), pq(do), pq(out)
        lsep = pq(lse.transpose(0, 1)[..., None])[..., 0].transpose(1, 2)  # (b, hq, msq)
        if blk:
            qtok, ktok = pq(qtok[0][..., None])[..., 0], pk(ktok[0][..., None])[..., 0]
    else:
        b = q.shape[0]
        lq = torch.full((b,), q.shape[1], dtype=torch.int64, device=q.device)
        lk = torch.full((b,), k.shape[1], dtype=torch.int64, device=q.device)
        qp, kp, vp, dop, op, lsep = q, k, v, do, out, lse
    qd, kd, vd = (
        expand_descale(x, b, hk, q.device) if x is not None else None for x in (q_descale, k_descale, v_descale)
    )
    qf = _bwd_dequant(qp, qd, qtok, g, cdt)
    kf = _bwd_dequant(kp, kd, ktok, 1, cdt)
    vf = _bwd_dequant(vp, vd, None, 1, cdt)
    dq, dk, dv = _bwd_padded(
        dop.to(cdt),
        qf,
        kf,
        vf,
        op,
        lsep,
        lq.to(q.device),
        lk.to(q.device),
        softmax_scale,
        causal,
        (window_left, window_right),
        softcap,
        mode,
        cdt,
    )
    if varlen:
        dq = _scatter_rows(dq, cu_seqlens_q, q.shape[0])
        dk = _scatter_rows(dk, cu_seqlens_k, k.shape[0])
        dv = _scatter_rows(dv, cu_seqlens_k, v.shape[0])
    return tuple(x.to(grad_dtype).contiguous() for x in (dq, dk, dv))
