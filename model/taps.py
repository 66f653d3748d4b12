"""Intermediate values of a forward pass, layer by layer, for `dsv4 audit` (docs/numerics.md).

`record_taps(model)` registers forward hooks on every block's parts and collects, in execution
order, what each produced in one forward call. The same hooks run while torch.export traces the
model (non-strict tracing calls modules through ``nn.Module.__call__``), so a compiled probe module
returns the very values the eager model records here (export/exporter.py `probe_module`).

Parts of layer i, in the order they run (`PARTS`):

* ``hc_attn``: the mHC collapse feeding attention (attn_norm's input) [B,T,d]
* ``indexer``: the lightning indexer's selection [B,T,k] (CSA layers only; -1 = nothing)
* ``attn``: the attention output [B,T,d]
* ``hc_ffn``: the mHC collapse feeding the MoE (ffn_norm's input) [B,T,d]
* ``router``: the routed experts chosen per token [B*T,k]
* ``moe``: the MoE output [B,T,d]
* ``out``: the block's output streams [B,T,n,d]
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

__all__ = ["PARTS", "CHOICE_PARTS", "tap_names", "record_taps"]

PARTS = ("hc_attn", "indexer", "attn", "hc_ffn", "router", "moe", "out")
CHOICE_PARTS = ("indexer", "router")  # integer choices (compared as sets), the rest are values


def tap_names(cfg) -> list[str]:
    """The taps `record_taps` collects for a model of config `cfg`, in order: "<layer>.<part>"."""
    return [f"{i}.{p}" for i in range(cfg.n_layers) for p in PARTS
            if p != "indexer" or cfg.compress_ratios[i] == 4]


@contextlib.contextmanager
def record_taps(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """While the block runs, every forward of `model` (a Transformer) fills the yielded dict with its
    taps (`tap_names` order); values float32 (choices int64). Hooks are removed on exit."""
    taps: dict[str, torch.Tensor] = {}
    handles = []

    def put(name: str, t: torch.Tensor) -> None:
        taps[name] = t if not t.is_floating_point() else t.float()

    def output(name: str, pick=lambda o: o):
        return lambda mod, args, out: put(name, pick(out))

    def first_input(name: str):
        return lambda mod, args: put(name, args[0])

    for i, blk in enumerate(model.layers):
        handles.append(blk.attn_norm.register_forward_pre_hook(first_input(f"{i}.hc_attn")))
        if blk.attn.ratio == 4:
            handles.append(blk.attn.indexer.register_forward_hook(output(f"{i}.indexer")))
        handles.append(blk.attn.register_forward_hook(output(f"{i}.attn")))
        handles.append(blk.ffn_norm.register_forward_pre_hook(first_input(f"{i}.hc_ffn")))
        handles.append(blk.ffn.gate.register_forward_hook(output(f"{i}.router", lambda o: o[1])))
        handles.append(blk.ffn.register_forward_hook(output(f"{i}.moe")))
        handles.append(blk.register_forward_hook(output(f"{i}.out")))
    try:
        yield taps
    finally:
        for h in handles:
            h.remove()
