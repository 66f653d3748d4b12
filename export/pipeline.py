"""Pipeline export: the layers split into N consecutive stages, one compiled module per device.

`dsv4 export --devices N --pipeline` builds N modules instead of one multi-device module
(export/sharding.py). Stage k holds layers [first_k, last_k); the first also embeds the tokens, the
last also applies the head. Every stage keeps the parameter names of the whole model, so one .irpa
serves all of them and each module loads only the tensors it reads. Between stages the runtime
moves the residual streams `[B,T,hc,d]` through host memory once per call (runtime/module.py
`PipelineModule`), which needs no peer access between the GPUs: IREE 3.13's CUDA driver has none, so
this is how an export runs on two or more H200s (docs/scale.md). Each stage owns the state of its
layers only (model/state.py `StateLayout.stage`), named ``stage{k}.<tensor>`` in config.json
(contract/artifact.py `stage_state_name`: the naming is part of the export contract).

The streams cross as float32: the model carries them in its activation dtype (bf16 or fp32), both
exactly representable in fp32, so the split changes no bit of any result (tests/test_multidevice.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsv4.model.model import Batch, embed_streams, final_logits, rope_of
from dsv4.model.state import StateLayout

__all__ = ["Stage", "stage_bounds", "check_pipeline", "pipeline_layout"]


def stage_bounds(n_layers: int, n: int) -> list[tuple[int, int]]:
    """[first, last) of each of `n` stages: consecutive layers, as equal in count as they divide."""
    cuts = [round(k * n_layers / n) for k in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def check_pipeline(cfg: Any, n: int) -> None:
    """ValueError unless `cfg`'s layers can form `n` stages (at least one layer each)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise ValueError(f"a pipeline needs at least 2 devices, got {n!r}")
    if n > cfg.n_layers:
        raise ValueError(f"cannot split {cfg.n_layers} layers into {n} pipeline stages (one layer each at least)")


def pipeline_layout(cfg: Any, n: int) -> dict[str, Any]:
    """config.json's "devices" field of an n-stage pipeline export."""
    return {"count": n, "split": "pipeline", "stages": [list(b) for b in stage_bounds(cfg.n_layers, n)],
            "layout": {"layers": "consecutive stages, stage k on device k (one module each)",
                       "embedding": "stage 0", "head": "last stage",
                       "state": "each stage holds its own layers' state",
                       "between stages": "residual streams [B,T,hc,d] as float32 through host memory"}}


class Stage(nn.Module):
    """Layers [first, last) of a Transformer as a module of their own, with the whole model's
    parameter names (``layers.<i>...``, ``embed...`` on the first stage, ``head``/``norm``/``hc_head_*``
    on the last), reading the stage's own state tensors (`StateLayout.stage_spec`).

    ``forward(tokens, start_pos, lengths, slots, state, h=None, all_logits=False)``: the first stage
    embeds `tokens`, a later one continues from the streams `h` of the stage before it; a stage
    that is not the last returns its streams as float32, the last the logits (as `Transformer`)."""

    def __init__(self, model: nn.Module, first: int, last: int):
        super().__init__()
        cfg = model.cfg
        if not 0 <= first < last <= cfg.n_layers:
            raise ValueError(f"stage layers [{first}, {last}) outside the model's {cfg.n_layers} layers")
        self.cfg, self.dtype, self.first, self.last = cfg, model.dtype, first, last
        self.is_first, self.is_last = first == 0, last == cfg.n_layers
        if self.is_first:
            self.embed = model.embed
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first, last)})
        if self.is_last:
            self.norm, self.head = model.norm, model.head
            self.hc_head_fn, self.hc_head_base, self.hc_head_scale = (
                model.hc_head_fn, model.hc_head_base, model.hc_head_scale)
        for kind in ("window", "compressed"):
            for part in ("cos", "sin"):
                name = f"rope_{kind}_{part}"
                self.register_buffer(name, getattr(model, name), persistent=False)
        self.layer_states, _ = StateLayout(cfg).stage(first, last)

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                state: dict[str, torch.Tensor], h: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        b = Batch.make(tokens, start_pos, lengths, slots)
        rope = rope_of(self, b.pos)
        if self.is_first:
            h = embed_streams(self.embed, tokens, self.cfg.hc_mult)
        elif h is None:
            raise ValueError(f"stage [{self.first}, {self.last}) continues from the streams of the stage before it")
        else:
            h = h.to(self.dtype)
        for i, st in zip(range(self.first, self.last), self.layer_states):
            h = self.layers[str(i)](h, b, st, state, rope, tokens)
        if not self.is_last:
            return h.float()
        return final_logits(h, lengths, all_logits, self.hc_head_fn, self.hc_head_base, self.hc_head_scale,
                            self.norm, self.head, self.cfg)
