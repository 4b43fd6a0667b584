"""fp8attn.quant: formats, saturating casts, NaN encodings, granularities, floors, static vs dynamic."""

import math

import pytest
import torch

import fp8attn
from fp8attn import quant
from fp8attn.quant import (
    DESCALE_FLOOR,
    compute_descale,
    dequantize,
    descale_for_tokens,
    expand_descale,
    fp8_max,
    quantize,
    saturating_cast,
)

E4M3, E5M2, FNUZ = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz
FORMATS = [E4M3, E5M2, FNUZ]
# relative half-ulp of normal numbers (mantissa bits 3, 2, 3) and the smallest subnormal step
HALF_ULP = {E4M3: 2.0**-4, E5M2: 2.0**-3, FNUZ: 2.0**-4}
SUBNORMAL_STEP = {E4M3: 2.0**-9, E5M2: 2.0**-16, FNUZ: 2.0**-10}


def bytes_of(x):
    return x.view(torch.uint8).tolist()


def test_fp8_max_and_aliases():
    assert fp8_max() == 448.0 and fp8_max(E4M3) == 448.0
    assert fp8_max(E5M2) == 57344.0
    assert fp8_max(FNUZ) == 240.0
    assert fp8_max("e4m3") == 448.0 and fp8_max("e4m3fnuz") == 240.0 and fp8_max("e5m2") == 57344.0
    with pytest.raises(ValueError, match="fp8_dtype"):
        fp8_max("e3m4")
    with pytest.raises(TypeError, match="fp8_dtype"):
        fp8_max(torch.bfloat16)
    assert quant.is_fp8(E4M3) and not quant.is_fp8(torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_at_max_including_inf(fmt):
    m = fp8_max(fmt)
    x = torch.tensor([m, -m, m * 1.01, -m * 1.01, m * 4, -m * 4, 1e30, -1e30, float("inf"), float("-inf")])
    y = saturating_cast(x, fmt).float()
    expect = torch.tensor([m, -m] * 5)
    assert torch.equal(y, expect), y
    # bf16 / fp16 inputs saturate the same way
    assert torch.equal(saturating_cast(x.bfloat16(), fmt).float(), expect)


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_stays_nan(fmt):
    y = saturating_cast(torch.tensor([float("nan"), 1.0, float("nan")]), fmt)
    assert torch.isnan(y.float()[0]) and torch.isnan(y.float()[2]) and y.float()[1] == 1.0


def test_nan_and_one_encodings_fn_vs_fnuz():
    nan, one = torch.tensor([float("nan")]), torch.tensor([1.0])
    # e4m3fn: NaN is S.1111.111 (0x7f / 0xff); 1.0 = 0.0111.000 (bias 7)
    assert bytes_of(saturating_cast(nan, E4M3))[0] & 0x7F == 0x7F
    assert bytes_of(saturating_cast(one, E4M3)) == [0x38]
    # e4m3fnuz: the only NaN is 0x80 (negative zero's code); 1.0 = 0.1000.000 (bias 8)
    assert bytes_of(saturating_cast(nan, FNUZ)) == [0x80]
    assert bytes_of(saturating_cast(one, FNUZ)) == [0x40]
    # the max encodings differ too: 448 = 0x7e in fn, 240 = 0x7f in fnuz (which would be NaN in fn)
    assert bytes_of(saturating_cast(torch.tensor([1e9]), E4M3)) == [0x7E]
    assert bytes_of(saturating_cast(torch.tensor([1e9]), FNUZ)) == [0x7F]
    assert torch.isnan(torch.tensor([0x7F], dtype=torch.uint8).view(E4M3).float()).all()
    assert torch.tensor([0x7F], dtype=torch.uint8).view(FNUZ).float().item() == 240.0
    # reinterpreting fnuz bytes as fn would be wrong by 2x: the formats are distinct
    x = saturating_cast(torch.tensor([3.0]), FNUZ)
    assert x.view(torch.uint8).view(E4M3).float().item() == 6.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_finite_code_round_trips_exactly(fmt):
    codes = torch.arange(256, dtype=torch.uint8).view(fmt)
    vals = codes.float()
    fin = torch.isfinite(vals)
    back = saturating_cast(vals[fin], fmt)
    assert torch.equal(back.float(), vals[fin])
    assert vals[fin].abs().max().item() == fp8_max(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gran", ["per_tensor", "per_head", "per_sequence", "per_token_head", "per_block"])
def test_round_trip_within_format_rounding(fmt, gran):
    x = torch.randn(2, 37, 3, 16) * torch.logspace(-2, 2, 16)  # several magnitudes within each row
    x8, d = quantize(x, gran, fmt, block_size=16)
    assert x8.dtype == fmt and x8.shape == x.shape and d.dtype == torch.float32
    y = dequantize(x8, d, gran, block_size=16)
    assert y.dtype == torch.float32
    db = quant._broadcast(d, x.shape, gran, 16)
    # |y - x| <= half-ulp * |x| (normals) or half a subnormal step (times the descale)
    bound = HALF_ULP[fmt] * x.abs() + 0.5 * SUBNORMAL_STEP[fmt] * db * 1.0001
    assert ((y - x).abs() <= bound).all()
    # dynamic scales use the full range: the amax element maps to +-fp8_max
    assert x8.float().abs().max().item() == fp8_max(fmt)


def _amax_by_loops(x, gran, block=16):
    b, s, h, _ = x.shape
    a = x.abs()
    if gran == "per_tensor":
        return a.max()
    if gran == "per_head":
        return torch.tensor([[a[i, :, j].max() for j in range(h)] for i in range(b)])
    if gran == "per_sequence":
        return torch.tensor([[a[i].max()] for i in range(b)])
    if gran == "per_token_head":
        return torch.tensor([[[a[i, t, j].max() for j in range(h)] for t in range(s)] for i in range(b)])
    nb = math.ceil(s / block)
    return torch.tensor(
        [[[a[i, n * block : (n + 1) * block, j].max() for n in range(nb)] for j in range(h)] for i in range(b)]
    )


@pytest.mark.parametrize(
    "gran,shape",
    [
        ("per_tensor", ()),
        ("per_head", (2, 3)),
        ("per_sequence", (2, 1)),
        ("per_token_head", (2, 37, 3)),
        ("per_block", (2, 3, 3)),
    ],
)
@pytest.mark.parametrize("fmt", [E4M3, FNUZ])
def test_granularity_shape_and_values(gran, shape, fmt):
    x = torch.randn(2, 37, 3, 8) * 5
    d = compute_descale(x, gran, fmt, block_size=16)
    assert tuple(d.shape) == shape and d.dtype == torch.float32
    torch.testing.assert_close(d, (_amax_by_loops(x, gran) / fp8_max(fmt)).float().reshape(shape))
    x8, d2 = quantize(x, gran, fmt, block_size=16)
    assert torch.equal(d2, d)
    # manual broadcast for per_head: element (b, s, h, :) uses d[b, h]
    if gran == "per_head":
        manual = saturating_cast(x / d[:, None, :, None], fmt)
        assert torch.equal(x8.view(torch.uint8), manual.view(torch.uint8))


def test_per_block_partial_last_block():
    x = torch.zeros(1, 20, 1, 4)
    x[0, 17, 0, 2] = -9.0  # only in the last (partial) block of 16
    x[0, 3, 0, 0] = 4.5
    d = compute_descale(x, "per_block", block_size=16)
    assert d.shape == (1, 1, 2)
    torch.testing.assert_close(d[0, 0], torch.tensor([4.5 / 448, 9.0 / 448]))


def test_zero_amax_floor():
    z = torch.zeros(2, 5, 3, 8)
    for gran in ("per_tensor", "per_head", "per_sequence", "per_token_head", "per_block"):
        d = compute_descale(z, gran)
        assert (d > 0).all() and torch.isfinite(d).all()
        torch.testing.assert_close(d, torch.full_like(d, DESCALE_FLOOR))
        x8, _ = quantize(z, gran)
        assert (x8.float() == 0).all()
    assert DESCALE_FLOOR > 0 and DESCALE_FLOOR <= 2.0**-30
    # a partly-zero tensor: only the zero heads are floored
    x = torch.randn(1, 4, 2, 8)
    x[:, :, 1] = 0
    d = compute_descale(x, "per_head")
    assert d[0, 1].item() == pytest.approx(DESCALE_FLOOR) and d[0, 0].item() > 1e-4


def test_zero_k_causal_attention_gives_no_nan():
    # K is all zero: its dynamic descale is the floor. Causal with sq > sk masks the first rows fully;
    # a zero descale folded into the logits would make 0 * -inf = NaN there.
    b, sq, sk, h, d = 1, 6, 3, 2, 16
    q8, qd = quantize(torch.randn(b, sq, h, d), "per_head")
    k8, kd = quantize(torch.zeros(b, sk, h, d), "per_head")
    v8, vd = quantize(torch.randn(b, sk, h, d), "per_head")
    o, lse = fp8attn.flash_attn_func(
        q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True
    )
    assert not torch.isnan(o.float()).any() and not torch.isnan(lse).any()
    assert (o[0, :3].float() == 0).all() and torch.isneginf(lse[0, :, :3]).all()
    # visible rows: all logits are 0 -> uniform average of the visible dequantized V rows
    vf = v8.float() * vd[:, None, :, None]
    for i in range(3, 6):
        n = i - 3 + 1
        torch.testing.assert_close(o[0, i].float(), vf[0, :n].mean(0), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(lse[0, :, i], torch.full((h,), math.log(n)), atol=1e-5, rtol=1e-5)


def test_compute_descale_ignores_nan_and_saturates_inf():
    x = torch.tensor([1.0, float("nan"), -2.0]).view(1, 3, 1, 1)
    assert compute_descale(x).item() == pytest.approx(2.0 / 448)
    xi = torch.tensor([1.0, float("inf")])
    assert compute_descale(xi).item() == pytest.approx(1.0)  # amax treated as fp8_max
    x8, d = quantize(xi)
    assert x8.float().tolist() == [1.0, 448.0]


def test_static_vs_dynamic():
    x = torch.randn(2, 9, 2, 8) * 3
    # dynamic: computed from x
    x8d, dd = quantize(x, "per_head")
    torch.testing.assert_close(dd, compute_descale(x, "per_head"))
    # static: the given descale is used as is (and returned), values past its range saturate
    static = torch.full((2, 2), 0.001)
    x8s, ds = quantize(x, "per_head", descale=static)
    assert torch.equal(ds, static)
    assert torch.equal(x8s.view(torch.uint8), saturating_cast(x / 0.001).view(torch.uint8))
    assert x8s.float().abs().max().item() == 448.0  # 3 * N(0, 1) / 0.001 saturates
    # static per-tensor, 0-d
    x8t, dt = quantize(x, "per_tensor", descale=torch.tensor(0.5))
    assert dt.shape == () and torch.equal(x8t.view(torch.uint8), saturating_cast(x / 0.5).view(torch.uint8))
    # a static scale equal to the dynamic one gives identical bytes
    x8e, _ = quantize(x, "per_head", descale=dd)
    assert torch.equal(x8e.view(torch.uint8), x8d.view(torch.uint8))


def test_dequantize_dtype_and_granularity():
    x8 = torch.tensor([1.0, 2.0, -4.0, 0.5]).view(1, 2, 2, 1).to(E4M3)
    d = torch.tensor([[2.0, 3.0]])
    y = dequantize(x8, d, "per_head", dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert y.float().flatten().tolist() == [2.0, 6.0, -8.0, 1.5]
    yt = dequantize(x8, torch.tensor([[[1.0, 2.0], [3.0, 4.0]]]), "per_token_head")
    assert yt.flatten().tolist() == [1.0, 4.0, -12.0, 2.0]


def test_expand_descale_views():
    b, hk = 3, 4
    one = expand_descale(None, b, hk)
    assert one.shape == (b, hk) and (one == 1).all() and one.dtype == torch.float32
    for d in (torch.tensor(0.5), torch.tensor([0.5]), torch.tensor([[0.5]])):
        e = expand_descale(d, b, hk)
        assert e.shape == (b, hk) and (e == 0.5).all() and e.stride() == (0, 0)  # broadcast, no copy
    ps = torch.tensor([[1.0], [2.0], [3.0]])
    e = expand_descale(ps, b, hk)
    assert e.shape == (b, hk) and e.stride(1) == 0 and e[:, 0].tolist() == [1.0, 2.0, 3.0]
    full = torch.rand(b, hk)
    assert torch.equal(expand_descale(full, b, hk), full)


def test_descale_for_tokens():
    d = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    seq = torch.tensor([1, 0, 1], dtype=torch.int32)
    assert descale_for_tokens(d, seq, 3, 2).tolist() == [[3.0, 4.0], [1.0, 2.0], [3.0, 4.0]]
    assert descale_for_tokens(torch.tensor(0.5), None, 3, 2).tolist() == [[0.5, 0.5]] * 3
    assert descale_for_tokens(torch.tensor([[5.0], [6.0]]), seq, 3, 2).tolist() == [[6.0, 6.0], [5.0, 5.0], [6.0, 6.0]]
    with pytest.raises(ValueError, match="token_seq_idx"):
        descale_for_tokens(d, None, 3, 2)


def test_bad_granularity_names_argument():
    with pytest.raises(ValueError, match="granularity"):
        compute_descale(torch.randn(1, 2, 1, 8), "per_row")
    with pytest.raises(ValueError, match="x"):
        compute_descale(torch.randn(2, 8), "per_head")


def test_empty_inputs_get_floored_descales():
    """Zero-length inputs (a sequence with no tokens) give the floor, not an error."""
    from fp8attn.quant import DESCALE_FLOOR, compute_descale

    assert compute_descale(torch.empty(0, 3)).item() == pytest.approx(DESCALE_FLOOR)
    d = compute_descale(torch.empty(2, 0, 3, 8), "per_head")
    assert d.shape == (2, 3) and (d > 0).all()


@pytest.mark.parametrize("shape", [(2, 5, 3, 4), (1, 1, 1, 16), (2, 0, 3, 4), (0, 3, 0, 2), (7, 3, 8), (0, 4, 2)])
def test_layout_strides_are_torchs(shape):
    """quant's one definition of the two layouts gives the strides torch gives the same layouts (empty
    dimensions included): sequence-major as a permuted contiguous (batch, heads, dim, seqlen), row-major as
    contiguous; so do the e4m3 outputs and views carved from one allocation."""
    lead = (1, *shape) if len(shape) == 3 else shape
    b, s, h, d = lead
    want = torch.empty(b, h, d, s).permute(0, 3, 1, 2)
    want = want.squeeze(0) if len(shape) == 3 else want
    got = quant.empty_seq_major(shape, torch.float32, "cpu")
    assert (got.shape, got.stride()) == (want.shape, want.stride())
    if len(shape) == 4:
        assert quant._empty_fp8(shape, "cpu", True).stride() == want.stride()
        assert quant._empty_fp8(shape, "cpu", False).stride() == torch.empty(shape).stride()
        assert quant._carve(torch.float8_e4m3fn, "cpu", [(shape, None)])[0].stride() == torch.empty(shape).stride()
