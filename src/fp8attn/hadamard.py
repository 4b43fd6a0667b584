"""Random-sign Hadamard rotations for incoherent processing of Q and K (torch only).

``R = H_n @ diag(signs) / sqrt(n)`` applied block-diagonally over the head dimension, where ``n`` is
the largest power of two dividing the head dim (n = d for 64/128/256; 64 for 192) and ``signs`` are
±1 drawn from a seeded generator. ``R`` is orthogonal, so rotating Q and K by the same ``R`` leaves
``Q K^T`` unchanged while spreading outlier channels over the whole head, which shrinks the amax that
sets the FP8 scale.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["hadamard_block_size", "rotation_signs", "rotation_matrix", "rotate"]

DEFAULT_SEED = 0x5EED


def hadamard_block_size(d: int) -> int:
    """Largest power of two dividing ``d`` (capped at 256)."""
    n = d & (-d)
    return min(n, 256)


@functools.lru_cache(maxsize=64)
def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=64)
def rotation_signs(d: int, seed: int = DEFAULT_SEED) -> torch.Tensor:
    """float64 (d,) of ±1 from a seeded CPU generator (the same on every device)."""
    g = torch.Generator().manual_seed(int(seed))
    return (torch.randint(0, 2, (d,), generator=g, dtype=torch.int64) * 2 - 1).to(torch.float64)


@functools.lru_cache(maxsize=64)
def _rotation_cpu(d: int, seed: int, normalized: bool) -> torch.Tensor:
    n = hadamard_block_size(d)
    h = _sylvester(n)
    blocks = torch.block_diag(*([h] * (d // n)))
    r = torch.diag(rotation_signs(d, seed)) @ blocks  # rows scaled by signs: x @ r = (x * s) @ H
    return r / (n**0.5) if normalized else r


def rotation_matrix(
    d: int, seed: int = DEFAULT_SEED, device=None, dtype=torch.float32, normalized: bool = True
) -> torch.Tensor:
    """The (d, d) rotation ``R`` (``x_rot = x @ R``); ``normalized=False`` gives the ±1 matrix
    (exact in bf16), to be multiplied by ``1/sqrt(hadamard_block_size(d))``."""
    return _rotation_cpu(int(d), int(seed), bool(normalized)).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor, seed: int = DEFAULT_SEED) -> torch.Tensor:
    """Rotate the last dim of ``x`` (any leading shape) by ``R``; computed in float32, returns float32."""
    r = rotation_matrix(x.shape[-1], seed, device=x.device, dtype=torch.float32)
    return x.float() @ r
