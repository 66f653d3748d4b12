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
from .linear import stacked_linear


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    g, u = g.float(), u.float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return torch.nn.functional.silu(g) * u


def _group(t: torch.Tensor | None, e0: int, e1: int) -> torch.Tensor | None:
    return None if t is None else t[e0:e1]


EXPERT_GROUP = 16  # experts dequantized together: bounds eager memory for 256-expert layers


@hookable("moe_experts")
def moe_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                w1: torch.Tensor, s1: torch.Tensor | None, w2: torch.Tensor, s2: torch.Tensor | None,
                w3: torch.Tensor, s3: torch.Tensor | None, limit: float) -> torch.Tensor:
    """x [N,d], weights/indices [N,k]; w1/w3 [E,I,.], w2 [E,d,.] stacked (scales [E,..] or None) -> fp32 [N,d].

    Experts run in groups of EXPERT_GROUP through `stacked_linear` (same numerics as `linear` per
    expert); for the small presets that is a single group, which keeps the traced graph small."""
    E = w1.shape[0]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e0 in range(0, E, EXPERT_GROUP):
        e1 = min(E, e0 + EXPERT_GROUP)
        ids = torch.arange(e0, e1, device=x.device)
        # [e, N, 1]: each expert's gate weight per token, 0 where the token is not routed to it
        we = (weights[None] * (indices[None] == ids[:, None, None])).sum(-1, keepdim=True)
        g = stacked_linear(x, w1[e0:e1], _group(s1, e0, e1))
        u = stacked_linear(x, w3[e0:e1], _group(s3, e0, e1))
        a = swiglu(g, u, limit) * we
        y = y + stacked_linear(a.to(x.dtype), w2[e0:e1], _group(s2, e0, e1)).float().sum(0)
    return y
