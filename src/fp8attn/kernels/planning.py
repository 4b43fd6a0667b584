"""Host-side launch planning shared by the kernel launchers and the CPU path (torch only, no Triton).

The CPU path rounds P as the GPU kernel that would run the call does, so it needs the part of the
kernels' dispatch that depends on the call itself (dtypes, head dims, page size and V layout, query
counts, options), not on memory (contiguity, alignment, devices), which the launchers add. Here: the
window flags and the TMA kernels' call rules; the paged Triton kernel's plan (tiles per regime, split
count, grid), fixed from shapes, never from live lengths, so that it can be captured in a CUDA graph;
its multiply precisions; and the constants the kernels share with the host (the descale floor, the
scale storage padding, the V cache layout predicate). Host modules import them from here.
"""
from __future__ import annotations

import functools
import os

import torch

__all__ = ["backend_env", "cdiv", "next_pow2", "window_flags", "attention_out_dtype", "tma_options_reason",
           "paged_tma_call_reason",
           "TMA_QUERY_BLOCK", "PAGED_TMA_HEAD_DIMS", "PAGED_TMA_MIN_PAGE", "PAGED_TMA_SMALL_PAGES",
           "DESCALE_FLOOR", "scale_storage_pad", "is_v_seq_major", "split_partials",
           "decode_shaped", "small_shaped", "decode_row_queries", "paged_precision", "paged_precisions",
           "choose_num_splits", "choose_prefill_splits", "paged_config", "paged_grid", "DECODE_BLOCKS_PER_SM",
           "PREFILL_BLOCKS_PER_SM", "CPU_NUM_SMS", "dense_out_shapes"]

# Query rows of one TMA query block: a fixed-length call runs on the paged TMA kernel with a multiple of
# this many queries; a varlen call sends it its sequences of this many queries or more.
TMA_QUERY_BLOCK = 128
PAGED_TMA_HEAD_DIMS = (64, 128)
PAGED_TMA_MIN_PAGE = 64
# FA3's layout only: pages smaller than a tile, loaded one TMA box per page
PAGED_TMA_SMALL_PAGES = (16, 32)

_E4M3 = torch.float8_e4m3fn


def backend_env(name: str) -> str:
    """The kernel choice in the environment variable ``name``: ``auto`` (unset or empty), ``triton`` or ``tma``."""
    backend = os.environ.get(name, "auto") or "auto"
    if backend not in ("auto", "triton", "tma"):
        raise ValueError(f"{name}: expected auto, triton or tma, got {backend!r}")
    return backend


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b). Launchers use this, not ``triton.cdiv``: in triton 3.6 that is a constexpr
    function, whose call costs microseconds of host time on every launch."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Host-side smallest power of two >= n (1 for n <= 1); see ``cdiv`` for why not
    ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def attention_out_dtype(q_dtype, out_dtype, out_scale):
    """The output dtype of an attention op: e4m3fn with ``out_scale``, else ``out_dtype``, else bf16 for FP8
    inputs and the input dtype for 16/32-bit ones."""
    if out_scale is not None:
        return torch.float8_e4m3fn
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if q_dtype not in (torch.float16, torch.bfloat16, torch.float32) else q_dtype


def window_flags(causal, window_size):
    """Host side, for every launcher: ``(causal, window_left, window_right, has_window)`` as the kernels
    see them. A right edge of 0 is the diagonal, so any window ending there is the causal mask (FA3's
    API passes causal as the window (-1, 0)); under causal a right edge is implied by the diagonal and
    dropped. Only what is left selects the window path (``HAS_WINDOW``), whose extra masks and bounds
    every causal call would otherwise compile in."""
    wl, wr = window_size if window_size is not None else (-1, -1)
    wl = -1 if wl is None else int(wl)
    wr = -1 if wr is None else int(wr)
    causal = bool(causal) or wr == 0
    if causal:
        wr = -1
    return causal, wl, wr, wl >= 0 or wr >= 0


def tma_options_reason(q_dtype, k_dtype, v_dtype, out_dtype, *, window_size, softcap, out_scale, per_block=False,
                       names=("q", "k", "v")):
    """The rules every TMA kernel shares: no sliding window, softcap or per-block descales; e4m3 q/k/v;
    bf16 out, or e4m3 out with a one-element float32 ``out_scale``. None when they hold."""
    if window_flags(False, window_size)[3]:
        return f"sliding window {tuple(window_size)} is not supported"
    if softcap and float(softcap) != 0.0:
        return "softcap is not supported"
    if per_block:
        return "per-block descales are not supported"
    if any(dt != _E4M3 for dt in (q_dtype, k_dtype, v_dtype)):
        return f"{', '.join(names)} must be float8_e4m3fn, got {q_dtype}, {k_dtype}, {v_dtype}"
    if out_scale is None and out_dtype != torch.bfloat16:
        return f"out must be bfloat16 (or float8_e4m3fn with out_scale), got {out_dtype}"
    if out_scale is not None:
        if out_dtype != _E4M3:
            return f"with out_scale, out must be float8_e4m3fn, got {out_dtype}"
        if not torch.is_tensor(out_scale) or out_scale.dtype != torch.float32 or out_scale.numel() != 1:
            return "out_scale must be a float32 tensor with one element"
    return None


def paged_tma_call_reason(q, k_cache, v_cache, out_dtype, *, varlen, window_size, softcap, out_scale, token_scales,
                          num_splits, v_seq_major):
    """Why the paged TMA kernel cannot take a call by its semantics, or None when it can (the launcher then
    checks memory and the device: ``kernels.hopper.paged_launch.unsupported_reason``).

    q : (batch, seqlen_q, nheads_q, d), or (total_q, nheads_q, d) with ``varlen``; k_cache, v_cache :
    (num_blocks, page_size, nheads_k, d); ``v_seq_major``: V sequence-major inside each page
    (``planning.is_v_seq_major``), else FA3's layout (V must then be contiguous).
    """
    if int(num_splits) > 1:
        return f"num_splits={num_splits}: the kernel does not split the keys"
    if token_scales:
        return "per-token-head cache scales are not supported"
    why = tma_options_reason(q.dtype, k_cache.dtype, v_cache.dtype, out_dtype, window_size=window_size,
                             softcap=softcap, out_scale=out_scale, names=("q", "k_cache", "v_cache"))
    if why:
        return why
    if q.dim() != (3 if varlen else 4) or k_cache.dim() != 4 or v_cache.dim() != 4:
        return ("q must be (total_q, nheads_q, d) with cu_seqlens_q" if varlen else
                "q must be (batch, seqlen_q, nheads_q, d)") + " and the caches (num_blocks, page_size, nheads_k, d)"
    d, dk, dv = q.shape[-1], k_cache.shape[-1], v_cache.shape[-1]
    if d not in PAGED_TMA_HEAD_DIMS or dk != d or dv != d:
        return f"head dim must be 64 or 128 for q, k and v, got {d}, {dk}, {dv}"
    if not varlen and (q.shape[1] == 0 or q.shape[1] % TMA_QUERY_BLOCK != 0):
        return f"seqlen_q ({q.shape[1]}) must be a positive multiple of {TMA_QUERY_BLOCK}"
    v_rows = not v_seq_major
    if v_rows and not v_cache.is_contiguous():
        return "v_cache must be contiguous (FA3's layout) or sequence-major within each page (paged.to_v_seq_major)"
    ps = k_cache.shape[1]
    if ps % PAGED_TMA_MIN_PAGE != 0 and not (v_rows and ps in PAGED_TMA_SMALL_PAGES):
        return (f"page_size ({ps}) must be a multiple of {PAGED_TMA_MIN_PAGE} (or one of {PAGED_TMA_SMALL_PAGES} "
                "with FA3's V layout)")
    return None


# ---------------------------------------------------------------------------------------------
# Constants the kernels share with the host
# ---------------------------------------------------------------------------------------------
# The smallest descale emitted, as a fraction of the format's max: amax below 2**-40 * fp8_max is
# treated as 2**-40 * fp8_max, so descale >= 2**-40 (finite, non-zero, and tiny enough never to
# matter for real data). A zero descale would turn masked -inf logits into 0 * -inf = NaN.
DESCALE_FLOOR = 2.0 ** -40


def scale_storage_pad(dtype: torch.dtype) -> float:
    """Factor a descale is multiplied by before it is rounded to ``dtype`` for storage, so the stored
    value is never below the exact one (a smaller descale would push the amax past fp8_max and clip).
    bf16 keeps 8 significant bits: nearest rounding moves a value by <= 2**-8 relative and truncation
    (the CPU interpreter's cast) by < 2**-7, so 1 + 2**-7 covers both."""
    return 1.0 if dtype == torch.float32 else 1.0 + 2.0 ** -7


def is_v_seq_major(v_cache: torch.Tensor) -> bool:
    """True for a sequence-major V cache: shape (num_blocks, page_size, nheads_k, headdim) whose memory
    order is (num_blocks, nheads_k, headdim, page_size) (``alloc_paged_cache(..., v_seq_major=True)``):
    the slots of one page are contiguous, so a V tile is K-major for the FP8 P@V without a transpose."""
    if v_cache.dim() != 4:
        return False
    nb, ps, hk, d = v_cache.shape
    return (ps > 1 and d > 1 and v_cache.stride(1) == 1 and v_cache.stride(3) == ps
            and v_cache.stride(2) == d * ps and (nb == 1 or v_cache.stride(0) == hk * d * ps))


def split_partials(q: torch.Tensor, num_splits: int, headdim_v: int, nheads_q: int):
    """Uninitialized float32 split-KV partials for calls shaped like ``q`` ((batch, seqlen_q, ...) or varlen
    (total_q, ...)): ``(out_partial, lse_partial)`` of shapes (num_splits, *q.shape[:-2], nheads_q,
    headdim_v) and (num_splits, *q.shape[:-2], nheads_q). No validation (the host's ``split_workspace``
    checks its arguments, then calls this)."""
    lead = tuple(q.shape[:-2])
    op = torch.empty((num_splits, *lead, nheads_q, headdim_v), dtype=torch.float32, device=q.device)
    lp = torch.empty((num_splits, *lead, nheads_q), dtype=torch.float32, device=q.device)
    return op, lp


# ---------------------------------------------------------------------------------------------
# The paged Triton kernel: tile classes and multiply precisions
# ---------------------------------------------------------------------------------------------
_DECODE_ROWS, _SMALL_ROWS = 16, 64  # query rows per kv head of the paged kernel's decode and small tiles


def decode_shaped(max_seqlen_q: int, qg: int) -> bool:
    """At most 16 query rows per kv head (``max(1, max_seqlen_q) * qg <= 16``, ``qg`` query heads per kv
    head): the paged kernel's decode tiles."""
    return max(1, int(max_seqlen_q)) * qg <= _DECODE_ROWS and qg <= _DECODE_ROWS


def small_shaped(max_seqlen_q: int, qg: int) -> bool:
    """At most 64 query rows per kv head: the paged kernel's decode or small tiles (decode, speculative
    decoding), not its prefill tiles."""
    return max(1, int(max_seqlen_q)) * qg <= _SMALL_ROWS and qg <= _SMALL_ROWS


def decode_row_queries(qg: int) -> int:
    """Queries of the longest sequence that is a decode row of a varlen call (its rows fill at most one
    decode tile): the sequences the paged kernel serves in its small tile class."""
    return _DECODE_ROWS // qg


@functools.lru_cache(maxsize=1024)
def paged_precisions(q_dtype, k_dtype, v_dtype, k_token_scales: bool, v_token_scales: bool, max_seqlen_q: int,
                     qg: int, v_seq_major: bool):
    """``paged_precision`` of a call, and of a varlen call's decode rows (the sequences of at most
    ``decode_row_queries(qg)`` queries, the paged kernel's small tile class, which multiply as a decode call
    of their own would): ``((fp8_qk, fp8_pv, compute_dtype), (fp8_qk, fp8_pv, compute_dtype))``, for the
    kernel's launcher and the CPU path (cached per shape class: host time)."""
    args = (q_dtype, k_dtype, v_dtype, k_token_scales, v_token_scales, v_seq_major)
    return (paged_precision(*args, small_shaped(max_seqlen_q, qg)),
            paged_precision(*args, decode_shaped(1, qg) or small_shaped(max_seqlen_q, qg)))


def paged_precision(q_dtype, k_dtype, v_dtype, k_token_scales: bool, v_token_scales: bool, v_seq_major: bool,
                    small: bool):
    """How the paged Triton kernel multiplies: ``(fp8_qk, fp8_pv, compute_dtype)``; one rule for the kernel's
    launcher and the CPU path.

    Q, K and V all e4m3 without per-token-head scales: QK^T in FP8 (``fp8_qk``), and P@V in FP8 with P scaled
    into e4m3's range (``fp8_pv``) where V is sequence-major inside its pages, i.e. K-major as FP8 wgmma
    wants it. Over V in FA3's layout P@V runs in fp16 instead (V upcast in registers, exact for e4m3, P
    rounded to fp16): an FP8 P@V would transpose V byte by byte in registers, and the fp16 one measured
    faster on the H200 with a smaller error (docs/decisions.md). ``small`` (decode or small tiles,
    ``small_shaped``) over FA3's layout also runs QK^T in fp16: the whole 16-bit path below, faster in
    those tiles. The paged TMA kernel, which takes FP8 prefill chunks, multiplies P@V in FP8 in both
    layouts (``paged_tma_call_reason``).

    Otherwise (16-bit Q over an FP8 cache, e5m2 caches, per-token-head scales, 16-bit caches) K/V are
    upcast in registers to ``compute_dtype`` and both dots run in it (P rounded to it): a 16-bit cache's
    own dtype; bf16 for bf16 Q with per-token-head V scales (the scaled rows may leave fp16's range); fp16
    otherwise (e4m3/e5m2 -> fp16 is exact and one convert per pair, where bf16 needs a detour that made
    decode ALU-bound; Q is cast to fp16, clamped to +-65504; an e4m3 Q is exact in fp16). ``compute_dtype``
    is also the dtype of a 16-bit P@V after FP8 QK^T (fp16 then).
    """
    fp8 = (q_dtype == _E4M3 and k_dtype == _E4M3 and v_dtype == _E4M3
           and not k_token_scales and not v_token_scales)
    fp8_qk = fp8 and (v_seq_major or not small)
    fp8_pv = fp8 and v_seq_major
    if k_dtype in (torch.bfloat16, torch.float16):
        cdt = k_dtype
    elif q_dtype == torch.bfloat16 and v_token_scales:
        cdt = torch.bfloat16
    else:
        cdt = torch.float16
    return fp8_qk, fp8_pv, cdt


# ---------------------------------------------------------------------------------------------
# The paged Triton kernel's launch plan: tiles per regime, the split count, the grid
# ---------------------------------------------------------------------------------------------
# The SM count the plan assumes without a GPU (H100 SXM / H200).
CPU_NUM_SMS = 132


# Decode blocks resident per SM (64-key one-page tiles, 128 registers, 3 stages; the split target).
DECODE_BLOCKS_PER_SM = 4


def choose_num_splits(batch: int, nheads_k: int, max_context: int, num_sms: int = CPU_NUM_SMS,
                      num_q_blocks: int = 1, min_tokens_per_split: int = 512, max_splits: int = 128) -> int:
    """Split count fixed from shapes (never from live lengths), so it can be captured in a CUDA graph.

    Below one program per SM, splits fill one wave of resident decode blocks:
    ``splits = floor(DECODE_BLOCKS_PER_SM * num_sms / programs)``, with at least ``min_tokens_per_split``
    context tokens per split. From one to three programs per SM it splits in two; from three per SM on it
    does not split. Each rule beat its neighbours on the H200 (docs/decisions.md, the paged kernel's split
    heuristic).
    """
    programs = max(1, batch * nheads_k * num_q_blocks)
    if programs >= 3 * num_sms:
        return 1
    want = 2 if programs >= num_sms else (DECODE_BLOCKS_PER_SM * num_sms) // programs
    cap = max(1, max_context // min_tokens_per_split)
    return int(max(1, min(want, cap, max_splits)))


# Programs of the 4-warp (128, 64) prefill tile at head dim 128 resident per SM (on the H200 the same work
# split into 304 to 464 programs takes the same time: two rounds of 264).
PREFILL_BLOCKS_PER_SM = 2
# The cost of one more split of a prefill launch, as a fraction of the unsplit launch's time: the partials'
# writes and the combine (measured on the H200, 2k-context chunks over 8k keys).
_SPLIT_COST = 0.015
_PREFILL_MAX_SPLITS = 4


def choose_prefill_splits(programs: int, num_sms: int = CPU_NUM_SMS, max_context: int = 2 ** 31,
                          min_tokens_per_split: int = 512) -> int:
    """Split count of a fixed-length launch of 4-warp (128, 64) prefill tiles at head dim 128 whose unsplit
    grid (``programs``) fills one to three rounds of decode blocks (``choose_num_splits`` splits those in two).

    A round holds ``PREFILL_BLOCKS_PER_SM * num_sms`` programs and each split divides a program's keys, so
    ``s`` splits take ``ceil(programs * s / round) / s`` of the unsplit round's time, plus ``_SPLIT_COST`` per
    split beyond the first; the cheapest of 1 to 4 splits wins (ties: fewer). The model picked the fastest
    count of those measured on the H200 (32 q / 8 kv heads, page 64, chunks over 8k keys; docs/decisions.md).
    """
    rnd = PREFILL_BLOCKS_PER_SM * num_sms
    cap = max(1, min(_PREFILL_MAX_SPLITS, max_context // min_tokens_per_split))
    cost = {s: cdiv(programs * s, rnd) / s + _SPLIT_COST * (s - 1) for s in range(1, cap + 1)}
    return min(cost, key=lambda s: (cost[s], s))


# (block_m, block_n, num_warps, num_stages) by regime, the fastest measured on the H200 (docs/decisions.md).
_CONFIGS = {
    "decode": (16, 128, 4, 3),
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
    # one-page (16,64,4,4) tile at page 64; prefill tiles are 64 keys already. The capped decode tiles below
    # are one-page tiles.
    if not decode and page_size is not None and 64 <= page_size < bn and bn % page_size == 0:
        bn = page_size
    # Sequence-major V in pages of 128+ keys: 128-key one-page prefill tiles, faster on the H200. With
    # 64-key pages a 128-key tile would gather V rows, much slower.
    if (not decode and rows > 64 and v_seq_major and page_size is not None and page_size % 128 == 0
            and headdim <= 128):
        bn = 128
    # P@V in fp16 over an FP8 cache (16-bit Q, or FP8 Q over FA3's layout) in (128, 64) prefill tiles: 4 warps
    # of 32 query rows beat 8 of 16 on the H200, in every page size and V layout measured. The (128, 128)
    # sequence-major tile keeps 8 warps (with 4 it ran at half the speed).
    if not decode and fp8_cache and not (mma_fp8 and v_seq_major) and not token_scales and (bm, bn) == (128, 64):
        nw = 4
    one_page_tiles = page_size is not None and page_size >= 64 and page_size % 64 == 0
    # Decode over an FP8 cache is bandwidth bound: four resident blocks per SM (128 registers per thread,
    # 3-stage rings of 64-key one-page tiles, <= 57 KB) stream faster than three on the H200 (more registers
    # or a 4-stage ring cost the fourth block), in both V layouts. A sequence-major V page is contiguous only
    # inside the page, so it is read in one-page tiles anyway (a row-gathered 128-key tile spilled).
    # Per-token-head scales spill under the cap (in the sm90 compile) and keep the uncapped tiles.
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


def dense_out_shapes(q, v, varlen):
    """``(out shape, LSE shape)`` of a dense call: q's shape with v's head dim; LSE (batch, nheads_q, seqlen_q),
    varlen (nheads_q, total_q)."""
    oshape = tuple(q.shape[:-1]) + (v.shape[-1],)
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    return oshape, lse_shape
