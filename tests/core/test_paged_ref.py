"""Paged KV caches on the CPU path: paged == dense, appends (chunked prefill, mixed batches), scale
granularities, write_kv_cache, flash_attn_combine.

Every paged cache is NaN-poisoned (e4m3fn NaN byte 0x7f) outside the written slots, page tables are
random permutations of a pool 3x larger than needed, and unused table entries hold -1.
"""

import math

import pytest
import torch

from fp8attn import flash_attn_combine, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, write_kv_cache
from fp8attn.paged_cache import slot_mapping_for, to_v_seq_major
from fp8attn.quant import quantize, saturating_cast
from helpers import (
    check_vs_oracle,
    fp8_inputs,
    naive_attention,
    page_table_3x,
    poisoned_cache,
    rand_descale,
    scatter_dense,
)

E4M3 = torch.float8_e4m3fn


def gather_dense(cache, pt, b, n):
    ps = cache.shape[1]
    rows = [cache[int(pt[b, t // ps]), t % ps] for t in range(n)]
    return torch.stack(rows)[None] if rows else cache[:0, 0][None]


# ------------------------------------------------------------------------------------ paged == dense
@pytest.mark.parametrize("ps", [1, 16, 64, 256])
@pytest.mark.parametrize("qkind", ["bf16", "fp8"])
def test_paged_equals_dense(ps, qkind):
    lens = [0, 1, 37, 300]
    b, hq, hk, d, sq = len(lens), 4, 2, 64, 3
    L = max(lens)
    k8, kd = quantize(torch.randn(b, L, hk, d), "per_head")
    v8, vd = quantize(torch.randn(b, L, hk, d) * 2, "per_head")
    kd, vd = kd * rand_descale(b, hk, 0.8, 1.25), vd * rand_descale(b, hk, 0.8, 1.25)  # non-unit, per (seq, head)
    pt, nblocks = page_table_3x(lens, ps)
    kc, vc = poisoned_cache(nblocks, ps, hk, d), poisoned_cache(nblocks, ps, hk, d)
    scatter_dense(kc, pt, k8, lens)
    scatter_dense(vc, pt, v8, lens)
    cs = torch.tensor(lens, dtype=torch.int32)
    if qkind == "fp8":
        q, qd = quantize(torch.randn(b, sq, hq, d), "per_tensor")
        qd = qd.reshape(1, 1)
    else:
        q, qd = torch.randn(b, sq, hq, d).bfloat16(), None
    for causal in (False, True):
        out, lse = flash_attn_with_kvcache(
            q,
            kc,
            vc,
            cache_seqlens=cs,
            page_table=pt,
            q_descale=qd,
            k_descale=kd,
            v_descale=vd,
            causal=causal,
            return_softmax_lse=True,
        )
        assert out.shape == (b, sq, hq, d) and out.dtype == torch.bfloat16 and lse.shape == (b, hq, sq)
        # P as the paged kernel rounds it: fp16 (bf16 Q over the e4m3 cache; FP8 Q in decode / small tiles
        # over FA3's V layout, as here: 6 query rows per kv head)
        ref, ref_lse, lowp = naive_attention(
            q,
            k8,
            v8,
            seqlens_q=torch.full((b,), sq),
            seqlens_k=cs,
            causal=causal,
            q_descale=qd,
            k_descale=kd,
            v_descale=vd,
            p_round=torch.float16,
        )
        check_vs_oracle(out, lse, ref, ref_lse, lowp)
        # cache_seqlens = 0: output 0 and lse -inf, no NaN from the poisoned pool
        assert (out[0].float() == 0).all() and torch.isneginf(lse[0]).all()
        # dense API on the same FP8 tensors, per sequence (q must be FP8 for flash_attn_func): the paged call
        # over sequence-major V runs FP8 MMAs (P in e4m3) as the dense kernel does (one-slot pages have no
        # sequence-major order)
        if qkind == "fp8" and ps > 1:
            out8 = flash_attn_with_kvcache(
                q,
                kc,
                to_v_seq_major(vc),
                cache_seqlens=cs,
                page_table=pt,
                q_descale=qd,
                k_descale=kd,
                v_descale=vd,
                causal=causal,
            )
            for i in range(1, b):
                od = flash_attn_func(
                    q[i : i + 1],
                    k8[i : i + 1, : lens[i]],
                    v8[i : i + 1, : lens[i]],
                    causal=causal,
                    q_descale=qd,
                    k_descale=kd[i : i + 1],
                    v_descale=vd[i : i + 1],
                )
                torch.testing.assert_close(out8[i : i + 1], od, atol=1e-2, rtol=1e-2)


def test_paged_gqa_ratios_and_head_dims():
    for hq, hk, d, dv in [(3, 1, 64, 64), (8, 1, 128, 128), (16, 2, 256, 256), (4, 2, 192, 128)]:
        lens = [5, 70]
        ps = 16
        b, L = 2, 70
        k8, kd = quantize(torch.randn(b, L, hk, d), "per_head")
        v8, vd = quantize(torch.randn(b, L, hk, dv), "per_head")
        pt, nb = page_table_3x(lens, ps)
        kc, vc = poisoned_cache(nb, ps, hk, d), poisoned_cache(nb, ps, hk, dv)
        scatter_dense(kc, pt, k8, lens)
        scatter_dense(vc, pt, v8, lens)
        q = torch.randn(b, 2, hq, d).bfloat16()
        cs = torch.tensor(lens, dtype=torch.int32)
        out, lse = flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=cs, page_table=pt, k_descale=kd, v_descale=vd, causal=True, return_softmax_lse=True
        )
        assert out.shape == (b, 2, hq, dv)
        check_vs_oracle(out, lse, *naive_attention(q, k8, v8, seqlens_k=cs, causal=True, k_descale=kd, v_descale=vd))


def test_cache_seqlens_int_and_default_full():
    ps, hk, d = 8, 2, 32
    kc8, kd = quantize(torch.randn(6, ps, hk, d), "per_tensor")
    vc8, vd = quantize(torch.randn(6, ps, hk, d), "per_tensor")
    pt = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    q = torch.randn(2, 1, 4, d).bfloat16()
    kw = dict(page_table=pt, k_descale=kd.reshape(1, 1), v_descale=vd.reshape(1, 1))
    full = flash_attn_with_kvcache(q, kc8, vc8, **kw)  # default: the whole capacity
    as_int = flash_attn_with_kvcache(q, kc8, vc8, cache_seqlens=16, **kw)
    as_t = flash_attn_with_kvcache(q, kc8, vc8, cache_seqlens=torch.tensor([16, 16], dtype=torch.int32), **kw)
    assert torch.equal(full, as_int) and torch.equal(full, as_t)
    kdense = torch.stack([torch.cat([kc8[4], kc8[1]]), torch.cat([kc8[0], kc8[5]])])
    vdense = torch.stack([torch.cat([vc8[4], vc8[1]]), torch.cat([vc8[0], vc8[5]])])
    ref, _ = naive_attention(q, kdense, vdense, k_descale=kd, v_descale=vd)
    check_vs_oracle(full, None, ref, None)


@pytest.mark.parametrize("num_splits", [0, 1, 2, 3, 17, 64])
def test_num_splits_same_result(num_splits):
    lens = [1, 40, 0]
    ps, hk, d = 16, 1, 64
    k8, kd = quantize(torch.randn(3, 40, hk, d), "per_head")
    v8, vd = quantize(torch.randn(3, 40, hk, d), "per_head")
    pt, nb = page_table_3x(lens, ps)
    kc, vc = poisoned_cache(nb, ps, hk, d), poisoned_cache(nb, ps, hk, d)
    scatter_dense(kc, pt, k8, lens)
    scatter_dense(vc, pt, v8, lens)
    q = torch.randn(3, 1, 8, d).bfloat16()
    cs = torch.tensor(lens, dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(
        q,
        kc,
        vc,
        cache_seqlens=cs,
        page_table=pt,
        k_descale=kd,
        v_descale=vd,
        num_splits=num_splits,
        return_softmax_lse=True,
    )
    check_vs_oracle(out, lse, *naive_attention(q, k8, v8, seqlens_k=cs, k_descale=kd, v_descale=vd))


# ------------------------------------------------------------------------- appends: chunked prefill
def _append_setup(lens, ps, hk, d, dtype=E4M3):
    pt, nb = page_table_3x(lens, ps)
    return pt, poisoned_cache(nb, ps, hk, d, dtype), poisoned_cache(nb, ps, hk, d, dtype)


@pytest.mark.parametrize("scales", ["per_head", "per_tensor", "per_token_head", "bf16_cache"])
def test_chunked_prefill_equals_single_shot(scales):
    b, L, hq, hk, d, ps = 2, 45, 4, 2, 64, 16
    chunks = [16, 1, 20, 8]  # uniform across the batch (4-D q / k / v)
    q = torch.randn(b, L, hq, d).bfloat16()
    k = (torch.randn(b, L, hk, d) * 2).bfloat16()
    v = torch.randn(b, L, hk, d).bfloat16()
    cdt = torch.bfloat16 if scales == "bf16_cache" else E4M3
    pt, kc, vc = _append_setup([L] * b, ps, hk, d, cdt)
    kw = {}
    if scales == "per_head":
        kw = dict(k_descale=rand_descale(b, hk, 0.025, 0.05), v_descale=rand_descale(b, hk, 0.012, 0.03))
    elif scales == "per_tensor":  # |k| < ~9.5 and |v| < ~5 stay inside e4m3's range with these scales
        kw = dict(k_descale=torch.tensor([[0.03]]), v_descale=torch.tensor(0.015))
    extra = lambda c: {}
    if scales == "per_token_head":
        ks1, vs1 = torch.full(kc.shape[:3], float("nan")), torch.full(kc.shape[:3], float("nan"))
        ks2, vs2 = ks1.clone(), vs1.clone()
        extra = lambda c: dict(k_cache_scales=c[0], v_cache_scales=c[1])
    kc2, vc2 = kc.clone(), vc.clone()
    outs, pos = [], 0
    for c in chunks:
        o = flash_attn_with_kvcache(
            q[:, pos : pos + c],
            kc,
            vc,
            k=k[:, pos : pos + c],
            v=v[:, pos : pos + c],
            cache_seqlens=torch.full((b,), pos, dtype=torch.int32),
            page_table=pt,
            causal=True,
            **kw,
            **extra((ks1, vs1) if scales == "per_token_head" else None),
        )
        outs.append(o)
        pos += c
    chunked = torch.cat(outs, dim=1)
    single = flash_attn_with_kvcache(
        q,
        kc2,
        vc2,
        k=k,
        v=v,
        cache_seqlens=0,
        page_table=pt,
        causal=True,
        **kw,
        **extra((ks2, vs2) if scales == "per_token_head" else None),
    )
    # the caches hold the same bytes, and the attention results agree
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc2.view(torch.uint8))
    torch.testing.assert_close(chunked, single, atol=0, rtol=0)
    # ... and both match the oracle over the dequantized cache
    kd_tok = vd_tok = None
    if scales == "per_token_head":
        assert torch.equal(ks1.view(torch.uint8), ks2.view(torch.uint8))
        kd_tok = torch.stack([gather_dense(ks1, pt, i, L)[0] for i in range(b)])
        vd_tok = torch.stack([gather_dense(vs1, pt, i, L)[0] for i in range(b)])
    kdense = torch.cat([gather_dense(kc, pt, i, L) for i in range(b)])
    vdense = torch.cat([gather_dense(vc, pt, i, L) for i in range(b)])
    ref, _ = naive_attention(
        q, kdense, vdense, causal=True, k_token_descale=kd_tok, v_token_descale=vd_tok, **{n: t for n, t in kw.items()}
    )
    check_vs_oracle(single, None, ref, None)
    # the dequantized cache is the input within e4m3 rounding
    if cdt == E4M3:
        kdq = kdense.float()
        if scales == "per_token_head":
            kdq = kdq * kd_tok[..., None]
        else:
            kd_ = kw["k_descale"]
            kdq = kdq * (kd_.reshape(1, 1) if kd_.numel() == 1 else kd_)[:, None, :, None]
        err = (kdq - k.float()).abs()
        assert (err <= 2**-4 * k.float().abs() + 1e-3).all()


def test_chunked_prefill_varlen_chunks_with_cu_seqlens_k_new():
    """Unequal chunk sizes per sequence (incl. 0) through cu_seqlens_q / cu_seqlens_k_new."""
    hq, hk, d, ps = 4, 1, 32, 4
    plans = [[5, 0, 1, 7], [0, 3, 3, 1], [2, 2, 0, 0]]  # per sequence, per step
    lens = [sum(p) for p in plans]
    b, L = len(plans), max(lens)
    q = torch.randn(b, L, hq, d).bfloat16()
    k = torch.randn(b, L, hk, d).bfloat16()
    v = torch.randn(b, L, hk, d).bfloat16()
    kd, vd = rand_descale(b, hk, 0.004, 0.01), rand_descale(b, hk, 0.004, 0.01)
    pt, kc, vc = _append_setup(lens, ps, hk, d)
    pos = [0] * b
    got = [[] for _ in range(b)]
    for step in range(4):
        n = [plans[i][step] for i in range(b)]
        cu = torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32)
        qv = torch.cat([q[i, pos[i] : pos[i] + n[i]] for i in range(b)])
        kv = torch.cat([k[i, pos[i] : pos[i] + n[i]] for i in range(b)])
        vv = torch.cat([v[i, pos[i] : pos[i] + n[i]] for i in range(b)])
        o, lse = flash_attn_with_kvcache(
            qv,
            kc,
            vc,
            k=kv,
            v=vv,
            cache_seqlens=torch.tensor(pos, dtype=torch.int32),
            page_table=pt,
            cu_seqlens_q=cu,
            cu_seqlens_k_new=cu,
            max_seqlen_q=max(max(n), 1),
            k_descale=kd,
            v_descale=vd,
            causal=True,
            return_softmax_lse=True,
        )
        assert o.shape == (sum(n), hq, d) and lse.shape == (hq, sum(n))
        for i in range(b):
            got[i].append(o[int(cu[i]) : int(cu[i + 1])])
            pos[i] += n[i]
    for i in range(b):
        out_i = torch.cat(got[i])[None]
        kdn, vdn = gather_dense(kc, pt, i, lens[i]), gather_dense(vc, pt, i, lens[i])
        ref, _ = naive_attention(
            q[i : i + 1, : lens[i]], kdn, vdn, causal=True, k_descale=kd[i : i + 1], v_descale=vd[i : i + 1]
        )
        check_vs_oracle(out_i, None, ref, None)


def test_mixed_batch_equals_separate_calls():
    """Decode rows and a prefill chunk in one varlen call == one call per sequence."""
    hq, hk, d, ps = 6, 2, 64, 16
    prefix = [37, 0, 13]
    new = [1, 1, 20]  # decode, first token of a new sequence, prefill chunk
    total = [p + n for p, n in zip(prefix, new)]
    b = 3
    pt, kc, vc = _append_setup(total, ps, hk, d)
    kd, vd = rand_descale(b, hk, 0.005, 0.02), rand_descale(b, hk, 0.005, 0.02)
    # fill the prefixes with write_kv_cache (static per-(sequence, head) descales)
    kp = torch.randn(sum(prefix), hk, d) * 3
    vp = torch.randn(sum(prefix), hk, d)
    seq_idx = torch.cat([torch.full((p,), i, dtype=torch.int32) for i, p in enumerate(prefix)])
    positions = torch.cat([torch.arange(p) for p in prefix])
    slots = slot_mapping_for(pt, ps, seq_idx, positions)
    write_kv_cache(kp, vp, kc, vc, slots, k_descale=kd, v_descale=vd, token_seq_idx=seq_idx)
    q8, qd = quantize(torch.randn(sum(new), hq, d)[None], "per_tensor")
    q8, qd = q8[0], qd.reshape(1, 1)
    kn, vn = torch.randn(sum(new), hk, d).bfloat16(), torch.randn(sum(new), hk, d).bfloat16()
    cu = torch.tensor([0, 1, 2, 22], dtype=torch.int32)
    kc_sep, vc_sep = kc.clone(), vc.clone()
    cs = torch.tensor(prefix, dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(
        q8,
        kc,
        vc,
        k=kn,
        v=vn,
        cache_seqlens=cs,
        page_table=pt,
        cu_seqlens_q=cu,
        cu_seqlens_k_new=cu,
        max_seqlen_q=20,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        causal=True,
        return_softmax_lse=True,
    )
    for i in range(b):
        s = slice(int(cu[i]), int(cu[i + 1]))
        o_i, l_i = flash_attn_with_kvcache(
            q8[s][None],
            kc_sep,
            vc_sep,
            k=kn[s][None],
            v=vn[s][None],
            cache_seqlens=cs[i : i + 1],
            page_table=pt[i : i + 1],
            q_descale=qd,
            k_descale=kd[i : i + 1],
            v_descale=vd[i : i + 1],
            causal=True,
            return_softmax_lse=True,
        )
        torch.testing.assert_close(out[s], o_i[0], atol=0, rtol=0)
        torch.testing.assert_close(lse[:, s], l_i[0], atol=1e-6, rtol=1e-6)
        kdn, vdn = gather_dense(kc, pt, i, total[i]), gather_dense(vc, pt, i, total[i])
        ref, ref_lse, lowp = naive_attention(
            q8[s][None],
            kdn,
            vdn,
            causal=True,
            q_descale=qd,
            k_descale=kd[i : i + 1],
            v_descale=vd[i : i + 1],
            p_round="e4m3",
        )
        check_vs_oracle(out[s][None], lse[:, s][None], ref, ref_lse, lowp)
    assert torch.equal(kc.view(torch.uint8), kc_sep.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_sep.view(torch.uint8))


def test_mixed_batch_fp8q_equals_separate_calls_per_precision():
    """FP8 Q over V in FA3's layout on the CPU path: a mixed batch's decode rows round P in fp16 as decode
    calls do, its prefill chunk (80 query rows per kv head) in e4m3 as a chunk call does; each sequence's output
    equals its own call's bit for bit."""
    hq, hk, d, ps = 4, 2, 32, 16
    lens, qlens = [37, 60, 9], [1, 40, 2]
    pt, nb = page_table_3x(lens, ps)
    kc, vc = poisoned_cache(nb, ps, hk, d), poisoned_cache(nb, ps, hk, d)
    k8, kd = quantize(torch.randn(3, max(lens), hk, d), "per_head")
    v8, vd = quantize(torch.randn(3, max(lens), hk, d), "per_head")
    scatter_dense(kc, pt, k8, lens)
    scatter_dense(vc, pt, v8, lens)
    q8, qd = quantize(torch.randn(sum(qlens), hq, d)[None], "per_tensor")
    q8, qd = q8[0], qd.reshape(1, 1)
    cs = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, 1, 41, 43], dtype=torch.int32)
    kw = dict(q_descale=qd, causal=True, return_softmax_lse=True)
    out, lse = flash_attn_with_kvcache(
        q8, kc, vc, cache_seqlens=cs, page_table=pt, cu_seqlens_q=cu, max_seqlen_q=40, k_descale=kd, v_descale=vd, **kw
    )
    for i in range(3):
        s = slice(int(cu[i]), int(cu[i + 1]))
        o_i, l_i = flash_attn_with_kvcache(
            q8[s][None],
            kc,
            vc,
            cache_seqlens=cs[i : i + 1],
            page_table=pt[i : i + 1],
            k_descale=kd[i : i + 1],
            v_descale=vd[i : i + 1],
            **kw,
        )
        assert torch.equal(out[s], o_i[0]), i
        torch.testing.assert_close(lse[:, s], l_i[0], atol=1e-6, rtol=1e-6)
        ref, ref_lse, lowp = naive_attention(
            q8[s][None],
            k8[i : i + 1, : lens[i]],
            v8[i : i + 1, : lens[i]],
            causal=True,
            q_descale=qd,
            k_descale=kd[i : i + 1],
            v_descale=vd[i : i + 1],
            p_round="e4m3" if qlens[i] == 40 else torch.float16,
        )
        check_vs_oracle(out[s][None], lse[:, s][None], ref, ref_lse, lowp)


def test_mixed_batch_without_append():
    """cu_seqlens_q over a prefilled cache (no k/v): decode rows + a chunk with its own tokens already cached."""
    hq, hk, d, ps = 4, 2, 32, 8
    lens, nq = [25, 1, 19], [1, 1, 7]
    b, L = 3, 25
    k8, kd = quantize(torch.randn(b, L, hk, d), "per_head")
    v8, vd = quantize(torch.randn(b, L, hk, d), "per_head")
    pt, nb = page_table_3x(lens, ps)
    kc, vc = poisoned_cache(nb, ps, hk, d), poisoned_cache(nb, ps, hk, d)
    scatter_dense(kc, pt, k8, lens)
    scatter_dense(vc, pt, v8, lens)
    q = torch.randn(sum(nq), hq, d).bfloat16()
    cu = torch.tensor([0, 1, 2, 9], dtype=torch.int32)
    cs = torch.tensor(lens, dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(
        q,
        kc,
        vc,
        cache_seqlens=cs,
        page_table=pt,
        cu_seqlens_q=cu,
        max_seqlen_q=7,
        k_descale=kd,
        v_descale=vd,
        causal=True,
        return_softmax_lse=True,
    )
    for i in range(b):
        s = slice(int(cu[i]), int(cu[i + 1]))
        ref, ref_lse = naive_attention(
            q[s][None],
            k8[i : i + 1, : lens[i]],
            v8[i : i + 1, : lens[i]],
            causal=True,
            k_descale=kd[i : i + 1],
            v_descale=vd[i : i + 1],
        )
        check_vs_oracle(out[s][None], lse[:, s][None], ref, ref_lse)


# ------------------------------------------------------------------------------- per-token-head scales
def test_per_token_head_scales_with_fp8_q():
    lens = [9, 33]
    b, hq, hk, d, ps = 2, 4, 2, 64, 16
    L = max(lens)
    x = torch.randn(b, L, hk, d) * torch.logspace(-1, 1, L)[None, :, None, None]  # token magnitudes vary
    k8, ks = quantize(x, "per_token_head")
    v8, vs = quantize(torch.randn(b, L, hk, d), "per_token_head")
    pt, nb = page_table_3x(lens, ps)
    kc, vc = poisoned_cache(nb, ps, hk, d), poisoned_cache(nb, ps, hk, d)
    kcs, vcs = torch.full((nb, ps, hk), float("nan")), torch.full((nb, ps, hk), float("nan"))
    scatter_dense(kc, pt, k8, lens)
    scatter_dense(vc, pt, v8, lens)
    scatter_dense(kcs, pt, ks, lens)
    scatter_dense(vcs, pt, vs, lens)
    q8, qd = quantize(torch.randn(b, 2, hq, d), "per_head")
    qd = qd.view(b, hk, 2).amax(-1) * rand_descale(b, hk, 1.0, 1.3)  # (batch, nheads_k), non-unit
    q8 = saturating_cast(torch.randn(b, 2, hq, d) / qd.repeat_interleave(2, 1)[:, None, :, None] * 0.01)
    cs = torch.tensor(lens, dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(
        q8,
        kc,
        vc,
        cache_seqlens=cs,
        page_table=pt,
        q_descale=qd,
        k_cache_scales=kcs,
        v_cache_scales=vcs,
        causal=True,
        return_softmax_lse=True,
    )
    ref, ref_lse = naive_attention(
        q8,
        k8,
        v8,
        seqlens_q=torch.full((b,), 2),
        seqlens_k=cs,
        causal=True,
        q_descale=qd,
        k_token_descale=ks,
        v_token_descale=vs,
    )
    check_vs_oracle(out, lse, ref, ref_lse)
    # the per-token scales matter: a uniform scale gives a different answer
    wrong = flash_attn_with_kvcache(
        q8,
        kc,
        vc,
        cache_seqlens=cs,
        page_table=pt,
        q_descale=qd,
        k_cache_scales=torch.ones_like(kcs),
        v_cache_scales=vcs,
        causal=True,
    )
    assert (wrong.float() - out.float()).abs().max() > 1e-2


# ----------------------------------------------------------------------------------------- write_kv_cache
def test_write_kv_cache_round_trip_and_negative_slots():
    nb, ps, hk, d = 5, 4, 2, 32
    kc, vc = poisoned_cache(nb, ps, hk, d), poisoned_cache(nb, ps, hk, d)
    n = 9
    k, v = torch.randn(n, hk, d) * 3, torch.randn(n, hk, d)
    slots = torch.tensor([17, 3, -1, 0, 8, -5, 12, 19, 1])
    kd, vd = torch.tensor(3 * 4.5 / 448), torch.tensor([[4.5 / 448]])
    write_kv_cache(k, v, kc, vc, slots, k_descale=kd, v_descale=vd)
    written = set(int(s) for s in slots if s >= 0)
    for t in range(n):
        s = int(slots[t])
        if s < 0:
            continue
        for cache, x, dsc in ((kc, k, kd), (vc, v, vd)):
            got = cache[s // ps, s % ps].float() * dsc.reshape(())
            assert (got - x[t]).abs().le(2**-4 * x[t].abs() + 2**-10 * dsc + 1e-7).all()
            assert torch.equal(
                cache[s // ps, s % ps].view(torch.uint8), saturating_cast(x[t] / dsc.reshape(())).view(torch.uint8)
            )
    for s in range(nb * ps):
        if s not in written:  # negative slots are skipped: every other slot is still poisoned
            assert torch.isnan(kc[s // ps, s % ps].float()).all() and torch.isnan(vc[s // ps, s % ps].float()).all()


def test_write_kv_cache_per_seq_head_descale_and_dynamic_scales():
    nb, ps, hk, d = 4, 4, 2, 16
    k, v = torch.randn(6, hk, d), torch.randn(6, hk, d)
    seq = torch.tensor([0, 0, 1, 1, 1, 0], dtype=torch.int32)
    slots = torch.tensor([0, 1, 4, 5, 6, 2])
    kd = rand_descale(2, hk, 0.005, 0.02)
    vd = rand_descale(2, 1, 0.005, 0.02)  # per-sequence
    kc, vc = poisoned_cache(nb, ps, hk, d), poisoned_cache(nb, ps, hk, d)
    write_kv_cache(k, v, kc, vc, slots, k_descale=kd, v_descale=vd, token_seq_idx=seq)
    for t in range(6):
        s, i = int(slots[t]), int(seq[t])
        assert torch.equal(
            kc[s // ps, s % ps].view(torch.uint8), saturating_cast(k[t] / kd[i][:, None]).view(torch.uint8)
        )
        assert torch.equal(vc[s // ps, s % ps].view(torch.uint8), saturating_cast(v[t] / vd[i]).view(torch.uint8))
    # dynamic per-token-head: scales land beside the cache; dequantized values ~ input
    kc, vc = poisoned_cache(nb, ps, hk, d), poisoned_cache(nb, ps, hk, d)
    ks, vs = torch.full((nb, ps, hk), float("nan")), torch.full((nb, ps, hk), float("nan"))
    k[3] = 0  # an all-zero token: floored scale, no NaN
    write_kv_cache(k, v, kc, vc, slots, k_cache_scales=ks, v_cache_scales=vs)
    for t in range(6):
        s = int(slots[t])
        sc = ks[s // ps, s % ps]
        torch.testing.assert_close(sc, (k[t].abs().amax(-1) / 448).clamp_min(2.0**-40))
        deq = kc[s // ps, s % ps].float() * sc[:, None]
        assert ((deq - k[t]).abs() <= 2**-4 * k[t].abs() + 1e-6).all()
    assert (ks[1, 1] > 0).all() and not torch.isnan(kc[1, 1].float()).any()
    assert torch.isnan(ks[3]).all()  # untouched


def test_write_kv_cache_bf16_cache_is_plain_copy():
    kc = torch.full((2, 4, 1, 8), float("nan"), dtype=torch.bfloat16)
    vc = kc.clone()
    k = torch.randn(3, 1, 8)
    with pytest.raises(ValueError, match="k_descale: expected None for a torch.bfloat16 k_cache"):
        write_kv_cache(k, k, kc, vc, torch.tensor([5, -1, 2]), k_descale=torch.tensor(7.0))  # describes FP8 only
    assert torch.isnan(kc.float()).all()
    write_kv_cache(k, k, kc, vc, torch.tensor([5, -1, 2]))
    assert torch.equal(kc[1, 1], k[0].bfloat16()) and torch.equal(kc[0, 2], k[2].bfloat16())
    assert torch.isnan(kc[0, 0].float()).all()


# ------------------------------------------------------------------------------------------ combine
def _splits_of(q, k, v, bounds, ds):
    """Run flash_attn_func on KV slices; returns out_partial (S, b, sq, h, d) f32 and lse_partial (S, b, sq, h)."""
    outs, lses = [], []
    for a, c in zip(bounds[:-1], bounds[1:]):
        if a == c:  # an empty split, as a split-KV kernel reports it: (0, -inf)
            outs.append(torch.zeros(q.shape[:3] + (v.shape[-1],)))
            lses.append(torch.full(q.shape[:3], float("-inf")))
            continue
        o, lse = flash_attn_func(q, k[:, a:c], v[:, a:c], out_dtype=torch.float32, return_attn_probs=True, **ds)
        outs.append(o)
        lses.append(lse.transpose(1, 2))
    return torch.stack(outs), torch.stack(lses).contiguous()


@pytest.mark.parametrize("bounds", [[0, 40], [0, 13, 40], [0, 1, 2, 39, 40], [0, 0, 20, 20, 40]], ids=str)
def test_combine_of_splits_equals_unsplit(bounds):

    q8, k8, v8, qd, kd, vd = fp8_inputs(2, 3, 40, 4, 2, 64)
    # float32 (dequantized) inputs: the splits multiply P exactly, so the merge alone is measured
    q = q8.float() * qd.repeat_interleave(2, dim=1)[:, None, :, None]
    k, v = k8.float() * kd[:, None, :, None], v8.float() * vd[:, None, :, None]
    ds = {}
    op, lp = _splits_of(q, k, v, bounds, ds)
    if 0 in [c - a for a, c in zip(bounds[:-1], bounds[1:])]:
        assert torch.isneginf(lp).any()  # the empty splits report (0, -inf)
        op = torch.where(torch.isneginf(lp)[..., None], torch.full_like(op, float("nan")), op)  # and may hold NaN
    out, lse = flash_attn_combine(op, lp)
    assert out.shape == (2, 3, 4, 64) and out.dtype == torch.float32 and lse.shape == (2, 3, 4)
    ref, ref_lse = naive_attention(q, k, v, **ds)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse.transpose(1, 2), atol=1e-5, rtol=1e-5)
    full, full_lse = flash_attn_func(q, k, v, out_dtype=torch.float32, return_attn_probs=True, **ds)
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
    # out_dtype / out= / out_scale
    assert flash_attn_combine(op, lp, out_dtype=torch.bfloat16)[0].dtype == torch.bfloat16
    buf = torch.empty(2, 3, 4, 64)
    assert flash_attn_combine(op, lp, buf)[0] is buf and torch.equal(buf, out)
    o8, _ = flash_attn_combine(op, lp, out_scale=torch.tensor(0.01))
    assert o8.dtype == E4M3 and torch.equal(o8.view(torch.uint8), saturating_cast(out / 0.01).view(torch.uint8))


def test_combine_empty_splits_and_all_empty_rows():
    S, b, s, h, d = 3, 2, 2, 2, 16
    op = torch.randn(S, b, s, h, d)
    lp = torch.randn(S, b, s, h)
    lp[:, 0, 1, :] = float("-inf")  # row (0, 1): every split empty
    op[:, 0, 1, :] = float("nan")
    lp[1, 1] = float("-inf")  # one empty split elsewhere
    op[1, 1] = float("nan")
    out, lse = flash_attn_combine(op, lp)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[0, 1] == 0).all() and torch.isneginf(lse[0, 1]).all()
    # manual merge for the other rows
    w = torch.softmax(torch.where(torch.isneginf(lp), torch.full_like(lp, -1e30), lp), dim=0)
    manual = (torch.nan_to_num(op) * w[..., None]).sum(0)
    torch.testing.assert_close(out[1], manual[1])
    torch.testing.assert_close(out[0, 0], manual[0, 0])
    torch.testing.assert_close(lse[1], torch.logsumexp(lp[:, 1], 0))


def test_combine_varlen_layout():
    q, k, v = torch.randn(1, 7, 2, 32), torch.randn(1, 20, 1, 32), torch.randn(1, 20, 1, 32)
    op, lp = _splits_of(q, k, v, [0, 5, 20], {})
    out, lse = flash_attn_combine(op[:, 0].contiguous(), lp[:, 0].contiguous())  # (splits, total, h, d)
    assert out.shape == (7, 2, 32) and lse.shape == (7, 2)
    torch.testing.assert_close(out.double(), naive_attention(q, k, v)[0][0], atol=1e-5, rtol=1e-5)


def test_dense_zero_keys():
    q = torch.randn(2, 3, 2, 32).bfloat16()
    k = torch.randn(2, 0, 2, 32).bfloat16()
    out, lse = flash_attn_func(q, k, k, return_attn_probs=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_varlen_matches_paged_for_same_tokens():
    """flash_attn_varlen_func and flash_attn_with_kvcache agree on the same FP8 tokens."""
    lens_k, lens_q = [12, 30], [4, 30]
    hk, hq, d, ps = 2, 4, 32, 8
    b, L = 2, 30
    k8, kd = quantize(torch.randn(b, L, hk, d), "per_tensor")
    v8, vd = quantize(torch.randn(b, L, hk, d), "per_tensor")
    q8, qd = quantize(torch.randn(b, L, hq, d), "per_tensor")
    ds = dict(q_descale=qd.reshape(1, 1), k_descale=kd.reshape(1, 1), v_descale=vd.reshape(1, 1))
    pt, nb = page_table_3x(lens_k, ps)
    kc, vc = poisoned_cache(nb, ps, hk, d), poisoned_cache(nb, ps, hk, d)
    scatter_dense(kc, pt, k8, lens_k)
    scatter_dense(vc, pt, v8, lens_k)
    qv = torch.cat([q8[i, : lens_q[i]] for i in range(b)])
    kv = torch.cat([k8[i, : lens_k[i]] for i in range(b)])
    vv = torch.cat([v8[i, : lens_k[i]] for i in range(b)])
    cq = torch.tensor([0, 4, 34], dtype=torch.int32)
    ck = torch.tensor([0, 12, 42], dtype=torch.int32)
    o1 = flash_attn_varlen_func(qv, kv, vv, cq, ck, 30, 30, causal=True, **ds)
    # over sequence-major V the paged kernel runs FP8 MMAs (P in e4m3) as the varlen kernel does (over FA3's
    # V layout these small tiles, 60 query rows per kv head, would round P to fp16)
    o2 = flash_attn_with_kvcache(
        qv,
        kc,
        to_v_seq_major(vc),
        cache_seqlens=torch.tensor(lens_k, dtype=torch.int32),
        page_table=pt,
        cu_seqlens_q=cq,
        max_seqlen_q=30,
        causal=True,
        **ds,
    )
    torch.testing.assert_close(o1, o2, atol=1e-2, rtol=1e-2)
    assert not math.isnan(o1.float().sum().item())
