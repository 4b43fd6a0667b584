"""What this device / install supports, and the one fallback policy; cached.

* ``kernel_for(t, kernel)``: the dispatch point of every op. It returns the kernel's launch function for a
  call on ``t``'s device, or None for the torch reference; a CUDA call that no kernel can take (no triton,
  a GPU older than sm89, FP8ATTN_FORCE_REFERENCE=1, an ImportError inside ``fp8attn.kernels``) is a
  *fallback* and goes through ``report_fallback`` first (warn once per process and reason, raise
  ``FallbackError`` with FP8ATTN_FALLBACK=error, or nothing with ``silent``). CPU tensors never warn.
  The rule is the pure function ``decide``; its result is cached per (device, kernel, environment).
* ``supports(entry, **call_kwargs)``: which kernel ("hopper", "triton" or None) a call of a public
  function runs, and why, from the same rules dispatch runs (see docs/api.md).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
import warnings
from typing import NamedTuple

import torch

__all__ = [
    "has_triton",
    "triton_version",
    "kernel_path_ok",
    "execution_path",
    "warn_once",
    "launch_device",
    "FallbackWarning",
    "FallbackError",
    "fallback_mode",
    "report_fallback",
    "decide",
    "Decision",
    "kernel_for",
    "KERNELS",
    "supports",
    "Support",
    "ENTRIES",
    "MIN_CAPABILITY",
]


@functools.lru_cache(None)
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(None)
def triton_version() -> str | None:
    if not has_triton():
        return None
    import triton

    return triton.__version__


@functools.lru_cache(None)
def _cc(index: int):
    return torch.cuda.get_device_capability(index)


# FP8 tensor-core dots (tl.dot on e4m3) need sm89 (Ada) or newer; the kernels are tuned for sm90.
MIN_CAPABILITY = (8, 9)
_FORCE_ENV = "FP8ATTN_FORCE_REFERENCE"


class Decision(NamedTuple):
    """Whether a kernel can run for tensors on one device (``decide``).

    ok : a kernel runs. reason : the fallback's key when a CUDA call runs the torch reference instead,
    else None (the kernel runs, or the tensors are not on a CUDA device). message : why, and the fix.
    """

    ok: bool
    reason: str | None
    message: str


def decide(
    device_type: str,
    capability: tuple | None,
    triton_present: bool,
    force_reference: bool,
    import_error: str | None = None,
    kernel: str = "",
) -> Decision:
    """The fallback rule: whether tensors of ``device_type`` run a kernel, as a pure function of the facts.

    Parameters
    ----------
    device_type : "cuda", "cpu", "meta", ... (only CUDA tensors run kernels; the others run the reference
        without a fallback).
    capability : (major, minor) compute capability of the CUDA device (None elsewhere).
    triton_present : whether triton is installed.
    force_reference : FP8ATTN_FORCE_REFERENCE=1.
    import_error : the text of the ImportError that importing the kernel's module raised, or None.
    kernel : the kernel module's name (``fp8attn.kernels.<kernel>``), for the message and the reason key.

    Returns
    -------
    Decision
    """
    if device_type != "cuda":
        return Decision(False, None, f"{device_type} tensors run the torch reference (the CPU path; no fallback)")
    if force_reference:
        return Decision(
            False,
            "force_reference",
            f"{_FORCE_ENV}=1 makes CUDA calls run the torch reference "
            f"(10-100x slower than the kernels); unset {_FORCE_ENV} to run the kernels",
        )
    if not triton_present:
        return Decision(
            False,
            "no_triton",
            "triton is not installed, so CUDA calls run the torch reference "
            "(10-100x slower); install triton (3.6 is supported) to run the kernels",
        )
    if capability is None or tuple(capability) < MIN_CAPABILITY:
        cc = "unknown" if capability is None else f"sm{capability[0]}{capability[1]}"
        return Decision(
            False,
            "old_gpu",
            f"this GPU is {cc} and fp8attn's kernels need FP8 tensor cores "
            f"(sm{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]} or newer; tuned for Hopper sm90), so CUDA calls "
            "run the torch reference (10-100x slower); run on an Ada/Hopper GPU for the kernels",
        )
    if import_error is not None:
        return Decision(
            False,
            f"kernel_import:{kernel}",
            f"fp8attn.kernels.{kernel} failed to import "
            f"({import_error}), so its CUDA calls run the torch reference (10-100x slower); "
            "check the triton installation (3.6 is supported) and fix the import error",
        )
    return Decision(True, None, f"the Triton kernels run (sm{capability[0]}{capability[1]}, triton {triton_version()})")


# kernel name -> (module under fp8attn.kernels, launch function)
KERNELS = {
    "dense": ("dense", "launch_dense_fwd"),
    "paged": ("paged", "launch_paged_fwd"),
    "combine": ("combine", "launch_combine"),
    "cache": ("cache", "launch_write_kv_cache"),
    "append": ("cache", "launch_append_kv_cache"),
    "quantize": ("quantize", "launch_quantize"),
    "backward": ("backward", "launch_attention_bwd"),
}


def _import_kernel(kernel: str):
    """``(launch, None)``, or ``(None, error text)`` when ``fp8attn.kernels.<module>`` does not import.
    (Called once per (device, kernel): ``_DECISIONS`` caches the result.)"""
    module, name = KERNELS[kernel]
    try:
        mod = importlib.import_module(f"{__package__}.kernels.{module}")
    except ImportError as e:
        return None, f"{type(e).__name__}: {e}"
    fn = getattr(mod, name, None)
    return (fn, None) if fn is not None else (None, f"it defines no {name}")


def _facts(device: torch.device):
    """(device type, compute capability or None, triton installed) of ``device``: the live inputs of
    ``decide`` (tests replace this function to simulate other machines)."""
    if device.type != "cuda":
        return device.type, None, has_triton()
    return "cuda", _cc(device.index if device.index is not None else torch.cuda.current_device()), has_triton()


# (device, kernel, FP8ATTN_FORCE_REFERENCE) -> (launch or None, Decision)
_DECISIONS: dict = {}


def _decide_kernel(device: torch.device, kernel: str, loader=None, force=None):
    """``(launch or None, Decision)`` for ``kernel`` on ``device`` (computed once per key, then cached).
    ``loader``: for kernels outside ``KERNELS``, a function returning the launch function (raising
    ImportError when it cannot)."""
    env = os.environ.get(_FORCE_ENV) if force is None else force
    key = (device, kernel, env)
    hit = _DECISIONS.get(key)
    if hit is not None:
        return hit
    dtype_, cc, triton_ok = _facts(device)
    d = decide(dtype_, cc, triton_ok, env == "1", kernel=kernel)
    launch = None
    if d.ok:  # (imports only where they can be used: a CUDA device that can run the kernels)
        if loader is None:
            launch, err = _import_kernel(kernel)
        else:
            try:
                launch, err = loader(), None
            except ImportError as e:
                launch, err = None, f"{type(e).__name__}: {e}"
            if launch is None and err is None:
                err = "no launch function"
        if err is not None:
            d = decide(dtype_, cc, triton_ok, False, import_error=err, kernel=kernel)
    _DECISIONS[key] = (launch, d)
    return launch, d


def kernel_for(t: torch.Tensor, kernel: str, loader=None):
    """The launch function of ``kernel`` for a call on ``t``'s device, or None (run the reference).

    This is the one dispatch point of the fallback policy: for a CUDA tensor that no kernel can take
    (no triton, a GPU older than sm89, FP8ATTN_FORCE_REFERENCE=1, an ImportError inside
    ``fp8attn.kernels``) it calls ``report_fallback`` -- warn once, raise ``FallbackError`` or stay
    silent -- before returning None; call it before anything runs or is written. CPU tensors get None
    without a word. Cached per (device, kernel, FP8ATTN_FORCE_REFERENCE): one dict lookup per call.

    Parameters
    ----------
    t : the call's leading tensor (its device decides).
    kernel : a name of ``KERNELS``, or any name with ``loader``.
    loader : for kernels outside ``fp8attn.kernels``: returns the launch function (ImportError when it
        cannot be built).
    """
    launch, d = _decide_kernel(t.device, kernel, loader)
    if d.reason is not None:
        report_fallback(d.reason, d.message)
    return launch


def _clear_caches() -> None:
    """Forget the cached decisions and ``supports`` answers (tests that simulate another machine)."""
    _DECISIONS.clear()
    _SUPPORT_CACHE.clear()


def kernel_path_ok(t: torch.Tensor) -> bool:
    """True when ``t`` lives on a CUDA device where our Triton kernels run (FP8 dots need sm89+; the
    kernels are tuned for sm90). FP8ATTN_FORCE_REFERENCE=1 forces the reference path. A query: it
    reports no fallback (dispatch goes through ``kernel_for``)."""
    return _decide_kernel(t.device, "dense")[1].ok


def launch_device(t: torch.Tensor):
    """A context that makes ``t``'s CUDA device current while kernels are launched: triton launches on
    the current device, so inputs on another GPU (cuda:1 while cuda:0 is current) would otherwise run
    on the wrong one. A no-op (no guard object) when ``t`` is already on the current device."""
    idx = t.get_device()
    if idx < 0 or idx == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(idx)


def execution_path(device: str | torch.device | None = None) -> str:
    """'triton' or 'reference' for tensors on ``device`` (default: cuda if available, else cpu)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    return "triton" if _decide_kernel(dev, "dense")[1].ok else "reference"


_warned: set = set()
_warn_lock = threading.Lock()

_FALLBACK_MODES = ("warn", "error", "silent")


class FallbackWarning(RuntimeWarning):
    """A CUDA call that no kernel can take runs the torch reference instead (the fallback policy)."""


class FallbackError(NotImplementedError):
    """Raised instead of a fallback when FP8ATTN_FALLBACK=error."""


def warn_once(key: str, msg: str, category=RuntimeWarning) -> None:
    """``warnings.warn(msg)`` the first time ``key`` is seen in this process (thread-safe)."""
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(msg, category, stacklevel=3)


def fallback_mode() -> str:
    """The fallback policy from FP8ATTN_FALLBACK: 'warn' (default), 'error' or 'silent'."""
    mode = os.environ.get("FP8ATTN_FALLBACK", "warn").strip().lower() or "warn"
    if mode not in _FALLBACK_MODES:
        raise ValueError(
            f"FP8ATTN_FALLBACK: expected one of {_FALLBACK_MODES}, got {mode!r}; "
            "fix: unset it or set it to warn, error or silent"
        )
    return mode


def report_fallback(reason: str, message: str) -> None:
    """Apply the one fallback policy to a CUDA call that will run the torch reference.

    ``reason`` is a short stable key (one warning per process and reason); ``message`` says what
    runs instead and why. 'warn' warns once (FallbackWarning), 'error' raises FallbackError, 'silent'
    does nothing. Call it before the reference runs and before anything is written."""
    mode = fallback_mode()
    if mode == "silent":
        return
    text = f"fp8attn fallback ({reason}): {message}"
    if mode == "error":
        raise FallbackError(text + " [FP8ATTN_FALLBACK=error]")
    warn_once(
        "fallback:" + reason,
        text + " (warned once per process; FP8ATTN_FALLBACK=error raises instead, =silent hides this)",
        FallbackWarning,
    )


# ---------------------------------------------------------------------------------------------
# supports(): which kernel a call of a public function runs, and why
# ---------------------------------------------------------------------------------------------

ENTRIES = (
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "write_kv_cache",
    "quantize_qkv",
)
# entry -> (its leading tensor argument, the kernels (``KERNELS``) it launches)
_ENTRY_KERNELS = {
    "flash_attn_func": ("q", ("dense",)),
    "flash_attn_varlen_func": ("q", ("dense",)),
    "flash_attn_qkvpacked_func": ("qkv", ("dense",)),
    "flash_attn_with_kvcache": ("q", ("paged",)),  # (+ "append" with new k/v)
    "flash_attn_combine": ("out_partial", ("combine",)),
    "write_kv_cache": ("k", ("cache",)),
    "quantize_qkv": ("q", ("quantize",)),
}
_HOPPER_ENTRIES = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_with_kvcache")
_SUPPORT_CACHE: dict = {}


class Support(NamedTuple):
    """What ``supports`` answers.

    kernel : "hopper" (the TMA / warp-specialized Gluon kernel, sm90), "triton" (the plain Triton kernel)
        or None (the torch reference: the CPU path, or a fallback on CUDA).
    reason : why, in words (for a fallback, the warning's text).
    """

    kernel: str | None
    reason: str


def supports(entry: str, *, device=None, **call_kwargs) -> Support:
    """Which kernel a call of the public function ``entry`` runs on this machine, and why.

    It asks the rules dispatch itself runs (``decide`` for the kernels-or-reference choice,
    ``kernels.dense.tma_reason`` / ``kernels.paged.tma_reason`` for Hopper-or-Triton), so the answer is
    what the call does. Nothing runs, nothing is allocated on a device, no fallback is reported. Cached
    per (device, configuration): call it per layer.

    Parameters
    ----------
    entry : one of ``ENTRIES``: "flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
        "flash_attn_with_kvcache", "flash_attn_combine", "write_kv_cache", "quantize_qkv".
    device : the device the call runs on (default: the leading tensor's, else cuda when available, else
        cpu). Pass it with shape-only arguments.
    **call_kwargs : the call's arguments by name, as the function takes them (``q=``, ``k=``, ``v=``,
        ``causal=``, ``out_scale=``, ``page_table=``, ...). A tensor may be given as itself, as a tensor on
        the meta device, or as a ``(shape, dtype)`` pair (a contiguous tensor of that shape). Arguments
        left out take the function's defaults; with no tensor at all the answer is the device's: the best
        kernel it runs for ``entry`` (what ``fp8attn info`` prints).

    Returns
    -------
    Support
        ``kernel`` in {"hopper", "triton", None} and ``reason``. A varlen paged call ("hopper") runs its
        sequences of 128 or more queries on the Hopper kernel and the others on the Triton kernel.
        Arguments the function would refuse are not checked here (the call raises as usual).

    Examples
    --------
    >>> supports("flash_attn_func", q=q8, k=k8, v=v8, causal=True)   # doctest: +SKIP
    Support(kernel='hopper', reason='...')
    """
    if entry not in _ENTRY_KERNELS:
        raise ValueError(f"entry: expected one of {ENTRIES}, got {entry!r}. Pass a public function's name.")
    kw = {name: _as_tensor(val) for name, val in call_kwargs.items()}
    lead = kw.get(_ENTRY_KERNELS[entry][0])
    if device is not None:
        dev = torch.device(device)
    elif isinstance(lead, torch.Tensor) and lead.device.type != "meta":
        dev = lead.device
    else:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (
        entry,
        dev,
        os.environ.get(_FORCE_ENV),
        os.environ.get("FP8ATTN_DENSE_BACKEND"),
        tuple(sorted((name, _key_of(val)) for name, val in kw.items())),
    )
    hit = _SUPPORT_CACHE.get(key)
    if hit is None:
        hit = _SUPPORT_CACHE[key] = _support(entry, dev, kw, lead is not None)
    return hit


def _as_tensor(val):
    """A ``(shape, dtype)`` pair as a contiguous meta tensor; anything else as given."""
    if isinstance(val, tuple) and len(val) == 2 and isinstance(val[1], torch.dtype):
        return torch.empty(tuple(val[0]), dtype=val[1], device="meta")
    return val


def _key_of(val):
    """A hashable summary of an argument: what the dispatch rules read (shape, dtype, strides, alignment)."""
    if isinstance(val, torch.Tensor):
        return (
            "tensor",
            tuple(val.shape),
            val.dtype,
            tuple(val.stride()),
            val.device.type,
            val.data_ptr() % 16 if val.device.type != "meta" else 0,
        )
    if isinstance(val, (list, tuple)):
        return tuple(_key_of(x) for x in val)
    if val is None or isinstance(val, (bool, int, float, str, torch.dtype)):
        return val
    return (type(val).__name__, repr(val))


def _support(entry, dev, kw, has_call):
    _, kernels = _ENTRY_KERNELS[entry]
    if entry == "flash_attn_with_kvcache" and kw.get("k") is not None:
        kernels = ("append",) + kernels
    if entry == "quantize_qkv" and kw.get("backend", "auto") != "auto":
        if kw["backend"] == "torch":
            return Support(None, "backend='torch' asks for the torch path")
        return Support("triton", "backend='triton' asks for the Triton kernel")
    decision = None
    for kernel in kernels:
        decision = _decide_kernel(dev, kernel)[1]
        if not decision.ok:
            return Support(None, decision.message)
    cc = _facts(dev)[1]
    if entry not in _HOPPER_ENTRIES:
        return Support("triton", f"{entry} has one kernel, the Triton kernel; {decision.message}")
    from .kernels.hopper import dense_launch

    why = dense_launch.capability_reason(cc) or (
        None if dense_launch.HAS_GLUON else "triton.experimental.gluon is not available"
    )
    if why:
        return Support("triton", f"the Triton kernel: the Hopper kernel {why} (this GPU is sm{cc[0]}{cc[1]})")
    if not has_call:
        return Support(
            "hopper",
            "sm90: the Hopper kernel for the calls its rules accept (FP8 e4m3 inputs, head dim "
            "64/128(/256 dense) or qk 192 / v 128, no window/softcap, ...), the Triton kernel for the others; pass a "
            "call's arguments for its answer",
        )
    why = _dense_reason(entry, kw, cc) if entry != "flash_attn_with_kvcache" else _paged_reason(kw, dev, cc)
    if why:
        return Support("triton", f"the Triton kernel: {why}")
    if entry == "flash_attn_with_kvcache" and (kw.get("cu_seqlens_q") is not None or kw.get("attention_chunk", 0)):
        return Support(
            "hopper", "the Hopper kernel for the sequences of 128 or more queries, the Triton kernel for the others"
        )
    return Support("hopper", "the Hopper kernel (TMA, warp-specialized)")


def _meta(shape, dtype):
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _descales_meta(batch, nheads_k):
    """The (batch, nheads_k) float32 descale views the public functions pass down (``quant.expand_descale``)."""
    return _meta((), torch.float32).expand(batch, nheads_k)


def _window(kw):
    left, right = kw.get("window_size", (-1, -1))
    return (int(left), 0 if kw.get("causal", False) else int(right))


def _dense_reason(entry, kw, cc):
    """``kernels.dense.tma_reason`` for the call ``flash_attn_func`` / ``_varlen_func`` / ``_qkvpacked_func``
    passes down (interface -> ops -> launcher), on shapes (meta tensors) where it allocates."""
    from .kernels import dense as kd
    from .kernels.planning import attention_out_dtype

    if entry == "flash_attn_qkvpacked_func":
        qkv, hq = kw["qkv"], kw.get("num_heads_q")
        if qkv.dim() == 5:
            q, k, v = qkv.unbind(dim=2)
        else:
            hk = (qkv.shape[2] - hq) // 2
            q, k, v = qkv.split([hq, hk, hk], dim=2)
    else:
        q, k, v = kw["q"], kw["k"], kw["v"]
    varlen = entry == "flash_attn_varlen_func"
    out_scale, out = kw.get("out_scale"), kw.get("out")
    dt = attention_out_dtype(q.dtype, kw.get("out_dtype"), out_scale)
    block = kw.get("descale_block_size")
    chunk = int(kw.get("attention_chunk", 0) or 0)
    hq, hk = q.shape[-2], k.shape[-2]
    cu_q, cu_k, max_q = kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k"), kw.get("max_seqlen_q")
    if not varlen:
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        if chunk and sq and sk and ((sk - 1) // chunk > 0 or sq > sk):  # local_attention.chunked_dense
            pieces = (max(sk - 1, 0) // chunk) + (sq // chunk + 1) + 1
            q, k, v = (_meta((x.shape[0] * x.shape[1],) + tuple(x.shape[2:]), x.dtype) for x in (q, k, v))
            cu_q = cu_k = _meta((b * pieces + 1,), torch.int32)
            max_q, varlen, batch = min(chunk, sq), True, b * pieces
            out = (
                out if out is None or out.is_contiguous() else None
            )  # (local_attention._packed_out: a view, else fresh)
            out = out.reshape(q.shape[0], hq, v.shape[-1]) if out is not None else None
        else:
            batch = b
    else:
        batch = cu_q.shape[0] - 1
        if chunk:  # local_attention.chunked_varlen
            max_k = int(kw["max_seqlen_k"])
            pieces = (max(max_k - 1, 0) // chunk) + (int(max_q) // chunk + 1) + 1
            cu_q = cu_k = _meta((batch * pieces + 1,), torch.int32)
            max_q, batch = min(chunk, int(max_q)), batch * pieces
    if not varlen and kd.wants_kmajor_copy(v, q.dtype == torch.float8_e4m3fn, None, True):
        b_, s_, h_, d_ = v.shape  # transpose_v_kmajor's copy: memory order (batch, nheads_k, headdim_v, seqlen_k)
        v = _meta((b_, h_, d_, s_), v.dtype).permute(0, 3, 1, 2)
    oshape = tuple(q.shape[:-1]) + (v.shape[-1],)
    if out is None:
        out = _meta(oshape, dt)
    lse = None
    if kw.get("return_attn_probs", False):
        lse = _meta((hq, q.shape[0]) if varlen else (q.shape[0], hq, q.shape[1]), torch.float32)
    if block:
        qd, kd_, vd = kw.get("q_descale"), kw.get("k_descale"), _descales_meta(batch, hk)
    else:
        qd = kd_ = vd = _descales_meta(batch, hk)
    return kd.tma_reason(
        q,
        k,
        v,
        out,
        lse,
        causal=bool(kw.get("causal", False)),
        window_size=_window(kw),
        softcap=float(kw.get("softcap", 0.0)),
        q_descale=qd,
        k_descale=kd_,
        v_descale=vd,
        out_scale=out_scale,
        cu_seqlens_q=cu_q if varlen else None,
        cu_seqlens_k=cu_k if varlen else None,
        seqused_q=kw.get("seqused_q"),
        seqused_k=kw.get("seqused_k"),
        max_seqlen_q=max_q,
        descale_block_q=block or None,
        descale_block_k=block or None,
        backend=kd.dense_backend(),
        capability=cc,
    )


def _paged_reason(kw, dev, cc):
    """``kernels.paged.tma_reason`` (and, varlen, the launch's split count) for the call
    ``flash_attn_with_kvcache`` passes down, on shapes (meta tensors) where it allocates."""
    from .kernels import paged as kp
    from .kernels.planning import CPU_NUM_SMS, attention_out_dtype

    q, k_cache, v_cache = kw["q"], kw["k_cache"], kw["v_cache"]
    cu_q = kw.get("cu_seqlens_q")
    varlen = cu_q is not None
    batch = cu_q.shape[0] - 1 if varlen else q.shape[0]
    max_q = int(kw["max_seqlen_q"]) if varlen else q.shape[1]
    hq, hk = q.shape[-2], k_cache.shape[2]
    chunk = int(kw.get("attention_chunk", 0) or 0)
    meta_cu = kw.get("scheduler_metadata")
    num_splits = int(meta_cu.shape[0]) if isinstance(meta_cu, torch.Tensor) else int(kw.get("num_splits", 0))
    pt = kw.get("page_table")
    if pt is None:
        if kw.get("cache_leftpad") is not None or chunk:  # one-token pages (interface._leftpad_view)
            n, s = k_cache.shape[0], k_cache.shape[1]
            k_cache, v_cache = (_meta((n * s, 1) + tuple(c.shape[2:]), c.dtype) for c in (k_cache, v_cache))
            pt = _meta((batch, s), torch.int32)
        else:
            pt = _meta((batch, 1), torch.int32)
    out_scale, out = kw.get("out_scale"), kw.get("out")
    dt = attention_out_dtype(q.dtype, kw.get("out_dtype"), out_scale)
    if chunk:  # local_attention.chunked_cache_call: one varlen call over chunk pieces
        pieces = max_q // chunk + 2
        width = min(pt.shape[1], chunk // k_cache.shape[1])
        if not varlen:
            q = _meta((q.shape[0] * q.shape[1],) + tuple(q.shape[2:]), q.dtype)
            out = None if out is None or not out.is_contiguous() else out.reshape(q.shape[0], hq, -1)
        batch, varlen = batch * pieces, True
        cu_q, max_q = _meta((batch + 1,), torch.int32), min(chunk, max_q)
        pt = _meta((batch, width), torch.int32)
    if out is None:
        out = _meta(tuple(q.shape[:-1]) + (v_cache.shape[-1],), dt)
    lse = None
    if kw.get("return_softmax_lse", False):
        lse = _meta((hq, q.shape[0]) if varlen else (batch, hq, q.shape[1]), torch.float32)
    ds = _descales_meta(batch, hk)
    ks, vs = kw.get("k_cache_scales"), kw.get("v_cache_scales")
    args = dict(
        cu_seqlens_q=cu_q if varlen else None,
        max_seqlen_q=max_q,
        causal=bool(kw.get("causal", False)),
        window_size=_window(kw),
        softcap=float(kw.get("softcap", 0.0)),
        q_descale=ds,
        k_descale=ds,
        v_descale=ds,
        k_cache_scales=ks,
        v_cache_scales=vs,
        out_scale=out_scale,
        num_splits=num_splits,
    )
    why = kp.tma_reason(q, k_cache, v_cache, pt, _meta((batch,), torch.int32), out, lse, capability=cc, **args)
    if why is None and varlen:
        num_sms = kp._num_sms(dev) if torch.cuda.is_available() and dev.type == "cuda" else CPU_NUM_SMS
        splits = kp.launch_grid(
            q,
            k_cache,
            v_cache,
            pt,
            cu_seqlens_q=cu_q,
            max_seqlen_q=max_q,
            k_token_scales=ks is not None,
            v_token_scales=vs is not None,
            num_splits=num_splits,
            num_sms=num_sms,
        )[-1]
        if splits > 1:
            why = f"the launch splits the keys ({splits} splits), which keeps the whole varlen batch on it"
    return why
