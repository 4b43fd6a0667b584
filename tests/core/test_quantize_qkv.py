"""quantize_qkv: Triton kernel (interpreter on CPU) vs the torch path vs fp8attn.quant; Hadamard."""

import math

import pytest
import torch

from fp8attn import hadamard as had
from fp8attn.qkv import quantize_qkv
from fp8attn.quant import quantize

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(b=2, sq=37, sk=45, hq=4, hk=2, d=64, dtype=torch.bfloat16):
    q = torch.randn(b, sq, hq, d, device=DEV) * 2
    k = torch.randn(b, sk, hk, d, device=DEV)
    v = torch.randn(b, sk, hk, d, device=DEV) * 3
    q[0, 3, 1, 5] = 60.0  # outliers
    k[1, 7, 0, 9] = -40.0
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("d", [64, 128])
def test_rotation_orthogonal_and_preserves_qk(d):
    r = had.rotation_matrix(d, dtype=torch.float64)
    torch.testing.assert_close(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    assert not torch.equal(r, had.rotation_matrix(d, seed=1, dtype=torch.float64))
    q, k = torch.randn(5, d, dtype=torch.float64), torch.randn(7, d, dtype=torch.float64)
    torch.testing.assert_close((q @ r) @ (k @ r).T, q @ k.T)
    assert had.hadamard_block_size(192) == 64


@pytest.mark.parametrize("granularity", ["per_tensor", "per_head", "per_block"])
@pytest.mark.parametrize("hadamard", [False, True])
def test_triton_matches_torch(granularity, hadamard):
    q, k, v = _qkv()
    kw = dict(granularity=granularity, hadamard=hadamard, block_size=16)
    t = quantize_qkv(q, k, v, backend="triton", **kw)
    c = quantize_qkv(q, k, v, backend="torch", **kw)
    for a, b_ in zip(t[3:], c[3:]):
        assert a.shape == b_.shape
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=0)
    for a, b_, _ds in zip(t[:3], c[:3], c[3:]):
        assert a.dtype == torch.float8_e4m3fn and a.shape == b_.shape
        # identical up to one e4m3 ulp (the rotation's fp32 sums may round differently)
        fa, fb = a.float(), b_.float()
        ulp = torch.exp2(torch.floor(torch.log2(fb.abs().clamp_min(2.0**-6))) - 3)
        assert ((fa - fb).abs() <= ulp).all()


def test_descale_shapes_and_values_match_quant_module():
    q, k, v = _qkv()
    b, sq, hq, d = q.shape
    hk = k.shape[2]
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, "per_head", backend="torch")
    assert qd.shape == kd.shape == vd.shape == (b, hk)
    # K and V (no GQA grouping) match fp8attn.quant exactly
    k8r, kdr = quantize(k, "per_head")
    torch.testing.assert_close(kd, kdr)
    assert torch.equal(k8.view(torch.uint8), k8r.view(torch.uint8))
    # Q's descale spans the group of query heads of each kv head
    amax = q.float().abs().amax(dim=(1, 3)).view(b, hk, hq // hk).amax(-1)
    torch.testing.assert_close(qd, amax / 448.0)
    _, _, _, qt, kt, vt = quantize_qkv(q, k, v, "per_tensor", backend="torch")
    assert qt.shape == (b, hk) and qt.stride() == (0, 0)
    torch.testing.assert_close(qt[0, 0], q.float().abs().max() / 448.0)
    _, _, _, qb, kb, vb = quantize_qkv(q, k, v, "per_block", block_size=16, backend="torch")
    assert qb.shape == (b, hq, math.ceil(sq / 16)) and kb.shape == (b, hk, math.ceil(k.shape[1] / 16))
    assert vb.shape == (b, hk)
    kbr = quantize(k, "per_block", block_size=16)[1]
    torch.testing.assert_close(kb, kbr)


def test_zero_input_descale_floor_and_varlen():
    q = torch.zeros(30, 2, 64, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(40, 1, 64, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(40, 1, 64, device=DEV, dtype=torch.bfloat16)
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, "per_head", backend="triton")
    assert q8.shape == q.shape and qd.shape == (1, 1)
    assert (qd > 0).all() and torch.isfinite(qd).all() and (q8.float() == 0).all()


@pytest.mark.parametrize("hadamard", [False, True])
def test_roundtrip_error_and_hadamard_helps_with_outliers(hadamard):
    torch.manual_seed(1)
    b, s, h, d = 1, 64, 2, 64
    x = torch.randn(b, s, h, d)  # drawn on the CPU: the same outliers on every device
    x = (x + torch.randn_like(x) * 10 * (torch.rand_like(x) < 0.01)).to(DEV)
    q8, k8, v8, qd, kd, vd = quantize_qkv(x, x, x, "per_head", hadamard=hadamard, backend="triton")
    deq = q8.float() * qd[:, None, :, None]
    target = had.rotate(x) if hadamard else x
    rel = ((deq - target).norm() / target.norm()).item()
    assert rel < 0.05
    if hadamard:
        plain = quantize_qkv(x, x, x, "per_head", backend="triton")
        deq0 = plain[0].float() * plain[3][:, None, :, None]
        rel0 = ((deq0 - x).norm() / x.norm()).item()
        assert rel < rel0


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["per_tensor", "per_head", "per_block"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_triton_matches_torch(granularity, d):
    q, k, v = _qkv(b=2, sq=1000, sk=1500, hq=8, hk=2, d=d)
    for hadamard in (False, True):
        kw = dict(granularity=granularity, hadamard=hadamard, block_size=128)
        t = quantize_qkv(q, k, v, backend="triton", **kw)
        c = quantize_qkv(q, k, v, backend="torch", **kw)
        for a, b_ in zip(t[3:], c[3:]):
            torch.testing.assert_close(a, b_, rtol=1e-5, atol=0)
        for a, b_ in zip(t[:3], c[:3]):
            fa, fb = a.float(), b_.float()
            ulp = torch.exp2(torch.floor(torch.log2(fb.abs().clamp_min(2.0**-6))) - 3)
            assert ((fa - fb).abs() <= ulp).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("varlen", [False, True])
def test_v_layout_seq_major_default(backend, varlen):
    """v8 defaults to a sequence-contiguous memory order (written in the quantize pass itself) with the
    same values as the row-major layout; q8/k8 stay contiguous; a bad v_layout names the choices."""
    q, k, v = _qkv()
    if varlen:
        q, k, v = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    sm = quantize_qkv(q, k, v, backend=backend)
    rm = quantize_qkv(q, k, v, backend=backend, v_layout="contiguous")
    v8 = sm[2]
    assert v8.shape == v.shape and v8.stride(-3) == 1 and not v8.is_contiguous()
    assert rm[2].is_contiguous() and sm[0].is_contiguous() and sm[1].is_contiguous()
    assert torch.equal(v8.contiguous().view(torch.uint8), rm[2].view(torch.uint8))
    for a, b_ in zip(sm[3:], rm[3:]):
        assert torch.equal(a, b_)
    with pytest.raises(ValueError, match="v_layout"):
        quantize_qkv(q, k, v, v_layout="kmajor")


def test_inputs_on_different_devices_are_rejected_by_name():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match=r"^k: expected device cpu \(as q\), got meta"):
        quantize_qkv(q, q.to("meta"), q)
    with pytest.raises(ValueError, match=r"^v: expected device cpu"):
        quantize_qkv(q, q, q.to("meta"))
