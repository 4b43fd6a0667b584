"""Chunked prefill on the warp-specialized TMA kernel over a paged FP8 cache (kernels/paged_launch.py).

CPU: the dispatch rules (``unsupported_reason``); test_kernel_dense_tma compiles every variant for sm90
and checks the varlen block list.
GPU (``gpu`` marker): outputs and LSE against the reference from the dequantized cache (shuffled 3x
page pool, NaN in every slot that is not a token, -1 in unused page-table entries, lengths that are
not multiples of 128, sequences shorter than the chunk and empty ones), bit-equality with the dense
TMA kernel on the gathered K/V and of a chunk with the same rows of a single-shot prefill, repeated
runs, the fused FP8 output, CUDA-graph replay at longer lengths, and a cache over 2**31 elements.
Varlen (mixed) batches run on both kernels (short sequences on the Triton kernel): the same checks, and
the TMA rows equal the fixed-length launch of the same sequence. Both V layouts (sequence-major, and
FA3's, transposed in the kernel, with pages of 16 to 256 keys): the same checks, and the bits of one
layout equal the other's.
"""

import math

import pytest
import torch

from fp8attn.kernels.dense import transpose_v_kmajor
from fp8attn.kernels.hopper import dense_launch, paged_launch
from fp8attn.paged_cache import empty_paged
from fp8attn.quant import saturating_cast
from fp8attn.reference import gather_paged
from helpers import (
    assert_row_scaled,
    check_paged,
    cu_from_lens,
    make_cache,
    paged_refs,
    poison_,
    rand_descale,
    replay_at_lengths,
    run_paged,
    v_seq_major_cache,
)

E4M3 = torch.float8_e4m3fn


def _inputs(seqlens, sq, page_size, hq, hk, d, device, v_rows=False):
    """``v_rows``: V in FA3's layout (rows of keys, transposed in the kernel), else sequence-major."""
    c = make_cache(seqlens, page_size, hk, d, device=device)
    c = c if v_rows else v_seq_major_cache(c)
    b = len(seqlens)
    q = saturating_cast(torch.randn(b, sq, hq, d, device=device) * 2, E4M3)
    dk = dict(
        q_descale=rand_descale(b, hk, 0.5, 2.0, device),
        k_descale=rand_descale(b, hk, 0.5, 2.0, device),
        v_descale=rand_descale(b, hk, 0.5, 2.0, device),
    )
    return q, c, dk


def _reason(q, c, *, out=None, lse=None, causal=True, **kw):
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device) if out is None else out
    args = dict(
        cu_seqlens_q=None,
        causal=causal,
        window_size=(-1, -1),
        softcap=0.0,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        k_cache_scales=None,
        v_cache_scales=None,
        out_scale=None,
        num_splits=1,
    )
    args.update(kw)
    return paged_launch.unsupported_reason(
        q, c["k_cache"], c["v_cache"], c["page_table"], c["cache_seqlens"], out, lse, **args
    )


# ------------------------------------------------------------------------------------------ CPU


@pytest.mark.skipif(not dense_launch.HAS_GLUON, reason="needs triton with Gluon")
def test_unsupported_reasons_name_the_rule():
    q, c, dk = _inputs([300, 700], 256, 128, 4, 2, 64, "cpu")
    assert _reason(q, c, **dk) == "inputs must be CUDA tensors"  # every shape rule passed
    cases = [
        (dict(cu_seqlens_q=torch.zeros(3, dtype=torch.int32)), "(total_q, nheads_q, d) with cu_seqlens_q"),
        (dict(num_splits=3), "num_splits=3"),
        (dict(window_size=(64, 0)), "sliding window"),
        (dict(softcap=30.0), "softcap"),
        (dict(k_cache_scales=torch.ones(1)), "per-token-head"),
        (dict(q_descale=torch.ones(2, 3)), "q_descale"),
        (dict(lse=torch.empty(2, 4, 100)), "lse"),
        (dict(out_scale=torch.ones(())), "out_scale"),
    ]
    for kw, words in cases:
        why = _reason(q, c, **kw)
        assert why is not None and words in why, (kw, why)
    assert "float8_e4m3fn" in _reason(q.to(torch.bfloat16), c)
    assert "seqlen_q (200)" in _reason(q[:, :200], c)
    assert "page_size (32)" in _reason(q, v_seq_major_cache(make_cache([300, 700], 32, 2, 64, device="cpu")))
    assert (
        _reason(q, v_seq_major_cache(make_cache([300, 700], 64, 2, 64, device="cpu"))) == "inputs must be CUDA tensors"
    )
    assert [paged_launch.block_n(p) for p in (64, 128, 192, 256)] == [64, 128, 64, 128]
    assert [paged_launch.box_rows(p, False) for p in (64, 128, 192, 256)] == [64, 128, 64, 128]
    # FA3's V layout: 128-key tiles in boxes of up to one page
    assert {paged_launch.block_n(p, True) for p in (16, 32, 64, 128, 192, 256)} == {128}
    assert [paged_launch.box_rows(p, True) for p in (16, 32, 64, 128, 192, 256)] == [16, 32, 64, 128, 64, 128]
    for ps in (16, 32):  # one TMA box per page: FA3's layout only
        assert _reason(q, make_cache([300, 700], ps, 2, 64, device="cpu")) == "inputs must be CUDA tensors"
    assert "page_size (48)" in _reason(q, make_cache([300, 700], 48, 2, 64, device="cpu"))
    assert _reason(q, dict(c, v_cache=c["v_cache"].contiguous())) == "inputs must be CUDA tensors"  # FA3's layout
    nb, ps, hk, d = c["v_cache"].shape
    strided = torch.empty(nb, hk, ps, d, dtype=E4M3).transpose(1, 2)  # neither layout
    assert "sequence-major" in _reason(q, dict(c, v_cache=strided))
    q256, c256, _ = _inputs([300], 128, 128, 2, 2, 256, "cpu")
    assert "head dim" in _reason(q256, c256)
    assert "page_table" in _reason(q, dict(c, page_table=c["page_table"].long()))
    assert "cache_seqlens" in _reason(q, dict(c, cache_seqlens=c["cache_seqlens"].long()))


@pytest.mark.skipif(not dense_launch.HAS_GLUON, reason="needs triton with Gluon")
def test_varlen_unsupported_reasons():
    qlens = [1, 300, 0, 129]
    q, c, dk = _inputs([40, 700, 5, 200], 1, 128, 4, 2, 64, "cpu")
    qv = saturating_cast(torch.randn(sum(qlens), 4, 64), E4M3)
    cu = cu_from_lens(qlens, "cpu")
    out = torch.empty(qv.shape, dtype=torch.bfloat16)

    def reason(**kw):
        args = dict(cu_seqlens_q=cu, out=out, **dk)
        args.update(kw)
        return _reason(qv, c, **args)

    assert reason() == "inputs must be CUDA tensors"  # every shape rule passed
    assert reason(lse=torch.empty(4, sum(qlens))) == "inputs must be CUDA tensors"
    assert "(nheads_q, total_q)" in reason(lse=torch.empty(1, 4, sum(qlens)))
    assert "cu_seqlens_q must be contiguous int32" in reason(cu_seqlens_q=cu.long())
    assert "cu_seqlens_q must be contiguous int32" in reason(cu_seqlens_q=cu[:1])
    assert "num_splits=2" in reason(num_splits=2)
    assert "shape mismatch" in reason(out=out[:-1])


# ------------------------------------------------------------------------------------------ GPU


def _run(q, c, dk, causal, **kw):
    """``run_paged`` that checks the TMA kernel ran once: on the whole batch, or with ``cu_seqlens_q`` in
    ``kw`` on the sequences of ``VARLEN_MIN_Q`` queries or more."""
    calls = []
    real = paged_launch.launch_paged_prefill_tma

    def spy(*a, **k):
        calls.append(k.get("min_len_q"))
        return real(*a, **k)

    paged_launch.launch_paged_prefill_tma = spy
    try:
        out, lse = run_paged(q, c, causal=causal, **dk, **kw)
    finally:
        paged_launch.launch_paged_prefill_tma = real
    varlen = kw.get("cu_seqlens_q") is not None
    assert calls == [paged_launch.VARLEN_MIN_Q if varlen else None], "the TMA kernel did not run these inputs"
    return out, lse


# (page size, V in FA3's layout): pages of 16 and 32 keys with FA3's layout only
_PAGES = [(64, False), (128, False), (256, False), (16, True), (32, True), (64, True), (128, True), (256, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size, v_rows", _PAGES)
def test_gpu_against_reference(d, causal, page_size, v_rows):
    # lengths past the chunk by 0, 77, 1000 keys, one shorter than the chunk, one empty
    sq = 256
    seqlens = [sq, sq + 77, sq + 1000, 100, 0]
    q, c, dk = _inputs(seqlens, sq, page_size, 8, 2, d, "cuda", v_rows)
    out, lse = _run(q, c, dk, causal)
    ref, ref_lse, lp = paged_refs(q, c, quantize_p=True, causal=causal, **dk)
    check_paged(out, lse, ref, ref_lse, lp, lse_tol=2e-3)
    tri, tri_lse = run_paged(q, c, causal=causal, **dk, config={"tma": False})
    check_paged(tri, tri_lse, ref, ref_lse, lp, lse_tol=2e-3)
    # determinism
    out2, lse2 = _run(q, c, dk, causal)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(lse, lse2)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_bits_equal_dense_tma(d, causal, monkeypatch):
    """Lengths that are multiples of 128: the same tiles in the same order as the dense kernel on the
    gathered K/V, so the same bits (output and LSE). The dense kernel runs its plain K box: key-permuted
    (``dense_launch.kperm_on``, head dim 64 causal) its fp32 row sums add in another order."""
    monkeypatch.setattr(dense_launch, "kperm_on", lambda *args: False)
    b, sq, L, hq, hk = 2, 384, 1152, 8, 2
    q, c, dk = _inputs([L] * b, sq, 128, hq, hk, d, "cuda")
    out, lse = _run(q, c, dk, causal)
    kg, _ = gather_paged(c["k_cache"], c["page_table"], c["cache_seqlens"], L)
    vg, _ = gather_paged(c["v_cache"], c["page_table"], c["cache_seqlens"], L)
    od = torch.empty_like(out)
    ld = torch.empty_like(lse)
    dense_launch.launch_dense_fwd_tma(
        q,
        kg.contiguous(),
        transpose_v_kmajor(vg),
        od,
        ld,
        softmax_scale=d**-0.5,
        causal=causal,
        **{k: v for k, v in dk.items()},
    )
    assert torch.equal(out.view(torch.int16), od.view(torch.int16))
    assert torch.equal(lse, ld)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, v_rows", [(64, False), (128, False), (16, True), (64, True)])
def test_gpu_row_sums_without_lse(page_size, v_rows):
    """A non-causal chunk without an LSE: the kernel sums each row's e4m3 P on the tensor core, so its output
    is the LSE call's up to one factor per row (``assert_row_scaled``; an empty sequence's zero rows aside),
    with NaN past the sequences' ends, masked last tiles and fewer keys than queries; it passes the
    reference rule."""
    sq = 256
    q, c, dk = _inputs([sq, sq + 77, sq + 1000, 100, 0], sq, page_size, 8, 2, 128, "cuda", v_rows)
    out, _ = _run(q, c, dk, False)
    out_rs, _ = _run(q, c, dk, False, with_lse=False)
    assert_row_scaled(out_rs, out)
    ref, _, lp = paged_refs(q, c, quantize_p=True, causal=False, **dk)
    check_paged(out_rs, None, ref, None, lp)


def _repaged(c, page_size):
    """The cache ``c`` (FA3's layout) as pages of ``page_size`` in sequence order, NaN past each end."""
    seqlens = c["cache_seqlens"]
    L = -(-max(int(seqlens.max()), 1) // page_size) * page_size
    b = seqlens.numel()
    kg, _ = gather_paged(c["k_cache"], c["page_table"], seqlens, L)
    vg, _ = gather_paged(c["v_cache"], c["page_table"], seqlens, L)
    dead = torch.arange(L, device=seqlens.device)[None, :] >= seqlens[:, None]
    caches = []
    for t in (kg, vg):  # e4m3, zeros past each end: poison them
        t = t.contiguous()
        t.view(torch.uint8)[dead] = 0x7F  # e4m3 NaN
        caches.append(t.view(b * (L // page_size), page_size, *t.shape[2:]))
    pt = torch.arange(b * (L // page_size), dtype=torch.int32, device=seqlens.device).view(b, -1)
    return dict(c, k_cache=caches[0], v_cache=caches[1], page_table=pt)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
def test_gpu_v_rows_bits_equal_seq_major(page_size):
    """V in FA3's layout, transposed in shared memory, in pages of 16 to 128 keys (128-key tiles, one TMA box
    per page or tile; the page table ending at the last page) gives the bits of the same values
    sequence-major in 128-key pages (the same tiles reach P V), NaN past every sequence's end:
    fixed-length and varlen (the TMA kernel's rows: the Triton kernel that runs the short sequences
    reads the layouts differently)."""
    seqlens, sq = [256, 333, 1256, 100, 0], 256
    c = make_cache(seqlens, page_size, 2, 128, device="cuda", extra_pages=0)
    q = saturating_cast(torch.randn(len(seqlens), sq, 8, 128, device="cuda") * 2, E4M3)
    dk = dict(
        q_descale=rand_descale(len(seqlens), 2, 0.5, 2.0, "cuda"),
        k_descale=rand_descale(len(seqlens), 2, 0.5, 2.0, "cuda"),
        v_descale=rand_descale(len(seqlens), 2, 0.5, 2.0, "cuda"),
    )
    ref = v_seq_major_cache(_repaged(c, 128))
    for causal in (True, False):
        a, la = _run(q, c, dk, causal)
        b, lb = _run(q, ref, dk, causal)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)) and torch.equal(la, lb)
    qv = saturating_cast(torch.randn(sum(_QLENS), 8, 128, device="cuda") * 2, E4M3)
    cv = make_cache(_SEQLENS, page_size, 2, 128, device="cuda", extra_pages=0)
    vk = dict(cu_seqlens_q=cu_from_lens(_QLENS, "cuda"), max_seqlen_q=max(_QLENS))
    dv = dict(
        q_descale=rand_descale(len(_QLENS), 2, 0.5, 2.0, "cuda"),
        k_descale=rand_descale(len(_QLENS), 2, 0.5, 2.0, "cuda"),
        v_descale=rand_descale(len(_QLENS), 2, 0.5, 2.0, "cuda"),
    )
    a, la = _run(qv, cv, dv, True, **vk)
    b, lb = _run(qv, v_seq_major_cache(_repaged(cv, 128)), dv, True, **vk)
    rows = torch.cat([torch.full((n,), n >= paged_launch.VARLEN_MIN_Q) for n in _QLENS]).cuda()
    assert rows.sum() >= 4 * paged_launch.VARLEN_MIN_Q
    assert torch.equal(a[rows].view(torch.int16), b[rows].view(torch.int16)) and torch.equal(la[:, rows], lb[:, rows])


@pytest.mark.gpu
def test_gpu_chunk_equals_single_shot_rows():
    """Chunked prefill: the second 256-query chunk over a 640-key cache gives the bits of those rows
    of a single-shot 640-query prefill (both on the TMA kernel)."""
    L, hq, hk, d = 640, 8, 2, 128
    q, c, dk = _inputs([L], L, 128, hq, hk, d, "cuda")
    full, full_lse = _run(q, c, dk, True)
    part = dict(c, cache_seqlens=torch.tensor([384], dtype=torch.int32, device="cuda"))
    chunk, chunk_lse = _run(q[:, 128:384].contiguous(), part, dk, True)
    assert torch.equal(chunk.view(torch.int16), full[:, 128:384].view(torch.int16))
    assert torch.equal(chunk_lse, full_lse[:, :, 128:384])


@pytest.mark.gpu
def test_gpu_fused_fp8_output():
    q, c, dk = _inputs([700, 1500], 256, 128, 8, 2, 128, "cuda")
    ob, _ = _run(q, c, dk, True)
    o8, _ = _run(q, c, dk, True, out_scale=torch.tensor(0.01, device="cuda"))
    r8 = saturating_cast(ob.float() / 0.01).float()
    assert ((o8.float() - r8).abs() <= 0.125 * r8.abs() + 2**-9).all()  # one e4m3 ulp


@pytest.mark.gpu
@pytest.mark.parametrize("v_rows", [False, True])
def test_gpu_cuda_graph_capture_short_replay_long(v_rows):
    hq, hk, d, sq = 8, 2, 128, 256
    seqlens = [3000, 1300, 4000]
    q, c, dk = _inputs(seqlens, sq, 128, hq, hk, d, "cuda", v_rows)
    out = torch.empty(len(seqlens), sq, hq, d, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(len(seqlens), hq, sq, device="cuda")
    seq_buf = torch.tensor([300, 256, 600], dtype=torch.int32, device="cuda")

    def launch():
        paged_launch.launch_paged_prefill_tma(
            q, c["k_cache"], c["v_cache"], c["page_table"], seq_buf, out, lse, softmax_scale=d**-0.5, causal=True, **dk
        )

    replay_at_lengths(launch, seq_buf, c["cache_seqlens"])
    eo, el = _run(q, c, dk, True)
    assert torch.equal(out.view(torch.int16), eo.view(torch.int16)) and torch.equal(lse, el)


@pytest.mark.gpu
@pytest.mark.parametrize("v_rows", [False, True])
def test_gpu_cache_over_2_31_elements(v_rows):
    hq, hk, d, ps, sq = 8, 8, 128, 128, 128
    nb = (2**31) // (ps * hk * d) + 3
    kc = poison_(torch.empty(nb, ps, hk, d, dtype=E4M3, device="cuda"))
    vc = poison_(empty_paged((nb, ps, hk, d), E4M3, "cuda", seq_major=not v_rows))
    pt = torch.tensor([[nb - 1, nb - 3, 0, -1], [nb - 2, 5, -1, -1]], dtype=torch.int32, device="cuda")
    seqlens = [300, 200]
    for b, L in enumerate(seqlens):
        for i in range(math.ceil(L / ps)):
            n = min(ps, L - i * ps)
            kc[pt[b, i], :n] = saturating_cast(torch.randn(n, hk, d, device="cuda"))
            vc[pt[b, i], :n] = saturating_cast(torch.randn(n, hk, d, device="cuda"))
    c = dict(
        k_cache=kc, v_cache=vc, page_table=pt, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    )
    q = saturating_cast(torch.randn(2, sq, hq, d, device="cuda"))
    dk = dict(
        q_descale=rand_descale(2, hk, 0.5, 2.0, "cuda"),
        k_descale=rand_descale(2, hk, 0.5, 2.0, "cuda"),
        v_descale=rand_descale(2, hk, 0.5, 2.0, "cuda"),
    )
    out, lse = _run(q, c, dk, True)
    ref, ref_lse, lp = paged_refs(q, c, quantize_p=True, causal=True, **dk)
    check_paged(out, lse, ref, ref_lse, lp, lse_tol=2e-3)


# ---- varlen (mixed) batches: sequences of 128+ queries here, the others on the Triton kernel


def _varlen_inputs(seqlens, qlens, page_size, hq, hk, d, v_rows=False):
    c = make_cache(seqlens, page_size, hk, d, device="cuda")
    c = c if v_rows else v_seq_major_cache(c)
    b = len(seqlens)
    q = saturating_cast(torch.randn(sum(qlens), hq, d, device="cuda") * 2, E4M3)
    dk = dict(
        q_descale=rand_descale(b, hk, 0.5, 2.0, "cuda"),
        k_descale=rand_descale(b, hk, 0.5, 2.0, "cuda"),
        v_descale=rand_descale(b, hk, 0.5, 2.0, "cuda"),
    )
    return q, c, dk, dict(cu_seqlens_q=cu_from_lens(qlens, "cuda"), max_seqlen_q=max(qlens))


# decode rows, chunks below / at / past one 128-row block, one empty, one longer than its prefix
_SEQLENS = [1500, 2300, 7, 900, 4000, 513, 128, 127, 0, 260]
_QLENS = [1, 300, 1, 129, 1000, 1, 128, 127, 0, 260]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size, v_rows", _PAGES)
def test_gpu_varlen_against_reference(d, causal, page_size, v_rows):
    q, c, dk, vk = _varlen_inputs(_SEQLENS, _QLENS, page_size, 8, 2, d, v_rows)
    out, lse = _run(q, c, dk, causal, **vk)
    ref, ref_lse, lp = paged_refs(q, c, quantize_p=True, causal=causal, **vk, **dk)
    check_paged(out, lse, ref, ref_lse, lp, lse_tol=2e-3)
    tri, tri_lse = run_paged(q, c, causal=causal, **vk, **dk, config={"tma": False})
    check_paged(tri, tri_lse, ref, ref_lse, lp, lse_tol=2e-3)
    out2, lse2 = _run(q, c, dk, causal, **vk)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(lse, lse2)


@pytest.mark.gpu
@pytest.mark.parametrize("qlens,varlen", [([128, 128], False), ([100, 100], False), ([130, 3], True)])
def test_gpu_p_rounding_is_the_cpu_paths(qlens, varlen):
    """FP8 Q over FA3's layout through the API: the CPU path rounds P as the kernel that runs each row does
    (e4m3 on the TMA kernel: 128-query chunks, a varlen sequence of 128+; fp16 on the Triton kernel: 100
    queries, a varlen sequence of 3), so the GPU output sits much closer to the CPU path's than to the
    other rounding. The kernels round P against the running max of its 128-key tile, the reference against
    the row's max: over more tiles the two e4m3 roundings part as far as e4m3 and fp16 do (a row max
    moving after its first tile re-grids every earlier P). Keys of 130 and 140 keep nearly every row
    within one tile."""
    from fp8attn import flash_attn_with_kvcache
    from fp8attn.reference import paged_attention_ref

    hq, hk, d = 4, 2, 64
    c = make_cache([130, 140], 16, hk, d, device="cuda")
    q = saturating_cast(torch.randn(sum(qlens), hq, d, device="cuda") * 2, E4M3)
    q = q if varlen else q.view(2, qlens[0], hq, d)
    dk = dict(
        q_descale=rand_descale(2, hk, 0.5, 2.0, "cuda"),
        k_descale=rand_descale(2, hk, 0.5, 2.0, "cuda"),
        v_descale=rand_descale(2, hk, 0.5, 2.0, "cuda"),
    )
    vk = dict(cu_seqlens_q=cu_from_lens(qlens, "cuda"), max_seqlen_q=max(qlens)) if varlen else {}
    args = (q, c["k_cache"], c["v_cache"])
    kw = dict(cache_seqlens=c["cache_seqlens"], page_table=c["page_table"], causal=True, **dk, **vk)
    gpu = flash_attn_with_kvcache(*args, **kw).float().cpu()
    cpu_kw = {k: v.cpu() if torch.is_tensor(v) else v for k, v in kw.items()}
    cpu = flash_attn_with_kvcache(*(t.cpu() for t in args), **cpu_kw).float()
    tma_rows = torch.cat([torch.full((n,), n >= paged_launch.VARLEN_MIN_Q) for n in qlens])
    tma_rows = tma_rows if varlen else tma_rows.view(2, qlens[0])
    ref_kw = {k: v for k, v in cpu_kw.items() if k not in ("cache_seqlens", "page_table")}
    rargs = (args[0].cpu(), c["k_cache"].cpu(), c["v_cache"].cpu(), cpu_kw["page_table"], cpu_kw["cache_seqlens"])
    e4m3 = paged_attention_ref(*rargs, out_dtype=torch.float32, quantize_p=True, **ref_kw)
    fp16 = paged_attention_ref(*rargs, out_dtype=torch.float32, p_dtype=torch.float16, **ref_kw)
    other = torch.where(tma_rows[..., None, None], fp16, e4m3)  # the rounding the row does not get
    # relative L2 per group of rows: a max-abs gap is one P element whose e4m3 rounding flips between the
    # GPU's exp2 and the CPU's, or one bf16 output ulp, either as large as the gap between the roundings
    for kind, rows in (("e4m3", tma_rows), ("fp16", ~tma_rows)):
        if rows.any():
            g, cp, ot = gpu[rows], cpu[rows], other[rows]
            near, far = ((g - cp).norm() / cp.norm()).item(), ((g - ot).norm() / cp.norm()).item()
            assert near < 0.5 * far, (kind, near, far)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_varlen_rows_equal_fixed_length_launch(causal):
    """A sequence's rows in a varlen batch are the bits of the fixed-length TMA launch of it alone (the
    same query blocks and KV tiles), beside decode rows."""
    d, hq, hk = 128, 8, 2
    qlens, seqlens = [1, 256, 1, 384, 128], [900, 1000, 5, 2000, 128]
    q, c, dk, vk = _varlen_inputs(seqlens, qlens, 128, hq, hk, d)
    out, lse = _run(q, c, dk, causal, **vk)
    cu = vk["cu_seqlens_q"].tolist()
    for b in (1, 3, 4):
        s, e = cu[b], cu[b + 1]
        cb = dict(c, page_table=c["page_table"][b : b + 1].contiguous(), cache_seqlens=c["cache_seqlens"][b : b + 1])
        ob, lb = _run(q[None, s:e].contiguous(), cb, {k: v[b : b + 1] for k, v in dk.items()}, causal)
        assert torch.equal(ob[0].view(torch.int16), out[s:e].view(torch.int16)), b
        assert torch.equal(lb[0], lse[:, s:e]), b


@pytest.mark.gpu
def test_gpu_varlen_fused_fp8_output():
    q, c, dk, vk = _varlen_inputs(_SEQLENS, _QLENS, 128, 8, 2, 128)
    ob, _ = _run(q, c, dk, True, **vk)
    o8, _ = _run(q, c, dk, True, **vk, out_scale=torch.tensor(0.01, device="cuda"))
    r8 = saturating_cast(ob.float() / 0.01).float()
    assert ((o8.float() - r8).abs() <= 0.125 * r8.abs() + 2**-9).all()  # one e4m3 ulp


@pytest.mark.gpu
@pytest.mark.parametrize("v_rows", [False, True])
def test_gpu_varlen_cuda_graph_capture_short_replay_long(v_rows):
    from fp8attn.kernels.paged import launch_paged_fwd

    hq, hk, d = 8, 2, 128
    qlens = [1, 256, 1, 300]
    seqlens = [3000, 1300, 700, 4000]
    q, c, dk, vk = _varlen_inputs(seqlens, qlens, 128, hq, hk, d, v_rows)
    out = torch.empty(q.shape, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(hq, q.shape[0], device="cuda")
    seq_buf = torch.tensor([300, 256, 1, 400], dtype=torch.int32, device="cuda")

    def launch():
        launch_paged_fwd(
            q,
            c["k_cache"],
            c["v_cache"],
            c["page_table"],
            seq_buf,
            out,
            lse,
            softmax_scale=d**-0.5,
            causal=True,
            **vk,
            **dk,
        )

    replay_at_lengths(launch, seq_buf, c["cache_seqlens"])
    eo, el = _run(q, c, dk, True, **vk)
    assert torch.equal(out.view(torch.int16), eo.view(torch.int16)) and torch.equal(lse, el)
