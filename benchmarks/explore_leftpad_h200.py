"""What ``cache_leftpad`` costs on one H200 (the source of ``results/h200/explore/leftpad.json``): decode and a
128-query chunk over a contiguous e4m3 cache (32 q / 8 kv heads, d128, bf16 Q, per-(sequence, head) descales)
through ``flash_attn_with_kvcache`` with a left pad of 0-255 rows per sequence (one-token pages) against the same
call without the pad (one page per cache row), CUDA-graph replays of one call. Usage (repo root, GPU machine):
``OUT=<dir> PYTHONPATH=src python benchmarks/explore_leftpad_h200.py``.
"""
import json
import os

import torch

import fp8attn
from fp8attn.bench.common import graph_replay, time_ms

HQ, HK, D = 32, 8, 128


def main():
    torch.manual_seed(0)
    rows = {}
    for batch, ctx, sq in ((64, 4096, 1), (8, 32768, 1), (4, 4096, 128)):
        S = ctx + 256
        kc = torch.randn(batch, S, HK, D, device="cuda").to(torch.float8_e4m3fn)
        vc = torch.randn(batch, S, HK, D, device="cuda").to(torch.float8_e4m3fn)
        q = torch.randn(batch, sq, HQ, D, device="cuda", dtype=torch.bfloat16)
        dd = torch.rand(batch, HK, device="cuda") + 0.5
        pad = torch.randint(0, 256, (batch,), device="cuda", dtype=torch.int32)
        out = torch.empty(batch, sq, HQ, D, device="cuda", dtype=torch.bfloat16)
        kw = dict(k_descale=dd, v_descale=dd, causal=True, out=out)
        calls = {
            "no_pad": lambda: fp8attn.flash_attn_with_kvcache(
                q, kc, vc, cache_seqlens=torch.full((batch,), ctx, device="cuda", dtype=torch.int32), **kw),
            "leftpad": lambda: fp8attn.flash_attn_with_kvcache(
                q, kc, vc, cache_seqlens=pad + ctx, cache_leftpad=pad, **kw),
        }
        row = {}
        for name, fn in calls.items():
            call, graphed = graph_replay([fn])
            row[name + "_us"] = round(min(time_ms(call) for _ in range(2)) * 1e3, 1)
            row[name + "_graphed"] = graphed
        row["kv_bytes"] = 2 * batch * ctx * HK * D
        row["leftpad_tbps"] = round(row["kv_bytes"] / row["leftpad_us"] / 1e6, 3)
        row["no_pad_tbps"] = round(row["kv_bytes"] / row["no_pad_us"] / 1e6, 3)
        rows[f"B{batch} L{ctx} q{sq}"] = row
        print(f"B{batch} L{ctx} q{sq}", row, flush=True)
        del kc, vc
        torch.cuda.empty_cache()
    os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "out"), "leftpad.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
