"""Alias of :mod:`fp8attn.bench.engine` (the ``engine`` benchmark routine), kept so
``python -m fp8attn.engine.bench`` keeps working for this release; use ``fp8attn bench engine``."""

from ..bench.engine import *  # noqa: F401,F403
from ..bench.engine import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
