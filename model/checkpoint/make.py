"""A randomly initialized checkpoint in the released format (`dsv4 checkpoint make`, tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..model import Transformer, init_random
from .write import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

__all__ = ["make_random_checkpoint"]


def make_random_checkpoint(preset: str, output: str | Path, *, seed: int = 0, layout: str = "official",
                           expert_dtype: str | None = None, scale_fmt: str = "ue8m0", unquantized: bool = False,
                           std: float = 0.02, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                           force: bool = False) -> tuple[Path, ModelConfig]:
    """Write preset `preset` with random weights (init std `std`) to `output` in `layout` ("official"
    or "transformers"), quantized as released (FP8 linears with `scale_fmt` block scales, MXFP4 experts
    unless `expert_dtype` says fp8/bf16) or, with `unquantized`, all bf16. Returns (directory, config);
    FileExistsError when a checkpoint is there already and not `force`. No tokenizer is written."""
    cfg = ModelConfig.preset(preset)
    if unquantized:
        cfg = cfg.replace(quantization_config=None, expert_dtype=None)
    else:
        qc = {**(cfg.quantization_config or {}), "scale_fmt": scale_fmt}
        cfg = cfg.replace(quantization_config=qc, expert_dtype=expert_dtype or cfg.expert_dtype)
    if cfg.expert_dtype == "bf16":
        cfg = cfg.replace(expert_dtype=None)
    model = init_random(Transformer(cfg, dtype=torch.float32), seed=seed, std=std)
    out = write_checkpoint(model, cfg, output, layout, max_shard_bytes=max_shard_bytes, overwrite=force)
    return out, cfg
