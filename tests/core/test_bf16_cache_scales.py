"""Per-token-head KV-cache scales stored in bfloat16 (half the scale bytes), torch and Triton paths."""

import pytest
import torch

import fp8attn
from fp8attn.paged_cache import alloc_paged_cache, make_page_table
from fp8attn.quant import round_descale_for_storage, scale_storage_pad
from fp8attn.reference import paged_attention_ref


def _write(path, scale_dtype):
    # the Triton path runs compiled on a GPU, in the interpreter on CPU tensors otherwise
    device = "cuda" if path == "triton" and torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    nb, ps, hk, d, n = 12, 16, 2, 64, 40
    k = (torch.randn(n, hk, d, generator=g) * torch.rand(n, hk, 1, generator=g) * 30).to(device)
    v = (torch.randn(n, hk, d, generator=g) * 3).to(device)
    kc, vc = alloc_paged_cache(nb, ps, hk, d, device=device, poison_nan=True)
    ks = torch.full((nb, ps, hk), float("nan"), dtype=scale_dtype, device=device)
    vs = ks.clone()
    slots = torch.randperm(nb * ps, generator=g)[:n].to(device)
    if path == "triton":
        pytest.importorskip("triton")
        from fp8attn.kernels.cache import launch_write_kv_cache

        launch_write_kv_cache(k, v, kc, vc, slots, k_cache_scales=ks, v_cache_scales=vs)
    else:
        from fp8attn.ops import _write_kv_cache_torch

        _write_kv_cache_torch(k, v, kc, vc, slots, None, None, None, ks, vs)
    return k, v, kc, vc, ks, vs, slots, ps


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_bf16_scales_never_clip_and_round_trip(path):
    k, v, kc, vc, ks, vs, slots, ps = _write(path, torch.bfloat16)
    blk, off = slots // ps, slots % ps
    for x, c, s in ((k, kc, ks), (v, vc, vs)):
        stored = s[blk, off].float()  # (n, hk)
        exact = x.abs().amax(-1) / 448.0
        assert (stored >= exact).all(), "a stored descale below amax/448 would clip the largest element"
        assert (stored <= exact * (1 + 2**-6)).all()
        assert (c[blk, off].float().abs().amax(-1) <= 448).all()
        deq = c[blk, off].float() * stored[..., None]
        rel = ((deq - x).norm() / x.norm()).item()
        assert rel < 0.04, rel  # e4m3 rounding (3 mantissa bits), nothing more


def test_torch_and_triton_write_agree():
    a = _write("torch", torch.bfloat16)
    b = [t.cpu() if isinstance(t, torch.Tensor) else t for t in _write("triton", torch.bfloat16)]
    blk, off = a[6] // a[7], a[6] % a[7]
    # the CPU interpreter's bf16 cast truncates where the GPU rounds: allow one bf16 ulp in the scale
    torch.testing.assert_close(a[4][blk, off].float(), b[4][blk, off].float(), rtol=2**-7, atol=0)
    deq_a = a[2][blk, off].float() * a[4][blk, off].float()[..., None]
    deq_b = b[2][blk, off].float() * b[4][blk, off].float()[..., None]
    assert ((deq_a - deq_b).abs() / a[0].abs().amax()).max() < 0.07  # at most one e4m3 step apart


def test_attention_with_bf16_scales_matches_fp32_scales():
    g = torch.Generator().manual_seed(7)
    B, hq, hk, d, ps = 3, 4, 2, 64, 16
    lens = [33, 1, 70]
    nb = 3 * sum(-(-n // ps) for n in lens)
    pt = make_page_table(lens, ps, nb, generator=g)
    q = torch.randn(sum(lens), hq, d, generator=g).bfloat16()
    k = torch.randn(sum(lens), hk, d, generator=g) * 4
    v = torch.randn(sum(lens), hk, d, generator=g)
    cu = torch.tensor([0, 33, 34, 104], dtype=torch.int32)
    outs = {}
    for sdt in (torch.float32, torch.bfloat16):
        kc, vc = alloc_paged_cache(nb, ps, hk, d, poison_nan=True)
        ks = torch.full((nb, ps, hk), float("nan"), dtype=sdt)
        vs = ks.clone()
        outs[sdt] = fp8attn.flash_attn_with_kvcache(
            q,
            kc,
            vc,
            k=k,
            v=v,
            cache_seqlens=torch.zeros(B, dtype=torch.int32),
            page_table=pt,
            cu_seqlens_q=cu,
            cu_seqlens_k_new=cu,
            max_seqlen_q=70,
            causal=True,
            k_cache_scales=ks,
            v_cache_scales=vs,
        )
        # bf16 Q with per-token-head V scales: the kernel multiplies in bf16 (P rounded to bf16)
        ref = paged_attention_ref(
            q,
            kc,
            vc,
            pt,
            torch.tensor(lens, dtype=torch.int32),
            cu_seqlens_q=cu,
            max_seqlen_q=70,
            k_cache_scales=ks,
            v_cache_scales=vs,
            causal=True,
            p_dtype=torch.bfloat16,
        )
        assert not torch.isnan(outs[sdt]).any()
        torch.testing.assert_close(outs[sdt].float(), ref.float(), atol=1e-2, rtol=0)
    # against attention over the unquantized K/V, bf16 scale storage costs (almost) nothing in accuracy
    from fp8attn.reference import varlen_attention_ref

    exact = varlen_attention_ref(
        q.double(), k.double(), v.double(), cu, cu, 70, 70, causal=True, compute_dtype=torch.float64
    )
    err = {sdt: ((o.double() - exact).norm() / exact.norm()).item() for sdt, o in outs.items()}
    assert err[torch.bfloat16] <= 1.15 * err[torch.float32] + 1e-3, err


def test_scale_bytes_under_one_percent_of_the_bf16_cache():
    nb, ps, hk, d = 64, 16, 8, 128
    kc, vc, ks, vs = alloc_paged_cache(nb, ps, hk, d, with_scales=True)
    ks, vs = ks.bfloat16(), vs.bfloat16()
    fp8 = sum(t.numel() * t.element_size() for t in (kc, vc))
    scales = sum(t.numel() * t.element_size() for t in (ks, vs))
    bf16 = 2 * fp8
    assert fp8 == bf16 // 2 and scales / bf16 <= 0.01, scales / bf16


def test_bad_scale_dtype_is_rejected_with_the_argument_named():
    kc, vc = alloc_paged_cache(4, 16, 2, 64)
    bad = torch.ones(4, 16, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="k_cache_scales"):
        fp8attn.write_kv_cache(
            torch.randn(3, 2, 64),
            torch.randn(3, 2, 64),
            kc,
            vc,
            torch.arange(3),
            k_cache_scales=bad,
            v_cache_scales=bad,
        )


def test_storage_pad_rule():
    d = torch.rand(1000) + 1e-3
    r = round_descale_for_storage(d, torch.bfloat16)
    assert (r >= d).all() and scale_storage_pad(torch.float32) == 1.0
