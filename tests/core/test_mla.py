"""MLA prefill: the fused quantization kernel (interpreter on CPU) vs its torch form, the chunked pipeline vs a
float64 reference of the whole MLA computation, the capability decision and fallback, saturation counts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8attn import capability, mla
from helpers import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SRC = Path(__file__).resolve().parents[2] / "src"
E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def _bits(x):
    return x.view(torch.uint8)


def _parts(T=37, H=2, dn=128, dr=64, dv=128, dtype=BF16, dev=DEV):
    """Strided inputs: q_nope / q_pe slices of one projection, k_pe a column slice, v head-major."""
    qall = torch.randn(T, H, dn + dr + 8, device=dev) * 1.7
    q_nope = qall[..., :dn].to(dtype)
    q_pe = qall.to(dtype)[..., dn : dn + dr]  # a strided view
    k_nope = (torch.randn(H, T, dn, device=dev) * 0.7).to(dtype).transpose(0, 1)  # head-major memory
    k_pe = (torch.randn(T, dr + 32, device=dev) * 3).to(dtype)[:, 16 : 16 + dr]
    v = (torch.randn(T, H, dv, device=dev) * 2.5).to(dtype)
    k_nope[3, H - 1, 5] = -41.0  # outliers set the descales
    v[T - 1, 0, 7] = 60.0
    return q_nope, q_pe, k_nope, k_pe, v


def test_quant_kernel_matches_torch_bits():
    parts = _parts()
    assert not parts[1].is_contiguous() and not parts[2].is_contiguous() and not parts[3].is_contiguous()
    a = mla.quantize_mla(*parts, backend="triton")
    b = mla.quantize_mla(*parts, backend="torch")
    for x, y in zip(a[:3], b[:3]):
        assert x.dtype == E4M3 and torch.equal(_bits(x), _bits(y))
    for x, y in zip(a[3:], b[3:]):
        assert x.shape == (1, 1) and torch.equal(x, y)
    q8, k8, v8, qd, kd, vd = a
    q_nope, q_pe, k_nope, k_pe, v = parts
    T, H = q_nope.shape[:2]
    assert q8.shape == (T, H, 192) and q8.is_contiguous() and v8.shape == (T, H, 128) and v8.stride(0) == 1
    # the descales are per tensor over the concatenation, the parts land side by side
    k_full = torch.cat([k_nope.float(), k_pe.float()[:, None].expand(T, H, 64)], dim=-1)
    assert kd.item() == pytest.approx(k_full.abs().max().item() / 448, rel=1e-6)
    assert vd.item() == pytest.approx(60.0 / 448, rel=1e-6)
    torch.testing.assert_close(k8.float() * kd, k_full, rtol=2**-3, atol=kd.item() * 2**-9)
    torch.testing.assert_close(q8[..., 128:].float() * qd, q_pe.float(), rtol=2**-3, atol=qd.item() * 2**-9)
    torch.testing.assert_close(v8.float() * vd, v.float(), rtol=2**-3, atol=vd.item() * 2**-9)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_quant_nonfinite_makes_the_descale_nan(backend):
    q_nope, q_pe, k_nope, k_pe, v = _parts(T=9, H=1)
    k_pe = k_pe.clone()
    k_pe[4, 2] = float("nan")
    v = v.clone()
    v[2, 0, 1] = float("inf")
    q8, k8, v8, qd, kd, vd = mla.quantize_mla(q_nope, q_pe, k_nope, k_pe, v, backend=backend)
    assert torch.isfinite(qd).all() and torch.isnan(kd).all() and torch.isnan(vd).all()
    assert torch.isnan(k8.float()).all() and torch.isnan(v8.float()).all() and not torch.isnan(q8.float()).any()


def test_quant_static_descales_count_saturation():
    """The one-pass form (fp8_gather): the kernel's clipped-element count equals torch's."""
    _, _, k_nope, k_pe, v = _parts(T=40, H=2)
    ds = torch.tensor([1.0, 0.02, 0.05], device=DEV)  # small enough that the outliers clip
    a = mla._quant(None, None, k_nope, k_pe, v, ds=ds, count=True, use_triton=True)
    b = mla._quant(None, None, k_nope, k_pe, v, ds=ds, count=True, use_triton=False)
    assert torch.equal(_bits(a[1]), _bits(b[1])) and torch.equal(_bits(a[2]), _bits(b[2]))
    inv = 1.0 / ds  # the kernels multiply by the float32 reciprocal
    want = int(
        (k_nope.float().abs() * inv[1] > 448).sum()
        + 2 * (k_pe.float().abs() * inv[1] > 448).sum()
        + (v.float().abs() * inv[2] > 448).sum()
    )
    assert want > 0 and int(a[4]) == want and int(b[4]) == want


# ----------------------------------------------------------------------------------------------------------
# the pipeline
# ----------------------------------------------------------------------------------------------------------
def _problem(
    B=2,
    H=16,
    rank=64,
    dn=128,
    dr=64,
    dv=128,
    new=(13, 21),
    ctx=(70, 0),
    ps=16,
    cache_dtype=BF16,
    dev=DEV,
    outlier=None,
    latent_mean=1.0,
):
    """New tokens, a NaN-poisoned paged latent cache (randperm pages over a pool 3x larger, -1 past each
    sequence's pages) and non-unit weights. ``outlier``: (b, position) of one cached row scaled by 100.

    The latents have per-channel means (N(0, latent_mean^2)) as real normalized activations do, so the
    output has a component common to the keys; with isotropic mean-zero data the output is itself at the
    noise level and its relative error is about e4m3's precision times the logits' spread."""
    g = torch.Generator(device="cpu").manual_seed(1)
    mean = torch.randn(rank, generator=g) * latent_mean

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dev)

    def lat(n):
        return (torch.randn(n, rank, generator=g) * 0.8 + mean).to(dev)

    T = sum(new)
    max_ctx = max(max(ctx), 1)
    npages = -(-max_ctx // ps)
    pool = 3 * B * npages
    cache = torch.full((pool, ps, rank + dr), float("nan"), device=dev)
    pt = torch.full((B, npages), -1, dtype=torch.int32, device=dev)
    perm = torch.randperm(pool, generator=g).to(dev)
    for b in range(B):
        n = -(-ctx[b] // ps)
        pt[b, :n] = perm[b * npages : b * npages + n].int()
        for p in range(n):
            rows = min(ps, ctx[b] - p * ps)
            cache[pt[b, p].long(), :rows] = torch.cat([lat(rows), rnd(rows, dr, scale=1.5)], -1)
    if outlier is not None:
        b, pos = outlier
        cache[pt[b, pos // ps].long(), pos % ps] *= 100.0
    descale = None
    if cache_dtype in (E4M3, torch.float8_e5m2):
        descale = torch.tensor([0.011], device=dev)
        cache = (cache / descale).clamp(-448, 448).to(cache_dtype)
    else:
        cache = cache.to(cache_dtype)
    args = (
        rnd(T, H, dn, scale=0.9).to(BF16),
        rnd(T, H, dr, scale=1.2).to(BF16),
        lat(T).to(BF16),
        rnd(T, dr, scale=1.5).to(BF16),
        rnd(rank, H, dn, scale=rank**-0.5).to(BF16),
        rnd(rank, H, dv, scale=rank**-0.5 * 2).to(BF16),
    )
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    kw = dict(
        cu_seqlens_q=cu,
        max_seqlen_q=max(new),
        softmax_scale=(dn + dr) ** -0.5 * 1.3,
        latent_cache=cache,
        page_table=pt,
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
        max_context_len=max(ctx),
        latent_descale=descale,
    )
    return args, kw


def _ref(args, kw):
    kw = {k: v for k, v in kw.items() if k not in ("max_seqlen_q", "max_context_len")}
    return mla.prefill_ref(*args, **kw)


@pytest.mark.parametrize(
    "mode,cache_dtype,latent_mean",
    [
        ("bf16_gather", BF16, 1.0),
        ("fp8_gather", BF16, 1.0),
        ("bf16_gather", E4M3, 1.0),
        ("fp8_gather", E4M3, 1.0),
        ("bf16_gather", BF16, 0.0),
        ("off", BF16, 0.0),
    ],
)
def test_prefill_matches_float64_reference(mode, cache_dtype, latent_mean):
    """Realistic latents (per-channel means): the relative error bound of the issue, 3e-2. Isotropic
    mean-zero latents put the output at the noise level, where per-tensor e4m3 Q/K (about 2% relative
    per element, times the logits' spread of about 1.5 here) measured 5.6-5.7%: bound 8e-2, which still
    catches a dropped or doubled chunk (a third of the keys)."""
    args, kw = _problem(cache_dtype=cache_dtype, latent_mean=latent_mean)
    out = mla.prefill(*args, **kw, chunk_size=32, mode=mode)
    assert out.shape == (34, 16, 128) and out.dtype == BF16
    assert not torch.isnan(out).any()
    err = rel_err(out, _ref(args, kw))
    bound = 5e-3 if mode == "off" else 3e-2 if latent_mean else 8e-2
    assert err <= bound, err


def test_no_prefix_and_an_empty_context():
    args, kw = _problem(ctx=(0, 0))
    kw.update(max_context_len=0, latent_cache=None, page_table=None, context_lens=None)
    out = mla.prefill(*args, **kw, mode="fp8_gather")
    # 13 and 21 keys per query at most: little averaging of the e4m3 rounding (measured 3.2%)
    assert rel_err(out, _ref(args, kw)) <= 5e-2


@pytest.mark.parametrize("mode", ["fp8_gather", "bf16_gather", "off"])
def test_chunked_equals_unchunked(mode):
    """24 keys per chunk vs the whole prefix in one. In 16 bits only the fp32 merge order differs (isotropic
    latents, where a lost or doubled chunk would show at once). In FP8 the chunks also round P against
    their own row maxima (e4m3), and bf16_gather quantizes each chunk with its own dynamic descales
    (measured 0.6% and 1.8% apart on realistic latents); both stay within the float64 bound."""
    args, kw = _problem(ctx=(70, 45), latent_mean=0.0 if mode == "off" else 1.0)
    one = mla.prefill(*args, **kw, chunk_size=128, mode=mode)
    many = mla.prefill(*args, **kw, chunk_size=24, mode=mode)
    assert rel_err(many, one) <= {"fp8_gather": 1.5e-2, "bf16_gather": 3e-2, "off": 4e-3}[mode]
    if mode != "off":
        ref = _ref(args, kw)
        assert rel_err(many, ref) <= 3e-2 and rel_err(one, ref) <= 3e-2


@pytest.mark.parametrize("mode", ["fp8_gather", "bf16_gather"])
def test_q_is_quantized_once_for_all_chunks(monkeypatch, mode):
    args, kw = _problem(ctx=(70, 45))
    calls = []
    real = mla._quant
    monkeypatch.setattr(
        mla, "_quant", lambda *a, **k: calls.append((a[0] is not None, k.get("ds") is None)) or real(*a, **k)
    )
    mla.prefill(*args, **kw, chunk_size=32, mode=mode)
    # one call with Q (dynamic), then one per chunk without Q: estimated descales with fp8_gather
    assert calls == [(True, True)] + [(False, mode == "bf16_gather")] * 3


def test_saturation_with_an_outlier_in_the_cached_prefix():
    args, kw = _problem(ctx=(70, 45), outlier=(0, 37))
    H, dn, dr, dv = 16, 128, 64, 128
    stats = mla.SaturationStats(DEV)
    out = mla.prefill(*args, **kw, chunk_size=48, mode="fp8_gather", stats=stats)
    assert stats.total == (70 + 45) * H * (dn + dr + dv)
    assert 0 < stats.saturated < H * (dn + dr + dv)  # only the outlier row's elements clip
    assert not torch.isnan(out).any()
    before = stats.counts.clone()
    mla.prefill(*args, **kw, chunk_size=48, mode="bf16_gather", stats=stats)  # dynamic: nothing estimated
    assert torch.equal(stats.counts, before)
    clean = mla.SaturationStats(DEV)
    args2, kw2 = _problem(ctx=(70, 45))
    mla.prefill(*args2, **kw2, chunk_size=48, mode="fp8_gather", stats=clean)
    assert clean.saturated == 0 and clean.rate() == 0.0 and clean.total == stats.total


# ----------------------------------------------------------------------------------------------------------
# capability and fallback
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_plans():
    mla._plan.cache_clear()
    yield
    mla._plan.cache_clear()


def _forbid_fp8(monkeypatch):
    def no(*a, **k):
        raise AssertionError("the fallback quantized or gathered in FP8")

    monkeypatch.setattr(mla, "_quant", no)


def test_fallback_equals_the_16bit_pipeline_exactly(monkeypatch, fresh_plans):
    args, kw = _problem()
    want = mla.prefill(*args, **kw, chunk_size=32, mode="off")
    saved = [a.clone() for a in args] + [kw["latent_cache"].clone()]
    monkeypatch.setattr(mla, "_support_fp8_prefill", lambda **k: mla.Support(False, "simulated"))
    _forbid_fp8(monkeypatch)
    monkeypatch.setenv("FP8ATTN_FALLBACK", "silent")
    got = mla.prefill(*args, **kw, chunk_size=32, mode="fp8_gather")
    assert torch.equal(got, want)
    for a, s in zip(list(args) + [kw["latent_cache"]], saved):  # the 16-bit data is untouched (NaN slots too)
        assert torch.equal(a.view(torch.int16), s.view(torch.int16))
    monkeypatch.setenv("FP8ATTN_FALLBACK", "error")  # raised before anything runs
    with pytest.raises(capability.FallbackError, match="simulated"):
        mla.prefill(*args, **kw, chunk_size=32)


def test_fp16_takes_the_16bit_path_without_a_report(monkeypatch, fresh_plans):
    args, kw = _problem()
    args = tuple(a.half() for a in args)
    _forbid_fp8(monkeypatch)
    monkeypatch.setenv("FP8ATTN_FALLBACK", "error")
    out = mla.prefill(*args, **kw, chunk_size=32, mode="fp8_gather")
    assert out.dtype == torch.float16 and rel_err(out, _ref(args, kw)) <= 1e-2


def test_fp8_gather_unsupported_keeps_fp8_attention(monkeypatch, fresh_plans):
    args, kw = _problem(cache_dtype=torch.float8_e5m2)
    monkeypatch.setenv("FP8ATTN_FALLBACK", "error")
    with pytest.raises(capability.FallbackError, match="mla_fp8_gather"):
        mla.prefill(*args, **kw, chunk_size=32, mode="fp8_gather")
    monkeypatch.setenv("FP8ATTN_FALLBACK", "silent")
    stats = mla.SaturationStats(DEV)
    calls = []
    real = mla._quant
    monkeypatch.setattr(mla, "_quant", lambda *a, **k: calls.append(k.get("ds") is None) or real(*a, **k))
    out = mla.prefill(*args, **kw, chunk_size=32, mode="fp8_gather", stats=stats)
    assert calls == [True] * 4 and stats.total == 0  # Q/K/V once, 3 chunks dynamically
    assert rel_err(out, _ref(args, kw)) <= 3e-2


def test_one_warning_per_process():
    code = f"""
import sys, warnings
sys.path.insert(0, {str(SRC)!r})
import torch
from fp8attn import mla
mla._support_fp8_prefill = lambda **k: mla.Support(False, "simulated")
T, H = 5, 2
args = (torch.randn(T, H, 128).bfloat16(), torch.randn(T, H, 64).bfloat16(), torch.randn(T, 32).bfloat16(),
        torch.randn(T, 64).bfloat16(), torch.randn(32, H, 128).bfloat16(), torch.randn(32, H, 128).bfloat16())
cu = torch.tensor([0, T], dtype=torch.int32)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    for _ in range(3):
        mla.prefill(*args, cu_seqlens_q=cu, max_seqlen_q=T, softmax_scale=0.1)
print(sum(issubclass(x.category, mla.capability.FallbackWarning) for x in w))
"""
    env = {k: v for k, v in os.environ.items() if k != "FP8ATTN_FALLBACK"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "1"


def test_kernel_error_propagates_without_retry(monkeypatch, fresh_plans):
    args, kw = _problem()
    ran16 = []
    monkeypatch.setattr(mla, "_concat16", lambda *a: ran16.append(1))

    def boom(*a, **k):
        raise RuntimeError("injected kernel error")

    monkeypatch.setattr(mla, "_quant", boom)
    with pytest.raises(RuntimeError, match="injected"):
        mla.prefill(*args, **kw, chunk_size=32, mode="bf16_gather")
    assert not ran16


def test_mode_switch(monkeypatch):
    monkeypatch.delenv(mla.ENV_MODE, raising=False)
    assert mla.resolve_mode(None) == mla.DEFAULT_MODE == "bf16_gather"
    for env, want in (("fp8_gather", "fp8_gather"), ("0", "off"), ("1", mla.DEFAULT_MODE), ("OFF", "off")):
        monkeypatch.setenv(mla.ENV_MODE, env)
        assert mla.resolve_mode(None) == want
    assert mla.resolve_mode("fp8_gather") == "fp8_gather"  # the argument wins
    monkeypatch.setenv(mla.ENV_MODE, "fast")
    with pytest.raises(ValueError, match=mla.ENV_MODE):
        mla.resolve_mode(None)
    with pytest.raises(ValueError, match="mode"):
        mla.resolve_mode("fp8")


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a, k: k.update(max_context_len=-1), "max_context_len"),
        (lambda a, k: k.update(chunk_size=0), "chunk_size"),
        (lambda a, k: k.update(softmax_scale=float("nan")), "softmax_scale"),
        (lambda a, k: k.update(latent_descale=None), "latent_descale"),
        (lambda a, k: k.update(page_table=k["page_table"].long()), "page_table"),
        (lambda a, k: k.update(context_lens=k["context_lens"][:1]), "context_lens"),
        (lambda a, k: a.__setitem__(3, a[3][:, :32]), "k_pe"),
        (lambda a, k: a.__setitem__(5, a[5].float()), "w_uv"),
    ],
)
def test_bad_arguments_raise_before_any_write(change, match):
    args, kw = _problem(cache_dtype=E4M3)
    args = list(args)
    change(args, kw)
    out = torch.full((34, 16, 128), 7.0, dtype=BF16, device=DEV)
    with pytest.raises((ValueError, TypeError), match=match):
        mla.prefill(*args, **kw, out=out)
    assert (out == 7.0).all()


# ----------------------------------------------------------------------------------------------------------
# GPU (H200)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16_gather", "fp8_gather"])
def test_gpu_real_shapes(mode):
    torch.manual_seed(0)
    H, rank, T, ctx, chunk = 128, 512, 1024, 3000, 1024
    args, kw = _problem(B=1, H=H, rank=rank, new=(T,), ctx=(ctx,), ps=64, dev="cuda")
    stats = mla.SaturationStats("cuda")
    out = mla.prefill(*args, **kw, chunk_size=chunk, mode=mode, stats=stats)
    hs = slice(0, 16)  # the float64 oracle on 16 heads
    ref = mla.prefill_ref(
        args[0][:, hs],
        args[1][:, hs],
        args[2],
        args[3],
        args[4][:, hs],
        args[5][:, hs],
        cu_seqlens_q=kw["cu_seqlens_q"],
        softmax_scale=kw["softmax_scale"],
        latent_cache=kw["latent_cache"],
        page_table=kw["page_table"],
        context_lens=kw["context_lens"],
    )
    assert rel_err(out[:, hs], ref) <= 3e-2
    if mode == "fp8_gather":
        assert stats.total == ctx * H * 320 and stats.rate() < 1e-3


@pytest.mark.gpu
def test_gpu_quant_kernel_bits_at_real_shapes():
    parts = _parts(T=4099, H=128, dev="cuda")
    a = mla.quantize_mla(*parts, backend="triton")
    b = mla.quantize_mla(*parts, backend="torch")
    for x, y in zip(a[:3], b[:3]):
        assert torch.equal(_bits(x), _bits(y))
    assert all(torch.equal(x, y) for x, y in zip(a[3:], b[3:]))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16_gather", "fp8_gather"])
def test_gpu_cuda_graph_replay_with_modified_inputs(mode):
    args, kw = _problem(B=2, H=16, rank=512, new=(256, 200), ctx=(1000, 700), ps=64, dev="cuda")
    stats = mla.SaturationStats("cuda")
    out = torch.empty(456, 16, 128, dtype=BF16, device="cuda")

    def step():
        mla.prefill(*args, **kw, chunk_size=512, mode=mode, stats=stats, out=out)

    step()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    args2, kw2 = _problem(B=2, H=16, rank=512, new=(256, 200), ctx=(1000, 700), ps=64, dev="cuda")
    for a, a2 in zip(args, args2):
        a.copy_(a2 * 0.5 + torch.randn_like(a2) * 0.1)
    kw["context_lens"].copy_(torch.tensor([900, 333], dtype=torch.int32))
    stats.reset()
    g.replay()
    torch.cuda.synchronize()
    want = mla.prefill(*args, **kw, chunk_size=512, mode=mode)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    if mode == "fp8_gather":
        assert stats.total == (900 + 333) * 16 * 320


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16_gather", "fp8_gather"])
def test_gpu_no_host_sync(mode):
    args, kw = _problem(B=2, H=16, rank=512, new=(256, 200), ctx=(1000, 700), ps=64, dev="cuda")
    stats = mla.SaturationStats("cuda")
    mla.prefill(*args, **kw, chunk_size=512, mode=mode, stats=stats)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mla.prefill(*args, **kw, chunk_size=512, mode=mode, stats=stats)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.slow
def test_quant_kernel_compiles_for_sm90_without_spills_or_divisions():
    """``tools/aot_mla_sm90.py`` (sm_90a, no GPU needed): every launch of the quantization kernel without
    stack or local memory (spills), and without an fp32 division (the approximate one would break the
    kernel's bit equality with the torch form)."""
    pytest.importorskip("triton")
    env = dict(
        os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    )
    r = subprocess.run(
        [sys.executable, str(SRC.parent / "tools" / "aot_mla_sm90.py")],
        cwd=SRC.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("mla_quant ")]
    assert len(lines) == 5, r.stdout
    for ln in lines:
        assert "STACK:0 " in ln and "LOCAL:0 " in ln and ln.endswith("div: none"), ln
