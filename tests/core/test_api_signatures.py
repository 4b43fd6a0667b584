"""Signature parity with FlashAttention-3's flash_attn_interface (docs/design.md, API conventions).

FA3's parameters must come first, with the same names, order, kinds and defaults; every extension is
keyword-only and comes after them.
"""

import inspect

import pytest
import torch

import fp8attn
from fp8attn import interface

_E = inspect.Parameter.empty

FA3 = {
    "flash_attn_func": [
        ("q", _E),
        ("k", _E),
        ("v", _E),
        ("softmax_scale", None),
        ("causal", False),
        ("qv", None),
        ("q_descale", None),
        ("k_descale", None),
        ("v_descale", None),
        ("window_size", (-1, -1)),
        ("attention_chunk", 0),
        ("softcap", 0.0),
        ("num_splits", 1),
        ("pack_gqa", None),
        ("deterministic", False),
        ("sm_margin", 0),
        ("return_attn_probs", False),
    ],
    "flash_attn_varlen_func": [
        ("q", _E),
        ("k", _E),
        ("v", _E),
        ("cu_seqlens_q", _E),
        ("cu_seqlens_k", _E),
        ("max_seqlen_q", _E),
        ("max_seqlen_k", _E),
        ("seqused_q", None),
        ("seqused_k", None),
        ("softmax_scale", None),
        ("causal", False),
        ("qv", None),
        ("q_descale", None),
        ("k_descale", None),
        ("v_descale", None),
        ("window_size", (-1, -1)),
        ("attention_chunk", 0),
        ("softcap", 0.0),
        ("num_splits", 1),
        ("pack_gqa", None),
        ("deterministic", False),
        ("sm_margin", 0),
        ("return_attn_probs", False),
    ],
    "flash_attn_with_kvcache": [
        ("q", _E),
        ("k_cache", _E),
        ("v_cache", _E),
        ("k", None),
        ("v", None),
        ("qv", None),
        ("rotary_cos", None),
        ("rotary_sin", None),
        ("cache_seqlens", None),
        ("cache_batch_idx", None),
        ("cache_leftpad", None),
        ("page_table", None),
        ("cu_seqlens_q", None),
        ("cu_seqlens_k_new", None),
        ("max_seqlen_q", None),
        ("rotary_seqlens", None),
        ("q_descale", None),
        ("k_descale", None),
        ("v_descale", None),
        ("softmax_scale", None),
        ("causal", False),
        ("window_size", (-1, -1)),
        ("attention_chunk", 0),
        ("softcap", 0.0),
        ("rotary_interleaved", True),
        ("scheduler_metadata", None),
        ("num_splits", 0),
        ("pack_gqa", None),
        ("sm_margin", 0),
        ("return_softmax_lse", False),
    ],
    "flash_attn_combine": [("out_partial", _E), ("lse_partial", _E), ("out", None), ("out_dtype", None)],
    "flash_attn_qkvpacked_func": [
        ("qkv", _E),
        ("softmax_scale", None),
        ("causal", False),
        ("q_descale", None),
        ("k_descale", None),
        ("v_descale", None),
        ("window_size", (-1, -1)),
        ("attention_chunk", 0),
        ("softcap", 0.0),
        ("deterministic", False),
        ("num_heads_q", None),
        ("sm_margin", 0),
        ("return_attn_probs", False),
    ],
    "get_scheduler_metadata": [
        ("batch_size", _E),
        ("max_seqlen_q", _E),
        ("max_seqlen_k", _E),
        ("num_heads_q", _E),
        ("num_heads_kv", _E),
        ("headdim", _E),
        ("cache_seqlens", _E),
        ("qkv_dtype", torch.bfloat16),
        ("headdim_v", None),
        ("cu_seqlens_q", None),
        ("cu_seqlens_k_new", None),
        ("cache_leftpad", None),
        ("page_size", None),
        ("max_seqlen_k_new", 0),
        ("causal", False),
        ("window_size", (-1, -1)),
        ("attention_chunk", 0),
        ("has_softcap", False),
        ("num_splits", 0),
        ("pack_gqa", None),
        ("sm_margin", 0),
    ],
}

# Extensions the API promises (docs/design.md, API conventions); each must be keyword-only.
EXTENSIONS = {
    "flash_attn_func": {"out", "out_dtype", "out_scale", "fp8_backward"},
    "flash_attn_varlen_func": {"out", "out_dtype", "out_scale", "fp8_backward"},
    "flash_attn_with_kvcache": {"out", "out_dtype", "out_scale", "k_cache_scales", "v_cache_scales"},
    "flash_attn_combine": set(),
    "flash_attn_qkvpacked_func": {"out", "out_dtype", "out_scale", "fp8_backward"},
    "get_scheduler_metadata": set(),
}

# fp8attn.attention, the training entry (integrations call exactly this): q, k, v positional, the rest
# keyword-only with these defaults.
ATTENTION = [
    ("causal", False),
    ("softmax_scale", None),
    ("window_size", (-1, -1)),
    ("softcap", 0.0),
    ("granularity", "per_head"),
    ("hadamard", False),
    ("fp8_backward", None),
    ("deterministic", False),
    ("cu_seqlens_q", None),
    ("cu_seqlens_k", None),
    ("max_seqlen_q", None),
    ("max_seqlen_k", None),
    ("return_lse", False),
]


def test_attention_signature_pinned():
    params = list(inspect.signature(fp8attn.attention).parameters.values())
    assert [(p.name, p.kind) for p in params[:3]] == [(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in "qkv"]
    assert [(p.name, p.default) for p in params[3:]] == ATTENTION
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in params[3:])
    assert {"attention", "set_fp8_backward", "get_fp8_backward"} <= set(fp8attn.__all__)


@pytest.mark.parametrize("name", sorted(FA3))
def test_fa3_parameters_names_order_defaults(name):
    params = list(inspect.signature(getattr(fp8attn, name)).parameters.values())
    expected = FA3[name]
    got = [(p.name, p.default) for p in params[: len(expected)]]
    assert [n for n, _ in got] == [n for n, _ in expected], f"{name}: FA3 parameter names/order differ"
    for (n, d), (_en, ed) in zip(got, expected):
        if ed is _E:
            assert d is _E, f"{name}.{n}: FA3 has no default, got {d!r}"
        else:
            assert d == ed and type(d) is type(ed), f"{name}.{n}: default {d!r} != FA3's {ed!r}"
    for p in params[: len(expected)]:
        assert p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{name}.{p.name} must be positional-or-keyword"


@pytest.mark.parametrize("name", sorted(FA3))
def test_extensions_are_keyword_only_after_fa3(name):
    params = list(inspect.signature(getattr(fp8attn, name)).parameters.values())
    extra = params[len(FA3[name]) :]
    for p in extra:
        assert p.kind == inspect.Parameter.KEYWORD_ONLY, f"{name}.{p.name}: extensions must be keyword-only"
        assert p.default is not _E, f"{name}.{p.name}: an extension needs a default"
    assert EXTENSIONS[name] <= {p.name for p in extra}, f"{name}: missing extensions"
    assert not any(p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for p in params), (
        f"{name}: *args/**kwargs would swallow misspelled arguments"
    )


@pytest.mark.parametrize("name", sorted(FA3))
def test_reexported_from_interface(name):
    assert getattr(fp8attn, name) is getattr(interface, name)
    assert name in fp8attn.__all__
    doc = getattr(fp8attn, name).__doc__ or ""
    assert "Parameters" in doc and "----------" in doc  # numpy-style docstring


def test_fa3_positional_call_order():
    """Positional calls in FA3 order land on the right parameters (causal is the 5th positional)."""
    import torch

    q = torch.randn(1, 4, 1, 16)
    k = torch.randn(1, 6, 1, 16)
    v = torch.randn(1, 6, 1, 16)
    a = fp8attn.flash_attn_func(q, k, v, 0.3, True)
    b = fp8attn.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True)
    assert torch.equal(a, b)
    c = fp8attn.flash_attn_func(q, k, v, 0.3, False)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("name", sorted(FA3))
def test_docstring_documents_every_parameter(name):
    """Each parameter is described (or the docstring defers to flash_attn_func, which describes it)."""
    import re

    fn = getattr(fp8attn, name)
    doc = fn.__doc__
    assert "Returns" in doc, f"{name}: no Returns section"
    covered = doc
    if "flash_attn_func" in doc and name != "flash_attn_func":
        covered += fp8attn.flash_attn_func.__doc__
    missing = [p for p in inspect.signature(fn).parameters if not re.search(rf"\b{p}\b", covered)]
    assert not missing, f"{name}: undocumented parameters {missing}"
