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
    "engine": ("fp8attn.bench.engine", "run"),
    "host": ("fp8attn.bench.host", "run"),
    "cp": ("fp8attn.bench.cp", "run"),
    "cp-simulate": ("fp8attn.bench.cp", "run_simulate"),
    "backward": ("fp8attn.bench.backward", "run"),
    "convergence": ("fp8attn.bench.convergence", "run"),
    "transformers": ("fp8attn.bench.transformers_integration", "run_speed"),
    "transformers-accuracy": ("fp8attn.bench.transformers_integration", "run_accuracy"),
}
# the routines that run without a GPU (the others time GPU kernels)
CPU_ROUTINES = ("accuracy", "transformers-accuracy")

# command -> one-line description (``fp8attn --help``)
COMMANDS = {
    "info": "versions, the device, each entry point's kernel (or the reference) with the reason, the fallback mode",
    "demo": "FP8 vs BF16 KV cache on a real model and ShareGPT prompts (accuracy table and plot)",
    "drive": "run ShareGPT prompts through the paged engine; save or validate outputs, time tokens",
    "bench": "benchmark routines: write benchmarks/results/<gpu>/<routine>.json",
    "accuracy-demo": "a self-contained FP8-vs-BF16 attention accuracy table on random inputs",
}
# the commands whose options their own module parses (``fp8attn <command> --help`` shows them)
_PASSTHROUGH = ("demo", "drive")


def info() -> int:
    from . import __version__
    from .capability import ENTRIES, fallback_mode, supports, triton_version

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [("fp8attn", __version__), ("python", platform.python_version()), ("torch", torch.__version__),
            ("triton", triton_version() or "not installed"),
            ("device", torch.cuda.get_device_name() if dev == "cuda" else "cpu")]
    if dev == "cuda":
        cc = torch.cuda.get_device_capability()
        rows.append(("compute capability", f"sm{cc[0]}{cc[1]}"))
    try:
        mode = fallback_mode()
    except ValueError as e:  # a bad FP8ATTN_FALLBACK: say so instead of failing the whole report
        mode = f"invalid ({e})"
    rows.append(("fallback mode", f"{mode} (FP8ATTN_FALLBACK=warn|error|silent)"))
    for fn in ENTRIES:
        s = supports(fn, device=dev)
        rows.append((fn, f"{s.kernel or 'reference'}: {s.reason}"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _accuracy_demo_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--seqlen", type=_positive_int, default=512, help="sequence length of q and k/v")
    p.add_argument("--heads", type=_positive_int, default=4, help="attention heads")
    p.add_argument("--headdim", type=_positive_int, default=64, help="head dimension (a multiple of 8, at most 256)")
    return p


def accuracy_demo(argv=None) -> int:
    """Self-contained FP8-vs-BF16 attention accuracy table on the current device (CPU by default)."""
    p = _accuracy_demo_options(argparse.ArgumentParser(prog="fp8attn accuracy-demo",
                                                       description=COMMANDS["accuracy-demo"],
                                                       formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    return _accuracy_guarded(p.parse_args(argv))


def _accuracy_guarded(a) -> int:
    try:
        return _accuracy_table(a)
    except (ValueError, TypeError, NotImplementedError) as e:  # a refused argument: its message, no traceback
        print(f"fp8attn accuracy-demo: error: {e}", file=sys.stderr)
        return 2


def _accuracy_table(a) -> int:
    from . import flash_attn_func
    from .quant import quantize
    from .reference import attention_ref

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    header = f"{'distribution':<22}{'causal':<8}{'bf16 rel.err':>14}{'fp8 per-tensor':>16}{'fp8 per-head':>14}"
    lines = []
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
            lines.append(f"{dist:<22}{str(causal):<8}{res[0]:>14.3e}{res[1]:>16.3e}{res[2]:>14.3e}")
    print(header)  # (after every row is computed: a refused input prints no half table)
    print("\n".join(lines))
    return 0


def _load(module: str, fn: str):
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        print(f"fp8attn: {module} is unavailable here ({e}).", file=sys.stderr)
        return None
    return getattr(mod, fn)


def _bench_epilog() -> str:
    gpu = ", ".join(r for r in sorted(BENCH_ROUTINES) if r not in CPU_ROUTINES)
    return (f"Routines that need a CUDA GPU: {gpu}. Routines that also run on a CPU (the reference path): "
            f"{', '.join(CPU_ROUTINES)}.")


def build_parser() -> argparse.ArgumentParser:
    """The ``fp8attn`` parser: one subcommand per entry of ``COMMANDS``."""
    p = argparse.ArgumentParser(prog="fp8attn", description="FP8 attention for Hopper GPUs, with a CPU reference path.")
    sub = p.add_subparsers(dest="command", metavar="<command>", title="commands")
    sub.add_parser("info", help=COMMANDS["info"], description=COMMANDS["info"])
    for name in _PASSTHROUGH:  # (their options: ``fp8attn <name> --help``, parsed by fp8attn.serving.demo)
        sub.add_parser(name, help=COMMANDS[name], description=COMMANDS[name], add_help=False)
    bp = sub.add_parser("bench", help=COMMANDS["bench"], description=COMMANDS["bench"], epilog=_bench_epilog(),
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bp.add_argument("routine", choices=sorted(BENCH_ROUTINES), metavar="routine",
                    help=f"one of: {', '.join(sorted(BENCH_ROUTINES))}")
    bp.add_argument("--out-dir", default=None, help="results folder (None: benchmarks/results/<gpu>)")
    bp.add_argument("--quick", action="store_true", help="a few cases only (smoke run)")
    _accuracy_demo_options(sub.add_parser("accuracy-demo", help=COMMANDS["accuracy-demo"],
                                          description=COMMANDS["accuracy-demo"],
                                          formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    if not argv:
        p.print_help(sys.stderr)
        return 2
    try:
        if argv[0] in _PASSTHROUGH:  # every argument is the command's own
            a, rest = p.parse_args(argv[:1]), argv[1:]
        else:
            a, rest = p.parse_args(argv), []
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, message printed)
        return int(e.code or 0)
    if a.command == "info":
        return info()
    if a.command == "accuracy-demo":
        return _accuracy_guarded(a)
    if a.command in _PASSTHROUGH:
        fn = _load("fp8attn.serving.demo", f"{a.command}_main")
        return 2 if fn is None else int(fn(rest) or 0)
    if a.command == "bench":
        if not torch.cuda.is_available() and a.routine not in CPU_ROUTINES:
            print(f"fp8attn bench: {a.routine} times GPU kernels and needs a CUDA device ({_bench_epilog()})",
                  file=sys.stderr)
            return 2
        fn = _load(*BENCH_ROUTINES[a.routine])
        if fn is None:
            return 2
        path = fn(out_dir=a.out_dir, quick=a.quick)
        if path:
            print(f"wrote {path}")
        return 0
    p.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
