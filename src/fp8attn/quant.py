"""FP8 formats, saturating casts, scales, quantize / dequantize, and the bodies of the quantization ops.

Every quantization rule of the host side lives here; ``fp8attn.ops`` registers the ops that run them
(``fp8attn::quantize_fp8``, ``fp8attn::quant_fp8_static``) and ``fp8attn.qkv`` holds the public
``quantize_qkv`` (validation, then one op per input). ``quantize_fp8``'s Triton kernel is
``fp8attn.kernels.quantize``; the one-line static-quantization kernel is built here on first use.

Convention: ``x ~= dequantize(x8, descale) = x8.float() * descale`` with
``descale = max(amax, DESCALE_FLOOR * fp8_max) / fp8_max``.  The floor keeps a zero amax (an all-zero
tensor, or a padded head) from producing a zero descale: a zero descale would turn masked ``-inf``
logits into ``0 * -inf = NaN`` once it is folded into the softmax scale.

Granularities (shape of the descale for an input of shape (batch, seqlen, heads, dim)):

=================  =============================  ==========================================
name               descale shape                  meaning
=================  =============================  ==========================================
per_tensor         ()                             one value (broadcast as a stride-0 view)
per_head           (batch, heads)                 FA3's (batch, nheads_k) convention
per_sequence       (batch, 1)                     one value per sequence, all heads
per_token_head     (batch, seqlen, heads)         KV caches: (num_blocks, page_size, nheads_k)
per_block          (batch, heads, nblocks)        ``block_size`` consecutive tokens per value
=================  =============================  ==========================================
"""

from __future__ import annotations

import functools
import math

import torch

from . import hadamard as _had
from .kernels.planning import DESCALE_FLOOR, scale_storage_pad

__all__ = [
    "FP8_FORMATS",
    "GRANULARITIES",
    "DESCALE_FLOOR",
    "fp8_max",
    "is_fp8",
    "saturating_cast",
    "compute_descale",
    "quantize",
    "dequantize",
    "expand_descale",
    "descale_for_tokens",
    "SCALE_STORAGE_DTYPES",
    "scale_storage_pad",
    "round_descale_for_storage",
    "descale_from_amax",
    "empty_seq_major",
    "descale_shape",
    "quantize_one",
    "quant_fp8_static_torch",
    "launch_quant_fp8_static",
]

FP8_FORMATS = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
    torch.float8_e4m3fnuz: 240.0,
}
_ALIASES = {
    "e4m3": torch.float8_e4m3fn,
    "e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e4m3fnuz": torch.float8_e4m3fnuz,
}
GRANULARITIES = ("per_tensor", "per_head", "per_sequence", "per_token_head", "per_block")


def descale_from_amax(amax: torch.Tensor, fp8_max_value: float) -> torch.Tensor:
    """The module's descale convention, float32: ``max(amax, DESCALE_FLOOR * fp8_max) / fp8_max``, the
    correctly rounded quotient on every device (torch's CUDA division by a scalar multiplies by its
    reciprocal, one ulp away at times; a float64 quotient rounded once to float32 is exact, as the
    kernels' ``div_rn``)."""
    return (amax.double().clamp_min(DESCALE_FLOOR * fp8_max_value) / fp8_max_value).to(torch.float32)


# Per-token-head KV-cache scales may be stored in float32 or bfloat16 (half the scale bytes: 4 B per
# (token, head) for K+V, 1.6% of a d128 FP8 cache, 0.8% of the bf16 cache it replaces).
SCALE_STORAGE_DTYPES = (torch.float32, torch.bfloat16)


def round_descale_for_storage(d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 value a descale takes once stored in ``dtype`` (padded up first: ``scale_storage_pad``)."""
    if dtype == torch.float32:
        return d.float()
    return (d.float() * scale_storage_pad(dtype)).to(dtype).float()


def _fmt(fp8_dtype) -> torch.dtype:
    if isinstance(fp8_dtype, str):
        if fp8_dtype not in _ALIASES:
            raise ValueError(f"fp8_dtype: expected one of {sorted(_ALIASES)}, got {fp8_dtype!r}")
        return _ALIASES[fp8_dtype]
    if fp8_dtype not in FP8_FORMATS:
        raise TypeError(
            f"fp8_dtype: expected one of {list(FP8_FORMATS)}, got {fp8_dtype}; "
            "use torch.float8_e4m3fn (default), torch.float8_e5m2 or torch.float8_e4m3fnuz"
        )
    return fp8_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_FORMATS


def fp8_max(fp8_dtype=torch.float8_e4m3fn) -> float:
    """Largest finite value of the format: 448 (e4m3fn), 57344 (e5m2), 240 (e4m3fnuz)."""
    return FP8_FORMATS[_fmt(fp8_dtype)]


def saturating_cast(x: torch.Tensor, fp8_dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """Cast to FP8 clamping to +-fp8_max (Inf saturates too); NaN stays NaN.

    The clamp is explicit because older torch CPU casts did not saturate. For e4m3fnuz, NaN is
    encoded as 0x80 by torch's own cast (never reinterpret fnuz bytes as fn).
    """
    dt = _fmt(fp8_dtype)
    m = FP8_FORMATS[dt]
    xf = x.float() if x.dtype not in (torch.float32, torch.float64) else x
    return xf.clamp(-m, m).to(dt)


def _reduce_dims(x: torch.Tensor, granularity: str):
    """Dims to reduce amax over for a (batch, seqlen, heads, dim) tensor."""
    if granularity == "per_tensor":
        return None
    if granularity == "per_head":
        return (1, 3)
    if granularity == "per_sequence":
        return (1, 2, 3)
    if granularity == "per_token_head":
        return (3,)
    raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")


def _check_quant_args(x, granularity, block_size):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}. Pass the values as a tensor.")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}.")
    if granularity != "per_tensor" and x.dim() != 4:
        raise ValueError(
            f"x: expected a 4-D (batch, seqlen, heads, dim) tensor for {granularity}, got shape "
            f"{tuple(x.shape)}. Add the missing dimensions, or use per_tensor."
        )
    if granularity == "per_block" and (
        isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0
    ):
        raise ValueError(f"block_size: expected a positive int (tokens per scale), got {block_size!r}.")


def compute_descale(
    x: torch.Tensor, granularity: str = "per_tensor", fp8_dtype=torch.float8_e4m3fn, block_size: int = 128
) -> torch.Tensor:
    """Dynamic descale ``max(amax, floor) / fp8_max`` at the given granularity (float32).

    Parameters
    ----------
    x : (batch, seqlen, heads, dim) tensor (any float dtype); per_tensor accepts any shape.
    granularity : one of GRANULARITIES (see module docstring for the output shape).
    block_size : tokens per scale for ``per_block``.

    NaN in ``x`` is ignored for the amax (a NaN element has no magnitude to represent).
    """
    _check_quant_args(x, granularity, block_size)
    m = fp8_max(fp8_dtype)
    a = x.detach().float().abs().nan_to_num(nan=0.0, posinf=m, neginf=m)
    if granularity == "per_block":
        b, s, h, d = x.shape
        nb = max(1, math.ceil(s / block_size))
        pad = nb * block_size - s
        a = torch.nn.functional.pad(a, (0, 0, 0, 0, 0, pad))
        if a.numel() == 0:  # no batch rows, heads or dims: amax 0 -> the floor
            amax = a.new_zeros(b, h, nb)
        else:
            amax = a.view(b, nb, block_size, h, d).amax(dim=(2, 4)).transpose(1, 2).contiguous()
    else:
        dims = _reduce_dims(x, granularity)
        if a.numel() == 0:  # empty input (e.g. a zero-length sequence): amax 0 -> the floor
            shape = () if dims is None else [n for i, n in enumerate(a.shape) if i not in dims]
            amax = a.new_zeros(shape)
        else:
            amax = a.amax() if dims is None else a.amax(dim=dims)
        if granularity == "per_sequence":
            amax = amax.view(-1, 1)
    return descale_from_amax(amax, m)


def _broadcast(descale: torch.Tensor, shape, granularity: str, block_size: int) -> torch.Tensor:
    """View a descale so it broadcasts against a (batch, seqlen, heads, dim) tensor."""
    d = descale.float()
    if granularity == "per_tensor":
        return d.reshape([1] * len(shape)) if d.numel() == 1 else d
    b, s, h, _ = shape
    if granularity == "per_head":
        return d.reshape(d.shape[0], 1, d.shape[-1], 1)
    if granularity == "per_sequence":
        return d.reshape(-1, 1, 1, 1)
    if granularity == "per_token_head":
        return d.reshape(d.shape[0], d.shape[1], d.shape[2], 1)
    if granularity == "per_block":
        idx = torch.arange(s, device=d.device) // block_size
        return d[:, :, idx].transpose(1, 2).unsqueeze(-1)  # (b, s, h, 1)
    raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")


def quantize(
    x: torch.Tensor,
    granularity: str = "per_tensor",
    fp8_dtype=torch.float8_e4m3fn,
    descale: torch.Tensor | None = None,
    block_size: int = 128,
):
    """Quantize ``x`` to FP8 with a saturating cast.

    Parameters
    ----------
    x : (batch, seqlen, heads, dim) float tensor (per_tensor: any shape).
    descale : static descale of the granularity's shape (see module docstring); computed from ``x``
        (dynamic) when None.

    Returns
    -------
    (x8, descale) : x8 has x's shape and dtype ``fp8_dtype``; descale is float32.
    """
    dt = _fmt(fp8_dtype)
    if descale is None:
        descale = compute_descale(x, granularity, dt, block_size)  # (checks the arguments)
    else:
        _check_quant_args(x, granularity, block_size)
    d = _broadcast(descale, x.shape, granularity, block_size)
    return saturating_cast(x.float() / d, dt), descale.float()


def dequantize(
    x8: torch.Tensor,
    descale: torch.Tensor,
    granularity: str = "per_tensor",
    dtype: torch.dtype = torch.float32,
    block_size: int = 128,
) -> torch.Tensor:
    """``x8.to(dtype) * descale`` with the descale broadcast for its granularity."""
    return (x8.to(torch.float32) * _broadcast(descale, x8.shape, granularity, block_size)).to(dtype)


_ONES: dict = {}


def _ones(device) -> torch.Tensor:
    """A float32 one on ``device``; on a GPU, one kept per device (kernels only read descales), so that
    calls without a descale pass the same memory each time (``kernels.replay`` constants)."""
    t = _ONES.get(device)
    if t is None:
        t = torch.ones((), dtype=torch.float32, device=device)
        if t.is_cuda:
            from .kernels import replay

            _ONES[device] = replay.constant(t)
    return t


def expand_descale(descale: torch.Tensor | None, batch: int, nheads_k: int, device=None) -> torch.Tensor:
    """Normalize a descale to FA3's (batch, nheads_k) float32 view (stride-0 for broadcasts).

    Accepts None (-> ones), 0-d / (1,) / (1, 1) per-tensor, (batch, 1) per-sequence and
    (batch, nheads_k). No copy is made for broadcasts.
    """
    if descale is None:
        return _ones(device).expand(batch, nheads_k)
    if descale.dtype == torch.float32 and descale.shape == (batch, nheads_k):
        return descale  # already FA3's form (the common case): no new view per call
    d = descale.float()
    if d.dim() == 0:
        d = d.reshape(1, 1)
    elif d.dim() == 1:
        d = d.reshape(1, -1) if d.numel() == nheads_k and d.numel() != 1 else d.reshape(-1, 1)
    return d.expand(batch, nheads_k)


def descale_for_tokens(
    descale: torch.Tensor, token_seq_idx: torch.Tensor | None, num_tokens: int, nheads_k: int
) -> torch.Tensor:
    """Per-token (num_tokens, nheads_k) view of a per-tensor or per-(sequence, head) descale."""
    d = descale.float()
    if d.numel() == 1:
        return d.reshape(1, 1).expand(num_tokens, nheads_k)
    if token_seq_idx is None:
        raise ValueError(
            "token_seq_idx: required with a per-(sequence, head) descale of shape "
            f"{tuple(d.shape)}; pass the batch row of each token as an int32 tensor"
        )
    d = d.reshape(d.shape[0], -1).expand(d.shape[0], nheads_k)
    return d[token_seq_idx.long()]


# --------------------------------------------------------------------------------------------
# The bodies of the quantization ops (registered in fp8attn.ops): ``fp8attn::quantize_fp8`` quantizes one
# input of ``fp8attn.quantize_qkv`` to e4m3 with descales per scale group, ``fp8attn::quant_fp8_static``
# is the static per-tensor output quantization. Each has a Triton launch and a torch form that compute
# the same values (the torch form runs wherever the kernel cannot).
# --------------------------------------------------------------------------------------------

E4M3_MAX = 448.0


def _as4d(x):
    """(batch, seqlen, heads, dim) view; varlen (total, heads, dim) becomes batch 1."""
    return x.unsqueeze(0) if x.dim() == 3 else x


def empty_seq_major(shape, dtype, device):
    """An uninitialized (batch, seqlen, heads, dim) / varlen (total, heads, dim) tensor whose sequence
    dimension is contiguous: memory order (batch, heads, dim, seqlen) / (heads, dim, total). This is the
    K-major layout Hopper's FP8 P @ V reads V in; attention given such a V runs no transpose pass."""
    shape4 = (1, *shape) if len(shape) == 3 else tuple(shape)
    y = torch.empty_strided(shape4, _layout_strides(shape4, True), dtype=dtype, device=device)
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


@functools.lru_cache(maxsize=32)
def _padded_rotation(d, block_d, seed, device, dtype):
    """The +-1 rotation zero-padded to (block_d, block_d), built once per (d, seed, device, dtype): a call
    then launches nothing but the quantize kernels (and copies nothing from the host)."""
    r = torch.zeros(block_d, block_d, device=device, dtype=dtype)  # ±1: exact in any dtype
    r[:d, :d] = _had.rotation_matrix(d, seed, device=device, dtype=dtype, normalized=False)
    if r.is_cuda:  # (kernels only read it: a replayed launch passes it as recorded)
        from .kernels import replay

        replay.constant(r)
    return r


def _block_d(d):
    """A head dim padded to the kernels' block: a power of two, at least 16."""
    return max(16, 1 << (d - 1).bit_length())


def _empty_fp8(shape, device, seq_major):
    """The e4m3 output of a (batch, seqlen, heads, dim) input: sequence-major when ``seq_major`` (the kernel
    stores through its strides, so it is written that way in the same pass), else row-major."""
    return torch.empty_strided(shape, _layout_strides(shape, seq_major), device=device, dtype=torch.float8_e4m3fn)


def _layout_strides(shape, seq_major):
    """The strides of a (batch, seqlen, heads, dim) tensor: memory order (batch, heads, dim, seqlen) when
    ``seq_major`` (``empty_seq_major``'s layout), else row-major; empty dimensions count as 1, as torch's
    contiguous strides do."""
    s, h, d = (max(n, 1) for n in shape[1:])
    return (h * d * s, 1, d * s, s) if seq_major else (s * h * d, h * d, d, 1)


def _carve(dtype, device, layouts):
    """Dense tensors of ``layouts`` ((shape, strides or None: contiguous) each) carved from one allocation,
    each starting on a 128-byte boundary: an eager call's outputs for the price of one allocation (every
    ``torch.empty`` costs a caching-allocator round trip on the host)."""
    align = 128 // dtype.itemsize
    sizes = [-(-math.prod(shape) // align) * align for shape, _ in layouts]
    buf = torch.empty(sum(sizes), dtype=dtype, device=device)
    out, off = [], 0
    for (shape, strides), n in zip(layouts, sizes):
        if strides is None:
            strides = tuple(math.prod(max(n, 1) for n in shape[i + 1 :]) for i in range(len(shape)))
        out.append(buf.as_strided(shape, strides, off))
        off += n
    return tuple(out)


def _rotation_args(rotate, d, seed, device, dtype, unused):
    """``(r, r_scale)`` of the quantize kernels: the padded +-1 rotation and its norm, or ``unused`` and 1.0."""
    if not rotate:
        return unused, 1.0
    return _padded_rotation(d, _block_d(d), int(seed), device, dtype), 1.0 / math.sqrt(_had.hadamard_block_size(d))


def _triton_path(x, granularity, nheads_k, rotate, seed, block_t, seq_major=False, single=None):
    from .kernels.quantize import launch_quantize

    x4 = _as4d(x)
    d = x4.shape[-1]
    y = _empty_fp8(x4.shape, x.device, seq_major)
    r, r_scale = _rotation_args(rotate, d, seed, x.device, x.dtype, y)
    ds = torch.empty(descale_shape(x4, granularity, nheads_k, block_t), device=x.device, dtype=torch.float32)
    launch_quantize(
        x4,
        y,
        r,
        r_scale,
        ds,
        granularity=granularity,
        nheads_k=nheads_k,
        rotate=rotate,
        block_t=block_t,
        block_d=_block_d(d),
        single=single,
    )
    return (y.squeeze(0) if x.dim() == 3 else y), ds


def triton_qkv(q, k, v, granularity, nheads_k, rotate, seed, block_t, v_seq_major):
    """``quantize_qkv``'s three Triton quantizations in one launch, ``(q8, k8, v8, qd, kd, vd)`` as three
    ``_triton_path`` calls return them (the same bits), or None where ``kernels.quantize.qkv_single_ok``
    refuses the inputs (larger scale groups, per_block, mixed dtypes)."""
    from .kernels.quantize import launch_quantize_qkv, qkv_single_ok

    xs = (_as4d(q), _as4d(k), _as4d(v))
    if not qkv_single_ok(xs[0], xs[1], xs[2], granularity, nheads_k, block_t):
        return None
    dev = q.device
    ys = _carve(
        torch.float8_e4m3fn, dev, [(x.shape, _layout_strides(x.shape, sm)) for x, sm in zip(xs, (0, 0, v_seq_major))]
    )
    dss = _carve(torch.float32, dev, [(descale_shape(x, granularity, nheads_k, block_t), None) for x in xs])
    d = xs[0].shape[-1]
    r, r_scale = _rotation_args(rotate, d, seed, dev, q.dtype, ys[0])
    launch_quantize_qkv(
        xs,
        ys,
        dss,
        r,
        r_scale,
        granularity=granularity,
        nheads_k=nheads_k,
        rotate=rotate,
        block_t=block_t,
        block_d=_block_d(d),
        block_dv=_block_d(xs[2].shape[-1]),
    )
    if q.dim() == 3:
        return (*(y.squeeze(0) for y in ys), *dss)
    return (*ys, *dss)


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


def quant_fp8_static_torch(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch form: ``clamp(x.float() * (1 / scale), -448, 448).to(e4m3fn)``.

    Parameters
    ----------
    x : any shape, bf16 / fp16 / fp32. scale : float32, one element.

    Returns
    -------
    float8_e4m3fn, x's shape, contiguous.
    """
    inv = 1.0 / scale.float().reshape(())
    y = (x.float() * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device).copy_(y)


@functools.lru_cache(None)
def launch_quant_fp8_static():
    """The CUDA launch function ``launch(x, scale, y)`` of the standalone static quantization
    (``kernels.quantize.launch_quant_static``), or None without triton."""
    from .kernels import quantize as kq

    return kq.launch_quant_static if kq.HAS_TRITON else None
