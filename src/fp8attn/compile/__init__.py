"""torch.compile integration: the static FP8 output-quantization fusion pass.

>>> import fp8attn.compile
>>> fp8attn.compile.enable_output_quant_fusion()      # before torch.compile(...) runs
>>> fn = torch.compile(step, fullgraph=True, dynamic=True)

The pass (:mod:`fp8attn.compile.output_quant`) runs as Inductor's ``post_grad_custom_post_pass``
and folds ``attention -> view/reshape -> static per-tensor FP8 quant`` into the attention op's
``out_scale=`` (the kernel writes e4m3fn directly; the 16-bit intermediate disappears). Only static
per-tensor quantization fuses; :func:`fused_output_quant_supported` says which kinds do.
"""

from __future__ import annotations

__all__ = [
    "enable_output_quant_fusion",
    "disable_output_quant_fusion",
    "output_quant_fusion_enabled",
    "fused_output_quant_supported",
    "QUANT_KINDS",
]

# kind -> fuses into the attention epilogue?
QUANT_KINDS = {
    "static_per_tensor": True,
    "dynamic_per_tensor": False,
    "static_per_token": False,
    "dynamic_per_token": False,
    "per_group": False,
    "per_block": False,
    "per_channel": False,
    "mx": False,
}
_ALIASES = {
    "static": "static_per_tensor",
    "per_tensor": "static_per_tensor",
    "dynamic": "dynamic_per_tensor",
    "per_token": "dynamic_per_token",
    "group": "per_group",
    "block": "per_block",
    "mxfp8": "mx",
}
_WHY = (
    "the attention epilogue has one static scale per output tensor; {kind} needs a scale computed "
    "from (or varying over) the output, so quantize the output separately"
)


def _canon(kind: str) -> str:
    if not isinstance(kind, str):
        raise TypeError(f"kind: expected a string such as 'static_per_tensor', got {type(kind).__name__}.")
    k = kind.lower().replace("-", "_")
    k = _ALIASES.get(k, k)
    if k not in QUANT_KINDS:
        raise ValueError(f"kind: expected one of {sorted(QUANT_KINDS)} (or {sorted(_ALIASES)}), got {kind!r}.")
    return k


def fused_output_quant_supported(kind: str) -> bool:
    """Whether output quantization of ``kind`` fuses into the attention kernels (``out_scale=``).

    True only for ``"static_per_tensor"`` (alias ``"static"``/``"per_tensor"``): a fixed float32
    scale for the whole output. Per-token, dynamic (scale from the output's amax), per-group/block,
    per-channel and MX kinds return False. An unknown kind raises ValueError.
    """
    return QUANT_KINDS[_canon(kind)]


def _installed():
    import torch._inductor.config as ic

    from .output_quant import OutputQuantFusionPass

    cur = ic.post_grad_custom_post_pass
    return cur if isinstance(cur, OutputQuantFusionPass) else None


def enable_output_quant_fusion(kinds=("static_per_tensor",)):
    """Install the fusion as Inductor's post-grad custom pass (idempotent). Returns the pass object.

    Parameters
    ----------
    kinds : iterable of str
        The quantization kinds to fuse. Only ``"static_per_tensor"`` fuses; asking for any other kind
        (``"dynamic_per_token"``, ``"per_group"``, ...) raises NotImplementedError.

    A post-grad custom pass that is already installed keeps running, before this one. Compiled
    graphs cache under the pass's uuid (a hash of its source), so enabling it changes the cache key.
    """
    if isinstance(kinds, str):
        kinds = (kinds,)
    for kind in kinds:
        k = _canon(kind)
        if not QUANT_KINDS[k]:
            raise NotImplementedError(
                f"output quantization kind {kind!r} does not fuse into fp8attn's attention kernels: "
                + _WHY.format(kind=k)
                + ". Only 'static_per_tensor' fuses."
            )
    import torch._inductor.config as ic

    from .output_quant import OutputQuantFusionPass

    p = _installed()
    if p is not None:
        return p
    p = OutputQuantFusionPass(chained=ic.post_grad_custom_post_pass)
    ic.post_grad_custom_post_pass = p
    return p


def disable_output_quant_fusion() -> None:
    """Remove the pass (restoring a chained pass that was installed before it)."""
    import torch._inductor.config as ic

    p = _installed()
    if p is not None:
        ic.post_grad_custom_post_pass = p.chained


def output_quant_fusion_enabled() -> bool:
    return _installed() is not None
