"""Greedy speculative decoding with the model's own MTP block (docs/runtime.md, Speculative decoding).

Two calls, each one exported entry point (export/exporter.py), written like `Transformer.forward`:
static shapes, no `.item()`, every state write a whole-tensor `index_put_`.

* `mtp_prefill`: a prefill chunk, then the MTP block over the chunk's positions (next token of the
  last one: `next_tokens`, or the chosen token when the chunk ends the prompt), then K drafts.
* `verify`: the backbone over [x_p, d_1 .. d_K] at positions p .. p+K with its state writes deferred
  (Batch.pending); the token chosen at every position (argmax); draft i is accepted while it equals
  the token chosen at position p+i-1; the deferred writes are then applied for the kept positions
  p .. p+n only, so a rejected draft leaves no trace in any state tensor; then the MTP block over the
  kept positions and K new drafts.

The drafts: MTP at the last kept position q (backbone streams at q, the token chosen there) gives
d_1; for K > 1 the block runs again on its own output streams and the previous draft at q+1, q+2, ...
(one MTP block serves every draft, as vLLM and SGLang run DeepSeek's MTP), those positions with their
writes never applied: only kept positions reach the MTP block's window.
"""

from __future__ import annotations

import torch

from .device_sampling import all_finite, first_argmax
from .model import Batch, Transformer

__all__ = ["choose", "draft", "mtp_prefill", "verify"]


def choose(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row of logits [..., V] (first argmax), -1 where a row is not all finite."""
    flat = logits.flatten(0, -2)
    ids = torch.where(all_finite(flat), first_argmax(flat, two_level=False)[:, 0], -1)
    return ids.view(logits.shape[:-1])


def draft(model: Transformer, h: torch.Tensor, next_tokens: torch.Tensor, start: torch.Tensor,
          lengths: torch.Tensor, slots: torch.Tensor, state: dict[str, torch.Tensor], n_draft: int) -> torch.Tensor:
    """MTP block 0 over positions start .. start+lengths-1 (h [B,T,n,d]: the backbone's streams there,
    next_tokens [B,T]: the token after each), its window written for those positions; returns the
    n_draft greedy drafts [B,n_draft] for positions start+lengths+1 ... (rows with lengths 0: garbage)."""
    if n_draft < 1:
        raise ValueError(f"n_draft must be >= 1, got {n_draft}")
    x = model.mtp_streams(h, Batch.make(next_tokens, start, lengths, slots), state)
    last = (lengths - 1).clamp(min=0)
    xs = [torch.gather(x, 1, last.view(-1, 1, 1, 1).expand(-1, 1, *x.shape[2:]))]  # [B,1,n,d] at q
    ds = [choose(model.mtp_head(xs[0], torch.ones_like(lengths), False))]
    q = start + last
    for j in range(1, n_draft):  # chained drafts at q+1 .. q+j: computed, never written
        b = Batch.make(torch.stack(ds, 1).clamp(min=0), q + 1, torch.full_like(lengths, j), slots, deferred=True)
        y = model.mtp_streams(torch.cat(xs, 1), b, state)
        xs.append(y[:, -1:])
        ds.append(choose(model.mtp_head(xs[-1], torch.ones_like(lengths), False)))
    return torch.stack(ds, 1)


def mtp_prefill(model: Transformer, tokens: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor,
                slots: torch.Tensor, state: dict[str, torch.Tensor], next_tokens: torch.Tensor, n_draft: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill chunk (as Transformer.forward) plus the MTP block over its positions. next_tokens [B]:
    the token after the chunk (the next chunk's first), or -1 when the chunk ends the prompt (then the
    token chosen here follows). Returns (logits f32[B,V] at the last real token, its greedy token
    [B], drafts [B,n_draft] for the positions after it)."""
    B, T = tokens.shape
    h = model.hidden(tokens, start, lengths, slots, state)
    logits = model.logits(h, lengths, False)
    chosen = choose(logits)
    t = torch.arange(T, device=tokens.device)[None, :]
    # tokens[:, 1:] by a gather (a T-1 slice makes torch.export guard the dynamic T, see score_logprobs)
    nxt = tokens.gather(1, ((t + 1) % T).expand(B, -1))
    tail = torch.where(next_tokens >= 0, next_tokens, chosen.clamp(min=0))
    nxt = torch.where(t == (lengths - 1)[:, None], tail[:, None], nxt)
    return logits, chosen, draft(model, h, nxt, start, lengths, slots, state, n_draft)


def verify(model: Transformer, tokens: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor,
           slots: torch.Tensor, state: dict[str, torch.Tensor], n_draft: int | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score tokens [B,1+K] = [x_p, d_1 .. d_K] at positions start .. start+K (lengths [B]: real tokens,
    1 .. 1+K, 0 for a padding row). Returns (logits f32[B,1+K,V], chosen [B,1+K] the greedy token
    at each position, accepted [B] the number n of leading drafts equal to the token chosen before
    them, drafts [B,n_draft] (default K) for the positions after chosen[n]). The state ends as if
    x_p, d_1 .. d_n alone had been decoded (backbone and MTP window); the output continues with
    chosen[:n+1] and the next call starts at start + n + 1 with [chosen[n], drafts]."""
    B, T = tokens.shape
    b = Batch.make(tokens, start, lengths, slots, deferred=True)
    h = model.streams(b, state)
    logits = model.logits(h, lengths, True)
    chosen = choose(logits)
    i = torch.arange(1, T, device=tokens.device)[None, :]
    # logical_and, not `&`: torch-mlir does not lower aten.__and__ on bool tensors
    ok = torch.logical_and(torch.logical_and(tokens[:, 1:] == chosen[:, :-1], chosen[:, :-1] >= 0), i < lengths[:, None])
    # the leading run of accepted drafts: the first rejected index (a float min: GPU backends fail on
    # int64 reductions, model/kernels/topk.py)
    accepted = torch.where(ok, float(T - 1), (i - 1).float()).amin(1).long()
    keep = torch.where(lengths > 0, accepted + 1, 0)
    b.commit(keep)
    # the token after each kept position is the one chosen there (an accepted draft equals it)
    drafts = draft(model, h, chosen.clamp(min=0), start, keep, slots, state, T - 1 if n_draft is None else n_draft)
    return logits, chosen, accepted, drafts
