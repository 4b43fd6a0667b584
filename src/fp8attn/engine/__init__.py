"""Alias of :mod:`fp8attn.serving.engine`, kept so ``fp8attn.engine`` imports keep working for this release;
new code imports ``fp8attn.serving.engine``."""

from ..serving.engine import *  # noqa: F401,F403
from ..serving.engine import __all__  # noqa: F401
