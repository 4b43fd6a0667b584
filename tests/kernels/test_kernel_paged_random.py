"""The paged kernel on random combinations of its features against the reference (interpreter on CPU, the
kernel on a GPU): batch, cache lengths (0 included), page size, GQA ratio, head dim, Q and cache dtypes (e4m3,
e5m2, bf16; per-(sequence, head) or per-token-head scales), V layout, fixed-length or varlen queries (decode
rows next to chunks), causal or not, sliding window, softcap, split count and (every third seed) the fused e4m3
output, over NaN-poisoned caches with
randomly permuted page tables. The grid tests in test_kernel_paged.py vary one feature at a time; here each
seed draws all of them (470 seeds of this generator passed on the CPU when it was written).
"""

import math
import random

import pytest
import torch

from fp8attn.quant import saturating_cast
from helpers import (
    DEV,
    E4M3,
    E5M2,
    check_paged,
    cu_from_lens,
    make_cache,
    paged_refs,
    rand_descale,
    run_paged,
    v_seq_major_cache,
)


def _draw(seed, large):
    """One random call: (q, cache, kwargs for run_paged and the reference, the kernel's P rounding)."""
    rnd = random.Random(seed)
    torch.manual_seed(seed)
    batch = rnd.randint(1, 3)
    lengths = [1, 65, 130, 200, 300] if large else [0, 1, 5, 17, 33, 64, 65, 100, 130, 200]
    seqlens = [rnd.choice(lengths) for _ in range(batch)]
    page = rnd.choice([1, 16, 32, 64])
    hq, hk = rnd.choice([(4, 1), (6, 2), (2, 2), (8, 2)])
    d = rnd.choice([32, 64])
    kv_dtype = rnd.choice([E4M3, E4M3, E5M2, torch.bfloat16])
    q_dtype = {
        E4M3: rnd.choice([torch.bfloat16, E4M3]),
        E5M2: rnd.choice([E5M2, torch.bfloat16]),
        torch.bfloat16: torch.bfloat16,
    }[kv_dtype]
    varlen = rnd.random() < 0.5
    kw = dict(
        causal=rnd.random() < 0.7,
        window_size=rnd.choice([(-1, -1), (-1, -1), (16, 0), (40, 8)]),
        softcap=rnd.choice([0.0, 0.0, 20.0]),
        num_splits=rnd.choice([1, 1, 2, 3, 0]),
    )
    token_scales = kv_dtype == E4M3 and rnd.random() < 0.25
    seq_major = kv_dtype != torch.bfloat16 and not token_scales and page >= 16 and rnd.random() < 0.3
    c = make_cache(seqlens, page, hk, d, dtype=kv_dtype, device=DEV, per_token_scales=token_scales)
    if seq_major:
        c = v_seq_major_cache(c)
    if varlen:
        most = 140 if large else 40
        qlens = [max(1, rnd.randint(0, min(s, most))) if s else 0 for s in seqlens]
        if sum(qlens) == 0:
            return None
        qf = torch.randn(sum(qlens), hq, d, device=DEV) * 2
        kw.update(cu_seqlens_q=cu_from_lens(qlens, DEV), max_seqlen_q=max(qlens))
    else:
        qf = torch.randn(batch, rnd.choice([17, 40, 100, 130] if large else [1, 3, 16, 40]), hq, d, device=DEV) * 2
    fp8_q = q_dtype in (E4M3, E5M2)
    q = saturating_cast(qf, q_dtype) if fp8_q else qf.to(q_dtype)
    if kv_dtype != torch.bfloat16 and not token_scales:
        kw.update(k_descale=rand_descale(batch, hk, 0.5, 2.0, DEV), v_descale=rand_descale(batch, hk, 0.5, 2.0, DEV))
    if fp8_q:
        kw["q_descale"] = rand_descale(batch, hk, 0.5, 2.0, DEV)
    return q, c, kw, fp8_q


@pytest.mark.parametrize("seed", list(range(24)) + [1000 + i for i in range(6)])
def test_random_feature_combinations(seed):
    drawn = _draw(seed, large=seed >= 1000)
    if drawn is None:
        pytest.skip("the draw has no query rows")
    q, c, kw, fp8_q = drawn
    splits = kw.pop("num_splits")
    out, lse = run_paged(q, c, num_splits=splits, **kw)
    ref, ref_lse, lp = paged_refs(q, c, quantize_p=fp8_q, **kw)
    check_paged(out, lse, ref, ref_lse, lp, floor=4e-3, lse_tol=2e-3)
    assert math.isfinite(float(out.float().abs().sum())), "non-finite output"
    if seed % 3 == 0:  # the fused e4m3 output: within one e4m3 step of the 16-bit output quantized after
        osc = torch.tensor(0.02, device=DEV)
        o8, _ = run_paged(q, c, num_splits=splits, out_scale=osc, **kw)
        r8 = saturating_cast(out.float() / osc).float()
        assert ((o8.float() - r8).abs() <= 0.125 * r8.abs() + 2**-9).all(), "fused e4m3 output"
