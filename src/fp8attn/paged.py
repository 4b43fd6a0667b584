"""Paged-cache helpers (torch): page tables, slot mappings, allocation of a test/engine pool."""
from __future__ import annotations

import torch

__all__ = ["make_page_table", "slot_mapping_for", "alloc_paged_cache"]


def alloc_paged_cache(num_blocks, page_size, nheads_k, headdim, dtype=torch.float8_e4m3fn, device="cpu",
                      poison_nan=False, with_scales=False):
    """Allocate (k_cache, v_cache[, k_scales, v_scales]) of shape (num_blocks, page_size, nheads_k, headdim).

    ``poison_nan`` fills every slot with NaN (for tests: unwritten slots must never be read)."""
    shape = (num_blocks, page_size, nheads_k, headdim)
    if poison_nan:
        k = torch.full(shape, float("nan"), device=device).to(dtype)
        v = torch.full(shape, float("nan"), device=device).to(dtype)
    else:
        k = torch.zeros(shape, device=device, dtype=dtype)
        v = torch.zeros(shape, device=device, dtype=dtype)
    if not with_scales:
        return k, v
    sc = lambda: torch.full(shape[:3], float("nan") if poison_nan else 1.0, device=device)  # noqa: E731
    return k, v, sc(), sc()


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
        table[b, :n] = perm[at:at + n].to(torch.int32)
        at += n
    return table.to(device)


def slot_mapping_for(page_table, page_size, seq_idx, positions):
    """Slots (block * page_size + offset) of tokens at ``positions`` of sequences ``seq_idx``.

    The page column is clamped to the table's width, so a position past the capacity (rejected by the
    API's value checks where they run) never indexes outside the table (no host sync needed)."""
    positions = positions.long()
    page_col = (positions // page_size).clamp(max=page_table.shape[1] - 1)
    pages = page_table.long()[seq_idx.long(), page_col]
    return pages * page_size + positions % page_size
