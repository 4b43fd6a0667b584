"""Alias of :mod:`fp8attn.serving.models`, kept so ``fp8attn.models`` imports keep working for this release;
new code imports ``fp8attn.serving.models``."""

from .serving.models import *  # noqa: F401,F403
from .serving.models import __all__  # noqa: F401
