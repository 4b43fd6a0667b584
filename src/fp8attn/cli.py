"""The ``fp8attn`` command: info, demo, drive, bench, accuracy-demo."""
from __future__ import annotations

import argparse
import importlib
import platform
import sys

import torch

# routine name -> (module, function)
BENCH_ROUTINES = {
    "dense": ("fp8attn.bench.dense", "run"),
    "accuracy": ("fp8attn.bench.accuracy", "run"),
    "decode": ("fp8attn.bench.paged", "run_decode"),
    "decode-fp8q": ("fp8attn.bench.paged", "run_decode_fp8q"),
    "decode-large": ("fp8attn.bench.paged", "run_decode_large"),
    "prefill-chunked": ("fp8attn.bench.paged", "run_prefill_chunked"),
    "mixed": ("fp8attn.bench.paged", "run_mixed"),
    "output-quant": ("fp8attn.bench.output_quant", "run"),
    "mla": ("fp8attn.bench.mla", "run"),
    "engine": ("fp8attn.engine.bench", "run"),
    "host": ("fp8attn.bench.host", "run"),
    "cp": ("fp8attn.bench.cp", "run"),
    "cp-simulate": ("fp8attn.bench.cp", "run_simulate"),
    "transformers": ("fp8attn.bench.transformers_integration", "run_speed"),
    "transformers-accuracy": ("fp8attn.bench.transformers_integration", "run_accuracy"),
}


def info() -> int:
    from . import __version__
    from .capability import execution_path, has_triton, triton_version

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [("fp8attn", __version__), ("python", platform.python_version()), ("torch", torch.__version__),
            ("triton", triton_version() or "not installed"), ("device", torch.cuda.get_device_name() if dev == "cuda" else "cpu")]
    if dev == "cuda":
        cc = torch.cuda.get_device_capability()
        rows.append(("compute capability", f"sm{cc[0]}{cc[1]}"))
    path = execution_path(dev)
    for fn in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine",
               "write_kv_cache"):
        rows.append((fn, f"{path} ({dev})" if has_triton() or path == "reference" else "reference"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0


def accuracy_demo(argv=None) -> int:
    """Self-contained FP8-vs-BF16 attention accuracy table on the current device (CPU by default)."""
    from . import flash_attn_func
    from .quant import quantize
    from .reference import attention_ref

    p = argparse.ArgumentParser(prog="fp8attn accuracy-demo")
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--headdim", type=int, default=64)
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    print(f"{'distribution':<22}{'causal':<8}{'bf16 rel.err':>14}{'fp8 per-tensor':>16}{'fp8 per-head':>14}")
    for dist in ("normal", "outliers (FA3)"):
        shape = (2, a.seqlen, a.heads, a.headdim)
        q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
        if dist != "normal":
            for t in (q, k, v):
                t += torch.randn(shape, generator=g) * 10 * (torch.rand(shape, generator=g) < 1e-3)
        q, k, v = q.to(dev), k.to(dev), v.to(dev)
        for causal in (False, True):
            ref = attention_ref(q.double(), k.double(), v.double(), causal=causal, compute_dtype=torch.float64)
            err = lambda o: float((o.double() - ref).norm() / ref.norm())  # noqa: E731
            bf = flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal)
            res = [err(bf)]
            for gran in ("per_tensor", "per_head"):
                (q8, qd), (k8, kd), (v8, vd) = (quantize(t, gran) for t in (q, k, v))
                if gran == "per_tensor":
                    qd, kd, vd = (d.reshape(1, 1) for d in (qd, kd, vd))
                res.append(err(flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)))
            print(f"{dist:<22}{str(causal):<8}{res[0]:>14.3e}{res[1]:>16.3e}{res[2]:>14.3e}")
    return 0


def _load(module: str, fn: str):
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        print(f"fp8attn: {module} is unavailable here ({e}).", file=sys.stderr)
        return None
    return getattr(mod, fn)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="fp8attn", description="FP8 attention: info, demo, drive, bench")
    p.add_argument("command", choices=["info", "demo", "drive", "bench", "accuracy-demo"])
    if not argv:
        p.print_help()
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("-h", "--help"):
        p.print_help()
        return 0
    if cmd == "info":
        return info()
    if cmd == "accuracy-demo":
        return accuracy_demo(rest)
    if cmd in ("demo", "drive"):
        fn = _load("fp8attn.demo", f"{cmd}_main")
        return 2 if fn is None else int(fn(rest) or 0)
    if cmd == "bench":
        bp = argparse.ArgumentParser(prog="fp8attn bench")
        bp.add_argument("routine", choices=sorted(BENCH_ROUTINES))
        bp.add_argument("--out-dir", default=None, help="results folder (default benchmarks/results/<gpu>)")
        bp.add_argument("--quick", action="store_true", help="a few cases only (smoke run)")
        ba = bp.parse_args(rest)
        if not torch.cuda.is_available() and ba.routine not in ("accuracy", "transformers-accuracy"):
            print("fp8attn bench: this routine times GPU kernels and needs a CUDA device.", file=sys.stderr)
            return 2
        fn = _load(*BENCH_ROUTINES[ba.routine])
        if fn is None:
            return 2
        path = fn(out_dir=ba.out_dir, quick=ba.quick)
        if path:
            print(f"wrote {path}")
        return 0
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
