"""Rotary embeddings in flash_attn_with_kvcache (FA3 semantics) against an explicit loop."""

import pytest
import torch

import fp8attn
from fp8attn.paged_cache import alloc_paged_cache, make_page_table


def _tables(n, rd, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rd, 2).float() / rd)
    ang = torch.arange(n).float()[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def _rot_loop(x, cos, sin, pos, interleaved):
    """x (d,) at position pos: explicit pairwise rotation."""
    y = x.clone().double()
    half = cos.shape[1]
    for j in range(half):
        a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
        c, s = float(cos[pos, j]), float(sin[pos, j])
        y[a] = x[a] * c - x[b] * s
        y[b] = x[a] * s + x[b] * c
    return y


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary_append_equals_prerotated_inputs(interleaved, causal):
    g = torch.Generator().manual_seed(11)
    B, sq, hq, hk, d, rd, ps = 2, 3, 4, 2, 64, 32, 16
    prev = torch.tensor([5, 17], dtype=torch.int32)
    cos, sin = _tables(64, rd)
    q = torch.randn(B, sq, hq, d, generator=g).bfloat16()
    k = torch.randn(B, sq, hk, d, generator=g).bfloat16()
    v = torch.randn(B, sq, hk, d, generator=g).bfloat16()
    nb = 3 * 2 * 2
    pt = make_page_table([22, 22], ps, nb, generator=g)
    old_k = torch.randn(nb, ps, hk, d, generator=g).bfloat16()
    old_v = torch.randn(nb, ps, hk, d, generator=g).bfloat16()
    kc, vc = old_k.clone(), old_v.clone()
    out = fp8attn.flash_attn_with_kvcache(
        q,
        kc,
        vc,
        k=k,
        v=v,
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=prev,
        page_table=pt,
        causal=causal,
        rotary_interleaved=interleaved,
    )
    # expected: rotate by hand, write by hand, attend without rotary
    qr, kr = q.clone(), k.clone()
    for b in range(B):
        for i in range(sq):
            qpos = int(prev[b]) + (i if causal else 0)
            kpos = int(prev[b]) + i
            for h in range(hq):
                qr[b, i, h] = _rot_loop(q[b, i, h].float(), cos, sin, qpos, interleaved).bfloat16()
            for h in range(hk):
                kr[b, i, h] = _rot_loop(k[b, i, h].float(), cos, sin, kpos, interleaved).bfloat16()
    kc2, vc2 = old_k.clone(), old_v.clone()
    exp = fp8attn.flash_attn_with_kvcache(qr, kc2, vc2, k=kr, v=v, cache_seqlens=prev, page_table=pt, causal=causal)
    torch.testing.assert_close(kc.float(), kc2.float(), atol=1e-2, rtol=0)
    torch.testing.assert_close(out.float(), exp.float(), atol=2e-2, rtol=0)
    # features past rotary_dim are untouched
    blk = pt[0, 5 // ps].long()
    assert torch.equal(kc[blk, 5 % ps, :, rd:], k[0, 0, :, rd:])


def test_rotary_varlen_positions_and_fp8_cache():
    g = torch.Generator().manual_seed(12)
    hq, hk, d, ps = 2, 1, 64, 16
    prev = torch.tensor([0, 9], dtype=torch.int32)
    cu = torch.tensor([0, 4, 5], dtype=torch.int32)
    cos, sin = _tables(32, d)
    q = torch.randn(5, hq, d, generator=g).bfloat16()
    k = torch.randn(5, hk, d, generator=g).bfloat16()
    v = torch.randn(5, hk, d, generator=g).bfloat16()
    pt = make_page_table([4, 10], ps, 6, generator=g)
    kc, vc = alloc_paged_cache(6, ps, hk, d, poison_nan=True)
    kc2, vc2 = alloc_paged_cache(6, ps, hk, d, poison_nan=True)
    # fill sequence 1's 9 cached tokens identically in both caches
    pre = torch.randn(9, hk, d, generator=g)
    slots = pt[1].long()[torch.arange(9) // ps] * ps + torch.arange(9) % ps
    fp8attn.write_kv_cache(pre, pre, kc, vc, slots)
    fp8attn.write_kv_cache(pre, pre, kc2, vc2, slots)
    out = fp8attn.flash_attn_with_kvcache(
        q,
        kc,
        vc,
        k=k,
        v=v,
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=prev,
        page_table=pt,
        cu_seqlens_q=cu,
        cu_seqlens_k_new=cu,
        max_seqlen_q=4,
        causal=True,
        rotary_interleaved=False,
    )
    qpos = [0, 1, 2, 3, 9]
    qr = torch.stack(
        [torch.stack([_rot_loop(q[t, h].float(), cos, sin, qpos[t], False) for h in range(hq)]) for t in range(5)]
    ).bfloat16()
    kr = torch.stack(
        [torch.stack([_rot_loop(k[t, h].float(), cos, sin, qpos[t], False) for h in range(hk)]) for t in range(5)]
    ).bfloat16()
    exp = fp8attn.flash_attn_with_kvcache(
        qr,
        kc2,
        vc2,
        k=kr,
        v=v,
        cache_seqlens=prev,
        page_table=pt,
        cu_seqlens_q=cu,
        cu_seqlens_k_new=cu,
        max_seqlen_q=4,
        causal=True,
    )
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), exp.float(), atol=3e-2, rtol=0)


def test_rotary_bad_inputs_name_the_argument():
    kc, vc = alloc_paged_cache(4, 16, 1, 64, dtype=torch.bfloat16)
    pt = torch.arange(4, dtype=torch.int32).view(1, 4)
    q = torch.randn(1, 1, 2, 64).bfloat16()
    cos, sin = _tables(8, 32)
    with pytest.raises(ValueError, match="rotary_cos"):  # no new k
        fp8attn.flash_attn_with_kvcache(q, kc, vc, rotary_cos=cos, rotary_sin=sin, cache_seqlens=3, page_table=pt)
    k = torch.randn(1, 1, 1, 64).bfloat16()
    with pytest.raises(ValueError, match="rotary_cos"):  # table too short for position 20
        fp8attn.flash_attn_with_kvcache(
            q, kc, vc, k=k, v=k, rotary_cos=cos, rotary_sin=sin, cache_seqlens=20, page_table=pt
        )
    with pytest.raises(NotImplementedError, match="rotary_cos"):
        fp8attn.flash_attn_with_kvcache(
            q.float().to(torch.float8_e4m3fn),
            kc.to(torch.float8_e4m3fn),
            vc.to(torch.float8_e4m3fn),
            k=k,
            v=k,
            rotary_cos=cos,
            rotary_sin=sin,
            cache_seqlens=2,
            page_table=pt,
        )
    with pytest.raises(ValueError, match="rotary_seqlens"):
        fp8attn.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=2, page_table=pt, rotary_seqlens=torch.tensor([1], dtype=torch.int32)
        )
