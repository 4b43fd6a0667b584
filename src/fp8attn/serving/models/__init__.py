"""Small Llama runner for the demo and driver: weights/tokenizer loading and a paged-attention forward."""

from .llama import LLAMA3_8B, LlamaConfig, LlamaModel, rope_inv_freq
from .loading import MissingDependency, default_gguf_path, load_pretrained, load_tokenizer, require

__all__ = [
    "LlamaConfig",
    "LlamaModel",
    "LLAMA3_8B",
    "rope_inv_freq",
    "MissingDependency",
    "require",
    "default_gguf_path",
    "load_pretrained",
    "load_tokenizer",
]
