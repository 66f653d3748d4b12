"""mHC hot spot: the Sinkhorn normalization of the residual-mixing matrix (docs/model.md, Forward pass).

hc_pre turns each token's n x n `comb` logits into a (nearly) doubly stochastic matrix: softmax over
the last dim + eps, then one column normalization and `iters - 1` rounds of rows-then-columns. With
the released 20 iterations that is 39 normalizations, ~117 traced graph nodes per hc_pre and two
hc_pre per layer; the kernel (mhc.mlir.jinja) is one node. Its sums run in a fixed order,
((c0 + c1) + c2) + c3, the order torch's CPU reduction uses for these 4-wide rows and columns.
"""

from __future__ import annotations

import torch

from . import kernel


@kernel("hc_sinkhorn", args={"comb": "..., N, N", "iters": int, "eps": float}, results={"y": "..., N, N"},
        static=("N",), dtypes={"comb": (torch.float32,)}, mlir="mhc.mlir.jinja")
def hc_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., n, n] fp32 (positive) -> columns normalized, then iters-1 rounds of rows, columns;
    each step x / (sum + eps)."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):  # Sinkhorn: rows then columns
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb
