"""fp8attn's torch.library ops (ops.py): opcheck, exact fakes, out= variants, safe re-import.

CPU: every op through ``torch.library.opcheck`` (schema, autograd registration, fake tensor, aot
dispatch dynamic) at small shapes on the reference path; fakes must match the real outputs' shapes,
dtypes and strides (LSE included); the Python entry points must give the same results as the
reference; importing twice / reloading must not register anything twice.
"""

import importlib
import subprocess
import sys
import warnings

import pytest
import torch

import fp8attn
from fp8attn import ops, reference
from fp8attn.quant import quantize

E4M3 = torch.float8_e4m3fn
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _fp8(shape, scale=1.0):
    x8, d = quantize(torch.randn(shape) * scale, "per_tensor")
    return x8, d


def _descale(b, hk):
    return (torch.rand(b, hk) * 0.5 + 0.75).float()


def _nan_poison_cache(cache):
    cache.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn
    return cache


def _paged_case(varlen=False, out_scale=None, out_dtype=None, return_lse=True):
    b, hq, hk, d, ps, npages = 3, 4, 2, 32, 4, 3
    pool = b * npages * 3
    kc = _nan_poison_cache(torch.empty(pool, ps, hk, d, dtype=E4M3))
    vc = _nan_poison_cache(torch.empty(pool, ps, hk, d, dtype=E4M3))
    pt = torch.full((b, npages), -1, dtype=torch.int32)
    perm = torch.randperm(pool).to(torch.int32)
    lens = torch.tensor([5, 1, 11], dtype=torch.int32)
    for i, n in enumerate(lens.tolist()):
        np_ = -(-n // ps)
        pt[i, :np_] = perm[i * npages : i * npages + np_]
        for t in range(n):
            kc[pt[i, t // ps], t % ps] = torch.randn(hk, d).to(E4M3)
            vc[pt[i, t // ps], t % ps] = torch.randn(hk, d).to(E4M3)
    if varlen:
        qlens = torch.tensor([2, 1, 3])
        cu = torch.nn.functional.pad(qlens.cumsum(0), (1, 0)).to(torch.int32)
        q = torch.randn(int(qlens.sum()), hq, d).to(E4M3)
        msq = 3
    else:
        cu, msq = None, None
        q = torch.randn(b, 1, hq, d).to(E4M3)
    args = (
        q,
        kc,
        vc,
        pt,
        lens,
        cu,
        msq,
        0.17,
        True,
        -1,
        0,
        0.0,
        _descale(b, hk),
        _descale(b, hk),
        _descale(b, hk),
        None,
        None,
        out_scale,
        out_dtype,
        0,
        return_lse,
    )
    return args


def _dense_case(varlen=False, out_scale=None, out_dtype=None, return_lse=True):
    b, sq, sk, hq, hk, d = 2, 5, 7, 4, 2, 32
    if varlen:
        lq, lk = torch.tensor([2, 5]), torch.tensor([7, 3])
        cq = torch.nn.functional.pad(lq.cumsum(0), (1, 0)).to(torch.int32)
        ck = torch.nn.functional.pad(lk.cumsum(0), (1, 0)).to(torch.int32)
        q = torch.randn(int(lq.sum()), hq, d).to(E4M3)
        k = torch.randn(int(lk.sum()), hk, d).to(E4M3)
        v = torch.randn(int(lk.sum()), hk, d).to(E4M3)
        extra = (cq, ck, None, None, 5, 7)
    else:
        q = torch.randn(b, sq, hq, d).to(E4M3)
        k = torch.randn(b, sk, hk, d).to(E4M3)
        v = torch.randn(b, sk, hk, d).to(E4M3)
        extra = (None, None, None, None, None, None)
    return (
        (q, k, v)
        + extra
        + (
            0.2,
            True,
            -1,
            0,
            0.0,
            _descale(b, hk),
            _descale(b, hk),
            _descale(b, hk),
            out_scale,
            out_dtype,
            False,
            0,
            return_lse,
        )
    )


OSCALE = torch.tensor(0.013)


@pytest.fixture(autouse=True)
def _fp8_allclose(monkeypatch):
    """opcheck's schema check compares inputs before/after with torch.allclose, which has no FP8 CPU
    kernel; compare FP8 tensors bit for bit instead (what the mutation check means)."""
    orig = torch.allclose

    def allclose(a, b, *args, **kw):
        if a.dtype in (E4M3, torch.float8_e5m2) and b.dtype == a.dtype:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return orig(a, b, *args, **kw)

    monkeypatch.setattr(torch, "allclose", allclose)


def _cases():
    cases = []
    for varlen in (False, True):
        for osc, odt in ((None, None), (OSCALE, None), (None, torch.float32)):
            tag = f"varlen={varlen} out_scale={osc is not None} out_dtype={odt}"
            cases.append(("dense_fwd", _dense_case(varlen, osc, odt), tag))
            cases.append(("paged_fwd", _paged_case(varlen, osc, odt), tag))
        tag = f"varlen={varlen} return_lse=False"
        cases.append(("dense_fwd", _dense_case(varlen, return_lse=False), tag))
        cases.append(("paged_fwd", _paged_case(varlen, return_lse=False), tag))
    return cases


def _out_for(name, args):
    fn = {"dense_fwd": ops._dense_fake, "paged_fwd": ops._paged_fake}[name]
    o, _ = fn(*args)
    return (
        torch.full(o.shape, float("nan")).to(o.dtype)
        if o.dtype != E4M3
        else torch.empty(o.shape, dtype=torch.uint8).fill_(0x7F).view(E4M3)
    )


@pytest.mark.parametrize("name,args,tag", _cases(), ids=[c[2] + " " + c[0] for c in _cases()])
def test_opcheck_attention(name, args, tag):
    torch.library.opcheck(ops.OPS[name], args, test_utils=OPCHECK_TESTS)
    out = _out_for(name, args)
    torch.library.opcheck(ops.OPS[name + "_out"], args + (out,), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck_paged_with_split_workspace(varlen):
    """The split-KV scratch arguments (mutable, optional) of the out variant: opcheck, and the same results
    as the functional op (which has none, so graphs keep it a plain node); the Python entry point takes the
    out variant when given a workspace without ``out=``, also under torch.compile."""
    args = _paged_case(varlen=varlen)
    args = args[:19] + (3,) + args[20:]  # num_splits 3
    ws = fp8attn.split_workspace(args[0], 4, args[2].shape[-1])
    assert not ops.OPS["paged_fwd"]._schema.is_mutable
    out = _out_for("paged_fwd", args)
    torch.library.opcheck(ops.OPS["paged_fwd_out"], args + (out,) + ws, test_utils=OPCHECK_TESTS)
    lse = ops.OPS["paged_fwd_out"](*args, out, *ws)
    o2, lse2 = ops.OPS["paged_fwd"](*args)
    assert torch.equal(out.view(torch.uint8), o2.view(torch.uint8)) and torch.equal(lse, lse2)
    names = (
        "cu_seqlens_q",
        "max_seqlen_q",
        "softmax_scale",
        "causal",
        "window_size",
        "softcap",
        "q_descale",
        "k_descale",
        "v_descale",
        "k_cache_scales",
        "v_cache_scales",
        "out_scale",
        "out_dtype",
        "num_splits",
    )
    kw = dict(zip(names, args[5:9] + ((args[9], args[10]),) + args[11:20]))

    def entry(*a):
        return ops.paged_fwd(*a, **kw, split_workspace=ws)

    o3, lse3 = entry(*args[:5])
    o4, lse4 = torch.compile(entry, fullgraph=True, backend="aot_eager")(*args[:5])
    for o_, l_ in ((o3, lse3), (o4, lse4)):
        assert torch.equal(o_.view(torch.uint8), o2.view(torch.uint8)) and torch.equal(l_, lse2)


@pytest.mark.parametrize("name,args,tag", _cases()[:4], ids=[c[2] + " " + c[0] for c in _cases()[:4]])
def test_fake_matches_real_exactly(name, args, tag):
    real = ops.OPS[name](*args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = ops.OPS[name](*fargs)
    assert len(real) == len(fake) == 2
    for r, f in zip(real, fake):
        assert (tuple(r.shape), r.dtype, r.stride()) == (tuple(f.shape), f.dtype, f.stride())


def test_out_variant_writes_in_place_and_matches_functional():
    args = _dense_case(varlen=True, out_scale=OSCALE)
    o, lse = ops.OPS["dense_fwd"](*args)
    out = _out_for("dense_fwd", args)
    lse2 = ops.OPS["dense_fwd_out"](*args, out)
    assert torch.equal(out.view(torch.uint8), o.view(torch.uint8))
    assert torch.equal(lse, lse2)
    # Python entry point with out= returns the very buffer
    q, k, v = args[:3]
    buf = torch.empty(o.shape, dtype=torch.bfloat16)
    res, _ = ops.dense_fwd(
        q,
        k,
        v,
        cu_seqlens_q=args[3],
        cu_seqlens_k=args[4],
        max_seqlen_q=5,
        max_seqlen_k=7,
        softmax_scale=0.2,
        causal=True,
        window_size=(-1, 0),
        softcap=0.0,
        q_descale=args[14],
        k_descale=args[15],
        v_descale=args[16],
        out=buf,
    )
    assert res is buf


def test_paged_op_matches_reference_with_fused_output():
    args = _paged_case(varlen=True, out_scale=OSCALE)
    q, kc, vc, pt, lens, cu, msq = args[:7]
    o, lse = ops.OPS["paged_fwd"](*args)
    ref = reference.paged_attention_ref(
        q,
        kc,
        vc,
        pt,
        lens,
        cu_seqlens_q=cu,
        max_seqlen_q=msq,
        softmax_scale=0.17,
        causal=True,
        window_size=(-1, 0),
        q_descale=args[12],
        k_descale=args[13],
        v_descale=args[14],
        out_scale=OSCALE,
        p_dtype=torch.float16,
    )  # small tiles over FA3's V: 16-bit path
    assert o.dtype == E4M3 and lse.shape == (q.shape[1], q.shape[0])
    assert torch.equal(o.view(torch.uint8), ref.view(torch.uint8))
    assert torch.isfinite(o.float()).all()


@pytest.mark.parametrize("name", ["dense_fwd", "paged_fwd"])
@pytest.mark.parametrize("varlen", [False, True])
def test_return_lse_false_gives_the_same_output_and_an_empty_lse(name, varlen):
    case = {"dense_fwd": _dense_case, "paged_fwd": _paged_case}[name]
    with_lse = case(varlen, return_lse=True)
    without = with_lse[:-1] + (False,)
    o, lse = ops.OPS[name](*with_lse)
    o2, lse2 = ops.OPS[name](*without)
    assert torch.equal(o, o2) and lse.numel() > 0
    assert lse2.shape == (0,) and lse2.dtype == torch.float32
    out = _out_for(name, without)
    assert ops.OPS[name + "_out"](*without, out).shape == (0,)
    assert torch.equal(out, o)


def test_api_without_lse_matches_api_with_lse():
    """flash_attn_with_kvcache / flash_attn_func ask their op for an LSE only when it is returned."""
    args = _paged_case(varlen=False)
    q, kc, vc, pt, lens = args[:5]
    kw = dict(
        cache_seqlens=lens, page_table=pt, q_descale=args[12], k_descale=args[13], v_descale=args[14], causal=True
    )
    o = fp8attn.flash_attn_with_kvcache(q, kc, vc, **kw)
    o2, lse = fp8attn.flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **kw)
    assert torch.equal(o, o2) and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    q, k, v = _dense_case()[:3]
    d = _descale(q.shape[0], k.shape[2])
    o = fp8attn.flash_attn_func(q, k, v, causal=True, q_descale=d, k_descale=d, v_descale=d)
    o2, lse = fp8attn.flash_attn_func(
        q, k, v, causal=True, q_descale=d, k_descale=d, v_descale=d, return_attn_probs=True
    )
    assert torch.equal(o, o2) and lse.shape == (q.shape[0], q.shape[2], q.shape[1])


def test_opcheck_combine():
    s, b, h, d = 3, 2, 4, 32
    op_ = torch.randn(s, b, 5, h, d)
    lp = torch.randn(s, b, 5, h)
    lp[1, 0] = float("-inf")  # an empty split
    op_[1, 0] = float("nan")  # ... whose partial must be ignored
    for osc, odt in ((None, None), (OSCALE, None), (None, torch.bfloat16)):
        torch.library.opcheck(ops.OPS["combine"], (op_, lp, osc, odt), test_utils=OPCHECK_TESTS)
        o, lse = ops.OPS["combine"](op_, lp, osc, odt)
        assert torch.isfinite(o.float()).all()
        dt = E4M3 if osc is not None else (odt or torch.float32)
        out = torch.empty(op_.shape[1:], dtype=dt)
        torch.library.opcheck(ops.OPS["combine_out"], (op_, lp, osc, out), test_utils=OPCHECK_TESTS)


def test_opcheck_write_kv_cache():
    nb, ps, hk, d, n = 6, 4, 2, 32, 5
    k = torch.randn(n, hk, d, dtype=torch.bfloat16)
    v = torch.randn(n, hk, d, dtype=torch.bfloat16)
    slots = torch.tensor([3, 0, -1, 17, 9])
    for scales in (False, True):
        kc = torch.zeros(nb, ps, hk, d, dtype=E4M3)
        vc = torch.zeros(nb, ps, hk, d, dtype=E4M3)
        ks = torch.ones(nb, ps, hk) if scales else None
        vs = torch.ones(nb, ps, hk) if scales else None
        kd = None if scales else torch.tensor([[0.02]])
        torch.library.opcheck(
            ops.OPS["write_kv_cache"], (k, v, kc, vc, slots, kd, kd, None, ks, vs), test_utils=OPCHECK_TESTS
        )
    kc = torch.zeros(nb, ps, hk, d, dtype=E4M3)
    vc = torch.zeros(nb, ps, hk, d, dtype=E4M3)
    ops.write_kv_cache(k, v, kc, vc, slots, k_descale=torch.tensor([[0.02]]), v_descale=torch.tensor([[0.02]]))
    want = (k[0].float() / 0.02).clamp(-448, 448).to(E4M3)
    assert torch.equal(kc[0, 3].view(torch.uint8), want.view(torch.uint8))
    assert kc.view(torch.uint8).count_nonzero() > 0 and (kc[1].float() == 0).all()  # slot -1 skipped


def test_opcheck_append_kv_cache():
    """``fp8attn::append_kv_cache`` (the append of flash_attn_with_kvcache): opcheck with fixed new tokens and
    static per-(sequence, head) descales, and varlen new tokens with dynamic scales (mutated); the lengths it
    returns."""
    nb, ps, hk, d = 6, 4, 2, 32
    pt = torch.tensor([[3, 0], [5, 1]], dtype=torch.int32)
    cached = torch.tensor([2, 4], dtype=torch.int32)
    for varlen, scales in ((False, False), (True, True)):
        cu = torch.tensor([0, 3, 4], dtype=torch.int32) if varlen else None
        shape = (4, hk, d) if varlen else (2, 2, hk, d)
        k, v = torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16)
        kc = torch.zeros(nb, ps, hk, d, dtype=E4M3)
        vc = torch.zeros(nb, ps, hk, d, dtype=E4M3)
        ks = torch.ones(nb, ps, hk) if scales else None
        vs = torch.ones(nb, ps, hk) if scales else None
        kd = None if scales else torch.rand(2, hk) * 0.05 + 0.01
        args = (k, v, kc, vc, pt, cached, cu, kd, kd, ks, vs)
        torch.library.opcheck(ops.OPS["append_kv_cache"], args, test_utils=OPCHECK_TESTS)
        total = ops.append_kv_cache(
            k,
            v,
            kc,
            vc,
            pt,
            cached,
            cu_seqlens_k_new=cu,
            k_descale=kd,
            v_descale=kd,
            k_cache_scales=ks,
            v_cache_scales=vs,
        )
        assert total.dtype == torch.int32 and total.tolist() == ([5, 5] if varlen else [4, 6])
        assert kc[3, 2].view(torch.uint8).count_nonzero() > 0  # sequence 0's first new token: page 3, offset 2


def test_opcheck_quant_and_scaled_bmm():
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16) * 50
    torch.library.opcheck(ops.OPS["quant_fp8_static"], (x, OSCALE), test_utils=OPCHECK_TESTS)
    y = ops.quant_fp8_static(x, OSCALE)
    want = (x.float() * (1.0 / OSCALE)).clamp(-448, 448).to(E4M3)
    assert torch.equal(y.view(torch.uint8), want.view(torch.uint8))
    assert y.float().abs().max() == 448  # saturates
    a = torch.randn(2, 5, 32).to(E4M3)
    b = torch.randn(2, 32, 6).to(E4M3)
    torch.library.opcheck(
        ops.OPS["scaled_bmm"],
        (a, b, torch.rand(2, 5) + 0.5, torch.rand(2, 1, 6) + 0.5, torch.bfloat16),
        test_utils=OPCHECK_TESTS,
    )


@pytest.mark.parametrize("granularity", ["per_tensor", "per_head", "per_block"])
@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck_quantize_fp8(granularity, varlen):
    """``fp8attn::quantize_fp8`` (the op behind quantize_qkv): opcheck with and without the Hadamard rotation
    and sequence-major output, fakes equal to the real shapes/strides, and quantize_qkv's results through it."""
    x = torch.randn(*((37,) if varlen else (2, 37)), 4, 32, dtype=torch.bfloat16) * 3
    for rotate, seq_major in ((False, False), (True, False), (False, True)):
        args = (x, granularity, 2, rotate, 7, 16, seq_major, False)
        torch.library.opcheck(ops.OPS["quantize_fp8"], args, test_utils=OPCHECK_TESTS)
        real = ops.OPS["quantize_fp8"](*args)
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            fake = ops.OPS["quantize_fp8"](mode.from_tensor(x), *args[1:])
        for r, f in zip(real, fake):
            assert (tuple(r.shape), r.dtype, r.stride()) == (tuple(f.shape), f.dtype, f.stride())
    k = torch.randn(*x.shape[:-2], 2, 32, dtype=torch.bfloat16)
    q8, k8, v8, qd, kd, vd = fp8attn.quantize_qkv(x, k, k, granularity, block_size=16)
    y, d = ops.OPS["quantize_fp8"](x, granularity, 2, False, fp8attn.hadamard.DEFAULT_SEED, 16, False, False)
    assert torch.equal(q8.view(torch.uint8), y.view(torch.uint8))
    assert torch.equal(qd, d.expand(qd.shape) if granularity == "per_tensor" else d)


def _bf16(args):
    return tuple(a.float().bfloat16() if isinstance(a, torch.Tensor) and a.dtype == E4M3 else a for a in args)


def test_opcheck_16bit_inputs_and_autograd():
    """16-bit q/k/v; autograd: registered on dense_fwd (tests/core/test_backward.py checks its gradients), a C++
    fallthrough at the Autograd key of paged_fwd, whose Python entry point makes a backward raise instead of
    silently dropping gradients."""
    for name, args in (("dense_fwd", _bf16(_dense_case(True))), ("paged_fwd", _bf16(_paged_case(False, OSCALE)))):
        torch.library.opcheck(ops.OPS[name], args, test_utils=OPCHECK_TESTS)
        rg = (args[0].clone().requires_grad_(True),) + args[1:]
        torch.library.opcheck(ops.OPS[name], rg, test_utils=("test_autograd_registration",))
        assert torch._C._dispatch_has_kernel_for_dispatch_key(ops.OPS[name].name(), "Autograd")
    q = torch.randn(1, 3, 2, 32, requires_grad=True)
    kc = torch.randn(4, 4, 2, 32)
    pt = torch.arange(4, dtype=torch.int32)[None]
    o = fp8attn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([9], dtype=torch.int32), page_table=pt)
    assert o.requires_grad
    with pytest.raises(NotImplementedError, match="no backward"):
        o.sum().backward()
    with torch.no_grad():
        assert not fp8attn.flash_attn_with_kvcache(
            q, kc, kc, cache_seqlens=torch.tensor([9], dtype=torch.int32), page_table=pt
        ).requires_grad
    with pytest.raises(NotImplementedError, match="out="):
        fp8attn.flash_attn_func(q, q, q, out=torch.empty(1, 3, 2, 32))


def test_ops_live_only_in_fp8attn_namespace():
    for name, op in ops.OPS.items():
        assert op.name() == f"fp8attn::{name}"
    assert "aten" not in {op.namespace for op in ops.OPS.values()}


def test_reload_does_not_reregister():
    before = dict(ops.OPS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(ops)
        importlib.reload(fp8attn)
    assert all(ops.OPS[k] is before[k] or ops.OPS[k] == before[k] for k in before)
    q = torch.randn(2, 3, 2, 32).to(E4M3)
    fp8attn.flash_attn_func(q, q, q)


def test_import_twice_in_fresh_process_warning_free():
    code = (
        "import warnings, sys, importlib; warnings.simplefilter('error');"
        "import fp8attn, fp8attn.ops, fp8attn.compile;"
        "[sys.modules.pop(m) for m in list(sys.modules) if m.startswith('fp8attn')];"
        "import fp8attn, fp8attn.ops; importlib.reload(fp8attn.ops);"
        "import torch; q = torch.randn(2, 3, 2, 32).to(torch.float8_e4m3fn); fp8attn.flash_attn_func(q, q, q);"
        "print('ok')"
    )
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
    assert "Overriding a previously registered kernel" not in r.stderr


def test_eager_calls_skip_the_dispatcher_only_when_unobservable():
    """ops.dense_fwd / paged_fwd / combine call the implementation directly in plain eager mode; under a
    dispatch mode, FakeTensor or torch.compile they go through fp8attn::* (graphs and modes see the op),
    with the same numbers either way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    b, s, h, d = 1, 16, 2, 32
    q8, qd = _fp8((b, s, h, d))
    k8, kd = _fp8((b, s, h, d))
    v8, vd = _fp8((b, s, h, d))
    assert ops._eager_direct(q8, k8, v8, None)
    kw = dict(q_descale=qd.expand(b, h), k_descale=kd.expand(b, h), v_descale=vd.expand(b, h), causal=True)
    o_direct, lse_direct = fp8attn.flash_attn_func(q8, k8, v8, return_attn_probs=True, **kw)
    with Record() as rec:
        assert not ops._eager_direct(q8, k8, v8, None)
        o_op, lse_op = fp8attn.flash_attn_func(q8, k8, v8, return_attn_probs=True, **kw)
    assert "fp8attn.dense_fwd.default" in rec.names
    assert torch.equal(o_direct, o_op) and torch.equal(lse_direct, lse_op)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        assert not ops._eager_direct(mode.from_tensor(q8))
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    compiled = torch.compile(lambda q, k, v: fp8attn.flash_attn_func(q, k, v, **kw), backend=backend, fullgraph=True)
    assert torch.equal(compiled(q8, k8, v8), o_direct)
    assert any("fp8attn.dense_fwd" in t for t in seen), seen
