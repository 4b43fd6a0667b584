"""Alias of :mod:`fp8attn.paged_cache`, kept so the documented ``fp8attn.paged.alloc_paged_cache`` (and the
module's other helpers) keep working for this release; new code imports ``fp8attn.paged_cache``."""

from .paged_cache import *  # noqa: F401,F403
from .paged_cache import __all__  # noqa: F401
