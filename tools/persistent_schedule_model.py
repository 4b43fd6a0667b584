"""Load model of the persistent dense kernel's causal schedule (no GPU needed).

Each 128-row causal query block costs its visible KV tiles plus a fixed per-block cost; prints each
schedule's makespan over the ideal (total work / CTAs) for the bench's causal shapes (16 heads,
batch * seqlen = 16k, 132 CTAs):

* alternating round robin (``scheduler._ws_round_robin``) over the longest-blocks-of-all-heads-first
  order (``_ws_block_of``), over a head-major order, and over orders that group 2, 4 or 8 heads;
* one block per CTA, dispatched greedily in head-major order (what the hardware does with a full grid).
"""

import heapq

CTAS = 132


def alternating(n_mb, n_bh, rank_of, cost=0.3):
    load = [0.0] * CTAS
    n = n_mb * n_bh
    for r in range(-(-n // CTAS)):
        for c in range(CTAS):
            t = r * CTAS + (c if r % 2 == 0 else CTAS - 1 - c)
            if t < n:
                load[c] += rank_of(t, n_mb, n_bh) + 1 + cost
    return max(load) / (sum(load) / CTAS)


def greedy_head_major(n_mb, n_bh, cost=1.0):
    heap = [(0.0, c) for c in range(CTAS)]
    total = 0.0
    for _ in range(n_bh):
        for m in reversed(range(n_mb)):
            t, c = heapq.heappop(heap)
            heapq.heappush(heap, (t + m + 1 + cost, c))
            total += m + 1 + cost
    return max(t for t, _ in heap) / (total / CTAS)


def longest_first(t, n_mb, n_bh):
    return n_mb - 1 - t // n_bh


def head_major(t, n_mb, n_bh):
    return n_mb - 1 - t % n_mb


def grouped(g):
    return lambda t, n_mb, n_bh: n_mb - 1 - (t % (g * n_mb)) // g


if __name__ == "__main__":
    print("seqlen  longest-first  head-major  groups of 2 / 4 / 8  one block per CTA (greedy)")
    for s in (2048, 4096, 8192, 16384):
        n_mb, n_bh = s // 128, 16 * (16384 // s)
        groups = " / ".join(f"{alternating(n_mb, n_bh, grouped(g)):.3f}" for g in (2, 4, 8))
        print(
            f"{s:6d}  {alternating(n_mb, n_bh, longest_first):13.3f}  {alternating(n_mb, n_bh, head_major):10.3f}"
            f"  {groups:>19s}  {greedy_head_major(n_mb, n_bh):.3f}"
        )
