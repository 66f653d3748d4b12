"""Lightning-indexer hook: score compressed entries and select the top-k per query (docs/model.md, Forward pass).

score[t, j] = sum_h w[t, h] * relu(q[t, h] · k[j]) over entries j < n_visible[t]; the k best
visible entries are returned as indices (-1 where fewer than k are visible). The product runs
in the inputs' dtype (bf16 in the reference). Selection must be exact: a kernel is checked on the
indices it returns, not on the scores.
"""

from __future__ import annotations

import torch

from . import kernel
from .topk import topk_indices


@kernel("indexer_scores", args={"q": "B, T, Hi, Di", "w": "B, T, Hi", "keys": "B, R, Di"},
        results={"scores": "B, T, R"}, static=("Hi", "Di", "R"),
        dtypes={"q": (torch.float32, torch.bfloat16), "w": (torch.float32, torch.bfloat16), "keys": (torch.float32, torch.bfloat16)},
        mlir="indexer.mlir.jinja", trace_sizes=("T",))
def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [B,T,Hi,di], w [B,T,Hi], keys [B,R,di] -> scores [B,T,R] (input dtype). The kernel sums in f32 and
    rounds once; it pads a prefill's query rows so GPUs run the dots on the matrix cores (indexer.mlir.jinja)."""
    s = torch.einsum("bthd,brd->bthr", q, keys).relu()
    return (s * w[..., None]).sum(2)


def indexer_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, n_visible: torch.Tensor,
                 k: int) -> torch.Tensor:
    """Top-k visible entries per query: [B,T,k] int64 entry indices, -1 where not visible."""
    R = keys.shape[1]
    s = indexer_scores(q, w, keys).float()
    visible = torch.arange(R, device=s.device)[None, None, :] < n_visible[..., None]
    s = s.masked_fill(~visible, float("-inf"))
    sel = topk_indices(s, min(k, R))
    # validity is decided by position, never by the score value (ties at -inf pick arbitrary rows)
    return torch.where(sel < n_visible[..., None], sel, -1)
