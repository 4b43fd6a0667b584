"""FlashAttention-3-compatible public API (``flash_attn_interface``), extended for FP8 serving.

FA3's names, argument order and defaults are kept exactly; extensions are keyword-only and come
after FA3's parameters:

* ``out=``       preallocated output (CUDA-graph friendly), written in place and returned.
* ``out_dtype=`` bf16 (default for FP8 inputs), fp16 or fp32.
* ``out_scale=`` static per-tensor FP8 output scale (float32, one element): the kernel writes
  ``saturate(out / out_scale)`` in e4m3fn directly.
* ``k_cache_scales=`` / ``v_cache_scales=`` per-token-head KV-cache descales
  (num_blocks, page_size, nheads_k) float32 (``flash_attn_with_kvcache``).
* ``validate=`` run the checks that read tensor values on GPU tensors too (they sync the device).

Every function runs on CPU tensors through the reference path with the same semantics.
Unsupported FA3 arguments raise NotImplementedError naming them; none is silently ignored.

Each entry point has one shape: a named ``_validate_*`` helper runs every check before anything is
written and returns what the body needs (``_DenseCall``, ``_CachePlan``), then a short body dispatches
to ``fp8attn.ops`` (``fp8attn.local_attention`` for ``attention_chunk``). Eager CUDA calls first look
up a plan cached per call signature (``fp8attn.plan``): a repeated call skips the Python checks its
signature already passed.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from . import _checks as C
from . import local_attention, ops, plan
from .capability import kernel_for
from .paged_cache import slot_mapping_for
from .paged_cache import token_rows as _token_rows
from .quant import expand_descale, is_fp8
from .rotary import apply_rotary

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "get_scheduler_metadata",
    "write_kv_cache",
]


def _resolve_window(causal, window_size):
    C.check_window(window_size)
    left, right = window_size
    if causal:  # FA3: causal is a window whose right edge is the diagonal
        right = 0
    return (int(left), int(right))


def _unsupported_qv(qv):
    C.unsupported("qv", qv, None, "the extra qv head (MLA absorbed form) is not implemented")


def _check_out_args(out, out_dtype, out_scale, oshape, q):
    C.check_out_dtype(out_dtype)
    C.check_out_scale(out_scale, q.device, out_dtype)
    dt = ops._out_dtype(q, out_dtype, out_scale)
    C.check_out(out, oshape, dt, q.device)


def _check_split_workspace(split_workspace, num_splits, chunk, q, nheads_q, headdim_v):
    """``split_workspace``: None, or ``(out_partial, lse_partial)`` of ``fp8attn.split_workspace`` for this
    q with at least ``num_splits`` (explicit, >= 1) splits."""
    if split_workspace is None:
        return None
    fix = (
        f"Allocate it once with fp8attn.split_workspace(q, num_splits, {headdim_v}) and pass an explicit "
        "num_splits (or scheduler_metadata)."
    )
    if not isinstance(split_workspace, (tuple, list)) or len(split_workspace) != 2:
        raise TypeError(
            f"split_workspace: expected a tuple (out_partial, lse_partial), got {type(split_workspace).__name__}. {fix}"
        )
    if num_splits < 1:
        raise ValueError(
            f"split_workspace: expected an explicit num_splits >= 1 with a workspace (0 lets the "
            f"heuristic choose a count the workspace may not hold), got num_splits={num_splits}. {fix}"
        )
    if chunk:
        raise ValueError(
            f"split_workspace: not supported with attention_chunk={chunk} (its calls run over "
            "rearranged query rows). Drop split_workspace."
        )
    op, lp = split_workspace
    lead = (*q.shape[:-2], nheads_q)
    for name, t, tail in (("out_partial", op, (headdim_v,)), ("lse_partial", lp, ())):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"split_workspace: expected {name} to be a torch.Tensor, got {type(t).__name__}. {fix}")
        ok = (
            t.dim() == len(lead) + len(tail) + 1
            and tuple(t.shape[1:]) == lead + tail
            and t.shape[0] >= num_splits
            and t.dtype == torch.float32
            and t.is_contiguous()
        )
        if not ok:
            want = f"contiguous float32 (>= {num_splits}, {', '.join(map(str, lead + tail))})"
            raise ValueError(
                f"split_workspace: expected {name} {want}, got {t.dtype} {tuple(t.shape)}"
                f"{'' if t.is_contiguous() else ' (not contiguous)'}. {fix}"
            )
        if t.device != q.device:
            raise ValueError(f"split_workspace: expected {name} on {q.device}, got {t.device}. Move it to {q.device}.")
    return op, lp


def _descales(q_descale, k_descale, v_descale, batch, nheads_k, device, validate, q_dtype, kv_dtype):
    """FA3's (batch, nheads_k) descales (or their broadcasts), each for an FP8 tensor only, as expanded views."""
    for name, d, what, dt in (
        ("q_descale", q_descale, "q", q_dtype),
        ("k_descale", k_descale, "k", kv_dtype),
        ("v_descale", v_descale, "v", kv_dtype),
    ):
        C.check_descale_kind(name, d, what, dt)
        C.check_descale(name, d, batch, nheads_k, device)
        C.check_descale_values(name, d, validate)
    return (
        expand_descale(q_descale, batch, nheads_k, device),
        expand_descale(k_descale, batch, nheads_k, device),
        expand_descale(v_descale, batch, nheads_k, device),
    )


def _block_descales(
    q_descale, k_descale, v_descale, block, batch, nheads_q, nheads_k, seqlen_q, seqlen_k, device, validate, dtype
):
    """Validate per-block Q/K descales (batch, heads, cdiv(seqlen, block)); V stays per (batch, KV head)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 16 or block > 256 or block & (block - 1):
        raise ValueError(
            f"descale_block_size: expected a power of two in [16, 256], got {C.describe(block)}. "
            "Use the block_size passed to fp8attn.quantize_qkv(granularity='per_block')."
        )
    for name, d, h, s in (("q_descale", q_descale, nheads_q, seqlen_q), ("k_descale", k_descale, nheads_k, seqlen_k)):
        C.check_descale_kind(name, d, name[0], dtype)
        want = (batch, h, -(-s // block))
        if not isinstance(d, torch.Tensor) or tuple(d.shape) != want or d.dtype != torch.float32:
            got = f"{d.dtype} {tuple(d.shape)}" if isinstance(d, torch.Tensor) else C.describe(d)
            raise ValueError(
                f"{name}: expected float32 {want} (batch, heads, cdiv(seqlen, {block})) with "
                f"descale_block_size={block}, got {got}. Pass the per-block descales from quantize_qkv."
            )
        if d.device != device:
            raise ValueError(f"{name}: expected device {device}, got {d.device}. Move {name} to {device}.")
        C.check_descale_values(name, d, validate)
    C.check_descale_kind("v_descale", v_descale, "v", dtype)
    C.check_descale("v_descale", v_descale, batch, nheads_k, device)
    C.check_descale_values("v_descale", v_descale, validate)
    return q_descale, k_descale, expand_descale(v_descale, batch, nheads_k, device)


def _check_fp8_backward(fp8_backward):
    if fp8_backward is not None:
        ops.check_bwd_mode("fp8_backward", fp8_backward)


def _check_attention_chunk(attention_chunk):
    if isinstance(attention_chunk, bool) or not isinstance(attention_chunk, int) or attention_chunk < 0:
        raise ValueError(
            f"attention_chunk: expected an int >= 0 (0 = no chunks), got {C.describe(attention_chunk)}. "
            "Pass the chunk length in tokens."
        )
    return attention_chunk


def _validate_options(
    q, oshape, softmax_scale, causal, window_size, softcap, out, out_dtype, out_scale, validate, flags=()
):
    """The Python-valued options every attention entry point shares, checked without a tensor op (plus the
    out_scale value where values are checked): the attention keywords of ``ops.dense_fwd`` / ``ops.paged_fwd``.
    ``flags``: further ``(name, value)`` bools (pack_gqa may also be None)."""
    C.check_flag("causal", causal)
    C.check_flag("validate", validate)
    for name, val in flags:
        C.check_flag(name, val, allow_none=name == "pack_gqa")
    _check_out_args(out, out_dtype, out_scale, oshape, q)
    C.check_out_scale_values(out_scale, validate)
    return dict(
        softmax_scale=C.check_softmax_scale(softmax_scale, q.shape[-1]),
        causal=bool(causal),
        window_size=_resolve_window(causal, window_size),
        softcap=C.check_softcap(softcap),
        out_scale=out_scale,
        out_dtype=out_dtype,
        out=out,
    )


def _new_plan(key, tensors, make, *args):
    """After the validation of a call with a plan ``key``: the plan ``make(*args)`` builds (stored under
    ``key``), or None (the call runs the checked dispatch; so does any call that may not take a plan)."""
    if not plan.eager_ok(*tensors):
        return None
    run = make(*args)
    if run is not None:
        plan.store(key, run)
    return run


class _DenseCall(NamedTuple):
    """What ``_validate_dense`` / ``_validate_varlen`` hand their entry point: the expanded descales
    ``(q, k, v)``, the attention keywords of ``ops.dense_fwd`` and whether ``attention_chunk`` splits the
    call into chunk pieces (``fp8attn.local_attention``)."""

    descales: tuple
    attn: dict
    chunked: bool


def _check_dense_inputs(q, k, v, qv, attention_chunk, num_splits, sm_margin, ndim, no_splits_why):
    """The checks that open both dense validations: the arguments not supported, then q, k and v as
    ``ndim``-D tensors. Returns the attention chunk."""
    _unsupported_qv(qv)
    chunk = _check_attention_chunk(attention_chunk)
    C.unsupported("num_splits", num_splits, 1, no_splits_why)
    C.unsupported("sm_margin", sm_margin, 0)
    for name, t in (("q", q), ("k", k), ("v", v)):
        C.check_tensor(name, t, ndim=ndim, allow_seq_contiguous=name == "v")
    return chunk


def _dense_options(
    q,
    oshape,
    softmax_scale,
    causal,
    window_size,
    softcap,
    pack_gqa,
    deterministic,
    return_attn_probs,
    out,
    out_dtype,
    out_scale,
    validate,
):
    """``_validate_options`` with the dense entry points' flags: the attention keywords of ``ops.dense_fwd``."""
    attn = _validate_options(
        q,
        oshape,
        softmax_scale,
        causal,
        window_size,
        softcap,
        out,
        out_dtype,
        out_scale,
        validate,
        (("pack_gqa", pack_gqa), ("deterministic", deterministic), ("return_attn_probs", return_attn_probs)),
    )
    attn.update(pack_gqa=pack_gqa, return_lse=bool(return_attn_probs))
    return attn


def _dense_call(descales, attn, chunked, fp8_backward, deterministic):
    """The last check of both dense validations (``fp8_backward``) and their plan."""
    _check_fp8_backward(fp8_backward)
    attn.update(fp8_backward=fp8_backward, deterministic=bool(deterministic))
    return _DenseCall(descales, attn, chunked)


def _dense_plan(q, k, v, out, out_scale, c):
    """The eager plan of a validated 4-D call (``c``: its ``_DenseCall``): the Hopper kernel's single launch,
    else the kernel-level launcher's, or None (the reference path)."""
    qd, kd, vd = c.descales
    attn = c.attn
    return plan.dense_tma_plan(
        q,
        k,
        v,
        qd,
        kd,
        vd,
        out,
        out_scale,
        softmax_scale=attn["softmax_scale"],
        causal=attn["causal"],
        window_size=attn["window_size"],
        softcap=attn["softcap"],
        out_dtype=attn["out_dtype"],
        return_lse=attn["return_lse"],
    ) or plan.dense_plan(q, k, v, batch=q.shape[0], attn=attn, varlen=False, return_lse=attn["return_lse"])


def _validate_dense(
    q,
    k,
    v,
    softmax_scale,
    causal,
    qv,
    q_descale,
    k_descale,
    v_descale,
    window_size,
    attention_chunk,
    softcap,
    num_splits,
    pack_gqa,
    deterministic,
    sm_margin,
    return_attn_probs,
    out,
    out_dtype,
    out_scale,
    descale_block_size,
    validate,
    fp8_backward,
):
    """Every check of :func:`flash_attn_func` (before anything is written). Returns its ``_DenseCall``."""
    chunk = _check_dense_inputs(
        q,
        k,
        v,
        qv,
        attention_chunk,
        num_splits,
        sm_margin,
        4,
        "the dense kernel does not split KV; use flash_attn_with_kvcache for split-KV",
    )
    C.check_same_device(q=q, k=k, v=v)
    C.check_qkv_dtypes(q, k, v)
    C.check_heads(q, k, v)
    b, sq, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or v.shape[1] != k.shape[1]:
        raise ValueError(
            f"k/v: expected batch {b} and matching seqlen_k, got k {tuple(k.shape)} v {tuple(v.shape)}. "
            "Give q, k and v the same batch and k, v the same seqlen."
        )
    hk, sk = k.shape[2], k.shape[1]
    attn = _dense_options(
        q,
        (b, sq, hq, v.shape[-1]),
        softmax_scale,
        causal,
        window_size,
        softcap,
        pack_gqa,
        deterministic,
        return_attn_probs,
        out,
        out_dtype,
        out_scale,
        validate,
    )
    chunked = chunk > 0 and local_attention.splits_into_chunks(chunk, sq, sk)
    if descale_block_size is None:
        descales = _descales(q_descale, k_descale, v_descale, b, hk, q.device, validate, q.dtype, k.dtype)
    else:
        descales = _block_descales(
            q_descale, k_descale, v_descale, descale_block_size, b, hq, hk, sq, sk, q.device, validate, q.dtype
        )
        if chunked:
            raise NotImplementedError(
                "attention_chunk with descale_block_size is not supported: pass per-(batch, "
                "head) descales (quantize_qkv granularity='per_head') with attention_chunk."
            )
    return _dense_call(descales, attn, chunked, fp8_backward, deterministic)


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    *,
    out=None,
    out_dtype=None,
    out_scale=None,
    descale_block_size=None,
    validate=False,
    fp8_backward=None,
):
    """Dense attention.

    Parameters
    ----------
    q : (batch, seqlen_q, nheads_q, headdim), float8_e4m3fn / float8_e5m2 / bf16 / fp16 / fp32.
    k : (batch, seqlen_k, nheads_k, headdim), same dtype as q. nheads_q % nheads_k == 0.
    v : (batch, seqlen_k, nheads_k, headdim_v), same dtype as q; the last dim contiguous, or the
        sequence dim (memory order (batch, nheads_k, headdim_v, seqlen_k), ``quantize_qkv``'s v8): that
        is the K-major operand of Hopper's FP8 P @ V, which FP8 V in any other layout is first copied
        into on CUDA (one transpose pass over V).
    softmax_scale : finite float >= 0, default 1/sqrt(headdim).
    causal : bool (a non-bool is a TypeError), bottom-right aligned (query i sees keys <= i + seqlen_k - seqlen_q).
    q_descale, k_descale, v_descale : float32 (batch, nheads_k), or per-tensor (), (1,), (1, 1), or
        per-sequence (batch, 1); finite and > 0. Dequantized value = fp8 * descale. Default 1. A descale
        describes an FP8 tensor: one given for a 16/32-bit input is refused.
    window_size : (left, right) ints >= -1, -1 = unbounded; bottom-right aligned like causal.
    softcap : finite float >= 0, logits -> softcap * tanh(logits / softcap) when > 0.
    num_splits : must be 1 (the dense kernel does not split KV).
    pack_gqa : None/False/True, a scheduling hint for GQA (the same result either way).
    deterministic : every fp8attn forward is deterministic (bit-identical reruns); passed to the backward
        (bit-identical gradients on reruns).
    sm_margin : must be 0.
    return_attn_probs : when True also return the LSE (FA3 semantics; no probabilities).
    attention_chunk : int >= 0 (FA3 semantics); > 0: query i (at key position p = i + seqlen_k - seqlen_q)
        sees only keys of its chunk, ``p // chunk * chunk <= j < (p // chunk + 1) * chunk``, intersected with
        the causal / window masks. Runs as a varlen call with one sequence per (batch, chunk).
    qv : not supported yet; a non-default value raises NotImplementedError.
    out : optional preallocated output, written in place and returned.
    out_dtype : bf16 / fp16 / fp32 output. out_scale : float32 one-element static per-tensor scale;
        the output is then e4m3fn ``saturate(out / out_scale)``, written by the kernel.
    descale_block_size : per-block Q/K scales (``quantize_qkv(granularity="per_block")``): q_descale
        float32 (batch, nheads_q, cdiv(seqlen_q, block)), k_descale (batch, nheads_k, cdiv(seqlen_k, block));
        v_descale stays (batch, nheads_k). A power of two in [16, 256]. Varlen: batch 1 over packed tokens.
    validate : also run the value checks (descale and out_scale values) on GPU tensors (they sync the device;
        docs/api.md, "Validation and the nothing-lost guarantee").
    fp8_backward : "dequantized" / "fp8", the precision of this call's backward; None: the process default
        (``fp8attn.set_fp8_backward``). Differentiable when q, k or v requires grad (docs/api.md "Training
        (backward)"); gradients of FP8 leaves are cast by autograd to the leaf's FP8 dtype (use
        ``fp8attn.attention`` to train from 16-bit tensors).

    Returns
    -------
    out : (batch, seqlen_q, nheads_q, headdim_v), bf16 for FP8 inputs (``out_dtype`` overrides), the
        input dtype for 16/32-bit inputs, e4m3fn with ``out_scale``.
    lse : (batch, nheads_q, seqlen_q) float32 natural-log (only with return_attn_probs). Rows that see
        no key give out = 0 and lse = -inf.
    """
    tensors = (q, k, v, q_descale, k_descale, v_descale, out, out_scale)
    key = run = None
    if (
        type(attention_chunk) is int
        and attention_chunk == 0
        and descale_block_size is None
        and qv is None
        and plan.plannable(q, validate, causal, return_attn_probs, deterministic, window_size)
    ):
        key, run = plan.find(
            "dense",
            tensors,
            (
                softmax_scale,
                causal,
                window_size,
                softcap,
                num_splits,
                pack_gqa,
                deterministic,
                sm_margin,
                return_attn_probs,
                out_dtype,
                fp8_backward,
            ),
        )
        if run is not None:
            return run(*tensors)
    c = _validate_dense(
        q,
        k,
        v,
        softmax_scale,
        causal,
        qv,
        q_descale,
        k_descale,
        v_descale,
        window_size,
        attention_chunk,
        softcap,
        num_splits,
        pack_gqa,
        deterministic,
        sm_margin,
        return_attn_probs,
        out,
        out_dtype,
        out_scale,
        descale_block_size,
        validate,
        fp8_backward,
    )
    if key is not None and (run := _new_plan(key, tensors, _dense_plan, q, k, v, out, out_scale, c)):
        return run(*tensors)
    qd, kd, vd = c.descales
    if c.chunked:
        o, lse = local_attention.chunked_dense(q, k, v, attention_chunk, qd, kd, vd, **c.attn)
    else:
        o, lse = ops.dense_fwd(
            q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, descale_block=descale_block_size or 0, **c.attn
        )
    return (o, lse) if return_attn_probs else o


def _validate_qkvpacked(qkv, num_heads_q):
    """The checks of :func:`flash_attn_qkvpacked_func`'s packing (the rest are :func:`flash_attn_func`'s).
    Returns the ``(q, k, v)`` views of ``qkv``."""
    C.check_tensor("qkv", qkv, ndim=(4, 5))
    if qkv.dim() == 5:
        if qkv.shape[2] != 3 or num_heads_q is not None:
            raise ValueError(
                f"qkv: expected (batch, seqlen, 3, nheads, headdim) without num_heads_q, got shape "
                f"{tuple(qkv.shape)} and num_heads_q={C.describe(num_heads_q)}. Stack q, k, v on dim 2, "
                "or pass the 4-D form with num_heads_q."
            )
        return qkv.unbind(dim=2)
    total = qkv.shape[2]
    if not isinstance(num_heads_q, int) or not 0 < num_heads_q < total or (total - num_heads_q) % 2:
        raise ValueError(
            f"num_heads_q: expected an int with qkv's {total} heads = num_heads_q + 2 * nheads_k, got "
            f"{C.describe(num_heads_q)}. Pass the number of query heads packed first."
        )
    hk = (total - num_heads_q) // 2
    return qkv.split([num_heads_q, hk, hk], dim=2)


def flash_attn_qkvpacked_func(
    qkv,
    softmax_scale=None,
    causal=False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    deterministic=False,
    num_heads_q=None,
    sm_margin=0,
    return_attn_probs=False,
    *,
    out=None,
    out_dtype=None,
    out_scale=None,
    validate=False,
    fp8_backward=None,
):
    """Dense attention over packed Q/K/V (FA3's ``flash_attn_qkvpacked_func``): :func:`flash_attn_func` on views
    of ``qkv``, no copy.

    Parameters
    ----------
    qkv : (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, nheads_q + 2 * nheads_k, headdim) with
        ``num_heads_q`` (GQA: the query heads, then the key heads, then the value heads). Any dtype
        :func:`flash_attn_func` takes; FP8 with the descales.
    num_heads_q : the query heads of a 4-D ``qkv``; must be None for a 5-D one.
    fp8_backward : as :func:`flash_attn_func` (the gradient lands in ``qkv``).

    The other arguments are :func:`flash_attn_func`'s.

    Returns
    -------
    out : (batch, seqlen, nheads_q, headdim), as :func:`flash_attn_func`.
    lse : (batch, nheads_q, seqlen) float32, only with return_attn_probs.
    """
    C.check_tensor("qkv", qkv, ndim=(4, 5))
    if qkv.dim() == 5:
        if qkv.shape[2] != 3 or num_heads_q is not None:
            raise ValueError(
                f"qkv: expected (batch, seqlen, 3, nheads, headdim) without num_heads_q, got shape "
                f"{tuple(qkv.shape)} and num_heads_q={C.describe(num_heads_q)}. Stack q, k, v on dim 2, "
                "or pass the 4-D form with num_heads_q."
            )
        q, k, v = qkv.unbind(dim=2)
    else:
        total = qkv.shape[2]
        if not isinstance(num_heads_q, int) or not 0 < num_heads_q < total or (total - num_heads_q) % 2:
            raise ValueError(
                f"num_heads_q: expected an int with qkv's {total} heads = num_heads_q + 2 * nheads_k, got "
                f"{C.describe(num_heads_q)}. Pass the number of query heads packed first."
            )
        hk = (total - num_heads_q) // 2
        q, k, v = qkv.split([num_heads_q, hk, hk], dim=2)
    return flash_attn_func(
        q,
        k,
        v,
        softmax_scale,
        causal,
        None,
        q_descale,
        k_descale,
        v_descale,
        window_size,
        attention_chunk,
        softcap,
        1,
        None,
        deterministic,
        sm_margin,
        return_attn_probs,
        out=out,
        out_dtype=out_dtype,
        out_scale=out_scale,
        validate=validate,
        fp8_backward=fp8_backward,
    )


def _validate_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q,
    seqused_k,
    softmax_scale,
    causal,
    qv,
    q_descale,
    k_descale,
    v_descale,
    window_size,
    attention_chunk,
    softcap,
    num_splits,
    pack_gqa,
    deterministic,
    sm_margin,
    return_attn_probs,
    out,
    out_dtype,
    out_scale,
    descale_block_size,
    validate,
    fp8_backward,
):
    """Every check of :func:`flash_attn_varlen_func` (before anything is written). Returns its ``_DenseCall``."""
    chunk = _check_dense_inputs(
        q, k, v, qv, attention_chunk, num_splits, sm_margin, 3, "the dense kernel does not split KV"
    )
    C.check_same_device(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k
    )
    C.check_qkv_dtypes(q, k, v)
    C.check_heads(q, k, v)
    C.check_leading_dims("k", k, "v", v, 1, "token count (total_k)")
    C.check_flag("validate", validate)
    C.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, validate=validate, total=q.shape[0], total_name="q")
    b = cu_seqlens_q.numel() - 1
    C.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch=b, validate=validate, total=k.shape[0], total_name="k")
    C.check_max_seqlen("max_seqlen_q", max_seqlen_q, "cu_seqlens_q", cu_seqlens_q, validate)
    C.check_max_seqlen("max_seqlen_k", max_seqlen_k, "cu_seqlens_k", cu_seqlens_k, validate)
    C.check_seqused("seqused_q", seqused_q, b, cu_seqlens_q, validate)
    C.check_seqused("seqused_k", seqused_k, b, cu_seqlens_k, validate)
    hk = k.shape[1]
    attn = _dense_options(
        q,
        (q.shape[0], q.shape[1], v.shape[-1]),
        softmax_scale,
        causal,
        window_size,
        softcap,
        pack_gqa,
        deterministic,
        return_attn_probs,
        out,
        out_dtype,
        out_scale,
        validate,
    )
    if descale_block_size is None:
        descales = _descales(q_descale, k_descale, v_descale, b, hk, q.device, validate, q.dtype, k.dtype)
    else:
        qd, kd, _ = _block_descales(
            q_descale,
            k_descale,
            None,
            descale_block_size,
            1,
            q.shape[1],
            hk,
            q.shape[0],
            k.shape[0],
            q.device,
            validate,
            q.dtype,
        )
        C.check_descale_kind("v_descale", v_descale, "v", v.dtype)
        C.check_descale("v_descale", v_descale, b, hk, q.device)
        C.check_descale_values("v_descale", v_descale, validate)
        descales = qd, kd, expand_descale(v_descale, b, hk, q.device)
    if chunk:
        for name, val in (
            ("seqused_q", seqused_q),
            ("seqused_k", seqused_k),
            ("descale_block_size", descale_block_size),
        ):
            if val is not None:
                raise NotImplementedError(
                    f"attention_chunk with {name} is not supported: drop {name} (trim the "
                    "sequences in cu_seqlens instead; per-(batch, head) descales)."
                )
    return _dense_call(descales, attn, bool(chunk), fp8_backward, deterministic)


def _varlen_plan(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, c):
    """The eager plan of a validated varlen call (``c``: its ``_DenseCall``): the kernel-level launcher's, or
    None (the reference path)."""
    return plan.dense_plan(
        q,
        k,
        v,
        batch=cu_seqlens_q.numel() - 1,
        attn=c.attn,
        varlen=True,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        return_lse=c.attn["return_lse"],
    )


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
    *,
    out=None,
    out_dtype=None,
    out_scale=None,
    descale_block_size=None,
    validate=False,
    fp8_backward=None,
):
    """Variable-length attention over packed sequences.

    Parameters
    ----------
    q : (total_q, nheads_q, headdim); k : (total_k, nheads_k, headdim); v : (total_k, nheads_k, headdim_v),
        last dim or token dim contiguous (``quantize_qkv``'s v8: no transpose pass, as flash_attn_func).
    cu_seqlens_q, cu_seqlens_k : (batch + 1,) int32 non-decreasing offsets starting at 0.
    max_seqlen_q, max_seqlen_k : int upper bounds of the per-sequence lengths.
    seqused_q, seqused_k : optional (batch,) int32: tokens actually used per sequence (<= its length).
    Other arguments as in :func:`flash_attn_func` (``attention_chunk`` too, without seqused_q/k and per-block
    descales; ``fp8_backward`` and ``deterministic`` for the backward, which takes no seqused_q/k); descales
    are (batch, nheads_k). With
    ``descale_block_size`` the per-block Q/K descales run over the packed token index:
    q_descale (1, nheads_q, cdiv(total_q, block)), k_descale (1, nheads_k, cdiv(total_k, block)).

    Returns
    -------
    out : (total_q, nheads_q, headdim_v); lse : (nheads_q, total_q) float32 (with return_attn_probs).
    """
    tensors = (
        q,
        k,
        v,
        q_descale,
        k_descale,
        v_descale,
        out,
        out_scale,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_q,
        seqused_k,
    )
    key = run = None
    if (
        type(attention_chunk) is int
        and attention_chunk == 0
        and descale_block_size is None
        and qv is None
        and plan.plannable(q, validate, causal, return_attn_probs, deterministic, window_size)
    ):
        key, run = plan.find(
            "varlen",
            tensors,
            (
                max_seqlen_q,
                max_seqlen_k,
                softmax_scale,
                causal,
                window_size,
                softcap,
                num_splits,
                pack_gqa,
                deterministic,
                sm_margin,
                return_attn_probs,
                out_dtype,
                fp8_backward,
            ),
        )
        if run is not None:
            return run(*tensors)
    c = _validate_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        seqused_q,
        seqused_k,
        softmax_scale,
        causal,
        qv,
        q_descale,
        k_descale,
        v_descale,
        window_size,
        attention_chunk,
        softcap,
        num_splits,
        pack_gqa,
        deterministic,
        sm_margin,
        return_attn_probs,
        out,
        out_dtype,
        out_scale,
        descale_block_size,
        validate,
        fp8_backward,
    )
    if key is not None and (
        run := _new_plan(key, tensors, _varlen_plan, q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, c)
    ):
        return run(*tensors)
    qd, kd, vd = c.descales
    if c.chunked:
        o, lse = local_attention.chunked_varlen(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            int(max_seqlen_q),
            int(max_seqlen_k),
            attention_chunk,
            qd,
            kd,
            vd,
            **c.attn,
        )
    else:
        o, lse = ops.dense_fwd(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            seqused_q=seqused_q,
            seqused_k=seqused_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            q_descale=qd,
            k_descale=kd,
            v_descale=vd,
            descale_block=descale_block_size or 0,
            **c.attn,
        )
    return (o, lse) if return_attn_probs else o


def _metadata_splits(scheduler_metadata, num_splits):
    """The split count a ``get_scheduler_metadata`` result sets (its length); an explicit ``num_splits`` must agree."""
    if (
        not isinstance(scheduler_metadata, torch.Tensor)
        or scheduler_metadata.dim() != 1
        or scheduler_metadata.dtype != torch.int32
    ):
        got = (
            f"{scheduler_metadata.dtype} {tuple(scheduler_metadata.shape)}"
            if isinstance(scheduler_metadata, torch.Tensor)
            else type(scheduler_metadata).__name__
        )
        raise ValueError(
            f"scheduler_metadata: expected the 1-D int32 tensor of fp8attn.get_scheduler_metadata, got "
            f"{got}. Pass that function's result, or None."
        )
    n = scheduler_metadata.shape[0]
    if num_splits not in (0, n):
        raise ValueError(
            f"num_splits: expected 0 or {n} (the split count of scheduler_metadata), got "
            f"{C.describe(num_splits)}. Pass one of them."
        )
    return n


def _leftpad_view(k_cache, v_cache, rows, cache_seqlens, cache_leftpad, batch, value_checks):
    """A contiguous cache with left padding as a paged cache of one-token pages (FA3's ``cache_leftpad``).

    Sequence ``b``'s keys are rows ``cache_leftpad[b] .. cache_seqlens[b]`` (+ new tokens) of its cache row
    ``rows[b, 0]``; its page table lists exactly those slots, so lengths, masks and appends count from the
    first live token. Returns ``(k_cache, v_cache, page_table, cache_seqlens)``: views of the same memory
    (appends land in the caller's tensors) and the lengths after the pad."""
    C.check_int32("cache_leftpad", cache_leftpad, ndim=1)
    if cache_leftpad.numel() != batch:
        raise ValueError(
            f"cache_leftpad: expected {batch} entries (batch), got {cache_leftpad.numel()}. "
            "Give each sequence its first live cache row."
        )
    if value_checks and batch:
        bad = (cache_leftpad < 0) | (cache_leftpad > cache_seqlens)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"cache_leftpad: expected 0 <= cache_leftpad <= cache_seqlens per sequence, got "
                f"{int(cache_leftpad[b])} with cache_seqlens {int(cache_seqlens[b])} for sequence {b}. "
                "The pad precedes the cached tokens."
            )
    seqlen = k_cache.shape[1]
    views = []
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        token = c.stride(1) if seqlen > 1 else c.stride(0)  # consecutive tokens of a row, then the next row
        if c.stride(-1) != 1 or c.stride(0) != seqlen * token:
            raise ValueError(
                f"{name}: expected rows of contiguous tokens (stride(0) == seqlen_cache * stride(1), last "
                f"dim contiguous) with cache_leftpad, got strides {tuple(c.stride())}. Allocate the cache "
                "contiguous."
            )
        views.append(
            c.as_strided((c.shape[0] * seqlen, 1, *c.shape[2:]), (token, token, *c.stride()[2:]), c.storage_offset())
        )
    pos = torch.arange(seqlen, device=cache_leftpad.device, dtype=torch.int64)[None, :] + cache_leftpad.long()[:, None]
    # positions outside the row (lengths past it, unchecked on a GPU) get page -1: an append there is skipped, never
    # written over another token of the cache
    page_table = torch.where((pos >= 0) & (pos < seqlen), rows[:, :1].long() * seqlen + pos, -1).to(torch.int32)
    return views[0], views[1], page_table, cache_seqlens - cache_leftpad


def _new_token_slots(page_table, cache_seqlens, ps, batch, seqlen_new=None, cu_seqlens_k_new=None, total_new=None):
    """Slot ids, batch rows and positions among the new tokens, for tokens appended after ``cache_seqlens``."""
    seq, pos_in_new = _token_rows(page_table.device, batch, seqlen_new, cu_seqlens_k_new, total_new)
    if cu_seqlens_k_new is None:
        new_len = torch.full((batch,), seqlen_new, dtype=torch.int32, device=page_table.device)
    else:
        new_len = (cu_seqlens_k_new[1:] - cu_seqlens_k_new[:-1]).to(torch.int32)
    # (tokens past cu_seqlens_k_new[-1] are padding: sequence ``batch``, slot -1)
    rows = seq if cu_seqlens_k_new is None else seq.clamp(max=max(batch - 1, 0))
    slots = slot_mapping_for(page_table, ps, seq, cache_seqlens.long()[rows] + pos_in_new)
    return slots, seq.to(torch.int32), pos_in_new, new_len


def _validate_rotary(
    q, kn, cos, sin, rotary_seqlens, cache_seqlens, seq_idx, pos_in_new, cu_seqlens_q, batch, positional_q, validate
):
    """The checks of FA3's rotary (see flash_attn_with_kvcache) and the rotated positions: ``(q_pos, k_pos)``
    int64 (no host sync), or None without rotary tables."""
    if cos is None and sin is None:
        if rotary_seqlens is not None:
            raise ValueError(
                f"rotary_seqlens: expected None without rotary_cos/rotary_sin, got "
                f"{C.describe(rotary_seqlens)}. Pass the rotary tables too, or drop rotary_seqlens."
            )
        return None
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        C.check_tensor(name, t, ndim=2)
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}. Build the tables in float32.")
    if kn is None:
        raise ValueError(
            "rotary_cos: expected new k/v with rotary tables (the rotation is applied to the new keys "
            "and to q), got k=None. Pass k= and v=, or rotate q yourself."
        )
    if (
        tuple(cos.shape) != tuple(sin.shape)
        or 2 * cos.shape[1] > q.shape[-1]
        or cos.shape[1] % 8 != 0
        or not cos.shape[0]
    ):
        raise ValueError(
            f"rotary_cos: expected (seqlen_ro, rotary_dim / 2) with rotary_dim <= headdim {q.shape[-1]} "
            f"and a multiple of 16, matching rotary_sin; got {tuple(cos.shape)} and {tuple(sin.shape)}."
        )
    if is_fp8(q.dtype):
        raise NotImplementedError(
            "rotary_cos with an FP8 q is not supported: rotate the 16-bit q before quantizing it."
        )
    base = cache_seqlens
    if rotary_seqlens is not None:
        C.check_int32("rotary_seqlens", rotary_seqlens, ndim=1)
        if rotary_seqlens.numel() != batch:
            raise ValueError(
                f"rotary_seqlens: expected {batch} entries (batch), got {rotary_seqlens.numel()}. "
                "Pass one rotary position per sequence."
            )
        base = rotary_seqlens
    # new keys: position base[b] + i (i = index among the sequence's new tokens)
    k_pos = base.long()[seq_idx.long().clamp(max=max(batch - 1, 0))] + pos_in_new
    # queries: base[b] + i when causal / windowed, else base[b] for all of them
    if cu_seqlens_q is None:
        q_seq, q_i = _token_rows(q.device, batch, seqlen=q.shape[1])
    else:
        q_seq, q_i = _token_rows(q.device, batch, cu_seqlens=cu_seqlens_q, total=q.shape[0])
        q_seq = q_seq.clamp(max=max(batch - 1, 0))  # (rows past cu_seqlens_q[-1]: padding)
    q_pos = base.long()[q_seq] + (q_i if positional_q else 0)
    if not C.want_value_checks(q_pos, validate):  # unchecked positions past the tables: their last row, never a fault
        return q_pos.clamp(0, cos.shape[0] - 1), k_pos.clamp(0, cos.shape[0] - 1)
    pos = torch.cat((k_pos, q_pos))
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= cos.shape[0]):
        raise ValueError(
            f"rotary_cos: expected rows for positions [{int(pos.min())}, {int(pos.max())}] (the "
            f"rotated positions), got {cos.shape[0]} rows. Build the tables for the full context "
            "length (and pass non-negative rotary_seqlens)."
        )
    return q_pos, k_pos


def _cache_rows(q, k_cache, page_table, cache_batch_idx, k_cache_scales, batch, validate):
    """The (batch, pages) int32 page table of the call: ``page_table``, or one page per row of a contiguous cache."""
    if page_table is not None:
        C.check_int32("page_table", page_table, ndim=2)
        if cache_batch_idx is not None:
            raise NotImplementedError("cache_batch_idx with page_table is not supported; index the page table instead.")
        if page_table.shape[0] != batch:
            raise ValueError(
                f"page_table: expected {batch} rows (batch), got {page_table.shape[0]}. One row per sequence."
            )
        return page_table
    C.unsupported("k_cache_scales", k_cache_scales, None, "per-token-head scales need a paged cache (page_table)")
    if cache_batch_idx is None:
        if k_cache.shape[0] < batch:
            raise ValueError(
                f"k_cache: expected at least batch={batch} rows, got {k_cache.shape[0]}. "
                "Allocate one cache row per sequence or pass cache_batch_idx."
            )
        return torch.arange(batch, device=q.device, dtype=torch.int32).view(-1, 1)
    C.check_int32("cache_batch_idx", cache_batch_idx, ndim=1)
    if cache_batch_idx.numel() != batch:
        raise ValueError(
            f"cache_batch_idx: expected {batch} entries (batch), got {cache_batch_idx.numel()}. "
            "Give each sequence its cache row."
        )
    C.check_index_values("cache_batch_idx", cache_batch_idx, k_cache.shape[0], validate, "rows of k_cache")
    return cache_batch_idx.view(-1, 1)


def _cache_lengths(cache_seqlens, batch, default, device):
    """``cache_seqlens`` as a (batch,) int32 tensor (an int is broadcast; None is ``default``)."""
    if cache_seqlens is None:
        return torch.full((batch,), default, dtype=torch.int32, device=device)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    C.check_int32("cache_seqlens", cache_seqlens, ndim=1)
    if cache_seqlens.numel() != batch:
        raise ValueError(f"cache_seqlens: expected {batch} entries (batch), got {cache_seqlens.numel()}.")
    return cache_seqlens


def _validate_new_tokens(k, v, k_cache, v_cache, cu_seqlens_k_new, batch, validate):
    """The new tokens of an append: 16/32-bit (batch, seqlen_new, nheads_k, headdim[_v]) or, with cu_seqlens_k_new,
    (total_new, nheads_k, headdim[_v])."""
    if (k is None) != (v is None):
        raise ValueError("k/v: expected both new K and new V or neither, got only one. Pass both to append.")
    if k is None:
        if cu_seqlens_k_new is not None:
            raise ValueError(
                f"cu_seqlens_k_new: expected None without new k/v, got {C.describe(cu_seqlens_k_new)}. "
                "Pass k= and v= with it, or drop it."
            )
        return
    hk = k_cache.shape[2]
    C.check_tensor("k", k, ndim=3 if cu_seqlens_k_new is not None else 4)
    C.check_tensor("v", v, ndim=3 if cu_seqlens_k_new is not None else 4)
    for name, t in (("k", k), ("v", v)):
        C.check_new_tokens(name, t, "Pass the unquantized values (they are quantized into an FP8 cache here).")
    if k.shape[-2] != hk or k.shape[-1] != k_cache.shape[-1] or v.shape[-1] != v_cache.shape[-1]:
        raise ValueError(f"k: expected (..., {hk}, {k_cache.shape[-1]}) like the cache, got {tuple(k.shape)}.")
    C.check_leading_dims("k", k, "v", v, k.dim() - 1, "token dims")
    if cu_seqlens_k_new is None and k.shape[0] != batch:
        raise ValueError(
            f"k: expected batch {batch} (as q) in (batch, seqlen_new, nheads_k, headdim), got "
            f"{tuple(k.shape)}. Pass one row of new tokens per sequence, or cu_seqlens_k_new."
        )
    if cu_seqlens_k_new is not None:
        C.check_cu_seqlens(
            "cu_seqlens_k_new", cu_seqlens_k_new, batch=batch, validate=validate, total=k.shape[0], total_name="k"
        )


def _check_cache_values(
    cache_seqlens, total_len, pt, ps, capacity, slots, k_cache, page_table, cache_leftpad, leftpad_end, validate
):
    """The value checks of a cache call (CPU, or validate=True on a GPU): lengths within the capacity, used page
    ids in the cache, the new tokens' slots distinct."""
    if not total_len.numel():
        return
    if int(cache_seqlens.min()) < 0:
        raise ValueError(
            f"cache_seqlens: expected lengths >= 0, got {int(cache_seqlens.min())}. "
            "Pass the tokens already in each sequence's cache."
        )
    if cache_leftpad is not None and int(leftpad_end.max()) > capacity:
        raise ValueError(
            f"cache_seqlens: expected lengths <= the cache rows' {capacity} tokens, got "
            f"{int(leftpad_end.max())} (left pad included). Shorten the sequence."
        )
    longest = int(total_len.max())
    if longest > capacity:
        raise ValueError(
            f"cache_seqlens: expected lengths <= the cache capacity {capacity} "
            f"(max_pages {pt.shape[1]} x page_size {ps}), got {longest}. "
            "Allocate more pages or shorten the sequence."
        )
    if page_table is not None and page_table.numel():
        used = torch.arange(pt.shape[1], device=pt.device)[None, :] * ps < total_len.long()[:, None]
        C.check_index_values("page_table", pt[used], k_cache.shape[0], validate, "page ids (for used pages)")
    if slots is not None:
        C.check_slots(
            slots,
            k_cache.shape[0] * k_cache.shape[1],
            validate,
            name="page_table" if page_table is not None else "cache_batch_idx",
        )


class _CachePlan(NamedTuple):
    """What ``_validate_kvcache`` hands the body of ``flash_attn_with_kvcache``: the caches (a one-token-page view
    with cache_leftpad), page table, lengths after the append, the cached lengths (after the pad), the new
    tokens, rotary positions ``(q_pos, k_pos)`` or None, expanded descales, the attention keywords of
    ``ops.paged_fwd``, the split workspace, attention_chunk, the split count and the batch."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    pt: torch.Tensor
    total_len: torch.Tensor | None  # (None with new tokens on a GPU without value checks: the append computes it)
    cache_seqlens: torch.Tensor
    kn: torch.Tensor | None
    vn: torch.Tensor | None
    rotary: tuple | None
    descales: tuple
    attn: dict
    ws: tuple | None
    chunk: int
    num_splits: int
    batch: int


def _check_cache_inputs(
    q,
    k_cache,
    v_cache,
    k,
    v,
    qv,
    rotary_cos,
    rotary_sin,
    cache_seqlens,
    cache_batch_idx,
    cache_leftpad,
    page_table,
    cu_seqlens_q,
    cu_seqlens_k_new,
    max_seqlen_q,
    rotary_seqlens,
    attention_chunk,
    scheduler_metadata,
    num_splits,
    sm_margin,
    k_cache_scales,
    v_cache_scales,
    validate,
):
    """The checks that open ``_validate_kvcache``: the arguments not supported, the split count, q and the
    caches as tensors on one device with matching dtypes and heads, varlen q's offsets. Returns
    ``(attention chunk, split count, batch)``."""
    _unsupported_qv(qv)
    chunk = _check_attention_chunk(attention_chunk)
    if scheduler_metadata is not None:
        num_splits = _metadata_splits(scheduler_metadata, num_splits)
    C.unsupported("sm_margin", sm_margin, 0)
    C.check_num_splits(num_splits)
    varlen = cu_seqlens_q is not None
    C.check_tensor("q", q, ndim=3 if varlen else 4)
    C.check_tensor("k_cache", k_cache, ndim=4)
    C.check_tensor("v_cache", v_cache, ndim=4, allow_v_seq_major=True)
    C.check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=page_table,
        cache_seqlens=cache_seqlens,
        cu_seqlens_q=cu_seqlens_q,
        k=k,
        v=v,
        cache_batch_idx=cache_batch_idx,
        k_cache_scales=k_cache_scales,
        v_cache_scales=v_cache_scales,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        cu_seqlens_k_new=cu_seqlens_k_new,
        cache_leftpad=cache_leftpad,
        rotary_seqlens=rotary_seqlens,
    )
    C.check_qkv_dtypes(q, k_cache, v_cache, k_name="k_cache", v_name="v_cache", allow_mixed_q=True)
    C.check_heads(q, k_cache, v_cache)
    if v_cache.shape[0] != k_cache.shape[0] or v_cache.shape[1] != k_cache.shape[1]:  # (heads: check_heads)
        C.check_leading_dims("k_cache", k_cache, "v_cache", v_cache, 3, "(num_blocks, page_size, nheads_k)")
    C.check_flag("validate", validate)
    if not varlen:
        return chunk, num_splits, q.shape[0]
    C.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, validate=validate, total=q.shape[0], total_name="q")
    if max_seqlen_q is None:
        raise ValueError("max_seqlen_q: expected an int with cu_seqlens_q, got None. Pass the longest query length.")
    C.check_max_seqlen("max_seqlen_q", max_seqlen_q, "cu_seqlens_q", cu_seqlens_q, validate)
    return chunk, num_splits, cu_seqlens_q.numel() - 1


def _check_cache_scales(k, k_cache, k_cache_scales, v_cache_scales, k_descale, v_descale):
    """Per-token-head cache scales: beside an FP8 cache, instead of the static descales, both with new k/v."""
    for name, sc in (("k_cache_scales", k_cache_scales), ("v_cache_scales", v_cache_scales)):
        if sc is not None:
            C.check_tensor(name, sc, ndim=3)
            C.check_cache_scales(name, sc, k_cache)
            C.check_scales_cache(name, k_cache)
    if k_cache_scales is not None and k_descale is not None:
        raise ValueError(
            "k_descale: expected None with k_cache_scales (per-token-head scales replace it), got a tensor. Drop one."
        )
    if v_cache_scales is not None and v_descale is not None:
        raise ValueError(
            "v_descale: expected None with v_cache_scales (per-token-head scales replace it), got a tensor. Drop one."
        )
    if k is not None and (k_cache_scales is None) != (v_cache_scales is None):
        raise ValueError(
            "k_cache_scales/v_cache_scales: expected both (per-token-head scales) or neither with new "
            "k/v, got one. Allocate both beside the cache."
        )


def _cache_view(
    q, k_cache, v_cache, k, page_table, cache_batch_idx, cache_leftpad, cache_seqlens, k_cache_scales, batch, validate
):
    """The cache as the kernels read it: a contiguous cache is a paged one with one page per cache row, and
    with ``cache_leftpad`` one with one-token pages that start at each row's first live token. Returns
    ``(k_cache, v_cache, page_table, page_size, capacity, lengths after the pad, lengths from row 0,
    value_checks)``."""
    pt = _cache_rows(q, k_cache, page_table, cache_batch_idx, k_cache_scales, batch, validate)
    ps = k_cache.shape[1]
    capacity = pt.shape[1] * ps
    cache_seqlens = _cache_lengths(cache_seqlens, batch, capacity if k is None else 0, q.device)
    value_checks = C.want_value_checks(cache_seqlens, validate)  # (free on CPU; opt-in on a GPU)
    from_row0 = cache_seqlens
    if cache_leftpad is not None:
        if page_table is not None:
            raise NotImplementedError(
                "cache_leftpad with page_table is not supported: leave the pad out of the page "
                "table (start each row at its first live page), or use a contiguous cache."
            )
        k_cache, v_cache, pt, cache_seqlens = _leftpad_view(
            k_cache, v_cache, pt, cache_seqlens, cache_leftpad, batch, value_checks
        )
        ps, capacity = 1, pt.shape[1]
    return k_cache, v_cache, pt, ps, capacity, cache_seqlens, from_row0, value_checks


def _lengths_after_append(k, pt, ps, cache_seqlens, cu_seqlens_k_new, batch, value_checks, rotary):
    """The new tokens' slots (value checks only), their sequences and positions among the new tokens (value
    checks and ``rotary``), and the lengths after the append (None on a GPU without value checks: the append
    derives them on the device, ``ops.append_kv_cache``). Returns ``(slots, seq_idx, pos_in_new, total_len)``."""
    if k is None:
        return None, None, None, cache_seqlens
    seqlen_new = k.shape[1] if cu_seqlens_k_new is None else None
    if value_checks:
        slots, seq_idx, pos_in_new, new_len = _new_token_slots(
            pt, cache_seqlens, ps, batch, seqlen_new, cu_seqlens_k_new, k.shape[0]
        )
        return slots, seq_idx, pos_in_new, cache_seqlens + new_len
    seq_idx = pos_in_new = None
    if rotary:
        seq_idx, pos_in_new = _token_rows(pt.device, batch, seqlen_new, cu_seqlens_k_new, k.shape[0])
    return None, seq_idx, pos_in_new, None


def _validate_kvcache(
    q,
    k_cache,
    v_cache,
    k,
    v,
    qv,
    rotary_cos,
    rotary_sin,
    cache_seqlens,
    cache_batch_idx,
    cache_leftpad,
    page_table,
    cu_seqlens_q,
    cu_seqlens_k_new,
    max_seqlen_q,
    rotary_seqlens,
    q_descale,
    k_descale,
    v_descale,
    softmax_scale,
    causal,
    window_size,
    attention_chunk,
    softcap,
    rotary_interleaved,
    scheduler_metadata,
    num_splits,
    pack_gqa,
    sm_margin,
    return_softmax_lse,
    out,
    out_dtype,
    out_scale,
    k_cache_scales,
    v_cache_scales,
    split_workspace,
    validate,
):
    """Every check of :func:`flash_attn_with_kvcache`, before anything is written (the append included). Returns
    the call's ``_CachePlan``. Tensor work here is device-side (no host sync) except the value checks (CPU, or
    validate=True)."""
    chunk, num_splits, batch = _check_cache_inputs(
        q,
        k_cache,
        v_cache,
        k,
        v,
        qv,
        rotary_cos,
        rotary_sin,
        cache_seqlens,
        cache_batch_idx,
        cache_leftpad,
        page_table,
        cu_seqlens_q,
        cu_seqlens_k_new,
        max_seqlen_q,
        rotary_seqlens,
        attention_chunk,
        scheduler_metadata,
        num_splits,
        sm_margin,
        k_cache_scales,
        v_cache_scales,
        validate,
    )
    hk, dv = k_cache.shape[2], v_cache.shape[-1]
    attn = _validate_options(
        q,
        tuple(q.shape[:-1]) + (dv,),
        softmax_scale,
        causal,
        window_size,
        softcap,
        out,
        out_dtype,
        out_scale,
        validate,
        (
            ("pack_gqa", pack_gqa),
            ("rotary_interleaved", rotary_interleaved),
            ("return_softmax_lse", return_softmax_lse),
        ),
    )
    ws = _check_split_workspace(split_workspace, num_splits, chunk, q, q.shape[-2], dv)
    _check_cache_scales(k, k_cache, k_cache_scales, v_cache_scales, k_descale, v_descale)
    descales = _descales(q_descale, k_descale, v_descale, batch, hk, q.device, validate, q.dtype, k_cache.dtype)
    _validate_new_tokens(k, v, k_cache, v_cache, cu_seqlens_k_new, batch, validate)
    k_cache, v_cache, pt, ps, capacity, cache_seqlens, rotary_base, value_checks = _cache_view(
        q,
        k_cache,
        v_cache,
        k,
        page_table,
        cache_batch_idx,
        cache_leftpad,
        cache_seqlens,
        k_cache_scales,
        batch,
        validate,
    )
    if chunk:
        local_attention.check_chunked_cache_call(
            chunk,
            cache_leftpad,
            ps if page_table is not None else 1,
            bool(causal),
            max_seqlen_q if cu_seqlens_q is not None else q.shape[1],
        )
    slots, seq_idx, pos_in_new, total_len = _lengths_after_append(
        k,
        pt,
        ps,
        cache_seqlens,
        cu_seqlens_k_new,
        batch,
        value_checks,
        rotary_cos is not None or rotary_sin is not None,
    )
    if value_checks:
        leftpad_end = total_len + cache_leftpad if cache_leftpad is not None else None
        _check_cache_values(
            cache_seqlens, total_len, pt, ps, capacity, slots, k_cache, page_table, cache_leftpad, leftpad_end, validate
        )
    # (rotary positions stay absolute cache rows (FA3), left pad included)
    rotary = _validate_rotary(
        q,
        k,
        rotary_cos,
        rotary_sin,
        rotary_seqlens,
        rotary_base,
        seq_idx,
        pos_in_new,
        cu_seqlens_q,
        batch,
        bool(causal) or tuple(window_size) != (-1, -1),
        validate,
    )
    return _CachePlan(
        k_cache, v_cache, pt, total_len, cache_seqlens, k, v, rotary, descales, attn, ws, chunk, num_splits, batch
    )


def _paged_plan(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, return_lse, c, append):
    """The eager plan of a validated paged call (``c``: its ``_CachePlan``), or None: the call must use the
    caller's cache and page table and its int32 lengths as they are, without rotary. Without an append the
    attention reads those lengths; with one (``append``: fixed-length new tokens) the append writes the cache
    through the page table from them, and the attention reads the lengths the append leaves."""
    lens = c.cache_seqlens if append else c.total_len
    if not (
        c.pt is page_table
        and c.k_cache is k_cache
        and c.v_cache is v_cache
        and lens is cache_seqlens
        and isinstance(cache_seqlens, torch.Tensor)
        and cache_seqlens.dtype == torch.int32
        and c.rotary is None
    ):
        return None
    return plan.paged_plan(
        q,
        k_cache,
        cu_seqlens_q,
        max_seqlen_q,
        v_cache,
        batch=c.batch,
        attn=c.attn,
        num_splits=c.num_splits,
        return_lse=return_lse,
        append=append,
    )


def _rotate(q, kn, cos, sin, positions, interleaved):
    """q and the new keys rotated at their ``positions`` ``(q_pos, k_pos)`` (``_validate_rotary``)."""
    q_pos, k_pos = positions
    q = apply_rotary(q.reshape(-1, *q.shape[-2:]), cos, sin, q_pos, interleaved).reshape(q.shape)
    kn = apply_rotary(kn.reshape(-1, *kn.shape[-2:]), cos, sin, k_pos, interleaved).reshape(kn.shape)
    return q, kn


def _append(q, kn, c, cu_seqlens_k_new, k_descale, v_descale, k_cache_scales, v_cache_scales):
    """Write the new tokens into the cache: the call's first write, after every check. Returns the lengths
    after it."""
    if not torch.compiler.is_compiling():  # (compiled: the ops report at run time, inside their implementation)
        kernel_for(q, "paged")  # the attention's fallback is reported before the append writes (error: no write)
    _, kd, vd = c.descales
    return ops.append_kv_cache(
        kn,
        c.vn,
        c.k_cache,
        c.v_cache,
        c.pt,
        c.cache_seqlens,
        cu_seqlens_k_new=cu_seqlens_k_new,
        k_descale=kd if k_descale is not None else None,
        v_descale=vd if v_descale is not None else None,
        k_cache_scales=k_cache_scales,
        v_cache_scales=v_cache_scales,
    )


def _chunked_cache_call(q, c, contiguous, total_len, cu_seqlens_q, max_seqlen_q, attn):
    """The attention of a cache call with ``attention_chunk`` (``local_attention.chunked_cache_call``), a
    contiguous cache seen as one-token pages over the same memory (row * seqlen_cache + token)."""
    k_cache, v_cache, pt = c.k_cache, c.v_cache, c.pt
    if contiguous:
        k_cache, v_cache, pt, _ = _leftpad_view(
            k_cache, v_cache, pt, total_len, torch.zeros_like(total_len, dtype=torch.int32), c.batch, False
        )
    return local_attention.chunked_cache_call(
        q, k_cache, v_cache, pt, total_len, c.chunk, cu_seqlens_q, max_seqlen_q, c.descales, **attn
    )


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    page_table=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
    rotary_seqlens=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
    *,
    out=None,
    out_dtype=None,
    out_scale=None,
    k_cache_scales=None,
    v_cache_scales=None,
    split_workspace=None,
    validate=False,
):
    """Attention over a KV cache (contiguous or paged), optionally appending new K/V first.

    Parameters
    ----------
    q : (batch, seqlen_q, nheads_q, headdim), or varlen (total_q, nheads_q, headdim) with cu_seqlens_q.
        bf16/fp16 over an FP8 cache (K/V dequantized in the kernel), or FP8 with an FP8 cache.
    k_cache, v_cache : paged (num_blocks, page_size, nheads_k, headdim[_v]) with ``page_table``, or
        contiguous (batch_cache, seqlen_cache, nheads_k, headdim[_v]). e4m3fn / e5m2 / bf16 / fp16.
        Updated in place when k/v are given.
    k, v : optional new tokens (batch, seqlen_new, nheads_k, headdim) (or (total_new, ...) with
        cu_seqlens_k_new), 16-bit; quantized into an FP8 cache with k_descale/v_descale (or dynamic
        per-token-head scales written to k_cache_scales/v_cache_scales); written at positions
        cache_seqlens[b], cache_seqlens[b] + 1, ...
    cache_seqlens : int or (batch,) int32: tokens already in the cache (before the append).
    cache_batch_idx : (batch,) int32, rows of a contiguous cache used by each batch entry.
    page_table : (batch, max_pages) int32; unused entries may hold -1.
    cu_seqlens_q : (batch + 1,) int32 for varlen q (mixed prefill chunks and decode rows); max_seqlen_q int.
    q_descale, k_descale, v_descale : float32 (batch, nheads_k) or per-tensor/per-sequence broadcasts:
        q_descale for an FP8 q only; k_descale / v_descale for an FP8 cache only (a bf16 q over an FP8 cache
        takes them; new k/v are quantized with them).
    causal, window_size, softcap, softmax_scale : as in :func:`flash_attn_func` (bottom-right alignment:
        the queries are the last tokens of each sequence).
    num_splits : 0 = heuristic from shapes (never from live lengths), 1 = no split, n = n KV splits.
    split_workspace : optional ``(out_partial, lse_partial)`` from :func:`fp8attn.split_workspace` (float32,
        at least ``num_splits`` splits, q's shape): the split partials go there instead of tensors allocated
        per call, so an engine allocates them once, before CUDA-graph capture. Needs an explicit num_splits.
    return_softmax_lse : also return the LSE, (batch, nheads_q, seqlen_q) or varlen (nheads_q, total_q).
    rotary_cos, rotary_sin : (seqlen_ro, rotary_dim / 2), applied to the new k and to 16-bit q (FA3
        semantics): k at positions cache_seqlens[b] + i; q at cache_seqlens[b] + i when causal or with a
        window, else all of q at cache_seqlens[b]. Needs k/v. Features past rotary_dim are unchanged.
    rotary_seqlens : optional (batch,) int32 positions used instead of cache_seqlens for the rotation.
    rotary_interleaved : True rotates feature pairs (0, 1), (2, 3), ... (GPT-J); False pairs
        (i, i + rotary_dim / 2) (GPT-NeoX).
    cache_leftpad : optional (batch,) int32, contiguous caches only: sequence b's tokens start at row
        cache_leftpad[b] of its cache row (rows before are padding, never read); ``cache_seqlens`` still
        counts from row 0 (the end of the cached tokens), and rotary positions stay absolute rows (FA3).
        Such calls read the cache in one-token pages (the Triton kernel, not the TMA prefill kernel).
    scheduler_metadata : optional result of :func:`get_scheduler_metadata`: sets ``num_splits`` to its length
        (the schedule is fixed from shapes anyway; an explicit ``num_splits`` must agree).
    attention_chunk : int >= 0 (FA3 semantics, see :func:`flash_attn_func`) over a contiguous cache or a paged
        cache whose page size divides the chunk; several queries per sequence need ``causal=True``.
    qv, sm_margin : not supported yet; a non-default value raises NotImplementedError.
    pack_gqa : None/False/True, a scheduling hint (decode always packs the query heads of a KV head).
    out : optional preallocated output (shape of the result, dtype as below), written in place.
    out_dtype : bf16 (default for FP8 q), fp16 or fp32. out_scale : float32 one-element static scale;
        the output is then e4m3fn ``saturate(out / out_scale)``.
    k_cache_scales, v_cache_scales : (num_blocks, page_size, nheads_k) float32 or bfloat16 per-token-head descales.
    validate : also run the value checks (page ids, lengths, slots, descale and out_scale values) on GPU
        tensors (syncs). Every check runs before the append writes the cache (docs/api.md, "Validation and the
        nothing-lost guarantee", says what the kernels do with unchecked values).

    Returns
    -------
    out : q's shape with headdim_v, (batch, seqlen_q, nheads_q, headdim_v) or (total_q, nheads_q, headdim_v).
    lse : with return_softmax_lse, (batch, nheads_q, seqlen_q) or varlen (nheads_q, total_q) float32.
    """
    tensors: tuple = (
        q,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        cu_seqlens_q,
        q_descale,
        k_descale,
        v_descale,
        k_cache_scales,
        v_cache_scales,
        out,
        out_scale,
    )
    key = run = None
    # plans serve a paged cache read as it is, or after an append of fixed-length new tokens: no rotary, left
    # pad, row index, chunks or given schedule
    appends = k is not None or v is not None
    if appends:
        tensors = (*tensors, k, v)
    if (
        qv is None
        and rotary_cos is None
        and rotary_sin is None
        and rotary_seqlens is None
        and cache_batch_idx is None
        and cache_leftpad is None
        and page_table is not None
        and cu_seqlens_k_new is None
        and type(attention_chunk) is int
        and attention_chunk == 0
        and scheduler_metadata is None
        and split_workspace is None
        and plan.plannable(q, validate, causal, return_softmax_lse, rotary_interleaved, window_size)
    ):
        key, run = plan.find(
            "paged_append" if appends else "paged",
            tensors,
            (
                max_seqlen_q,
                softmax_scale,
                causal,
                window_size,
                softcap,
                num_splits,
                pack_gqa,
                sm_margin,
                return_softmax_lse,
                rotary_interleaved,
                out_dtype,
            ),
        )
        if run is not None:
            return run(*tensors)
    c = _validate_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        qv,
        rotary_cos,
        rotary_sin,
        cache_seqlens,
        cache_batch_idx,
        cache_leftpad,
        page_table,
        cu_seqlens_q,
        cu_seqlens_k_new,
        max_seqlen_q,
        rotary_seqlens,
        q_descale,
        k_descale,
        v_descale,
        softmax_scale,
        causal,
        window_size,
        attention_chunk,
        softcap,
        rotary_interleaved,
        scheduler_metadata,
        num_splits,
        pack_gqa,
        sm_margin,
        return_softmax_lse,
        out,
        out_dtype,
        out_scale,
        k_cache_scales,
        v_cache_scales,
        split_workspace,
        validate,
    )
    if key is not None and (
        run := _new_plan(
            key,
            tensors,
            _paged_plan,
            q,
            k_cache,
            v_cache,
            page_table,
            cache_seqlens,
            cu_seqlens_q,
            max_seqlen_q,
            return_softmax_lse,
            c,
            appends,
        )
    ):
        return run(*tensors)
    kn = c.kn
    if c.rotary is not None:
        q, kn = _rotate(q, kn, rotary_cos, rotary_sin, c.rotary, rotary_interleaved)
    total_len = c.total_len
    if k is not None:
        total_len = _append(q, kn, c, cu_seqlens_k_new, k_descale, v_descale, k_cache_scales, v_cache_scales)
    attn = dict(
        c.attn,
        k_cache_scales=k_cache_scales,
        v_cache_scales=v_cache_scales,
        num_splits=c.num_splits,
        return_lse=bool(return_softmax_lse),
    )
    if c.chunk:
        o, lse = _chunked_cache_call(q, c, page_table is None, total_len, cu_seqlens_q, max_seqlen_q, attn)
    else:
        qd, kd, vd = c.descales
        o, lse = ops.paged_fwd(
            q,
            c.k_cache,
            c.v_cache,
            c.pt,
            total_len.to(torch.int32),
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            q_descale=qd,
            k_descale=kd,
            v_descale=vd,
            split_workspace=c.ws,
            **attn,
        )
    return (o, lse) if return_softmax_lse else o


def _validate_scheduler_metadata(
    batch_size,
    max_seqlen_q,
    max_seqlen_k,
    num_heads_q,
    num_heads_kv,
    headdim,
    cache_seqlens,
    attention_chunk,
    num_splits,
    sm_margin,
):
    """Every check of :func:`get_scheduler_metadata`."""
    C.check_num_splits(num_splits)
    for name, val in (
        ("batch_size", batch_size),
        ("max_seqlen_q", max_seqlen_q),
        ("max_seqlen_k", max_seqlen_k),
        ("num_heads_q", num_heads_q),
        ("num_heads_kv", num_heads_kv),
        ("headdim", headdim),
    ):
        try:  # any integer type (Python, NumPy, a 0-d integer tensor)
            ok = not isinstance(val, bool) and operator.index(val) >= 0
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"{name}: expected an int >= 0, got {C.describe(val)}. Pass the call's shape.")
    _check_attention_chunk(attention_chunk)
    C.unsupported("sm_margin", sm_margin, 0)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(
            f"cache_seqlens: expected a tensor (its device is the metadata's), got "
            f"{type(cache_seqlens).__name__}. Pass the call's cache_seqlens."
        )


def get_scheduler_metadata(
    batch_size,
    max_seqlen_q,
    max_seqlen_k,
    num_heads_q,
    num_heads_kv,
    headdim,
    cache_seqlens,
    qkv_dtype=torch.bfloat16,
    headdim_v=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    cache_leftpad=None,
    page_size=None,
    max_seqlen_k_new=0,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    has_softcap=False,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
):
    """FA3's ``get_scheduler_metadata``, for code that passes its result to :func:`flash_attn_with_kvcache`.

    fp8attn fixes its schedule from shapes in every call (never from live lengths), so a call needs no
    precomputed metadata and is CUDA-graph safe as it is. What this returns carries only the split count.
    Passed as ``scheduler_metadata=``, it sets the call's ``num_splits``.

    Parameters
    ----------
    batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim : ints >= 0, the call's
        shape (checked, not used: the split count is ``num_splits``).
    cache_seqlens : (batch,) int32 tensor; the metadata is made on its device.
    num_splits : 0 = fp8attn's heuristic (fixed from the call's shapes), 1 = no split, n = n KV splits.
    attention_chunk : int >= 0, checked; it does not change the result (pass the same value to
        :func:`flash_attn_with_kvcache`, which applies it).
    sm_margin : must be 0.
    qkv_dtype, headdim_v, cu_seqlens_q, cu_seqlens_k_new, cache_leftpad, page_size, max_seqlen_k_new, causal,
        window_size, has_softcap, pack_gqa : accepted for FA3 parity; they do not change the result.

    Returns
    -------
    torch.Tensor : int32, shape (num_splits,), zeros.
    """
    _validate_scheduler_metadata(
        batch_size,
        max_seqlen_q,
        max_seqlen_k,
        num_heads_q,
        num_heads_kv,
        headdim,
        cache_seqlens,
        attention_chunk,
        num_splits,
        sm_margin,
    )
    return torch.zeros(num_splits, dtype=torch.int32, device=cache_seqlens.device)


def _validate_combine(out_partial, lse_partial, out, out_dtype, out_scale, validate):
    """Every check of :func:`flash_attn_combine` (before ``out`` is written)."""
    C.check_tensor("out_partial", out_partial, ndim=(4, 5))
    C.check_tensor("lse_partial", lse_partial, ndim=(3, 4))
    C.check_flag("validate", validate)
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        raise ValueError(
            f"lse_partial: expected shape {tuple(out_partial.shape[:-1])} (out_partial without headdim), "
            f"got {tuple(lse_partial.shape)}. Pass the LSE of each split in (num_splits, batch, seqlen, nheads)."
        )
    if out_partial.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(
            f"out_partial: expected float32 or bfloat16, got {out_partial.dtype}. Keep split partials "
            "in float32 (or bfloat16, as the Hopper kernel writes them)."
        )
    if lse_partial.dtype != torch.float32:
        raise TypeError(f"lse_partial: expected float32, got {lse_partial.dtype}. Keep split LSEs in float32.")
    if out_partial.shape[0] == 0:
        raise ValueError(
            f"out_partial: expected at least one split (num_splits >= 1 on dim 0), got shape "
            f"{tuple(out_partial.shape)}. Pass the partials of a split-KV call."
        )
    C.check_same_device(out_partial=out_partial, lse_partial=lse_partial, out=out, out_scale=out_scale)
    C.check_out_dtype(out_dtype)
    C.check_out_scale(out_scale, out_partial.device, out_dtype)
    dt = torch.float8_e4m3fn if out_scale is not None else (out_dtype or out_partial.dtype)
    C.check_out(out, out_partial.shape[1:], dt, out_partial.device)
    C.check_out_scale_values(out_scale, validate)
    C.check_lse_values(lse_partial, validate)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None, *, out_scale=None, validate=False):
    """Merge split-KV partial results.

    Parameters
    ----------
    out_partial : (num_splits, batch, seqlen, nheads, headdim) or (num_splits, total, nheads, headdim), float32
        or bfloat16; num_splits >= 1.
    lse_partial : (num_splits, batch, seqlen, nheads) or (num_splits, total, nheads), float32 natural-log.
        An empty split has lse = -inf (its out_partial is ignored, even if NaN); NaN or +inf are refused where
        values are checked.
    out : optional preallocated output of out_partial.shape[1:].
    out_dtype : output dtype (default: out_partial's dtype).
    out_scale : float32 one-element static scale; the output is then e4m3fn ``saturate(out / out_scale)``.
    validate : also run the value checks (out_scale and LSE values) on GPU tensors (they sync the device).

    Returns
    -------
    (out, lse) : out (batch, seqlen, nheads, headdim); lse (batch, seqlen, nheads) float32. Rows whose
        splits are all empty give 0 and -inf.
    """
    _validate_combine(out_partial, lse_partial, out, out_dtype, out_scale, validate)
    return ops.combine(out_partial, lse_partial, out=out, out_dtype=out_dtype, out_scale=out_scale)


def _per_sequence_rows(k_descale, v_descale):
    """The batch rows of the per-(sequence, head) descales among ``k_descale`` / ``v_descale`` (the fewest), or
    None when both are per-tensor (or None)."""
    rows = [d.shape[0] for d in (k_descale, v_descale) if d is not None and d.numel() != 1]
    return min(rows) if rows else None


def _check_write_tensors(
    k, v, k_cache, v_cache, slot_mapping, k_descale, v_descale, token_seq_idx, k_cache_scales, v_cache_scales
):
    """The tensors of :func:`write_kv_cache`: kinds, one device, the cache dtypes, and shapes that agree."""
    for name, t in (("k", k), ("v", v)):
        C.check_tensor(name, t, ndim=3)
        C.check_new_tokens(name, t, "Pass the unquantized values.")
    C.check_tensor("k_cache", k_cache, ndim=4)
    C.check_tensor("v_cache", v_cache, ndim=4, allow_v_seq_major=True)
    C.check_tensor("slot_mapping", slot_mapping, ndim=1)
    for name, d in (
        ("k_descale", k_descale),
        ("v_descale", v_descale),
        ("token_seq_idx", token_seq_idx),
        ("k_cache_scales", k_cache_scales),
        ("v_cache_scales", v_cache_scales),
    ):
        if d is not None:
            C.check_tensor(name, d)
    C.check_same_device(
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=slot_mapping,
        k_descale=k_descale,
        v_descale=v_descale,
        token_seq_idx=token_seq_idx,
        k_cache_scales=k_cache_scales,
        v_cache_scales=v_cache_scales,
    )
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not (is_fp8(c.dtype) or c.dtype in (torch.float16, torch.bfloat16, torch.float32)):
            raise TypeError(
                f"{name}: expected an FP8 (e4m3fn / e5m2) or bf16/fp16/fp32 cache, got {c.dtype}. "
                "Allocate it with fp8attn.paged.alloc_paged_cache."
            )
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"v_cache: expected the dtype of k_cache ({k_cache.dtype}), got {v_cache.dtype}. "
            "Store K and V in one dtype."
        )
    if k_cache.dtype == torch.float8_e4m3fnuz and k_cache.device.type != "cpu":
        raise NotImplementedError(
            "k_cache: float8_e4m3fnuz caches are supported by the CPU reference path only "
            "(emulation); allocate an e4m3fn cache."
        )
    C.check_leading_dims("k", k, "v", v, 1, "token count")
    C.check_leading_dims("k_cache", k_cache, "v_cache", v_cache, 3, "(num_blocks, page_size, nheads_k)")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping: expected int64 or int32, got {slot_mapping.dtype}. Pass slot ids as integers.")
    if slot_mapping.numel() != k.shape[0]:
        raise ValueError(f"slot_mapping: expected {k.shape[0]} entries (one per token), got {slot_mapping.numel()}.")
    if k.shape[1:] != k_cache.shape[2:] or v.shape[1:] != v_cache.shape[2:]:
        raise ValueError(
            f"k: expected (num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}) matching k_cache, got {tuple(k.shape)}."
        )


def _check_write_scales(k_cache, k_descale, v_descale, token_seq_idx, k_cache_scales, v_cache_scales, validate):
    """How :func:`write_kv_cache` scales: per-token-head cache scales (both, FP8 cache, no static descale), or
    static descales per tensor or per (sequence, head) with ``token_seq_idx``."""
    hk = k_cache.shape[2]
    if (k_cache_scales is None) != (v_cache_scales is None):
        raise ValueError(
            "k_cache_scales/v_cache_scales: expected both (per-token-head scales) or neither, got one. "
            "Allocate both beside the cache."
        )
    for name, sc, d in (("k_cache_scales", k_cache_scales, k_descale), ("v_cache_scales", v_cache_scales, v_descale)):
        if sc is None:
            continue
        C.check_cache_scales(name, sc, k_cache)
        C.check_scales_cache(name, k_cache)
        if d is not None:
            raise ValueError(
                f"{name[0]}_descale: expected None with {name} (per-token-head scales replace it), got "
                f"{C.describe(d)}. Drop one."
            )
    for name, d in (("k_descale", k_descale), ("v_descale", v_descale)):
        if d is None:
            continue
        C.check_descale_kind(name, d, "k_cache" if name[0] == "k" else "v_cache", k_cache.dtype)
        if d.dtype != torch.float32:
            raise TypeError(f"{name}: expected float32, got {d.dtype}. Pass {name}.float().")
        per_seq = (d.dim() == 1 or (d.dim() == 2 and d.shape[1] in (1, hk))) and d.shape[0] >= 1
        if not (d.numel() == 1 and d.dim() <= 2) and not per_seq:
            raise ValueError(
                f"{name}: expected a per-tensor (), (1,) or (1, 1) descale, or a per-(sequence, head) "
                f"(batch, {hk}) / per-sequence (batch, 1) one, got shape {tuple(d.shape)}. "
                "Pass the cache's descales in FA3's (batch, nheads_k) form."
            )
        if d.numel() != 1 and token_seq_idx is None:
            raise ValueError(
                f"token_seq_idx: expected an int32 (num_tokens,) tensor with a per-(sequence, head) "
                f"{name} of shape {tuple(d.shape)}, got None. Pass each token's batch row."
            )
        C.check_descale_values(name, d, validate)


def _validate_write_kv_cache(
    k, v, k_cache, v_cache, slot_mapping, k_descale, v_descale, token_seq_idx, k_cache_scales, v_cache_scales, validate
):
    """Every check of :func:`write_kv_cache` (before the caches are written)."""
    C.check_flag("validate", validate)
    _check_write_tensors(
        k, v, k_cache, v_cache, slot_mapping, k_descale, v_descale, token_seq_idx, k_cache_scales, v_cache_scales
    )
    _check_write_scales(k_cache, k_descale, v_descale, token_seq_idx, k_cache_scales, v_cache_scales, validate)
    C.check_int32("token_seq_idx", token_seq_idx, ndim=1)
    if token_seq_idx is not None and token_seq_idx.numel() != k.shape[0]:
        raise ValueError(
            f"token_seq_idx: expected {k.shape[0]} entries (one per token), got {token_seq_idx.numel()}. "
            "Pass each token's batch row."
        )
    rows = _per_sequence_rows(k_descale, v_descale)
    if rows is not None and C.want_value_checks(token_seq_idx, validate):  # (tokens with a negative slot are skipped)
        C.check_index_values(
            "token_seq_idx", token_seq_idx[slot_mapping >= 0], rows, validate, "batch rows of the descales"
        )
    C.check_slots(slot_mapping, k_cache.shape[0] * k_cache.shape[1], validate)


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
    validate=False,
):
    """Write (and quantize) new tokens into a paged KV cache, in place.

    Parameters
    ----------
    k, v : (num_tokens, nheads_k, headdim[_v]) bf16 / fp16 / fp32.
    k_cache, v_cache : (num_blocks, page_size, nheads_k, headdim[_v]) e4m3fn / e5m2 (quantized with a
        saturating cast) or bf16 / fp16 / fp32 (plain copy), one dtype.
    slot_mapping : (num_tokens,) int64 (or int32), ``block_id * page_size + offset``; negative = skip.
        Slots are distinct within a call and < num_blocks * page_size (value checks; see docs/api.md).
    k_descale, v_descale : static descales of an FP8 cache (refused for a 16/32-bit one), float32,
        per-tensor (0-d / (1,) / (1, 1)) or per-(sequence, head) (batch, nheads_k) / per-sequence (batch, 1)
        with ``token_seq_idx`` (num_tokens,) int32 giving each token's row, in [0, batch).
    k_cache_scales, v_cache_scales : (num_blocks, page_size, nheads_k) float32 or bfloat16: dynamic
        per-token-head scales, computed (amax / fp8_max, floored; for bf16 padded up by 2**-7 so rounding
        never clips) and stored here; tokens are quantized with exactly the stored value.
    validate : also check slot ids and descale values on GPU tensors (syncs the device).

    Returns
    -------
    None : ``k_cache`` / ``v_cache`` (and the scales) are written in place.
    """
    tensors = (
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_descale,
        v_descale,
        token_seq_idx,
        k_cache_scales,
        v_cache_scales,
    )
    key = None
    if validate is False and type(k) is torch.Tensor and k.is_cuda:
        key, run = plan.find("write_kv_cache", tensors, ())
        if run is not None:
            run(*tensors)
            return
    _validate_write_kv_cache(*tensors, validate)  # (tensors: the call's, in its argument order)
    if key is not None and (run := _new_plan(key, tensors, plan.write_kv_plan, k)):
        run(*tensors)
        return
    ops.write_kv_cache(
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
