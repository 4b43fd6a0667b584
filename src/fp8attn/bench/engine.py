"""``fp8attn bench engine``: decode throughput of the paged engine on a random-weight Llama-3-8B shape (32
layers, 32/8 heads, d128), bf16 against FP8 KV caches, batch 64 at 4k context, CUDA-graph decode steps, after
the engine's GPU correctness checks (``fp8attn.engine.bench``; results ``engine.json``).

Cases (option ``cases``, comma-separated; the engine bench's ``--cases`` help names them): by default the
page-16 comparison (bf16, fp8, fp8_seq_head, fp8_2x) and page 64 in both V layouts (fp8_p64,
fp8_p64_vseq); ``--cases bf16_p64,fp8_p64_vseq,fp8_2x_p64_vseq`` compares the engine's defaults.
"""
from __future__ import annotations

from pathlib import Path

from ..engine.bench import main as engine_main
from .common import gpu_dirname

__all__ = ["run", "DEFAULT_CASES"]

DEFAULT_CASES = "bf16,fp8,fp8_seq_head,fp8_2x,fp8_p64,fp8_p64_vseq"


def run(out_dir=None, quick=False, cases=None):
    """Run the engine bench; returns the results path (``<out_dir>/engine.json``)."""
    argv = ["--steps", "5" if quick else "20", "--batch", "64", "--context", "4096", "--cases", cases or DEFAULT_CASES]
    if not quick:
        argv.append("--check")
    out = Path(out_dir) if out_dir else Path("benchmarks") / "results" / gpu_dirname()
    rc = engine_main(argv + ["--out", str(out)])
    if rc:
        raise SystemExit(rc)
    return out / "engine.json"
