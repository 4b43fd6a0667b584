"""A mixed batch's two kernels side by side on one H200 (the source of ``results/h200/explore/mixed_streams.json``):
32 decode rows at 4096 keys + one 2048-query FP8 chunk over an 8192 prefix (32 q / 8 kv heads, d128, sequence-major
V, pages 64 and 128). The chunk's TMA kernel runs its persistent grid on ``132 - R`` SMs while the Triton launches of
the decode rows run on a second stream (fork / join inside one CUDA graph), so the decode rows can take the R SMs
the TMA kernel leaves; against the same pieces in series (R = 0), the committed call, and the decode rows and the
chunk launched separately. The block list is built once outside the timings (the call folds it into another
launch). Usage (repo root, GPU machine): ``OUT=<dir> PYTHONPATH=src python benchmarks/explore_mixed_streams_h200.py``.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from explore_mixed_split_h200 import N_DEC, _block_list, mixed_inputs  # noqa: E402

from fp8attn.bench.common import graph_replay, time_ms  # noqa: E402
from fp8attn.bench.paged import D  # noqa: E402
from fp8attn.kernels.hopper import dense_launch, paged_launch  # noqa: E402
from fp8attn.kernels.paged import launch_paged_fwd  # noqa: E402

RESERVED = (0, 8, 12, 16, 20, 24, 32)


def main():
    rows = []
    side = torch.cuda.Stream()
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    sms = dense_launch._num_sms
    for page in (64, 128):
        m = mixed_inputs(page)
        lst = _block_list(m.cu, m.seqlens, sum(m.qlens))
        sub = lambda s: {k: v[s] for k, v in m.ds.items()}  # noqa: E731

        def tma(r):
            dense_launch._num_sms = lambda i: nsm - r
            try:
                paged_launch.launch_paged_prefill_tma(m.q, m.kc, m.vs, m.pt, m.seqlens, m.out, None,
                                                   softmax_scale=D ** -0.5, causal=True, cu_seqlens_q=m.cu,
                                                   min_len_q=128, block_list=lst, **m.ds)
            finally:
                dense_launch._num_sms = sms

        def triton_part():
            launch_paged_fwd(m.q, m.kc, m.vs, m.pt, m.seqlens, m.out, None, **m.base,
                             config={"tma": False, "split_at": paged_launch.VARLEN_MIN_Q})

        def side_by_side(r, tma_first=True):
            main_s = torch.cuda.current_stream()
            side.wait_stream(main_s)
            if tma_first:
                tma(r)
            with torch.cuda.stream(side):
                triton_part()
            if not tma_first:
                tma(r)
            main_s.wait_stream(side)

        fns = {
            "call": lambda: launch_paged_fwd(m.q, m.kc, m.vs, m.pt, m.seqlens, m.out, None, **m.base),
            "separate": lambda: (
                launch_paged_fwd(m.qd_, m.kc, m.vs, m.pt[:N_DEC], m.seqlens[:N_DEC], m.od, None, max_seqlen_q=1,
                                 softmax_scale=D ** -0.5, causal=True, **sub(slice(0, N_DEC))),
                launch_paged_fwd(m.qc_, m.kc, m.vs, m.pt[N_DEC:], m.seqlens[N_DEC:], m.oc, None,
                                 max_seqlen_q=m.qc_.shape[1], softmax_scale=D ** -0.5, causal=True,
                                 **sub(slice(N_DEC, None)))),
            "serial": lambda: (triton_part(), tma(0)),
        }
        for r in RESERVED:
            fns[f"streams_R{r}"] = lambda r=r: side_by_side(r)
        fns["streams_R16_triton_first"] = lambda: side_by_side(16, tma_first=False)
        row = {"page": page}
        fns["call"]()
        torch.cuda.synchronize()
        ref = m.out.clone()
        calls = {}
        for name, fn in fns.items():
            m.out.fill_(float("nan"))
            call, graphed = graph_replay([fn])
            calls[name] = call
            call()
            torch.cuda.synchronize()
            if name != "separate":
                row[name + "_bit_identical"] = bool(torch.equal(m.out, ref))
            row[name + "_graphed"] = graphed
        for name in fns:
            row[name + "_us"] = []
        for _ in range(2):
            for name in fns:
                row[name + "_us"].append(round(time_ms(calls[name]) * 1000, 1))
        rows.append(row)
        print({k: v for k, v in row.items() if k.endswith("_us")}, flush=True)
        print({k: v for k, v in row.items() if k.endswith("identical") and not v}, flush=True)
        torch.cuda.empty_cache()
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "out"), "mixed_streams.json"), "w") as f:
        json.dump(doc, f, indent=1)
    for r in rows:
        print(r["page"], " ".join(f"{k[:-3]}={min(v)}" for k, v in r.items() if k.endswith("_us")))


if __name__ == "__main__":
    main()
