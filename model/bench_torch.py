"""The torch side of `dsv4 bench`: the export's own weights in the eager model, eager or torch.compile'd,
behind the same two calls the timing protocol (dsv4.runtime.bench) uses for the compiled module.

The weights are read from the export's .irpa (the tensors the vmfb runs), so every backend runs the
same numbers: the model is rebuilt from config.json's model section with the stored formats (FP8
linears, MXFP4 experts stay low-bit) and loaded by name, strictly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .config import ModelConfig
from .model import Transformer
from .state import new_state

__all__ = ["load_export_model", "TorchBackend", "TORCH_DEVICE"]

# IREE driver -> torch device (ROCm torch calls its GPUs cuda too)
TORCH_DEVICE = {"cuda": "cuda", "hip": "cuda", "local-task": "cpu", "local-sync": "cpu"}


def _irpa_tensors(irpa: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an .irpa written by iree-turbine (dtype and shape from its PYTORCH: metadata)."""
    import iree.runtime as rt

    idx = rt.ParameterIndex()
    idx.load(str(irpa))
    out = {}
    for key, e in idx.items():
        meta = bytes(e.metadata)
        if not meta.startswith(b"PYTORCH:"):
            raise ValueError(f"{irpa}: parameter {key} has no torch metadata (not written by iree-turbine)")
        info = json.loads(meta[len(b"PYTORCH:"):])
        dtype = getattr(torch, info["dtype"])
        raw = torch.from_numpy(np.frombuffer(e.file_view, dtype=np.uint8).copy())
        out[key.removeprefix("model.")] = raw.view(dtype).reshape(info["shape"])
    return out


def load_export_model(export_dir: str | Path, device: str = "cpu") -> tuple[Transformer, ModelConfig, torch.dtype]:
    """The eager Transformer with the weights of `export_dir/model.irpa` (or the parameters file the
    export names), its config and activation dtype."""
    d = Path(export_dir)
    raw = json.loads((d / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw["model"])
    dtype = getattr(torch, raw.get("activation_dtype", "bfloat16").removeprefix("torch."))
    tensors = _irpa_tensors(d / raw["parameters"])
    quantized = any(t.dtype in (torch.float8_e4m3fn, torch.uint8) for n, t in tensors.items()
                    if n.endswith(("weight", "w1", "w2", "w3")))
    model = Transformer(cfg, dtype=dtype, quantized=quantized)  # (not via checkpoint.py: it needs safetensors)
    want = model.state_dict()
    for name, t in tensors.items():
        if name in want and want[name].dtype != t.dtype:
            raise ValueError(f"{d}: parameter {name} is {t.dtype} in the export but {want[name].dtype} in the "
                             "model (an e4m3fnuz export for gfx942? measure torch with the cuda/cpu export)")
    model.load_state_dict(tensors, strict=True)
    return model.eval().to(device), cfg, dtype


class TorchBackend:
    """`torch-eager` or `torch-compile` (mode default) on the torch device of `device`."""

    def __init__(self, export_dir: str | Path, name: str, device: str, n_slots: int):
        if name not in ("torch-eager", "torch-compile"):
            raise ValueError(f"unknown torch backend {name!r}")
        self.device = TORCH_DEVICE.get(device)
        if self.device is None:
            raise ValueError(f"no torch device for {device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{name}: torch sees no GPU (torch {torch.__version__})")
        self.model, cfg, dtype = load_export_model(export_dir, self.device)
        self.state = new_state(cfg, n_slots, dtype, device=self.device)
        self.name = f"{name} ({self.device})"
        self.fn: Callable = self.model
        if name == "torch-compile":
            import torch._dynamo as dynamo

            # torch.compile as a user calls it (mode default, automatic dynamic shapes: a second batch
            # size recompiles once with a dynamic batch); a higher recompile limit so it never falls back to eager
            for knob in ("cache_size_limit", "recompile_limit"):
                if hasattr(dynamo.config, knob):
                    setattr(dynamo.config, knob, 64)
            self.fn = torch.compile(self.model)

    def _run(self, tokens, start, lengths, slots) -> np.ndarray:
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        with torch.no_grad():
            logits = self.fn(t(tokens), t(start), t(lengths), t(slots), self.state)
            return logits.argmax(-1).cpu().numpy()  # .cpu() waits for the device

    def prefill(self, tokens, start, lengths, slots) -> np.ndarray:
        return self._run(tokens, start, lengths, slots)

    def decode(self, tokens, start, slots) -> np.ndarray:
        return self._run(tokens, start, np.ones(len(slots), np.int64), slots)
