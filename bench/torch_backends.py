"""The torch side of `dsv4 bench`: the export's own weights in the eager model, eager or torch.compile'd,
behind the same two calls the timing protocol (dsv4.bench.speed) uses for the compiled module.

The weights are read from the export's .irpa files (the tensors the vmfb runs: checkpoint/irpa.py
`load_export_model`), so every backend runs the same numbers: the model is rebuilt from config.json's
model section with the stored formats (FP8 linears, MXFP4 experts stay low-bit) and loaded by name,
strictly.

Both torch backends run the routed MoE (`routed_moe`, what the export traces): only the chosen experts'
weights are read. Eager's default hook evaluates every expert on every token, which is a test oracle,
not how anyone would run 256 experts (1.35 s per Flash decode step, 4 layers, batch 1).

`transformers` is Hugging Face's own DeepseekV4ForCausalLM (eager, its default kernels) holding the
same tensors dequantized (`transformers_state_dict`: it has no FP8/MXFP4 path for this model) in the
export's activation dtype, with its own cache (one DynamicCache per group of rows prefilled together).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from dsv4.model.checkpoint.irpa import load_export_model
from dsv4.model.kernels.moe import routed_moe
from dsv4.model.moe import Gate
from dsv4.model.state import new_state

__all__ = ["load_export_model", "TorchBackend", "TransformersBackend", "TORCH_DEVICE", "Routing"]

# IREE driver -> torch device (ROCm torch calls its GPUs cuda too)
TORCH_DEVICE = {"cuda": "cuda", "hip": "cuda", "local-task": "cpu", "local-sync": "cpu"}


def _torch_device(device: str, who: str) -> str:
    """The torch device of IREE driver `device`, or ValueError naming why `who` cannot run there."""
    dev = TORCH_DEVICE.get(device)
    if dev is None:
        raise ValueError(f"no torch device for {device!r}")
    if dev == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{who}: torch sees no GPU (torch {torch.__version__})")
    return dev


class Routing:
    """The experts each decode layer's router picked, per call (filled by TorchBackend.record_routing)."""

    def __init__(self, n_layers: int):
        self.calls: list[list[np.ndarray]] = [[] for _ in range(n_layers)]

    def distinct_per_layer(self) -> list[list[int]]:
        """Per layer, the distinct experts of each recorded call (all rows of the step together)."""
        return [[len(np.unique(ids)) for ids in layer] for layer in self.calls]


class TorchBackend:
    """`torch-eager` or `torch-compile` (mode default) on the torch device of `device`."""

    def __init__(self, export_dir: str | Path, name: str, device: str, n_slots: int):
        if name not in ("torch-eager", "torch-compile"):
            raise ValueError(f"unknown torch backend {name!r}")
        self.device = _torch_device(device, name)
        self.model, cfg, dtype = load_export_model(export_dir, self.device)
        self.state = new_state(cfg, n_slots, dtype, device=self.device)
        self.name = f"{name} ({self.device})"
        self.fn: Callable = self.model
        if name == "torch-compile":
            import torch._dynamo as dynamo

            # mode default, one static graph per shape, as a server with fixed batch sizes compiles it
            # (and as the export specializes). Automatic dynamic shapes would recompile the second
            # batch size with a symbolic batch (and a symbolic routed-MoE block count); at Flash
            # dimensions that recompile did not finish in 400 s. A higher recompile limit so
            # it never falls back to eager.
            for knob in ("cache_size_limit", "recompile_limit"):
                if hasattr(dynamo.config, knob):
                    setattr(dynamo.config, knob, 64)
            self.fn = torch.compile(self.model, dynamic=False)
        else:
            self.record_routing = self._record_routing  # hooks would break torch-compile's graph

    @contextlib.contextmanager
    def _record_routing(self) -> Iterator[Routing]:
        """Record the expert ids every layer's router (model/moe.py Gate) returns while inside (the
        MTP block's gate, which decode does not run, is left out)."""
        gates = [m for name, m in self.model.named_modules() if isinstance(m, Gate) and name.startswith("layers.")]
        rec = Routing(len(gates))
        hooks = [g.register_forward_hook(lambda mod, args, out, i=i: rec.calls[i].append(out[1].cpu().numpy()))
                 for i, g in enumerate(gates)]
        try:
            yield rec
        finally:
            for h in hooks:
                h.remove()

    def _run(self, tokens, start, lengths, slots) -> np.ndarray:
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        with torch.no_grad(), routed_moe():
            logits = self.fn(t(tokens), t(start), t(lengths), t(slots), self.state)
            return logits.argmax(-1).cpu().numpy()  # .cpu() waits for the device

    def prefill(self, tokens, start, lengths, slots) -> np.ndarray:
        return self._run(tokens, start, lengths, slots)

    def decode(self, tokens, start, slots) -> np.ndarray:
        return self._run(tokens, start, np.ones(len(slots), np.int64), slots)


class TransformersBackend:
    """transformers' DeepseekV4ForCausalLM on the export's weights (dequantized) and torch device.

    Its cache has no slots: rows are prefilled together (`any_prefill_batch`: the bench gives each
    batch's rows to one prefill call per chunk) and decoded as that same group. Every row of a call
    must have the same length (the bench's rows do)."""

    any_prefill_batch = True

    def __init__(self, export_dir: str | Path, device: str):
        try:
            from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
        except ImportError as e:
            if isinstance(e, ModuleNotFoundError):  # no transformers at all: the caller names the extra
                raise
            import transformers

            raise ValueError(f"transformers {transformers.__version__} has no DeepSeek-V4 model "
                             "(--compare transformers needs transformers >= 5.8)") from e

        from dsv4.model.checkpoint import transformers_state_dict, unquantized_config
        from dsv4.model.transformers_config import transformers_config_dict

        self.device = _torch_device(device, "transformers")
        model, cfg, dtype = load_export_model(export_dir, "cpu")
        state = transformers_state_dict(model, cfg, dtype)
        del model
        hf_cfg = DeepseekV4Config(**transformers_config_dict(unquantized_config(cfg)))
        hf, info = DeepseekV4ForCausalLM.from_pretrained(None, config=hf_cfg, state_dict=state, dtype=dtype,
                                                         output_loading_info=True)
        if info["missing_keys"] or info["mismatched_keys"]:
            raise ValueError(f"transformers backend: weights do not fit DeepseekV4ForCausalLM: "
                             f"missing {sorted(info['missing_keys'])[:5]}, mismatched {info['mismatched_keys'][:5]}")
        del state
        self.model = hf.to(self.device).eval()
        self.name = f"transformers ({self.device})"
        self.dtype = dtype
        self.autocast = False
        self.caches: dict[tuple[int, ...], Any] = {}

    def _step(self, tokens: np.ndarray, slots: np.ndarray, new: bool) -> np.ndarray:
        from transformers import DynamicCache

        key = tuple(int(x) for x in slots)
        if new:
            self.caches[key] = DynamicCache(config=self.model.config)
        elif key not in self.caches:
            raise ValueError(f"transformers backend: rows {key} were not prefilled together")
        ids = torch.from_numpy(np.ascontiguousarray(tokens)).to(self.device)
        try:
            out = self._forward(ids, self.caches[key])
        except RuntimeError as e:
            # transformers 5.17's DeepSeek-V4 hands an fp32 hidden state to a bf16 linear (5.24 does
            # not): run its forward under autocast to our dtype instead, and say so in the row name
            if self.autocast or not new or "same dtype" not in str(e) or self.dtype == torch.float32:
                raise
            self.autocast = True
            self.name = f"transformers ({self.device}, autocast)"
            self.caches[key] = DynamicCache(config=self.model.config)
            out = self._forward(ids, self.caches[key])
        return out.logits[:, -1].argmax(-1).cpu().numpy()  # .cpu() waits for the device

    def _forward(self, ids: torch.Tensor, cache: Any) -> Any:
        amp = (torch.autocast(torch.device(self.device).type, dtype=self.dtype) if self.autocast
               else contextlib.nullcontext())
        with torch.no_grad(), amp:
            return self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def prefill(self, tokens, start, lengths, slots) -> np.ndarray:
        n, s = int(lengths[0]), int(start[0])
        if (np.asarray(lengths) != n).any() or (np.asarray(start) != s).any():
            raise ValueError("transformers backend: every row of a prefill call needs the same start and length")
        return self._step(np.asarray(tokens)[:, :n], slots, new=s == 0)

    def decode(self, tokens, start, slots) -> np.ndarray:
        return self._step(tokens, slots, new=False)
