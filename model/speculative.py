"""Speculative decoding with the model's own MTP block (docs/runtime.md, Speculative decoding).

Two calls, each one exported entry point (export/exporter.py), written like `Transformer.forward`:
static shapes, no `.item()`, every state write an `index_put_` of whole rows.

* `mtp_prefill`: a prefill chunk, then the MTP block over the chunk's positions (next token of the
  last one: `next_tokens`, or the chosen token when the chunk ends the prompt), then K drafts.
* `verify`: the backbone over [x_p, d_1 .. d_K] at positions p .. p+K with its state writes deferred
  (Batch.pending); the token chosen at every position (`choose_sampled`: argmax, or the sampled
  acceptance rule below); draft i is accepted while it equals the token chosen at position p+i-1; the deferred writes are then applied for the kept positions
  p .. p+n only, so a rejected draft leaves no trace in any state tensor; then the MTP block over the
  kept positions and K new drafts.

The drafts: MTP at the last kept position q (backbone streams at q, the token chosen there) gives
d_1; for K > 1 the block runs again on its own output streams and the previous draft at q+1, q+2, ...
(one MTP block serves every draft, as vLLM and SGLang run DeepSeek's MTP), those positions with their
writes never applied: only kept positions reach the MTP block's window.

Sampling (a row with temperature > 0; `choose_sampled`): the drafts stay the MTP head's argmax, so
the draft distribution q is one-hot at the draft d, and the speculative-sampling rule (accept d with
probability min(1, p(d)/q(d)), else sample from max(0, p - q) renormalised) becomes: accept d with
probability p(d), else sample from p with d removed, renormalised; after K accepted drafts the bonus
token is sampled from p. p is the target distribution after temperature, top-k and top-p, as
device_sampling.sample filters it. Each emitted token is then distributed as p exactly:
P(d) = p(d), P(t != d) = (1 - p(d)) p(t) / (1 - p(d)). The rule runs inside the call because the
call's state commit and its next drafts depend on what was accepted and on the token chosen at the
last kept position. Uniforms come from the row's 32-bit key (device_sampling.hash_uniform), so a row's
tokens depend only on its logits and its key: batched and solo calls choose alike.
"""

from __future__ import annotations

import torch

from .device_sampling import _row_max, _row_sum, all_finite, first_argmax, gumbel, hash_uniform, kept, sample
from .model import Batch, Transformer

__all__ = ["choose", "choose_sampled", "draft", "mtp_prefill", "verify", "Sampling"]

# per row: (temperature f32[B], top_k i64[B], top_p f32[B], key i64[B]); temperature 0 is greedy
Sampling = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def choose(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row of logits [..., V] (first argmax), -1 where a row is not all finite."""
    flat = logits.flatten(0, -2)
    ids = torch.where(all_finite(flat), first_argmax(flat, two_level=False)[:, 0], -1)
    return ids.view(logits.shape[:-1])


def choose_sampled(logits: torch.Tensor, following: torch.Tensor, lengths: torch.Tensor,
                   sampling: Sampling) -> torch.Tensor:
    """The token chosen at each position of logits [B,T,V] under the speculative-sampling rule (module
    docstring). following [B,T]: the draft after each position (following[:, i] = d_{i+1}); positions
    i < lengths-1 have one, the last real position draws the bonus token from p. A sampled row's
    position i gives d_{i+1} when u_i < p_i(d_{i+1}) (or d_{i+1} is its only kept token), else a
    Gumbel-max draw over the kept tokens other than d_{i+1}. Rows with temperature <= 0: `choose`.
    -1 where a position's logits are not all finite. Uniforms: hash_uniform(key, T (V+1)) viewed as
    [T, V+1], V Gumbel draws then the acceptance draw per position."""
    B, T, V = logits.shape
    temperature, top_k, top_p, key = sampling
    x = logits.flatten(0, 1).float()
    per_pos = [t.reshape(B, 1).expand(B, T).reshape(B * T) for t in (temperature, top_k, top_p)]
    xs, keep, hot = kept(x, *per_pos)
    u = hash_uniform(key, T * (V + 1)).view(B * T, V + 1)
    g, ua = gumbel(u[:, :V]), u[:, V]
    d = following.reshape(B * T, 1).clamp(0, V - 1)
    # vocabulary-long sums and maxima in two levels, as device_sampling.sample (one workgroup per piece)
    e = torch.where(keep, torch.exp(xs - _row_max(xs)), 0.0)
    p_d = (e.gather(1, d) / _row_sum(e))[:, 0]
    others = torch.logical_and(keep, torch.arange(V, device=x.device)[None, :] != d)
    alone = _row_sum(others.float())[:, 0] < 0.5  # d is the only kept token: accepted whatever the draw
    ok = torch.logical_or(ua < p_d, alone)
    resid = first_argmax(torch.where(others, xs + g, float("-inf")))[:, 0]
    full = first_argmax(torch.where(keep, xs + g, float("-inf")))[:, 0]
    has_draft = (torch.arange(T, device=x.device)[None, :] < (lengths - 1)[:, None]).reshape(B * T)
    drawn = torch.where(has_draft, torch.where(ok, d[:, 0], resid), full)
    ids = torch.where(hot[:, 0], drawn, first_argmax(x, two_level=False)[:, 0])
    return torch.where(all_finite(x), ids, -1).view(B, T)


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
                slots: torch.Tensor, state: dict[str, torch.Tensor], next_tokens: torch.Tensor, n_draft: int,
                sampling: Sampling | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill chunk (as Transformer.forward) plus the MTP block over its positions. next_tokens [B]:
    the token after the chunk (the next chunk's first), or -1 when the chunk ends the prompt (then the
    token chosen here follows). sampling: per-row temperature, top_k, top_p, key (None: greedy); a
    sampled row's token is device_sampling.sample's. Returns (logits f32[B,V] at the last real token,
    its chosen token [B], drafts [B,n_draft] for the positions after it)."""
    B, T = tokens.shape
    h = model.hidden(tokens, start, lengths, slots, state)
    logits = model.logits(h, lengths, False)
    chosen = choose(logits) if sampling is None else sample(logits, *sampling)
    t = torch.arange(T, device=tokens.device)[None, :]
    # tokens[:, 1:] by a gather (a T-1 slice makes torch.export guard the dynamic T, see score_logprobs)
    nxt = tokens.gather(1, ((t + 1) % T).expand(B, -1))
    tail = torch.where(next_tokens >= 0, next_tokens, chosen.clamp(min=0))
    nxt = torch.where(t == (lengths - 1)[:, None], tail[:, None], nxt)
    return logits, chosen, draft(model, h, nxt, start, lengths, slots, state, n_draft)


def verify(model: Transformer, tokens: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor,
           slots: torch.Tensor, state: dict[str, torch.Tensor], n_draft: int | None = None,
           sampling: Sampling | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score tokens [B,1+K] = [x_p, d_1 .. d_K] at positions start .. start+K (lengths [B]: real tokens,
    1 .. 1+K, 0 for a padding row). sampling: per-row temperature, top_k, top_p, key (None: greedy
    for every row). Returns (logits f32[B,1+K,V], chosen [B,1+K] the token chosen at each position
    (`choose_sampled`: the greedy token; for a sampled row its draft when accepted, else a draw),
    accepted [B] the number n of leading drafts equal to the token chosen before them, drafts [B,n_draft] (default K) for the positions after chosen[n]). The state ends as if
    x_p, d_1 .. d_n alone had been decoded (backbone and MTP window); the output continues with
    chosen[:n+1] and the next call starts at start + n + 1 with [chosen[n], drafts]."""
    B, T = tokens.shape
    b = Batch.make(tokens, start, lengths, slots, deferred=True)
    h = model.streams(b, state)
    logits = model.logits(h, lengths, True)
    if sampling is None:
        chosen = choose(logits)
    else:  # the draft after each position: tokens[:, 1:] shifted left by a gather (see mtp_prefill)
        t = torch.arange(T, device=tokens.device)[None, :]
        chosen = choose_sampled(logits, tokens.gather(1, ((t + 1) % T).expand(B, -1)), lengths, sampling)
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
