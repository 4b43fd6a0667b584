"""Multi-head latent attention (MLA) prefill in FP8 over a cached prefix (DeepSeek-V2/V3-style shapes).

Per head the query and key have a NoPE part (``qk_nope``, 128) and a RoPE part (``qk_rope``, 64; the
key's RoPE part ``k_pe`` is one per token, shared by every head) and V has ``v_head_dim`` (128). The
latent cache holds per token the compressed KV ``kv_c`` (``kv_lora_rank``, 512) and ``k_pe`` (64),
paged, bf16 or FP8. ``prefill`` attends the new tokens (causal among themselves) and their cached
prefix, which it walks in chunks: gather the chunk's latent rows, up-project them with ``w_uk`` /
``w_uv`` to per-head K NoPE / V, build FP8 K / V, attend, and merge all partial results by their LSE
(``flash_attn_combine``). Q is quantized once and reused by every chunk. See docs/mla.md.

Modes (argument ``mode``, else the environment variable ``FP8ATTN_MLA_FP8_PREFILL``):

* ``"bf16_gather"`` (the default): each chunk is gathered and up-projected in the activations' dtype,
  then quantized with its own dynamic per-tensor descales (amax pass + quantize pass).
* ``"fp8_gather"``: each chunk is written to FP8 in one pass with descales estimated from the new
  tokens, ``max(new_token_descale, 1e-6) * 2``; larger values saturate and are counted on the device
  (``SaturationStats``).
* ``"off"``: the 16-bit pipeline (no quantization at all).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from . import capability
from ._checks import _fail
from .interface import flash_attn_combine, flash_attn_varlen_func
from .kernels.planning import DESCALE_FLOOR
from .quant import empty_seq_major

__all__ = [
    "prefill",
    "prefill_ref",
    "quantize_mla",
    "resolve_mode",
    "SaturationStats",
    "Support",
    "MODES",
    "DEFAULT_MODE",
    "ENV_MODE",
    "GATHER_DESCALE_MIN",
    "GATHER_DESCALE_MARGIN",
]

MODES = ("bf16_gather", "fp8_gather", "off")
DEFAULT_MODE = "bf16_gather"
ENV_MODE = "FP8ATTN_MLA_FP8_PREFILL"
# fp8_gather's descale estimate for a cached chunk: max(new_token_descale, GATHER_DESCALE_MIN) * MARGIN
GATHER_DESCALE_MIN = 1e-6
GATHER_DESCALE_MARGIN = 2.0
E4M3_MAX = 448.0
_E4M3 = torch.float8_e4m3fn
_ENV_ALIASES = {"1": DEFAULT_MODE, "on": DEFAULT_MODE, "0": "off", "": None}
_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


class SaturationStats:
    """Device-side counters of ``fp8_gather``'s saturation, accumulated by every ``prefill`` given it.

    ``counts`` is an int64 (2,) tensor on the device: [elements of the cached chunks' K and V that fell
    outside +-448 before the saturating cast, elements quantized with an estimated descale]. Updated
    with device ops only (no host read; CUDA-graph capturable); read it after the call.
    """

    def __init__(self, device="cpu"):
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)

    def reset(self) -> None:
        self.counts.zero_()

    @property
    def saturated(self) -> int:
        """Saturated elements so far (a host read)."""
        return int(self.counts[0])

    @property
    def total(self) -> int:
        """Elements quantized with an estimated descale so far (a host read)."""
        return int(self.counts[1])

    def rate(self) -> float:
        """saturated / total (0.0 before any element was counted); a host read."""
        s, t = self.counts.tolist()
        return s / t if t else 0.0


# ----------------------------------------------------------------------------------------------------------
# quantization: the fused kernel and its torch form
# ----------------------------------------------------------------------------------------------------------
def _descale(amax: torch.Tensor) -> torch.Tensor:
    """float32 descales from amaxes: ``max(amax, DESCALE_FLOOR * 448) / 448``, NaN where the amax is not
    finite (a NaN or Inf input), so that the damage shows in the output instead of being scaled away."""
    d = amax.float().clamp_min(DESCALE_FLOOR * E4M3_MAX) / E4M3_MAX
    return torch.where(torch.isfinite(amax), d, torch.full_like(d, float("nan")))


def _amax_torch(*parts):
    """The kernel's amax of the parts together: +inf when any element is NaN or Inf."""
    out = None
    for p in parts:
        a = p.float().abs()
        a = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)
        m = a.amax() if a.numel() else a.new_zeros(())
        out = m if out is None else torch.maximum(out, m)
    return out


def _cast_torch(x, inv, y):
    """``y[...] = saturate(x * inv)`` in e4m3fn (NaN propagates); returns the count of clipped elements."""
    z = x.float() * inv
    y.copy_(z.clamp(-E4M3_MAX, E4M3_MAX).to(_E4M3))
    return (z.abs() > E4M3_MAX).sum()


def _kv_only(kv):
    """(3,) descales from K's and V's (2,): the unused Q slot repeats K's."""
    return torch.cat([kv[:1], kv])


def _alloc(T, H, dn, dr, dv, device, has_q):
    q8 = torch.empty(T, H, dn + dr, dtype=_E4M3, device=device) if has_q else None
    k8 = torch.empty(T, H, dn + dr, dtype=_E4M3, device=device)
    return q8, k8, empty_seq_major((T, H, dv), _E4M3, device)


def _quant(qn, qp, kn, kp, v, ds=None, count=False, use_triton=False):
    """Quantize (Q,) K, V of MLA to FP8 e4m3fn, the RoPE parts concatenated after the NoPE parts.

    ``qn``/``qp`` (T, H, dn)/(T, H, dr) or None (K and V only); ``kn`` (T, H, dn); ``kp`` (T, dr) shared by
    the heads; ``v`` (T, H, dv). ``ds``: float32 (3,) static descales of Q, K, V (then one pass), or None
    for dynamic per-tensor descales (amax pass, device reduction, quantize pass).

    Returns ``(q8, k8, v8, ds, sat)``: q8 / k8 float8_e4m3fn (T, H, dn + dr) contiguous (q8 None without
    Q), v8 float8_e4m3fn (T, H, dv) sequence-major, ds float32 (3,), sat an int64 0-d count of clipped K/V
    elements (None unless ``count``)."""
    T, H, dn = kn.shape
    dr, dv = kp.shape[-1], v.shape[-1]
    has_q = qn is not None
    q8, k8, v8 = _alloc(T, H, dn, dr, dv, kn.device, has_q)
    kph = kp.unsqueeze(1).expand(T, H, dr)  # a zero head stride: never materialized
    if use_triton:
        from .kernels.mla_quant import BLOCK_T, launch_mla_quant

        n = -(-T // BLOCK_T) * H
        qa, qb = (qn, qp) if has_q else (kn, kph)
        launch = functools.partial(launch_mla_quant, qa, qb, kn, kph, v, q8 if has_q else k8, k8, v8, has_q=has_q)
        if ds is None:  # every slot of the workspace is written by the amax pass
            amax = torch.empty(3, n, dtype=torch.float32, device=kn.device)
            launch(amax, amax, amax, amax_pass=True, quant=False, count=False)
            ds = _descale(amax.amax(dim=1)) if has_q else _kv_only(_descale(amax[1:].amax(dim=1)))
        inv = 1.0 / ds  # IEEE division here, a multiply in the kernel: the torch form's bits
        sat = torch.empty(n, dtype=torch.int32, device=kn.device) if count else inv
        launch(inv, inv, sat, amax_pass=False, quant=True, count=count)
        return q8, k8, v8, ds, (sat.sum() if count else None)
    if ds is None:
        kv = _descale(torch.stack([_amax_torch(kn, kp), _amax_torch(v)]))
        ds = torch.cat([_descale(_amax_torch(qn, qp)).reshape(1), kv]) if has_q else _kv_only(kv)
    inv = 1.0 / ds
    if has_q:
        _cast_torch(qn, inv[0], q8[..., :dn])
        _cast_torch(qp, inv[0], q8[..., dn:])
    sat = _cast_torch(kn, inv[1], k8[..., :dn]) + _cast_torch(kph, inv[1], k8[..., dn:]) + _cast_torch(v, inv[2], v8)
    return q8, k8, v8, ds, (sat if count else None)


def quantize_mla(q_nope, q_pe, k_nope, k_pe, v, *, backend="auto"):
    """Quantize MLA's Q, K, V to FP8 e4m3fn with per-tensor dynamic descales, the NoPE and RoPE parts
    concatenated in the kernel (no 16-bit concatenation is materialized).

    Parameters
    ----------
    q_nope : torch.Tensor
        (T, nheads, qk_nope) bf16 / fp16 / fp32, any strides.
    q_pe : torch.Tensor
        (T, nheads, qk_rope), q_nope's dtype, any strides.
    k_nope : torch.Tensor
        (T, nheads, qk_nope), any strides.
    k_pe : torch.Tensor
        (T, qk_rope), one per token, broadcast over the heads; any strides.
    v : torch.Tensor
        (T, nheads, v_head_dim), any strides.
    backend : {"auto", "triton", "torch"}
        auto: the Triton kernel (``kernels/mla_quant.py``, two passes: per-tile amaxes into a workspace,
        then quantization with the reduced descale; no atomics, no host synchronization) on CUDA tensors
        with Triton, torch otherwise (the same numbers).

    Returns
    -------
    (q8, k8, v8, q_descale, k_descale, v_descale)
        q8, k8 float8_e4m3fn (T, nheads, qk_nope + qk_rope) contiguous; v8 float8_e4m3fn (T, nheads,
        v_head_dim) with the sequence dimension contiguous (memory order (nheads, v_head_dim, T), the
        layout the FP8 attention kernels read V in); descales float32 (1, 1) with
        ``descale = max(amax, 2**-40 * 448) / 448``, NaN when the tensor holds a NaN or Inf.
    """
    _validate_parts(q_nope, q_pe, k_nope, k_pe, v)
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend: expected 'auto', 'triton' or 'torch', got {backend!r}. Use 'auto'.")
    if backend == "triton" and not capability.has_triton():
        raise ValueError(
            "backend: expected 'auto' or 'torch' without triton installed, got 'triton'. "
            "Install triton or pass backend='torch'."
        )
    use_triton = backend == "triton" or (backend == "auto" and capability.kernel_path_ok(q_nope))
    q8, k8, v8, ds, _ = _quant(q_nope, q_pe, k_nope, k_pe, v, use_triton=use_triton)
    return q8, k8, v8, ds[0:1].view(1, 1), ds[1:2].view(1, 1), ds[2:3].view(1, 1)


# ----------------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------------
def _tensor(name, t, ndim, dtypes=None):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(t).__name__, f"Pass {name} as a tensor.")
    if t.dim() != ndim:
        _fail(
            ValueError, name, f"a {ndim}-D tensor", f"shape {tuple(t.shape)}", "See prefill's docstring for the layout."
        )
    if dtypes is not None and t.dtype not in dtypes:
        _fail(TypeError, name, " or ".join(str(d) for d in dtypes), str(t.dtype), f"Convert {name}.")


def _validate_parts(q_nope, q_pe, k_nope, k_pe, v):
    act = (torch.bfloat16, torch.float16, torch.float32)
    for name, t, nd in (
        ("q_nope", q_nope, 3),
        ("q_pe", q_pe, 3),
        ("k_nope", k_nope, 3),
        ("k_pe", k_pe, 2),
        ("v", v, 3),
    ):
        _tensor(name, t, nd, act)
        if t.dtype != q_nope.dtype:
            _fail(TypeError, name, f"q_nope's dtype {q_nope.dtype}", str(t.dtype), f"Convert {name} to {q_nope.dtype}.")
        if t.device != q_nope.device:
            _fail(ValueError, name, f"device {q_nope.device}", str(t.device), f"Move {name} to {q_nope.device}.")
    T, H, dn = q_nope.shape
    dr = q_pe.shape[-1]
    for name, t, want in (
        ("q_pe", q_pe, (T, H, dr)),
        ("k_nope", k_nope, (T, H, dn)),
        ("k_pe", k_pe, (T, dr)),
        ("v", v, (T, H, v.shape[-1])),
    ):
        if tuple(t.shape) != want:
            _fail(
                ValueError,
                name,
                f"shape {want}",
                f"{tuple(t.shape)}",
                "All parts share the token count T and heads; k_pe is (T, qk_rope), one per token.",
            )


def _validate_prefill(
    q_nope,
    q_pe,
    kv_c,
    k_pe,
    w_uk,
    w_uv,
    cu_seqlens_q,
    max_seqlen_q,
    latent_cache,
    page_table,
    context_lens,
    max_context_len,
    latent_descale,
    softmax_scale,
    chunk_size,
    out,
):
    act = (torch.bfloat16, torch.float16, torch.float32)
    _tensor("q_nope", q_nope, 3, act)
    T, H, dn = q_nope.shape
    for name, t, nd in (("q_pe", q_pe, 3), ("kv_c", kv_c, 2), ("k_pe", k_pe, 2), ("w_uk", w_uk, 3), ("w_uv", w_uv, 3)):
        _tensor(name, t, nd, (q_nope.dtype,))
        if t.device != q_nope.device:
            _fail(ValueError, name, f"device {q_nope.device}", str(t.device), f"Move {name} to {q_nope.device}.")
    dr, rank, dv = q_pe.shape[-1], kv_c.shape[-1], w_uv.shape[-1]
    for name, t, want in (
        ("q_pe", q_pe, (T, H, dr)),
        ("kv_c", kv_c, (T, rank)),
        ("k_pe", k_pe, (T, dr)),
        ("w_uk", w_uk, (rank, H, dn)),
        ("w_uv", w_uv, (rank, H, dv)),
    ):
        if tuple(t.shape) != want:
            _fail(
                ValueError,
                name,
                f"shape {want}",
                f"{tuple(t.shape)}",
                "q_nope (T, H, qk_nope), q_pe (T, H, qk_rope), kv_c (T, kv_lora_rank), k_pe (T, qk_rope), "
                "w_uk (kv_lora_rank, H, qk_nope), w_uv (kv_lora_rank, H, v_head_dim).",
            )
    if T == 0 or H == 0:
        _fail(
            ValueError,
            "q_nope",
            "at least one new token and one head",
            f"shape {tuple(q_nope.shape)}",
            "Skip the call when there is nothing to attend.",
        )
    _tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    if cu_seqlens_q.numel() < 2 or cu_seqlens_q.device != q_nope.device:
        _fail(
            ValueError,
            "cu_seqlens_q",
            f"int32 (batch + 1,) on {q_nope.device}",
            f"shape {tuple(cu_seqlens_q.shape)} on {cu_seqlens_q.device}",
            "Pass the new tokens' offsets [0, ..., T].",
        )
    B = cu_seqlens_q.numel() - 1
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 1:
        _fail(
            ValueError, "max_seqlen_q", "a positive int", repr(max_seqlen_q), "Pass the longest sequence's new tokens."
        )
    if isinstance(max_context_len, bool) or not isinstance(max_context_len, int) or max_context_len < 0:
        _fail(
            ValueError,
            "max_context_len",
            "an int >= 0",
            repr(max_context_len),
            "Pass an upper bound of context_lens (it fixes the chunk plan; 0 without a cached prefix).",
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        _fail(
            ValueError, "chunk_size", "a positive int", repr(chunk_size), "Pass the cached tokens per chunk, e.g. 4096."
        )
    if (
        not isinstance(softmax_scale, (int, float))
        or isinstance(softmax_scale, bool)
        or not (0.0 < float(softmax_scale) < float("inf"))
    ):
        _fail(
            ValueError,
            "softmax_scale",
            "a finite float > 0",
            repr(softmax_scale),
            "Pass the layer's softmax scale (MLA's includes its YaRN factor).",
        )
    if max_context_len > 0:
        _tensor("latent_cache", latent_cache, 3, _CACHE_DTYPES)
        if (
            latent_cache.shape[-1] != rank + dr
            or latent_cache.stride(-1) != 1
            or latent_cache.stride(0) != latent_cache.shape[1] * latent_cache.stride(1)
        ):
            _fail(
                ValueError,
                "latent_cache",
                f"(num_blocks, page_size, {rank + dr}) with rows of kv_c then k_pe, pages one after another",
                f"shape {tuple(latent_cache.shape)} strides {latent_cache.stride()}",
                "Allocate the cache contiguous.",
            )
        if latent_cache.device != q_nope.device:
            _fail(ValueError, "latent_cache", f"device {q_nope.device}", str(latent_cache.device), "Move it.")
        fp8 = latent_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        if fp8 != (latent_descale is not None):
            _fail(
                ValueError,
                "latent_descale",
                "a float32 one-element tensor exactly when the cache is FP8",
                "None" if latent_descale is None else f"a descale with a {latent_cache.dtype} cache",
                "Pass the FP8 cache's per-tensor descale, or none for a 16-bit cache.",
            )
        if fp8 and (
            not isinstance(latent_descale, torch.Tensor)
            or latent_descale.numel() != 1
            or latent_descale.dtype != torch.float32
            or latent_descale.device != q_nope.device
        ):
            _fail(
                ValueError,
                "latent_descale",
                f"a float32 one-element tensor on {q_nope.device}",
                repr(latent_descale),
                "Pass the cache's per-tensor descale.",
            )
        _tensor("page_table", page_table, 2, (torch.int32,))
        _tensor("context_lens", context_lens, 1, (torch.int32,))
        if page_table.shape[0] != B or context_lens.shape[0] != B:
            _fail(
                ValueError,
                "page_table/context_lens",
                f"batch {B} rows (cu_seqlens_q has batch + 1 entries)",
                f"{page_table.shape[0]} and {context_lens.shape[0]}",
                "Pass one row per sequence.",
            )
        if page_table.shape[1] * latent_cache.shape[1] < max_context_len:
            _fail(
                ValueError,
                "page_table",
                f"at least {max_context_len} tokens of pages per row",
                f"{page_table.shape[1]} pages of {latent_cache.shape[1]}",
                "Widen the page table or lower max_context_len.",
            )
        for name, t in (("page_table", page_table), ("context_lens", context_lens)):
            if t.device != q_nope.device:
                _fail(ValueError, name, f"device {q_nope.device}", str(t.device), f"Move {name}.")
    if out is not None:
        _tensor("out", out, 3, (q_nope.dtype,))
        if tuple(out.shape) != (T, H, dv) or out.device != q_nope.device or not out.is_contiguous():
            _fail(
                ValueError,
                "out",
                f"contiguous {(T, H, dv)} on {q_nope.device}",
                f"{tuple(out.shape)} on {out.device}",
                "Preallocate out as (T, nheads, v_head_dim).",
            )
    return B


def resolve_mode(mode):
    """``mode`` as given, else FP8ATTN_MLA_FP8_PREFILL, else ``DEFAULT_MODE``; validated."""
    if mode is None:
        env = os.environ.get(ENV_MODE)
        if env is not None:
            env = env.strip().lower()
            mode = _ENV_ALIASES.get(env, env)
            if mode is not None and mode not in MODES:
                raise ValueError(
                    f"{ENV_MODE}: expected one of {MODES} (or 1 / 0), got {env!r}; fix: unset it or set it to a mode"
                )
        mode = mode or DEFAULT_MODE
    if mode not in MODES:
        raise ValueError(
            f"mode: expected one of {MODES} or None, got {mode!r}. None reads {ENV_MODE} (default {DEFAULT_MODE!r})."
        )
    return mode


# ----------------------------------------------------------------------------------------------------------
# capability: one cached decision per layer configuration
# ----------------------------------------------------------------------------------------------------------
class Support(NamedTuple):
    """Whether a fast path runs (``kernel``) and, when not, why (``reason``)."""

    kernel: bool
    reason: str | None


class _Plan(NamedTuple):
    fp8: bool  # FP8 attention
    fp8_gather: bool  # cached chunks quantized with the estimated descales
    fallback: str | None  # reason key reported to capability.report_fallback
    message: str | None


# The two queries below answer as ``capability.supports(entry, **call_kwargs) -> Support(kernel, reason)`` will
# (keyword arguments of the call in, the same pair out), so that they can become entries of it.
def _support_fp8_prefill(*, device_type, kernel_ok, dims) -> Support:
    """FP8 MLA prefill: the fused quantization and FP8 attention (the torch path on CPU tensors, the
    Triton kernels on CUDA ones: head-dim parts of power-of-two widths, qk and v up to 256)."""
    if device_type != "cuda":
        return Support(True, None)
    if not kernel_ok:
        return Support(False, "no FP8 kernel for these CUDA tensors (needs triton and an sm89+ GPU)")
    dn, dr, dv = dims
    if any(d & (d - 1) or d < 16 for d in dims) or dn + dr > 256 or dv > 256:
        return Support(
            False,
            f"head dims qk_nope {dn}, qk_rope {dr}, v {dv}: the kernels take power-of-two "
            "parts >= 16 with qk_nope + qk_rope <= 256 and v <= 256",
        )
    return Support(True, None)


def _support_fp8_gather(*, cache_dtype) -> Support:
    """FP8 gather: the chunk is written with the estimated descales from a bf16 / fp16 / e4m3fn cache."""
    if cache_dtype not in (None, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        return Support(False, f"a {cache_dtype} latent cache is gathered in 16 bits and quantized dynamically")
    return Support(True, None)


@functools.lru_cache(maxsize=None)
def _plan(mode, device_type, kernel_ok, act_dtype, cache_dtype, dims) -> _Plan:
    """The decision for one layer configuration (cached: a layer calls with the same one every step)."""
    if mode == "off" or act_dtype != torch.bfloat16:  # fp16/fp32 models: the normal 16-bit path
        return _Plan(False, False, None, None)
    s = _support_fp8_prefill(device_type=device_type, kernel_ok=kernel_ok, dims=dims)
    if not s.kernel:
        return _Plan(
            False,
            False,
            "mla_fp8_prefill",
            f"FP8 MLA prefill cannot run ({s.reason}); the 16-bit MLA prefill runs instead, before any quantization",
        )
    if mode == "fp8_gather":
        g = _support_fp8_gather(cache_dtype=cache_dtype)
        if not g.kernel:
            return _Plan(True, False, "mla_fp8_gather", f"FP8 gather unsupported ({g.reason}); FP8 attention is kept")
    return _Plan(True, mode == "fp8_gather", None, None)


# ----------------------------------------------------------------------------------------------------------
# the pipeline
# ----------------------------------------------------------------------------------------------------------
def _gather(latent_cache, latent_descale, page_table, context_lens, start, chunk, dtype):
    """The latent rows of cached positions [start, start + chunk) of every sequence, packed.

    Returns ``(rows, cu_k)``: rows (batch * chunk, kv_lora_rank + qk_rope) in ``dtype`` (FP8 caches
    dequantized with ``latent_descale``), sequence b's valid rows at ``cu_k[b]:cu_k[b + 1]`` and zeros
    after ``cu_k[-1]`` (unused page-table entries and NaN-poisoned slots are never read into a valid row);
    cu_k int32 (batch + 1,). Packing the rows (instead of padding each sequence to ``chunk`` and passing
    ``seqused_k``) keeps the chunk calls on the Hopper kernel, which takes no ``seqused_k``."""
    B, npages = page_table.shape
    ps, width = latent_cache.shape[1], latent_cache.shape[2]
    dev = page_table.device
    lens = (context_lens.long() - start).clamp(0, chunk)
    cu = torch.zeros(B + 1, dtype=torch.long, device=dev)
    cu[1:] = lens.cumsum(0)
    r = torch.arange(B * chunk, device=dev)
    seq = torch.searchsorted(cu[1:], r, right=True).clamp(max=B - 1)
    valid = r < cu[B]
    pos = start + r - cu[seq]
    pidx = (pos // ps).clamp(0, npages - 1)
    pages = torch.where(valid, page_table[seq, pidx].long(), 0).clamp_min(0)
    slots = pages * ps + torch.where(valid, pos % ps, 0)
    flat = latent_cache.view(-1, width)
    if latent_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raw = flat.view(torch.uint8)[slots].view(latent_cache.dtype)
        rows = raw.float() * latent_descale.reshape(())
    else:
        rows = flat[slots]
    rows = torch.where(valid[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device)).to(dtype)
    return rows, cu.to(torch.int32)


def _up_project(kv_c, w_uk, w_uv):
    """kv_c (N, rank) -> (k_nope (N, H, dn), v (N, H, dv)) in kv_c's dtype."""
    rank, H, dn = w_uk.shape
    kn = (kv_c @ w_uk.reshape(rank, H * dn)).view(-1, H, dn)
    v = (kv_c @ w_uv.reshape(rank, H * w_uv.shape[-1])).view(-1, H, w_uv.shape[-1])
    return kn, v


def _concat16(nope, pe):
    """16-bit path only: (N, H, dn) + (N, H or 1, dr) -> (N, H, dn + dr)."""
    return torch.cat([nope, pe.expand(nope.shape[0], nope.shape[1], pe.shape[-1])], dim=-1)


def _attend(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, seqused_k, descales, out, out_dtype):
    qd, kd, vd = descales if descales is not None else (None, None, None)
    o, lse = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        seqused_k=seqused_k,
        softmax_scale=scale,
        causal=causal,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        return_attn_probs=True,
        out=out,
        out_dtype=out_dtype,
    )
    return o, lse


def _run(
    q_nope,
    q_pe,
    kv_c,
    k_pe,
    w_uk,
    w_uv,
    cu_q,
    max_q,
    latent_cache,
    page_table,
    context_lens,
    max_context_len,
    latent_descale,
    scale,
    chunk,
    out,
    plan,
    stats,
    use_triton,
    attend16=None,
):
    """The pipeline, FP8 (``plan.fp8``) or 16-bit. Returns out (T, H, dv) in q_nope's dtype."""
    T, H, dn = q_nope.shape
    dv = w_uv.shape[-1]
    dt = q_nope.dtype
    n_chunks = -(-max_context_len // chunk)
    out = out if out is not None else torch.empty(T, H, dv, dtype=dt, device=q_nope.device)
    # FP8 partial outputs in bf16, as the Hopper kernel writes them (its rounding is far below FP8's error);
    # the 16-bit path keeps float32 partials.
    part_dt = torch.bfloat16 if plan.fp8 and dt == torch.bfloat16 else torch.float32
    if n_chunks:
        o_part = torch.empty(n_chunks + 1, T, H, dv, dtype=part_dt, device=q_nope.device)
        lse_part = torch.empty(n_chunks + 1, T, H, dtype=torch.float32, device=q_nope.device)
    kn, v = _up_project(kv_c, w_uk, w_uv)
    if plan.fp8:  # Q once, for every chunk
        q, k, vv, ds, _ = _quant(q_nope, q_pe, kn, k_pe, v, use_triton=use_triton)
        qd = ds[0:1].view(1, 1)
        new_desc = (qd, ds[1:2].view(1, 1), ds[2:3].view(1, 1))
        if plan.fp8_gather:  # the chunks' estimate: max(new-token descale, 1e-6) * 2 (device ops)
            est = torch.cat([ds[:1], ds[1:].clamp_min(GATHER_DESCALE_MIN) * GATHER_DESCALE_MARGIN])
    else:
        q, k, vv, new_desc = _concat16(q_nope, q_pe), _concat16(kn, k_pe[:, None]), v, None
    attend = _attend if plan.fp8 or attend16 is None else attend16
    for c in range(n_chunks):
        rows, cu_k = _gather(latent_cache, latent_descale, page_table, context_lens, c * chunk, chunk, dt)
        ckn, cv = _up_project(rows[:, : kv_c.shape[-1]], w_uk, w_uv)
        cpe = rows[:, kv_c.shape[-1] :]
        if plan.fp8:
            count = plan.fp8_gather and stats is not None
            _, ck, cvv, cds, sat = _quant(
                None, None, ckn, cpe, cv, ds=est if plan.fp8_gather else None, count=count, use_triton=use_triton
            )
            if count:
                stats.counts[0].add_(sat.to(torch.int64))
                stats.counts[1].add_(cu_k[-1].to(torch.int64) * (H * (dn + cpe.shape[-1] + dv)))
            desc = (qd, cds[1:2].view(1, 1), cds[2:3].view(1, 1))
        else:
            ck, cvv, desc = _concat16(ckn, cpe[:, None]), cv, None
        _, lse = attend(q, ck, cvv, cu_q, cu_k, max_q, chunk, scale, False, None, desc, o_part[c], part_dt)
        lse_part[c].copy_(lse.t())
    if not n_chunks:
        attend(q, k, vv, cu_q, cu_q, max_q, max_q, scale, True, None, new_desc, out, dt)
        return out
    _, lse = attend(q, k, vv, cu_q, cu_q, max_q, max_q, scale, True, None, new_desc, o_part[n_chunks], part_dt)
    lse_part[n_chunks].copy_(lse.t())
    flash_attn_combine(o_part, lse_part, out=out, out_dtype=dt)
    return out


def prefill(
    q_nope,
    q_pe,
    kv_c,
    k_pe,
    w_uk,
    w_uv,
    *,
    cu_seqlens_q,
    max_seqlen_q,
    softmax_scale,
    latent_cache=None,
    page_table=None,
    context_lens=None,
    max_context_len=0,
    latent_descale=None,
    chunk_size=4096,
    mode=None,
    stats=None,
    out=None,
):
    """MLA prefill of new tokens over their cached prefix, FP8 attention with a capability-checked fallback.

    Sequence b's new tokens (rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``) attend the first
    ``context_lens[b]`` tokens of its cached prefix and, causally (bottom-right), each other. The
    prefix is walked in ``cdiv(max_context_len, chunk_size)`` chunks (a plan fixed by host integers, so
    a call is CUDA-graph capturable); each chunk's partial output and LSE are merged with the new
    tokens' by ``flash_attn_combine``. The new tokens' K NoPE and V are up-projected from ``kv_c``.

    Parameters
    ----------
    q_nope : torch.Tensor
        (T, H, qk_nope) bf16 (fp16 / fp32 take the 16-bit path); T new tokens of all sequences, packed.
    q_pe : torch.Tensor
        (T, H, qk_rope), RoPE applied; q_nope's dtype.
    kv_c : torch.Tensor
        (T, kv_lora_rank) the new tokens' compressed KV (normalized); q_nope's dtype.
    k_pe : torch.Tensor
        (T, qk_rope) the new tokens' RoPE key, shared by the heads; q_nope's dtype.
    w_uk, w_uv : torch.Tensor
        (kv_lora_rank, H, qk_nope) and (kv_lora_rank, H, v_head_dim) up-projections: ``k_nope = kv_c @ w_uk``,
        ``v = kv_c @ w_uv`` per head; q_nope's dtype.
    cu_seqlens_q : torch.Tensor
        int32 (batch + 1,) offsets of the new tokens.
    max_seqlen_q : int
        Upper bound of the new tokens per sequence.
    softmax_scale : float
        The layer's softmax scale, passed to attention unchanged.
    latent_cache : torch.Tensor, optional
        (num_blocks, page_size, kv_lora_rank + qk_rope): each row kv_c then k_pe; bf16, fp16, or
        float8_e4m3fn / float8_e5m2 with ``latent_descale``. Required when ``max_context_len > 0``.
    page_table : torch.Tensor, optional
        int32 (batch, max_pages); entries past a sequence's context are never dereferenced (may be -1).
    context_lens : torch.Tensor, optional
        int32 (batch,) cached prefix tokens per sequence (each <= ``max_context_len``; 0 allowed).
    max_context_len : int
        Host-side upper bound of ``context_lens``; fixes the number of chunks (0: no prefix).
    latent_descale : torch.Tensor, optional
        float32, one element: the FP8 cache's per-tensor descale (real = fp8 * descale).
    chunk_size : int
        Cached tokens per sequence and chunk (the gathered buffers hold batch * chunk_size rows).
    mode : {"bf16_gather", "fp8_gather", "off"} or None
        None reads ``FP8ATTN_MLA_FP8_PREFILL`` (a mode name, 1 for the default, 0 for off), else
        ``"bf16_gather"``. See the module docstring and docs/mla.md.
    stats : SaturationStats, optional
        Device counters that ``fp8_gather`` adds its saturated and total K/V element counts to.
    out : torch.Tensor, optional
        (T, H, v_head_dim) in q_nope's dtype, contiguous; written in place.

    Returns
    -------
    torch.Tensor
        (T, H, v_head_dim) in q_nope's dtype.

    Notes
    -----
    Capability (decided once per layer configuration): bf16 activations with a mode other than
    ``"off"`` run FP8 attention; when FP8 MLA prefill cannot run for CUDA tensors the 16-bit pipeline
    runs instead, before any quantization (the 16-bit inputs are never quantize-dequantized), reported
    once per process through ``capability.report_fallback`` (FP8ATTN_FALLBACK=error raises instead);
    a cache the FP8 gather cannot take is gathered in 16 bits and quantized dynamically, FP8 attention
    kept (reported the same way). fp16 / fp32 activations run the 16-bit pipeline without a report.
    A kernel error propagates; nothing is retried on another path.
    """
    mode = resolve_mode(mode)
    _validate_prefill(
        q_nope,
        q_pe,
        kv_c,
        k_pe,
        w_uk,
        w_uv,
        cu_seqlens_q,
        max_seqlen_q,
        latent_cache,
        page_table,
        context_lens,
        max_context_len,
        latent_descale,
        softmax_scale,
        chunk_size,
        out,
    )
    if stats is not None and (not isinstance(stats, SaturationStats) or stats.counts.device != q_nope.device):
        _fail(
            TypeError,
            "stats",
            f"a SaturationStats on {q_nope.device} or None",
            type(stats).__name__ if not isinstance(stats, SaturationStats) else f"one on {stats.counts.device}",
            f"Pass mla.SaturationStats({str(q_nope.device)!r}).",
        )
    kernel_ok = capability.kernel_path_ok(q_nope)
    dims = (q_nope.shape[-1], q_pe.shape[-1], w_uv.shape[-1])
    cache_dtype = latent_cache.dtype if max_context_len > 0 else None
    plan = _plan(mode, q_nope.device.type, kernel_ok, q_nope.dtype, cache_dtype, dims)
    if plan.fallback is not None:  # before anything is quantized, gathered or written
        capability.report_fallback(plan.fallback, plan.message)
    return _run(
        q_nope,
        q_pe,
        kv_c,
        k_pe,
        w_uk,
        w_uv,
        cu_seqlens_q,
        max_seqlen_q,
        latent_cache,
        page_table,
        context_lens,
        max_context_len,
        latent_descale,
        float(softmax_scale),
        chunk_size,
        out,
        plan,
        stats,
        kernel_ok,
    )


def prefill_ref(
    q_nope,
    q_pe,
    kv_c,
    k_pe,
    w_uk,
    w_uv,
    *,
    cu_seqlens_q,
    softmax_scale,
    latent_cache=None,
    page_table=None,
    context_lens=None,
    latent_descale=None,
    compute_dtype=torch.float64,
):
    """The whole MLA prefill in ``compute_dtype`` (float64: the oracle), one sequence at a time, with no
    chunks and no quantization: the prefix's latent rows (FP8 caches dequantized) and the new ones are
    up-projected and attended together (bottom-right causal). Arguments as ``prefill``.

    Returns
    -------
    torch.Tensor
        (T, H, v_head_dim) in ``compute_dtype``.
    """
    cdt = compute_dtype
    rank = kv_c.shape[-1]
    wk, wv = w_uk.to(cdt), w_uv.to(cdt)
    cu = cu_seqlens_q.tolist()
    outs = []
    for b in range(len(cu) - 1):
        rows = torch.cat([kv_c[cu[b] : cu[b + 1]].to(cdt), k_pe[cu[b] : cu[b + 1]].to(cdt)], dim=-1)
        n_ctx = int(context_lens[b]) if context_lens is not None else 0
        if n_ctx:
            ps = latent_cache.shape[1]
            pos = torch.arange(n_ctx, device=latent_cache.device)
            slots = page_table[b].long()[pos // ps] * ps + pos % ps
            flat = latent_cache.view(-1, latent_cache.shape[-1])
            ctx = (flat.view(torch.uint8)[slots].view(flat.dtype) if flat.dtype.itemsize == 1 else flat[slots]).to(cdt)
            if latent_descale is not None:
                ctx = ctx * latent_descale.to(cdt).reshape(())
            rows = torch.cat([ctx, rows], dim=0)
        kn = torch.einsum("nr,rhd->nhd", rows[:, :rank], wk)
        v = torch.einsum("nr,rhd->nhd", rows[:, :rank], wv)
        k = torch.cat([kn, rows[:, None, rank:].expand(-1, kn.shape[1], -1)], dim=-1)
        q = torch.cat([q_nope[cu[b] : cu[b + 1]], q_pe[cu[b] : cu[b + 1]]], dim=-1).to(cdt)
        sq, sk = q.shape[0], k.shape[0]
        for i in range(0, sq, 512):  # query blocks bound the (H, 512, sk) logits
            s = torch.einsum("qhd,khd->hqk", q[i : i + 512], k) * softmax_scale
            rows_q = torch.arange(i, min(i + 512, sq), device=q.device)
            mask = torch.arange(sk, device=q.device)[None, :] <= rows_q[:, None] + (sk - sq)
            s = s.masked_fill(~mask, float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v))
    return torch.cat(outs, dim=0)
