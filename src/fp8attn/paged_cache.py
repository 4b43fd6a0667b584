"""Paged KV-cache layout helpers (torch): page tables, slot mappings, cache and split-workspace allocation, the
V layout predicates and the precision rule the paged kernels and the CPU path share."""

from __future__ import annotations

import torch

from .kernels.planning import (
    decode_row_queries,
    decode_shaped,
    is_v_seq_major,
    paged_precision,
    paged_precisions,
    small_shaped,
    split_partials,
)

__all__ = [
    "make_page_table",
    "slot_mapping_for",
    "alloc_paged_cache",
    "empty_paged",
    "to_v_seq_major",
    "is_v_seq_major",
    "paged_precision",
    "paged_precisions",
    "decode_shaped",
    "small_shaped",
    "decode_row_queries",
    "packed_token_seqs",
    "token_rows",
    "split_workspace",
]

_CACHE_DTYPES = (
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.bfloat16,
    torch.float16,
    torch.float32,
)


def _check_cache_shape(**sizes):
    """Each ``name=(value, minimum)``: a Python int >= minimum. (Messages as ``_checks._fail`` writes them;
    ``_checks`` imports this module.)"""
    for name, (n, lo) in sizes.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < lo:
            got = repr(n) if isinstance(n, (int, float, str)) else type(n).__name__
            raise (ValueError if isinstance(n, int) and not isinstance(n, bool) else TypeError)(
                f"{name}: expected an int >= {lo}, got {got}. Pass the {name.replace('_', ' ')} as an int."
            )


def alloc_paged_cache(
    num_blocks,
    page_size,
    nheads_k,
    headdim,
    dtype=torch.float8_e4m3fn,
    device="cpu",
    poison_nan=False,
    with_scales=False,
    v_seq_major=False,
):
    """Allocate (k_cache, v_cache[, k_scales, v_scales]) of shape (num_blocks, page_size, nheads_k, headdim).

    num_blocks >= 0, page_size, nheads_k, headdim >= 1 (ints); dtype: e4m3fn, e5m2, e4m3fnuz (CPU emulation),
    bf16, fp16 or fp32.

    ``poison_nan`` fills every slot with NaN (for tests: unwritten slots must never be read).
    ``v_seq_major`` stores V sequence-major inside each page: the same (num_blocks, page_size, nheads_k,
    headdim) shape, memory order (num_blocks, nheads_k, headdim, page_size). Every function taking a V
    cache accepts it; on Hopper the FP8 P@V of chunked prefill then reads V tiles K-major instead of
    transposing them (use page_size >= 64)."""
    _check_cache_shape(
        num_blocks=(num_blocks, 0), page_size=(page_size, 1), nheads_k=(nheads_k, 1), headdim=(headdim, 1)
    )
    if dtype not in _CACHE_DTYPES:
        raise TypeError(
            f"dtype: expected one of {', '.join(str(d) for d in _CACHE_DTYPES)}, got {dtype!r}. "
            "Pass torch.float8_e4m3fn for an FP8 cache, or the model's 16-bit dtype."
        )
    for name, flag in (("poison_nan", poison_nan), ("with_scales", with_scales), ("v_seq_major", v_seq_major)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected True or False, got {type(flag).__name__}. Pass {name} as a bool.")
    shape = (num_blocks, page_size, nheads_k, headdim)
    k = empty_paged(shape, dtype, device)
    v = empty_paged(shape, dtype, device, seq_major=v_seq_major)
    for t in (k, v):
        t.fill_(float("nan")) if poison_nan else t.zero_()
    if not with_scales:
        return k, v
    sc = lambda: torch.full(shape[:3], float("nan") if poison_nan else 1.0, device=device)  # noqa: E731
    return k, v, sc(), sc()


def empty_paged(shape, dtype, device, seq_major=False) -> torch.Tensor:
    """Uninitialized (num_blocks, page_size, nheads_k, headdim) cache; ``seq_major`` puts it in the
    memory order (num_blocks, nheads_k, headdim, page_size) (a sequence-major V cache)."""
    if not seq_major:
        return torch.empty(shape, dtype=dtype, device=device)
    nb, ps, hk, d = shape
    return torch.empty((nb, hk, d, ps), dtype=dtype, device=device).permute(0, 3, 1, 2)


def to_v_seq_major(v_cache: torch.Tensor) -> torch.Tensor:
    """A sequence-major copy of ``v_cache`` (same shape and values, NaN slots included)."""
    out = empty_paged(v_cache.shape, v_cache.dtype, v_cache.device, seq_major=True)
    return out.copy_(v_cache)


def split_workspace(q: torch.Tensor, num_splits: int, headdim_v: int, nheads_q: int | None = None):
    """Preallocate the split-KV partials of calls shaped like ``q`` (allocate once, outside CUDA-graph capture;
    pass as ``flash_attn_with_kvcache(..., num_splits=n, split_workspace=...)``, n <= ``num_splits``).

    Parameters
    ----------
    q : (batch, seqlen_q, nheads_q, headdim) or varlen (total_q, nheads_q, headdim); only its shape and
        device are read.
    num_splits : int >= 1, the most KV splits a call will use.
    headdim_v : V's head dim. nheads_q : query heads (default: q's).

    Returns
    -------
    (out_partial, lse_partial) : float32 (num_splits, batch, seqlen_q, nheads_q, headdim_v) and
        (num_splits, batch, seqlen_q, nheads_q); varlen q gives (num_splits, total_q, nheads_q, headdim_v)
        and (num_splits, total_q, nheads_q). Their contents are scratch (overwritten by every call).
    """
    if not isinstance(q, torch.Tensor) or q.dim() not in (3, 4):
        got = f"shape {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise (ValueError if isinstance(q, torch.Tensor) else TypeError)(
            f"q: expected a (batch, seqlen_q, nheads_q, headdim) or varlen (total_q, nheads_q, headdim) tensor, got "
            f"{got}. Pass the q of the calls the workspace serves."
        )
    _check_cache_shape(
        num_splits=(num_splits, 1),
        headdim_v=(headdim_v, 1),
        **({} if nheads_q is None else {"nheads_q": (nheads_q, 1)}),
    )
    return split_partials(q, num_splits, headdim_v, q.shape[-2] if nheads_q is None else nheads_q)


def make_page_table(seqlens, page_size, num_blocks, generator=None, device="cpu", fill=-1):
    """A random (batch, max_pages) int32 page table over a pool of ``num_blocks`` pages.

    Pages are drawn without replacement from a random permutation of the pool; entries beyond a
    sequence's pages hold ``fill`` (-1 by default)."""
    seqlens = [int(s) for s in seqlens]
    need = [(s + page_size - 1) // page_size for s in seqlens]
    max_pages = max(max(need, default=0), 1)
    if sum(need) > num_blocks:
        raise ValueError(f"num_blocks: expected >= {sum(need)} pages for these sequences, got {num_blocks}.")
    perm = torch.randperm(num_blocks, generator=generator)
    table = torch.full((len(seqlens), max_pages), fill, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at : at + n].to(torch.int32)
        at += n
    return table.to(device)


def packed_token_seqs(cu_seqlens: torch.Tensor, total: int):
    """``(sequence, token)`` int64 indices of the ``total`` tokens of a packed (cu_seqlens) batch, without a
    host sync; tokens past ``cu_seqlens[-1]`` (padding) get the sequence index ``batch``."""
    tok = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), tok, right=True), tok


def token_rows(device, batch, seqlen=None, cu_seqlens=None, total=None):
    """(batch row, index within the row) of every token of a padded (batch, seqlen) or packed (cu_seqlens, ``total``
    tokens) layout, as int64 tensors in token order (no host sync); packed tokens past ``cu_seqlens[-1]`` get the
    row ``batch``."""
    if cu_seqlens is None:
        return (
            torch.arange(batch, device=device).repeat_interleave(seqlen),
            torch.arange(seqlen, device=device).repeat(batch),
        )
    seq, tok = packed_token_seqs(cu_seqlens, total)
    return seq, tok - cu_seqlens.long()[seq]


def slot_mapping_for(page_table, page_size, seq_idx, positions, num_blocks=None):
    """Slots (block * page_size + offset) of tokens at ``positions`` of sequences ``seq_idx``.

    A token whose position lies outside its row's capacity ``[0, max_pages * page_size)``, whose sequence is not a
    row of the table, or (with ``num_blocks``) whose page id is outside ``[0, num_blocks)``, gets slot -1, which
    the cache writes skip: lengths the API's value checks did not see never write over another token's slot (no
    host sync). (A page id of -1 gives a negative slot either way.)"""
    positions, seq_idx = positions.long(), seq_idx.long()
    rows, cols = page_table.shape
    page_col = torch.div(positions, page_size, rounding_mode="floor")
    ok = (positions >= 0) & (page_col < cols) & (seq_idx < rows)
    pages = page_table.long()[seq_idx.clamp(max=max(rows - 1, 0)), page_col.clamp(0, max(cols - 1, 0))]
    if num_blocks is not None:
        ok &= (pages >= 0) & (pages < num_blocks)
    return torch.where(ok, pages * page_size + positions % page_size, -1)
