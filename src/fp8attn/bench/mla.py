"""``fp8attn bench mla``: MLA FP8 prefill (``fp8attn.mla.prefill``) end to end against the same pipeline with
torch SDPA (cuDNN backend, bf16) as its attention.

Cases (the results format of bench/common.py, results/<gpu>/mla_prefill.json): one sequence of 8192 new tokens, 128 heads, qk 192
(NoPE 128 + RoPE 64) / v 128, kv_lora_rank 512, with no cached prefix and with a 32k cached prefix walked in
4k chunks (paged bf16 latent cache, 64-token pages in a shuffled pool), each in both gather modes
(``bf16_gather``, ``fp8_gather``).

* ``ours.ms``: one eager ``prefill`` call end to end (new tokens' up-projection and quantization, every
  chunk's gather, up-projection and quantization, attention, LSE merge).
* ``peers.bf16.ms``: the same pipeline in 16 bits (same gather and up-projection code) with
  ``torch.ops.aten._scaled_dot_product_cudnn_attention`` (its LSE merged by ``flash_attn_combine``).
* ``tflops`` (ours and the peer): attention only -- the attention calls of one prefill over inputs built
  beforehand, counted as 2 x visible pairs x (192 + 128) x heads; ``params.attn_ms`` is that time.
* ``err``: relative L2 error of the output against a float64 reference of the whole MLA computation
  (``mla.prefill_ref``) on the first 16 heads; ``params.saturation_rate``: the share of the cached
  chunks' K / V elements that ``fp8_gather``'s estimated descales clipped.

Activations are synthetic: latents with per-channel means N(0, 1) and log-normal per-channel scales
(normalized activations have uneven, biased channels) plus rare outliers (probability 1e-3, N(0, 10^2)), the
same channel statistics for the new tokens and the cache, so that the saturation rate reflects the
estimate, not a distribution shift. With isotropic mean-zero latents instead, the output is itself at the
noise level and its relative error is about e4m3's precision times the logits' spread (5-6% measured in
the CPU tests' small shapes), not a property of the pipeline.
"""

from __future__ import annotations

import torch

from .common import attn_flops, results_header, time_ms, write_results

H, DN, DR, DV, RANK, T, PS = 128, 128, 64, 128, 512, 8192, 64
REF_HEADS = 16


def _latents(n, width, gen, dev):
    g = torch.Generator().manual_seed(width)  # the same channel statistics for the new tokens and the cache
    scale = torch.exp(torch.randn(width, generator=g) * 0.5)
    mean = torch.randn(width, generator=g)
    x = torch.randn(n, width, generator=gen) * scale + mean
    x += (torch.rand(n, width, generator=gen) < 1e-3) * torch.randn(n, width, generator=gen) * 10
    return x.to(dev, torch.bfloat16)


def _inputs(ctx, dev="cuda"):
    gen = torch.Generator().manual_seed(0)
    q_nope = (torch.randn(T, H, DN, generator=gen)).to(dev, torch.bfloat16)
    q_pe = (torch.randn(T, H, DR, generator=gen)).to(dev, torch.bfloat16)
    kv_c = _latents(T, RANK, gen, dev)
    k_pe = _latents(T, DR, gen, dev)
    w_uk = (torch.randn(RANK, H, DN, generator=gen) * RANK**-0.5).to(dev, torch.bfloat16)
    w_uv = (torch.randn(RANK, H, DV, generator=gen) * RANK**-0.5).to(dev, torch.bfloat16)
    kw = dict(
        cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32, device=dev),
        max_seqlen_q=T,
        softmax_scale=(DN + DR) ** -0.5,
        max_context_len=ctx,
    )
    if ctx:
        npages = ctx // PS
        cache = torch.full((2 * npages, PS, RANK + DR), float("nan"), dtype=torch.bfloat16, device=dev)
        pt = torch.randperm(2 * npages, generator=gen)[:npages].to(dev, torch.int32).view(1, npages)
        rows = torch.cat([_latents(ctx, RANK, gen, dev), _latents(ctx, DR, gen, dev)], dim=-1)
        cache.view(-1, RANK + DR)[(pt[0].long()[:, None] * PS + torch.arange(PS, device=dev)).reshape(-1)] = rows
        kw.update(latent_cache=cache, page_table=pt, context_lens=torch.tensor([ctx], dtype=torch.int32, device=dev))
    return (q_nope, q_pe, kv_c, k_pe, w_uk, w_uv), kw


def _sdpa_attend(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, seqused_k, descales, out, out_dtype):
    """One sequence through cuDNN SDPA (bf16): out (T, H, dv) written, LSE (H, T) returned."""
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        None,
        True,
        0.0,
        bool(causal),
        False,
        scale=scale,
    )[:2]
    out.copy_(o[0].transpose(0, 1))
    return out, lse.reshape(q.shape[1], q.shape[0]).float()


def _run16(args, kw, attend, chunk, out):
    from .. import mla

    plan = mla._Plan(False, False, None, None)
    return mla._run(
        *args,
        kw["cu_seqlens_q"],
        kw["max_seqlen_q"],
        kw.get("latent_cache"),
        kw.get("page_table"),
        kw.get("context_lens"),
        kw["max_context_len"],
        None,
        kw["softmax_scale"],
        chunk,
        out,
        plan,
        None,
        True,
        attend16=attend,
    )


def _attention_only(args, kw, chunk, fp8):
    """A callable running just the attention calls of one prefill, over inputs built here."""
    from .. import mla

    q_nope, q_pe, kv_c, k_pe, w_uk, w_uv = args
    n = kw["max_context_len"] // chunk
    kn, v = mla._up_project(kv_c, w_uk, w_uv)
    cu = kw["cu_seqlens_q"]
    chunks = []
    for c in range(n):
        rows, cu_k = mla._gather(
            kw["latent_cache"], None, kw["page_table"], kw["context_lens"], c * chunk, chunk, torch.bfloat16
        )
        chunks.append((*mla._up_project(rows[:, :RANK], w_uk, w_uv), rows[:, RANK:], cu_k))
    # the partial-output dtypes of mla._run: bf16 for FP8 attention, float32 for the 16-bit pipeline
    o = torch.empty(n + 1, T, H, DV, device=cu.device, dtype=torch.bfloat16 if fp8 else torch.float32)
    if fp8:
        q, k, vv, ds, _ = mla._quant(q_nope, q_pe, kn, k_pe, v, use_triton=True)
        d = [x.view(1, 1) for x in ds]
        built = [(*mla._quant(None, None, a, p, b, use_triton=True)[1:4], cu_k) for a, b, p, cu_k in chunks]
        attend = mla._attend
        calls = [
            (q, ck, cv, cu, cu_k, T, chunk, False, None, (d[0], cds[1:2].view(1, 1), cds[2:3].view(1, 1)))
            for ck, cv, cds, cu_k in built
        ]
        calls.append((q, k, vv, cu, cu, T, T, True, None, tuple(d)))
    else:
        q, k = mla._concat16(q_nope, q_pe), mla._concat16(kn, k_pe[:, None])
        attend = _sdpa_attend
        calls = [
            (q, mla._concat16(a, p[:, None]), b, cu, cu_k, T, chunk, False, None, None) for a, b, p, cu_k in chunks
        ]
        calls.append((q, k, v, cu, cu, T, T, True, None, None))

    def run():
        for i, (qq, kk, vv_, cq, ck_, mq, mk, causal, used, desc) in enumerate(calls):
            attend(qq, kk, vv_, cq, ck_, mq, mk, kw["softmax_scale"], causal, used, desc, o[i], o.dtype)

    return run


def _err(out, args, kw):
    from .. import mla

    hs = slice(0, REF_HEADS)
    a = (args[0][:, hs], args[1][:, hs], args[2], args[3], args[4][:, hs], args[5][:, hs])
    ref = mla.prefill_ref(
        *a,
        cu_seqlens_q=kw["cu_seqlens_q"],
        softmax_scale=kw["softmax_scale"],
        latent_cache=kw.get("latent_cache"),
        page_table=kw.get("page_table"),
        context_lens=kw.get("context_lens"),
    )
    o = out[:, hs].double()
    return float((o - ref).norm() / ref.norm())


def _case(ctx, chunk, mode):
    from .. import mla

    args, kw = _inputs(ctx)
    out = torch.empty(T, H, DV, dtype=torch.bfloat16, device="cuda")
    stats = mla.SaturationStats("cuda")
    mla.prefill(*args, **kw, chunk_size=chunk, mode=mode, out=out, stats=stats)
    torch.cuda.synchronize()
    err = _err(out, args, kw)
    rate = stats.rate() if mode == "fp8_gather" and ctx else None
    ms = time_ms(lambda: mla.prefill(*args, **kw, chunk_size=chunk, mode=mode, out=out))
    pairs = T * (T + 1) / 2 + T * ctx
    flops = attn_flops(1, H, T, T + ctx, DN + DR, DV, visible_pairs=pairs)
    attn_ms = time_ms(_attention_only(args, kw, chunk, True))
    params = {
        "batch": 1,
        "new_tokens": T,
        "cached_tokens": ctx,
        "chunk": chunk if ctx else None,
        "nheads": H,
        "qk_head_dim": DN + DR,
        "v_head_dim": DV,
        "kv_lora_rank": RANK,
        "page_size": PS,
        "mode": mode,
        "causal": True,
        "latent_cache": "bf16" if ctx else None,
        "attn_ms": attn_ms,
        "saturation_rate": rate,
        "err_heads": REF_HEADS,
    }
    peers = {}
    try:
        out16 = torch.empty_like(out)
        _run16(args, kw, _sdpa_attend, chunk, out16)
        torch.cuda.synchronize()
        p_ms = time_ms(lambda: _run16(args, kw, _sdpa_attend, chunk, out16))
        p_attn = time_ms(_attention_only(args, kw, chunk, False))
        peers["bf16"] = {
            "ms": p_ms,
            "tflops": flops / p_attn * 1e-9,
            "gbps": None,
            "err": _err(out16, args, kw),
            "attn_ms": p_attn,
        }
    except Exception as e:  # the peer may be missing on this install: say why in the results
        peers["bf16"] = {"ms": None, "tflops": None, "gbps": None, "error": f"{type(e).__name__}: {e}"[:300]}
    name = f"mla new{T // 1024}k " + (f"ctx{ctx // 1024}k chunk{chunk // 1024}k" if ctx else "ctx0") + f" {mode}"
    return {
        "case": name,
        "params": params,
        "ours": {"ms": ms, "tflops": flops / attn_ms * 1e-9, "gbps": None, "err": err},
        "peers": peers,
    }


def run(out_dir=None, quick=False, attention=False, seqlen=None, dense_rules=None):
    """Run the cases, print a table, write results/<gpu>/mla_prefill.json; returns the path.

    ``attention`` (``fp8attn bench mla --attention [--seqlen N] [--dense-rules ...]``): the attention alone
    instead (``run_attention``, results ``mla_attention``)."""
    if attention:
        variants = [v.strip() for v in dense_rules.split(";") if v.strip()] if dense_rules else []
        return write_results(run_attention(seqlen or T, (16,) if quick else (H, 16), variants), out_dir)
    if seqlen is not None or dense_rules is not None:
        raise ValueError(
            "seqlen / dense_rules: the prefill pipeline runs 8192 new tokens on the committed rules; "
            "--seqlen and --dense-rules apply to --attention only. Add --attention or drop them."
        )
    doc = results_header("mla_prefill")
    plan = [(0, 4096), (32768, 4096)] if not quick else [(0, 4096)]
    for ctx, chunk in plan:
        for mode in ("bf16_gather", "fp8_gather"):
            doc["cases"].append(_case(ctx, chunk, mode))
            torch.cuda.empty_cache()
    print(f"{'case':<40}{'ms':>9}{'bf16 ms':>9}{'x':>7}{'attn TF/s':>11}{'bf16':>8}{'err':>10}{'sat':>10}")
    for c in doc["cases"]:
        p = c["peers"]["bf16"]
        x = p["ms"] / c["ours"]["ms"] if p.get("ms") else float("nan")
        print(
            f"{c['case']:<40}{c['ours']['ms']:>9.2f}{(p.get('ms') or float('nan')):>9.2f}{x:>7.2f}"
            f"{c['ours']['tflops']:>11.0f}{(p.get('tflops') or float('nan')):>8.0f}{c['ours']['err']:>10.2e}"
            f"{(c['params']['saturation_rate'] or 0):>10.2e}"
        )
    return write_results(doc, out_dir)


def _quantize_per_head(x):
    """bf16 (b, s, h, d) -> e4m3 with per-(batch, head) descales ``amax / 448``: ``(x8, descale (b, h))``."""
    ds = x.float().abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    return (x.float() / ds[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn), ds.contiguous()


def run_attention(seqlen, heads, rule_variants=()):
    """The attention of MLA prefill alone (routine ``mla_attention``): one sequence of ``seqlen`` tokens, e4m3
    Q/K (head dim 192 = NoPE 128 + RoPE 64) and V (128) with per-head descales, causal and not, per head count.
    ``ours``: the dense launcher on its default kernel for these head dims, the warp-specialized TMA kernel
    (``ms_lse``: writing the LSE too; ``kernel``: the kernels its call ran, from the profiler); peers
    ``triton`` (the same call with ``FP8ATTN_DENSE_BACKEND=triton``), ``varlen`` (the sequence as a one-sequence
    varlen batch, the call ``mla.prefill`` makes for its new tokens, LSE included) and ``sdpa_cudnn_bf16``
    (torch SDPA's cuDNN backend on the dequantized bf16 inputs). TF/s: 2 x visible pairs x (192 + 128) per
    head. ``err``: max |out - ref| / max |ref| on the first 2 heads against the float reference of the e4m3
    inputs.
    ``rule_variants``: dense rule overrides (``FP8ATTN_DENSE_RULES``'s syntax, e.g. ``stages=3``,
    ``persistent=0``), each an extra peer ``rules:<value>`` (the same call under them, ``set_dense_rules``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .. import mla
    from ..kernels.dense import launch_dense_fwd, transpose_v_kmajor
    from ..reference import attention_ref
    from .common import kernel_times_us, with_env
    from .dense import _with_rules

    dqk, ref_heads = DN + DR, 2
    doc = results_header("mla_attention")
    scale = dqk**-0.5
    for h in heads:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k = (torch.randn(1, seqlen, h, dqk, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(1, seqlen, h, DV, device="cuda", generator=g, dtype=torch.bfloat16)
        (q8, qd), (k8, kd), (v8, vd) = (_quantize_per_head(x) for x in (q, k, v))
        q = k = v = None
        vt = transpose_v_kmajor(v8)
        qb, kb, vb = (
            x.float().mul(d[:, None, :, None]).to(torch.bfloat16).transpose(1, 2).contiguous()
            for x, d in ((q8, qd), (k8, kd), (v8, vd))
        )
        for causal in (True, False):
            pairs = seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen
            flops = attn_flops(1, h, 1, 1, dqk, DV, visible_pairs=pairs)
            ref = attention_ref(
                q8[:, :, :ref_heads],
                k8[:, :, :ref_heads],
                v8[:, :, :ref_heads],
                softmax_scale=scale,
                causal=causal,
                q_descale=qd[:, :ref_heads],
                k_descale=kd[:, :ref_heads],
                v_descale=vd[:, :ref_heads],
                out_dtype=torch.float32,
            )

            def err(o):
                return float((o[:, :, :ref_heads].float() - ref).abs().max() / ref.abs().max())

            out = torch.empty(1, seqlen, h, DV, device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(1, h, seqlen, device="cuda", dtype=torch.float32)
            kw = dict(
                softmax_scale=scale,
                causal=causal,
                window_size=(-1, -1),
                softcap=0.0,
                q_descale=qd,
                k_descale=kd,
                v_descale=vd,
                v_kmajor=False,
            )

            def ours(lse_=None):
                launch_dense_fwd(q8, k8, vt, out, lse_, **kw)

            ours()
            torch.cuda.synchronize()
            res = {
                "ms": time_ms(ours),
                "ms_lse": time_ms(lambda: ours(lse)),
                "err": err(out),
                "kernel": sorted(kernel_times_us(ours, reps=2)),
                "gbps": None,
            }
            res["tflops"] = flops / res["ms"] / 1e9
            out.fill_(float("nan"))

            def measured(fn):
                fn()
                torch.cuda.synchronize()
                ms_ = time_ms(fn)
                return {
                    "ms": ms_,
                    "tflops": flops / ms_ / 1e9,
                    "err": err(out),
                    "kernel": sorted(kernel_times_us(fn, reps=2)),
                }

            peers = {"triton": with_env("FP8ATTN_DENSE_BACKEND", "triton", lambda: measured(ours))}
            # the same sequence as a one-sequence varlen batch, as mla.prefill attends its new tokens
            cu = torch.tensor([0, seqlen], device="cuda", dtype=torch.int32)

            def varlen():
                mla._attend(
                    q8[0],
                    k8[0],
                    v8[0],
                    cu,
                    cu,
                    seqlen,
                    seqlen,
                    scale,
                    causal,
                    None,
                    (qd, kd, vd),
                    out[0],
                    torch.bfloat16,
                )

            peers["varlen"] = measured(varlen)
            for var in rule_variants:

                def rules_ms():
                    ours()
                    torch.cuda.synchronize()
                    return time_ms(ours), err(out)

                try:
                    ms_v, err_v = _with_rules(var, rules_ms)
                    peers[f"rules:{var}"] = {"ms": ms_v, "tflops": flops / ms_v / 1e9, "err": err_v}
                except Exception as e:  # a value this call cannot take: recorded, the others go on
                    peers[f"rules:{var}"] = {"ms": None, "error": f"{type(e).__name__}: {str(e)[:200]}"}

            def cudnn(causal=causal):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=scale)

            try:
                oc = cudnn()
                ms_c = time_ms(cudnn)
                peers["sdpa_cudnn_bf16"] = {"ms": ms_c, "tflops": flops / ms_c / 1e9, "err": err(oc.transpose(1, 2))}
                oc = None
            except Exception as e:  # backend unavailable here: say why in the results
                peers["sdpa_cudnn_bf16"] = {"ms": None, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            doc["cases"].append(
                {
                    "case": f"qk{dqk} v{DV} B1 S{seqlen} H{h} causal={int(causal)}",
                    "params": {
                        "batch": 1,
                        "seqlen_q": seqlen,
                        "seqlen_k": seqlen,
                        "nheads_q": h,
                        "nheads_k": h,
                        "headdim": dqk,
                        "headdim_v": DV,
                        "causal": causal,
                        "dtype": "float8_e4m3fn",
                        "out_dtype": "bfloat16",
                    },
                    "ours": res,
                    "peers": peers,
                }
            )
            print(
                f"mla attention H{h} causal={int(causal)}: ours {res['ms']:.3f} ms {res['tflops']:.0f} TF/s | "
                + " ".join(f"{k_}={p['ms']:.3f}ms" for k_, p in peers.items() if p.get("ms")),
                flush=True,
            )
        torch.cuda.empty_cache()
    return doc
