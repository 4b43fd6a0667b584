"""Head dim 64, dense warp-specialized kernel: K loaded key-permuted (a 5-D TMA box whose shared-memory row
16a + 8g + 2q + e holds key 16a + 4q + 2g + e), so that P in the wgmma accumulator layout, relabelled to
key order, is already the A operand of P V (no cross-lane exchange; ``dense_launch.kperm_on``), against the
plain K box, both forced through ``dense_launch.kperm_on`` in one process: the two alternate in each of three
rounds (best kept), CUDA-graph replays, calls with and without an LSE. Shapes as bench dense (16 heads,
batch * seqlen = 16k, sequence-major V). A check first: GQA (6 q / 2 kv heads), 384 queries over 640 keys,
non-unit descales, causal and not, with and without an LSE: both forms against the reference, and their
output bits and LSEs compared. Writes kperm.json.

An earlier form of this script switched the permutation by an environment variable read at import and
alternated processes (two rounds each); it measured the same (docs/perf-notes.md, dense round 18)."""
import json
import sys

import torch

from fp8attn.bench.common import attn_flops, graph_replay, time_ms
from fp8attn.bench.dense import dense_inputs
from fp8attn.kernels.hopper import dense_launch
from fp8attn.kernels.dense import transpose_v_kmajor
from fp8attn.reference import attention_ref

E4M3 = torch.float8_e4m3fn
SHAPES = [(1024, False), (4096, False), (16384, False), (1024, True), (4096, True), (16384, True)]
RULE = dense_launch.kperm_on


def _force(on):
    dense_launch.kperm_on = lambda *args, _on=on: _on


def main(out_dir):
    torch.manual_seed(0)
    checks = []
    q, k, v = ((torch.randn(2, n, h, 64, device="cuda") * 3).to(E4M3) for n, h in ((384, 6), (640, 2), (640, 2)))
    qd, kd = (torch.rand(2, 2, device="cuda") * 0.28 + 0.02 for _ in range(2))
    vd = torch.rand(2, 2, device="cuda") * 1.5 + 0.5
    for causal in (False, True):
        kw = dict(softmax_scale=0.088, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
        ref = attention_ref(q, k, v, out_dtype=torch.float32, **kw)
        for with_lse in (False, True):
            res = {}
            for on in (False, True):
                _force(on)
                o = torch.full((2, 384, 6, 64), float("nan"), device="cuda").bfloat16()
                lse = torch.full((2, 6, 384), float("nan"), device="cuda") if with_lse else None
                dense_launch.launch_dense_fwd_tma(q, k, transpose_v_kmajor(v), o, lse, **kw)
                res[on] = (o, lse)
            (o0, l0), (o1, l1) = res[False], res[True]
            checks.append({"causal": causal, "lse": with_lse,
                           "rel_err_plain": float((o0.float() - ref).norm() / ref.norm()),
                           "rel_err_kperm": float((o1.float() - ref).norm() / ref.norm()),
                           "nan": bool(torch.isnan(o1).any()), "same_output_bits": bool(torch.equal(o0, o1)),
                           "lse_max_abs_diff": None if l0 is None else float((l0 - l1).abs().max())})
            print(checks[-1], flush=True)
    rows = []
    for s, causal in SHAPES:
        b, h, d = 16384 // s, 16, 64
        q8, k8, v8, qd8, kd8, vd8 = dense_inputs(b, s, h, d)
        vt = transpose_v_kmajor(v8)
        out = torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(b, h, s, device="cuda")
        kw = dict(softmax_scale=d ** -0.5, causal=causal, q_descale=qd8, k_descale=kd8, v_descale=vd8)
        calls = {}
        for on in (False, True):
            _force(on)
            for name, ls in (("nolse", None), ("lse", lse)):
                call, graphed = graph_replay(
                    [lambda ls=ls: dense_launch.launch_dense_fwd_tma(q8, k8, vt, out, ls, **kw)])
                assert graphed, "an eager fallback would time whichever form was forced last"
                calls[f"{'kperm' if on else 'plain'}_{name}"] = call
        best = {}
        for _ in range(3):
            for key, fn in calls.items():
                best[key] = min(best.get(key, 1e9), time_ms(fn))
        flops = attn_flops(b, h, s, s, d, causal=causal)
        row = {"seqlen": s, "causal": causal, **{f"ms_{k}": v for k, v in best.items()},
               **{f"tflops_{k}": flops / v / 1e9 for k, v in best.items()},
               "gain_nolse": best["plain_nolse"] / best["kperm_nolse"], "gain_lse": best["plain_lse"] / best["kperm_lse"],
               "rule_nolse": RULE(d, 2, causal, False), "rule_lse": RULE(d, 2, causal, True)}
        rows.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if not k.startswith("ms_")},
              flush=True)
        calls.clear()
    dense_launch.kperm_on = RULE
    doc = {"routine": "kperm", "description": __doc__, "torch": torch.__version__, "checks": checks, "rows": rows}
    with open(f"{out_dir}/kperm.json", "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
