"""The Hopper TMA kernels' launch signature, shared by the kernels (``forward``) and their launchers
(``dense_launch``, ``paged_launch``); Python only, so it imports without Gluon.

Integers and pointers are not specialized (values, divisibility, alignment): a compiled kernel depends
only on its constexprs and the descriptors' block types, which lets ``dense_launch._launch`` reuse it.
"""
from __future__ import annotations

__all__ = ["HEAD_DIMS", "BLOCK_M", "BLOCK_N", "NUM_STAGES", "NUM_WARPS", "ENTRY", "MODE_DENSE", "MODE_PAGED",
           "MODE_VARLEN", "MODE_PAGED_VARLEN"]

HEAD_DIMS = (64, 128, 256)
BLOCK_M = 128
BLOCK_N = 128
NUM_STAGES = 2
NUM_WARPS = 8
_PTR_ARGS = ("Lse", "QDs", "KDs", "VDs", "OutScale")
_INT_ARGS = ("stride_lb", "stride_lh", "stride_lm", "stride_qds_b", "stride_qds_h", "stride_kds_b",
             "stride_kds_h", "stride_vds_b", "stride_vds_h", "seqlen_q", "seqlen_k", "nheads_q", "nheads_k",
             "batch")
_BOUNDED_PTR_ARGS = _PTR_ARGS + ("PageTable", "SeqlensK", "BlockList", "Out")
_BOUNDED_INT_ARGS = tuple(a for a in _INT_ARGS if a != "seqlen_k") + ("stride_pt", "page_size", "stride_om",
                                                                      "stride_oh")
# Where the warp-specialized kernel's sequences come from (its MODE): fixed lengths (dense); a paged cache
# (key counts per sequence, fixed query count); varlen queries and keys (cu_seqlens_q / cu_seqlens_k);
# varlen queries over a paged cache. Bit 0: keys from pages; bit 1: varlen queries (a block list).
MODE_DENSE, MODE_PAGED, MODE_VARLEN, MODE_PAGED_VARLEN = 0, 1, 2, 3

# A varlen block list entry: (sequence, query block, first query row, query count, first key row, key count),
# padded to 8 int32 (one 32-byte sector); the header (the block count) takes the first 8 slots.
ENTRY = 8
