"""Top-k index selection, the one place every top-k of the model goes through.

IREE 3.13 can return correct top-k values with wrong indices when a top-k follows other work on
a dynamic token dim (iree-notes §6, bug 6), so export may swap this for an exact formulation; the
eager reference is torch.topk.
"""

from __future__ import annotations

import torch


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim (int64)."""
    return x.topk(k, dim=-1).indices
