"""The only module that touches ``torch.library``: every fp8attn op, its fake, and dispatch.

Each op is defined in the ``fp8attn::`` namespace with an explicit schema, ONE implementation
registered to ``CompositeExplicitAutograd`` that picks the Triton launch function (CUDA, sm89+) or
the reference (everything else) at run time, and a fake (``register_fake``) that gives the exact
shape, dtype and strides of every output (LSE included) without touching data. The ops are opaque
to ``torch.compile``: Inductor calls them as extern kernels, never traces into them, and graph
passes (``fp8attn.compile``) can match them by name.

Why ``Library.define`` + one impl and not ``torch.library.custom_op``: the same opaque op with the
same fake, but dispatch stays in C++ up to the Python implementation (no Python autograd wrapper, no
run-time aliasing check), a fraction of custom_op's per-call overhead (docs/compile.md).

Autograd: ``dense_fwd`` is differentiable (``torch.library.register_autograd``; its backward is the
opaque op ``dense_bwd``, so a compiled forward + backward holds both ops and no graph break). The
forward saves only Q/K/V as given (FP8 or 16-bit), the descales, O and the natural-log LSE. The other
ops are not differentiable: their Autograd key is a C++ fallthrough, and the Python entry points below,
when grad mode is on and an input requires grad, return outputs whose backward raises
NotImplementedError -- the forward works (inference without ``torch.no_grad``), a backward through
them fails loudly instead of silently dropping gradients. (Calling ``torch.ops.fp8attn.paged_fwd``
directly gives outputs that do not require grad.) ``QuantizedAttention`` is the autograd of
``fp8attn.attention`` (16-bit leaves, straight-through quantizer).

Eager calls of the attention entry points (``dense_fwd``, ``paged_fwd``, ``combine``), of the cache append
and of ``quantize_fp8`` skip the dispatcher hop and call the op's implementation directly when nothing could
observe the difference
(``_eager_direct``: not traced by torch.compile / jit, no torch-function or dispatch mode, no functorch
transform, plain tensors, and no input that requires grad with grad mode on). That hop costs microseconds per call
(``noop_op_hop_us`` in benchmarks/results/h200/output_quant.json); under
tracing, FakeTensor, export or any mode the op is called, so graphs still hold
``fp8attn::*`` ops and their fakes.

Ops (``torch.ops.fp8attn.<name>.default``):

=====================  =======================================================================
dense_fwd              dense / varlen forward -> (out, lse); lse (0,) if not return_lse
dense_fwd_out          same, writes ``out`` (mutated) -> lse (not differentiable: out= with grad raises)
dense_bwd              attention backward -> (dq, dk, dv) (reference.attention_bwd_ref's semantics)
paged_fwd              paged-cache attention -> (out, lse); lse (0,) if not return_lse
paged_fwd_out          same, writes ``out`` (mutated; the split workspace too, when given) -> lse
combine                split-KV merge -> (out, lse)
combine_out            same, writes ``out`` (mutated) -> lse
write_kv_cache         scatter/quantize new tokens into the caches (mutated) -> ()
append_kv_cache        append new tokens after the cached ones (caches mutated) -> lengths after the append
quant_fp8_static       static per-tensor FP8 quant: clamp(x * (1/scale), -448, 448) -> e4m3fn
quantize_fp8           dynamic FP8 quant of one of quantize_qkv's inputs -> (x8, descale), optionally rotated
scaled_bmm             batched FP8 matmul with per-batch / per-row / per-column scales
=====================  =======================================================================

The Python functions below (``dense_fwd``, ``paged_fwd``, ``combine``, ``write_kv_cache``,
``append_kv_cache``, ``quantize_fp8``, ``quant_fp8_static``, ``scaled_bmm``) keep the signatures
``interface`` calls and route ``out=`` to the ``*_out`` ops. Registration is idempotent: re-importing or reloading this module reuses ops that
already exist instead of registering a kernel twice (which would emit "Overriding a previously
registered kernel").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import reference as ref
from ._checks import check_same_device
from .capability import kernel_for, launch_device, report_fallback
from .kernels.planning import (
    CPU_NUM_SMS,
    TMA_QUERY_BLOCK,
    attention_out_dtype,
    dense_out_shapes,
    is_v_seq_major,
    paged_grid,
    paged_precisions,
    paged_tma_call_reason,
)
from .paged_cache import packed_token_seqs, slot_mapping_for, token_rows
from .quant import (
    descale_for_tokens,
    descale_from_amax,
    descale_shape,
    empty_seq_major,
    fp8_max,
    launch_quant_fp8_static,
    quant_fp8_static_torch,
    quantize_one,
    round_descale_for_storage,
    saturating_cast,
)
from .scaled_bmm import scaled_bmm_impl

__all__ = [
    "dense_fwd",
    "paged_fwd",
    "combine",
    "write_kv_cache",
    "append_kv_cache",
    "quantize_fp8",
    "quant_fp8_static",
    "scaled_bmm",
    "QuantizedAttention",
    "set_fp8_backward",
    "fp8_backward_mode",
    "check_bwd_mode",
    "BWD_MODES",
    "OPS",
    "NAMESPACE",
]

NAMESPACE = "fp8attn"


def _out_dtype(q, out_dtype, out_scale):
    return attention_out_dtype(q.dtype, out_dtype, out_scale)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor with x's values (exactly the strides the fakes promise)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)


def _into(out: torch.Tensor, x: torch.Tensor) -> None:
    if out.dtype == x.dtype and out.dtype.itemsize == 1 and out.is_floating_point():
        out.view(torch.uint8).copy_(x.view(torch.uint8))  # byte copy: no FP8 arithmetic involved
    else:
        out.copy_(x)


# --------------------------------------------------------------------------------------------
# Implementations (run inside the ops; concrete tensors and ints only)
# --------------------------------------------------------------------------------------------


def _no_lse(q):
    """The LSE output of an attention op called with ``return_lse=False``: an empty float32 tensor (the
    kernels then write no LSE)."""
    return q.new_empty((0,), dtype=torch.float32)


def _dense_p_model(q, v):
    """The dense kernel's P@V for the reference path: e4m3 P for e4m3 inputs (P_FP8), P in the input
    dtype for 16-bit inputs, exact otherwise."""
    return {
        "quantize_p": q.dtype == torch.float8_e4m3fn,
        "p_dtype": v.dtype if v.dtype in (torch.bfloat16, torch.float16) else None,
    }


def _dense_impl(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window_left,
    window_right,
    softcap,
    q_descale,
    k_descale,
    v_descale,
    out_scale,
    out_dtype,
    pack_gqa,
    descale_block,
    return_lse,
    out,
):
    varlen = cu_seqlens_q is not None
    dt = _out_dtype(q, out_dtype, out_scale)
    oshape, lse_shape = dense_out_shapes(q, v, varlen)
    window = (int(window_left), int(window_right))
    launch = kernel_for(q, "dense")  # (None: the reference; a CUDA call reports the fallback first)
    if launch is not None:
        o = out if out is not None else torch.empty(oshape, dtype=dt, device=q.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
        with launch_device(q):
            launch(
                q,
                k,
                v,
                o,
                lse,
                softmax_scale=softmax_scale,
                causal=causal,
                window_size=window,
                softcap=softcap,
                q_descale=q_descale,
                k_descale=k_descale,
                v_descale=v_descale,
                out_scale=out_scale,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                seqused_q=seqused_q,
                seqused_k=seqused_k,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                pack_gqa=bool(pack_gqa),
                descale_block_q=descale_block or None,
                descale_block_k=descale_block or None,
            )
        return o, lse if return_lse else _no_lse(q)
    kw = dict(
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window,
        softcap=softcap,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        out_scale=out_scale,
        out_dtype=dt,
        return_lse=True,
        **_dense_p_model(q, v),
    )
    if descale_block:  # per-block Q/K descales -> per-token scales for the reference
        kw.update(
            q_descale=None,
            k_descale=None,
            q_token_descale=_block_tokens(q_descale, q, varlen, descale_block),
            k_token_descale=_block_tokens(k_descale, k, varlen, descale_block),
        )
    if varlen:
        o, lse = ref.varlen_attention_ref(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            seqused_q=seqused_q,
            seqused_k=seqused_k,
            **kw,
        )
    else:
        sq = seqused_q.long() if seqused_q is not None else None
        sk = seqused_k.long() if seqused_k is not None else None
        o, lse = ref.attention_ref(q, k, v, seqlens_q=sq, seqlens_k=sk, **kw)
    if out is not None:
        _into(out, o)
        o = out
    else:
        o = _fresh(o)
    return o, _fresh(lse) if return_lse else _no_lse(q)


def _block_tokens(descale, x, varlen, block):
    """Per-block (batch, heads, nblocks) descales -> per-token: (batch, seqlen, heads), or (total, heads)
    for varlen (whose blocks run over the packed token index, batch 1)."""
    n = x.shape[0] if varlen else x.shape[1]
    t = ref.block_descales_to_tokens(descale, n, block)
    return t[0] if varlen else t


def _dense_bwd_impl(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window_left,
    window_right,
    softcap,
    q_descale,
    k_descale,
    v_descale,
    descale_block,
    mode,
    deterministic,
    grad_dtype,
):
    kw = dict(
        softmax_scale=softmax_scale,
        causal=causal,
        window_left=int(window_left),
        window_right=int(window_right),
        softcap=softcap,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        mode=mode,
        deterministic=deterministic,
    )
    if q.device.type == "cuda":
        launch = kernel_for(q, "backward")  # (None: a fallback, already reported)
        why = _bwd_kernel_gap(q, launch)
        if why is None:
            return _dense_bwd_kernel(
                launch, dout, q, k, v, out, lse, q_descale, k_descale, v_descale, descale_block, grad_dtype, kw
            )
        if launch is not None:
            report_fallback(why[0], why[1])
    return ref.attention_bwd_ref(
        dout,
        q,
        k,
        v,
        out,
        lse,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        descale_block=descale_block,
        grad_dtype=grad_dtype,
        **kw,
    )


def _bwd_kernel_gap(q, launch):
    """Why no backward kernel takes this CUDA call, as ``(reason, message)`` for ``report_fallback``; None when
    one does."""
    if launch is None:
        return ("backward-no-kernel", "no backward kernel on this device/install")
    if q.dtype not in (torch.float8_e4m3fn, torch.bfloat16, torch.float16):
        return (
            "backward-dtype",
            f"the backward kernel takes e4m3fn or bf16/fp16 inputs, got {q.dtype}; the "
            "attention backward runs the torch reference",
        )
    return None


def _dense_bwd_kernel(launch, dout, q, k, v, out, lse, q_descale, k_descale, v_descale, descale_block, grad_dtype, kw):
    if descale_block:  # the kernel folds (batch, nheads_k) descales only: per-block scales are applied here, to bf16
        q, k, v = _per_block_bf16(q, k, v, q_descale, k_descale, v_descale, descale_block, kw["cu_seqlens_k"])
        q_descale = k_descale = v_descale = None
    dq = torch.empty(q.shape, dtype=grad_dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=grad_dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=grad_dtype, device=q.device)
    with launch_device(q):
        launch(dout, q, k, v, out, lse, dq, dk, dv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, **kw)
    return dq, dk, dv


def _per_block_bf16(q, k, v, q_descale, k_descale, v_descale, block, cu_seqlens_k):
    """Per-block-scaled FP8 Q/K (and per-(sequence, head) V) as bf16 real values, for the backward kernel's
    16-bit path (a transient copy the backward frees; the forward saved the FP8 tensors)."""
    varlen = cu_seqlens_k is not None
    qr = q.float() * _block_tokens(q_descale, q, varlen, block)[..., None]
    kr = k.float() * _block_tokens(k_descale, k, varlen, block)[..., None]
    if varlen:  # v_descale is per sequence: (batch, nheads_k) -> each packed token's row
        seq = packed_token_seqs(cu_seqlens_k, v.shape[0])[0].clamp(max=v_descale.shape[0] - 1)
        vr = v.float() * v_descale[seq][..., None]
    else:
        vr = v.float() * v_descale[:, None, :, None]
    return qr.to(torch.bfloat16), kr.to(torch.bfloat16), vr.to(torch.bfloat16)


def _paged_impl(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    cu_seqlens_q,
    max_seqlen_q,
    softmax_scale,
    causal,
    window_left,
    window_right,
    softcap,
    q_descale,
    k_descale,
    v_descale,
    k_cache_scales,
    v_cache_scales,
    out_scale,
    out_dtype,
    num_splits,
    return_lse,
    out,
    out_partial=None,
    lse_partial=None,
):
    varlen = cu_seqlens_q is not None
    dt = _out_dtype(q, out_dtype, out_scale)
    oshape, lse_shape = dense_out_shapes(q, v_cache, varlen)
    window = (int(window_left), int(window_right))
    if max_seqlen_q is None:
        max_seqlen_q = q.shape[1] if not varlen else q.shape[0]
    launch = kernel_for(q, "paged")
    if launch is not None:
        o = out if out is not None else torch.empty(oshape, dtype=dt, device=q.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
        with launch_device(q):
            launch(
                q,
                k_cache,
                v_cache,
                page_table,
                cache_seqlens,
                o,
                lse,
                cu_seqlens_q=cu_seqlens_q,
                max_seqlen_q=max_seqlen_q,
                softmax_scale=softmax_scale,
                causal=causal,
                window_size=window,
                softcap=softcap,
                q_descale=q_descale,
                k_descale=k_descale,
                v_descale=v_descale,
                k_cache_scales=k_cache_scales,
                v_cache_scales=v_cache_scales,
                out_scale=out_scale,
                num_splits=num_splits,
                out_partial=out_partial,
                lse_partial=lse_partial,
            )
        return o, lse if return_lse else _no_lse(q)
    qg = q.shape[-2] // k_cache.shape[2]
    v_seq_major = is_v_seq_major(v_cache)
    token_scales = k_cache_scales is not None or v_cache_scales is not None
    # P as the Triton kernel rounds it (its decode rows' P@V runs in the same dtype as the call's)
    precisions = paged_precisions(
        q.dtype,
        k_cache.dtype,
        v_cache.dtype,
        k_cache_scales is not None,
        v_cache_scales is not None,
        max_seqlen_q,
        qg,
        v_seq_major,
    )
    p_e4m3, cdt = precisions[0][1:]

    def reference(p_e4m3):
        return ref.paged_attention_ref(
            q,
            k_cache,
            v_cache,
            page_table,
            cache_seqlens,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            k_cache_scales=k_cache_scales,
            v_cache_scales=v_cache_scales,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window,
            softcap=softcap,
            q_descale=q_descale,
            k_descale=k_descale,
            v_descale=v_descale,
            out_scale=out_scale,
            out_dtype=dt,
            return_lse=True,
            quantize_p=p_e4m3,
            p_dtype=None if p_e4m3 or k_cache.dtype == torch.float32 else cdt,
        )  # fp32: a CPU/test cache format

    o, lse = reference(p_e4m3)
    if not p_e4m3:  # FP8 prefill chunks the paged TMA kernel would take round P to e4m3 (FA3's layout)
        rows = _paged_tma_tokens(
            q,
            k_cache,
            v_cache,
            page_table,
            cu_seqlens_q,
            max_seqlen_q,
            dt,
            window,
            softcap,
            out_scale,
            token_scales,
            num_splits,
            v_seq_major,
            precisions,
        )
        if rows is True:
            o, lse = reference(True)
        elif rows is not None and bool(rows.any()):
            o8, lse8 = reference(True)
            o = (
                torch.where(rows[:, None, None], o8.view(torch.uint8), o.view(torch.uint8)).view(o.dtype)
                if o.element_size() == 1
                else torch.where(rows[:, None, None], o8, o)
            )
            lse = torch.where(rows[None, :], lse8, lse)  # varlen LSE: (nheads, total_q)
    if out is not None:
        _into(out, o)
        o = out
    else:
        o = _fresh(o)
    return o, _fresh(lse) if return_lse else _no_lse(q)


def _paged_tma_tokens(
    q,
    k_cache,
    v_cache,
    page_table,
    cu_seqlens_q,
    max_seqlen_q,
    out_dtype,
    window,
    softcap,
    out_scale,
    token_scales,
    num_splits,
    v_seq_major,
    precisions,
):
    """The query tokens of a paged call that the paged TMA kernel multiplies on the GPU, by the call's
    semantics (``kernels.planning.paged_tma_call_reason``): None (none), True (all: a fixed-length call), or a
    (total_q,) bool mask (varlen: the sequences of ``TMA_QUERY_BLOCK`` queries or more, unless the launch
    plan splits the keys, which keeps the whole batch on the Triton kernel; the plan of a GPU with
    ``kernels.planning.CPU_NUM_SMS`` SMs)."""
    varlen = cu_seqlens_q is not None
    if (max_seqlen_q if varlen else q.shape[1]) < TMA_QUERY_BLOCK:
        return None
    if (
        paged_tma_call_reason(
            q,
            k_cache,
            v_cache,
            out_dtype,
            varlen=varlen,
            window_size=window,
            softcap=softcap,
            out_scale=out_scale,
            token_scales=token_scales,
            num_splits=num_splits,
            v_seq_major=v_seq_major,
        )
        is not None
    ):
        return None
    if not varlen:
        return True
    total_q, hq, d = q.shape
    cu = cu_seqlens_q.long()
    batch, hk = cu.shape[0] - 1, k_cache.shape[2]
    if batch < 1:  # no sequences
        return None
    splits = paged_grid(
        batch=batch,
        nheads_k=hk,
        qg=hq // hk,
        headdim=d,
        max_seqlen_q=max_seqlen_q,
        q_rows=total_q,
        varlen=True,
        page_size=k_cache.shape[1],
        capacity=page_table.shape[1] * k_cache.shape[1],
        mma_fp8=precisions[0][0],
        mma_fp8_s=precisions[1][0],
        v_seq_major=v_seq_major,
        fp8_cache=True,
        token_scales=token_scales,
        num_splits=num_splits,
        num_sms=CPU_NUM_SMS,
    )[-1]
    if splits > 1:
        return None
    seq, tok = packed_token_seqs(cu, total_q)
    seq = seq.clamp(max=batch - 1)  # (padding tokens: masked out below)
    return (tok < cu[-1]) & ((cu[1:] - cu[:-1])[seq] >= TMA_QUERY_BLOCK)


def _combine_dtype(out_partial, out_dtype, out_scale):
    return torch.float8_e4m3fn if out_scale is not None else (out_dtype or out_partial.dtype)


def _combine_impl(out_partial, lse_partial, out_scale, out_dtype, out):
    dt = _combine_dtype(out_partial, out_dtype, out_scale)
    launch = kernel_for(out_partial, "combine")
    if launch is not None:
        o = out if out is not None else torch.empty(out_partial.shape[1:], dtype=dt, device=out_partial.device)
        lse = torch.empty(lse_partial.shape[1:], dtype=torch.float32, device=out_partial.device)
        with launch_device(out_partial):
            launch(out_partial, lse_partial, o, lse, out_scale=out_scale)
        return o, lse
    o, lse = ref.combine_ref(out_partial, lse_partial, out_dtype=dt, out_scale=out_scale)
    if out is not None:
        _into(out, o)
        o = out
    else:
        o = _fresh(o)
    return o, _fresh(lse)


def _write_kv_cache_impl(
    k, v, k_cache, v_cache, slot_mapping, k_descale, v_descale, token_seq_idx, k_cache_scales, v_cache_scales
):
    launch = kernel_for(k, "cache")
    if launch is not None:
        with launch_device(k):
            launch(
                k,
                v,
                k_cache,
                v_cache,
                slot_mapping,
                k_descale=k_descale,
                v_descale=v_descale,
                token_seq_idx=token_seq_idx,
                k_cache_scales=k_cache_scales,
                v_cache_scales=v_cache_scales,
            )
        return
    _write_kv_cache_torch(
        k, v, k_cache, v_cache, slot_mapping, k_descale, v_descale, token_seq_idx, k_cache_scales, v_cache_scales
    )


def _write_kv_cache_torch(
    k, v, k_cache, v_cache, slot_mapping, k_descale, v_descale, token_seq_idx, k_cache_scales, v_cache_scales
):
    nb, ps, hk, _ = k_cache.shape
    # unchecked slots (a GPU call without validate=True) outside the cache are skipped, as the kernel does
    keep = (slot_mapping >= 0) & (slot_mapping < nb * ps)
    rows = [d.shape[0] for d in (k_descale, v_descale) if d is not None and d.numel() != 1]
    if rows and token_seq_idx is not None and k_cache_scales is None and k_cache.element_size() == 1:
        # (so are tokens whose row has no descale, as the kernel skips them)
        keep &= (token_seq_idx >= 0) & (token_seq_idx < min(rows))
    slots = slot_mapping[keep].long()
    blk, off = slots // ps, slots % ps
    sel = keep.nonzero().squeeze(-1)
    seq_idx = token_seq_idx[keep] if token_seq_idx is not None else None
    for x, cache, descale, scales in ((k, k_cache, k_descale, k_cache_scales), (v, v_cache, v_descale, v_cache_scales)):
        xs = x[sel].float()
        if cache.dtype in (torch.float16, torch.bfloat16, torch.float32):
            cache[blk, off] = xs.to(cache.dtype)
            continue
        if scales is not None:  # per-token-head dynamic scales, stored beside the cache
            m = fp8_max(cache.dtype)
            d = descale_from_amax(xs.abs().nan_to_num(0.0).amax(dim=-1), m)
            d = round_descale_for_storage(d, scales.dtype)  # quantize with the value that is stored
            scales[blk, off] = d.to(scales.dtype)
        elif descale is not None:
            d = descale_for_tokens(descale, seq_idx, xs.shape[0], hk)
        else:
            d = torch.ones(xs.shape[0], hk, device=x.device)
        q8 = saturating_cast(xs / d[..., None], cache.dtype)
        cache.view(torch.uint8)[blk, off] = q8.view(torch.uint8)


def _append_kv_cache_impl(
    k,
    v,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    cu_seqlens_k_new,
    k_descale,
    v_descale,
    k_cache_scales,
    v_cache_scales,
):
    launch = kernel_for(k, "append")
    if launch is not None:
        with launch_device(k):
            return launch(
                k,
                v,
                k_cache,
                v_cache,
                page_table,
                cache_seqlens,
                cu_seqlens_k_new,
                k_descale=k_descale,
                v_descale=v_descale,
                k_cache_scales=k_cache_scales,
                v_cache_scales=v_cache_scales,
            )
    # the reference: explicit slots (-1 where the kernel skips the token), then the scatter
    batch, hk = page_table.shape[0], k.shape[-2]
    if cu_seqlens_k_new is None:
        seq, i = token_rows(k.device, batch, seqlen=k.shape[1])
        new_len = torch.full((batch,), k.shape[1], dtype=torch.int32, device=k.device)
        k, v = k.reshape(-1, hk, k.shape[-1]), v.reshape(-1, hk, v.shape[-1])
    else:
        seq, i = token_rows(k.device, batch, cu_seqlens=cu_seqlens_k_new, total=k.shape[0])
        new_len = (cu_seqlens_k_new[1:] - cu_seqlens_k_new[:-1]).to(torch.int32)
    live = seq < batch  # (packed tokens past cu_seqlens_k_new[-1] belong to no sequence)
    seq = seq.clamp(max=max(batch - 1, 0))
    pos = cache_seqlens.long()[seq] + i if batch else i
    slots = torch.where(live, slot_mapping_for(page_table, k_cache.shape[1], seq, pos, k_cache.shape[0]), -1)
    _write_kv_cache_torch(
        k, v, k_cache, v_cache, slots, k_descale, v_descale, seq.to(torch.int32), k_cache_scales, v_cache_scales
    )
    return (cache_seqlens + new_len).to(torch.int32)


def _quantize_fp8_impl(x, granularity, nheads_k, rotate, seed, block_t, seq_major, use_triton):
    with launch_device(x):  # (a no-op on the CPU)
        y, d = quantize_one(x, granularity, nheads_k, rotate, seed, block_t, seq_major, use_triton)
    return y, (d if d.is_contiguous() else _fresh(d))  # (the torch path's per-block descales are a transposed view)


def _quant_impl(x, scale):
    launch = kernel_for(x, "quant_fp8_static", launch_quant_fp8_static)
    if launch is not None:
        y = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        with launch_device(x):
            launch(x, scale, y)
        return y
    return quant_fp8_static_torch(x, scale)


def _scaled_bmm_impl(a, b, scale_a, scale_b, out_dtype):
    return scaled_bmm_impl(a, b, scale_a, scale_b, out_dtype)


# --------------------------------------------------------------------------------------------
# Fakes (shapes/dtypes/strides only; no data access)
# --------------------------------------------------------------------------------------------


def _lse_fake(q, v, cu_seqlens_q, return_lse):
    """An attention op's LSE: float32 (batch, nheads_q, seqlen_q) / varlen (nheads_q, total_q), or empty
    without ``return_lse``."""
    if not return_lse:
        return _no_lse(q)
    return q.new_empty(dense_out_shapes(q, v, cu_seqlens_q is not None)[1], dtype=torch.float32)


def _attn_fake(q, v, cu_seqlens_q, out_scale, out_dtype, return_lse):
    """(out, lse) of an attention op: out is q's shape with v's head dim; lse as ``_lse_fake``."""
    oshape = dense_out_shapes(q, v, cu_seqlens_q is not None)[0]
    return (q.new_empty(oshape, dtype=_out_dtype(q, out_dtype, out_scale)), _lse_fake(q, v, cu_seqlens_q, return_lse))


def _dense_fake(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window_left,
    window_right,
    softcap,
    q_descale,
    k_descale,
    v_descale,
    out_scale,
    out_dtype,
    pack_gqa,
    descale_block,
    return_lse,
):
    return _attn_fake(q, v, cu_seqlens_q, out_scale, out_dtype, return_lse)


def _dense_bwd_fake(dout, q, k, v, out, lse, *rest):
    grad_dtype = rest[-1]
    return tuple(x.new_empty(x.shape, dtype=grad_dtype) for x in (q, k, v))


def _dense_out_fake(*args):
    *rest, return_lse, out = args
    q, v, cu = rest[0], rest[2], rest[3]
    return _lse_fake(q, v, cu, return_lse)


def _paged_fake(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    cu_seqlens_q,
    max_seqlen_q,
    softmax_scale,
    causal,
    window_left,
    window_right,
    softcap,
    q_descale,
    k_descale,
    v_descale,
    k_cache_scales,
    v_cache_scales,
    out_scale,
    out_dtype,
    num_splits,
    return_lse,
):
    return _attn_fake(q, v_cache, cu_seqlens_q, out_scale, out_dtype, return_lse)


def _paged_out_fake(*args):
    q, v_cache, cu, return_lse = args[0], args[2], args[5], args[_PAGED_NARGS - 1]
    return _lse_fake(q, v_cache, cu, return_lse)


def _combine_fake(out_partial, lse_partial, out_scale, out_dtype):
    return (
        out_partial.new_empty(out_partial.shape[1:], dtype=_combine_dtype(out_partial, out_dtype, out_scale)),
        lse_partial.new_empty(lse_partial.shape[1:], dtype=torch.float32),
    )


def _combine_out_fake(out_partial, lse_partial, out_scale, out):
    return lse_partial.new_empty(lse_partial.shape[1:], dtype=torch.float32)


def _write_kv_cache_fake(*args):
    return None


def _append_kv_cache_fake(k, v, k_cache, v_cache, page_table, cache_seqlens, *args):
    return cache_seqlens.new_empty((page_table.shape[0],), dtype=torch.int32)


def _quantize_fp8_fake(x, granularity, nheads_k, rotate, seed, block_t, seq_major, use_triton):
    y = (
        empty_seq_major(tuple(x.shape), torch.float8_e4m3fn, x.device)
        if seq_major
        else x.new_empty(x.shape, dtype=torch.float8_e4m3fn)
    )
    return y, x.new_empty(descale_shape(x, granularity, nheads_k, block_t), dtype=torch.float32)


def _quant_fake(x, scale):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn)


def _scaled_bmm_fake(a, b, scale_a, scale_b, out_dtype):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=out_dtype)


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------

_DENSE_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? seqused_q, "
    "Tensor? seqused_k, SymInt? max_seqlen_q, SymInt? max_seqlen_k, float softmax_scale, bool causal, "
    "int window_left, int window_right, float softcap, Tensor? q_descale, Tensor? k_descale, "
    "Tensor? v_descale, Tensor? out_scale, ScalarType? out_dtype, bool pack_gqa, int descale_block, "
    "bool return_lse"
)
_DENSE_NARGS = _DENSE_ARGS.count(",") + 1
_DENSE_BWD_ARGS = (
    "Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? cu_seqlens_q, "
    "Tensor? cu_seqlens_k, SymInt? max_seqlen_q, SymInt? max_seqlen_k, float softmax_scale, bool causal, "
    "int window_left, int window_right, float softcap, Tensor? q_descale, Tensor? k_descale, "
    "Tensor? v_descale, int descale_block, str mode, bool deterministic, ScalarType grad_dtype"
)
_PAGED_ARGS = (
    "Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cache_seqlens, "
    "Tensor? cu_seqlens_q, SymInt? max_seqlen_q, float softmax_scale, bool causal, int window_left, "
    "int window_right, float softcap, Tensor? q_descale, Tensor? k_descale, Tensor? v_descale, "
    "Tensor? k_cache_scales, Tensor? v_cache_scales, Tensor? out_scale, ScalarType? out_dtype, "
    "int num_splits, bool return_lse"
)
_PAGED_NARGS = _PAGED_ARGS.count(",") + 1
# The split-KV partials (``paged.split_workspace``): scratch the kernel writes when it splits the keys
# (``paged_fwd_out`` only).
_SPLIT_WS = "Tensor(b!)? out_partial=None, Tensor(c!)? lse_partial=None"

# name -> (schema, implementation, fake). (The `type: ignore`s below: mypy takes `*a` to fill every parameter,
# so the trailing `out=None` reads as one argument too many.)
_SPECS: dict[str, tuple[str, Callable[..., Any], Callable[..., Any]]] = {
    # (bwd_mode / deterministic only steer the backward: see _dense_setup_context)
    "dense_fwd": (
        f"({_DENSE_ARGS}, str bwd_mode='dequantized', bool deterministic=False) -> (Tensor, Tensor)",
        lambda *a: _dense_impl(*a[:_DENSE_NARGS], None),  # type: ignore[call-arg]
        lambda *a: _dense_fake(*a[:_DENSE_NARGS]),
    ),
    "dense_bwd": (f"({_DENSE_BWD_ARGS}) -> (Tensor, Tensor, Tensor)", _dense_bwd_impl, _dense_bwd_fake),
    "dense_fwd_out": (f"({_DENSE_ARGS}, Tensor(a!) out) -> Tensor", lambda *a: _dense_impl(*a)[1], _dense_out_fake),
    # (functional: no mutable argument, so graphs keep it as a plain node that passes can rewrite; a call with
    # a split workspace takes the out variant)
    "paged_fwd": (f"({_PAGED_ARGS}) -> (Tensor, Tensor)", lambda *a: _paged_impl(*a, None), _paged_fake),  # type: ignore[call-arg]
    "paged_fwd_out": (
        f"({_PAGED_ARGS}, Tensor(a!) out, {_SPLIT_WS}) -> Tensor",
        lambda *a: _paged_impl(*a)[1],
        _paged_out_fake,
    ),
    "combine": (
        "(Tensor out_partial, Tensor lse_partial, Tensor? out_scale, ScalarType? out_dtype) -> (Tensor, Tensor)",
        lambda *a: _combine_impl(*a, None),  # type: ignore[call-arg]
        _combine_fake,
    ),
    "combine_out": (
        "(Tensor out_partial, Tensor lse_partial, Tensor? out_scale, Tensor(a!) out) -> Tensor",
        lambda op, lp, sc, out: _combine_impl(op, lp, sc, None, out)[1],
        _combine_out_fake,
    ),
    "write_kv_cache": (
        "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor? k_descale, Tensor? v_descale, Tensor? token_seq_idx, Tensor(c!)? k_cache_scales, "
        "Tensor(d!)? v_cache_scales) -> ()",
        _write_kv_cache_impl,
        _write_kv_cache_fake,
    ),
    "append_kv_cache": (
        "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor page_table, "
        "Tensor cache_seqlens, Tensor? cu_seqlens_k_new, Tensor? k_descale, Tensor? v_descale, "
        "Tensor(c!)? k_cache_scales, Tensor(d!)? v_cache_scales) -> Tensor",
        _append_kv_cache_impl,
        _append_kv_cache_fake,
    ),
    "quant_fp8_static": ("(Tensor x, Tensor scale) -> Tensor", _quant_impl, _quant_fake),
    "quantize_fp8": (
        "(Tensor x, str granularity, int nheads_k, bool rotate, int seed, int block_t, bool seq_major, "
        "bool use_triton) -> (Tensor, Tensor)",
        _quantize_fp8_impl,
        _quantize_fp8_fake,
    ),
    "scaled_bmm": (
        "(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype) -> Tensor",
        _scaled_bmm_impl,
        _scaled_bmm_fake,
    ),
}

# --------------------------------------------------------------------------------------------
# Autograd of dense_fwd (the backward is the opaque op dense_bwd)
# --------------------------------------------------------------------------------------------

BWD_MODES = ref.BWD_MODES
_bwd_default = {"mode": "dequantized"}


def set_fp8_backward(mode: str) -> None:
    """Set the process default of the attention backward (see ``fp8attn.set_fp8_backward``)."""
    _bwd_default["mode"] = check_bwd_mode("mode", mode)


def fp8_backward_mode() -> str:
    """The process default of the attention backward: "dequantized" or "fp8"."""
    return _bwd_default["mode"]


def check_bwd_mode(name, mode):
    if mode not in BWD_MODES:
        raise ValueError(
            f"{name}: expected one of {BWD_MODES}, got {mode!r}. 'dequantized' runs the backward "
            "products in 16/32-bit; 'fp8' rounds dO, P and dS to e4m3 with per-block scales."
        )
    return mode


def _grad_dtype(x):
    """The dtype dense_bwd returns a gradient in: the input's for 16/32-bit inputs, float32 for FP8 inputs
    (autograd then casts it to the FP8 leaf's dtype; ``fp8attn.attention`` keeps it)."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64) else torch.float32


def _dense_setup_context(ctx, inputs, output):
    (
        q,
        k,
        v,
        cu_q,
        cu_k,
        _squ,
        _suk,
        max_q,
        max_k,
        scale,
        causal,
        wl,
        wr,
        softcap,
        qd,
        kd,
        vd,
        _osc,
        _odt,
        _pg,
        block,
        return_lse,
        mode,
        deterministic,
    ) = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)  # (as FA3: the LSE output carries no gradient)
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, qd, kd, vd)
    ctx.inputs = inputs if not return_lse else None  # (to recompute the LSE the caller did not ask for)
    ctx.attrs = (max_q, max_k, scale, causal, wl, wr, softcap, block, mode, deterministic)


def _dense_backward(ctx, grad_out, grad_lse):
    q, k, v, o, lse, cu_q, cu_k, qd, kd, vd = ctx.saved_tensors
    if ctx.inputs is not None:  # a direct op call without the LSE: one more forward (the Python entry asks for it)
        args = list(ctx.inputs)
        args[_DENSE_NARGS - 1] = True
        with torch.no_grad():
            lse = OPS["dense_fwd"](*args)[1]
    grads = _dense_grads(grad_out, q, k, v, o, lse, cu_q, cu_k, qd, kd, vd, ctx.attrs, _grad_dtype(q))
    return (*grads,) + (None,) * (_DENSE_NARGS + 2 - 3)


# name -> (backward, setup_context) for torch.library.register_autograd
_AUTOGRAD = {"dense_fwd": (_dense_backward, _dense_setup_context)}

_TAGS = tuple(
    t
    for t in (getattr(torch.Tag, "pt2_compliant_tag", None), getattr(torch.Tag, "needs_fixed_stride_order", None))
    if t is not None
)


def _op_exists(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"{NAMESPACE}::{name}", "")
        return True
    except RuntimeError:
        return False


def _register():
    # One FRAGMENT library per process; it lives on the torch.ops namespace object so a reload of this
    # module (or a second import under another module object) finds it instead of defining twice.
    ns = getattr(torch.ops, NAMESPACE)
    lib = getattr(ns, "_fp8attn_library", None)
    for name, (schema, impl, fake) in _SPECS.items():
        if _op_exists(name):
            continue
        if lib is None:
            lib = torch.library.Library(NAMESPACE, "FRAGMENT")
            ns._fp8attn_library = lib
        lib.define(name + schema, tags=_TAGS)
        lib.impl(name, impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
        if name in _AUTOGRAD:
            torch.library.register_autograd(
                f"{NAMESPACE}::{name}", _AUTOGRAD[name][0], setup_context=_AUTOGRAD[name][1], lib=lib
            )
        else:
            # Non-differentiable ops: autograd falls through in C++ (no Python hop per call). The Python
            # entry points attach a backward that raises when an input requires grad (_no_backward).
            lib.impl(name, torch.library.fallthrough_kernel, "Autograd")


_register()

OPS = {name: getattr(getattr(torch.ops, NAMESPACE), name).default for name in _SPECS}
_dense_op, _dense_out_op = OPS["dense_fwd"], OPS["dense_fwd_out"]
_paged_op, _paged_out_op = OPS["paged_fwd"], OPS["paged_fwd_out"]
_combine_op, _combine_out_op = OPS["combine"], OPS["combine_out"]
_write_kv_cache_op = OPS["write_kv_cache"]
_append_kv_cache_op = OPS["append_kv_cache"]


# --------------------------------------------------------------------------------------------
# Python entry points (the signatures interface.py calls)
# --------------------------------------------------------------------------------------------


class _RaiseOnBackward(torch.autograd.Function):
    """Identity on ``out`` that links it to the inputs and raises ``NotImplementedError(message)`` in backward."""

    @staticmethod
    def forward(ctx, message, out, *inputs):
        ctx.message = message
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(ctx.message)


_DOUBLE_BACKWARD = (
    "fp8attn: the attention backward is not differentiable, so gradients of its gradients (double backward: "
    "a gradient penalty or a Hessian-vector product through torch.autograd.grad(..., create_graph=True)) cannot "
    "be computed. Differentiate the attention once (create_graph=False), or compute the second-order term "
    "with torch.nn.functional.scaled_dot_product_attention."
)


def _first_order_only(grads, out, dout):
    """The backward's gradients as they are, or, when the backward runs with ``create_graph=True`` (grad mode on
    inside it), each linked to a node that raises on a second differentiation: they depend on the inputs through
    kernels autograd does not see, so a second-order gradient through them would silently miss those terms.
    The link goes through the saved output ``out`` (whose graph reaches every input) and ``dout``, so that
    ``torch.autograd.grad`` of a gradient penalty with respect to the inputs reaches the node."""
    if not torch.is_grad_enabled():  # (every backward without create_graph: nothing more to look at)
        return grads
    links = [t for t in (out, dout) if t.requires_grad]
    if not links:
        return grads
    return tuple(g if g is None else _RaiseOnBackward.apply(_DOUBLE_BACKWARD, g, *links) for g in grads)


class QuantizedAttention(torch.autograd.Function):
    """FP8 attention of 16-bit leaves with a straight-through quantizer (``fp8attn.attention``).

    ``forward(q, k, v, q8, k8, v8, q_descale, k_descale, v_descale, rotation, attn)``: q, k, v are the 16-bit
    tensors (differentiable), q8..v_descale their ``quantize_qkv`` result (computed by the caller, not
    differentiated), ``rotation`` the (headdim, headdim) float32 Hadamard matrix Q and K were rotated by (or
    None) and ``attn`` a tuple ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
    window_left, window_right, softcap, descale_block, mode, deterministic)``. Returns ``(out, lse)``.

    The quantizer is the identity for the backward (straight-through): the gradient with respect to the real
    values the FP8 tensors represent is the gradient of the 16-bit inputs, rotated back (``@ R^T``) for Q and
    K when they were rotated. Saved for the backward: the FP8 Q/K/V, their descales, O and the LSE only.
    """

    @staticmethod
    def forward(ctx, q, k, v, q8, k8, v8, q_descale, k_descale, v_descale, rotation, attn):
        cu_q, cu_k, max_q, max_k, scale, causal, wl, wr, softcap, block, mode, deterministic = attn
        o_lse = _planned_fwd(q.dtype, q8, k8, v8, q_descale, k_descale, v_descale, attn)
        if o_lse is None:  # no plan: the op (its implementation directly where nothing traces the call)
            args = (
                q8,
                k8,
                v8,
                cu_q,
                cu_k,
                None,
                None,
                max_q,
                max_k,
                scale,
                causal,
                wl,
                wr,
                softcap,
                q_descale,
                k_descale,
                v_descale,
                None,
                q.dtype,
                False,
                block,
                True,
            )
            o_lse = _dense_impl(*args, None) if _eager_direct(q8, k8, v8) else _dense_op(*args)
        o, lse = o_lse
        ctx.save_for_backward(q8, k8, v8, q_descale, k_descale, v_descale, o, lse, rotation, cu_q, cu_k)
        ctx.attn = attn
        ctx.grad_dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q8, k8, v8, qd, kd, vd, o, lse, rotation, cu_q, cu_k = ctx.saved_tensors
        gdt = torch.float32 if rotation is not None else ctx.grad_dtypes[0]
        # ctx.attn[2:]: (max_q, max_k, scale, causal, wl, wr, softcap, block, mode, deterministic), dense_fwd's attrs
        dq, dk, dv = _dense_grads(grad_out, q8, k8, v8, o, lse, cu_q, cu_k, qd, kd, vd, ctx.attn[2:], gdt)
        if rotation is not None:  # x_rot = x @ R  =>  dL/dx = dL/dx_rot @ R^T
            dq = (dq @ rotation.t()).to(ctx.grad_dtypes[0])
            dk = (dk @ rotation.t()).to(ctx.grad_dtypes[1])
        return dq, dk.to(ctx.grad_dtypes[1]), dv.to(ctx.grad_dtypes[2]), None, None, None, None, None, None, None, None


def _planned_fwd(out_dtype, q8, k8, v8, qd, kd, vd, attn):
    """``(out, lse)`` of the forward of a dense ``fp8attn.attention`` call through its eager plan (what a planned
    ``flash_attn_func`` call runs: the Hopper kernel's recorded launch), or None where the call takes no plan
    (varlen, per-block descales, compiled or traced, a call the Hopper kernel does not take; ``plan.obtain``
    remembers those signatures)."""
    from . import plan

    cu_q, _, _, _, scale, causal, wl, wr, softcap, block, _, _ = attn
    if cu_q is not None or block or not q8.is_cuda:
        return None
    tensors = (q8, k8, v8, qd, kd, vd)

    def build():
        return plan.dense_tma_plan(
            *tensors,
            None,
            None,
            softmax_scale=scale,
            causal=causal,
            window_size=(wl, wr),
            softcap=softcap,
            out_dtype=out_dtype,
            return_lse=True,
        )

    run = plan.obtain("attention_fwd", tensors, (scale, causal, wl, wr, softcap, out_dtype), build)
    return None if run is None else run(*tensors, None, None)


def _dense_grads(dout, q, k, v, o, lse, cu_q, cu_k, qd, kd, vd, attrs, grad_dtype):
    """``(dq, dk, dv)`` of the backward of a dense call (``attrs``: ``(max_seqlen_q, max_seqlen_k, softmax_scale,
    causal, window_left, window_right, softcap, descale_block, mode, deterministic)``; ``dout`` made contiguous
    here): through the eager plan of its signature where one takes it (dense, no per-block descales, not
    ``deterministic``), else the ``dense_bwd`` op (``_dense_grads_of``), outside autograd; a second
    differentiation of the result raises (``_first_order_only``). The one backward path of ``flash_attn_func``'s
    autograd and of ``fp8attn.attention``, and the one place that spells the op's argument order."""
    with torch.no_grad():  # (create_graph=True: the CPU path's torch ops would record a partial graph)
        grads = _dense_grads_of(dout.contiguous(), q, k, v, o, lse, cu_q, cu_k, qd, kd, vd, attrs, grad_dtype)
    return _first_order_only(grads, o, dout)


def _dense_grads_of(dout, q, k, v, o, lse, cu_q, cu_k, qd, kd, vd, attrs, grad_dtype):
    """``_dense_grads``'s gradients on a contiguous ``dout``: the eager plan or the ``dense_bwd`` op."""
    max_q, max_k, scale, causal, wl, wr, softcap, block, mode, deterministic = attrs
    if cu_q is None and not block and not deterministic:
        grads = _planned_bwd(
            dout, q, k, v, o, lse, qd, kd, vd, (scale, causal, wl, wr, softcap, block, mode), grad_dtype
        )
        if grads is not None:
            return grads
    return OPS["dense_bwd"](
        dout,
        q,
        k,
        v,
        o,
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        scale,
        causal,
        wl,
        wr,
        softcap,
        qd,
        kd,
        vd,
        block,
        mode,
        deterministic,
        grad_dtype,
    )


def _planned_bwd(dout, q, k, v, o, lse, qd, kd, vd, attrs, grad_dtype):
    """``(dq, dk, dv)`` of a dense backward through its eager plan (``plan.dense_bwd_plan``: the Hopper backward
    kernel's recorded launches), or None where the call takes no plan; ``attrs`` is ``(softmax_scale, causal,
    window_left, window_right, softcap, descale_block, mode)``."""
    from . import plan

    if not q.is_cuda:
        return None
    tensors = (dout, q, k, v, o, lse, qd, kd, vd)
    scale, causal, wl, wr, softcap, _block, mode = attrs

    def build():
        return plan.dense_bwd_plan(
            *tensors,
            softmax_scale=scale,
            causal=causal,
            window_size=(wl, wr),
            softcap=softcap,
            mode=mode,
            grad_dtype=grad_dtype,
        )

    run = plan.obtain("attention_bwd", tensors, (*attrs, grad_dtype), build)
    return None if run is None else run(*tensors)


def _needs_grad(*ts):
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts)


def _no_backward(name, res, grad_inputs, out_given):
    """Attach a raising backward to the first output when an input requires grad."""
    if out_given:
        raise NotImplementedError(
            f"fp8attn::{name}: out= with inputs that require grad is not supported (there is "
            "no backward). Run under torch.no_grad() or drop out=."
        )
    o, lse = res
    if not o.is_floating_point() or o.dtype.itemsize == 1:
        return res  # an FP8 output cannot carry a gradient anyway
    message = (
        f"fp8attn::{name} has no backward (paged / KV-cache attention and combine are inference ops; the dense and "
        "varlen attention of flash_attn_func / flash_attn_varlen_func and fp8attn.attention are differentiable). "
        "Run inference under torch.no_grad() / torch.inference_mode(), or detach the inputs."
    )
    return _RaiseOnBackward.apply(message, o, *grad_inputs), lse


def _check_grad_call(out, out_scale, seqused_q, seqused_k):
    """The forward options the attention backward does not take, rejected before anything runs."""
    for name, val, why in (
        ("out", out, "a preallocated output is written in place (no autograd through it)"),
        ("out_scale", out_scale, "an FP8 output carries no gradient"),
        ("seqused_q", seqused_q, "the backward takes whole varlen sequences"),
        ("seqused_k", seqused_k, "the backward takes whole varlen sequences"),
    ):
        if val is not None:
            raise NotImplementedError(
                f"{name}= with inputs that require grad is not supported: {why}. Drop {name}, "
                "or run under torch.no_grad() for inference."
            )


def _eager_direct(*ts) -> bool:
    """Whether a call may run an op's implementation without the dispatcher (see module docstring)."""
    return (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_function_stack() == 0
        and torch._C._len_torch_dispatch_stack() == 0
        and torch._C._functorch.peek_interpreter_stack() is None
        and torch._C._get_tracing_state() is None
        and all(type(t) is torch.Tensor for t in ts if t is not None)
    )


def dense_fwd(
    q,
    k,
    v,
    *,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    seqused_q=None,
    seqused_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    softmax_scale,
    causal,
    window_size,
    softcap,
    q_descale,
    k_descale,
    v_descale,
    out_scale=None,
    out_dtype=None,
    out=None,
    pack_gqa=None,
    descale_block=0,
    return_lse=True,
    fp8_backward=None,
    deterministic=False,
):
    """Dense (4-D q) or varlen (3-D q + cu_seqlens) forward through ``fp8attn::dense_fwd[_out]``.

    Differentiable when q, k or v requires grad (grad mode on): the call then goes through the dispatcher
    (autograd registered on ``fp8attn::dense_fwd``), computes the LSE even when ``return_lse`` is False (the
    backward recomputes P from it) and the backward runs ``fp8attn::dense_bwd`` with ``fp8_backward`` (None:
    the process default, ``set_fp8_backward``) and ``deterministic``.

    Parameters
    ----------
    q : (batch, seqlen_q, nheads_q, headdim) or varlen (total_q, nheads_q, headdim); FP8 or 16/32-bit.
    k : (batch, seqlen_k, nheads_k, headdim) or varlen (total_k, nheads_k, headdim), q's dtype.
    v : (batch, seqlen_k, nheads_k, headdim_v) or varlen (total_k, nheads_k, headdim_v).
    cu_seqlens_q, cu_seqlens_k : (batch + 1,) int32 (varlen). seqused_q, seqused_k : (batch,) int32.
    q_descale, k_descale, v_descale : float32 (batch, nheads_k) views (or None for 16-bit inputs).
        With ``descale_block > 0``: q_descale (batch, nheads_q, cdiv(seqlen_q, block)) and k_descale
        (batch, nheads_k, cdiv(seqlen_k, block)) per-block; varlen counts as batch 1 over packed tokens.
    out_scale : float32 one-element static output scale (output e4m3fn), or None.
    out : optional preallocated output (written in place and returned).
    return_lse : False: the kernel writes no LSE and ``lse`` is an empty float32 tensor.

    Returns
    -------
    (out, lse) : out (..., nheads_q, headdim_v); lse float32 (batch, nheads_q, seqlen_q) or varlen
        (nheads_q, total_q), or (0,) without ``return_lse``.
    """
    args = (
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_q,
        seqused_k,
        max_seqlen_q,
        max_seqlen_k,
        float(softmax_scale),
        bool(causal),
        window_size[0],
        window_size[1],
        float(softcap),
        q_descale,
        k_descale,
        v_descale,
        out_scale,
        out_dtype,
        bool(pack_gqa),
        int(descale_block),
        bool(return_lse),
    )
    if _needs_grad(q, k, v):  # never the eager fast path: autograd is registered on the op
        _check_grad_call(out, out_scale, seqused_q, seqused_k)
        mode = check_bwd_mode("fp8_backward", fp8_backward if fp8_backward is not None else fp8_backward_mode())
        o, lse = _dense_op(*args[:-1], True, mode, bool(deterministic))
        return o, lse if return_lse else _no_lse(q)
    if _eager_direct(q, k, v, out):
        return _dense_impl(*args, out)
    if out is None:
        return _dense_op(*args)
    return out, _dense_out_op(*args, out)


def paged_fwd(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    *,
    cu_seqlens_q=None,
    max_seqlen_q=None,
    softmax_scale,
    causal,
    window_size,
    softcap,
    q_descale,
    k_descale,
    v_descale,
    k_cache_scales=None,
    v_cache_scales=None,
    out_scale=None,
    out_dtype=None,
    out=None,
    num_splits=0,
    return_lse=True,
    split_workspace=None,
):
    """Attention over a paged cache (chunked prefill, mixed batches, decode) through
    ``fp8attn::paged_fwd[_out]``.

    Parameters
    ----------
    q : (batch, seqlen_q, nheads_q, headdim) or varlen (total_q, nheads_q, headdim) with cu_seqlens_q.
    k_cache, v_cache : (num_blocks, page_size, nheads_k, headdim[_v]).
    page_table : (batch, max_pages) int32. cache_seqlens : (batch,) int32 (queries' tokens included).
    k_cache_scales, v_cache_scales : optional (num_blocks, page_size, nheads_k) float32.
    return_lse : False: the kernel writes no LSE and ``lse`` is an empty float32 tensor.
    split_workspace : optional ``(out_partial, lse_partial)`` of ``paged.split_workspace`` (float32, at least
        the call's split count), written instead of partials allocated per call when the keys are split.

    Returns
    -------
    (out, lse) : out (..., nheads_q, headdim_v); lse float32 (batch, nheads_q, seqlen_q) or (nheads_q, total_q),
        or (0,) without ``return_lse``.
    """
    args = (
        q,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        cu_seqlens_q,
        max_seqlen_q,
        float(softmax_scale),
        bool(causal),
        window_size[0],
        window_size[1],
        float(softcap),
        q_descale,
        k_descale,
        v_descale,
        k_cache_scales,
        v_cache_scales,
        out_scale,
        out_dtype,
        int(num_splits),
        bool(return_lse),
    )
    ws = tuple(split_workspace) if split_workspace is not None else (None, None)
    if _needs_grad(q, k_cache, v_cache):  # (the workspace is scratch: the functional op allocates its own)
        return _no_backward(
            "paged_fwd", _paged_op(*args) if out is None else None, (q, k_cache, v_cache), out is not None
        )
    if _eager_direct(q, k_cache, v_cache, out, *ws):
        return _paged_impl(*args, out, *ws)
    if out is None and split_workspace is None:
        return _paged_op(*args)
    if out is None:  # the workspace is a mutable argument of the out variant only
        oshape = dense_out_shapes(q, v_cache, cu_seqlens_q is not None)[0]
        out = q.new_empty(oshape, dtype=_out_dtype(q, out_dtype, out_scale))
    return out, _paged_out_op(*args, out, *ws)


def combine(out_partial, lse_partial, *, out=None, out_dtype=None, out_scale=None):
    """Merge split-KV partials through ``fp8attn::combine[_out]``.

    Parameters
    ----------
    out_partial : (num_splits, ..., headdim) float32; lse_partial : (num_splits, ...) float32.

    Returns
    -------
    (out, lse) : out (..., headdim) in out_dtype (e4m3fn with out_scale); lse (...) float32.
    """
    if _needs_grad(out_partial):
        return _no_backward(
            "combine",
            _combine_op(out_partial, lse_partial, out_scale, out_dtype) if out is None else None,
            (out_partial,),
            out is not None,
        )
    if _eager_direct(out_partial, lse_partial, out):
        return _combine_impl(out_partial, lse_partial, out_scale, out_dtype, out)
    if out is None:
        return _combine_op(out_partial, lse_partial, out_scale, out_dtype)
    return out, _combine_out_op(out_partial, lse_partial, out_scale, out)


def write_kv_cache(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    *,
    k_descale=None,
    v_descale=None,
    token_seq_idx=None,
    k_cache_scales=None,
    v_cache_scales=None,
):
    """Scatter (and quantize) new tokens into a paged cache in place (``fp8attn::write_kv_cache``).
    Negative slots are skipped.

    Parameters
    ----------
    k, v : (num_tokens, nheads_k, headdim[_v]) 16/32-bit. k_cache, v_cache : (num_blocks, page_size,
    nheads_k, headdim[_v]), mutated. slot_mapping : (num_tokens,) int32/int64.
    """
    _write_kv_cache_op(
        k, v, k_cache, v_cache, slot_mapping, k_descale, v_descale, token_seq_idx, k_cache_scales, v_cache_scales
    )


def append_kv_cache(
    k,
    v,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    *,
    cu_seqlens_k_new=None,
    k_descale=None,
    v_descale=None,
    k_cache_scales=None,
    v_cache_scales=None,
):
    """Append new tokens after each sequence's cached ones, quantized as ``write_kv_cache`` does, in place
    (``fp8attn::append_kv_cache``: on a GPU one launch that derives the slots itself).

    Parameters
    ----------
    k, v : (batch, seqlen_new, nheads_k, headdim[_v]) or varlen (total_new, nheads_k, headdim[_v]) with
        cu_seqlens_k_new (batch + 1,) int32; 16/32-bit. k_cache, v_cache : (num_blocks, page_size, nheads_k,
        headdim[_v]), mutated. page_table : (batch, max_pages) int32. cache_seqlens : (batch,) int32, the
        tokens already cached: sequence b's i-th new token goes to position cache_seqlens[b] + i.
    k_descale, v_descale : float32 per-tensor or (batch, nheads_k) / (batch, 1) static descales, or None (1).
    k_cache_scales, v_cache_scales : (num_blocks, page_size, nheads_k) dynamic per-token-head scales (mutated).

    Tokens at a position outside the row's pages (negative, or >= max_pages * page_size) or in a page id
    outside [0, num_blocks) are not written.

    Returns
    -------
    (batch,) int32: the lengths after the append (cache_seqlens + each sequence's new tokens).
    """
    args = (
        k,
        v,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        cu_seqlens_k_new,
        k_descale,
        v_descale,
        k_cache_scales,
        v_cache_scales,
    )
    if _eager_direct(*args):
        return _append_kv_cache_impl(*args)
    return _append_kv_cache_op(*args)


def quantize_fp8(x, granularity, nheads_k, rotate, seed, block_t, seq_major, use_triton):
    """Dynamic FP8 quantization of one of ``quantize_qkv``'s inputs (``fp8attn::quantize_fp8``; see
    ``quant.quantize_one`` for the arguments). Returns ``(x8, descale)``."""
    args = (x, granularity, nheads_k, rotate, seed, block_t, seq_major, use_triton)
    if not _needs_grad(x) and _eager_direct(x):
        return _quantize_fp8_impl(*args)
    return OPS["quantize_fp8"](*args)


def quant_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor FP8 quantization ``clamp(x * (1 / scale), -448, 448)`` -> e4m3fn
    (``fp8attn::quant_fp8_static``; the same rounding as the fused ``out_scale=`` epilogue).

    Parameters
    ----------
    x : any shape, bf16 / fp16 / fp32. scale : float32 tensor with one element.

    Returns
    -------
    float8_e4m3fn tensor of x's shape (contiguous).
    """
    return OPS["quant_fp8_static"](x, scale)


def scaled_bmm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16):
    """Batched FP8 matmul with per-batch / per-row / per-column scales (``fp8attn::scaled_bmm``).
    See :mod:`fp8attn.scaled_bmm` for the accepted scale shapes."""
    for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(t, torch.Tensor):  # (the dispatcher's own message is a RuntimeError)
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}. Pass {name} as a tensor.")
    # (mixed with a meta tensor the dispatcher would run the fake)
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b)
    return OPS["scaled_bmm"](a, b, scale_a, scale_b, out_dtype)
