"""The Hopper (sm90) TMA / wgmma kernels in Gluon, by role.

``signature`` (the launch signature, tiles, modes; Python only), ``softmax`` (the online-softmax step and
the P V product), ``epilogue`` (normalization, LSE, output cast and stores), ``pipeline`` (TMA boxes,
shared-memory rings and barriers, a query block's bounds), ``scheduler`` (the persistent schedule),
``consumer`` (the consumer warpgroups), ``forward`` (the warp-specialized kernels and their producer),
``backward`` (the attention backward kernel), and the launchers ``dense_launch``, ``paged_launch`` and
``backward_launch``. Importing this package imports none of them.
"""

__all__: list[str] = []
