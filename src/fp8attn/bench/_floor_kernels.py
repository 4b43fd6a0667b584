"""Triton kernels that set floors: do-nothing kernels for `bench host`'s launch floors, a read-only kernel for
`bench decode --read-ceiling` (triton reads a kernel's source from its file)."""

import triton
import triton.language as tl


@triton.jit
def floor_1(X, a0):
    pass


@triton.jit
def floor_64(
    X,
    a0,
    a1,
    a2,
    a3,
    a4,
    a5,
    a6,
    a7,
    a8,
    a9,
    a10,
    a11,
    a12,
    a13,
    a14,
    a15,
    a16,
    a17,
    a18,
    a19,
    a20,
    a21,
    a22,
    a23,
    a24,
    a25,
    a26,
    a27,
    a28,
    a29,
    a30,
    a31,
    a32,
    a33,
    a34,
    a35,
    a36,
    a37,
    a38,
    a39,
    a40,
    a41,
    a42,
    a43,
    a44,
    a45,
    a46,
    a47,
    a48,
    a49,
    a50,
    a51,
    a52,
    a53,
    a54,
    a55,
    a56,
    a57,
    a58,
    a59,
    a60,
    a61,
    a62,
    a63,
):
    pass


@triton.jit
def _read_kernel(X, Out, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Sum of program ``pid``'s contiguous CHUNK int32 words of X (each read once, BLOCK per step, not cached
    in L1), so that the loads cannot be dropped."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for s in range(0, CHUNK, BLOCK):
        offs = base + s + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0, cache_modifier=".cg")
    tl.store(Out + pid, tl.sum(acc, 0))


def read_fn(x32, chunk, block, warps):
    """A callable that reads every int32 word of ``x32`` once (``_read_kernel``, ``chunk`` words per program)."""
    import torch

    n = x32.numel()
    grid = (triton.cdiv(n, chunk),)
    out = torch.empty(grid[0], dtype=torch.int32, device=x32.device)
    return lambda: _read_kernel[grid](x32, out, n, CHUNK=chunk, BLOCK=block, num_warps=warps)
