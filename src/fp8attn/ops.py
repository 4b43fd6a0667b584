"""Execution layer: each op chooses the Triton kernel (CUDA, sm89+) or the reference (everything
else) and returns exactly the same outputs. Arguments arrive validated and normalized by
``interface`` (descales expanded to (batch, nheads_k) float32 views, window resolved for causal).
"""
from __future__ import annotations

import torch

from . import reference as ref
from .capability import kernel_path_ok
from .quant import descale_for_tokens, fp8_max, saturating_cast, DESCALE_FLOOR

__all__ = ["dense_fwd", "paged_fwd", "combine", "write_kv_cache"]


def _kernel(module: str, name: str):
    """Import a launch function lazily (kernels import triton)."""
    import importlib

    try:
        mod = importlib.import_module(f"fp8attn.kernels.{module}")
    except ImportError:
        return None
    return getattr(mod, name, None)


def _out_dtype(q, out_dtype, out_scale):
    if out_scale is not None:
        return torch.float8_e4m3fn
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) else q.dtype


def dense_fwd(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
              max_seqlen_q=None, max_seqlen_k=None, softmax_scale, causal, window_size, softcap,
              q_descale, k_descale, v_descale, out_scale=None, out_dtype=None, out=None,
              pack_gqa=None):
    """Dense (4-D q) or varlen (3-D q + cu_seqlens) forward. Returns (out, lse)."""
    varlen = cu_seqlens_q is not None
    dt = _out_dtype(q, out_dtype, out_scale)
    oshape = tuple(q.shape[:-1]) + (v.shape[-1],)
    if varlen:
        lse_shape = (q.shape[1], q.shape[0])
    else:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    launch = _kernel("dense", "launch_dense_fwd") if kernel_path_ok(q) else None
    if launch is not None:
        o = out if out is not None else torch.empty(oshape, dtype=dt, device=q.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        launch(q, k, v, o, lse, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
               softcap=softcap, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
               out_scale=out_scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
               seqused_q=seqused_q, seqused_k=seqused_k, max_seqlen_q=max_seqlen_q,
               max_seqlen_k=max_seqlen_k, pack_gqa=bool(pack_gqa))
        return o, lse
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
              q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_scale=out_scale,
              out_dtype=dt, return_lse=True)
    if varlen:
        o, lse = ref.varlen_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          seqused_q=seqused_q, seqused_k=seqused_k, **kw)
    else:
        sq = seqused_q.long() if seqused_q is not None else None
        sk = seqused_k.long() if seqused_k is not None else None
        o, lse = ref.attention_ref(q, k, v, seqlens_q=sq, seqlens_k=sk, **kw)
    if out is not None:
        out.copy_(o)
        o = out
    return o, lse


def paged_fwd(q, k_cache, v_cache, page_table, cache_seqlens, *, cu_seqlens_q=None, max_seqlen_q=None,
              softmax_scale, causal, window_size, softcap, q_descale, k_descale, v_descale,
              k_cache_scales=None, v_cache_scales=None, out_scale=None, out_dtype=None, out=None,
              num_splits=0):
    """Attention over a paged cache (chunked prefill, mixed batches, decode). Returns (out, lse)."""
    varlen = cu_seqlens_q is not None
    dt = _out_dtype(q, out_dtype, out_scale)
    oshape = tuple(q.shape[:-1]) + (v_cache.shape[-1],)
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    launch = _kernel("paged", "launch_paged_fwd") if kernel_path_ok(q) else None
    if launch is not None:
        o = out if out is not None else torch.empty(oshape, dtype=dt, device=q.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        if max_seqlen_q is None:
            max_seqlen_q = q.shape[1] if not varlen else q.shape[0]
        launch(q, k_cache, v_cache, page_table, cache_seqlens, o, lse, cu_seqlens_q=cu_seqlens_q,
               max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, causal=causal,
               window_size=window_size, softcap=softcap, q_descale=q_descale, k_descale=k_descale,
               v_descale=v_descale, k_cache_scales=k_cache_scales, v_cache_scales=v_cache_scales,
               out_scale=out_scale, num_splits=num_splits)
        return o, lse
    o, lse = ref.paged_attention_ref(
        q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
        k_cache_scales=k_cache_scales, v_cache_scales=v_cache_scales, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, q_descale=q_descale, k_descale=k_descale,
        v_descale=v_descale, out_scale=out_scale, out_dtype=dt, return_lse=True)
    if out is not None:
        out.copy_(o)
        o = out
    return o, lse


def combine(out_partial, lse_partial, *, out=None, out_dtype=None, out_scale=None):
    """Merge split-KV partials. Returns (out, lse) with lse shaped like lse_partial[0]."""
    dt = torch.float8_e4m3fn if out_scale is not None else (out_dtype or out_partial.dtype)
    launch = _kernel("combine", "launch_combine") if kernel_path_ok(out_partial) else None
    if launch is not None:
        o = out if out is not None else torch.empty(out_partial.shape[1:], dtype=dt, device=out_partial.device)
        lse = torch.empty(lse_partial.shape[1:], dtype=torch.float32, device=out_partial.device)
        launch(out_partial, lse_partial, o, lse, out_scale=out_scale)
        return o, lse
    o, lse = ref.combine_ref(out_partial, lse_partial, out_dtype=dt, out_scale=out_scale)
    if out is not None:
        out.copy_(o)
        o = out
    return o, lse


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_descale=None, v_descale=None,
                   token_seq_idx=None, k_cache_scales=None, v_cache_scales=None):
    """Scatter (and quantize) new tokens into a paged cache in place. Negative slots are skipped."""
    launch = _kernel("cache", "launch_write_kv_cache") if kernel_path_ok(k) else None
    if launch is not None:
        launch(k, v, k_cache, v_cache, slot_mapping, k_descale=k_descale, v_descale=v_descale,
               token_seq_idx=token_seq_idx, k_cache_scales=k_cache_scales, v_cache_scales=v_cache_scales)
        return
    _write_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping, k_descale, v_descale, token_seq_idx,
                          k_cache_scales, v_cache_scales)


def _write_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping, k_descale, v_descale, token_seq_idx,
                          k_cache_scales, v_cache_scales):
    nb, ps, hk, _ = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // ps, slots % ps
    sel = keep.nonzero().squeeze(-1)
    seq_idx = token_seq_idx[keep] if token_seq_idx is not None else None
    for x, cache, descale, scales in ((k, k_cache, k_descale, k_cache_scales), (v, v_cache, v_descale, v_cache_scales)):
        xs = x[sel].float()
        if cache.dtype in (torch.float16, torch.bfloat16, torch.float32):
            cache[blk, off] = xs.to(cache.dtype)
            continue
        if scales is not None:  # per-token-head dynamic scales, stored beside the cache
            m = fp8_max(cache.dtype)
            d = (xs.abs().nan_to_num(0.0).amax(dim=-1).clamp_min(DESCALE_FLOOR * m) / m).float()
            scales[blk, off] = d
        elif descale is not None:
            d = descale_for_tokens(descale, seq_idx, xs.shape[0], hk)
        else:
            d = torch.ones(xs.shape[0], hk, device=x.device)
        q8 = saturating_cast(xs / d[..., None], cache.dtype)
        cache.view(torch.uint8)[blk, off] = q8.view(torch.uint8)
