"""Causal calls without an LSE taking their row sums from the tensor core (as non-causal ones do), against
the fp32 sums: FP8ATTN_EXPLORE_CAUSAL_ROWSUM lists the head dims that do (read when the kernels compile).
Run as a driver (no argument but the output directory): it alternates processes with and without it, each with
its own Triton cache, and writes causal_rowsum.json. Shapes as bench dense (16 heads, batch * seqlen = 16k,
sequence-major V, CUDA-graph replays, best of three); in each process a GQA check against the reference.
The switch existed only in the measured tree: the committed rule (``softmax._rowsum_mma``) takes the
tensor-core sums for causal calls at head dim 64 in the dense kernel, so this script now times that rule twice."""
import json
import os
import subprocess
import sys
import tempfile

import torch

E4M3 = torch.float8_e4m3fn
SHAPES = [(64, 2048), (64, 4096), (64, 8192), (128, 4096), (128, 16384)]


def child():
    from fp8attn.bench.common import attn_flops, graph_replay, time_ms
    from fp8attn.bench.dense import dense_inputs
    from fp8attn.kernels.hopper import dense_launch
    from fp8attn.kernels.dense import transpose_v_kmajor
    from fp8attn.reference import attention_ref

    torch.manual_seed(0)
    rows = []
    # GQA check: batch 2, 384 queries over 640 keys, 6 q / 2 kv heads, non-unit descales
    for d in (64, 128):
        q, k, v = ((torch.randn(2, n, h, d, device="cuda") * 3).to(E4M3) for n, h in ((384, 6), (640, 2), (640, 2)))
        qd, kd = (torch.rand(2, 2, device="cuda") * 0.28 + 0.02 for _ in range(2))
        vd = torch.rand(2, 2, device="cuda") * 1.5 + 0.5
        o = torch.full((2, 384, 6, d), float("nan"), device="cuda").bfloat16()
        o_lse = o.clone()
        kw = dict(softmax_scale=0.088, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
        dense_launch.launch_dense_fwd_tma(q, k, transpose_v_kmajor(v), o, None, **kw)
        dense_launch.launch_dense_fwd_tma(q, k, transpose_v_kmajor(v), o_lse, torch.empty(2, 6, 384, device="cuda"), **kw)
        ref = attention_ref(q, k, v, out_dtype=torch.float32, **kw)
        rows.append({"check": f"gqa d{d}", "rel_err": float((o.float() - ref).norm() / ref.norm()),
                     "rel_err_lse_call": float((o_lse.float() - ref).norm() / ref.norm()),
                     "nan": bool(torch.isnan(o).any()), "same_bits_as_lse_call": bool(torch.equal(o, o_lse))})
    for d, s in SHAPES:
        b, h = 16384 // s, 16
        q8, k8, v8, qd, kd, vd = dense_inputs(b, s, h, d)
        vt = transpose_v_kmajor(v8)
        out = torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(b, h, s, device="cuda")
        kw = dict(softmax_scale=d ** -0.5, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
        calls = {"nolse": graph_replay([lambda: dense_launch.launch_dense_fwd_tma(q8, k8, vt, out, None, **kw)])[0],
                 "lse": graph_replay([lambda: dense_launch.launch_dense_fwd_tma(q8, k8, vt, out, lse, **kw)])[0]}
        best = {}
        for _ in range(3):
            for key, fn in calls.items():
                best[key] = min(best.get(key, 1e9), time_ms(fn))
        flops = attn_flops(b, h, s, s, d, causal=True)
        rows.append({"headdim": d, "seqlen": s, **{f"ms_{k}": v for k, v in best.items()},
                     **{f"tflops_{k}": flops / v / 1e9 for k, v in best.items()}})
        calls.clear()
    print("ROWS " + json.dumps(rows), flush=True)


def main(out_dir):
    runs = []
    for rnd in range(2):
        for dims in ("", "64,128"):
            env = dict(os.environ, FP8ATTN_EXPLORE_CAUSAL_ROWSUM=dims, TRITON_CACHE_DIR=tempfile.mkdtemp())
            r = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True)
            line = [x for x in r.stdout.splitlines() if x.startswith("ROWS ")]
            if not line:
                print(r.stdout[-2000:], r.stderr[-3000:])
                raise SystemExit(1)
            runs.append({"round": rnd, "causal_rowsum_dims": dims, "rows": json.loads(line[0][5:])})
            for row in runs[-1]["rows"]:
                print(dims or "fp32", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                                       if not k.startswith("ms_")}, flush=True)
    doc = {"routine": "causal_rowsum", "description": __doc__, "torch": torch.__version__, "runs": runs}
    with open(f"{out_dir}/causal_rowsum.json", "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child()
    else:
        main(sys.argv[1])
