"""FA3's flash_attn_qkvpacked_func and get_scheduler_metadata: packed Q/K/V runs flash_attn_func on views of
the packed tensor; the metadata's split count reaches flash_attn_with_kvcache."""
import re

import pytest
import torch

import fp8attn

E4M3 = torch.float8_e4m3fn


def _raises(exc, arg, fn, *args, **kw):
    with pytest.raises(exc) as ei:
        fn(*args, **kw)
    assert re.search(rf"(^|\W){re.escape(arg)}(\W|$)", str(ei.value)), str(ei.value)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_5d_equals_flash_attn_func(fp8, causal):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 37, 3, 4, 64, generator=g)
    kw = {}
    if fp8:
        qkv = qkv.to(E4M3)
        kw = {n: torch.rand(2, 4, generator=g) + 0.5 for n in ("q_descale", "k_descale", "v_descale")}
    else:
        qkv = qkv.bfloat16()
    out, lse = fp8attn.flash_attn_qkvpacked_func(qkv, causal=causal, return_attn_probs=True, **kw)
    ref, ref_lse = fp8attn.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal,
                                           return_attn_probs=True, **kw)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert out.shape == (2, 37, 4, 64) and lse.shape == (2, 4, 37)


def test_qkvpacked_4d_gqa_splits_query_key_value_heads():
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, 20, 8 + 2 * 2, 64, generator=g).bfloat16()  # 8 query heads, 2 kv heads
    out = fp8attn.flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=8, window_size=(5, 0))
    ref = fp8attn.flash_attn_func(qkv[:, :, :8], qkv[:, :, 8:10], qkv[:, :, 10:], causal=True, window_size=(5, 0))
    assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_qkvpacked_equals_contiguous_inputs(causal):
    """On the GPU kernels the packed views (strided rows) give the result of contiguous q, k, v."""
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(2, 1024, 3, 8, 128, generator=g).to(E4M3).cuda()
    ds = {n: (torch.rand(2, 8, generator=g) + 0.5).cuda() for n in ("q_descale", "k_descale", "v_descale")}
    out = fp8attn.flash_attn_qkvpacked_func(qkv, causal=causal, **ds)
    ref = fp8attn.flash_attn_func(*(qkv[:, :, i].contiguous() for i in range(3)), causal=causal, **ds)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_qkvpacked_bad_inputs_name_the_argument():
    _raises(ValueError, "qkv", fp8attn.flash_attn_qkvpacked_func, torch.zeros(1, 4, 2, 2, 64))  # 2 not 3
    _raises(ValueError, "qkv", fp8attn.flash_attn_qkvpacked_func, torch.zeros(1, 4, 3, 2, 64), num_heads_q=2)
    _raises(ValueError, "num_heads_q", fp8attn.flash_attn_qkvpacked_func, torch.zeros(1, 4, 7, 64))
    _raises(ValueError, "num_heads_q", fp8attn.flash_attn_qkvpacked_func, torch.zeros(1, 4, 7, 64), num_heads_q=2)
    _raises(ValueError, "num_heads_q", fp8attn.flash_attn_qkvpacked_func, torch.zeros(1, 4, 6, 64), num_heads_q=6)
    _raises(ValueError, "qkv", fp8attn.flash_attn_qkvpacked_func, torch.zeros(4, 64))


def _paged_call(g):
    kc = torch.randn(8, 16, 2, 64, generator=g).to(E4M3)
    vc = torch.randn(8, 16, 2, 64, generator=g).to(E4M3)
    pt = torch.randperm(8, generator=g).to(torch.int32).view(2, 4)
    q = torch.randn(2, 1, 4, 64, generator=g).bfloat16()
    return q, kc, vc, pt, torch.tensor([50, 61], dtype=torch.int32)


@pytest.mark.parametrize("splits", [0, 1, 3])
def test_scheduler_metadata_sets_the_split_count(splits):
    g = torch.Generator().manual_seed(6)
    q, kc, vc, pt, lens = _paged_call(g)
    meta = fp8attn.get_scheduler_metadata(2, 1, 64, 4, 2, 64, lens, qkv_dtype=torch.bfloat16, page_size=16,
                                          causal=True, num_splits=splits)
    assert meta.dtype == torch.int32 and meta.shape == (splits,) and meta.device == lens.device
    out, lse = fp8attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=pt, causal=True,
                                               scheduler_metadata=meta, return_softmax_lse=True)
    ref, ref_lse = fp8attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=pt, causal=True,
                                                   num_splits=splits, return_softmax_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    agreeing = fp8attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=pt, causal=True,
                                               scheduler_metadata=meta, num_splits=splits)
    assert torch.equal(agreeing, ref)


def test_scheduler_metadata_bad_inputs_name_the_argument():
    g = torch.Generator().manual_seed(7)
    q, kc, vc, pt, lens = _paged_call(g)
    meta = fp8attn.get_scheduler_metadata(2, 1, 64, 4, 2, 64, lens, num_splits=3)
    call = dict(cache_seqlens=lens, page_table=pt, causal=True)
    _raises(ValueError, "num_splits", fp8attn.flash_attn_with_kvcache, q, kc, vc, scheduler_metadata=meta, num_splits=2,
            **call)
    _raises(ValueError, "scheduler_metadata", fp8attn.flash_attn_with_kvcache, q, kc, vc,
            scheduler_metadata=torch.zeros(3, dtype=torch.int64), **call)
    _raises(ValueError, "scheduler_metadata", fp8attn.flash_attn_with_kvcache, q, kc, vc, scheduler_metadata=[0, 0],
            **call)
    _raises(ValueError, "num_splits", fp8attn.get_scheduler_metadata, 2, 1, 64, 4, 2, 64, lens, num_splits=-1)
    _raises(ValueError, "max_seqlen_k", fp8attn.get_scheduler_metadata, 2, 1, "64", 4, 2, 64, lens)
    _raises(ValueError, "batch_size", fp8attn.get_scheduler_metadata, 2.0, 1, 64, 4, 2, 64, lens)
    assert fp8attn.get_scheduler_metadata(torch.tensor(2), 1, 64, 4, 2, 64, lens, num_splits=2).shape == (2,)
    _raises(TypeError, "cache_seqlens", fp8attn.get_scheduler_metadata, 2, 1, 64, 4, 2, 64, [50, 61])
    _raises(NotImplementedError, "attention_chunk", fp8attn.get_scheduler_metadata, 2, 1, 64, 4, 2, 64, lens,
            attention_chunk=32)
