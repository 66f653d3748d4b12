"""Held-out perplexity, and the one end-of-run check: perplexity + the greedy continuation of the
fixed prompt, logged (after training, after finishing a master from elsewhere, on the FP8 checkpoint)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dsv4.model.checkpoint import EMBEDDED_PROMPT
from dsv4.model.generate import greedy
from dsv4.model.model import Transformer
from dsv4.model.state import new_state
from dsv4.contract.tokenizer import decode, encode

__all__ = ["evaluate", "eval_and_sample", "DEFAULT_PROMPT"]

DEFAULT_PROMPT = EMBEDDED_PROMPT  # the fixed prompt of `make run` (defined beside the checkpoint location)


@torch.no_grad()
def evaluate(model: Transformer, stream: torch.Tensor, seq_len: int, batch_size: int = 8,
             max_windows: int | None = None) -> dict[str, float]:
    """Held-out perplexity: non-overlapping windows of seq_len predictions, each from position 0."""
    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    dev = model.embed.weight.device
    nll, count = 0.0, 0
    for a in range(0, n, batch_size):
        rows = torch.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(a, min(n, a + batch_size))])
        rows = rows.to(dev)
        B = rows.shape[0]
        state = new_state(model.cfg, B, model.dtype, device=dev)
        logits = model(rows[:, :-1], torch.zeros(B, dtype=torch.long, device=dev),
                       torch.full((B,), seq_len, device=dev), torch.arange(B, device=dev), state, all_logits=True)
        nll += float(F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum"))
        count += rows[:, 1:].numel()
    return {"nll": nll / count, "ppl": math.exp(nll / count), "tokens": count}


def eval_and_sample(model: Transformer, tok: Any, eval_ids: torch.Tensor, seq_len: int, batch_size: int,
                    max_windows: int | None, sample_tokens: int, label: str,
                    log: Callable[[str], None] | None = print) -> tuple[dict[str, float], str]:
    """(held-out perplexity, greedy continuation of DEFAULT_PROMPT: "" when sample_tokens is 0) of
    an eval-mode model, both logged under `label`."""
    t0 = time.perf_counter()
    ev = evaluate(model, eval_ids, seq_len, batch_size, max_windows)
    sample = decode(tok, greedy(model, encode(tok, DEFAULT_PROMPT, bos=True), sample_tokens)) if sample_tokens else ""
    if log:
        log(f"{label}: held-out ppl {ev['ppl']:.2f} over {ev['tokens']:,} tokens (eval {time.perf_counter() - t0:.0f} s)")
        log(f"{label} greedy: {DEFAULT_PROMPT!r} -> {sample!r}")
    return ev, sample
