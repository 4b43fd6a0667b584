"""Dense FP8 attention forward for Hopper with TMA loads and asynchronous wgmma (Gluon).

The fast path of ``dense.launch_dense_fwd`` for the common prefill case: e4m3 Q/K/V, head dim 64,
128 or 256 (the same for q/k and v) or MLA prefill's qk 192 / v 128 (``QK192_V128``: Q and K in three
64-wide boxes whose S MMAs chain, V and O as at head dim 128; ``FP8ATTN_TMA_QK192=0`` leaves it to the
Triton kernel), sequence lengths that are multiples of 128, per-(batch, kv head)
descales, optional bottom-right causal mask and LSE; bf16 output, or e4m3 output with the fused
static per-tensor scale ``out_scale``. Everything else stays on the Triton kernel (``supported``).
This module holds the launchers. The kernels' Gluon code is in ``forward`` (the kernels and their producer)
and ``consumer``, built from ``softmax``, ``epilogue``, ``pipeline`` and ``scheduler``. Head dim, output
dtype (``OUT_FP8``), causal and LSE are compile-time constants:

* ``forward._dense_fwd_tma_ws_kernel`` (every head dim), warp-specialized like FA3: a 1-warp TMA producer
  fills a double-buffered Q and a K/V ring guarded by ready/empty mbarriers, and two 4-warp consumers
  (64 query rows each, 240 registers) take turns issuing their MMAs -- S_j = Q K_j^T together with
  P_{j-1} V_{j-1} -- so one consumer's softmax overlaps the other's tensor-core work ("ping-pong").
  Persistent: one CTA per SM walks the query blocks in rounds, and a block's epilogue overlaps the
  next block's loads (causal inputs longer than 8k run one block per CTA, except at head dim 64).
  Head dim 256 runs Q/K in two 128-wide halves, V/O in four 64-wide quarters and 64-key tiles
  (``_ws_attend_d256``). Head dim 64 loads K key-permuted (``kperm_on``), so that P becomes the A
  operand of P V without a cross-lane exchange.
* ``forward._bounded_fwd_tma_ws_kernel``: the warp-specialized kernel's partitions with per-sequence bounds
  (``MODE``): over a paged FP8 KV cache (chunked prefill, ``paged_launch``: the producer reads each
  tile's page from the page table), with varlen queries and keys (``cu_seqlens``), or varlen queries
  over a paged cache (mixed batches); lengths come from the device, varlen query blocks from a list
  built on the device (``varlen_block_list``), and the tiles at the diagonal or a sequence's end run
  masked (head dims 64, 128).

The tests hold the warp-specialized kernel's bits to an 8-warp lockstep schedule of the same math, kept
outside the package (``_kernel_for``, ``_use_ws``). K/V tiles stream through a ``NUM_STAGES``-deep ring of
shared-memory buffers filled by TMA.

Operands as 2-D TMA views (no copies), D the head dim:

* q, out: (batch * seqlen_q, nheads_q * D); tile [b * seqlen_q + m0, h * D]
* k:      (batch * seqlen_k, nheads_k * D); tile [b * seqlen_k + n0, hk * D]
* v:      sequence-contiguous (``dense.transpose_v_kmajor``), (batch * nheads_k * D, seqlen_k);
  tile [(b * nheads_k + hk) * D, n0] -- the K-major B operand FP8 wgmma needs for P @ V.

Because seqlen_q and seqlen_k are multiples of 128, no tile crosses into the next sequence's rows.

Numerics match the Triton kernel (``common``): base-2 online softmax with
``q_descale * k_descale * softmax_scale * log2(e)`` folded into the logit scale, P computed as
``exp2(s - m + 8)`` (in [0, 256]) and cast to e4m3, the row sum taken over the fp32 P, each tile's
P @ V started from a zero accumulator and added to the fp32 accumulator (two-level accumulation),
``v_descale`` folded into the final 1 / rowsum. The FP8 output is ``common.output_epilogue``'s
``clamp(o * (1 / out_scale), -448, 448)`` cast to e4m3fn, with ``out_scale`` loaded in the kernel.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # triton without Gluon: the fast path is simply unavailable
    HAS_GLUON = False

from ..common import INTERPRET, cdiv, fill_varlen_block_list, find_seq, next_pow2
from ..planning import tma_options_reason, window_flags
from ..replay import SUPPORTED, HostDesc, constant, hooks_installed, launch

# the kernels' signature; MODE_* and ENTRY are also read here by the paged launchers and the tests
from .signature import (
    _BOUNDED_PTR_ARGS,
    _PTR_ARGS,
    BLOCK_M,
    BLOCK_N,
    ENTRY,
    HEAD_DIMS,
    MODE_PAGED,
    MODE_PAGED_VARLEN,
    MODE_VARLEN,
    NUM_STAGES,
)

if HAS_GLUON:
    from .forward import _bounded_fwd_tma_ws_kernel, _dense_fwd_tma_ws_kernel
    from .pipeline import box_keys, kperm_box_on

__all__ = ["supported", "unsupported_reason", "capability_reason", "device_reason", "launch_dense_fwd_tma",
           "varlen_v_kmajor", "HAS_GLUON", "QK192_V128", "qk192_enabled", "dense_rules", "set_dense_rules",
           "MODE_PAGED", "MODE_PAGED_VARLEN"]

_LOG2E = 1.4426950408889634


@triton.jit
def _block_list_kernel(CuQ, KSrc, Blocks, batch, min_len_q, BM: tl.constexpr, BLOCK_B: tl.constexpr,
                       KEYS_CU: tl.constexpr, ENTRY: tl.constexpr):
    """``varlen_block_list`` in one program (``common.fill_varlen_block_list``; a mixed paged batch builds
    the list inside one of its Triton launches instead)."""
    fill_varlen_block_list(CuQ, KSrc, Blocks, batch, min_len_q, BM, BLOCK_B, KEYS_CU, ENTRY)


@triton.jit
def _varlen_v_layout_kernel(X, Y, CuK, batch, head_dim, stride_xs, stride_xh, stride_xd, stride_yh, stride_yd,
                            BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """``varlen_v_kmajor`` in one pass. Program (i, h): the i-th BLOCK_S-token tile of the capacity
    ``total_k // BLOCK_S + batch``, whose sequence b's tiles start at ``cu_seqlens_k[b] // BLOCK_S + b``
    (``find_seq``): its tokens are contiguous in Y's columns, so the transposed store is a row of
    BLOCK_S bytes per head-dim index (a per-token sequence lookup made it byte stores, several times slower)."""
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = find_seq(CuK, pid, batch, BLOCK_S)
    start = tl.load(CuK + b)
    offs_s = (pid - (start // BLOCK_S + b)) * BLOCK_S + tl.arange(0, BLOCK_S)  # tokens of the sequence
    offs_d = tl.arange(0, BLOCK_D)
    len_k = tl.load(CuK + b + 1) - start
    d_ok = offs_d[None, :] < head_dim
    x = tl.load(X + (start + offs_s).to(tl.int64)[:, None] * stride_xs + h * stride_xh + offs_d[None, :] * stride_xd,
                mask=(offs_s[:, None] < len_k) & d_ok, other=0)
    dest = 16 * (start // 16 + b).to(tl.int64) + offs_s
    # The store covers the sequence's columns up to a multiple of 16 (zeros past its end, before the next
    # sequence's first column): a mask constant over 16 columns lets the compiler store 16 bytes at a time
    # (an exact per-column mask made byte stores).
    tl.store(Y + h * stride_yh + offs_d[None, :] * stride_yd + dest[:, None], x,
             mask=(offs_s[:, None] < (len_k + 15) // 16 * 16) & d_ok)


def varlen_v_kmajor(v: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """Varlen V laid out for the TMA kernel.

    V becomes (nheads_k, d, columns) with sequence b's keys contiguous from column
    ``16 * (cu_seqlens_k[b] // 16 + b)`` (a TMA box must start on 16 bytes; the start grows by more
    than each sequence's length); the columns after a sequence hold zeros up to the next multiple of 16,
    the rest between sequences is not written (the kernel never uses it). One Triton pass
    (``_varlen_v_layout_kernel``; on CUDA, or on the CPU under the interpreter), no host synchronization;
    torch otherwise (``_varlen_v_kmajor_torch``).

    Parameters
    ----------
    v : torch.Tensor
        (total_k, nheads_k, d), any dtype and strides (the head dim or the tokens contiguous read fastest:
        the kernel is compiled for a unit stride of either).
    cu_seqlens_k : torch.Tensor
        int32 (batch + 1,).

    Returns
    -------
    torch.Tensor
        (nheads_k, d, 16 * (total_k // 16 + batch + 1)), contiguous, ``v``'s dtype.
    """
    total_k, hk, d = v.shape
    batch = cu_seqlens_k.numel() - 1
    cols = 16 * (total_k // 16 + batch + 1)
    if v.is_cuda or INTERPRET:
        one_byte = v.element_size() == 1
        y = torch.empty(hk, d, cols, device=v.device, dtype=torch.uint8 if one_byte else v.dtype)
        bs = 128  # one 128-byte row of Y per head-dim index and tile
        launch(_varlen_v_layout_kernel, (total_k // bs + batch, hk),
            v.view(torch.uint8) if one_byte else v, y, cu_seqlens_k, batch, d, *v.stride(), y.stride(0), y.stride(1),
            BLOCK_S=bs, BLOCK_D=max(16, next_pow2(d)), num_warps=4)
        return y.view(v.dtype)
    return _varlen_v_kmajor_torch(v, cu_seqlens_k)


def _varlen_v_kmajor_torch(v, cu_seqlens_k):
    """``varlen_v_kmajor`` in torch operations (zeros between sequences)."""
    total_k, hk, d = v.shape
    batch = cu_seqlens_k.numel() - 1
    cols = 16 * (total_k // 16 + batch + 1)
    tok = torch.arange(total_k, device=v.device, dtype=torch.int32)
    seq = (torch.searchsorted(cu_seqlens_k, tok, right=True) - 1).to(torch.int32)
    start = cu_seqlens_k[seq.long()]
    dest = 16 * (start // 16 + seq) + (tok - start)
    y = torch.zeros(hk, d, cols, device=v.device, dtype=torch.uint8 if v.element_size() == 1 else v.dtype)
    src = v.view(torch.uint8) if v.element_size() == 1 else v
    y.index_copy_(2, dest.long(), src.permute(1, 2, 0))
    return y.view(v.dtype)


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _capability(index):
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _num_sms(index):
    """The persistent kernel's grid: one CTA per SM (its shared memory and registers allow one)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


# Head dims on the warp-specialized kernel: every one, faster than the 8-warp lockstep schedule at every length
# and mask measured on the H200, with the same bits (docs/decisions.md).
_WS_HEAD_DIMS = (64, 128, 256)
_VARLEN_HEAD_DIMS = (64, 128)  # the bounded kernel's
# The one pair of unequal head dims (qk, v) on the warp-specialized dense kernel: MLA prefill's (qk_nope 128 +
# qk_rope 64, v 128). Taken by default; ``FP8ATTN_TMA_QK192=0`` leaves it to the Triton kernel (``qk192_enabled``).
QK192_V128 = (192, 128)


def qk192_enabled():
    """Whether dense (non-varlen) calls at qk 192 / v 128 may run on the warp-specialized kernel: unless the
    environment variable ``FP8ATTN_TMA_QK192`` is ``0`` (unset, empty or ``1``: yes; anything else is a
    ValueError)."""
    flag = os.environ.get("FP8ATTN_TMA_QK192", "1") or "1"
    if flag not in ("0", "1"):
        raise ValueError(f"FP8ATTN_TMA_QK192: expected 0 or 1, got {flag!r}. Unset it (or 1) to run qk 192 / "
                         "v 128 on the TMA kernel, 0 to keep it on the Triton kernel.")
    return flag == "1"


# The warp-specialized kernel runs persistent (one CTA per SM walking the query blocks; a block's epilogue
# overlaps the next one's loads) except for causal inputs longer than this, where one block per CTA measured
# faster on the H200 (shorter inputs: even or faster persistent). A load model puts the alternating schedule
# close to perfect balance there, so the likelier cause is its order: every head's K/V is live at once, where
# one block per CTA in the hardware's order works through about one head at a time (not measured).
_WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q = 8192
# ... but the dense kernel's causal inputs at these head dims run persistent at any length: at d64 the
# persistent grid measured faster beyond 8k on the H200, with an LSE or without (docs/decisions.md).
_WS_PERSISTENT_CAUSAL_HEAD_DIMS = (64,)
# ... and causal inputs whose K/V (one sequence, all KV heads, e4m3) exceeds this run one block per CTA at any
# length and head dim: qk 192 / v 128 at 8k tokens measured faster that way with 128 heads (320 MiB of K/V)
# and slower with 16 heads (40 MiB); the dense grid's inputs up to 8k stay at or below 64 MiB
# (docs/decisions.md). Consistent with the order explanation above: the more K/V the heads in flight hold,
# the less of it the 50 MiB L2 keeps.
_WS_PERSISTENT_CAUSAL_MAX_KV_BYTES = 128 << 20

# Head dim 256 on the warp-specialized kernel: a call without an LSE runs the LSE variant into a scratch
# tensor (B * H * S float32, ~1 MB at 16k tokens and 16 heads). The two variants sum in fp32 and give the
# same output bits, but ptxas compiles the one without an LSE into a slower consumer loop (fewer spills in
# the sm_90a compile, yet slower on the H200; docs/decisions.md).
_D256_LSE_SCRATCH = True


# ``FP8ATTN_DENSE_RULES``: overrides of the dense launcher's rules, for A/B timings in one process (``fp8attn
# bench dense --dense-rules``): comma-separated ``rule=value`` with ws (warp-specialized kernel, 0/1),
# persistent (the warp-specialized grid, 0/1), consumers (2/3), stages (K/V ring stages of the warp-specialized
# kernel, 2-4), kperm (0/1), d256_scratch (0/1). Unset or empty: the rules as committed. Fixed-length launches
# only (varlen keeps its rules). Read once, at the first launch (a bad value then raises there, not at import);
# ``set_dense_rules`` changes them in a running process (a per-launch read of the environment would cost
# microseconds on every eager call).
DENSE_RULES_ENV = "FP8ATTN_DENSE_RULES"
_RULE_NAMES = {"ws": (0, 1), "persistent": (0, 1), "consumers": (2, 3), "stages": (2, 3, 4), "kperm": (0, 1),
               "d256_scratch": (0, 1)}


@functools.lru_cache(maxsize=16)
def dense_rules(text):
    """``FP8ATTN_DENSE_RULES``'s value parsed: ``{rule: int}`` (empty for None or ""). ValueError naming the
    variable for an unknown rule or value."""
    rules = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, _, val = item.partition("=")
        name, val = name.strip(), val.strip()
        if name not in _RULE_NAMES or not val.lstrip("-").isdigit() or int(val) not in _RULE_NAMES[name]:
            raise ValueError(f"{DENSE_RULES_ENV}: expected comma-separated rule=value with "
                             + ", ".join(f"{k} in {v}" for k, v in _RULE_NAMES.items())
                             + f"; got {item.strip()!r}. Unset it for the committed rules.")
        rules[name] = int(val)
    return rules


_DENSE_RULES = None  # {rule: int} once read


def _dense_rules_now():
    global _DENSE_RULES
    if _DENSE_RULES is None:
        _DENSE_RULES = dense_rules(os.environ.get(DENSE_RULES_ENV))
    return _DENSE_RULES


def set_dense_rules(text):
    """Replace the dense launcher's rule overrides (``FP8ATTN_DENSE_RULES``'s syntax; None or "": the
    committed rules) for the launches that follow; returns the previous overrides' text form. ValueError for
    a value ``dense_rules`` refuses (nothing changes then)."""
    global _DENSE_RULES
    new = dense_rules(text or None)
    old = ",".join(f"{k}={v}" for k, v in _dense_rules_now().items())
    _DENSE_RULES = new
    return old


def varlen_preferred(head_dim, max_seqlen_q):
    """Whether varlen inputs that the TMA kernel supports go to it by default (``FP8ATTN_DENSE_BACKEND``
    unset): head dims 64 and 128, and q/k head dim 192 (qk 192 / v 128: not measured, taken as head dim 128 is;
    ``FP8ATTN_TMA_QK192=0`` turns it off), with sequences up to at least 1024 queries: there the TMA kernel
    measured faster than the Triton kernel on the H200 at both head dims, causal or not, V laid out by
    ``varlen_v_kmajor`` in each call (docs/decisions.md); shorter batches were not measured."""
    return (head_dim in _VARLEN_HEAD_DIMS or head_dim == QK192_V128[0]) and max_seqlen_q is not None \
        and int(max_seqlen_q) >= 1024


def ws_grid(n_blocks, causal, seqlen_q, device_index, head_dim=None, persistent=None, kv_bytes=0):
    """The warp-specialized kernels' grid for ``n_blocks`` query blocks: one CTA per SM (persistent), or
    one per block for causal inputs longer than ``_WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q`` unless ``head_dim``
    (passed by the dense launcher) is in ``_WS_PERSISTENT_CAUSAL_HEAD_DIMS``, and for causal inputs whose
    ``kv_bytes`` (one sequence's K and V) exceed ``_WS_PERSISTENT_CAUSAL_MAX_KV_BYTES``; ``persistent``
    overrides it."""
    if persistent is None:
        persistent = not causal or (
            (seqlen_q <= _WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q or head_dim in _WS_PERSISTENT_CAUSAL_HEAD_DIMS)
            and kv_bytes <= _WS_PERSISTENT_CAUSAL_MAX_KV_BYTES
        )
    return (min(n_blocks, _num_sms(device_index)) if persistent else n_blocks, 1)


def _use_ws(head_dim, causal, seqlen_q):
    """The warp-specialized kernel at every head dim it has (at least as fast as the 8-warp schedule at every
    length measured on the H200). The arguments are the signature the tests replace to force the 8-warp
    reference kernels (to compare bits)."""
    return head_dim in _WS_HEAD_DIMS


def ws_config(head_dim, causal, consumers=None, head_dim_v=None):
    """``(consumers, keys per KV tile, ring stages)`` of the warp-specialized dense kernel: two consumer
    warpgroups over ``_tiles``' tiles and ``NUM_STAGES`` ring stages. ``consumers=3`` (head dim 64 without a
    causal mask): three over 192-row blocks and 64-key tiles in a 4-stage ring (with 128-key tiles their 160
    registers spill the accumulator in the loop). Not the default: on the H200 it ran slower than two
    consumers without an LSE (the tensor-core row sums lose their gain at 64-key tiles) and within noise with
    one (docs/decisions.md). ``head_dim_v``: V's head dim
    where it differs (qk 192 / v 128: two consumers, 128-key tiles, as head dim 128)."""
    if consumers in (None, 2):
        return 2, _tiles(head_dim, True, head_dim_v)[3], NUM_STAGES
    if consumers == 3 and head_dim == 64 and not causal:
        return 3, 64, 4
    raise ValueError(f"consumers: expected 2, or 3 at head dim 64 without a causal mask, got {consumers!r} at head "
                     f"dim {head_dim}, causal={causal}. Pass consumers=2 (the default) otherwise.")


def _tiles(head_dim, ws, head_dim_v=None):
    """(rows of a Q/O box, head-dim width of a Q/K box, of a V/O box, keys per KV tile). The
    warp-specialized kernel loads Q and stores O per 64-row consumer; head dim 256 runs Q/K in two
    128-wide halves, V/O in four 64-wide quarters, with 64-key tiles (``_ws_attend_d256``, and the 8-warp
    ``_dense_fwd_tma_d256_kernel``). ``head_dim_v`` (V's and O's, when it differs; warp-specialized only):
    qk 192 / v 128 runs Q/K in three 64-wide boxes (a 192-byte row is no swizzle width: one box of it
    cannot be swizzled for the wgmma), V/O whole, 128-key tiles."""
    if head_dim_v not in (None, head_dim):
        if not (ws and (head_dim, head_dim_v) == QK192_V128):
            raise ValueError(f"head dims (qk, v): expected equal ones or {QK192_V128} on the warp-specialized "
                             f"kernel, got ({head_dim}, {head_dim_v}), ws={ws}")
        return (BLOCK_M // 2, 64, head_dim_v, BLOCK_N)
    if head_dim == 256:
        return (BLOCK_M // 2 if ws else BLOCK_M, 128, 64, 64)
    return (BLOCK_M // 2 if ws else BLOCK_M, head_dim, head_dim, BLOCK_N)


@functools.lru_cache(maxsize=None)
def _layouts(tiles, out_fp8, v_rows=False, k_rows=None, kperm=False):
    """Shared-memory layouts of the Q, K, V and output boxes of ``_tiles(...)`` (``v_rows``: V's box is
    K's, rows of keys; ``k_rows``: keys of K's box when fewer than the tile's, up to one page; ``kperm``:
    K's box is ``kperm_box``, rank 5 with the swizzle of the 2-D box)."""
    f8 = gl.float8e4nv
    rows, dh, dv, bn = tiles
    kb = k_rows or bn
    k_layout = gl.NVMMASharedLayout.get_default_for([kb, dh], f8)
    if kperm:
        k_layout = gl.NVMMASharedLayout(swizzle_byte_width=k_layout.swizzle_byte_width, element_bitwidth=8, rank=5)
    return (gl.NVMMASharedLayout.get_default_for([rows, dh], f8),
            k_layout,
            gl.NVMMASharedLayout.get_default_for([kb, dh] if v_rows else [dv, bn], f8),
            gl.NVMMASharedLayout.get_default_for([rows, dv], f8 if out_fp8 else gl.bfloat16))


@functools.lru_cache(maxsize=None)
def _ones_layout(tile_keys):
    """Shared-memory layout of the warp-specialized kernels' (16, keys) tile of e4m3 ones."""
    return gl.NVMMASharedLayout.get_default_for([_ONES_ROWS, tile_keys], gl.float8e4nv)


# Columns of the row-sum MMA (every column is the sum). 16 is the width the kernels were measured with; a
# standalone H200 check summed right with TMA-loaded tiles of 8 and 16.
_ONES_ROWS = 16
_ONES = {}


def _ones(device):
    """The (16, 128) e4m3 ones that the warp-specialized kernels load once per CTA for their row sums
    (``_row_sum_issue``), one tensor per device. Under CUDA-graph capture a first call makes
    its own (the graph's fill runs before each replay's launch) and keeps none."""
    t = _ONES.get(device)
    if t is None:
        t = torch.ones(_ONES_ROWS, BLOCK_N, device=device, dtype=torch.float8_e4m3fn)
        if not torch.cuda.is_current_stream_capturing():
            _ONES[device] = constant(t)  # (kernels only read it: a replayed launch passes it as recorded)
    return t


def _kernel_for(head_dim, ws):
    """(kernel, num_warps) of a dense launch: the warp-specialized kernel, at every head dim (its partitions add
    5 worker warps). Only it ships; ``ws`` False names the 8-warp lockstep schedule, which the tests keep
    outside the package as the reference the warp-specialized kernel's bits are held to (they replace
    this function and ``_use_ws`` to launch it)."""
    if not ws:
        raise ValueError(f"head dim {head_dim}: only the warp-specialized dense TMA kernel is available (ws=True)")
    return _dense_fwd_tma_ws_kernel, 4


def kperm_on(head_dim, consumers, causal, write_lse):
    """Whether the dense warp-specialized kernel loads K key-permuted (``kperm_box``): each 16 keys' rows in
    the order of the wgmma accumulator's columns, so that P, relabelled to key order, is already the A
    operand of P V (``_p_operand``; sm_90a: the conversion's SHFL.IDX, SEL and cross-lane PRMT
    gone). Head dim 64 with two consumers, except non-causal calls with an LSE, the one case where it measured
    slower on the H200 (docs/decisions.md). Without an LSE the output bits are the same as the plain box's;
    with one the fp32 row sums add in another order (the LSE moves in its last bits; the tests allow one
    bf16 ulp of output)."""
    return head_dim == 64 and consumers == 2 and (causal or not write_lse)


def kperm_box(keys, dh):
    """The 5-D K box of ``kperm_on``: (keys / 16, g 2, q 4, e 2, dh), shared-memory row
    16a + 8g + 2q + e holding key 16a + 4q + 2g + e (``_kperm_view``'s strides)."""
    return [keys // 16, 2, 4, 2, dh]


def _kperm_view(k):
    """Shape and strides of the 5-D TMA view of a contiguous K (batch, seqlen, nheads, d) for ``kperm_box``
    (batch * seqlen a multiple of 16, as the dense kernel's multiples of 128 are)."""
    b, s, h, d = k.shape
    r = h * d
    return [b * s // 16, 2, 4, 2, r], [16 * r, 2 * r, 4 * r, r, 1]


def _rows_2d(x):
    """Shape and strides of the (batch * seqlen, nheads * d) TMA view of a contiguous
    (batch, seqlen, nheads, d) tensor."""
    b, s, h, d = x.shape
    return [b * s, h * d], [h * d, 1]


def _vt_2d(v):
    """Shape and strides of the (batch * nheads_k * d, seqlen_k) TMA view of a sequence-contiguous V
    (batch, seqlen_k, nheads_k, d), memory order (batch, nheads_k, d, seqlen_k)."""
    b, s, h, d = v.shape
    return [b * h * d, s], [s, 1]


def unsupported_reason(q, k, v, out, *, causal, window_size, softcap, q_descale, k_descale, v_descale,
                       out_scale, cu_seqlens_q, descale_block_q, descale_block_k, lse, cu_seqlens_k=None,
                       capability=None):
    """Why the TMA fast path cannot run these inputs, or None when it can (see ``supported``).

    ``capability``: judge the device by this compute capability instead of the tensors' device (a query
    about a call, ``fp8attn.capability.supports``: its tensors may be shapes on the meta device)."""
    if not HAS_GLUON:
        return "triton.experimental.gluon is not available"
    why = tma_options_reason(q.dtype, k.dtype, v.dtype, out.dtype, window_size=window_size, softcap=softcap,
                             out_scale=out_scale, per_block=descale_block_q is not None or descale_block_k is not None)
    if why:
        return why
    if cu_seqlens_q is not None:
        return _varlen_unsupported_reason(q, k, v, out, q_descale=q_descale, k_descale=k_descale,
                                          v_descale=v_descale, out_scale=out_scale, cu_seqlens_q=cu_seqlens_q,
                                          cu_seqlens_k=cu_seqlens_k, lse=lse, capability=capability)
    causal = window_flags(causal, window_size)[0]
    ts = (q, k, v, out)
    if any(t.dim() != 4 for t in ts):
        return "q, k, v, out must be 4-d (batch, seqlen, nheads, headdim)"
    batch, sq, hq, d = q.shape
    _, sk, hk, _ = k.shape
    dv = v.shape[-1]
    if (d, k.shape[-1], dv) == (*QK192_V128[:1], *QK192_V128):
        if out_scale is not None:
            return "qk 192 / v 128 with the fused FP8 output (out_scale) runs on the Triton kernel"
        if not qk192_enabled():
            return "qk 192 / v 128 on the TMA kernel is switched off (FP8ATTN_TMA_QK192=0)"
    elif d not in HEAD_DIMS or k.shape[-1] != d or dv != d:
        return (f"head dim must be 64, 128 or 256 and equal for q, k and v, or {QK192_V128[0]} for q and k with "
                f"{QK192_V128[1]} for v (other head dims are not supported), got {d}, {k.shape[-1]}, {dv}")
    if (k.shape[0] != batch or tuple(v.shape[:-1]) != tuple(k.shape[:-1])
            or tuple(out.shape) != (*q.shape[:-1], dv)):
        return "shape mismatch between q, k, v, out"
    if batch == 0 or hq == 0:
        return "empty batch or no heads (nothing to launch)"
    if hk == 0 or hq % hk != 0:
        return f"nheads_q ({hq}) must be a multiple of nheads_k ({hk})"
    if sq % BLOCK_M != 0 or sk % BLOCK_N != 0 or sq == 0 or sk == 0:
        return f"seqlen_q ({sq}) and seqlen_k ({sk}) must be positive multiples of 128"
    if causal and sq > sk:
        return f"causal with seqlen_q ({sq}) > seqlen_k ({sk}) is not supported"
    if max(batch * sq, batch * sk, batch * hk * dv) >= 2 ** 31:
        return "too many rows for 32-bit TMA coordinates"
    if not (q.is_contiguous() and k.is_contiguous() and out.is_contiguous()):
        return "q, k, out must be contiguous (batch, seqlen, nheads, headdim)"
    if not v.permute(0, 2, 3, 1).is_contiguous():
        return "v must be sequence-contiguous (memory order (batch, nheads_k, headdim, seqlen_k))"
    return _common_unsupported_reason(ts, batch, hq, hk, q_descale, k_descale, v_descale, out_scale, lse,
                                      (batch, hq, sq), "(batch, nheads_q, seqlen_q)", capability=capability)


def _common_unsupported_reason(ts, batch, hq, hk, q_descale, k_descale, v_descale, out_scale, lse, lse_shape,
                               lse_name, extra=(), capability=None):
    """The alignment, descale, LSE and device rules of the dense and varlen paths."""
    if any(t.data_ptr() % 16 for t in ts):
        return "q, k, v, out must be 16-byte aligned"
    for name, ds in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if ds is None:
            return f"{name} is required"
        if ds.dtype != torch.float32 or tuple(ds.shape) != (batch, hk):
            return f"{name} must be float32 (batch, nheads_k)"
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != lse_shape):
        return f"lse must be float32 {lse_name}"
    # device checks last: the shape rules above hold (and are testable) without CUDA
    return device_reason(ts, tuple(extra) + (q_descale, k_descale, v_descale, lse, out_scale), capability)


def capability_reason(capability):
    """The compute-capability rule of every TMA kernel: None for sm90, else why not."""
    return None if tuple(capability) == (9, 0) else "needs an sm90 (Hopper) GPU"


def device_reason(ts, extra=(), capability=None):
    """The device rules of every TMA kernel: ``ts`` (q, k, v, out) CUDA tensors on one sm90 device with the
    tensors of ``extra`` (None entries skipped). None when they hold. With ``capability`` given, only
    ``capability_reason(capability)`` (the tensors' devices are the caller's business)."""
    if capability is not None:
        return capability_reason(capability)
    dev = ts[0].device
    if not all(t.is_cuda for t in ts):
        return "inputs must be CUDA tensors"
    if any(t.device != dev for t in tuple(ts) + tuple(t for t in extra if t is not None)):
        return "all tensors must be on one device"
    return capability_reason(_capability(dev.index if dev.index is not None else torch.cuda.current_device()))


def _varlen_unsupported_reason(q, k, v, out, *, q_descale, k_descale, v_descale, out_scale, cu_seqlens_q,
                               cu_seqlens_k, lse, capability=None):
    """``unsupported_reason`` for varlen inputs (``_bounded_fwd_tma_ws_kernel`` in ``MODE_VARLEN``), after
    ``planning.tma_options_reason``."""
    if cu_seqlens_k is None:
        return "varlen needs cu_seqlens_k"
    if out_scale is not None:  # compiled for sm90, not yet run on a GPU: the Triton kernel serves it
        return "varlen with the fused FP8 output (out_scale) runs on the Triton kernel"
    ts = (q, k, v, out)
    if any(t.dim() != 3 for t in ts):
        return "varlen q, k, v, out must be 3-d (total, nheads, headdim)"
    total_q, hq, d = q.shape
    total_k, hk, _ = k.shape
    dv = v.shape[-1]
    if (d, k.shape[-1], dv) == (*QK192_V128[:1], *QK192_V128):
        if not qk192_enabled():
            return "qk 192 / v 128 on the TMA kernel is switched off (FP8ATTN_TMA_QK192=0)"
    elif d not in _VARLEN_HEAD_DIMS or k.shape[-1] != d or dv != d:
        return (f"varlen head dim must be 64 or 128 for q, k and v, or {QK192_V128[0]} for q and k with "
                f"{QK192_V128[1]} for v, got {d}, {k.shape[-1]}, {dv}")
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]) or tuple(out.shape) != (*q.shape[:-1], dv):
        return "shape mismatch between q/out or k/v"
    if total_q == 0 or hq == 0 or hk == 0 or hq % hk != 0:
        return f"nheads_q ({hq}) must be a positive multiple of nheads_k ({hk}), total_q positive"
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.stride(0) != 1:
            return f"{name} must be contiguous int32 (batch + 1,)"
    batch = cu_seqlens_q.numel() - 1
    if cu_seqlens_k.numel() != batch + 1 or batch < 1:
        return "cu_seqlens_q and cu_seqlens_k must have batch + 1 entries (batch >= 1)"
    if not (q.is_contiguous() and k.is_contiguous() and out.is_contiguous()):
        return "varlen q, k, out must be contiguous (total, nheads, headdim)"
    if max(total_q + 128 * (batch + 1), 16 * (total_k // 16 + batch + 1) + 128, hk * d) >= 2 ** 31:
        return "too many rows for 32-bit TMA coordinates"
    return _common_unsupported_reason(ts, batch, hq, hk, q_descale, k_descale, v_descale, out_scale, lse,
                                      (hq, total_q), "(nheads_q, total_q)", extra=(cu_seqlens_q, cu_seqlens_k),
                                      capability=capability)


def supported(q, k, v, out, *, causal, window_size, softcap, q_descale, k_descale, v_descale,
              out_scale, cu_seqlens_q, descale_block_q, descale_block_k, lse, cu_seqlens_k=None) -> bool:
    """Whether ``launch_dense_fwd_tma`` handles these inputs.

    Parameters
    ----------
    q, k, v, out : torch.Tensor
        As for ``dense.launch_dense_fwd``; ``v`` already sequence-contiguous.
    causal, window_size, softcap, q_descale, k_descale, v_descale, out_scale, cu_seqlens_q,
    descale_block_q, descale_block_k, lse, cu_seqlens_k
        As for ``dense.launch_dense_fwd``.

    Returns
    -------
    bool
        True for: CUDA tensors on an sm90 device; q, k, v float8_e4m3fn; out bfloat16, or
        float8_e4m3fn together with ``out_scale`` (a float32 tensor with one element, on the same
        device); head dim 64, 128 or 256, the same for q, k and v, or 192 for q and k with 128 for v and
        out (``QK192_V128``, bf16 out, unless ``FP8ATTN_TMA_QK192=0``: ``qk192_enabled``); contiguous q,
        k, out (batch, seqlen, nheads, d) and V in memory order (batch, nheads_k, d, seqlen_k);
        seqlen_q and seqlen_k multiples of 128; nheads_q a multiple of nheads_k; causal only with
        seqlen_q <= seqlen_k; float32 (batch, nheads_k) descales (broadcast views allowed); no
        sliding window (``(-1, 0)`` is the causal mask), softcap or per-block descales; lse None or
        float32 (batch, nheads_q, seqlen_q). Varlen (``cu_seqlens_q`` and ``cu_seqlens_k``, int32): head
        dims 64 and 128 or qk 192 / v 128, bf16 out, contiguous q/k/out (total, nheads, d), V in any layout, lse None or
        (nheads_q, total_q). ``unsupported_reason`` says why not.
    """
    return unsupported_reason(q, k, v, out, causal=causal, window_size=window_size, softcap=softcap,
                              q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                              out_scale=out_scale, cu_seqlens_q=cu_seqlens_q,
                              descale_block_q=descale_block_q, descale_block_k=descale_block_k,
                              lse=lse, cu_seqlens_k=cu_seqlens_k) is None


def launch_dense_fwd_tma(q, k, v_kmajor, out, lse, *, softmax_scale, causal, q_descale, k_descale, v_descale,
                         out_scale=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """Launch the TMA/wgmma dense forward. No validation: call only when ``supported`` is True.

    Parameters
    ----------
    q : torch.Tensor
        float8_e4m3fn (batch, seqlen_q, nheads_q, d), contiguous; d is 64, 128 or 256, or 192 with
        dv 128 (MLA prefill's qk 192 / v 128, ``QK192_V128``; dense inputs, bf16 out).
    k : torch.Tensor
        float8_e4m3fn (batch, seqlen_k, nheads_k, d), contiguous.
    v_kmajor : torch.Tensor
        float8_e4m3fn (batch, seqlen_k, nheads_k, dv) with memory order
        (batch, nheads_k, dv, seqlen_k) (``dense.transpose_v_kmajor``); dv is d but at qk 192.
    out : torch.Tensor
        (batch, seqlen_q, nheads_q, dv), contiguous: bfloat16, or float8_e4m3fn with ``out_scale``.
        Written in place.
    lse : torch.Tensor or None
        float32 (batch, nheads_q, seqlen_q), any strides; natural-log LSE written when given.
    softmax_scale : float
    causal : bool
        Bottom-right aligned causal mask (seqlen_q <= seqlen_k).
    q_descale, k_descale, v_descale : torch.Tensor
        float32 (batch, nheads_k); stride-0 broadcast views allowed.
    out_scale : torch.Tensor or None
        float32, one element: the output is ``clamp(o / out_scale, -448, 448)`` in e4m3fn (read on
        the device; no host synchronization).
    cu_seqlens_q, cu_seqlens_k : torch.Tensor or None
        int32 (batch + 1,): varlen inputs (head dims 64, 128, qk 192 / v 128), q/out (total_q, nheads_q, d), k
        (total_k, nheads_k, d), v_kmajor (total_k, nheads_k, d) in any layout (laid out again by
        ``dense.varlen_v_kmajor``), lse (nheads_q, total_q).

    Notes
    -----
    ``supported`` takes qk 192 / v 128 by default; the environment variable ``FP8ATTN_TMA_QK192=0`` turns that
    off (those calls then run on the Triton kernel of ``dense``), ``1`` or unset keeps it on.

    Returns
    -------
    tuple
        ``(out, lse)``.
    """
    if cu_seqlens_q is not None:
        return _launch_varlen(q, k, v_kmajor, out, lse, softmax_scale=softmax_scale, causal=causal,
                              q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, out_scale=out_scale,
                              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    batch, sq, hq, d = q.shape
    sk, hk, d_v = k.shape[1], k.shape[2], v_kmajor.shape[-1]
    out_fp8 = out_scale is not None
    rules = _DENSE_RULES if _DENSE_RULES is not None else _dense_rules_now()
    # (qk 192 / v 128 has only the warp-specialized kernel)
    ws = d_v != d or bool(rules.get("ws", _use_ws(d, causal, sq)))
    rows, dh, dv, bn = _tiles(d, ws, d_v)
    nc, stages = 2, NUM_STAGES
    if ws:
        nc, bn, stages = ws_config(d, causal, rules.get("consumers"), None if d_v == d else d_v)
        stages = rules.get("stages", stages)
    kperm = ws and bool(rules.get("kperm", kperm_on(d, nc, causal, lse is not None)))
    if kperm and not (d == 64 and nc == 2):
        raise ValueError(f"{DENSE_RULES_ENV}: kperm=1 needs head dim 64 and two consumers, got head dim {d} and "
                         f"{nc}. Drop kperm=1 for this call.")
    k_view = (*_kperm_view(k), kperm_box(bn, dh)) if kperm else (*_rows_2d(k), [bn, dh])
    descs = ((q, *_rows_2d(q), [rows, dh]), (k, *k_view),
             (v_kmajor, *_vt_2d(v_kmajor), [dv, bn]), (out, *_rows_2d(out), [rows, dv]))
    lse_k = lse
    if lse is None and ws and d == 256 and rules.get("d256_scratch", _D256_LSE_SCRATCH):
        lse_k = torch.empty(batch, hq, sq, device=q.device, dtype=torch.float32)
    ls = lse_k.stride() if lse_k is not None else (0, 0, 0)
    args = (lse_k if lse_k is not None else q_descale, q_descale, k_descale, v_descale,
            out_scale if out_fp8 else q_descale, *ls, *q_descale.stride(), *k_descale.stride(),
            *v_descale.stride(), sq, sk, hq, hk, batch, float(softmax_scale) * _LOG2E)
    if ws:
        grid = ws_grid(cdiv(sq, nc * rows) * batch * hq, causal, sq, q.device.index, head_dim=d,
                       persistent=None if "persistent" not in rules else bool(rules["persistent"]),
                       kv_bytes=sk * hk * (d + d_v))
    else:
        grid = (sq // BLOCK_M, batch * hq)
    _launch(d, ws, grid, descs, args,
            (bool(causal), lse_k is not None, out_fp8, stages) + ((d, nc, d_v) if ws else ()), tiles=(rows, dh, dv, bn))
    return out, lse


def _launch_varlen(q, k, v_kmajor, out, lse, *, softmax_scale, causal, q_descale, k_descale, v_descale, out_scale,
                   cu_seqlens_q, cu_seqlens_k):
    """``launch_dense_fwd_tma`` for varlen inputs: the bounded kernel in ``MODE_VARLEN``, persistent over the
    query blocks of ``varlen_block_list`` (the grid from their capacity, ``total_q // 128 + batch`` per head)."""
    total_q, hq, d = q.shape
    total_k, hk, _ = k.shape
    d_v = v_kmajor.shape[-1]
    batch = cu_seqlens_q.numel() - 1
    rows, dh, dv, bn = tiles = _tiles(d, True, d_v)
    vt = varlen_v_kmajor(v_kmajor, cu_seqlens_k)
    blocks, ls, row_strides, grid = varlen_schedule(cu_seqlens_q, cu_seqlens_k, True, total_q, hq, lse, out)
    descs = ((q, [total_q, hq * d], [hq * d, 1], [rows, dh]), (k, [total_k, hk * d], [hk * d, 1], [bn, dh]),
             (vt, [hk * d_v, vt.shape[-1]], [vt.shape[-1], 1], [dv, bn]),
             (out, [total_q, hq * d_v], [hq * d_v, 1], [rows, dv]))
    out_fp8 = out_scale is not None
    args = (lse if lse is not None else q_descale, q_descale, k_descale, v_descale,
            out_scale if out_fp8 else q_descale, cu_seqlens_q, cu_seqlens_q, blocks, out, *ls, *q_descale.stride(),
            *k_descale.stride(), *v_descale.stride(), 0, 1, *row_strides, total_q, hq, hk, batch,
            float(softmax_scale) * _LOG2E)
    _launch(d, True, grid, descs, args,
            (bool(causal), lse is not None, out_fp8, NUM_STAGES, d, MODE_VARLEN, False, d_v), bounded=True, tiles=tiles)
    return out, lse


def empty_block_list(cu_seqlens_q, total_q):
    """An unfilled ``varlen_block_list`` of capacity ``total_q // 128 + batch`` blocks (for a kernel that
    fills it with ``common.fill_varlen_block_list``)."""
    capacity = total_q // BLOCK_M + cu_seqlens_q.numel() - 1
    return torch.empty(ENTRY * (1 + capacity), device=cu_seqlens_q.device, dtype=torch.int32)


def varlen_block_list(cu_seqlens_q, keys, keys_cumulative, total_q, min_len_q=1):
    """The query blocks of a varlen launch of the bounded kernel (MODE >= 2), built on the device (one
    Triton program, no host synchronization): sequence b's ``ceil(len_q / 128)`` blocks, in sequence
    order, for the sequences with at least ``min_len_q`` queries (the others are left to another kernel).

    Parameters
    ----------
    cu_seqlens_q : torch.Tensor
        int32 (batch + 1,) query offsets.
    keys : torch.Tensor
        int32: (batch + 1,) key offsets (``keys_cumulative``, varlen K/V), or (batch,) key counts (a paged
        cache, whose keys start at row 0 of each sequence's pages).
    keys_cumulative : bool
    total_q : int
        The number of queries (sets the list's capacity, ``total_q // 128 + batch``).
    min_len_q : int

    Returns
    -------
    torch.Tensor
        int32 (8 * (1 + capacity),): the block count, then (from slot 8) one entry of 8 slots per block:
        its sequence, query block within the sequence, the sequence's first query row, query count, first
        key row and key count (two slots of padding: an entry is one 32-byte sector, so that the kernel
        reads a block's bounds in one round of independent loads). Entries past the count are not written.
    """
    batch = cu_seqlens_q.numel() - 1
    blocks = empty_block_list(cu_seqlens_q, total_q)
    launch(_block_list_kernel, (1,), cu_seqlens_q, keys, blocks, batch, int(min_len_q), BM=BLOCK_M, BLOCK_B=256,
                             KEYS_CU=bool(keys_cumulative), ENTRY=ENTRY, num_warps=4)
    return blocks


def varlen_schedule(cu_seqlens_q, keys, keys_cumulative, total_q, nheads_q, lse, out, min_len_q=1, blocks=None):
    """What a varlen launch of the bounded kernel (MODE >= 2, dense or paged) passes besides its tensors:
    ``(block_list, lse_strides, out_row_strides, grid)``: the ``varlen_block_list`` (``keys`` and
    ``keys_cumulative`` as there; ``blocks``: one already filled on the stream, from ``empty_block_list``),
    the (0, head, row) strides of an (nheads_q, total_q) LSE (zeros without one), ``out``'s (row, head)
    strides for the masked row stores, and the persistent grid (one CTA per SM, at most one per block of
    the list's capacity)."""
    if blocks is None:
        blocks = varlen_block_list(cu_seqlens_q, keys, keys_cumulative, total_q, min_len_q)
    ls = (0, lse.stride(0), lse.stride(1)) if lse is not None else (0, 0, 0)
    grid = (min((blocks.numel() // ENTRY - 1) * nheads_q, _num_sms(out.device.index)), 1)
    return blocks, ls, (out.stride(0), out.stride(1)), grid


# (device, head dim, kernel, constexprs) -> triton's compiled kernel. The kernels specialize on nothing
# else (``_INT_ARGS`` / ``_PTR_ARGS``; the descriptors' block types follow from head dim and output dtype).
_COMPILED: dict = {}
_CONST_NAMES = ("CAUSAL", "WRITE_LSE", "OUT_FP8", "NUM_STAGES", "HEAD_DIM")
_DIRECT_LAUNCH = HAS_GLUON and SUPPORTED  # (triton 3.6's launcher calling convention)


def _launch(d, ws, grid, descs, args, consts, bounded=False, tiles=None):
    """Launch the head-dim-``d`` kernel (``ws``: the warp-specialized one; ``bounded``: its variant with
    per-sequence bounds, ``_bounded_fwd_tma_ws_kernel``, whose ``tiles`` may differ from ``_tiles(d, ws)``)
    on the current device and stream.

    The first launch per (device, head dim, constexprs) goes through triton's JIT (compile, bind,
    specialize) and keeps the compiled kernel; later launches call it directly with the same argument
    list and lightweight descriptors, a fraction of the host time per launch (and no descriptor
    construction; docs/decisions.md). Triton's own path is used whenever launch
    hooks are installed (profilers) or an integer argument needs 64 bits (a different signature).

    Parameters
    ----------
    descs : four (tensor, shape, strides, block_shape) tuples: the Q, K, V and output TMA views (the
        warp-specialized kernels' fifth, their tile of ones, is added here).
    args : the kernel's remaining run-time arguments in signature order.
    consts : the constexprs in ``_CONST_NAMES`` order: (CAUSAL, WRITE_LSE, OUT_FP8, NUM_STAGES), and HEAD_DIM,
        CONSUMERS and HEAD_DIM_V for the warp-specialized kernel, HEAD_DIM, MODE, V_ROWS and HEAD_DIM_V for the
        bounded one.
    """
    drv = triton.runtime.driver.active  # the device and stream triton's own launch would use
    dev = drv.get_current_device()
    kernel, num_warps = (_bounded_fwd_tma_ws_kernel, 4) if bounded else _kernel_for(d, ws)
    n_ptr = len(_BOUNDED_PTR_ARGS if bounded else _PTR_ARGS)
    tiles = tiles or _tiles(d, ws)
    kperm = kperm_box_on(descs[1][3])  # K's box key-permuted (``kperm_box``)
    k_rows = box_keys(descs[1][3])  # K's box: the tile's keys, or up to one page of them
    if ws:  # the warp-specialized kernels' tile of ones (row sums)
        descs = (*descs, (_ones(descs[0][0].device), [_ONES_ROWS, BLOCK_N], [BLOCK_N, 1], [_ONES_ROWS, tiles[3]]))
    key = (dev, d, kernel, tiles, k_rows, kperm) + consts
    ck = _COMPILED.get(key)
    if ck is None or hooks_installed() or max(args[n_ptr:-1]) >= 2 ** 31:
        layouts = _layouts(tiles, consts[2], bounded and consts[6], k_rows, kperm) + (_ones_layout(tiles[3]),)
        tds = [TensorDescriptor(t, shape, strides, block, layout)
               for (t, shape, strides, block), layout in zip(descs, layouts)]
        names = _CONST_NAMES + (("MODE", "V_ROWS") if bounded else ("CONSUMERS",)) + ("HEAD_DIM_V",)
        ck = launch(kernel, grid, *tds, *args, **dict(zip(names, consts)), num_warps=num_warps)
        if _DIRECT_LAUNCH and not hasattr(ck, "result"):
            _COMPILED[key] = ck
        return
    ck.run(grid[0], grid[1], 1, drv.get_current_stream(dev), ck.function, ck.packed_metadata,
           None, None, None, *[HostDesc(t, shape, strides) for t, shape, strides, _ in descs], *args, *consts)


# ---------------------------------------------------------------------------------------------
# ahead-of-time compile (inspection without a GPU)
# ---------------------------------------------------------------------------------------------
def _aot_compile(causal, write_lse=True, arch=90, head_dim=128, out_fp8=False, ws=None, mode=None, block_n=None,
                 v_rows=False, box=None, consumers=None, kperm=None, head_dim_v=None):
    """Compile the kernel for ``sm_{arch}`` without a GPU; returns triton's compiled kernel.

    Arguments get the specializations of a launch: none (the jit decorator turns them off).
    ``ws``: the warp-specialized kernel (default: whenever the head dim has it). ``mode``: the kernel
    with per-sequence bounds (``_bounded_fwd_tma_ws_kernel``, ``MODE_*``; head dims 64 and 128),
    ``block_n`` its keys per tile, ``v_rows`` its V in K's layout (``V_ROWS``), ``box`` the rows of its K and
    V boxes when fewer than the tile's keys (16, 32, 64, with ``v_rows``: ``paged_launch.box_rows``).
    ``consumers``: the dense warp-specialized kernel's consumer warpgroups, with ``block_n`` and the ring's
    stages from ``ws_config`` unless given. ``kperm``: its key-permuted K box forced on or off (default: the
    launcher's rule, ``kperm_on``). ``head_dim_v``: V's and O's head dim where it differs (``QK192_V128``, the
    dense warp-specialized kernel).
    """
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bounded = mode is not None
    ws = (head_dim in _WS_HEAD_DIMS or head_dim_v not in (None, head_dim) if ws is None else ws) or bounded
    tiles = _tiles(head_dim, ws, head_dim_v)
    stages = NUM_STAGES
    if ws and not bounded:
        consumers, cfg_bn, stages = ws_config(head_dim, causal, consumers, head_dim_v)
        tiles = (*tiles[:3], cfg_bn)
    if block_n:
        tiles = (*tiles[:3], block_n)
    rows, dh, dv, bn = tiles
    if v_rows:
        tiles = (*tiles[:3], BLOCK_N)  # V_ROWS tiles are 128 keys (``_tile_keys``)
        rows, dh, dv, bn = tiles
    if kperm is None:
        kperm = ws and not bounded and kperm_on(head_dim, consumers, causal, write_lse)
    ql, kl, vl, ol = _layouts(tiles, out_fp8, v_rows, box, kperm)
    kb = box or bn
    k_box = kperm_box(kb, dh) if kperm else [kb, dh]
    kernel, num_warps = (_bounded_fwd_tma_ws_kernel, 4) if bounded else _kernel_for(head_dim, ws)

    def desc(shape, layout, dtype="fp8e4nv"):
        return f"tensordesc<{dtype}[{', '.join(str(x) for x in shape)}],{layout!r}>"

    # in the kernels' parameter order
    ptrs = _BOUNDED_PTR_ARGS if bounded else _PTR_ARGS
    ints = ("stride_lb", "stride_lh", "stride_lm", "stride_qds_b", "stride_qds_h", "stride_kds_b",
            "stride_kds_h", "stride_vds_b", "stride_vds_h") + \
        (("stride_pt", "page_size", "stride_om", "stride_oh", "seqlen_q") if bounded else ("seqlen_q", "seqlen_k")) + \
        ("nheads_q", "nheads_k", "batch")
    sig = {
        "q_desc": desc([rows, dh], ql), "k_desc": desc(k_box, kl),
        "v_desc": desc([kb, dh] if v_rows else [dv, bn], vl),
        "o_desc": desc([rows, dv], ol, "fp8e4nv" if out_fp8 else "bf16"),
        **({"ones_desc": desc([_ONES_ROWS, bn], _ones_layout(bn))} if ws else {}),
        **{n: "*i32" if n in ("PageTable", "SeqlensK", "BlockList") else
           ("*fp8e4nv" if out_fp8 else "*bf16") if n == "Out" else "*fp32" for n in ptrs},
        **{n: "i32" for n in ints},
        "softmax_scale_log2": "fp32",
        "CAUSAL": "constexpr", "WRITE_LSE": "constexpr", "OUT_FP8": "constexpr", "NUM_STAGES": "constexpr",
    }
    consts = {"CAUSAL": bool(causal), "WRITE_LSE": bool(write_lse), "OUT_FP8": bool(out_fp8),
              "NUM_STAGES": stages}
    if ws:
        sig["HEAD_DIM"] = "constexpr"
        consts["HEAD_DIM"] = head_dim
    if ws and not bounded:
        sig["CONSUMERS"] = sig["HEAD_DIM_V"] = "constexpr"
        consts["CONSUMERS"] = consumers
        consts["HEAD_DIM_V"] = head_dim_v or head_dim
    if bounded:
        sig["MODE"] = sig["V_ROWS"] = sig["HEAD_DIM_V"] = "constexpr"
        consts["MODE"] = int(mode)
        consts["V_ROWS"] = bool(v_rows)
        consts["HEAD_DIM_V"] = head_dim_v or head_dim
    # no attributes: a launch specializes no integer or pointer argument (_INT_ARGS, _PTR_ARGS)
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs={})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
