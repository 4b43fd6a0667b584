"""The paged Triton kernel's launch plan, fixed from shapes (never from live lengths, so that it can be
captured in a CUDA graph): tiles per regime, the split count, the grid. Pure Python (no Triton): the
launcher (``kernels.paged``) runs it, and the CPU path runs the same plan to round P as the GPU kernel
that would take each row does (``ops``).
"""
from __future__ import annotations

import functools

from .launch_rules import cdiv, next_pow2
from .paged_cache import decode_shaped, small_shaped

__all__ = ["choose_num_splits", "choose_prefill_splits", "paged_config", "paged_grid", "DECODE_BLOCKS_PER_SM",
           "PREFILL_BLOCKS_PER_SM", "CPU_NUM_SMS"]

# The SM count the plan assumes without a GPU (H100 SXM / H200).
CPU_NUM_SMS = 132


# Decode blocks resident per SM (64-key one-page tiles, 128 registers, 3 stages; the split target).
DECODE_BLOCKS_PER_SM = 4


def choose_num_splits(batch: int, nheads_k: int, max_context: int, num_sms: int = CPU_NUM_SMS,
                      num_q_blocks: int = 1, min_tokens_per_split: int = 512, max_splits: int = 128) -> int:
    """Split count fixed from shapes (never from live lengths), so it can be captured in a CUDA graph.

    Below one program per SM, splits fill one wave of resident decode blocks:
    ``splits = floor(DECODE_BLOCKS_PER_SM * num_sms / programs)``, with at least ``min_tokens_per_split``
    context tokens per split (H200, 32/8 heads, FP8 cache page 64, sequence-major V: B1/L128k 66 splits
    85 us vs 33 splits 92 us; B8/L32k 8 vs 5: 141 vs 159 us; B16/L32k 4 vs 3: 259 vs 267 us). From one
    to three programs per SM it splits in two; from three per SM on it does not split (B64/L4096
    unsplit 0.139 ms vs 0.146 in two splits). See docs/perf-notes.md, paged round 7.
    """
    programs = max(1, batch * nheads_k * num_q_blocks)
    if programs >= 3 * num_sms:
        return 1
    want = 2 if programs >= num_sms else (DECODE_BLOCKS_PER_SM * num_sms) // programs
    cap = max(1, max_context // min_tokens_per_split)
    return int(max(1, min(want, cap, max_splits)))


# Programs of the 4-warp (128, 64) prefill tile at head dim 128 resident per SM (H200: 304 to 464 programs of
# the same work take the same time, two rounds of 264).
PREFILL_BLOCKS_PER_SM = 2
# The measured cost of one more split of a prefill launch, as a fraction of the unsplit launch's time (H200,
# 2k-context chunks over 8k keys: +4-5 us per split on ~255 us: the partials' writes, the combine).
_SPLIT_COST = 0.015
_PREFILL_MAX_SPLITS = 4


def choose_prefill_splits(programs: int, num_sms: int = CPU_NUM_SMS, max_context: int = 2 ** 31,
                          min_tokens_per_split: int = 512) -> int:
    """Split count of a fixed-length launch of 4-warp (128, 64) prefill tiles at head dim 128 whose unsplit
    grid (``programs``) fills one to three rounds of decode blocks (``choose_num_splits`` splits those in two).

    A round holds ``PREFILL_BLOCKS_PER_SM * num_sms`` programs and each split divides a program's keys, so
    ``s`` splits take ``ceil(programs * s / round) / s`` of the unsplit round's time, plus ``_SPLIT_COST`` per
    split beyond the first; the cheapest of 1 to 4 splits wins (ties: fewer). H200, 32 q / 8 kv heads, page
    64, chunks over 8k keys (``explore/prefill_splits.json``): 152-176 programs take 3 splits, 186-189 us
    against 261 in two; 232 programs one split (255 vs 263 us); 280 four (317 vs 340 us); 376 two.
    """
    rnd = PREFILL_BLOCKS_PER_SM * num_sms
    cap = max(1, min(_PREFILL_MAX_SPLITS, max_context // min_tokens_per_split))
    cost = {s: cdiv(programs * s, rnd) / s + _SPLIT_COST * (s - 1) for s in range(1, cap + 1)}
    return min(cost, key=lambda s: (cost[s], s))


# (block_m, block_n, num_warps, num_stages) by regime; see docs/perf-notes.md (paged, version 3).
_CONFIGS = {
    "decode": (16, 128, 4, 3),  # H200 quick run: best of (16,64,4,4) (16,32,4,6) (16,128,4,3) at B64/L4096
    "small": (64, 64, 4, 3),
    "prefill": (128, 64, 8, 3),
}


def paged_config(max_seqlen_q: int, qg: int, headdim: int, mma_fp8: bool, override: dict | None = None,
                 page_size: int | None = None, v_seq_major: bool = False, fp8_cache: bool = True,
                 token_scales: bool = False):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg) for a launch; fixed from shapes (cached per shape class).

    Outside decode, with ``page_size`` >= 64 smaller than the regime's BLOCK_N, BLOCK_N drops to the page
    size so that every KV tile lies in one page (one page id per tile). ``maxnreg`` (None: the compiler's
    choice) caps registers per thread where that buys a resident block per SM. An explicit ``override``
    is kept as given.
    """
    return _paged_config(max_seqlen_q, qg, headdim, mma_fp8, tuple(sorted((override or {}).items())), page_size,
                         v_seq_major, fp8_cache, token_scales)


@functools.lru_cache(maxsize=1024)
def _paged_config(max_seqlen_q: int, qg: int, headdim: int, mma_fp8: bool, override_items: tuple,
                  page_size: int | None, v_seq_major: bool, fp8_cache: bool, token_scales: bool):
    override = dict(override_items)
    maxnreg = None
    rows = max(1, max_seqlen_q) * qg
    decode = decode_shaped(max_seqlen_q, qg)
    if decode:
        bm, bn, nw, ns = _CONFIGS["decode"]
    elif small_shaped(max_seqlen_q, qg):
        bm, bn, nw, ns = _CONFIGS["small"]
    else:
        bm, bn, nw, ns = _CONFIGS["prefill"]
    bm = max(bm, next_pow2(qg))
    if headdim > 128:
        bn = min(bn, 32)
        if not mma_fp8 and bm > 64:
            bm, nw = 64, 4
    # Uncapped decode keeps its 128-key tiles: on the H200 the row-gathered (16,128,4,3) tile beat the
    # one-page (16,64,4,4) tile at page 64 (0.199 vs 0.218 ms, B64/L4096); prefill tiles are 64 keys
    # already. The capped decode tiles below are one-page tiles.
    if not decode and page_size is not None and 64 <= page_size < bn and bn % page_size == 0:
        bn = page_size
    # Sequence-major V in pages of 128+ keys: 128-key one-page prefill tiles (H200, 2k chunk over 8k,
    # FP8 Q, page 128: 0.588 -> 0.495 ms). With 64-key pages a 128-key tile gathers V rows (1.12 ms).
    if (not decode and rows > 64 and v_seq_major and page_size is not None and page_size % 128 == 0
            and headdim <= 128):
        bn = 128
    # P@V in fp16 over an FP8 cache (16-bit Q, or FP8 Q over FA3's layout) in (128, 64) prefill tiles: 4 warps
    # of 32 query rows beat 8 of 16 (H200, bf16 Q, 2k chunk over 8k: page 16 1.061 -> 0.959 ms, page 64
    # 1.037 -> 0.937, sequence-major V page 64 0.984 -> 0.863, page 128 1.074 -> 0.896; FP8 Q over FA3's
    # layout, 2000 queries over 8k: page 64 678 -> 589 us, page 16 700 -> 676). The (128, 128)
    # sequence-major tile keeps 8 warps (4: 0.880 -> 1.912 ms).
    if not decode and fp8_cache and not (mma_fp8 and v_seq_major) and not token_scales and (bm, bn) == (128, 64):
        nw = 4
    one_page_tiles = page_size is not None and page_size >= 64 and page_size % 64 == 0
    # Decode over an FP8 cache is bandwidth bound: four resident blocks per SM (128 registers per thread,
    # 3-stage rings of 64-key one-page tiles, <= 57 KB) stream faster than three. H200, B64/L4096 unsplit:
    # sequence-major V 0.139 ms vs 0.178 (136 registers) and 0.195 (4 stages); FA3's layout 0.172 vs
    # 0.189 (168 registers). A sequence-major V page is contiguous only inside the page, so it is read in
    # one-page tiles anyway (a row-gathered 128-key tile spilled). Per-token-head scales spill under the
    # cap (23-28 spilled loads in the sm90 compile) and keep the uncapped tiles (not timed capped).
    if (decode and fp8_cache and not token_scales and one_page_tiles and headdim <= 128
            and (v_seq_major or not mma_fp8)):
        bn, ns, maxnreg = 64, 3, 128
    elif decode and v_seq_major and one_page_tiles:
        bn, ns = 64, 4
    if override:
        bm = override.get("block_m", bm)
        bn = override.get("block_n", bn)
        nw = override.get("num_warps", nw)
        ns = override.get("num_stages", ns)
        maxnreg = override.get("maxnreg", maxnreg)
    return bm, bn, nw, ns, maxnreg


def paged_grid(*, batch: int, nheads_k: int, qg: int, headdim: int, max_seqlen_q: int, q_rows: int, varlen: bool,
               page_size: int, capacity: int, mma_fp8: bool, mma_fp8_s: bool, v_seq_major: bool, fp8_cache: bool,
               token_scales: bool, num_splits: int, num_sms: int, config: dict | None = None):
    """The launch's tiles, grid and split count: ``(tiles, small_tiles, block_q, two_class, grid0, num_splits)``.

    tiles / small_tiles: ``paged_config`` of the call and of its small tile class (a varlen call's decode
    rows); ``two_class``: a varlen call whose decode rows get programs of their own; ``grid0``: programs per
    (kv head, split) (``q_rows``: ``total_q`` for varlen, else ``seqlen_q``; 0 when there is nothing to
    launch); ``num_splits``: the call's, or with 0 the heuristic's (``choose_num_splits`` over ``capacity``
    cache slots per sequence). Cached per shape (host time: one lookup per launch).
    """
    return _paged_grid(batch, nheads_k, qg, headdim, max_seqlen_q, q_rows, varlen, page_size, capacity, mma_fp8,
                       mma_fp8_s, v_seq_major, fp8_cache, bool(token_scales), int(num_splits), num_sms,
                       tuple(sorted(config.items())) if config else ())


@functools.lru_cache(maxsize=4096)
def _paged_grid(batch, nheads_k, qg, headdim, max_seqlen_q, q_rows, varlen, page_size, capacity, mma_fp8, mma_fp8_s,
                v_seq_major, fp8_cache, token_scales, num_splits, num_sms, config_items):
    config = dict(config_items)
    tiles = paged_config(max_seqlen_q, qg, headdim, mma_fp8, config, page_size, v_seq_major, fp8_cache, token_scales)
    block_q = max(1, tiles[0] // qg)
    small_tiles = paged_config(1, qg, headdim, mma_fp8_s, None, page_size, v_seq_major, fp8_cache, token_scales)
    two_class = varlen and tiles[0] > small_tiles[0] and bool(config.get("two_class", True))
    if varlen:
        grid0 = q_rows // block_q + batch + (batch if two_class else 0)
    else:
        grid0 = batch * cdiv(max(q_rows, 1), block_q)
    if batch == 0:
        grid0 = 0
    if num_splits <= 0 and grid0:  # 0 = heuristic, fixed from shapes/capacities (CUDA-graph safe)
        num_splits = choose_num_splits(batch, nheads_k, capacity, num_sms, num_q_blocks=max(1, grid0 // max(batch, 1)))
        # the grids it splits in two, on the 4-warp prefill tile: by that tile's rounds
        if num_splits == 2 and not varlen and tiles[:3] == (128, 64, 4) and headdim == 128:
            num_splits = choose_prefill_splits(grid0 * nheads_k, num_sms, capacity)
    return tiles, small_tiles, block_q, two_class, grid0, max(1, num_splits)
