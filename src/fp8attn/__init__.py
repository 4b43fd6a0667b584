"""fp8attn: FP8 attention for LLM inference and training (FA3-compatible API)."""

from . import mla, quant, reference
from .compile import fused_output_quant_supported
from .interface import (
    flash_attn_combine,
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    get_scheduler_metadata,
    write_kv_cache,
)
from .paged_cache import split_workspace
from .qkv import quantize_qkv
from .training import attention, get_fp8_backward, set_fp8_backward

__version__ = "0.1.0"

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "get_scheduler_metadata",
    "write_kv_cache",
    "quantize_qkv",
    "fused_output_quant_supported",
    "split_workspace",
    "attention",
    "set_fp8_backward",
    "get_fp8_backward",
    "mla",
    "quant",
    "reference",
    "__version__",
]
