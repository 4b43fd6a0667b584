"""The Triton part of a mixed batch on one H200: 32 decode rows at 4096 keys + one 2048-query FP8 chunk over an
8192 prefix (32 q / 8 kv heads, d128, sequence-major V, page 64). ``triton_part``: the call's Triton launches
(the decode tiles, then the large-tile launch for sequences of 5-127 queries, empty here); ``decode_alone``:
the fixed-length decode launch of the same rows; ``call``: the whole varlen call. CUDA-graph replays (us),
three alternating medians (the source of ``results/h200/explore/find_seq_vector.json``). A variant is the
source tree on PYTHONPATH. Usage (repo root, GPU machine):
``PYTHONPATH=<variant>/src python benchmarks/explore_mixed_medium_launch_h200.py <name>``.
"""
import json
import math
import sys

import torch

from fp8attn.bench.common import graph_replay, time_ms
from fp8attn.bench.paged import D, E4M3, HK, HQ, _paged_pool
from fp8attn.kernels import paged_tma
from fp8attn.kernels.paged import launch_paged_fwd
from fp8attn.paged import to_v_seq_major

N_DEC, CTX, CHUNK, PREFIX, page = 32, 4096, 2048, 8192, 64
torch.manual_seed(0)
b = N_DEC + 1
L = PREFIX + CHUNK
pd, pc = math.ceil(CTX / page), math.ceil(L / page)
kc, vc, pts = _paged_pool(1, N_DEC * pd * page + pc * page, page, 1)
vs = to_v_seq_major(vc)
flat = pts[0].view(-1)
pt = torch.full((b, pc), -1, dtype=torch.int32, device="cuda")
pt[:N_DEC, :pd] = flat[:N_DEC * pd].view(N_DEC, pd)
pt[N_DEC] = flat[N_DEC * pd:N_DEC * pd + pc]
seqlens = torch.tensor([CTX] * N_DEC + [L], dtype=torch.int32, device="cuda")
qlens = [1] * N_DEC + [CHUNK]
cu = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
q = torch.randn(sum(qlens), HQ, D, device="cuda").to(E4M3)
dd = torch.rand(b, HK, device="cuda") + 0.5
ds = dict(q_descale=dd, k_descale=dd, v_descale=dd)
out = torch.empty(sum(qlens), HQ, D, device="cuda", dtype=torch.bfloat16)
od = torch.empty(N_DEC, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
base = dict(cu_seqlens_q=cu, max_seqlen_q=CHUNK, softmax_scale=D ** -0.5, causal=True, **ds)
fns = {"triton_part": lambda: launch_paged_fwd(q, kc, vs, pt, seqlens, out, None, **base,
                                               config={"tma": False, "split_at": paged_tma.VARLEN_MIN_Q}),
       "decode_alone": lambda: launch_paged_fwd(q[:N_DEC].view(N_DEC, 1, HQ, D), kc, vs, pt[:N_DEC], seqlens[:N_DEC],
                                                od, None, max_seqlen_q=1, softmax_scale=D ** -0.5, causal=True,
                                                **{k: v[:N_DEC] for k, v in ds.items()}),
       "call": lambda: launch_paged_fwd(q, kc, vs, pt, seqlens, out, None, **base)}
calls = {k: graph_replay([f])[0] for k, f in fns.items()}
res = {}
for rep in range(3):
    for k, c in calls.items():
        res.setdefault(k, []).append(round(time_ms(c) * 1000, 1))
print("RESULT", sys.argv[1], json.dumps(res))
