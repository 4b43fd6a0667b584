"""The dense/varlen Triton kernel on random combinations of its features against the reference (interpreter on
CPU, the kernel on a GPU): batch, fixed or varlen lengths (empty sequences included), GQA ratio, head dims (v
narrower than q/k), causal, sliding window and softcap, e4m3 inputs with random per-(batch, head) descales.
The grid tests in test_kernel_dense.py vary one feature at a time; here each seed draws all of them (300 seeds
of this generator passed on the CPU when it was written). Query counts start at 17 rows: FA3's bias check on
the mean error is a coin toss over a single row, and the interpreter truncates fp32 -> bf16 (16-bit inputs are
covered by the grid tests with their own tolerance).
"""

import random

import pytest
import torch

from fp8attn.reference import varlen_attention_ref
from helpers import DEV, assert_close_fa3, check_dense, dense_descales, fp8_randn, run_dense


@pytest.mark.parametrize("seed", range(20))
def test_random_feature_combinations(seed):
    rnd = random.Random(seed)
    torch.manual_seed(seed)
    b = rnd.randint(1, 3)
    hq, hk = rnd.choice([(4, 1), (6, 2), (2, 2)])
    d = rnd.choice([32, 64])
    dv = rnd.choice([d, d, 32])
    kw = dict(
        causal=rnd.random() < 0.6,
        window_size=rnd.choice([(-1, -1), (-1, -1), (8, 0), (20, 5)]),
        softcap=rnd.choice([0.0, 0.0, 15.0]),
    )
    varlen = rnd.random() < 0.4
    if varlen:
        lq = [rnd.choice([0, 17, 33, 64]) for _ in range(b)]
        lk = [rnd.choice([0, 1, 9, 40, 70]) for _ in range(b)]
        if sum(lq) == 0 or sum(lk) == 0:
            pytest.skip("the draw has no query or key rows")
        cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        shapes = (sum(lq), hq, d), (sum(lk), hk, d), (sum(lk), hk, dv)
    else:
        sq, sk = rnd.choice([17, 40, 64]), rnd.choice([1, 23, 45, 64, 100])
        shapes = (b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv)
    q, k, v = (fp8_randn(s) for s in shapes)
    qd, kd, vd = dense_descales(b, hk)
    ds = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    if not varlen:
        out, lse, args = run_dense(q, k, v, **kw, **ds)
        check_dense(q, k, v, out, lse, args)
        return
    out, lse, args = run_dense(
        q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lq), max_seqlen_k=max(lk), **kw, **ds
    )
    rkw = dict(softmax_scale=args["softmax_scale"], out_dtype=torch.float32, **kw, **ds)
    ref, ref_lse = varlen_attention_ref(q, k, v, cq, ck, max(lq), max(lk), return_lse=True, **rkw)
    lowp = varlen_attention_ref(q, k, v, cq, ck, max(lq), max(lk), quantize_p=True, **rkw)
    assert_close_fa3(out.float(), ref, lowp, floor=2e-3 * max(ref.abs().max().item(), 1e-3))
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)), "lse: -inf pattern differs"
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-3, rtol=1e-4)
