"""What this device / install supports; cached. Decides the execution path of each op."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
import warnings

import torch

__all__ = ["has_triton", "triton_version", "kernel_path_ok", "execution_path", "warn_once", "launch_device",
           "FallbackWarning", "FallbackError", "fallback_mode", "report_fallback"]


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


def kernel_path_ok(t: torch.Tensor) -> bool:
    """True when ``t`` lives on a CUDA device where our Triton kernels run (FP8 dots need sm89+;
    the kernels are tuned for sm90). FP8ATTN_FORCE_REFERENCE=1 forces the reference path."""
    if t.device.type != "cuda" or not has_triton() or os.environ.get("FP8ATTN_FORCE_REFERENCE") == "1":
        return False
    return _cc(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= (8, 9)


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
    if dev.type != "cuda":
        return "reference"
    return "triton" if kernel_path_ok(torch.empty(0, device=dev)) else "reference"


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
        raise ValueError(f"FP8ATTN_FALLBACK: expected one of {_FALLBACK_MODES}, got {mode!r}; "
                         "fix: unset it or set it to warn, error or silent")
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
    warn_once("fallback:" + reason, text + " (warned once per process; FP8ATTN_FALLBACK=error raises instead, "
              "=silent hides this)", FallbackWarning)
