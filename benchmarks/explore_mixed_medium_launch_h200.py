"""The Triton part of a mixed batch on one H200: 32 decode rows at 4096 keys + one 2048-query FP8 chunk over an
8192 prefix (32 q / 8 kv heads, d128, sequence-major V, page 64). ``triton_part``: the call's Triton launches
(the decode tiles, then the large-tile launch for sequences of 5-127 queries, empty here); ``decode_alone``:
the fixed-length decode launch of the same rows; ``call``: the whole varlen call. CUDA-graph replays (us),
three alternating medians (the source of ``results/h200/explore/find_seq_vector.json``). A variant is the
source tree on PYTHONPATH. Usage (repo root, GPU machine):
``PYTHONPATH=<variant>/src python benchmarks/explore_mixed_medium_launch_h200.py <name>``.
"""
import json
import sys

import torch
from explore_mixed_split_h200 import D, N_DEC, mixed_inputs

from fp8attn.bench.common import graph_replay, time_ms
from fp8attn.kernels.hopper import paged_launch
from fp8attn.kernels.paged import launch_paged_fwd

torch.manual_seed(0)
m = mixed_inputs(64)
fns = {"triton_part": lambda: launch_paged_fwd(m.q, m.kc, m.vs, m.pt, m.seqlens, m.out, None, **m.base,
                                               config={"tma": False, "split_at": paged_launch.VARLEN_MIN_Q}),
       "decode_alone": lambda: launch_paged_fwd(m.qd_, m.kc, m.vs, m.pt[:N_DEC], m.seqlens[:N_DEC], m.od, None,
                                                max_seqlen_q=1, softmax_scale=D ** -0.5, causal=True,
                                                **{k: v[:N_DEC] for k, v in m.ds.items()}),
       "call": lambda: launch_paged_fwd(m.q, m.kc, m.vs, m.pt, m.seqlens, m.out, None, **m.base)}
calls = {k: graph_replay([f])[0] for k, f in fns.items()}
res = {}
for rep in range(3):
    for k, c in calls.items():
        res.setdefault(k, []).append(round(time_ms(c) * 1000, 1))
print("RESULT", sys.argv[1], json.dumps(res))
