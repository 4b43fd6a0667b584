"""Paged KV-cache block allocator: a free list of fixed-size blocks and per-sequence block tables."""

from __future__ import annotations

from collections import deque

__all__ = ["BlockAllocator", "OutOfBlocks", "blocks_needed"]


class OutOfBlocks(RuntimeError):
    """Raised by :meth:`BlockAllocator.allocate` when the free list is too short."""


def blocks_needed(num_tokens: int, page_size: int) -> int:
    """Number of pages that hold ``num_tokens`` tokens (ceil division)."""
    return -(-int(num_tokens) // int(page_size))


class BlockAllocator:
    """Fixed pool of KV-cache blocks (pages) with a FIFO free list.

    Blocks are plain integer ids in ``[0, num_blocks)``; the cache tensors themselves live in
    :class:`fp8attn.engine.kv_cache.PagedKVCache`. Freed blocks go to the back of the free list, so
    a block is reused only after every other free block has been handed out once (this makes stale
    data bugs show up in tests instead of hiding behind an immediately reused block).

    Parameters
    ----------
    num_blocks : int
        Size of the pool.
    page_size : int
        Tokens per block.
    """

    def __init__(self, num_blocks: int, page_size: int):
        if num_blocks <= 0 or page_size <= 0:
            raise ValueError(f"num_blocks and page_size must be positive, got {num_blocks}, {page_size}")
        self.num_blocks = int(num_blocks)
        self.page_size = int(page_size)
        self._free: deque[int] = deque(range(self.num_blocks))
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owned)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the free list; raises :class:`OutOfBlocks` (taking none) if short."""
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.popleft() for _ in range(n)]
        self._owned.update(out)
        return out

    def free(self, blocks: list[int]) -> None:
        """Return ``blocks`` to the free list. Freeing a block that is not allocated raises."""
        for b in blocks:
            if b not in self._owned:
                raise ValueError(f"block {b} is not allocated (double free?)")
            self._owned.remove(b)
            self._free.append(b)

    def check_invariants(self) -> None:
        """Every block is either free or owned, never both, never lost."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate block in free list"
        assert not (free & self._owned), "block both free and owned"
        assert len(free) + len(self._owned) == self.num_blocks, "block lost"
