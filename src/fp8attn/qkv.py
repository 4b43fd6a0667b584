"""``quantize_qkv``: 16-bit Q, K, V -> FP8 e4m3 with descales, optionally Hadamard-rotating Q and K.

On CUDA (or under TRITON_INTERPRET=1) it runs the Triton tile kernel of kernels/quantize.py: a pass
that computes the amax of every (batch, head, token block) — and, for per-block granularity,
quantizes in the same pass since a tile is exactly one scale block — and, for per-tensor / per-head
granularity, a second pass that quantizes with the reduced descale. The tiny amax reductions between
the passes are torch ops (no host sync). A pure-torch path computes the same thing elsewhere.

Descale convention (fp8attn.quant): ``descale = max(amax, DESCALE_FLOOR * 448) / 448`` and
``x8 = saturate(x / descale)``.

Non-finite inputs are never replaced silently: where values are checked (CPU tensors, or ``validate=True``)
they raise; elsewhere a NaN or Inf makes the amax of its scale group NaN, hence its descale NaN, so every
attention output that reads the group is NaN (no host sync on the way).
"""
from __future__ import annotations

import functools
import math

import torch

from . import hadamard as _had
from . import ops
from ._checks import check_finite, check_flag, check_same_device, describe
from .capability import has_triton, kernel_for
from .quant import descale_from_amax

__all__ = ["quantize_qkv", "GRANULARITIES", "V_LAYOUTS", "empty_seq_major", "quantize_one", "descale_shape"]

GRANULARITIES = ("per_tensor", "per_head", "per_block")
V_LAYOUTS = ("seq_major", "contiguous")
E4M3_MAX = 448.0


def _validate(q, k, v, granularity, hadamard, block_size, seed, backend, v_layout, validate):
    """Every check of ``quantize_qkv``; returns the token block of the scales."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}. Pass {name} as a tensor.")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"{name}: expected bf16/fp16/fp32, got {t.dtype}. quantize_qkv takes unquantized inputs.")
        if t.dim() not in (3, 4):
            raise ValueError(f"{name}: expected (batch, seqlen, heads, dim) or varlen (total, heads, dim), "
                             f"got shape {tuple(t.shape)}. Reshape {name} to that layout.")
    check_same_device(q=q, k=k, v=v)
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(f"q/k/v: expected the same layout, got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D tensors.")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"q: expected nheads_q divisible by nheads_k = {k.shape[-2]}, got {q.shape[-2]}.")
    check_flag("hadamard", hadamard)
    check_flag("validate", validate)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {describe(granularity)}. "
                         "Pick per_tensor, per_head (FA3's descales) or per_block.")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size: expected an int (tokens per scale block), got {describe(block_size)}. "
                        "Pass a power of two in [16, 256].")
    if granularity == "per_block" and (block_size < 16 or block_size > 256 or block_size & (block_size - 1)):
        raise ValueError(f"block_size: expected a power of two in [16, 256], got {block_size}. Pass 64 or 128.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {describe(seed)}. Pass the rotation's seed as an int.")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend: expected 'auto', 'triton' or 'torch', got {describe(backend)}. "
                         "Pass 'auto' (Triton on CUDA tensors, torch otherwise).")
    if backend == "triton" and not has_triton():
        raise ValueError("backend: expected 'auto' or 'torch' without triton installed, got 'triton'. "
                         "Install triton or pass backend='torch'.")
    if v_layout not in V_LAYOUTS:
        raise ValueError(f"v_layout: expected one of {V_LAYOUTS}, got {describe(v_layout)}. seq_major feeds the FP8 "
                         "kernels without a transpose; contiguous keeps V row-major.")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_finite(name, t, validate)
    return block_size if granularity == "per_block" else 64


def _as4d(x):
    """(batch, seqlen, heads, dim) view; varlen (total, heads, dim) becomes batch 1."""
    return x.unsqueeze(0) if x.dim() == 3 else x


def empty_seq_major(shape, dtype, device):
    """An uninitialized (batch, seqlen, heads, dim) / varlen (total, heads, dim) tensor whose sequence
    dimension is contiguous: memory order (batch, heads, dim, seqlen) / (heads, dim, total). This is the
    K-major layout Hopper's FP8 P @ V reads V in; attention given such a V runs no transpose pass."""
    *lead, s, h, d = (1, *shape) if len(shape) == 3 else shape
    y = torch.empty(*lead, h, d, s, dtype=dtype, device=device).permute(0, 3, 1, 2)
    return y.squeeze(0) if len(shape) == 3 else y


def _reduce(amax_blocks, granularity, nheads_k):
    """(batch, heads, nblocks) block amaxes -> ``(descale, full)``: the descale in ``descale_shape`` (per-tensor
    (1, 1), per-head (b, h_k), per-block (b, h, blk)) and, as a view, the one the tile kernel reads at
    [b, h, blk]."""
    b, h, nb = amax_blocks.shape
    if granularity == "per_tensor":
        d = descale_from_amax(amax_blocks.amax(), E4M3_MAX).reshape(1, 1)
        return d, d.reshape(1, 1, 1).expand(b, h, nb)
    if granularity == "per_head":
        g = h // nheads_k
        a = amax_blocks.amax(dim=2).view(b, nheads_k, g).amax(dim=2)  # (b, h_k)
        d = descale_from_amax(a, E4M3_MAX)
        full = d.repeat_interleave(g, dim=1)[:, :, None].expand(b, h, nb)
        return d, full
    d = descale_from_amax(amax_blocks, E4M3_MAX)
    return d, d


def _torch_path(x, granularity, nheads_k, rotate, seed, block_t, seq_major=False):
    x4 = _as4d(x)
    b, s, h, d = x4.shape
    xf = _had.rotate(x4, seed) if rotate else x4.float()
    nb = max(1, math.ceil(s / block_t))
    # a NaN or Inf makes its group's amax, hence its descale, NaN (visible damage; see the module docstring)
    a = xf.abs()
    a = torch.where(torch.isfinite(a), a, float("nan"))
    a = torch.nn.functional.pad(a, (0, 0, 0, 0, 0, nb * block_t - s))
    amax_blocks = a.view(b, nb, block_t, h, d).amax(dim=(2, 4)).transpose(1, 2)  # (b, h, nb)
    ret, full = _reduce(amax_blocks, granularity, nheads_k)
    idx = torch.arange(s, device=x.device) // block_t
    dtok = full[:, :, idx].transpose(1, 2).unsqueeze(-1)  # (b, s, h, 1)
    y = (xf / dtok).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    y = y.squeeze(0) if x.dim() == 3 else y
    if seq_major:
        y = empty_seq_major(tuple(y.shape), y.dtype, y.device).copy_(y)
    return y, ret


def _triton_path(x, granularity, nheads_k, rotate, seed, block_t, seq_major=False):
    from .kernels.quantize import launch_quant_tile

    x4 = _as4d(x)
    b, s, h, d = x4.shape
    block_d = max(16, 1 << (d - 1).bit_length())
    nb = max(1, -(-s // block_t))
    if seq_major:  # the kernel stores through y's strides: written sequence-major in the same pass
        y = empty_seq_major((b, s, h, d), torch.float8_e4m3fn, x.device)
    else:
        y = torch.empty(b, s, h, d, device=x.device, dtype=torch.float8_e4m3fn)
    if rotate:
        r = torch.zeros(block_d, block_d, device=x.device, dtype=x.dtype)  # ±1: exact in any dtype
        r[:d, :d] = _had.rotation_matrix(d, seed, device=x.device, dtype=x.dtype, normalized=False)
        r_scale = 1.0 / math.sqrt(_had.hadamard_block_size(d))
    else:
        r, r_scale = y, 1.0
    amax = torch.empty(b, h, nb, device=x.device, dtype=torch.float32)
    launch = functools.partial(launch_quant_tile, x4, y, r, r_scale, amax, rotate=rotate, block_t=block_t,
                               block_d=block_d)
    if granularity == "per_block":  # a tile is exactly one scale block: one pass
        ret = torch.empty(b, h, nb, device=x.device, dtype=torch.float32)
        launch(ret, write_amax=False, quant=True, self_scale=True)
    else:  # amax pass, tiny torch reduction (no host sync), quantize pass
        launch(amax, write_amax=True, quant=False, self_scale=False)
        ret, full = _reduce(amax, granularity, nheads_k)
        launch(full, write_amax=False, quant=True, self_scale=False)
    return (y.squeeze(0) if x.dim() == 3 else y), ret


def quantize_one(x, granularity, nheads_k, rotate, seed, block_t, seq_major, use_triton):
    """One input of ``quantize_qkv`` (the body of the ``fp8attn::quantize_fp8`` op): ``(x8, descale)`` with
    the descale in ``descale_shape`` (per_tensor: (1, 1); the caller broadcasts it)."""
    fn = _triton_path if use_triton else _torch_path
    return fn(x, granularity, nheads_k, rotate, seed, block_t, seq_major=seq_major)


def descale_shape(x, granularity, nheads_k, block_t):
    """The descale shape ``quantize_one`` returns for x (batch, seqlen, heads, dim) / varlen (total, heads,
    dim): per_tensor (1, 1), per_head (batch, nheads_k), per_block (batch, heads, cdiv(seqlen, block_t)) (at
    least one block); varlen counts as batch 1."""
    b, s = (x.shape[0], x.shape[1]) if x.dim() == 4 else (1, x.shape[0])
    if granularity == "per_tensor":
        return (1, 1)
    if granularity == "per_head":
        return (b, nheads_k)
    return (b, x.shape[-2], torch.sym_max(1, (s + block_t - 1) // block_t))


def quantize_qkv(q, k, v, granularity="per_head", hadamard=False, block_size=128, *,
                 seed=_had.DEFAULT_SEED, backend="auto", v_layout="seq_major", validate=False):
    """Quantize 16-bit Q, K, V to FP8 e4m3 with dynamic descales; optionally Hadamard-rotate Q and K.

    Parameters
    ----------
    q : torch.Tensor
        (batch, seqlen_q, nheads_q, headdim) or varlen (total_q, nheads_q, headdim); bf16/fp16/fp32.
    k : torch.Tensor
        (batch, seqlen_k, nheads_k, headdim) or varlen (total_k, nheads_k, headdim).
    v : torch.Tensor
        (batch, seqlen_k, nheads_k, headdim_v) or varlen (total_k, nheads_k, headdim_v).
    granularity : {"per_tensor", "per_head", "per_block"}
        per_tensor: one descale per tensor, returned as a stride-0 (batch, nheads_k) view.
        per_head: float32 (batch, nheads_k) (FA3's convention; Q's amax spans the query heads that
        share a KV head). per_block: q_descale float32 (batch, nheads_q, cdiv(seqlen_q, block_size)),
        k_descale float32 (batch, nheads_k, cdiv(seqlen_k, block_size)); V stays per-head (batch,
        nheads_k). Varlen inputs count as batch 1 (blocks run over the packed token index).
    hadamard : bool
        Rotate Q and K over the head dim by the same seeded random-sign Hadamard matrix before
        quantizing (``Q K^T`` is unchanged; see fp8attn.hadamard). V is not rotated.
    block_size : int
        Tokens per scale block (power of two, 16..256) for per_block.
    seed : int
        Seed of the rotation's signs.
    backend : {"auto", "triton", "torch"}
        auto: Triton on CUDA tensors where the kernels run (a CUDA call that cannot reports a fallback,
        ``fp8attn.capability``), torch otherwise.
    v_layout : {"seq_major", "contiguous"}
        Memory order of ``v8`` (its shape is v's either way). seq_major (default): the sequence
        dimension is contiguous, memory order (batch, nheads_k, headdim_v, seqlen_k) / varlen
        (nheads_k, headdim_v, total_k) -- the K-major operand Hopper's FP8 P @ V needs, written in the
        same pass, so flash_attn_func / flash_attn_varlen_func skip their V transpose pass (a full read
        and write of V; H200, 16k tokens x 16 heads x d128: 23.6 us, 14% of an S512 forward). Use
        ``.reshape`` rather than ``.view`` on it. contiguous: row-major like the input.
    validate : bool
        Also check GPU inputs for NaN / Inf (a host sync). CPU inputs are always checked. A non-finite value
        raises ValueError naming the tensor and the count; unchecked (a GPU call without validate), it makes
        the descale of its scale group NaN (the group: the tensor for per_tensor, the (batch, KV head) for
        per_head, the (batch, head, token block) for per_block), so attention over it gives NaN, never a
        silently replaced value.

    Returns
    -------
    (q8, k8, v8, q_descale, k_descale, v_descale)
        FP8 e4m3fn tensors of the inputs' shapes (q8, k8 contiguous; v8 as ``v_layout``) and float32
        descales as above. With per_block, pass ``descale_block_size=block_size`` to flash_attn_func /
        flash_attn_varlen_func.
    """
    bt = _validate(q, k, v, granularity, hadamard, block_size, seed, backend, v_layout, validate)
    hk = k.shape[-2]
    # auto: the Triton kernel on a CUDA device that can run it; a CUDA call that cannot reports the fallback
    use_triton = backend == "triton" or (backend == "auto" and kernel_for(q, "quantize") is not None)
    op = ops.OPS["quantize_fp8"]  # one op per input: opaque to torch.compile, with an exact fake
    q8, qd = op(q, granularity, hk, bool(hadamard), int(seed), bt, False, use_triton)
    k8, kd = op(k, granularity, hk, bool(hadamard), int(seed), bt, False, use_triton)
    vg = "per_head" if granularity == "per_block" else granularity
    v8, vd = op(v, vg, hk, False, int(seed), 64, v_layout == "seq_major", use_triton)
    if granularity == "per_tensor":  # one descale, as a stride-0 (batch, nheads_k) view
        b = q.shape[0] if q.dim() == 4 else 1
        qd, kd, vd = (d.expand(b, hk) for d in (qd, kd, vd))
    return q8, k8, v8, qd, kd, vd
