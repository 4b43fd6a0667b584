"""The reference attention (fp8attn.reference) against an independent float64 oracle and hand-computed cases.

``helpers.naive_attention`` is the oracle, used by the CPU API tests too: a per-row loop in float64 that
shares no code with the library (it dequantizes, masks and normalizes one query row at a time).
"""

import math

import pytest
import torch

from fp8attn.quant import quantize
from fp8attn.reference import attention_ref, combine_ref, paged_attention_ref, varlen_attention_ref
from helpers import fp8_inputs, naive_attention

F64 = torch.float64
E4M3 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------------------------------
# The oracle
# ----------------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------------
# Oracle self-check: against an explicit softmax formula on a tiny case
# ----------------------------------------------------------------------------------------------------
def test_oracle_matches_softmax_formula():
    q, k, v = torch.randn(1, 3, 1, 8, dtype=F64), torch.randn(1, 4, 1, 8, dtype=F64), torch.randn(1, 4, 1, 8, dtype=F64)
    o, lse = naive_attention(q, k, v, softmax_scale=0.5)
    s = q[0, :, 0] @ k[0, :, 0].T * 0.5
    torch.testing.assert_close(o[0, :, 0], torch.softmax(s, -1) @ v[0, :, 0])
    torch.testing.assert_close(lse[0, 0], torch.logsumexp(s, -1))


# ----------------------------------------------------------------------------------------------------
# attention_ref vs the oracle
# ----------------------------------------------------------------------------------------------------
CASES = [
    # b, sq, sk, hq, hk, d, dv, causal, window, softcap
    (1, 1, 1, 1, 1, 16, 16, False, (-1, -1), 0.0),
    (2, 7, 13, 4, 2, 32, 32, True, (-1, -1), 0.0),
    (2, 13, 7, 3, 1, 16, 24, True, (-1, -1), 0.0),  # sq > sk: fully masked rows
    (1, 9, 9, 6, 2, 16, 16, False, (3, 1), 0.0),
    (2, 5, 11, 2, 2, 32, 16, True, (4, -1), 30.0),
    (1, 17, 17, 8, 1, 16, 16, False, (-1, -1), 5.0),  # MQA + softcap
    (1, 6, 10, 2, 1, 16, 16, False, (0, 0), 0.0),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"b{c[0]}q{c[1]}k{c[2]}h{c[3]}/{c[4]}d{c[5]}/{c[6]}c{int(c[7])}w{c[8]}s{c[9]}"
)
@pytest.mark.parametrize("cdt", [torch.float32, torch.float64])
def test_ref_fp32_fp64_vs_oracle(case, cdt):
    b, sq, sk, hq, hk, d, dv, causal, window, softcap = case
    q, k, v = torch.randn(b, sq, hq, d), torch.randn(b, sk, hk, d), torch.randn(b, sk, hk, dv)
    scale = 0.7 / math.sqrt(d)
    o, lse = attention_ref(
        q.to(cdt),
        k.to(cdt),
        v.to(cdt),
        softmax_scale=scale,
        causal=causal,
        window_size=window,
        softcap=softcap,
        compute_dtype=cdt,
        return_lse=True,
    )
    ro, rlse = naive_attention(q, k, v, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)
    tol = 1e-12 if cdt == F64 else 2e-6
    assert o.dtype == cdt and lse.dtype == torch.float32
    torch.testing.assert_close(o.to(F64), ro, atol=tol, rtol=tol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))
    fin = torch.isfinite(rlse)
    torch.testing.assert_close(lse[fin].to(F64), rlse[fin], atol=1e-5, rtol=1e-6)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("fmt", [E4M3, torch.float8_e5m2, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("causal", [False, True])
def test_ref_fp8_descaled_vs_oracle(fmt, causal):
    b, sq, sk, hq, hk, d = 2, 11, 19, 4, 2, 32
    q8, k8, v8, qd, kd, vd = fp8_inputs(b, sq, sk, hq, hk, d, fmt=fmt)
    ro, rlse = naive_attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    o, lse = attention_ref(
        q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True, out_dtype=torch.float32
    )
    torch.testing.assert_close(o.to(F64), ro, atol=2e-5, rtol=1e-5)
    fin = torch.isfinite(rlse)
    torch.testing.assert_close(lse[fin].to(F64), rlse[fin], atol=1e-4, rtol=1e-5)
    # Default output dtype for FP8 inputs is bf16.
    assert attention_ref(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd).dtype == torch.bfloat16


def test_ref_seqlens_padding_ignores_nan_padding():
    b, sq, sk, h, d = 3, 6, 9, 2, 16
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, h, d), torch.randn(b, sk, h, d)
    lq, lk = torch.tensor([6, 2, 0]), torch.tensor([9, 0, 4])
    for bi in range(b):  # poison the padding
        q[bi, lq[bi] :] = float("nan")
        k[bi, lk[bi] :] = float("nan")
        v[bi, lk[bi] :] = float("nan")
    o, lse = attention_ref(q, k, v, seqlens_q=lq, seqlens_k=lk, causal=True, return_lse=True)
    ro, rlse = naive_attention(q, k, v, seqlens_q=lq, seqlens_k=lk, causal=True)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.to(F64), ro, atol=2e-6, rtol=1e-5)
    assert (o[1] == 0).all()  # no keys
    assert torch.isneginf(lse[1]).all()


def test_ref_token_descales_vs_oracle():
    b, sk, hk, d = 2, 12, 2, 16
    q = torch.randn(b, 3, 4, d).to(torch.bfloat16)
    k, v = torch.randn(b, sk, hk, d), torch.randn(b, sk, hk, d)
    k8, ks = quantize(k, "per_token_head")
    v8, vs = quantize(v, "per_token_head")
    o = attention_ref(q, k8, v8, k_token_descale=ks, v_token_descale=vs, causal=True, out_dtype=torch.float32)
    ro, _ = naive_attention(q, k8, v8, k_token_descale=ks, v_token_descale=vs, causal=True)
    torch.testing.assert_close(o.to(F64), ro, atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Hand-computed cases
# ----------------------------------------------------------------------------------------------------
def test_hand_one_query_two_keys_fp8():
    # q = 1.0 * 0.5, k0 = (2.0, 0) * 0.25 -> dequantized k0 = (0.5, 0), k1 = 0. scale = 4:
    # s0 = 4 * 0.5 * 0.5 = 1, s1 = 0  ->  p = (e, 1) / (e + 1); v0 = 3 * 2, v1 = -1 * 2 (v_descale 2).
    q8 = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2).to(E4M3)
    k8 = torch.tensor([[2.0, 0.0], [0.0, 0.0]]).view(1, 2, 1, 2).to(E4M3)
    v8 = torch.tensor([[3.0, 1.0], [-1.0, 1.0]]).view(1, 2, 1, 2).to(E4M3)
    one = lambda x: torch.tensor([[x]], dtype=torch.float32)
    o, lse = attention_ref(
        q8,
        k8,
        v8,
        softmax_scale=4.0,
        q_descale=one(0.5),
        k_descale=one(0.25),
        v_descale=one(2.0),
        out_dtype=torch.float32,
        return_lse=True,
    )
    e = math.e
    expect0 = (3 * e - 1) / (e + 1) * 2
    assert o[0, 0, 0, 0].item() == pytest.approx(expect0, rel=1e-6)
    assert o[0, 0, 0, 1].item() == pytest.approx(2.0, rel=1e-6)
    assert lse[0, 0, 0].item() == pytest.approx(math.log(e + 1), rel=1e-6)


def test_hand_quantize_p_rounding():
    # s0 = c, s1 = 0 with c = ln(1/0.3): p = (1, 0.3). P * 256 = (256, 76.8); e4m3 spacing in [64, 128)
    # is 8, so 76.8 -> 80 and the quantized p1 is 80/256 = 0.3125. The row sum keeps the exact 1.3.
    c = math.log(1 / 0.3)
    q = torch.tensor([1.0]).view(1, 1, 1, 1).expand(1, 1, 1, 16).contiguous() / 4.0
    k = torch.zeros(1, 2, 1, 16)
    k[0, 0, 0, :] = 0.25
    v = torch.zeros(1, 2, 1, 16)
    v[0, 1, 0, :] = 1.0
    scale = c / (16 * 0.25 * 0.25)
    exact = attention_ref(q, k, v, softmax_scale=scale)[0, 0, 0, 0].item()
    emul = attention_ref(q, k, v, softmax_scale=scale, quantize_p=True)[0, 0, 0, 0].item()
    assert exact == pytest.approx(0.3 / 1.3, rel=1e-5)
    assert emul == pytest.approx(0.3125 / 1.3, rel=1e-5)
    # p0 = 1 -> 256 is exact in e4m3: quantizing P does not change a one-hot row.
    v2 = torch.zeros(1, 2, 1, 16)
    v2[0, 0, 0, :] = 1.0
    assert attention_ref(q, k, v2, softmax_scale=scale, quantize_p=True)[0, 0, 0, 0].item() == pytest.approx(
        1 / 1.3, rel=1e-5
    )


def test_quantize_p_matches_manual_emulation():
    b, sq, sk, h, d = 1, 5, 33, 2, 16
    q, k, v = torch.randn(b, sq, h, d) * 2, torch.randn(b, sk, h, d), torch.randn(b, sk, h, d)
    o = attention_ref(q.double(), k.double(), v.double(), quantize_p=True, causal=True, compute_dtype=F64)
    # manual: per row p = exp(s - max), pq = e4m3(p * 256) / 256, out = pq @ v / sum(p)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(d)
    mask = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    pq = (p * 256).float().clamp(-448, 448).to(E4M3).double() / 256
    ref = torch.einsum("bhqk,bkhd->bqhd", pq, v.double()) / p.sum(-1).permute(0, 2, 1)[..., None]
    torch.testing.assert_close(o, ref, atol=1e-12, rtol=1e-12)
    # and the emulation error is visible but bounded (e4m3 has a 2^-4 relative step)
    exact = attention_ref(q.double(), k.double(), v.double(), causal=True, compute_dtype=F64)
    err = (o - exact).abs().max().item()
    assert 0 < err < 0.1 * v.abs().max().item()


def test_out_scale_fused_equals_quantized_output():
    q8, k8, v8, qd, kd, vd = fp8_inputs(2, 9, 14, 4, 2, 32)
    osc = torch.tensor(0.01)
    o = attention_ref(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float32, causal=True)
    of = attention_ref(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, out_scale=osc, causal=True)
    assert of.dtype == E4M3
    expect = (o / osc).clamp(-448, 448).to(E4M3)
    assert torch.equal(of.view(torch.uint8), expect.view(torch.uint8))
    # saturation: a tiny out_scale clamps to +-448 instead of overflowing to NaN
    sat = attention_ref(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, out_scale=torch.tensor(1e-6))
    assert not torch.isnan(sat.float()).any() and sat.float().abs().max().item() == 448.0


def test_fully_masked_rows_zero_and_neg_inf():
    q, k, v = torch.randn(1, 8, 2, 16), torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16)
    for kw in (dict(causal=True), dict(window_size=(0, 0)), dict(window_size=(1, 0))):
        o, lse = attention_ref(q, k, v, return_lse=True, **kw)
        assert not torch.isnan(o).any() and not torch.isnan(lse).any()
        # queries 0..4 have i + sk - sq < 0: they see nothing
        assert (o[0, :5] == 0).all() and torch.isneginf(lse[0, :, :5]).all()
        assert torch.isfinite(lse[0, :, 5:]).all()
    # quantize_p and fp64 on the same fully masked rows
    o = attention_ref(q, k, v, causal=True, quantize_p=True, compute_dtype=F64)
    assert not torch.isnan(o).any() and (o[0, :5] == 0).all()


def test_varlen_ref_equals_per_sequence():
    lq, lk = [3, 0, 5, 1], [4, 2, 0, 7]
    hq, hk, d = 4, 2, 16
    q, k, v = torch.randn(sum(lq), hq, d), torch.randn(sum(lk), hk, d), torch.randn(sum(lk), hk, d)
    cq = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    ck = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    o, lse = varlen_attention_ref(q, k, v, cq, ck, max(lq), max(lk), causal=True, return_lse=True)
    assert o.shape == (sum(lq), hq, d) and lse.shape == (hq, sum(lq))
    for bi in range(4):
        qs, ks = slice(int(cq[bi]), int(cq[bi + 1])), slice(int(ck[bi]), int(ck[bi + 1]))
        if lq[bi] == 0:
            continue
        ro, rlse = naive_attention(q[None, qs], k[None, ks], v[None, ks], causal=True)
        torch.testing.assert_close(o[qs].to(F64), ro[0], atol=2e-6, rtol=1e-5)
        assert torch.equal(torch.isneginf(lse[:, qs]), torch.isneginf(rlse[0]))


def test_paged_ref_equals_dense_ref():
    ps, hk, d = 4, 2, 16
    lens = [5, 0, 9]
    kd = torch.randn(3, 9, hk, d)
    vd = torch.randn(3, 9, hk, d)
    k_cache = torch.full((12, ps, hk, d), float("nan"))
    v_cache = torch.full((12, ps, hk, d), float("nan"))
    perm = torch.randperm(12)
    pt = torch.full((3, 3), -1, dtype=torch.int32)
    at = 0
    for bi, n in enumerate(lens):
        for pg in range((n + ps - 1) // ps):
            pt[bi, pg] = int(perm[at])
            at += 1
        for t in range(n):
            k_cache[pt[bi, t // ps], t % ps] = kd[bi, t]
            v_cache[pt[bi, t // ps], t % ps] = vd[bi, t]
    q = torch.randn(3, 2, 4, d)
    cs = torch.tensor(lens, dtype=torch.int32)
    o, lse = paged_attention_ref(q, k_cache, v_cache, pt, cs, causal=True, return_lse=True)
    ro, rlse = naive_attention(q, kd, vd, seqlens_k=cs, causal=True)
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o.to(F64), ro, atol=2e-6, rtol=1e-5)
    assert torch.isneginf(lse[1]).all() and (o[1] == 0).all()


def test_combine_ref_hand_case():
    # two splits for one row: lse = log(1), log(3) -> weights 1/4, 3/4; combined lse = log(4)
    op = torch.tensor([[[[[2.0, 0.0]]]], [[[[6.0, 4.0]]]]])  # (2, 1, 1, 1, 2)
    lp = torch.tensor([[[[0.0]]], [[[math.log(3)]]]])
    o, lse = combine_ref(op, lp)
    torch.testing.assert_close(o[0, 0, 0], torch.tensor([0.5 + 4.5, 3.0]))
    assert lse.item() == pytest.approx(math.log(4))
    # an empty split (-inf) with NaN partials is ignored; an all-empty row is (0, -inf)
    op2 = torch.cat([op, torch.full_like(op[:1], float("nan"))])
    lp2 = torch.cat([lp, torch.full_like(lp[:1], float("-inf"))])
    o2, lse2 = combine_ref(op2, lp2)
    torch.testing.assert_close(o2, o)
    o3, lse3 = combine_ref(torch.full_like(op2, float("nan")), torch.full_like(lp2, float("-inf")))
    assert (o3 == 0).all() and torch.isneginf(lse3).all()
