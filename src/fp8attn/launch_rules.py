"""Host rules shared by the kernel launchers and the CPU path (torch only, no Triton).

The CPU path rounds P as the GPU kernel that would run the call does, so it needs the part of the
kernels' dispatch that depends on the call itself (dtypes, head dims, page size and V layout, query
counts, options), not on memory (contiguity, alignment, devices), which the launchers add.
"""
from __future__ import annotations

import torch

__all__ = ["cdiv", "next_pow2", "window_flags", "attention_out_dtype", "tma_options_reason", "paged_tma_call_reason",
           "TMA_QUERY_BLOCK", "PAGED_TMA_HEAD_DIMS", "PAGED_TMA_MIN_PAGE", "PAGED_TMA_SMALL_PAGES"]

# Query rows of one TMA query block: a fixed-length call runs on the paged TMA kernel with a multiple of
# this many queries; a varlen call sends it its sequences of this many queries or more.
TMA_QUERY_BLOCK = 128
PAGED_TMA_HEAD_DIMS = (64, 128)
PAGED_TMA_MIN_PAGE = 64
# FA3's layout only: pages smaller than a tile, loaded one TMA box per page
PAGED_TMA_SMALL_PAGES = (16, 32)

_E4M3 = torch.float8_e4m3fn


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b). Launchers use this, not ``triton.cdiv``: in triton 3.6 that is a constexpr
    function whose call costs ~1.5 us of host time (CPU machine; ~3x that on the H200 host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Host-side smallest power of two >= n (1 for n <= 1); see ``cdiv`` for why not
    ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def attention_out_dtype(q_dtype, out_dtype, out_scale):
    """The output dtype of an attention op: e4m3fn with ``out_scale``, else ``out_dtype``, else bf16 for FP8
    inputs and the input dtype for 16/32-bit ones."""
    if out_scale is not None:
        return torch.float8_e4m3fn
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if q_dtype not in (torch.float16, torch.bfloat16, torch.float32) else q_dtype


def window_flags(causal, window_size):
    """Host side, for every launcher: ``(causal, window_left, window_right, has_window)`` as the kernels
    see them. A right edge of 0 is the diagonal, so any window ending there is the causal mask (FA3's
    API passes causal as the window (-1, 0)); under causal a right edge is implied by the diagonal and
    dropped. Only what is left selects the window path (``HAS_WINDOW``), whose extra masks and bounds
    every causal call would otherwise compile in."""
    wl, wr = window_size if window_size is not None else (-1, -1)
    wl = -1 if wl is None else int(wl)
    wr = -1 if wr is None else int(wr)
    causal = bool(causal) or wr == 0
    if causal:
        wr = -1
    return causal, wl, wr, wl >= 0 or wr >= 0


def tma_options_reason(q_dtype, k_dtype, v_dtype, out_dtype, *, window_size, softcap, out_scale, per_block=False,
                       names=("q", "k", "v")):
    """The rules every TMA kernel shares: no sliding window, softcap or per-block descales; e4m3 q/k/v;
    bf16 out, or e4m3 out with a one-element float32 ``out_scale``. None when they hold."""
    if window_flags(False, window_size)[3]:
        return f"sliding window {tuple(window_size)} is not supported"
    if softcap and float(softcap) != 0.0:
        return "softcap is not supported"
    if per_block:
        return "per-block descales are not supported"
    if any(dt != _E4M3 for dt in (q_dtype, k_dtype, v_dtype)):
        return f"{', '.join(names)} must be float8_e4m3fn, got {q_dtype}, {k_dtype}, {v_dtype}"
    if out_scale is None and out_dtype != torch.bfloat16:
        return f"out must be bfloat16 (or float8_e4m3fn with out_scale), got {out_dtype}"
    if out_scale is not None:
        if out_dtype != _E4M3:
            return f"with out_scale, out must be float8_e4m3fn, got {out_dtype}"
        if not torch.is_tensor(out_scale) or out_scale.dtype != torch.float32 or out_scale.numel() != 1:
            return "out_scale must be a float32 tensor with one element"
    return None


def paged_tma_call_reason(q, k_cache, v_cache, out_dtype, *, varlen, window_size, softcap, out_scale, token_scales,
                          num_splits, v_seq_major):
    """Why the paged TMA kernel cannot take a call by its semantics, or None when it can (the launcher then
    checks memory and the device: ``kernels.paged_tma.unsupported_reason``).

    q : (batch, seqlen_q, nheads_q, d), or (total_q, nheads_q, d) with ``varlen``; k_cache, v_cache :
    (num_blocks, page_size, nheads_k, d); ``v_seq_major``: V sequence-major inside each page
    (``paged.is_v_seq_major``), else FA3's layout (V must then be contiguous).
    """
    if int(num_splits) > 1:
        return f"num_splits={num_splits}: the kernel does not split the keys"
    if token_scales:
        return "per-token-head cache scales are not supported"
    why = tma_options_reason(q.dtype, k_cache.dtype, v_cache.dtype, out_dtype, window_size=window_size,
                             softcap=softcap, out_scale=out_scale, names=("q", "k_cache", "v_cache"))
    if why:
        return why
    if q.dim() != (3 if varlen else 4) or k_cache.dim() != 4 or v_cache.dim() != 4:
        return ("q must be (total_q, nheads_q, d) with cu_seqlens_q" if varlen else
                "q must be (batch, seqlen_q, nheads_q, d)") + " and the caches (num_blocks, page_size, nheads_k, d)"
    d, dk, dv = q.shape[-1], k_cache.shape[-1], v_cache.shape[-1]
    if d not in PAGED_TMA_HEAD_DIMS or dk != d or dv != d:
        return f"head dim must be 64 or 128 for q, k and v, got {d}, {dk}, {dv}"
    if not varlen and (q.shape[1] == 0 or q.shape[1] % TMA_QUERY_BLOCK != 0):
        return f"seqlen_q ({q.shape[1]}) must be a positive multiple of {TMA_QUERY_BLOCK}"
    v_rows = not v_seq_major
    if v_rows and not v_cache.is_contiguous():
        return "v_cache must be contiguous (FA3's layout) or sequence-major within each page (paged.to_v_seq_major)"
    ps = k_cache.shape[1]
    if ps % PAGED_TMA_MIN_PAGE != 0 and not (v_rows and ps in PAGED_TMA_SMALL_PAGES):
        return (f"page_size ({ps}) must be a multiple of {PAGED_TMA_MIN_PAGE} (or one of {PAGED_TMA_SMALL_PAGES} "
                "with FA3's V layout)")
    return None
