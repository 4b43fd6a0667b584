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
    ref, ref_lse = fp8attn.flash_attn_func(q8, k8, v8, return_attn_probs=True, validate=True, **kw)
    first = fp8attn.flash_attn_func(q8, k8, v8, **kw)
    assert len(plan._PLANS) == 1, "the Hopper-served call left no plan"
    again = fp8attn.flash_attn_func(q8, k8, v8, **kw)
    o, lse = fp8attn.flash_attn_func(q8, k8, v8, return_attn_probs=True, **kw)
    out = torch.empty_like(ref)
    o2 = fp8attn.flash_attn_func(q8, k8, v8, out=out, **kw)
    assert o2 is out
    for x in (first, again, o, o2):
        assert torch.equal(x, ref)
    assert torch.equal(lse, ref_lse)
    assert len(plan._PLANS) == 3  # (no LSE, LSE, out=): one plan each


def test_eager_plan_not_taken_for_grad_or_other_signatures(monkeypatch):
    import fp8attn
    from fp8attn import plan

    plan.clear()
    q8, k8, v8, qd, kd, vd = _fp8_inputs()
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    fp8attn.flash_attn_func(q8, k8, v8, causal=True, **kw)
    assert len(plan._PLANS) == 1
    # a flag of another type is checked, not matched against causal=True's plan
    with pytest.raises(TypeError, match="causal"):
        fp8attn.flash_attn_func(q8, k8, v8, causal=1, **kw)
    # the environment switch of the dispatch is part of the signature
    monkeypatch.setenv("FP8ATTN_DENSE_BACKEND", "triton")
    fp8attn.flash_attn_func(q8, k8, v8, causal=True, **kw)
    assert len(plan._PLANS) == 1  # the Triton kernel's call leaves no plan
    # a bad descale value on a GPU: unchecked on both paths (validate=True checks it)
    monkeypatch.delenv("FP8ATTN_DENSE_BACKEND")
    with pytest.raises(ValueError, match="q_descale"):
        fp8attn.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd * float("nan"), k_descale=kd, v_descale=vd,
                                validate=True)
