"""cache_leftpad (FA3 semantics) in flash_attn_with_kvcache: a left-padded contiguous cache row is the same
sequence as that row shifted left by its pad, with rotary positions kept absolute."""

import pytest
import torch

import fp8attn
from helpers import raises_naming

E4M3 = torch.float8_e4m3fn
B, S, H, HK, D = 3, 48, 4, 2, 64


def _rotary_tables(n, rd):
    inv = 1.0 / 10000.0 ** (torch.arange(0, rd, 2).float() / rd)
    ang = torch.arange(n).float()[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def _case(g, device, cache_dtype, rows):
    kc = torch.randn(rows, S, HK, D, generator=g)
    vc = torch.randn(rows, S, HK, D, generator=g)
    if cache_dtype == E4M3:
        kc, vc = (kc / 2).to(E4M3), (vc / 3).to(E4M3)
    else:
        kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    return kc.to(device), vc.to(device)


def _shifted(c, idx, pad):
    """Each batch entry's cache row moved left by its pad (the oracle's cache, padding dropped)."""
    out = torch.zeros_like(c)
    for _b, (r, p) in enumerate(zip(idx.tolist(), pad.tolist())):
        out[r, : S - p] = c[r, p:]
    return out


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, E4M3])
@pytest.mark.parametrize("append,rotary", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("batch_idx", [False, True])
def test_leftpad_equals_the_shifted_cache(cache_dtype, append, rotary, batch_idx, device="cpu"):
    g = torch.Generator().manual_seed(5)
    rows = B + 2 if batch_idx else B
    kc, vc = _case(g, device, cache_dtype, rows)
    idx = torch.tensor([3, 0, 4], dtype=torch.int32) if batch_idx else torch.arange(B, dtype=torch.int32)
    pad = torch.tensor([0, 7, 20], dtype=torch.int32)
    cs = torch.tensor([9, 25, 20], dtype=torch.int32)  # the last row: everything cached so far is pad
    sq = 3 if append else 2
    q = torch.randn(B, sq, H, D, generator=g).bfloat16().to(device)
    kw = dict(causal=True, return_softmax_lse=True)
    if cache_dtype == E4M3:
        kw.update(
            k_descale=(torch.rand(B, HK, generator=g) + 0.5).to(device),
            v_descale=(torch.rand(B, HK, generator=g) + 0.5).to(device),
        )
    if batch_idx:
        kw["cache_batch_idx"] = idx.to(device)
    if append:
        kw.update(
            k=torch.randn(B, sq, HK, D, generator=g).bfloat16().to(device),
            v=torch.randn(B, sq, HK, D, generator=g).bfloat16().to(device),
        )
    if rotary:
        kw["rotary_cos"], kw["rotary_sin"] = (t.to(device) for t in _rotary_tables(S, 32))
    ks, vs = _shifted(kc, idx, pad), _shifted(vc, idx, pad)
    poisoned = [c.clone() for c in (kc, vc)]
    for c in poisoned:  # the pad is never read
        for r, p in zip(idx.tolist(), pad.tolist()):
            c[r, :p] = float("nan") if c.dtype != E4M3 else torch.tensor(float("nan")).to(E4M3)
    kp, vp = poisoned
    out, lse = fp8attn.flash_attn_with_kvcache(
        q, kp, vp, cache_seqlens=cs.to(device), cache_leftpad=pad.to(device), **kw
    )
    extra = {"rotary_seqlens": cs.to(device)} if rotary else {}  # positions stay the absolute rows
    ref, ref_lse = fp8attn.flash_attn_with_kvcache(q, ks, vs, cache_seqlens=(cs - pad).to(device), **kw, **extra)
    assert not torch.isnan(out).any()
    if device == "cpu":  # the same reference computation on the same keys
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    else:  # one-token pages vs one page per row: other tiles on the Triton kernel, the same math
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-3)
    if append:  # the new tokens land right after each sequence's cached tokens, at absolute rows
        for _b, (r, p, c) in enumerate(zip(idx.tolist(), pad.tolist(), cs.tolist())):
            for got, want in ((kp, ks), (vp, vs)):
                assert torch.equal(
                    got[r, c : c + sq].view(torch.uint8) if got.dtype == E4M3 else got[r, c : c + sq],
                    want[r, c - p : c - p + sq].view(torch.uint8)
                    if want.dtype == E4M3
                    else want[r, c - p : c - p + sq],
                )


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, E4M3])
@pytest.mark.parametrize("append,rotary", [(False, False), (True, True)])
def test_gpu_leftpad_equals_the_shifted_cache(cache_dtype, append, rotary):
    test_leftpad_equals_the_shifted_cache(cache_dtype, append, rotary, batch_idx=True, device="cuda")


def _call(**kw):
    kc = torch.zeros(B, S, HK, D, dtype=torch.bfloat16)
    args = dict(
        cache_seqlens=torch.tensor([9, 25, 20], dtype=torch.int32),
        cache_leftpad=torch.tensor([0, 7, 20], dtype=torch.int32),
    )
    args.update(kw)
    q = args.pop("q", torch.zeros(B, 1, H, D, dtype=torch.bfloat16))
    return fp8attn.flash_attn_with_kvcache(q, args.pop("k_cache", kc), args.pop("v_cache", kc.clone()), **args)


def test_leftpad_bad_inputs_name_the_argument():
    raises_naming(
        ValueError, "cache_leftpad", _call, cache_leftpad=torch.tensor([0, 26, 0], dtype=torch.int32)
    )  # > cache_seqlens
    raises_naming(ValueError, "cache_leftpad", _call, cache_leftpad=torch.tensor([-1, 0, 0], dtype=torch.int32))
    raises_naming(ValueError, "cache_leftpad", _call, cache_leftpad=torch.tensor([0, 0], dtype=torch.int32))
    raises_naming(TypeError, "cache_leftpad", _call, cache_leftpad=torch.tensor([0, 0, 0], dtype=torch.int64))
    rows_apart = torch.zeros(B, 2 * S, HK, D, dtype=torch.bfloat16)[:, :S]  # rows not one token run
    raises_naming(ValueError, "k_cache", _call, k_cache=rows_apart, v_cache=rows_apart.clone())
    raises_naming(
        ValueError,
        "cache_seqlens",
        _call,
        k=torch.zeros(B, 30, HK, D, dtype=torch.bfloat16),
        v=torch.zeros(B, 30, HK, D, dtype=torch.bfloat16),
        q=torch.zeros(B, 30, H, D, dtype=torch.bfloat16),
    )
    pt = torch.zeros(B, 1, dtype=torch.int32)
    pages = torch.zeros(4, S, HK, D, dtype=torch.bfloat16)
    raises_naming(NotImplementedError, "cache_leftpad", _call, page_table=pt, k_cache=pages, v_cache=pages.clone())
