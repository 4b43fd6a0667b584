"""Split-KV combine kernel (kernels/combine.py) against ``reference.combine_ref``."""

import pytest
import torch

from fp8attn.kernels.combine import combine_tiles, launch_combine
from fp8attn.quant import saturating_cast
from fp8attn.reference import combine_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _partials(shape_rows, num_splits, d):
    op = torch.randn(num_splits, *shape_rows, d, device=DEV)
    lp = torch.randn(num_splits, *shape_rows, device=DEV) * 3
    empty = torch.rand(num_splits, *shape_rows, device=DEV) < 0.4
    lp = torch.where(empty, torch.full_like(lp, float("-inf")), lp)
    op = torch.where(empty[..., None], torch.full_like(op, float("nan")), op)  # empty splits may hold NaN
    return op, lp


@pytest.mark.parametrize(
    "num_splits,d", [(1, 40), (2, 40), (3, 40), (17, 40), (64, 128), (70, 128), (130, 40), (66, 96)]
)
@pytest.mark.parametrize("varlen", [False, True])
def test_combine_matches_reference(num_splits, d, varlen):
    """70 splits at d128: four programs per row (head-dim slices of 32), one load of 128 split slots
    each; 130 at d40: two slices of 32 (the second mostly masked), two chunks of 128 splits; 66 at d96:
    three slices of 32."""
    rows = (5, 3) if varlen else (2, 3, 4)
    op, lp = _partials(rows, num_splits, d)
    lp[:, 0, 1] = float("-inf")  # a row whose splits are all empty
    out = torch.full((*rows, d), float("nan"), device=DEV, dtype=torch.bfloat16)
    lse = torch.full(rows, float("nan"), device=DEV)
    launch_combine(op, lp, out, lse)
    ro, rl = combine_ref(op, lp, out_dtype=torch.float32)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[0, 1] == 0).all() and torch.isneginf(lse[0, 1]).all()
    assert torch.allclose(out.float(), ro, atol=2**-7 * ro.abs().max().item() + 1e-6, rtol=0)
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse))
    assert torch.allclose(lse[fin], rl[fin], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize(
    "num_splits,d,tiles",
    [
        (2, 128, (128, 2, 2, 1)),  # few splits: one program per row, one load
        (8, 128, (128, 8, 8, 1)),
        (66, 128, (32, 128, 128, 4)),  # B1/L128k decode: head-dim slices of 32, all splits in one load
        (130, 40, (32, 256, 128, 4)),  # more splits than one load holds: two chunks
        (17, 256, (128, 32, 32, 4)),
    ],
)
def test_combine_tiles(num_splits, d, tiles):
    block_d, block_splits, chunk, nw = combine_tiles(num_splits, d)
    assert (block_d, block_splits, chunk, nw) == tiles
    assert chunk * block_d <= 4096 and block_d >= 32


def test_combine_strided_lse_and_fp8_out():
    """lse written through a transposed view (the paged kernel's (batch, nheads, seqlen) layout)."""
    b, s, h, d = 2, 3, 4, 32
    op, lp = _partials((b, s, h), 3, d)
    lse_bhs = torch.full((b, h, s), float("nan"), device=DEV)
    out = torch.empty((b, s, h, d), device=DEV, dtype=torch.float8_e4m3fn)
    out_scale = torch.tensor(0.05, device=DEV)
    launch_combine(op, lp, out, lse_bhs.transpose(1, 2), out_scale=out_scale)
    ro, rl = combine_ref(op, lp, out_dtype=torch.float32)
    ref8 = saturating_cast(ro / 0.05)
    fin = torch.isfinite(rl)
    assert torch.allclose(lse_bhs.transpose(1, 2)[fin], rl[fin], atol=1e-5)
    o, r = out.float(), ref8.float()
    if DEV == "cuda":  # exact up to one e4m3 ulp (<= 12.5% relative)
        assert ((o - r).abs() <= 0.125 * r.abs() + 2**-9).all()
    else:  # the interpreter's e4m3 cast may drop a carry (a factor 2 on some values)
        assert ((o - r).abs() <= 0.51 * r.abs() + 2**-9).all()
        assert ((o - r).abs() <= 0.0626 * r.abs() + 2**-9).float().mean() > 0.8


def test_combine_zero_splits_row_count():
    op = torch.empty(0, 2, 3, 16, device=DEV)
    lp = torch.empty(0, 2, 3, device=DEV)
    out = torch.full((2, 3, 16), float("nan"), device=DEV)
    lse = torch.empty(2, 3, device=DEV)
    launch_combine(op, lp, out, lse)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("num_splits", [3, 70])
def test_combine_bf16_partials(num_splits):
    """bf16 partials (as the Hopper kernel writes them) merge exactly as their float32 upcast does:
    the kernel and the reference both accumulate in float32."""
    rows, d = (2, 3, 4), 64
    op, lp = _partials(rows, num_splits, d)
    op16 = op.to(torch.bfloat16)
    out = torch.empty((*rows, d), device=DEV, dtype=torch.bfloat16)
    lse = torch.empty(rows, device=DEV)
    launch_combine(op16, lp, out, lse)
    ro, rl = combine_ref(op16.float(), lp, out_dtype=torch.float32)
    assert torch.allclose(out.float(), ro, atol=2**-7 * ro.abs().max().item() + 1e-6, rtol=0)
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse)) and torch.allclose(lse[fin], rl[fin], atol=1e-5, rtol=1e-6)
    o2, _ = combine_ref(op16, lp)
    assert o2.dtype == torch.bfloat16 and torch.allclose(o2.float(), ro, atol=2**-7 * ro.abs().max().item(), rtol=0)
