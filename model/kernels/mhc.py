"""mHC hot spot: the Sinkhorn normalization of the residual-mixing matrix (docs/model.md, Forward pass).

hc_pre turns each token's n x n `comb` logits into a (nearly) doubly stochastic matrix: softmax over
the last dim + eps, then one column normalization and `iters - 1` rounds of rows-then-columns. With
the released 20 iterations that is 39 normalizations, ~117 traced graph nodes per hc_pre and two
hc_pre per layer; the kernel (mhc.mlir.jinja) is one node, and one dispatch with the logits' affine
and softmax (apart, the softmax was one more dispatch per hc_pre: the kernel reads its input by
`tensor.extract`, through which IREE fuses no producer). Its sums run in a fixed order,
((c0 + c1) + c2) + c3, the order torch's CPU reduction uses for these 4-wide rows and columns.
"""

from __future__ import annotations

import torch

from . import kernel


@kernel("hc_sinkhorn", args={"mix": "..., M", "scale": "3", "base": "M", "n": int, "iters": int, "eps": float},
        results={"comb": "..., n, n"}, static=("M",),
        dtypes={"mix": (torch.float32,), "scale": (torch.float32,), "base": (torch.float32,)}, mlir="mhc.mlir.jinja")
def hc_sinkhorn(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int, iters: int,
                eps: float) -> torch.Tensor:
    """mHC's residual mixing matrix [..., n, n] from the mixing logits mix [..., (2+n)n] (fp32): the
    last n*n logits times scale[2] plus base, softmax over each row + eps, then the columns normalized
    and iters-1 rounds of rows, columns; each step x / (sum + eps)."""
    comb = (mix[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):  # Sinkhorn: rows then columns
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb
