"""Paged KV cache (bf16 / fp16 / fp32 / FP8) with FP8 scale management; the model's attention callable."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import quant
from ...paged_cache import alloc_paged_cache

__all__ = ["PagedKVCache", "StepInputs", "KV_DTYPES", "SCALE_MODES"]

KV_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
SCALE_MODES = ("per_tensor", "per_seq_head", "per_token_head")
SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _scale_dtype(name: str) -> torch.dtype:
    if name not in SCALE_DTYPES:
        raise ValueError(
            f"scale_dtype (kv_scale_dtype) must be one of {sorted(SCALE_DTYPES)}, got {name!r}. "
            "Use 'bfloat16' to halve the per-token-head scale bytes."
        )
    return SCALE_DTYPES[name]


def _api():
    import fp8attn

    return fp8attn.write_kv_cache, fp8attn.flash_attn_with_kvcache


@dataclass
class StepInputs:
    """Attention metadata of one engine step (all tensors on the cache's device).

    cu_seqlens_q : (batch + 1,) int32 query offsets of the flat token batch.
    max_seqlen_q : int, longest chunk this step.
    cache_seqlens : (batch,) int32 cache length per sequence including this step's tokens.
    page_table : (batch, max_pages) int32 block ids (unused entries -1 or any id; never read).
    slot_mapping : (num_tokens,) int64 ``block * page_size + offset`` per token (negative = skip).
    token_seq_idx : (num_tokens,) int32 batch row of each token.
    k_descale, v_descale : (num_layers, batch, nheads_k) float32 per-(sequence, head) descales, or None.
    calib_rows : (batch,) bool rows whose per-(sequence, head) descales are calibrated this step.
    calib_tensor : bool, calibrate the per-tensor descales from this step's tokens.
    """

    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    cache_seqlens: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    token_seq_idx: torch.Tensor
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    calib_rows: torch.Tensor | None = None
    calib_tensor: bool = False


class PagedKVCache:
    """Per-layer paged K/V tensors of shape (num_blocks, page_size, nheads_k, head_dim).

    Parameters
    ----------
    num_layers, num_blocks, page_size, nheads_k, head_dim : int
    kv_dtype : str
        One of :data:`KV_DTYPES` ("bf16", "fp8", ...).
    scale_mode : str
        FP8 only. "per_tensor": one K and one V descale per layer; "per_seq_head": a (nheads_k,)
        descale per sequence and layer, carried by the sequence (``StepInputs.k_descale``);
        "per_token_head": dynamic descales per cached token and head, stored beside the cache.
    k_descale, v_descale : sequence of float or torch.Tensor, optional
        Static per-tensor descales, one per layer (``per_tensor`` only). Without them the descales
        are calibrated from the first step that holds prefill tokens, then frozen.
    calib_margin : float
        Calibrated descale = ``max(amax * calib_margin, floor) / fp8_max``; a margin > 1 leaves
        headroom for later tokens that exceed the calibration amax (they saturate otherwise).
    poison : bool
        Fill the cache with NaN (tests: unused slots must never be read).
    v_seq_major : bool
        Store V sequence-major inside each page (``fp8attn.paged.alloc_paged_cache(v_seq_major=True)``):
        same results; the FP8 P@V of prefill chunks reads V K-major on Hopper.
    scale_dtype : "float32" | "bfloat16"
        Storage of the per-token-head scales: bfloat16 halves their bytes (4 B per token and kv head
        for K and V: 0.78% of a bf16 cache at d128); descales are rounded up on storage so that no
        token clips (``quant.round_descale_for_storage``, applied by ``write_kv_cache``).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        page_size: int,
        nheads_k: int,
        head_dim: int,
        kv_dtype: str = "bf16",
        scale_mode: str = "per_tensor",
        k_descale=None,
        v_descale=None,
        calib_margin: float = 1.0,
        device="cpu",
        poison: bool = False,
        scale_dtype: str = "float32",
        v_seq_major: bool = False,
    ):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
        self.scale_dtype = _scale_dtype(scale_dtype)
        self.scale_dtype_name = scale_dtype
        self.dtype = KV_DTYPES[kv_dtype]
        self.kv_dtype = kv_dtype
        self.is_fp8 = quant.is_fp8(self.dtype)
        self.scale_mode = scale_mode if self.is_fp8 else None
        self.num_layers, self.num_blocks, self.page_size = num_layers, num_blocks, page_size
        self.nheads_k, self.head_dim = nheads_k, head_dim
        self.device = torch.device(device)
        self.calib_margin = float(calib_margin)
        self.fp8_max = quant.fp8_max(self.dtype) if self.is_fp8 else None
        shape = (num_blocks, page_size, nheads_k, head_dim)

        layers = [
            alloc_paged_cache(
                num_blocks,
                page_size,
                nheads_k,
                head_dim,
                self.dtype,
                self.device,
                poison_nan=poison,
                v_seq_major=v_seq_major,
            )
            for _ in range(num_layers)
        ]
        self.k = [k for k, _ in layers]
        self.v = [v for _, v in layers]
        self.k_scales = self.v_scales = None
        if self.scale_mode == "per_token_head":
            self.k_scales = [
                torch.ones(shape[:3], device=self.device, dtype=self.scale_dtype) for _ in range(num_layers)
            ]
            self.v_scales = [
                torch.ones(shape[:3], device=self.device, dtype=self.scale_dtype) for _ in range(num_layers)
            ]
        # per-tensor descales (num_layers, 1)
        self.k_descale = torch.ones(num_layers, 1, device=self.device)
        self.v_descale = torch.ones(num_layers, 1, device=self.device)
        self.tensor_calibrated = False
        if k_descale is not None or v_descale is not None:
            self.set_static_descales(k_descale, v_descale)
        self.meta: StepInputs | None = None

    # ------------------------------------------------------------------ scales
    def set_static_descales(self, k_descale, v_descale) -> None:
        """Fix the per-tensor descales: each a float or a (num_layers,) sequence / tensor."""
        for dst, src in ((self.k_descale, k_descale), (self.v_descale, v_descale)):
            t = torch.as_tensor(src, dtype=torch.float32).reshape(-1)
            dst.copy_(t.to(self.device).expand(self.num_layers).reshape(self.num_layers, 1))
        self.tensor_calibrated = True

    def descale_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        return quant.descale_from_amax(amax.float() * self.calib_margin, self.fp8_max)

    # ------------------------------------------------------------------ sizes
    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one token over all layers (plus per-token scales when used)."""
        return self.bytes_per_token_for(
            self.num_layers,
            self.nheads_k,
            self.head_dim,
            self.kv_dtype,
            self.scale_mode or "per_tensor",
            self.scale_dtype_name,
        )

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_blocks * self.page_size

    @staticmethod
    def bytes_per_token_for(
        num_layers, nheads_k, head_dim, kv_dtype, scale_mode="per_tensor", scale_dtype="float32"
    ) -> int:
        dt = KV_DTYPES[kv_dtype]
        b = 2 * num_layers * nheads_k * head_dim * dt.itemsize
        if quant.is_fp8(dt) and scale_mode == "per_token_head":
            b += 2 * num_layers * nheads_k * _scale_dtype(scale_dtype).itemsize
        return b

    # ------------------------------------------------------------------ attention callable
    def __call__(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this step's k/v of layer ``li`` into the cache, then attend.

        q (num_tokens, nheads_q, head_dim), k/v (num_tokens, nheads_k, head_dim), model dtype.
        Returns (num_tokens, nheads_q, head_dim) in q's dtype.
        """
        write_kv_cache, flash_attn_with_kvcache = _api()
        m = self.meta
        kc, vc = self.k[li], self.v[li]
        B = m.cache_seqlens.shape[0]
        kd = vd = None
        extra = {}
        if self.is_fp8 and self.scale_mode == "per_tensor":
            if m.calib_tensor:
                self.k_descale[li].copy_(self.descale_from_amax(k.abs().amax()).reshape(1))
                self.v_descale[li].copy_(self.descale_from_amax(v.abs().amax()).reshape(1))
            write_kv_cache(k, v, kc, vc, m.slot_mapping, k_descale=self.k_descale[li], v_descale=self.v_descale[li])
            kd, vd = self.k_descale[li], self.v_descale[li]  # (1,): per-tensor
        elif self.is_fp8 and self.scale_mode == "per_seq_head":
            kd, vd = m.k_descale[li], m.v_descale[li]
            if m.calib_rows is not None:
                for x, d in ((k, kd), (v, vd)):
                    amax = torch.zeros(B, self.nheads_k, device=x.device, dtype=torch.float32)
                    idx = m.token_seq_idx.long()[:, None].expand(-1, self.nheads_k)
                    amax.scatter_reduce_(0, idx, x.abs().amax(-1).float(), "amax")
                    d.copy_(torch.where(m.calib_rows[:, None], self.descale_from_amax(amax), d))
            write_kv_cache(k, v, kc, vc, m.slot_mapping, k_descale=kd, v_descale=vd, token_seq_idx=m.token_seq_idx)
        elif self.is_fp8:  # per_token_head
            write_kv_cache(
                k, v, kc, vc, m.slot_mapping, k_cache_scales=self.k_scales[li], v_cache_scales=self.v_scales[li]
            )
            extra = {"k_cache_scales": self.k_scales[li], "v_cache_scales": self.v_scales[li]}
        else:
            write_kv_cache(k, v, kc, vc, m.slot_mapping)
        if not self.is_fp8 and q.dtype != self.dtype:
            q = q.to(self.dtype)
        elif self.is_fp8 and q.dtype == torch.float32:
            q = q.to(torch.bfloat16)  # 16-bit queries over an FP8 cache
        out = flash_attn_with_kvcache(
            q,
            kc,
            vc,
            cache_seqlens=m.cache_seqlens,
            page_table=m.page_table,
            cu_seqlens_q=m.cu_seqlens_q,
            max_seqlen_q=m.max_seqlen_q,
            causal=True,
            k_descale=kd,
            v_descale=vd,
            **extra,
        )
        return out
