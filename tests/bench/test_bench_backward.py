"""`fp8attn bench backward`'s per-case GPU time fields, on the CPU (the profiler stood in for)."""

from fp8attn.bench import backward as bb


def test_gpu_time_fields(monkeypatch):
    """``kernels_us`` is the profiler's per-kernel table over KERNEL_REPS steps, ``kernels_sum_us`` its sum."""
    seen = {}

    def fake(step, reps):
        seen["reps"] = reps
        step()
        return {"attn_fwd": 120.25, "attn_bwd": 400.5, "quantize": 80.0}

    calls = []
    monkeypatch.setattr(bb, "kernel_times_us", fake)
    out = bb._gpu_time(lambda: calls.append(1))
    assert seen["reps"] == bb.KERNEL_REPS and calls == [1]
    assert out["kernels_us"] == {"attn_fwd": 120.25, "attn_bwd": 400.5, "quantize": 80.0}
    assert out["kernels_sum_us"] == 600.8
