"""Inputs on a GPU that is not the current device (cuda:1 while cuda:0 is current).

Triton launches on the current device; the ops make the inputs' device current around every launch
(``capability.launch_device``). GPU, two devices: every kernel-backed entry point gives on cuda:1,
with cuda:0 current, exactly what it gives with cuda:1 current.
"""

import pytest
import torch

import fp8attn

pytestmark = pytest.mark.gpu


def _need_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")


def _bits(x):
    return x.view(torch.uint8) if x.element_size() == 1 else x


def _calls(dev):
    """Every kernel-backed entry point on tensors of ``dev`` (same seed -> same inputs on any device)."""
    g = torch.Generator().manual_seed(0)
    b, s, h, d = 2, 256, 4, 128
    x = [torch.randn(b, s, h, d, generator=g).to(dev, torch.bfloat16) for _ in range(3)]
    q8, k8, v8, qd, kd, vd = fp8attn.quantize_qkv(*x)
    dense = fp8attn.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    ps, pages = 16, 64
    kc = torch.zeros(pages, ps, h, d, device=dev, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    slots = torch.arange(b * s // 2, device=dev, dtype=torch.int64)
    kn, vn = x[1][:, : s // 2].reshape(-1, h, d), x[2][:, : s // 2].reshape(-1, h, d)
    one = torch.ones((), device=dev)
    fp8attn.write_kv_cache(kn, vn, kc, vc, slots, k_descale=one, v_descale=one)
    pt = torch.arange(pages, device=dev, dtype=torch.int32).view(b, -1)[:, : s // 2 // ps]
    cs = torch.full((b,), s // 2, device=dev, dtype=torch.int32)
    qd1 = x[0][:, :1]
    ones = torch.ones(b, h, device=dev)
    dec = fp8attn.flash_attn_with_kvcache(
        qd1, kc, vc, cache_seqlens=cs, page_table=pt, causal=True, k_descale=ones, v_descale=ones, num_splits=3
    )
    a8 = q8[0].transpose(0, 1).contiguous()  # (heads, seqlen, d) as a batch of matrices
    bmm = fp8attn.ops.scaled_bmm(
        a8,
        k8[0].permute(1, 2, 0),
        qd[0].reshape(h, 1, 1).expand(h, s, 1).contiguous(),
        kd[0].reshape(h, 1, 1).contiguous(),
        torch.bfloat16,
    )
    return [q8, k8, v8, qd, kd, vd, dense, kc, vc, dec, bmm]


def test_inputs_on_a_non_current_gpu_match_the_same_call_on_that_gpu():
    _need_two_gpus()
    with torch.cuda.device(1):
        want = [t.cpu() for t in _calls("cuda:1")]
    torch.cuda.set_device(0)
    got = _calls("cuda:1")
    torch.cuda.synchronize(1)
    for i, (a, b_) in enumerate(zip(got, want)):
        assert a.device == torch.device("cuda:1"), i
        assert torch.equal(_bits(a.cpu()), _bits(b_)), f"output {i} differs"
