"""Alias of :mod:`fp8attn.serving.data`, kept so ``fp8attn.data`` imports keep working for this release;
new code imports ``fp8attn.serving.data``."""

from .serving.data import *  # noqa: F401,F403
from .serving.data import __all__  # noqa: F401
