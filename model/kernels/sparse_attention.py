"""Sparse attention hook: gather the selected KV rows, sink-aware softmax, P·V (docs/model.md, Forward pass).

One K=V head of width D shared by all H query heads. Each query attends to the rows of `kv` named
by `idx` (-1 = no row). The attention sink adds exp(sink_h) to the softmax denominator and
carries no value. Numerics as the reference kernel: fp32 scores and softmax, P rounded to the KV
dtype before the P·V product, fp32 accumulation, output in q's dtype.
"""

from __future__ import annotations

import torch

from . import kernel

_F = (torch.float32, torch.bfloat16)

# Exports lower this op as its MLIR kernel. The traced reference's lowering (IREE fusing the gather and
# einsums below) returned NaN rows from Flash's first HCA layer on cuda in some builds (the last row of
# decode_bs40/48/64), and no build with the kernel did (docs/performance.md, GPU faults). It costs
# the H200 decode time (Flash-4: +1.2 ms at batch 1, +3-4 % at 8-64; docs/performance.md); on llvm-cpu
# it is as fast (embedded default, docs/performance.md). Compiled alone, the kernel itself
# returns a batch's last row non-finite on cuda when K is not a multiple of 16 (the reference was right
# there): the model pads idx (model.selection_rows; `git show a7b70ea:bench/sparse_attention_rows.py`).


@kernel("sparse_attention",
        args={"q": "B, T, H, D", "kv": "B, N, D", "idx": "B, T, K", "sink": "H", "scale": float},
        results={"out": "B, T, H, D"}, static=("H", "D"),
        dtypes={"q": _F, "kv": _F, "idx": (torch.int64,), "sink": (torch.float32,)},
        mlir="sparse_attention.mlir.jinja")
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [B,T,H,D], kv [B,N,D], idx [B,T,K] int (-1 masked), sink [H] fp32 -> [B,T,H,D]."""
    B = q.shape[0]
    batch = torch.arange(B, device=kv.device).view(B, 1, 1)
    return _attend(q, kv[batch, idx.clamp_min(0)], idx >= 0, sink, scale)


@kernel("sparse_attention_rows",
        args={"q": "B, T, H, D", "kv_a": "NA, D", "kv_b": "NB, D", "idx": "B, T, K", "sink": "H", "scale": float},
        results={"out": "B, T, H, D"}, static=("H", "D"),
        dtypes={"q": _F, "kv_a": _F, "kv_b": _F, "idx": (torch.int64,), "sink": (torch.float32,)},
        mlir="sparse_attention.mlir.jinja")
def sparse_attention_rows(q: torch.Tensor, kv_a: torch.Tensor, kv_b: torch.Tensor, idx: torch.Tensor,
                          sink: torch.Tensor, scale: float) -> torch.Tensor:
    """sparse_attention over rows of two tables read in place: idx [B,T,K] names rows of cat(kv_a, kv_b)
    (row r < NA is kv_a[r], else kv_b[r - NA]; -1 masked), kv_a [NA,D] and kv_b [NB,D] of one dtype. A
    decode call passes the flattened state tensors themselves (the window ring and a compressed cache,
    with global row ids), so no copy of a cache exists (model.Attention, docs/kernels.md)."""
    if kv_a.dtype != kv_b.dtype:
        raise ValueError(f"sparse_attention_rows: kv_a is {kv_a.dtype}, kv_b {kv_b.dtype}: one dtype")
    na, nb = kv_a.shape[0], kv_b.shape[0]
    r = idx.clamp_min(0)
    in_a = (r < na)[..., None]
    sel = torch.where(in_a, kv_a[r.clamp(max=na - 1)], kv_b[(r - na).clamp(0, nb - 1)])
    return _attend(q, sel, idx >= 0, sink, scale)


def _attend(q: torch.Tensor, sel: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention of q [B,T,H,D] over its gathered rows sel [B,T,K,D] (valid [B,T,K])."""
    B, T, H, D = q.shape
    # masked rows may hold anything (stale state): zero them so 0 * garbage cannot make NaN
    sel = torch.where(valid[..., None], sel, torch.zeros((), dtype=sel.dtype))
    # Batch invariance: rows (b, t) are merged into ONE dynamic dim n before the reductions. With
    # separate b and t, IREE folds b away when B == 1 and tiles the score/softmax/P·V reductions
    # differently than for B == 4, so the same request got other bits per batch-size function
    # (docs/numerics.md). Merged, every batch size compiles to the same [n, ...] ops.
    qf, sf, vf = q.flatten(0, 1).float(), sel.flatten(0, 1).float(), valid.flatten(0, 1)
    s = torch.einsum("nhd,nkd->nhk", qf, sf) * scale
    s = s.masked_fill(~vf[:, None, :], float("-inf"))
    m = torch.maximum(s.amax(-1), sink.float()[None, :])  # the sink is always present
    p = torch.exp(s - m[..., None])
    den = p.sum(-1) + torch.exp(sink.float()[None, :] - m)
    p = (p / den[..., None]).to(sel.dtype)
    o = torch.einsum("nhk,nkd->nhd", p.float(), sf)
    return o.to(q.dtype).unflatten(0, (B, T))
