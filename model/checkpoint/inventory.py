"""A checkpoint directory's inventory, read from config.json, the index and the safetensors headers
(no tensor data): every tensor under its canonical name, and one CheckpointError for all problems."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from ..config import ModelConfig
from .common import CheckpointError
from .names import HF_STACKED, canonical_name

__all__ = ["CheckpointError", "Checkpoint", "open_checkpoint", "read_config", "INDEX_FILE", "SINGLE_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class Entry:
    """One tensor (or one expert's slice of a stacked transformers tensor) in a shard."""

    file: str
    key: str
    dtype: str  # safetensors dtype string: BF16, F32, F8_E4M3, F8_E8M0, I8, I64, ...
    shape: tuple[int, ...]
    index: tuple[int, int, int] | None = None  # (expert, first row, end row) within `key`

    @property
    def nbytes(self) -> int:
        size = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}.get(self.dtype, 1)
        return math.prod(self.shape) * size

    def describe(self) -> str:
        if self.index is None:
            return f"{self.dtype} {list(self.shape)}"
        e, lo, hi = self.index
        return f"{self.dtype} {list(self.shape)}, rows {lo}:{hi} of expert {e} in {self.key}"


@dataclass
class Checkpoint:
    """A checkpoint directory, inventoried from its headers (no tensor data read yet)."""

    path: Path
    config: dict[str, Any]
    files: list[str]
    entries: dict[str, Entry]  # canonical name -> where it is
    layout: str  # "official", or "transformers" when any name needed mapping (incl. save_pretrained output)
    tokenizer_files: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in self.files)

    def has_mtp(self) -> bool:
        return any(n.startswith("mtp.") for n in self.entries)


def _read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Inventory a checkpoint directory: config, shard headers, canonical names (CheckpointError on
    unreadable/truncated shards, index mismatches, duplicate tensors, pickle-only directories)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(root, [f"file: {root} is not a directory"])
    problems: list[str] = []
    try:
        config = json.loads((root / "config.json").read_text())
    except FileNotFoundError:
        config = {}
        problems.append("file: config.json is missing")
    except json.JSONDecodeError as e:
        config = {}
        problems.append(f"file: config.json is not valid JSON ({e})")

    weight_map: dict[str, str] | None = None
    if (root / INDEX_FILE).exists():
        try:
            index = json.loads((root / INDEX_FILE).read_text())
            weight_map = dict(index["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(root, [f"file: {INDEX_FILE} is not a valid index ({e!r})"]) from None
        files = sorted(set(weight_map.values()))
        for f in files:
            if Path(f).name != f or not f.endswith(".safetensors"):
                problems.append(f"index: shard name {f!r} must be a plain *.safetensors file name")
    elif (root / SINGLE_FILE).exists():
        files = [SINGLE_FILE]
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            pickles = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            why = (f"only pickle files ({', '.join(pickles)}); they are never loaded (safetensors only)"
                   if pickles else "no model.safetensors, no index and no *.safetensors shards")
            raise CheckpointError(root, [f"file: {why}"])

    raw: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # file key -> (file, dtype, shape)
    unreadable: set[str] = set()
    for f in files:
        p = root / f
        if not p.exists():
            problems.append(f"file: shard {f} (named in {INDEX_FILE}) does not exist")
            unreadable.add(f)
            continue
        try:
            header = _read_header(p)
        except (SafetensorError, OSError) as e:
            problems.append(f"file: {f} is not a readable safetensors file, truncated or corrupt ({e})")
            unreadable.add(f)
            continue
        for k, (dt, shape) in header.items():
            if k in raw:
                problems.append(f"duplicate: {k} is stored in both {raw[k][0]} and {f}")
            raw[k] = (f, dt, shape)
            if weight_map is not None and weight_map.get(k) != f:
                where = weight_map.get(k)
                problems.append(f"index: {k} is in {f} but the index says "
                                f"{'nothing' if where is None else where}")
    if weight_map is not None:
        for k, f in weight_map.items():
            if k not in raw and f not in unreadable:
                problems.append(f"index: {k} is listed for {f} but not stored there")

    entries: dict[str, Entry] = {}
    renamed = 0
    for k, (f, dt, shape) in raw.items():
        canon = canonical_name(k)
        renamed += canon != k
        m = HF_STACKED.match(canon)
        if m is None:
            new = {canon: Entry(f, k, dt, shape)}
        else:
            new = _split_stacked(m, f, k, dt, shape, problems)
        for c, e in new.items():
            if c in entries:
                problems.append(f"duplicate: {e.key} and {entries[c].key} are both {c}")
            entries[c] = e
    if problems:
        raise CheckpointError(root, problems)
    layout = "transformers" if renamed else "official"
    tok = sorted(p.name for p in root.iterdir()
                 if p.name.startswith("tokenizer") or p.name == "special_tokens_map.json")
    return Checkpoint(root, config, files, entries, layout, tok)


def _split_stacked(m: re.Match, f: str, k: str, dt: str, shape: tuple[int, ...],
                   problems: list[str]) -> dict[str, Entry]:
    """Per-expert official entries of a stacked transformers tensor: gate_up_proj [E, 2I, .] holds
    w1 in rows [0, I) and w3 in rows [I, 2I) (its scale grid likewise, split at half its rows)."""
    prefix, kind, scale = m.group(1), m.group(2), m.group(3)
    leaf = "scale" if scale else "weight"
    if len(shape) != 3 or (kind == "gate_up_proj" and shape[1] % 2):
        problems.append(f"shape: {k} is {dt} {list(shape)}, expected [experts, rows, cols]"
                        + (" with an even row count (w1 rows then w3 rows)" if kind == "gate_up_proj" else ""))
        return {}
    E, rows = shape[0], shape[1]
    out = {}
    for e in range(E):
        if kind == "gate_up_proj":
            h = rows // 2
            out[f"{prefix}.{e}.w1.{leaf}"] = Entry(f, k, dt, (h, shape[2]), (e, 0, h))
            out[f"{prefix}.{e}.w3.{leaf}"] = Entry(f, k, dt, (h, shape[2]), (e, h, rows))
        else:
            out[f"{prefix}.{e}.w2.{leaf}"] = Entry(f, k, dt, (rows, shape[2]), (e, 0, rows))
    return out


def read_config(path: str | os.PathLike, **overrides: Any) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (official or transformers form of config.json)."""
    return ModelConfig.from_json(path, **overrides)
