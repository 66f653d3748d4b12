"""Loading: plan where every checkpoint tensor goes in the model (all structural problems found
before any data is read), then fill the model's tensors one *unit* at a time (a tensor, or a weight
with its block scale; a stacked expert tensor from its per-expert entries), reading through memory
maps that are closed after each unit (the pages a map touched count as the process's memory until
then, so memory stays bounded by one unit, not one shard).

The same plan and data movers serve `load_into` (units filled in the model's own tensors) and
`checkpoint_tensors` (units filled in fresh tensors and yielded as numpy arrays in the model's
state-dict order, optionally converted to e4m3fnuz: what the exporter writes into .irpa shards)."""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from dsv4.contract.artifact import FP8_DTYPES, PARAM_PREFIX

from ..config import ConfigError, ModelConfig
from ..quant.formats import FP8_BLOCK, MXFP4_BLOCK, dequant_fp8_block, dequant_mxfp4, e8m0_decode, mxfp4_to_fp8
from ..model import Transformer
from .common import CheckpointError, no_param_init as _no_param_init
from .inventory import Checkpoint, Entry, open_checkpoint
from .names import EXPERTS

__all__ = ["load_checkpoint", "load_into", "checkpoint_tensors"]

_ROW_CHUNK = 1024  # rows dequantized at a time (a multiple of 128): bounds the float32 temporaries
_CHECK_ELEMS = 1 << 24  # elements per value-check chunk
_FLOAT_ST = {"BF16", "F16", "F32", "F64"}
_INT_ST = {"I64", "I32"}
_PACKED_ST = {"I8", "U8"}
_FP8_DT = {torch.float8_e4m3fn}


@dataclass(frozen=True)
class _Slot:
    """Where an op writes: model tensor `name`, or expert `index` of it; shape and dtype as planned."""

    name: str
    index: int | None
    shape: torch.Size
    dtype: torch.dtype

    def of(self, out: dict[str, torch.Tensor]) -> torch.Tensor:
        t = out[self.name]
        return t if self.index is None else t[self.index]


@dataclass
class _Op:
    """Fill one model tensor (or an expert's slice of one, with its scale) from checkpoint entries.
    `unit` names the model tensor whose unit the op belongs to; `run(sources, out)` writes into
    the unit's tensors `out` (model name -> tensor)."""

    unit: str
    fills: tuple[str, ...]  # model tensors it writes
    sources: list[tuple[str, Entry]]  # (canonical name, entry)
    run: Callable[[list[torch.Tensor], dict[str, torch.Tensor]], None]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for _, e in self.sources)


class _Planner:
    def __init__(self, entries: dict[str, Entry], check_values: bool, n_experts: int):
        self.entries = entries
        self.check = check_values
        self.n_experts = n_experts
        self.ops: list[_Op] = []
        self.problems: list[str] = []
        self.value_problems: list[str] = []
        self.used: set[str] = set()

    # ---- helpers -------------------------------------------------------------------------
    def _get(self, name: str, want: str) -> Entry | None:
        e = self.entries.get(name)
        if e is None:
            self.problems.append(f"missing: {name} (model expects {want})")
        else:
            self.used.add(name)
        return e

    def _shape(self, name: str, e: Entry, shape: Sequence[int]) -> bool:
        if tuple(e.shape) != tuple(shape):
            self.problems.append(f"shape: {name} is {e.describe()}, model expects {list(shape)}")
            return False
        return True

    def _dtype(self, name: str, e: Entry, allowed: set[str], what: str) -> bool:
        if e.dtype not in allowed:
            self.problems.append(f"dtype: {name} is {e.describe()}, model expects {what} ({'/'.join(sorted(allowed))})")
            return False
        return True

    def _bad(self, name: str, msg: str) -> None:
        self.value_problems.append(f"value: {name} {msg}")

    def _count(self, t: torch.Tensor, bad: Callable[[torch.Tensor], torch.Tensor]) -> int:
        """Elements flagged by `bad`, counted over row chunks (bounded temporaries on big tables)."""
        if t.dim() == 0:
            return int(bad(t).sum())
        step = max(1, _CHECK_ELEMS // max(1, t[0].numel()))
        return sum(int(bad(t[r: r + step]).sum()) for r in range(0, t.shape[0], step))

    def _check_e8m0(self, name: str, b: torch.Tensor) -> None:
        n = self._count(b, lambda x: x == 0xFF) if self.check else 0
        if n:
            self._bad(name, f"has {n} NaN E8M0 scale byte(s) (0xFF)")

    def _check_fp8(self, name: str, t: torch.Tensor) -> None:
        n = self._count(t.view(torch.uint8), lambda x: (x & 0x7F) == 0x7F) if self.check else 0
        if n:
            self._bad(name, f"has {n} NaN e4m3fn code(s) (0x7F/0xFF)")

    def _check_float(self, name: str, t: torch.Tensor) -> None:
        n = self._count(t, lambda x: ~torch.isfinite(x)) if self.check else 0
        if n:
            self._bad(name, f"has {n} non-finite value(s)")

    # ---- plan entries ---------------------------------------------------------------------
    def plain(self, name: str, target: _Slot) -> None:
        """Norms, mHC, sinks, ape, gate, embed, head, float linears with no scale, tid2eid."""
        want = f"{str(target.dtype).replace('torch.', '')} {list(target.shape)}"
        e = self._get(name, want)
        if e is None:
            return
        ok = self._shape(name, e, target.shape)
        if target.dtype.is_floating_point:
            ok &= self._dtype(name, e, _FLOAT_ST, "a float tensor")
        else:
            ok &= self._dtype(name, e, _INT_ST, "an integer tensor")
        if not ok:
            return
        is_tid = name.endswith("gate.tid2eid")

        def run(ts: list[torch.Tensor], out: dict[str, torch.Tensor]) -> None:
            (t,) = ts
            if target.dtype.is_floating_point:
                self._check_float(name, t)
            elif is_tid and self.check and self._count(t, lambda x: (x < 0) | (x >= self.n_experts)):
                self._bad(name, f"has expert ids outside [0, {self.n_experts})")
            target.of(out).copy_(t)

        self.ops.append(_Op(target.name, (target.name,), [(name, e)], run))

    def weight(self, name: str, target: _Slot, target_scale: _Slot | None) -> None:
        """A linear / expert weight `X.weight` with its `X.scale` (if the checkpoint or model has one)."""
        sname = name[: -len("weight")] + "scale"
        stored = self.entries.get(name)
        if target.dtype in _FP8_DT and target_scale is not None and stored is not None and stored.dtype in _PACKED_ST:
            return self._mxfp4_as_fp8(name, sname, target, target_scale)
        if target.dtype in _FP8_DT or target.dtype == torch.uint8:
            if target_scale is None:
                raise TypeError(f"{name}: a {target.dtype} model weight without its scale parameter")
            fmt = "fp8" if target.dtype in _FP8_DT else "mxfp4"
            want = f"{'F8_E4M3' if fmt == 'fp8' else 'I8'} {list(target.shape)}"
            e = self._get(name, want)
            s = self._get(sname, f"{'F8_E8M0' if target_scale.dtype == torch.uint8 else 'F32/F8_E8M0'} "
                                 f"{list(target_scale.shape)}")
            if e is None or s is None:
                return
            ok = self._shape(name, e, target.shape) & self._shape(sname, s, target_scale.shape)
            if fmt == "fp8":
                ok &= self._dtype(name, e, {"F8_E4M3"}, "an FP8 e4m3fn weight (load with quantized=False "
                                  "to dequantize a differently stored checkpoint)")
            else:
                ok &= self._dtype(name, e, _PACKED_ST, "packed MXFP4 bytes")
            scale_ok = {"F8_E8M0"} if target_scale.dtype == torch.uint8 else {"F8_E8M0", "F32"}
            ok &= self._dtype(sname, s, scale_ok, "E8M0 block scales" if target_scale.dtype == torch.uint8
                              else "float32 or E8M0 block scales")
            if not ok:
                return

            def run(ts: list[torch.Tensor], out: dict[str, torch.Tensor]) -> None:
                w, sc = ts
                if fmt == "fp8":
                    self._check_fp8(name, w)
                    target.of(out).copy_(w)
                else:
                    target.of(out).copy_(w.view(torch.uint8))
                self._copy_scale(sname, sc, target_scale.of(out))

            self.ops.append(_Op(target.name, (target.name, target_scale.name), [(name, e), (sname, s)], run))
            return

        # float model tensor: plain copy, or dequantize an FP8 / MXFP4 checkpoint tensor
        if sname not in self.entries:
            return self.plain(name, target)
        e = self._get(name, f"{str(target.dtype).replace('torch.', '')} {list(target.shape)}")
        s = self._get(sname, "block scales")
        if e is None or s is None:
            return
        n, k = target.shape
        if e.dtype == "F8_E4M3":
            grid = (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
            ok = self._shape(name, e, (n, k)) & self._shape(sname, s, grid)
            ok &= self._dtype(sname, s, {"F8_E8M0", "F32"}, "FP8 block scales")
            if ok:
                self.ops.append(_Op(target.name, (target.name,), [(name, e), (sname, s)],
                                    lambda ts, out: self._dequant(name, sname, ts, target.of(out), "fp8")))
        elif e.dtype in _PACKED_ST:
            ok = self._shape(name, e, (n, k // 2)) & self._shape(sname, s, (n, k // MXFP4_BLOCK))
            ok &= self._dtype(sname, s, {"F8_E8M0"}, "MXFP4 E8M0 scales")
            if ok:
                self.ops.append(_Op(target.name, (target.name,), [(name, e), (sname, s)],
                                    lambda ts, out: self._dequant(name, sname, ts, target.of(out), "mxfp4")))
        else:
            self._dtype(name, e, {"F8_E4M3", "I8", "U8"}, "a quantized weight (it has a scale)")

    def _mxfp4_as_fp8(self, name: str, sname: str, target: _Slot, target_scale: _Slot) -> None:
        """A stored MXFP4 weight into an FP8 model weight (a model built with expert_dtype "fp8" from an
        MXFP4 checkpoint: `load_checkpoint(expert_dtype="fp8")`): re-encoded per 128x128 block by
        formats.mxfp4_to_fp8, exactly or not at all (a value problem naming the tensor)."""
        n, k = target.shape
        e = self._get(name, f"I8 {[n, k // 2]}")
        s = self._get(sname, f"F8_E8M0 {[n, k // MXFP4_BLOCK]}")
        if e is None or s is None:
            return
        ok = self._shape(name, e, (n, k // 2)) & self._shape(sname, s, (n, k // MXFP4_BLOCK))
        if not (ok & self._dtype(sname, s, {"F8_E8M0"}, "MXFP4 E8M0 scales")):
            return

        def run(ts: list[torch.Tensor], out: dict[str, torch.Tensor]) -> None:
            w, sc = ts
            b = sc.view(torch.uint8)
            self._check_e8m0(sname, b)
            try:
                w8, s8 = mxfp4_to_fp8(w.view(torch.uint8), b, strict=True)
            except ValueError as err:
                self._bad(name, f"cannot be re-encoded as FP8 exactly ({err})")
                return
            target.of(out).copy_(w8)
            t = target_scale.of(out)
            t.copy_(s8 if t.dtype == torch.uint8 else e8m0_decode(s8))

        self.ops.append(_Op(target.name, (target.name, target_scale.name), [(name, e), (sname, s)], run))

    # ---- data movers -----------------------------------------------------------------------
    def _copy_scale(self, sname: str, sc: torch.Tensor, target: torch.Tensor) -> None:
        if sc.dtype == torch.float8_e8m0fnu:
            b = sc.view(torch.uint8)
            self._check_e8m0(sname, b)
            target.copy_(b if target.dtype == torch.uint8 else e8m0_decode(b))
        else:  # float32 scales (-Base)
            if self.check and not bool((torch.isfinite(sc) & (sc > 0)).all()):
                self._bad(sname, "has non-finite or non-positive float32 scales")
            target.copy_(sc)

    def _dequant(self, name: str, sname: str, ts: list[torch.Tensor], target: torch.Tensor, fmt: str) -> None:
        w, sc = ts
        if sc.dtype == torch.float8_e8m0fnu:
            sc = sc.view(torch.uint8)
            self._check_e8m0(sname, sc)
        if fmt == "fp8":
            self._check_fp8(name, w)
        for r in range(0, w.shape[0], _ROW_CHUNK):
            rows = slice(r, r + _ROW_CHUNK)
            if fmt == "fp8":
                v = dequant_fp8_block(w[rows], sc[r // FP8_BLOCK: (r + _ROW_CHUNK) // FP8_BLOCK])
            else:
                v = dequant_mxfp4(w[rows].view(torch.uint8), sc[rows])
            target[rows].copy_(v)


def _plan(targets: dict[str, torch.Tensor], entries: dict[str, Entry], n_experts: int, check_values: bool,
          ignore: Callable[[str], bool]) -> _Planner:
    """Ops for every model tensor of `targets` (a state dict: only shapes and dtypes are read, so
    meta tensors do), in its order."""
    plan = _Planner(entries, check_values, n_experts)

    def slot(name: str, index: int | None = None) -> _Slot | None:
        t = targets.get(name)
        if t is None:
            return None
        return _Slot(name, index, t.shape[1:] if index is not None else t.shape, t.dtype)

    for name, t in targets.items():
        m = EXPERTS.match(name)
        if m:
            if m.group(3):
                continue  # handled with its weight
            prefix, w = m.group(1), m.group(2)
            for e in range(t.shape[0]):
                plan.weight(f"{prefix}.{e}.{w}.weight", slot(name, e), slot(f"{name}_scale", e))
        elif name.endswith(".scale") and name[:-6] + ".weight" in targets:
            continue  # handled with its weight
        elif name.endswith(".weight") and t.dim() == 2:
            plan.weight(name, slot(name), slot(name[:-7] + ".scale"))
        else:
            plan.plain(name, slot(name))
    for name in entries:
        if name not in plan.used and not ignore(name):
            plan.problems.append(f"extra: {name} ({entries[name].describe()} in {entries[name].file}) "
                                 "has no place in the model")
    return plan


class _Files:
    """The shards one unit reads, opened on first use and all closed by `close()`."""

    def __init__(self, root: Path):
        self.root = root
        self.open: dict[str, Any] = {}

    def tensor(self, e: Entry) -> torch.Tensor:
        h = self.open.get(e.file)
        if h is None:
            try:
                h = safe_open(str(self.root / e.file), framework="pt").__enter__()
            except (SafetensorError, OSError) as err:
                raise CheckpointError(self.root, [f"file: {e.file} could not be opened ({err})"]) from None
            self.open[e.file] = h
        t = h.get_tensor(e.key)  # a view of the memory map: nothing is copied yet
        if e.index is not None:
            x, lo, hi = e.index
            t = t[x, lo:hi]
        return t

    def close(self) -> None:
        for h in self.open.values():
            h.__exit__(None, None, None)
        self.open.clear()


def _fill(ckpt: Checkpoint, plan: _Planner, alloc: Callable[[str], torch.Tensor],
          progress: bool | None) -> Iterator[dict[str, torch.Tensor]]:
    """Run the plan unit by unit in the model's order: `alloc(name)` gives the tensor to fill, each
    filled unit is yielded ({model name: tensor}); value problems raise after the last one."""
    units: dict[str, list[_Op]] = {}
    for op in plan.ops:
        units.setdefault(op.unit, []).append(op)
    bar = tqdm(total=sum(e.nbytes for op in plan.ops for _, e in op.sources), unit="B", unit_scale=True,
               desc=f"loading {ckpt.path.name}", disable=None if progress is None else not progress, leave=False)
    try:
        for ops in units.values():
            out = {n: alloc(n) for n in dict.fromkeys(n for op in ops for n in op.fills)}
            files = _Files(ckpt.path)
            try:
                for op in ops:
                    op.run([files.tensor(e) for _, e in op.sources], out)
                    bar.update(sum(e.nbytes for _, e in op.sources))
            finally:
                files.close()
            yield out
    finally:
        bar.close()
    if plan.value_problems:
        raise CheckpointError(ckpt.path, plan.value_problems)


def _ignore_mtp(n_mtp: int, skip_mtp: bool) -> Callable[[str], bool]:
    """Checkpoint tensors that have no place in a model with `n_mtp` MTP blocks but are no error."""

    def ignore(name: str) -> bool:
        m = re.match(r"^mtp\.(\d+)\.(.*)$", name)
        if m is None:
            return False
        # convert.py drops these if present: MTP shares the model's embed and head (docs/model.md, Forward pass)
        return m.group(2) in ("embed.weight", "head.weight") or (skip_mtp and int(m.group(1)) >= n_mtp)

    return ignore


@torch.no_grad()
def load_into(model: Transformer, ckpt: Checkpoint | str | os.PathLike, *, check_values: bool = True,
              progress: bool | None = None, skip_mtp: bool = False) -> None:
    """Fill every parameter and persistent buffer of `model` from the checkpoint.

    Low-bit model tensors take the checkpoint's bytes unchanged; float model tensors take float
    checkpoint tensors (cast) or dequantized FP8/MXFP4 ones (e.g. `wo_a`, or a float model built to
    dequantize everything). All structural problems raise one CheckpointError before any data is
    read; value problems are collected during the copy and raised together at the end.
    `skip_mtp` ignores `mtp.*` tensors the model has no block for."""
    if not isinstance(ckpt, Checkpoint):
        ckpt = open_checkpoint(ckpt)
    targets = model.state_dict()
    plan = _plan(targets, ckpt.entries, model.cfg.n_routed_experts, check_values,
                 _ignore_mtp(len(getattr(model, "mtp", ())), skip_mtp))
    if plan.problems:
        raise CheckpointError(ckpt.path, plan.problems)
    for _ in _fill(ckpt, plan, targets.__getitem__, progress):
        pass


@torch.no_grad()
def checkpoint_tensors(ckpt: Checkpoint | str | os.PathLike, model: Transformer, fp8_dtype: str = "float8_e4m3fn", *,
                       prefix: str = PARAM_PREFIX, check_values: bool = True,
                       progress: bool | None = None) -> Iterator[tuple[str, np.ndarray, str]]:
    """The checkpoint's tensors as `model` holds them, one at a time in its state-dict order (the
    order of `irpa.param_inventory(model)`): (prefix + name, numpy array in the dtype's storage
    type, dtype name), for `contract.weights.write_shards`. `model` only gives shapes and dtypes (an
    empty or meta-device model does). Layers past the model's count are skipped (an export of the
    first N layers); FP8 weights come as `fp8_dtype` ("float8_e4m3fnuz" for gfx942: same bytes
    but 0x80 -> 0x00, block scale x2, formats.fp8_fn_to_fnuz). Structural problems raise one
    CheckpointError before the first tensor; value problems one after the last. Memory: one unit
    (at most a stacked expert tensor or the head) plus its conversion."""
    from .irpa import archive_tensors

    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype!r}")
    if not isinstance(ckpt, Checkpoint):
        ckpt = open_checkpoint(ckpt)
    targets = model.state_dict()
    mtp = _ignore_mtp(model.cfg.n_mtp, True)
    n_layers = model.cfg.n_layers

    def ignore(name: str) -> bool:
        m = re.match(r"^layers\.(\d+)\.", name)
        return mtp(name) or (m is not None and int(m.group(1)) >= n_layers)

    plan = _plan(targets, ckpt.entries, model.cfg.n_routed_experts, check_values, ignore)
    if plan.problems:
        raise CheckpointError(ckpt.path, plan.problems)
    for out in _fill(ckpt, plan, lambda n: torch.empty(targets[n].shape, dtype=targets[n].dtype), progress):
        yield from archive_tensors(out, fp8_dtype, prefix)  # empties `out`: memory holds one unit


def _storage_formats(ckpt: Checkpoint) -> tuple[str | None, str | None, str | None]:
    """(linear format, scale format, expert format) as stored, probed on the first layer."""
    def first(pattern: str) -> Entry | None:
        rx = re.compile(pattern)
        names = sorted((n for n in ckpt.entries if rx.match(n)), key=lambda n: [int(x) for x in re.findall(r"\d+", n)])
        return ckpt.entries[names[0]] if names else None

    lin = first(r"^layers\.\d+\.attn\.wq_a\.weight$")
    sc = first(r"^layers\.\d+\.attn\.wq_a\.scale$")
    exp = first(r"^layers\.\d+\.ffn\.experts\.\d+\.w1\.weight$")
    lin_fmt = "fp8" if lin is not None and lin.dtype == "F8_E4M3" else None
    scale_fmt = ("fp32" if sc is not None and sc.dtype == "F32" else "ue8m0") if lin_fmt else None
    exp_fmt = None
    if exp is not None:
        exp_fmt = {"F8_E4M3": "fp8", "I8": "fp4", "U8": "fp4"}.get(exp.dtype)
    return lin_fmt, scale_fmt, exp_fmt


def load_checkpoint(path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16, quantized: bool | None = None,
                    mtp: bool | None = None, overrides: dict[str, Any] | None = None, check_values: bool = True,
                    progress: bool | None = None, weights: bool = True, layers: int | None = None,
                    expert_dtype: str | None = None) -> Transformer:
    """Build a Transformer from a checkpoint directory and load its weights.

    quantized: None keeps the stored formats (FP8 linears / MXFP4 or FP8 experts stay low-bit, float
    checkpoints give a float model); False dequantizes everything into a float model of `dtype`
    (a reference); True is None but insists that something is quantized.
    mtp: None keeps MTP blocks if the checkpoint has them and drops them (with a warning) if it has
    none, as a transformers save does; False drops them; True requires them.
    overrides: ModelConfig fields that are ours, not the checkpoint's (max_seq_len, quant_sim, ...).
    weights=False: the model as it would be loaded, but with unwritten parameters (`empty_model`), for
    an export that streams the tensors with `checkpoint_tensors`; layers=N keeps the first N layers
    (ModelConfig.first_layers). expert_dtype="fp8" re-encodes MXFP4 experts as FP8 block weights,
    exactly (formats.mxfp4_to_fp8; a value that would round is a CheckpointError): what gfx942's FP8
    matrix cores multiply; FP8 experts stay as they are.
    """
    if expert_dtype not in (None, "fp8"):
        raise ValueError(f"expert_dtype: only 'fp8' (re-encode MXFP4 experts) is supported, got {expert_dtype!r}")
    ckpt = open_checkpoint(path)
    try:
        cfg = ModelConfig.from_checkpoint(ckpt.config, **(overrides or {}))
    except ConfigError as e:
        raise CheckpointError(ckpt.path, [f"config: {e}"]) from None
    if cfg.n_mtp and (mtp is False or (mtp is None and not ckpt.has_mtp())):
        if mtp is None:
            warnings.warn(f"{ckpt.path}: config has {cfg.n_mtp} MTP block(s) but the checkpoint has no mtp.* "
                          "tensors (a transformers save); loading the model without MTP", stacklevel=2)
        cfg = cfg.replace(num_nextn_predict_layers=0, compress_ratios=cfg.compress_ratios[:cfg.n_layers])
    lin, scale_fmt, exp = _storage_formats(ckpt)
    if quantized is False:
        if expert_dtype:
            raise ValueError("expert_dtype: a model loaded with quantized=False holds float experts")
        model_quantized = False
    else:
        if quantized and lin is None and exp is None:
            raise CheckpointError(ckpt.path, ["dtype: quantized=True but no FP8/MXFP4 weights are stored"])
        qc = None
        if lin:
            qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                  "activation_scheme": "dynamic", **(cfg.quantization_config or {}), "scale_fmt": scale_fmt}
        declared = (bool(cfg.quantization_config), cfg.expert_dtype if cfg.expert_dtype in ("fp4", "fp8") else None)
        if declared != (bool(qc), exp):
            warnings.warn(f"{ckpt.path}: config.json declares linears {'fp8' if declared[0] else 'float'} / experts "
                          f"{declared[1] or 'float'} but the tensors are {lin or 'float'} / {exp or 'float'}; "
                          "following the tensors", stacklevel=2)
        if expert_dtype and exp not in ("fp4", "fp8"):
            raise CheckpointError(ckpt.path, [f"expert_dtype: the experts are stored as {exp or 'float'} "
                                              f"tensors; only MXFP4 experts can be re-encoded as {expert_dtype}"])
        cfg = cfg.replace(quantization_config=qc, expert_dtype=expert_dtype or exp)
        model_quantized = bool(lin or exp)
    if layers is not None:
        cfg = cfg.first_layers(layers)
    if not weights:  # shapes and dtypes only: for an export that streams the weights (checkpoint_tensors)
        from dsv4.model.model import empty_model

        return empty_model(cfg, dtype, quantized=model_quantized).eval()
    with _no_param_init():
        model = Transformer(cfg, dtype=dtype, quantized=model_quantized)
    load_into(model, ckpt, check_values=check_values, progress=progress, skip_mtp=cfg.n_mtp == 0)
    return model.eval()
