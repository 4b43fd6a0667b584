"""Launchers of the Hopper backward kernels (``backward._bwd_tma_kernel``, ``backward._bwd_tma_fp8_kernel``):
which calls they take, and their launches.

They take the dense calls of ``kernels.backward.launch_attention_bwd`` with ``deterministic=False`` (dQ is added
in an order that varies): in the dequantized mode e4m3 or 16-bit Q/K/V, in the fp8 mode e4m3 ones; head dim 64
or 128 (the same for V), a bf16 or fp16 dO of Q's 16-bit type, contiguous Q and dO (their TMA views), K and V
with the head dim contiguous, a bottom-right causal mask or none, no window or softcap, on an sm90 GPU.
Everything else stays on the Triton kernels.
"""
from __future__ import annotations

import functools

import torch

try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .backward import _bwd_tma_fp8_kernel, _bwd_tma_kernel

    HAS_GLUON = True
except ImportError:  # triton without Gluon: the kernel is simply unavailable
    HAS_GLUON = False

from ..common import cdiv
from ..replay import launch
from .dense_launch import device_reason

__all__ = ["bwd_unsupported_reason", "launch_bwd_tma", "launch_bwd_tma_fp8", "ws_row_len", "dq_acc_rows",
           "transposed_len", "group_chunk", "BLOCK_M", "BLOCK_N", "HEAD_DIMS"]

BLOCK_M = 64  # query rows per tile (a TMA box of Q and of dO)
BLOCK_N = 128  # keys per CTA
HEAD_DIMS = (64, 128)
NUM_STAGES = 2
# CTAs per group chunk of a causal call's grid (group_chunk), per head dim: from a one-process A/B of chunk sizes
# on an H200 (docs/decisions.md)
_CHUNK_CTAS = {64: 256, 128: 128}
_16BIT = (torch.bfloat16, torch.float16)


def bwd_unsupported_reason(do, q, k, v, dq, dk, dv, *, varlen, mode, deterministic, window, softcap, capability=None):
    """Why the Hopper backward kernel cannot take a call, or None when it can (``capability``: check only
    it instead of the tensors' device)."""
    if not HAS_GLUON:
        return "this triton has no Gluon"
    if varlen:
        return "varlen inputs"
    if mode not in ("dequantized", "fp8"):
        return f"mode {mode!r}"
    if mode == "fp8" and q.dtype != torch.float8_e4m3fn:
        return "the fp8 mode with 16-bit q, k, v (its e4m3 products need e4m3 operands)"
    if deterministic:
        return "deterministic=True (the kernel adds dQ in an order that varies)"
    if window or softcap:
        return "sliding window or softcap"
    if q.numel() == 0 or k.numel() == 0:
        return "no query or key rows (a TMA view needs at least one)"
    d = q.shape[-1]
    if d not in HEAD_DIMS or v.shape[-1] != d:
        return f"head dims ({d}, {v.shape[-1]}): expected equal ones in {HEAD_DIMS}"
    if do.dtype not in _16BIT:
        return f"dO dtype {do.dtype}"
    if q.dtype != torch.float8_e4m3fn and q.dtype != do.dtype:
        return f"16-bit q ({q.dtype}) and dO ({do.dtype}) differ"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q, k, v dtypes differ"
    if not (q.is_contiguous() and do.is_contiguous()):
        return "q and dO must be contiguous (TMA views)"
    if any(t.stride(-1) != 1 for t in (k, dk, dv)):
        return "k, dk and dv need the head dim contiguous"
    if v.stride(-1) != 1 and v.stride(1) != 1:
        return "v needs the head dim or the sequence contiguous"
    if 2 * q.numel() // d >= 2 ** 31:
        return "more than 2**30 query rows (the kernel's row indices are 32-bit)"
    if q.data_ptr() % 16 or do.data_ptr() % 16:
        return "q and dO must be 16-byte aligned"
    return device_reason((q, k, v, do), capability=capability)


def ws_row_len(seqlen_q):
    """Row length of the preprocess workspace for this kernel: seqlen_q rounded up to 4 floats, so that every
    TMA box of a head's Delta / LSE starts 16-byte aligned (the entries past seqlen_q are never used)."""
    return (seqlen_q + 3) // 4 * 4


def transposed_len(seqlen_q):
    """Row length of the fp8 mode's transposed e4m3 copies of Q and dO: seqlen_q rounded up to 16 bytes (a TMA
    view's row stride)."""
    return (seqlen_q + 15) // 16 * 16


def dq_acc_rows(seqlen_q):
    """Rows per batch of the kernel's fp32 dQ accumulator: seqlen_q rounded up to a query tile, so that a tile's
    TMA reduction never reaches the next batch's rows."""
    return (seqlen_q + BLOCK_M - 1) // BLOCK_M * BLOCK_M


@functools.lru_cache(maxsize=None)
def _box_layout(dtype, d):
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, d], dtype)


_GL_DTYPE = {}
if HAS_GLUON:
    _GL_DTYPE = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
    _W_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    # the fp32 dQ tile: 128-byte swizzled column blocks, one TMA box each (the reduction is split among warps)
    _DQ_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)


def _desc(t, layout=None):
    """The (batch * seqlen, nheads * d) TMA view of a contiguous (batch, seqlen, nheads, d) tensor."""
    b, s, h, d = t.shape
    layout = layout or _box_layout(_GL_DTYPE[t.dtype], d)
    return TensorDescriptor(t, [b * s, h * d], [h * d, 1], [BLOCK_M, d], layout)


def launch_bwd_tma(do, q, k, v, ws, dq_acc, dk, dv, *, q_descale, k_descale, v_descale,
                   softmax_scale, causal):
    """dK, dV (written) and dQ (added to ``dq_acc``) of one dense call. Call only where
    ``bwd_unsupported_reason`` is None.

    Parameters
    ----------
    do : torch.Tensor
        (batch, seqlen_q, nheads_q, d), bf16 or fp16, contiguous.
    q : torch.Tensor
        (batch, seqlen_q, nheads_q, d), float8_e4m3fn or dO's dtype, contiguous.
    k, v : torch.Tensor
        (batch, seqlen_k, nheads_k, d), q's dtype, head dim contiguous.
    ws : torch.Tensor
        float32 (2, batch * nheads_q * ws_row_len(seqlen_q)), contiguous: ``kernels.backward``'s preprocess
        output (Delta, then the log2-domain LSE, (batch, head) rows of ``ws_row_len(seqlen_q)``).
    dq_acc : torch.Tensor
        float32 (batch, dq_acc_rows(seqlen_q), nheads_q, d), zeroed, contiguous: dQ is added into its first
        seqlen_q rows of each batch (the others take what the padded query rows add).
    dk, dv : torch.Tensor
        Shapes of k, v (head dim contiguous); any float dtype. Summed over each group's query heads.
    q_descale, k_descale, v_descale : torch.Tensor or None
        float32 (batch, nheads_k) for e4m3 inputs (broadcast views allowed); None for 16-bit.
    softmax_scale : float
    causal : bool
    """
    batch, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    is_fp8 = q.dtype == torch.float8_e4m3fn
    descs = (q_descale, k_descale, v_descale) if is_fp8 else (ws, ws, ws)
    w_desc = TensorDescriptor(ws, [ws.numel()], [1], [BLOCK_M], _W_LAYOUT)
    ds_strides = (*q_descale.stride(), *k_descale.stride(), *v_descale.stride()) if is_fp8 else (0,) * 6
    grid, chunk = _grid(sk, batch, hk, d, causal)
    launch(_bwd_tma_kernel, grid,
        _desc(q), _desc(do), w_desc, _desc(dq_acc, _DQ_LAYOUT), k, v, dk, dv, *descs,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        *ds_strides, ws.stride(0), ws_row_len(sq), dq_acc.shape[1],
        sq, sk, hq, hk, chunk, float(softmax_scale),
        CAUSAL=bool(causal), HEAD_DIM=d, IS_FP8=is_fp8, V_SEQ_MAJOR=v.stride(-1) != 1, NUM_STAGES=NUM_STAGES,
        num_warps=8)


def launch_bwd_tma_fp8(do8, dot8, qt8, do_scales, q, k, v, ws, dq_acc, dk, dv, *, q_descale, k_descale,
                       v_descale, softmax_scale, causal):
    """``launch_bwd_tma`` in the FP8-matmul mode (``backward._bwd_tma_fp8_kernel``), e4m3 q, k, v only.

    Parameters
    ----------
    do8 : torch.Tensor
        float8_e4m3fn (batch, seqlen_q, nheads_q, d), contiguous: dO divided by ``do_scales`` per query tile.
    dot8, qt8 : torch.Tensor
        float8_e4m3fn (batch, nheads_q, d, transposed_len(seqlen_q)), contiguous: the transposes of do8 and q,
        zeros from seqlen_q on.
    do_scales : torch.Tensor
        float32 (batch, nheads_q, cdiv(seqlen_q, BLOCK_M)), contiguous: each tile's dO scale.
    q, k, v, ws, dq_acc, dk, dv, q_descale, k_descale, v_descale, softmax_scale, causal
        As ``launch_bwd_tma`` (q e4m3; the descales required).
    """
    batch, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    st = dot8.shape[-1]
    w_desc = TensorDescriptor(ws, [ws.numel()], [1], [BLOCK_M], _W_LAYOUT)
    t_layout = _t_layout(d)
    qt_desc = TensorDescriptor(qt8, [batch * hq * d, st], [st, 1], [d, BLOCK_M], t_layout)
    dot_desc = TensorDescriptor(dot8, [batch * hq * d, st], [st, 1], [d, BLOCK_M], t_layout)
    launch(_bwd_tma_fp8_kernel, (cdiv(sk, BLOCK_N), batch, hk),
        _desc(q), qt_desc, _desc(do8), dot_desc, w_desc, _desc(dq_acc, _DQ_LAYOUT), k, v, dk, dv,
        q_descale, k_descale, v_descale, do_scales,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        *q_descale.stride(), *k_descale.stride(), *v_descale.stride(), ws.stride(0), ws_row_len(sq),
        dq_acc.shape[1], sq, sk, hq, hk, float(softmax_scale),
        CAUSAL=bool(causal), HEAD_DIM=d, V_SEQ_MAJOR=v.stride(-1) != 1, NUM_STAGES=NUM_STAGES, num_warps=8)


def group_chunk(n_blocks, groups, head_dim):
    """How many (batch, kv head) groups the dequantized kernel's causal grid takes at a time
    (``backward._cta_coords``; without a mask every CTA has the same work and ``_grid`` keeps the plain grid, the
    groups one after the other). Under a causal mask key block i sees the query tiles from its diagonal on, so
    the CTAs of block 0 are the heaviest; taken one group at a time, the grid ends with the last group's heavy
    blocks whenever it is a few waves long. A chunk starts the heavy blocks of several groups early and leaves
    light ones for the end: the largest power of two dividing ``groups`` whose chunk holds at most
    ``_CHUNK_CTAS[head_dim]`` CTAs (larger chunks were slower at d128 S16k). The FP8-matmul kernel keeps the
    plain grid: the computed coordinates cost it registers (docs/decisions.md)."""
    chunk = 1
    while groups % (2 * chunk) == 0 and 2 * chunk * n_blocks <= _CHUNK_CTAS[head_dim]:
        chunk *= 2
    return chunk


def _grid(sk, batch, hk, head_dim, causal):
    """The dequantized kernel's grid and group chunk (``backward._cta_coords``: 1-D under a causal mask)."""
    n_blocks = cdiv(sk, BLOCK_N)
    if not causal:
        return (n_blocks, batch, hk), 1
    return (n_blocks * batch * hk,), group_chunk(n_blocks, batch * hk, head_dim)


@functools.lru_cache(maxsize=None)
def _t_layout(d):
    return gl.NVMMASharedLayout.get_default_for([d, BLOCK_M], gl.float8e4nv)


def _aot_compile(causal=False, head_dim=128, fp8=True, arch=90, stages=NUM_STAGES, v_seq_major=True,
                 mode="dequantized"):
    """Compile the kernel of ``mode`` (the fp8 one takes e4m3 inputs only) for ``sm_{arch}`` without a GPU
    (inspection: registers, spills, SASS)."""
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fp8 = fp8 or mode == "fp8"
    kernel = _bwd_tma_fp8_kernel if mode == "fp8" else _bwd_tma_kernel
    in_t = "fp8e4nv" if fp8 else "bf16"
    in_gl = gl.float8e4nv if fp8 else gl.bfloat16
    do_t, do_gl = ("fp8e4nv", gl.float8e4nv) if mode == "fp8" else ("bf16", gl.bfloat16)

    def desc(dtype, layout, shape=(BLOCK_M, head_dim)):
        return f"tensordesc<{dtype}[{shape[0]}, {shape[1]}],{layout!r}>"

    descs = {"q_desc": desc(in_t, _box_layout(in_gl, head_dim)), "do_desc": desc(do_t, _box_layout(do_gl, head_dim)),
             "w_desc": f"tensordesc<fp32[{BLOCK_M}],{_W_LAYOUT!r}>", "dq_desc": desc("fp32", _DQ_LAYOUT)}
    if mode == "fp8":
        descs["qt_desc"] = descs["dot_desc"] = desc("fp8e4nv", _t_layout(head_dim), (head_dim, BLOCK_M))

    ptrs = {"K": f"*{in_t}", "V": f"*{in_t}", "DK": "*bf16", "DV": "*bf16", "QDs": "*fp32", "KDs": "*fp32",
            "VDs": "*fp32", "DOs": "*fp32", "softmax_scale": "fp32"}
    # the kernel's parameters in order: its descriptors, pointers and scale as above, constexprs, the rest int32
    sig = {p.name: descs.get(p.name) or ptrs.get(p.name) or ("constexpr" if p.is_constexpr else "i32")
           for p in kernel.params}
    consts = {"CAUSAL": bool(causal), "HEAD_DIM": head_dim, "IS_FP8": bool(fp8), "V_SEQ_MAJOR": bool(v_seq_major),
              "NUM_STAGES": stages}
    consts = {n: c for n, c in consts.items() if n in sig}
    # a launch's specialization of contiguous inputs: pointers and strides divisible by 16
    names = list(sig)
    divisible = ("stride_kn", "stride_vd", "stride_dkn", "stride_dvn", "stride_kb", "stride_vb", "stride_dkb",
                 "stride_dvb", "ws_lse_off", "ws_row", "dq_row")
    attrs = {(names.index(n),): BaseBackend.parse_attr("D") for n in names if sig[n].startswith("*") or n in divisible}
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
