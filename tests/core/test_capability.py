"""The capability and fallback policy (``fp8attn.capability``): the decision rule, fallbacks routed through
``report_fallback`` before anything runs or is written, kernel errors never retried, ``supports``.

There is no CUDA here, so the device is simulated: ``capability._facts`` (device type, compute capability,
triton installed) is replaced, which makes CPU tensors take the CUDA dispatch path; a fallback then runs the
reference on them, exactly what a CUDA fallback runs.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import fp8attn
from fp8attn import capability as cap
from fp8attn import reference

E4M3 = torch.float8_e4m3fn


@pytest.fixture
def machine(monkeypatch):
    """``machine(cc, triton=True)``: make this process look like a CUDA device of compute capability ``cc``
    (every tensor's device reports it); decisions and answers are recomputed."""

    def simulate(cc, triton=True):
        monkeypatch.setattr(cap, "_facts", lambda device: ("cuda", cc, triton))
        cap._clear_caches()

    monkeypatch.delenv("FP8ATTN_FORCE_REFERENCE", raising=False)
    monkeypatch.delenv("FP8ATTN_FALLBACK", raising=False)
    yield simulate
    cap._clear_caches()


def _fp8_call(seed=0, b=2, s=5, h=2, d=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(E4M3) for _ in range(3))
    qd, kd, vd = (torch.rand(b, h, generator=g) + 0.5 for _ in range(3))
    return dict(q=q, k=k, v=v, q_descale=qd, k_descale=kd, v_descale=vd, causal=True)


def _paged(seed=0, batch=2, page=4, pages=3, hk=2, d=16, dtype=E4M3):
    g = torch.Generator().manual_seed(seed)
    nb = batch * pages + 1
    k_cache, v_cache = (torch.randn(nb, page, hk, d, generator=g).to(dtype) for _ in range(2))
    pt = torch.randperm(nb, generator=g)[: batch * pages].view(batch, pages).to(torch.int32)
    return k_cache, v_cache, pt


# ---------------------------------------------------------------------------------------------
# the decision rule
# ---------------------------------------------------------------------------------------------


def test_decide_names_each_cause():
    assert cap.decide("cpu", None, True, False) == (False, None, cap.decide("cpu", None, True, False).message)
    assert cap.decide("cpu", None, False, True).reason is None  # CPU tensors never fall back
    assert cap.decide("cuda", (9, 0), True, False).ok
    assert cap.decide("cuda", (8, 9), True, False).ok
    cases = {
        "force_reference": cap.decide("cuda", (9, 0), True, True),
        "no_triton": cap.decide("cuda", (9, 0), False, False),
        "old_gpu": cap.decide("cuda", (8, 0), True, False),
        "kernel_import:dense": cap.decide("cuda", (9, 0), True, False, "ImportError: boom", kernel="dense"),
    }
    for key, d in cases.items():
        assert not d.ok and d.reason == key, (key, d)
    assert "FP8ATTN_FORCE_REFERENCE" in cases["force_reference"].message
    assert "install triton" in cases["no_triton"].message
    assert "sm80" in cases["old_gpu"].message and "sm89" in cases["old_gpu"].message
    assert (
        "fp8attn.kernels.dense" in cases["kernel_import:dense"].message
        and "boom" in cases["kernel_import:dense"].message
    )


def test_cpu_tensors_never_warn(monkeypatch):
    monkeypatch.setenv("FP8ATTN_FALLBACK", "error")  # a fallback would raise
    monkeypatch.setenv("FP8ATTN_FORCE_REFERENCE", "1")
    kw = _fp8_call()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8attn.flash_attn_func(**kw)
    assert cap.kernel_for(kw["q"], "dense") is None


# ---------------------------------------------------------------------------------------------
# fallbacks: reported first, then the reference (equal to the CPU path's result)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cause", ["old_gpu", "no_triton", "force_reference", "kernel_import"])
def test_simulated_fallback_warns_and_equals_the_reference(machine, monkeypatch, cause):
    kw = _fp8_call(seed=1)
    want = fp8attn.flash_attn_func(**kw)  # the CPU path (no simulation yet)
    if cause == "old_gpu":
        machine((8, 0))
    elif cause == "no_triton":
        machine((9, 0), triton=False)
    else:
        machine((9, 0))
        if cause == "force_reference":
            monkeypatch.setenv("FP8ATTN_FORCE_REFERENCE", "1")
        else:  # the module cannot be imported: the real import machinery raises ImportError
            monkeypatch.setitem(sys.modules, "fp8attn.kernels.dense", None)
    monkeypatch.setattr(cap, "_warned", set())
    with pytest.warns(cap.FallbackWarning) as rec:
        got = fp8attn.flash_attn_func(**kw)
    key = "kernel_import:dense" if cause == "kernel_import" else cause
    assert [str(w.message) for w in rec if f"({key})" in str(w.message)], [str(w.message) for w in rec]
    assert torch.equal(got, want)


def test_error_mode_raises_before_any_write(machine, monkeypatch):
    machine((8, 0))
    monkeypatch.setenv("FP8ATTN_FALLBACK", "error")
    k_cache, v_cache, pt = _paged()
    before = (k_cache.view(torch.uint8).clone(), v_cache.view(torch.uint8).clone())
    q = torch.randn(2, 1, 4, 16).to(torch.bfloat16)
    kn, vn = (torch.randn(2, 1, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([3, 5], dtype=torch.int32)
    ds = torch.full((1,), 0.05)
    with pytest.raises(cap.FallbackError, match="old_gpu"):
        fp8attn.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=kn, v=vn, cache_seqlens=lens, page_table=pt, k_descale=ds, v_descale=ds
        )
    with pytest.raises(cap.FallbackError):
        fp8attn.write_kv_cache(kn[:, 0], vn[:, 0], k_cache, v_cache, torch.tensor([0, 9]), k_descale=ds, v_descale=ds)
    assert torch.equal(k_cache.view(torch.uint8), before[0]) and torch.equal(v_cache.view(torch.uint8), before[1])
    assert issubclass(cap.FallbackError, NotImplementedError)


def test_attention_fallback_is_reported_before_the_append(machine, monkeypatch):
    """The append's kernel imports, the attention's does not: error mode refuses before the append writes."""
    machine((9, 0))
    monkeypatch.setenv("FP8ATTN_FALLBACK", "error")
    writes = []
    monkeypatch.setattr(
        cap,
        "_import_kernel",
        lambda kernel: (
            (lambda *a, **k: writes.append(kernel), None)
            if kernel == "cache"
            else (None, "ImportError: no paged kernel")
        ),
    )
    k_cache, v_cache, pt = _paged()
    q = torch.randn(2, 1, 4, 16).to(torch.bfloat16)
    kn, vn = (torch.randn(2, 1, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    with pytest.raises(cap.FallbackError, match="kernel_import:paged"):
        fp8attn.flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k=kn,
            v=vn,
            cache_seqlens=torch.tensor([3, 5]).int(),
            page_table=pt,
            k_descale=torch.ones(1),
            v_descale=torch.ones(1),
        )
    assert writes == []


def test_silent_mode_warns_nothing(machine, monkeypatch):
    machine((7, 5))
    monkeypatch.setenv("FP8ATTN_FALLBACK", "silent")
    monkeypatch.setattr(cap, "_warned", set())
    kw = _fp8_call()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fp8attn.flash_attn_func(**kw)
        o8, _, _, qd, kd, vd = fp8attn.quantize_qkv(*(torch.randn(1, 4, 2, 16) for _ in range(3)))
    assert out.shape == (2, 5, 2, 16) and o8.dtype == E4M3


def test_every_dispatch_reports(machine, monkeypatch):
    """dense, paged, combine, write_kv_cache, quantize_qkv, quant_fp8_static and scaled_bmm each report."""
    from fp8attn import ops

    machine((8, 0))
    monkeypatch.setenv("FP8ATTN_FALLBACK", "error")
    k_cache, v_cache, pt = _paged()
    x = torch.randn(2, 4, 2, 16)
    calls = {
        "flash_attn_func": lambda: fp8attn.flash_attn_func(**_fp8_call()),
        "flash_attn_with_kvcache": lambda: fp8attn.flash_attn_with_kvcache(
            torch.randn(2, 1, 2, 16).to(E4M3), k_cache, v_cache, cache_seqlens=torch.tensor([3, 5]).int(), page_table=pt
        ),
        "flash_attn_combine": lambda: fp8attn.flash_attn_combine(torch.randn(3, 2, 4, 2, 16), torch.randn(3, 2, 4, 2)),
        "write_kv_cache": lambda: fp8attn.write_kv_cache(
            x[0], x[0], k_cache, v_cache, torch.tensor([0, 1, 2, 3]), k_descale=torch.ones(1), v_descale=torch.ones(1)
        ),
        "quantize_qkv": lambda: fp8attn.quantize_qkv(x, x, x),
        "quant_fp8_static": lambda: ops.quant_fp8_static(x, torch.ones(1)),
        "scaled_bmm": lambda: ops.scaled_bmm(
            x[0].to(E4M3), x[0].transpose(1, 2).to(E4M3), torch.ones(1), torch.ones(1)
        ),
    }
    for _name, call in calls.items():
        with pytest.raises(cap.FallbackError, match="old_gpu"):
            call()


def test_one_warning_per_process_and_reason():
    """A fresh process: many calls from several threads, two causes -> exactly one warning per cause."""
    script = textwrap.dedent("""
        import os, threading, warnings
        import torch
        import fp8attn
        from fp8attn import capability as cap
        warnings.simplefilter("always")
        cap._facts = lambda device: ("cuda", (8, 0), True)
        q = torch.randn(1, 3, 2, 16)
        with warnings.catch_warnings(record=True) as rec:
            threads = [threading.Thread(target=lambda: [fp8attn.flash_attn_func(q, q, q) for _ in range(5)])
                       for _ in range(4)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            fp8attn.flash_attn_combine(torch.randn(2, 1, 3, 2, 16), torch.randn(2, 1, 3, 2))
            os.environ["FP8ATTN_FORCE_REFERENCE"] = "1"
            for _ in range(3):
                fp8attn.flash_attn_func(q, q, q)
        keys = sorted(str(w.message).split("(")[1].split(")")[0] for w in rec
                      if issubclass(w.category, cap.FallbackWarning))
        print("KEYS", keys)
    """)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("FP8ATTN_FALLBACK", None)
    env.pop("FP8ATTN_FORCE_REFERENCE", None)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "KEYS ['force_reference', 'old_gpu']" in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# a kernel that raised is never retried on another path
# ---------------------------------------------------------------------------------------------


def _raise(*args, **kwargs):
    raise RuntimeError("injected kernel failure")


@pytest.mark.parametrize("entry", ["dense", "paged", "combine", "cache"])
def test_kernel_error_propagates_unretried(machine, monkeypatch, entry):
    machine((9, 0))
    monkeypatch.setattr(cap, "_import_kernel", lambda kernel: (_raise, None))
    ref_calls = []
    for name in ("attention_ref", "varlen_attention_ref", "paged_attention_ref", "combine_ref"):
        real = getattr(reference, name)
        monkeypatch.setattr(
            reference, name, lambda *a, _real=real, _n=name, **k: ref_calls.append(_n) or _real(*a, **k)
        )
    from fp8attn import ops

    monkeypatch.setattr(ops, "_write_kv_cache_torch", lambda *a: ref_calls.append("write"))
    k_cache, v_cache, pt = _paged()
    before = k_cache.view(torch.uint8).clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either: the kernel was chosen and it raised
        with pytest.raises(RuntimeError, match="injected kernel failure"):
            if entry == "dense":
                fp8attn.flash_attn_func(**_fp8_call())
            elif entry == "paged":
                fp8attn.flash_attn_with_kvcache(
                    torch.randn(2, 1, 2, 16).to(E4M3),
                    k_cache,
                    v_cache,
                    cache_seqlens=torch.tensor([3, 5]).int(),
                    page_table=pt,
                )
            elif entry == "combine":
                fp8attn.flash_attn_combine(torch.randn(3, 2, 4, 2, 16), torch.randn(3, 2, 4, 2))
            else:
                fp8attn.write_kv_cache(
                    torch.randn(2, 2, 16),
                    torch.randn(2, 2, 16),
                    k_cache,
                    v_cache,
                    torch.tensor([0, 1]),
                    k_descale=torch.ones(1),
                    v_descale=torch.ones(1),
                )
    assert ref_calls == []
    assert torch.equal(k_cache.view(torch.uint8), before)


# ---------------------------------------------------------------------------------------------
# supports()
# ---------------------------------------------------------------------------------------------


def test_supports_cpu_tensors_and_bad_entry():
    kw = _fp8_call()
    s = cap.supports("flash_attn_func", **kw)
    assert s == cap.Support(None, s.reason) and "cpu" in s.reason
    for entry in cap.ENTRIES:
        assert cap.supports(entry, device="cpu").kernel is None
    with pytest.raises(ValueError, match="entry"):
        cap.supports("flash_attn", q=kw["q"])
    assert cap.supports("flash_attn_func", **kw) is s  # cached per configuration


@pytest.mark.parametrize("cc,triton,want", [((8, 0), True, "sm80"), ((9, 0), False, "triton is not installed")])
def test_supports_simulated_fallbacks(machine, cc, triton, want):
    machine(cc, triton)
    for entry in cap.ENTRIES:
        s = cap.supports(entry, device="cuda:0")
        assert s.kernel is None and want in s.reason, (entry, s)
    s = cap.supports(
        "flash_attn_func",
        device="cuda:0",
        q=((1, 128, 2, 64), E4M3),
        k=((1, 128, 2, 64), E4M3),
        v=((1, 128, 2, 64), E4M3),
    )
    assert s.kernel is None and want in s.reason


def test_supports_force_reference(machine, monkeypatch):
    machine((9, 0))
    monkeypatch.setenv("FP8ATTN_FORCE_REFERENCE", "1")
    assert cap.supports("flash_attn_combine", device="cuda:0").kernel is None


def _shape_call(b=1, sq=256, sk=256, hq=4, hk=2, d=128, dtype=E4M3):
    return dict(q=((b, sq, hq, d), dtype), k=((b, sk, hk, d), dtype), v=((b, sk, hk, d), dtype))


def test_supports_simulated_sm90_and_sm89(machine, monkeypatch):
    pytest.importorskip("triton")
    from fp8attn.kernels import paged as kp
    from fp8attn.kernels.hopper import dense_launch

    if not dense_launch.HAS_GLUON:
        pytest.skip("triton without Gluon")
    monkeypatch.setattr(kp, "INTERPRET", False)  # (the interpreter keeps paged calls on the Triton kernel)
    monkeypatch.delenv("FP8ATTN_DENSE_BACKEND", raising=False)
    machine((9, 0))
    dev = "cuda:0"
    assert cap.supports("flash_attn_func", device=dev).kernel == "hopper"
    assert cap.supports("flash_attn_combine", device=dev).kernel == "triton"
    assert cap.supports("write_kv_cache", device=dev).kernel == "triton"
    s = cap.supports("flash_attn_func", device=dev, causal=True, **_shape_call())
    assert s.kernel == "hopper", s
    assert cap.supports("flash_attn_func", device=dev, return_attn_probs=True, **_shape_call(d=64)).kernel == "hopper"
    for over, why in [
        (dict(window_size=(32, -1)), "window"),
        (dict(softcap=5.0), "softcap"),
        (dict(out_dtype=torch.float16), "bfloat16"),
    ]:
        s = cap.supports("flash_attn_func", device=dev, **_shape_call(), **over)
        assert s.kernel == "triton" and why in s.reason, (over, s)
    s = cap.supports("flash_attn_func", device=dev, **_shape_call(sq=200))
    assert s.kernel == "triton" and "multiples of 128" in s.reason
    s = cap.supports("flash_attn_func", device=dev, **_shape_call(dtype=torch.bfloat16))
    assert s.kernel == "triton" and "float8_e4m3fn" in s.reason
    # real tensors: V laid out sequence-major (quantize_qkv's v8) or transposed by the launcher -> the same answer
    q = torch.zeros(1, 128, 2, 64, dtype=E4M3)
    v_seq = torch.zeros(1, 2, 64, 128, dtype=E4M3).permute(0, 3, 1, 2)
    assert cap.supports("flash_attn_func", q=q, k=q, v=v_seq, device=dev).kernel == "hopper"
    assert cap.supports("flash_attn_func", q=q, k=q, v=q, device=dev).kernel == "hopper"
    # qkvpacked: q, k, v are strided views of one tensor (not contiguous) -> Triton
    s = cap.supports("flash_attn_qkvpacked_func", device=dev, qkv=((1, 128, 3, 2, 64), E4M3))
    assert s.kernel == "triton" and "contiguous" in s.reason
    # varlen: the Hopper kernel from 1024 queries (dense_launch.varlen_preferred)
    cu = torch.tensor([0, 1024, 2048], dtype=torch.int32)
    var = dict(
        q=((2048, 4, 128), E4M3),
        k=((2048, 2, 128), E4M3),
        v=((2048, 2, 128), E4M3),
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_k=1024,
    )
    assert cap.supports("flash_attn_varlen_func", device=dev, max_seqlen_q=1024, **var).kernel == "hopper"
    s = cap.supports("flash_attn_varlen_func", device=dev, max_seqlen_q=512, **var)
    assert s.kernel == "triton" and "varlen" in s.reason
    # paged: decode on the Triton kernel, a 128-query FP8 prefill chunk over 64-key pages on the Hopper kernel
    paged = dict(
        k_cache=((64, 64, 2, 128), E4M3),
        v_cache=((64, 64, 2, 128), E4M3),
        page_table=((2, 32), torch.int32),
        cache_seqlens=((2,), torch.int32),
    )
    s = cap.supports("flash_attn_with_kvcache", device=dev, q=((2, 1, 4, 128), E4M3), **paged)
    assert s.kernel == "triton" and "decode" in s.reason
    s = cap.supports("flash_attn_with_kvcache", device=dev, q=((2, 128, 4, 128), E4M3), causal=True, **paged)
    assert s.kernel == "hopper", s
    s = cap.supports("flash_attn_with_kvcache", device=dev, q=((2, 128, 4, 128), E4M3), num_splits=2, **paged)
    assert s.kernel == "triton" and "num_splits" in s.reason
    s = cap.supports("flash_attn_with_kvcache", device=dev, q=((2, 128, 4, 128), torch.bfloat16), **paged)
    assert s.kernel == "triton"
    # sm89: the kernels run, never the Hopper one
    machine((8, 9))
    s = cap.supports("flash_attn_func", device=dev, **_shape_call())
    assert s.kernel == "triton" and "sm90" in s.reason and "sm89" in s.reason


# ---------------------------------------------------------------------------------------------
# GPU: supports() agrees with the launcher that actually runs
# ---------------------------------------------------------------------------------------------


def _gpu_calls():
    """(entry, kwargs) of dense / varlen / packed / paged calls on the GPU; FP8 with random descales."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def t(*shape, dtype=E4M3):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    def ds(b, h):
        return torch.rand(b, h, device=dev, generator=g) + 0.5

    calls = []
    for d, s, over in [
        (128, 256, {}),
        (64, 128, dict(causal=True)),
        (128, 256, dict(window_size=(64, -1))),
        (128, 200, {}),
        (256, 128, dict(return_attn_probs=True)),
    ]:
        q, k, v = t(2, s, 4, d), t(2, s, 2, d), t(2, s, 2, d)
        calls.append(
            ("flash_attn_func", dict(q=q, k=k, v=v, q_descale=ds(2, 2), k_descale=ds(2, 2), v_descale=ds(2, 2), **over))
        )
    q = t(2, 256, 4, 128, dtype=torch.bfloat16)
    calls.append(
        (
            "flash_attn_func",
            dict(q=q, k=t(2, 256, 2, 128, dtype=torch.bfloat16), v=t(2, 256, 2, 128, dtype=torch.bfloat16)),
        )
    )
    calls.append(("flash_attn_qkvpacked_func", dict(qkv=t(1, 128, 3, 2, 64), causal=True)))
    for lens in ([1024, 1100], [300, 500]):
        cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=dev)
        tot = sum(lens)
        calls.append(
            (
                "flash_attn_varlen_func",
                dict(
                    q=t(tot, 4, 128),
                    k=t(tot, 2, 128),
                    v=t(tot, 2, 128),
                    cu_seqlens_q=cu,
                    cu_seqlens_k=cu,
                    max_seqlen_q=max(lens),
                    max_seqlen_k=max(lens),
                    causal=True,
                    q_descale=ds(2, 2),
                    k_descale=ds(2, 2),
                    v_descale=ds(2, 2),
                ),
            )
        )
    nb, ps, hk, d = 48, 64, 2, 128
    k_cache, v_cache = t(nb, ps, hk, d), t(nb, ps, hk, d)
    pt = torch.randperm(nb, device=dev)[:32].view(2, 16).to(torch.int32)
    lens = torch.tensor([700, 1000], dtype=torch.int32, device=dev)
    base = dict(
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=pt,
        cache_seqlens=lens,
        causal=True,
        q_descale=ds(2, hk),
        k_descale=ds(2, hk),
        v_descale=ds(2, hk),
    )
    for sq, over in [(128, {}), (1, {}), (128, dict(num_splits=2)), (256, dict(softcap=10.0))]:
        calls.append(("flash_attn_with_kvcache", dict(q=t(2, sq, 4, d), **base, **over)))
    cu = torch.tensor([0, 1, 257], dtype=torch.int32, device=dev)  # a mixed batch: one decode row, one chunk
    calls.append(("flash_attn_with_kvcache", dict(q=t(257, 4, d), cu_seqlens_q=cu, max_seqlen_q=256, **base)))
    contiguous = dict(k_cache=t(2, 512, hk, d), v_cache=t(2, 512, hk, d), cache_seqlens=lens // 2, causal=True)
    calls.append(("flash_attn_with_kvcache", dict(q=t(2, 128, 4, d), **contiguous)))
    return calls


@pytest.mark.gpu
def test_gpu_supports_matches_the_launcher_that_runs(monkeypatch):
    from fp8attn.kernels.hopper import dense_launch, paged_launch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    ran = []
    for mod, name in ((dense_launch, "launch_dense_fwd_tma"), (paged_launch, "launch_paged_prefill_tma")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, **k: ran.append("hopper") or _real(*a, **k))
    seen = set()
    for entry, kw in _gpu_calls():
        s = cap.supports(entry, **kw)
        ran.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error", cap.FallbackWarning)
            getattr(fp8attn, entry)(**kw)
        torch.cuda.synchronize()
        assert s.kernel in ("hopper", "triton"), (entry, s)
        assert (s.kernel == "hopper") == bool(ran), (entry, {n: getattr(v, "shape", v) for n, v in kw.items()}, s, ran)
        seen.add(s.kernel)
    assert seen == {"hopper", "triton"}  # the grid exercises both answers


@pytest.mark.gpu
def test_gpu_forced_reference_is_a_reported_fallback(monkeypatch):
    k_cache = torch.randn(4, 16, 2, 64, device="cuda").to(E4M3)
    v_cache = k_cache.clone()
    before = k_cache.view(torch.uint8).clone()
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(2, 1, 2, 64, device="cuda", dtype=torch.bfloat16)
    pt = torch.arange(4, device="cuda", dtype=torch.int32).view(2, 2)
    args = dict(
        k=kn,
        v=kn,
        cache_seqlens=torch.tensor([3, 7], device="cuda", dtype=torch.int32),
        page_table=pt,
        k_descale=torch.full((1,), 0.05, device="cuda"),
        v_descale=torch.full((1,), 0.05, device="cuda"),
    )
    monkeypatch.setenv("FP8ATTN_FORCE_REFERENCE", "1")
    monkeypatch.setenv("FP8ATTN_FALLBACK", "error")
    assert cap.supports("flash_attn_with_kvcache", q=q, k_cache=k_cache, v_cache=v_cache, **args).kernel is None
    with pytest.raises(cap.FallbackError, match="force_reference"):
        fp8attn.flash_attn_with_kvcache(q, k_cache, v_cache, **args)
    assert torch.equal(k_cache.view(torch.uint8), before)
    monkeypatch.setenv("FP8ATTN_FALLBACK", "warn")
    monkeypatch.setattr(cap, "_warned", set())
    with pytest.warns(cap.FallbackWarning, match="force_reference"):
        fp8attn.flash_attn_with_kvcache(q, k_cache, v_cache, **args)
