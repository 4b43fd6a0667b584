"""Alias of :mod:`fp8attn.serving.demo`, kept so ``fp8attn.demo`` imports keep working for this release;
new code imports ``fp8attn.serving.demo``."""

from .serving.demo import *  # noqa: F401,F403
from .serving.demo import __all__  # noqa: F401
