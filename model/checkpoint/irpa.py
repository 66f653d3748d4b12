"""The torch side of an export's weights (.irpa shards): the inventory of a model's parameters as the
vmfb names them, and loading those files back into a Transformer (`load_irpa`), so eager torch runs
exactly the weights the compiled module runs (e.g. ones `dsv4 weights random` made on a GPU host).

Keys are PARAM_PREFIX + the Transformer's state-dict names: iree-turbine externalizes the parameters
of the exporter's wrapper module, which holds the Transformer as `.model`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from dsv4.contract.artifact import DTYPES, FP8_DTYPES, PARAM_PREFIX, ExportConfig, TensorSpec

from .common import CheckpointError, no_param_init

if TYPE_CHECKING:
    import numpy as np

    from ..config import ModelConfig

__all__ = ["dtype_name", "param_inventory", "archive_tensors", "load_irpa", "load_export_model"]


def dtype_name(dtype: torch.dtype) -> str:
    """The inventory's name of a torch dtype (torch.bfloat16 -> "bfloat16")."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"no weights dtype for {dtype}")
    return name


def archive_tensors(tensors: dict[str, torch.Tensor], fp8_dtype: str = "float8_e4m3fn", prefix: str = ""
                    ) -> Iterator[tuple[str, "np.ndarray", str]]:
    """One unit of tensors (a module's parameters, a checkpoint unit; names ending in their leaf) as
    `contract.weights.write_shards` takes them: (prefix + name, array in the dtype's storage type,
    dtype name), emptying `tensors` on the way (each is dropped once yielded). With fp8_dtype
    "float8_e4m3fnuz" every e4m3fn weight is converted together with its block scale
    (`weight_of_scale` pairs them; formats.fp8_fn_to_fnuz: 0x80 -> 0x00, scale x2)."""
    from dsv4.contract.random_weights import weight_of_scale
    from dsv4.contract.weights import storage_dtype

    from ..quant.formats import fp8_fn_to_fnuz

    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype!r}")
    names = {n: dtype_name(t.dtype) for n, t in tensors.items()}
    if fp8_dtype == "float8_e4m3fnuz":
        for sname in list(tensors):
            owner = weight_of_scale(sname)
            if owner in tensors and tensors[owner].dtype == torch.float8_e4m3fn:
                tensors[owner], tensors[sname] = fp8_fn_to_fnuz(tensors[owner], tensors[sname])
                names[owner] = fp8_dtype
    for n in list(tensors):
        t = tensors.pop(n).detach().contiguous()
        yield prefix + n, t.reshape(-1).view(torch.uint8).numpy().view(storage_dtype(names[n])).reshape(t.shape), names[n]


def param_inventory(model: nn.Module, prefix: str = PARAM_PREFIX) -> list[TensorSpec]:
    """Every parameter and persistent buffer of `model` (meta tensors are fine) as the vmfb keys it:
    config.json's ``weights.tensors`` (`TensorSpec.to_json`), in state-dict order."""
    return [TensorSpec(prefix + n, tuple(t.shape), dtype_name(t.dtype)) for n, t in model.state_dict().items()]


def _weight_files(source: str | os.PathLike | Sequence[str | os.PathLike]) -> tuple[list[Path], str, int]:
    """The .irpa files to read: given, or an export directory's e4m3fn flavour (any flavour when it
    has only one), a name for messages, and the export's device count (its weights cut per device)."""
    from dsv4.contract.weights import open_weights

    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        d = Path(source)
        exp = ExportConfig.load(d)
        groups = exp.weight_groups()

        def fnuz(files: Sequence[Path]) -> bool:
            w = open_weights(files)
            return any((w.spec(k) or ((), ""))[1] == "float8_e4m3fnuz" for k in w)

        files = next((g.files for g in groups if not fnuz(g.files)), groups[0].files)
        return list(files), str(d), exp.weight_devices
    paths = [Path(source)] if isinstance(source, (str, os.PathLike)) else [Path(p) for p in source]
    return paths, ", ".join(str(p) for p in paths), 1


@torch.no_grad()
def load_irpa(model: nn.Module, source: str | os.PathLike | Sequence[str | os.PathLike], *,
              prefix: str = PARAM_PREFIX, mapped: bool = False) -> nn.Module:
    """Fill every parameter and persistent buffer of `model` from .irpa files: an export directory
    (its e4m3fn weights, or its only flavour; a multi-device export's per-device parts joined
    into whole tensors), one file or a list of shards. Keys are `prefix` +
    state-dict names. Every tensor's shape, dtype and byte size is checked against the model first,
    and missing or extra tensors are reported, all in one CheckpointError before anything is copied.
    e4m3fnuz weights are read into an e4m3fn model by formats.fp8_fnuz_to_fn (same values).

    `mapped=True` copies nothing: each tensor becomes a read-only view of the memory-mapped file
    (the model keeps the mapping alive), so a Flash-sized eager model costs page cache, not memory,
    and shares its pages with an IREE module reading the same files. Such a model must not be
    written to; converted (fnuz) tensors are still copied."""
    from dsv4.contract.random_weights import weight_of_scale
    from dsv4.contract.weights import WholeWeights, open_weights

    from ..quant.formats import fp8_fnuz_to_fn

    paths, where, n_devices = _weight_files(source)
    w = open_weights(paths)
    if n_devices > 1:
        w = WholeWeights(w, n_devices)
    targets = model.state_dict(keep_vars=True)
    problems, convert = [], set()
    for name, t in targets.items():
        key, want = prefix + name, dtype_name(t.dtype)
        if key not in w:
            problems.append(f"missing: {key} (model expects {want} {list(t.shape)})")
            continue
        shape, dtype = w.spec(key) or (tuple(t.shape), want)
        if dtype == "float8_e4m3fnuz" and want == "float8_e4m3fn":
            convert.add(name)
        elif dtype != want:
            problems.append(f"dtype: {key} is {dtype} in {w.file_of(key).name}, the model has {want}")
            continue
        if shape != tuple(t.shape) or w.nbytes(key) != t.numel() * t.element_size():
            problems.append(f"shape: {key} is {list(shape)} ({w.nbytes(key)} bytes) in {w.file_of(key).name}, "
                            f"the model has {list(t.shape)}")
    problems += [f"extra: {k} ({w.file_of(k).name}) has no place in the model" for k in w
                 if not k.startswith(prefix) or k[len(prefix):] not in targets]
    scales = {s: o for s in targets if (o := weight_of_scale(s)) in convert}
    problems += [f"dtype: {prefix + o} is e4m3fnuz but its scale {prefix + s} is missing"
                 for s, o in scales.items() if prefix + s not in w]
    if problems:
        raise CheckpointError(where, problems)

    def stored(name: str) -> torch.Tensor:
        t = targets[name]
        with warnings.catch_warnings():  # a read-only view of the map; it is only copied from
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(w[prefix + name])
        return raw.view(torch.float8_e4m3fnuz if name in convert else t.dtype).reshape(t.shape)

    for name, t in targets.items():
        if name in convert:
            scale = next(s for s, o in scales.items() if o == name)
            wt, sc = fp8_fnuz_to_fn(stored(name), stored(scale))
            t.copy_(wt)
            targets[scale].copy_(sc)
        elif name not in scales:
            if mapped:
                t.data = stored(name)
            else:
                t.copy_(stored(name))
    if mapped:
        model._irpa_mapping = w  # the views above point into its memory maps
    return model


def load_export_model(export_dir: str | os.PathLike, device: str = "cpu") -> tuple[nn.Module, "ModelConfig", torch.dtype]:
    """The eager Transformer of an export with the weights its vmfbs run (`load_irpa`): built from
    config.json's model section and activation dtype, low-bit weights kept low-bit when the files
    hold them. Returns (model in eval mode on `device`, its config, activation dtype)."""
    from dsv4.contract.weights import open_weights

    from ..config import ModelConfig
    from ..model import Transformer

    d = Path(export_dir)
    exp = ExportConfig.load(d)
    cfg = ModelConfig.from_dict(exp.model)
    dtype = getattr(torch, str(exp.raw.get("activation_dtype", "bfloat16")).removeprefix("torch."))
    paths, _, _ = _weight_files(d)
    w = open_weights(paths)
    quantized = any((w.spec(k) or ((), ""))[1] in (*FP8_DTYPES, "uint8") for k in w)
    del w
    with no_param_init():  # every tensor is about to be loaded
        model = Transformer(cfg, dtype=dtype, quantized=quantized)
    load_irpa(model, d)
    return model.eval().to(device), cfg, dtype
