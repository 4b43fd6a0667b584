"""The fused e4m3 output at head dim 128, non-causal, without an LSE: row sums on the tensor core (the rule of
``softmax._rowsum_mma``) against fp32 row sums (source of ``results/h200/explore/fp8_out_rowsum.json``).

``bench output-quant`` (B4 S4096 h16 d128) read the fused non-causal call at 0.723-0.729 ms on the kernels of
4efd3b7 against 0.686 ms on 33565af, while the bf16 output got faster (0.686 -> 0.678); the tensor-core row sums
(b80c71f) came between the two. One process per form (``--fp32-sums`` replaces the predicate with one that
keeps fp32 sums at head dim 128 before anything compiles), each timing the fused call without and with an LSE
and the bf16 call without one, CUDA-graph replays, three rounds. Usage (repo root, GPU machine):
``PYTHONPATH=src python benchmarks/explore_fp8_out_rowsum_h200.py [--fp32-sums]``.
"""
import json
import sys

import torch

if "--fp32-sums" in sys.argv[1:]:
    from triton.experimental import gluon

    from fp8attn.kernels.hopper import consumer, forward, softmax

    @gluon.constexpr_function
    def _rowsum_mma(causal, write_lse, head_dim, mode, out_fp8):  # fp32 sums at head dim 128
        return not write_lse and head_dim == 64 and (not causal or mode == 0)

    for m in (softmax, forward, consumer):
        m._rowsum_mma = _rowsum_mma

from fp8attn.bench.common import graph_replay, time_ms  # noqa: E402
from fp8attn.bench.output_quant import _case_prefill  # noqa: E402


def main():
    torch.manual_seed(0)
    attn = _case_prefill(False)[1]
    s = torch.tensor([0.01], device="cuda")
    out8 = torch.empty(4, 4096, 16, 128, dtype=torch.float8_e4m3fn, device="cuda")
    out16 = torch.empty(4, 4096, 16, 128, dtype=torch.bfloat16, device="cuda")
    forms = {"fp8 no lse": lambda: attn(out_scale=s, out=out8),
             "fp8 lse": lambda: attn(out_scale=s, out=out8, return_attn_probs=True),
             "bf16 no lse": lambda: attn(out=out16)}
    calls = {k: graph_replay([f])[0] for k, f in forms.items()}
    res = {k: [] for k in forms}
    for _ in range(3):
        for k, c in calls.items():
            res[k].append(round(time_ms(c) * 1000, 1))
    forms["fp8 no lse"]()
    torch.cuda.synchronize()
    res["fp8_bytes_sum"] = int(out8.view(torch.uint8).long().sum())
    res["form"] = "fp32 sums" if "--fp32-sums" in sys.argv[1:] else "default"
    print("RESULT", json.dumps(res))


if __name__ == "__main__":
    main()
