"""Head dim 64, non-causal: three consumer warpgroups over 64-key tiles (``dense_launch.ws_config``'s default)
against two over 128-key tiles, in one process, CUDA-graph replays alternating, bench dense's shapes
(16 heads, batch * seqlen = 16k, sequence-major V). Writes dense_consumers.json into the directory given."""
import json
import sys

import torch

from fp8attn.bench.common import attn_flops, graph_replay, results_header, time_ms
from fp8attn.bench.dense import _rel_err, dense_inputs
from fp8attn.kernels.hopper import dense_launch
from fp8attn.kernels.dense import transpose_v_kmajor

E4M3 = torch.float8_e4m3fn
default = dense_launch.ws_config


def use(consumers):
    dense_launch.ws_config = lambda d, c, n=None: default(d, c, consumers)


def main(out_dir):
    torch.manual_seed(0)
    doc = results_header("dense_consumers")
    doc["description"] = __doc__
    rows = []
    h, d = 16, 64
    for s in (512, 1024, 2048, 4096, 8192, 16384):
        b = 16384 // s
        q8, k8, v8, qd, kd, vd = dense_inputs(b, s, h, d)
        vt = transpose_v_kmajor(v8)
        out = torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        out8 = torch.empty(b, s, h, d, device="cuda", dtype=E4M3)
        lse = torch.empty(b, h, s, device="cuda")
        osc = torch.tensor([0.05], device="cuda")
        flops = attn_flops(b, h, s, s, d)
        kw = dict(softmax_scale=d ** -0.5, causal=False, q_descale=qd, k_descale=kd, v_descale=vd)
        calls = {}
        for nc in (2, 3):
            use(nc)
            calls[nc, "nolse"] = graph_replay([lambda: dense_launch.launch_dense_fwd_tma(q8, k8, vt, out, None, **kw)])[0]
            calls[nc, "lse"] = graph_replay([lambda: dense_launch.launch_dense_fwd_tma(q8, k8, vt, out, lse, **kw)])[0]
            calls[nc, "fp8out"] = graph_replay([lambda: dense_launch.launch_dense_fwd_tma(
                q8, k8, vt, out8, None, out_scale=osc, **kw)])[0]
        best = {}
        for _ in range(3):
            for key, fn in calls.items():
                t = time_ms(fn)
                best[key] = min(best.get(key, 1e9), t)
        row = {"seqlen": s, "batch": b}
        for nc in (2, 3):
            use(nc)
            dense_launch.launch_dense_fwd_tma(q8, k8, vt, out, None, **kw)
            row[f"err_nc{nc}"] = _rel_err(out, q8, k8, v8, qd, kd, vd, False)
            for form in ("nolse", "lse", "fp8out"):
                row[f"ms_{form}_nc{nc}"] = best[nc, form]
                row[f"tflops_{form}_nc{nc}"] = flops / best[nc, form] / 1e9
        for form in ("nolse", "lse", "fp8out"):
            row[f"speedup_{form}"] = best[2, form] / best[3, form]
        rows.append(row)
        print(f"S{s:6d} nolse {row['tflops_nolse_nc2']:6.1f} -> {row['tflops_nolse_nc3']:6.1f} TF/s "
              f"({row['speedup_nolse']:.3f}x)  lse {row['speedup_lse']:.3f}x  fp8out {row['speedup_fp8out']:.3f}x  "
              f"err {row['err_nc2']:.4f}/{row['err_nc3']:.4f}", flush=True)
        calls.clear()
        torch.cuda.empty_cache()
    use(None)
    doc["rows"] = rows
    with open(f"{out_dir}/dense_consumers.json", "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
