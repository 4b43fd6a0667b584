"""The kernels: @triton.jit / Gluon code and the thin launchers that run it.

A leaf of the package: nothing here imports from ``fp8attn`` outside ``fp8attn.kernels``. Host-side launch
planning (window flags, the TMA kernels' call rules, the paged kernel's tiles, splits and grid, and the
constants the kernels share with the host) lives in ``planning``, which imports only torch; the Hopper
Gluon kernels live in ``hopper``. Importing this package imports none of its modules.
"""

__all__: list[str] = []
