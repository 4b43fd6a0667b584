"""The persistent schedule of the warp-specialized kernels: block index -> (sequence, head, query
block), one mapping walked by the producer and every consumer of a CTA.

A grid of one CTA per SM takes the blocks in rounds (``_ws_round_robin``, alternating direction so that
long and short causal blocks pair up); a grid of one CTA per block runs one each. Varlen launches read
their blocks from a list built on the device (``dense_launch.varlen_block_list``).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .pipeline import _query_block
from .signature import ENTRY

__all__ = ["_ws_round_robin", "_ws_block", "_ws_num_blocks", "_ws_query_blocks", "_ws_block_of"]

# Globals read inside Gluon code must be constexpr.
_ENTRY_G = gl.constexpr(ENTRY)


@gluon.jit
def _ws_round_robin(r):
    """This CTA's block of round r: blocks r * grid .. r * grid + grid - 1 go one per CTA, in CTA
    order on even rounds and in reverse order on odd ones. Causal blocks shrink along the order, and
    alternating pairs a longer block with a shorter one (on the H200 a plain round robin ran well behind
    the one-block-per-CTA grid on long causal inputs, the alternating one close to it)."""
    g = gl.num_programs(0)
    c = gl.program_id(0)
    return r * g + gl.where(r % 2 == 0, c, g - 1 - c)


@gluon.jit
def _ws_block(t, n_blocks, seqlen_q, seqlen_k, batch, nheads_q, nheads_k, BM: gl.constexpr, BN: gl.constexpr,
              CAUSAL: gl.constexpr, SeqlensK, BlockList, MODE: gl.constexpr):
    """Block t of the persistent schedule -> ``(b, h, hk, m0, shift, n_tiles, seqlen_k, q_row, k_row,
    len_q)``: ``_query_block``'s values, the sequence's key count, the rows of its first query and key
    in the Q and K views, and its query count; the producer and both consumers walk the blocks through
    this one mapping (``n_blocks``: ``_ws_num_blocks``). MODE (``MODE_*``): dense; paged (key counts
    from ``SeqlensK``); varlen (MODE >= 2): the entries of ``BlockList`` (``varlen_block_list``: each
    block's sequence, query block, first query row, query count, first key row and key count)."""
    if MODE >= 2:
        # One entry holds the block's bounds (independent loads from one sector; the block count
        # comes from the caller's n_blocks, loaded once per CTA).
        pid_m, h = _ws_block_of(t, n_blocks // nheads_q, nheads_q, CAUSAL)
        e = BlockList + _ENTRY_G * (1 + pid_m)
        b = gl.load(e)
        qblk = gl.load(e + 1)
        q_row = gl.load(e + 2)
        len_q = gl.load(e + 3)
        k_row = gl.load(e + 4)
        seqlen_k = gl.load(e + 5)
        _, _, hk, m0, shift, n_tiles = _query_block(qblk, b * nheads_q + h, len_q, seqlen_k, nheads_q, nheads_k,
                                                    BM, BN, CAUSAL, True)
    else:
        pid_m, pid_bh = _ws_block_of(t, _ws_query_blocks(seqlen_q, BM), batch * nheads_q, CAUSAL)
        if MODE == 1:
            seqlen_k = gl.load(SeqlensK + pid_bh // nheads_q)
        b, h, hk, m0, shift, n_tiles = _query_block(pid_m, pid_bh, seqlen_q, seqlen_k, nheads_q, nheads_k, BM,
                                                    BN, CAUSAL, MODE == 1)
        q_row = b * seqlen_q
        k_row = b * seqlen_k
        len_q = seqlen_q
    return b, h, hk, m0, shift, n_tiles, seqlen_k, q_row, k_row, len_q


@gluon.jit
def _ws_num_blocks(seqlen_q, batch, nheads_q, BM: gl.constexpr, BlockList, MODE: gl.constexpr):
    """Query blocks of the persistent schedule (varlen: those of ``BlockList``, see ``_ws_block``)."""
    if MODE >= 2:
        return gl.load(BlockList) * nheads_q
    else:
        return _ws_query_blocks(seqlen_q, BM) * batch * nheads_q


@gluon.jit
def _ws_query_blocks(seqlen_q, BM: gl.constexpr):
    """Query blocks per sequence of fixed length: ``seqlen_q`` is a multiple of 128 (``dense_launch.supported``),
    so 128-row blocks divide it; 192-row blocks (three consumers) may end past it."""
    if BM == 128:
        return seqlen_q // BM
    else:
        return gl.cdiv(seqlen_q, BM)


@gluon.jit
def _ws_block_of(t, n_mb, n_bh, CAUSAL: gl.constexpr):
    """Block index t -> (query block, batch * head). Non-causal: the query blocks of one head are
    adjacent (concurrent CTAs share its K/V in L2). Causal on a persistent grid: the longest query
    blocks (most keys) of every head first, so that the alternating round robin (``_ws_round_robin``)
    balances the CTAs; causal on a full grid (one block per CTA, balanced by the hardware's dynamic
    scheduling): per head, longest first, as the other kernels' grids."""
    if CAUSAL:
        if gl.num_programs(0) < n_mb * n_bh:
            return n_mb - 1 - t // n_bh, t % n_bh
        else:
            return n_mb - 1 - t % n_mb, t // n_mb
    else:
        return t % n_mb, t // n_mb
