"""The torch side of an export's weights (.irpa shards): the inventory of a model's parameters as the
vmfb names them, and loading those files back into a Transformer (`load_irpa`), so eager torch runs
exactly the weights the compiled module runs (e.g. ones `dsv4 weights random` made on a GPU host).

Keys are PARAM_PREFIX + the Transformer's state-dict names: iree-turbine externalizes the parameters
of the exporter's wrapper module, which holds the Transformer as `.model`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from dsv4.runtime.artifact import DTYPES, FP8_DTYPES, PARAM_PREFIX, ExportConfig, TensorSpec

from .inventory import CheckpointError

__all__ = ["dtype_name", "param_inventory", "load_irpa"]


def dtype_name(dtype: torch.dtype) -> str:
    """The inventory's name of a torch dtype (torch.bfloat16 -> "bfloat16")."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"no weights dtype for {dtype}")
    return name


def param_inventory(model: nn.Module, prefix: str = PARAM_PREFIX) -> list[TensorSpec]:
    """Every parameter and persistent buffer of `model` (meta tensors are fine) as the vmfb keys it:
    config.json's ``weights.tensors`` (`TensorSpec.to_json`), in state-dict order."""
    return [TensorSpec(prefix + n, tuple(t.shape), dtype_name(t.dtype)) for n, t in model.state_dict().items()]
