"""torch.compile integration: the output-quant fusion pass and compile behaviour of a model step.

CPU (inductor CPU, the reference path inside the ops):
* the post-grad graph before/after the fusion pass: attention -> view -> static per-tensor FP8 quant
  (the fp8attn quant op and the plain torch form; functional output, torch.zeros and torch.empty
  out= buffers) becomes the attention op with out_scale; the quant nodes are counted and gone; the
  numbers equal the unfused eager path within one e4m3 ulp. Dynamic and per-token quantization stay.
* a small model step (chunked prefill through flash_attn_with_kvcache with cu_seqlens_q + page_table,
  then decode steps) compiled with fullgraph=True, dynamic=True and error_on_recompile across 10
  changes of batch and lengths: one graph per step function, equal to eager.
GPU: CUDA-graph replay (mode="reduce-overhead") equals eager; the fused epilogue is bit-exact
against clamp(out_fp32 / s).to(e4m3) for power-of-two scales and within one ulp otherwise.
"""
import os
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton (the inductor pass API does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fp8attn  # noqa: E402
import fp8attn.compile as fcompile  # noqa: E402
from fp8attn import ops  # noqa: E402
from fp8attn.compile import output_quant as oq  # noqa: E402
from fp8attn.quant import quantize  # noqa: E402

E4M3 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def ulp_distance(a, b):
    """Distance in e4m3fn code points (sign-magnitude bytes mapped to a monotonic integer line)."""
    def line(x):
        u = x.view(torch.uint8).int()
        mag = u & 0x7F
        return torch.where(u >= 0x80, -mag, mag)
    return (line(a) - line(b)).abs()


@pytest.fixture
def fusion(monkeypatch):
    """Enable the pass; record the post-grad graph (op counts) before and after each fusion."""
    records = []
    orig = oq.fuse_output_quant

    def recording(graph):
        before = _counts(graph)
        stats = orig(graph)
        records.append((before, _counts(graph), stats))
        return stats

    monkeypatch.setattr(oq, "fuse_output_quant", recording)
    fcompile.enable_output_quant_fusion()
    torch._dynamo.reset()
    # a cached compiled graph would skip the post-grad passes (and the recording)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield records
    fcompile.disable_output_quant_fusion()
    torch._dynamo.reset()


def _counts(graph):
    c = Counter()
    for n in graph.nodes:
        if n.op == "call_function":
            c[str(n.target)] += 1
            if "fp8attn" in str(n.target) or "auto_functionalized" in str(n.target):
                osc = n.kwargs.get("out_scale", None)
                if osc is None and n.args and hasattr(n.target, "_schema"):
                    names = [a.name for a in n.target._schema.arguments]
                    if "out_scale" in names and len(n.args) > names.index("out_scale"):
                        osc = n.args[names.index("out_scale")]
                c["attn_with_out_scale"] += osc is not None
    return c


def _dense_inputs(b=2, sq=9, sk=13, hq=4, hk=2, d=64):
    q8, _ = quantize(torch.randn(b, sq, hq, d), "per_tensor")
    k8, _ = quantize(torch.randn(b, sk, hk, d), "per_tensor")
    v8, _ = quantize(torch.randn(b, sk, hk, d), "per_tensor")
    descale = [torch.rand(b, hk) * 0.5 + 0.75 for _ in range(3)]
    return q8, k8, v8, descale


def _plain_quant(x, s):
    return (x / s).clamp(-448, 448).to(E4M3)


def attn_reshape_plain(q, k, v, qd, kd, vd, s):
    o = fp8attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    o = o.reshape(o.shape[0], o.shape[1], -1)
    return _plain_quant(o, s)


def attn_zeros_out_quant_op(q, k, v, qd, kd, vd, s):
    out = torch.zeros(q.shape[0], q.shape[1], q.shape[2] * v.shape[3], dtype=torch.bfloat16, device=q.device)
    fp8attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                            out=out.view(q.shape[0], q.shape[1], q.shape[2], v.shape[3]))
    return ops.quant_fp8_static(out, s)


def attn_empty_out_python_scale(q, k, v, qd, kd, vd, s):
    out = torch.empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3], dtype=torch.bfloat16, device=q.device)
    fp8attn.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, out=out)
    return _plain_quant(out.flatten(2), 0.0078125)


def attn_dynamic_quant(q, k, v, qd, kd, vd, s):
    o = fp8attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    dyn = o.abs().amax().float().clamp_min(1e-6) / 448
    return _plain_quant(o, dyn)


def attn_per_token_quant(q, k, v, qd, kd, vd, s):
    o = fp8attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd).flatten(2)
    s_tok = (torch.arange(o.shape[1], device=o.device, dtype=torch.float32) + 1)[None, :, None] * s
    return _plain_quant(o, s_tok)


CASES = [
    # fn, fused?, quant nodes removed
    (attn_reshape_plain, True, 6),
    (attn_zeros_out_quant_op, True, 1),
    (attn_empty_out_python_scale, True, 6),
    (attn_dynamic_quant, False, 0),
    (attn_per_token_quant, False, 0),
]


@pytest.mark.parametrize("fn,fused,removed", CASES, ids=[c[0].__name__ for c in CASES])
def test_fusion_pass_graph_and_numerics(fusion, fn, fused, removed):
    q, k, v, (qd, kd, vd) = _dense_inputs()
    s = torch.tensor(0.0123)
    eager = fn(q, k, v, qd, kd, vd, s)
    comp = torch.compile(fn, fullgraph=True, dynamic=True)(q, k, v, qd, kd, vd, s)
    assert comp.dtype == E4M3 and comp.shape == eager.shape
    assert len(fusion) == 1
    before, after, stats = fusion[0]
    quant_targets = ("aten.div.Tensor", "aten.clamp_min.default", "aten.clamp_max.default",
                     "prims.convert_element_type.default", "fp8attn.quant_fp8_static.default")
    n_before = sum(before[t] for t in quant_targets)
    n_after = sum(after[t] for t in quant_targets)
    print(f"\n{fn.__name__}: quant nodes {n_before} -> {n_after}; fused attention ops "
          f"{before['attn_with_out_scale']} -> {after['attn_with_out_scale']}; stats {stats}")
    if fused:
        assert stats.get("fused") == 1 and stats.get("removed_quant_nodes") == removed
        assert n_before - n_after == removed
        assert before["attn_with_out_scale"] == 0 and after["attn_with_out_scale"] == 1
        assert after["aten.full.default"] + after["aten.empty.memory_format"] >= 0
    else:
        assert not stats.get("fused") and n_after == n_before
        assert after["attn_with_out_scale"] == 0
    d = ulp_distance(comp, eager)
    assert d.max().item() <= 1, f"max ulp distance {d.max().item()}"
    assert (d > 0).float().mean().item() < 0.2  # the 16-bit rounding only moves a few ties


def test_fused_output_quant_supported_and_explicit_requests():
    assert fp8attn.compile.fused_output_quant_supported("static_per_tensor")
    assert fp8attn.compile.fused_output_quant_supported("static")
    for kind in ("dynamic_per_tensor", "per_token", "dynamic_per_token", "static_per_token", "per_group",
                 "group", "per_channel", "mx"):
        assert not fp8attn.compile.fused_output_quant_supported(kind)
        with pytest.raises(NotImplementedError, match="static_per_tensor"):
            fp8attn.compile.enable_output_quant_fusion(kinds=("static_per_tensor", kind))
    assert not fcompile.output_quant_fusion_enabled()
    with pytest.raises(ValueError, match="kind"):
        fp8attn.compile.fused_output_quant_supported("bogus")


def test_enable_is_idempotent_and_chains_existing_pass():
    import torch._inductor.config as ic

    seen = []
    prev = ic.post_grad_custom_post_pass
    try:
        ic.post_grad_custom_post_pass = seen.append
        p1 = fcompile.enable_output_quant_fusion()
        p2 = fcompile.enable_output_quant_fusion()
        assert p1 is p2 and p1.chained is not None
        fcompile.disable_output_quant_fusion()
        assert ic.post_grad_custom_post_pass == seen.append
    finally:
        ic.post_grad_custom_post_pass = prev


# ---------------------------------------------------------------------------------------------
# A small model step under torch.compile(fullgraph=True, dynamic=True), no recompiles
# ---------------------------------------------------------------------------------------------

HQ, HK, D, PS = 4, 2, 64, 8


def prefill_step(x, wq, wk, wv, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens, max_seqlen_q, kd, vd, s):
    t = x.shape[0]
    q = (x @ wq).view(t, HQ, D)
    k = (x @ wk).view(t, HK, D)
    v = (x @ wv).view(t, HK, D)
    o = fp8attn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                                        page_table=page_table, cu_seqlens_q=cu_seqlens, cu_seqlens_k_new=cu_seqlens,
                                        max_seqlen_q=max_seqlen_q, k_descale=kd, v_descale=vd, causal=True)
    return o.reshape(t, HQ * D) * s


def decode_step(x, wq, wk, wv, k_cache, v_cache, page_table, cache_seqlens, kd, vd, s):
    b = x.shape[0]
    q = (x @ wq).view(b, 1, HQ, D)
    k = (x @ wk).view(b, 1, HK, D)
    v = (x @ wv).view(b, 1, HK, D)
    o = fp8attn.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                                        page_table=page_table, k_descale=kd, v_descale=vd, causal=True)
    return o.reshape(b, HQ * D) * s


def _model(device=DEV, hidden=32):
    g = torch.Generator().manual_seed(1)
    w = [(torch.randn(hidden, n, generator=g) / hidden ** 0.5).to(device, torch.bfloat16) for n in (HQ * D, HK * D, HK * D)]
    pool = 96
    kc = torch.empty(pool, PS, HK, D, dtype=torch.uint8, device=device).fill_(0x7F).view(E4M3)  # NaN poison
    vc = torch.empty(pool, PS, HK, D, dtype=torch.uint8, device=device).fill_(0x7F).view(E4M3)
    kd = torch.tensor([[0.011]], device=device)
    vd = torch.tensor([[0.013]], device=device)
    return w, kc, vc, kd, vd


def _schedule():
    """10 steps: chunked prefill with changing batch / chunk lengths, then decode with changing batch.

    The first size of each step differs from the static sizes (dynamo's duck shaping would otherwise
    tie batch = nheads_k = 2 to one symbol and specialize it); later steps use any size >= 2."""
    pre = [[5, 7, 4], [7, 2], [6, 9, 11, 5], [2, 4, 6, 8, 10], [9, 3, 6]]
    dec = [5, 3, 4, 2, 3]
    return pre, dec


def _run_schedule(prefill, decode, device=DEV, hidden=32):
    w, kc, vc, kd, vd = _model(device, hidden)
    perm = torch.randperm(kc.shape[0], generator=torch.Generator().manual_seed(2)).to(torch.int32).to(device)
    max_pages = 8
    nseq = 5
    page_table = perm[:nseq * max_pages].view(nseq, max_pages).contiguous()
    lens = torch.zeros(nseq, dtype=torch.int32, device=device)
    s = torch.tensor(0.5, device=device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    outs = []
    pre, dec = _schedule()
    for chunk in pre:
        b = len(chunk)
        x = torch.randn(sum(chunk), hidden, generator=g).to(device, torch.bfloat16)
        cu = torch.nn.functional.pad(torch.tensor(chunk).cumsum(0), (1, 0)).to(torch.int32).to(device)
        outs.append(prefill(x, *w, kc, vc, page_table[:b], lens[:b].clone(), cu, max(chunk), kd, vd, s))
        lens[:b] += torch.tensor(chunk, dtype=torch.int32, device=device)
    for b in dec:
        x = torch.randn(b, hidden, generator=g).to(device, torch.bfloat16)
        outs.append(decode(x, *w, kc, vc, page_table[:b], lens[:b].clone(), kd, vd, s))
        lens[:b] += 1
    return outs, kc


def test_model_step_compiles_once_without_recompiles():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    eager, kc_e = _run_schedule(prefill_step, decode_step)
    with torch._dynamo.config.patch(error_on_recompile=True):
        cp = torch.compile(prefill_step, fullgraph=True, dynamic=True)
        cd = torch.compile(decode_step, fullgraph=True, dynamic=True)
        comp, kc_c = _run_schedule(cp, cd)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(kc_e.view(torch.uint8), kc_c.view(torch.uint8))  # same cache writes
    for i, (a, b) in enumerate(zip(eager, comp)):
        assert a.shape == b.shape
        assert torch.isfinite(b.float()).all(), f"step {i}"
        torch.testing.assert_close(b.float(), a.float(), rtol=2 ** -7, atol=1e-3, msg=f"step {i}")
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# GPU (H200)
# ---------------------------------------------------------------------------------------------

def decode_attn(q, k_cache, v_cache, page_table, cache_seqlens, qd, kd, vd, s):
    o = fp8attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
                                        q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    return o.flatten(1) * s


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_equals_eager():
    """mode="reduce-overhead": recorded CUDA graphs replay with new lengths / page tables == eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    w, kc, vc, kd, vd = _model("cuda")
    kc.copy_(torch.randn(kc.shape, device="cuda").to(E4M3))
    vc.copy_(torch.randn(vc.shape, device="cuda").to(E4M3))
    comp = torch.compile(decode_attn, mode="reduce-overhead", fullgraph=True, dynamic=False)
    s = torch.tensor(0.5, device="cuda", dtype=torch.bfloat16)
    qd = torch.tensor([[0.02]], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for b in (4, 4, 4, 4, 8, 8, 8):
        q = torch.randn(b, 1, HQ, D, device="cuda", generator=g).to(E4M3)
        pt = torch.randperm(kc.shape[0], device="cuda", generator=g)[:b * 8].view(b, 8).to(torch.int32)
        lens = torch.randint(1, 8 * PS + 1, (b,), device="cuda", generator=g, dtype=torch.int32)
        want = decode_attn(q, kc, vc, pt, lens, qd, kd, vd, s)
        got = comp(q, kc, vc, pt, lens, qd, kd, vd, s).clone()
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "paged_decode", "paged_varlen", "paged_split"])
def test_gpu_fused_epilogue_bit_exact(kind):
    torch.manual_seed(0)
    b, hq, hk, d = 4, 8, 2, 128
    q8, qd = quantize(torch.randn(b, 64 if kind == "dense" else 1, hq, d, device="cuda"), "per_tensor")
    if kind == "dense":
        k8, kd = quantize(torch.randn(b, 300, hk, d, device="cuda"), "per_tensor")
        v8, vd = quantize(torch.randn(b, 300, hk, d, device="cuda"), "per_tensor")

        def run(**kw):
            return fp8attn.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd.view(1, 1), k_descale=kd.view(1, 1),
                                           v_descale=vd.view(1, 1), **kw)
    else:
        ps, L = 16, 1000
        pool = b * (L // ps + 1) * 2
        kc = torch.empty(pool, ps, hk, d, device="cuda", dtype=torch.uint8).fill_(0x7F).view(E4M3)
        vc = torch.empty(pool, ps, hk, d, device="cuda", dtype=torch.uint8).fill_(0x7F).view(E4M3)
        npg = L // ps + 1
        pt = torch.randperm(pool, device="cuda")[:b * npg].view(b, npg).to(torch.int32)
        lens = torch.tensor([L, 1, 513, 77], device="cuda", dtype=torch.int32)
        for i, n in enumerate(lens.tolist()):
            for t0 in range(0, n, ps):
                m = min(ps, n - t0)
                kc[pt[i, t0 // ps], :m] = torch.randn(m, hk, d, device="cuda").to(E4M3)
                vc[pt[i, t0 // ps], :m] = torch.randn(m, hk, d, device="cuda").to(E4M3)
        if kind == "paged_varlen":
            ql = torch.tensor([5, 1, 9, 3], device="cuda")
            cu = torch.nn.functional.pad(ql.cumsum(0), (1, 0)).to(torch.int32)
            q8 = torch.randn(int(ql.sum()), hq, d, device="cuda").to(E4M3)
            extra = dict(cu_seqlens_q=cu, max_seqlen_q=9)
        else:
            extra = {}
        splits = 3 if kind == "paged_split" else 1

        def run(**kw):
            return fp8attn.flash_attn_with_kvcache(q8, kc, vc, cache_seqlens=lens, page_table=pt, causal=True,
                                                   q_descale=qd.view(1, 1), num_splits=splits, **extra, **kw)
    o32 = run(out_dtype=torch.float32)
    for s in (0.0078125, 0.013):  # a power of two (exact reciprocal) and a general scale
        st = torch.tensor([s], device="cuda")
        fused = run(out_scale=st)
        assert fused.dtype == E4M3
        want = (o32 / st).clamp(-448, 448).to(E4M3)
        d_ulp = ulp_distance(fused, want)
        if kind == "dense":
            # the dense kernel autotunes with OUT_FP8 in the key: the fp32 and FP8 runs may use other
            # tiles (another P-quantization grouping), so compare in value space: one e4m3 ulp of the
            # value (2**-3 relative) plus 2% of the output's largest magnitude (P-grouping noise).
            tol = want.float().abs() * 2 ** -3 * 1.001 + 0.02 * (o32 / st).abs().max()
            assert ((fused.float() - want.float()).abs() <= tol).all(), kind
        elif s == 0.0078125:
            assert d_ulp.max().item() == 0, kind
        else:
            assert d_ulp.max().item() <= 1, kind
        unfused = ops.quant_fp8_static(run(), st)  # bf16 output, then the separate quant kernel
        if kind != "dense":
            assert ulp_distance(fused, unfused).max().item() <= 1


@pytest.mark.gpu
def test_gpu_fusion_pass_inductor_cuda(fusion):
    q, k, v, (qd, kd, vd) = (t.cuda() if torch.is_tensor(t) else [x.cuda() for x in t] for t in _dense_inputs(b=4, sq=128, sk=384))
    s = torch.tensor(0.0123, device="cuda")
    for fn in (attn_reshape_plain, attn_zeros_out_quant_op):
        eager = fn(q, k, v, qd, kd, vd, s)
        comp = torch.compile(fn, fullgraph=True, dynamic=True)(q, k, v, qd, kd, vd, s)
        assert ulp_distance(comp, eager).max().item() <= 1
    assert sum(r[2].get("fused", 0) for r in fusion) == 2
