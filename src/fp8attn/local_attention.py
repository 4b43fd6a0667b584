"""Chunked local attention (FA3's ``attention_chunk``): query ``i`` at key position ``p`` sees only the keys of
its chunk, ``p // chunk * chunk <= j < (p // chunk + 1) * chunk``, intersected with the causal / window masks.

A chunked call runs as one varlen call over its chunk pieces: each (sequence, chunk) becomes a sequence
whose queries are the last positions of its keys, so the kernels' bottom-right causal / window masks are
the full call's inside each chunk. Offsets and page-table rows of the pieces are built on the device from
capacities (``max_seqlen_q`` / ``max_seqlen_k`` / the cache's pages), never from live lengths: no host
sync, CUDA-graph safe. Inputs arrive validated (``fp8attn.interface``).
"""

from __future__ import annotations

import torch

from . import ops

__all__ = [
    "splits_into_chunks",
    "chunk_cu_seqlens",
    "chunked_varlen",
    "chunked_dense",
    "check_chunked_cache_call",
    "chunked_cache_call",
]


def splits_into_chunks(chunk, seqlen_q, seqlen_k) -> bool:
    """Whether ``attention_chunk=chunk`` changes a (seqlen_q, seqlen_k) call: a chunk that holds every key and
    query position (keys 0 .. seqlen_k - 1, queries at or after 0) changes nothing."""
    return bool(chunk and seqlen_q and seqlen_k and ((seqlen_k - 1) // chunk > 0 or seqlen_q > seqlen_k))


def chunk_cu_seqlens(cu_q, cu_k, max_q, max_k, chunk):
    """Varlen offsets of a chunked call: sequence b split into its (query, key) pieces per chunk of key positions.

    Piece (b, c) holds the queries whose key position ``p = i + len_k - len_q`` lies in chunk c and that
    chunk's keys: runs of consecutive rows in which the queries are the last positions of the keys, so the
    varlen call's bottom-right causal / window masks are the full call's inside each chunk. The chunk range is a
    capacity from ``max_q`` / ``max_k`` (the lengths stay on the device: no sync, CUDA-graph safe); chunks a
    sequence does not reach are empty pieces.

    Parameters
    ----------
    cu_q, cu_k : (batch + 1,) int32 varlen offsets of the queries and keys.
    max_q, max_k : int bounds of the per-sequence query and key lengths.
    chunk : int > 0, the chunk length in key positions.

    Returns
    -------
    (cu_q, cu_k, pieces) : (batch * pieces + 1,) int32 offsets of the pieces, and the int pieces per sequence.
    """
    lq = (cu_q[1:] - cu_q[:-1]).long()[:, None]
    lk = (cu_k[1:] - cu_k[:-1]).long()[:, None]
    first = -(max_q // chunk + 1)  # at or before the chunk of every sequence's first query and of key 0
    last = max(max_k - 1, 0) // chunk  # at or after the chunk of every last key
    c = torch.arange(first, last + 2, device=cu_q.device, dtype=torch.int64)[None, :] * chunk
    q_bounds = torch.minimum((c - (lk - lq)).clamp_min(0), lq)
    k_bounds = torch.minimum(c.clamp_min(0), lk)
    return _piece_offsets(cu_q, q_bounds), _piece_offsets(cu_k, k_bounds), last - first + 1


def _piece_offsets(cu, bounds):
    """int32 varlen offsets of pieces: sequence b's piece r spans rows ``bounds[b, r] .. bounds[b, r + 1]`` of
    the sequence (``bounds``: (batch, pieces + 1) int64, non-decreasing, last column its length)."""
    return torch.cat(((cu[:-1, None].long() + bounds[:, :-1]).flatten(), cu[-1:].long())).to(torch.int32)


def _per_piece(descales, pieces):
    """(batch, heads) descales repeated for each of a sequence's ``pieces`` chunk pieces (None stays None)."""
    return tuple(x.repeat_interleave(pieces, dim=0) if x is not None else None for x in descales)


def chunked_varlen(q, k, v, cu_q, cu_k, max_q, max_k, chunk, qd, kd, vd, **kw):
    """A varlen call with ``attention_chunk`` as one varlen call over its chunk pieces (``chunk_cu_seqlens``).

    Parameters
    ----------
    q : (total_q, nheads_q, headdim); k, v : (total_k, nheads_k, headdim[_v]), as ``ops.dense_fwd`` takes them.
    cu_q, cu_k : (batch + 1,) int32 offsets; max_q, max_k : int bounds of the lengths; chunk : int > 0.
    qd, kd, vd : expanded (batch, nheads_k) float32 descales, or None.
    **kw : the other keywords of ``ops.dense_fwd``.

    Returns
    -------
    (out, lse) : as ``ops.dense_fwd``: (total_q, nheads_q, headdim_v) and (nheads_q, total_q) float32.
    """
    cq, ck, pieces = chunk_cu_seqlens(cu_q, cu_k, max_q, max_k, chunk)
    qd, kd, vd = _per_piece((qd, kd, vd), pieces)
    return ops.dense_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cq,
        cu_seqlens_k=ck,
        max_seqlen_q=min(chunk, max_q),
        max_seqlen_k=min(chunk, max_k),
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        **kw,
    )


def _packed_out(out, rows):
    """A caller's ``out`` (batch, seqlen, heads, headdim_v) as the packed rows (rows, heads, headdim_v) that a
    varlen call writes, or None when it cannot be viewed so (``_fill_out`` then copies the result in)."""
    if out is None:
        return None
    try:
        return out.view(rows, *out.shape[2:])
    except RuntimeError:
        return None


def _fill_out(out, packed, o):
    """The call's output: the caller's ``out`` (written through ``packed``, or copied into here), else ``o``."""
    if out is not None and packed is None:
        out.copy_(o)
    return o if out is None else out


def chunked_dense(q, k, v, chunk, qd, kd, vd, **kw):
    """``flash_attn_func`` with ``attention_chunk``: the batch as varlen sequences of equal lengths, chunked
    (``chunked_varlen``).

    Parameters
    ----------
    q : (batch, seqlen_q, nheads_q, headdim); k, v : (batch, seqlen_k, nheads_k, headdim[_v]).
    chunk : int > 0; qd, kd, vd : expanded (batch, nheads_k) float32 descales, or None.
    **kw : the other keywords of ``ops.dense_fwd``, ``out`` included (None, or the caller's
        (batch, seqlen_q, nheads_q, headdim_v) output, written in place).

    Returns
    -------
    (out, lse) : (batch, seqlen_q, nheads_q, headdim_v) and (batch, nheads_q, seqlen_q) float32 (empty without
        ``return_lse``).
    """
    b, sq, hq, _ = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
    rows = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    out = kw.pop("out")
    packed = _packed_out(out, b * sq)
    o, lse = chunked_varlen(
        q.reshape(b * sq, hq, q.shape[-1]),
        k.reshape(b * sk, hk, k.shape[-1]),
        v.reshape(b * sk, hk, dv),
        rows * sq,
        rows * sk,
        sq,
        sk,
        chunk,
        qd,
        kd,
        vd,
        out=packed,
        **kw,
    )
    o = _fill_out(out, packed, o.view(b, sq, hq, dv))
    if lse.numel():
        lse = lse.view(hq, b, sq).transpose(0, 1).contiguous()
    return o, lse


def check_chunked_cache_call(chunk, cache_leftpad, page_size, causal, max_q):
    """What ``chunked_cache_call`` cannot run (``page_size``: 1 for a contiguous cache, read as one-token pages)."""
    if cache_leftpad is not None:
        raise NotImplementedError(
            "attention_chunk with cache_leftpad is not supported: drop the pad from the cache rows."
        )
    if max_q > 1 and not causal:
        raise NotImplementedError(
            "attention_chunk with more than one query per sequence over a cache needs causal=True "
            "(the queries are the last tokens). Pass causal=True, or one query per sequence."
        )
    if chunk % page_size:
        raise NotImplementedError(
            f"attention_chunk: expected a multiple of the page size {page_size} with a paged "
            f"cache, got {chunk}. Allocate pages that divide the chunk length."
        )


def chunked_cache_call(q, k_cache, v_cache, pt, total_len, chunk, cu_seqlens_q, max_seqlen_q, descales, **kw):
    """``flash_attn_with_kvcache`` with ``attention_chunk``: one varlen paged call over chunk pieces.

    Sequence b's queries sit at key positions ``L - len_q .. L - 1`` (``L = total_len[b]``). Piece r of it
    holds the queries of chunk ``c = (L - len_q) // chunk + r`` and, as its cache, the keys
    ``c * chunk .. min((c + 1) * chunk, L) - 1`` through its own page-table row (the sequence's row shifted by
    ``c * chunk`` keys in whole pages), so its queries are the last positions of its keys and the bottom-right
    causal / window masks hold inside the chunk. ``k_cache`` / ``v_cache`` / ``pt`` are a paged cache (the caller
    sees a contiguous one as one-token pages, as with ``cache_leftpad``). Everything is built on the device from
    capacities (no sync).

    Parameters
    ----------
    q : (batch, seqlen_q, nheads_q, headdim), or (total_q, nheads_q, headdim) with ``cu_seqlens_q``.
    k_cache, v_cache : (num_blocks, page_size, nheads_k, headdim[_v]); pt : (batch, max_pages) int32.
    total_len : (batch,) int32 / int64 lengths of the cache after any append.
    chunk : int > 0, a multiple of page_size; cu_seqlens_q : (batch + 1,) int32 or None; max_seqlen_q : int.
    descales : the expanded ``(q, k, v)`` (batch, nheads_k) float32 descales (entries may be None).
    **kw : the other keywords of ``ops.paged_fwd``, ``out`` included.

    Returns
    -------
    (out, lse) : q's shape with headdim_v, and (batch, nheads_q, seqlen_q) / varlen (nheads_q, total_q) float32.
    """
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        qp, cu_q, max_q = q, cu_seqlens_q, int(max_seqlen_q)
    else:
        batch, sq = q.shape[0], q.shape[1]
        qp = q.reshape(batch * sq, *q.shape[2:])
        cu_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * sq
        max_q = sq
    ps = k_cache.shape[1]
    lq = (cu_q[1:] - cu_q[:-1]).long()[:, None]
    end = total_len.long()[:, None]
    begin = end - lq  # the first query's key position
    pieces = max_q // chunk + 2  # chunks a run of max_q positions can touch (+1 spare: empty pieces)
    c0 = begin.clamp_min(0) // chunk  # (queries before key 0 see nothing; they sit in chunk c0's piece)
    starts = (c0 + torch.arange(pieces + 1, device=q.device, dtype=torch.int64)[None, :]) * chunk
    q_bounds = torch.minimum((starts - begin).clamp_min(0), lq)
    q_bounds[:, 0] = 0
    cu_pieces = _piece_offsets(cu_q, q_bounds)
    lens = (torch.minimum(starts[:, 1:], end) - starts[:, :-1]).clamp_min(0)  # keys of each piece
    width = min(pt.shape[1], chunk // ps)
    cols = (starts[:, :-1, None] // ps) + torch.arange(width, device=q.device, dtype=torch.int64)[None, None, :]
    rows = pt.long().gather(1, cols.clamp(0, pt.shape[1] - 1).flatten(1)).view(batch * pieces, width)
    qd, kd, vd = _per_piece(descales, pieces)
    out = kw.pop("out")
    packed = out if varlen else _packed_out(out, qp.shape[0])
    o, lse = ops.paged_fwd(
        qp,
        k_cache,
        v_cache,
        rows.to(torch.int32),
        lens.flatten().to(torch.int32),
        cu_seqlens_q=cu_pieces,
        max_seqlen_q=min(chunk, max_q),
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        out=packed,
        **kw,
    )
    if not varlen:
        o = o.view(batch, sq, *o.shape[1:])
        if lse.numel():
            lse = lse.view(lse.shape[0], batch, sq).transpose(0, 1).contiguous()
    return _fill_out(out, packed, o), lse
