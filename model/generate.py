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
