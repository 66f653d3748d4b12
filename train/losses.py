"""Training losses: next-token + MTP cross entropy, the lightning indexer's KL to the main attention,
the MoE balance (ExpertLoad), and the routed-tokens-only expert kernel that makes training fast."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.model.kernels.indexer import indexer_scores
from dsv4.model.kernels.linear import linear
from dsv4.model.kernels.moe import swiglu
from dsv4.model.model import Indexer, Transformer
from dsv4.model.moe import Gate
from dsv4.model.state import new_state

__all__ = ["routed_moe_experts", "indexer_kl", "compute_losses", "ExpertLoad"]


def routed_moe_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                       w1: torch.Tensor, s1: torch.Tensor | None, w2: torch.Tensor, s2: torch.Tensor | None,
                       w3: torch.Tensor, s3: torch.Tensor | None, limit: float) -> torch.Tensor:
    """The `moe_experts` hook computed on routed tokens only (training speed; same math).

    The reference runs every expert on every token and multiplies unrouted ones by a zero weight,
    which keeps export static but costs E/k times the work; their contribution (and gradient) is
    exactly zero, so running each expert on its own tokens gives the same result up to fp32
    summation order. Eager only (data-dependent shapes)."""
    N, k = indices.shape
    E = w1.shape[0]
    flat = indices.flatten()
    order = torch.argsort(flat, stable=True)
    token = order // k
    wsel = weights.flatten()[order][:, None]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    a0 = 0
    for e, c in enumerate(torch.bincount(flat, minlength=E).tolist()):
        if c:
            t = token[a0:a0 + c]
            xe = x[t]
            s1e, s2e, s3e = (None if s is None else s[e] for s in (s1, s2, s3))
            a = swiglu(linear(xe, w1[e], s1e), linear(xe, w3[e], s3e), limit) * wsel[a0:a0 + c]
            y = y.index_add(0, t, linear(a.to(x.dtype), w2[e], s2e).float())
            a0 += c
    return y


def indexer_kl(aux: dict[str, torch.Tensor], attn_scale: float, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(main attention || indexer) over visible compressed entries, and the attention mass the
    indexer's top-k captures (NaN when no query had more than k entries to choose from).

    Rows with fewer than two visible entries carry no information and are skipped.
    """
    q, w, keys, n_vis = aux["q"], aux["w"], aux["keys"], aux["n_vis"]
    R = keys.shape[1]
    vis = torch.arange(R, device=keys.device) < n_vis[..., None]  # [B,T,R]
    rows = n_vis >= 2
    v = vis[rows]
    if v.shape[0] == 0:
        zero = (q.sum() * 0.0) + (w.sum() * 0.0) + (keys.sum() * 0.0)
        return zero, torch.tensor(float("nan"), device=keys.device)
    logp = torch.log_softmax(indexer_scores(q, w, keys).float()[rows].masked_fill(~v, float("-inf")), -1)
    with torch.no_grad():
        s = torch.einsum("bthd,brd->bthr", aux["attn_q"].float(), aux["attn_kv"].float()) * attn_scale
        s = s[rows].masked_fill(~v[:, None, :], float("-inf"))  # [N,H,R]
        p = s.softmax(-1).sum(1)
        p = p / p.sum(-1, keepdim=True)
        sel = aux["sel"][rows]
        choose = n_vis[rows] > topk
        got = (p.gather(-1, sel.clamp(min=0)) * (sel >= 0)).sum(-1)
        captured = got[choose].mean() if bool(choose.any()) else torch.tensor(float("nan"), device=keys.device)
    kl = (torch.xlogy(p, p) - p * logp.masked_fill(~v, 0.0)).sum(-1)
    return kl.mean(), captured


def _indexers(model: Transformer) -> list[tuple[Indexer, float]]:
    return [(layer.attn.indexer, layer.attn.scale) for layer in model.layers if hasattr(layer.attn, "indexer")]


def compute_losses(model: Transformer, batch: torch.Tensor, mtp_weight: float = 0.3,
                   indexer_weight: float = 1.0) -> dict[str, torch.Tensor]:
    """Training losses of one batch [B, T+2] run from position 0 with a fresh state.

    Returns lm (next token), mtp (token t+2), indexer_kl, indexer_captured (diagnostic) and loss
    (their weighted sum; train_steps adds the MoE balance term). indexer_weight=0 leaves the aux
    hook off entirely.
    """
    cfg = model.cfg
    B, T = batch.shape[0], batch.shape[1] - 2
    dev = batch.device
    state = new_state(cfg, B, model.dtype, device=dev)
    start = torch.zeros(B, dtype=torch.long, device=dev)
    lengths = torch.full((B,), T, dtype=torch.long, device=dev)
    slots = torch.arange(B, device=dev)
    inp, nxt, nxt2 = batch[:, :T], batch[:, 1:T + 1], batch[:, 2:T + 2]
    idx = _indexers(model) if indexer_weight else []
    for ix, _ in idx:
        ix.aux = {}
    try:
        h = model.hidden(inp, start, lengths, slots, state)
        logits = model.logits(h, lengths, all_logits=True)
        out = {"lm": F.cross_entropy(logits.flatten(0, 1), nxt.flatten())}
        loss = out["lm"]
        if cfg.n_mtp and mtp_weight:
            ml = model.mtp_logits(h, nxt, start, lengths, slots, state, all_logits=True)
            out["mtp"] = F.cross_entropy(ml.flatten(0, 1), nxt2.flatten())
            loss = loss + mtp_weight * out["mtp"]
        if idx:
            kls, caps = zip(*(indexer_kl(ix.aux, scale, ix.topk) for ix, scale in idx))
            out["indexer_kl"] = torch.stack(kls).mean()
            out["indexer_captured"] = torch.stack(caps).nanmean()
            loss = loss + indexer_weight * out["indexer_kl"]
        out["loss"] = loss
    finally:
        for ix, _ in idx:
            ix.aux = None
    return out


class ExpertLoad:
    """MoE load balancing as DeepSeek does it, attached with forward hooks on the score-routed gates.

    * auxiliary-loss-free: counts routed tokens per expert; `update` moves each gate's selection
      bias by speed * sign(mean load - load) (noaux_tc; the bias steers selection only);
    * the complementary balance loss sum_i f_i P_i (f_i = routed share of expert i x E/k over
      the batch, P_i = mean normalized affinity s_i / sum_j s_j), which DeepSeek adds with a tiny
      weight. Both are needed here: in a few hundred steps the bias alone cannot keep up with a gate
      whose logits share one direction across tokens (routing collapsed onto 2 of 8 experts).
    Hash-routed gates have no bias and a fixed token -> experts table: nothing to balance.
    """

    def __init__(self, model: Transformer):
        self.gates = [m for m in model.modules() if isinstance(m, Gate) and m.bias is not None]
        self.counts = {id(g): torch.zeros(g.bias.shape[0]) for g in self.gates}
        self.balance: list[torch.Tensor] = []
        self.handles = [g.register_forward_hook(self._hook) for g in self.gates]

    def _hook(self, gate: Gate, inputs: tuple[torch.Tensor, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        if not torch.is_grad_enabled():  # training forwards only
            return
        x, idx = inputs[0], output[1]
        E, k = gate.bias.shape[0], idx.shape[-1]
        count = torch.bincount(idx.flatten(), minlength=E).float()
        self.counts[id(gate)] += count.detach().cpu()
        s = F.softplus(F.linear(x.float(), gate.weight.float())).sqrt()
        P = (s / s.sum(-1, keepdim=True)).mean(0)
        f = count * E / (k * idx.shape[0])
        self.balance.append((f * P).sum())

    def take_balance_loss(self) -> torch.Tensor | None:
        """Mean balance loss of the gates run since the last call (1.0 when perfectly balanced)."""
        out = torch.stack(self.balance).mean() if self.balance else None
        self.balance = []
        return out

    @torch.no_grad()
    def update(self, speed: float) -> float:
        """Apply the bias step and reset the counts; returns the worst max/mean load ratio seen."""
        worst = 0.0
        for g in self.gates:
            c = self.counts[id(g)]
            if c.sum() > 0:
                worst = max(worst, float(c.max() / c.mean()))
                g.bias += speed * torch.sign(c.mean() - c).to(g.bias)
            c.zero_()
        return worst

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
