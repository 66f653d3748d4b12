"""Eager generation with the PyTorch model: the reference the compiled runtime is checked against."""

from __future__ import annotations

import torch

from .model import Transformer
from .state import new_state


def _i64(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.long)


@torch.no_grad()
def greedy(model: Transformer, prompt: list[int], max_new_tokens: int, chunk: int | None = None,
           stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation of `prompt` (token ids): prefill (in `chunk`-token pieces if given), then decode."""
    cfg = model.cfg
    if not prompt:
        raise ValueError("prompt is empty")
    if len(prompt) + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
                         f"{cfg.max_seq_len}")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"token ids out of range [0, {cfg.vocab_size}): {bad[:5]}")
    state = new_state(cfg, 1, model.dtype)
    slot = _i64(0)
    step = chunk or len(prompt)
    for s in range(0, len(prompt), step):
        piece = prompt[s:s + step]
        logits = model(torch.tensor([piece]), _i64(s), _i64(len(piece)), slot, state)
    out: list[int] = []
    pos = len(prompt)
    for _ in range(max_new_tokens):
        nxt = int(logits[0].argmax())
        out.append(nxt)
        if nxt in stop_ids:
            break
        logits = model(torch.tensor([[nxt]]), _i64(pos), _i64(1), slot, state)
        pos += 1
    return out


@torch.no_grad()
def speculative_greedy(model: Transformer, prompts: list[list[int]], max_new_tokens: int, n_draft: int,
                       chunk: int | None = None, stop_ids: tuple[int, ...] = ()) -> tuple[list[list[int]], dict]:
    """Greedy continuations of `prompts`, batched, with MTP speculative decoding (model/speculative.py):
    the same tokens as `greedy` per prompt. Returns (tokens per prompt, {"drafted", "accepted",
    "verify_calls", "accepted_per_call": [[drafts accepted per live row] per verify call]})."""
    from .speculative import mtp_prefill, verify

    cfg = model.cfg
    if not cfg.n_mtp:
        raise ValueError("speculative decoding needs an MTP block (num_nextn_predict_layers >= 1)")
    for p in prompts:
        if not p:
            raise ValueError("prompt is empty")
        if len(p) + max_new_tokens > cfg.max_seq_len:
            raise ValueError(f"prompt ({len(p)}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
                             f"{cfg.max_seq_len}")
    state = new_state(cfg, len(prompts), model.dtype)
    outs: list[list[int]] = []
    drafts, pos = [], []
    for r, p in enumerate(prompts):
        step = chunk or len(p)
        for s in range(0, len(p), step):
            piece = p[s:s + step]
            nxt = p[s + step] if s + step < len(p) else -1
            _, chosen, d = mtp_prefill(model, torch.tensor([piece]), _i64(s), _i64(len(piece)), _i64(r), state,
                                       _i64(nxt), n_draft)
        outs.append([int(chosen[0])])
        drafts.append(d[0])
        pos.append(len(p))
    stats: dict = {"drafted": 0, "accepted": 0, "verify_calls": 0, "accepted_per_call": []}
    done = lambda r: len(outs[r]) >= max_new_tokens or outs[r][-1] in stop_ids  # noqa: E731
    while live := [r for r in range(len(prompts)) if not done(r)]:
        toks = torch.stack([torch.cat([_i64(outs[r][-1]), drafts[r]]) for r in live])
        lengths = torch.tensor([min(1 + n_draft, max_new_tokens - len(outs[r])) for r in live])
        _, chosen, accepted, d = verify(model, toks, torch.tensor([pos[r] for r in live]), lengths,
                                        torch.tensor(live), state, n_draft)
        stats["verify_calls"] += 1
        stats["accepted_per_call"].append(accepted.tolist())
        for i, r in enumerate(live):
            n = int(accepted[i])
            stats["drafted"] += int(lengths[i]) - 1
            stats["accepted"] += n
            for t in chosen[i, :n + 1].tolist():
                outs[r].append(t)
                if t in stop_ids:
                    break
            drafts[r], pos[r] = d[i], pos[r] + n + 1
    return outs, stats
