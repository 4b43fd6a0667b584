"""Key-range and sequence-search helpers shared by the dense and paged kernels (kernels/common.py), checked
by brute force.

``kv_range`` bounds the keys a block of query rows may see; ``full_tile_range`` picks the tiles inside a
loop range that need no mask at all. A key tile wrongly called "full" would let masked keys (or
NaN-poisoned slots past the length) into the softmax, so every full tile is checked against the
visibility rule key by key, and the choice is checked to be tight (the tiles next to it do need masks).
"""

import random

import pytest
import torch
import triton
import triton.language as tl

from fp8attn.kernels.common import cdiv, find_seq, full_tile_range, kv_range, next_pow2

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NPARAM = 9  # tok_lo, tok_hi, seqlen_q, seqlen_k, window_left, window_right, split, num_splits, unused


@triton.jit
def _ranges_kernel(P, R, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    i = tl.program_id(0)
    tok_lo = tl.load(P + i * 9 + 0)
    tok_hi = tl.load(P + i * 9 + 1)
    seqlen_q = tl.load(P + i * 9 + 2)
    seqlen_k = tl.load(P + i * 9 + 3)
    wl = tl.load(P + i * 9 + 4)
    wr = tl.load(P + i * 9 + 5)
    split = tl.load(P + i * 9 + 6)
    num_splits = tl.load(P + i * 9 + 7)
    kv_lo, kv_hi = kv_range(tok_lo, tok_hi, seqlen_q, seqlen_k, wl, wr, CAUSAL, HAS_WINDOW, BLOCK_N)
    # the paged kernel's split of [kv_lo, kv_hi) into num_splits runs of whole tiles
    n_tiles = tl.cdiv(kv_hi - kv_lo, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    start = kv_lo + split * per_split * BLOCK_N
    end = tl.minimum(kv_hi, start + per_split * BLOCK_N)
    full_lo, full_hi = full_tile_range(
        tok_lo, tok_hi, seqlen_q, seqlen_k, wl, wr, CAUSAL, HAS_WINDOW, BLOCK_N, start, end
    )
    tl.store(R + i * 6 + 0, kv_lo)
    tl.store(R + i * 6 + 1, kv_hi)
    tl.store(R + i * 6 + 2, start)
    tl.store(R + i * 6 + 3, end)
    tl.store(R + i * 6 + 4, full_lo)
    tl.store(R + i * 6 + 5, full_hi)


def _visible(j, i, sq, sk, causal, wl, wr):
    shift = sk - sq
    ok = 0 <= j < sk
    if causal:
        ok = ok and j <= i + shift
    if wl >= 0:
        ok = ok and j >= i + shift - wl
    if wr >= 0:
        ok = ok and j <= i + shift + wr
    return ok


def _cases(rng, has_window, n=150):
    out = []
    for _ in range(n):
        sq = rng.randint(1, 70)
        sk = rng.choice([rng.randint(0, 90), sq + rng.randint(0, 90)])
        tok_lo = rng.randrange(sq)
        tok_hi = min(sq - 1, tok_lo + rng.randint(0, 20))
        wl = rng.choice([-1, rng.randint(0, 40)]) if has_window else -1
        wr = rng.choice([-1, rng.randint(0, 10)]) if has_window else -1
        num_splits = rng.choice([1, 1, 2, 3, 5])
        out.append([tok_lo, tok_hi, sq, sk, wl, wr, rng.randrange(num_splits), num_splits, 0])
    return out


@pytest.mark.parametrize("block_n", [16, 32])
@pytest.mark.parametrize("causal,has_window", [(True, False), (False, False), (True, True), (False, True)])
def test_full_tile_range_is_exact(block_n, causal, has_window):
    rng = random.Random(1000 * block_n + 10 * causal + has_window)
    cases = _cases(rng, has_window)
    params = torch.tensor(cases, dtype=torch.int32, device=DEV)
    res = torch.full((len(cases), 6), -7, dtype=torch.int32, device=DEV)
    _ranges_kernel[(len(cases),)](params, res, CAUSAL=causal, HAS_WINDOW=has_window, BLOCK_N=block_n)
    n_full = 0
    for (tok_lo, tok_hi, sq, sk, wl, wr, _, _, _), r in zip(cases, res.tolist()):
        kv_lo, kv_hi, start, end, full_lo, full_hi = r
        rows = range(tok_lo, tok_hi + 1)

        def tile_full(t0, sq=sq, sk=sk, wl=wl, wr=wr, rows=rows):
            return all(_visible(j, i, sq, sk, causal, wl, wr) for j in range(t0, t0 + block_n) for i in rows)

        # kv_range covers every visible key
        seen = [j for j in range(-5, sk + 5) if any(_visible(j, i, sq, sk, causal, wl, wr) for i in rows)]
        assert all(kv_lo <= j < kv_hi for j in seen), (r, seen[:3], seen[-3:])
        assert kv_lo % block_n == 0
        if start >= end:
            continue
        assert start % block_n == 0
        assert full_lo % block_n == 0 and full_hi % block_n == 0
        assert start <= full_lo <= full_hi <= -(-end // block_n) * block_n, r
        for t0 in range(full_lo, full_hi, block_n):
            assert tile_full(t0), (r, t0)
            n_full += 1
        # tight: the tiles just outside [full_lo, full_hi) inside the loop range need a mask
        if full_hi + block_n <= end:
            assert not tile_full(full_hi), (r, "tile at full_hi is fully visible")
        if full_lo - block_n >= start:
            assert not tile_full(full_lo - block_n), (r, "tile before full_lo is fully visible")
    assert n_full > 0  # the cases exercise the unmasked loop


@triton.jit
def _find_seq_kernel(CU, T, R, batch, BLOCK_Q: tl.constexpr):
    i = tl.program_id(0)
    tl.store(R + i, find_seq(CU, tl.load(T + i), batch, BLOCK_Q))


@pytest.mark.parametrize("batch", [1, 5, 256, 300])
def test_find_seq_matches_a_scan(batch):
    """``find_seq`` (vector loads of 256 sequences at a time) against a linear scan, with empty sequences,
    one-block ones and long ones, for every block index of the varlen grid's capacity (the programs past
    the last block find the last sequence, as with the binary search it replaced)."""
    rng = random.Random(batch)
    block_q = 4
    lens = [rng.choice([0, 0, 1, 3, 4, 5, 17]) for _ in range(batch)]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=DEV)
    capacity = int(cu[-1]) // block_q + batch
    targets = torch.arange(capacity + 3, dtype=torch.int32, device=DEV)
    got = torch.empty_like(targets)
    _find_seq_kernel[(targets.numel(),)](cu, targets, got, batch, BLOCK_Q=block_q)
    starts = [int(cu[i]) // block_q + i for i in range(batch)]
    want = [max(i for i in range(batch) if starts[i] <= t) for t in targets.tolist()]
    assert got.tolist() == want


def test_host_cdiv_and_next_pow2_match_triton():
    """The launchers' plain-Python ``cdiv`` / ``next_pow2`` (triton's are constexpr functions, ~1.5 us a call
    on the host) give triton's values."""
    for n in range(1, 2100):
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64, 128):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
    assert cdiv(0, 64) == 0 and next_pow2(1) == 1
