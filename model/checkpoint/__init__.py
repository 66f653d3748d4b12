"""Checkpoint I/O: load a DeepSeek-V4 checkpoint directory as released, and write one.

Files: `names.py` (naming schemes and their mapping), `inventory.py` (a directory's tensors from
its headers, CheckpointError), `load.py`, `write.py`, `make.py` (a random checkpoint: `dsv4 checkpoint make`), `irpa.py`
(an export's .irpa weights into a Transformer: `load_irpa`, `load_export_model`, `param_inventory`); the
quantizers are `dsv4.model.quant.quantize`, the transformers form of config.json `dsv4.model.transformers_config`.

Loading (`load_checkpoint`, `load_into`) reads `config.json` plus `model.safetensors` or
`model.safetensors.index.json` + shards, in any of three naming schemes, all mapped onto the one
canonical scheme (the official release names, docs/model.md, Checkpoint format):
  * official: `layers.{i}.attn.wq_a.weight`, per-expert `layers.{i}.ffn.experts.{e}.w1.weight`, ...;
  * transformers (`deepseek_v4`, docs/model.md, Checkpoint format): `model.layers.{i}.self_attn.q_a_proj.weight`, stacked
    `mlp.experts.gate_up_proj` [E, 2I, d] = cat(w1, w3), `...weight_scale_inv` for FP8 scales, ...;
  * what transformers' `save_pretrained` writes: its reverse conversion gives official names with a
    `model.` prefix, except that `embed_tokens`, `hc_head.hc_*` keep transformers names, the head is
    `head.weight` and the attention's `kv_norm` comes out as `attn.norm`.
The model keeps low-bit weights low-bit (FP8 e4m3fn + E8M0/float32 block scales, packed MXFP4 +
E8M0 scales; the kernels dequantize at use). Tensors are read through safetensors' memory maps one
at a time and copied straight into the model's parameters, so no weight is ever held twice; shards
are opened lazily and closed when their last tensor is in. Missing, extra, mis-shaped and mis-typed
tensors are all found from the headers before any data is read and reported in ONE CheckpointError;
corrupt values (NaN E8M0 or FP8 codes, non-finite floats, expert ids out of range) are collected
while reading and reported the same way. Only safetensors is read: nothing is ever unpickled.

Writing (`write_checkpoint`) produces exactly the official layout and dtypes (or the transformers
layout), quantizing float weights on the way: FP8 e4m3fn linears with 128x128 block scales =
smallest power of two >= amax/448 stored as F8_E8M0 (float32 amax/448 for -Base style
`scale_fmt: fp32`), MXFP4 experts as int8 with per-32 E8M0 scales = smallest power of two >= amax/6,
bf16 norms/embed/head/compressor/gate weights, fp32 mHC/attn_sink/ape/gate.bias, int64 tid2eid,
`wo_a` as FP8 + scale. Weights already in the target format are copied byte for byte.

The names below load on first use (PEP 562), so `irpa.py` (and `common.py`) import without
safetensors, e.g. on a GPU host that only runs eager torch on an export's .irpa weights.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

# name -> the module that defines it (imported when the name is first used)
_LAZY = {
    "CheckpointError": ".common",
    "Checkpoint": ".inventory",
    "open_checkpoint": ".inventory",
    "read_config": ".inventory",
    "load_checkpoint": ".load",
    "load_into": ".load",
    "checkpoint_tensors": ".load",
    "write_checkpoint": ".write",
    "transformers_state_dict": ".write",
    "unquantized_config": ".write",
    "canonical_name": ".names",
    "transformers_name": ".names",
    "load_irpa": ".irpa",
    "load_export_model": ".irpa",
    "param_inventory": ".irpa",
    "make_random_checkpoint": ".make",
    "quantize_fp8_block": "..quant.quantize",
    "quantize_mxfp4": "..quant.quantize",
    "transformers_config_dict": "..transformers_config",
}

__all__ = [*_LAZY, "EMBEDDED_CHECKPOINT", "EMBEDDED_PROMPT"]

# The embedded default model (trained by `python -m dsv4.train`, official layout): what `dsv4 export`
# and `dsv4 eager` use when given no checkpoint. Its held-out text is eval.txt beside the weights.
EMBEDDED_CHECKPOINT = Path(__file__).resolve().parent.parent / "assets" / "small"
EMBEDDED_PROMPT = "The list data type has some more methods."  # the fixed prompt of `make run`


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
