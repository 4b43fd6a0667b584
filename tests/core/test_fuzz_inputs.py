"""Every public entry point (the FA3-style API, quantize_qkv, quant.quantize, ops.scaled_bmm), one argument at a
time made wrong: the call runs, or raises a ValueError /
TypeError in the "<arg>: expected ..., got ..." form, or a NotImplementedError; never an IndexError,
a RuntimeError from deep inside, a hang or NaN from finite inputs (CPU path, value checks on); and a
refused call leaves every byte of its tensor arguments as it was (tests/core/test_nothing_lost.py holds a
grid per writing entry point).

Mutations per tensor argument: other dtypes, a dimension dropped or added, zero rows, a non-contiguous
last dimension, one row fewer or more, negative or huge integers, NaN or zeros in float inputs, a list
instead of a tensor, the meta device; per int argument: negative, a float, a string, a tensor; plus
bad scalar options (softmax_scale, softcap, window_size, num_splits, out_dtype, out_scale, out).
"""

import signal

import pytest
import torch

from fp8attn import (
    flash_attn_combine,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    quantize_qkv,
    write_kv_cache,
)

E4M3 = torch.float8_e4m3fn


def _descales():
    return dict(q_descale=torch.rand(2, 2) + 0.5, k_descale=torch.rand(2, 2) + 0.5, v_descale=torch.rand(2, 2) + 0.5)


def _dense():
    q, k, v = torch.randn(2, 5, 4, 64).to(E4M3), torch.randn(2, 7, 2, 64).to(E4M3), torch.randn(2, 7, 2, 64).to(E4M3)
    return flash_attn_func, dict(q=q, k=k, v=v, causal=True, **_descales())


def _varlen():
    q, k, v = torch.randn(9, 4, 64).to(E4M3), torch.randn(12, 2, 64).to(E4M3), torch.randn(12, 2, 64).to(E4M3)
    return flash_attn_varlen_func, dict(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32),
        max_seqlen_q=5,
        max_seqlen_k=7,
        causal=True,
        **_descales(),
    )


def _paged():
    kc, vc = torch.randn(10, 16, 2, 64).to(E4M3), torch.randn(10, 16, 2, 64).to(E4M3)
    return flash_attn_with_kvcache, dict(
        q=torch.randn(2, 3, 4, 64, dtype=torch.bfloat16),
        k_cache=kc,
        v_cache=vc,
        causal=True,
        cache_seqlens=torch.tensor([20, 40], dtype=torch.int32),
        page_table=torch.tensor([[3, 5, -1], [7, 1, 2]], dtype=torch.int32),
        k_descale=torch.rand(2, 2) + 0.5,
        v_descale=torch.rand(2, 2) + 0.5,
    )


def _paged_varlen():
    f, kw = _paged()
    kw.update(
        q=torch.randn(4, 4, 64, dtype=torch.bfloat16),
        cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32),
        max_seqlen_q=3,
    )
    return f, kw


def _append():
    f, kw = _paged()
    kw.update(
        k=torch.randn(2, 3, 2, 64, dtype=torch.bfloat16),
        v=torch.randn(2, 3, 2, 64, dtype=torch.bfloat16),
        cache_seqlens=torch.tensor([17, 37], dtype=torch.int32),
    )
    return f, kw


def _write():
    kc, vc = torch.zeros(10, 16, 2, 64).to(E4M3), torch.zeros(10, 16, 2, 64).to(E4M3)
    return write_kv_cache, dict(
        k=torch.randn(5, 2, 64),
        v=torch.randn(5, 2, 64),
        k_cache=kc,
        v_cache=vc,
        slot_mapping=torch.tensor([0, 1, 17, -1, 40]),
        k_descale=torch.tensor(0.5),
        v_descale=torch.tensor(0.5),
    )


def _combine():
    return flash_attn_combine, dict(out_partial=torch.randn(3, 2, 5, 4, 64), lse_partial=torch.randn(3, 2, 5, 4))


def _quantize():
    return quantize_qkv, dict(
        q=torch.randn(2, 128, 4, 64, dtype=torch.bfloat16),
        k=torch.randn(2, 128, 2, 64, dtype=torch.bfloat16),
        v=torch.randn(2, 128, 2, 64, dtype=torch.bfloat16),
    )


def _quantize_blocks():
    f, kw = _quantize()
    kw.update(granularity="per_block", hadamard=True, block_size=64)
    return f, kw


def _dense_blocks():
    q, k, v = (torch.randn(2, 128, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, granularity="per_block", block_size=64)
    return flash_attn_func, dict(
        q=q8, k=k8, v=v8, q_descale=qd, k_descale=kd, v_descale=vd, descale_block_size=64, causal=True
    )


def _token_scales():
    f, kw = _paged()
    kw.pop("k_descale"), kw.pop("v_descale")
    kw.update(k_cache_scales=torch.rand(10, 16, 2) + 0.5, v_cache_scales=torch.rand(10, 16, 2) + 0.5)
    return f, kw


def _contiguous_cache():
    kc, vc = torch.randn(3, 24, 2, 64).to(E4M3), torch.randn(3, 24, 2, 64).to(E4M3)
    return flash_attn_with_kvcache, dict(
        q=torch.randn(2, 1, 4, 64, dtype=torch.bfloat16),
        k_cache=kc,
        v_cache=vc,
        cache_seqlens=torch.tensor([5, 20], dtype=torch.int32),
        cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32),
        k_descale=torch.rand(2, 2) + 0.5,
        v_descale=torch.rand(2, 2) + 0.5,
    )


def _leftpad():
    f, kw = _contiguous_cache()
    kw.update(
        cache_leftpad=torch.tensor([2, 9], dtype=torch.int32),
        k=torch.randn(2, 1, 2, 64, dtype=torch.bfloat16),
        v=torch.randn(2, 1, 2, 64, dtype=torch.bfloat16),
    )
    return f, kw


def _rotary():
    f, kw = _append()
    kw.update(rotary_cos=torch.rand(64, 16), rotary_sin=torch.rand(64, 16))
    return f, kw


def _scaled_bmm():
    from fp8attn.ops import scaled_bmm

    return scaled_bmm, dict(
        a=torch.randn(2, 5, 16).to(E4M3),
        b=torch.randn(2, 16, 7).to(E4M3),
        scale_a=torch.rand(2, 5) + 0.5,
        scale_b=torch.rand(2, 1, 7) + 0.5,
    )


def _quant_helpers():
    from fp8attn.quant import quantize

    return quantize, dict(x=torch.randn(2, 128, 2, 64), granularity="per_block", block_size=64)


CALLS = dict(
    dense=_dense,
    varlen=_varlen,
    paged=_paged,
    paged_varlen=_paged_varlen,
    append=_append,
    write=_write,
    combine=_combine,
    quantize=_quantize,
    quantize_blocks=_quantize_blocks,
    dense_blocks=_dense_blocks,
    token_scales=_token_scales,
    contiguous_cache=_contiguous_cache,
    leftpad=_leftpad,
    rotary=_rotary,
    scaled_bmm=_scaled_bmm,
    quant=_quant_helpers,
)

_SCALARS = (
    ("softmax_scale", -1.0),
    ("softmax_scale", float("nan")),
    ("softcap", -1.0),
    ("window_size", (3,)),
    ("window_size", (-5, 2)),
    ("num_splits", -2),
    ("num_splits", 2.5),
    ("out_dtype", torch.int8),
    ("out_scale", torch.tensor([1.0, 2.0])),
    ("out", torch.empty(1)),
)


def _tensor_mutations(val):
    yield "float64", val.double()
    yield "int64", val.long()
    yield "float32", val.float()
    yield "drop_dim", val[0] if val.dim() > 0 else val
    yield "add_dim", val.unsqueeze(0)
    if val.dim() > 0:
        yield "zero_rows", val[:0]
    if val.dim() >= 1 and val.shape[-1] > 1:
        yield "noncontig_last", val.transpose(-1, -2) if val.dim() >= 2 else val[::2]
        yield "shrink_last", val[..., :-1]
    if val.dim() >= 2:
        yield "shrink_first", val[:-1]
        yield "grow_first", torch.cat([val, val[:1]])
    if val.dtype in (torch.int32, torch.int64):
        yield "negative", val - 1000
        yield "huge", val + 10**6
    if val.is_floating_point() and val.dtype != E4M3:
        nan = val.contiguous().clone()
        nan.view(-1)[0] = float("nan")
        yield "nan", nan
        yield "zeros", torch.zeros_like(val)
    yield "list", val.tolist()
    yield "meta", val.to("meta")


def _mutations(kw):
    for name, val in kw.items():
        if torch.is_tensor(val):
            for kind, bad in _tensor_mutations(val):
                yield name, kind, bad
        elif isinstance(val, bool):
            yield name, "str", "yes"
        elif isinstance(val, str):
            yield name, "unknown", "bogus"
            yield name, "int", 3
        elif isinstance(val, int):
            for kind, bad in (
                ("negative", -3),
                ("zero", 0),
                ("float", 2.5),
                ("str", "3"),
                ("tensor", torch.tensor(val)),
            ):
                yield name, kind, bad
    for name, bad in _SCALARS:
        yield name, "set", bad


class _Hang(Exception):
    pass


def _alarm(*_):
    raise _Hang()


def _outcome(fn, kw):
    """'ok', 'ok NaN', 'clear', or what went wrong."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(30)
    try:
        out = fn(**kw)
    except NotImplementedError:
        return "clear"
    except (ValueError, TypeError) as e:
        return "clear" if "expected" in str(e) else f"unformatted {type(e).__name__}: {e}"
    except _Hang:
        return "hang"
    except Exception as e:  # noqa: BLE001 -- the point of the test
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    nan = any(
        torch.is_tensor(o)
        and o.is_floating_point()
        and o.device.type != "meta"
        and o.numel()
        and bool(torch.isnan(o.float()).any())
        for o in outs
    )
    return "ok NaN" if nan else "ok"


def _snapshot(kw):
    """The bytes of every (non-meta) tensor argument, as uint8 (NaN slots compare equal)."""
    return {
        n: torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()).reshape(-1).view(torch.uint8)
        for n, t in kw.items()
        if torch.is_tensor(t) and t.device.type != "meta"
    }


@pytest.mark.parametrize("call", list(CALLS))
def test_one_bad_argument_at_a_time(call):
    fn, kw = CALLS[call]()
    assert _outcome(fn, kw) == "ok"
    bad = []
    for name, kind, value in _mutations(kw):
        for validate in (False, True) if "validate" in fn.__code__.co_varnames else (None,):
            fn, kw2 = CALLS[call]()  # fresh inputs (caches are written in place)
            kw2[name] = value
            if validate is not None:
                kw2["validate"] = validate
            before = _snapshot(kw2)
            res = _outcome(fn, kw2)
            if res == "ok NaN" and kind == "nan":
                continue  # NaN in, NaN out
            if res not in ("ok", "clear"):
                bad.append(f"{name} {kind} validate={validate}: {res}")
            elif res == "clear" and _snapshot(kw2).keys() == before.keys():
                changed = [n for n, b in _snapshot(kw2).items() if not torch.equal(b, before[n])]
                if changed:  # nothing lost: a refused call writes nothing
                    bad.append(f"{name} {kind} validate={validate}: refused after writing {changed}")
    assert not bad, "\n".join(bad)
