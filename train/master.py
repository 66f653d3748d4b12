"""The bf16 master: the trained weights under this model's own state_dict names, bf16 except the
small tensors the official checkpoint also keeps in fp32 (master-bf16.safetensors + config.json +
tokenizer + train_log.json in one folder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dsv4.model.config import ModelConfig
from dsv4.model.model import Transformer
from dsv4.contract.tokenizer import save_tokenizer

__all__ = ["MASTER_FILE", "master_state", "master_model", "cast_model", "save_master", "load_master"]

MASTER_FILE = "master-bf16.safetensors"

# Small fp32 tensors the official checkpoint also keeps in fp32 (docs/model.md, Checkpoint format); everything else
# floating-point is stored bf16 in the master.
_F32_LEAVES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
               "hc_head_fn", "hc_head_base", "hc_head_scale", "attn_sink", "ape", "bias")


def cast_model(model: Transformer, cfg: ModelConfig, dtype: torch.dtype) -> Transformer:
    """The same weights in a model of `dtype` and config `cfg` (e.g. fp32 at max_seq_len 1024)."""
    out = Transformer(cfg, dtype=dtype)
    out.load_state_dict(model.state_dict())
    return out.eval()


def _master_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and name.rsplit(".", 1)[-1] not in _F32_LEAVES:
        return t.detach().to("cpu", torch.bfloat16).contiguous()
    return t.detach().cpu().contiguous()


def master_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The tensors of the bf16 master, exactly as saved (the model's own state_dict names)."""
    return {k: _master_tensor(k, v) for k, v in model.state_dict().items()}


def master_model(model: Transformer, cfg: ModelConfig) -> Transformer:
    """The bf16 eager model the shipped master gives (same bytes as save_master + load_master)."""
    out = Transformer(cfg, dtype=torch.bfloat16)
    out.load_state_dict(master_state(model))
    return out.eval()


def save_master(model: Transformer, cfg: ModelConfig, directory: str | Path, tokenizer: Any = None,
                record: dict[str, Any] | None = None) -> Path:
    """Write the bf16 master (the model's own state_dict names; mHC, sinks, ape and gate biases
    fp32 as in the official checkpoint), config.json, the tokenizer files and train_log.json."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = master_state(model)
    save_file(tensors, str(out / MASTER_FILE), metadata={"format": "pt", "layout": "dsv4.model state_dict"})
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, out, model_max_length=cfg.max_seq_len)
    if record is not None:
        (out / "train_log.json").write_text(json.dumps(record, indent=1) + "\n")
    return out


def load_master(directory: str | Path, dtype: torch.dtype = torch.bfloat16, **overrides: Any) -> Transformer:
    """Build the model from a master folder (config.json + master-bf16.safetensors), in `dtype`."""
    d = Path(directory)
    cfg = ModelConfig.from_json(d / "config.json", **overrides)
    model = Transformer(cfg, dtype=dtype)
    model.load_state_dict(load_file(str(d / MASTER_FILE)))
    return model.eval()
