"""TMA/wgmma dense forward (kernels/dense_launch) vs the reference, and its dispatch from launch_dense_fwd.

CPU: ``supported`` rejects every case outside the fast path's contract and accepts (up to the device
check) head dims 64, 128 and 256, qk 192 / v 128 (``FP8ATTN_TMA_QK192``) and the fused FP8 output, and every
kernel variant compiles ahead of time for sm90 when the compiler is present. GPU (`gpu` marker, sm90): head
dims 64, 128 and 256, causal and non-causal, seqlen_q == / < seqlen_k, GQA, random per-(batch, kv head)
descales, LSE, determinism, the FP8ATTN_DENSE_BACKEND switch; the fused e4m3 output against the Triton
kernel's (at most one e4m3 code apart) and against the reference, and under CUDA-graph replay with a
changed out_scale; qk 192 / v 128 against the reference (GQA, Sq != Sk causal, with and without an LSE, dense
and varlen) and its switch.
"""

import math
import os
import sys

import pytest
import torch

pytest.importorskip("triton")

import background
from fp8attn.kernels import dense as dense_mod
from fp8attn.kernels.dense import launch_dense_fwd, transpose_v_kmajor
from fp8attn.kernels.hopper import dense_launch
from fp8attn.kernels.hopper.dense_launch import varlen_v_kmajor
from fp8attn.reference import attention_ref
from helpers import assert_close_fa3, assert_row_scaled, dense_descales, fp8_randn

E4M3 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def _case(b=2, sq=256, sk=256, hq=8, hk=2, d=128, device="cpu"):
    q, k, v = (
        fp8_randn((b, sq, hq, d), device=device),
        fp8_randn((b, sk, hk, d), device=device),
        fp8_randn((b, sk, hk, d), device=device),
    )
    qd, kd, vd = dense_descales(b, hk, device)
    out = torch.empty(b, sq, hq, d, device=device, dtype=torch.bfloat16)
    lse = torch.empty(b, hq, sq, device=device)
    return q, k, v, qd, kd, vd, out, lse


def _codes(x):
    """e4m3 bytes -> integers on one line (sign-magnitude: neighbouring values differ by 1)."""
    u = x.view(torch.uint8).int()
    mag = u & 0x7F
    return torch.where(u >= 0x80, -mag, mag)


def _kw(qd, kd, vd, lse, **over):
    kw = dict(
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        out_scale=None,
        cu_seqlens_q=None,
        descale_block_q=None,
        descale_block_k=None,
        lse=lse,
    )
    kw.update(over)
    return kw


# ---------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------
def _want_block_list(qlens, klens, min_len, keys_cumulative):
    """The expected entries: (sequence, query block, first query row, query count, first key row, key count)."""
    want, q0, k0 = [], 0, 0
    for b, (n, nk) in enumerate(zip(qlens, klens)):
        if n >= min_len:
            want += [(b, j, q0, n, k0 if keys_cumulative else 0, nk) for j in range(-(-n // 128))]
        q0, k0 = q0 + n, k0 + nk
    return want


def _check_block_list(dev):
    g = torch.Generator().manual_seed(1)
    cases = [[1, 300, 0, 128, 127, 1000, 5, 129], torch.randint(0, 300, (300,), generator=g).tolist()]
    for qlens in cases:
        klens = [n + 7 * b for b, n in enumerate(qlens)]
        cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0] + torch.tensor(klens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        cap = sum(qlens) // 128 + len(qlens)
        for min_len in (1, 128):
            for keys_cumulative in (True, False):
                keys = cu_k if keys_cumulative else torch.tensor(klens, dtype=torch.int32, device=dev)
                got = dense_launch.varlen_block_list(cu, keys, keys_cumulative, sum(qlens), min_len).cpu()
                want = _want_block_list(qlens, klens, min_len, keys_cumulative)
                n = got[0].item()
                assert got.numel() == 8 * (1 + cap) and n == len(want) <= cap, (n, len(want), cap)
                entries = got[8 : 8 + 8 * n].view(n, 8)[:, :6]
                assert [tuple(e) for e in entries.tolist()] == want


def test_varlen_block_list():
    """``varlen_block_list``: the count, then one entry per block of each sequence (ceil(len / 128) blocks
    in order) with the sequence's query and key bounds, for the sequences with at least min_len_q queries;
    keys from cumulative offsets or per-sequence counts; 300 sequences (two 256-sequence chunks of the
    builder's prefix sum)."""
    if not (dense_mod.INTERPRET or torch.cuda.is_available()):
        pytest.skip("the list kernel needs CUDA or the interpreter")
    _check_block_list(DEV)


@pytest.mark.parametrize("path,token_major", [("kernel", False), ("kernel", True), ("torch", False)])
def test_varlen_v_kmajor_layout(path, token_major):
    """Each sequence's V keys contiguous from a 16-aligned column, in order: the Triton layout kernel
    (interpreted on the CPU) from V with the head dim or the tokens contiguous, and the torch path."""
    lens = [300, 0, 7, 1, 517, 16]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    v = fp8_randn((int(cu[-1]), 2, 64), device="cpu")
    if path == "torch":
        vt = dense_launch._varlen_v_kmajor_torch(v, cu)
    elif dense_mod.INTERPRET or torch.cuda.is_available():
        src = transpose_v_kmajor(v.to(DEV)) if token_major else v.to(DEV)
        assert src.stride(0) == 1 if token_major else src.stride(-1) == 1
        vt = varlen_v_kmajor(src, cu.to(DEV)).cpu()
    else:
        pytest.skip("the layout kernel needs CUDA or the interpreter")
    assert vt.dtype == E4M3 and vt.shape == (2, 64, 16 * (int(cu[-1]) // 16 + len(lens) + 1)) and vt.is_contiguous()
    used = torch.zeros(vt.shape[-1], dtype=torch.bool)
    end = 0
    for b, L in enumerate(lens):
        c0 = 16 * (int(cu[b]) // 16 + b)
        assert c0 % 16 == 0 and c0 >= end
        assert torch.equal(
            vt[:, :, c0 : c0 + L].view(torch.uint8), v[int(cu[b]) : int(cu[b + 1])].permute(1, 2, 0).view(torch.uint8)
        )
        used[c0 : c0 + L] = True
        end = c0 + L
    if path == "torch":
        assert not vt.view(torch.uint8)[:, :, ~used].any()


def test_varlen_preferred_rule():
    assert dense_launch.varlen_preferred(128, 1024) and dense_launch.varlen_preferred(64, 8192)
    assert not dense_launch.varlen_preferred(128, 1023) and not dense_launch.varlen_preferred(256, 8192)
    assert not dense_launch.varlen_preferred(128, None)


def test_varlen_rules():
    """Varlen inputs the bounded kernel takes pass every shape rule (only the device check is left on
    the CPU); the others are named."""
    total_q, total_k, hq, hk, d = 818, 832, 8, 2, 128
    q, k = fp8_randn((total_q, hq, d), device="cpu"), fp8_randn((total_k, hk, d), device="cpu")
    vt = fp8_randn((total_k, hk, d), device="cpu").permute(1, 2, 0).contiguous().permute(2, 0, 1)  # sequence-contiguous
    out = torch.empty(total_q, hq, d, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 300, 301, 818], dtype=torch.int32)
    cu_k = torch.tensor([0, 300, 310, 832], dtype=torch.int32)
    ds = torch.ones(3, hk)
    kw = _kw(ds, ds, ds, torch.empty(hq, total_q), causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert dense_launch.unsupported_reason(q, k, vt, out, **kw) == "inputs must be CUDA tensors"
    assert dense_launch.unsupported_reason(q, k, k, out, **kw) == "inputs must be CUDA tensors"  # V in any layout
    cases = [
        ((q, k, vt, out), dict(cu_seqlens_k=None), "cu_seqlens_k"),
        ((q, k, vt[:800], out), {}, "shape mismatch"),
        ((q, k, vt, out), dict(lse=torch.empty(total_q, hq)), "(nheads_q, total_q)"),
        ((q, k, vt, out), dict(cu_seqlens_k=cu_k.long()), "int32"),
        ((q, k, vt, out), dict(window_size=(64, 0)), "window"),
        ((q, k, vt, out.to(E4M3)), dict(out_scale=torch.ones(1)), "out_scale"),
    ]
    for args, over, words in cases:
        why = dense_launch.unsupported_reason(*args, **dict(kw, **over))
        assert why is not None and words in why, (words, why)
    q256, k256 = fp8_randn((total_q, hq, 256), device="cpu"), fp8_randn((total_k, hk, 256), device="cpu")
    out256 = torch.empty(total_q, hq, 256, dtype=torch.bfloat16)
    assert "head dim" in dense_launch.unsupported_reason(q256, k256, k256, out256, **kw)


def test_ws_config():
    """Two consumers by default (128-key tiles except at head dim 256); three only at head dim 64 without a
    causal mask, else a ValueError naming ``consumers``."""
    assert dense_launch.ws_config(128, True) == (2, 128, dense_launch.NUM_STAGES)
    assert dense_launch.ws_config(256, False) == (2, 64, dense_launch.NUM_STAGES)
    assert dense_launch.ws_config(64, False, 3) == (3, 64, 4)
    for args in ((64, True, 3), (128, False, 3), (64, False, 4)):
        with pytest.raises(ValueError, match="^consumers: "):
            dense_launch.ws_config(*args)


def test_supported_rejects_outside_contract():
    q, k, v, qd, kd, vd, out, lse = _case()
    vt = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # sequence-contiguous layout
    kw = _kw(qd, kd, vd, lse)
    # CPU tensors: never the fast path (and no CUDA call is made to find that out)
    assert not dense_launch.supported(q, k, vt, out, **kw)
    assert "CUDA" in dense_launch.unsupported_reason(q, k, vt, out, **kw)
    cu = torch.tensor([0, 256, 512], dtype=torch.int32)
    cases = {
        "varlen": dict(cu_seqlens_q=cu),
        "window": dict(window_size=(64, 0)),
        "right window": dict(window_size=(-1, 8)),
        "softcap": dict(softcap=20.0),
        "out_scale with bf16 out": dict(out_scale=torch.tensor([0.01])),
        "per-block": dict(descale_block_q=64, descale_block_k=64),
    }
    for name, over in cases.items():
        why = dense_launch.unsupported_reason(q, k, vt, out, **_kw(qd, kd, vd, lse, **over))
        assert why is not None and "CUDA" not in why, name
        assert not dense_launch.supported(q, k, vt, out, **_kw(qd, kd, vd, lse, **over)), name
    # the API's causal window (-1, 0) is the causal mask, not a sliding window
    assert "CUDA" in dense_launch.unsupported_reason(q, k, vt, out, **_kw(qd, kd, vd, lse, window_size=(-1, 0)))
    # shape / dtype cases are rejected before the device check as well
    q96, k96, v96, qd96, kd96, vd96, out96, lse96 = _case(d=96)
    assert "head dim" in dense_launch.unsupported_reason(q96, k96, v96, out96, **_kw(qd96, kd96, vd96, lse96))
    v64 = fp8_randn((2, 256, 2, 64), device="cpu")  # head dim of v != head dim of q/k
    out64 = torch.empty(2, 256, 8, 64, dtype=torch.bfloat16)
    assert "head dim" in dense_launch.unsupported_reason(q, k, v64, out64, **kw)
    q2, k2, v2, qd2, kd2, vd2, out2, lse2 = _case(sq=200, sk=200)
    assert not dense_launch.supported(q2, k2, v2, out2, **_kw(qd2, kd2, vd2, lse2))
    q0, k0, v0, out0 = q[:0], k[:0], vt[:0], out[:0]  # empty batch: nothing to launch
    assert "empty" in dense_launch.unsupported_reason(q0, k0, v0, out0, **_kw(qd[:0], kd[:0], vd[:0], lse[:0]))
    qh, kh, vh = q.to(torch.float16), k.to(torch.float16), vt.to(torch.float16)
    assert "float8_e4m3fn" in dense_launch.unsupported_reason(qh, kh, vh, out, **kw)
    out32 = out.float()
    assert "bfloat16" in dense_launch.unsupported_reason(q, k, vt, out32, **kw)


def test_supported_accepts_d64_d256_and_fp8_out():
    """Head dims 64 and 256 and the fused e4m3 output pass every shape/dtype rule: on CPU tensors the
    only reason left is the device check."""
    for d in (64, 128, 256):
        q, k, v, qd, kd, vd, out, lse = _case(d=d)
        vt = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        for causal in (False, True):
            why = dense_launch.unsupported_reason(q, k, vt, out, **_kw(qd, kd, vd, lse, causal=causal))
            assert "CUDA" in why, (d, causal, why)
            assert not dense_launch.supported(q, k, vt, out, **_kw(qd, kd, vd, lse, causal=causal))
        out8 = torch.empty(out.shape, dtype=E4M3)
        osc = torch.tensor([0.01])
        for scale in (osc, torch.tensor(0.01), osc.reshape(1, 1)):
            for lse_ in (lse, None):
                why = dense_launch.unsupported_reason(q, k, vt, out8, **_kw(qd, kd, vd, lse_, out_scale=scale))
                assert "CUDA" in why, (d, why)
        bad = {
            "e4m3 out without out_scale": (out8, None),
            "out_scale with bf16 out": (out, osc),
            "float64 out_scale": (out8, osc.double()),
            "two-element out_scale": (out8, torch.tensor([0.01, 0.02])),
            "python float out_scale": (out8, 0.01),
            "fp16 out with out_scale": (out.half(), osc),
        }
        for name, (o, sc) in bad.items():
            why = dense_launch.unsupported_reason(q, k, vt, o, **_kw(qd, kd, vd, lse, out_scale=sc))
            assert why is not None and "CUDA" not in why, (d, name)


@pytest.mark.gpu
def test_supported_rejects_on_gpu():
    """The shape/layout rules on CUDA tensors (seqlen 200, d96, non-contiguous V, causal sq > sk)."""
    q, k, v, qd, kd, vd, out, lse = _case(device="cuda")
    vt = transpose_v_kmajor(v)
    if torch.cuda.get_device_capability() != (9, 0):
        assert not dense_launch.supported(q, k, vt, out, **_kw(qd, kd, vd, lse))
        pytest.skip("not an sm90 device")
    assert dense_launch.supported(q, k, vt, out, **_kw(qd, kd, vd, lse))
    assert not dense_launch.supported(q, k, v, out, **_kw(qd, kd, vd, lse))  # V not sequence-contiguous
    q2, k2, v2, qd2, kd2, vd2, out2, lse2 = _case(sq=200, sk=200, device="cuda")
    assert "multiples of 128" in dense_launch.unsupported_reason(
        q2, k2, transpose_v_kmajor(v2), out2, **_kw(qd2, kd2, vd2, lse2)
    )
    q3, k3, v3, qd3, kd3, vd3, out3, lse3 = _case(d=96, device="cuda")
    assert "head dim" in dense_launch.unsupported_reason(
        q3, k3, transpose_v_kmajor(v3), out3, **_kw(qd3, kd3, vd3, lse3)
    )
    q6, k6, v6, qd6, kd6, vd6, out6, lse6 = _case(d=256, device="cuda")
    assert dense_launch.supported(q6, k6, transpose_v_kmajor(v6), out6, **_kw(qd6, kd6, vd6, lse6))
    q5, k5, v5, qd5, kd5, vd5, out5, lse5 = _case(d=64, device="cuda")
    assert dense_launch.supported(q5, k5, transpose_v_kmajor(v5), out5, **_kw(qd5, kd5, vd5, lse5))
    out8 = torch.empty(out5.shape, dtype=E4M3, device="cuda")
    osc = torch.tensor([0.01], device="cuda")
    assert dense_launch.supported(q5, k5, transpose_v_kmajor(v5), out8, **_kw(qd5, kd5, vd5, lse5, out_scale=osc))
    assert "device" in dense_launch.unsupported_reason(
        q5, k5, transpose_v_kmajor(v5), out8, **_kw(qd5, kd5, vd5, lse5, out_scale=osc.cpu())
    )
    q4, k4, v4, qd4, kd4, vd4, out4, lse4 = _case(sq=512, sk=256, device="cuda")
    assert not dense_launch.supported(q4, k4, transpose_v_kmajor(v4), out4, **_kw(qd4, kd4, vd4, lse4, causal=True))


_AOT_SNIPPET = """
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, {src!r})
sys.path.insert(0, {tests!r})
import tma_lockstep
from fp8attn.kernels.hopper import dense_launch
dense_launch._kernel_for = tma_lockstep.kernel_for  # (ws=False: the 8-warp reference kernels)
causal = CAUSAL
for d, ws in ((64, True), (64, False), (128, True), (128, False), (256, True), (256, False)):
    for out_fp8 in (False, True):
        k = dense_launch._aot_compile(causal, write_lse=True, head_dim=d, out_fp8=out_fp8, ws=ws)
        assert k.asm["cubin"], "no cubin"
        print("ok", d, ws, causal, out_fp8, k.metadata.shared)
for d in (64, 128):
    for out_fp8 in (False, True):
        k = dense_launch._aot_compile(causal, write_lse=True, head_dim=d, out_fp8=out_fp8, mode=dense_launch.MODE_PAGED)
        assert k.asm["cubin"], "no cubin"
        print("ok paged", d, causal, out_fp8, k.metadata.shared)
    k = dense_launch._aot_compile(causal, write_lse=True, head_dim=d, mode=dense_launch.MODE_PAGED, block_n=64)
    assert k.asm["cubin"], "no cubin"
    print("ok paged 64-key tiles", d, causal, k.metadata.shared)
    k = dense_launch._aot_compile(causal, write_lse=True, head_dim=d, mode=dense_launch.MODE_VARLEN)
    assert k.asm["cubin"], "no cubin"
    print("ok varlen", d, causal, k.metadata.shared)
    for bn in (None, 64):
        k = dense_launch._aot_compile(causal, write_lse=True, head_dim=d, out_fp8=bn is None,
                                   mode=dense_launch.MODE_PAGED_VARLEN, block_n=bn)
        assert k.asm["cubin"], "no cubin"
        print("ok paged varlen", d, causal, bn, k.metadata.shared)
    for mode in (dense_launch.MODE_PAGED, dense_launch.MODE_PAGED_VARLEN):
        for box in (None, 16, 64):
            k = dense_launch._aot_compile(causal, write_lse=True, head_dim=d, mode=mode, v_rows=True, box=box)
            assert k.asm["cubin"], "no cubin"
            print("ok paged V rows", d, causal, mode, box, k.metadata.shared)
if causal:  # without an LSE at d64: the row sums on the tensor core (softmax._rowsum_mma)
    k = dense_launch._aot_compile(causal, write_lse=False, head_dim=64)
    assert k.asm["cubin"], "no cubin"
    print("ok no lse causal", 64, k.metadata.shared)
else:  # without an LSE: the row sums on the tensor core (softmax._row_sum_issue)
    for d in (64, 128):
        for kw in (dict(out_fp8=False), dict(out_fp8=True), dict(mode=dense_launch.MODE_VARLEN)):
            k = dense_launch._aot_compile(causal, write_lse=False, head_dim=d, **kw)
            assert k.asm["cubin"], "no cubin"
            print("ok no lse", d, kw, k.metadata.shared)
    for kw in (dict(mode=dense_launch.MODE_PAGED, block_n=64), dict(mode=dense_launch.MODE_PAGED_VARLEN, v_rows=True, box=16)):
        k = dense_launch._aot_compile(causal, write_lse=False, head_dim=128, **kw)
        assert k.asm["cubin"], "no cubin"
        print("ok no lse", 128, kw, k.metadata.shared)
    for lse in (False, True):  # three consumer warpgroups (dense_launch.ws_config(consumers=3))
        k = dense_launch._aot_compile(causal, write_lse=lse, head_dim=64, consumers=3)
        assert k.asm["cubin"], "no cubin"
        print("ok three consumers", lse, k.metadata.shared)
"""


def _sm90_skip_reason():
    """Why the sm90 compile snippets cannot run here (no Gluon, no NVIDIA compiler backend), or None."""
    if not dense_launch.HAS_GLUON:
        return "triton without gluon"
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401 -- the probe
    except Exception as e:  # pragma: no cover
        return f"no NVIDIA compiler backend: {e}"
    return None


def _snippet_job(snippet, timeout):
    """``(argv, subprocess kwargs)`` running ``snippet`` (formatted with ``src`` and ``tests``, the test
    directory) in a clean process without interpreter mode."""
    code = snippet.format(src=os.path.abspath(SRC), tests=os.path.dirname(os.path.abspath(__file__)))
    return [sys.executable, "-c", code], dict(env=dict(os.environ, TRITON_INTERPRET="0"), timeout=timeout)


def _sm90_jobs(**snippets):
    """``background.jobs`` for the sm90 snippets ``key=snippet`` (none where they would skip)."""
    return lambda: {} if _sm90_skip_reason() else {k: _snippet_job(v, 420) for k, v in snippets.items()}


def _run_sm90_snippet(snippet, key=None, timeout=300):
    """Run ``snippet`` (``_snippet_job``; the background job ``key`` where one was started); its output.
    Skips without Gluon or the sm90 toolchain (ptxas, nvdisasm: the snippet prints "no nvdisasm")."""
    reason = _sm90_skip_reason()
    if reason:
        pytest.skip(reason)
    argv, kw = _snippet_job(snippet, timeout)
    r = background.result(key or snippet, argv, **kw)
    out = r.stdout + r.stderr
    if "no nvdisasm" in out or (r.returncode != 0 and "ptxas" in out and ("not found" in out or "No such file" in out)):
        pytest.skip("no sm90 toolchain (ptxas / nvdisasm)")
    assert r.returncode == 0, out[-3000:]
    return out


def _aot_snippet(causal):
    return _AOT_SNIPPET.replace("CAUSAL", str(causal))


@background.jobs(_sm90_jobs(aot_False=_aot_snippet(False), aot_True=_aot_snippet(True)))
@pytest.mark.parametrize("causal", [False, True])
def test_aot_compile_sm90(causal):
    """Every variant of the Gluon kernels (head dim 64/128/256, the warp-specialized and the 8-warp kernels,
    x bf16/e4m3 output; at 64 with an LSE the key-permuted K box when causal), and the paged-cache kernel at
    head dims 64 and 128 (and with 64-key tiles, and with V in K's layout in boxes of a tile or of a smaller
    page), in varlen mode and varlen over pages, and non-causal without an LSE (row sums on the tensor core)
    and with three consumers, compiles for sm90 without a GPU (in a clean process: no interpreter mode; one
    process per mask, started early by tests/background.py)."""
    out = _run_sm90_snippet(_aot_snippet(causal), key=f"aot_{causal}", timeout=420)
    # non-causal without an LSE: the row sums on the tensor core (8 more variants)
    # non-causal: also the three-consumer variant, with and without an LSE (2 more)
    # causal: d64 without an LSE (1 more)
    assert out.count("ok ") == (37 if causal else 46), out[-3000:]


# The start of a snippet that reads sm90 SASS: ``sass_of(kernel)`` disassembles a compiled kernel.
_SASS_PRELUDE = """
import os, re, subprocess, sys, tempfile
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, {src!r})
import triton.backends.nvidia
from fp8attn.kernels.hopper import dense_launch
nvdisasm = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "nvdisasm")
if not os.path.exists(nvdisasm):
    print("no nvdisasm"); sys.exit(0)
def sass_of(k):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
"""

_FP8_STORE_SNIPPET = (
    _SASS_PRELUDE
    + """
for out_fp8 in (False, True):
    sass = sass_of(dense_launch._aot_compile(False, write_lse=True, head_dim=128, out_fp8=out_fp8))
    print("counts", out_fp8, sass.count("STSM."), sass.count("STS.U16"), sass.count("STS.U8"))
"""
)


@background.jobs(_sm90_jobs(fp8_store=_FP8_STORE_SNIPPET))
def test_sm90_fp8_output_tile_is_stored_with_stmatrix():
    """The fused e4m3 output goes to shared memory as the bf16 output does, with stmatrix, not 1- or 2-byte
    stores (the wgmma accumulator holds byte pairs 8 columns apart; ``_fp8_store_layout`` regroups them in
    registers first): sm90 SASS of the d128 warp-specialized kernel, compiled without a GPU."""
    out = _run_sm90_snippet(_FP8_STORE_SNIPPET, key="fp8_store")
    counts = {
        line.split()[1]: [int(x) for x in line.split()[2:]] for line in out.splitlines() if line.startswith("counts ")
    }
    assert set(counts) == {"False", "True"}, out[-3000:]
    stsm_bf16, stsm_fp8 = counts["False"][0], counts["True"][0]
    assert stsm_bf16 > 0 and stsm_fp8 > 0, counts
    assert counts["True"][1:] == [0, 0], counts  # no 2- or 1-byte shared stores of the e4m3 tile


_V_ROWS_REGS_SNIPPET = (
    _SASS_PRELUDE
    + """
for box in (16, 64):
    sass = sass_of(dense_launch._aot_compile(True, write_lse=True, mode=dense_launch.MODE_PAGED, head_dim=128,
                                          v_rows=True, box=box))
    regs = sorted({{int(x, 16) for x in re.findall(r"USETMAXREG\\.\\S+\\s+(0x[0-9a-f]+)", sass)}})
    print("regs", box, *regs)
"""
)


@background.jobs(_sm90_jobs(v_rows=_V_ROWS_REGS_SNIPPET))
def test_sm90_v_rows_register_split():
    """The FA3-layout paged kernel's 12 warps share a 64512-register pool: with boxes of 64+ keys the
    transposing producer runs at 24 registers so both consumer warpgroups get 240 (at 32 the second got
    232); with 16-key boxes (page 16) the producer keeps 32. sm90 SASS (``USETMAXREG``), no GPU."""
    out = _run_sm90_snippet(_V_ROWS_REGS_SNIPPET, key="v_rows")
    regs = {
        int(line.split()[1]): {int(x) for x in line.split()[2:]}
        for line in out.splitlines()
        if line.startswith("regs ")
    }
    assert set(regs) == {16, 64}, out[-3000:]
    assert {24, 240} <= regs[64] and 32 not in regs[64] and 232 not in regs[64], regs
    assert 32 in regs[16] and 24 not in regs[16], regs


# ---------------------------------------------------------------------------------------------
# GPU (sm90)
# ---------------------------------------------------------------------------------------------
def _need_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA kernel needs an sm90 device")


def _reference_check(q, k, v, qd, kd, vd, out, lse, causal, scale, out_scale=None):
    kw = dict(softmax_scale=scale, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float32)
    ref, ref_lse = attention_ref(q, k, v, return_lse=True, **kw)
    lowp = attention_ref(q, k, v, quantize_p=True, **kw)
    if out_scale is None:
        # bf16 output: half an ulp of bf16 at the output's magnitude on top of the rule's floor
        floor = 2e-3 * ref.abs().max().item() + ref.abs().max().item() * 2**-8
        assert_close_fa3(out.float(), ref, lowp, floor=floor)
    else:
        # e4m3 output, dequantized: half an ulp of e4m3 at the output's magnitude on top of the floor
        floor = 2e-3 * ref.abs().max().item() + ref.abs().max().item() * 2**-4
        assert_close_fa3(out.float() * out_scale.float(), ref, lowp, floor=floor)
    if lse is not None:
        assert torch.isfinite(lse).all()
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq,sk", [(256, 256), (256, 640), (384, 384)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_tma_vs_reference(sq, sk, causal, d, monkeypatch):
    _need_sm90()
    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "tma")  # raises if the fast path were not taken
    q, k, v, qd, kd, vd, out, lse = _case(b=2, sq=sq, sk=sk, hq=8, hk=2, d=d, device="cuda")
    vt = transpose_v_kmajor(v)
    assert dense_launch.supported(q, k, vt, out, **_kw(qd, kd, vd, lse, causal=causal))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    scale = 1.0 / math.sqrt(d)
    launch_dense_fwd(
        q,
        k,
        v,
        out,
        lse,
        softmax_scale=scale,
        causal=causal,
        window_size=(-1, -1),
        softcap=0.0,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
    )
    _reference_check(q, k, v, qd, kd, vd, out, lse, causal, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_tma_broadcast_descales_strided_lse_no_lse(d):
    _need_sm90()
    b, s, hq, hk = 2, 512, 4, 4
    q, k, v, _, _, _, out, _ = _case(b=b, sq=s, sk=s, hq=hq, hk=hk, d=d, device="cuda")
    qd = torch.tensor(0.11, device="cuda").reshape(1, 1).expand(b, hk)  # stride-0 views
    kd = torch.rand(1, hk, device="cuda").mul(0.2).add(0.05).expand(b, hk)
    vd = torch.rand(b, 1, device="cuda").add(0.5).expand(b, hk)
    lse_big = torch.full((b, s, hq), float("nan"), device="cuda")
    lse = lse_big.permute(0, 2, 1)  # (b, hq, s) with non-standard strides
    vt = transpose_v_kmajor(v)
    assert dense_launch.supported(q, k, vt, out, **_kw(qd, kd, vd, lse, causal=True))
    scale = 0.07
    dense_launch.launch_dense_fwd_tma(
        q, k, vt, out, lse, softmax_scale=scale, causal=True, q_descale=qd, k_descale=kd, v_descale=vd
    )
    _reference_check(q, k, v, qd, kd, vd, out, lse, True, scale)
    out2 = torch.empty_like(out)
    dense_launch.launch_dense_fwd_tma(
        q, k, vt, out2, None, softmax_scale=scale, causal=True, q_descale=qd, k_descale=kd, v_descale=vd
    )
    if d == 64:  # causal without an LSE at d64: the row sums from the tensor core
        assert_row_scaled(out2, out)
    else:
        assert torch.equal(out.view(torch.int16), out2.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_tma_deterministic_and_backend_switch(causal, d, monkeypatch):
    _need_sm90()
    monkeypatch.delenv("FP8ATTN_DENSE_BACKEND", raising=False)  # the default dispatch
    q, k, v, qd, kd, vd, out, lse = _case(b=2, sq=1024, sk=1024, hq=8, hk=2, d=d, device="cuda")
    assert dense_launch.supported(q, k, transpose_v_kmajor(v), out, **_kw(qd, kd, vd, lse, causal=causal))
    kw = dict(
        softmax_scale=1.0 / math.sqrt(d),
        causal=causal,
        window_size=(-1, -1),
        softcap=0.0,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
    )
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
    ref = attention_ref(
        q,
        k,
        v,
        softmax_scale=1.0 / math.sqrt(128),
        causal=True,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        out_dtype=torch.float32,
    )
    assert (out.float() - ref).abs().max().item() <= 0.05 * ref.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq,sk", [(256, 256), (256, 640), (1024, 1024)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_tma_fp8_out(sq, sk, causal, d, monkeypatch):
    """Fused e4m3 output: within FP8 attention error of the Triton kernel's fused output (also where it
    saturates), the reference within the FA3 rule after dequantizing, LSE as with bf16 output, and at
    most one e4m3 code from this kernel's own bf16 output quantized afterwards."""
    _need_sm90()
    q, k, v, qd, kd, vd, out, lse = _case(b=2, sq=sq, sk=sk, hq=8, hk=2, d=d, device="cuda")
    scale = 1.0 / math.sqrt(d)
    kw = dict(
        softmax_scale=scale, causal=causal, window_size=(-1, -1), softcap=0.0, q_descale=qd, k_descale=kd, v_descale=vd
    )
    ref = attention_ref(
        q, k, v, softmax_scale=scale, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float32
    )
    calibrated = (ref.abs().max() / 448.0).reshape(1).float()
    for osc in (calibrated, calibrated * 0.25):  # the second one saturates the largest outputs
        out8 = torch.full(out.shape, float("nan"), device="cuda").to(E4M3)
        lse.fill_(float("nan"))
        assert dense_launch.supported(
            q, k, transpose_v_kmajor(v), out8, **_kw(qd, kd, vd, lse, causal=causal, out_scale=osc)
        )
        monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "tma")  # raises if the fast path were not taken
        launch_dense_fwd(q, k, v, out8, lse, out_scale=osc, **kw)
        monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "triton")
        ot8, lt = torch.empty_like(out8), torch.empty_like(lse)
        launch_dense_fwd(q, k, v, ot8, lt, out_scale=osc, **kw)
        assert not torch.isnan(out8.float()).any()
        # The Triton kernel may tile the keys differently (BLOCK_N 64 vs 128), which moves the running
        # max and so the e4m3 rounding of P: the two agree within FP8 attention error, not bit-wise.
        # Bit-level agreement is checked against this kernel's own bf16-output path below.
        both = ref.abs().max().item() * (2e-3 + 2**-3)
        assert (out8.float() - ot8.float()).abs().max().item() * osc.item() <= both
        torch.testing.assert_close(lt, lse, atol=1e-3, rtol=1e-4)
        if osc is calibrated:
            _reference_check(q, k, v, qd, kd, vd, out8, lse, causal, scale, out_scale=osc)
            _reference_check(q, k, v, qd, kd, vd, ot8, lt, causal, scale, out_scale=osc)
        else:
            assert out8.float().abs().max().item() == 448.0
    # the fused output is the bf16 path's fp32 output quantized: compare with the bf16 output (the fp32
    # values differ from their bf16 rounding by less than half a bf16 ulp, so at most one code apart)
    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "tma")
    launch_dense_fwd(q, k, v, out, None, **kw)
    from_bf16 = (out.float() * (1.0 / calibrated)).clamp(-448, 448).to(E4M3)
    out8 = torch.empty(out.shape, device="cuda", dtype=E4M3)
    launch_dense_fwd(q, k, v, out8, None, out_scale=calibrated, **kw)
    assert (_codes(out8) - _codes(from_bf16)).abs().max().item() <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("backend,varlen", [("tma", False), ("triton", False), ("triton", True)])
@pytest.mark.parametrize("with_lse", [False, True])
def test_gpu_fp8_out_bits_equal_the_epilogue_formula(d, backend, varlen, with_lse, monkeypatch):
    """The fused e4m3 output equals clamp(out * (1 / out_scale), -448, 448).to(e4m3) bit for bit, through both
    copies of the epilogue: the TMA kernel's (``epilogue._output_epilogue``, Gluon; fixed-length calls of
    128-multiples) and the Triton kernel's (``common.output_epilogue``; other lengths, and varlen calls with
    ``out_scale``), on inputs whose fp32 output is known exactly: every key is zero, so every logit is exactly 0
    whichever way a kernel forms ``s - max``, each P entry is the same power of two (exp2 of the kernels' P offset)
    and the output is the mean of V's rows (256 keys, a power of two; V's magnitudes in
    [1/2, 4), so every partial sum is exact in fp32) times a power-of-two v_descale. The scales 0.013 and
    1/448 are not powers of two, so the epilogue's own rounding decides the codes; 1/2048 saturates."""
    _need_sm90()
    import fp8attn

    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", backend)  # tma: raises if the TMA kernel were not taken
    b, sq, sk, hq, hk = 2, 256 if backend == "tma" else 200, 256, 4, 2
    g = torch.Generator(device="cuda").manual_seed(d)
    q = fp8_randn((b, sq, hq, d), device="cuda")
    k = torch.zeros(b, sk, hk, d, device="cuda").to(E4M3)
    # magnitudes in [1/2, 4): within one wgmma's 32-key sum the terms stay within 11 bits of each other (its
    # internal alignment keeps more), and the fp32 sums over 256 keys are exact
    mag = torch.empty(b, sk, hk, d, device="cuda").uniform_(-1, 1.9, generator=g).exp2()
    sign = torch.randint(0, 2, (b, sk, hk, d), device="cuda", generator=g) * 2 - 1
    v = (mag * sign).to(E4M3)
    qd = torch.rand(b, hk, device="cuda", generator=g) * 0.3 + 0.02
    kd = torch.rand(b, hk, device="cuda", generator=g) * 0.3 + 0.02
    vd = 2.0 ** torch.randint(-2, 3, (b, hk), device="cuda", generator=g).float()
    exact = v.float().sum(1) / sk * vd[:, :, None]  # (b, hk, d), exact in fp32
    exact = exact.repeat_interleave(hq // hk, dim=1)[:, None].expand(b, sq, hq, d)
    for osc in (0.013, 1.0 / 448, 1.0 / 2048):
        st = torch.tensor([osc], device="cuda")
        want = (exact * (1.0 / st)).clamp(-448, 448).to(E4M3)
        if varlen:
            cu = torch.tensor([0, sq, 2 * sq], dtype=torch.int32, device="cuda")
            cuk = torch.tensor([0, sk, 2 * sk], dtype=torch.int32, device="cuda")
            res = fp8attn.flash_attn_varlen_func(
                q.flatten(0, 1),
                k.flatten(0, 1),
                v.flatten(0, 1),
                cu,
                cuk,
                sq,
                sk,
                q_descale=qd,
                k_descale=kd,
                v_descale=vd,
                out_scale=st,
                return_attn_probs=with_lse,
            )
        else:
            res = fp8attn.flash_attn_func(
                q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, out_scale=st, return_attn_probs=with_lse
            )
        out = (res[0] if with_lse else res).reshape(b, sq, hq, d)
        assert out.dtype == E4M3
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (
            osc,
            (_codes(out) - _codes(want)).abs().max(),
        )
    assert want.float().abs().max().item() == 448.0  # the last scale saturates


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_tma_fp8_out_cuda_graph(d, monkeypatch):
    """out_scale is read on the device: a captured launch follows a new out_scale value on replay."""
    _need_sm90()
    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "tma")
    q, k, v, qd, kd, vd, out, lse = _case(b=2, sq=512, sk=512, hq=8, hk=2, d=d, device="cuda")
    kw = dict(
        softmax_scale=1.0 / math.sqrt(d),
        causal=True,
        window_size=(-1, -1),
        softcap=0.0,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
    )
    osc = torch.tensor([0.002], device="cuda")
    out8 = torch.empty(out.shape, device="cuda", dtype=E4M3)
    launch_dense_fwd(q, k, v, out8, lse, out_scale=osc, **kw)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch_dense_fwd(q, k, v, out8, lse, out_scale=osc, **kw)
    for value in (0.002, 0.004):
        osc.fill_(value)
        out8.zero_()
        g.replay()
        torch.cuda.synchronize()
        # the eager reference writes an LSE too: at d64 causal the no-LSE variant sums rows on the
        # tensor core, so only the same variant is bit-comparable
        ref8 = torch.empty_like(out8)
        launch_dense_fwd(q, k, v, ref8, torch.empty_like(lse), out_scale=osc, **kw)
        assert torch.equal(out8.view(torch.uint8), ref8.view(torch.uint8)), value


@pytest.mark.gpu
def test_gpu_flash_attn_func_fp8_out_takes_fast_path(monkeypatch):
    _need_sm90()
    import fp8attn

    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "tma")
    for d in (64, 128):
        q, k, v, qd, kd, vd, _, _ = _case(b=2, sq=256, sk=640, hq=8, hk=2, d=d, device="cuda")
        osc = torch.tensor([0.003], device="cuda")
        out = fp8attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, out_scale=osc)
        out = out[0] if isinstance(out, tuple) else out
        assert out.dtype == E4M3
        ref = attention_ref(
            q,
            k,
            v,
            softmax_scale=1.0 / math.sqrt(d),
            causal=True,
            q_descale=qd,
            k_descale=kd,
            v_descale=vd,
            out_dtype=torch.float32,
        )
        assert (
            out.float() * 0.003 - ref.clamp(-448 * 0.003, 448 * 0.003)
        ).abs().max().item() <= 0.12 * ref.abs().max().item()  # e4m3 rounding (2^-4 relative) + the FP8 attention error


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_quantize_qkv_v_feeds_tma_without_transpose(causal, monkeypatch):
    """quantize_qkv's sequence-major v8 reaches the TMA kernel through flash_attn_func with no transpose
    pass, bit-identical to the row-major v8 (which is transposed first)."""
    _need_sm90()
    import fp8attn
    from fp8attn.kernels import dense as dense_mod

    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "tma")
    x = [torch.randn(2, 512, h, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2)]
    q8, k8, v8, qd, kd, vd = fp8attn.quantize_qkv(*x)
    v8_rows = fp8attn.quantize_qkv(*x, v_layout="contiguous")[2]
    row = fp8attn.flash_attn_func(q8, k8, v8_rows, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    monkeypatch.setattr(dense_mod, "transpose_v_kmajor", lambda v: pytest.fail("V transposed"))
    seq = fp8attn.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    assert torch.equal(seq.view(torch.int16), row.view(torch.int16))


@pytest.mark.gpu
def test_gpu_varlen_and_triton_paths_take_quantize_qkv_v(monkeypatch):
    """quantize_qkv's sequence-major v8 on the paths the TMA kernel does not serve (varlen, a sliding
    window, head dim 256): no transpose, the same result as row-major v8, and the reference rule."""
    import fp8attn
    from fp8attn.kernels import dense as dense_mod

    lens = [300, 1, 517]
    cu = torch.tensor([0, 300, 301, 818], dtype=torch.int32, device="cuda")
    for d in (128, 256):
        x = [torch.randn(818, h, d, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2)]
        q8, k8, v8, qd, kd, vd = fp8attn.quantize_qkv(*x, granularity="per_tensor")
        v8_rows = fp8attn.quantize_qkv(*x, granularity="per_tensor", v_layout="contiguous")[2]
        kw = dict(
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=max(lens),
            max_seqlen_k=max(lens),
            causal=True,
            q_descale=qd.reshape(-1)[:1],
            k_descale=kd.reshape(-1)[:1],
            v_descale=vd.reshape(-1)[:1],
            window_size=(128, 0),
        )
        row = fp8attn.flash_attn_varlen_func(q8, k8, v8_rows, **kw)
        with monkeypatch.context() as m:
            m.setattr(dense_mod, "transpose_v_kmajor", lambda v: pytest.fail("V transposed"))
            seq = fp8attn.flash_attn_varlen_func(q8, k8, v8, **kw)
        assert torch.equal(seq.view(torch.int16), row.view(torch.int16))
        for i in range(len(lens)):  # each sequence against the reference on its slice
            s0, s1 = int(cu[i]), int(cu[i + 1])
            one = dict(
                softmax_scale=d**-0.5,
                causal=True,
                window_size=(128, 0),
                q_descale=qd.reshape(-1)[:1],
                k_descale=kd.reshape(-1)[:1],
                v_descale=vd.reshape(-1)[:1],
                out_dtype=torch.float32,
            )
            ref = attention_ref(q8[None, s0:s1], k8[None, s0:s1], v8[None, s0:s1], **one)
            lowp = attention_ref(q8[None, s0:s1], k8[None, s0:s1], v8[None, s0:s1], quantize_p=True, **one)
            floor = 2e-3 * ref.abs().max().item() + ref.abs().max().item() * 2**-8
            assert_close_fa3(seq[None, s0:s1].float(), ref, lowp, floor=floor)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("out_fp8", [False, True])
def test_gpu_tma_direct_launch_equals_jit_launch(d, out_fp8):
    """The first launch per (head dim, constexprs) goes through triton's JIT and keeps the compiled
    kernel; later launches call it directly (dense_launch._launch). Both give the same bits, also when the
    later launch changes every run-time integer (batch, lengths, heads, strides)."""
    _need_sm90()
    q, k, v, qd, kd, vd, out, lse = _case(b=2, sq=256, sk=384, hq=4, hk=2, d=d, device="cuda")
    scale = torch.tensor([0.37], device="cuda") if out_fp8 else None
    if out_fp8:
        out = torch.empty_like(out, dtype=E4M3)
    vt = transpose_v_kmajor(v)
    kw = dict(softmax_scale=0.09, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, out_scale=scale)
    dense_launch._COMPILED.clear()
    dense_launch.launch_dense_fwd_tma(q, k, vt, out, lse, **kw)  # JIT path
    assert any(key[1] == d for key in dense_launch._COMPILED), "the compiled kernel was not kept"
    out2, lse2 = torch.empty_like(out), torch.empty_like(lse)
    dense_launch.launch_dense_fwd_tma(q, k, vt, out2, lse2, **kw)  # direct path
    assert torch.equal(out.view(torch.uint8), out2.view(torch.uint8)) and torch.equal(lse, lse2)
    # other run-time integers on the kept kernel, against a fresh JIT launch of the same inputs
    q3, k3, v3, qd3, kd3, vd3, out3, _ = _case(b=1, sq=128, sk=640, hq=6, hk=3, d=d, device="cuda")
    if out_fp8:
        out3 = torch.empty_like(out3, dtype=E4M3)
    lse3 = torch.empty(1, 128, 6, device="cuda").permute(0, 2, 1)
    kw3 = dict(kw, q_descale=qd3, k_descale=kd3, v_descale=vd3)
    vt3 = transpose_v_kmajor(v3)
    dense_launch.launch_dense_fwd_tma(q3, k3, vt3, out3, lse3, **kw3)
    dense_launch._COMPILED.clear()
    out4, lse4 = torch.empty_like(out3), torch.empty_like(lse3)
    dense_launch.launch_dense_fwd_tma(q3, k3, vt3, out4, lse4, **kw3)
    assert torch.equal(out3.view(torch.uint8), out4.view(torch.uint8)) and torch.equal(lse3, lse4)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_tma_row_sums_without_lse(d):
    """Without an LSE a non-causal call sums each row's e4m3 P on the tensor core (``softmax._row_sum_issue``
    over a TMA-loaded tile of ones); with one, the fp32 sum of the unrounded P, so that the LSE is exact.
    Dense (bf16 and fused e4m3 output, GQA, per-(batch, kv head) descales) and varlen: the two outputs
    are row-scaled copies of each other (``assert_row_scaled``) and both pass the reference rule. Causal
    calls do the same at head dim 64; at 128 causal calls and the fused e4m3 output sum in fp32 either way:
    the same bits."""
    _need_sm90()
    q, k, v, qd, kd, vd, out, lse = _case(b=2, sq=384, sk=640, hq=6, hk=2, d=d, device="cuda")
    vt = transpose_v_kmajor(v)
    for causal in (False, True):
        for out_scale in (None, torch.tensor([0.21], device="cuda")):
            kw = dict(softmax_scale=0.088, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, out_scale=out_scale)
            dt = E4M3 if out_scale is not None else torch.bfloat16
            o_lse, o_rs = (torch.full(out.shape, float("nan"), device="cuda").to(dt) for _ in range(2))
            dense_launch.launch_dense_fwd_tma(q, k, vt, o_lse, lse, **kw)
            dense_launch.launch_dense_fwd_tma(q, k, vt, o_rs, None, **kw)
            if d == 128 and (causal or out_scale is not None):
                assert torch.equal(o_rs.view(torch.uint8), o_lse.view(torch.uint8))
            else:
                assert_row_scaled(o_rs, o_lse, out_scale is not None)
                _reference_check(q, k, v, qd, kd, vd, o_rs, None, causal, 0.088, out_scale=out_scale)
    lens_q, lens_k = [300, 1, 517, 128], [300, 50, 901, 128]
    vq, vk, vv, vqd, vkd, vvd, cu_q, cu_k = _varlen_case(lens_q, lens_k, d=d)
    o_lse, _ = _varlen_run(vq, vk, vv, vqd, vkd, vvd, cu_q, cu_k, False)
    o_rs, _ = _varlen_run(vq, vk, vv, vqd, vkd, vvd, cu_q, cu_k, False, with_lse=False)
    assert_row_scaled(o_rs, o_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk", [(128, 256), (640, 384), (1152, 1280)])
def test_gpu_tma_three_consumers_d64(sq, sk, monkeypatch):
    """The warp-specialized kernel's three-consumer variant (``dense_launch.ws_config(consumers=3)``: head dim 64
    without a causal mask, 192-row blocks, 64-key tiles): a sequence's last block may end past it (here by 64
    or 128 rows, which in a batch are the next sequence's), and those rows are neither stored nor written to
    the LSE. Against the reference and against the default two consumers, with and without an LSE, bf16 and
    fused e4m3 output, GQA, per-(batch, kv head) descales; and bit-identical on a repeat."""
    _need_sm90()
    assert dense_launch.ws_config(64, False)[0] == 2
    q, k, v, qd, kd, vd, out, lse = _case(b=3, sq=sq, sk=sk, hq=6, hk=2, d=64, device="cuda")
    vt = transpose_v_kmajor(v)
    default = dense_launch.ws_config
    for out_scale in (None, torch.tensor([0.21], device="cuda")):
        kw = dict(softmax_scale=0.125, causal=False, q_descale=qd, k_descale=kd, v_descale=vd, out_scale=out_scale)
        dt = E4M3 if out_scale is not None else torch.bfloat16
        runs = {}
        for consumers in (3, 2):
            monkeypatch.setattr(
                dense_launch, "ws_config", lambda d, c, n=None, consumers=consumers: default(d, c, consumers)
            )
            for with_lse in (True, False):
                o = torch.full(out.shape, float("nan"), device="cuda").to(dt)
                ls = torch.full_like(lse, float("nan")) if with_lse else None
                dense_launch.launch_dense_fwd_tma(q, k, vt, o, ls, **kw)
                _reference_check(q, k, v, qd, kd, vd, o, ls, False, 0.125, out_scale=out_scale)
                runs[consumers, with_lse] = (o, ls)
        o3, l3 = runs[3, True]
        torch.testing.assert_close(l3, runs[2, True][1], atol=1e-3, rtol=1e-4)
        assert_row_scaled(runs[3, False][0], o3, out_scale is not None)
        monkeypatch.setattr(dense_launch, "ws_config", lambda d, c, n=None: default(d, c, 3))
        o = torch.full(out.shape, float("nan"), device="cuda").to(dt)
        ls = torch.full_like(lse, float("nan"))
        dense_launch.launch_dense_fwd_tma(q, k, vt, o, ls, **kw)
        assert torch.equal(o.view(torch.uint8), o3.view(torch.uint8)) and torch.equal(ls, l3)


def _on_both_kernels(monkeypatch, q, k, vt, out, lse, **kw):
    """``[(out, lse) of the warp-specialized kernel, (out, lse) of the 8-warp kernel]`` for the same call,
    the kernel choice (``_use_ws``) forced, each written into NaN-filled tensors shaped like out / lse."""
    import tma_lockstep  # (Gluon only: the 8-warp kernels, a reference kept outside the package)

    monkeypatch.setattr(dense_launch, "_kernel_for", tma_lockstep.kernel_for)
    res = []
    for ws in (True, False):
        monkeypatch.setattr(dense_launch, "_use_ws", lambda head_dim, causal, seqlen_q, ws=ws: ws)
        o, ls = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
        dense_launch.launch_dense_fwd_tma(q, k, vt, o, ls, **kw)
        res.append((o, ls))
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(128, 128), (256, 640), (512, 512)])
def test_gpu_tma_warp_specialized_equals_8warp_kernel(causal, sq, sk, d, monkeypatch):
    """Forced onto both kernels at small shapes, the warp-specialized kernel gives the bits of the
    8-warp kernel of the same head dim (same softmax step and accumulation order; at 256 both split
    the head dim the same way), bf16 and fused e4m3 output, with GQA and per-(batch, kv head)
    descales, and passes the reference rule."""
    _need_sm90()
    q, k, v, qd, kd, vd, out, lse = _case(b=2, sq=sq, sk=sk, hq=6, hk=2, d=d, device="cuda")
    vt = transpose_v_kmajor(v)
    for out_scale in (None, torch.tensor([0.21], device="cuda")):
        o = torch.empty_like(out, dtype=E4M3 if out_scale is not None else torch.bfloat16)
        (o_ws, l_ws), (o_8w, l_8w) = _on_both_kernels(
            monkeypatch,
            q,
            k,
            vt,
            o,
            lse,
            softmax_scale=0.088,
            causal=causal,
            q_descale=qd,
            k_descale=kd,
            v_descale=vd,
            out_scale=out_scale,
        )
        assert torch.equal(o_ws.view(torch.uint8), o_8w.view(torch.uint8)) and torch.equal(l_ws, l_8w)
        _reference_check(q, k, v, qd, kd, vd, o_ws, l_ws, causal, 0.088, out_scale=out_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_sms", [3, 7, None])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_tma_persistent_schedule_equals_8warp_kernel(causal, num_sms, d, monkeypatch):
    """The warp-specialized kernel is persistent: one CTA per SM walks the query blocks in rounds
    (alternating direction), with a double-buffered Q and one K/V ring across blocks. With the grid cut
    to 3 or 7 CTAs (many rounds, odd and even, a partial last round) and at the real SM count, every
    block is written and gives the 8-warp kernel's bits; so does a causal input on the one-block-per-CTA
    grid (seqlen_q above ``_WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q``, forced at head dim 64 too, which the launcher
    runs persistent at any length)."""
    _need_sm90()
    q, k, v, qd, kd, vd, out, lse = _case(b=3, sq=640, sk=896, hq=4, hk=2, d=d, device="cuda")
    vt = transpose_v_kmajor(v)
    if num_sms is not None:
        monkeypatch.setattr(dense_launch, "_num_sms", lambda index: num_sms)
    for max_persistent in (8192, 0) if causal else (8192,):  # causal: persistent, then one block per CTA
        monkeypatch.setattr(dense_launch, "_WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q", max_persistent)
        monkeypatch.setattr(dense_launch, "_WS_PERSISTENT_CAUSAL_HEAD_DIMS", () if max_persistent == 0 else (64,))
        (o_ws, l_ws), (o_8w, l_8w) = _on_both_kernels(
            monkeypatch,
            q,
            k,
            vt,
            out,
            lse,
            softmax_scale=0.088,
            causal=causal,
            q_descale=qd,
            k_descale=kd,
            v_descale=vd,
        )
        assert not torch.isnan(o_ws).any() and not torch.isnan(l_ws).any(), "a query block was not written"
        if dense_launch.kperm_on(d, 2, causal, True):
            # K key-permuted: the fp32 row sums add in another order, so l (and the LSE) may differ in its
            # last bits and an output in its last bf16 bit
            _assert_within_ulps(o_ws, o_8w, l_ws, l_8w)
        else:
            assert torch.equal(o_ws.view(torch.uint8), o_8w.view(torch.uint8)) and torch.equal(l_ws, l_8w)
    _reference_check(q, k, v, qd, kd, vd, o_ws, l_ws, causal, 0.088)


def _assert_within_ulps(o, o_ref, lse, lse_ref):
    """bf16 outputs at most one bf16 ulp apart, LSEs within 1e-5 (the key-permuted box moved them by up to
    1.4e-6 on the H200: its fp32 row sums add in another order)."""
    diff = (o.float() - o_ref.float()).abs()
    assert bool((diff <= o_ref.float().abs() * 2**-7).all()), diff.max().item()
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("fp8_out", [False, True])
def test_gpu_tma_kperm_matches_plain_box(causal, with_lse, fp8_out, monkeypatch):
    """Head dim 64: K loaded key-permuted (``dense_launch.kperm_on``; P then needs no cross-lane exchange)
    gives the output bits of the plain K box without an LSE, forced both ways whatever the rule picks, with GQA,
    sequences of 384 queries over 640 keys, non-unit descales, bf16 and fused e4m3 output. With an LSE the
    row sums are fp32 and add in another order: the LSE within 1e-5 and the output within one ulp."""
    _need_sm90()
    q, k, v, qd, kd, vd, out, lse = _case(b=2, sq=384, sk=640, hq=6, hk=2, d=64, device="cuda")
    vt = transpose_v_kmajor(v)
    osc = torch.tensor([0.05], device="cuda") if fp8_out else None
    res = []
    for forced in (True, False):
        monkeypatch.setattr(dense_launch, "kperm_on", lambda *args, f=forced: f)
        o = torch.full(out.shape, float("nan"), device="cuda").to(E4M3 if fp8_out else torch.bfloat16)
        ls = torch.full_like(lse, float("nan")) if with_lse else None
        dense_launch.launch_dense_fwd_tma(
            q, k, vt, o, ls, softmax_scale=0.088, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, out_scale=osc
        )
        res.append((o, ls))
    (o_p, l_p), (o_n, l_n) = res
    if with_lse:
        torch.testing.assert_close(l_p, l_n, atol=1e-5, rtol=0)
        if fp8_out:
            assert (_codes(o_p) - _codes(o_n)).abs().max().item() <= 1
        else:
            _assert_within_ulps(o_p, o_n, l_p, l_n)
    else:
        assert torch.equal(o_p.view(torch.uint8), o_n.view(torch.uint8))
    _reference_check(q, k, v, qd, kd, vd, o_p, l_p, causal, 0.088, out_scale=osc)


def test_kperm_rule_and_box():
    """Key-permuted K at head dim 64 with two consumers, except non-causal calls with an LSE; the 5-D view
    reads shared-memory row 16a + 8g + 2q + e from key 16a + 4q + 2g + e."""
    assert dense_launch.kperm_on(64, 2, False, False) and dense_launch.kperm_on(64, 2, True, True)
    assert dense_launch.kperm_on(64, 2, True, False) and not dense_launch.kperm_on(64, 2, False, True)
    assert not any(dense_launch.kperm_on(d, 2, c, w) for d in (128, 256) for c in (False, True) for w in (False, True))
    assert not dense_launch.kperm_on(64, 3, False, False)
    k = torch.arange(2 * 256, dtype=torch.int32).view(2, 256, 1, 1).expand(2, 256, 3, 64).contiguous()
    shape, strides = dense_launch._kperm_view(k)
    assert shape == [2 * 256 // 16, 2, 4, 2, 3 * 64] and strides[-1] == 1
    box = torch.as_strided(k.view(-1), shape, strides)  # element strides of the same view
    rows = box[:, :, :, :, 64 + 5].reshape(-1)  # smem order: (a, g, q, e) row-major; head 1, column 5
    a, g, q, e = torch.meshgrid(*(torch.arange(n) for n in (2 * 256 // 16, 2, 4, 2)), indexing="ij")
    assert torch.equal(rows, (16 * a + 4 * q + 2 * g + e).reshape(-1).int())
    assert dense_launch.kperm_box(128, 64) == [8, 2, 4, 2, 64]
    # the consumers' view: S column c holds key _kperm_keys(c), and _p_operand's relabelling puts the
    # columns back in key order
    from fp8attn.kernels.hopper.softmax import _kperm_keys

    c = torch.arange(128)
    keys = _kperm_keys.fn(c)
    assert torch.equal(keys, rows[:128].long())
    relabelled = keys.view(1, 8, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(128)
    assert torch.equal(relabelled, c)


def test_kernel_choice_by_head_dim_and_length(monkeypatch):
    """Every head dim runs the warp-specialized kernel at every length (the rule of ``_use_ws``); the grid is
    persistent except for causal inputs beyond ``_WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q`` at head dims 128 and
    256 (dense) or from the paged launcher, which passes no head dim, and for causal inputs with more K/V
    than ``_WS_PERSISTENT_CAUSAL_MAX_KV_BYTES``."""
    longest = dense_launch._WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q
    for d in (64, 128, 256):
        assert all(dense_launch._use_ws(d, c, s) for c in (False, True) for s in (512, longest, 4 * longest))
    grid, n_sms = dense_launch.ws_grid, 132
    monkeypatch.setattr(dense_launch, "_num_sms", lambda index: n_sms)
    assert grid(10_000, True, longest, 0, head_dim=128) == (n_sms, 1)
    assert grid(10_000, True, longest + 128, 0, head_dim=128) == (10_000, 1)
    assert grid(10_000, True, longest + 128, 0, head_dim=256) == (10_000, 1)
    assert grid(10_000, True, longest + 128, 0) == (10_000, 1)
    assert grid(10_000, True, 4 * longest, 0, head_dim=64) == (n_sms, 1)
    assert grid(10_000, False, 4 * longest, 0, head_dim=128) == (n_sms, 1)
    assert grid(100, False, 512, 0, head_dim=128) == (100, 1)
    # causal K/V beyond _WS_PERSISTENT_CAUSAL_MAX_KV_BYTES: one block per CTA at any length and head dim
    # (qk 192 / v 128 at 8k tokens: 128 heads hold 320 MiB, 16 heads 40 MiB)
    mla = lambda heads, causal=True: grid(10_000, causal, 8192, 0, head_dim=192, kv_bytes=8192 * heads * 320)  # noqa: E731
    assert mla(128) == (10_000, 1) and mla(16) == (n_sms, 1) and mla(128, causal=False) == (n_sms, 1)
    most = dense_launch._WS_PERSISTENT_CAUSAL_MAX_KV_BYTES
    assert grid(10_000, True, 4 * longest, 0, head_dim=64, kv_bytes=most) == (n_sms, 1)
    assert grid(10_000, True, 4 * longest, 0, head_dim=64, kv_bytes=most + 1) == (10_000, 1)
    assert dense_launch._kernel_for(256, True) == (dense_launch._dense_fwd_tma_ws_kernel, 4)


def _varlen_case(lens_q, lens_k, hq=8, hk=2, d=128, dv=None):
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    b = len(lens_q)
    q, k, v = (
        fp8_randn((int(cu[-1]), h, w), device="cuda")
        for cu, h, w in ((cu_q, hq, d), (cu_k, hk, d), (cu_k, hk, dv or d))
    )
    qd = torch.rand(b, hk, device="cuda") * 0.28 + 0.02
    kd = torch.rand(b, hk, device="cuda") * 0.28 + 0.02
    vd = torch.rand(b, hk, device="cuda") * 1.5 + 0.5
    return q, k, v, qd, kd, vd, cu_q, cu_k


def _varlen_run(q, k, v, qd, kd, vd, cu_q, cu_k, causal, expect_tma=True, with_lse=True):
    calls = []
    real = dense_launch._launch_varlen

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    out = torch.full((*q.shape[:2], v.shape[-1]), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device="cuda") if with_lse else None
    lens_q, lens_k = (cu[1:] - cu[:-1] for cu in (cu_q, cu_k))
    dense_launch._launch_varlen = spy
    old = os.environ.get("FP8ATTN_DENSE_BACKEND")
    os.environ["FP8ATTN_DENSE_BACKEND"] = "tma" if expect_tma else "triton"  # (auto prefers Triton below 2k)
    try:
        launch_dense_fwd(
            q,
            k,
            v,
            out,
            lse,
            softmax_scale=q.shape[-1] ** -0.5,
            causal=causal,
            window_size=(-1, -1),
            softcap=0.0,
            q_descale=qd,
            k_descale=kd,
            v_descale=vd,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=int(lens_q.max()),
            max_seqlen_k=int(lens_k.max()),
        )
    finally:
        dense_launch._launch_varlen = real
        if old is None:
            os.environ.pop("FP8ATTN_DENSE_BACKEND")
        else:
            os.environ["FP8ATTN_DENSE_BACKEND"] = old
    assert calls == ([1] if expect_tma else []), "varlen TMA dispatch"
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_tma_varlen_vs_reference_and_triton(d, causal):
    """Varlen on the bounded warp-specialized kernel: lengths off the 128 grid, a one-query sequence, an
    empty one, a key count that is not a multiple of 16; every sequence against the reference on its
    slice, the whole batch against the Triton kernel, and repeated runs bit-identical."""
    _need_sm90()
    lens_q, lens_k = [300, 1, 0, 517, 128, 1000], [300, 50, 7, 901, 128, 1000]
    q, k, v, qd, kd, vd, cu_q, cu_k = _varlen_case(lens_q, lens_k, d=d)
    out, lse = _varlen_run(q, k, v, qd, kd, vd, cu_q, cu_k, causal)
    for i in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if q1 == q0:
            continue
        one = (q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], qd[i : i + 1], kd[i : i + 1], vd[i : i + 1])
        _reference_check(*one, out[None, q0:q1], lse[None, :, q0:q1], causal, d**-0.5)
    out2, lse2 = _varlen_run(q, k, v, qd, kd, vd, cu_q, cu_k, causal)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(lse, lse2)
    tri, tri_lse = _varlen_run(q, k, v, qd, kd, vd, cu_q, cu_k, causal, expect_tma=False)
    assert (out.float() - tri.float()).abs().max().item() <= 2e-2 * tri.float().abs().max().item()
    torch.testing.assert_close(lse, tri_lse, atol=2e-3, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_tma_varlen_bits_equal_dense(causal):
    """Equal sequences of 384 queries / 640 keys: the varlen blocks are the dense kernel's blocks, tile
    for tile, so the same bits."""
    _need_sm90()
    b, sq, sk, hq, hk, d = 2, 384, 640, 8, 2, 128
    q, k, v, qd, kd, vd, cu_q, cu_k = _varlen_case([sq] * b, [sk] * b, hq, hk, d)
    out, lse = _varlen_run(q, k, v, qd, kd, vd, cu_q, cu_k, causal)
    od = torch.empty(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    ld = torch.empty(b, hq, sq, device="cuda")
    dense_launch.launch_dense_fwd_tma(
        q.view(b, sq, hq, d),
        k.view(b, sk, hk, d),
        transpose_v_kmajor(v.view(b, sk, hk, d)),
        od,
        ld,
        softmax_scale=d**-0.5,
        causal=causal,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
    )
    assert torch.equal(out.view(b, sq, hq, d).view(torch.int16), od.view(torch.int16))
    assert torch.equal(lse.view(hq, b, sq).transpose(0, 1), ld)


@pytest.mark.gpu
def test_gpu_varlen_v_kmajor_matches_cpu():
    """The one-pass CUDA layout kernel writes what the torch path writes (every sequence's columns), and
    the compiled block-list kernel the list of the CPU test."""
    lens = [300, 0, 7, 1, 517, 16, 1000]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    v = fp8_randn((int(cu[-1]), 2, 128), device="cpu")
    ref = dense_launch._varlen_v_kmajor_torch(v, cu)
    got = varlen_v_kmajor(v.cuda(), cu.cuda())
    got_t = varlen_v_kmajor(transpose_v_kmajor(v.cuda()), cu.cuda())  # from token-contiguous V
    _check_block_list("cuda")
    for b, L in enumerate(lens):
        c0 = 16 * (int(cu[b]) // 16 + b)
        for g in (got, got_t):
            assert torch.equal(g[:, :, c0 : c0 + L].cpu().view(torch.uint8), ref[:, :, c0 : c0 + L].view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# qk 192 / v 128 (MLA prefill) on the warp-specialized kernel
# ---------------------------------------------------------------------------------------------
def _case_qk192(b=2, sq=256, sk=256, hq=8, hk=2, device="cpu"):
    """``_case`` with q/k head dim 192, v/out head dim 128, V sequence-contiguous (``vt``) as well."""
    q, k, v = (
        fp8_randn((b, sq, hq, 192), device=device),
        fp8_randn((b, sk, hk, 192), device=device),
        fp8_randn((b, sk, hk, 128), device=device),
    )
    qd = torch.rand(b, hk, device=device) * 0.28 + 0.02
    kd = torch.rand(b, hk, device=device) * 0.28 + 0.02
    vd = torch.rand(b, hk, device=device) * 1.5 + 0.5
    out = torch.empty(b, sq, hq, 128, device=device, dtype=torch.bfloat16)
    lse = torch.empty(b, hq, sq, device=device)
    vt = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    return q, k, v, vt, qd, kd, vd, out, lse


def test_qk192_rules(monkeypatch):
    """qk 192 / v 128 passes every shape rule of the dense path (on CPU tensors only the device check is
    left), causal or not, with or without an LSE, GQA 1 or 4; unless ``FP8ATTN_TMA_QK192=0``, with the fused
    e4m3 output, varlen, or with any other unequal pair. Its tiles: Q/K in 64-wide boxes, V/O whole, two
    consumers over 128-key tiles."""
    monkeypatch.delenv("FP8ATTN_TMA_QK192", raising=False)
    assert dense_launch.qk192_enabled()
    for hk in (2, 8):
        q, k, v, vt, qd, kd, vd, out, lse = _case_qk192(hk=hk)
        for causal in (False, True):
            for lse_ in (lse, None):
                why = dense_launch.unsupported_reason(q, k, vt, out, **_kw(qd, kd, vd, lse_, causal=causal))
                assert why == "inputs must be CUDA tensors", (hk, causal, why)
    q, k, v, vt, qd, kd, vd, out, lse = _case_qk192()
    kw = _kw(qd, kd, vd, lse)
    for flag in ("1", ""):
        monkeypatch.setenv("FP8ATTN_TMA_QK192", flag)
        assert dense_launch.unsupported_reason(q, k, vt, out, **kw) == "inputs must be CUDA tensors"
    from fp8attn import plan

    on = plan.env_sig()
    monkeypatch.setenv("FP8ATTN_TMA_QK192", "0")
    assert not dense_launch.qk192_enabled() and plan.env_sig() != on  # (eager plans are keyed on the switch)
    assert "FP8ATTN_TMA_QK192=0" in dense_launch.unsupported_reason(q, k, vt, out, **kw)
    monkeypatch.setenv("FP8ATTN_TMA_QK192", "yes")
    with pytest.raises(ValueError, match="FP8ATTN_TMA_QK192"):
        dense_launch.unsupported_reason(q, k, vt, out, **kw)
    monkeypatch.delenv("FP8ATTN_TMA_QK192")
    out8 = torch.empty(out.shape, dtype=E4M3)
    assert "Triton" in dense_launch.unsupported_reason(q, k, vt, out8, **_kw(qd, kd, vd, lse, out_scale=torch.ones(1)))
    out192 = torch.empty(2, 256, 8, 192, dtype=torch.bfloat16)
    assert "shape mismatch" in dense_launch.unsupported_reason(q, k, vt, out192, **kw)
    for dq, dk, dv in ((192, 192, 192), (192, 192, 64), (128, 128, 192), (192, 128, 128), (256, 256, 128)):
        qx, kx, vx = (
            fp8_randn((2, 256, 8, dq), device="cpu"),
            fp8_randn((2, 256, 2, dk), device="cpu"),
            fp8_randn((2, 256, 2, dv), device="cpu"),
        )
        ox = torch.empty(2, 256, 8, dv, dtype=torch.bfloat16)
        assert "head dim" in dense_launch.unsupported_reason(qx, kx, vx, ox, **kw), (dq, dk, dv)
    # varlen: the bounded kernel (by default from 1024 queries, as head dim 128), also behind the switch
    cu = torch.tensor([0, 256, 512], dtype=torch.int32)
    kv = _kw(qd, kd, vd, torch.empty(8, 512), cu_seqlens_q=cu, cu_seqlens_k=cu)
    vargs = (q.view(512, 8, 192), k.view(512, 2, 192), v.view(512, 2, 128), out.view(512, 8, 128))
    assert dense_launch.unsupported_reason(*vargs, **kv) == "inputs must be CUDA tensors"
    assert dense_launch.varlen_preferred(192, 1024) and not dense_launch.varlen_preferred(192, 1023)
    assert "shape mismatch" in dense_launch.unsupported_reason(*vargs[:3], out.view(512, 8, 128)[:, :4], **kv)
    assert "head dim" in dense_launch.unsupported_reason(
        *vargs[:2], k.view(512, 2, 192), out.view(512, 8, 128).new_empty(512, 8, 192), **kv
    )
    monkeypatch.setenv("FP8ATTN_TMA_QK192", "0")
    assert "FP8ATTN_TMA_QK192=0" in dense_launch.unsupported_reason(*vargs, **kv)
    monkeypatch.delenv("FP8ATTN_TMA_QK192")
    assert dense_launch._tiles(192, True, 128) == (64, 64, 128, 128)
    assert dense_launch.ws_config(192, True, head_dim_v=128) == (2, 128, dense_launch.NUM_STAGES)
    for args in ((192, False, 128), (192, True, 64), (128, True, 192)):
        with pytest.raises(ValueError, match="head dims"):
            dense_launch._tiles(*args)
    with pytest.raises(ValueError, match="^consumers: "):
        dense_launch.ws_config(192, False, 3, head_dim_v=128)


_QK192_AOT_SNIPPET = (
    _SASS_PRELUDE
    + """
for mode in (None, dense_launch.MODE_VARLEN):
    for causal in (False, True):
        for lse in (False, True):
            k = dense_launch._aot_compile(causal, write_lse=lse, head_dim=192, head_dim_v=128, mode=mode)
            sass = sass_of(k)
            regs = sorted({{int(x, 16) for x in re.findall(r"USETMAXREG\\.\\S+\\s+(0x[0-9a-f]+)", sass)}})
            print("qk192", mode, int(causal), int(lse), k.metadata.shared, len(re.findall(r"\\bSTL", sass)),
                  len(re.findall(r"\\bLDL", sass)), *regs)
"""
)


@background.jobs(_sm90_jobs(qk192=_QK192_AOT_SNIPPET))
def test_aot_compile_sm90_qk192():
    """qk 192 / v 128 on the warp-specialized kernel (dense, and varlen on the bounded kernel) compiles for
    sm90 without a GPU, causal or not, with or without an LSE: the 240 / 24 register split of head dim 128,
    shared memory within the H200's 227 KB, and few spilled stores / loads, of a block's scalars outside the
    loop over KV tiles but for one pair per tile as at head dim 128 (sm_90a, causal with an LSE: dense 20 / 30
    against head dim 128's 14 / 18; varlen non-causal without one 46 / 47 against 30 / 33). An accumulator
    spilled in the loop would be hundreds."""
    out = _run_sm90_snippet(_QK192_AOT_SNIPPET, key="qk192")
    rows = [line.split()[1:] for line in out.splitlines() if line.startswith("qk192 ")]
    assert len(rows) == 8, out[-3000:]
    for mode, causal, lse, smem, stl, ldl, *regs in rows:
        assert {24, 240} <= {int(r) for r in regs}, (mode, causal, lse, regs)
        assert int(smem) <= 232448, (mode, causal, lse, smem)
        assert int(stl) <= 64 and int(ldl) <= 64, (mode, causal, lse, stl, ldl)


@pytest.mark.gpu
@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 4)])
@pytest.mark.parametrize(
    "sq,sk,causal",
    [
        (128, 128, False),
        (128, 128, True),
        (1024, 1024, False),
        (1024, 1024, True),
        (1024, 4096, True),
        (1024, 4096, False),
        (4096, 4096, True),
    ],
)
def test_gpu_tma_qk192_vs_reference(sq, sk, causal, hq, hk, with_lse, monkeypatch):
    """qk 192 / v 128 through ``launch_dense_fwd``'s default dispatch takes the warp-specialized kernel (the
    launch is spied on: head dim 192, V / O 128 wide) and matches the reference from the dequantized inputs
    (FA3's rule; random per-(batch, kv head) descales); the LSE within 1e-3. Without an LSE: causal, the same
    bits as with one (fp32 row sums, as at head dim 128); non-causal, each row the same up to one factor (the
    row sums of the e4m3 P, taken on the tensor core: ``assert_row_scaled``)."""
    _need_sm90()
    monkeypatch.delenv("FP8ATTN_DENSE_BACKEND", raising=False)
    monkeypatch.delenv("FP8ATTN_TMA_QK192", raising=False)
    q, k, v, _, qd, kd, vd, out, lse = _case_qk192(b=2, sq=sq, sk=sk, hq=hq, hk=hk, device="cuda")
    launches = []
    real = dense_launch._launch

    def spy(d, ws, grid, descs, args, consts, **kw):
        launches.append((d, ws, consts, descs[2][3], descs[3][3]))
        return real(d, ws, grid, descs, args, consts, **kw)

    monkeypatch.setattr(dense_launch, "_launch", spy)
    scale = 192**-0.5
    kw = dict(
        softmax_scale=scale, causal=causal, window_size=(-1, -1), softcap=0.0, q_descale=qd, k_descale=kd, v_descale=vd
    )
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    launch_dense_fwd(q, k, v, out, lse, **kw)
    assert launches == [
        (192, True, (causal, True, False, dense_launch.NUM_STAGES, 192, 2, 128), [128, 128], [64, 128])
    ], launches
    _reference_check(q, k, v, qd, kd, vd, out, lse, causal, scale)
    if not with_lse:
        o2 = torch.full_like(out, float("nan"))
        launch_dense_fwd(q, k, v, o2, None, **kw)
        assert len(launches) == 2 and launches[1][2][1] is False
        if causal:
            assert torch.equal(o2.view(torch.int16), out.view(torch.int16))
        else:
            assert_row_scaled(o2, out)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_tma_qk192_switch_and_triton(causal, monkeypatch):
    """``FP8ATTN_TMA_QK192=0`` sends qk 192 / v 128 to the Triton kernel (the TMA launcher is not called; with
    ``FP8ATTN_DENSE_BACKEND=tma`` a ValueError names the switch); both kernels agree within FP8 attention error
    and the TMA kernel is deterministic; ``flash_attn_func`` takes the TMA kernel by default, also through its
    eager plan, which the switch then bypasses."""
    _need_sm90()
    import fp8attn

    monkeypatch.delenv("FP8ATTN_DENSE_BACKEND", raising=False)
    q, k, v, _, qd, kd, vd, out, lse = _case_qk192(b=1, sq=1024, sk=2048, hq=16, hk=16, device="cuda")
    kw = dict(
        softmax_scale=0.1, causal=causal, window_size=(-1, -1), softcap=0.0, q_descale=qd, k_descale=kd, v_descale=vd
    )
    calls = []
    real = dense_launch.launch_dense_fwd_tma

    def spy(*a, **k_):
        calls.append(1)
        return real(*a, **k_)

    monkeypatch.setattr(dense_launch, "launch_dense_fwd_tma", spy)
    launch_dense_fwd(q, k, v, out, lse, **kw)
    o2, l2 = torch.empty_like(out), torch.empty_like(lse)
    launch_dense_fwd(q, k, v, o2, l2, **kw)
    assert len(calls) == 2
    assert torch.equal(out.view(torch.int16), o2.view(torch.int16)) and torch.equal(lse, l2)
    monkeypatch.setenv("FP8ATTN_TMA_QK192", "0")
    ot, lt = torch.empty_like(out), torch.empty_like(lse)
    launch_dense_fwd(q, k, v, ot, lt, **kw)
    assert len(calls) == 2
    assert (ot.float() - out.float()).abs().max().item() <= 0.05 * ot.float().abs().max().item()
    torch.testing.assert_close(lt, lse, atol=1e-3, rtol=1e-4)
    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "tma")
    with pytest.raises(ValueError, match="FP8ATTN_TMA_QK192=0"):
        launch_dense_fwd(q, k, v, ot, lt, **kw)
    monkeypatch.delenv("FP8ATTN_TMA_QK192")
    monkeypatch.delenv("FP8ATTN_DENSE_BACKEND")
    of = fp8attn.flash_attn_func(q, k, v, softmax_scale=0.1, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    of = of[0] if isinstance(of, tuple) else of
    assert len(calls) == 3 and of.shape == out.shape
    assert (of.float() - out.float()).abs().max().item() <= 0.05 * out.float().abs().max().item()
    fp8attn.flash_attn_func(q, k, v, softmax_scale=0.1, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    assert len(calls) == 4  # (the call's plan)
    monkeypatch.setenv("FP8ATTN_TMA_QK192", "0")  # a plan made with the switch on does not serve it off
    fp8attn.flash_attn_func(q, k, v, softmax_scale=0.1, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    assert len(calls) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_tma_qk192_varlen_vs_reference_and_triton(causal, hq, hk, with_lse, monkeypatch):
    """Varlen qk 192 / v 128 on the bounded kernel (``_launch_varlen`` spied on): lengths off the 128 grid, a
    one-query and an empty sequence, key counts not a multiple of 16; each sequence against the reference on its
    slice (with an LSE; without one, causal the same bits, non-causal each row up to one factor:
    ``assert_row_scaled``), the batch against the Triton kernel, repeated runs bit-identical; the default
    dispatch takes it from 1024 queries unless ``FP8ATTN_TMA_QK192=0``."""
    _need_sm90()
    monkeypatch.delenv("FP8ATTN_TMA_QK192", raising=False)
    lens_q, lens_k = [300, 1, 0, 517, 128, 1000], [300, 50, 7, 901, 128, 1000]
    q, k, v, qd, kd, vd, cu_q, cu_k = _varlen_case(lens_q, lens_k, hq, hk, d=192, dv=128)
    out, lse = _varlen_run(q, k, v, qd, kd, vd, cu_q, cu_k, causal)
    assert out.shape == (q.shape[0], hq, 128)
    for i in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if q1 == q0:
            continue
        one = (q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], qd[i : i + 1], kd[i : i + 1], vd[i : i + 1])
        _reference_check(*one, out[None, q0:q1], lse[None, :, q0:q1], causal, 192**-0.5)
    out2, lse2 = _varlen_run(q, k, v, qd, kd, vd, cu_q, cu_k, causal)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(lse, lse2)
    tri, tri_lse = _varlen_run(q, k, v, qd, kd, vd, cu_q, cu_k, causal, expect_tma=False)
    assert (out.float() - tri.float()).abs().max().item() <= 2e-2 * tri.float().abs().max().item()
    torch.testing.assert_close(lse, tri_lse, atol=2e-3, rtol=1e-4)
    if not with_lse:
        o3, _ = _varlen_run(q, k, v, qd, kd, vd, cu_q, cu_k, causal, with_lse=False)
        if causal:
            assert torch.equal(o3.view(torch.int16), out.view(torch.int16))
        else:
            assert_row_scaled(o3, out)
    # the default dispatch (no FP8ATTN_DENSE_BACKEND): TMA from 1024 queries, Triton with the switch off
    calls = []
    real = dense_launch._launch_varlen
    monkeypatch.setattr(dense_launch, "_launch_varlen", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.delenv("FP8ATTN_DENSE_BACKEND", raising=False)
    o4 = torch.empty_like(out)
    kw = dict(
        softmax_scale=192**-0.5,
        causal=causal,
        window_size=(-1, -1),
        softcap=0.0,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=1024,
        max_seqlen_k=1024,
    )
    launch_dense_fwd(q, k, v, o4, torch.empty_like(lse), **kw)
    assert calls == [1] and torch.equal(o4.view(torch.int16), out.view(torch.int16))
    monkeypatch.setenv("FP8ATTN_TMA_QK192", "0")
    launch_dense_fwd(q, k, v, o4, torch.empty_like(lse), **kw)
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_tma_qk192_varlen_bits_equal_dense(causal):
    """qk 192 / v 128, equal sequences of 384 queries / 640 keys: the varlen kernel's blocks are the dense
    kernel's, tile for tile, so the same output and LSE bits."""
    _need_sm90()
    b, sq, sk, hq, hk = 2, 384, 640, 8, 2
    q, k, v, qd, kd, vd, cu_q, cu_k = _varlen_case([sq] * b, [sk] * b, hq, hk, d=192, dv=128)
    out, lse = _varlen_run(q, k, v, qd, kd, vd, cu_q, cu_k, causal)
    od = torch.empty(b, sq, hq, 128, device="cuda", dtype=torch.bfloat16)
    ld = torch.empty(b, hq, sq, device="cuda")
    dense_launch.launch_dense_fwd_tma(
        q.view(b, sq, hq, 192),
        k.view(b, sk, hk, 192),
        transpose_v_kmajor(v.view(b, sk, hk, 128)),
        od,
        ld,
        softmax_scale=192**-0.5,
        causal=causal,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
    )
    assert torch.equal(out.view(b, sq, hq, 128).view(torch.int16), od.view(torch.int16))
    assert torch.equal(lse.view(hq, b, sq).transpose(0, 1), ld)


def test_qk192_launch_views(monkeypatch):
    """The qk 192 / v 128 launches' TMA views and boxes (the launch itself replaced, CPU tensors): Q and K as
    (rows, heads * 192) in 64-wide boxes, V sequence-major as (heads * 128, keys) in 128 x 128 boxes, O as
    (rows, heads * 128) in 64 x 128 boxes; HEAD_DIM 192 with HEAD_DIM_V 128, dense and varlen."""
    seen = []
    monkeypatch.setattr(
        dense_launch,
        "_launch",
        lambda d, ws, grid, descs, args, consts, **kw: seen.append(
            (d, ws, [(list(shape), list(strides), box) for _, shape, strides, box in descs], consts, kw)
        ),
    )
    monkeypatch.setattr(dense_launch, "_num_sms", lambda index: 132)
    b, sq, sk, hq, hk = 2, 256, 384, 8, 2
    q, k, v, vt, qd, kd, vd, out, lse = _case_qk192(b=b, sq=sq, sk=sk, hq=hq, hk=hk)
    dense_launch.launch_dense_fwd_tma(
        q, k, vt, out, None, softmax_scale=0.1, causal=True, q_descale=qd, k_descale=kd, v_descale=vd
    )
    d, ws, views, consts, kw = seen.pop()
    assert (d, ws, consts) == (192, True, (True, False, False, dense_launch.NUM_STAGES, 192, 2, 128))
    assert views == [
        ([b * sq, hq * 192], [hq * 192, 1], [64, 64]),
        ([b * sk, hk * 192], [hk * 192, 1], [128, 64]),
        ([b * hk * 128, sk], [sk, 1], [128, 128]),
        ([b * sq, hq * 128], [hq * 128, 1], [64, 128]),
    ]
    assert kw == dict(tiles=(64, 64, 128, 128))
    if not (dense_mod.INTERPRET or torch.cuda.is_available()):
        pytest.skip("the varlen block list needs CUDA or the interpreter")
    cu = torch.tensor([0, 100, 356], dtype=torch.int32)
    tq = 356
    dense_launch.launch_dense_fwd_tma(
        q.view(-1, hq, 192)[:tq],
        k.view(-1, hk, 192)[:tq],
        v.view(-1, hk, 128)[:tq],
        out.view(-1, hq, 128)[:tq],
        torch.empty(hq, tq),
        softmax_scale=0.1,
        causal=False,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
    )
    d, ws, views, consts, kw = seen.pop()
    cols = 16 * (tq // 16 + b + 1)
    assert (d, ws, consts) == (
        192,
        True,
        (False, True, False, dense_launch.NUM_STAGES, 192, dense_launch.MODE_VARLEN, False, 128),
    )
    assert views == [
        ([tq, hq * 192], [hq * 192, 1], [64, 64]),
        ([tq, hk * 192], [hk * 192, 1], [128, 64]),
        ([hk * 128, cols], [cols, 1], [128, 128]),
        ([tq, hq * 128], [hq * 128, 1], [64, 128]),
    ]
    assert kw == dict(bounded=True, tiles=(64, 64, 128, 128))
