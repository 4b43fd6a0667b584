"""Rotary position embeddings applied by ``flash_attn_with_kvcache`` (FA3's rotary_cos / rotary_sin).

Torch ops on the caller's device (no host sync); the rotated Q and new K then go through the usual
kernels. Computed in float32 and cast back to the input dtype.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary"]


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` features of every head of ``x``.

    Parameters
    ----------
    x : (tokens, nheads, headdim) 16/32-bit.
    cos, sin : (seqlen_ro, rotary_dim / 2) float tensors.
    positions : (tokens,) integer position of each token (row of cos / sin).
    interleaved : True pairs features (0, 1), (2, 3), ... (GPT-J); False pairs (i, i + rotary_dim / 2)
        (GPT-NeoX).

    Returns
    -------
    A tensor of x's shape and dtype; features past rotary_dim are unchanged.
    """
    half = cos.shape[-1]
    rd = 2 * half
    c = cos.float()[positions.long()][:, None, :]  # (tokens, 1, half)
    s = sin.float()[positions.long()][:, None, :]
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rd:]), dim=-1) if rd < x.shape[-1] else out.to(x.dtype)
