"""The ``fp8attn`` command: info, demo, drive, bench, accuracy-demo."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import platform
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .bench.common import gpu_dirname

# routine name -> (module, function)
BENCH_ROUTINES = {
    "dense": ("fp8attn.bench.dense", "run"),
    "accuracy": ("fp8attn.bench.accuracy", "run"),
    "decode": ("fp8attn.bench.paged", "run_decode"),
    "decode-fp8q": ("fp8attn.bench.paged", "run_decode_fp8q"),
    "decode-large": ("fp8attn.bench.paged", "run_decode_large"),
    "prefill-chunked": ("fp8attn.bench.paged", "run_prefill_chunked"),
    "mixed": ("fp8attn.bench.paged", "run_mixed"),
    "leftpad": ("fp8attn.bench.paged", "run_leftpad"),
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


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _int_list(text: str) -> tuple:
    """``"0,2,48"`` -> ``(0, 2, 48)`` (non-negative integers)."""
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 0,2,48, got {text!r}") from None
    if not vals or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated non-negative integers, got {text!r}")
    return vals


def _name_list(text: str) -> tuple:
    """``"a,b"`` -> ``("a", "b")`` (at least one name)."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _shape_list(text: str) -> tuple:
    """``"64x4096,1x131072"`` -> ``((64, 4096), (1, 131072))``: each shape positive integers joined by ``x``."""
    try:
        shapes = tuple(tuple(int(v) for v in s.split("x")) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected shapes such as 64x4096,1x131072, got {text!r}") from None
    if not shapes or any(min(s) <= 0 for s in shapes) or len({len(s) for s in shapes}) != 1:
        raise argparse.ArgumentTypeError(f"expected shapes of positive integers, all of one rank, got {text!r}")
    return shapes


def _config_list(text: str) -> tuple:
    """A JSON list of launch-config objects (the ``config=`` override of the paged launcher)."""
    try:
        val = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"expected a JSON list of objects such as '[{{\"num_warps\": 8}}]', got {text!r} ({e.msg})"
        ) from None
    if isinstance(val, dict):
        val = [val]
    if not isinstance(val, list) or not val or not all(isinstance(c, dict) for c in val):
        raise argparse.ArgumentTypeError(f"expected a JSON object or a non-empty list of objects, got {text!r}")
    return tuple(val)


def _file_stem(text: str) -> str:
    if not text or not all(c.isalnum() or c in "-_." for c in text) or text.startswith("."):
        raise argparse.ArgumentTypeError(f"expected a file name of letters, digits, '-', '_' or '.', got {text!r}")
    return text


# option (as typed, --flag) -> (type, help); a routine takes an option when its function has a parameter of
# that name (dashes as underscores), so each option means one thing for every routine that takes it
BENCH_OPTIONS = {
    "shapes": (
        _shape_list,
        "cases to run instead of the grid: decode BxL (batch x context), prefill-chunked BxLxQ "
        "(batch x keys x queries, the queries the last keys), dense BxS",
    ),
    "splits": (_int_list, "split-KV counts timed beside the heuristic's (0 = the heuristic, choose_num_splits)"),
    "configs": (
        _config_list,
        "JSON list of launch overrides timed beside the default "
        '(launch_paged_fwd\'s config=, e.g. \'[{"tma": false, "num_warps": 8}]\')',
    ),
    "page-sizes": (_int_list, "page sizes to run (paged routines)"),
    "runs": (_name_list, "convergence: comma-separated runs to train, in that order, instead of all"),
    "headdims": (_int_list, "dense, backward: head dims instead of 64,128,256; prefill-chunked: instead of 128"),
    "cases": (str, "engine: comma-separated engine cases (python -m fp8attn.engine.bench --help names them)"),
    "read-ceiling": (bool, "decode: add peer read_ceiling, a kernel that only reads the same KV bytes"),
    "varlen": (bool, "dense: varlen batches on both kernels (FP8ATTN_DENSE_BACKEND=tma / triton) instead of the grid"),
    "dense-rules": (
        str,
        "dense, mla --attention: FP8ATTN_DENSE_RULES values to A/B, separated by ';' (an empty "
        "entry = the committed rules), e.g. ';kperm=0;consumers=3'",
    ),
    "attention": (
        bool,
        "mla: the attention alone at qk 192 / v 128 (B1 x --seqlen, heads 128 and 16) on both "
        "kernels against torch SDPA cuDNN bf16, instead of the prefill pipeline",
    ),
    "seqlen": (_positive_int, "mla --attention: tokens of the one sequence (default 8192)"),
}

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
    rows = [
        ("fp8attn", __version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("triton", triton_version() or "not installed"),
        ("device", torch.cuda.get_device_name() if dev == "cuda" else "cpu"),
    ]
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


def _accuracy_demo_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--seqlen", type=_positive_int, default=512, help="sequence length of q and k/v")
    p.add_argument("--heads", type=_positive_int, default=4, help="attention heads")
    p.add_argument("--headdim", type=_positive_int, default=64, help="head dimension (a multiple of 8, at most 256)")
    return p


def accuracy_demo(argv=None) -> int:
    """Self-contained FP8-vs-BF16 attention accuracy table on the current device (CPU by default)."""
    p = _accuracy_demo_options(
        argparse.ArgumentParser(
            prog="fp8attn accuracy-demo",
            description=COMMANDS["accuracy-demo"],
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
    )
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
            err = lambda o, ref=ref: float((o.double() - ref).norm() / ref.norm())  # noqa: E731
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
    return (
        f"Routines that need a CUDA GPU: {gpu}. Routines that also run on a CPU (the reference path): "
        f"{', '.join(CPU_ROUTINES)}."
    )


def _routine_params(routine: str) -> set:
    module, fn = BENCH_ROUTINES[routine]
    return set(inspect.signature(getattr(importlib.import_module(module), fn)).parameters)


def _bench_options(a) -> dict:
    """The routine options given on the command line as keyword arguments of ``a.routine``'s function.

    Raises ValueError for an option that routine does not take (naming the routines that do), and for an
    option given without ``--name`` (a sweep must not overwrite the routine's committed results file)."""
    given = {flag: getattr(a, flag.replace("-", "_")) for flag in BENCH_OPTIONS if hasattr(a, flag.replace("-", "_"))}
    try:
        params = _routine_params(a.routine)
    except ImportError:  # an optional dependency missing: _bench reports it
        return {}
    for flag in given:
        if flag.replace("-", "_") not in params:
            takers = [r for r in sorted(BENCH_ROUTINES) if _takes(r, flag)]
            raise ValueError(
                f"{a.routine} takes no --{flag} (routines that do: {', '.join(takers) or 'none'}). "
                f"Drop the option or run one of those routines."
            )
    if given and a.name is None:
        raise ValueError(
            f"--{next(iter(given))} changes what {a.routine} measures: give --name NAME so that the "
            f"results go to NAME.json and not over the routine's own file."
        )
    return {flag.replace("-", "_"): v for flag, v in given.items()}


def _takes(routine: str, flag: str) -> bool:
    try:
        return flag.replace("-", "_") in _routine_params(routine)
    except ImportError:
        return False


def _bench(a, argv) -> int:
    """Run the routine with its options and stamp the command that made its results. With ``--name`` the
    routine writes into a scratch folder and its files (results, plot) move to ``NAME.json`` / ``NAME.png``
    beside the routine's own, which stay untouched."""
    fn = _load(*BENCH_ROUTINES[a.routine])
    if fn is None:
        return 2
    opts = _bench_options(a)
    with tempfile.TemporaryDirectory() as scratch:
        path = fn(out_dir=scratch if a.name else a.out_dir, quick=a.quick, **opts)
        if not path:
            return 0
        path = Path(path)
        doc = json.loads(path.read_text())
        # the command that reproduces the file (the results folder is where it went, not what it holds)
        doc["command"] = shlex.join(["fp8attn"] + _without_out_dir(argv))
        path.write_text(json.dumps(doc, indent=1) + "\n")
        if a.name:
            dest = Path(a.out_dir) if a.out_dir else Path("benchmarks") / "results" / gpu_dirname()
            dest.mkdir(parents=True, exist_ok=True)
            for f in sorted(Path(scratch).iterdir()):
                shutil.move(str(f), str(dest / f"{a.name}{f.suffix}" if f.stem == path.stem else dest / f.name))
            path = dest / f"{a.name}.json"
    print(f"wrote {path}")
    return 0


def _without_out_dir(argv) -> list:
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
        elif tok == "--out-dir":
            skip = True
        elif not tok.startswith("--out-dir="):
            out.append(tok)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``fp8attn`` parser: one subcommand per entry of ``COMMANDS``."""
    p = argparse.ArgumentParser(prog="fp8attn", description="FP8 attention for Hopper GPUs, with a CPU reference path.")
    sub = p.add_subparsers(dest="command", metavar="<command>", title="commands")
    sub.add_parser("info", help=COMMANDS["info"], description=COMMANDS["info"])
    for name in _PASSTHROUGH:  # (their options: ``fp8attn <name> --help``, parsed by fp8attn.serving.demo)
        sub.add_parser(name, help=COMMANDS[name], description=COMMANDS[name], add_help=False)
    bp = sub.add_parser(
        "bench",
        help=COMMANDS["bench"],
        description=COMMANDS["bench"],
        epilog=_bench_epilog(),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bp.add_argument(
        "routine",
        choices=sorted(BENCH_ROUTINES),
        metavar="routine",
        help=f"one of: {', '.join(sorted(BENCH_ROUTINES))}",
    )
    bp.add_argument("--out-dir", default=None, help="results folder (None: benchmarks/results/<gpu>)")
    bp.add_argument("--quick", action="store_true", help="a few cases only (smoke run)")
    bp.add_argument(
        "--name",
        default=None,
        type=_file_stem,
        help="results file name without .json (None: the routine's own); required with the options below",
    )
    opts = bp.add_argument_group("routine options (each routine takes the ones it names; docs/benchmarks.md)")
    for flag, (kind, text) in BENCH_OPTIONS.items():
        if kind is bool:  # (SUPPRESS: no attribute unless given, and no "(default: None)" in --help)
            opts.add_argument(f"--{flag}", action="store_true", default=argparse.SUPPRESS, help=text)
        else:
            opts.add_argument(f"--{flag}", type=kind, default=argparse.SUPPRESS, help=text)
    _accuracy_demo_options(
        sub.add_parser(
            "accuracy-demo",
            help=COMMANDS["accuracy-demo"],
            description=COMMANDS["accuracy-demo"],
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
    )
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
        try:
            _bench_options(a)
        except ValueError as e:  # an option the routine does not take: say which routines do
            print(f"fp8attn bench: error: {e}", file=sys.stderr)
            return 2
        if not torch.cuda.is_available() and a.routine not in CPU_ROUTINES:
            print(
                f"fp8attn bench: {a.routine} times GPU kernels and needs a CUDA device ({_bench_epilog()})",
                file=sys.stderr,
            )
            return 2
        return _bench(a, argv)
    p.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
