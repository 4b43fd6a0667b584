"""Head dim 64 causal inputs longer than 8k queries: the 8-warp kernel (the rule before this run,
``dense_launch._use_ws``) against the warp-specialized kernel, with one CTA per query block and persistent,
now that causal d64 calls without an LSE sum their rows on the tensor core (dense round 16). One process;
the three variants alternate in each of three rounds (best kept); CUDA-graph replays; 16 heads,
sequence-major V, calls with and without an LSE. Each variant is checked against the 8-warp kernel's
output (relative L2) at every shape. Writes d64_causal_long.json. The result made the committed rule: the
warp-specialized kernel, persistent at any length, for head dim 64 (``_WS_PERSISTENT_CAUSAL_HEAD_DIMS``)."""
import json
import sys

import torch

from fp8attn.bench.common import attn_flops, graph_replay, time_ms
from fp8attn.bench.dense import dense_inputs
from fp8attn.kernels.hopper import dense_launch
from fp8attn.kernels.dense import transpose_v_kmajor

SHAPES = [(2, 8192), (1, 16384), (1, 32768)]
VARIANTS = {"8warp": (False, 8192, ()), "ws_per_block": (True, 8192, ()), "ws_persistent": (True, 1 << 30, ())}


def _set(variant):
    ws, cap, dims = VARIANTS[variant]
    dense_launch._use_ws = lambda d, c, s, _ws=ws: _ws
    dense_launch._WS_PERSISTENT_CAUSAL_MAX_SEQLEN_Q = cap
    dense_launch._WS_PERSISTENT_CAUSAL_HEAD_DIMS = dims


def main(out_dir):
    torch.manual_seed(0)
    rows = []
    for b, s in SHAPES:
        h, d = 16, 64
        q8, k8, v8, qd, kd, vd = dense_inputs(b, s, h, d)
        vt = transpose_v_kmajor(v8)
        kw = dict(softmax_scale=d ** -0.5, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
        flops = attn_flops(b, h, s, s, d, causal=True)
        outs, best, errs = {}, {}, {}
        for variant in VARIANTS:
            _set(variant)
            for lse_on in (False, True):
                o = torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                lse = torch.empty(b, h, s, device="cuda") if lse_on else None
                dense_launch.launch_dense_fwd_tma(q8, k8, vt, o, lse, **kw)
                outs[(variant, lse_on)] = o
        base = outs[("8warp", True)].float()
        for key, o in outs.items():
            errs[f"{key[0]}_{'lse' if key[1] else 'nolse'}"] = float((o.float() - base).norm() / base.norm())
        calls = {}
        for variant in VARIANTS:
            _set(variant)
            for lse_on in (False, True):
                o = outs[(variant, lse_on)]
                lse = torch.empty(b, h, s, device="cuda") if lse_on else None
                call, graphed = graph_replay(
                    [lambda o=o, lse=lse: dense_launch.launch_dense_fwd_tma(q8, k8, vt, o, lse, **kw)])
                assert graphed, "an eager fallback would time whichever variant was set last"
                calls[f"{variant}_{'lse' if lse_on else 'nolse'}"] = call
        for _ in range(3):
            for key, fn in calls.items():
                best[key] = min(best.get(key, 1e9), time_ms(fn))
        row = {"batch": b, "seqlen": s, "rel_diff_vs_8warp_lse": errs,
               **{f"tflops_{k}": flops / v / 1e9 for k, v in best.items()}, **{f"ms_{k}": v for k, v in best.items()}}
        rows.append(row)
        print(b, s, {k: round(v, 1) for k, v in row.items() if k.startswith("tflops_")},
              {k: f"{v:.1e}" for k, v in errs.items()}, flush=True)
        calls.clear()
    doc = {"routine": "d64_causal_long", "description": __doc__, "torch": torch.__version__, "rows": rows}
    with open(f"{out_dir}/d64_causal_long.json", "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
