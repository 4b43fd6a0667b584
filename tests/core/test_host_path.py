"""The eager host path of every public entry point: no host sync on CUDA (validate=False), and the
`bench host` routine's entries all run (their timing lives in benchmarks/results, never here)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _entries(d):
    from fp8attn.bench.host import _entries as entries

    e, peers, _ = entries("tiny", d)
    return e


@pytest.mark.parametrize("d", [64, 128])
def test_no_host_sync_in_eager_calls(d):
    """Every entry point, after a warm-up call (compile, autotune), runs without a device-to-host sync."""
    entries = _entries(d)
    for fn in entries.values():
        fn()
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, fn in entries.items():
            try:
                fn()
            except RuntimeError as e:  # the sync debug mode raises RuntimeError naming the syncing op
                raise AssertionError(f"{name}: host sync in an eager call: {e}") from e
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()


def test_grad_mode_call_records_backward_or_raises():
    """With an input that requires grad, the call never takes a path that drops the backward."""
    import fp8attn

    q, k, v = (torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg = q.clone().requires_grad_(True)
    out = fp8attn.flash_attn_func(qg, k, v, causal=True)
    assert out.requires_grad and out.grad_fn is not None


def _attention_plans(plan):
    """How many stored plans are attention plans (quantize_qkv, which makes the inputs, stores its own)."""
    return sum(key[0] != "quantize_qkv" for key in plan._PLANS)


def _fp8_inputs(b=2, s=256, hq=4, hk=2, d=128, per_tensor=False):
    import fp8attn

    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk))
    return fp8attn.quantize_qkv(q, k, v, granularity="per_tensor" if per_tensor else "per_head")


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_eager_plan_equals_checked_path(causal, per_tensor):
    """A repeated eager call runs its cached plan (fp8attn.plan): the same bits as the checked path
    (validate=True never takes a plan), with and without the LSE and out=."""
    import fp8attn
    from fp8attn import plan

    plan.clear()
    q8, k8, v8, qd, kd, vd = _fp8_inputs(per_tensor=per_tensor)
    kw = dict(causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
    # (the checked path per output form: a call with an LSE may sum its rows in another order, e.g. the
    # key-permuted K box's rule depends on it)
    ref_nolse = fp8attn.flash_attn_func(q8, k8, v8, validate=True, **kw)
    ref, ref_lse = fp8attn.flash_attn_func(q8, k8, v8, return_attn_probs=True, validate=True, **kw)
    first = fp8attn.flash_attn_func(q8, k8, v8, **kw)
    assert _attention_plans(plan) == 1, "the Hopper-served call left no plan"
    again = fp8attn.flash_attn_func(q8, k8, v8, **kw)
    o, lse = fp8attn.flash_attn_func(q8, k8, v8, return_attn_probs=True, **kw)
    out = torch.empty_like(ref)
    o2 = fp8attn.flash_attn_func(q8, k8, v8, out=out, **kw)
    assert o2 is out
    for x in (first, again, o2):
        assert torch.equal(x, ref_nolse)
    assert torch.equal(o, ref) and torch.equal(lse, ref_lse)
    assert _attention_plans(plan) == 3  # (no LSE, LSE, out=): one plan each


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_eager_plan_keeps_out_dtype(out_dtype):
    """An out_dtype the Hopper kernel does not write: every call, the first (which builds the plan) and the
    planned ones, returns it with the checked path's bits."""
    import fp8attn
    from fp8attn import plan

    plan.clear()
    q8, k8, v8, qd, kd, vd = _fp8_inputs()
    kw = dict(causal=True, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=out_dtype)
    ref = fp8attn.flash_attn_func(q8, k8, v8, validate=True, **kw)
    assert ref.dtype == out_dtype
    for i in range(3):
        got = fp8attn.flash_attn_func(q8, k8, v8, **kw)
        assert got.dtype == out_dtype and torch.equal(got, ref), f"call {i}"
    assert _attention_plans(plan) == 1


def test_eager_plan_not_taken_for_grad_or_other_signatures(monkeypatch):
    import fp8attn
    from fp8attn import plan

    plan.clear()
    q8, k8, v8, qd, kd, vd = _fp8_inputs()
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    fp8attn.flash_attn_func(q8, k8, v8, causal=True, **kw)
    assert _attention_plans(plan) == 1
    # a flag of another type is checked, not matched against causal=True's plan
    with pytest.raises(TypeError, match="causal"):
        fp8attn.flash_attn_func(q8, k8, v8, causal=1, **kw)
    # the environment switch of the dispatch is part of the signature
    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "triton")
    fp8attn.flash_attn_func(q8, k8, v8, causal=True, **kw)
    assert _attention_plans(plan) == 2  # its own plan (the Triton kernel's launcher), not the Hopper one
    # a bad descale value on a GPU: unchecked on both paths (validate=True checks it)
    monkeypatch.delenv("FP8ATTN_DENSE_BACKEND")
    with pytest.raises(ValueError, match="q_descale"):
        fp8attn.flash_attn_func(
            q8, k8, v8, causal=True, q_descale=qd * float("nan"), k_descale=kd, v_descale=vd, validate=True
        )


@pytest.mark.parametrize("q_fp8", [False, True])
def test_eager_plan_paged_decode_equals_checked_path(q_fp8):
    """A repeated eager decode over a paged FP8 cache (no append) runs its plan: the same bits as the
    checked path, NaN-poisoned unused slots and non-unit scales included."""
    import fp8attn
    from fp8attn import plan
    from fp8attn.paged_cache import alloc_paged_cache, make_page_table

    plan.clear()
    b, hq, hk, d, ps, L = 4, 8, 2, 128, 16, 300
    nb = 3 * b * ((L + ps - 1) // ps)
    kc, vc = alloc_paged_cache(nb, ps, hk, d, device="cuda", poison_nan=True, v_seq_major=True)
    pt = make_page_table([L] * b, ps, nb, generator=torch.Generator().manual_seed(1)).cuda()
    seqlens = torch.tensor([L, 1, 257, 128], dtype=torch.int32, device="cuda")
    desc = torch.rand(b, hk, device="cuda") * 0.1 + 0.01
    fp8attn.write_kv_cache(
        torch.randn(b * L, hk, d, device="cuda"),
        torch.randn(b * L, hk, d, device="cuda"),
        kc,
        vc,
        (pt.long()[:, :, None] * ps + torch.arange(ps, device="cuda"))
        .reshape(b, -1)[:, :L]
        .reshape(-1)
        .masked_fill(torch.arange(L, device="cuda").repeat(b) >= seqlens.repeat_interleave(L), -1),
        k_descale=desc,
        v_descale=desc,
        token_seq_idx=torch.arange(b, device="cuda", dtype=torch.int32).repeat_interleave(L),
    )
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    kw = dict(cache_seqlens=seqlens, page_table=pt, k_descale=desc, v_descale=desc)
    if q_fp8:
        qd = torch.rand(b, hk, device="cuda") * 0.05 + 0.01
        q = (q.float() / 0.05).clamp(-448, 448).to(torch.float8_e4m3fn)
        kw["q_descale"] = qd
    ref, ref_lse = fp8attn.flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, validate=True, **kw)
    outs = [fp8attn.flash_attn_with_kvcache(q, kc, vc, **kw) for _ in range(3)]
    o, lse = fp8attn.flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **kw)
    assert sum(key[0] == "paged" for key in plan._PLANS) == 2  # (besides write_kv_cache's)
    assert not torch.isnan(ref).any()
    for x in (*outs, o):
        assert torch.equal(x, ref)
    assert torch.equal(lse, ref_lse)


@pytest.mark.parametrize("causal", [False, True])
def test_eager_plan_triton_kernel_calls_equal_checked_path(causal):
    """Calls the Triton dense kernel serves (varlen at short lengths, 16-bit inputs, a window) run the
    kernel-level launcher's plan: the same bits as the checked path."""
    import fp8attn
    from fp8attn import plan

    plan.clear()
    q8, k8, v8, qd, kd, vd = _fp8_inputs(b=3, s=192, d=64)
    cu = torch.tensor([0, 100, 150, 576], dtype=torch.int32, device="cuda")
    args = (
        q8.reshape(-1, *q8.shape[2:]),
        k8.reshape(-1, *k8.shape[2:]),
        v8.reshape(-1, *v8.shape[2:]),
        cu,
        cu,
        426,
        426,
    )
    kw = dict(
        causal=causal,
        q_descale=qd[:1].expand(3, -1).contiguous(),
        k_descale=kd[:1].expand(3, -1).contiguous(),
        v_descale=vd[:1].expand(3, -1).contiguous(),
    )
    ref = fp8attn.flash_attn_varlen_func(*args, validate=True, **kw)
    got = [fp8attn.flash_attn_varlen_func(*args, **kw) for _ in range(3)]
    qb, kb, vb = (torch.randn(2, 200, h, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    ref16 = fp8attn.flash_attn_func(
        qb, kb, vb, causal=causal, window_size=(64, 0) if causal else (-1, -1), validate=True
    )
    got16 = [
        fp8attn.flash_attn_func(qb, kb, vb, causal=causal, window_size=(64, 0) if causal else (-1, -1))
        for _ in range(3)
    ]
    assert _attention_plans(plan) == 2
    for x in got:
        assert torch.equal(x, ref)
    for x in got16:
        assert torch.equal(x, ref16)


def _replayed(plan):
    """The stored plans' launch replays (``kernels.replay``): every plan with launches must have one."""
    runs = [r for r in plan._PLANS.values() if hasattr(r, "launches")]
    assert runs, "no plan with launches"
    return [r.launches.replay for r in runs]


@pytest.mark.parametrize("kind", ["dense_tma", "varlen_triton", "paged_split", "paged_no_descale"])
def test_replayed_plans_follow_each_calls_tensors(kind):
    """After the first call records a plan's launches, later calls replay them with *their* tensors: each
    call gets new inputs (new addresses and values) and must equal the checked path on those inputs; a
    k/v descale that was one tensor at recording and two tensors later must not reuse the recording."""
    import fp8attn
    from fp8attn import plan
    from fp8attn.paged_cache import alloc_paged_cache, make_page_table

    plan.clear()
    g = torch.Generator(device="cuda").manual_seed(0)

    def call(i, **over):
        if kind == "dense_tma":
            q8, k8, v8, qd, kd, vd = _fp8_inputs(b=2, s=256, d=128)
            kd = vd if i == 0 else kd  # aliased at recording only
            kw = dict(causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
            return lambda **v: fp8attn.flash_attn_func(q8, k8, v8, **kw, **v)
        if kind == "varlen_triton":
            q8, k8, v8, qd, kd, vd = _fp8_inputs(b=3, s=192, d=64)
            cu = torch.tensor([0, 100, 150, 576], dtype=torch.int32, device="cuda")
            flat = [t.reshape(-1, *t.shape[2:]) for t in (q8, k8, v8)]
            kw = dict(
                causal=True, q_descale=qd[:1].expand(3, -1).contiguous(), k_descale=kd[:1].expand(3, -1).contiguous()
            )
            return lambda **v: fp8attn.flash_attn_varlen_func(*flat, cu, cu, 426, 426, **kw, **v)
        b, hq, hk, d, ps, L = 2, 8, 2, 128, 16, 2000  # a long context over few rows: split-KV + combine
        nb = b * (L // ps + 2)
        kc, vc = alloc_paged_cache(nb, ps, hk, d, device="cuda", poison_nan=True, v_seq_major=True)
        kc.copy_((torch.randn(kc.shape, device="cuda", generator=g) * 2).to(kc.dtype))
        vc.copy_((torch.randn(vc.shape, device="cuda", generator=g) * 2).to(vc.dtype))
        pt = make_page_table([L] * b, ps, nb, generator=torch.Generator().manual_seed(i)).cuda()
        seqlens = torch.tensor([L, L - 37], dtype=torch.int32, device="cuda")
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        kw = dict(cache_seqlens=seqlens, page_table=pt)
        if kind == "paged_split":
            kw.update(
                k_descale=torch.rand(b, hk, device="cuda", generator=g) + 0.5,
                v_descale=torch.rand(b, hk, device="cuda", generator=g) + 0.5,
            )
        return lambda **v: fp8attn.flash_attn_with_kvcache(q, kc, vc, **kw, **v)

    for i in range(4):
        f = call(i)
        got = f()
        ref = f(validate=True)
        assert not torch.isnan(ref).any()
        assert torch.equal(got, ref), f"call {i}: the replayed plan differs from the checked path"
    replays = _replayed(plan)
    from fp8attn.kernels import replay

    assert all(r is not None for r in replays), f"a plan's launches were not recorded: {replay.last_refusal}"
    if kind == "paged_split":
        assert len(replays[0].entries) == 2, "expected the split-KV launch and its combine"


@pytest.mark.parametrize("per_seq", [False, True])
def test_replayed_write_kv_cache_follows_each_calls_tensors(per_seq):
    """write_kv_cache's plan (recorded, then replayed) writes each call's tokens where and as the checked
    path does: new K/V, slots and descales every call, into two caches compared bit for bit."""
    import fp8attn
    from fp8attn import plan
    from fp8attn.kernels import replay
    from fp8attn.paged_cache import alloc_paged_cache

    plan.clear()
    nb, ps, hk, d, n = 16, 16, 2, 128, 24
    caches = [alloc_paged_cache(nb, ps, hk, d, device="cuda", poison_nan=True) for _ in range(2)]
    g = torch.Generator(device="cuda").manual_seed(3)
    for i in range(4):
        k, v = (torch.randn(n, hk, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        slots = torch.randperm(nb * ps, device="cuda", generator=g)[:n].to(torch.int32)
        slots[i] = -1  # a skipped token
        kw = dict(k_descale=torch.rand((), device="cuda", generator=g) + 0.05)
        kw["v_descale"] = kw["k_descale"] * 2
        if per_seq:
            kw = dict(
                k_descale=torch.rand(3, hk, device="cuda", generator=g) + 0.05,
                v_descale=torch.rand(3, hk, device="cuda", generator=g) + 0.05,
                token_seq_idx=torch.randint(0, 3, (n,), device="cuda", generator=g, dtype=torch.int32),
            )
        fp8attn.write_kv_cache(k, v, *caches[0], slots, **kw)
        fp8attn.write_kv_cache(k, v, *caches[1], slots, validate=True, **kw)
        for a, b in zip(*caches):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"call {i}"
    assert all(r is not None for r in _replayed(plan)), replay.last_refusal


@pytest.mark.parametrize("scales", ["static", "per_token_head"])
def test_replayed_decode_with_append_follows_each_calls_tensors(scales):
    """flash_attn_with_kvcache(k=, v=)'s plan (the append, then attention over the lengths it leaves;
    recorded, then replayed) equals the checked path on every call: new queries and tokens each step, two
    caches compared bit for bit after each append, outputs equal."""
    import fp8attn
    from fp8attn import plan
    from fp8attn.kernels import replay
    from fp8attn.paged_cache import alloc_paged_cache, make_page_table

    plan.clear()
    b, hq, hk, d, ps, L = 4, 8, 2, 128, 16, 200
    nb = b * (L // ps + 4)
    caches = [alloc_paged_cache(nb, ps, hk, d, device="cuda", poison_nan=True, v_seq_major=True) for _ in range(2)]
    pt = make_page_table([L + 8] * b, ps, nb, generator=torch.Generator().manual_seed(5)).cuda()
    g = torch.Generator(device="cuda").manual_seed(4)
    kw: dict = dict(page_table=pt)
    if scales == "static":
        kw.update(k_descale=torch.rand(b, hk, device="cuda", generator=g) * 0.05 + 0.01)
        kw["v_descale"] = kw["k_descale"] * 1.5
        sc = [{}, {}]
    else:
        sc = [
            dict(
                k_cache_scales=torch.ones(nb, ps, hk, device="cuda"),
                v_cache_scales=torch.ones(nb, ps, hk, device="cuda"),
            )
            for _ in range(2)
        ]
    lens = torch.tensor([L - 3, 0, 57, L - 40], dtype=torch.int32, device="cuda")
    # the cached context (the slots past it stay NaN): the same tokens in both caches
    pos = torch.arange(L, device="cuda")
    slots = (pt.long()[:, pos // ps] * ps + pos % ps).masked_fill(pos >= lens[:, None], -1).reshape(-1)
    ctx = [torch.randn(b * L, hk, d, device="cuda", generator=g) for _ in range(2)]
    for c in range(2):
        wkw = dict(sc[c]) if sc[c] else dict(k_descale=kw["k_descale"], v_descale=kw["v_descale"])
        if not sc[c]:
            wkw["token_seq_idx"] = torch.arange(b, device="cuda", dtype=torch.int32).repeat_interleave(L)
        fp8attn.write_kv_cache(*ctx, *caches[c], slots, validate=True, **wkw)
    for i in range(4):
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(b, 1, hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        seq = lens + i
        got = fp8attn.flash_attn_with_kvcache(q, *caches[0], k=k, v=v, cache_seqlens=seq, **kw, **sc[0])
        ref = fp8attn.flash_attn_with_kvcache(q, *caches[1], k=k, v=v, cache_seqlens=seq, validate=True, **kw, **sc[1])
        assert not torch.isnan(ref).any()
        assert torch.equal(got, ref), f"call {i}"
        for a, c in zip(caches[0], caches[1]):
            assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)), f"call {i}: caches differ"
    assert sum(key[0] == "paged_append" for key in plan._PLANS) == 1
    assert all(r is not None for r in _replayed(plan)), replay.last_refusal


@pytest.mark.parametrize("granularity", ["per_tensor", "per_head", "per_block"])
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("seqlen", [300, 128])
def test_replayed_quantize_qkv_follows_each_calls_tensors(granularity, hadamard, seqlen):
    """quantize_qkv's plan (recorded, then replayed: its outputs are memory the replay allocates) returns
    what the checked path returns for each call's inputs, in the same layouts. At 128 tokens every per-head
    group is small, so the plan quantizes Q, K and V in one launch (the checked path: three)."""
    import fp8attn
    from fp8attn import plan
    from fp8attn.kernels import replay

    plan.clear()
    g = torch.Generator(device="cuda").manual_seed(6)
    outs = []
    for i in range(4):
        q, k, v = (
            torch.randn(2, seqlen, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) * (i + 1)
            for h in (8, 2, 2)
        )
        got = fp8attn.quantize_qkv(q, k, v, granularity=granularity, hadamard=hadamard)
        ref = fp8attn.quantize_qkv(q, k, v, granularity=granularity, hadamard=hadamard, validate=True)
        for a, b in zip(got, ref):
            assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            assert torch.equal(
                a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b
            ), f"call {i}"
        outs.append(got)
    assert outs[1][0].data_ptr() != outs[2][0].data_ptr()  # each call's own memory
    assert all(r is not None for r in _replayed(plan)), replay.last_refusal
    launches = [len(r.entries) for r in _replayed(plan)]
    if granularity == "per_head" and seqlen == 128:  # groups of 2 x 4 and 2 tiles (the per-tensor ones: 32)
        assert launches == [1]
    else:  # one or two launches per input
        assert len(launches) == 1 and 3 <= launches[0] <= 6
