"""Integrations of fp8attn with other libraries; each submodule imports its library on import.

- :mod:`fp8attn.integrations.transformers`: ``attn_implementation="fp8attn"`` for Hugging Face
  transformers models and :class:`~fp8attn.integrations.transformers.FP8Cache`, an FP8 KV cache for
  ``generate()``. Importing it registers the attention implementation.

The core library never imports this package.
"""

__all__: list[str] = []
