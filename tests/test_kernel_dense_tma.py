"""TMA/wgmma dense forward (kernels/dense_tma) vs the reference, and its dispatch from launch_dense_fwd.

CPU: ``supported`` rejects every case outside the fast path's contract, and the kernel compiles ahead
of time for sm90 when the compiler is present. GPU (`gpu` marker, sm90): causal and non-causal,
seqlen_q == / < seqlen_k, GQA, random per-(batch, kv head) descales, LSE, determinism, the
FP8ATTN_DENSE_BACKEND switch.
"""
import math
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from conftest import assert_close_fa3  # noqa: E402

from fp8attn.kernels import dense_tma  # noqa: E402
from fp8attn.kernels.dense import launch_dense_fwd, transpose_v_kmajor  # noqa: E402
from fp8attn.reference import attention_ref  # noqa: E402

E4M3 = torch.float8_e4m3fn
SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def _fp8(shape, device, scale=3.0):
    return (torch.randn(shape, device=device) * scale).clamp(-448, 448).to(E4M3)


def _case(b=2, sq=256, sk=256, hq=8, hk=2, d=128, device="cpu"):
    q, k, v = _fp8((b, sq, hq, d), device), _fp8((b, sk, hk, d), device), _fp8((b, sk, hk, d), device)
    qd = torch.rand(b, hk, device=device) * 0.28 + 0.02
    kd = torch.rand(b, hk, device=device) * 0.28 + 0.02
    vd = torch.rand(b, hk, device=device) * 1.5 + 0.5
    out = torch.empty(b, sq, hq, d, device=device, dtype=torch.bfloat16)
    lse = torch.empty(b, hq, sq, device=device)
    return q, k, v, qd, kd, vd, out, lse


def _kw(qd, kd, vd, lse, **over):
    kw = dict(causal=False, window_size=(-1, -1), softcap=0.0, q_descale=qd, k_descale=kd, v_descale=vd,
              out_scale=None, cu_seqlens_q=None, descale_block_q=None, descale_block_k=None, lse=lse)
    kw.update(over)
    return kw


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------
def test_supported_rejects_outside_contract():
    q, k, v, qd, kd, vd, out, lse = _case()
    vt = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # sequence-contiguous layout
    kw = _kw(qd, kd, vd, lse)
    # CPU tensors: never the fast path (and no CUDA call is made to find that out)
    assert not dense_tma.supported(q, k, vt, out, **kw)
    assert "CUDA" in dense_tma.unsupported_reason(q, k, vt, out, **kw)
    cu = torch.tensor([0, 256, 512], dtype=torch.int32)
    cases = {
        "varlen": dict(cu_seqlens_q=cu),
        "window": dict(window_size=(64, 0)),
        "right window": dict(window_size=(-1, 8)),
        "softcap": dict(softcap=20.0),
        "out_scale": dict(out_scale=torch.tensor([0.01])),
        "per-block": dict(descale_block_q=64, descale_block_k=64),
    }
    for name, over in cases.items():
        why = dense_tma.unsupported_reason(q, k, vt, out, **_kw(qd, kd, vd, lse, **over))
        assert why is not None and "CUDA" not in why, name
        assert not dense_tma.supported(q, k, vt, out, **_kw(qd, kd, vd, lse, **over)), name
    # the API's causal window (-1, 0) is the causal mask, not a sliding window
    assert dense_tma.effective_causal(False, (-1, 0)) and not dense_tma.effective_causal(False, (-1, -1))
    assert "CUDA" in dense_tma.unsupported_reason(q, k, vt, out, **_kw(qd, kd, vd, lse, window_size=(-1, 0)))
    # shape / dtype cases are rejected before the device check as well
    q64, k64, v64, qd64, kd64, vd64, out64, lse64 = _case(d=64)
    assert "head dim" in dense_tma.unsupported_reason(q64, k64, v64, out64, **_kw(qd64, kd64, vd64, lse64))
    q2, k2, v2, qd2, kd2, vd2, out2, lse2 = _case(sq=200, sk=200)
    assert not dense_tma.supported(q2, k2, v2, out2, **_kw(qd2, kd2, vd2, lse2))
    qh, kh, vh = q.to(torch.float16), k.to(torch.float16), vt.to(torch.float16)
    assert "float8_e4m3fn" in dense_tma.unsupported_reason(qh, kh, vh, out, **kw)
    out32 = out.float()
    assert "bfloat16" in dense_tma.unsupported_reason(q, k, vt, out32, **kw)


@pytest.mark.gpu
def test_supported_rejects_on_gpu():
    """The shape/layout rules on CUDA tensors (seqlen 200, d64, non-contiguous V, causal sq > sk)."""
    q, k, v, qd, kd, vd, out, lse = _case(device="cuda")
    vt = transpose_v_kmajor(v)
    if torch.cuda.get_device_capability() != (9, 0):
        assert not dense_tma.supported(q, k, vt, out, **_kw(qd, kd, vd, lse))
        pytest.skip("not an sm90 device")
    assert dense_tma.supported(q, k, vt, out, **_kw(qd, kd, vd, lse))
    assert not dense_tma.supported(q, k, v, out, **_kw(qd, kd, vd, lse))  # V not sequence-contiguous
    q2, k2, v2, qd2, kd2, vd2, out2, lse2 = _case(sq=200, sk=200, device="cuda")
    assert "multiples of 128" in dense_tma.unsupported_reason(q2, k2, transpose_v_kmajor(v2), out2,
                                                              **_kw(qd2, kd2, vd2, lse2))
    q3, k3, v3, qd3, kd3, vd3, out3, lse3 = _case(d=64, device="cuda")
    assert not dense_tma.supported(q3, k3, transpose_v_kmajor(v3), out3, **_kw(qd3, kd3, vd3, lse3))
    q4, k4, v4, qd4, kd4, vd4, out4, lse4 = _case(sq=512, sk=256, device="cuda")
    assert not dense_tma.supported(q4, k4, transpose_v_kmajor(v4), out4, **_kw(qd4, kd4, vd4, lse4, causal=True))


_AOT_SNIPPET = """
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, {src!r})
from fp8attn.kernels import dense_tma
for causal in (False, True):
    k = dense_tma._aot_compile(causal, write_lse=True)
    assert k.asm["cubin"], "no cubin"
    print("ok", causal, k.metadata.shared)
"""


def test_aot_compile_sm90():
    """The Gluon kernel compiles for sm90 without a GPU (in a clean process: no interpreter mode)."""
    if not dense_tma.HAS_GLUON:
        pytest.skip("triton without gluon")
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as e:  # pragma: no cover
        pytest.skip(f"no NVIDIA compiler backend: {e}")
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", _AOT_SNIPPET.format(src=os.path.abspath(SRC))],
                       capture_output=True, text=True, timeout=120, env=env)
    out = r.stdout + r.stderr
    if r.returncode != 0 and ("ptxas" in out and ("not found" in out or "No such file" in out)):
        pytest.skip("ptxas not available")
    assert r.returncode == 0, out[-3000:]
    assert out.count("ok ") == 2, out[-3000:]


# ---------------------------------------------------------------------------------------------
# GPU (sm90)
# ---------------------------------------------------------------------------------------------
def _need_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA kernel needs an sm90 device")


def _reference_check(q, k, v, qd, kd, vd, out, lse, causal, scale):
    kw = dict(softmax_scale=scale, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
              out_dtype=torch.float32)
    ref, ref_lse = attention_ref(q, k, v, return_lse=True, **kw)
    lowp = attention_ref(q, k, v, quantize_p=True, **kw)
    # bf16 output: half an ulp of bf16 at the output's magnitude on top of the rule's floor
    floor = 2e-3 * ref.abs().max().item() + ref.abs().max().item() * 2 ** -8
    assert_close_fa3(out.float(), ref, lowp, floor=floor)
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", [(256, 256), (256, 640), (384, 384)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_tma_vs_reference(sq, sk, causal, monkeypatch):
    _need_sm90()
    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "tma")  # raises if the fast path were not taken
    q, k, v, qd, kd, vd, out, lse = _case(b=2, sq=sq, sk=sk, hq=8, hk=2, device="cuda")
    vt = transpose_v_kmajor(v)
    assert dense_tma.supported(q, k, vt, out, **_kw(qd, kd, vd, lse, causal=causal))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    scale = 1.0 / math.sqrt(128)
    launch_dense_fwd(q, k, v, out, lse, softmax_scale=scale, causal=causal, window_size=(-1, -1), softcap=0.0,
                     q_descale=qd, k_descale=kd, v_descale=vd)
    _reference_check(q, k, v, qd, kd, vd, out, lse, causal, scale)


@pytest.mark.gpu
def test_gpu_tma_broadcast_descales_strided_lse_no_lse():
    _need_sm90()
    b, s, hq, hk = 2, 512, 4, 4
    q, k, v, _, _, _, out, _ = _case(b=b, sq=s, sk=s, hq=hq, hk=hk, device="cuda")
    qd = torch.tensor(0.11, device="cuda").reshape(1, 1).expand(b, hk)  # stride-0 views
    kd = torch.rand(1, hk, device="cuda").mul(0.2).add(0.05).expand(b, hk)
    vd = torch.rand(b, 1, device="cuda").add(0.5).expand(b, hk)
    lse_big = torch.full((b, s, hq), float("nan"), device="cuda")
    lse = lse_big.permute(0, 2, 1)  # (b, hq, s) with non-standard strides
    vt = transpose_v_kmajor(v)
    assert dense_tma.supported(q, k, vt, out, **_kw(qd, kd, vd, lse, causal=True))
    scale = 0.07
    dense_tma.launch_dense_fwd_tma(q, k, vt, out, lse, softmax_scale=scale, causal=True,
                                   q_descale=qd, k_descale=kd, v_descale=vd)
    _reference_check(q, k, v, qd, kd, vd, out, lse, True, scale)
    out2 = torch.empty_like(out)
    dense_tma.launch_dense_fwd_tma(q, k, vt, out2, None, softmax_scale=scale, causal=True,
                                   q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_tma_deterministic_and_backend_switch(causal, monkeypatch):
    _need_sm90()
    monkeypatch.delenv("FP8ATTN_DENSE_BACKEND", raising=False)  # the default dispatch
    q, k, v, qd, kd, vd, out, lse = _case(b=2, sq=1024, sk=1024, hq=8, hk=2, device="cuda")
    assert dense_tma.supported(q, k, transpose_v_kmajor(v), out, **_kw(qd, kd, vd, lse, causal=causal))
    kw = dict(softmax_scale=1.0 / math.sqrt(128), causal=causal, window_size=(-1, -1), softcap=0.0,
              q_descale=qd, k_descale=kd, v_descale=vd)
    launch_dense_fwd(q, k, v, out, lse, **kw)
    for _ in range(3):
        o2, l2 = torch.empty_like(out), torch.empty_like(lse)
        launch_dense_fwd(q, k, v, o2, l2, **kw)
        assert torch.equal(out.view(torch.int16), o2.view(torch.int16)) and torch.equal(lse, l2)
    # the Triton kernel on the same inputs: same numerics up to rounding order
    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "triton")
    ot, lt = torch.empty_like(out), torch.empty_like(lse)
    launch_dense_fwd(q, k, v, ot, lt, **kw)
    scale_ = ot.float().abs().max().item()
    assert (ot.float() - out.float()).abs().max().item() <= 0.05 * scale_
    torch.testing.assert_close(lt, lse, atol=1e-3, rtol=1e-4)
    # tma with unsupported inputs names the reason
    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "tma")
    with pytest.raises(ValueError, match="softcap"):
        launch_dense_fwd(q, k, v, ot, lt, **dict(kw, softcap=10.0))


@pytest.mark.gpu
def test_gpu_flash_attn_func_takes_fast_path(monkeypatch):
    _need_sm90()
    import fp8attn

    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "tma")
    q, k, v, qd, kd, vd, _, _ = _case(b=2, sq=256, sk=640, hq=8, hk=2, device="cuda")
    out = fp8attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    out = out[0] if isinstance(out, tuple) else out
    assert out.dtype == torch.bfloat16
    ref = attention_ref(q, k, v, softmax_scale=1.0 / math.sqrt(128), causal=True, q_descale=qd, k_descale=kd,
                        v_descale=vd, out_dtype=torch.float32)
    assert (out.float() - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
