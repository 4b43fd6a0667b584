"""Bad input (docs/design.md, Validation and nothing lost): each error has the right type and its message
names the argument.

Messages follow "<arg>: expected <what>, got <what>. <fix>"; ``helpers.raises_naming`` checks the argument name and,
where given, a fragment of what arrived.
"""

import pytest
import torch

from fp8attn import flash_attn_combine, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, write_kv_cache
from helpers import raises_naming

E4M3 = torch.float8_e4m3fn
B, S, H, D = 2, 5, 2, 64


def qkv(dtype=torch.bfloat16, b=B, s=S, hq=H, hk=H, d=D, dv=None):
    dv = dv or d
    return (torch.randn(b, s, hq, d).to(dtype), torch.randn(b, s, hk, d).to(dtype), torch.randn(b, s, hk, dv).to(dtype))


def paged(b=B, nblocks=6, ps=4, hk=H, d=D, dtype=E4M3):
    kc = torch.zeros(nblocks, ps, hk, d).to(dtype)
    vc = torch.zeros(nblocks, ps, hk, d).to(dtype)
    pt = torch.arange(b * 2, dtype=torch.int32).view(b, 2)
    return kc, vc, pt


# ---------------------------------------------------------------------------------------------- dtypes
def test_dtype_mismatch_q_vs_kv():
    q, k, v = qkv(E4M3)
    msg = raises_naming(TypeError, "q", flash_attn_func, q.float().bfloat16(), k, v, got="bfloat16")
    assert "expected" in msg


def test_dtype_mismatch_k_vs_v():
    q, k, v = qkv(E4M3)
    raises_naming(TypeError, "v", flash_attn_func, q, k, v.to(torch.float8_e5m2), got="float8_e5m2")


def test_dtype_integer_inputs():
    q, k, v = qkv()
    raises_naming(TypeError, "q", flash_attn_func, q.to(torch.int8), k.to(torch.int8), v.to(torch.int8), got="int8")


def test_dtype_mismatch_kvcache():
    kc, vc, pt = paged()
    q = torch.randn(B, 1, H, D)  # fp32 q over an FP8 cache: only bf16/fp16 may mix
    raises_naming(TypeError, "q", flash_attn_with_kvcache, q, kc, vc, page_table=pt, cache_seqlens=3, got="float32")
    raises_naming(
        TypeError,
        "v_cache",
        flash_attn_with_kvcache,
        q.bfloat16(),
        kc,
        vc.to(torch.float8_e5m2),
        page_table=pt,
        cache_seqlens=3,
    )


def test_dtype_varlen():
    q, k, v = (t.reshape(-1, H, D) for t in qkv())
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    raises_naming(TypeError, "q", flash_attn_varlen_func, q.half(), k, v, cu, cu, 5, 5, got="float16")


# ------------------------------------------------------------------------------------------- head dims
@pytest.mark.parametrize("d", [60, 4, 264, 512])
def test_unsupported_head_dim_q(d):
    q, k, v = qkv(d=d)
    raises_naming(ValueError, "q", flash_attn_func, q, k, v, got=str(d))


def test_unsupported_head_dim_v():
    q, k, v = qkv(d=64, dv=20)
    raises_naming(ValueError, "v", flash_attn_func, q, k, v, got="20")


def test_head_dim_q_k_differ():
    q, k, v = qkv()
    raises_naming(ValueError, "k", flash_attn_func, q, k[..., :32].contiguous(), v, got="32")


# ------------------------------------------------------------------------------------------- GQA heads
def test_nheads_not_divisible():
    q, k, v = qkv(hq=3, hk=2)
    msg = raises_naming(ValueError, "q", flash_attn_func, q, k, v, got="3")
    assert "nheads" in msg


def test_nheads_k_v_differ():
    q, k, v = qkv(hq=4, hk=2)
    raises_naming(ValueError, "v", flash_attn_func, q, k, v[:, :, :1].contiguous())


def test_nheads_not_divisible_kvcache():
    kc, vc, pt = paged(hk=2)
    raises_naming(
        ValueError,
        "q",
        flash_attn_with_kvcache,
        torch.randn(B, 1, 3, D).bfloat16(),
        kc,
        vc,
        page_table=pt,
        cache_seqlens=2,
    )


# -------------------------------------------------------------------------------------------- descales
@pytest.mark.parametrize("bad", [(3,), (B, H + 1), (B + 1, H), (1, 1, 1), (2 * B, 1)])
def test_descale_shape(bad):
    q, k, v = qkv(E4M3)
    raises_naming(ValueError, "k_descale", flash_attn_func, q, k, v, k_descale=torch.ones(bad), got=str(tuple(bad)))


@pytest.mark.parametrize("dt", [torch.float16, torch.float64, torch.bfloat16])
def test_descale_dtype(dt):
    q, k, v = qkv(E4M3)
    raises_naming(TypeError, "q_descale", flash_attn_func, q, k, v, q_descale=torch.ones(B, H, dtype=dt), got=str(dt))


def test_descale_device():
    q, k, v = qkv(E4M3)
    raises_naming(
        ValueError, "v_descale", flash_attn_func, q, k, v, v_descale=torch.ones(B, H, device="meta"), got="meta"
    )


def test_descale_not_a_tensor():
    q, k, v = qkv(E4M3)
    raises_naming(TypeError, "q_descale", flash_attn_func, q, k, v, q_descale=0.5, got="float")


def test_descale_shape_kvcache_and_varlen():
    kc, vc, pt = paged()
    raises_naming(
        ValueError,
        "k_descale",
        flash_attn_with_kvcache,
        torch.randn(B, 1, H, D).bfloat16(),
        kc,
        vc,
        page_table=pt,
        cache_seqlens=3,
        k_descale=torch.ones(B, 3),
    )
    q, k, v = (t.reshape(-1, H, D) for t in qkv(E4M3))
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    raises_naming(ValueError, "q_descale", flash_attn_varlen_func, q, k, v, cu, cu, 5, 5, q_descale=torch.ones(3, H))


@pytest.mark.parametrize("shape", [(), (1,), (1, 1), (B, 1), (B, H), (1, H)])
def test_descale_accepted_shapes(shape):
    q, k, v = qkv(E4M3)
    out = flash_attn_func(q, k, v, q_descale=torch.full(shape, 0.5), k_descale=torch.full(shape, 0.25))
    assert out.shape == (B, S, H, D) and not torch.isnan(out.float()).any()


def test_expanded_stride0_descale_accepted():
    q, k, v = qkv(E4M3)
    ref = flash_attn_func(q, k, v, q_descale=torch.full((B, H), 0.5))
    out = flash_attn_func(q, k, v, q_descale=torch.full((1, 1), 0.5).expand(B, H))
    assert torch.equal(out, ref)


# ----------------------------------------------------------------------------------------- cu_seqlens
def _varlen():
    q, k, v = (t.reshape(-1, H, D) for t in qkv())
    return q, k, v


@pytest.mark.parametrize("dt", [torch.int64, torch.float32])
def test_cu_seqlens_not_int32(dt):
    q, k, v = _varlen()
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    raises_naming(TypeError, "cu_seqlens_q", flash_attn_varlen_func, q, k, v, cu.to(dt), cu, 5, 5, got=str(dt))
    raises_naming(TypeError, "cu_seqlens_k", flash_attn_varlen_func, q, k, v, cu, cu.to(dt), 5, 5, got=str(dt))


def test_cu_seqlens_decreasing():
    q, k, v = _varlen()
    good = torch.tensor([0, 5, 10], dtype=torch.int32)
    bad = torch.tensor([0, 7, 5], dtype=torch.int32)
    msg = raises_naming(ValueError, "cu_seqlens_k", flash_attn_varlen_func, q, k, v, good, bad, 5, 7)
    assert "non-decreasing" in msg


def test_cu_seqlens_not_starting_at_zero():
    q, k, v = _varlen()
    good = torch.tensor([0, 5, 10], dtype=torch.int32)
    raises_naming(
        ValueError,
        "cu_seqlens_q",
        flash_attn_varlen_func,
        q,
        k,
        v,
        torch.tensor([1, 5, 10], dtype=torch.int32),
        good,
        5,
        5,
    )


def test_cu_seqlens_batch_mismatch():
    q, k, v = _varlen()
    raises_naming(
        ValueError,
        "cu_seqlens_k",
        flash_attn_varlen_func,
        q,
        k,
        v,
        torch.tensor([0, 5, 10], dtype=torch.int32),
        torch.tensor([0, 10], dtype=torch.int32),
        5,
        10,
    )


def test_max_seqlen_too_small_or_not_int():
    q, k, v = _varlen()
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    raises_naming(ValueError, "max_seqlen_q", flash_attn_varlen_func, q, k, v, cu, cu, 5, 7)
    raises_naming(TypeError, "max_seqlen_k", flash_attn_varlen_func, q, k, v, cu, cu, 7, 7.0)


def test_cu_seqlens_q_kvcache_not_int32():
    kc, vc, pt = paged()
    raises_naming(
        TypeError,
        "cu_seqlens_q",
        flash_attn_with_kvcache,
        torch.randn(2, H, D).bfloat16(),
        kc,
        vc,
        page_table=pt,
        cache_seqlens=torch.tensor([3, 3], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 2]),
        max_seqlen_q=1,
    )


# ----------------------------------------------------------------------------------- page_table / cache
@pytest.mark.parametrize("dt", [torch.int64, torch.int16])
def test_page_table_not_int32(dt):
    kc, vc, pt = paged()
    raises_naming(
        TypeError,
        "page_table",
        flash_attn_with_kvcache,
        torch.randn(B, 1, H, D).bfloat16(),
        kc,
        vc,
        page_table=pt.to(dt),
        cache_seqlens=3,
        got=str(dt),
    )


def test_cache_seqlens_not_int32():
    kc, vc, pt = paged()
    raises_naming(
        TypeError,
        "cache_seqlens",
        flash_attn_with_kvcache,
        torch.randn(B, 1, H, D).bfloat16(),
        kc,
        vc,
        page_table=pt,
        cache_seqlens=torch.tensor([3, 3]),
        got="int64",
    )


def test_cache_seqlens_beyond_capacity():
    kc, vc, pt = paged(ps=4)  # 2 pages of 4 per row: capacity 8
    q = torch.randn(B, 1, H, D).bfloat16()
    msg = raises_naming(
        ValueError,
        "cache_seqlens",
        flash_attn_with_kvcache,
        q,
        kc,
        vc,
        page_table=pt,
        cache_seqlens=torch.tensor([3, 9], dtype=torch.int32),
        got="9",
    )
    assert "8" in msg
    # appending new tokens past the capacity is caught too (7 cached + 2 new > 8)
    k_new = torch.randn(B, 2, H, D).bfloat16()
    raises_naming(
        ValueError,
        "cache_seqlens",
        flash_attn_with_kvcache,
        torch.randn(B, 2, H, D).bfloat16(),
        kc,
        vc,
        k=k_new,
        v=k_new,
        page_table=pt,
        cache_seqlens=torch.tensor([7, 0], dtype=torch.int32),
    )
    # contiguous cache: capacity = seqlen_cache
    kcc = torch.zeros(B, 6, H, D).to(E4M3)
    raises_naming(ValueError, "cache_seqlens", flash_attn_with_kvcache, q, kcc, kcc.clone(), cache_seqlens=7)


def test_cache_seqlens_wrong_batch():
    kc, vc, pt = paged()
    raises_naming(
        ValueError,
        "cache_seqlens",
        flash_attn_with_kvcache,
        torch.randn(B, 1, H, D).bfloat16(),
        kc,
        vc,
        page_table=pt,
        cache_seqlens=torch.tensor([3, 3, 3], dtype=torch.int32),
    )


def test_page_table_wrong_batch():
    kc, vc, pt = paged()
    raises_naming(
        ValueError,
        "page_table",
        flash_attn_with_kvcache,
        torch.randn(B, 1, H, D).bfloat16(),
        kc,
        vc,
        page_table=pt[:1],
        cache_seqlens=2,
    )


def test_k_cache_scales_wrong_shape():
    kc, vc, pt = paged()
    raises_naming(
        ValueError,
        "k_cache_scales",
        flash_attn_with_kvcache,
        torch.randn(B, 1, H, D).bfloat16(),
        kc,
        vc,
        page_table=pt,
        cache_seqlens=2,
        k_cache_scales=torch.ones(6, 4, H + 1),
    )


def test_k_cache_scales_with_k_descale():
    kc, vc, pt = paged()
    raises_naming(
        ValueError,
        "k_descale",
        flash_attn_with_kvcache,
        torch.randn(B, 1, H, D).bfloat16(),
        kc,
        vc,
        page_table=pt,
        cache_seqlens=2,
        k_cache_scales=torch.ones(6, 4, H),
        k_descale=torch.ones(B, H),
    )


def test_only_one_of_k_v_new():
    kc, vc, pt = paged()
    kn = torch.randn(B, 1, H, D).bfloat16()
    raises_naming(ValueError, "k/v", flash_attn_with_kvcache, kn, kc, vc, k=kn, page_table=pt, cache_seqlens=2)


# ------------------------------------------------------------------------------------------------ out=
def test_out_wrong_shape():
    q, k, v = qkv(E4M3)
    raises_naming(
        ValueError,
        "out",
        flash_attn_func,
        q,
        k,
        v,
        out=torch.empty(B, S, H, D + 8, dtype=torch.bfloat16),
        got=str((B, S, H, D + 8)),
    )


def test_out_wrong_dtype():
    q, k, v = qkv(E4M3)
    raises_naming(
        TypeError, "out", flash_attn_func, q, k, v, out=torch.empty(B, S, H, D, dtype=torch.float16), got="float16"
    )
    # with out_dtype=float32 the buffer must be float32
    raises_naming(
        TypeError,
        "out",
        flash_attn_func,
        q,
        k,
        v,
        out=torch.empty(B, S, H, D, dtype=torch.bfloat16),
        out_dtype=torch.float32,
    )
    # with out_scale the output is e4m3fn
    raises_naming(
        TypeError,
        "out",
        flash_attn_func,
        q,
        k,
        v,
        out=torch.empty(B, S, H, D, dtype=torch.bfloat16),
        out_scale=torch.tensor(0.1),
    )


def test_out_wrong_shape_kvcache_and_combine():
    kc, vc, pt = paged()
    q = torch.randn(B, 1, H, D).bfloat16()
    raises_naming(
        ValueError,
        "out",
        flash_attn_with_kvcache,
        q,
        kc,
        vc,
        page_table=pt,
        cache_seqlens=3,
        out=torch.empty(B, 2, H, D, dtype=torch.bfloat16),
    )
    op, lp = torch.randn(3, B, 1, H, D), torch.randn(3, B, 1, H)
    raises_naming(ValueError, "out", flash_attn_combine, op, lp, out=torch.empty(B, 1, H, D + 8))
    raises_naming(TypeError, "out", flash_attn_combine, op, lp, out=torch.empty(B, 1, H, D, dtype=torch.bfloat16))


def test_out_dtype_and_out_scale_bad():
    q, k, v = qkv(E4M3)
    raises_naming(TypeError, "out_dtype", flash_attn_func, q, k, v, out_dtype=torch.float8_e4m3fn)
    raises_naming(ValueError, "out_scale", flash_attn_func, q, k, v, out_scale=torch.ones(2))
    raises_naming(ValueError, "out_scale", flash_attn_func, q, k, v, out_scale=torch.ones(1, dtype=torch.float64))
    # a per-token / per-group scale asks for a kind that does not fuse: NotImplementedError (a ValueError too)
    for scale in (torch.ones(q.shape[0] * q.shape[1]), torch.ones(q.shape[0], q.shape[1], 1, 1), torch.ones(4)):
        raises_naming(NotImplementedError, "fused_output_quant_supported", flash_attn_func, q, k, v, out_scale=scale)
    op, lp = torch.randn(3, B, 1, H, D), torch.randn(3, B, 1, H)
    raises_naming(NotImplementedError, "out_scale", flash_attn_combine, op, lp, out_scale=torch.ones(B))
    raises_naming(
        ValueError, "out_dtype", flash_attn_func, q, k, v, out_scale=torch.tensor(1.0), out_dtype=torch.bfloat16
    )


def test_combine_bad_inputs():
    op, lp = torch.randn(3, B, 1, H, D), torch.randn(3, B, 1, H)
    raises_naming(ValueError, "lse_partial", flash_attn_combine, op, lp[:, :, :, :1])
    raises_naming(TypeError, "out_partial", flash_attn_combine, op.half(), lp)
    raises_naming(TypeError, "lse_partial", flash_attn_combine, op, lp.double())


# ------------------------------------------------------------------------------- unsupported FA3 args
_T = torch.ones(1)


# (attention_chunk is supported by flash_attn_func: tests/core/test_api_fa3_extras.py)
@pytest.mark.parametrize("arg,value", [("qv", _T), ("num_splits", 2), ("sm_margin", 4)])
def test_not_implemented_flash_attn_func(arg, value):
    q, k, v = qkv()
    raises_naming(NotImplementedError, arg, flash_attn_func, q, k, v, **{arg: value})


@pytest.mark.parametrize("arg,value", [("qv", _T), ("num_splits", 3), ("sm_margin", 1)])
def test_not_implemented_varlen(arg, value):
    q, k, v = _varlen()
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    raises_naming(NotImplementedError, arg, flash_attn_varlen_func, q, k, v, cu, cu, 5, 5, **{arg: value})


# rotary_cos / rotary_sin / rotary_seqlens are supported (tests/core/test_rotary.py checks their errors).
# (cache_leftpad with a page_table; scheduler_metadata and decode rows' attention_chunk are supported:
# tests/core/test_api_fa3_extras.py)
@pytest.mark.parametrize("arg,value", [("qv", _T), ("cache_leftpad", _T), ("sm_margin", 2)])
def test_not_implemented_kvcache(arg, value):
    kc, vc, pt = paged()
    raises_naming(
        NotImplementedError,
        arg,
        flash_attn_with_kvcache,
        torch.randn(B, 1, H, D).bfloat16(),
        kc,
        vc,
        page_table=pt,
        cache_seqlens=3,
        **{arg: value},
    )


def test_not_implemented_cache_batch_idx_with_page_table():
    kc, vc, pt = paged()
    raises_naming(
        NotImplementedError,
        "cache_batch_idx",
        flash_attn_with_kvcache,
        torch.randn(B, 1, H, D).bfloat16(),
        kc,
        vc,
        page_table=pt,
        cache_seqlens=3,
        cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32),
    )


def test_supported_defaults_are_accepted():
    """The FA3 defaults (and the harmless hints) must not raise."""
    q, k, v = qkv()
    flash_attn_func(q, k, v, qv=None, attention_chunk=0, num_splits=1, pack_gqa=True, deterministic=True, sm_margin=0)
    kc, vc, pt = paged()
    flash_attn_with_kvcache(
        q[:, :1], kc, vc, page_table=pt, cache_seqlens=3, rotary_interleaved=True, num_splits=0, pack_gqa=False
    )


# ---------------------------------------------------------------------------------- validate=True mode
@pytest.mark.parametrize("bad", [float("nan"), -0.5, 0.0, float("inf")])
def test_validate_descale_values(bad):
    q, k, v = qkv(E4M3)
    d = torch.ones(B, H)
    d[1, 0] = bad
    raises_naming(ValueError, "k_descale", flash_attn_func, q, k, v, k_descale=d, validate=True)


def test_validate_page_ids_out_of_range():
    kc, vc, pt = paged(nblocks=6)
    q = torch.randn(B, 1, H, D).bfloat16()
    bad = pt.clone()
    bad[1, 0] = 6  # == num_blocks
    raises_naming(
        ValueError,
        "page_table",
        flash_attn_with_kvcache,
        q,
        kc,
        vc,
        page_table=bad,
        cache_seqlens=torch.tensor([3, 3], dtype=torch.int32),
        validate=True,
        got="6",
    )
    neg = pt.clone()
    neg[0, 1] = -1  # a -1 inside the used range (5 tokens span 2 pages of 4)
    raises_naming(
        ValueError,
        "page_table",
        flash_attn_with_kvcache,
        q,
        kc,
        vc,
        page_table=neg,
        cache_seqlens=torch.tensor([5, 3], dtype=torch.int32),
        validate=True,
        got="-1",
    )
    # -1 in unused entries is fine
    ok = pt.clone()
    ok[:, 1] = -1
    out = flash_attn_with_kvcache(
        q, kc, vc, page_table=ok, cache_seqlens=torch.tensor([4, 1], dtype=torch.int32), validate=True
    )
    assert not torch.isnan(out.float()).any()


def test_validate_write_kv_cache_slot_range():
    kc, vc, _ = paged(nblocks=2, ps=4)
    k = torch.randn(3, H, D)
    raises_naming(
        ValueError, "slot_mapping", write_kv_cache, k, k, kc, vc, torch.tensor([0, 5, 8]), validate=True, got="8"
    )


def test_write_kv_cache_bad_inputs():
    kc, vc, _ = paged(nblocks=2, ps=4)
    k = torch.randn(3, H, D)
    raises_naming(TypeError, "k", write_kv_cache, k.to(E4M3), k, kc, vc, torch.tensor([0, 1, 2]))
    raises_naming(TypeError, "slot_mapping", write_kv_cache, k, k, kc, vc, torch.tensor([0.0, 1.0, 2.0]))
    raises_naming(ValueError, "slot_mapping", write_kv_cache, k, k, kc, vc, torch.tensor([0, 1]))
    raises_naming(
        TypeError,
        "k_descale",
        write_kv_cache,
        k,
        k,
        kc,
        vc,
        torch.tensor([0, 1, 2]),
        k_descale=torch.ones(1, dtype=torch.float64),
    )
    raises_naming(
        ValueError, "token_seq_idx", write_kv_cache, k, k, kc, vc, torch.tensor([0, 1, 2]), k_descale=torch.ones(2, H)
    )
    raises_naming(
        ValueError,
        "v_descale",
        write_kv_cache,
        k,
        k,
        kc,
        vc,
        torch.tensor([0, 1, 2]),
        v_descale=torch.tensor([-1.0]),
        validate=True,
    )


# ------------------------------------------------------------------------------ other argument checks
def test_window_size_bad():
    q, k, v = qkv()
    raises_naming(ValueError, "window_size", flash_attn_func, q, k, v, window_size=(3,))
    raises_naming(ValueError, "window_size", flash_attn_func, q, k, v, window_size=(1.5, 0))


def test_non_contiguous_last_dim():
    q, k, v = qkv()
    raises_naming(ValueError, "k", flash_attn_func, q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v)


def test_wrong_rank_and_not_tensor():
    q, k, v = qkv()
    raises_naming(ValueError, "q", flash_attn_func, q[0], k, v)
    raises_naming(TypeError, "v", flash_attn_func, q, k, v.tolist())


def test_batch_mismatch():
    q, k, v = qkv()
    raises_naming(ValueError, "k/v", flash_attn_func, q, k[:1], v[:1])


def test_device_mismatch():
    q, k, v = qkv()
    raises_naming(ValueError, "v", flash_attn_func, q, k, v.to("meta"), got="meta")


def test_num_splits_negative_kvcache():
    kc, vc, pt = paged()
    raises_naming(
        ValueError,
        "num_splits",
        flash_attn_with_kvcache,
        torch.randn(B, 1, H, D).bfloat16(),
        kc,
        vc,
        page_table=pt,
        cache_seqlens=3,
        num_splits=-1,
    )


# ------------------------------------------------- tensors that index the same rows, and their totals
def test_v_cache_pages_differ_from_k_cache():
    kc, vc, pt = paged()
    q = torch.randn(B, 1, H, D).bfloat16()
    raises_naming(
        ValueError, "v_cache", flash_attn_with_kvcache, q, kc, vc[:3], page_table=pt, cache_seqlens=3, got="(3, 4, 2)"
    )


def test_new_kv_rows_differ():
    kc, vc, pt = paged()
    q = torch.randn(B, 1, H, D).bfloat16()
    k, v = torch.randn(B, 1, H, D).bfloat16(), torch.randn(B, 1, H, D).bfloat16()
    kw = dict(page_table=pt, cache_seqlens=torch.tensor([2, 3], dtype=torch.int32))
    raises_naming(ValueError, "v", flash_attn_with_kvcache, q, kc, vc, k=k, v=v[:1], **kw)
    raises_naming(ValueError, "k", flash_attn_with_kvcache, q, kc, vc, k=k[:1], v=v[:1], **kw, got="(1, 1, 2, 64)")


def test_varlen_offsets_past_the_packed_rows():
    q, k, v = (torch.randn(9, H, D).to(E4M3) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    raises_naming(ValueError, "cu_seqlens_q", flash_attn_varlen_func, q[:8], k, v, cu, cu, 5, 5, got="9")
    raises_naming(ValueError, "cu_seqlens_k", flash_attn_varlen_func, q, k[:8], v[:8], cu, cu, 5, 5, got="9")
    raises_naming(ValueError, "v", flash_attn_varlen_func, q, k, v[:8], cu, cu, 5, 5)
    kc, vc, pt = paged(dtype=E4M3)
    qb = torch.randn(9, H, D).bfloat16()
    kw = dict(page_table=pt, cache_seqlens=torch.tensor([6, 8], dtype=torch.int32), cu_seqlens_q=cu)
    raises_naming(ValueError, "cu_seqlens_q", flash_attn_with_kvcache, qb[:8], kc, vc, max_seqlen_q=5, **kw, got="9")
    raises_naming(ValueError, "max_seqlen_q", flash_attn_with_kvcache, qb, kc, vc, max_seqlen_q=4, **kw, got="5")
    raises_naming(TypeError, "max_seqlen_q", flash_attn_with_kvcache, qb, kc, vc, max_seqlen_q=4.5, **kw)


def test_negative_cache_seqlens():
    kc, vc, pt = paged()
    q = torch.randn(B, 1, H, D).bfloat16()
    raises_naming(
        ValueError,
        "cache_seqlens",
        flash_attn_with_kvcache,
        q,
        kc,
        vc,
        page_table=pt,
        cache_seqlens=torch.tensor([2, -3], dtype=torch.int32),
        got="-3",
    )
    k = torch.randn(B, 1, H, D).bfloat16()  # with an append, before the new tokens' slots are computed
    raises_naming(
        ValueError,
        "cache_seqlens",
        flash_attn_with_kvcache,
        q,
        kc,
        vc,
        k=k,
        v=k.clone(),
        page_table=pt,
        cache_seqlens=torch.tensor([2, -3], dtype=torch.int32),
        got="-3",
    )


@pytest.mark.parametrize("scale", [-0.1, float("nan"), float("inf")])
def test_softmax_scale_negative_or_not_finite(scale):
    q, k, v = qkv()
    raises_naming(ValueError, "softmax_scale", flash_attn_func, q, k, v, softmax_scale=scale)


def test_softmax_scale_zero_is_uniform_attention():
    q, k, v = qkv(torch.float32)
    out = flash_attn_func(q, k, v, softmax_scale=0.0)
    torch.testing.assert_close(out, v.mean(dim=1, keepdim=True).expand_as(out), rtol=1e-5, atol=1e-5)


def test_write_kv_cache_rows_and_devices():
    kc, vc, _ = paged()
    k, v = torch.randn(3, H, D), torch.randn(3, H, D)
    slots = torch.tensor([0, 1, 5])
    ds = torch.tensor(0.5)
    raises_naming(ValueError, "v", write_kv_cache, k, v[:2], kc, vc, slots, k_descale=ds, v_descale=ds)
    raises_naming(ValueError, "v_cache", write_kv_cache, k, v, kc, vc[:2], slots, k_descale=ds, v_descale=ds)
    raises_naming(
        ValueError, "k_descale", write_kv_cache, k, v, kc, vc, slots, k_descale=ds.to("meta"), v_descale=ds, got="meta"
    )


def test_cache_batch_idx_rows_and_devices():
    kc, vc = torch.zeros(3, 8, H, D).to(E4M3), torch.zeros(3, 8, H, D).to(E4M3)
    q = torch.randn(B, 1, H, D).bfloat16()
    kw = dict(cache_seqlens=torch.tensor([2, 3], dtype=torch.int32))
    raises_naming(
        ValueError,
        "cache_batch_idx",
        flash_attn_with_kvcache,
        q,
        kc,
        vc,
        cache_batch_idx=torch.tensor([0], dtype=torch.int32),
        **kw,
        got="1",
    )
    raises_naming(
        ValueError,
        "cache_batch_idx",
        flash_attn_with_kvcache,
        q,
        kc,
        vc,
        cache_batch_idx=torch.tensor([0, 3], dtype=torch.int32),
        **kw,
        got="3]",
    )
    raises_naming(
        ValueError,
        "cache_batch_idx",
        flash_attn_with_kvcache,
        q,
        kc,
        vc,
        cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32, device="meta"),
        **kw,
        got="meta",
    )
    kc, vc, pt = paged()
    raises_naming(
        ValueError,
        "k_cache_scales",
        flash_attn_with_kvcache,
        q,
        kc,
        vc,
        page_table=pt,
        **kw,
        k_cache_scales=torch.ones(6, 4, H, device="meta"),
        v_cache_scales=torch.ones(6, 4, H),
        got="meta",
    )
