"""The paged kernel's launch configurations (and the backward kernels' defaults) compile for sm90 within the
H200's shared memory.

Shared memory is only checked by the driver when a kernel loads, so a configuration whose pipelined
rings outgrow the 227 KB per block passes every interpreter test and fails on the GPU. This test
compiles the launches of ``tools/aot_paged_sm90.py`` (decode and prefill, FP8 and bf16 caches,
both V layouts) ahead of time for sm90 on the CPU, in a subprocess (the compile needs the JIT, not the
interpreter), and checks each kernel's static shared memory, and that a 16-bit P@V over an FP8 cache in
FA3's layout (bf16 Q; FP8 Q, whose P@V runs in fp16 there) reads its V operand from shared memory as 16-bit
values, not byte by byte (LDS.U8: the cast moved after the operand read; docs/decisions.md, Paged
decode).
"""

import os
import re
import sys
from pathlib import Path

import pytest

import background

ROOT = Path(__file__).resolve().parents[2]
H200_SMEM_PER_BLOCK = 232448  # bytes of dynamic shared memory one block may use on sm90


def _ptxas_available() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def _tool_job(*argv, timeout):
    """``(argv, subprocess kwargs)`` running a tools/ script without interpreter mode."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT / "src"))
    return [sys.executable, str(ROOT / "tools" / argv[0]), *argv[1:]], dict(cwd=ROOT, env=env, timeout=timeout)


def _tool_jobs(key, *argv, timeout):
    """``background.jobs`` for one tools/ script (none without ptxas: the test skips)."""
    return lambda: {key: _tool_job(*argv, timeout=timeout)} if _ptxas_available() else {}


@pytest.mark.skipif(not _ptxas_available(), reason="triton's bundled ptxas is needed for the sm90 compile")
@background.jobs(_tool_jobs("aot_paged", "aot_paged_sm90.py", timeout=600))
def test_paged_launches_fit_shared_memory():
    argv, kw = _tool_job("aot_paged_sm90.py", timeout=600)
    r = background.result("aot_paged", argv, **kw)
    lines = [ln for ln in r.stdout.splitlines() if " cfg=" in ln or " FAILED " in ln]
    assert r.returncode == 0, r.stderr[-2000:]
    assert not [ln for ln in lines if " FAILED " in ln], "\n".join(lines)
    smem = {ln.split(" cfg=")[0].strip(): int(re.search(r"smem=(\d+)", ln).group(1)) for ln in lines}
    assert len(smem) >= 19 and any("bf16kv varlen" in k for k in smem), lines
    too_big = {k: v for k, v in smem.items() if v > H200_SMEM_PER_BLOCK}
    assert not too_big, f"shared memory over {H200_SMEM_PER_BLOCK} bytes per block: {too_big}"
    lds_u8 = {ln.split(" cfg=")[0].strip(): int(re.search(r"LDS\.U8=(\d+)", ln).group(1)) for ln in lines}
    # 16-bit P@V over an FP8 cache in FA3's layout: bf16 Q, and FP8 Q (its P@V runs in fp16 there)
    fa3_16bit = [
        k for k in lds_u8 if (k.startswith("decode bf16q") or "e4m3q" in k) and "bf16kv" not in k and "vseq" not in k
    ]
    assert len(fa3_16bit) >= 9, lines
    byte_reads = {k: lds_u8[k] for k in fa3_16bit if lds_u8[k]}
    assert not byte_reads, f"byte-wise shared reads of V (LDS.U8 per kernel): {byte_reads}"


@pytest.mark.skipif(not _ptxas_available(), reason="triton's bundled ptxas is needed for the sm90 compile")
@background.jobs(_tool_jobs("aot_backward", "aot_backward_sm90.py", "--quick", timeout=900))
def test_backward_default_configs_compile():
    """The default launch configurations of both Triton main kernels compile for sm90 (d64 dequantized causal, d128
    fp8 mode; each with the atomic dQ and with ``deterministic``'s dQ pass), run their products on wgmma (QGMMA in
    the SASS: the e4m3 operand layouts were accepted), fit the H200's shared memory and barely spill (register-file
    overflow, which the interpreter cannot show); so does the Hopper kernel (``kernels/hopper/backward.py``), without
    spilling but for a few words at d128."""
    argv, kw = _tool_job("aot_backward_sm90.py", "--quick", timeout=900)
    r = background.result("aot_backward", argv, **kw)
    lines = [ln for ln in r.stdout.splitlines() if " cfg=" in ln and not ln.startswith("hopper ")]
    hopper = [ln for ln in r.stdout.splitlines() if ln.startswith("hopper ")]
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    # the Hopper kernels (four dequantized cases, three fp8): e4m3 S^T on QGMMA (every product but dQ's in the fp8
    # mode), the others on HGMMA, dQ added by a TMA reduction (no per-thread atomics); both kernels warp-specialized
    # (their consumers raised to 240 registers); no spills at d64, a few at d128 (docs/decisions.md)
    assert len(hopper) == 7, r.stdout
    for ln in hopper:
        vals = dict(re.findall(r"(\w+)=(\d+)", ln))
        assert int(vals["HGMMA"]) > 0 and int(vals["TMA_RED"]) > 0 and int(vals["RED"]) == 0, ln
        assert (int(vals["QGMMA"]) > 0) == (" e4m3 " in ln), ln
        assert (int(vals["QGMMA"]) > int(vals["HGMMA"])) == (" fp8 " in ln), ln
        assert int(vals["smem"]) <= H200_SMEM_PER_BLOCK, ln
        if " fp8 " in ln:  # its e4m3 casts rely on the conversion's saturation (kernels/hopper/backward.py: _e4m3)
            assert int(vals["CVT_E4M3"]) > 0 and int(vals["CVT_SAT"]) == int(vals["CVT_E4M3"]), ln
        assert int(vals["MAXNREG"]) == 240, ln
        # d128: the fp8 kernel holds 5-35 spilled words, the dequantized one 3-12 (at 240 registers; the fp8 kernel's
        # dK / dV store conversion added a few, for a faster kernel: docs/decisions.md)
        spills = (40 if " fp8 " in ln else 16) if " d128 " in ln else 0
        assert int(vals["LDL"]) <= spills and int(vals["STL"]) <= spills, f"spills: {ln}"
    # d64 dequantized causal: dK/dV/dQ, then dK/dV and dQ; d128 fp8 mode: dK/dQ and dV, then dK, dV and dQ
    assert len(lines) == 8, r.stdout
    assert sum(int(dict(re.findall(r"(\w+)=(\d+)", ln))["RED"]) > 0 for ln in lines) == 2, r.stdout
    for ln in lines:
        vals = dict(re.findall(r"(\w+)=(\d+)", ln))
        assert int(vals["QGMMA"]) > 0 and int(vals["wgmma"]) > 0, ln
        assert int(vals["smem"]) <= H200_SMEM_PER_BLOCK, ln
        # at most a few spilled words; a tile that outgrows the register file spills hundreds (the d256 dK/dV
        # configurations: docs in kernels/backward.py)
        assert int(re.search(r"STACK:(\d+)", ln).group(1)) <= 16, f"spills: {ln}"
