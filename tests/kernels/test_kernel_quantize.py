"""The fused quantize kernel behind quantize_qkv (kernels/quantize.py ``launch_quantize``).

Without rotation the kernel's result is exactly defined (amax of each scale group, ``descale_from_amax``,
saturating cast), so it must equal the torch path bit for bit in every form: one launch per group, two
launches (partials, then in-kernel group reduction), per_block; with the Hadamard rotation the one- and
two-launch forms agree bit for bit. A NaN or Inf makes its group's descale and values NaN and leaves the
other groups as they were. GPU tests count quantize_qkv's launches and run it under the sync debug mode.
"""

import pytest
import torch

from fp8attn import ops, quant
from fp8attn.quant import descale_from_amax

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GRANS = ["per_tensor", "per_head", "per_block"]


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _x(b=2, s=21, h=4, d=16, varlen=False):
    x = (torch.randn(b, s, h, d) * 3).to(DEV, torch.bfloat16)
    x[0, 3, 1, 5] = 70.0  # an outlier in one group
    return x.reshape(b * s, h, d) if varlen else x


def _run(x, gran, single, rotate=False, seq_major=False, bt=16, hk=2):
    return quant._triton_path(x, gran, hk, rotate, 7, bt, seq_major=seq_major, single=single)


@pytest.mark.parametrize("gran,varlen", [("per_tensor", True), ("per_head", False), ("per_block", True)])
def test_fused_equals_exact_torch_path(gran, varlen):
    """Bytes and descales equal the torch path (no rotation: the result is exactly defined), for the one- and
    two-launch forms and both V layouts; shapes and strides as the op's fake promises."""
    x = _x(varlen=varlen)
    want_y, want_d = quant._torch_path(x, gran, 2, False, 7, 16)
    forms = ((None, True),) if gran == "per_block" else ((True, False), (False, True))
    for single, seq_major in forms:
        y, d = _run(x, gran, single, seq_major=seq_major)
        assert torch.equal(_bits(y), _bits(want_y)) and torch.equal(d, want_d.contiguous())
        assert d.is_contiguous() and d.shape == quant.descale_shape(x, gran, 2, 16)
        assert (y.stride(-3) == 1) == seq_major


@pytest.mark.parametrize("gran", ["per_head"])
def test_hadamard_one_and_two_launch_forms_agree(gran):
    """With the rotation both forms compute the same tiles: the same bits (and the torch path within 1 ulp)."""
    x = _x(b=1, h=2)
    y1, d1 = _run(x, gran, True, rotate=True, hk=1)
    y2, d2 = _run(x, gran, False, rotate=True, seq_major=True, hk=1)
    assert torch.equal(_bits(y1), _bits(y2)) and torch.equal(d1, d2)
    yt, dt = quant._torch_path(x, gran, 1, True, 7, 16)
    torch.testing.assert_close(d1, dt, rtol=1e-5, atol=0)
    ulp = torch.exp2(torch.floor(torch.log2(yt.float().abs().clamp_min(2.0**-6))) - 3)
    assert ((y1.float() - yt.float()).abs() <= ulp).all()


@pytest.mark.parametrize(
    "gran,bad", [("per_tensor", float("inf")), ("per_head", float("nan")), ("per_block", float("-inf"))]
)
def test_non_finite_poisons_only_its_group(gran, bad):
    """A NaN / Inf in (batch 1, head 3, token 20) makes its group's descale NaN and all its values NaN; the
    other groups keep the bits of the clean input (the group: everything per tensor; batch 1's KV head 1 per
    head; (batch 1, head 3, block 1) per block)."""
    x = _x()
    forms = (None,) if gran == "per_block" else (True, False)
    clean = _run(x, gran, None) if gran != "per_tensor" else None
    x[1, 20, 3, 7] = bad
    for single in forms:
        y, d = _run(x, gran, single)
        hit = torch.zeros(y.shape, dtype=torch.bool, device=DEV)
        dhit = torch.zeros(d.shape, dtype=torch.bool, device=DEV)
        if gran == "per_tensor":
            hit[:], dhit[:] = True, True
        elif gran == "per_head":
            hit[1, :, 2:4], dhit[1, 1] = True, True
        else:
            hit[1, 16:32, 3], dhit[1, 3, 1] = True, True
        assert y.float()[hit].isnan().all() and d[dhit].isnan().all()
        if clean is not None:
            assert torch.equal(_bits(y)[~hit], _bits(clean[0])[~hit]) and torch.equal(d[~dhit], clean[1][~dhit])


def test_zero_and_empty_inputs_take_the_floor():
    x = torch.zeros(1, 5, 2, 16, device=DEV, dtype=torch.bfloat16)
    for gran in GRANS:
        y, d = _run(x, gran, None)
        assert (d == descale_from_amax(torch.zeros(()), 448.0).item()).all() and (y.float() == 0).all()
    y, d = _run(torch.zeros(0, 5, 2, 16, device=DEV, dtype=torch.bfloat16), "per_head", None)
    assert y.shape == (0, 5, 2, 16) and d.shape == (0, 2)


def test_many_tiles_per_group_reduce_in_kernel():
    """Groups larger than one program's share of partials (several tiles per pass-2 program) still reduce
    to the exact group amax."""
    import fp8attn.kernels.quantize as kq

    x = _x(b=1, s=100, h=2, d=16)
    want_y, want_d = quant._torch_path(x, "per_tensor", 1, False, 7, 16)
    old = kq._PARTIALS_PER_TILE
    kq._PARTIALS_PER_TILE = 4  # 14 tiles in the group: 4 tiles per program
    try:
        y, d = _run(x, "per_tensor", False, hk=1)
    finally:
        kq._PARTIALS_PER_TILE = old
    assert torch.equal(_bits(y), _bits(want_y)) and torch.equal(d, want_d)


def test_opcheck_quantize_fp8_triton():
    """The op with the Triton path (the interpreter on the CPU): opcheck and the fake's exact shapes/strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = _x(b=1, s=20, h=2, d=16).cpu()
    for gran, rotate, seq_major in (("per_head", False, True),):
        args = (x, gran, 1, rotate, 7, 16, seq_major, True)
        torch.library.opcheck(
            ops.OPS["quantize_fp8"], args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration")
        )
        real = ops.quantize_fp8(*args)
        with FakeTensorMode() as mode:
            fake = ops.OPS["quantize_fp8"](mode.from_tensor(x), *args[1:])
        for r, f in zip(real, fake):
            assert (tuple(r.shape), r.dtype, r.stride()) == (tuple(f.shape), f.dtype, f.stride())


@pytest.mark.parametrize(
    "shape,gran,rotate,seq_major",
    [
        ((1, 128, 128, 4, 4, 64, 64), "per_head", False, True),
        ((2, 70, 33, 6, 2, 32, 16), "per_head", True, False),
        ((None, 45, 9, 4, 1, 40, 24), "per_tensor", True, True),  # varlen, head dims padded
    ],
)
def test_one_launch_qkv_equals_three_launches(shape, gran, rotate, seq_major):
    """quant.triton_qkv (Q, K and V in one launch, what the quantize_qkv plan runs) returns what three
    one-launch quantizations return, bit for bit, with their shapes and strides."""
    b, sq, sk, hq, hk, d, dv = shape
    lead = (lambda s: (s,)) if b is None else (lambda s: (b, s))
    q = (torch.randn(*lead(sq), hq, d) * 3).to(DEV, torch.bfloat16)
    k = torch.randn(*lead(sk), hk, d).to(DEV, torch.bfloat16)
    v = (torch.randn(*lead(sk), hk, dv) * 0.1).to(DEV, torch.bfloat16)
    got = quant.triton_qkv(q, k, v, gran, hk, rotate, 7, 64, seq_major)
    assert got is not None
    want = (
        quant._triton_path(q, gran, hk, rotate, 7, 64, single=True),
        quant._triton_path(k, gran, hk, rotate, 7, 64, single=True),
        quant._triton_path(v, gran, hk, False, 7, 64, seq_major=seq_major, single=True),
    )
    for a, w in zip(got, [w[0] for w in want] + [w[1] for w in want]):
        assert (a.shape, a.stride(), a.dtype) == (w.shape, w.stride(), w.dtype)
        assert torch.equal(_bits(a), _bits(w)) if a.dtype == torch.float8_e4m3fn else torch.equal(a, w)
    # the three e4m3 outputs carved from one allocation, the three descales from another, each on a 128-byte
    # boundary and none overlapping the next
    for group in (got[:3], got[3:]):
        base = group[0].untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base and (t.data_ptr() - base) % 128 == 0 for t in group)
        assert all(
            group[i + 1].data_ptr() >= group[i].data_ptr() + group[i].numel() * group[i].element_size()
            for i in range(2)
        )


def test_one_launch_qkv_refuses_large_groups_and_per_block():
    """Groups of more than SINGLE_MAX_TILES tiles, per_block scales and mixed dtypes keep three launches."""
    q = torch.randn(1, 64 * 9, 2, 16, device=DEV, dtype=torch.bfloat16)
    k = v = torch.randn(1, 64, 2, 16, device=DEV, dtype=torch.bfloat16)
    assert quant.triton_qkv(q, k, v, "per_head", 2, False, 7, 64, True) is None
    assert quant.triton_qkv(k, k, v, "per_block", 2, False, 7, 64, True) is None
    assert quant.triton_qkv(k, k.float(), v, "per_head", 2, False, 7, 64, True) is None
    assert quant.triton_qkv(k, k, v, "per_head", 2, False, 7, 64, True) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("s", [128, 4096])
def test_gpu_quantize_qkv_launches_and_no_sync(gran, hadamard, s):
    """quantize_qkv on the GPU: at most 6 kernel launches (2 per input), no host sync (sync debug mode
    "error"), the same results as a call outside the profiler, and bit-identical one/two-launch forms."""
    from torch.profiler import ProfilerActivity, profile

    import fp8attn

    q = torch.randn(1, s, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, s, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, s, 2, 128, device="cuda", dtype=torch.bfloat16)
    kw = dict(granularity=gran, hadamard=hadamard)
    want = fp8attn.quantize_qkv(q, k, v, **kw)  # warm-up (compiles, builds the rotation)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")  # (synchronize itself counts as a sync: outside)
        try:
            got = fp8attn.quantize_qkv(q, k, v, **kw)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) <= 6, kernels
    for a, b in zip(got, want):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    if gran != "per_block":
        y1, d1 = _run(q, gran, True, rotate=hadamard, bt=64, hk=2)
        y2, d2 = _run(q, gran, False, rotate=hadamard, bt=64, hk=2)
        assert torch.equal(_bits(y1), _bits(y2)) and torch.equal(d1, d2)
    if not hadamard:  # the descale is quant.descale_from_amax of the exact group amax
        want_d = quant._torch_path(q, gran, 2, False, 7, 128 if gran == "per_block" else 64)[1]
        assert torch.equal(got[3], want_d.expand(got[3].shape) if gran == "per_tensor" else want_d)


def test_static_quant_kernel_matches_torch():
    """The standalone static quantization kernel (the unfused peer of ``out_scale=``) writes the bytes of the
    torch path, saturation included, for a strided input."""
    from fp8attn.kernels.quantize import launch_quant_static
    from fp8attn.quant import quant_fp8_static_torch

    x = (torch.randn(3, 7, 5, device=DEV) * 300).transpose(1, 2)
    s = torch.tensor([0.37], device=DEV)
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=DEV)
    launch_quant_static(x, s, y)
    assert torch.equal(y.view(torch.uint8), quant_fp8_static_torch(x, s).view(torch.uint8))
    assert y.float().abs().max() == 448
