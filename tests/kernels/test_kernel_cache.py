"""write_kv_cache kernel (kernels/cache.py): scale modes, skipped slots, round trips, int64 offsets."""

import pytest
import torch

from fp8attn.kernels.cache import launch_write_kv_cache
from fp8attn.paged_cache import to_v_seq_major
from fp8attn.quant import compute_descale, saturating_cast

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _setup(num_tokens=13, hk=3, d=32, dv=None, num_blocks=7, page_size=4, dtype=E4M3):
    dv = d if dv is None else dv
    k = (torch.randn(num_tokens, hk, d) * 3).to(DEV, torch.bfloat16)
    v = (torch.randn(num_tokens, hk, dv) * 3).to(DEV, torch.bfloat16)
    kc = torch.empty(num_blocks, page_size, hk, d, dtype=dtype, device=DEV)
    vc = torch.empty(num_blocks, page_size, hk, dv, dtype=dtype, device=DEV)
    for c in (kc, vc):
        if dtype in (E4M3, E5M2):
            c.view(torch.uint8).fill_(0x7F)
        else:
            c.fill_(float("nan"))
    slots = torch.randperm(num_blocks * page_size)[:num_tokens].to(DEV)
    slots[[1, 5]] = -1  # padding tokens: skipped
    return k, v, kc, vc, slots


def _gather(c, slots):
    ps = c.shape[1]
    s = slots[slots >= 0].long()
    return c[s // ps, s % ps]


def _untouched(c, slots):
    ps = c.shape[1]
    mask = torch.ones(c.shape[0] * ps, dtype=torch.bool, device=c.device)
    mask[slots[slots >= 0].long()] = False
    flat = (
        c.view(torch.uint8).reshape(c.shape[0] * ps, -1) if c.dtype in (E4M3, E5M2) else c.reshape(c.shape[0] * ps, -1)
    )
    rest = flat[mask]
    return (rest == 0x7F).all() if c.dtype in (E4M3, E5M2) else rest.isnan().all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_static_per_tensor(dtype):
    k, v, kc, vc, slots = _setup(dtype=dtype, dv=24)
    kd, vd = torch.tensor(0.37, device=DEV), torch.tensor([[1.9]], device=DEV)
    launch_write_kv_cache(k, v, kc, vc, slots, k_descale=kd, v_descale=vd)
    keep = slots >= 0
    assert torch.equal(
        _gather(kc, slots).view(torch.uint8), saturating_cast(k[keep].float() / 0.37, dtype).view(torch.uint8)
    )
    assert torch.equal(
        _gather(vc, slots).view(torch.uint8), saturating_cast(v[keep].float() / vd.reshape(()), dtype).view(torch.uint8)
    )
    assert _untouched(kc, slots) and _untouched(vc, slots)


def test_static_per_seq_head_saturates():
    k, v, kc, vc, slots = _setup()
    seq = torch.tensor([0] * 5 + [1] * 4 + [2] * 4, dtype=torch.int32, device=DEV)
    kd = (torch.rand(3, 3) + 0.01).to(DEV)
    vd = (torch.rand(3, 3) * 0.01 + 1e-3).to(DEV)  # tiny descales: most V values saturate
    launch_write_kv_cache(k, v, kc, vc, slots, k_descale=kd, v_descale=vd, token_seq_idx=seq)
    keep = slots >= 0
    rk = saturating_cast(k.float() / kd[seq.long()][..., None], E4M3)[keep]
    rv = saturating_cast(v.float() / vd[seq.long()][..., None], E4M3)[keep]
    assert torch.equal(_gather(kc, slots).view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(_gather(vc, slots).view(torch.uint8), rv.view(torch.uint8))
    assert (_gather(vc, slots).float().abs() == 448).any()
    assert _untouched(kc, slots)


def test_per_token_head_dynamic_round_trip():
    k, v, kc, vc, slots = _setup(hk=2, d=64)
    k[3, 1] = 0  # zero amax: floored descale, no NaN
    ks = torch.full(kc.shape[:3], float("nan"), device=DEV)
    vs = torch.full(vc.shape[:3], float("nan"), device=DEV)
    launch_write_kv_cache(k, v, kc, vc, slots, k_cache_scales=ks, v_cache_scales=vs)
    keep = slots >= 0
    ps = kc.shape[1]
    s = slots[keep].long()
    for x, c, sc in ((k, kc, ks), (v, vc, vs)):
        d_ref = compute_descale(x[None], "per_token_head")[0][keep]
        assert torch.equal(sc[s // ps, s % ps], d_ref)
        x8 = saturating_cast(x[keep].float() / d_ref[..., None], E4M3)
        assert torch.equal(_gather(c, slots).view(torch.uint8), x8.view(torch.uint8))
        deq = _gather(c, slots).float() * sc[s // ps, s % ps][..., None]
        err = (deq - x[keep].float()).abs().max() / x.float().abs().max()
        assert err <= 2**-4  # e4m3 relative precision
    assert torch.isnan(
        ks.view(-1, 2)[torch.ones(ks.shape[0] * ps, dtype=torch.bool, device=DEV).index_fill_(0, s, False)]
    ).all()
    assert not torch.isnan(ks[s // ps, s % ps]).any()


def test_bf16_cache_plain_copy():
    k, v, kc, vc, slots = _setup(dtype=torch.bfloat16)
    launch_write_kv_cache(k, v, kc, vc, slots, k_descale=torch.tensor(3.0, device=DEV))
    keep = slots >= 0
    assert torch.equal(_gather(kc, slots), k[keep]) and torch.equal(_gather(vc, slots), v[keep])
    assert _untouched(vc, slots)


@pytest.mark.gpu
def test_int64_offsets_large_cache():
    """A cache of more than 2**31 elements; writes land in the last pages."""
    ps, hk, d = 256, 8, 128
    nb = (2**31) // (ps * hk * d) + 2
    kc = torch.empty(nb, ps, hk, d, dtype=E4M3, device="cuda")
    vc = torch.empty(nb, ps, hk, d, dtype=E4M3, device="cuda")
    k = torch.randn(4, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(4, hk, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([(nb - 1) * ps + 255, (nb - 1) * ps, (nb - 2) * ps + 7, 3], device="cuda")
    launch_write_kv_cache(k, v, kc, vc, slots, k_descale=torch.tensor(0.5, device="cuda"))
    got = kc[slots // ps, slots % ps]
    assert torch.equal(got.view(torch.uint8), saturating_cast(k.float() / 0.5).view(torch.uint8))


@pytest.mark.parametrize("scales", ["static", "per_token_head", "bf16_copy"])
def test_v_seq_major_cache_same_values(scales):
    """A sequence-major V cache (memory order (blocks, heads, headdim, page)) receives exactly the values
    of the standard layout; untouched slots stay poisoned."""
    dtype = torch.bfloat16 if scales == "bf16_copy" else E4M3
    k, v, kc, vc, slots = _setup(dv=24, page_size=8, dtype=dtype)
    nb, ps, hk, dv = vc.shape
    vs = to_v_seq_major(vc)
    kc2 = kc.clone()
    kw = {}
    if scales == "static":
        kw = dict(k_descale=torch.tensor(0.37, device=DEV), v_descale=torch.tensor([[1.9]], device=DEV))
    elif scales == "per_token_head":
        sc = lambda: torch.full((nb, ps, hk), float("nan"), device=DEV)
        kw = dict(k_cache_scales=sc(), v_cache_scales=sc())
        kw2 = dict(k_cache_scales=sc(), v_cache_scales=sc())
    launch_write_kv_cache(k, v, kc, vc, slots, **kw)
    launch_write_kv_cache(k, v, kc2, vs, slots, **(kw2 if scales == "per_token_head" else kw))
    bits = (lambda t: t.view(torch.uint8)) if dtype != torch.bfloat16 else (lambda t: t.view(torch.int16))
    assert torch.equal(bits(vs.contiguous()), bits(vc))
    assert torch.equal(bits(kc2), bits(kc))
    assert _untouched(vs.contiguous(), slots)
