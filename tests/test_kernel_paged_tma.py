"""Chunked prefill on the warp-specialized TMA kernel over a paged FP8 cache (kernels/paged_tma.py).

CPU: the dispatch rules (``unsupported_reason``); test_kernel_dense_tma compiles every variant for sm90.
GPU (``gpu`` marker): outputs and LSE against the reference from the dequantized cache (shuffled 3x
page pool, NaN in every slot that is not a token, -1 in unused page-table entries, lengths that are
not multiples of 128, sequences shorter than the chunk and empty ones), bit-equality with the dense
TMA kernel on the gathered K/V and of a chunk with the same rows of a single-shot prefill, repeated
runs, the fused FP8 output, CUDA-graph replay at longer lengths, and a cache over 2**31 elements.
"""
import math

import pytest
import torch

from test_kernel_paged import (_v_seq_major, check, make_cache, poison_, rand_descale, refs,
                               replay_at_lengths, run_paged)
from fp8attn.kernels import dense_tma, paged_tma
from fp8attn.kernels.dense import transpose_v_kmajor
from fp8attn.paged import empty_paged
from fp8attn.quant import saturating_cast
from fp8attn.reference import gather_paged

E4M3 = torch.float8_e4m3fn


def _inputs(seqlens, sq, page_size, hq, hk, d, device):
    c = _v_seq_major(make_cache(seqlens, page_size, hk, d, device=device))
    b = len(seqlens)
    q = saturating_cast(torch.randn(b, sq, hq, d, device=device) * 2, E4M3)
    dk = dict(q_descale=rand_descale(b, hk, device), k_descale=rand_descale(b, hk, device),
              v_descale=rand_descale(b, hk, device))
    return q, c, dk


def _reason(q, c, *, out=None, lse=None, causal=True, **kw):
    b, sq, hq, d = q.shape
    out = torch.empty(b, sq, hq, d, dtype=torch.bfloat16, device=q.device) if out is None else out
    args = dict(cu_seqlens_q=None, causal=causal, window_size=(-1, -1), softcap=0.0, q_descale=None,
                k_descale=None, v_descale=None, k_cache_scales=None, v_cache_scales=None, out_scale=None,
                num_splits=1)
    args.update(kw)
    return paged_tma.unsupported_reason(q, c["k_cache"], c["v_cache"], c["page_table"], c["cache_seqlens"], out, lse,
                                        **args)


# ------------------------------------------------------------------------------------------ CPU


@pytest.mark.skipif(not dense_tma.HAS_GLUON, reason="needs triton with Gluon")
def test_unsupported_reasons_name_the_rule():
    q, c, dk = _inputs([300, 700], 256, 128, 4, 2, 64, "cpu")
    assert _reason(q, c, **dk) == "inputs must be CUDA tensors"  # every shape rule passed
    cases = [
        (dict(cu_seqlens_q=torch.zeros(3, dtype=torch.int32)), "varlen"),
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
    assert "page_size (32)" in _reason(q, _v_seq_major(make_cache([300, 700], 32, 2, 64, device="cpu")))
    assert _reason(q, _v_seq_major(make_cache([300, 700], 64, 2, 64, device="cpu"))) == "inputs must be CUDA tensors"
    assert [paged_tma.block_n(p) for p in (64, 128, 192, 256)] == [64, 128, 64, 128]
    assert "sequence-major" in _reason(q, dict(c, v_cache=c["v_cache"].contiguous()))
    q256, c256, _ = _inputs([300], 128, 128, 2, 2, 256, "cpu")
    assert "head dim" in _reason(q256, c256)
    assert "page_table" in _reason(q, dict(c, page_table=c["page_table"].long()))
    assert "cache_seqlens" in _reason(q, dict(c, cache_seqlens=c["cache_seqlens"].long()))


# ------------------------------------------------------------------------------------------ GPU


def _run(q, c, dk, causal, **kw):
    calls = []
    real = paged_tma.launch_paged_prefill_tma

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    paged_tma.launch_paged_prefill_tma = spy
    try:
        out, lse = run_paged(q, c, causal=causal, **dk, **kw)
    finally:
        paged_tma.launch_paged_prefill_tma = real
    assert calls == [1], "the TMA kernel did not run these inputs"
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size", [64, 128, 256])
def test_gpu_against_reference(d, causal, page_size):
    # lengths past the chunk by 0, 77, 1000 keys, one shorter than the chunk, one empty
    sq = 256
    seqlens = [sq, sq + 77, sq + 1000, 100, 0]
    q, c, dk = _inputs(seqlens, sq, page_size, 8, 2, d, "cuda")
    out, lse = _run(q, c, dk, causal)
    ref, ref_lse, lp = refs(q, c, quantize_p=True, causal=causal, **dk)
    check(out, lse, ref, ref_lse, lp, lse_tol=2e-3)
    tri, tri_lse = run_paged(q, c, causal=causal, **dk, config={"tma": False})
    check(tri, tri_lse, ref, ref_lse, lp, lse_tol=2e-3)
    # determinism
    out2, lse2 = _run(q, c, dk, causal)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(lse, lse2)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_bits_equal_dense_tma(d, causal):
    """Lengths that are multiples of 128: the same tiles in the same order as the dense kernel on the
    gathered K/V, so the same bits (output and LSE)."""
    b, sq, L, hq, hk = 2, 384, 1152, 8, 2
    q, c, dk = _inputs([L] * b, sq, 128, hq, hk, d, "cuda")
    out, lse = _run(q, c, dk, causal)
    kg, _ = gather_paged(c["k_cache"], c["page_table"], c["cache_seqlens"], L)
    vg, _ = gather_paged(c["v_cache"], c["page_table"], c["cache_seqlens"], L)
    od = torch.empty_like(out)
    ld = torch.empty_like(lse)
    dense_tma.launch_dense_fwd_tma(q, kg.contiguous(), transpose_v_kmajor(vg), od, ld, softmax_scale=d ** -0.5,
                                   causal=causal, **{k: v for k, v in dk.items()})
    assert torch.equal(out.view(torch.int16), od.view(torch.int16))
    assert torch.equal(lse, ld)


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
    assert ((o8.float() - r8).abs() <= 0.125 * r8.abs() + 2 ** -9).all()  # one e4m3 ulp


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_short_replay_long():
    hq, hk, d, sq = 8, 2, 128, 256
    seqlens = [3000, 1300, 4000]
    q, c, dk = _inputs(seqlens, sq, 128, hq, hk, d, "cuda")
    out = torch.empty(len(seqlens), sq, hq, d, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(len(seqlens), hq, sq, device="cuda")
    seq_buf = torch.tensor([300, 256, 600], dtype=torch.int32, device="cuda")

    def launch():
        paged_tma.launch_paged_prefill_tma(q, c["k_cache"], c["v_cache"], c["page_table"], seq_buf, out, lse,
                                           softmax_scale=d ** -0.5, causal=True, **dk)

    replay_at_lengths(launch, seq_buf, c["cache_seqlens"])
    eo, el = _run(q, c, dk, True)
    assert torch.equal(out.view(torch.int16), eo.view(torch.int16)) and torch.equal(lse, el)


@pytest.mark.gpu
def test_gpu_cache_over_2_31_elements():
    hq, hk, d, ps, sq = 8, 8, 128, 128, 128
    nb = (2 ** 31) // (ps * hk * d) + 3
    kc = poison_(torch.empty(nb, ps, hk, d, dtype=E4M3, device="cuda"))
    vc = poison_(empty_paged((nb, ps, hk, d), E4M3, "cuda", seq_major=True))
    pt = torch.tensor([[nb - 1, nb - 3, 0, -1], [nb - 2, 5, -1, -1]], dtype=torch.int32, device="cuda")
    seqlens = [300, 200]
    for b, L in enumerate(seqlens):
        for i in range(math.ceil(L / ps)):
            n = min(ps, L - i * ps)
            kc[pt[b, i], :n] = saturating_cast(torch.randn(n, hk, d, device="cuda"))
            vc[pt[b, i], :n] = saturating_cast(torch.randn(n, hk, d, device="cuda"))
    c = dict(k_cache=kc, v_cache=vc, page_table=pt, cache_seqlens=torch.tensor(seqlens, dtype=torch.int32,
                                                                                device="cuda"))
    q = saturating_cast(torch.randn(2, sq, hq, d, device="cuda"))
    dk = dict(q_descale=rand_descale(2, hk, "cuda"), k_descale=rand_descale(2, hk, "cuda"),
              v_descale=rand_descale(2, hk, "cuda"))
    out, lse = _run(q, c, dk, True)
    ref, ref_lse, lp = refs(q, c, quantize_p=True, causal=True, **dk)
    check(out, lse, ref, ref_lse, lp, lse_tol=2e-3)
