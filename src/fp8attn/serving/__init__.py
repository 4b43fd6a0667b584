"""Serving on top of the public API: the continuous-batching engine, the Llama runner, the ShareGPT prompts and
the ``fp8attn demo`` / ``fp8attn drive`` commands.

Nothing in the core (``fp8attn`` outside ``serving``, ``bench``, ``integrations`` and ``cli``) imports this
package: it is a user of the library, not a part of it, so the attention API loads without it.

=================  ==================================================================================
``engine``         paged KV cache, block allocator, scheduler, ``LLMEngine``, CUDA-graph decode, metrics
``models``         ``LlamaConfig`` / ``LlamaModel`` and the checkpoint / tokenizer loaders
``data``           ShareGPT prompts for the demo, the driver and the benchmarks
``demo``           ``demo_main`` (``fp8attn demo``) and ``drive_main`` (``fp8attn drive``)
=================  ==================================================================================
"""

__all__ = ["engine", "models", "data", "demo"]
