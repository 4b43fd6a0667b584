"""Engine decode throughput: bf16 vs FP8 paged KV cache on a RANDOM-weight model of real shape.

``fp8attn bench engine`` (or ``python -m fp8attn.bench.engine --batch 64 --context 4096``) fills each
sequence's cache with random K/V of ``context`` tokens (no prefill: weights are random, so only speed is
meaningful), then times engine decode steps (scheduling + CUDA-graph forward + sampling), and the graph
replay alone. Results use the common results format (docs/benchmarks.md): routine "engine", params
batch/context, ours.tokens_per_s, peer bf16_cache.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from ..serving.engine.engine import EngineConfig, LLMEngine
from ..serving.engine.scheduler import SamplingParams, SeqStatus, Sequence
from .common import gpu_dirname, results_header, write_results

__all__ = ["fill_decode_state", "time_decode", "check_gpu_paths", "main", "run", "DEFAULT_CASES"]


def fill_decode_state(eng: LLMEngine, batch: int, context: int, max_new: int, seed: int = 0) -> list[Sequence]:
    """Put ``batch`` sequences of ``context`` cached tokens (random K/V) into the engine, ready to decode."""
    cache, sch = eng.cache, eng.scheduler
    g = torch.Generator(device=eng.device).manual_seed(seed)
    for t in cache.k + cache.v:  # random K/V, |x| ~ 1..3 like real activations
        if cache.is_fp8:
            t.copy_((torch.randn(t.shape, generator=g, device=t.device) * 2.0).clamp(-448, 448).to(t.dtype))
        else:
            t.copy_(torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype))
    if cache.is_fp8 and cache.scale_mode == "per_tensor":
        cache.set_static_descales(0.5, 0.5)
    seqs = []
    V = eng.model.cfg.vocab_size
    for i in range(batch):
        s = Sequence(
            10_000 + i,
            torch.randint(3, V, (context,), generator=g, device=eng.device).tolist(),
            SamplingParams(max_new_tokens=max_new),
            index=i,
        )
        s.output_logprobs = []
        s.tokens.append(5)  # first generated token; its K/V is written by the first decode step
        s.block_table = eng.allocator.allocate(-(-(context + max_new) // eng.config.page_size))
        s.num_computed = context
        if cache.is_fp8 and cache.scale_mode == "per_seq_head":
            L, H = cache.num_layers, cache.nheads_k
            s.k_descale = torch.full((L, H), 0.5, device=eng.device)
            s.v_descale = torch.full((L, H), 0.5, device=eng.device)
        s.status = SeqStatus.RUNNING
        sch.running.append(s)
        seqs.append(s)
    return seqs


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, warmup: int, steps: int, dev) -> float:
    """Seconds per call of ``fn`` over ``steps`` calls after ``warmup`` calls (device synchronized)."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(dev)
    return (time.perf_counter() - t0) / steps


def time_decode(
    model,
    kv: str,
    scale: str,
    batch: int,
    context: int,
    steps: int,
    warmup: int = 3,
    cuda_graphs: bool = True,
    page_size: int = 16,
    v_seq_major: bool = False,
) -> dict:
    """Median-free simple timing: wall time of ``steps`` engine decode steps after ``warmup`` steps."""
    cfg = EngineConfig(
        kv_cache_dtype=kv,
        kv_scale=scale,
        max_batch_size=batch,
        max_batched_tokens=max(batch, 256),
        max_context_len=context + warmup + steps + 2,
        page_size=page_size,
        cuda_graphs=cuda_graphs,
        num_blocks=batch * (-(-(context + warmup + steps + 2) // page_size)),
        v_seq_major=v_seq_major,
    )
    eng = LLMEngine(model, cfg)
    fill_decode_state(eng, batch, context, warmup + steps + 1)
    dev = eng.device
    dt = _timed(eng.step, warmup, steps, dev) * steps
    res = {
        "kv": kv,
        "kv_scale": scale if kv.startswith("fp8") else None,
        "batch": batch,
        "context": context,
        "page_size": page_size,
        "v_seq_major": v_seq_major,
        "steps": steps,
        "step_ms": dt / steps * 1e3,
        "tokens_per_s": batch * steps / dt,
        "kv_cache_bytes": eng.cache.total_bytes,
        "kv_bytes_per_token": eng.cache.bytes_per_token,
        "graphs": eng.graphs is not None and not eng.graphs.disabled,
    }
    # forward only (graph replay or eager forward), no scheduling / sampling
    if eng.graphs is not None and not eng.graphs.disabled and batch in eng.graphs.graphs:
        res["forward_ms"] = _timed(eng.graphs.graphs[batch][0].replay, 2, steps, dev) * 1e3
    eng = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def check_gpu_paths(dev: str = "cuda") -> list[str]:
    """Correctness checks of the engine on the GPU (tiny random model, fp32 weights): CUDA-graph decode
    equals eager decode, and the Triton paged path matches the reference path. Returns report lines."""
    from ..serving.models import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    )
    model = LlamaModel.random(cfg, dtype=torch.bfloat16, device=dev, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(5, 300, (11,), generator=g)
    ]
    lines = []
    for kv, scale in (
        ("bf16", "per_tensor"),
        ("fp8", "per_tensor"),
        ("fp8", "per_seq_head"),
        ("fp8", "per_token_head"),
    ):
        res = {}
        for name, graphs, force_ref in (("graph", True, False), ("eager", False, False), ("reference", False, True)):
            os.environ["FP8ATTN_FORCE_REFERENCE"] = "1" if force_ref else "0"
            try:
                eng = LLMEngine(
                    model,
                    EngineConfig(
                        kv_cache_dtype=kv,
                        kv_scale=scale,
                        max_batch_size=8,
                        page_size=16,
                        prefill_chunk_size=64,
                        max_context_len=512,
                        cuda_graphs=graphs,
                        poison_cache=True,
                    ),
                )
                outs, _ = eng.generate(prompts, SamplingParams(max_new_tokens=16))
                res[name] = outs
            except Exception as e:
                lines.append(f"check {kv}/{scale} {name}: ERROR {type(e).__name__}: {str(e)[:300]}")
            finally:
                os.environ.pop("FP8ATTN_FORCE_REFERENCE", None)
        if len(res) == 3:
            same_ge = all(a.output_ids == b.output_ids for a, b in zip(res["graph"], res["eager"]))
            dlp = max(
                abs(x - y)
                for a, b in zip(res["graph"], res["eager"])
                for x, y in zip(a.output_logprobs, b.output_logprobs)
            )
            ok_ref = sum(a.output_ids == b.output_ids for a, b in zip(res["eager"], res["reference"]))
            dref = max(
                abs(x - y)
                for a, b in zip(res["eager"], res["reference"])
                for x, y in zip(a.output_logprobs[:1], b.output_logprobs[:1])
            )
            lines.append(
                f"check {kv}/{scale}: graph==eager tokens {same_ge} (max dlogprob {dlp:.2e}); "
                f"triton vs reference: {ok_ref}/{len(prompts)} identical sequences, first-token max dlogprob {dref:.2e}"
            )
    return lines


def main(argv=None) -> int:
    from ..serving.models import LLAMA3_8B, LlamaConfig, LlamaModel

    p = argparse.ArgumentParser(prog="python -m fp8attn.bench.engine")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--preset", default="llama3-8b", choices=["llama3-8b", "tiny"])
    p.add_argument(
        "--cases",
        default="bf16,fp8,fp8_seq_head,fp8_2x",
        help="fp8_2x: FP8 with 2x batch (same KV bytes); fp8_p64: page 64; fp8_p64_vseq: page 64 with "
        "V sequence-major inside each page (the engine's FP8 default); bf16_p64: bf16 cache at page 64 "
        "(the engine's 16-bit default); fp8_2x_p64_vseq: the FP8 default at 2x batch",
    )
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/<gpu>)")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--check", action="store_true", help="run the GPU correctness checks first")
    a = p.parse_args(argv)
    checks = []
    if a.check:
        checks = check_gpu_paths("cuda" if torch.cuda.is_available() else "cpu")
        for ln in checks:
            print(ln, flush=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = (
        LLAMA3_8B
        if a.preset == "llama3-8b"
        else LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    )
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = LlamaModel.random(cfg, dtype=dtype, device=dev, seed=0)
    runs = {}
    for c in [x for x in a.cases.split(",") if x]:
        kv, scale, b, page, vseq = {
            "bf16": ("bf16", "per_tensor", a.batch, 16, False),
            "fp8": ("fp8", "per_tensor", a.batch, 16, False),
            "fp8_seq_head": ("fp8", "per_seq_head", a.batch, 16, False),
            "fp8_2x": ("fp8", "per_tensor", 2 * a.batch, 16, False),
            "fp8_p64": ("fp8", "per_tensor", a.batch, 64, False),
            "fp8_p64_vseq": ("fp8", "per_tensor", a.batch, 64, True),
            "bf16_p64": ("bf16", "per_tensor", a.batch, 64, False),
            "fp8_2x_p64_vseq": ("fp8", "per_tensor", 2 * a.batch, 64, True),
        }[c]
        try:
            runs[c] = time_decode(
                model, kv, scale, b, a.context, a.steps, cuda_graphs=not a.no_graphs, page_size=page, v_seq_major=vseq
            )
        except Exception as e:  # keep the other cases
            runs[c] = {"error": f"{type(e).__name__}: {e}"}
        print(c, json.dumps(runs[c]), flush=True)
    doc = results_header("engine")
    doc["model"] = (
        f"RANDOM weights, {a.preset} shape ({cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} heads, d{cfg.head_dim}), {str(dtype).replace('torch.', '')}"
    )
    ref = runs.get("bf16", {})
    for c, r in runs.items():
        if c == "bf16" or "error" in r:
            continue
        doc["cases"].append(
            {
                "case": f"decode {c} B{r['batch']} ctx{r['context']}",
                "params": {
                    "batch": r["batch"],
                    "context": r["context"],
                    "kv_cache": r["kv"],
                    "kv_scale": r["kv_scale"],
                    "page_size": r["page_size"],
                    "v_seq_major": r["v_seq_major"],
                    "steps": r["steps"],
                    "cuda_graphs": r["graphs"],
                    "kv_cache_bytes": r["kv_cache_bytes"],
                },
                "ours": {
                    "ms": r["step_ms"],
                    "tokens_per_s": r["tokens_per_s"],
                    "forward_ms": r.get("forward_ms"),
                    "tflops": None,
                    "gbps": None,
                    "err": None,
                },
                "peers": {
                    "bf16_cache": {
                        "ms": ref.get("step_ms"),
                        "tokens_per_s": ref.get("tokens_per_s"),
                        "forward_ms": ref.get("forward_ms"),
                        "batch": ref.get("batch"),
                        "kv_cache_bytes": ref.get("kv_cache_bytes"),
                    }
                }
                if ref and "error" not in ref
                else {},
            }
        )
    doc["runs"] = runs
    doc["checks"] = checks
    path = write_results(doc, a.out)
    print(f"\n{'case':<14}{'batch':>6}{'step ms':>10}{'fwd ms':>9}{'tok/s':>10}{'KV GiB':>8}  vs bf16")
    for c, r in runs.items():
        if "error" in r:
            print(f"{c:<14} ERROR {r['error'][:200]}")
            continue
        sp = r["tokens_per_s"] / ref["tokens_per_s"] if ref and "error" not in ref else float("nan")
        print(
            f"{c:<14}{r['batch']:>6}{r['step_ms']:>10.2f}{r.get('forward_ms') or float('nan'):>9.2f}"
            f"{r['tokens_per_s']:>10.0f}{r['kv_cache_bytes'] / 2**30:>8.1f}  {sp:.2f}x"
        )
    print(f"wrote {path}")
    return 0


DEFAULT_CASES = "bf16,fp8,fp8_seq_head,fp8_2x,fp8_p64,fp8_p64_vseq"


def run(out_dir=None, quick=False, cases=None):
    """`fp8attn bench engine`: B64 / 4k context decode, bf16 vs FP8 caches (quick: fewer steps, no checks).

    ``cases``: comma-separated engine cases (default ``DEFAULT_CASES``: the page-16 comparison and page 64 in
    both V layouts; ``bf16_p64,fp8_p64_vseq,fp8_2x_p64_vseq`` compares the engine's defaults). Returns the
    results path (``<out_dir>/engine.json``)."""
    argv = ["--steps", "5" if quick else "20", "--batch", "64", "--context", "4096", "--cases", cases or DEFAULT_CASES]
    if not quick:
        argv.append("--check")
    out = Path(out_dir) if out_dir else Path("benchmarks") / "results" / gpu_dirname()
    rc = main(argv + ["--out", str(out)])
    if rc:
        raise SystemExit(rc)
    return out / "engine.json"


if __name__ == "__main__":
    raise SystemExit(main())
