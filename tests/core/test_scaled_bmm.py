"""fp8attn::scaled_bmm: batched FP8 matmul with per-batch / per-row / per-column scales.

Checked against a float64 product of the dequantized operands with random (never unit) scales, on
the CPU path, through the Triton kernel under TRITON_INTERPRET=1 (small shapes), and on the GPU.
"""

import pytest
import torch

from fp8attn import ops
from fp8attn.scaled_bmm import launch_scaled_bmm, normalize_scales

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(b, m, k, n, dt_a=E4M3, dt_b=E4M3, device="cpu"):
    a = (torch.randn(b, m, k, device=device) * 3).to(dt_a)
    bb = (torch.randn(b, k, n, device=device) * 3).to(dt_b)
    return a, bb


def _oracle(a, b, sa, sb):
    san, sbn = normalize_scales(a, b, sa, sb)
    return (a.double() * san.double()[:, :, None]) @ (b.double() * sbn.double()[:, None, :])


SCALES = {
    "per_tensor": lambda b, m, n: (torch.rand(()) + 0.1, torch.rand(1, 1, 1) + 0.1),
    "per_batch": lambda b, m, n: (torch.rand(b) + 0.1, torch.rand(b, 1, 1) + 0.1),
    "per_row_col": lambda b, m, n: (torch.rand(b, m) * 2 + 0.01, torch.rand(b, 1, n) * 2 + 0.01),
    "per_token_3d": lambda b, m, n: (torch.rand(b, m, 1) * 2 + 0.01, torch.rand(b) + 0.1),
}


@pytest.mark.parametrize("gran", sorted(SCALES))
@pytest.mark.parametrize("shape", [(1, 1, 16, 1), (3, 17, 48, 7), (2, 64, 128, 33)])
@pytest.mark.parametrize("dts", [(E4M3, E4M3), (E5M2, E5M2), (E4M3, E5M2)], ids=["e4m3", "e5m2", "mixed"])
def test_cpu_vs_float64(gran, shape, dts):
    b, m, k, n = shape
    a, bb = _operands(b, m, k, n, *dts)
    sa, sb = SCALES[gran](b, m, n)
    ref = _oracle(a, bb, sa, sb)
    out32 = ops.scaled_bmm(a, bb, sa, sb, torch.float32)
    assert out32.shape == (b, m, n) and out32.dtype == torch.float32
    tol = 1e-6 * (a.double().abs() @ bb.double().abs()).max().item() * max(sa.max().item(), 1) * max(sb.max().item(), 1)
    assert (out32.double() - ref).abs().max().item() <= tol + 1e-12
    out16 = ops.scaled_bmm(a, bb, sa, sb, torch.bfloat16)
    assert out16.dtype == torch.bfloat16
    assert torch.allclose(out16.double(), ref, rtol=2**-8, atol=1e-6 * ref.abs().max().item())


def test_per_row_scales_are_not_per_tensor():
    """A per-row scale must scale rows independently (guards against broadcasting the wrong axis)."""
    a, bb = _operands(2, 4, 16, 5)
    sa = torch.tensor([[1.0, 2.0, 4.0, 8.0], [0.5, 0.25, 3.0, 1.5]])
    base = ops.scaled_bmm(a, bb, torch.ones(()), torch.ones(()), torch.float32)
    out = ops.scaled_bmm(a, bb, sa, torch.ones(()), torch.float32)
    assert torch.equal(out, base * sa[:, :, None])


def test_bad_scale_shapes_raise():
    a, bb = _operands(2, 4, 16, 5)
    with pytest.raises(ValueError, match="scale_a"):
        ops.scaled_bmm(a, bb, torch.rand(2, 5), torch.ones(()), torch.float32)
    with pytest.raises(ValueError, match="scale_b"):
        ops.scaled_bmm(a, bb, torch.ones(()), torch.rand(2, 4, 1), torch.float32)
    with pytest.raises(TypeError, match="float32"):
        ops.scaled_bmm(a, bb, torch.ones((), dtype=torch.float64), torch.ones(()), torch.float32)
    with pytest.raises(ValueError, match="b:"):
        ops.scaled_bmm(a, bb.transpose(1, 2), torch.ones(()), torch.ones(()), torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU only)")
@pytest.mark.parametrize("shape", [(2, 5, 40, 7), (1, 70, 130, 66)])
def test_triton_kernel_interpreter(shape):
    b, m, k, n = shape
    a, bb = _operands(b, m, k, n)
    sa, sb = SCALES["per_row_col"](b, m, n)
    san, sbn = normalize_scales(a, bb, sa, sb)
    out = torch.full((b, m, n), float("nan"), dtype=torch.float32)
    launch_scaled_bmm()(a, bb, san, sbn, out)
    ref = _oracle(a, bb, sa, sb)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("gran", sorted(SCALES))
@pytest.mark.parametrize("shape", [(3, 17, 48, 7), (8, 256, 512, 384), (2, 1, 4096, 128)])
def test_gpu_vs_float64(gran, shape):
    b, m, k, n = shape
    a, bb = _operands(b, m, k, n, device="cuda")
    sa, sb = (s.cuda() for s in SCALES[gran](b, m, n))
    ref = _oracle(a, bb, sa, sb)
    out = ops.scaled_bmm(a, bb, sa, sb, torch.float32)
    err = (out.double() - ref).abs().max().item()
    # Hopper's FP8 MMA accumulates one K tile (128) with a reduced-precision accumulator (~2**-14
    # relative measured); tiles are summed in fp32. Bound: 2**-12 of the |a| @ |b| magnitude.
    san, sbn = normalize_scales(a, bb, sa, sb)
    mag = ((a.double().abs() * san.double()[:, :, None]) @ (bb.double().abs() * sbn.double()[:, None, :])).max().item()
    assert err <= 2**-12 * mag, (err, mag)
    out16 = ops.scaled_bmm(a, bb.transpose(1, 2).contiguous().transpose(1, 2), sa, sb, torch.bfloat16)
    assert torch.allclose(out16.double(), ref, rtol=2**-8, atol=2**-12 * mag)
