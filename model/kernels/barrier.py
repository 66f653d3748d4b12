"""A fusion barrier: the identity, which IREE's dispatch creation does not fuse across.

With aggressive fusion (export/compile.py FUSION_FLAGS) IREE 3.13 pulls a reduction's producers into
the reduction's dispatch, and for two of the model's counts gfx942's code generation of the fused
dispatch then fails: the routed MoE's chunked rank with the `j < i` mask every layer shares fused in
("failed to distribute"), and the radix select's last threshold update fused with the count after it
("failed to bufferize"; docs/performance.md, Dispatches per step). Where the
barrier stands, the producer stays in a dispatch of its own and the count compiles. Eager it is the
identity, and so is the compiled kernel (an ``iree_tensor_ext.compute_barrier.end``, which the
compiler drops once the dispatches are formed; a ``util.optimization_barrier`` stayed in the stream
program and made the host wait for the GPU at every barrier).
"""

from __future__ import annotations

import torch

from . import kernel


@kernel("fusion_barrier", args={"x": "..., N"}, results={"y": "..., N"}, mlir="barrier.mlir.jinja")
def fusion_barrier(x: torch.Tensor) -> torch.Tensor:
    """x itself; the export keeps x's producers out of the dispatches that read x."""
    return x
