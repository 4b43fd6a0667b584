"""Per-block Q/K descales through the public API (quantize_qkv(granularity="per_block") -> flash_attn_*)."""

import pytest
import torch

import fp8attn
from fp8attn.reference import attention_ref, varlen_attention_ref
from helpers import rel_err

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_per_block_equals_per_head_when_blocks_agree(device, causal):
    if device == "cuda":
        pytest.importorskip("triton")
    q, k, v = (torch.randn(2, s, h, 64, device=device) for s, h in ((100, 4), (130, 2), (130, 2)))
    q8, k8, v8, qd, kd, vd = fp8attn.quantize_qkv(q, k, v, granularity="per_head")
    qb = qd.repeat_interleave(2, dim=1)[:, :, None].expand(2, 4, 4).contiguous()
    kb = kd[:, :, None].expand(2, 2, 5).contiguous()
    a = fp8attn.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    b = fp8attn.flash_attn_func(
        q8, k8, v8, causal=causal, q_descale=qb, k_descale=kb, v_descale=vd, descale_block_size=32
    )
    # The two paths apply the same descales in a different order (per head vs per token), so a last-bit
    # difference can move an element of P to the next e4m3 value: bit equality held with one CPU build
    # of torch (2.13) and not with another (2.11 on the H200 host), so both devices use the GPU's tolerance.
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_per_block_with_outlier_blocks_beats_per_tensor(device):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 256, 2, 64, generator=g) for _ in range(3))
    k[:, 128:] *= 30.0  # one block range with a much larger amax
    q, k, v = q.to(device), k.to(device), v.to(device)
    ref = attention_ref(q.double(), k.double(), v.double(), compute_dtype=torch.float64)
    errs = {}
    for gran in ("per_tensor", "per_block"):
        q8, k8, v8, qd, kd, vd = fp8attn.quantize_qkv(q, k, v, granularity=gran, block_size=64)
        kw = {"descale_block_size": 64} if gran == "per_block" else {}
        o = fp8attn.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **kw)
        assert not torch.isnan(o).any()
        errs[gran] = rel_err(o, ref)
    assert errs["per_block"] <= errs["per_tensor"] * 1.05, errs


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_per_block_matches_reference(device):
    g = torch.Generator().manual_seed(2)
    cu_q = torch.tensor([0, 70, 70, 150], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 90, 100, 230], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(n, h, 64, generator=g).to(device) for n, h in ((150, 4), (230, 2), (230, 2)))
    q8, k8, v8, qd, kd, vd = fp8attn.quantize_qkv(q, k, v, granularity="per_block", block_size=32)
    o = fp8attn.flash_attn_varlen_func(
        q8,
        k8,
        v8,
        cu_q,
        cu_k,
        80,
        130,
        causal=True,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd.expand(3, 2),
        descale_block_size=32,
    )
    ref = varlen_attention_ref(
        q.double(), k.double(), v.double(), cu_q, cu_k, 80, 130, causal=True, compute_dtype=torch.float64
    )
    assert not torch.isnan(o).any()
    assert rel_err(o, ref) < 0.08


def test_bad_block_descales_name_the_argument():
    q8 = torch.randn(1, 64, 2, 64).to(torch.float8_e4m3fn)
    good = torch.ones(1, 2, 2)
    with pytest.raises(ValueError, match="descale_block_size"):
        fp8attn.flash_attn_func(q8, q8, q8, q_descale=good, k_descale=good, descale_block_size=48)
    with pytest.raises(ValueError, match="q_descale"):
        fp8attn.flash_attn_func(q8, q8, q8, q_descale=torch.ones(1, 2), k_descale=good, descale_block_size=32)
    with pytest.raises(ValueError, match="k_descale"):
        fp8attn.flash_attn_func(q8, q8, q8, q_descale=good, k_descale=torch.ones(1, 2, 3), descale_block_size=32)


def test_kernel_varlen_per_block_indexes_packed_tokens():
    """The Triton kernel (interpreter on CPU, compiled on GPU) reads per-block descales of a multi-sequence
    varlen batch by packed token index, like the reference."""
    pytest.importorskip("triton")
    from fp8attn.kernels.dense import launch_dense_fwd

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    cu_q = torch.tensor([0, 40, 40, 90], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 50, 60, 140], dtype=torch.int32, device=dev)
    q, k, v = (torch.randn(n, h, 64, generator=g).to(dev) for n, h in ((90, 2), (140, 1), (140, 1)))
    k[60:] *= 8.0  # the last sequence's blocks carry much larger descales
    q8, k8, v8, qd, kd, vd = fp8attn.quantize_qkv(q, k, v, granularity="per_block", block_size=16)
    out = torch.empty(90, 2, 64, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(2, 90, device=dev)
    launch_dense_fwd(
        q8,
        k8,
        v8,
        out,
        lse,
        softmax_scale=0.125,
        causal=True,
        window_size=(-1, 0),
        softcap=0.0,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd.expand(3, 1),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=50,
        max_seqlen_k=80,
        descale_block_q=16,
        descale_block_k=16,
    )
    ref = fp8attn.flash_attn_varlen_func(
        q8.cpu(),
        k8.cpu(),
        v8.cpu(),
        cu_q.cpu(),
        cu_k.cpu(),
        50,
        80,
        causal=True,
        q_descale=qd.cpu(),
        k_descale=kd.cpu(),
        v_descale=vd.cpu().expand(3, 1),
        descale_block_size=16,
    )
    err = (out.cpu().float() - ref.float()).abs().max().item()
    assert err < 0.05, err
