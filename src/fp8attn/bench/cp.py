"""Context-parallel decode benchmark: ``cp`` (2 GPUs, NCCL) and ``cp-simulate`` (2 shards on one GPU).

* cp (``cp_decode.json``): one decode call of a layer, 32 q / 8 kv heads, d128, bf16 Q over an e4m3 paged
  cache (page 64, V sequence-major inside its pages, per-(sequence, head) descales), B in {1, 8} x context
  {128k, 512k}, the cache sharded round-robin over 2 GPUs (``fp8attn.distributed.cp_decode`` over NCCL, NVLink
  multicast off: ``NCCL_NVLS_ENABLE=0``). ``ours.ms``: a replay of a one-call CUDA graph (local attention,
  all-gather, combine); ``eager_ms`` the eager call with its rank check (``check_ranks=True``, a small
  collective and a host read), ``eager_nocheck_ms`` without it. Peer ``one_gpu``: the single-GPU decode
  (``flash_attn_with_kvcache``) on the full cache on rank 0, graph replay and eager. ``params.seqlen_k`` is the
  context. The parts, each rank's slowest: ``local_attention_ms`` (the shard's attention with its LSE, a graph
  replay) and ``all_gather_ms`` (the gather of the partials alone, eager). ``gbps``: FP8 K + V bytes of the whole context / time (both GPUs together for ours). ``err``: relative
  error against an fp32 attention over the dequantized cache; ``err_vs_one_gpu`` against the one-GPU output.
  Timing: both ranks run the same fixed loops (a median over rounds of CUDA-event-timed loops, after a barrier)
  so their collectives stay in step; ours is the slower rank's time.
  Launch: ``fp8attn bench cp`` (spawns 2 ranks on cuda:0 and cuda:1) or
  ``torchrun --nproc-per-node 2 -m fp8attn.bench.cp``.
* cp-simulate (``cp_decode_simulate.json``, one GPU): the same cases with both shards on one GPU, one after the
  other (``simulate_cp_decode``: the partials straight into the gather buffer, then the merge): checks the
  merged result against the single decode (``err_vs_one_gpu``) and records each shard's partial alone
  (``shard_ms``) and the merge (``merge_ms``), what a 2-GPU call costs besides its all-gather.
  ``python -m fp8attn.bench.cp --simulate`` runs it too.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics

import torch
import torch.distributed as dist

from ..distributed import (
    CPShardPlan,
    CPWorkspace,
    _all_gather,
    cp_decode,
    launch_local,
    shard_paged_cache,
    simulate_cp_decode,
)
from ..interface import flash_attn_combine, flash_attn_with_kvcache
from ..paged_cache import empty_paged
from .common import gpu_dirname, graph_replay, results_header, time_ms, write_results

__all__ = ["run", "run_simulate", "main"]

HQ, HK, D, PAGE = 32, 8, 128, 64
E4M3 = torch.float8_e4m3fn
BATCHES, CONTEXTS = (1, 8), (131072, 524288)
LAYOUT = "round_robin"
TIMEOUT = datetime.timedelta(minutes=10)  # the reference and the one-GPU peer run on rank 0 while rank 1 waits


def _cases(quick):
    return [(1, 131072)] if quick else [(b, L) for b in BATCHES for L in CONTEXTS]


def _fill_e4m3(t, gen):
    """Random e4m3 values in a contiguous tensor, in chunks (bounded memory)."""
    flat = t.view(torch.uint8).view(-1)
    step = 1 << 28
    for s in range(0, flat.numel(), step):
        n = min(step, flat.numel() - s)
        flat[s : s + n] = (
            torch.randn(n, device=t.device, dtype=torch.bfloat16, generator=gen).to(E4M3).view(torch.uint8)
        )


def _problem(b, L, dev, seed=0):
    """The full cache of one case; the same values on every device for a seed."""
    pages = L // PAGE
    nb = b * pages
    gen = torch.Generator(device=dev).manual_seed(seed)
    kc = torch.empty(nb, PAGE, HK, D, dtype=E4M3, device=dev)
    vc = empty_paged((nb, PAGE, HK, D), E4M3, dev, seq_major=True)
    _fill_e4m3(kc, gen)
    _fill_e4m3(vc.permute(0, 2, 3, 1), gen)  # (the contiguous storage of the sequence-major pages)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    pt = perm.view(b, pages).to(dev)
    cs = torch.full((b,), L, dtype=torch.int32, device=dev)
    q = torch.randn(b, 1, HQ, D, device=dev, generator=gen).to(torch.bfloat16)
    kd = torch.rand(b, HK, device=dev, generator=gen) + 0.5
    vd = torch.rand(b, HK, device=dev, generator=gen) + 0.5
    return dict(q=q, kc=kc, vc=vc, pt=pt, cs=cs, kd=kd, vd=vd)


def _reference(p):
    """fp32 attention over the dequantized cache, one sequence at a time: (batch, 1, HQ, D) float32."""
    b = p["q"].shape[0]
    out = torch.empty(b, 1, HQ, D, device=p["q"].device)
    g = HQ // HK
    for i in range(b):
        n = int(p["cs"][i])
        pages = p["pt"][i, : n // PAGE].long()
        k = p["kc"][pages].reshape(n, HK, D).float() * p["kd"][i][None, :, None]
        v = p["vc"][pages].reshape(n, HK, D).float() * p["vd"][i][None, :, None]
        qi = p["q"][i, 0].float().view(HK, g, D)
        s = torch.einsum("hgd,nhd->hgn", qi, k) * D**-0.5
        out[i, 0] = torch.einsum("hgn,nhd->hgd", torch.softmax(s, dim=-1), v).reshape(HQ, D)
        k = v = s = None
    return out


def _rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _loop_ms(fn, iters=20, rounds=7, group_sync=False):
    """Median over ``rounds`` of the per-call time of ``iters`` back-to-back calls (CUDA events). With
    ``group_sync`` every rank enters each round together (a barrier) and runs the same number of calls."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        if group_sync:
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def _slowest(ms):
    """The largest of every rank's time (None if any rank has none)."""
    t = torch.tensor([float("nan") if ms is None else ms], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    v = t.item()
    return None if v != v else v


def _capture(fn):
    """A one-call CUDA graph of ``fn`` (after side-stream warm-up), or None; every rank agrees."""
    g = None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 -- recorded in the results as an eager-only case
        print(f"cp bench: CUDA-graph capture failed: {type(e).__name__}: {e}")
        g = None
    ok = torch.tensor([1 if g is not None else 0], device="cuda")
    if dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return g if int(ok.item()) else None


def _single_call(p, out):
    return lambda: flash_attn_with_kvcache(
        p["q"],
        p["kc"],
        p["vc"],
        cache_seqlens=p["cs"],
        page_table=p["pt"],
        k_descale=p["kd"],
        v_descale=p["vd"],
        out=out,
    )


def _params(b, L, world):
    return {
        "batch": b,
        "seqlen_q": 1,
        "seqlen_k": L,
        "nheads_q": HQ,
        "nheads_k": HK,
        "headdim": D,
        "causal": False,
        "page_size": PAGE,
        "layout": LAYOUT,
        "world_size": world,
        "q_dtype": "bf16",
        "kv_dtype": "e4m3",
        "v_seq_major": True,
    }


def _bench_ranks(rank, world, out_dir=None, quick=False):
    """Every rank's part of ``cp``; rank 0 writes the results and returns their path."""
    dev = torch.device("cuda", torch.cuda.current_device())
    doc = results_header("cp_decode")
    doc["gpu"] = f"{world}x {torch.cuda.get_device_name()}"
    for b, L in _cases(quick):
        p = _problem(b, L, dev)
        plan = CPShardPlan(world, PAGE, p["pt"].shape[1], LAYOUT)
        s = shard_paged_cache(p["kc"], p["vc"], p["pt"], p["cs"], plan, rank)
        kv_bytes = 2 * b * L * HK * D
        ws = CPWorkspace(p["q"], D, world)
        out = torch.empty(b, 1, HQ, D, device=dev, dtype=torch.bfloat16)
        args = (p["q"], s.k_cache, s.v_cache, s.page_table, s.cache_seqlens)
        kw = dict(k_descale=p["kd"], v_descale=p["vd"], out=out, workspace=ws)
        cp_decode(*args, **kw)  # eager, with the rank check: validates the whole setup once
        got = out.clone()
        peer, err, err1 = {}, None, None
        if rank == 0:
            ref = _reference(p)
            one = torch.empty_like(out)
            call1 = _single_call(p, one)
            call1()
            err, err1 = _rel_err(got, ref), _rel_err(got, one)
            g1, graphed1 = graph_replay([call1])
            ms1 = _loop_ms(g1)
            peer = {
                "ms": ms1,
                "tflops": None,
                "gbps": kv_bytes / ms1 / 1e6,
                "err": _rel_err(one, ref),
                "eager_ms": _loop_ms(call1),
                "cuda_graph": graphed1,
            }
            ref = None
        else:
            del p["kc"], p["vc"]  # only rank 0 keeps the full cache (its one-GPU peer)
        dist.barrier()
        eager = _slowest(_loop_ms(lambda: cp_decode(*args, **kw), group_sync=True))
        eager_nocheck = _slowest(_loop_ms(lambda: cp_decode(*args, check_ranks=False, **kw), group_sync=True))
        # the parts: this rank's attention alone (a graph replay) and the all-gather alone
        part_out, _ = ws.views(ws.send)
        part = lambda: flash_attn_with_kvcache(  # noqa: E731
            p["q"],
            s.k_cache,
            s.v_cache,
            cache_seqlens=s.cache_seqlens,
            page_table=s.page_table,
            out=part_out,
            out_dtype=torch.float32,
            return_softmax_lse=True,
            k_descale=p["kd"],
            v_descale=p["vd"],
        )
        local_ms = _slowest(_loop_ms(graph_replay([part])[0]))
        gather_ms = _slowest(_loop_ms(lambda: _all_gather(ws.recv, ws.send, None), group_sync=True))
        g = _capture(lambda: cp_decode(*args, check_ranks=False, **kw))
        ms = _slowest(_loop_ms(g.replay, group_sync=True)) if g is not None else None
        if g is not None:
            g.replay()
            torch.cuda.synchronize()
            graph_same = bool(torch.equal(out, got))
        else:
            graph_same = None
        if rank == 0:
            t = ms if ms is not None else eager
            case = {
                "case": f"d128 B{b} L{L} cp{world}",
                "params": _params(b, L, world),
                "ours": {
                    "ms": ms,
                    "tflops": None,
                    "gbps": kv_bytes / t / 1e6,
                    "err": err,
                    "err_vs_one_gpu": err1,
                    "eager_ms": eager,
                    "eager_nocheck_ms": eager_nocheck,
                    "cuda_graph": ms is not None,
                    "graph_equals_eager": graph_same,
                    "local_attention_ms": local_ms,
                    "all_gather_ms": gather_ms,
                    "speedup_vs_one_gpu": peer["ms"] / t,
                    "eager_speedup_vs_one_gpu": peer["eager_ms"] / eager,
                },
                "peers": {"one_gpu": peer},
            }
            doc["cases"].append(case)
            print(
                f"B{b:<2} L{L:<7} 2 GPUs {t:.3f} ms (eager {eager:.3f}) | 1 GPU {peer['ms']:.3f} ms "
                f"(eager {peer['eager_ms']:.3f}) | {peer['ms'] / t:.2f}x | err {err:.2e} vs 1 GPU {err1:.2e}"
            )
        g = s = p = ws = None
        torch.cuda.empty_cache()
        dist.barrier()
    if rank != 0:
        return None
    folder = re.sub(r"x\d+$", "", gpu_dirname()) + f"x{world}"  # the GPUs used, not the host's count
    return str(write_results(doc, out_dir or os.path.join("benchmarks", "results", folder)))


def run(out_dir=None, quick=False):
    """``fp8attn bench cp``: 2 ranks on cuda:0 / cuda:1 (or the ranks of a torchrun launch)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        dist.init_process_group("nccl", timeout=TIMEOUT)
        try:
            return _bench_ranks(dist.get_rank(), dist.get_world_size(), out_dir, quick)
        finally:
            dist.destroy_process_group()
    if torch.cuda.device_count() < 2:
        print(
            "fp8attn bench cp: needs 2 GPUs (found "
            f"{torch.cuda.device_count()}); `fp8attn bench cp-simulate` runs both shards on one GPU."
        )
        return None
    return launch_local(_bench_ranks, 2, out_dir, quick, backend="nccl", timeout=TIMEOUT, deadline_s=3600.0)[0]


def run_simulate(out_dir=None, quick=False, world=2):
    """``fp8attn bench cp-simulate``: ``world`` shards on one GPU, one after the other."""
    dev = torch.device("cuda", torch.cuda.current_device())
    doc = results_header("cp_decode_simulate")
    for b, L in _cases(quick):
        p = _problem(b, L, dev)
        plan = CPShardPlan(world, PAGE, p["pt"].shape[1], LAYOUT)
        shards = [shard_paged_cache(p["kc"], p["vc"], p["pt"], p["cs"], plan, r) for r in range(world)]
        kv_bytes = 2 * b * L * HK * D
        ws = CPWorkspace(p["q"], D, world)
        out, one = (torch.empty(b, 1, HQ, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        kw = dict(k_descale=p["kd"], v_descale=p["vd"])
        sim = lambda: simulate_cp_decode(p["q"], shards, out=out, workspace=ws, **kw)  # noqa: E731
        call1 = _single_call(p, one)
        sim()
        call1()
        ref = _reference(p)
        err, err1, err_one = _rel_err(out, ref), _rel_err(out, one), _rel_err(one, ref)
        ref = None
        g, graphed = graph_replay([sim])
        g1, graphed1 = graph_replay([call1])
        ms, ms1 = time_ms(g), time_ms(g1)
        shard_ms = []
        for s in shards:
            lse_out = torch.empty(b, 1, HQ, D, device=dev)
            part = lambda s=s, o=lse_out: flash_attn_with_kvcache(  # noqa: E731
                p["q"],
                s.k_cache,
                s.v_cache,
                cache_seqlens=s.cache_seqlens,
                page_table=s.page_table,
                out=o,
                out_dtype=torch.float32,
                return_softmax_lse=True,
                **kw,
            )
            shard_ms.append(time_ms(graph_replay([part])[0]))
        merge = lambda: flash_attn_combine(ws.out_partial, ws.lse_partial, out=out, out_dtype=out.dtype)  # noqa: E731
        merge_ms = time_ms(graph_replay([merge])[0])
        doc["cases"].append(
            {
                "case": f"d128 B{b} L{L} simulated cp{world}",
                "params": _params(b, L, world),
                "ours": {
                    "ms": ms,
                    "tflops": None,
                    "gbps": kv_bytes / ms / 1e6,
                    "err": err,
                    "err_vs_one_gpu": err1,
                    "cuda_graph": graphed,
                    "shard_ms": shard_ms,
                    "merge_ms": merge_ms,
                    "two_gpu_estimate_ms": max(shard_ms) + merge_ms,
                },
                "peers": {
                    "one_gpu": {
                        "ms": ms1,
                        "tflops": None,
                        "gbps": kv_bytes / ms1 / 1e6,
                        "err": err_one,
                        "cuda_graph": graphed1,
                    }
                },
            }
        )
        print(
            f"B{b:<2} L{L:<7} {world} shards in turn {ms:.3f} ms (shards {', '.join(f'{t:.3f}' for t in shard_ms)}"
            f", merge {merge_ms:.3f}) | 1 GPU {ms1:.3f} ms | err {err:.2e}, vs 1 GPU {err1:.2e}"
        )
        shards = p = g = g1 = None
        torch.cuda.empty_cache()
    return str(write_results(doc, out_dir or os.path.join("benchmarks", "results", gpu_dirname())))


def main(argv=None):
    """``python -m fp8attn.bench.cp [--simulate] [--quick] [--out-dir DIR]`` (also the torchrun entry point)."""
    ap = argparse.ArgumentParser(prog="python -m fp8attn.bench.cp")
    ap.add_argument("--simulate", action="store_true", help="both shards on one GPU, one after the other")
    ap.add_argument("--quick", action="store_true", help="B1 x 128k only")
    ap.add_argument("--out-dir", default=None)
    a = ap.parse_args(argv)
    path = (run_simulate if a.simulate else run)(out_dir=a.out_dir, quick=a.quick)
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
