"""Static per-tensor FP8 output quantization: the standalone (unfused) kernel.

``fp8attn::quant_fp8_static(x, scale)`` (registered in :mod:`fp8attn.ops`) computes
``clamp(x * (1 / scale), -448, 448)`` cast to e4m3fn. On CUDA it runs the one-pass Triton kernel
below (one read of ``x``, one FP8 write) through ``kernels.common.output_epilogue`` -- the same
epilogue the attention kernels fuse with ``out_scale=`` -- so the fused and unfused paths round the
same way. On CPU it runs the same arithmetic in torch (float32 ``1 / scale``, multiply, saturate).

This kernel is the "unfused" peer of the fused-output benchmark and the op that the
``fp8attn.compile`` fusion pass removes.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["launch_quant_fp8_static", "quant_fp8_static_torch"]


def quant_fp8_static_torch(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch form: ``clamp(x.float() * (1 / scale), -448, 448).to(e4m3fn)``.

    Parameters
    ----------
    x : any shape, bf16 / fp16 / fp32. scale : float32, one element.

    Returns
    -------
    float8_e4m3fn, x's shape, contiguous.
    """
    inv = 1.0 / scale.float().reshape(())
    y = (x.float() * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device).copy_(y)


@functools.lru_cache(None)
def launch_quant_fp8_static():
    """Return the CUDA launch function ``launch(x, scale, y)`` (None without triton)."""
    try:
        import triton
        import triton.language as tl

        from .kernels.common import cdiv, output_epilogue
    except ImportError:
        return None

    @triton.jit
    def _quant_kernel(X, Y, S, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        inv = 1.0 / tl.load(S)
        tl.store(Y + offs, output_epilogue(x, inv, True, tl.float8e4nv), mask=m)

    def launch(x: torch.Tensor, scale: torch.Tensor, y: torch.Tensor) -> None:
        """x: any shape 16/32-bit; scale: float32 one element; y: e4m3fn contiguous, x's shape."""
        xc = x if x.is_contiguous() else x.contiguous()
        n = xc.numel()
        if n == 0:
            return
        block = 2048
        _quant_kernel[(cdiv(n, block),)](xc, y, scale, n, BLOCK=block, num_warps=8)

    return launch
