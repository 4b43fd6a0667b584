"""The fused cache append (kernels/cache.py ``launch_append_kv_cache``, op ``fp8attn::append_kv_cache``).

The one-launch append derives each new token's slot in the kernel; it must leave exactly the cache bytes
that the explicit-slot path leaves (torch slot arithmetic + ``launch_write_kv_cache``), and the op's CPU
reference the same bytes again, for every scale kind, fixed and varlen new tokens, sequence-major V,
NaN-poisoned caches, page sizes 1 and 16 and empty sequences; out-of-range positions and page ids are
skipped (opcheck: tests/core/test_ops.py). GPU tests count the launches of a decode step with an append and
run it under the sync debug mode.
"""

import pytest
import torch

from fp8attn import ops
from fp8attn.kernels.cache import launch_append_kv_cache, launch_write_kv_cache
from fp8attn.paged_cache import slot_mapping_for, to_v_seq_major, token_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HK, D, DV = 2, 16, 8


def _bits(t):
    return (
        t.view(torch.uint8)
        if t.dtype.itemsize == 1
        else t.view(torch.int16)
        if t.dtype.itemsize == 2
        else t.view(torch.int32)
    )


def _poisoned(shape, dtype, seq_major=False):
    c = torch.full(shape, float("nan"), device=DEV).to(dtype)  # (NaN in every FP8 format and 16-bit dtype)
    return to_v_seq_major(c) if seq_major else c


def _case(ps, varlen, dtype, scales, seq_major=False, d=D, dv=DV):
    """Inputs of one append: 3 sequences (cached lengths 0, 5, 17) over a shuffled page pool."""
    batch, max_pages = 3, 3
    nb = batch * max_pages + 2
    cached = torch.tensor([0, 5, 17], dtype=torch.int32)
    if ps == 1:
        cached = torch.tensor([0, 1, 0], dtype=torch.int32)
    pt = torch.randperm(nb)[: batch * max_pages].view(batch, max_pages).to(torch.int32)
    if varlen:
        new = torch.tensor([2, 0, 1], dtype=torch.int32)
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), new.cumsum(0).to(torch.int32)])
        k = torch.randn(int(new.sum()), HK, d) * 3
        v = torch.randn(int(new.sum()), HK, dv) * 3
    else:
        cu = None
        k = torch.randn(batch, 2, HK, d) * 3
        v = torch.randn(batch, 2, HK, dv) * 3
    k, v = k.to(DEV, torch.bfloat16), v.to(DEV, torch.bfloat16)
    kc = _poisoned((nb, ps, HK, d), dtype)
    vc = _poisoned((nb, ps, HK, dv), dtype, seq_major)
    kw = {}
    if scales == "per_tensor":
        kw = dict(k_descale=torch.tensor(0.37, device=DEV), v_descale=torch.tensor([[1.9]], device=DEV))
    elif scales == "per_seq_head":  # (batch, nheads_k) and a stride-0 per-sequence broadcast
        kw = dict(
            k_descale=(torch.rand(batch, HK) * 0.05 + 0.005).to(DEV),
            v_descale=(torch.rand(batch, 1) * 0.05 + 0.005).to(DEV).expand(batch, HK),
        )
    elif scales in ("dynamic", "dynamic_bf16"):
        sdt = torch.bfloat16 if scales == "dynamic_bf16" else torch.float32
        kw = dict(
            k_cache_scales=torch.full((nb, ps, HK), float("nan"), device=DEV, dtype=sdt),
            v_cache_scales=torch.full((nb, ps, HK), float("nan"), device=DEV, dtype=sdt),
        )
    return k, v, kc, vc, pt.to(DEV), cached.to(DEV), cu if cu is None else cu.to(DEV), kw


def _clone(kc, vc, kw):
    vc2 = to_v_seq_major(vc) if vc.stride(1) == 1 and vc.shape[1] > 1 else vc.clone()
    return kc.clone(), vc2, {n: (t.clone() if "scales" in n else t) for n, t in kw.items()}


def _explicit_slots(k, pt, cached, cu, kc):
    """The slots the append path computed with torch ops before the fused kernel, and the tokens' rows."""
    batch = pt.shape[0]
    if cu is None:
        seq, i = token_rows(k.device, batch, seqlen=k.shape[1])
    else:
        seq, i = token_rows(k.device, batch, cu_seqlens=cu, total=k.shape[0])
    return slot_mapping_for(pt, kc.shape[1], seq, cached.long()[seq] + i, kc.shape[0]), seq.to(torch.int32)


def _assert_same(a, b):
    for x, y in zip(a, b):
        if x is not None:
            assert torch.equal(_bits(x.contiguous()), _bits(y.contiguous()))


SCALES = ["copy", "none", "per_tensor", "per_seq_head", "dynamic", "dynamic_bf16"]


@pytest.mark.parametrize("scales,varlen", [(s, i % 2 == 1) for i, s in enumerate(SCALES)] + [("per_seq_head", False)])
def test_append_equals_explicit_slots_and_reference(scales, varlen):
    """Fused kernel == explicit slots + write kernel == the op's CPU reference, bytes of caches and scales."""
    dtype = torch.bfloat16 if scales == "copy" else (E5M2 if scales == "per_tensor" else E4M3)
    ps = 16 if scales in ("per_seq_head", "dynamic", "copy") else 1
    k, v, kc, vc, pt, cached, cu, kw = _case(ps, varlen, dtype, scales, seq_major=scales in ("per_tensor", "dynamic"))
    kc2, vc2, kw2 = _clone(kc, vc, kw)
    kc3, vc3, kw3 = _clone(kc, vc, kw)
    total = launch_append_kv_cache(k, v, kc, vc, pt, cached, cu, **kw)
    slots, seq = _explicit_slots(k, pt, cached, cu, kc)
    k3, v3 = k.reshape(-1, HK, D), v.reshape(-1, HK, DV)
    launch_write_kv_cache(k3, v3, kc2, vc2, slots, token_seq_idx=seq, **kw2)
    _assert_same(
        (kc, vc, kw.get("k_cache_scales"), kw.get("v_cache_scales")),
        (kc2, vc2, kw2.get("k_cache_scales"), kw2.get("v_cache_scales")),
    )
    new = (cu[1:] - cu[:-1]) if varlen else torch.full_like(cached, k.shape[1])
    assert total.dtype == torch.int32 and torch.equal(total, cached + new)
    # the op's CPU reference (torch slots + scatter) leaves the same bytes (bf16 scales aside: the interpreter's
    # bf16 cast truncates where torch rounds, which the storage pad covers, quant.scale_storage_pad)
    if DEV == "cpu" and scales != "dynamic_bf16":
        total3 = ops._append_kv_cache_impl(
            k,
            v,
            kc3,
            vc3,
            pt,
            cached,
            cu,
            kw3.get("k_descale"),
            kw3.get("v_descale"),
            kw3.get("k_cache_scales"),
            kw3.get("v_cache_scales"),
        )
        _assert_same(
            (kc, vc, kw.get("k_cache_scales"), kw.get("v_cache_scales"), total),
            (kc3, vc3, kw3.get("k_cache_scales"), kw3.get("v_cache_scales"), total3),
        )
    # every written slot was poisoned before and holds a value now; the others are untouched (NaN)
    written = slots[slots >= 0]
    assert written.numel() == k3.shape[0]
    flat = kc.float().reshape(-1, HK, D)
    assert not flat[written].isnan().any()
    keep = torch.ones(flat.shape[0], dtype=torch.bool, device=DEV)
    keep[written] = False
    assert flat[keep].isnan().all()


def test_out_of_range_positions_and_pages_are_skipped():
    """Positions past the row's pages, negative positions and page ids outside the cache write nothing (the
    kernel and the reference agree); the lengths after the append still count every new token."""
    ps, nb = 4, 5
    k = torch.randn(4, 1, HK, D).to(DEV, torch.bfloat16)
    v = torch.randn(4, 1, HK, DV).to(DEV, torch.bfloat16)
    # rows: a full row (position 8 == capacity), a negative length, a -1 page, a page id past the cache
    pt = torch.tensor([[0, 1], [2, 2], [-1, 3], [nb, 4]], dtype=torch.int32, device=DEV)
    cached = torch.tensor([8, -1, 1, 2], dtype=torch.int32, device=DEV)
    for impl in (launch_append_kv_cache, ops._append_kv_cache_impl) if DEV == "cpu" else (launch_append_kv_cache,):
        kc, vc = _poisoned((nb, ps, HK, D), E4M3), _poisoned((nb, ps, HK, DV), E4M3)
        desc = torch.tensor(0.5, device=DEV)
        if impl is launch_append_kv_cache:
            total = impl(k, v, kc, vc, pt, cached, None, k_descale=desc, v_descale=desc)
        else:
            total = impl(k, v, kc, vc, pt, cached, None, desc, desc, None, None)
        assert total.tolist() == [9, 0, 2, 3]
        assert kc.float().isnan().all() and vc.float().isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["per_seq_head", "dynamic"])
def test_gpu_decode_append_is_one_launch_without_sync(scales):
    """flash_attn_with_kvcache with a one-token append (validate=False): the append is one kernel launch, the
    whole call runs under the sync debug mode "error" (no host sync), and the result equals a call without the
    append over the cache filled by the previous path."""
    from torch.profiler import ProfilerActivity, profile

    import fp8attn

    torch.manual_seed(0)
    hq, ps, d = 8, 16, 64
    k, v, kc, vc, pt, cached, cu, kw = _case(ps, False, E4M3, scales, d=d, dv=d)
    k, v = k[:, :1], v[:, :1]  # (one new token per sequence; a strided view)
    q = torch.randn(3, 1, hq, d, device=DEV, dtype=torch.bfloat16)
    kc = kc.float().nan_to_num(0.0).to(E4M3)
    vc = vc.float().nan_to_num(0.0).to(E4M3)
    kw = {n: t.nan_to_num(1.0) if "scales" in n else t for n, t in kw.items()}
    kc2, vc2, kw2 = _clone(kc, vc, kw)
    call = dict(cache_seqlens=cached, page_table=pt, **kw)
    fp8attn.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k=k, v=v, **call)  # warm-up (compiles)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")  # (synchronize itself counts as a sync: outside)
        try:
            out = fp8attn.flash_attn_with_kvcache(q, kc, vc, k=k, v=v, **call)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    appends = [n for n in names if "_append_kv_kernel" in n]
    assert len(appends) == 1, names
    assert not any("_write_kv_kernel" in n for n in names), names
    # the previous path: explicit slots + write kernel, then attention over the grown cache
    slots, seq = _explicit_slots(k, pt, cached, None, kc)
    launch_write_kv_cache(k.reshape(-1, HK, d), v.reshape(-1, HK, d), kc2, vc2, slots, token_seq_idx=seq, **kw2)
    _assert_same(
        (kc, vc, kw.get("k_cache_scales"), kw.get("v_cache_scales")),
        (kc2, vc2, kw2.get("k_cache_scales"), kw2.get("v_cache_scales")),
    )
    ref = fp8attn.flash_attn_with_kvcache(q, kc2, vc2, cache_seqlens=cached + 1, page_table=pt, **kw2)
    assert torch.equal(out, ref)
