"""A fusion barrier: the identity, which IREE's dispatch creation does not fuse across.

With aggressive fusion (export/compile.py FUSION_FLAGS) IREE 3.13 pulls a reduction's producers into
the reduction's dispatch, and for two of the model's counts the GPU code generation of the fused
dispatch then fails: a count over a gathered operand ("failed to distribute") and a count over the
radix select's order keys ("failed to bufferize"; docs/performance.md, Dispatches per step). Where the
barrier stands, the producer stays in a dispatch of its own and the count compiles. Eager it is the
identity, and so is the compiled kernel (a ``util.optimization_barrier``, which the compiler drops
after forming the dispatches).
"""

from __future__ import annotations

import torch

from . import kernel


@kernel("fusion_barrier", args={"x": "..., N"}, results={"y": "..., N"}, mlir="barrier.mlir.jinja")
def fusion_barrier(x: torch.Tensor) -> torch.Tensor:
    """x itself; the export keeps x's producers out of the dispatches that read x."""
    return x
