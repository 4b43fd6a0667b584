"""Helpers shared by the test modules: the float64 oracle, FA3's tolerance rule, NaN-poisoned caches, random
non-unit descales, and the launch-and-check wrappers of the dense and paged kernel tests.

Test modules import from here (``from helpers import ...``; pytest puts tests/ on the path); nothing here
is collected.
"""

import math
import re

import pytest
import torch

from fp8attn.kernels.dense import launch_dense_fwd
from fp8attn.kernels.paged import launch_paged_fwd
from fp8attn.paged_cache import is_v_seq_major, make_page_table, to_v_seq_major
from fp8attn.quant import quantize, saturating_cast
from fp8attn.reference import attention_ref, paged_attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


# ----------------------------------------------------------------------------------------------------
# Tolerances and error checks
# ----------------------------------------------------------------------------------------------------
def assert_close_fa3(out, ref, ref_lowprec, floor=1e-3, name="out"):
    """FA3's rule: max|out - ref| <= 2 * max|ref_lowprec - ref| + floor, plus a bias check on the mean error.

    ``ref`` is the fp32/fp64 reference from the dequantized inputs; ``ref_lowprec`` is the reference
    run with the same low-precision steps as the kernel (P in e4m3).
    """
    o, r, rl = out.double(), ref.double(), ref_lowprec.double()
    assert not torch.isnan(o).any(), f"{name}: NaN in output"
    err = (o - r).abs().max().item()
    bound = 2 * (rl - r).abs().max().item() + floor
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"
    bias = (o - r).mean().abs().item()
    bias_bound = 2 * (rl - r).mean().abs().item() + floor / 10
    assert bias <= bias_bound, f"{name}: mean error {bias:.3e} > {bias_bound:.3e}"


def rel_err(out, ref):
    """Relative Frobenius-norm error of ``out`` against ``ref``, in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def raises_naming(exc, arg, fn, *args, got=None, **kw):
    """``fn(*args, **kw)`` raises ``exc`` whose message names ``arg`` (and contains ``got``, what arrived, when
    given); returns the message."""
    with pytest.raises(exc) as ei:
        fn(*args, **kw)
    msg = str(ei.value)
    assert re.search(rf"(^|\W){re.escape(arg)}(\W|$)", msg), f"message does not name {arg!r}: {msg}"
    if got is not None:
        assert got in msg, f"message does not say what arrived ({got!r}): {msg}"
    return msg


def check_vs_oracle(out, lse, ref, ref_lse, lowp=None):
    """FA3's rule against the oracle; the baseline is the oracle with P rounded as the kernel rounds it
    (``lowp``; default: the exact oracle), rounded to the output dtype."""
    assert not torch.isnan(out.float()).any()
    assert_close_fa3(out.float(), ref, (ref if lowp is None else lowp).to(out.dtype).float())
    if lse is not None:
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        fin = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[fin].double(), ref_lse[fin], atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# The float64 oracle: a per-row loop that shares no code with the library (it dequantizes, masks and
# normalizes one query row at a time)
# ----------------------------------------------------------------------------------------------------
def _as64(x):
    return x.to(torch.float32).to(F64)


def _bh(d, b, hk):
    """A (batch, nheads_k) float64 view of None / per-tensor / per-sequence / per-head descales."""
    if d is None:
        return torch.ones(b, hk, dtype=F64)
    d = d.to(F64)
    if d.numel() == 1:
        return d.reshape(1, 1).expand(b, hk)
    return d.reshape(d.shape[0], -1).expand(b, hk)


def _round_p(p, p_round):
    """P as a kernel multiplies it: e4m3 after scaling by 2**8 (then scaled back), or a 16-bit dtype."""
    if p_round == "e4m3":
        return saturating_cast((p * 256.0).float()).to(F64) / 256.0
    return p.to(p_round).to(F64)


def naive_attention(
    q,
    k,
    v,
    *,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    k_token_descale=None,
    v_token_descale=None,
    seqlens_q=None,
    seqlens_k=None,
    p_round=None,
):
    """Float64 oracle, one query row at a time.

    q : (b, sq, hq, d); k : (b, sk, hk, d); v : (b, sk, hk, dv) -- any float / fp8 dtype.
    Descales: None / per-tensor / (b, 1) / (b, hk); token descales (b, sk, hk).
    Returns out (b, sq, hq, dv) float64 (rows past seqlens_q are 0) and lse (b, hq, sq) float64.
    p_round ("e4m3", torch.bfloat16 or torch.float16): also return, third, the output with P rounded
    that way before P @ V (the row sum unrounded), the low-precision baseline of FA3's rule.
    """
    b, sq, hq, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hk
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qd, kd, vd = _bh(q_descale, b, hk), _bh(k_descale, b, hk), _bh(v_descale, b, hk)
    Q, K, V = _as64(q), _as64(k), _as64(v)
    if k_token_descale is not None:
        K = K * k_token_descale.to(F64)[..., None]
    if v_token_descale is not None:
        V = V * v_token_descale.to(F64)[..., None]
    out = torch.zeros(b, sq, hq, dv, dtype=F64)
    out_lowp = torch.zeros(b, sq, hq, dv, dtype=F64)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=F64)
    left, right = window_size
    for bi in range(b):
        lq = sq if seqlens_q is None else int(seqlens_q[bi])
        lk = sk if seqlens_k is None else int(seqlens_k[bi])
        shift = lk - lq
        for h in range(hq):
            kh = h // g
            for i in range(lq):
                hi = lk - 1
                lo = 0
                if causal:
                    hi = min(hi, i + shift)
                if right >= 0:
                    hi = min(hi, i + shift + right)
                if left >= 0:
                    lo = max(lo, i + shift - left)
                if hi < lo:
                    continue  # no visible key: out 0, lse -inf
                qrow = Q[bi, i, h] * qd[bi, kh]
                keys = K[bi, lo : hi + 1, kh] * kd[bi, kh]
                s = (keys @ qrow) * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                mx = s.max()
                p = torch.exp(s - mx)
                denom = p.sum()
                out[bi, i, h] = (p @ V[bi, lo : hi + 1, kh]) / denom * vd[bi, kh]
                if p_round is not None:
                    out_lowp[bi, i, h] = (_round_p(p, p_round) @ V[bi, lo : hi + 1, kh]) / denom * vd[bi, kh]
                lse[bi, h, i] = mx + torch.log(denom)
    return (out, lse) if p_round is None else (out, lse, out_lowp)


# ----------------------------------------------------------------------------------------------------
# Inputs: random descales, FP8 tensors, NaN-poisoned paged caches
# ----------------------------------------------------------------------------------------------------
def rand_descale(b, hk, lo=0.3, hi=2.0, device="cpu"):
    """Random non-unit (b, hk) float32 descales, uniform in [lo, hi)."""
    return (lo + (hi - lo) * torch.rand(b, hk)).float().to(device)


def fp8_inputs(b, sq, sk, hq, hk, d, dv=None, fmt=E4M3, granularity="per_head"):
    """Random FP8 q/k/v with non-unit (batch, nheads_k) descales; returns (q8, k8, v8, qd, kd, vd)."""
    dv = dv or d
    q = torch.randn(b, sq, hq, d) * 3
    k = torch.randn(b, sk, hk, d) * 0.5
    v = torch.randn(b, sk, hk, dv) * 2
    k8, kd = quantize(k, granularity, fmt)
    v8, vd = quantize(v, granularity, fmt)
    # q is quantized per (batch, kv head) too (FA3's q_descale is (batch, nheads_k)).
    g = hq // hk
    qa = q.abs().view(b, sq, hk, g, d).amax(dim=(1, 3, 4))
    qd = (qa / 448.0 * rand_descale(b, hk, 1.0, 1.5)).float()  # also exercises a non-tight scale
    q8 = saturating_cast(q / qd.repeat_interleave(g, dim=1)[:, None, :, None], fmt)
    return q8, k8, v8, qd, kd, vd


def fp8_randn(shape, scale=3.0, device=DEV):
    return (torch.randn(shape, device=device) * scale).clamp(-448, 448).to(E4M3)


def dense_descales(b, hk, device=DEV):
    # never all ones: random per-(batch, head) values in [0.02, 0.3] (q, k) and [0.5, 2] (v)
    qd = torch.rand(b, hk, device=device) * 0.28 + 0.02
    kd = torch.rand(b, hk, device=device) * 0.28 + 0.02
    vd = torch.rand(b, hk, device=device) * 1.5 + 0.5
    return qd, kd, vd


def poison_(t):
    if t.dtype in (E4M3, E5M2):
        t.view(torch.uint8).fill_(0x7F)  # NaN in both formats
    else:
        t.fill_(float("nan"))
    return t


def poisoned_cache(nblocks, ps, hk, d, dtype=E4M3):
    """A (nblocks, ps, hk, d) cache of ``dtype`` that is NaN in every slot."""
    c = poison_(torch.empty((nblocks, ps, hk, d), dtype=dtype))
    assert torch.isnan(c.float()).all()
    return c


def page_table_3x(lens, ps):
    """Random page table over a pool 3x the needed pages (at least 3); -1 in unused entries."""
    need = sum((n + ps - 1) // ps for n in lens)
    nblocks = max(3 * need, 3)
    pt = make_page_table(lens, ps, nblocks, fill=-1)
    assert pt.dtype == torch.int32
    used = [(n + ps - 1) // ps for n in lens]
    ids = torch.cat([pt[i, :u] for i, u in enumerate(used)]) if need else torch.zeros(0, dtype=torch.int32)
    assert ids.unique().numel() == ids.numel() and (ids >= 0).all() and (ids < nblocks).all()
    for i, u in enumerate(used):
        assert (pt[i, u:] == -1).all()
    return pt, nblocks


def scatter_dense(cache, pt, x, lens):
    """Write dense x (b, L, hk, d) tokens [0, len) into the paged cache, byte for byte (independent of the library)."""
    ps = cache.shape[1]
    raw, xr = (
        cache.view(torch.uint8) if cache.element_size() == 1 else cache,
        x.view(torch.uint8) if x.element_size() == 1 else x,
    )
    for b, n in enumerate(lens):
        for t in range(n):
            raw[int(pt[b, t // ps]), t % ps] = xr[b, t]


def make_cache(
    seqlens, page_size, hk, d, dv=None, dtype=E4M3, device=DEV, per_token_scales=False, extra_pages=1, pool_factor=3
):
    """Random paged K/V over a randperm 3x pool; NaN outside valid tokens; -1 in unused entries."""
    dv = d if dv is None else dv
    batch = len(seqlens)
    pages_per = [-(-int(L) // page_size) for L in seqlens]
    max_pages = max(pages_per + [1]) + extra_pages
    num_blocks = pool_factor * max(sum(pages_per), 1)
    perm = torch.randperm(num_blocks).tolist()
    pt = torch.full((batch, max_pages), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(pages_per):
        for p in range(n):
            pt[b, p] = perm[i]
            i += 1
    kc = poison_(torch.empty((num_blocks, page_size, hk, d), dtype=dtype))
    vc = poison_(torch.empty((num_blocks, page_size, hk, dv), dtype=dtype))
    ks = torch.full((num_blocks, page_size, hk), float("nan")) if per_token_scales else None
    vs = torch.full((num_blocks, page_size, hk), float("nan")) if per_token_scales else None
    for b, L in enumerate(seqlens):
        L = int(L)
        if L == 0:
            continue
        pos = torch.arange(L)
        blk = pt[b, pos // page_size].long()
        off = pos % page_size
        kk = torch.randn(L, hk, d)
        vv = torch.randn(L, hk, dv)
        if dtype in (E4M3, E5M2):
            if per_token_scales:
                ksc = torch.rand(L, hk) * 0.05 + 0.01
                vsc = torch.rand(L, hk) * 0.05 + 0.01
                ks[blk, off] = ksc
                vs[blk, off] = vsc
                kk, vv = kk / ksc[..., None], vv / vsc[..., None]
            kc.view(torch.uint8)[blk, off] = saturating_cast(kk, dtype).view(torch.uint8)
            vc.view(torch.uint8)[blk, off] = saturating_cast(vv, dtype).view(torch.uint8)
        else:
            kc[blk, off] = kk.to(dtype)
            vc[blk, off] = vv.to(dtype)
    c = dict(
        k_cache=kc.to(device),
        v_cache=vc.to(device),
        page_table=pt.to(device),
        cache_seqlens=torch.tensor([int(L) for L in seqlens], dtype=torch.int32, device=device),
    )
    if per_token_scales:
        c["k_cache_scales"], c["v_cache_scales"] = ks.to(device), vs.to(device)
    return c


def cu_from_lens(lens, device=DEV):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)


def v_seq_major_cache(c):
    """The same cache with V stored sequence-major inside each page (values, NaN poison included)."""
    vc = c["v_cache"]
    vs = to_v_seq_major(vc)
    assert is_v_seq_major(vs) and not is_v_seq_major(vc)
    assert torch.equal(vs.contiguous().view(torch.uint8), vc.view(torch.uint8))  # NaN poison included
    return dict(c, v_cache=vs)


# ----------------------------------------------------------------------------------------------------
# Kernel launches into NaN-poisoned outputs, and their checks against the reference
# ----------------------------------------------------------------------------------------------------
def run_dense(q, k, v, *, out_dtype=torch.float32, lse=True, **kw):
    varlen = kw.get("cu_seqlens_q") is not None
    if varlen:
        out = torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"), device=q.device, dtype=torch.float32)
        l = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device) if lse else None
    else:
        out = torch.full(q.shape[:3] + (v.shape[-1],), float("nan"), device=q.device, dtype=torch.float32)
        l = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device) if lse else None
    out = out.to(out_dtype) if out_dtype != E4M3 else torch.zeros_like(out, dtype=E4M3)
    args = dict(
        softmax_scale=kw.pop("softmax_scale", 1.0 / math.sqrt(q.shape[-1])),
        causal=kw.pop("causal", False),
        window_size=kw.pop("window_size", (-1, -1)),
        softcap=kw.pop("softcap", 0.0),
        q_descale=kw.pop("q_descale", None),
        k_descale=kw.pop("k_descale", None),
        v_descale=kw.pop("v_descale", None),
    )
    launch_dense_fwd(q, k, v, out, l, **args, **kw)
    return out, l, args


def check_dense(q, k, v, out, lse, args, floor_rel=2e-3, **refkw):
    kw = dict(
        softmax_scale=args["softmax_scale"],
        causal=args["causal"],
        window_size=args["window_size"],
        softcap=args["softcap"],
        q_descale=args["q_descale"],
        k_descale=args["k_descale"],
        v_descale=args["v_descale"],
        out_dtype=torch.float32,
        **refkw,
    )
    ref, ref_lse = attention_ref(q, k, v, return_lse=True, **kw)
    lowp = attention_ref(q, k, v, quantize_p=q.dtype == E4M3, **kw)
    floor = floor_rel * max(ref.abs().max().item(), 1e-3)
    assert_close_fa3(out.float(), ref, lowp, floor=floor)
    if lse is not None:
        fin = torch.isfinite(ref_lse)
        assert torch.equal(fin, torch.isfinite(lse)), "lse: -inf pattern differs"
        assert (lse[~fin] == float("-inf")).all()
        torch.testing.assert_close(lse[fin], ref_lse[fin], atol=1e-3, rtol=1e-4)
    return ref


def run_paged(
    q,
    cache,
    *,
    cu_seqlens_q=None,
    max_seqlen_q=None,
    causal=True,
    window_size=(-1, -1),
    softcap=0.0,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    num_splits=1,
    out_dtype=None,
    out_scale=None,
    softmax_scale=None,
    config=None,
    with_lse=True,
    split_workspace=(None, None),
):
    """The paged launch into NaN-poisoned outputs: ``(out, lse)`` (``lse`` None without ``with_lse``)."""
    hq, d = q.shape[-2], q.shape[-1]
    dv = cache["v_cache"].shape[-1]
    if out_dtype is None:
        out_dtype = torch.bfloat16 if q.dtype in (E4M3, E5M2) else q.dtype
    if out_scale is not None:
        out_dtype = E4M3
    out = poison_(torch.empty((*q.shape[:-1], dv), dtype=out_dtype, device=q.device))
    if cu_seqlens_q is None:
        b, sq = q.shape[:2]
        lse = torch.full((b, hq, sq), float("nan"), device=q.device)
        max_seqlen_q = sq
    else:
        lse = torch.full((hq, q.shape[0]), float("nan"), device=q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    lse = lse if with_lse else None
    launch_paged_fwd(
        q,
        cache["k_cache"],
        cache["v_cache"],
        cache["page_table"],
        cache["cache_seqlens"],
        out,
        lse,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        softmax_scale=scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        k_cache_scales=cache.get("k_cache_scales"),
        v_cache_scales=cache.get("v_cache_scales"),
        out_scale=out_scale,
        num_splits=num_splits,
        out_partial=split_workspace[0],
        lse_partial=split_workspace[1],
        config=config,
    )
    return out, lse


def paged_refs(q, cache, *, quantize_p, **kw):
    """(fp32 reference with LSE, reference with the kernel's low-precision steps)."""
    args = (q, cache["k_cache"], cache["v_cache"], cache["page_table"], cache["cache_seqlens"])
    extra = dict(k_cache_scales=cache.get("k_cache_scales"), v_cache_scales=cache.get("v_cache_scales"))
    ref, lse = paged_attention_ref(*args, **extra, out_dtype=torch.float32, return_lse=True, **kw)
    out_dt = torch.bfloat16 if q.dtype in (E4M3, E5M2) else q.dtype
    lp = paged_attention_ref(*args, **extra, out_dtype=out_dt, quantize_p=quantize_p, **kw)
    return ref, lse, lp


def check_paged(out, lse, ref, ref_lse, ref_lp, floor=2e-3, lse_tol=1e-3):
    if DEV == "cpu":  # the interpreter's fp32 -> bf16 cast truncates: allow one output ulp
        floor = max(floor, 2.0**-7 * ref.abs().max().item())
    assert_close_fa3(out, ref, ref_lp, floor=floor)
    if lse is None:
        return
    assert not torch.isnan(lse).any(), "NaN in lse (unwritten or leaked)"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "lse -inf pattern differs"
    if fin.any():  # relative: FP8 QK^T accumulates with reduced precision on Hopper
        assert ((lse[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp_min(1.0)).max().item() <= lse_tol


def replay_at_lengths(launch, seq_buf, lengths):
    """Capture ``launch`` in a CUDA graph at the lengths now in ``seq_buf`` (after a compiling call), then
    replay it with ``lengths`` copied into ``seq_buf``."""
    launch()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch()
    seq_buf.copy_(lengths)
    g.replay()
    torch.cuda.synchronize()


def assert_row_scaled(o_rs, o_exact, out_fp8=False):
    """``o_rs`` (a non-causal call without an LSE: row sums of the e4m3 P on the tensor core) against
    ``o_exact`` (the same call with an LSE: the fp32 sum of the unrounded P). Both normalize the same P V
    accumulator, so each row of one is the other's times one factor l / l~, with |log| <= log(1 + 2^-4)
    (e4m3 moves each term by at most 2^-4 of itself), up to the output's rounding; and the factor is not
    1 everywhere, or the tensor-core sum is not in use."""
    a = o_rs.float().flatten(0, -2)
    b = o_exact.float().flatten(0, -2)
    live = (b * b).sum(-1) > 0
    assert live.any() and not torch.isnan(a).any()
    a, b = a[live], b[live]
    r = (a * b).sum(-1) / (b * b).sum(-1)  # each row's factor, least squares
    lr = r.log().abs()
    assert lr.max().item() <= math.log1p(2**-4) + 2e-3, lr.max().item()
    assert lr.max().item() > 0, "the same rows: the row sums are the fp32 ones"
    tol = 2**-3 if out_fp8 else 2**-7  # one e4m3 (half ulp <= 2^-4) / bf16 rounding on each side
    err = (a - r[:, None] * b).abs() - tol * b.abs()
    assert err.max().item() <= 1e-3 * b.abs().max().item(), err.max().item()
