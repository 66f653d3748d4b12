"""RMSNorm as one kernel op: the norm before every attention and expert block, of q, of the KV, of the
compressed entries and before the head (docs/model.md, Forward pass).

Traced as torch, a norm was three dispatches in a decode step (the fp32 copy of x, the sum of squares,
the scaling: 4 norms a layer, 12 dispatches); the kernel (norm.mlir.jinja) converts x to fp32 inside
both of its generics, so the copy is never written, and IREE fuses the sum into the scaling's dispatch.
"""

from __future__ import annotations

import torch

from . import kernel

_F = (torch.float32, torch.bfloat16)


# x [B, T, D], not "..., D": flattening a leading T // m + 1 (a compressor's entries) into one dim made
# torch.export guard the traced prompt length
@kernel("rms_norm", args={"x": "B, T, D", "weight": "D", "eps": float}, results={"y": "B, T, D"}, static=("D",),
        dtypes={"x": _F, "weight": (torch.float32,)}, mlir="norm.mlir.jinja")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) in fp32, returned in x's dtype (the mean: the sum over D,
    divided by D)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)
