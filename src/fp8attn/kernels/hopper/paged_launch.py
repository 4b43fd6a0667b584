"""Chunked prefill over a paged FP8 KV cache on the warp-specialized TMA kernel (Hopper).

The fast path of ``paged.launch_paged_fwd`` for prefill chunks: ``dense_launch``'s warp-specialized
persistent kernel with its producer reading each KV tile's page from the page table
(``_bounded_fwd_tma_ws_kernel`` in ``MODE_PAGED``). Two V layouts:

- FA3's (V like K, rows of keys, the cache ``flash_attn_with_kvcache`` takes): V tiles are loaded as K's
  and transposed in shared memory by the producer warps (Hopper's FP8 wgmma reads V only
  sequence-major); pages of 16 or 32 keys or a multiple of 64, loaded in boxes of up to one page.
- sequence-major V within each page (``paged.alloc_paged_cache(..., v_seq_major=True)``): no transpose;
  pages a multiple of 64.

Tiles are 128 keys, except 64 with sequence-major V in pages that 128 keys would straddle. Sequence
lengths come from ``cache_seqlens`` on the device (any value, zero included; the queries are the last
``seqlen_q`` keys, bottom-right causal). Tiles that cross the diagonal or the sequence's end run masked,
and the last V tile's slots past the end are zeroed in shared memory before P V reads them, so unused
slots (NaN in a poisoned cache) never reach the output.

Varlen queries (``cu_seqlens_q``, ``MODE_PAGED_VARLEN``): the query blocks listed on the device by
``dense_launch.varlen_block_list``, which leaves out the sequences with fewer than ``min_len_q`` queries: a
mixed batch's decode rows would each fill a 128-row block alone, once per query head, so
``paged.launch_paged_fwd`` leaves the sequences below ``VARLEN_MIN_Q`` queries to the Triton kernel
(which packs a kv head's query heads into one block) and runs the rest here.

Numerics are ``dense_launch``'s (the same softmax step, two-level accumulation and epilogues): with
128-key tiles and lengths that are multiples of 128 the output is bit-identical to the dense kernel
run on the gathered K/V with its plain K box (``dense_launch.kperm_on`` off), and both V layouts give the
same bits. Everything else (16-bit Q or cache,
per-token-head scales, other page sizes, windows, softcap, explicit splits) stays on the Triton kernel;
``unsupported_reason`` says why.
"""
from __future__ import annotations

import math

import torch

from ..planning import (
    PAGED_TMA_HEAD_DIMS,
    PAGED_TMA_MIN_PAGE,
    PAGED_TMA_SMALL_PAGES,
    TMA_QUERY_BLOCK,
    is_v_seq_major,
    paged_tma_call_reason,
)
from . import dense_launch

__all__ = ["unsupported_reason", "launch_paged_prefill_tma", "block_n", "box_rows", "descale_strides", "HEAD_DIMS",
           "VARLEN_MIN_Q", "SMALL_PAGES"]

HEAD_DIMS = PAGED_TMA_HEAD_DIMS
_TILE = dense_launch.BLOCK_N  # rows per query block, keys per KV tile (64 for 64-slot pages)
_MIN_PAGE = PAGED_TMA_MIN_PAGE
# FA3's layout only: pages smaller than a tile, loaded one TMA box per page
SMALL_PAGES = PAGED_TMA_SMALL_PAGES
# Varlen launches of ``paged.launch_paged_fwd``: sequences with at least this many queries (one full
# query block) run here, shorter ones (decode rows, short chunks) on the Triton kernel.
VARLEN_MIN_Q = TMA_QUERY_BLOCK
assert TMA_QUERY_BLOCK == dense_launch.BLOCK_M == _TILE


def block_n(page_size, v_rows=False):
    """Keys per KV tile: 128, or with sequence-major V 64 for pages that 128 keys would straddle (a tile
    is then one TMA box of K and of V). With FA3's V layout (``v_rows``) always 128, in boxes of up to
    one page (``box_rows``)."""
    return _TILE if v_rows or page_size % _TILE == 0 else _MIN_PAGE


def box_rows(page_size, v_rows):
    """Keys per TMA box of K (and of V with FA3's layout): the tile, or the largest power of two up to
    128 that divides the page (16, 32 or 64 keys: one page or part of one). A box of fewer than 64 keys
    is a whole page (pages of 16 or 32, ``unsupported_reason``): the kernel's producer relies on it
    (``forward._box_rows``)."""
    return math.gcd(page_size, block_n(page_size, v_rows))


def _descale_ok(ds, batch, nheads_k):
    """A descale broadcastable to (batch, nheads_k): one element, (batch,), (batch, 1), (batch, nheads_k)."""
    if ds.dtype != torch.float32:
        return False
    if ds.numel() == 1:
        return True
    if ds.dim() == 1:
        return ds.shape[0] == batch
    return ds.dim() == 2 and ds.shape[0] in (1, batch) and ds.shape[1] in (1, nheads_k)


def descale_strides(ds):
    """(stride over batch, stride over kv heads) of a descale broadcastable to (batch, nheads_k) (None, one
    element: zeros)."""
    if ds is None or ds.numel() == 1:
        return 0, 0
    if ds.dim() == 1:
        return ds.stride(0), 0
    return (ds.stride(0) if ds.shape[0] > 1 else 0), (ds.stride(1) if ds.shape[1] > 1 else 0)


def unsupported_reason(q, k_cache, v_cache, page_table, cache_seqlens, out, lse, *, cu_seqlens_q, causal,
                       window_size, softcap, q_descale, k_descale, v_descale, k_cache_scales, v_cache_scales,
                       out_scale, num_splits, capability=None):
    """Why ``launch_paged_prefill_tma`` cannot run these inputs, or None when it can.

    Parameters are those of ``paged.launch_paged_fwd``. Supported: CUDA tensors on an sm90 device;
    q (batch, seqlen_q, nheads_q, d) float8_e4m3fn, contiguous, seqlen_q a positive multiple of 128, or
    varlen q (total_q, nheads_q, d) with contiguous int32 ``cu_seqlens_q`` (batch + 1,);
    d 64 or 128 for q, k and v; k_cache float8_e4m3fn (num_blocks, page_size, nheads_k, d) contiguous,
    v_cache the same, contiguous too (FA3's layout, transposed in the kernel) or sequence-major
    (``planning.is_v_seq_major``); page_size a multiple of 64, or 16 or 32 with FA3's V layout;
    nheads_q a multiple of nheads_k; int32 page_table (batch, max_pages) with unit last stride and
    int32 cache_seqlens (batch,); float32 descales broadcastable to (batch, nheads_k) (None reads as
    1); out bfloat16, or float8_e4m3fn with a one-element float32 ``out_scale``; lse None or float32
    (batch, nheads_q, seqlen_q) (varlen: (nheads_q, total_q)); no window, softcap, per-token-head cache
    scales, or ``num_splits`` above 1 (0, the heuristic, runs unsplit here: the kernel is persistent).
    ``capability``: judge the device by this compute capability instead of the tensors' device
    (``dense_launch.device_reason``).
    """
    if not dense_launch.HAS_GLUON:
        return "triton.experimental.gluon is not available"
    varlen = cu_seqlens_q is not None
    v_seq_major = is_v_seq_major(v_cache)
    why = paged_tma_call_reason(q, k_cache, v_cache, out.dtype, varlen=varlen, window_size=window_size,
                                softcap=softcap, out_scale=out_scale,
                                token_scales=k_cache_scales is not None or v_cache_scales is not None,
                                num_splits=num_splits, v_seq_major=v_seq_major)
    if why:
        return why
    if varlen:
        if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.dim() != 1 or cu_seqlens_q.stride(0) != 1 \
                or cu_seqlens_q.numel() < 2:
            return "cu_seqlens_q must be contiguous int32 (batch + 1,), batch >= 1"
        (total_q, hq, d), batch, sq = q.shape, cu_seqlens_q.numel() - 1, None
        rows, lse_shape = total_q + _TILE * (batch + 1), (hq, total_q)
    else:
        batch, sq, hq, d = q.shape
        rows, lse_shape = batch * sq, (batch, hq, sq)
    nb, ps, hk, dk = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape) or tuple(out.shape) != tuple(q.shape):
        return "shape mismatch between q/out or k_cache/v_cache"
    if varlen and (q.shape[0] == 0 or hq == 0):
        return "total_q and nheads_q must be positive"
    if not varlen and (batch == 0 or hq == 0):
        return "batch and nheads_q must be positive"
    if hk == 0 or hq % hk != 0:
        return f"nheads_q ({hq}) must be a multiple of nheads_k ({hk})"
    if not (q.is_contiguous() and k_cache.is_contiguous() and out.is_contiguous()):
        return "q, k_cache, out must be contiguous"
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != batch \
            or page_table.stride(1) != 1:
        return "page_table must be int32 (batch, max_pages) with unit last stride"
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (batch,) or cache_seqlens.stride(0) != 1:
        return "cache_seqlens must be contiguous int32 (batch,)"
    for name, ds in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if ds is not None and not _descale_ok(ds, batch, hk):
            return f"{name} must be float32 broadcastable to (batch, nheads_k)"
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != lse_shape):
        return "lse must be float32 " + ("(nheads_q, total_q)" if varlen else "(batch, nheads_q, seqlen_q)")
    if max(rows, nb * ps, nb * hk * d, page_table.stride(0) * batch) >= 2 ** 31:
        return "too many rows for 32-bit TMA coordinates"
    ts = (q, k_cache, v_cache, out)
    if any(t.data_ptr() % 16 for t in ts):
        return "q, k_cache, v_cache, out must be 16-byte aligned"
    # device checks last: the shape rules above hold (and are testable) without CUDA
    return dense_launch.device_reason(ts, (page_table, cache_seqlens, cu_seqlens_q, q_descale, k_descale, v_descale, lse,
                                        out_scale), capability)


def launch_paged_prefill_tma(q, k_cache, v_cache, page_table, cache_seqlens, out, lse, *, softmax_scale, causal,
                             q_descale=None, k_descale=None, v_descale=None, out_scale=None, cu_seqlens_q=None,
                             min_len_q=1, num_stages=None, block_list=None):
    """Launch the paged TMA prefill kernel. No validation: call only when ``unsupported_reason`` is None.

    Parameters
    ----------
    q : torch.Tensor
        float8_e4m3fn (batch, seqlen_q, nheads_q, d), or varlen (total_q, nheads_q, d) with
        ``cu_seqlens_q``; contiguous; the last queries of each sequence.
    k_cache : torch.Tensor
        float8_e4m3fn (num_blocks, page_size, nheads_k, d), contiguous.
    v_cache : torch.Tensor
        float8_e4m3fn (num_blocks, page_size, nheads_k, d), contiguous (FA3's layout: its tiles are
        transposed in shared memory, ``forward._ws_transpose_v``) or in memory order (num_blocks,
        nheads_k, d, page_size) (sequence-major: no transpose).
    page_table : torch.Tensor
        int32 (batch, max_pages); entries past a sequence's pages are never read.
    cache_seqlens : torch.Tensor
        int32 (batch,): keys per sequence, the queries' own included.
    out : torch.Tensor
        Like ``q``, contiguous: bfloat16, or float8_e4m3fn with ``out_scale``.
    lse : torch.Tensor or None
        float32 (batch, nheads_q, seqlen_q) (varlen: (nheads_q, total_q)), natural log; -inf (and out =
        0) for rows that see no key.
    softmax_scale : float
    causal : bool
        Bottom-right aligned causal mask.
    q_descale, k_descale, v_descale : torch.Tensor or None
        float32, broadcastable to (batch, nheads_k); None reads as 1.
    out_scale : torch.Tensor or None
        float32, one element: the fused e4m3 output's static scale.
    cu_seqlens_q : torch.Tensor or None
        int32 (batch + 1,): varlen query offsets.
    min_len_q : int
        Varlen: sequences with fewer queries are skipped (their rows of ``out`` / ``lse`` untouched).
    num_stages : int or None
        Depth of the K/V ring (default ``dense_launch.NUM_STAGES``, 2: on the H200 deeper rings ran no faster
        at 128-key tiles and slower at 64-key tiles).
    block_list : torch.Tensor or None
        Varlen: the query blocks (``dense_launch.empty_block_list``) when an earlier launch on the stream
        has filled them for ``min_len_q`` (``common.fill_varlen_block_list``); None builds them here.
    """
    varlen = cu_seqlens_q is not None
    if varlen:
        (total_q, hq, d), batch = q.shape, cu_seqlens_q.numel() - 1
        rows_q = total_q
    else:
        batch, sq, hq, d = q.shape
        rows_q = batch * sq
    nb, ps, hk, _ = k_cache.shape
    one = None
    if q_descale is None or k_descale is None or v_descale is None:
        one = torch.ones((), device=q.device, dtype=torch.float32)
    qd, kd, vd = (x if x is not None else one for x in (q_descale, k_descale, v_descale))
    rows, dh, dv, _ = dense_launch._tiles(d, True)
    v_rows = not is_v_seq_major(v_cache)
    bn = block_n(ps, v_rows)
    kb = box_rows(ps, v_rows)
    assert kb >= 64 or kb == ps, (kb, ps)  # the kernel takes a box under 64 keys for the whole page
    descs = ((q, [rows_q, hq * d], [hq * d, 1], [rows, dh]),
             (k_cache, [nb * ps, hk * d], [hk * d, 1], [kb, dh]),
             (v_cache, [nb * ps, hk * d], [hk * d, 1], [kb, dh]) if v_rows else
             (v_cache, [nb * hk * d, ps], [ps, 1], [dv, bn]),
             (out, [rows_q, hq * d], [hq * d, 1], [rows, dv]))
    if varlen:  # the query blocks listed on the device
        blocks, ls, row_args, grid = dense_launch.varlen_schedule(cu_seqlens_q, cache_seqlens, False, total_q, hq, lse,
                                                               out, min_len_q, block_list)
        seq_args = (blocks, out)
        seqlen_q, mode = total_q, dense_launch.MODE_PAGED_VARLEN
    else:
        ls = lse.stride() if lse is not None else (0, 0, 0)
        seq_args = (cache_seqlens, out)
        row_args, seqlen_q, mode = (0, 0), sq, dense_launch.MODE_PAGED
        grid = dense_launch.ws_grid((sq // dense_launch.BLOCK_M) * batch * hq, causal, sq, q.device.index)
    args = (lse if lse is not None else qd, qd, kd, vd, out_scale if out_scale is not None else qd, page_table,
            cache_seqlens, *seq_args, *ls, *descale_strides(qd), *descale_strides(kd), *descale_strides(vd),
            page_table.stride(0), ps, *row_args, seqlen_q, hq, hk, batch, float(softmax_scale) * dense_launch._LOG2E)
    dense_launch._launch(d, True, grid, descs, args,
                      (bool(causal), lse is not None, out_scale is not None, num_stages or dense_launch.NUM_STAGES, d,
                       mode, v_rows, d), bounded=True, tiles=(rows, dh, dv, bn))
    return out, lse
