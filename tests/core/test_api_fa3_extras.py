"""FA3's flash_attn_qkvpacked_func and get_scheduler_metadata: packed Q/K/V runs flash_attn_func on views of
the packed tensor; the metadata's split count reaches flash_attn_with_kvcache."""

import pytest
import torch

import fp8attn
from helpers import assert_close_fa3, raises_naming

E4M3 = torch.float8_e4m3fn


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
    ref, ref_lse = fp8attn.flash_attn_func(
        qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal, return_attn_probs=True, **kw
    )
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
    raises_naming(ValueError, "qkv", fp8attn.flash_attn_qkvpacked_func, torch.zeros(1, 4, 2, 2, 64))  # 2 not 3
    raises_naming(ValueError, "qkv", fp8attn.flash_attn_qkvpacked_func, torch.zeros(1, 4, 3, 2, 64), num_heads_q=2)
    raises_naming(ValueError, "num_heads_q", fp8attn.flash_attn_qkvpacked_func, torch.zeros(1, 4, 7, 64))
    raises_naming(ValueError, "num_heads_q", fp8attn.flash_attn_qkvpacked_func, torch.zeros(1, 4, 7, 64), num_heads_q=2)
    raises_naming(ValueError, "num_heads_q", fp8attn.flash_attn_qkvpacked_func, torch.zeros(1, 4, 6, 64), num_heads_q=6)
    raises_naming(ValueError, "qkv", fp8attn.flash_attn_qkvpacked_func, torch.zeros(4, 64))


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
    meta = fp8attn.get_scheduler_metadata(
        2, 1, 64, 4, 2, 64, lens, qkv_dtype=torch.bfloat16, page_size=16, causal=True, num_splits=splits
    )
    assert meta.dtype == torch.int32 and meta.shape == (splits,) and meta.device == lens.device
    out, lse = fp8attn.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=lens, page_table=pt, causal=True, scheduler_metadata=meta, return_softmax_lse=True
    )
    ref, ref_lse = fp8attn.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=lens, page_table=pt, causal=True, num_splits=splits, return_softmax_lse=True
    )
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    agreeing = fp8attn.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=lens, page_table=pt, causal=True, scheduler_metadata=meta, num_splits=splits
    )
    assert torch.equal(agreeing, ref)
    # chunked-local attention, as FA3 code runs it: the same attention_chunk to both calls
    meta = fp8attn.get_scheduler_metadata(
        2, 1, 64, 4, 2, 64, lens, page_size=16, causal=True, attention_chunk=32, num_splits=splits
    )
    chunked = dict(cache_seqlens=lens, page_table=pt, causal=True, attention_chunk=32)
    out = fp8attn.flash_attn_with_kvcache(q, kc, vc, scheduler_metadata=meta, **chunked)
    ref = fp8attn.flash_attn_with_kvcache(q, kc, vc, num_splits=splits, **chunked)
    assert torch.equal(out, ref) and not torch.equal(out, agreeing)


def test_scheduler_metadata_bad_inputs_name_the_argument():
    g = torch.Generator().manual_seed(7)
    q, kc, vc, pt, lens = _paged_call(g)
    meta = fp8attn.get_scheduler_metadata(2, 1, 64, 4, 2, 64, lens, num_splits=3)
    call = dict(cache_seqlens=lens, page_table=pt, causal=True)
    raises_naming(
        ValueError,
        "num_splits",
        fp8attn.flash_attn_with_kvcache,
        q,
        kc,
        vc,
        scheduler_metadata=meta,
        num_splits=2,
        **call,
    )
    raises_naming(
        ValueError,
        "scheduler_metadata",
        fp8attn.flash_attn_with_kvcache,
        q,
        kc,
        vc,
        scheduler_metadata=torch.zeros(3, dtype=torch.int64),
        **call,
    )
    raises_naming(
        ValueError, "scheduler_metadata", fp8attn.flash_attn_with_kvcache, q, kc, vc, scheduler_metadata=[0, 0], **call
    )
    raises_naming(ValueError, "num_splits", fp8attn.get_scheduler_metadata, 2, 1, 64, 4, 2, 64, lens, num_splits=-1)
    raises_naming(ValueError, "max_seqlen_k", fp8attn.get_scheduler_metadata, 2, 1, "64", 4, 2, 64, lens)
    raises_naming(ValueError, "batch_size", fp8attn.get_scheduler_metadata, 2.0, 1, 64, 4, 2, 64, lens)
    assert fp8attn.get_scheduler_metadata(torch.tensor(2), 1, 64, 4, 2, 64, lens, num_splits=2).shape == (2,)
    raises_naming(TypeError, "cache_seqlens", fp8attn.get_scheduler_metadata, 2, 1, 64, 4, 2, 64, [50, 61])
    # attention_chunk: checked and accepted (FA3 code passes the call's value); the split count is num_splits's
    assert torch.equal(
        fp8attn.get_scheduler_metadata(2, 1, 64, 4, 2, 64, lens, attention_chunk=32, num_splits=3),
        torch.zeros(3, dtype=torch.int32),
    )
    for bad in (-1, 2.5, True):
        raises_naming(
            ValueError, "attention_chunk", fp8attn.get_scheduler_metadata, 2, 1, 64, 4, 2, 64, lens, attention_chunk=bad
        )


def _chunk_oracle(q, k, v, chunk, causal, window, qd=None, kd=None, vd=None, dtype=torch.float64):
    """Attention of the dequantized inputs with FA3's chunk mask, computed in ``dtype``: (out, lse)."""
    import math

    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    qf, kf, vf = (x.to(torch.float64) for x in (q, k, v))
    if qd is not None:
        qf = qf * qd.double().repeat_interleave(g, 1)[:, None, :, None]
        kf, vf = kf * kd.double()[:, None, :, None], vf * vd.double()[:, None, :, None]
    qf, kf, vf = qf.to(dtype), kf.repeat_interleave(g, 2).to(dtype), vf.repeat_interleave(g, 2).to(dtype)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) / math.sqrt(d)
    pos = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    vis = j // chunk == torch.div(pos, chunk, rounding_mode="floor")
    if causal:
        vis &= j <= pos
    if window[0] >= 0:
        vis &= j >= pos - window[0]
    if window[1] >= 0:
        vis &= j <= pos + window[1]
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s.double(), -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vf), lse


def _chunk_lowprec(q, k, v, chunk, causal, window, descales):
    """The low-precision reference of the tolerance rule for FP8 inputs: each chunk's queries against its keys
    through ``reference.attention_ref`` with P rounded to e4m3, as the kernels round it."""
    from fp8attn.reference import attention_ref

    sq, sk = q.shape[1], k.shape[1]
    shift = sk - sq
    out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    for c in range(min(shift // chunk, 0), (sk - 1) // chunk + 1):
        q0, q1 = max(c * chunk - shift, 0), min((c + 1) * chunk - shift, sq)
        k0, k1 = max(c * chunk, 0), min((c + 1) * chunk, sk)
        if q1 <= q0 or k1 <= k0:
            continue
        out[:, q0:q1] = attention_ref(
            q[:, q0:q1],
            k[:, k0:k1],
            v[:, k0:k1],
            causal=causal,
            window_size=window,
            quantize_p=True,
            compute_dtype=torch.float64,
            out_dtype=torch.float64,
            **descales,
        )
    return out


@pytest.mark.parametrize(
    "sq,sk,chunk,causal,window",
    [
        (37, 37, 8, True, (-1, -1)),  # self-attention, a partial last chunk
        (5, 50, 16, True, (-1, -1)),  # queries in the last chunk only (chunked prefill / decode shape)
        (50, 20, 8, False, (-1, -1)),  # more queries than keys: the first rows lie before key 0 and see nothing
        (30, 45, 7, False, (3, 2)),  # window and chunk intersect
        (20, 100, 32, True, (10, 0)),
        (40, 40, 64, True, (-1, -1)),  # one chunk holds everything: the plain call
    ],
)
@pytest.mark.parametrize("fp8", [False, True])
def test_attention_chunk_matches_the_masked_oracle(sq, sk, chunk, causal, window, fp8):

    g = torch.Generator().manual_seed(9)
    q, k, v = (
        torch.randn(2, sq, 4, 32, generator=g),
        torch.randn(2, sk, 2, 32, generator=g),
        torch.randn(2, sk, 2, 32, generator=g),
    )
    kw = {}
    if fp8:
        q, k, v = (x.to(E4M3) for x in (q, k, v))
        kw = {n: torch.rand(2, 2, generator=g) + 0.5 for n in ("q_descale", "k_descale", "v_descale")}
    else:
        q, k, v = (x.bfloat16() for x in (q, k, v))
    out, lse = fp8attn.flash_attn_func(
        q, k, v, causal=causal, window_size=window, attention_chunk=chunk, return_attn_probs=True, **kw
    )
    descales = [kw.get(n) for n in ("q_descale", "k_descale", "v_descale")]
    ref, ref_lse = _chunk_oracle(q, k, v, chunk, causal, window, *descales)
    low = (
        _chunk_lowprec(q, k, v, chunk, causal, window, kw)
        if fp8
        else _chunk_oracle(q, k, v, chunk, causal, window, dtype=torch.bfloat16)[0]
    )
    assert out.shape == (2, sq, 4, 32) and lse.shape == (2, 4, sq)
    assert_close_fa3(out.float(), ref, low.float(), floor=1e-3)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], atol=2e-2, rtol=0)
    assert (out.float()[~seen.transpose(1, 2)] == 0).all()  # rows that see no key give 0


def test_attention_chunk_writes_out_and_runs_packed():
    g = torch.Generator().manual_seed(10)
    qkv = torch.randn(2, 40, 3, 4, 32, generator=g).bfloat16()
    ref = fp8attn.flash_attn_qkvpacked_func(qkv, causal=True, attention_chunk=16)
    q, k, v = qkv.unbind(2)
    assert torch.equal(ref, fp8attn.flash_attn_func(q, k, v, causal=True, attention_chunk=16))
    out = torch.empty(2, 40, 4, 32, dtype=torch.bfloat16)
    assert fp8attn.flash_attn_func(q, k, v, causal=True, attention_chunk=16, out=out) is out
    assert torch.equal(out, ref)
    strided = torch.empty(2, 4, 40, 32, dtype=torch.bfloat16).transpose(1, 2)  # not viewable as rows
    assert fp8attn.flash_attn_func(q, k, v, causal=True, attention_chunk=16, out=strided) is strided
    assert torch.equal(strided, ref)


def test_attention_chunk_bad_values_and_unsupported_calls():
    q = torch.zeros(1, 8, 2, 32, dtype=torch.bfloat16)
    raises_naming(ValueError, "attention_chunk", fp8attn.flash_attn_func, q, q, q, attention_chunk=-1)
    raises_naming(ValueError, "attention_chunk", fp8attn.flash_attn_func, q, q, q, attention_chunk=2.5)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    raises_naming(
        NotImplementedError,
        "seqused_k",
        fp8attn.flash_attn_varlen_func,
        q[0],
        q[0],
        q[0],
        cu,
        cu,
        8,
        8,
        seqused_k=torch.tensor([6], dtype=torch.int32),
        attention_chunk=4,
    )


@pytest.mark.parametrize("fp8", [False, True])
def test_attention_chunk_varlen_equals_each_sequence_alone(fp8):
    """Varlen chunking (lengths on the device) gives each sequence what the masked oracle gives it alone,
    with empty sequences and sequences of more queries than keys in the batch."""

    g = torch.Generator().manual_seed(13)
    lens = [(10, 37), (0, 5), (25, 25), (7, 3), (1, 70)]
    cu_q = torch.tensor([0] + torch.tensor([a for a, _ in lens]).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor([b for _, b in lens]).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 4, 32, generator=g)
    k, v = torch.randn(int(cu_k[-1]), 2, 32, generator=g), torch.randn(int(cu_k[-1]), 2, 32, generator=g)
    kw = {}
    if fp8:
        q, k, v = (x.to(E4M3) for x in (q, k, v))
        kw = {n: torch.rand(len(lens), 2, generator=g) + 0.5 for n in ("q_descale", "k_descale", "v_descale")}
    else:
        q, k, v = (x.bfloat16() for x in (q, k, v))
    out, lse = fp8attn.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 25, 70, causal=True, attention_chunk=16, return_attn_probs=True, **kw
    )
    for i, (lq, _lk) in enumerate(lens):
        if lq == 0:
            continue
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        ds = {n: t[i : i + 1] for n, t in kw.items()}
        args = (q[None, qs], k[None, ks], v[None, ks])
        ref, ref_lse = _chunk_oracle(
            *args, 16, True, (-1, -1), *[ds.get(n) for n in ("q_descale", "k_descale", "v_descale")]
        )
        low = (
            _chunk_lowprec(*args, 16, True, (-1, -1), ds)
            if fp8
            else _chunk_oracle(*args, 16, True, (-1, -1), dtype=torch.bfloat16)[0]
        )
        assert_close_fa3(out[None, qs].float(), ref, low.float(), floor=1e-3)
        seen = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isfinite(lse[:, qs]), seen)


@pytest.mark.gpu
def test_gpu_attention_chunk_matches_the_masked_oracle():

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 1536, 8, 128, generator=g).to(E4M3) for _ in range(3))
    ds = {n: torch.rand(2, 8, generator=g) + 0.5 for n in ("q_descale", "k_descale", "v_descale")}
    out = fp8attn.flash_attn_func(
        q.cuda(), k.cuda(), v.cuda(), causal=True, attention_chunk=512, **{n: t.cuda() for n, t in ds.items()}
    )
    descales = [ds[n] for n in ("q_descale", "k_descale", "v_descale")]
    ref, _ = _chunk_oracle(q, k, v, 512, True, (-1, -1), *descales)
    low = _chunk_lowprec(q, k, v, 512, True, (-1, -1), ds)
    assert_close_fa3(out.cpu().float(), ref, low.float(), floor=2e-2)


def _gather_keys(cache, pt, length, page_size):
    rows = [cache[int(pt[j // page_size]), j % page_size] for j in range(length)]
    return torch.stack(rows)[None]  # (1, length, hk, d)


@pytest.mark.parametrize("sq", [1, 20])
@pytest.mark.parametrize("layout", ["paged", "paged_seq_major_v", "contiguous"])
def test_attention_chunk_over_a_cache(layout, sq, device="cpu"):
    """Decode rows and prefill chunks (appended) see only their chunk's keys: against the float64 masked oracle.
    The 20-query chunks cross chunk boundaries (positions 4..23, 39..58 and 76..95 with chunks of 32)."""
    from fp8attn.paged_cache import to_v_seq_major

    g = torch.Generator().manual_seed(12)
    B, HQ, HK, D, PS, CH = 3, 4, 2, 32, 16, 32
    lens = torch.tensor([4, 39, 76], dtype=torch.int32)  # before the append of sq tokens
    if layout == "contiguous":
        kc = torch.randn(B, 112, HK, D, generator=g).bfloat16()
        vc = torch.randn(B, 112, HK, D, generator=g).bfloat16()
        pt, kw = None, {}
    else:
        kc = torch.randn(24, PS, HK, D, generator=g).to(E4M3)
        vc = torch.randn(24, PS, HK, D, generator=g).to(E4M3)
        pt = torch.randperm(24, generator=g).to(torch.int32).view(B, 8)
        kw = {"k_descale": torch.rand(B, HK, generator=g) + 0.5, "v_descale": torch.rand(B, HK, generator=g) + 0.5}
        if layout == "paged_seq_major_v":
            vc = to_v_seq_major(vc)
    q = torch.randn(B, sq, HQ, D, generator=g).bfloat16()
    kn, vn = torch.randn(B, sq, HK, D, generator=g).bfloat16(), torch.randn(B, sq, HK, D, generator=g).bfloat16()
    dev = {n: t.to(device) for n, t in (("kc", kc), ("vc", vc), ("q", q), ("kn", kn), ("vn", vn), ("lens", lens))}
    assert dev["vc"].stride() == vc.stride()  # (.to keeps the sequence-major strides)
    pt_dev = pt.to(device) if pt is not None else None
    out = fp8attn.flash_attn_with_kvcache(
        dev["q"],
        dev["kc"],
        dev["vc"],
        k=dev["kn"],
        v=dev["vn"],
        cache_seqlens=dev["lens"],
        page_table=pt_dev,
        causal=True,
        attention_chunk=CH,
        **{n: t.to(device) for n, t in kw.items()},
    )
    out = out.cpu()
    kc, vc = dev["kc"].cpu(), dev["vc"].cpu()  # with the appended tokens (the same tensors on the CPU)
    for b in range(B):
        n = int(lens[b]) + sq
        if pt is None:
            kb, vb = kc[b : b + 1, :n], vc[b : b + 1, :n]
        else:
            kb, vb = _gather_keys(kc, pt[b], n, PS), _gather_keys(vc, pt[b], n, PS)
        ds = [None, kw["k_descale"][b : b + 1], kw["v_descale"][b : b + 1]] if kw else [None, None, None]
        if kw:  # q is 16-bit: its descale is 1
            ds[0] = torch.ones(1, HK)
        ref, _ = _chunk_oracle(q[b : b + 1], kb, vb, CH, True, (-1, -1), *ds)
        low, _ = _chunk_oracle(q[b : b + 1], kb, vb, CH, True, (-1, -1), *ds, dtype=torch.bfloat16)
        assert_close_fa3(out[b : b + 1].float(), ref, low.float(), floor=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("sq", [1, 20])
@pytest.mark.parametrize("layout", ["paged", "paged_seq_major_v", "contiguous"])
def test_gpu_attention_chunk_over_a_cache(layout, sq):
    test_attention_chunk_over_a_cache(layout, sq, device="cuda")


def test_attention_chunk_mixed_batch_equals_its_sequences_alone():
    """A varlen batch of decode rows and a prefill chunk: each sequence as in its own chunked call."""
    g = torch.Generator().manual_seed(14)
    kc = torch.randn(40, 16, 2, 32, generator=g).to(E4M3)
    vc = torch.randn(40, 16, 2, 32, generator=g).to(E4M3)
    pt = torch.randperm(40, generator=g).to(torch.int32).view(4, 10)
    lens = torch.tensor([70, 33, 140, 5], dtype=torch.int32)  # after the queries' own tokens
    qlens = [1, 1, 30, 1]
    cu = torch.tensor([0, 1, 2, 32, 33], dtype=torch.int32)
    q = torch.randn(33, 4, 32, generator=g).bfloat16()
    kd, vd = torch.rand(4, 2, generator=g) + 0.5, torch.rand(4, 2, generator=g) + 0.5
    out = fp8attn.flash_attn_with_kvcache(
        q,
        kc,
        vc,
        cache_seqlens=lens,
        page_table=pt,
        cu_seqlens_q=cu,
        max_seqlen_q=30,
        causal=True,
        attention_chunk=32,
        k_descale=kd,
        v_descale=vd,
    )
    for b in range(4):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        alone = fp8attn.flash_attn_with_kvcache(
            q[None, rows],
            kc,
            vc,
            cache_seqlens=lens[b : b + 1],
            page_table=pt[b : b + 1],
            causal=True,
            attention_chunk=32,
            k_descale=kd[b : b + 1],
            v_descale=vd[b : b + 1],
        )
        torch.testing.assert_close(out[rows].float(), alone[0].float(), atol=1e-2, rtol=1e-2)
    assert qlens == [int(cu[i + 1] - cu[i]) for i in range(4)]


def test_attention_chunk_in_kvcache_rejects_what_it_cannot_run():
    kc = torch.zeros(8, 16, 2, 32, dtype=torch.bfloat16)
    pt = torch.arange(8, dtype=torch.int32).view(2, 4)
    lens = torch.tensor([20, 30], dtype=torch.int32)
    q2 = torch.zeros(2, 2, 4, 32, dtype=torch.bfloat16)  # two queries per sequence, not causal
    raises_naming(
        NotImplementedError,
        "causal",
        fp8attn.flash_attn_with_kvcache,
        q2,
        kc,
        kc.clone(),
        cache_seqlens=lens,
        page_table=pt,
        causal=False,
        attention_chunk=32,
    )
    q1 = q2[:, :1]
    raises_naming(
        NotImplementedError,
        "attention_chunk",
        fp8attn.flash_attn_with_kvcache,
        q1,
        kc,
        kc.clone(),
        cache_seqlens=lens,
        page_table=pt,
        causal=True,
        attention_chunk=24,
    )  # not a multiple of the page
    raises_naming(
        ValueError,
        "attention_chunk",
        fp8attn.flash_attn_with_kvcache,
        q1,
        kc,
        kc.clone(),
        cache_seqlens=lens,
        page_table=pt,
        attention_chunk=-4,
    )
    contiguous = torch.zeros(2, 48, 2, 32, dtype=torch.bfloat16)
    raises_naming(
        NotImplementedError,
        "attention_chunk",
        fp8attn.flash_attn_with_kvcache,
        q1,
        contiguous,
        contiguous.clone(),
        cache_seqlens=lens,
        cache_leftpad=torch.tensor([1, 2], dtype=torch.int32),
        attention_chunk=16,
    )


def test_attention_chunk_over_a_cache_writes_out():
    g = torch.Generator().manual_seed(15)
    kc = torch.randn(16, 16, 2, 32, generator=g).bfloat16()
    vc = torch.randn(16, 16, 2, 32, generator=g).bfloat16()
    pt = torch.randperm(16, generator=g).to(torch.int32).view(2, 8)
    lens = torch.tensor([50, 100], dtype=torch.int32)
    q = torch.randn(2, 20, 4, 32, generator=g).bfloat16()
    call = dict(cache_seqlens=lens, page_table=pt, causal=True, attention_chunk=32)
    ref = fp8attn.flash_attn_with_kvcache(q, kc, vc, **call)
    out = torch.empty_like(ref)
    assert fp8attn.flash_attn_with_kvcache(q, kc, vc, out=out, **call) is out and torch.equal(out, ref)
    strided = torch.empty(2, 4, 20, 32, dtype=torch.bfloat16).transpose(1, 2)  # not viewable as packed rows
    assert fp8attn.flash_attn_with_kvcache(q, kc, vc, out=strided, **call) is strided and torch.equal(strided, ref)


def test_attention_chunk_refused_over_a_cache_writes_nothing():
    """A chunked call the cache path cannot run is refused before its new tokens are written."""
    kc = torch.zeros(8, 16, 2, 32, dtype=torch.bfloat16)
    vc = kc.clone()
    pt = torch.arange(8, dtype=torch.int32).view(2, 4)
    new = torch.ones(2, 2, 2, 32, dtype=torch.bfloat16)
    q = torch.zeros(2, 2, 4, 32, dtype=torch.bfloat16)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    for kw in ({"attention_chunk": 24, "causal": True}, {"attention_chunk": 32, "causal": False}):
        with pytest.raises(NotImplementedError):
            fp8attn.flash_attn_with_kvcache(q, kc, vc, k=new, v=new, cache_seqlens=lens, page_table=pt, **kw)
        assert not kc.any() and not vc.any()
