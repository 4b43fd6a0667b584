"""Triton kernel behind ``fp8attn.quantize_qkv`` (see fp8attn/qkv.py for the orchestration).

The unit of work is a tile: ``BLOCK_T`` tokens of one (batch, head), optionally Hadamard-rotated. A scale
group is the tiles one descale covers: the whole tensor (per_tensor), one (batch, KV head) with its query
heads (per_head), or the tile itself (per_block). ``launch_quantize`` quantizes one input in at most two
launches with nothing between them:

* per_block: one launch; each tile quantizes with its own descale.
* a group of at most ``SINGLE_MAX_TILES`` tiles: one launch, one program per group, which reads its tiles
  twice (the amax, then the quantization).
* otherwise: pass 1 writes each tile's amax (a partial); pass 2 programs each reduce the partials of their
  group (the few of one (batch, KV head), or all of them per tensor), quantize ``TPP`` tiles, and the
  group's first program stores the descale. Pass 2 runs in the reverse of pass 1's order (its first tiles
  are still in L2).

Descale convention (fp8attn.quant): ``descale = max(amax, DESCALE_FLOOR * 448) / 448`` (an IEEE division,
as ``quant.descale_from_amax``) and ``x8 = saturate(x / descale)``. A NaN or Inf in a group makes its
amax, hence its descale and every value quantized with it, NaN: visible damage, never a value replaced
silently.
"""
from __future__ import annotations

import torch

from .planning import DESCALE_FLOOR
from .replay import launch

try:  # the package must import on machines without triton
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["launch_quantize", "launch_quantize_qkv", "qkv_single_ok", "launch_quant_static", "HAS_TRITON",
           "SINGLE_MAX_TILES"]

E4M3_MAX = 448.0
# Largest group one program quantizes alone (one launch): its tiles are read twice by one SM, which stays
# cheap for groups this small and saves the second launch.
SINGLE_MAX_TILES = 8
# Partials a pass-2 program may read per tile it quantizes (4 bytes each against a tile's 8-32 KiB).
_PARTIALS_PER_TILE = 512

MODE_PARTIAL, MODE_QUANT, MODE_SINGLE, MODE_BLOCK = 0, 1, 2, 3


if HAS_TRITON:
    from .common import cdiv, next_pow2  # (also applies the interpreter fixes under TRITON_INTERPRET=1, once)

    @triton.jit
    def _load_tile(X, R, b, h, blk, seqlen, head_dim, r_scale, stride_xb, stride_xs, stride_xh, stride_xd,
                   ROTATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """The fp32 tile (BLOCK_T tokens of (b, h), rotated by R when ROTATE; 0 outside the tensor)."""
        offs_t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, BLOCK_D)
        m = (offs_t < seqlen)[:, None] & (offs_d < head_dim)[None, :]
        t64 = offs_t.to(tl.int64)
        x = tl.load(X + b * stride_xb + t64[:, None] * stride_xs + h * stride_xh + offs_d[None, :] * stride_xd,
                    mask=m, other=0.0)
        if ROTATE:
            r = tl.load(R + offs_d[:, None] * BLOCK_D + offs_d[None, :])
            xf = tl.dot(x, r, input_precision="ieee") * r_scale
        else:
            xf = x.to(tl.float32)
        return tl.where(m, xf, 0.0)

    @triton.jit
    def _store_tile(Y, xf, ds, b, h, blk, seqlen, head_dim, stride_yb, stride_ys, stride_yh, stride_yd,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        offs_t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, BLOCK_D)
        m = (offs_t < seqlen)[:, None] & (offs_d < head_dim)[None, :]
        t64 = offs_t.to(tl.int64)
        y = xf / ds
        y = tl.minimum(tl.maximum(y, -E4M3_MAX_C), E4M3_MAX_C)
        tl.store(Y + b * stride_yb + t64[:, None] * stride_ys + h * stride_yh + offs_d[None, :] * stride_yd,
                 y.to(tl.float8e4nv), mask=m)

    @triton.jit
    def _tile_amax(xf):
        """max |x| over the tile, NaN if it holds a NaN or Inf (|x| < inf is False for NaN and +-Inf; no
        max-with-NaN semantics are relied on)."""
        fin = tl.abs(xf) < float("inf")
        n_bad = tl.sum(tl.sum(tl.where(fin, 0, 1), 1), 0)
        amax = tl.max(tl.max(tl.abs(tl.where(fin, xf, 0.0)), 1), 0)
        return tl.where(n_bad > 0, float("nan"), amax)

    @triton.jit
    def _descale(amax):
        """``quant.descale_from_amax`` bit for bit (IEEE division: Triton's ``/`` is approximate); NaN stays."""
        ds = tl.math.div_rn(tl.maximum(amax, DESCALE_FLOOR_C * E4M3_MAX_C), E4M3_MAX_C)
        return tl.where(amax != amax, amax, ds)

    @triton.jit
    def _single_group(X, Y, R, DS, group, batch, seqlen, nheads, head_dim, nblocks, group_heads, r_scale,
                      stride_xb, stride_xs, stride_xh, stride_xd, stride_yb, stride_ys, stride_yh, stride_yd,
                      stride_db, stride_dh,
                      PER_TENSOR: tl.constexpr, ROTATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """Scale group ``group`` in one program: reads its tiles twice (the amax, then the quantization)."""
        if PER_TENSOR:
            first = tl.zeros((), tl.int64)
            count = batch * nheads * nblocks
        else:
            first = group.to(tl.int64) * group_heads * nblocks
            count = group_heads * nblocks
        amax = tl.zeros((), tl.float32)
        bad = tl.zeros((), tl.int32)
        # pass 1 (it < count) takes the amax of each tile, pass 2 quantizes them; one loop, so that the tile
        # load (and its rotation's shared-memory buffers) exists once in the kernel
        for it in range(0, 2 * count):
            quant = it >= count
            f = first + it - count * quant.to(tl.int64)
            b = f // (nheads * nblocks)
            h = (f // nblocks) % nheads
            blk = f % nblocks
            xf = _load_tile(X, R, b, h, blk, seqlen, head_dim, r_scale, stride_xb, stride_xs, stride_xh,
                            stride_xd, ROTATE, BLOCK_T, BLOCK_D)
            a = _tile_amax(xf)
            bad += ((a != a) & (it < count)).to(tl.int32)
            amax = tl.where(quant, amax, tl.maximum(amax, tl.where(a != a, 0.0, a)))
            ds = _descale(tl.where(bad > 0, float("nan"), amax))
            if quant:
                if it == count:
                    tl.store(DS + b * stride_db + (h // group_heads) * stride_dh, ds)
                _store_tile(Y, xf, ds, b, h, blk, seqlen, head_dim, stride_yb, stride_ys, stride_yh, stride_yd,
                            BLOCK_T, BLOCK_D)

    @triton.jit
    def _quantize_kernel(X, Y, R, P, DS,
                         batch, seqlen, nheads, head_dim, nblocks, group_heads, r_scale,
                         stride_xb, stride_xs, stride_xh, stride_xd,
                         stride_yb, stride_ys, stride_yh, stride_yd,
                         stride_db, stride_dh, stride_dn,
                         MODE: tl.constexpr, PER_TENSOR: tl.constexpr, TPP: tl.constexpr, BLOCK_P: tl.constexpr,
                         ROTATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """See the module docstring. Tiles are numbered ``(b * nheads + h) * nblocks + blk`` (P's layout); a
        group is a run of ``group_tiles`` consecutive tiles from ``first``: per head, the ``group_heads`` heads
        of one KV head; per tensor, all of them."""
        if MODE == 2:  # one program per group
            _single_group(X, Y, R, DS, tl.program_id(0), batch, seqlen, nheads, head_dim, nblocks, group_heads,
                          r_scale, stride_xb, stride_xs, stride_xh, stride_xd, stride_yb, stride_ys, stride_yh,
                          stride_yd, stride_db, stride_dh, PER_TENSOR, ROTATE, BLOCK_T, BLOCK_D)
        else:
            blk0 = tl.program_id(0)
            b = tl.program_id(1).to(tl.int64)
            h = tl.program_id(2).to(tl.int64)
            if MODE == 1:  # reduce the group's partials, then quantize TPP tiles
                # in the reverse of pass 1's launch order: the first programs read the tiles pass 1 read last,
                # still in L2 (a tensor larger than L2 re-read in the same order misses on every tile)
                blk0 = tl.num_programs(0) - 1 - blk0
                b = batch - 1 - b
                h = nheads - 1 - h
                if PER_TENSOR:
                    first = tl.zeros((), tl.int64)
                    count = batch * nheads * nblocks
                else:
                    first = (b * nheads + (h // group_heads) * group_heads) * nblocks
                    count = group_heads * nblocks
                acc = tl.zeros((BLOCK_P,), tl.float32)
                bad = tl.zeros((BLOCK_P,), tl.int32)
                for p0 in range(0, count, BLOCK_P):
                    offs = p0 + tl.arange(0, BLOCK_P)
                    p = tl.load(P + first + offs, mask=offs < count, other=0.0)
                    bad += (p != p).to(tl.int32)
                    acc = tl.maximum(acc, tl.where(p != p, 0.0, p))
                amax = tl.where(tl.sum(bad, 0) > 0, float("nan"), tl.max(acc, 0))
                ds = _descale(amax)
                if PER_TENSOR:
                    lead = (blk0 == 0) & (b == 0) & (h == 0)
                else:
                    lead = (blk0 == 0) & (h % group_heads == 0)
                if lead:
                    tl.store(DS + b * stride_db + (h // group_heads) * stride_dh, ds)
                for j in range(TPP):
                    blk = blk0 * TPP + j  # (past the last block every token is masked)
                    xf = _load_tile(X, R, b, h, blk, seqlen, head_dim, r_scale, stride_xb, stride_xs, stride_xh,
                                    stride_xd, ROTATE, BLOCK_T, BLOCK_D)
                    _store_tile(Y, xf, ds, b, h, blk, seqlen, head_dim, stride_yb, stride_ys, stride_yh,
                                stride_yd, BLOCK_T, BLOCK_D)
            else:
                xf = _load_tile(X, R, b, h, blk0, seqlen, head_dim, r_scale, stride_xb, stride_xs, stride_xh,
                                stride_xd, ROTATE, BLOCK_T, BLOCK_D)
                amax = _tile_amax(xf)
                if MODE == 0:
                    tl.store(P + (b * nheads + h) * nblocks + blk0, amax)
                else:  # per block: the tile is its own group
                    ds = _descale(amax)
                    tl.store(DS + b * stride_db + h * stride_dh + blk0 * stride_dn, ds)
                    _store_tile(Y, xf, ds, b, h, blk0, seqlen, head_dim, stride_yb, stride_ys, stride_yh,
                                stride_yd, BLOCK_T, BLOCK_D)

    @triton.jit
    def _quantize_qkv_single_kernel(
            XQ, YQ, DSQ, XK, YK, DSK, XV, YV, DSV, R, r_scale, batch, head_dim, head_dim_v,
            seqlen_q, nheads_q, nblocks_q, group_heads_q, seqlen_k, nheads_k, nblocks_k,
            stride_qb, stride_qs, stride_qh, stride_qd, stride_q8b, stride_q8s, stride_q8h, stride_q8d,
            stride_qdb, stride_qdh,
            stride_kb, stride_ks, stride_kh, stride_kd, stride_k8b, stride_k8s, stride_k8h, stride_k8d,
            stride_kdb, stride_kdh,
            stride_vb, stride_vs, stride_vh, stride_vd, stride_v8b, stride_v8s, stride_v8h, stride_v8d,
            stride_vdb, stride_vdh,
            PER_TENSOR: tl.constexpr, ROTATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_DV: tl.constexpr):
        """Q, K and V of ``quantize_qkv`` in one launch: program (group, i) quantizes scale group ``group`` of
        input i (0: Q, 1: K, 2: V) as ``_quantize_kernel``'s one-program-per-group mode does. The arguments are
        flat: a tuple argument would lose its constexpr elements behind the run-time branch (triton 3.6)."""
        group = tl.program_id(0)
        which = tl.program_id(1)
        if which == 0:
            _single_group(XQ, YQ, R, DSQ, group, batch, seqlen_q, nheads_q, head_dim, nblocks_q, group_heads_q,
                          r_scale, stride_qb, stride_qs, stride_qh, stride_qd, stride_q8b, stride_q8s, stride_q8h,
                          stride_q8d, stride_qdb, stride_qdh, PER_TENSOR, ROTATE, BLOCK_T, BLOCK_D)
        elif which == 1:
            _single_group(XK, YK, R, DSK, group, batch, seqlen_k, nheads_k, head_dim, nblocks_k, 1,
                          r_scale, stride_kb, stride_ks, stride_kh, stride_kd, stride_k8b, stride_k8s, stride_k8h,
                          stride_k8d, stride_kdb, stride_kdh, PER_TENSOR, ROTATE, BLOCK_T, BLOCK_D)
        else:
            _single_group(XV, YV, R, DSV, group, batch, seqlen_k, nheads_k, head_dim_v, nblocks_k, 1,
                          1.0, stride_vb, stride_vs, stride_vh, stride_vd, stride_v8b, stride_v8s, stride_v8h,
                          stride_v8d, stride_vdb, stride_vdh, PER_TENSOR, False, BLOCK_T, BLOCK_DV)

    DESCALE_FLOOR_C = tl.constexpr(DESCALE_FLOOR)
    E4M3_MAX_C = tl.constexpr(E4M3_MAX)


def _group_tiles(granularity, b, h, nheads_k, nb):
    """Tiles of one scale group."""
    return b * h * nb if granularity == "per_tensor" else (h // nheads_k) * nb


def _one_program_per_group(granularity, b, s, h, nheads_k, block_t):
    """Whether a (b, s, h, d) input's scale groups are small enough (at most ``SINGLE_MAX_TILES`` tiles) for one
    program each to quantize alone."""
    return _group_tiles(granularity, b, h, nheads_k, max(1, cdiv(s, block_t))) <= SINGLE_MAX_TILES


def launch_quantize(x4, y, r, r_scale, ds, *, granularity, nheads_k, rotate, block_t, block_d, single=None):
    """Quantize x4 (batch, seqlen, heads, dim) into y with dynamic descales written to ds.

    Parameters
    ----------
    x4 : (batch, seqlen, heads, dim) bf16/fp16/fp32 input (any strides). y : same shape, float8_e4m3fn output
        (any strides: a sequence-major y is written in the same pass).
    r : (block_d, block_d) +-1 rotation (x4's dtype) when rotate, else any tensor; r_scale its norm.
    ds : float32 descales, written: per_tensor (1, 1), per_head (batch, nheads_k), per_block (batch, heads,
        cdiv(seqlen, block_t)).
    granularity : "per_tensor", "per_head" or "per_block". nheads_k : KV heads (heads // nheads_k query heads
        share a per-head descale). block_t : tokens per tile (the per_block scale block). block_d : the head dim
        padded to a power of two >= 16.
    single : force (True) or forbid (False) the one-launch form; None picks it for groups of at most
        ``SINGLE_MAX_TILES`` tiles.
    """
    b, s, h, d = x4.shape
    nb = max(1, cdiv(s, block_t))
    common = (b, s, h, d, nb, h // nheads_k if granularity == "per_head" else 1, r_scale, *x4.stride(), *y.stride())
    # (num_stages=1 where a program loops over tiles: a pipelined loop would multiply the rotation's shared
    # memory past the 227 KiB of an sm90 block at head dim 256)
    meta = dict(PER_TENSOR=granularity == "per_tensor", ROTATE=rotate, BLOCK_T=block_t, BLOCK_D=block_d,
                num_warps=4)
    dstr = tuple(ds.stride()) + (0,) * (3 - ds.dim())
    if b * h == 0:  # no tile: every descale is the floor's
        ds.fill_(DESCALE_FLOOR)
        return
    if granularity == "per_block":
        launch(_quantize_kernel, (nb, b, h), x4, y, r, ds, ds, *common, *dstr, MODE=MODE_BLOCK, TPP=1, BLOCK_P=16, **meta)
        return
    tiles = _group_tiles(granularity, b, h, nheads_k, nb)
    if single if single is not None else _one_program_per_group(granularity, b, s, h, nheads_k, block_t):
        groups = 1 if granularity == "per_tensor" else b * nheads_k
        launch(_quantize_kernel, (groups,), x4, y, r, ds, ds, *common, *dstr, MODE=MODE_SINGLE, TPP=1, BLOCK_P=16,
                                    num_stages=1, **meta)
        return
    partials = torch.empty(b * h * nb, device=x4.device, dtype=torch.float32)
    launch(_quantize_kernel, (nb, b, h), x4, y, r, partials, ds, *common, *dstr, MODE=MODE_PARTIAL, TPP=1, BLOCK_P=16, **meta)
    tpp = min(next_pow2(cdiv(tiles, _PARTIALS_PER_TILE)), next_pow2(nb))
    launch(_quantize_kernel, (cdiv(nb, tpp), b, h), x4, y, r, partials, ds, *common, *dstr, MODE=MODE_QUANT, TPP=tpp,
                                            BLOCK_P=min(next_pow2(tiles), 1024), num_stages=1, **meta)


def qkv_single_ok(q4, k4, v4, granularity, nheads_k, block_t) -> bool:
    """Whether ``launch_quantize_qkv`` can take these (batch, seqlen, heads, dim) inputs: per_tensor or
    per_head scales, one dtype, q/k of one head dim, equal batches, and every scale group of at most
    ``SINGLE_MAX_TILES`` tiles (the groups one program quantizes alone)."""
    if granularity not in ("per_tensor", "per_head") or not (q4.dtype == k4.dtype == v4.dtype):
        return False
    b, sq, hq, d = q4.shape
    if k4.shape[0] != b or v4.shape[0] != b or k4.shape[-1] != d or b * hq == 0 or b * k4.shape[2] == 0:
        return False
    return all(_one_program_per_group(granularity, b, x.shape[1], x.shape[2], nheads_k, block_t) for x in (q4, k4, v4))


def launch_quantize_qkv(xs, ys, dss, r, r_scale, *, granularity, nheads_k, rotate, block_t, block_d, block_dv):
    """Quantize Q, K and V in one launch (inputs ``qkv_single_ok`` accepts): what three ``launch_quantize``
    calls in their one-launch form write, bit for bit.

    xs, ys : (q, k, v) (batch, seqlen, heads, dim) inputs and their float8_e4m3fn outputs (any strides).
    dss : float32 descales, written: per_tensor (1, 1) each, per_head (batch, nheads_k) each.
    r, r_scale : the rotation of Q and K when ``rotate`` (V is not rotated), as for ``launch_quantize``.
    block_dv : V's head dim padded to a power of two >= 16.
    """
    (q4, k4, v4), (q8, k8, v8), (qd, kd, vd) = xs, ys, dss
    b, sq, hq, d = q4.shape
    sk, hk = k4.shape[1], k4.shape[2]
    groups = 1 if granularity == "per_tensor" else b * nheads_k
    launch(_quantize_qkv_single_kernel, (groups, 3), q4, q8, qd, k4, k8, kd, v4, v8, vd, r, r_scale, b, d,
           v4.shape[-1], sq, hq, max(1, cdiv(sq, block_t)), hq // nheads_k if granularity == "per_head" else 1,
           sk, hk, max(1, cdiv(sk, block_t)),
           *q4.stride(), *q8.stride(), *qd.stride(), *k4.stride(), *k8.stride(), *kd.stride(),
           *v4.stride(), *v8.stride(), *vd.stride(),
           PER_TENSOR=granularity == "per_tensor", ROTATE=rotate, BLOCK_T=block_t, BLOCK_D=block_d,
           BLOCK_DV=block_dv, num_warps=4, num_stages=1)


if HAS_TRITON:
    from .common import output_epilogue

    @triton.jit
    def _quant_static_kernel(X, Y, S, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        inv = 1.0 / tl.load(S)
        tl.store(Y + offs, output_epilogue(x, inv, True, tl.float8e4nv), mask=m)


def launch_quant_static(x: torch.Tensor, scale: torch.Tensor, y: torch.Tensor) -> None:
    """Static FP8 quantization ``y = saturate(x / scale)`` in one launch: one read of ``x``, one e4m3 write,
    through ``common.output_epilogue``, the epilogue the attention kernels fuse with ``out_scale=``, so the
    fused and unfused paths round the same way (it is the unfused peer the ``fp8attn.compile`` fusion pass
    removes).

    x : any shape, 16/32-bit; scale : float32, one element; y : float8_e4m3fn, contiguous, x's shape.
    """
    xc = x if x.is_contiguous() else x.contiguous()
    n = xc.numel()
    if n == 0:
        return
    block = 2048
    launch(_quant_static_kernel, (cdiv(n, block),), xc, y, scale, n, BLOCK=block, num_warps=8)
