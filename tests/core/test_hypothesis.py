"""Property-based tests over shapes and lengths on the CPU (reference) path.

The "ci" hypothesis profile (conftest) is derandomized; examples per test are kept modest.
"""

import pytest
import torch

hyp = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fp8attn import flash_attn_combine, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402
from fp8attn.quant import dequantize, quantize, saturating_cast  # noqa: E402
from helpers import assert_close_fa3, naive_attention  # noqa: E402

E4M3 = torch.float8_e4m3fn
HEADS = st.sampled_from([(1, 1), (2, 1), (3, 3), (4, 2), (6, 2), (8, 1)])
WINDOWS = st.sampled_from([(-1, -1), (0, 0), (3, 0), (2, 5), (-1, 2), (6, -1)])


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=4),
    heads=HEADS,
    causal=st.booleans(),
    window=WINDOWS,
    fp8=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_varlen_equals_per_sequence_dense(lens, heads, causal, window, fp8, seed):
    g = _gen(seed)
    hq, hk = heads
    d = 16
    lq, lk = [a for a, _ in lens], [c for _, c in lens]
    b = len(lens)
    q = torch.randn(sum(lq), hq, d, generator=g)
    k = torch.randn(sum(lk), hk, d, generator=g)
    v = torch.randn(sum(lk), hk, d, generator=g)
    ds = {}
    if fp8:
        (q, qd), (k, kd), (v, vd) = (quantize(t, "per_tensor") for t in (q, k, v))
        ds = dict(
            q_descale=qd.reshape(1, 1) * (0.5 + torch.rand(b, hk, generator=g)),
            k_descale=kd.reshape(1, 1).expand(b, hk).contiguous(),
            v_descale=vd.reshape(1, 1) * (0.5 + torch.rand(b, 1, generator=g)),
        )
    else:
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    out, lse = flash_attn_varlen_func(
        q, k, v, cq, ck, max(lq), max(lk), causal=causal, window_size=window, return_attn_probs=True, **ds
    )
    assert out.shape == (sum(lq), hq, d) and lse.shape == (hq, sum(lq))
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
    for i in range(b):
        if lq[i] == 0:
            continue
        qs, ks = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        dsi = {n: (t[i : i + 1] if t.shape[0] == b else t) for n, t in ds.items()}
        if lk[i] == 0:
            assert (out[qs].float() == 0).all() and torch.isneginf(lse[:, qs]).all()
            continue
        od, ld = flash_attn_func(
            q[None, qs], k[None, ks], v[None, ks], causal=causal, window_size=window, return_attn_probs=True, **dsi
        )
        torch.testing.assert_close(out[qs].float(), od[0].float(), atol=1e-2, rtol=1e-2)
        assert torch.equal(torch.isneginf(lse[:, qs]), torch.isneginf(ld[0]))
        # baseline: P rounded as the dense kernel rounds it (e4m3 for FP8 inputs, bf16 for bf16 ones)
        ref, ref_lse, lowp = naive_attention(
            q[None, qs],
            k[None, ks],
            v[None, ks],
            causal=causal,
            window_size=window,
            p_round="e4m3" if fp8 else torch.bfloat16,
            **dsi,
        )
        assert_close_fa3(out[None, qs].float(), ref, lowp.to(out.dtype).float())


@settings(max_examples=30, deadline=None)
@given(
    lens=st.lists(st.integers(0, 70), min_size=1, max_size=4),
    ps=st.sampled_from([1, 4, 16, 64]),
    sq=st.integers(1, 5),
    heads=HEADS,
    causal=st.booleans(),
    window=WINDOWS,
    seed=st.integers(0, 2**16),
)
def test_paged_equals_dense(lens, ps, sq, heads, causal, window, seed):
    g = _gen(seed)
    hq, hk = heads
    d = 16
    b, L = len(lens), max(max(lens), 1)
    k8, kd = quantize(torch.randn(b, L, hk, d, generator=g), "per_head")
    v8, vd = quantize(torch.randn(b, L, hk, d, generator=g), "per_head")
    need = [(n + ps - 1) // ps for n in lens]
    nblocks = max(3 * sum(need), 1)
    perm = torch.randperm(nblocks, generator=g)
    pt = torch.full((b, max(max(need), 1)), -1, dtype=torch.int32)
    kc = torch.full((nblocks, ps, hk, d), 0x7F, dtype=torch.uint8).view(E4M3)  # NaN everywhere
    vc = kc.clone()
    at = 0
    for i, n in enumerate(lens):
        pt[i, : need[i]] = perm[at : at + need[i]].int()
        at += need[i]
        for t in range(n):
            kc.view(torch.uint8)[pt[i, t // ps], t % ps] = k8.view(torch.uint8)[i, t]
            vc.view(torch.uint8)[pt[i, t // ps], t % ps] = v8.view(torch.uint8)[i, t]
    q = torch.randn(b, sq, hq, d, generator=g).bfloat16()
    cs = torch.tensor(lens, dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(
        q,
        kc,
        vc,
        cache_seqlens=cs,
        page_table=pt,
        k_descale=kd,
        v_descale=vd,
        causal=causal,
        window_size=window,
        return_softmax_lse=True,
    )
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
    # baseline: bf16 Q over the e4m3 cache multiplies in fp16 (P rounded to fp16)
    ref, ref_lse, lowp = naive_attention(
        q,
        k8,
        v8,
        seqlens_q=torch.full((b,), sq),
        seqlens_k=cs,
        causal=causal,
        window_size=window,
        k_descale=kd,
        v_descale=vd,
        p_round=torch.float16,
    )
    assert_close_fa3(out.float(), ref, lowp.to(out.dtype).float())
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 2),
    sq=st.integers(1, 24),
    sk=st.integers(1, 24),
    heads=HEADS,
    dims=st.sampled_from([(16, 16), (32, 16), (8, 24)]),
    causal=st.booleans(),
    window=WINDOWS,
    softcap=st.sampled_from([0.0, 1.5, 20.0]),
    seed=st.integers(0, 2**16),
)
def test_reference_vs_oracle(b, sq, sk, heads, dims, causal, window, softcap, seed):
    from fp8attn.reference import attention_ref

    g = _gen(seed)
    hq, hk = heads
    d, dv = dims
    q = torch.randn(b, sq, hq, d, generator=g) * 2
    k = torch.randn(b, sk, hk, d, generator=g)
    v = torch.randn(b, sk, hk, dv, generator=g)
    o, lse = attention_ref(q, k, v, causal=causal, window_size=window, softcap=softcap, return_lse=True)
    ref, ref_lse = naive_attention(q, k, v, causal=causal, window_size=window, softcap=softcap)
    torch.testing.assert_close(o.double(), ref, atol=3e-6, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(sk=st.integers(1, 40), cuts=st.lists(st.integers(0, 40), max_size=4), seed=st.integers(0, 2**16))
def test_combine_splits_equals_unsplit(sk, cuts, seed):
    g = _gen(seed)
    q = torch.randn(1, 3, 2, 16, generator=g)
    k = torch.randn(1, sk, 1, 16, generator=g)
    v = torch.randn(1, sk, 1, 16, generator=g)
    bounds = [0] + sorted(min(c, sk) for c in cuts) + [sk]  # repeated cuts give empty splits
    outs, lses = [], []
    for a, c in zip(bounds[:-1], bounds[1:]):
        if a == c:
            outs.append(torch.full((1, 3, 2, 16), float("nan")))
            lses.append(torch.full((1, 3, 2), float("-inf")))
            continue
        o, lse = flash_attn_func(q, k[:, a:c], v[:, a:c], return_attn_probs=True)
        outs.append(o)
        lses.append(lse.transpose(1, 2))
    out, lse = flash_attn_combine(torch.stack(outs), torch.stack(lses).contiguous())
    ref, ref_lse = naive_attention(q, k, v)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse.transpose(1, 2), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 40), st.integers(1, 3), st.sampled_from([8, 16])),
    gran=st.sampled_from(["per_tensor", "per_head", "per_sequence", "per_token_head", "per_block"]),
    fmt=st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz]),
    log_mag=st.floats(-12, 12),
    seed=st.integers(0, 2**16),
)
def test_quant_round_trip_property(shape, gran, fmt, log_mag, seed):
    g = _gen(seed)
    x = torch.randn(shape, generator=g) * (2.0**log_mag)
    x8, d = quantize(x, gran, fmt, block_size=8)
    assert (d > 0).all() and torch.isfinite(d).all()
    y = dequantize(x8, d, gran, block_size=8)
    half_ulp = 2.0**-3 if fmt == torch.float8_e5m2 else 2.0**-4
    sub = {torch.float8_e4m3fn: 2.0**-10, torch.float8_e5m2: 2.0**-17, torch.float8_e4m3fnuz: 2.0**-11}[fmt]
    from fp8attn.quant import _broadcast

    db = _broadcast(d, x.shape, gran, 8)
    assert ((y - x).abs() <= half_ulp * x.abs() + sub * db * 1.001).all()
    # saturating_cast is idempotent on representable values
    assert torch.equal(saturating_cast(x8.float(), fmt).view(torch.uint8), x8.view(torch.uint8))
