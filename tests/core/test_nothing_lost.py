"""Nothing lost: a refused call changes no byte of any argument, and says which argument is wrong.

For every public entry point that writes (cache appends of ``flash_attn_with_kvcache``, ``write_kv_cache``,
``out=``, split workspaces, ``flash_attn_combine``'s ``out=``) and for ``quantize_qkv``, a grid of bad inputs
(one mutation of a valid call each): every tensor argument is snapshotted byte for byte, the call must raise
the expected TypeError / ValueError / NotImplementedError (nothing else may escape) with a message that names
the argument, and afterwards every tensor argument holds the same bytes (compared as uint8, so NaN-poisoned
slots compare equal). CPU path: every value check runs.
"""

import math
import re

import pytest
import torch

from fp8attn import (
    flash_attn_combine,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    quantize_qkv,
    split_workspace,
    write_kv_cache,
)
from fp8attn.paged_cache import alloc_paged_cache

E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16
NAN, INF = float("nan"), float("inf")


# --------------------------------------------------------------------------------------- valid calls
def _append():
    """A paged append (bf16 tokens into a NaN-poisoned FP8 cache) with out= and the LSE."""
    kc, vc = alloc_paged_cache(8, 4, 2, 32, poison_nan=True)
    q = torch.randn(2, 2, 4, 32, dtype=BF16)
    return flash_attn_with_kvcache, dict(
        q=q,
        k_cache=kc,
        v_cache=vc,
        k=torch.randn(2, 2, 2, 32, dtype=BF16),
        v=torch.randn(2, 2, 2, 32, dtype=BF16),
        cache_seqlens=torch.tensor([3, 5], dtype=torch.int32),
        page_table=torch.tensor([[6, 1, -1], [0, 4, 2]], dtype=torch.int32),
        k_descale=torch.tensor([[0.5, 0.25], [0.75, 0.5]]),
        v_descale=torch.tensor([[0.5, 1.0], [0.25, 0.5]]),
        causal=True,
        return_softmax_lse=True,
        out=torch.full((2, 2, 4, 32), NAN, dtype=BF16),
    )


def _append_split():
    """An append with an explicit split count and a preallocated split workspace."""
    f, kw = _append()
    kw.update(num_splits=2, split_workspace=split_workspace(kw["q"], 2, 32))
    return f, kw


def _append_varlen_rotary():
    """A varlen append (cu_seqlens_k_new) into a contiguous cache with rotary tables and cache_batch_idx."""
    kc = torch.full((3, 16, 2, 32), NAN, dtype=BF16)
    vc = torch.full((3, 16, 2, 32), NAN, dtype=BF16)
    return flash_attn_with_kvcache, dict(
        q=torch.randn(3, 4, 32, dtype=BF16),
        k_cache=kc,
        v_cache=vc,
        k=torch.randn(3, 2, 32, dtype=BF16),
        v=torch.randn(3, 2, 32, dtype=BF16),
        cache_seqlens=torch.tensor([4, 2], dtype=torch.int32),
        cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
        max_seqlen_q=2,
        cu_seqlens_k_new=torch.tensor([0, 1, 3], dtype=torch.int32),
        rotary_cos=torch.rand(16, 8),
        rotary_sin=torch.rand(16, 8),
        causal=True,
        out=torch.full((3, 4, 32), NAN, dtype=BF16),
    )


def _write():
    """write_kv_cache with per-(sequence, head) descales."""
    kc, vc = alloc_paged_cache(4, 4, 2, 32, poison_nan=True)
    return write_kv_cache, dict(
        k=torch.randn(4, 2, 32),
        v=torch.randn(4, 2, 32),
        k_cache=kc,
        v_cache=vc,
        slot_mapping=torch.tensor([0, 5, -1, 14]),
        k_descale=torch.tensor([[0.5, 0.25], [0.75, 0.5]]),
        v_descale=torch.tensor([[0.5], [0.25]]),
        token_seq_idx=torch.tensor([0, 0, 1, 1], dtype=torch.int32),
    )


def _write_dynamic():
    """write_kv_cache with per-token-head scales stored beside the cache."""
    kc, vc, ks, vs = alloc_paged_cache(4, 4, 2, 32, poison_nan=True, with_scales=True)
    return write_kv_cache, dict(
        k=torch.randn(3, 2, 32),
        v=torch.randn(3, 2, 32),
        k_cache=kc,
        v_cache=vc,
        slot_mapping=torch.tensor([2, 9, 3]),
        k_cache_scales=ks,
        v_cache_scales=vs,
    )


def _combine():
    return flash_attn_combine, dict(
        out_partial=torch.randn(3, 2, 5, 4, 32), lse_partial=torch.randn(3, 2, 5, 4), out=torch.full((2, 5, 4, 32), NAN)
    )


def _dense():
    q, k, v = (torch.randn(2, 5, h, 32).to(E4M3) for h in (4, 2, 2))
    return flash_attn_func, dict(
        q=q,
        k=k,
        v=v,
        q_descale=torch.rand(2, 2) + 0.5,
        k_descale=torch.rand(2, 2) + 0.5,
        v_descale=torch.rand(2, 2) + 0.5,
        causal=True,
        out=torch.full((2, 5, 4, 32), NAN, dtype=BF16),
    )


def _varlen():
    q, k, v = torch.randn(7, 4, 32).to(E4M3), torch.randn(9, 2, 32).to(E4M3), torch.randn(9, 2, 32).to(E4M3)
    return flash_attn_varlen_func, dict(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 4, 9], dtype=torch.int32),
        max_seqlen_q=4,
        max_seqlen_k=5,
        seqused_k=torch.tensor([4, 3], dtype=torch.int32),
        k_descale=torch.rand(2, 2) + 0.5,
        out=torch.full((7, 4, 32), NAN, dtype=BF16),
    )


def _quantize():
    return quantize_qkv, dict(
        q=torch.randn(2, 16, 4, 32, dtype=BF16),
        k=torch.randn(2, 16, 2, 32, dtype=BF16),
        v=torch.randn(2, 16, 2, 32, dtype=BF16),
    )


CALLS = dict(
    append=_append,
    append_split=_append_split,
    append_varlen_rotary=_append_varlen_rotary,
    write=_write,
    write_dynamic=_write_dynamic,
    combine=_combine,
    dense=_dense,
    varlen=_varlen,
    quantize=_quantize,
)


# ------------------------------------------------------------------------------------- bad inputs
def _with_nan(name, pos=0, value=NAN):
    def f(kw):
        t = kw[name].clone()
        t.view(-1)[pos] = value
        return {name: t}

    return f


def _set(**changes):
    return lambda kw: changes


def _fp8_out(kw):
    return {"out": torch.empty(kw["out"].shape, dtype=E4M3)}


def _out_scale(value):
    return lambda kw: {"out_scale": torch.tensor(value), **_fp8_out(kw)}


def _bf16_qkv(kw):
    return {n: kw[n].to(BF16) for n in ("q", "k", "v")}


_OPTIONS = [  # (what, mutation, exception, argument named) for every attention entry point
    ("softmax_scale nan", _set(softmax_scale=NAN), ValueError, "softmax_scale"),
    ("softmax_scale negative", _set(softmax_scale=-0.5), ValueError, "softmax_scale"),
    ("softmax_scale str", _set(softmax_scale="0.1"), ValueError, "softmax_scale"),
    ("window one int", _set(window_size=(3,)), ValueError, "window_size"),
    ("window below -1", _set(window_size=(-4, 0)), ValueError, "window_size"),
    ("window float", _set(window_size=(2.5, 0)), ValueError, "window_size"),
    ("softcap negative", _set(softcap=-1.0), ValueError, "softcap"),
    ("softcap nan", _set(softcap=NAN), ValueError, "softcap"),
    ("softcap inf", _set(softcap=INF), ValueError, "softcap"),
    ("causal str", _set(causal="no"), TypeError, "causal"),
    ("causal None", _set(causal=None), TypeError, "causal"),
    ("validate str", _set(validate="yes"), TypeError, "validate"),
    ("pack_gqa str", _set(pack_gqa="auto"), TypeError, "pack_gqa"),
    ("out_scale zero", _out_scale(0.0), ValueError, "out_scale"),
    ("out_scale negative", _out_scale(-0.5), ValueError, "out_scale"),
    ("out_scale nan", _out_scale(NAN), ValueError, "out_scale"),
    ("out_scale inf", _out_scale(INF), ValueError, "out_scale"),
    ("out shape", lambda kw: {"out": kw["out"][..., :16]}, ValueError, "out"),
    ("out dtype", lambda kw: {"out": kw["out"].float()}, TypeError, "out"),
    ("out_dtype int", _set(out_dtype=torch.int8), TypeError, "out_dtype"),
    ("qv tensor", lambda kw: {"qv": torch.randn(*kw["q"].shape[:-1], 64)}, NotImplementedError, "qv"),
]

_CACHE = [  # flash_attn_with_kvcache with an append
    ("return_softmax_lse str", _set(return_softmax_lse="yes"), TypeError, "return_softmax_lse"),
    ("rotary_interleaved int", _set(rotary_interleaved=1), TypeError, "rotary_interleaved"),
    ("q_descale for bf16 q", _set(q_descale=torch.ones(2, 2)), ValueError, "q_descale"),
    ("k_descale nan", _with_nan("k_descale"), ValueError, "k_descale"),
    ("k_descale zero", _with_nan("k_descale", 1, 0.0), ValueError, "k_descale"),
    ("v_descale shape", _set(v_descale=torch.ones(2, 3)), ValueError, "v_descale"),
    ("v_descale float64", lambda kw: {"v_descale": kw["v_descale"].double()}, TypeError, "v_descale"),
    (
        "cache_seqlens past capacity",
        _set(cache_seqlens=torch.tensor([3, 11], dtype=torch.int32)),
        ValueError,
        "cache_seqlens",
    ),
    (
        "cache_seqlens negative",
        _set(cache_seqlens=torch.tensor([-1, 5], dtype=torch.int32)),
        ValueError,
        "cache_seqlens",
    ),
    ("cache_seqlens int64", _set(cache_seqlens=torch.tensor([3, 5])), TypeError, "cache_seqlens"),
    (
        "cache_seqlens wrong batch",
        _set(cache_seqlens=torch.tensor([3], dtype=torch.int32)),
        ValueError,
        "cache_seqlens",
    ),
    (
        "page id past the pool",
        _set(page_table=torch.tensor([[6, 8, -1], [0, 4, 2]], dtype=torch.int32)),
        ValueError,
        "page_table",
    ),
    (
        "page id -1 in use",
        _set(page_table=torch.tensor([[6, -1, -1], [0, 4, 2]], dtype=torch.int32)),
        ValueError,
        "page_table",
    ),
    (
        "two appends, one slot",
        _set(
            page_table=torch.tensor([[6, 1, -1], [0, 1, 2]], dtype=torch.int32),
            cache_seqlens=torch.tensor([5, 5], dtype=torch.int32),
        ),
        ValueError,
        "page_table",
    ),
    ("new k fp8", lambda kw: {"k": kw["k"].to(E4M3), "v": kw["v"].to(E4M3)}, TypeError, "k"),
    ("new k heads", lambda kw: {"k": kw["k"][:, :, :1], "v": kw["v"][:, :, :1]}, ValueError, "k"),
    ("new v missing", _set(v=None), ValueError, "k/v"),
    ("num_splits negative", _set(num_splits=-1), ValueError, "num_splits"),
    ("sm_margin", _set(sm_margin=2), NotImplementedError, "sm_margin"),
    ("attention_chunk negative", _set(attention_chunk=-16), ValueError, "attention_chunk"),
    (
        "k_cache_scales alone",
        lambda kw: {"k_cache_scales": torch.ones(kw["k_cache"].shape[:3]), "k_descale": None},
        ValueError,
        "k_cache_scales/v_cache_scales",
    ),
]

_SPLIT = [
    (
        "workspace too few splits",
        lambda kw: {"split_workspace": split_workspace(kw["q"], 1, 32)},
        ValueError,
        "split_workspace",
    ),
    ("workspace without num_splits", _set(num_splits=0), ValueError, "split_workspace"),
    (
        "workspace bf16",
        lambda kw: {"split_workspace": tuple(t.to(BF16) for t in kw["split_workspace"])},
        ValueError,
        "split_workspace",
    ),
]

_CACHE_VARLEN = [
    (
        "rotary rows too few",
        lambda kw: {"rotary_cos": kw["rotary_cos"][:4], "rotary_sin": kw["rotary_sin"][:4]},
        ValueError,
        "rotary_cos",
    ),
    ("rotary_seqlens int64", _set(rotary_seqlens=torch.tensor([1, 2])), TypeError, "rotary_seqlens"),
    (
        "rotary_seqlens wrong batch",
        _set(rotary_seqlens=torch.tensor([1], dtype=torch.int32)),
        ValueError,
        "rotary_seqlens",
    ),
    (
        "cache_batch_idx out of range",
        _set(cache_batch_idx=torch.tensor([3, 0], dtype=torch.int32)),
        ValueError,
        "cache_batch_idx",
    ),
    (
        "two appends, one slot",
        _set(
            cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32),
            cache_seqlens=torch.tensor([2, 2], dtype=torch.int32),
        ),
        ValueError,
        "cache_batch_idx",
    ),
    (
        "cu_seqlens_k_new past k",
        _set(cu_seqlens_k_new=torch.tensor([0, 2, 4], dtype=torch.int32)),
        ValueError,
        "cu_seqlens_k_new",
    ),
    (
        "cu_seqlens_k_new decreasing",
        _set(cu_seqlens_k_new=torch.tensor([0, 2, 1], dtype=torch.int32)),
        ValueError,
        "cu_seqlens_k_new",
    ),
    ("cu_seqlens_q past q", _set(cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32)), ValueError, "cu_seqlens_q"),
    ("max_seqlen_q below", _set(max_seqlen_q=1), ValueError, "max_seqlen_q"),
    ("max_seqlen_q bool", _set(max_seqlen_q=True), TypeError, "max_seqlen_q"),
    ("k_descale for a bf16 cache", _set(k_descale=torch.ones(2, 2)), ValueError, "k_descale"),
    (
        "cache_leftpad past the length",
        _set(cache_leftpad=torch.tensor([5, 0], dtype=torch.int32)),
        ValueError,
        "cache_leftpad",
    ),
]

_WRITE = [
    ("slot past the cache", _set(slot_mapping=torch.tensor([0, 5, -1, 16])), ValueError, "slot_mapping"),
    ("duplicate slots", _set(slot_mapping=torch.tensor([0, 5, -1, 5])), ValueError, "slot_mapping"),
    ("slots float", _set(slot_mapping=torch.tensor([0.0, 5.0, -1.0, 14.0])), TypeError, "slot_mapping"),
    ("slots too few", _set(slot_mapping=torch.tensor([0, 5, -1])), ValueError, "slot_mapping"),
    (
        "token_seq_idx past the descales",
        _set(token_seq_idx=torch.tensor([0, 2, 1, 1], dtype=torch.int32)),
        ValueError,
        "token_seq_idx",
    ),
    (
        "token_seq_idx negative",
        _set(token_seq_idx=torch.tensor([0, -1, 1, 1], dtype=torch.int32)),
        ValueError,
        "token_seq_idx",
    ),
    (
        "token_seq_idx too short",
        _set(token_seq_idx=torch.tensor([0, 1], dtype=torch.int32)),
        ValueError,
        "token_seq_idx",
    ),
    ("token_seq_idx missing", _set(token_seq_idx=None), ValueError, "token_seq_idx"),
    ("k_descale heads", _set(k_descale=torch.ones(2, 3)), ValueError, "k_descale"),
    ("k_descale 3-D", _set(k_descale=torch.ones(2, 2, 1)), ValueError, "k_descale"),
    ("k_descale nan", _with_nan("k_descale"), ValueError, "k_descale"),
    ("v_descale negative", _with_nan("v_descale", 1, -1.0), ValueError, "v_descale"),
    (
        "descales for a bf16 cache",
        lambda kw: {"k_cache": kw["k_cache"].to(BF16), "v_cache": kw["v_cache"].to(BF16)},
        ValueError,
        "k_descale",
    ),
    (
        "int8 cache",
        lambda kw: {"k_cache": kw["k_cache"].view(torch.int8), "v_cache": kw["v_cache"].view(torch.int8)},
        TypeError,
        "k_cache",
    ),
    ("caches of two dtypes", lambda kw: {"v_cache": kw["v_cache"].to(torch.float8_e5m2)}, TypeError, "v_cache"),
    ("new k fp8", lambda kw: {"k": kw["k"].to(E4M3)}, TypeError, "k"),
    ("new v tokens differ", lambda kw: {"v": kw["v"][:3]}, ValueError, "v"),
    ("validate str", _set(validate="yes"), TypeError, "validate"),
    ("k_descale a list", _set(k_descale=[0.5]), TypeError, "k_descale"),
]

_WRITE_DYNAMIC = [
    ("scales and a descale", _set(k_descale=torch.tensor(0.5)), ValueError, "k_descale"),
    ("one scale tensor", _set(v_cache_scales=None), ValueError, "k_cache_scales/v_cache_scales"),
    (
        "scales of a 16-bit cache",
        lambda kw: {"k_cache": kw["k_cache"].to(BF16), "v_cache": kw["v_cache"].to(BF16)},
        ValueError,
        "k_cache_scales",
    ),
    ("scales shape", lambda kw: {"k_cache_scales": kw["k_cache_scales"][:, :2]}, ValueError, "k_cache_scales"),
    ("scales a list", _set(k_cache_scales=[1.0]), TypeError, "k_cache_scales"),
    ("duplicate slots", _set(slot_mapping=torch.tensor([2, 9, 2])), ValueError, "slot_mapping"),
]

_COMBINE = [
    (
        "no splits",
        lambda kw: {"out_partial": kw["out_partial"][:0], "lse_partial": kw["lse_partial"][:0]},
        ValueError,
        "out_partial",
    ),
    ("lse nan", _with_nan("lse_partial", 7), ValueError, "lse_partial"),
    ("lse +inf", _with_nan("lse_partial", 7, INF), ValueError, "lse_partial"),
    ("out_scale zero", _out_scale(0.0), ValueError, "out_scale"),
    ("out_scale nan", _out_scale(NAN), ValueError, "out_scale"),
    (
        "out_scale with out_dtype",
        lambda kw: {"out_scale": torch.tensor(1.0), "out_dtype": BF16, **_fp8_out(kw)},
        ValueError,
        "out_dtype",
    ),
    ("out dtype", lambda kw: {"out": kw["out"].to(BF16)}, TypeError, "out"),
    ("out shape", lambda kw: {"out": kw["out"][:1]}, ValueError, "out"),
    ("lse shape", lambda kw: {"lse_partial": kw["lse_partial"][:, :, :2]}, ValueError, "lse_partial"),
    ("validate str", _set(validate=1), TypeError, "validate"),
]

_DENSE = [
    ("descales of bf16 inputs", _bf16_qkv, ValueError, "q_descale"),
    ("deterministic str", _set(deterministic="yes"), TypeError, "deterministic"),
    ("return_attn_probs str", _set(return_attn_probs="yes"), TypeError, "return_attn_probs"),
    ("k_descale inf", _with_nan("k_descale", 2, INF), ValueError, "k_descale"),
    ("num_splits", _set(num_splits=2), NotImplementedError, "num_splits"),
    ("descale_block_size", _set(descale_block_size=24), ValueError, "descale_block_size"),
]

_VARLEN = [
    ("seqused_k past the sequence", _set(seqused_k=torch.tensor([4, 6], dtype=torch.int32)), ValueError, "seqused_k"),
    ("seqused_k negative", _set(seqused_k=torch.tensor([-1, 3], dtype=torch.int32)), ValueError, "seqused_k"),
    ("seqused_q wrong batch", _set(seqused_q=torch.tensor([1, 1, 1], dtype=torch.int32)), ValueError, "seqused_q"),
    ("seqused_q 2-D", _set(seqused_q=torch.ones(2, 1, dtype=torch.int32)), ValueError, "seqused_q"),
    ("seqused_q past the sequence", _set(seqused_q=torch.tensor([4, 1], dtype=torch.int32)), ValueError, "seqused_q"),
    (
        "cu_seqlens_k decreasing",
        _set(cu_seqlens_k=torch.tensor([0, 5, 4], dtype=torch.int32)),
        ValueError,
        "cu_seqlens_k",
    ),
    (
        "v_descale for bf16 v",
        lambda kw: {**_bf16_qkv(kw), "k_descale": None, "v_descale": torch.ones(2, 2)},
        ValueError,
        "v_descale",
    ),
    ("max_seqlen_k float", _set(max_seqlen_k=5.0), TypeError, "max_seqlen_k"),
]

_QUANTIZE = [
    ("q nan", _with_nan("q", 100), ValueError, "q"),
    ("k inf", _with_nan("k", 3, INF), ValueError, "k"),
    ("v -inf", _with_nan("v", 50, -INF), ValueError, "v"),
    ("hadamard str", _set(hadamard="yes"), TypeError, "hadamard"),
    ("block_size str", _set(block_size="64"), TypeError, "block_size"),
    ("block_size not a power of two", _set(granularity="per_block", block_size=48), ValueError, "block_size"),
    ("granularity", _set(granularity="per_row"), ValueError, "granularity"),
    ("backend", _set(backend="cuda"), ValueError, "backend"),
    ("v_layout", _set(v_layout="column"), ValueError, "v_layout"),
    ("validate str", _set(validate="yes"), TypeError, "validate"),
    ("seed float", _set(seed=1.5), TypeError, "seed"),
]

_ATTN = {"append", "append_split", "append_varlen_rotary", "dense", "varlen"}
GRID = {
    "append": _CACHE,
    "append_split": _SPLIT,
    "append_varlen_rotary": _CACHE_VARLEN,
    "write": _WRITE,
    "write_dynamic": _WRITE_DYNAMIC,
    "combine": _COMBINE,
    "dense": _DENSE,
    "varlen": _VARLEN,
    "quantize": _QUANTIZE,
}
CASES = [(call, *m) for call in CALLS for m in (_OPTIONS if call in _ATTN else []) + GRID[call]]


def _tensors(kw):
    """Every tensor argument (tensors inside tuples, such as a split workspace, too), by a readable name."""
    for name, val in kw.items():
        if isinstance(val, torch.Tensor):
            yield name, val
        elif isinstance(val, (tuple, list)):
            for i, t in enumerate(val):
                if isinstance(t, torch.Tensor):
                    yield f"{name}[{i}]", t


def _bytes(t):
    """A fresh contiguous copy of t's bytes (uint8: NaN payloads compare equal)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t.detach()).reshape(-1).view(torch.uint8)


def refused_unchanged(fn, kw, exc, arg):
    """Call ``fn(**kw)``: it must raise ``exc`` naming ``arg`` in the "<arg>: expected ..., got ..." form (never
    printing a tensor's values), and leave every byte of every tensor argument as it was. Returns the message."""
    before = {n: _bytes(t) for n, t in _tensors(kw)}
    with pytest.raises((TypeError, ValueError, NotImplementedError)) as ei:
        fn(**kw)
    msg = str(ei.value)
    assert isinstance(ei.value, exc), f"{type(ei.value).__name__} instead of {exc.__name__}: {msg}"
    assert re.search(rf"(^|\W){re.escape(arg)}(\W|$)", msg), f"the message does not name {arg!r}: {msg}"
    if exc is not NotImplementedError:
        assert "expected" in msg and "got" in msg, f"not in the '<arg>: expected ..., got ...' form: {msg}"
    assert "tensor(" not in msg and len(msg) < 700, f"the message prints a tensor: {msg[:300]}..."
    changed = [n for n, t in _tensors(kw) if not torch.equal(_bytes(t), before[n])]
    assert not changed, f"a refused call wrote into {changed}: {msg}"
    return msg


@pytest.mark.parametrize("call", list(CALLS))
def test_valid_calls_run(call):
    """The grid's starting points are valid (so each case below tests its one mutation)."""
    fn, kw = CALLS[call]()
    fn(**kw)


@pytest.mark.parametrize("call,what,mutate,exc,arg", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_refused_call_changes_nothing(call, what, mutate, exc, arg):
    fn, kw = CALLS[call]()
    kw.update(mutate(kw))
    refused_unchanged(fn, kw, exc, arg)


# ------------------------------------------------------------------------ one test per class of problem
def test_appends_land_only_after_every_check():
    """The example of the issue: a bad softmax_scale / window_size with k=, v= used to write the new tokens
    first; now the cache is untouched, and the same call with good options then writes them."""
    for bad in (dict(softmax_scale=NAN), dict(softmax_scale=-1.0), dict(window_size=(1,)), dict(softcap=NAN)):
        fn, kw = _append()
        refused_unchanged(fn, dict(kw, **bad), ValueError, next(iter(bad)))
    fn, kw = _append()
    before = _bytes(kw["k_cache"])
    fn(**kw)
    assert not torch.equal(_bytes(kw["k_cache"]), before)


def test_out_scale_and_softcap_values_checked_like_descales():
    q, k, v = (torch.randn(1, 4, 2, 32).to(E4M3) for _ in range(3))
    for s in (0.0, -1.0, NAN, INF):
        with pytest.raises(ValueError, match="out_scale"):
            flash_attn_func(q, k, v, out_scale=torch.tensor(s))
    o = flash_attn_func(q, k, v, out_scale=torch.tensor(0.01))  # a good scale still fuses
    assert o.dtype == E4M3
    for c in (-0.5, NAN, "1"):
        with pytest.raises(ValueError, match="softcap"):
            flash_attn_func(q, k, v, softcap=c)
    assert torch.equal(flash_attn_func(q, k, v, softcap=0), flash_attn_func(q, k, v))  # 0 and 0.0: off


def test_flags_must_be_bools():
    q, k, v = (torch.randn(1, 4, 2, 32, dtype=BF16) for _ in range(3))
    with pytest.raises(TypeError, match="causal"):
        flash_attn_func(q, k, v, causal="no")
    for name in ("deterministic", "return_attn_probs", "validate"):
        with pytest.raises(TypeError, match=name):
            flash_attn_func(q, k, v, **{name: "no"})


def test_seqused_k_larger_than_the_sequence_is_refused_and_smaller_is_used():
    fn, kw = _varlen()
    kw.pop("out")
    full = fn(**dict(kw, seqused_k=None))
    used = fn(**kw)  # sequence 1 keeps 3 of its 5 keys
    assert torch.equal(used[:3], full[:3]) and not torch.equal(used[3:], full[3:])
    refused_unchanged(fn, dict(kw, seqused_k=torch.tensor([4, 6], dtype=torch.int32)), ValueError, "seqused_k")


@pytest.mark.parametrize("gran", ["per_tensor", "per_head", "per_block"])
def test_quantize_qkv_refuses_non_finite_on_cpu(gran):
    q, k, v = (torch.randn(1, 32, h, 32, dtype=BF16) for h in (2, 1, 1))
    k[0, 5, 0, 3] = NAN
    k[0, 9, 0, 1] = INF
    with pytest.raises(ValueError, match=r"k: expected finite values, got 2 NaN/Inf") as ei:
        quantize_qkv(q, k, v, granularity=gran, block_size=16)
    assert "q:" not in str(ei.value)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("gran", ["per_tensor", "per_head", "per_block"])
def test_quantize_unchecked_non_finite_gives_nan_descale(gran, use_triton):
    """What a GPU call without validate does (the op itself, below the checks): the scale group holding a NaN or
    Inf gets a NaN descale, the others stay finite (Triton under the interpreter on CPU)."""
    from fp8attn import ops

    x = torch.randn(2, 32, 2, 16, dtype=BF16)
    x[1, 20, 1, 3] = INF if use_triton else NAN
    _, d = ops.OPS["quantize_fp8"](x, gran, 2, False, 0, 16, False, use_triton)
    nan = torch.isnan(d)
    if gran == "per_tensor":
        assert nan.all()
    elif gran == "per_head":
        assert nan[1, 1] and nan.sum() == 1
    else:  # (batch, heads, blocks of 16 tokens): token 20 is in block 1
        assert nan[1, 1, 1] and nan.sum() == 1
    assert torch.isfinite(d[~nan]).all()


def test_quantize_nan_descale_makes_attention_nan():
    """The damage is visible downstream: attention over a group with a NaN descale is NaN (the op below the API's
    descale value checks, as a GPU call without validate runs it), where the FP8 values alone showed nothing."""
    from fp8attn import ops

    k = torch.randn(1, 8, 1, 32, dtype=BF16)
    k[0, 2, 0, 0] = NAN
    k8, kd = ops.OPS["quantize_fp8"](k, "per_head", 1, False, 0, 64, False, False)
    q8 = torch.randn(1, 4, 1, 32).to(E4M3)
    one = torch.ones(1, 1)
    out, _ = ops.dense_fwd(
        q8,
        k8,
        k8,
        softmax_scale=0.2,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        q_descale=one,
        k_descale=kd,
        v_descale=kd,
    )
    assert torch.isnan(kd).all() and torch.isnan(out.float()).all()


def test_descales_describe_fp8_tensors_only():
    q, k, v = (torch.randn(1, 4, 2, 32, dtype=BF16) for _ in range(3))
    for name in ("q_descale", "k_descale", "v_descale"):
        with pytest.raises(ValueError, match=f"{name}: expected None for a torch.bfloat16 .* describes an FP8 tensor"):
            flash_attn_func(q, k, v, **{name: torch.ones(1, 2)})
    # a bf16 q over an FP8 cache still takes the cache's descales
    kc, vc = alloc_paged_cache(2, 4, 2, 32)
    kc.copy_(torch.randn(2, 4, 2, 32).to(E4M3))
    vc.copy_(torch.randn(2, 4, 2, 32).to(E4M3))
    pt = torch.tensor([[0, 1]], dtype=torch.int32)
    one = flash_attn_with_kvcache(q[:, :1], kc, vc, page_table=pt, cache_seqlens=8)
    half = flash_attn_with_kvcache(q[:, :1], kc, vc, page_table=pt, cache_seqlens=8, v_descale=torch.tensor(0.5))
    torch.testing.assert_close(half.float(), one.float() * 0.5, rtol=1e-2, atol=1e-2)


def test_no_raw_torch_error_from_helpers():
    """Allocation helpers refuse bad sizes and dtypes by name (they used to allocate, or raise from torch)."""
    for kw, exc, arg in (
        (dict(num_blocks=-1), ValueError, "num_blocks"),
        (dict(page_size=0), ValueError, "page_size"),
        (dict(dtype=torch.int8), TypeError, "dtype"),
        (dict(headdim=2.5), TypeError, "headdim"),
    ):
        args = {**dict(num_blocks=2, page_size=4, nheads_k=1, headdim=32), **kw}
        with pytest.raises(exc, match=arg):
            alloc_paged_cache(**args)
    with pytest.raises(ValueError, match="num_splits"):
        split_workspace(torch.empty(1, 1, 2, 32), 0, 32)


def test_messages_never_print_a_tensor():
    q, k, v = (torch.randn(1, 4, 2, 32, dtype=BF16) for _ in range(3))
    with pytest.raises(NotImplementedError) as ei:
        flash_attn_func(q, k, v, qv=torch.randn(1, 4, 2, 64))
    assert "tensor(" not in str(ei.value) and "(1, 4, 2, 64)" in str(ei.value)


def test_unchecked_bad_slots_are_skipped_by_the_kernel_and_the_torch_path():
    """Without value checks (a GPU call without validate) slots past the cache and tokens whose descale row does
    not exist are skipped, never written out of bounds: the launcher (interpreter on CPU) and the op's torch
    path, called directly below the API's checks."""
    from fp8attn.kernels.cache import launch_write_kv_cache
    from fp8attn.ops import _write_kv_cache_torch

    for write in (
        lambda *a, **kw: launch_write_kv_cache(*a, **kw),
        lambda k, v, kc, vc, s, **kw: _write_kv_cache_torch(
            k, v, kc, vc, s, kw["k_descale"], kw["v_descale"], kw["token_seq_idx"], None, None
        ),
    ):
        kc, vc = alloc_paged_cache(2, 4, 1, 16, poison_nan=True)
        k = torch.randn(4, 1, 16, dtype=BF16)
        d = torch.tensor([[0.5], [0.25]])
        slots = torch.tensor([1, 8, 3, 2])  # 8 = past the 2 x 4 slots
        seq = torch.tensor([0, 0, 2, 1], dtype=torch.int32)  # 2 = no such descale row
        write(k, k, kc, vc, slots, k_descale=d, v_descale=d, token_seq_idx=seq)
        written = ~torch.isnan(kc.float()).reshape(8, 16).all(dim=1)
        assert written.tolist() == [False, True, True, False, False, False, False, False]
        torch.testing.assert_close(kc.reshape(8, 16)[2].float() * 0.25, k[3, 0].float(), rtol=0.07, atol=0.02)


def test_unchecked_appends_past_the_capacity_get_no_slot():
    """slot_mapping_for (the append path's slots, computed on the device): positions outside a row's capacity,
    negative ones and padding rows give slot -1, which every writer skips."""
    from fp8attn.paged_cache import slot_mapping_for

    pt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    slots = slot_mapping_for(pt, 4, torch.tensor([0, 0, 1, 1, 2]), torch.tensor([5, 8, -1, 7, 0]))
    assert slots.tolist() == [1 * 4 + 1, -1, -1, 2 * 4 + 3, -1]


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_unchecked_values_never_write_out_of_bounds():
    """On a GPU without validate=True the value checks do not run (no sync); bad slots are skipped and a too-large
    seqused_k is clamped to the sequence (as the CPU reference does), and a NaN in quantize_qkv's input makes the
    group's descale NaN."""
    kc, vc = alloc_paged_cache(2, 4, 1, 16, poison_nan=True, device="cuda")
    k = torch.randn(3, 1, 16, dtype=BF16, device="cuda")
    write_kv_cache(
        k,
        k,
        kc,
        vc,
        torch.tensor([1, 8, 3], device="cuda"),
        k_descale=torch.tensor(0.5, device="cuda"),
        v_descale=torch.tensor(0.5, device="cuda"),
    )
    written = ~torch.isnan(kc.float()).reshape(8, 16).all(dim=1)
    assert written.cpu().tolist() == [False, True, False, True, False, False, False, False]
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(k, k, kc, vc, torch.tensor([1, 8, 3], device="cuda"), validate=True)

    fn, kw = _varlen()
    kw = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in kw.items() if n != "out"}
    clamped = fn(**dict(kw, seqused_k=torch.tensor([4, 9], dtype=torch.int32, device="cuda")))
    full = fn(**dict(kw, seqused_k=None))
    torch.testing.assert_close(clamped.float(), full.float())
    with pytest.raises(ValueError, match="seqused_k"):
        fn(**dict(kw, seqused_k=torch.tensor([4, 9], dtype=torch.int32, device="cuda")), validate=True)

    q, kk, v = (torch.randn(1, 64, 2, 64, dtype=BF16, device="cuda") for _ in range(3))
    kk[0, 3, 1, 5] = NAN
    _, _, _, qd, kd, vd = quantize_qkv(q, kk, v)
    assert torch.isnan(kd[0, 1]) and torch.isfinite(kd[0, 0]) and torch.isfinite(qd).all()
    with pytest.raises(ValueError, match="k: expected finite values, got 1 NaN/Inf"):
        quantize_qkv(q, kk, v, validate=True)
    assert not math.isnan(float(vd.sum()))
