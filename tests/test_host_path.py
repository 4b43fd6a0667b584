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
