"""Context-parallel decode over torch.distributed: one sequence's paged FP8 KV cache sharded across ranks.

Each rank of a context-parallel (CP) group holds a shard of every sequence's cache (its own block pool,
page table and lengths). :func:`cp_decode` attends to the local shard with
:func:`fp8attn.flash_attn_with_kvcache` (``return_softmax_lse=True``, float32 partial output), all-gathers
the partial outputs and LSEs over the group in one collective, and merges them with
:func:`fp8attn.flash_attn_combine`. The merge is exact softmax algebra: ``out = sum_r w_r out_r`` with
``w_r = exp(lse_r - lse)``, ``lse = log(sum_r exp(lse_r))``; a shard with no token of a sequence gives
``lse_r = -inf`` and weighs exactly 0 (its partial output is never read, even if NaN).

Sharding (:class:`CPShardPlan`): a sequence's logical pages (page ``j`` holds tokens ``j * page_size`` ..
``(j + 1) * page_size - 1``) are owned by one rank each, in one of two layouts:

* ``"contiguous"``: rank ``r`` owns pages ``[r * P, (r + 1) * P)``, ``P = ceil(max_pages / world_size)``
  (a prefix fills rank 0 first; short sequences leave later ranks empty).
* ``"round_robin"``: rank ``r`` owns pages ``j`` with ``j % world_size == r`` (shards stay within one page
  of each other as a sequence grows).

On the owner, the pages keep their order, so a shard is itself a valid paged cache whose tokens are
contiguous from 0 (only its last page may be partial): :meth:`CPShardPlan.local_seqlens` gives its lengths
from the global ones, on the device, without a host sync. :func:`shard_paged_cache` cuts a paged cache into
one rank's shard; :func:`route_new_tokens` writes new tokens on their owner only.

Head parallelism composes: split the heads across a tensor-parallel group (:func:`tp_head_slices`) and the
sequence across a CP group (:func:`new_cp_tp_groups`); each rank calls :func:`cp_decode` on its heads over
its CP group.

Errors: every rank validates its arguments (the local attention call included) before any collective,
then the ranks exchange one small status tensor (``check_ranks=True``, on by default outside CUDA-graph
capture): a rank that rejected its arguments raises its own error and every other rank raises the same
exception type with that message, and arguments that must agree across ranks (the query's shape and dtype,
heads, head dims, softmax scale, causal, softcap, output dtype; q and the descales by their float64 sums) are
compared, so a bad input raises on every rank instead of leaving the others waiting in the gather. Collectives run under the process group's
timeout (``timeout=`` of ``init_process_group`` / ``new_group``; :data:`CP_TIMEOUT` in this module's helpers).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import struct
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import _checks as C
from .interface import flash_attn_combine, flash_attn_with_kvcache, write_kv_cache
from .kernels.planning import is_v_seq_major
from .paged_cache import empty_paged, packed_token_seqs
from .quant import is_fp8

__all__ = [
    "cp_decode",
    "simulate_cp_decode",
    "CPWorkspace",
    "CPShardPlan",
    "CPShard",
    "shard_paged_cache",
    "route_new_tokens",
    "tp_head_slices",
    "new_cp_tp_groups",
    "CPTPGroups",
    "launch_local",
    "CP_TIMEOUT",
    "LAYOUTS",
]

#: Collective timeout of the groups this module creates (``new_cp_tp_groups``, ``launch_local``).
CP_TIMEOUT = datetime.timedelta(seconds=60)
LAYOUTS = ("contiguous", "round_robin")

_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.bfloat16, torch.float16, torch.float32)
_EXC = (ValueError, TypeError, NotImplementedError, RuntimeError)  # codes 1..4 of the status exchange
_MSG_BYTES = 512  # the failing rank's message travels to the others (truncated to this many UTF-8 bytes)


# ------------------------------------------------------------------------------------------ the shard plan
@dataclass(frozen=True)
class CPShardPlan:
    """Which rank of a context-parallel group owns each logical page of a sequence, and where.

    Parameters
    ----------
    world_size : ranks in the CP group (>= 1).
    page_size : tokens per page (the caches' ``shape[1]``).
    max_pages : logical pages per sequence (the width of the unsharded page table), so a sequence holds at
        most ``max_pages * page_size`` tokens.
    layout : ``"contiguous"`` or ``"round_robin"`` (module docstring).
    """

    world_size: int
    page_size: int
    max_pages: int
    layout: str = "round_robin"

    def __post_init__(self):
        for name in ("world_size", "page_size", "max_pages"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                C._fail(ValueError, name, "an int >= 1", repr(val), f"Pass the {name.replace('_', ' ')}.")
        if self.layout not in LAYOUTS:
            C._fail(ValueError, "layout", f"one of {LAYOUTS}", repr(self.layout), "Pick a layout.")

    @property
    def local_max_pages(self) -> int:
        """Width of every rank's page table: ``ceil(max_pages / world_size)`` pages."""
        return -(-self.max_pages // self.world_size)

    def owner(self, page):
        """Rank owning logical page(s) ``page`` (int or int64 tensor)."""
        return page // self.local_max_pages if self.layout == "contiguous" else page % self.world_size

    def local_page(self, page):
        """Column of logical page(s) ``page`` in the owner's page table."""
        return page % self.local_max_pages if self.layout == "contiguous" else page // self.world_size

    def global_page(self, rank: int, local_page: int) -> int:
        """The logical page held in column ``local_page`` of ``rank``'s page table."""
        if self.layout == "contiguous":
            return rank * self.local_max_pages + local_page
        return local_page * self.world_size + rank

    def local_seqlens(self, cache_seqlens: torch.Tensor, rank: int) -> torch.Tensor:
        """Tokens of each sequence held by ``rank``.

        Parameters
        ----------
        cache_seqlens : (batch,) int32, the sequences' global lengths.

        Returns
        -------
        (batch,) int32 on the same device (no host sync): the lengths to pass as ``cache_seqlens_shard``.
        """
        _check_rank(rank, self.world_size)
        n = cache_seqlens.long()
        ps, w = self.page_size, self.world_size
        if self.layout == "contiguous":
            cap = self.local_max_pages * ps
            local = (n - rank * cap).clamp(0, cap)
        else:
            full, rem = n // ps, n % ps
            # owned full pages j = rank, rank + w, ... < full; the partial page j = full if this rank owns it
            local = (full - rank + w - 1).div(w, rounding_mode="floor").clamp_min(0) * ps
            local = local + torch.where(full % w == rank, rem, torch.zeros_like(rem))
        return local.to(torch.int32)

    def slot_mapping(
        self, page_table_shard: torch.Tensor, rank: int, seq_idx: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Slots in ``rank``'s pool of tokens at global ``positions`` of sequences ``seq_idx``; -1 for tokens
        another rank owns (or whose local page is unallocated, -1 in the table: :func:`route_new_tokens`
        rejects those where value checks run).

        Parameters
        ----------
        page_table_shard : (batch, >= local_max_pages) int32, ``rank``'s page table.
        seq_idx, positions : (num_tokens,) integer tensors.

        Returns
        -------
        (num_tokens,) int64, ``block * page_size + offset`` or -1.
        """
        pos = positions.long()
        page = pos // self.page_size
        col = self.local_page(page).clamp(0, page_table_shard.shape[1] - 1)
        blk = page_table_shard.long()[seq_idx.long(), col]
        own = (self.owner(page) == rank) & (blk >= 0) & (page < self.max_pages)
        return torch.where(own, blk * self.page_size + pos % self.page_size, torch.full_like(pos, -1))


class CPShard(NamedTuple):
    """One rank's shard of a paged cache: its own block pool, page table and lengths (the arguments of
    :func:`cp_decode`). ``k_cache_scales`` / ``v_cache_scales``: per-token-head scales, or None."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    k_cache_scales: torch.Tensor | None = None
    v_cache_scales: torch.Tensor | None = None


def _check_rank(rank, world_size):
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        C._fail(
            ValueError,
            "rank",
            f"an int in [0, {world_size})",
            repr(rank),
            "Pass this rank's index in the context-parallel group (torch.distributed.get_rank(group)).",
        )


def _check_plan(plan, page_size):
    if not isinstance(plan, CPShardPlan):
        C._fail(
            TypeError,
            "plan",
            "a CPShardPlan",
            type(plan).__name__,
            "Build one with CPShardPlan(world_size, page_size, max_pages, layout).",
        )
    if plan.page_size != page_size:
        C._fail(
            ValueError,
            "plan",
            f"page_size {page_size} (the cache's)",
            f"page_size {plan.page_size}",
            "Build the plan with the cache's page size.",
        )


def shard_paged_cache(
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    plan,
    rank,
    *,
    k_cache_scales=None,
    v_cache_scales=None,
    num_blocks=None,
    device=None,
) -> CPShard:
    """Cut one rank's shard out of a paged cache (set-up time: it copies pages and may sync).

    Parameters
    ----------
    k_cache, v_cache : (num_blocks, page_size, nheads_k, headdim[_v]), any cache dtype; a sequence-major V
        cache gives a sequence-major shard.
    page_table : (batch, max_pages) int32 over that pool; -1 (or any negative id) marks an unallocated page.
        Every allocated page the rank owns is copied, also past a sequence's length (pages reserved for
        growth stay reserved on the owner). Blocks shared by several entries (a common prefix) stay shared.
    cache_seqlens : (batch,) int32 global lengths.
    plan : :class:`CPShardPlan` with ``max_pages`` = the table's width and the cache's page size.
    rank : this rank's index in the CP group.
    k_cache_scales, v_cache_scales : optional (num_blocks, page_size, nheads_k) per-token-head scales.
    num_blocks : the shard pool's size (>= the blocks it needs; default exactly those). Blocks past the
        copied ones are zero.
    device : where the shard lives (default the cache's device).

    Returns
    -------
    CPShard : k_cache, v_cache (num_blocks_shard, page_size, nheads_k, headdim[_v]); page_table
        (batch, plan.local_max_pages) int32 with -1 in unallocated entries; cache_seqlens (batch,) int32
        (``plan.local_seqlens``); the scale shards or None.
    """
    C.check_tensor("k_cache", k_cache, ndim=4)
    C.check_tensor("v_cache", v_cache, ndim=4, allow_v_seq_major=True)
    C.check_leading_dims("k_cache", k_cache, "v_cache", v_cache, 3, "(num_blocks, page_size, nheads_k)")
    C.check_int32("page_table", page_table, ndim=2)
    C.check_int32("cache_seqlens", cache_seqlens, ndim=1)
    _check_plan(plan, k_cache.shape[1])
    _check_rank(rank, plan.world_size)
    if page_table.shape[1] != plan.max_pages:
        C._fail(
            ValueError,
            "page_table",
            f"{plan.max_pages} columns (plan.max_pages)",
            f"{page_table.shape[1]}",
            "Build the plan with max_pages = page_table.shape[1].",
        )
    if cache_seqlens.numel() != page_table.shape[0]:
        C._fail(
            ValueError,
            "cache_seqlens",
            f"{page_table.shape[0]} entries (page_table rows)",
            f"{cache_seqlens.numel()}",
            "Pass one length per sequence.",
        )
    for name, sc in (("k_cache_scales", k_cache_scales), ("v_cache_scales", v_cache_scales)):
        C.check_cache_scales(name, sc, k_cache)
    if (k_cache_scales is None) != (v_cache_scales is None):
        C._fail(ValueError, "k_cache_scales/v_cache_scales", "both or neither", "one", "Pass both scale tensors.")
    device = torch.device(device) if device is not None else k_cache.device
    lmp = plan.local_max_pages
    cols = [plan.global_page(rank, j) for j in range(lmp) if plan.global_page(rank, j) < plan.max_pages]
    sub = page_table[:, cols].to(k_cache.device).long()
    valid = sub >= 0
    ids, inverse = torch.unique(sub[valid], return_inverse=True)
    need = ids.numel()
    if need and int(ids[-1]) >= k_cache.shape[0]:  # (unique ids come sorted)
        C._fail(
            ValueError,
            "page_table",
            f"block ids < {k_cache.shape[0]} (the pool's blocks)",
            f"block {int(ids[-1])} among the pages rank {rank} owns",
            "Fix the block allocation.",
        )
    nb = need if num_blocks is None else num_blocks
    if isinstance(nb, bool) or not isinstance(nb, int) or nb < need:
        C._fail(
            ValueError,
            "num_blocks",
            f"an int >= {need} (the blocks rank {rank} owns)",
            repr(num_blocks),
            "Pass None for exactly those blocks, or a larger pool.",
        )
    local = torch.full(tuple(sub.shape), -1, dtype=torch.int64, device=k_cache.device)
    local[valid] = inverse
    table = torch.full((page_table.shape[0], lmp), -1, dtype=torch.int32, device=device)
    table[:, : len(cols)] = local.to(device, torch.int32)

    def take(src, seq_major=False):
        if src is None:
            return None
        shape = (nb, *src.shape[1:])
        dst = (
            empty_paged(shape, src.dtype, device, seq_major=seq_major)
            if src.dim() == 4
            else torch.empty(shape, dtype=src.dtype, device=device)
        )
        dst.zero_()
        if need:
            dst[:need].copy_(src[ids])
        return dst

    return CPShard(
        take(k_cache),
        take(v_cache, is_v_seq_major(v_cache)),
        table,
        plan.local_seqlens(cache_seqlens.to(device), rank),
        take(k_cache_scales),
        take(v_cache_scales),
    )


def route_new_tokens(
    k,
    v,
    k_cache_shard,
    v_cache_shard,
    page_table_shard,
    cache_seqlens,
    plan,
    rank,
    *,
    cu_seqlens_k_new=None,
    k_descale=None,
    v_descale=None,
    k_cache_scales=None,
    v_cache_scales=None,
    validate=False,
) -> torch.Tensor:
    """Append new tokens to a sharded cache: each token is written (quantized, as :func:`fp8attn.write_kv_cache`
    writes it) on the rank that owns its page only; every rank calls this with the same new tokens.

    Parameters
    ----------
    k, v : new tokens, (batch, seqlen_new, nheads_k, headdim[_v]), or (total_new, nheads_k, headdim[_v]) with
        ``cu_seqlens_k_new``; bf16 / fp16 / fp32.
    k_cache_shard, v_cache_shard, page_table_shard : this rank's shard (:class:`CPShard`). The owner's page of
        every new token must be allocated (not -1) in ``page_table_shard``.
    cache_seqlens : (batch,) int32 GLOBAL lengths before the append (identical on every rank); new token
        ``i`` of sequence ``b`` lands at global position ``cache_seqlens[b] + i``.
    plan, rank : the :class:`CPShardPlan` and this rank's index in the CP group.
    cu_seqlens_k_new : (batch + 1,) int32 offsets of packed new tokens.
    k_descale, v_descale, k_cache_scales, v_cache_scales : as in :func:`fp8attn.write_kv_cache` (descales
        per-tensor or (batch, nheads_k)).
    validate : also run the value checks (capacity, allocated pages) on GPU tensors (syncs the device).

    Returns
    -------
    (num_new_tokens,) int64 slot mapping used on this rank: ``block * page_size + offset`` for the tokens it
    owns, -1 for the others. Afterwards the local lengths are ``plan.local_seqlens(cache_seqlens + new, rank)``.
    """
    C.check_tensor("k_cache_shard", k_cache_shard, ndim=4)
    _check_plan(plan, k_cache_shard.shape[1])
    _check_rank(rank, plan.world_size)
    C.check_int32("page_table_shard", page_table_shard, ndim=2)
    C.check_int32("cache_seqlens", cache_seqlens, ndim=1)
    C.check_tensor("k", k, ndim=3 if cu_seqlens_k_new is not None else 4)
    C.check_tensor("v", v, ndim=k.dim())
    batch = cache_seqlens.numel()
    if page_table_shard.shape[0] != batch or page_table_shard.shape[1] < plan.local_max_pages:
        C._fail(
            ValueError,
            "page_table_shard",
            f"({batch}, >= {plan.local_max_pages}) (batch, plan.local_max_pages)",
            f"{tuple(page_table_shard.shape)}",
            "Pass this rank's page table (shard_paged_cache builds it).",
        )
    dev = k_cache_shard.device
    if cu_seqlens_k_new is not None:
        C.check_cu_seqlens(
            "cu_seqlens_k_new", cu_seqlens_k_new, batch=batch, validate=validate, total=k.shape[0], total_name="k"
        )
        seq, tok = packed_token_seqs(cu_seqlens_k_new, k.shape[0])
        pad = seq >= batch  # rows past the last offset: not tokens of any sequence
        seq = seq.clamp(max=max(batch - 1, 0))
        pos = cache_seqlens.long()[seq] + tok - cu_seqlens_k_new.long()[seq]
        kf, vf = k, v
    else:
        if k.shape[0] != batch:
            C._fail(
                ValueError,
                "k",
                f"batch {batch} (cache_seqlens' entries) in (batch, seqlen_new, nheads_k, headdim)",
                f"{tuple(k.shape)}",
                "Pass one row of new tokens per sequence, or cu_seqlens_k_new.",
            )
        s_new = k.shape[1]
        seq = torch.arange(batch, device=dev).repeat_interleave(s_new)
        pos = cache_seqlens.long()[seq] + torch.arange(s_new, device=dev).repeat(batch)
        pad = None
        kf, vf = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
    slots = plan.slot_mapping(page_table_shard, rank, seq, pos)
    if pad is not None:
        slots = torch.where(pad, torch.full_like(slots, -1), slots)
    if C.want_value_checks(cache_seqlens, validate) and pos.numel():
        live = ~pad if pad is not None else torch.ones_like(pos, dtype=torch.bool)
        cap = plan.max_pages * plan.page_size
        if bool((live & (pos >= cap)).any()):
            C._fail(
                ValueError,
                "cache_seqlens",
                f"lengths after the append <= the capacity {cap} "
                f"(max_pages {plan.max_pages} x page_size {plan.page_size})",
                f"a new token at position {int(pos[live].max())}",
                "Allocate more pages or shorten the sequence.",
            )
        page = pos // plan.page_size
        mine = live & (plan.owner(page) == rank)
        lost = mine & (slots < 0)
        if bool(lost.any()):
            i = int(lost.nonzero()[0, 0])
            C._fail(
                ValueError,
                "page_table_shard",
                f"an allocated block (>= 0) for every page rank {rank} owns that new tokens reach",
                f"-1 at row {int(seq[i])}, column {int(plan.local_page(page[i]))}",
                "Allocate the page on its owner before appending.",
            )
    write_kv_cache(
        kf,
        vf,
        k_cache_shard,
        v_cache_shard,
        slots,
        k_descale=k_descale,
        v_descale=v_descale,
        token_seq_idx=seq.to(torch.int32),
        k_cache_scales=k_cache_scales,
        v_cache_scales=v_cache_scales,
        validate=validate,
    )
    return slots


# ------------------------------------------------------------------------------------- the decode itself
class CPWorkspace:
    """Preallocated buffers of :func:`cp_decode` for one query shape (allocate once, before CUDA-graph capture).

    Each rank's partial result is one float32 chunk ``[out (batch*seqlen_q*nheads_q*headdim_v) | lse
    (batch*seqlen_q*nheads_q)]``, so the gather is one collective into ``recv`` (world_size chunks).

    Parameters
    ----------
    q : (batch, seqlen_q, nheads_q, headdim); only its shape and device are read.
    headdim_v : V's head dim. world_size : ranks in the CP group.

    Attributes
    ----------
    send : (chunk,) float32. recv : (world_size * chunk,) float32.
    out_partial : (world_size, batch, seqlen_q, nheads_q, headdim_v) float32 view of recv.
    lse_partial : (world_size, batch, seqlen_q, nheads_q) float32 view of recv.
    """

    def __init__(self, q: torch.Tensor, headdim_v: int, world_size: int):
        b, sq, hq, _ = q.shape
        self.shape = (b, sq, hq, int(headdim_v))
        self.world_size = int(world_size)
        self.n_out = b * sq * hq * int(headdim_v)
        self.chunk = self.n_out + b * sq * hq
        self.send = torch.empty(self.chunk, dtype=torch.float32, device=q.device)
        self.recv = torch.empty(self.world_size * self.chunk, dtype=torch.float32, device=q.device)
        rows = self.recv.view(self.world_size, self.chunk)
        self.out_partial = rows[:, : self.n_out].view(self.world_size, *self.shape)
        self.lse_partial = rows[:, self.n_out :].view(self.world_size, *self.shape[:3])

    def views(self, flat: torch.Tensor):
        """``(out (batch, seqlen_q, nheads_q, headdim_v), lse (batch, seqlen_q, nheads_q))`` views of one chunk."""
        return flat[: self.n_out].view(self.shape), flat[self.n_out :].view(self.shape[:3])

    def rank_chunk(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s chunk of ``recv`` (where the gather puts its partial)."""
        return self.recv[rank * self.chunk : (rank + 1) * self.chunk]


def _group_info(group):
    if not (dist.is_available() and dist.is_initialized()):
        C._fail(
            ValueError,
            "group",
            "an initialized torch.distributed process group",
            "none initialized",
            "Call torch.distributed.init_process_group first (or run under fp8attn.distributed.launch_local).",
        )
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    except (ValueError, RuntimeError) as e:
        C._fail(
            ValueError,
            "group",
            "a process group this rank belongs to",
            f"{group!r} ({e})",
            "Pass the context-parallel group of this rank (new_cp_tp_groups builds it).",
        )
    if rank < 0:
        C._fail(
            ValueError,
            "group",
            "a process group this rank belongs to",
            "a group without this rank",
            "Pass the context-parallel group of this rank.",
        )
    return rank, world, str(dist.get_backend(group)).lower()


def _check_cp_call(
    q, v_cache, causal, window_size, out, out_dtype, out_scale, workspace, world, page_table=None, cache_seqlens=None
):
    """Checks of cp_decode's own arguments (the local attention call checks the rest)."""
    C.check_tensor("q", q, ndim=4)
    C.check_tensor("v_cache_shard", v_cache, ndim=4, allow_v_seq_major=True)
    b, sq, hq, _ = q.shape
    if page_table is not None or cache_seqlens is not None:
        C.check_int32("page_table_shard", page_table, ndim=2)
        C.check_int32("cache_seqlens_shard", cache_seqlens, ndim=1)
        for name, t, n in (
            ("page_table_shard", page_table, page_table.shape[0]),
            ("cache_seqlens_shard", cache_seqlens, cache_seqlens.numel()),
        ):
            if n != b:
                C._fail(
                    ValueError,
                    name,
                    f"{b} rows (q's batch)",
                    f"{n} ({tuple(t.shape)})",
                    "Pass this rank's page table and lengths of every sequence (0 where it holds none).",
                )
    if sq < 1:
        C._fail(
            ValueError,
            "q",
            "seqlen_q >= 1 in (batch, seqlen_q, nheads_q, headdim)",
            f"{tuple(q.shape)}",
            "Pass the decode queries.",
        )
    if causal and sq > 1:
        raise NotImplementedError(
            "causal=True with seqlen_q > 1 is not supported by cp_decode: a shard's keys are "
            "not the sequence's last ones, so the bottom-right causal mask of each shard is "
            "not the sequence's. Decode one query per sequence, or pass causal=False."
        )
    C.check_window(window_size)
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(
            f"window_size={tuple(window_size)} is not supported by cp_decode (a shard holds no "
            "global positions); leave it at (-1, -1)."
        )
    C.check_out_dtype(out_dtype)
    C.check_out_scale(out_scale, q.device, out_dtype)
    C.check_out(out, (b, sq, hq, v_cache.shape[-1]), _out_dtype(q, out_dtype, out_scale), q.device)
    if workspace is not None:
        if not isinstance(workspace, CPWorkspace):
            C._fail(
                TypeError,
                "workspace",
                "a CPWorkspace",
                type(workspace).__name__,
                "Allocate it with CPWorkspace(q, headdim_v, world_size).",
            )
        want = (b, sq, hq, v_cache.shape[-1])
        if workspace.shape != want or workspace.world_size != world or workspace.recv.device != q.device:
            C._fail(
                ValueError,
                "workspace",
                f"a CPWorkspace for {want} over {world} ranks on {q.device}",
                f"{workspace.shape} over {workspace.world_size} on {workspace.recv.device}",
                "Allocate one per query shape: CPWorkspace(q, headdim_v, world_size).",
            )


def _out_dtype(q, out_dtype, out_scale):
    if out_scale is not None:
        return torch.float8_e4m3fn
    return out_dtype or (torch.bfloat16 if is_fp8(q.dtype) else q.dtype)


def _attend(q, shard_args, attn, out_flat, ws):
    """The local partial: attention over one shard into ``out_flat`` (a workspace chunk)."""
    k_cache, v_cache, page_table, cache_seqlens, k_scales, v_scales = shard_args
    o, lse_chunk = ws.views(out_flat)
    _, lse = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=cache_seqlens,
        page_table=page_table,
        k_cache_scales=k_scales,
        v_cache_scales=v_scales,
        out=o,
        out_dtype=torch.float32,
        return_softmax_lse=True,
        **attn,
    )
    lse_chunk.copy_(lse.transpose(1, 2))


def _merge(ws, out, out_dtype, out_scale, q, return_softmax_lse):
    dt = None if out_scale is not None else _out_dtype(q, out_dtype, None)
    o, lse = flash_attn_combine(ws.out_partial, ws.lse_partial, out=out, out_dtype=dt, out_scale=out_scale)
    return (o, lse.transpose(1, 2).contiguous()) if return_softmax_lse else o


def _f64_bits(x):
    try:
        return struct.unpack("<q", struct.pack("<d", float(x)))[0]
    except (TypeError, ValueError, OverflowError):
        return -1


def _signature(q, k_cache, v_cache, softmax_scale, causal, softcap, out_dtype, out_scale):
    """(name, argument, value) of what every rank must pass alike."""
    qs = tuple(q.shape) if isinstance(q, torch.Tensor) and q.dim() == 4 else (-1,) * 4
    code = lambda t: _DTYPES.index(t.dtype) if isinstance(t, torch.Tensor) and t.dtype in _DTYPES else -1  # noqa: E731
    dim = lambda t, i: t.shape[i] if isinstance(t, torch.Tensor) and t.dim() == 4 else -1  # noqa: E731
    return (
        ("batch", "q", qs[0]),
        ("seqlen_q", "q", qs[1]),
        ("nheads_q", "q", qs[2]),
        ("headdim", "q", qs[3]),
        ("dtype", "q", code(q)),
        ("nheads_k", "k_cache_shard", dim(k_cache, 2)),
        ("headdim_v", "v_cache_shard", dim(v_cache, 3)),
        ("value", "softmax_scale", -2 if softmax_scale is None else _f64_bits(softmax_scale)),
        ("value", "causal", int(bool(causal))),
        ("value", "softcap", _f64_bits(softcap)),
        ("dtype code", "out_dtype", _DTYPES.index(out_dtype) if out_dtype in _DTYPES else -1),
        ("presence", "out_scale", int(out_scale is not None)),
    )


def _checksums(values, device, ok):
    """float64 sums of ``values`` ((name, tensor or None) pairs) as int64 bits on ``device``, computed there
    (no host read); zeros where a rank failed (its tensors may be anything) or a value is None."""
    sums = []
    for _, t in values:
        if ok and isinstance(t, torch.Tensor):
            sums.append(t.detach().to(device=device, dtype=torch.float64).sum().reshape(1))
        else:
            sums.append(torch.zeros(1, dtype=torch.float64, device=device))
    return torch.cat(sums).view(torch.int64) if sums else torch.zeros(0, dtype=torch.int64, device=device)


def _agree(sig, values, err, group, world, device):
    """Exchange every rank's status, signature and checksums of ``values`` (one small all-gather, then a host
    read) and raise on every rank if any rank failed or they differ."""
    msg = b""
    code = 0
    if err is not None:
        code = next((i + 1 for i, cls in enumerate(_EXC) if isinstance(err, cls)), len(_EXC))
        msg = str(err).encode("utf-8", "replace")[:_MSG_BYTES]
    row = [code, *(v for _, _, v in sig), len(msg), *msg, *([0] * (_MSG_BYTES - len(msg)))]
    mine = torch.cat((torch.tensor(row, dtype=torch.int64, device=device), _checksums(values, device, err is None)))
    rows = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    _all_gather(rows, mine, group)
    table = rows.view(world, -1).tolist()
    failed = [r for r in range(world) if table[r][0]]
    if err is not None:
        raise err
    if failed:
        r = failed[0]
        n = len(sig) + 1
        text = bytes(table[r][n + 1 : n + 1 + table[r][n]]).decode("utf-8", "replace")
        raise _EXC[table[r][0] - 1](f"{text} [raised on rank {r} of the context-parallel group; every rank raises it]")
    for i, (field, arg, _) in enumerate(sig):
        vals = [table[r][i + 1] for r in range(world)]
        if len(set(vals)) > 1:
            got = ", ".join(f"{v} on rank {r}" for r, v in enumerate(vals))
            C._fail(
                ValueError,
                arg,
                f"the same {field} on every rank of the context-parallel group",
                got,
                "Pass every rank the same query and options; only the cache shards, page tables and lengths "
                "differ per rank.",
            )
    for i, (name, _) in enumerate(values):
        vals = [table[r][len(row) + i] for r in range(world)]
        if len(set(vals)) > 1:
            got = ", ".join(f"{struct.unpack('<d', struct.pack('<q', v))[0]!r} on rank {r}" for r, v in enumerate(vals))
            C._fail(
                ValueError,
                name,
                "the same values on every rank of the context-parallel group (compared by their float64 sums)",
                got,
                f"Pass every rank the same {name}.",
            )


def _all_gather(recv, send, group):
    """All-gather ``send`` (n,) of every rank into ``recv`` (world * n,), one collective."""
    backend = str(dist.get_backend(group)).lower()
    if backend in ("nccl", "gloo"):
        # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(recv, send, group=group)
    else:  # backends without a single-tensor all-gather: the same buffer as a list of views
        dist.all_gather(list(recv.view(-1, send.numel()).unbind(0)), send, group=group)


def _capturing(t):
    return isinstance(t, torch.Tensor) and t.is_cuda and torch.cuda.is_current_stream_capturing()


def cp_decode(
    q,
    k_cache_shard,
    v_cache_shard,
    page_table_shard,
    cache_seqlens_shard,
    *,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    num_splits=0,
    k_cache_scales=None,
    v_cache_scales=None,
    group=None,
    out=None,
    out_dtype=None,
    out_scale=None,
    return_softmax_lse=False,
    workspace=None,
    check_ranks=True,
    validate=False,
):
    """Decode attention over a paged cache sharded along the sequence across the ranks of ``group``.

    Every rank passes the same query and options and its own shard; every rank returns the full result.

    Parameters
    ----------
    q : (batch, seqlen_q, nheads_q, headdim), bf16 / fp16 over an FP8 cache, or FP8 (as
        :func:`fp8attn.flash_attn_with_kvcache`); identical on every rank.
    k_cache_shard, v_cache_shard : this rank's pool, (num_blocks_r, page_size, nheads_k, headdim[_v]); the pool
        size and page size may differ per rank.
    page_table_shard : (batch, max_pages_r) int32 over this rank's pool; -1 in unused entries.
    cache_seqlens_shard : (batch,) int32, this rank's tokens of each sequence (0 allowed: an empty shard).
    q_descale, k_descale, v_descale : float32 (batch, nheads_k) or per-tensor / per-sequence broadcasts: the
        sequence's descales (the same on every rank).
    softmax_scale, softcap, num_splits : as in :func:`fp8attn.flash_attn_with_kvcache` (``num_splits``: the local
        call's KV splits).
    causal : allowed with seqlen_q == 1 (the query is the last token, so it sees every key either way);
        seqlen_q > 1 with causal raises NotImplementedError. window_size : must be (-1, -1).
    k_cache_scales, v_cache_scales : this shard's per-token-head scales (num_blocks_r, page_size, nheads_k).
    group : the context-parallel process group (default: the world). NCCL on GPUs, gloo on CPUs.
    out : optional preallocated output (batch, seqlen_q, nheads_q, headdim_v), written in place.
    out_dtype : bf16 (default for FP8 q; else q's dtype), fp16 or fp32. out_scale : float32 one-element static
        scale; the output is then e4m3fn ``saturate(out / out_scale)`` (fused in the merge).
    return_softmax_lse : also return the merged LSE (batch, nheads_q, seqlen_q) float32 (-inf for a row no rank
        has a key for; its output is 0).
    workspace : optional :class:`CPWorkspace` (allocated once; needed for CUDA graphs with a fixed address).
    check_ranks : exchange a status tensor before the gather so that a rank's bad argument raises on every rank
        (one small extra collective and a host read). Skipped while a CUDA graph is being captured. The same on
        every rank (it sets the number of collectives).
    validate : also run the value checks on GPU tensors (they sync the device).

    Returns
    -------
    out : (batch, seqlen_q, nheads_q, headdim_v); with ``return_softmax_lse`` also the LSE.

    Notes
    -----
    CUDA graphs (NCCL): no host sync on the path; capture after one eager call (which also runs the rank
    check and initializes the communicator), with ``workspace=`` and ``out=`` preallocated. Collectives run
    under the group's timeout.
    """
    _, world, backend = _group_info(group)
    agree = check_ranks and not _capturing(q)
    sig = (
        _signature(q, k_cache_shard, v_cache_shard, softmax_scale, causal, softcap, out_dtype, out_scale)
        if agree
        else ()
    )
    err, ws = None, workspace
    try:
        _check_cp_call(
            q,
            v_cache_shard,
            causal,
            window_size,
            out,
            out_dtype,
            out_scale,
            workspace,
            world,
            page_table_shard,
            cache_seqlens_shard,
        )
        ws = workspace or CPWorkspace(q, v_cache_shard.shape[-1], world)
        attn = dict(
            q_descale=q_descale,
            k_descale=k_descale,
            v_descale=v_descale,
            softmax_scale=softmax_scale,
            causal=bool(causal),
            softcap=softcap,
            num_splits=num_splits,
            validate=validate,
        )
        _attend(
            q,
            (k_cache_shard, v_cache_shard, page_table_shard, cache_seqlens_shard, k_cache_scales, v_cache_scales),
            attn,
            ws.send,
            ws,
        )
    except Exception as e:  # noqa: BLE001 -- every failure is reported to the other ranks, then re-raised
        if not agree:
            raise
        err = e
    if agree:
        dev = torch.device("cpu")
        if backend == "nccl":  # NCCL gathers device tensors only
            dev = (
                q.device
                if isinstance(q, torch.Tensor) and q.is_cuda
                else torch.device("cuda", torch.cuda.current_device())
            )
        _agree(
            sig,
            (("q", q), ("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)),
            err,
            group,
            world,
            dev,
        )
    _all_gather(ws.recv, ws.send, group)
    return _merge(ws, out, out_dtype, out_scale, q, return_softmax_lse)


def simulate_cp_decode(
    q,
    shards,
    *,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    softcap=0.0,
    num_splits=0,
    out=None,
    out_dtype=None,
    out_scale=None,
    return_softmax_lse=False,
    workspace=None,
    validate=False,
):
    """:func:`cp_decode` with every shard in this process, one after the other, and no collective: each
    shard's partial goes straight into its chunk of the gather buffer, then the same merge runs. For checking
    a sharding (and timing the shards) on one device.

    Parameters
    ----------
    q : as in :func:`cp_decode`.
    shards : sequence of :class:`CPShard` (or tuples ``(k_cache, v_cache, page_table, cache_seqlens[,
        k_cache_scales, v_cache_scales])``), one per simulated rank, on q's device.
    Other arguments as in :func:`cp_decode` (``workspace``: a CPWorkspace for ``len(shards)`` ranks).

    Returns
    -------
    out (and the LSE) exactly as :func:`cp_decode` over those shards would return.
    """
    shards = [CPShard(*s) for s in shards]
    if not shards:
        C._fail(ValueError, "shards", "at least one shard", "none", "Pass one CPShard per simulated rank.")
    _check_cp_call(q, shards[0].v_cache, causal, (-1, -1), out, out_dtype, out_scale, workspace, len(shards))
    ws = workspace or CPWorkspace(q, shards[0].v_cache.shape[-1], len(shards))
    attn = dict(
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        softmax_scale=softmax_scale,
        causal=bool(causal),
        softcap=softcap,
        num_splits=num_splits,
        validate=validate,
    )
    for r, s in enumerate(shards):
        _attend(q, tuple(s), attn, ws.rank_chunk(r), ws)
    return _merge(ws, out, out_dtype, out_scale, q, return_softmax_lse)


# ------------------------------------------------------------------------------ composition with heads
def tp_head_slices(nheads_q: int, nheads_k: int, tp_rank: int, tp_size: int):
    """The query and KV heads of tensor-parallel rank ``tp_rank``: ``(slice_q, slice_k)``.

    KV head ``h`` and its query heads ``h * g .. (h + 1) * g - 1`` (``g = nheads_q // nheads_k``) stay on one
    rank; ``nheads_k`` must divide by ``tp_size``. Slice q on dim 2, the caches on dim 2 and (batch, nheads_k)
    descales on dim 1 (per-tensor and per-sequence descales stay as they are).
    """
    for name, val in (("nheads_q", nheads_q), ("nheads_k", nheads_k), ("tp_size", tp_size)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            C._fail(ValueError, name, "an int >= 1", repr(val), f"Pass {name}.")
    _check_rank(tp_rank, tp_size)
    if nheads_q % nheads_k or nheads_k % tp_size:
        C._fail(
            ValueError,
            "tp_size",
            f"a divisor of nheads_k = {nheads_k} (with nheads_q = {nheads_q} a multiple of nheads_k)",
            f"{tp_size}",
            "Use a tensor-parallel size that divides the KV heads.",
        )
    hk = nheads_k // tp_size
    hq = hk * (nheads_q // nheads_k)
    return slice(tp_rank * hq, (tp_rank + 1) * hq), slice(tp_rank * hk, (tp_rank + 1) * hk)


class CPTPGroups(NamedTuple):
    """This rank's tensor-parallel (heads) and context-parallel (sequence) groups and its index in each."""

    tp_group: object
    cp_group: object
    tp_rank: int
    cp_rank: int


def new_cp_tp_groups(tp_size: int, cp_size: int, *, timeout=CP_TIMEOUT, backend=None) -> CPTPGroups:
    """Split the world into ``cp_size`` x ``tp_size`` ranks: global rank ``cp_rank * tp_size + tp_rank``.

    The ``tp_size`` ranks of one TP group hold the same sequence shard and split the heads; the ``cp_size`` ranks
    of one CP group hold the same heads and split the sequence. Every rank must call this (collectively, in the
    same order). ``timeout`` bounds each collective of the new groups.
    """
    for name, val in (("tp_size", tp_size), ("cp_size", cp_size)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            C._fail(ValueError, name, "an int >= 1", repr(val), f"Pass {name}.")
    rank, world, _ = _group_info(None)
    if tp_size * cp_size != world:
        C._fail(
            ValueError,
            "tp_size",
            f"tp_size * cp_size == world size {world}",
            f"{tp_size} * {cp_size}",
            "Choose sizes whose product is the number of ranks.",
        )
    tp_group = cp_group = None
    for c in range(cp_size):
        ranks = [c * tp_size + t for t in range(tp_size)]
        g = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            tp_group = g
    for t in range(tp_size):
        ranks = [c * tp_size + t for c in range(cp_size)]
        g = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            cp_group = g
    return CPTPGroups(tp_group, cp_group, rank % tp_size, rank // tp_size)


# ----------------------------------------------------------------------------------- a local launcher
def _local_worker(fn, rank, world_size, backend, folder, timeout, args):
    path = os.path.join(folder, f"rank{rank}.pt")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:  # one intra-op thread: the ranks share the host's cores, and a forked child must not reuse the
            torch.set_num_threads(1)  # parent's OpenMP pool
        store = dist.FileStore(os.path.join(folder, "store"), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save({"result": result}, path)
    except BaseException as err:  # noqa: BLE001 -- the parent re-raises it with this rank's traceback
        torch.save({"error": traceback.format_exc()}, path)
        raise SystemExit(1) from err


def launch_local(fn, world_size, *args, backend="gloo", timeout=CP_TIMEOUT, deadline_s=600.0, start_method=None):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes joined in one process group.

    For tests and single-host benchmarks (engines launch their ranks themselves, e.g. with torchrun).

    Parameters
    ----------
    fn : the function each rank runs; with ``start_method="spawn"`` it must be importable (module level).
    backend : "gloo" (CPU) or "nccl" (rank r on cuda:r).
    timeout : the process group's collective timeout.
    deadline_s : the whole run's limit: ranks still running then are killed and TimeoutError is raised.
    start_method : "fork" (default for gloo where available: no re-import) or "spawn" (default for NCCL, which
        cannot fork a process that has used CUDA).

    Returns
    -------
    list : each rank's return value (saved with torch.save), in rank order. A rank that raised makes this raise
    RuntimeError with its traceback.
    """
    if start_method is None:
        start_method = "fork" if backend != "nccl" and "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(start_method)
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(target=_local_worker, args=(fn, r, world_size, backend, folder, timeout, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline_s
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        if hung:
            raise TimeoutError(f"launch_local: ranks {hung} still ran after {deadline_s} s and were killed.")
        out = []
        for r in range(world_size):
            path = os.path.join(folder, f"rank{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"launch_local: rank {r} exited with code {procs[r].exitcode} and no result.")
            res = torch.load(path, weights_only=False)
            if "error" in res:
                raise RuntimeError(f"launch_local: rank {r} raised:\n{res['error']}")
            out.append(res["result"])
        return out
