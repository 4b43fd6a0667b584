"""Shared benchmark plumbing: timing, peer discovery, and the one results format (docs/benchmarks.md,
"Results format")."""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
from pathlib import Path

import torch

__all__ = [
    "time_ms",
    "graph_replay",
    "graph_step_ms",
    "rotating",
    "results_header",
    "write_results",
    "gpu_dirname",
    "attn_flops",
    "kernel_times_us",
]


def with_env(name, value, fn):
    """``fn()`` with the environment variable ``name`` set to ``value`` (restored after)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


def time_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of ``fn()`` in milliseconds (CUDA events through triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def kernel_times_us(fn, reps: int = 20) -> dict:
    """{kernel name (60 chars): mean GPU microseconds per call} of ``fn()`` under the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {
        e.key[:60]: round(e.self_device_time_total / reps, 2)
        for e in prof.key_averages()
        if getattr(e, "self_device_time_total", 0) > 0
    }


def graph_replay(fns):
    """Capture each fn in a CUDA graph (after a warm-up call) and return a rotating replay callable.

    Returns ``(call, graphed)``. Kernels of tens of microseconds timed eagerly measure the host launch
    path; a replay does not. Falls back to eager calls (``graphed`` False) when capture fails."""
    try:
        for f in fns:
            f()
        torch.cuda.synchronize()
        graphs = []
        for f in fns:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                f()
            graphs.append(g)
        torch.cuda.synchronize()
        return rotating([g.replay for g in graphs]), True
    except Exception:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return rotating(fns), False


def graph_step_ms(fns, calls: int = 8):
    """Milliseconds per call of ``calls`` back-to-back calls (cycling ``fns``) captured in ONE CUDA graph.

    The form an engine runs a decode step in (every layer's attention in one captured graph): the
    graph's launch and the first kernel's start are paid once per step, not once per call as in
    ``graph_replay``'s one-call graphs (an empty one-kernel graph replays in ~4.5 us on an H200).
    None when capture fails."""
    try:
        for f in fns:
            f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fns[i % len(fns)]()
        torch.cuda.synchronize()
        return time_ms(g.replay) / calls
    except Exception:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return None


def rotating(fns):
    """A callable that calls ``fns`` in turn (rotating inputs defeat the L2 between timed calls)."""
    i = [0]

    def call():
        fns[i[0] % len(fns)]()
        i[0] += 1

    return call


def attn_flops(batch, nheads, seqlen_q, seqlen_k, headdim, headdim_v=None, causal=False, visible_pairs=None):
    """4*B*H*Sq*Sk*D (2 for QK^T, 2 for PV); halved for causal, or the exact visible count."""
    headdim_v = headdim if headdim_v is None else headdim_v
    pairs = visible_pairs if visible_pairs is not None else seqlen_q * seqlen_k * (0.5 if causal else 1.0)
    return 2.0 * batch * nheads * pairs * (headdim + headdim_v)


def gpu_dirname() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    n = torch.cuda.device_count() if torch.cuda.is_available() else 1
    base = "h200" if "H200" in name else "h100" if "H100" in name else name.lower().replace(" ", "_")
    return base if n <= 1 else f"{base}x{n}"


def _git_sha() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], stderr=subprocess.DEVNULL, text=True).strip()
    except Exception:
        return os.environ.get("FP8ATTN_COMMIT", "unknown")


def results_header(routine: str) -> dict:
    import triton

    return {
        "routine": routine,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__.split("+")[0],
        "triton": triton.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": _git_sha(),
        "cases": [],
    }


def write_results(doc: dict, out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``doc`` to ``<out_dir>/<routine>.json`` (default benchmarks/results/<gpu>/)."""
    out_dir = Path(out_dir) if out_dir else Path("benchmarks") / "results" / gpu_dirname()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{doc['routine']}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
