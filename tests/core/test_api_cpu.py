"""The public API on CPU tensors (the reference path) over the edge grid of docs/design.md, Testing.

Every result is compared with the independent float64 oracle (tests/helpers.py::naive_attention)
computed from the dequantized inputs, with FA3's tolerance rule where the low-precision step is the
output cast (bf16 for FP8 inputs).
"""

import math

import pytest
import torch

from fp8attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from fp8attn.quant import quantize
from helpers import assert_close_fa3, fp8_inputs, naive_attention, rand_descale

E4M3 = torch.float8_e4m3fn
F64 = torch.float64


def check(out, lse, ref, ref_lse, lowp=None, name="out"):
    """out vs the float64 oracle: FA3 rule with the oracle's low-precision run (``lowp``: P rounded as
    the kernel rounds it; default the exact oracle) rounded to the output dtype as the baseline; LSE:
    same -inf pattern, finite values within fp32 accuracy."""
    assert not torch.isnan(out.float()).any(), f"{name}: NaN"
    assert_close_fa3(out.float(), ref, (ref if lowp is None else lowp).to(out.dtype).float(), name=name)
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
        assert not torch.isnan(lse).any()
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{name}: -inf pattern of lse differs"
        fin = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[fin].double(), ref_lse[fin], atol=1e-4, rtol=1e-5)


def oracle(q, k, v, p_round="dense", **kw):
    """naive_attention plus the low-precision baseline of the path the API takes: by default the dense
    kernels' P@V (P in e4m3 for e4m3 inputs, in the 16-bit input dtype for 16-bit inputs)."""
    if p_round == "dense":
        p_round = "e4m3" if q.dtype == E4M3 else q.dtype if q.dtype in (torch.bfloat16, torch.float16) else None
    if p_round is None:
        out, lse = naive_attention(q, k, v, **kw)
        return out, lse, out
    return naive_attention(q, k, v, p_round=p_round, **kw)


def make(kind, b, sq, sk, hq, hk, d, dv=None):
    """q, k, v and descale kwargs; FP8 inputs carry random non-unit (batch, nheads_k) descales."""
    dv = dv or d
    if kind == "fp8":
        q, k, v, qd, kd, vd = fp8_inputs(b, sq, sk, hq, hk, d, dv)
        return q, k, v, dict(q_descale=qd, k_descale=kd, v_descale=vd)
    q, k, v = torch.randn(b, sq, hq, d), torch.randn(b, sk, hk, d), torch.randn(b, sk, hk, dv) * 2
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), {}


SEQLEN_PAIRS = [(1, 1), (239, 1), (1, 239), (113, 203), (1023, 1024)] + [
    (a, c) for a in (127, 128, 129) for c in (127, 128, 129)
]


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SEQLEN_PAIRS)
def test_dense_seqlen_grid(sq, sk, causal, kind):
    big = sq * sk > 200_000
    b, hq, hk, d = (1, 2, 1, 32) if big else (2, 4, 2, 64)
    q, k, v, ds = make(kind, b, sq, sk, hq, hk, d)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **ds)
    assert out.shape == (b, sq, hq, d) and out.dtype == torch.bfloat16
    assert lse.shape == (b, hq, sq)
    ref, ref_lse, lowp = oracle(q, k, v, causal=causal, **ds)
    check(out, lse, ref, ref_lse, lowp)
    if causal and sq > sk:  # the first sq - sk rows see nothing
        assert (out[:, : sq - sk].float() == 0).all() and torch.isneginf(lse[:, :, : sq - sk]).all()


@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (6, 2), (8, 1), (16, 2), (3, 1)], ids=lambda x: str(x))
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_gqa_mqa_ratios(hq, hk, kind):
    q, k, v, ds = make(kind, 2, 9, 14, hq, hk, 32)
    out, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, **ds)
    check(out, lse, *oracle(q, k, v, causal=True, **ds))
    # pack_gqa is only a scheduling hint
    for pg in (True, False):
        assert torch.equal(flash_attn_func(q, k, v, causal=True, pack_gqa=pg, **ds), out)


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256), (192, 128)], ids=lambda x: str(x))
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_head_dims(d, dv, kind):
    q, k, v, ds = make(kind, 1, 17, 33, 2, 1, d, dv)
    out, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, **ds)
    assert out.shape == (1, 17, 2, dv)
    check(out, lse, *oracle(q, k, v, causal=True, **ds))


@pytest.mark.parametrize("window", [(0, 0), (3, 0), (5, 2), (-1, 4), (7, -1)], ids=str)
@pytest.mark.parametrize("sq,sk", [(10, 25), (25, 10), (16, 16)])
def test_sliding_window(window, sq, sk):
    q, k, v, ds = make("fp8", 2, sq, sk, 4, 2, 32)
    out, lse = flash_attn_func(q, k, v, window_size=window, return_attn_probs=True, **ds)
    check(out, lse, *oracle(q, k, v, window_size=window, **ds))
    # causal=True is a window whose right edge is 0
    oc = flash_attn_func(q, k, v, causal=True, window_size=(window[0], -1), **ds)
    assert torch.equal(oc, flash_attn_func(q, k, v, window_size=(window[0], 0), **ds))


def test_fully_masked_rows():
    q, k, v, ds = make("fp8", 2, 12, 4, 2, 1, 32)
    for kw in (
        dict(causal=True),
        dict(window_size=(0, 0)),
        dict(window_size=(2, 0)),
        dict(causal=True, window_size=(1, -1)),
    ):
        out, lse = flash_attn_func(q, k, v, return_attn_probs=True, **kw, **ds)
        assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any()
        assert (out[:, :8].float() == 0).all() and torch.isneginf(lse[:, :, :8]).all()
        check(out, lse, *oracle(q, k, v, **kw, **ds))
    # a window that excludes every key of every row (queries far before the keys' diagonal)
    q, k, v, ds = make("bf16", 1, 40, 4, 2, 2, 16)
    out, lse = flash_attn_func(q, k, v, window_size=(0, 30), return_attn_probs=True)
    check(out, lse, *oracle(q, k, v, window_size=(0, 30)))
    assert torch.isneginf(lse[:, :, :6]).all()


@pytest.mark.parametrize("softcap", [0.0, 2.0, 30.0])
def test_softcap(softcap):
    q, k, v, ds = make("fp8", 2, 11, 21, 4, 2, 64)
    out, lse = flash_attn_func(q, k, v, softcap=softcap, softmax_scale=0.5, causal=True, return_attn_probs=True, **ds)
    check(out, lse, *oracle(q, k, v, softcap=softcap, softmax_scale=0.5, causal=True, **ds))


@pytest.mark.parametrize("gran", ["per_tensor", "per_sequence"])
def test_descale_broadcasts(gran):
    b, s, h, d = 3, 8, 2, 32
    xs = [torch.randn(b, s, h, d) * c for c in (2, 1, 3)]
    (q8, qd), (k8, kd), (v8, vd) = (quantize(x, gran) for x in xs)
    if gran == "per_tensor":
        qd, kd, vd = qd.reshape(1, 1), kd.reshape(()), vd.reshape(1)
    out, lse = flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True)
    ref = oracle(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    check(out, lse, *ref)
    # the same values passed as a full (batch, nheads_k) tensor give identical results
    full = [
        d.reshape(-1, 1).expand(b, h).contiguous() if d.numel() > 1 else d.reshape(1, 1).expand(b, h).contiguous()
        for d in (qd, kd, vd)
    ]
    assert torch.equal(flash_attn_func(q8, k8, v8, q_descale=full[0], k_descale=full[1], v_descale=full[2]), out)


def test_descales_are_used():
    """Changing a descale changes the output the predicted way (no silently ignored scale)."""
    q, k, v, ds = make("fp8", 2, 6, 9, 2, 2, 32)
    base = flash_attn_func(q, k, v, out_dtype=torch.float32, **ds)
    vd2 = ds["v_descale"].clone()
    vd2[1, 0] *= 2
    o2 = flash_attn_func(q, k, v, out_dtype=torch.float32, **{**ds, "v_descale": vd2})
    torch.testing.assert_close(o2[1, :, 0], 2 * base[1, :, 0])
    torch.testing.assert_close(o2[0], base[0])
    qd2 = ds["q_descale"] * 3
    o3 = flash_attn_func(q, k, v, out_dtype=torch.float32, **{**ds, "q_descale": qd2})
    assert (o3 - base).abs().max() > 1e-3
    ref3 = oracle(q, k, v, **{**ds, "q_descale": qd2})
    check(o3, None, ref3[0], None, ref3[2])


@pytest.mark.parametrize("fmt", [torch.float8_e5m2, torch.float8_e4m3fnuz])
def test_other_fp8_formats_on_cpu(fmt):
    q, k, v, qd, kd, vd = fp8_inputs(2, 7, 12, 2, 1, 32, fmt=fmt)
    out, lse = flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=True, return_attn_probs=True)
    check(out, lse, *oracle(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=True))


def test_out_dtype_out_and_out_scale():
    q, k, v, ds = make("fp8", 2, 9, 13, 4, 2, 32)
    ref, _, lowp = oracle(q, k, v, causal=True, **ds)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        o = flash_attn_func(q, k, v, causal=True, out_dtype=dt, **ds)
        assert o.dtype == dt
        check(o, None, ref, None, lowp)
        buf = torch.full((2, 9, 4, 32), float("nan"), dtype=dt)
        o2 = flash_attn_func(q, k, v, causal=True, out=buf, out_dtype=dt if dt != torch.bfloat16 else None, **ds)
        assert o2 is buf and torch.equal(buf, o)
    osc = torch.tensor(0.02)
    o8 = flash_attn_func(q, k, v, causal=True, out_scale=osc, **ds)
    assert o8.dtype == E4M3
    o32 = flash_attn_func(q, k, v, causal=True, out_dtype=torch.float32, **ds)
    expect = (o32 / osc).clamp(-448, 448).to(E4M3)
    # equal to clamp(out / out_scale).to(e4m3) within one e4m3 ulp
    diff = (o8.view(torch.uint8).int() - expect.view(torch.uint8).int()).abs()
    assert diff.max().item() <= 1
    buf8 = torch.empty(2, 9, 4, 32, dtype=E4M3)
    assert flash_attn_func(q, k, v, causal=True, out_scale=osc, out=buf8, **ds) is buf8


def test_16bit_dtypes_keep_dtype():
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(1, 5, 2, 16).to(dt) for _ in range(3))
        out, lse = flash_attn_func(q, k, v, return_attn_probs=True)
        assert out.dtype == dt
        check(out, lse, *oracle(q, k, v))


def test_deterministic_reruns():
    q, k, v, ds = make("fp8", 2, 33, 47, 4, 2, 64)
    a = flash_attn_func(q, k, v, causal=True, **ds)
    b = flash_attn_func(q, k, v, causal=True, deterministic=True, **ds)
    assert torch.equal(a, b)


def _seq_major(v):
    """v with the same values, memory order (batch, heads, dim, seqlen) (varlen: (heads, dim, total))."""
    return v.movedim(-3, -1).contiguous().movedim(-1, -3)


def test_v_with_contiguous_sequence_dim():
    """FP8 V whose sequence dim is contiguous (quantize_qkv's v8) is accepted by the dense and varlen
    APIs and gives the same result as row-major V; any other layout without a contiguous last dim is a
    ValueError naming v and both accepted layouts."""
    q, k, v, ds = make("fp8", 2, 33, 47, 4, 2, 64)
    a = flash_attn_func(q, k, v, causal=True, **ds)
    vs = _seq_major(v)
    assert vs.stride(-3) == 1 and vs.stride(-1) != 1
    assert torch.equal(flash_attn_func(q, k, vs, causal=True, **ds), a)
    cu_q = torch.tensor([0, 33, 66], dtype=torch.int32)
    cu_k = torch.tensor([0, 47, 94], dtype=torch.int32)
    qv, kv, vv = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    var = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=33, max_seqlen_k=47, causal=True, **ds)
    b = flash_attn_varlen_func(qv, kv, vv, **var)
    assert torch.equal(flash_attn_varlen_func(qv, kv, _seq_major(vv), **var), b)
    bad = v.transpose(-1, -2).contiguous().transpose(-1, -2)  # head dim strided, sequence dim not contiguous
    with pytest.raises(ValueError, match=r"^v: .*contiguous sequence dimension"):
        flash_attn_func(q, k, bad, **ds)


def test_softmax_scale_default():
    q, k, v, ds = make("bf16", 1, 5, 7, 2, 2, 64)
    assert torch.equal(flash_attn_func(q, k, v), flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(64)))


# ----------------------------------------------------------------------------------------------- varlen
def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_varlen_zero_length_sequences(causal, kind):
    lq = [3, 0, 5, 1, 0, 129]
    lk = [4, 2, 0, 7, 0, 128]
    b, hq, hk, d = len(lq), 4, 2, 32
    q, k, v, ds = make(kind, 1, sum(lq), sum(lk), hq, hk, d)
    q, k, v = q[0], k[0], v[0]
    if ds:  # per-sequence variation around the scales the values were quantized with
        ds = {n: t.expand(b, hk) * rand_descale(b, hk, 0.5, 1.5) for n, t in ds.items()}
    cq, ck = _cu(lq), _cu(lk)
    out, lse = flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=causal, return_attn_probs=True, **ds)
    assert out.shape == (sum(lq), hq, d) and lse.shape == (hq, sum(lq))
    for i in range(b):
        if lq[i] == 0:
            continue
        qs, ks = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        dsi = {n: t[i : i + 1] for n, t in ds.items()}
        ref, ref_lse, lowp = oracle(q[None, qs], k[None, ks], v[None, ks], causal=causal, **dsi)
        check(out[None, qs], lse[None, :, qs], ref, ref_lse, lowp, name=f"seq{i}")
        if lk[i] == 0:
            assert (out[qs].float() == 0).all() and torch.isneginf(lse[:, qs]).all()


def test_varlen_seqused():
    lq, lk = [4, 6, 3], [5, 8, 2]
    used_q, used_k = [2, 6, 0], [5, 3, 2]
    q, k, v, ds = make("fp8", 1, sum(lq), sum(lk), 2, 1, 32)
    q, k, v = q[0], k[0], v[0]
    cq, ck = _cu(lq), _cu(lk)
    ds = {n: t.expand(3, 1) * rand_descale(3, 1, 0.5, 1.5) for n, t in ds.items()}
    out, lse = flash_attn_varlen_func(
        q,
        k,
        v,
        cq,
        ck,
        6,
        8,
        seqused_q=torch.tensor(used_q, dtype=torch.int32),
        seqused_k=torch.tensor(used_k, dtype=torch.int32),
        causal=True,
        return_attn_probs=True,
        **ds,
    )
    assert not torch.isnan(out.float()).any()
    for i in range(3):
        q0, k0 = int(cq[i]), int(ck[i])
        if used_q[i]:
            dsi = {n: t[i : i + 1] for n, t in ds.items()}
            ref, ref_lse, lowp = oracle(
                q[None, q0 : q0 + used_q[i]],
                k[None, k0 : k0 + used_k[i]],
                v[None, k0 : k0 + used_k[i]],
                causal=True,
                **dsi,
            )
            check(out[None, q0 : q0 + used_q[i]], lse[None, :, q0 : q0 + used_q[i]], ref, ref_lse, lowp)
        # rows past seqused_q are not attended: 0 output
        assert (out[q0 + used_q[i] : int(cq[i + 1])].float() == 0).all()


def test_varlen_all_empty_batch():
    q = torch.randn(0, 2, 32).bfloat16()
    k = torch.randn(0, 2, 32).bfloat16()
    cu = torch.zeros(3, dtype=torch.int32)
    out, lse = flash_attn_varlen_func(q, k, k, cu, cu, 0, 0, return_attn_probs=True)
    assert out.shape == (0, 2, 32) and lse.shape == (2, 0)


# ----------------------------------------------------------------------------- contiguous KV cache
def test_kvcache_contiguous_with_cache_batch_idx():
    bc, L, hk, d = 4, 20, 2, 32
    kc8, kd = quantize(torch.randn(bc, L, hk, d), "per_tensor")
    vc8, vd = quantize(torch.randn(bc, L, hk, d), "per_tensor")
    kd, vd = kd.reshape(1, 1), vd.reshape(1, 1)
    q = torch.randn(2, 3, 4, d).bfloat16()
    idx = torch.tensor([3, 1], dtype=torch.int32)
    lens = torch.tensor([20, 7], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(
        q,
        kc8,
        vc8,
        cache_seqlens=lens,
        cache_batch_idx=idx,
        k_descale=kd,
        v_descale=vd,
        causal=True,
        return_softmax_lse=True,
    )
    for i in range(2):
        r = int(idx[i])
        # bf16 Q over an e4m3 cache: the paged kernel's fp16 dots (P rounded to fp16)
        ref, ref_lse, lowp = oracle(
            q[i : i + 1],
            kc8[r : r + 1, : lens[i]],
            vc8[r : r + 1, : lens[i]],
            causal=True,
            k_descale=kd,
            v_descale=vd,
            p_round=torch.float16,
        )
        check(out[i : i + 1], lse[i : i + 1], ref, ref_lse, lowp)


def test_kvcache_v_seq_major_append_and_attend():
    """A sequence-major V cache through the public API: appends (k=, v=) and attention give the standard
    layout's result; a V cache with any other non-contiguous last dim is rejected with the fix."""
    from fp8attn.paged_cache import alloc_paged_cache, is_v_seq_major

    b, hq, hk, d, ps, nb = 2, 4, 2, 32, 16, 8
    g = torch.Generator().manual_seed(0)
    pt = torch.randperm(nb, generator=g).to(torch.int32).view(b, nb // b)
    res = []
    for seq_major in (False, True):
        kc, vc = alloc_paged_cache(nb, ps, hk, d, poison_nan=True, v_seq_major=seq_major)
        assert is_v_seq_major(vc) == seq_major
        lens = torch.zeros(b, dtype=torch.int32)
        torch.manual_seed(1)
        outs = []
        for step in (37, 1, 5):  # a prefill chunk, a decode token, a short chunk
            q = torch.randn(b, step, hq, d).bfloat16()
            k, v = torch.randn(b, step, hk, d).bfloat16(), torch.randn(b, step, hk, d).bfloat16()
            o = flash_attn_with_kvcache(
                q,
                kc,
                vc,
                k=k,
                v=v,
                cache_seqlens=lens,
                page_table=pt,
                causal=True,
                k_descale=torch.tensor([[0.02]]),
                v_descale=torch.tensor([[0.03]]),
            )
            lens = lens + step
            outs.append(o)
        res.append(outs)
    for a, s in zip(*res):
        assert not torch.isnan(s.float()).any()
        assert torch.equal(a, s)
    kc, vc = alloc_paged_cache(nb, ps, hk, d)
    bad = torch.empty(nb, ps, d, hk).permute(0, 1, 3, 2).to(vc.dtype)  # head dim strided by nheads_k
    with pytest.raises(ValueError, match="v_cache.*sequence-major"):
        flash_attn_with_kvcache(
            torch.randn(b, 1, hq, d).bfloat16(),
            kc,
            bad,
            page_table=pt,
            cache_seqlens=torch.ones(b, dtype=torch.int32),
            k_descale=torch.tensor([[0.02]]),
            v_descale=torch.tensor([[0.03]]),
        )


def test_kvcache_split_workspace():
    """``split_workspace=``: a preallocated (out_partial, lse_partial) gives the same result as partials
    allocated per call (varlen too); wrong workspaces are rejected naming the argument and the fix."""
    from fp8attn import split_workspace
    from fp8attn.paged_cache import alloc_paged_cache

    b, hq, hk, d, ps, nb = 3, 4, 2, 32, 16, 12
    kc, vc = alloc_paged_cache(nb, ps, hk, d, poison_nan=True)
    pt = torch.randperm(nb).to(torch.int32).view(b, nb // b)
    lens = torch.tensor([40, 3, 17], dtype=torch.int32)
    k, v = torch.randn(b, 40, hk, d).bfloat16(), torch.randn(b, 40, hk, d).bfloat16()
    kw = dict(k_descale=torch.tensor([[0.02]]), v_descale=torch.tensor([[0.03]]), causal=True)
    flash_attn_with_kvcache(
        torch.randn(b, 40, hq, d).bfloat16(),
        kc,
        vc,
        k=k,
        v=v,
        page_table=pt,
        cache_seqlens=torch.zeros(b, dtype=torch.int32),
        **kw,
    )
    q = torch.randn(b, 1, hq, d).bfloat16()
    ws = split_workspace(q, 5, d)
    o1, l1 = flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=lens, page_table=pt, num_splits=3, return_softmax_lse=True, **kw
    )
    o2, l2 = flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=lens, page_table=pt, num_splits=3, return_softmax_lse=True, split_workspace=ws, **kw
    )
    assert torch.equal(o1, o2) and torch.equal(l1, l2) and not torch.isnan(o2.float()).any()
    qv = torch.randn(4, hq, d).bfloat16()  # varlen: decode rows and a 2-query chunk
    cu = torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    vkw = dict(cache_seqlens=lens, page_table=pt, cu_seqlens_q=cu, max_seqlen_q=2, num_splits=2, **kw)
    assert torch.equal(
        flash_attn_with_kvcache(qv, kc, vc, **vkw),
        flash_attn_with_kvcache(qv, kc, vc, split_workspace=split_workspace(qv, 2, d), **vkw),
    )
    call = dict(cache_seqlens=lens, page_table=pt, **kw)
    bad = [
        (dict(num_splits=3, split_workspace=ws[0]), TypeError, "split_workspace: expected a tuple"),
        (dict(num_splits=0, split_workspace=ws), ValueError, "explicit num_splits"),
        (dict(num_splits=6, split_workspace=ws), ValueError, r"out_partial contiguous float32 \(>= 6"),
        (dict(num_splits=2, split_workspace=split_workspace(q, 2, d + 1)), ValueError, "out_partial"),
        (dict(num_splits=2, split_workspace=(ws[0], ws[1].double())), ValueError, "lse_partial.*float64"),
        (
            dict(num_splits=2, split_workspace=(ws[0].transpose(1, 3).contiguous().transpose(1, 3), ws[1])),
            ValueError,
            "not contiguous",
        ),
        (dict(num_splits=2, split_workspace=ws, attention_chunk=16), ValueError, "attention_chunk"),
    ]
    for extra, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            flash_attn_with_kvcache(q, kc, vc, **call, **extra)


# ------------------------------------------------------------------ the CPU path rounds P like the GPU
def test_cpu_path_rounds_p_like_the_kernels():
    """e4m3 inputs: P in e4m3 (FP8 P@V); bf16 inputs: P in bf16; bf16 Q over an e4m3 paged cache: P in
    fp16 (the paged kernel's fp16 dots). Each equals the reference with that switch and differs from
    the exact-P reference."""
    from fp8attn.paged_cache import make_page_table, to_v_seq_major
    from fp8attn.reference import attention_ref, paged_attention_ref

    for kind, model in (("fp8", dict(quantize_p=True)), ("bf16", dict(p_dtype=torch.bfloat16))):
        q, k, v, ds = make(kind, 2, 17, 40, 4, 2, 64)
        out = flash_attn_func(q, k, v, causal=True, out_dtype=torch.float32, **ds)
        kw = dict(causal=True, out_dtype=torch.float32, **ds)
        assert torch.equal(out, attention_ref(q, k, v, **kw, **model)), kind
        assert not torch.equal(out, attention_ref(q, k, v, **kw)), kind
    lens, ps, hk, d = [40, 9], 16, 2, 64
    pt = make_page_table(lens, ps, 8, generator=torch.Generator().manual_seed(0))
    kc, kd = quantize(torch.randn(8, ps, hk, d), "per_tensor")
    vc, vd = quantize(torch.randn(8, ps, hk, d), "per_tensor")
    q = torch.randn(2, 3, 4, d).bfloat16()
    cs = torch.tensor(lens, dtype=torch.int32)
    kw = dict(k_descale=kd.reshape(1, 1), v_descale=vd.reshape(1, 1), causal=True)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, page_table=pt, out_dtype=torch.float32, **kw)
    ref16 = paged_attention_ref(q, kc, vc, pt, cs, out_dtype=torch.float32, p_dtype=torch.float16, **kw)
    assert torch.equal(out, ref16)
    assert not torch.equal(out, paged_attention_ref(q, kc, vc, pt, cs, out_dtype=torch.float32, **kw))
    # e4m3 Q: over V in FA3's layout the Triton kernel's P@V runs in fp16 (P in fp16); over sequence-major V,
    # and in the prefill chunks the paged TMA kernel takes, P@V is FP8 (P in e4m3)
    q8, qd = quantize(torch.randn(2, 3, 4, d), "per_tensor")
    kw8 = dict(kw, q_descale=qd.reshape(1, 1))
    out = flash_attn_with_kvcache(q8, kc, vc, cache_seqlens=cs, page_table=pt, out_dtype=torch.float32, **kw8)
    assert torch.equal(
        out, paged_attention_ref(q8, kc, vc, pt, cs, out_dtype=torch.float32, p_dtype=torch.float16, **kw8)
    )
    vs = to_v_seq_major(vc)
    out = flash_attn_with_kvcache(q8, kc, vs, cache_seqlens=cs, page_table=pt, out_dtype=torch.float32, **kw8)
    assert torch.equal(out, paged_attention_ref(q8, kc, vc, pt, cs, out_dtype=torch.float32, quantize_p=True, **kw8))
    q8l, qdl = quantize(torch.randn(2, 9, 4, d), "per_tensor")  # 18 rows per kv head: small tiles
    kw8 = dict(kw, q_descale=qdl.reshape(1, 1))
    out = flash_attn_with_kvcache(q8l, kc, vc, cache_seqlens=cs, page_table=pt, out_dtype=torch.float32, **kw8)
    assert torch.equal(
        out, paged_attention_ref(q8l, kc, vc, pt, cs, out_dtype=torch.float32, p_dtype=torch.float16, **kw8)
    )
    q8p, qdp = quantize(torch.randn(2, 9, 16, d), "per_tensor")  # 72 rows per kv head: prefill tiles, P in fp16
    kw8 = dict(kw, q_descale=qdp.reshape(1, 1))
    out = flash_attn_with_kvcache(q8p, kc, vc, cache_seqlens=cs, page_table=pt, out_dtype=torch.float32, **kw8)
    assert torch.equal(
        out, paged_attention_ref(q8p, kc, vc, pt, cs, out_dtype=torch.float32, p_dtype=torch.float16, **kw8)
    )
    out = flash_attn_with_kvcache(q8p, kc, vs, cache_seqlens=cs, page_table=pt, out_dtype=torch.float32, **kw8)
    assert torch.equal(out, paged_attention_ref(q8p, kc, vc, pt, cs, out_dtype=torch.float32, quantize_p=True, **kw8))


def test_cpu_path_rounds_p_like_the_paged_tma_kernel():
    """FP8 Q over an e4m3 cache in FA3's layout: the prefill chunks the paged TMA kernel takes (a multiple of
    128 queries; in a varlen call, each sequence of 128 queries or more) round P to e4m3 as that kernel
    does; the rest of the call, and calls it does not take (a window, splits, a float32 output), round P to
    fp16 as the Triton kernel does."""
    from fp8attn.paged_cache import make_page_table
    from fp8attn.reference import paged_attention_ref

    lens, ps, hk, hq, d = [300, 140], 16, 2, 4, 64
    pt = make_page_table(lens, ps, 40, generator=torch.Generator().manual_seed(1))
    kc, kd = quantize(torch.randn(40, ps, hk, d), "per_tensor")
    vc, vd = quantize(torch.randn(40, ps, hk, d), "per_tensor")
    cs = torch.tensor(lens, dtype=torch.int32)
    q8, qd = quantize(torch.randn(2, 128, hq, d), "per_tensor")
    kw = dict(q_descale=qd.reshape(1, 1), k_descale=kd.reshape(1, 1), v_descale=vd.reshape(1, 1), causal=True)

    def ref(q, p8, **extra):
        return paged_attention_ref(
            q,
            kc,
            vc,
            pt,
            cs,
            **{"out_dtype": torch.bfloat16, **kw, **extra},
            **(dict(quantize_p=True) if p8 else dict(p_dtype=torch.float16)),
        )

    out = flash_attn_with_kvcache(q8, kc, vc, cache_seqlens=cs, page_table=pt, out_dtype=torch.bfloat16, **kw)
    assert torch.equal(out, ref(q8, True))
    for extra in (dict(window_size=(64, 0)), dict(num_splits=2), dict(out_dtype=torch.float32)):
        out = flash_attn_with_kvcache(
            q8, kc, vc, cache_seqlens=cs, page_table=pt, **{"out_dtype": torch.bfloat16, **kw, **extra}
        )
        assert torch.equal(out, ref(q8, False, **{k: v for k, v in extra.items() if k != "num_splits"})), extra
    # varlen: a 130-query chunk (e4m3 P) beside a 3-query chunk (fp16 P)
    qv = q8.reshape(-1, hq, d)[:133]
    cu = torch.tensor([0, 130, 133], dtype=torch.int32)
    vkw = dict(cu_seqlens_q=cu, max_seqlen_q=130)
    out = flash_attn_with_kvcache(
        qv, kc, vc, cache_seqlens=cs, page_table=pt, out_dtype=torch.bfloat16, cu_seqlens_q=cu, max_seqlen_q=130, **kw
    )
    assert torch.equal(out[:130], ref(qv, True, **vkw)[:130])
    assert torch.equal(out[130:], ref(qv, False, **vkw)[130:])
    assert not torch.equal(out[:130], ref(qv, False, **vkw)[:130])
