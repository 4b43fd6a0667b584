"""torch.compile integration: the output-quant fusion pass and compile behaviour of a model step.

CPU (inductor CPU, the reference path inside the ops):
* the post-grad graph before/after the fusion pass: attention (fp8attn::dense_fwd, paged_fwd, combine
  and their out= forms) -> view -> static per-tensor FP8 quant (the fp8attn quant op and the plain
  torch form; functional output, torch.zeros and torch.empty out= buffers; tensor and Python-float
  scales) becomes the attention op with out_scale; the quant nodes are counted and gone; the numbers
  equal the unfused eager path within one e4m3 ulp. Dynamic and per-token quantization stay.
* one model step (new K/V written into an FP8 paged cache, then attention, through
  flash_attn_with_kvcache with cu_seqlens_q + page_table) compiled with fullgraph=True, dynamic=True
  and error_on_recompile, run over 12 prefill / decode / mixed steps of other (batch, tokens,
  page-table width): one graph, no graph break, equal to eager.
GPU: CUDA-graph replay (mode="reduce-overhead") equals eager, also for a decode step that writes the
FP8 cache and outputs FP8 (bit for bit); the fused epilogue is bit-exact against
clamp(out_fp32 / s).to(e4m3) for power-of-two scales and within one ulp otherwise.
"""

from collections import Counter

import pytest
import torch

import fp8attn
import fp8attn.compile as fcompile
from fp8attn import ops
from fp8attn.compile import output_quant as oq
from fp8attn.quant import quantize

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
    """Enable the pass; record the post-grad graph (op counts, node list) before and after each fusion."""
    records = []
    orig = oq.fuse_output_quant

    def recording(graph):
        before, before_nodes = _counts(graph), _node_list(graph)
        stats = orig(graph)
        records.append((before, _counts(graph), stats, before_nodes, _node_list(graph)))
        return stats

    monkeypatch.setattr(oq, "fuse_output_quant", recording)
    fcompile.enable_output_quant_fusion()
    torch._dynamo.reset()
    # a cached compiled graph would skip the post-grad passes (and the recording)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield records
    fcompile.disable_output_quant_fusion()
    torch._dynamo.reset()


def _out_scale(n):
    """The out_scale argument of an fp8attn attention node (or of the op an auto_functionalized wraps)."""
    osc = n.kwargs.get("out_scale", None)
    if osc is None and n.args and hasattr(n.target, "_schema"):
        names = [a.name for a in n.target._schema.arguments]
        if "out_scale" in names and len(n.args) > names.index("out_scale"):
            osc = n.args[names.index("out_scale")]
    return osc


def _counts(graph):
    c = Counter()
    for n in graph.nodes:
        if n.op == "call_function":
            c[str(n.target)] += 1
            if "fp8attn" in str(n.target) or "auto_functionalized" in str(n.target):
                c["attn_with_out_scale"] += _out_scale(n) is not None
    return c


def _node_list(graph):
    """The graph's ops in order as short ``name:dtype`` tokens (auto_functionalized names the op it
    wraps; ``+out_scale`` marks an attention op that writes FP8)."""
    toks = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        name = getattr(n.target, "__name__", str(n.target))
        if "auto_functionalized" in name:
            name = f"{name}({n.args[0]._opname})"
        elif hasattr(n.target, "_opname"):
            name = n.target._opname
        if ("fp8attn" in str(n.target) or "auto_functionalized" in name) and _out_scale(n) is not None:
            name += "+out_scale"
        v = n.meta.get("val")
        toks.append(f"{name}:{str(v.dtype)[6:]}" if isinstance(v, torch.Tensor) else name)
    return ", ".join(toks)


def _dense_inputs(b=2, sq=9, sk=13, hq=4, hk=2, d=64):
    q8, _ = quantize(torch.randn(b, sq, hq, d), "per_tensor")
    k8, _ = quantize(torch.randn(b, sk, hk, d), "per_tensor")
    v8, _ = quantize(torch.randn(b, sk, hk, d), "per_tensor")
    descale = [torch.rand(b, hk) * 0.5 + 0.75 for _ in range(3)]
    return q8, k8, v8, descale


def _dense_args():
    q, k, v, (qd, kd, vd) = _dense_inputs()
    return q, k, v, qd, kd, vd


def _paged_args(b=3, sq=2, hq=4, hk=2, d=64, ps=8, pages=3):
    """FP8 q (b, sq, hq, d) over an FP8 paged cache; the queries are the last sq cached tokens."""
    pool = b * pages + 2
    q8, _ = quantize(torch.randn(b, sq, hq, d), "per_tensor")
    kc = torch.randn(pool, ps, hk, d).to(E4M3)
    vc = torch.randn(pool, ps, hk, d).to(E4M3)
    pt = torch.randperm(pool)[: b * pages].view(b, pages).to(torch.int32)
    lens = torch.tensor([5, ps * pages, 11][:b], dtype=torch.int32)
    qd, kd, vd = (torch.rand(b, hk) * 0.5 + 0.75 for _ in range(3))
    return q8, kc, vc, pt, lens, qd, kd, vd


def _combine_args(splits=3, b=2, sq=3, h=4, d=64):
    lse = torch.randn(splits, b, sq, h)
    lse[1, 0] = -float("inf")  # an empty split
    return torch.randn(splits, b, sq, h, d), lse


def _plain_quant(x, s):
    return (x / s).clamp(-448, 448).to(E4M3)


def attn_reshape_plain(q, k, v, qd, kd, vd, s):
    o = fp8attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    o = o.reshape(o.shape[0], o.shape[1], -1)
    return _plain_quant(o, s)


def attn_reshape_quant_op(q, k, v, qd, kd, vd, s):
    o = fp8attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    return ops.quant_fp8_static(o.reshape(o.shape[0], o.shape[1], -1), s)


def attn_zeros_out_quant_op(q, k, v, qd, kd, vd, s):
    out = torch.zeros(q.shape[0], q.shape[1], q.shape[2] * v.shape[3], dtype=torch.bfloat16, device=q.device)
    fp8attn.flash_attn_func(
        q,
        k,
        v,
        causal=True,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        out=out.view(q.shape[0], q.shape[1], q.shape[2], v.shape[3]),
    )
    return ops.quant_fp8_static(out, s)


def attn_zeros_out_plain(q, k, v, qd, kd, vd, s):
    out = torch.zeros(q.shape[0], q.shape[1], q.shape[2] * v.shape[3], dtype=torch.bfloat16, device=q.device)
    fp8attn.flash_attn_func(
        q,
        k,
        v,
        causal=True,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        out=out.view(q.shape[0], q.shape[1], q.shape[2], v.shape[3]),
    )
    return _plain_quant(out, s)


def attn_empty_out_python_scale(q, k, v, qd, kd, vd, s):
    out = torch.empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3], dtype=torch.bfloat16, device=q.device)
    fp8attn.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, out=out)
    return _plain_quant(out.flatten(2), 0.0078125)


def attn_empty_out_tensor_scale(q, k, v, qd, kd, vd, s):
    out = torch.empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3], dtype=torch.bfloat16, device=q.device)
    fp8attn.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, out=out)
    return _plain_quant(out.flatten(2), s)


def attn_empty_out_quant_op(q, k, v, qd, kd, vd, s):
    out = torch.empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3], dtype=torch.bfloat16, device=q.device)
    fp8attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, out=out)
    return ops.quant_fp8_static(out.flatten(2), s)


def attn_dynamic_quant(q, k, v, qd, kd, vd, s):
    o = fp8attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    dyn = o.abs().amax().float().clamp_min(1e-6) / 448
    return _plain_quant(o, dyn)


def attn_per_token_quant(q, k, v, qd, kd, vd, s):
    o = fp8attn.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd).flatten(2)
    s_tok = (torch.arange(o.shape[1], device=o.device, dtype=torch.float32) + 1)[None, :, None] * s
    return _plain_quant(o, s_tok)


def _paged(q, kc, vc, pt, lens, qd, kd, vd, **kw):
    return fp8attn.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=lens, page_table=pt, q_descale=qd, k_descale=kd, v_descale=vd, causal=True, **kw
    )


def paged_plain(q, kc, vc, pt, lens, qd, kd, vd, s):
    return _plain_quant(_paged(q, kc, vc, pt, lens, qd, kd, vd).flatten(2), s)


def paged_quant_op(q, kc, vc, pt, lens, qd, kd, vd, s):
    return ops.quant_fp8_static(_paged(q, kc, vc, pt, lens, qd, kd, vd).flatten(2), s)


def paged_empty_out_quant_op(q, kc, vc, pt, lens, qd, kd, vd, s):
    out = torch.empty(*q.shape[:-1], vc.shape[-1], dtype=torch.bfloat16, device=q.device)
    _paged(q, kc, vc, pt, lens, qd, kd, vd, out=out)
    return ops.quant_fp8_static(out.flatten(2), s)


def paged_zeros_out_plain(q, kc, vc, pt, lens, qd, kd, vd, s):
    out = torch.zeros(*q.shape[:-1], vc.shape[-1], dtype=torch.bfloat16, device=q.device)
    _paged(q, kc, vc, pt, lens, qd, kd, vd, out=out)
    return _plain_quant(out.flatten(2), s)


def paged_split_workspace_plain(q, kc, vc, pt, lens, qd, kd, vd, s):
    # a split workspace without out=: the out variant with a fresh output buffer and two more mutated bases
    ws = fp8attn.split_workspace(q, 2, vc.shape[-1])
    return _plain_quant(_paged(q, kc, vc, pt, lens, qd, kd, vd, num_splits=2, split_workspace=ws).flatten(2), s)


def paged_empty_out_dynamic_per_token(q, kc, vc, pt, lens, qd, kd, vd, s):
    out = torch.empty(*q.shape[:-1], vc.shape[-1], dtype=torch.bfloat16, device=q.device)
    _paged(q, kc, vc, pt, lens, qd, kd, vd, out=out)
    s_tok = out.float().abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-6) / 448
    return _plain_quant(out, s_tok)


def combine_plain(op, lp, s):
    o, _ = fp8attn.flash_attn_combine(op, lp)  # float32 output
    return _plain_quant(o, s)


def combine_zeros_out_quant_op(op, lp, s):
    out = torch.zeros(op.shape[1:], dtype=torch.bfloat16, device=op.device)
    fp8attn.flash_attn_combine(op, lp, out=out, out_dtype=torch.bfloat16)
    return ops.quant_fp8_static(out.flatten(2), s)


# The plain form of a 16-bit output decomposes into 6 nodes (div, convert to fp32, clamp_min, clamp_max,
# convert back to the 16-bit dtype, convert to e4m3fn); of a float32 output into 4 (no converts around the clamp).
CASES = [
    # fn, inputs, fused?, quant nodes removed
    (attn_reshape_plain, _dense_args, True, 6),
    (attn_reshape_quant_op, _dense_args, True, 1),
    (attn_zeros_out_quant_op, _dense_args, True, 1),
    (attn_zeros_out_plain, _dense_args, True, 6),
    (attn_empty_out_python_scale, _dense_args, True, 6),
    (attn_empty_out_tensor_scale, _dense_args, True, 6),
    (attn_empty_out_quant_op, _dense_args, True, 1),
    (attn_dynamic_quant, _dense_args, False, 0),
    (attn_per_token_quant, _dense_args, False, 0),
    (paged_plain, _paged_args, True, 6),  # fp8attn::paged_fwd
    (paged_quant_op, _paged_args, True, 1),
    (paged_empty_out_quant_op, _paged_args, True, 1),  # fp8attn::paged_fwd_out
    (paged_zeros_out_plain, _paged_args, True, 6),
    (paged_split_workspace_plain, _paged_args, True, 6),
    (paged_empty_out_dynamic_per_token, _paged_args, False, 0),
    (combine_plain, _combine_args, True, 4),  # fp8attn::combine
    (combine_zeros_out_quant_op, _combine_args, True, 1),  # fp8attn::combine_out
]


@pytest.mark.parametrize("fn,make_inputs,fused,removed", CASES, ids=[c[0].__name__ for c in CASES])
def test_fusion_pass_graph_and_numerics(fusion, fn, make_inputs, fused, removed):
    args = make_inputs()
    s = torch.tensor(0.0123)
    eager = fn(*args, s)
    comp = torch.compile(fn, fullgraph=True, dynamic=True)(*args, s)
    assert comp.dtype == E4M3 and comp.shape == eager.shape
    assert len(fusion) == 1
    before, after, stats, before_nodes, after_nodes = fusion[0]
    quant_targets = (
        "aten.div.Tensor",
        "aten.clamp_min.default",
        "aten.clamp_max.default",
        "prims.convert_element_type.default",
        "fp8attn.quant_fp8_static.default",
    )
    n_before = sum(before[t] for t in quant_targets)
    n_after = sum(after[t] for t in quant_targets)
    print(
        f"\n{fn.__name__}: quant nodes {n_before} -> {n_after}; fused attention ops "
        f"{before['attn_with_out_scale']} -> {after['attn_with_out_scale']}; stats {stats}"
        f"\n  before: {before_nodes}\n  after:  {after_nodes}"
    )
    if fused:
        assert stats.get("fused") == 1 and stats.get("removed_quant_nodes") == removed, stats
        assert n_before == removed and n_after == 0
        assert before["attn_with_out_scale"] == 0 and after["attn_with_out_scale"] == 1
    else:
        assert not stats.get("fused") and n_after == n_before
        assert after["attn_with_out_scale"] == 0
    d = ulp_distance(comp, eager)
    assert d.max().item() <= 1, f"max ulp distance {d.max().item()}"
    assert (d > 0).float().mean().item() < 0.2  # the 16-bit rounding only moves a few ties


def test_fused_output_quant_supported_and_explicit_requests():
    assert fp8attn.compile.fused_output_quant_supported("static_per_tensor")
    assert fp8attn.compile.fused_output_quant_supported("static")
    for kind in (
        "dynamic_per_tensor",
        "per_token",
        "dynamic_per_token",
        "static_per_token",
        "per_group",
        "group",
        "per_channel",
        "mx",
    ):
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


def model_step(x, wq, wk, wv, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens, max_seqlen_q, kd, vd, s):
    """One serving step over packed tokens: prefill chunks, decode rows (one token each) or a mix.

    The new K/V are quantized into the FP8 paged cache at ``cache_seqlens`` and attended to in the same call.
    """
    t = x.shape[0]
    q = (x @ wq).view(t, HQ, D)
    k = (x @ wk).view(t, HK, D)
    v = (x @ wv).view(t, HK, D)
    o = fp8attn.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=k,
        v=v,
        cache_seqlens=cache_seqlens,
        page_table=page_table,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k_new=cu_seqlens,
        max_seqlen_q=max_seqlen_q,
        k_descale=kd,
        v_descale=vd,
        causal=True,
    )
    return o.reshape(t, HQ * D) * s


def _model(device=DEV, hidden=32):
    g = torch.Generator().manual_seed(1)
    w = [
        (torch.randn(hidden, n, generator=g) / hidden**0.5).to(device, torch.bfloat16) for n in (HQ * D, HK * D, HK * D)
    ]
    pool = 96
    kc = torch.empty(pool, PS, HK, D, dtype=torch.uint8, device=device).fill_(0x7F).view(E4M3)  # NaN poison
    vc = torch.empty(pool, PS, HK, D, dtype=torch.uint8, device=device).fill_(0x7F).view(E4M3)
    kd = torch.tensor([[0.011]], device=device)
    vd = torch.tensor([[0.013]], device=device)
    return w, kc, vc, kd, vd


# New tokens per sequence of each step (the first len(step) sequences take part): prefill chunks, decode
# steps and mixed steps, each with another (batch, tokens, page-table width) and the contexts growing.
# Sizes that dynamo sees as 0 or 1 on the first call are specialized, and sizes equal on the first call
# share one symbol (duck shaping), so either would recompile on a later step. The first step's sizes are
# therefore all >= 2, distinct from each other and from the static ones (hidden 32, heads 2, head dim 64,
# page size 8, 96 pages, projections 128 / 256): batch 3, cu_seqlens 4, tokens 66, page-table width 5,
# max_seqlen_q 37. Later steps may take any size >= 2 (batch and page-table width stay >= 2 here);
# max_seqlen_q is an int, which dynamic=True keeps symbolic even at 1 (decode steps).
SCHEDULE = [
    [9, 37, 20],
    [1, 1, 1],
    [6, 3, 2, 30, 17],
    [1, 1, 1, 1],
    [1, 1, 12, 1, 25],
    [1, 1],
    [20, 4],
    [1, 1, 1, 1, 1],
    [8, 16, 11, 27],
    [1, 1, 1],
    [2, 1, 9, 1, 1],
    [1, 1, 1, 1, 1],
]


def _run_schedule(step, device=DEV, hidden=32):
    """Run SCHEDULE through ``step`` (eager or compiled) from an empty cache; returns the outputs, the
    (batch, tokens, page-table width) of each step and the K cache."""
    w, kc, vc, kd, vd = _model(device, hidden)
    nseq, max_pages = 5, 12
    perm = torch.randperm(kc.shape[0], generator=torch.Generator().manual_seed(2)).to(torch.int32)
    page_table = perm[: nseq * max_pages].view(nseq, max_pages)
    lens = torch.zeros(nseq, dtype=torch.int32)
    s = torch.tensor(0.5, device=device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    outs, shapes = [], []
    for new in SCHEDULE:
        b, t = len(new), sum(new)
        new = torch.tensor(new, dtype=torch.int32)
        pages = -(-int((lens[:b] + new).max()) // PS)  # the page table as wide as the longest context needs
        x = torch.randn(t, hidden, generator=g).to(device, torch.bfloat16)
        cu = torch.nn.functional.pad(new.cumsum(0), (1, 0)).to(torch.int32).to(device)
        outs.append(
            step(
                x,
                *w,
                kc,
                vc,
                page_table[:b, :pages].contiguous().to(device),
                lens[:b].clone().to(device),
                cu,
                int(new.max()),
                kd,
                vd,
                s,
            )
        )
        shapes.append((b, t, pages))
        lens[:b] += new
    return outs, shapes, kc


def test_model_step_compiles_once_without_recompiles():
    """One compiled step (fullgraph, dynamic) serves every prefill / decode / mixed step: no recompile,
    no graph break, the same cache writes and outputs as the eager step."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    eager, shapes, kc_e = _run_schedule(model_step)
    assert len(set(shapes)) >= 10, shapes
    with torch._dynamo.config.patch(error_on_recompile=True):
        comp, _, kc_c = _run_schedule(torch.compile(model_step, fullgraph=True, dynamic=True))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(kc_e.view(torch.uint8), kc_c.view(torch.uint8))  # same cache writes
    for i, (a, b) in enumerate(zip(eager, comp)):
        assert a.shape == b.shape
        assert torch.isfinite(b.float()).all(), f"step {i}"
        torch.testing.assert_close(b.float(), a.float(), rtol=2**-7, atol=1e-3, msg=f"step {i}")
    torch._dynamo.reset()


def test_compiled_calls_take_no_eager_plan(monkeypatch):
    """Under torch.compile a call never reads the eager-plan cache (its key holds tensor addresses, which
    dynamo cannot trace): with every call made plannable, as CUDA calls are, the compiled dense and paged
    calls trace in one graph and equal the eager ones."""
    from fp8attn import plan

    monkeypatch.setattr(plan, "plannable", lambda *a: True)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 24, h, D, generator=g).to(E4M3) for h in (HQ, HK, HK))
    kc, vc = (torch.randn(8, PS, HK, D, generator=g).to(E4M3) for _ in range(2))
    pt = torch.arange(8, dtype=torch.int32).view(2, 4)
    lens = torch.tensor([19, 30], dtype=torch.int32)
    ds = torch.full((2, HK), 0.05)

    def fn(q, k, v, kc, vc, pt, lens, ds):
        o1 = fp8attn.flash_attn_func(q, k, v, causal=True, q_descale=ds, k_descale=ds, v_descale=ds, validate=False)
        o2 = fp8attn.flash_attn_with_kvcache(
            q[:, -1:], kc, vc, cache_seqlens=lens, page_table=pt, k_descale=ds, v_descale=ds, validate=False
        )
        return o1, o2

    want = fn(q, k, v, kc, vc, pt, lens, ds)
    got = torch.compile(fn, backend="eager", fullgraph=True)(q, k, v, kc, vc, pt, lens, ds)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# GPU (H200)
# ---------------------------------------------------------------------------------------------


def decode_attn(q, k_cache, v_cache, page_table, cache_seqlens, qd, kd, vd, s):
    o = fp8attn.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=cache_seqlens,
        page_table=page_table,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        causal=True,
    )
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
        pt = torch.randperm(kc.shape[0], device="cuda", generator=g)[: b * 8].view(b, 8).to(torch.int32)
        lens = torch.randint(1, 8 * PS + 1, (b,), device="cuda", generator=g, dtype=torch.int32)
        want = decode_attn(q, kc, vc, pt, lens, qd, kd, vd, s)
        got = comp(q, kc, vc, pt, lens, qd, kd, vd, s).clone()
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch._dynamo.reset()


def decode_write_attn(q, k, v, k_cache, v_cache, page_table, cache_seqlens, qd, kd, vd, s):
    """A decode step's attention: append the new K/V (quantized with kd / vd) at ``cache_seqlens``, attend
    over the cache, write the output in e4m3fn (``out_scale``)."""
    return fp8attn.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=k,
        v=v,
        cache_seqlens=cache_seqlens,
        page_table=page_table,
        q_descale=qd,
        k_descale=kd,
        v_descale=vd,
        causal=True,
        out_scale=s,
    )


@pytest.mark.gpu
def test_gpu_cuda_graph_decode_cache_write_out_scale():
    """mode="reduce-overhead" of a decode step that writes the FP8 paged cache and outputs FP8: replays with
    new lengths, page tables and tokens (same shapes) equal the eager step bit for bit, output and cache.

    The projections stay outside the step: fused 16-bit pointwise code in Inductor may round otherwise than
    eager, and this test compares bits of fp8attn's ops under graph replay."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _, kc_e, vc_e, kd, vd = _model("cuda")
    kc_e.copy_(torch.randn(kc_e.shape, device="cuda").to(E4M3))  # finite everywhere: any length reads real tokens
    vc_e.copy_(torch.randn(vc_e.shape, device="cuda").to(E4M3))
    kc_c, vc_c = kc_e.clone(), vc_e.clone()
    # fixed addresses, as an engine's caches: the graph writes them in place rather than copying them into
    # its own buffers (and the writes back) around each replay
    torch._dynamo.mark_static_address(kc_c)
    torch._dynamo.mark_static_address(vc_c)
    comp = torch.compile(decode_write_attn, mode="reduce-overhead", fullgraph=True, dynamic=False)
    qd = torch.tensor([[0.02]], device="cuda")
    s = torch.tensor([0.001], device="cuda")  # outputs span most of e4m3's range
    b, max_pages = 4, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    for i in range(6):  # warm-up, record, then replays
        q = torch.randn(b, 1, HQ, D, device="cuda", generator=g).to(E4M3)
        k = torch.randn(b, 1, HK, D, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(b, 1, HK, D, device="cuda", generator=g, dtype=torch.bfloat16)
        pt = torch.randperm(kc_e.shape[0], device="cuda", generator=g)[: b * max_pages].view(b, -1).to(torch.int32)
        lens = torch.randint(0, max_pages * PS, (b,), device="cuda", generator=g, dtype=torch.int32)  # room for 1
        want = decode_write_attn(q, k, v, kc_e, vc_e, pt, lens, qd, kd, vd, s)
        torch.compiler.cudagraph_mark_step_begin()
        got = comp(q, k, v, kc_c, vc_c, pt, lens, qd, kd, vd, s).clone()  # (a replay overwrites its output)
        assert got.dtype == E4M3 and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"call {i}"
        assert torch.equal(kc_c.view(torch.uint8), kc_e.view(torch.uint8)), f"call {i}: K cache"
        assert torch.equal(vc_c.view(torch.uint8), vc_e.view(torch.uint8)), f"call {i}: V cache"
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
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
            return fp8attn.flash_attn_func(
                q8, k8, v8, causal=True, q_descale=qd.view(1, 1), k_descale=kd.view(1, 1), v_descale=vd.view(1, 1), **kw
            )
    else:
        ps, L = 16, 1000
        pool = b * (L // ps + 1) * 2
        kc = torch.empty(pool, ps, hk, d, device="cuda", dtype=torch.uint8).fill_(0x7F).view(E4M3)
        vc = torch.empty(pool, ps, hk, d, device="cuda", dtype=torch.uint8).fill_(0x7F).view(E4M3)
        npg = L // ps + 1
        pt = torch.randperm(pool, device="cuda")[: b * npg].view(b, npg).to(torch.int32)
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
            return fp8attn.flash_attn_with_kvcache(
                q8,
                kc,
                vc,
                cache_seqlens=lens,
                page_table=pt,
                causal=True,
                q_descale=qd.view(1, 1),
                num_splits=splits,
                **extra,
                **kw,
            )

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
            tol = want.float().abs() * 2**-3 * 1.001 + 0.02 * (o32 / st).abs().max()
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
    q, k, v, (qd, kd, vd) = (
        t.cuda() if torch.is_tensor(t) else [x.cuda() for x in t] for t in _dense_inputs(b=4, sq=128, sk=384)
    )
    s = torch.tensor(0.0123, device="cuda")
    for fn in (attn_reshape_plain, attn_zeros_out_quant_op):
        eager = fn(q, k, v, qd, kd, vd, s)
        comp = torch.compile(fn, fullgraph=True, dynamic=True)(q, k, v, qd, kd, vd, s)
        assert ulp_distance(comp, eager).max().item() <= 1
    assert sum(r[2].get("fused", 0) for r in fusion) == 2
