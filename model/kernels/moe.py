"""MoE expert hook: routed SwiGLU experts weighted by the gate (spec §2.8).

Reference semantics: every token runs its top-k experts; g = w1 x, u = w3 x in fp32, clamped
(g <= L, |u| <= L), a = silu(g) * u * weight, out = w2(a in the activation dtype), summed in fp32.
This reference evaluates every expert on every token and zeroes the unrouted ones, which keeps the
graph static for export (a kernel replaces it with token-sorted grouped GEMMs); the result for a
routed token is the same as running only its experts.
"""

from __future__ import annotations

import torch

from . import hookable
from .linear import linear


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    g, u = g.float(), u.float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return torch.nn.functional.silu(g) * u


def _at(scale: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if scale is None else scale[e]


@hookable("moe_experts")
def moe_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                w1: torch.Tensor, s1: torch.Tensor | None, w2: torch.Tensor, s2: torch.Tensor | None,
                w3: torch.Tensor, s3: torch.Tensor | None, limit: float) -> torch.Tensor:
    """x [N,d], weights/indices [N,k]; w1/w3 [E,I,.], w2 [E,d,.] stacked (scales [E,..] or None) -> fp32 [N,d]."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w1.shape[0]):
        we = (weights * (indices == e)).sum(-1, keepdim=True)  # [N,1], 0 for tokens not routed to e
        a = swiglu(linear(x, w1[e], _at(s1, e)), linear(x, w3[e], _at(s3, e)), limit) * we
        y = y + linear(a.to(x.dtype), w2[e], _at(s2, e)).float()
    return y
