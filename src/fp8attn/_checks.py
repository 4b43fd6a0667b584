"""Argument validation for the public API.

Every error names the argument, what was expected, what arrived, and the fix. Checks that read
tensor *values* (and so would synchronize a GPU) run for CPU tensors always and for device tensors
only when ``validate=True`` is passed (and never while a CUDA graph is being captured).
"""

from __future__ import annotations

import math

import torch

from .kernels.planning import is_v_seq_major
from .quant import FP8_FORMATS, SCALE_STORAGE_DTYPES, is_fp8

__all__ = [
    "SUPPORTED_OUT_DTYPES",
    "MAX_HEADDIM",
    "UnsupportedOutputQuant",
    "want_value_checks",
    "check_tensor",
    "check_qkv_dtypes",
    "check_heads",
    "check_same_device",
    "check_descale",
    "check_descale_values",
    "check_leading_dims",
    "check_cu_seqlens",
    "check_max_seqlen",
    "check_cache_scales",
    "check_int32",
    "check_out",
    "check_out_dtype",
    "check_out_scale",
    "check_num_splits",
    "check_new_tokens",
    "check_scales_cache",
    "check_window",
    "unsupported",
    "describe",
    "check_flag",
    "check_softmax_scale",
    "check_softcap",
    "check_descale_kind",
    "check_out_scale_values",
    "check_seqused",
    "check_slots",
    "check_index_values",
    "check_lse_values",
    "check_finite",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEADDIM = 256


def _fail(exc, arg, expected, got, fix):
    raise exc(f"{arg}: expected {expected}, got {got}. {fix}")


class UnsupportedOutputQuant(NotImplementedError, ValueError):
    """An ``out_scale`` of a kind that does not fuse (per-token, per-group, dynamic): NotImplementedError,
    and a ValueError too, as every other bad ``out_scale`` is."""


def want_value_checks(t: torch.Tensor, validate: bool) -> bool:
    """Value checks are free on CPU; on a GPU they sync, so they are opt-in and skipped in capture.
    Never while torch.compile traces (a value read would break the graph)."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cpu":
        return True
    if not validate:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_tensor(name, t, ndim=None, allow_none=False, allow_v_seq_major=False, allow_seq_contiguous=False):
    if t is None and allow_none:
        return
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(t).__name__, f"Pass {name} as a tensor.")
    if ndim is not None and t.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        _fail(
            ValueError,
            name,
            f"a {ndim}-D tensor",
            f"shape {tuple(t.shape)}",
            "See the docstring for the layout (batch, seqlen, nheads, headdim) / varlen (total, nheads, headdim).",
        )
    if t.dim() > 0 and t.stride(-1) != 1 and t.numel() > 1 and t.shape[-1] > 1:
        if allow_v_seq_major and is_v_seq_major(t):
            return
        if allow_seq_contiguous and t.dim() >= 3 and t.stride(-3) == 1:
            return
        if allow_v_seq_major:
            also = (
                " or a sequence-major V cache (memory order (num_blocks, nheads_k, headdim, page_size), "
                "fp8attn.paged.alloc_paged_cache(..., v_seq_major=True))"
            )
        elif allow_seq_contiguous:
            also = " or a contiguous sequence dimension (stride(-3) == 1, as quantize_qkv returns v8)"
        else:
            also = ""
        _fail(
            ValueError,
            name,
            "a contiguous last dimension" + also,
            f"stride {tuple(t.stride())}",
            f"Call {name}.contiguous() (only the last dimension must be contiguous).",
        )


def check_qkv_dtypes(q, k, v, *, q_name="q", k_name="k", v_name="v", allow_mixed_q=False):
    """q/k/v are all one FP8 format, or all the same 16/32-bit dtype (allow_mixed_q: 16-bit q over FP8 KV)."""
    for name, t in ((q_name, q), (k_name, k), (v_name, v)):
        if not (is_fp8(t.dtype) or t.dtype in _FLOATS):
            _fail(
                TypeError,
                name,
                f"an FP8 ({', '.join(str(d) for d in FP8_FORMATS)}) or bf16/fp16/fp32 tensor",
                str(t.dtype),
                "Quantize with fp8attn.quantize_qkv or cast to bfloat16.",
            )
    if k.dtype != v.dtype:
        _fail(
            TypeError,
            v_name,
            f"the dtype of {k_name} ({k.dtype})",
            str(v.dtype),
            f"Store {k_name} and {v_name} in one dtype.",
        )
    if q.dtype != k.dtype and not (allow_mixed_q and is_fp8(k.dtype) and q.dtype in (torch.bfloat16, torch.float16)):
        allowed = f"{k.dtype}" + (" or bf16/fp16 (FP8 cache)" if allow_mixed_q and is_fp8(k.dtype) else "")
        _fail(
            TypeError,
            q_name,
            allowed,
            str(q.dtype),
            f"Give {q_name} the dtype of {k_name} (quantize both, or cast both to bfloat16).",
        )
    if torch.float8_e4m3fnuz in (q.dtype, k.dtype) and not (q.device.type == "cpu"):
        _fail(
            NotImplementedError,
            k_name,
            "e4m3fn or e5m2 on this device",
            "float8_e4m3fnuz",
            "e4m3fnuz is supported by the CPU reference path only (emulation); convert through fp32 to e4m3fn.",
        )


def check_heads(q, k, v, *, head_dim_axis=-1):
    hq, hk = q.shape[-2], k.shape[-2]
    if v.shape[-2] != hk:
        _fail(
            ValueError,
            "v",
            f"nheads_k = {hk} heads (as k)",
            f"{v.shape[-2]}",
            "k and v must have the same number of heads.",
        )
    if hk == 0 or hq % hk != 0:
        _fail(
            ValueError,
            "q",
            f"nheads_q divisible by nheads_k = {hk}",
            f"nheads_q = {hq}",
            "Use a number of query heads that is a multiple of the KV heads (GQA/MQA).",
        )
    d, dv = q.shape[-1], v.shape[-1]
    if k.shape[-1] != d:
        _fail(ValueError, "k", f"headdim {d} (as q)", f"{k.shape[-1]}", "q and k must share the head dimension.")
    for name, dim in (("q", d), ("v", dv)):
        if dim % 8 != 0 or dim > MAX_HEADDIM or dim <= 0:
            _fail(
                ValueError,
                name,
                f"a head dimension that is a multiple of 8 and <= {MAX_HEADDIM}",
                f"{dim}",
                "Pad the head dimension (e.g. to 64, 128 or 256).",
            )


def check_same_device(**tensors):
    dev = None
    for t in tensors.values():  # one pass, no dict built on the usual path (it runs on every call)
        if isinstance(t, torch.Tensor):
            if dev is None:
                dev = t.device
            elif t.device != dev:
                break
    else:
        return
    devs = {n: t.device for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devs.values())) > 1:
        first = next(iter(devs))
        for n, dv in devs.items():
            if dv != devs[first]:
                _fail(ValueError, n, f"device {devs[first]} (as {first})", str(dv), f"Move {n} to {devs[first]}.")


def check_descale(name, d, batch, nheads_k, device):
    if d is None:
        return
    if not isinstance(d, torch.Tensor):  # stride-0 broadcast views are fine: no contiguity rule here
        _fail(TypeError, name, "a torch.Tensor", type(d).__name__, f"Pass {name} as a tensor.")
    if d.dtype != torch.float32:
        _fail(TypeError, name, "a float32 tensor", str(d.dtype), f"Pass {name}.float().")
    if d.device != device:
        _fail(ValueError, name, f"device {device}", str(d.device), f"Move {name} to {device}.")
    ok = (d.numel() == 1 and d.dim() <= 2) or (
        d.dim() == 2 and d.shape[0] in (1, batch) and d.shape[1] in (1, nheads_k)
    )
    if not ok:
        _fail(
            ValueError,
            name,
            f"shape ({batch}, {nheads_k}) = (batch, nheads_k), or a per-tensor (), (1,) or (1, 1), "
            f"or per-sequence ({batch}, 1)",
            f"shape {tuple(d.shape)}",
            "Pass one descale per (sequence, KV head), as FA3 does.",
        )


def check_descale_values(name, d, validate):
    if d is None or not want_value_checks(d, validate):
        return
    bad = ~torch.isfinite(d) | (d <= 0)
    if bool(bad.any()):
        _fail(
            ValueError,
            name,
            "finite, positive descales",
            f"{int(bad.sum())} NaN/Inf/non-positive value(s)",
            "Compute descales as max(amax, floor) / fp8_max (fp8attn.quant.compute_descale).",
        )


def check_leading_dims(k_name, k, v_name, v, ndim, what):
    """v's first ``ndim`` dims equal k's (they index the same tokens, pages or slots)."""
    if v.shape[:ndim] != k.shape[:ndim]:
        _fail(
            ValueError,
            v_name,
            f"{what} {tuple(k.shape[:ndim])} (as {k_name})",
            f"{tuple(v.shape[:ndim])}",
            f"Give {k_name} and {v_name} the same {what}.",
        )


def check_cu_seqlens(name, cu, batch=None, validate=False, total=None, total_name=None):
    """``total``: the rows of the packed tensor the offsets index (``total_name``); the last offset may not
    pass it (a value check)."""
    check_tensor(name, cu, ndim=1)
    if cu.dtype != torch.int32:
        _fail(TypeError, name, "an int32 tensor", str(cu.dtype), f"Pass {name}.to(torch.int32).")
    if batch is not None and cu.numel() != batch + 1:
        _fail(
            ValueError,
            name,
            f"{batch + 1} entries (batch + 1)",
            f"{cu.numel()}",
            "cu_seqlens holds batch + 1 offsets starting at 0.",
        )
    if cu.numel() < 1:
        _fail(
            ValueError,
            name,
            "at least one entry",
            "an empty tensor",
            "cu_seqlens holds batch + 1 offsets starting at 0.",
        )
    if want_value_checks(cu, validate) and cu.numel() > 1:
        if bool((cu[1:] < cu[:-1]).any()) or int(cu[0]) != 0:
            _fail(
                ValueError,
                name,
                "non-decreasing offsets starting at 0",
                f"{cu.tolist()[:16]}",
                "Build it as torch.nn.functional.pad(seqlens.cumsum(0), (1, 0)).to(torch.int32).",
            )
        if total is not None and int(cu[-1]) > total:
            _fail(
                ValueError,
                name,
                f"a last offset <= {total} (the rows of {total_name})",
                f"{int(cu[-1])}",
                f"Pack every sequence's rows into {total_name}, or fix the offsets.",
            )


def check_max_seqlen(name, mx, cu_name, cu, validate):
    """``mx`` (an int; a SymInt under torch.compile) bounds the lengths in ``cu`` (a value check)."""
    if isinstance(mx, bool) or not isinstance(mx, (int, torch.SymInt)) or mx < 0:
        _fail(TypeError, name, "a non-negative int", describe(mx), "Pass the longest sequence length as an int.")
    if want_value_checks(cu, validate) and cu.numel() > 1:
        longest = int((cu[1:] - cu[:-1]).max())
        if longest > mx:
            _fail(
                ValueError,
                name,
                f">= the longest sequence ({longest})",
                f"{mx}",
                f"Pass the true maximum of the lengths in {cu_name}.",
            )


def check_cache_scales(name, sc, k_cache):
    """Per-token-head scales beside a paged cache: float32 or bfloat16 (num_blocks, page_size, nheads_k)."""
    check_tensor(name, sc, allow_none=True)
    if sc is not None and (tuple(sc.shape) != tuple(k_cache.shape[:3]) or sc.dtype not in SCALE_STORAGE_DTYPES):
        _fail(
            ValueError,
            name,
            f"float32 or bfloat16 {tuple(k_cache.shape[:3])} (num_blocks, page_size, nheads_k)",
            f"{sc.dtype} {tuple(sc.shape)}",
            "Allocate it beside the cache.",
        )


def check_int32(name, t, ndim=None):
    if t is None:
        return
    check_tensor(name, t, ndim=ndim)
    if t.dtype != torch.int32:
        _fail(TypeError, name, "an int32 tensor", str(t.dtype), f"Pass {name}.to(torch.int32).")


def check_out(out, shape, dtype, device):
    if out is None:
        return
    check_tensor("out", out)
    if tuple(out.shape) != tuple(shape):
        _fail(
            ValueError,
            "out",
            f"shape {tuple(shape)}",
            f"{tuple(out.shape)}",
            "Preallocate out with the output's shape.",
        )
    if out.dtype != dtype:
        _fail(
            TypeError,
            "out",
            f"dtype {dtype}",
            str(out.dtype),
            "Allocate out with the output dtype (see out_dtype / out_scale).",
        )
    if out.device != device:
        _fail(ValueError, "out", f"device {device}", str(out.device), f"Allocate out on {device}.")


def check_out_dtype(out_dtype):
    if out_dtype is not None and out_dtype not in SUPPORTED_OUT_DTYPES:
        _fail(
            TypeError,
            "out_dtype",
            "torch.bfloat16, torch.float16 or torch.float32",
            str(out_dtype),
            "For FP8 output pass out_scale= (static per-tensor scale) instead.",
        )


def check_out_scale(out_scale, device, out_dtype=None):
    """A static per-tensor FP8 output scale: float32, one element, on ``device``; ``out_dtype`` must then be
    None (the output is float8_e4m3fn)."""
    if out_scale is None:
        return
    check_tensor("out_scale", out_scale)
    if out_scale.numel() != 1:  # a scale per token / group / channel: a kind that does not fuse
        _fail(
            UnsupportedOutputQuant,
            "out_scale",
            "a float32 tensor with one element (static per-tensor scale)",
            f"shape {tuple(out_scale.shape)}",
            "Per-token, per-group and dynamic output quantization do not fuse "
            "(fp8attn.fused_output_quant_supported(kind) is False for them): pass out_scale=None and quantize "
            "the output separately.",
        )
    if out_scale.dtype != torch.float32:
        _fail(
            ValueError,
            "out_scale",
            "a float32 tensor with one element (static per-tensor scale)",
            f"shape {tuple(out_scale.shape)} dtype {out_scale.dtype}",
            "Only static per-tensor output scales fuse; quantize the output separately for other kinds.",
        )
    if out_scale.device != device:
        _fail(ValueError, "out_scale", f"device {device}", str(out_scale.device), f"Move out_scale to {device}.")
    if out_dtype is not None:
        raise ValueError(
            f"out_dtype: expected None when out_scale is given (the output is float8_e4m3fn), "
            f"got {out_dtype}. Drop out_dtype or out_scale."
        )


def check_num_splits(num_splits):
    """A split count: an int >= 0 (0 = the heuristic). Returns it."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(
            f"num_splits: expected an int >= 0 (0 = heuristic), got {describe(num_splits)}. Pass 0, 1 or a split count."
        )
    return num_splits


def check_new_tokens(name, t, fix):
    """New tokens written into a cache are 16/32-bit (an FP8 cache quantizes them)."""
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected bf16/fp16/fp32 new tokens, got {t.dtype}. {fix}")


def check_scales_cache(name, k_cache):
    """Per-token-head scales (``name``, given) describe an FP8 cache only."""
    if not is_fp8(k_cache.dtype):
        raise ValueError(
            f"{name}: expected None for a {k_cache.dtype} cache, got a tensor. Scales apply to FP8 caches."
        )


def check_window(window_size):
    if type(window_size) is tuple and len(window_size) == 2:  # (the usual form, without a generator)
        left, right = window_size
        if type(left) is int and type(right) is int and left >= -1 and right >= -1:
            return
    ok = (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    )
    if not ok:
        _fail(
            ValueError,
            "window_size",
            "a (left, right) pair of ints >= -1 (-1 = unbounded)",
            describe(window_size),
            "Pass window_size=(-1, -1) for no window.",
        )


def unsupported(name, value, default, why=""):
    """Raise NotImplementedError for an FA3 argument this implementation does not support yet."""
    if value is None or value is default:
        return
    if isinstance(value, (int, float, bool, tuple)) and value == default:
        return
    raise NotImplementedError(
        f"{name}={describe(value)} is not supported by fp8attn yet{': ' + why if why else ''}; leave it at {default!r}."
    )


def describe(value) -> str:
    """A short description of an argument for a message: a tensor's shape, dtype and device, never its values."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def check_flag(name, value, allow_none=False):
    """A Python bool (``numpy.bool_`` too); ``allow_none``: None as well (a hint left to the library)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return
    _fail(
        TypeError,
        name,
        "True or False" + (" (or None)" if allow_none else ""),
        describe(value),
        f"Pass {name} as a bool (a string such as 'no' would read as True).",
    )


def _finite_nonneg(value):
    """``value`` as a finite float >= 0 (anything ``float()`` takes: a Python or NumPy number, a one-element
    tensor), or None when it is not one; bools and strings count as not one although ``float()`` takes them."""
    if isinstance(value, (bool, str)):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return x if 0.0 <= x < math.inf else None


def check_softmax_scale(softmax_scale, headdim):
    """The logit scale: None (1/sqrt(headdim)) or a finite float >= 0. Returns the float."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if type(softmax_scale) is float and 0.0 <= softmax_scale < math.inf:  # (the usual form: no parse)
        return softmax_scale
    # the kernels take the row max of the raw logits and scale it after (max(s) * c == max(s * c) needs c >= 0)
    s = _finite_nonneg(softmax_scale)
    if s is None:
        _fail(
            ValueError,
            "softmax_scale",
            "a finite float >= 0",
            describe(softmax_scale),
            f"Pass None for 1/sqrt(headdim) = {1.0 / math.sqrt(headdim):.6g}, or negate q instead of the scale.",
        )
    return s


def check_softcap(softcap):
    """FA3's softcap: 0 (off) or a finite float > 0. Returns the float."""
    if type(softcap) is float and 0.0 <= softcap < math.inf:  # (the usual form: no parse)
        return softcap
    c = _finite_nonneg(softcap)
    if c is None:
        _fail(
            ValueError,
            "softcap",
            "a finite float >= 0 (0 = no capping)",
            describe(softcap),
            "Pass softcap=0.0 to disable it, or the model's positive cap (e.g. 30.0 or 50.0).",
        )
    return c


def check_descale_kind(name, d, tensor_name, dtype):
    """A descale describes an FP8 tensor: refuse one for a 16/32-bit ``tensor_name`` (FA3 applies descales to
    FP8 inputs only)."""
    if d is not None and not is_fp8(dtype):
        _fail(
            ValueError,
            name,
            f"None for a {dtype} {tensor_name} (a descale describes an FP8 tensor)",
            describe(d),
            f"Drop {name} (FA3 applies descales to FP8 data only), or pass an FP8 {tensor_name} "
            "(fp8attn.quantize_qkv) with its descale.",
        )


def check_out_scale_values(out_scale, validate):
    """The static output scale is finite and > 0 (a value check: CPU, or validate=True on a GPU)."""
    if out_scale is None or not want_value_checks(out_scale, validate):
        return
    s = float(out_scale.reshape(()))
    if not (0.0 < s < math.inf):
        _fail(
            ValueError,
            "out_scale",
            "a finite value > 0",
            f"{s}",
            "Pass the static output scale amax / 448 of the tensor the output feeds (a calibrated value).",
        )


def check_seqused(name, seqused, batch, cu, validate):
    """``seqused_q`` / ``seqused_k``: (batch,) int32, each 0 <= seqused[b] <= the sequence's length in ``cu``
    (the length a value check)."""
    if seqused is None:
        return
    check_int32(name, seqused, ndim=1)
    if seqused.numel() != batch:
        _fail(ValueError, name, f"{batch} entries (batch)", f"{seqused.numel()}", "Pass one used length per sequence.")
    if want_value_checks(seqused, validate) and batch:
        lens = (cu[1:] - cu[:-1]).to(seqused.device)
        bad = (seqused < 0) | (seqused > lens)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            _fail(
                ValueError,
                name,
                "0 <= seqused[b] <= the sequence's length in cu_seqlens",
                f"{int(seqused[b])} for sequence {b} of length {int(lens[b])}",
                "Use at most the tokens each sequence holds (or grow its cu_seqlens entry).",
            )


def check_slots(slot_mapping, num_slots, validate, name="slot_mapping"):
    """Slot ids < ``num_slots`` and, among the non-negative ones, distinct (a value check)."""
    if not want_value_checks(slot_mapping, validate) or not slot_mapping.numel():
        return
    hi = int(slot_mapping.max())
    if hi >= num_slots:
        _fail(
            ValueError,
            name,
            f"slots < num_blocks * page_size = {num_slots} (negative = skip)",
            f"{hi}",
            "Fix the block allocation.",
        )
    used = slot_mapping[slot_mapping >= 0]
    if used.numel() != torch.unique(used).numel():
        dup = int(used.sort().values.unique_consecutive(return_counts=True)[1].gt(1).sum())
        _fail(
            ValueError,
            name,
            "distinct slots within one call",
            f"{dup} slot(s) given to more than one token",
            "Give every new token its own slot (the order two writes to one slot land in is undefined on a GPU).",
        )


def check_index_values(name, t, limit, validate, what):
    """Integer entries in [0, limit) (a value check)."""
    if t is None or not t.numel() or not want_value_checks(t, validate):
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= limit:
        _fail(ValueError, name, f"{what} in [0, {limit})", f"range [{lo}, {hi}]", f"Index existing {what}.")


def check_lse_values(lse_partial, validate):
    """Split LSEs are finite or -inf (an empty split); NaN or +inf would poison the merge (a value check)."""
    if not want_value_checks(lse_partial, validate) or not lse_partial.numel():
        return
    bad = torch.isnan(lse_partial) | torch.isposinf(lse_partial)
    if bool(bad.any()):
        _fail(
            ValueError,
            "lse_partial",
            "finite values or -inf (an empty split)",
            f"{int(bad.sum())} NaN/+inf value(s)",
            "Pass the LSEs the split-KV kernel wrote.",
        )


def check_finite(name, t, validate):
    """No NaN or Inf in ``t`` (a value check: CPU, or validate=True on a GPU)."""
    if not want_value_checks(t, validate) or not t.numel():
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        n = int(bad.sum())
        _fail(
            ValueError,
            name,
            "finite values",
            f"{n} NaN/Inf value(s) of {t.numel()}",
            f"Find where {name} overflowed (or clamp it) before quantizing: a non-finite value has no FP8 scale.",
        )
