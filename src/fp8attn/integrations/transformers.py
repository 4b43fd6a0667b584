"""Hugging Face transformers integration: ``attn_implementation="fp8attn"`` and an FP8 KV cache.

Importing this module registers ``"fp8attn"`` with transformers' ``AttentionInterface`` (the attention
function) and ``AttentionMaskInterface`` (the 2-D padding mask transformers builds for its flash-attention
implementations: no dense 4-D mask is materialized)::

    import fp8attn.integrations.transformers  # registers "fp8attn"
    from fp8attn.integrations.transformers import FP8Cache

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="fp8attn")
    cache = FP8Cache(config=model.config, max_batch_size=8, max_cache_len=4096)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)

The attention function quantizes the 16-bit Q/K/V of each call to e4m3 with dynamic descales
(:func:`fp8attn.quantize_qkv`; granularity and Hadamard rotation from :func:`fp8attn_options` or the
model config's ``fp8attn_granularity`` / ``fp8attn_hadamard`` attributes) and runs the FP8 kernels.
Padded batches (left or right padding) and packed sequences run as varlen calls over their real tokens;
grouped-query K/V are passed unexpanded; causal, sliding-window (``config.sliding_window``, per layer) and
softcap settings come from the module. With gradients enabled it calls ``fp8attn.attention`` (the FP8
forward and backward).

:class:`FP8Cache` stores K/V in a paged e4m3 cache (half the bytes of a bf16 cache) and decodes through
:func:`fp8attn.flash_attn_with_kvcache`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass

import torch

try:
    import transformers  # noqa: F401 -- the availability probe: ImportError here means the extra is missing
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fp8attn.integrations.transformers needs transformers 5.x (pip install 'fp8attn[transformers]'); "
        f"importing it failed: {e}"
    ) from e

import fp8attn
from fp8attn import quant

__all__ = [
    "ATTN_IMPLEMENTATION",
    "register",
    "fp8attn_attention_forward",
    "fp8attn_options",
    "FP8Cache",
    "FP8CacheLayer",
    "GRANULARITIES",
    "CACHE_SCALES",
    "CACHE_MIN_VERSION",
    "cache_keyword",
]

ATTN_IMPLEMENTATION = "fp8attn"
GRANULARITIES = ("per_tensor", "per_head", "per_block")
CACHE_SCALES = ("per_tensor", "per_seq_head", "per_token_head")
_BLOCK = 128  # tokens per scale block of the per_block granularity
# FP8Cache reaches the attention function through the attention kwargs that a model hands Cache.update, which
# transformers does from 5.24 on (the extra's pin); older models never pass them
CACHE_MIN_VERSION = (5, 24)
_E4M3 = torch.float8_e4m3fn


# ====================================================================== options
@dataclass(frozen=True)
class _Options:
    granularity: str = "per_head"
    hadamard: bool = False


_OVERRIDE: contextvars.ContextVar = contextvars.ContextVar("fp8attn_options", default=None)


def _check_granularity(name, g):
    if g not in GRANULARITIES:
        raise ValueError(
            f"{name}: expected one of {GRANULARITIES}, got {g!r}. per_head is FA3's (batch, kv head) "
            "descales; per_tensor one descale; per_block one per 128 tokens and head."
        )
    return g


def _check_hadamard(name, h):
    if not isinstance(h, bool):
        raise TypeError(f"{name}: expected True or False, got {h!r}. Pass a bool.")
    return h


@contextlib.contextmanager
def fp8attn_options(granularity: str | None = None, hadamard: bool | None = None):
    """Override the quantization of ``attn_implementation="fp8attn"`` inside a ``with`` block.

    Parameters
    ----------
    granularity : {"per_tensor", "per_head", "per_block"}, optional
        Scale granularity of the dynamic Q/K/V quantization (:func:`fp8attn.quantize_qkv`).
    hadamard : bool, optional
        Rotate Q and K by a seeded random-sign Hadamard matrix before quantizing.

    Precedence: this context, then the model config's ``fp8attn_granularity`` / ``fp8attn_hadamard``
    attributes, then the defaults (per_head, no rotation). Values left None keep the outer setting.
    """
    cur = _OVERRIDE.get() or {}
    new = dict(cur)
    if granularity is not None:
        new["granularity"] = _check_granularity("granularity", granularity)
    if hadamard is not None:
        new["hadamard"] = _check_hadamard("hadamard", hadamard)
    token = _OVERRIDE.set(new)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def _options(module) -> _Options:
    cfg = getattr(module, "config", None)
    over = _OVERRIDE.get() or {}
    g = over.get("granularity", getattr(cfg, "fp8attn_granularity", None) or "per_head")
    h = over.get("hadamard", getattr(cfg, "fp8attn_hadamard", None))
    return _Options(
        _check_granularity("config.fp8attn_granularity", g),
        False if h is None else _check_hadamard("config.fp8attn_hadamard", h),
    )


# ====================================================================== varlen metadata
@dataclass
class _Varlen:
    """Real tokens of a padded / packed batch: flat indices into (batch * seqlen) and cu_seqlens."""

    idx_q: torch.Tensor | None  # None: every query row is real (one query per sequence)
    idx_k: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


_MEMO: dict = {}  # one entry: every layer of a forward gets the same mask / position_ids tensor


def _memo(key_tensor: torch.Tensor, extra, build):
    """``build()`` cached on (tensor identity, version, extra): the layers of one forward reuse the
    unpadding metadata (and its one host sync) of the first layer."""
    if torch.compiler.is_compiling():
        return build()
    key = (key_tensor._version, extra)
    hit = _MEMO.get("v")
    if hit is not None and hit[0] is key_tensor and hit[1] == key:
        return hit[2]
    val = build()
    _MEMO["v"] = (key_tensor, key, val)
    return val


def _cu(lens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))


def _from_mask(mask: torch.Tensor, sq: int) -> _Varlen:
    """Unpad a (batch, seqlen_k) 2-D padding mask (True / 1 = real token). Queries are the last ``sq``
    positions (left padding aligns them with the last keys, as transformers' flash attention assumes)."""
    m = mask.bool()
    lens_k = m.sum(-1, dtype=torch.int32)
    idx_k = torch.nonzero(m.flatten()).flatten()
    max_k = int(lens_k.max()) if lens_k.numel() else 0  # the one host sync of a padded call
    if sq == m.shape[1]:
        return _Varlen(idx_k, idx_k, _cu(lens_k), _cu(lens_k), max_k, max_k)
    if sq == 1:
        cu_q = torch.arange(m.shape[0] + 1, dtype=torch.int32, device=m.device)
        return _Varlen(None, idx_k, cu_q, _cu(lens_k), 1, max_k)
    mq = m[:, -sq:]
    lens_q = mq.sum(-1, dtype=torch.int32)
    return _Varlen(
        torch.nonzero(mq.flatten()).flatten(),
        idx_k,
        _cu(lens_q),
        _cu(lens_k),
        int(lens_q.max()) if lens_q.numel() else 0,
        max_k,
    )


def _from_position_ids(pos: torch.Tensor) -> _Varlen | None:
    """Packed sequences in one row (position ids restarting): their cu_seqlens, or None when the row is
    one sequence."""
    p = pos.reshape(-1)
    breaks = torch.nonzero(torch.diff(p) != 1).flatten() + 1
    if breaks.numel() == 0:
        return None
    cu = torch.cat([breaks.new_zeros(1), breaks, breaks.new_tensor([p.numel()])]).to(torch.int32)
    mx = int((cu[1:] - cu[:-1]).max())
    idx = torch.arange(p.numel(), device=p.device)
    return _Varlen(idx, idx, cu, cu, mx, mx)


# ====================================================================== the attention function
def _wants_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _window(sliding_window, causal: bool) -> tuple[int, int]:
    """transformers' sliding window (the query plus sliding_window - 1 earlier keys; symmetric when not
    causal) as fp8attn's inclusive (left, right) window."""
    if sliding_window is None:
        return (-1, -1)
    w = int(sliding_window)
    if w <= 0:
        raise ValueError(f"sliding_window: expected a positive int or None, got {sliding_window!r}.")
    return (w - 1, 0) if causal else (w - 1, w - 1)


def _out_dtype(dt: torch.dtype) -> torch.dtype:
    return dt if dt in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def _fp8_attention(q, k, v, vl: _Varlen | None, *, scale, causal, window, softcap, opts: _Options):
    """Attention over 16-bit (batch, seqlen, heads, dim) tensors, or varlen (total, heads, dim) ones with
    ``vl``: quantized to FP8 here, or through ``fp8attn.attention`` (FP8 forward and backward) when
    gradients are wanted."""
    out_dtype = _out_dtype(q.dtype)
    common = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=softcap)
    if _wants_grad(q, k, v):
        kw = (
            {}
            if vl is None
            else dict(cu_seqlens_q=vl.cu_q, cu_seqlens_k=vl.cu_k, max_seqlen_q=vl.max_q, max_seqlen_k=vl.max_k)
        )
        out = fp8attn.attention(q, k, v, granularity=opts.granularity, hadamard=opts.hadamard, **common, **kw)
        return out if out.dtype == q.dtype else out.to(q.dtype)
    q8, k8, v8, qd, kd, vd = fp8attn.quantize_qkv(
        q, k, v, granularity=opts.granularity, hadamard=opts.hadamard, block_size=_BLOCK
    )
    blk = _BLOCK if opts.granularity == "per_block" else None
    if vl is None:
        out = fp8attn.flash_attn_func(
            q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=out_dtype, descale_block_size=blk, **common
        )
    else:
        nseq = vl.cu_q.numel() - 1
        if blk is None:  # varlen quantization gives one descale per KV head over the batch's real tokens
            qd, kd = qd.expand(nseq, -1), kd.expand(nseq, -1)
        vd = vd.expand(nseq, -1)
        out = fp8attn.flash_attn_varlen_func(
            q8,
            k8,
            v8,
            vl.cu_q,
            vl.cu_k,
            vl.max_q,
            vl.max_k,
            q_descale=qd,
            k_descale=kd,
            v_descale=vd,
            out_dtype=out_dtype,
            descale_block_size=blk,
            **common,
        )
    return out


def _validate_call(query, key, value, attention_mask, dropout, kwargs):
    if kwargs.get("output_attentions", False):
        raise NotImplementedError(
            "attn_implementation='fp8attn' does not return attention weights "
            "(output_attentions=True); use attn_implementation='eager' for them."
        )
    if dropout:
        raise NotImplementedError(
            f"attn_implementation='fp8attn': attention dropout {dropout} is not supported; "
            "set config.attention_dropout = 0.0."
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attn_implementation='fp8attn': attention sinks (s_aux) are not supported.")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}.")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise NotImplementedError(
            f"attention_mask: attn_implementation='fp8attn' takes the 2-D (batch, seqlen_k) padding mask that its "
            f"registered mask function builds, got {shape}. Call fp8attn.integrations.transformers.register() "
            "before building the model, and pass a 2-D attention_mask (no custom 4-D masks)."
        )


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def cache_keyword(model) -> str:
    """The keyword ``model``'s forward takes its cache under: ``"cache"`` (transformers >= 5.24) or
    ``"past_key_values"`` (earlier). An unknown keyword would not fail in transformers: it would travel on as
    an attention kwarg while the model built a cache of its own."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _refuse_unrouted_cache(kwargs) -> None:
    """An FP8Cache among the attention kwargs (not routed through Cache.update) was passed under a keyword
    the model's forward does not take, so the model attends over a cache of its own: refuse it."""
    for name, val in kwargs.items():
        if isinstance(val, FP8Cache):
            raise TypeError(
                f"{name}=: an FP8Cache arrived as an attention kwarg, so this model's forward does not take "
                f"its cache under {name!r} and runs with a cache of its own (transformers "
                f"{transformers.__version__}). Pass it as {'past_key_values' if name == 'cache' else 'cache'}=; "
                f"FP8Cache needs transformers >= {'.'.join(map(str, CACHE_MIN_VERSION))}."
            )


def fp8attn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    fp8attn_cache=None,
    **kwargs,
):
    """transformers attention function of ``attn_implementation="fp8attn"``.

    Parameters
    ----------
    module : the attention module (its ``is_causal`` and ``config`` are read).
    query : (batch, nheads_q, seqlen_q, head_dim) bf16 / fp16 / fp32.
    key, value : (batch, nheads_k, seqlen_k, head_dim[_v]), unexpanded GQA (nheads_q % nheads_k == 0):
        all keys (prefix included) for the default caches; the new tokens with :class:`FP8Cache`.
    attention_mask : None or the 2-D (batch, seqlen_k) padding mask (True / 1 = real token) built by the
        registered mask function; padded rows run as a varlen call over their real tokens.
    dropout : must be 0. scaling : softmax scale (None: 1/sqrt(head_dim)).
    sliding_window : the query and ``sliding_window - 1`` earlier keys (None: no window).
    softcap : logit softcap (None or 0: none). is_causal : overrides ``module.is_causal``.
    fp8attn_cache : set by :class:`FP8Cache` (the cache layer and the new keys it was given).
    kwargs : transformers' attention kwargs; ``position_ids`` of packed sequences (one row whose positions
        restart) and ``cu_seq_lens_q/k`` + ``max_length_q/k`` select a varlen call.

    Returns
    -------
    (out, None) : out (batch, seqlen_q, nheads_q, head_dim_v) in query's dtype; padded query rows are 0.
    """
    _validate_call(query, key, value, attention_mask, dropout, kwargs)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    window = _window(sliding_window, causal)
    cap = float(softcap or 0.0)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, heads, dim)
    if fp8attn_cache is None:
        _refuse_unrouted_cache(kwargs)
    else:
        layer, staged = fp8attn_cache
        if staged is not key:
            raise RuntimeError(
                "FP8Cache: the keys given to the attention function are not the ones the cache "
                "stored for this layer; the model changed them between Cache.update and attention."
            )
        out = layer.attend(q, k, v, attention_mask, scale=scale, causal=causal, window=window, softcap=cap)
        return out, None
    b, sq = q.shape[:2]
    opts = _options(module)
    common = dict(scale=scale, causal=causal, window=window, softcap=cap, opts=opts)
    vl = None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if attention_mask is not None:
        if k.shape[1] > attention_mask.shape[1]:  # a static cache's unused tail
            k, v = k[:, : attention_mask.shape[1]], v[:, : attention_mask.shape[1]]
        elif k.shape[1] < attention_mask.shape[1]:
            attention_mask = attention_mask[:, -k.shape[1] :]
        vl = _memo(attention_mask, (sq, k.shape[1]), lambda: _from_mask(attention_mask, sq))
    elif cu_q is not None and cu_k is not None and kwargs.get("max_length_q") is not None:
        n = q.shape[0] * q.shape[1]
        idx = torch.arange(n, device=q.device)
        vl = _Varlen(
            idx,
            idx,
            cu_q.to(torch.int32),
            cu_k.to(torch.int32),
            int(kwargs["max_length_q"]),
            int(kwargs["max_length_k"] if kwargs.get("max_length_k") is not None else kwargs["max_length_q"]),
        )
    elif b == 1 and sq > 1 and sq == k.shape[1] and kwargs.get("position_ids") is not None:
        pos = kwargs["position_ids"]
        vl = _memo(pos, ("pos", sq), lambda: _from_position_ids(pos))
    if vl is None:
        return _fp8_attention(q, k, v, None, **common), None
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    qf = flat(q) if vl.idx_q is None else flat(q).index_select(0, vl.idx_q)
    kf, vf = flat(k).index_select(0, vl.idx_k), flat(v).index_select(0, vl.idx_k)
    o = _fp8_attention(qf, kf, vf, vl, **common)
    if vl.idx_q is None:
        return o.view(b, sq, *o.shape[1:]), None
    out = o.new_zeros((b * sq, *o.shape[1:])).index_copy(0, vl.idx_q, o)
    return out.view(b, sq, *o.shape[1:]), None


# ====================================================================== the FP8 cache
def _raw(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as bytes (the same memory): torch lacks FP8 index_copy on the CPU."""
    return t.view(torch.uint8) if t.dtype == _E4M3 else t


def _page_count(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class FP8CacheLayer(CacheLayerMixin):
    """One decoder layer of :class:`FP8Cache`: a paged e4m3 K/V pool, its page table and scales.

    Row ``b`` of the batch owns pages ``j * batch + b`` (page ``j`` of the row), so growing a row appends
    pages at the end of the pool without moving any. Padding tokens are never written: row ``b`` holds
    ``lens[b]`` real tokens, compacted, and attention runs over exactly those.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, cache: "FP8Cache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.seen = 0  # positions processed, padding included (transformers' sequence length)
        self._staged = None

    # ------------------------------------------------------------------ allocation
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        c = self.cache
        b, hk, _, d = key_states.shape
        if c.batch_capacity is not None and b > c.batch_capacity:
            raise ValueError(
                f"FP8Cache: expected a batch of at most max_batch_size={c.batch_capacity}, got {b}. "
                "Create the cache with a larger max_batch_size."
            )
        self.device = key_states.device
        self.batch, self.nheads_k, self.head_dim, self.head_dim_v = b, hk, d, value_states.shape[-1]
        self.pages = 0
        pages = _page_count(c.length_capacity, c.page_size) if c.length_capacity is not None else 0
        self._alloc(pages)
        self.lens = torch.zeros(b, dtype=torch.int32, device=self.device)
        # which positions hold real tokens: None while all do, else (batch, >= seen) bool, updated in place
        # (a compiled decode step mutates it without growing any Python state)
        self._real: torch.Tensor | None = None
        # known on the host that every row holds a token (so per_seq_head has calibrated every row and
        # skips its calibration ops); False while unknown
        self._all_started = False
        self._seq_rows: tuple = ((0, 0), None)  # the last (b, s) asked for and its rows
        f32 = dict(dtype=torch.float32, device=self.device)
        if c.scale == "per_tensor":
            self.k_descale = torch.ones(1, 1, **f32) if c.k_descale is None else self._static(c.k_descale, "k_descale")
            self.v_descale = torch.ones(1, 1, **f32) if c.v_descale is None else self._static(c.v_descale, "v_descale")
            self.calibrated = c.k_descale is not None
        elif c.scale == "per_seq_head":
            self.k_descale = torch.ones(b, hk, **f32)
            self.v_descale = torch.ones(b, hk, **f32)
        self.is_initialized = True

    def _static(self, d, name):
        t = torch.as_tensor(d, dtype=torch.float32).reshape(-1)
        t = t[self.layer_idx] if t.numel() > 1 else t
        if not bool(torch.isfinite(t).all()) or float(t.min()) <= 0:
            raise ValueError(f"FP8Cache {name}: expected positive finite descales, got {t.tolist()}.")
        return t.reshape(1, 1).to(self.device)

    def _alloc(self, pages: int) -> None:
        """Grow every row to ``pages`` pages (new pages at the end of the pool; old ids keep their data)."""
        c, b = self.cache, self.batch
        add = pages - self.pages
        if add <= 0:
            return
        shape = (add * b, c.page_size, self.nheads_k)
        k = torch.empty((*shape, self.head_dim), dtype=_E4M3, device=self.device)
        v = torch.empty((*shape, self.head_dim_v), dtype=_E4M3, device=self.device)
        if self.pages == 0:
            self.keys, self.values = k, v
        else:
            self.keys, self.values = torch.cat([self.keys, k]), torch.cat([self.values, v])
        if c.scale == "per_token_head":
            s = torch.ones(shape, dtype=torch.float32, device=self.device)
            self.k_scales = s if self.pages == 0 else torch.cat([self.k_scales, s])
            self.v_scales = s.clone() if self.pages == 0 else torch.cat([self.v_scales, s.clone()])
        self.pages = pages
        j = torch.arange(pages, dtype=torch.int32, device=self.device)
        self.page_table = (
            j[None, :] * b + torch.arange(b, dtype=torch.int32, device=self.device)[:, None]
        ).contiguous()

    def _reserve(self, new_tokens: int) -> None:
        c = self.cache
        need = self.seen + new_tokens
        if c.length_capacity is not None and need > c.length_capacity:
            raise ValueError(
                f"FP8Cache: {need} tokens exceed max_cache_len={c.length_capacity} "
                f"(cached {self.seen}, new {new_tokens}). Create the cache with a larger max_cache_len."
            )
        pages = _page_count(need, c.page_size)
        if pages > self.pages:  # grow geometrically: few reallocations over a generation
            self._alloc(max(pages, 2 * self.pages))

    # ------------------------------------------------------------------ transformers' layer API
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch:
            raise ValueError(
                f"FP8Cache: expected batch {self.batch} (the cache's), got {key_states.shape[0]}. "
                "Use a new cache (or cache.reset()) for a different batch."
            )
        if self._staged is not None:
            raise RuntimeError(
                f"FP8Cache: layer {self.layer_idx} was updated twice without attending through "
                "attn_implementation='fp8attn' in between: its previous step ran another attention implementation "
                "over incomplete keys. Load the model with attn_implementation='fp8attn'."
            )
        self._reserve(key_states.shape[2])
        self.seen += key_states.shape[2]
        self._staged = key_states
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1 if self.cache.length_capacity is None else self.cache.length_capacity

    def reset(self) -> None:
        if self.is_initialized:
            self.lens.zero_()
            self._real = None
            self._all_started = False
            if self.cache.scale == "per_tensor" and self.cache.k_descale is None:
                self.calibrated = False
        self.seen = 0
        self._staged = None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop cached tokens: a negative (or zero) count removes that many from the end; a positive value is
        the length to keep (the older transformers convention)."""
        keep = self.seen - abs(tokens_to_remove) if tokens_to_remove <= 0 else min(self.seen, tokens_to_remove)
        if keep < 0:
            raise ValueError(f"FP8Cache.crop: cannot remove {-tokens_to_remove} of {self.seen} cached tokens.")
        if not self.is_initialized or keep == self.seen:
            return
        if self._real is None:
            self.lens.fill_(keep)
            self._all_started = self._all_started and keep > 0
        else:
            self.lens.copy_(self._real[:, :keep].sum(1, dtype=torch.int32))
            self._all_started = False  # (a left-padded row may keep no real token)
        self.seen = keep

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``b`` takes the contents of row ``beam_idx[b]`` (beam search)."""
        if not self.is_initialized:
            return
        idx = beam_idx.to(self.device).long()
        if idx.numel() != self.batch:
            raise ValueError(f"FP8Cache.reorder_cache: expected {self.batch} indices (the batch), got {idx.numel()}.")
        self._gather_rows(idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._gather_rows(torch.as_tensor(indices, device=self.device).long(), new_batch=True)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            idx = torch.arange(self.batch, device=self.device).repeat_interleave(repeats)
            self._gather_rows(idx, new_batch=True)

    def _gather_rows(self, idx: torch.Tensor, new_batch: bool = False) -> None:
        """Rebuild the cache so that row ``b`` is old row ``idx[b]`` (pages copied: rows diverge after)."""
        old_pt, pages = self.page_table, self.pages
        src = old_pt.index_select(0, idx).reshape(-1).long()
        tensors = ["keys", "values"] + (["k_scales", "v_scales"] if self.cache.scale == "per_token_head" else [])
        data = {n: getattr(self, n).index_select(0, src) for n in tensors}  # (new_batch * pages, ...) row-major
        if new_batch:
            self.batch = idx.numel()
        self.pages = 0
        self._alloc(pages)
        dst = self.page_table.reshape(-1).long()
        for n in tensors:
            _raw(getattr(self, n)).index_copy_(0, dst, _raw(data[n]))
        self.lens = self.lens.index_select(0, idx)
        if self._real is not None:
            self._real = self._real.index_select(0, idx)
        if self.cache.scale == "per_seq_head":
            self.k_descale = self.k_descale.index_select(0, idx)
            self.v_descale = self.v_descale.index_select(0, idx)

    # ------------------------------------------------------------------ attention
    def _calibrate(self, k, v, new_mask, first):
        """Set descales from this step's real tokens: per_tensor once per layer; per_seq_head for the rows
        receiving their first tokens (``first``, (batch,) bool)."""
        c = self.cache
        amax = []
        for x in (k, v):
            a = x.detach().abs().amax(-1).float()  # (batch, seqlen, nheads_k)
            if new_mask is not None:
                a = a * new_mask[..., None]
            amax.append(a)
        if c.scale == "per_tensor":
            self.k_descale = quant.descale_from_amax(amax[0].amax() * c.calib_margin, 448.0).reshape(1, 1)
            self.v_descale = quant.descale_from_amax(amax[1].amax() * c.calib_margin, 448.0).reshape(1, 1)
            self.calibrated = True
            return
        for name, a in (("k_descale", amax[0]), ("v_descale", amax[1])):
            d = quant.descale_from_amax(a.amax(1) * c.calib_margin, 448.0)
            setattr(self, name, torch.where(first[:, None], d, getattr(self, name)))

    def attend(self, q, k, v, attention_mask, *, scale, causal, window, softcap):
        """Write the staged new tokens into the FP8 cache, then attend over each row's cached real tokens.

        q (batch, seqlen_new, nheads_q, head_dim), k/v (batch, seqlen_new, nheads_k, head_dim[_v]) 16-bit;
        attention_mask None or (batch, >= seqlen_new) 2-D. Returns (batch, seqlen_new, nheads_q, head_dim_v).
        """
        self._staged = None
        c = self.cache
        b, s = q.shape[:2]
        dev = q.device
        new_mask = None if attention_mask is None else attention_mask[:, -s:].bool()
        ar = torch.arange(s, device=dev, dtype=torch.int32)
        if new_mask is None:
            pos = self.lens[:, None] + ar
            n_new = s
        else:
            csum = new_mask.to(torch.int32).cumsum(1, dtype=torch.int32)
            pos = self.lens[:, None] + csum - 1
            n_new = csum[:, -1]
        ps = c.page_size
        page = self.page_table.gather(1, (pos.clamp_min(0) // ps).long())
        slot = page.long() * ps + (pos.clamp_min(0) % ps).long()
        if new_mask is not None:
            slot = torch.where(new_mask, slot, torch.full_like(slot, -1))
        if c.scale == "per_tensor" and not self.calibrated:
            self._calibrate(k, v, new_mask, None)
        elif c.scale == "per_seq_head" and not self._all_started:
            self._calibrate(k, v, new_mask, (self.lens == 0) & (torch.as_tensor(n_new, device=dev) > 0))
        kf, vf = k.reshape(b * s, *k.shape[2:]), v.reshape(b * s, *v.shape[2:])
        wkw, akw = {}, {}
        if c.scale == "per_token_head":
            wkw = akw = dict(k_cache_scales=self.k_scales, v_cache_scales=self.v_scales)
        else:
            akw = wkw = dict(k_descale=self.k_descale, v_descale=self.v_descale)
            if c.scale == "per_seq_head":
                wkw = dict(wkw, token_seq_idx=self._token_rows(b, s))
        fp8attn.write_kv_cache(kf.detach(), vf.detach(), self.keys, self.values, slot.reshape(-1), **wkw)
        self.lens.add_(n_new)  # (in place: a compiled step rebinds no cache attribute)
        self._mark_real(s, new_mask)
        if new_mask is None and s > 0:
            self._all_started = True
        out_dtype = _out_dtype(q.dtype)
        # 16-bit Q over FP8 K/V: fp32 queries go to fp16, whose 10 mantissa bits keep more of them than bf16
        qq = q if q.dtype in (torch.bfloat16, torch.float16) else q.to(torch.float16)
        common = dict(
            cache_seqlens=self.lens,
            page_table=self.page_table,
            softmax_scale=scale,
            causal=causal,
            window_size=window,
            softcap=softcap,
            out_dtype=out_dtype,
            **akw,
        )
        if new_mask is None or s == 1:
            # every new token real (or one query per row, whose pad output is ignored): a dense call, no sync
            return fp8attn.flash_attn_with_kvcache(qq, self.keys, self.values, **common)
        idx = torch.nonzero(new_mask.reshape(-1)).flatten()
        # (this branch synchronizes for idx anyway: learn whether every row now holds a token)
        self._all_started = bool((self.lens > 0).all())
        cu_q = _cu(new_mask.sum(1, dtype=torch.int32))
        o = fp8attn.flash_attn_with_kvcache(
            qq.reshape(b * s, *q.shape[2:]).index_select(0, idx),
            self.keys,
            self.values,
            cu_seqlens_q=cu_q,
            max_seqlen_q=s,
            **common,
        )
        out = o.new_zeros((b * s, *o.shape[1:])).index_copy(0, idx, o)
        return out.view(b, s, *o.shape[1:])

    def _mark_real(self, s: int, new_mask: torch.Tensor | None) -> None:
        """Record which of the last ``s`` positions hold real tokens (``crop`` recounts the rows from it)."""
        if new_mask is None and self._real is None:
            return
        end = self.seen
        if self._real is None or self._real.shape[1] < end:
            real = torch.ones(
                self.batch, max(end, self.pages * self.cache.page_size), dtype=torch.bool, device=self.device
            )
            if self._real is not None:
                real[:, : self._real.shape[1]] = self._real
            self._real = real
        self._real[:, end - s : end] = True if new_mask is None else new_mask

    def _token_rows(self, b: int, s: int) -> torch.Tensor:
        """int32 (b * s,): the row of each new token, kept for the last (b, s) asked for (decode steps ask for
        the same one; prefills of other lengths replace it rather than accumulate)."""
        key, t = self._seq_rows
        if t is None or key != (b, s):
            t = torch.arange(b, device=self.device, dtype=torch.int32).repeat_interleave(s)
            self._seq_rows = ((b, s), t)
        return t

    @property
    def kv_bytes(self) -> int:
        """Bytes of this layer's K/V pool (and per-token-head scales)."""
        if not self.is_initialized:
            return 0
        n = self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
        if self.cache.scale == "per_token_head":
            n += self.k_scales.numel() * 4 + self.v_scales.numel() * 4
        return n


class FP8Cache(Cache):
    """A transformers ``Cache`` holding K/V in FP8 e4m3 paged pools; attention through fp8attn's kernels.

    Use it with a model loaded with ``attn_implementation="fp8attn"``::

        cache = FP8Cache(config=model.config, max_batch_size=4, max_cache_len=1024)
        model.generate(**inputs, past_key_values=cache)

    Parameters
    ----------
    config : the model's ``PretrainedConfig`` (its decoder text config gives the layer count; its
        ``_attn_implementation`` must be "fp8attn" whenever the cache is updated).
    max_batch_size : int, optional
        Largest batch the cache accepts (checked at the first update).
    max_cache_len : int, optional
        Tokens per row (padding included). Given: each layer allocates its pages once, at its first
        update. None: pages are added as the rows grow (the pool doubles).
    scale : {"per_seq_head", "per_tensor", "per_token_head"}
        per_seq_head (default): one K and one V descale per (sequence, KV head), calibrated from the
        sequence's first tokens (its prompt). per_tensor: one descale per layer, static (``k_descale`` /
        ``v_descale``) or calibrated from the first update. per_token_head: a descale per cached token and
        head, computed as tokens are written (float32, stored beside the pool).
    page_size : int
        Tokens per page (default 64).
    k_descale, v_descale : float or sequence of floats (one per layer), optional
        Static per-tensor descales (scale="per_tensor" only).
    calib_margin : float
        Calibrated descale = ``max(amax * calib_margin, floor) / 448``; > 1 leaves headroom for later tokens
        (larger values saturate otherwise).

    Notes
    -----
    Padding tokens (0 in the 2-D attention_mask) are never written: each row holds its real tokens only,
    so left and right padding both attend correctly. Sliding-window layers keep all their tokens (the window
    is applied by the kernel). ``crop``, ``reorder_cache`` (beam search), ``batch_select_indices``,
    ``batch_repeat_interleave`` and ``reset`` are supported. The decode step is not ``torch.compile``-able
    (``is_compileable`` is False: per-row lengths and page growth are bookkept on the host).
    """

    def __init__(
        self,
        config=None,
        max_batch_size: int | None = None,
        max_cache_len: int | None = None,
        *,
        scale: str = "per_seq_head",
        page_size: int = 64,
        k_descale=None,
        v_descale=None,
        calib_margin: float = 1.0,
        **kwargs,
    ):
        if _version(transformers.__version__) < CACHE_MIN_VERSION:
            raise RuntimeError(
                f"FP8Cache needs transformers >= {'.'.join(map(str, CACHE_MIN_VERSION))} (its models hand "
                f"Cache.update the attention kwargs through which the cache reaches fp8attn's attention); "
                f"this is transformers {transformers.__version__}. pip install 'fp8attn[transformers]'."
            )
        if config is None or not hasattr(config, "get_text_config"):
            raise TypeError(
                f"FP8Cache: expected config=<the model's PretrainedConfig>, got {type(config).__name__}. "
                "Pass config=model.config."
            )
        if kwargs:
            raise TypeError(f"FP8Cache: unexpected arguments {sorted(kwargs)}.")
        if scale not in CACHE_SCALES:
            raise ValueError(f"scale: expected one of {CACHE_SCALES}, got {scale!r}.")
        for name, val in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len)):
            if val is not None and (not isinstance(val, int) or val < 1):
                raise ValueError(f"{name}: expected a positive int or None, got {val!r}.")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size: expected a positive int, got {page_size!r}.")
        if (k_descale is not None or v_descale is not None) and scale != "per_tensor":
            raise ValueError(f"k_descale/v_descale: static descales need scale='per_tensor', got scale={scale!r}.")
        if (k_descale is None) != (v_descale is None):
            raise ValueError("k_descale/v_descale: expected both static descales or neither, got one.")
        if not (calib_margin >= 1.0 and math.isfinite(calib_margin)):
            raise ValueError(f"calib_margin: expected a finite float >= 1, got {calib_margin!r}.")
        self.config = config
        self.batch_capacity, self.length_capacity = max_batch_size, max_cache_len
        for name, val in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len)):
            try:  # transformers' own attributes where they are plain ones (read-only properties in some versions)
                setattr(self, name, val)
            except AttributeError:
                pass
        self.scale, self.page_size = scale, page_size
        self.k_descale, self.v_descale = k_descale, v_descale
        self.calib_margin = float(calib_margin)
        text = config.get_text_config(decoder=True)
        n = int(text.num_hidden_layers)
        super().__init__(layers=[FP8CacheLayer(self, i) for i in range(n)])

    def _check_attention(self) -> None:
        impl = getattr(self.config, "_attn_implementation", None)
        if isinstance(impl, dict):  # composite configs: the decoder's entry
            impl = impl.get("text_config", impl.get("", None))
        text_impl = getattr(self.config.get_text_config(decoder=True), "_attn_implementation", impl)
        if text_impl != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"FP8Cache holds FP8 keys and values that only attn_implementation='{ATTN_IMPLEMENTATION}' reads, "
                f"but this model attends with {text_impl!r}. Load it with attn_implementation='{ATTN_IMPLEMENTATION}' "
                f"(or call model.set_attn_implementation('{ATTN_IMPLEMENTATION}')), or use the default cache."
            )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, kwargs=None, **extra):
        """Stage the new 16-bit K/V of ``layer_idx``; the fp8attn attention function writes them into the
        FP8 pool and attends. Returns the new K/V unchanged (never the cache)."""
        self._check_attention()
        if kwargs is None:
            raise RuntimeError(
                "FP8Cache: this model's attention does not pass its attention kwargs to Cache.update "
                "(cache.update(k, v, layer_idx, kwargs=kwargs)), so the cache cannot reach the attention function. "
                "FP8Cache supports the transformers 5.x models that do (Llama, Mistral, Qwen2, ...)."
            )
        layer = self.layers[layer_idx]
        k, v = layer.update(key_states, value_states)
        kwargs["fp8attn_cache"] = (layer, k)  # handed to fp8attn_attention_forward through the same kwargs
        return k, v

    @property
    def kv_bytes(self) -> int:
        """Bytes of all layers' FP8 K/V pools (and per-token-head scales)."""
        return sum(layer.kv_bytes for layer in self.layers)


# ====================================================================== registration
def register() -> None:
    """Register ``"fp8attn"`` with transformers' AttentionInterface and AttentionMaskInterface (the 2-D
    padding mask of its flash-attention implementations). Idempotent; run on import of this module."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, fp8attn_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, flash_attention_mask)


register()
