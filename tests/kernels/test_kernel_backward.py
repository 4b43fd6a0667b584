"""Attention backward kernels (kernels/backward.py) against float64 autograd on the dequantized inputs.

CPU: the kernels run under TRITON_INTERPRET=1 at tiny shapes. The oracle is float64 torch autograd of
attention on the dequantized inputs (random non-unit per-(batch, kv head) descales). Tolerance (docs/design.md,
Testing): max|kernel - oracle| <= 2 * max|lowprec - oracle| + floor, plus the same rule on the mean error,
where ``lowprec`` is:

* mode "dequantized": a float64 backward that rounds P and dS to bf16 before their products, as the
  kernel does (its accumulators are fp32);
* mode "fp8": a float64 emulation of the FP8-matmul backward that rounds dO, P * 2**8 and dS to e4m3
  with ONE scale per (sequence, head) (448 / amax). The kernel scales per tile, which is finer (a
  tile's amax is at most the head's), so its rounding error is no larger than this emulation's in
  expectation; the rule's factor 2 covers the sampling noise between the two.

The floor is 2e-3 of the oracle's largest magnitude (bf16 resolves 4e-3 relative).
"""

import math
import os

import pytest
import torch
import triton
import triton.language as tl

from fp8attn.kernels.backward import _tile_inv_scale, _to_e4m3, launch_attention_bwd
from helpers import assert_close_fa3

E4M3 = torch.float8_e4m3fn
DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU_DEV = "cuda"  # the gpu tests' device (their helpers also run on the CPU at toy shapes)


# ------------------------------------------------------------------------------------------------
# oracle
# ------------------------------------------------------------------------------------------------
def _visible(sq, sk, causal, wl, wr, device):
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    shift = sk - sq
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        keep &= j <= i + shift
    if wl >= 0:
        keep &= j >= i + shift - wl
    if wr >= 0:
        keep &= j <= i + shift + wr
    return keep


def _attn_seq(q, k, v, scale, causal, wl, wr, softcap):
    """One sequence, head-first: q (Hq, Sq, D), k (Hk, Sk, D), v (Hk, Sk, Dv) -> (out, lse, t).
    Rows that see no key get out = 0, lse = -inf (no NaN on the way, so autograd stays finite)."""
    g = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(g, 0)
    v = v.repeat_interleave(g, 0)
    s = torch.einsum("hmd,hnd->hmn", q, k) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    keep = _visible(q.shape[1], k.shape[1], causal, wl, wr, q.device).expand_as(s)
    any_key = keep.any(-1, keepdim=True)
    s_safe = torch.where(keep, s, torch.full_like(s, -math.inf))
    s_safe = torch.where(any_key, s_safe, torch.zeros_like(s))
    lse = torch.logsumexp(s_safe, -1, keepdim=True)
    p = torch.where(keep, torch.exp(s - lse), torch.zeros_like(s))
    out = p @ v
    return out, torch.where(any_key, lse, torch.full_like(lse, -math.inf))[..., 0], p, t


def _fp8_round(x):
    """e4m3 rounding with one scale per head (dim 0): 448 / amax, as the module docstring explains."""
    if x.numel() == 0:
        return x
    inv = 448.0 / x.abs().amax(dim=(1, 2), keepdim=True).clamp_min(1e-30)
    return (x * inv).clamp(-448, 448).to(E4M3).double() / inv


def _round_bf16(x):
    return x.to(torch.bfloat16).double()


def _round_fp8_p(p):
    return (p * 256).to(E4M3).double() / 256


def _emul_seq(q, k, v, do, out_lp, scale, causal, wl, wr, softcap, mode):
    """Float64 backward of one sequence with the kernel's low-precision steps: mode "dequantized" rounds P
    and dS to bf16 (dO is bf16 already); mode "fp8" rounds dO, P * 2**8 and dS to e4m3 (per-head scales)."""
    q, k, v, do, out_lp = (x.double() for x in (q, k, v, do, out_lp))
    g = q.shape[0] // k.shape[0]
    _, _, p, t = _attn_seq(q, k, v, scale, causal, wl, wr, softcap)
    ke, ve = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    rd, rp, rs = (_fp8_round, _round_fp8_p, _fp8_round) if mode == "fp8" else (lambda x: x, _round_bf16, _round_bf16)
    do_r = rd(do)
    dv = rp(p).transpose(1, 2) @ do_r
    dp = do_r @ ve.transpose(1, 2)
    delta = (do * out_lp).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if softcap:
        ds = ds * (1 - t * t)
    ds = rs(ds)
    dq = scale * ds @ ke
    dk = scale * ds.transpose(1, 2) @ q
    hk = k.shape[0]
    return dq, dk.view(hk, g, *dk.shape[1:]).sum(1), dv.view(hk, g, *dv.shape[1:]).sum(1)


def _grads_seq(q, k, v, do, scale, causal, wl, wr, softcap, dtype):
    """(out, lse, dq, dk, dv) by autograd in ``dtype`` of one head-first sequence."""
    q, k, v = (x.to(dtype).detach().requires_grad_() for x in (q, k, v))
    out, lse, _, _ = _attn_seq(q, k, v, scale, causal, wl, wr, softcap)
    out.backward(do.to(dtype))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------
def _make(seqs_q, seqs_k, hq, hk, d, dv, *, fp8=True, varlen=False, v_seq_major=False, dtype=torch.bfloat16):
    """Random inputs. Dense when ``varlen`` is False (all seqs equal). Returns a dict with the kernel's
    tensors (rows past each sequence NaN-poisoned for varlen) and per-sequence dequantized float64 views."""
    b = len(seqs_q)
    pad_q, pad_k = (7, 5) if varlen else (0, 0)
    tq, tk = sum(seqs_q) + pad_q, sum(seqs_k) + pad_k
    cu_q = torch.tensor([0] + list(torch.tensor(seqs_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(seqs_k).cumsum(0)), dtype=torch.int32)
    if fp8:
        desc = [torch.rand(b, hk) + 0.5 for _ in range(3)]
        raw = [torch.randn(tq, hq, d), torch.randn(tk, hk, d), torch.randn(tk, hk, dv) * 2]
        x8 = [r.to(E4M3) for r in raw]
        # dequantized float64 per token: sequence b's tokens use descale[b]
        seq_of_q = torch.repeat_interleave(torch.arange(b), torch.tensor(seqs_q))
        seq_of_k = torch.repeat_interleave(torch.arange(b), torch.tensor(seqs_k))
        g = hq // hk
        deq = [
            x8[0][: sum(seqs_q)].double() * desc[0].double().repeat_interleave(g, 1)[seq_of_q][:, :, None],
            x8[1][: sum(seqs_k)].double() * desc[1].double()[seq_of_k][:, :, None],
            x8[2][: sum(seqs_k)].double() * desc[2].double()[seq_of_k][:, :, None],
        ]
        q, k, v = x8
    else:
        desc = [None] * 3
        q, k, v = (torch.randn(n, h, dd).to(dtype) for n, h, dd in ((tq, hq, d), (tk, hk, d), (tk, hk, dv)))
        deq = [q[: sum(seqs_q)].double(), k[: sum(seqs_k)].double(), v[: sum(seqs_k)].double()]
    do = torch.randn(tq, hq, dv).to(torch.bfloat16)
    if varlen:
        for x, n in ((q, sum(seqs_q)), (k, sum(seqs_k)), (v, sum(seqs_k)), (do, sum(seqs_q))):
            x[n:] = float("nan")
    if v_seq_major:  # memory order (heads, dv, tokens), logical (tokens, heads, dv)
        v = v.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    return dict(
        q=q,
        k=k,
        v=v,
        do=do,
        desc=desc,
        deq=deq,
        cu_q=cu_q,
        cu_k=cu_k,
        seqs_q=seqs_q,
        seqs_k=seqs_k,
        hq=hq,
        hk=hk,
        varlen=varlen,
    )


def _references(inp, scale, causal, wl, wr, softcap, mode):
    """Per-sequence float64 oracle, the low-precision reference and the forward's out/lse, concatenated
    in the varlen token layout: dict of (total, H, D) tensors and lse (Hq, total_q)."""
    res = {n: [] for n in ("out", "lse", "dq", "dk", "dv", "lq", "lk", "lv")}
    oq = ok = 0
    for sq, sk in zip(inp["seqs_q"], inp["seqs_k"]):
        q, k, v = (
            x.transpose(0, 1)
            for x in (inp["deq"][0][oq : oq + sq], inp["deq"][1][ok : ok + sk], inp["deq"][2][ok : ok + sk])
        )
        do = inp["do"][oq : oq + sq].transpose(0, 1).double()
        out, lse, dq, dk, dv = _grads_seq(q, k, v, do, scale, causal, wl, wr, softcap, torch.float64)
        out_lp = out.to(torch.bfloat16).double()
        lq, lk, lv = _emul_seq(q, k, v, do, out_lp, scale, causal, wl, wr, softcap, mode)
        for n, x in (("out", out_lp), ("dq", dq), ("dk", dk), ("dv", dv), ("lq", lq), ("lk", lk), ("lv", lv)):
            res[n].append(x.double().transpose(0, 1))
        res["lse"].append(lse.float())
        oq, ok = oq + sq, ok + sk
    cat = {n: torch.cat(x, 0) for n, x in res.items() if n != "lse"}
    cat["lse"] = torch.cat(res["lse"], 1)
    return cat


def _kernel_args(inp, ref, *, causal, wl, wr, softcap, mode, grad_dtype, lse_shift=0.0):
    """(views, grads, kwargs) of ``launch_attention_bwd`` for ``inp`` with the forward's out/lse from ``ref``
    (``lse_shift`` added to the LSE); grads NaN-filled."""
    d, dv_dim = inp["q"].shape[-1], inp["v"].shape[-1]
    b, hq, hk = len(inp["seqs_q"]), inp["hq"], inp["hk"]
    nq = sum(inp["seqs_q"])
    tq = inp["q"].shape[0]
    out = torch.full((tq, hq, dv_dim), float("nan"), dtype=torch.bfloat16)
    out[:nq] = ref["out"].to(torch.bfloat16)
    lse = torch.full((hq, tq), float("nan"))
    lse[:, :nq] = ref["lse"] + lse_shift
    q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
    kw = dict(
        q_descale=inp["desc"][0],
        k_descale=inp["desc"][1],
        v_descale=inp["desc"][2],
        softmax_scale=d**-0.5,
        causal=causal,
        window_left=wl,
        window_right=wr,
        softcap=softcap,
        mode=mode,
    )
    if inp["varlen"]:
        kw.update(
            cu_seqlens_q=inp["cu_q"],
            cu_seqlens_k=inp["cu_k"],
            max_seqlen_q=max(inp["seqs_q"]),
            max_seqlen_k=max(inp["seqs_k"]),
        )
        views = (do, q, k, v, out, lse)
    else:
        sq, sk = inp["seqs_q"][0], inp["seqs_k"][0]
        views = (
            do.view(b, sq, hq, dv_dim),
            q.view(b, sq, hq, d),
            k.view(b, sk, hk, d),
            v.unflatten(0, (b, sk)),
            out.view(b, sq, hq, dv_dim),
            lse.view(hq, b, sq).transpose(0, 1),
        )
    views = tuple(x.to(DEV) for x in views)
    kw = {n: (x.to(DEV) if torch.is_tensor(x) else x) for n, x in kw.items()}
    grads = [torch.full(x.shape, float("nan"), dtype=grad_dtype, device=DEV) for x in views[1:4]]
    return views, grads, kw


def _run_and_check(
    inp,
    *,
    causal=False,
    wl=-1,
    wr=-1,
    softcap=0.0,
    mode="dequantized",
    grad_dtype=torch.float32,
    rerun=False,
    deterministic=False,
):
    ref = _references(inp, inp["q"].shape[-1] ** -0.5, causal, wl, wr, softcap, mode)
    nq, nk = sum(inp["seqs_q"]), sum(inp["seqs_k"])
    views, grads, kw = _kernel_args(
        inp, ref, causal=causal, wl=wl, wr=wr, softcap=softcap, mode=mode, grad_dtype=grad_dtype
    )
    kw["deterministic"] = deterministic
    launch_attention_bwd(*views, *grads, **kw)
    dq, dk, dv = (g.reshape(-1, *g.shape[-2:]).cpu() for g in grads)
    if inp["varlen"]:
        for g, n in ((dq, nq), (dk, nk), (dv, nk)):
            assert (g[n:] == 0).all(), "varlen rows after the last sequence must be zero"
    for name, got, r, lo in (
        ("dq", dq[:nq], ref["dq"], ref["lq"]),
        ("dk", dk[:nk], ref["dk"], ref["lk"]),
        ("dv", dv[:nk], ref["dv"], ref["lv"]),
    ):
        floor = 2e-3 * r.abs().max().item() + 1e-6
        # the reference takes the kernel's last rounding too: the store in the gradient dtype
        assert_close_fa3(got.float(), r, lo.to(grad_dtype), floor=floor, name=name)
    if rerun:
        again = [torch.empty_like(g) for g in grads]
        launch_attention_bwd(*views, *again, **kw)
        for g, a in zip(grads, again):
            assert torch.equal(g, a), "rerun not bit-identical"
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------
# CPU (interpreter) tests
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mode", ["dequantized", "fp8"])
def test_dense_gqa_noncausal(mode, deterministic):
    # deterministic=False adds dQ atomically in the dK/dV kernel, True runs the separate dQ pass
    inp = _make([37], [37], 4, 2, 64, 64)
    _run_and_check(inp, mode=mode, deterministic=deterministic)


@pytest.mark.parametrize("mode", ["dequantized", "fp8"])
def test_dense_mqa_causal_sq_ne_sk(mode):
    inp = _make([21], [40], 3, 1, 64, 64)
    _run_and_check(inp, causal=True, mode=mode, rerun=True, deterministic=True)


def test_causal_more_queries_than_keys_rows_without_keys():
    # bottom-right alignment: the first 40 - 23 queries see no key (lse = -inf, zero gradient)
    inp = _make([40], [23], 2, 2, 64, 64)
    dq, _, _ = _run_and_check(inp, causal=True)
    assert (dq[:17] == 0).all()


@pytest.mark.parametrize("wl,wr", [(6, 3), (35, 25)])  # narrower than a tile; wide enough for unmasked tiles
def test_window_softcap_bf16_grads(wl, wr):
    inp = _make([45], [50], 2, 2, 64, 64)
    _run_and_check(inp, wl=wl, wr=wr, softcap=8.0, grad_dtype=torch.bfloat16)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mode", ["dequantized", "fp8"])
def test_varlen_empty_seq_nan_poison_seqmajor_v(mode, deterministic):
    # lengths not multiples of the block, an empty query sequence and an empty key sequence
    inp = _make([19, 0, 29, 5], [21, 9, 35, 0], 4, 2, 64, 64, varlen=True, v_seq_major=True)
    _run_and_check(inp, causal=True, mode=mode, deterministic=deterministic)


@pytest.mark.parametrize("mode", ["dequantized", "fp8"])
def test_fused_dq_16bit_grads_causal_gqa(mode):
    # dQ added atomically in the dK/dV kernel (fp8 mode; d64 causal in the dequantized mode) into an fp32
    # accumulator, then copied into the bf16 dq
    inp = _make([33], [47], 4, 2, 64, 64)
    _run_and_check(inp, causal=True, mode=mode, grad_dtype=torch.bfloat16)


@pytest.mark.parametrize("deterministic", [False, True])
def test_headdim_192_128_causal_gqa(deterministic):
    inp = _make([18], [27], 2, 1, 192, 128)
    _run_and_check(inp, causal=True, deterministic=deterministic)


def test_16bit_inputs_seqmajor_v():
    inp = _make([26, 26], [31, 31], 2, 1, 64, 64, fp8=False, v_seq_major=True)
    _run_and_check(inp, causal=True, rerun=True, deterministic=True)


def test_hopper_causal_group_chunk():
    """The dequantized kernel's grid and group chunk (``backward_launch._grid``, ``group_chunk``): without a mask
    the plain (key blocks, batch, kv heads) grid, chunk 1 (every CTA the same work); under one a 1-D grid, chunked
    by the largest power of two that divides the groups and keeps a chunk within 128 CTAs at d128, 256 at d64, so
    that the heavy key blocks of the last chunks do not end the grid."""
    from fp8attn.kernels.hopper.backward_launch import BLOCK_N, HAS_GLUON, _grid

    if not HAS_GLUON:
        pytest.skip("this triton has no Gluon")
    # (key blocks, groups, head dim) -> chunk: S1k..16k at 16k tokens x 16 heads, odd and small group counts
    cases = {
        (8, 256, 128): 16,
        (16, 128, 128): 8,
        (32, 64, 128): 4,
        (64, 32, 128): 2,
        (128, 16, 128): 1,
        (8, 256, 64): 32,
        (32, 64, 64): 8,
        (128, 16, 64): 2,
        (256, 8, 64): 1,
        (32, 6, 64): 2,
        (32, 3, 128): 1,
        (300, 64, 64): 1,
        (1, 1, 128): 1,
    }
    for (blocks, groups, d), want in cases.items():
        sk = blocks * BLOCK_N - 1  # a partial last key block counts as a block
        assert _grid(sk, groups, 1, d, causal=True) == ((blocks * groups,), want), (blocks, groups, d)
        assert _grid(sk, groups, 1, d, causal=False) == ((blocks, groups, 1), 1)


def test_hopper_kernel_rules():
    """Which calls the Hopper kernel takes (``bwd_unsupported_reason``, the sm90 rule given as a capability)."""
    from fp8attn.kernels.hopper.backward_launch import HAS_GLUON, bwd_unsupported_reason

    if not HAS_GLUON:
        pytest.skip("this triton has no Gluon")
    q = torch.empty(2, 256, 8, 128, dtype=E4M3)
    k = torch.empty(2, 256, 2, 128, dtype=E4M3)
    v = torch.empty(2, 2, 128, 256, dtype=E4M3).permute(0, 3, 1, 2)  # sequence-major, as quantize_qkv
    do = torch.empty(2, 256, 8, 128, dtype=torch.bfloat16)
    grads = [torch.empty(x.shape) for x in (q, k, v)]
    call = dict(varlen=False, mode="dequantized", deterministic=False, window=False, softcap=False, capability=(9, 0))

    def why(**change):
        t = dict(do=do, q=q, k=k, v=v)
        t.update({n: change.pop(n) for n in list(change) if n in t})
        return bwd_unsupported_reason(t["do"], t["q"], t["k"], t["v"], *grads, **{**call, **change})

    assert why() is None
    assert why(v=v.contiguous()) is None
    assert why(q=q.to(torch.bfloat16), k=k.to(torch.bfloat16), v=v.to(torch.bfloat16)) is None
    assert why(mode="fp8") is None
    for change, word in [
        (dict(capability=(8, 9)), "sm90"),
        (dict(varlen=True), "varlen"),
        (dict(mode="fp8", q=q.to(torch.bfloat16), k=k.to(torch.bfloat16), v=v.to(torch.bfloat16)), "16-bit"),
        (dict(mode="exact"), "mode"),
        (dict(deterministic=True), "deterministic"),
        (dict(window=True), "window"),
        (dict(softcap=True), "softcap"),
        (dict(q=q[..., :96], k=k[..., :96], v=v[..., :96], do=do[..., :96]), "head dims"),
        (dict(q=q.to(torch.float16), k=k.to(torch.float16), v=v.to(torch.float16)), "differ"),
        (dict(do=do.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
        (dict(v=torch.empty(2, 128, 256, 2, dtype=E4M3).permute(0, 2, 3, 1)), "contiguous"),
        (dict(q=q[:, :0], do=do[:, :0]), "no query or key rows"),
        (dict(k=k[:, :0], v=v[:, :0]), "no query or key rows"),
    ]:
        reason = why(**change)
        assert reason is not None and word in reason, (change, reason)


@pytest.mark.parametrize("sq,d", [(77, 64), (130, 128)])
def test_fp8_operands_kernel(sq, d):
    """The fp8 mode's operand kernel (the Hopper kernel's inputs), under the interpreter: dO scaled by one amax / 448
    per (query tile of 64, head), its transpose and Q's with zeros past seqlen_q (NaN-poisoned buffers otherwise)."""
    from fp8attn.kernels import backward as kb

    torch.manual_seed(0)
    b, h = 2, 3
    do = torch.randn(b, sq, h, d, dtype=torch.bfloat16) * torch.rand(1, sq, h, 1).to(torch.bfloat16) * 4
    q = torch.randn(b, sq, h, d).to(E4M3)
    real_empty = torch.empty

    def poisoned(*shape, **kw):  # every buffer the kernel writes starts as NaN: what it leaves unwritten shows
        return real_empty(*shape, **kw).fill_(float("nan"))

    kb.torch.empty, saved = poisoned, kb.torch.empty
    try:
        do8, dot8, qt8, scales = kb._fp8_operands(do, q)
    finally:
        kb.torch.empty = saved
    st = (sq + 15) // 16 * 16
    assert dot8.shape == qt8.shape == (b, h, d, st) and scales.shape == (b, h, (sq + 63) // 64)
    tiles = torch.nn.functional.pad(do.float(), (0, 0, 0, 0, 0, -sq % 64)).reshape(b, -1, 64, h, d)
    amax = tiles.abs().amax(dim=(2, 4)).transpose(1, 2)  # (b, h, tiles)
    assert torch.equal(scales, amax / 448)
    inv = (448 / amax).repeat_interleave(64, dim=2)[:, :, :sq].transpose(1, 2)[..., None]
    assert torch.equal(do8.float(), (do.float() * inv).to(E4M3).float())
    assert torch.equal(dot8.float()[..., :sq], do8.float().permute(0, 2, 3, 1))
    assert torch.equal(qt8.float()[..., :sq], q.float().permute(0, 2, 3, 1))
    assert (dot8.float()[..., sq:] == 0).all() and (qt8.float()[..., sq:] == 0).all()


def test_hopper_backend_refusal_writes_nothing(monkeypatch):
    """FP8ATTN_BWD_BACKEND=tma on a call the Hopper kernel cannot take raises ValueError naming the reason before
    any write; an unknown value raises too."""
    torch.manual_seed(0)
    inp = _make([40], [40], 2, 1, 32, 32)
    ref = _references(inp, 32**-0.5, True, 8, -1, 0.0, "dequantized")
    views, grads, kw = _kernel_args(
        inp, ref, causal=True, wl=8, wr=-1, softcap=0.0, mode="dequantized", grad_dtype=torch.float32
    )
    for t in grads:
        t.fill_(7.0)
    monkeypatch.setenv("FP8ATTN_BWD_BACKEND", "tma")
    with pytest.raises(ValueError, match="FP8ATTN_BWD_BACKEND=tma: the Hopper backward kernel does not take"):
        launch_attention_bwd(*views, *grads, **kw)
    assert all(bool((t == 7.0).all()) for t in grads), "a refused call wrote its gradients"
    monkeypatch.setenv("FP8ATTN_BWD_BACKEND", "cuda")
    with pytest.raises(ValueError, match="expected auto, triton or tma"):
        launch_attention_bwd(*views, *grads, **kw)


def _launch_no_window(do, q, k, v, out, lse, grads, *, causal, descales=None, softmax_scale=0.125, **kw):
    """``launch_attention_bwd`` with no window or softcap (``kw``: e.g. the mode), writing ``grads`` (dq, dk, dv);
    ``descales`` (q, k, v) None: unit (batch, kv head) ones for e4m3 q, k, v (none for 16-bit ones)."""
    if descales is None:
        fp8 = q.dtype == E4M3
        descales = [torch.ones(q.shape[0], k.shape[2], device=q.device) if fp8 else None for _ in range(3)]
    launch_attention_bwd(
        do,
        q,
        k,
        v,
        out,
        lse,
        *grads,
        q_descale=descales[0],
        k_descale=descales[1],
        v_descale=descales[2],
        softmax_scale=softmax_scale,
        causal=causal,
        window_left=-1,
        window_right=-1,
        softcap=0.0,
        **kw,
    )


@pytest.mark.parametrize("sq", [128, 70])
def test_preprocess_zeroes_the_hopper_dq_accumulator(monkeypatch, sq):
    """Where the Hopper kernel takes a call, the preprocess launch zeroes its fp32 dQ accumulator (every row up to
    whole query tiles, the padding its TMA reductions reach included; no torch fill, which a plan's recording
    refuses) and still writes Delta and the log2-scaled LSE. The accumulator starts NaN-poisoned; the Hopper
    launch is a capture."""
    import fp8attn.kernels.backward as kb

    seen = {}

    def capture(do, q, k, v, ws, dq_acc, dk, dv, **kw):
        seen["acc"], seen["ws"] = dq_acc.clone(), ws.clone()

    rows = kb.backward_launch.dq_acc_rows(sq)
    poisoned = torch.full((2, rows, 4, 64), float("nan"))
    monkeypatch.setattr(kb.backward_launch, "bwd_unsupported_reason", lambda *a, **k: None)
    monkeypatch.setattr(kb.backward_launch, "launch_bwd_tma", capture)
    monkeypatch.setattr(kb.backward_launch, "ws_row_len", lambda s: s)
    monkeypatch.setattr(kb, "_fp32_acc", lambda dq, rows, zero: poisoned)
    q = torch.randn(2, sq, 4, 64).to(E4M3)
    k, v = (torch.randn(2, 32, 2, 64).to(E4M3) for _ in range(2))
    do, out = (torch.randn(2, sq, 4, 64, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.randn(2, 4, sq)
    grads = [torch.full(x.shape, float("nan"), dtype=torch.bfloat16) for x in (q, k, v)]
    _launch_no_window(do, q, k, v, out, lse, grads, causal=False)
    assert seen["acc"].shape == (2, rows, 4, 64) and bool((seen["acc"] == 0).all())
    delta = (do.float() * out.float()).sum(-1).permute(0, 2, 1).reshape(-1)
    torch.testing.assert_close(seen["ws"][0], delta, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen["ws"][1], lse.reshape(-1) * math.log2(math.e), rtol=1e-6, atol=1e-6)
    assert bool((grads[0] == 0).all())  # dq: the accumulator's zero rows, converted


@pytest.mark.parametrize("sq,grad_dtype", [(40, torch.bfloat16), (40, torch.float32), (64, torch.float32)])
@pytest.mark.parametrize("mode", ["dequantized", "fp8"])
def test_hopper_path_dq_accumulator(monkeypatch, sq, grad_dtype, mode):
    """The Hopper path's glue on the CPU (the kernel stood in for): the launch gets a zeroed, contiguous fp32 dQ
    accumulator with rows per batch rounded up to a query tile (dq itself when it is fp32, contiguous and
    already whole tiles), and only the first seqlen_q rows of each batch come back into dq. In the fp8 mode the
    launch also gets the e4m3 operands of ``_fp8_operands`` (their values: test_fp8_operands_kernel)."""
    from fp8attn.kernels.hopper import backward_launch

    seen = {}

    def fake_launch(do, q, k, v, ws, dq_acc, dk, dv, **kw):
        b, rows, h, d = dq_acc.shape
        seen.update(shape=dq_acc.shape, ptr=dq_acc.data_ptr(), zero=bool((dq_acc == 0).all()))
        assert dq_acc.dtype == torch.float32 and dq_acc.is_contiguous()
        dq_acc.copy_(torch.arange(dq_acc.numel(), dtype=torch.float32).view(dq_acc.shape))
        dq_acc[:, q.shape[1] :] = float("nan")  # the padded rows: never read back
        dk.fill_(1.0)
        dv.fill_(2.0)

    def fake_launch_fp8(do8, dot8, qt8, scales, q, k, v, ws, dq_acc, dk, dv, **kw):
        b, s, h, d = q.shape
        st = backward_launch.transposed_len(s)
        assert do8.shape == q.shape and dot8.shape == qt8.shape == (b, h, d, st)
        assert {t.dtype for t in (do8, dot8, qt8)} == {E4M3} and scales.shape == (b, h, -(-s // 64))
        fake_launch(None, q, k, v, ws, dq_acc, dk, dv, **kw)

    monkeypatch.setattr(backward_launch, "bwd_unsupported_reason", lambda *a, **k: None)
    monkeypatch.setattr(backward_launch, "launch_bwd_tma", fake_launch)
    monkeypatch.setattr(backward_launch, "launch_bwd_tma_fp8", fake_launch_fp8)
    torch.manual_seed(0)
    inp = _make([sq, sq], [sq, sq], 2, 1, 32, 32)
    ref = _references(inp, 32**-0.5, True, -1, -1, 0.0, mode)
    views, grads, kw = _kernel_args(inp, ref, causal=True, wl=-1, wr=-1, softcap=0.0, mode=mode, grad_dtype=grad_dtype)
    launch_attention_bwd(*views, *grads, **kw)
    rows = backward_launch.dq_acc_rows(sq)
    assert rows % backward_launch.BLOCK_M == 0 and sq <= rows < sq + backward_launch.BLOCK_M
    assert seen["shape"] == (2, rows, 2, 32) and seen["zero"]
    assert (seen["ptr"] == grads[0].data_ptr()) == (grad_dtype == torch.float32 and rows == sq)
    expect = torch.arange(2 * rows * 2 * 32, dtype=torch.float32).view(2, rows, 2, 32)[:, :sq]
    assert torch.equal(grads[0].float(), expect.to(grad_dtype).float())
    assert bool((grads[1] == 1.0).all()) and bool((grads[2] == 2.0).all())


@pytest.mark.parametrize("sq,sk", [(0, 16), (16, 0), (0, 0)])
def test_empty_inputs_zero_gradients_without_launches(monkeypatch, sq, sk):
    """No query or no key rows: zero gradients (a row that sees no key has none; no query, no dK / dV) and no
    kernel launched (the Hopper kernel's TMA views cannot be empty)."""
    import fp8attn.kernels.backward as kb

    def no_launch(*a, **k):
        raise AssertionError("a kernel was launched for an empty call")

    monkeypatch.setattr(kb.backward_launch, "launch_bwd_tma", no_launch)
    monkeypatch.setattr(kb, "_bwd_preprocess_kernel", None)  # indexing it (a launch) would raise TypeError
    b, hq, hk, d = 2, 4, 2, 64
    q = torch.randn(b, sq, hq, d).to(E4M3)
    k, v = (torch.randn(b, sk, hk, d).to(E4M3) for _ in range(2))
    do, out = (torch.randn(b, sq, hq, d, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.full((b, hq, sq), float("-inf"))
    grads = [torch.full(x.shape, float("nan")) for x in (q, k, v)]
    for mode in ("dequantized", "fp8"):
        _launch_no_window(do, q, k, v, out, lse, grads, causal=True, mode=mode)
        assert all(bool((g == 0).all()) for g in grads), mode


def test_bad_mode():
    inp = _make([16], [16], 1, 1, 64, 64)
    with pytest.raises(ValueError, match="mode"):
        _run_and_check(inp, mode="e5m2")


@triton.jit
def _e4m3_probe(X, Y, S, SCALE: tl.constexpr, AMAX: tl.constexpr):
    """Y = the bits of the backward's e4m3 cast of a 4 x 4 tile X (scale: the tile's amax scale or SCALE),
    S = the scale."""
    i = tl.arange(0, 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
    x = tl.load(X + i)
    if AMAX:
        inv = _tile_inv_scale(x)
    else:
        inv = tl.full((), SCALE, tl.float32)
    tl.store(Y + i, _to_e4m3(x, inv).to(tl.int8, bitcast=True))  # bits: the interpreter reads 0x7F as 480
    tl.store(S, inv)


@pytest.fixture
def strict_e4m3_cast(monkeypatch):
    """The interpreter's float -> e4m3 conversion made non-saturating: a value past 448 becomes NaN. The
    kernels must clamp every e4m3 operand themselves (docs/design.md, Formats and saturating casts); with the
    interpreter's default (saturating) conversion a cast that skips the clamp cannot be told apart."""
    import numpy as np
    from triton.runtime import interpreter as ti

    saturating = ti.InterpreterBuilder.create_fp_to_fp

    def strict(self, src, dst_type, rounding_mode):
        out = saturating(self, src, dst_type, rounding_mode)
        if dst_type.scalar == tl.float8e4nv:
            past = np.abs(np.asarray(src.data, dtype=np.float32)) > 448.0
            out.data[past] = 0x7F  # e4m3fn NaN
        return out

    monkeypatch.setattr(ti.InterpreterBuilder, "create_fp_to_fp", strict)
    return saturating  # to restore the saturating conversion inside a test


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="patches the interpreter's e4m3 cast")
def test_e4m3_helpers_saturate_and_keep_zero_tiles_finite(strict_e4m3_cast):
    def probe(x, scale=1.0, amax=True):
        y, s = torch.empty(16, dtype=torch.int8), torch.empty(1)
        _e4m3_probe[(1,)](x, y, s, SCALE=scale, AMAX=amax)
        return y.view(E4M3).float(), s.item()

    # values at, just past and far past 448, at a fixed scale (P * 2**8 of a P above 1.75)
    x = torch.tensor([448.0, 448.5, 463.0, 464.0, 1e6, 3.0e38, -449.0, -1e9] + [0.0] * 8)
    y, _ = probe(x, amax=False)
    assert torch.equal(y[:8], torch.tensor([448.0] * 6 + [-448.0] * 2)), y
    # a NaN stays NaN (no clamp turns it into a finite -448)
    y, _ = probe(torch.tensor([float("nan"), 1.0] + [0.0] * 14), amax=False)
    assert y[0].isnan() and y[1] == 1.0, y
    y, _ = probe(torch.tensor([1.0] * 8 + [2.0] * 8), scale=256.0, amax=False)
    assert (y == 256.0).sum() == 8 and (y == 448.0).sum() == 8, y
    # an amax scale may round the largest element just past 448; an all-zero tile keeps a finite scale
    x = torch.randn(16) * 1e-3
    y, s = probe(x)
    assert torch.isfinite(y).all() and y.abs().max() == 448.0 and math.isfinite(s), (y, s)
    y, s = probe(torch.zeros(16))
    assert torch.equal(y, torch.zeros(16)) and 0.0 < s < float("inf") and math.isfinite(1.0 / s), s


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="patches the interpreter's e4m3 cast")
def test_fp8_mode_p_past_one_stays_finite(strict_e4m3_cast):
    # P recomputed from a saved LSE below the recomputed logits' logsumexp exceeds 1 (a forward whose
    # logits or LSE differ from the backward's); here by e**4, so P * 2**8 reaches past 448 (every row's
    # largest P is at least 1 / seqlen_k). Every e4m3 operand must be clamped by the kernel: with the
    # non-saturating cast a missed clamp gives NaN bytes (0x7F) and gradients that differ from the
    # saturating cast's bits, which a clamped kernel reproduces exactly.
    inp = _make([20], [20], 2, 1, 64, 64)
    ref = _references(inp, 64**-0.5, False, -1, -1, 0.0, "fp8")
    shift = -4.0
    assert math.exp(-shift) / 20 * 256 > 464  # past 448 after rounding too
    views, grads, kw = _kernel_args(
        inp, ref, causal=False, wl=-1, wr=-1, softcap=0.0, mode="fp8", grad_dtype=torch.float32, lse_shift=shift
    )
    launch_attention_bwd(*views, *grads, **kw)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), f"{name}: NaN/inf with P * 2**8 past 448"
    sat = [torch.empty_like(g) for g in grads]
    from triton.runtime import interpreter as ti

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ti.InterpreterBuilder, "create_fp_to_fp", strict_e4m3_cast)
        launch_attention_bwd(*views, *sat, **kw)
    for name, g, s in zip(("dq", "dk", "dv"), grads, sat):
        assert torch.equal(g, s), f"{name}: differs between the strict and the saturating e4m3 cast"


# ------------------------------------------------------------------------------------------------
# GPU tests (H200)
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("s", [1024, 4096])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["dequantized", "fp8"])
def test_gpu_grid(d, s, causal, mode):
    torch.manual_seed(0)
    hq, hk = 4, 2
    inp = _make_gpu(2 if s <= 1024 else 1, s, s, hq, hk, d, d)
    _gpu_check(inp, causal=causal, mode=mode)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hk", [(8, 8), (8, 1), (6, 2)])
def test_gpu_gqa_window_softcap_192(hq, hk):
    torch.manual_seed(0)
    inp = _make_gpu(1, 1000, 1500, hq, hk, 192, 128)
    _gpu_check(inp, causal=True, wl=300, softcap=20.0)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dequantized", "fp8"])
def test_gpu_deterministic(mode):
    # the separate dQ pass (no atomics): accurate, and bit-identical on a rerun
    torch.manual_seed(0)
    inp = _make_gpu(1, 2048, 2048, 8, 2, 128, 128)
    _gpu_check(inp, causal=True, mode=mode, deterministic=True)
    a = _gpu_launch(inp, causal=True, mode=mode, deterministic=True)
    b = _gpu_launch(inp, causal=True, mode=mode, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "d,causal,b,sq,sk,hq,hk",
    [
        (128, False, 2, 1024, 1024, 4, 2),
        (128, True, 1, 4096, 4096, 4, 2),
        (64, True, 2, 1024, 1024, 4, 2),
        (64, False, 2, 777, 777, 8, 1),  # partial query and key blocks, MQA
        (128, True, 2, 1000, 1500, 6, 2),  # seqlen_q < seqlen_k
        (128, True, 1, 2048, 1000, 4, 4),  # rows that see no key (zero gradient)
        (64, True, 2, 777, 1200, 8, 2),
    ],
)
@pytest.mark.parametrize("mode", ["dequantized", "fp8"])
def test_gpu_hopper_kernel(monkeypatch, d, causal, b, sq, sk, hq, hk, mode):
    """The Hopper kernels (FP8ATTN_BWD_BACKEND=tma: they must take these calls, else ValueError) against the oracle
    and the mode's emulation, with the workspace's unused entries (rows padded to 4) NaN-poisoned through the
    caching allocator."""
    monkeypatch.setenv("FP8ATTN_BWD_BACKEND", "tma")
    torch.manual_seed(0)
    inp = _make_gpu(b, sq, sk, hq, hk, d, d)
    ref = _gpu_ref(inp, causal, -1, -1, 0.0, mode)
    n = 2 * b * hq * ((sq + 3) // 4 * 4)
    torch.full((n,), float("nan"), device=GPU_DEV)  # freed at once: the workspace of the same size reuses it
    got = _gpu_launch(inp, causal=causal, fwd=ref, mode=mode)
    for name, x, r, lo in zip(("dq", "dk", "dv"), got, ref[2:5], ref[5:8]):
        assert_close_fa3(x.float(), r, lo, floor=2e-3 * r.abs().max().item() + 1e-6, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("qkv,grad", [("bf16", "bf16"), ("fp16", "fp16"), ("e4m3", "fp16")])
def test_gpu_hopper_kernel_dtypes_match_triton(monkeypatch, qkv, grad):
    """16-bit Q/K/V, and e4m3 ones with an fp16 dO: the Hopper kernel against the Triton kernels on the same inputs
    (the same products; with e4m3 inputs and an fp16 dO the Hopper kernel rounds dS to fp16, the Triton kernel to
    bf16)."""
    torch.manual_seed(1)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}
    b, s, hq, hk, d = 2, 1536, 8, 2, 128
    if qkv == "e4m3":
        q, k, v = (torch.randn(b, s, h, d, device=GPU_DEV).to(E4M3) for h in (hq, hk, hk))
        ds = [torch.rand(b, hk, device=GPU_DEV) + 0.5 for _ in range(3)]
    else:
        q, k, v = (torch.randn(b, s, h, d, device=GPU_DEV, dtype=dt[qkv]) for h in (hq, hk, hk))
        ds = [None] * 3
    do, out = (torch.randn(b, s, hq, d, device=GPU_DEV, dtype=dt[grad]) for _ in range(2))
    lse = torch.randn(b, hq, s, device=GPU_DEV) + 8
    got = {}
    for backend in ("tma", "triton"):
        monkeypatch.setenv("FP8ATTN_BWD_BACKEND", backend)
        got[backend] = [torch.empty(x.shape, device=GPU_DEV) for x in (q, k, v)]
        _launch_no_window(do, q, k, v, out, lse, got[backend], causal=True, descales=ds, softmax_scale=d**-0.5)
    tol = 1e-2 if qkv == "e4m3" else 1e-3
    for name, x, r in zip(("dq", "dk", "dv"), got["tma"], got["triton"]):
        rel = ((x - r).norm() / r.norm()).item()
        assert rel < tol, f"{name}: relative difference {rel:.2e} between the Hopper and the Triton kernels"


def _make_gpu(b, sq, sk, hq, hk, d, dv):
    desc = [(torch.rand(b, hk, device=GPU_DEV) + 0.5) for _ in range(3)]
    q = (torch.randn(b, sq, hq, d, device=GPU_DEV)).to(E4M3)
    k = (torch.randn(b, sk, hk, d, device=GPU_DEV)).to(E4M3)
    v = (torch.randn(b, hk, dv, sk, device=GPU_DEV) * 2).to(E4M3).permute(0, 3, 1, 2)  # sequence-major, as quantize_qkv
    do = torch.randn(b, sq, hq, dv, device=GPU_DEV, dtype=torch.bfloat16)
    return dict(q=q, k=k, v=v, do=do, desc=desc)


def _gpu_ref(inp, causal, wl, wr, softcap, mode):
    """float32 autograd oracle (float64 einsums of 4k x 4k per head are slow) and the low-precision
    emulation of ``mode`` (``_emul_seq``), per batch element; (out, lse, dq, dk, dv, lq, lk, lv), token-major."""
    q, k, v = inp["q"], inp["k"], inp["v"]
    g = q.shape[2] // k.shape[2]
    f = torch.float32
    deq = [
        q.to(f) * inp["desc"][0].repeat_interleave(g, 1)[:, None, :, None],
        k.to(f) * inp["desc"][1][:, None, :, None],
        v.to(f) * inp["desc"][2][:, None, :, None],
    ]
    res = [[] for _ in range(8)]
    scale = q.shape[-1] ** -0.5
    for bi in range(q.shape[0]):
        qh, kh, vh = (x[bi].transpose(0, 1) for x in deq)
        do = inp["do"][bi].transpose(0, 1).to(f)
        out, lse, dq, dk, dv = _grads_seq(qh, kh, vh, do, scale, causal, wl, wr, softcap, f)
        low = _emul_seq(qh, kh, vh, do, out.to(torch.bfloat16).to(f), scale, causal, wl, wr, softcap, mode)
        for lst, x in zip(res, (out, lse, dq, dk, dv, *low)):
            lst.append(x)
    return [torch.stack(x).transpose(1, 2) if i != 1 else torch.stack(x) for i, x in enumerate(res)]


def _gpu_launch(inp, *, causal=False, wl=-1, wr=-1, softcap=0.0, mode="dequantized", fwd=None, deterministic=False):
    if fwd is None:
        fwd = _gpu_ref(inp, causal, wl, wr, softcap, mode)
    out, lse = fwd[0].to(torch.bfloat16).contiguous(), fwd[1].float().contiguous()
    grads = [torch.empty(x.shape, device=GPU_DEV, dtype=torch.float32) for x in (inp["q"], inp["k"], inp["v"])]
    launch_attention_bwd(
        inp["do"],
        inp["q"],
        inp["k"],
        inp["v"],
        out,
        lse,
        *grads,
        q_descale=inp["desc"][0],
        k_descale=inp["desc"][1],
        v_descale=inp["desc"][2],
        softmax_scale=inp["q"].shape[-1] ** -0.5,
        causal=causal,
        window_left=wl,
        window_right=wr,
        softcap=softcap,
        mode=mode,
        deterministic=deterministic,
    )
    return grads


def _gpu_check(inp, *, causal=False, wl=-1, wr=-1, softcap=0.0, mode="dequantized", deterministic=False):
    """The CPU tests' rule at real shapes: within 2x the emulated low-precision error of the mode + floor."""
    ref = _gpu_ref(inp, causal, wl, wr, softcap, mode)
    got = _gpu_launch(
        inp, causal=causal, wl=wl, wr=wr, softcap=softcap, mode=mode, fwd=ref, deterministic=deterministic
    )
    for name, x, r, lo in zip(("dq", "dk", "dv"), got, ref[2:5], ref[5:8]):
        err = (x.double() - r.double()).abs().max().item()
        low = (lo.double() - r.double()).abs().max().item()
        print(f"{name} mode={mode} err={err:.3e} emulated={low:.3e} max|ref|={r.abs().max().item():.3e}")
        assert_close_fa3(x.float(), r, lo, floor=2e-3 * r.abs().max().item() + 1e-6, name=name)
