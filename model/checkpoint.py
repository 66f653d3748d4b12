"""Checkpoint I/O: load a DeepSeek-V4 checkpoint directory as released, and write one.

Loading (`load_checkpoint`, `load_into`) reads `config.json` plus `model.safetensors` or
`model.safetensors.index.json` + shards, in any of three naming schemes, all mapped onto the one
canonical scheme (the official release names, spec §4.2):
  * official: `layers.{i}.attn.wq_a.weight`, per-expert `layers.{i}.ffn.experts.{e}.w1.weight`, ...;
  * transformers (`deepseek_v4`, spec §4.5): `model.layers.{i}.self_attn.q_a_proj.weight`, stacked
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
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from .config import PRESETS, ConfigError, ModelConfig
from .formats import (
    E4M3FN,
    FP8_BLOCK,
    MXFP4_BLOCK,
    dequant_fp8_block,
    dequant_mxfp4,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode,
    fp8_encode,
    pack_e2m1,
)
from .model import Transformer, init_random

__all__ = [
    "CheckpointError",
    "Checkpoint",
    "open_checkpoint",
    "read_config",
    "load_checkpoint",
    "load_into",
    "write_checkpoint",
    "canonical_name",
    "transformers_name",
    "transformers_config_dict",
    "quantize_fp8_block",
    "quantize_mxfp4",
    "checkpoint_make_main",
]

# The embedded default model (trained by model/train.py, official layout): what `dsv4 export` and
# `dsv4 eager` use when given no checkpoint. Its held-out text is eval.txt beside the weights.
EMBEDDED_CHECKPOINT = Path(__file__).resolve().parent / "assets" / "small"
EMBEDDED_PROMPT = "The list data type has some more methods."  # the fixed prompt of `make run`

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 4 << 30
_ROW_CHUNK = 1024  # rows dequantized at a time (a multiple of 128): bounds the float32 temporaries
_CHECK_ELEMS = 1 << 24  # elements per value-check chunk

_FLOAT_ST = {"BF16", "F16", "F32", "F64"}
_INT_ST = {"I64", "I32"}
_PACKED_ST = {"I8", "U8"}
_ST_OF_TORCH = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0",
}


class CheckpointError(ValueError):
    """Everything wrong with a checkpoint, in one error. `problems` lists each one ("kind: detail")."""

    def __init__(self, where: str | os.PathLike, problems: Sequence[str]):
        self.where = str(where)
        self.problems = list(problems)
        super().__init__(_format_problems(self.where, self.problems))


def _format_problems(where: str, problems: list[str], limit: int = 60) -> str:
    lines = [f"checkpoint {where}: {len(problems)} problem(s)"]
    lines += [f"  {p}" for p in problems[:limit]]
    if len(problems) > limit:
        # the rest as counts per kind and name pattern (digits folded), so the message stays readable
        rest: dict[str, int] = {}
        for p in problems[limit:]:
            key = re.sub(r"\d+", "#", p.split(" (")[0])
            rest[key] = rest.get(key, 0) + 1
        lines.append(f"  ... and {len(problems) - limit} more (all in CheckpointError.problems):")
        lines += [f"    {k}  x{n}" for k, n in sorted(rest.items())]
    return "\n".join(lines)


# =============================================================================================
# names


def _rules(pairs: Sequence[tuple[str, str]]) -> list[tuple[re.Pattern, str]]:
    return [(re.compile(p), r) for p, r in pairs]


# transformers / save_pretrained names -> official names; every rule leaves official names alone
_CANON_RULES = _rules([
    (r"^model\.", ""),
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.norm\.", ".attn.kv_norm."),  # save_pretrained's reverse of `.norm.` -> `.kv_norm.`
    (r"\.ffn\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.weight_scale_inv$", ".scale"),
])
_HF_STACKED = re.compile(r"^(.*\.ffn\.experts)\.(gate_up_proj|down_proj)(_scale_inv)?$")

# official names -> transformers names (backbone only: transformers has no MTP, whose tensors keep
# their official names, which transformers ignores on load)
_HF_RULES = _rules([
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.", "model.layers."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.attn_sink$", ".attn.sinks"),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.(compressor|indexer)\.wkv\.", r".\1.kv_proj."),
    (r"\.(compressor|indexer)\.wgate\.", r".\1.gate_proj."),
    (r"\.(compressor|indexer)\.norm\.", r".\1.kv_norm."),
    (r"\.(compressor|indexer)\.ape$", r".\1.position_bias"),
    (r"\.attn\.wq_a\.", ".attn.q_a_proj."),
    (r"\.attn\.q_norm\.", ".attn.q_a_norm."),
    (r"\.attn\.wq_b\.", ".attn.q_b_proj."),
    (r"\.attn\.wkv\.", ".attn.kv_proj."),
    (r"\.attn\.wo_a\.", ".attn.o_a_proj."),
    (r"\.attn\.wo_b\.", ".attn.o_b_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.gate\.bias$", ".ffn.gate.e_score_correction_bias"),
    (r"\.ffn\.shared_experts\.w1\.", ".ffn.shared_experts.gate_proj."),
    (r"\.ffn\.shared_experts\.w2\.", ".ffn.shared_experts.down_proj."),
    (r"\.ffn\.shared_experts\.w3\.", ".ffn.shared_experts.up_proj."),
    (r"\.ffn\.", ".mlp."),
    (r"(?<!_hc)\.scale$", ".weight_scale_inv"),  # linear scales, not the mHC attn_hc/ffn_hc.scale
])


def canonical_name(key: str) -> str:
    """The official name of a checkpoint tensor given in any supported naming (see module doc).

    Stacked transformers experts (`...experts.gate_up_proj`) have no single official name; they come
    back as `layers.{i}.ffn.experts.gate_up_proj` etc. and are split per expert by the reader."""
    for pat, rep in _CANON_RULES:
        key = pat.sub(rep, key)
    return key


def transformers_name(name: str) -> str:
    """The transformers (`deepseek_v4`) name of an official tensor name; MTP names are unchanged."""
    if name.startswith("mtp."):
        return name
    for pat, rep in _HF_RULES:
        name = pat.sub(rep, name)
    return name


# =============================================================================================
# reading: the checkpoint's inventory


@dataclass(frozen=True)
class _Entry:
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
    entries: dict[str, _Entry]  # canonical name -> where it is
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

    entries: dict[str, _Entry] = {}
    renamed = 0
    for k, (f, dt, shape) in raw.items():
        canon = canonical_name(k)
        renamed += canon != k
        m = _HF_STACKED.match(canon)
        if m is None:
            new = {canon: _Entry(f, k, dt, shape)}
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
                   problems: list[str]) -> dict[str, _Entry]:
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
            out[f"{prefix}.{e}.w1.{leaf}"] = _Entry(f, k, dt, (h, shape[2]), (e, 0, h))
            out[f"{prefix}.{e}.w3.{leaf}"] = _Entry(f, k, dt, (h, shape[2]), (e, h, rows))
        else:
            out[f"{prefix}.{e}.w2.{leaf}"] = _Entry(f, k, dt, (rows, shape[2]), (e, 0, rows))
    return out


def read_config(path: str | os.PathLike, **overrides: Any) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (official or transformers form of config.json)."""
    return ModelConfig.from_json(path, **overrides)


# =============================================================================================
# reading: the plan (what goes where), checked before any data is read

_EXPERTS = re.compile(r"^(.*\.ffn\.experts)\.(w[123])(_scale)?$")
_FP8_DT = {torch.float8_e4m3fn}


@dataclass
class _Op:
    """Fill one model tensor (or an expert's slice of one) from checkpoint entries."""

    sources: list[tuple[str, _Entry]]  # (canonical name, entry)
    run: Callable[[list[torch.Tensor]], None]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for _, e in self.sources)


class _Planner:
    def __init__(self, entries: dict[str, _Entry], check_values: bool, n_experts: int):
        self.entries = entries
        self.check = check_values
        self.n_experts = n_experts
        self.ops: list[_Op] = []
        self.problems: list[str] = []
        self.value_problems: list[str] = []
        self.used: set[str] = set()

    # ---- helpers -------------------------------------------------------------------------
    def _get(self, name: str, want: str) -> _Entry | None:
        e = self.entries.get(name)
        if e is None:
            self.problems.append(f"missing: {name} (model expects {want})")
        else:
            self.used.add(name)
        return e

    def _shape(self, name: str, e: _Entry, shape: Sequence[int]) -> bool:
        if tuple(e.shape) != tuple(shape):
            self.problems.append(f"shape: {name} is {e.describe()}, model expects {list(shape)}")
            return False
        return True

    def _dtype(self, name: str, e: _Entry, allowed: set[str], what: str) -> bool:
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
    def plain(self, name: str, target: torch.Tensor) -> None:
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

        def run(ts: list[torch.Tensor]) -> None:
            (t,) = ts
            if target.dtype.is_floating_point:
                self._check_float(name, t)
            elif is_tid and self.check and self._count(t, lambda x: (x < 0) | (x >= self.n_experts)):
                self._bad(name, f"has expert ids outside [0, {self.n_experts})")
            target.copy_(t)

        self.ops.append(_Op([(name, e)], run))

    def weight(self, name: str, target: torch.Tensor, target_scale: torch.Tensor | None) -> None:
        """A linear / expert weight `X.weight` with its `X.scale` (if the checkpoint or model has one)."""
        sname = name[: -len("weight")] + "scale"
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

            def run(ts: list[torch.Tensor]) -> None:
                w, sc = ts
                if fmt == "fp8":
                    self._check_fp8(name, w)
                    target.copy_(w)
                else:
                    target.copy_(w.view(torch.uint8))
                self._copy_scale(sname, sc, target_scale)

            self.ops.append(_Op([(name, e), (sname, s)], run))
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
                self.ops.append(_Op([(name, e), (sname, s)],
                                    lambda ts: self._dequant(name, sname, ts, target, "fp8")))
        elif e.dtype in _PACKED_ST:
            ok = self._shape(name, e, (n, k // 2)) & self._shape(sname, s, (n, k // MXFP4_BLOCK))
            ok &= self._dtype(sname, s, {"F8_E8M0"}, "MXFP4 E8M0 scales")
            if ok:
                self.ops.append(_Op([(name, e), (sname, s)],
                                    lambda ts: self._dequant(name, sname, ts, target, "mxfp4")))
        else:
            self._dtype(name, e, {"F8_E4M3", "I8", "U8"}, "a quantized weight (it has a scale)")

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


def _plan(model: nn.Module, entries: dict[str, _Entry], n_experts: int, check_values: bool,
          ignore: Callable[[str], bool]) -> _Planner:
    plan = _Planner(entries, check_values, n_experts)
    targets = model.state_dict()
    for name, t in targets.items():
        m = _EXPERTS.match(name)
        if m:
            if m.group(3):
                continue  # handled with its weight
            prefix, w = m.group(1), m.group(2)
            ts = targets.get(f"{name}_scale")
            for e in range(t.shape[0]):
                plan.weight(f"{prefix}.{e}.{w}.weight", t[e], None if ts is None else ts[e])
        elif name.endswith(".scale") and name[:-6] + ".weight" in targets:
            continue  # handled with its weight
        elif name.endswith(".weight") and t.dim() == 2:
            plan.weight(name, t, targets.get(name[:-7] + ".scale"))
        else:
            plan.plain(name, t)
    for name in entries:
        if name not in plan.used and not ignore(name):
            plan.problems.append(f"extra: {name} ({entries[name].describe()} in {entries[name].file}) "
                                 "has no place in the model")
    return plan


class _Shards:
    """Open shards on first use, close each when its last pending tensor has been copied."""

    def __init__(self, root: Path, ops: list[_Op]):
        self.root = root
        self.pending: dict[str, int] = {}
        for op in ops:
            for f in {e.file for _, e in op.sources}:
                self.pending[f] = self.pending.get(f, 0) + 1
        self.open: dict[str, Any] = {}

    def tensor(self, e: _Entry) -> torch.Tensor:
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

    def done(self, op: _Op) -> None:
        for f in {e.file for _, e in op.sources}:
            self.pending[f] -= 1
            if self.pending[f] == 0 and f in self.open:
                self.open.pop(f).__exit__(None, None, None)

    def close(self) -> None:
        for h in self.open.values():
            h.__exit__(None, None, None)
        self.open.clear()


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
    n_mtp = len(getattr(model, "mtp", ()))

    def ignore(name: str) -> bool:
        m = re.match(r"^mtp\.(\d+)\.(.*)$", name)
        if m is None:
            return False
        # convert.py drops these if present: MTP shares the model's embed and head (spec §2.10)
        return m.group(2) in ("embed.weight", "head.weight") or (skip_mtp and int(m.group(1)) >= n_mtp)

    plan = _plan(model, ckpt.entries, model.cfg.n_routed_experts, check_values, ignore)
    if plan.problems:
        raise CheckpointError(ckpt.path, plan.problems)
    order = {f: i for i, f in enumerate(ckpt.files)}
    ops = sorted(plan.ops, key=lambda op: min(order[e.file] for _, e in op.sources))
    shards = _Shards(ckpt.path, ops)
    bar = tqdm(total=sum(op.nbytes for op in ops), unit="B", unit_scale=True, desc=f"loading {ckpt.path.name}",
               disable=None if progress is None else not progress, leave=False)
    try:
        for op in ops:
            op.run([shards.tensor(e) for _, e in op.sources])
            shards.done(op)
            bar.update(op.nbytes)
    finally:
        shards.close()
        bar.close()
    if plan.value_problems:
        raise CheckpointError(ckpt.path, plan.value_problems)


# =============================================================================================
# reading: the front door


def _storage_formats(ckpt: Checkpoint) -> tuple[str | None, str | None, str | None]:
    """(linear format, scale format, expert format) as stored, probed on the first layer."""
    def first(pattern: str) -> _Entry | None:
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


@contextlib.contextmanager
def _no_param_init() -> Iterator[None]:
    """Skip torch's random init while building a model whose every tensor is about to be loaded
    (nn.Embedding / nn.Linear would otherwise fill vocab-sized tables for nothing)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def load_checkpoint(path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16, quantized: bool | None = None,
                    mtp: bool | None = None, overrides: dict[str, Any] | None = None, check_values: bool = True,
                    progress: bool | None = None) -> Transformer:
    """Build a Transformer from a checkpoint directory and load its weights.

    quantized: None keeps the stored formats (FP8 linears / MXFP4 or FP8 experts stay low-bit, float
    checkpoints give a float model); False dequantizes everything into a float model of `dtype`
    (a reference); True is None but insists that something is quantized.
    mtp: None keeps MTP blocks if the checkpoint has them and drops them (with a warning) if it has
    none, as a transformers save does; False drops them; True requires them.
    overrides: ModelConfig fields that are ours, not the checkpoint's (max_seq_len, quant_sim, ...).
    """
    ckpt = open_checkpoint(path)
    try:
        cfg = ModelConfig.from_dict(ckpt.config, **(overrides or {}))
    except ConfigError as e:
        raise CheckpointError(ckpt.path, [f"config: {e}"]) from None
    if cfg.n_mtp and (mtp is False or (mtp is None and not ckpt.has_mtp())):
        if mtp is None:
            warnings.warn(f"{ckpt.path}: config has {cfg.n_mtp} MTP block(s) but the checkpoint has no mtp.* "
                          "tensors (a transformers save); loading the model without MTP", stacklevel=2)
        cfg = cfg.replace(num_nextn_predict_layers=0, compress_ratios=cfg.compress_ratios[:cfg.n_layers])
    lin, scale_fmt, exp = _storage_formats(ckpt)
    if quantized is False:
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
        cfg = cfg.replace(quantization_config=qc, expert_dtype=exp)
        model_quantized = bool(lin or exp)
    with _no_param_init():
        model = Transformer(cfg, dtype=dtype, quantized=model_quantized)
    load_into(model, ckpt, check_values=check_values, progress=progress, skip_mtp=cfg.n_mtp == 0)
    return model.eval()


# =============================================================================================
# writing: quantizers


def _pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes of the smallest power of two >= x (x floored at 2^-127, E8M0's smallest)."""
    return e8m0_encode(x.double().clamp_min(2.0 ** -127), round_up=True)


def quantize_fp8_block(w: torch.Tensor, scale_fmt: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """Float [N, K] -> (float8_e4m3fn [N, K], scales [ceil(N/128), ceil(K/128)]).

    ue8m0: scale = smallest power of two >= amax/448 per 128x128 block (uint8 E8M0 bytes), so w/scale
    is exact and only the e4m3 rounding (RNE) loses bits. fp32 (-Base style): scale = amax/448."""
    n, k = w.shape
    wf = w.float()
    nb, kb = math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)
    padded = F.pad(wf.abs(), (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    amax = padded.view(nb, FP8_BLOCK, kb, FP8_BLOCK).amax((1, 3))
    if scale_fmt == "fp32":
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        sf = scale
    elif scale_fmt == "ue8m0":
        scale = _pow2_at_least(amax.double() / 448.0)
        sf = e8m0_decode(scale)
    else:
        raise ValueError(f"unknown scale_fmt {scale_fmt!r}")
    full = sf.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return fp8_encode(wf / full, E4M3FN), scale


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [N, K] -> (packed uint8 [N, K/2], low nibble = element 2i; E8M0 uint8 [N, K/32]) with
    scale = smallest power of two >= amax/6 per 32 consecutive K elements."""
    n, k = w.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"quantize_mxfp4: K={k} is not a multiple of {MXFP4_BLOCK}")
    wf = w.float().view(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    scale = _pow2_at_least(wf.abs().amax(-1).double() / 6.0)
    codes = e2m1_encode(wf / e8m0_decode(scale)[..., None])
    return pack_e2m1(codes.view(n, k)), scale


# =============================================================================================
# writing: what the official checkpoint holds for each model tensor

_FP8_LINEAR = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
                         r"|e_proj|h_proj)\.weight$")
_BF16 = re.compile(r"^(embed|head)\.weight$|norm\.weight$|\.compressor\.(wkv|wgate)\.weight$"
                   r"|\.indexer\.weights_proj\.weight$|\.ffn\.gate\.weight$")
_F32 = re.compile(r"(^|\.)(hc_(attn|ffn|head)_(fn|base|scale)|attn_sink|ape|bias)$")
_I64 = re.compile(r"\.ffn\.gate\.tid2eid$")


@dataclass
class _Out:
    """One tensor to write: name, dtype and shape known up front (for sharding), data made on demand."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _source_format(w: torch.Tensor, s: torch.Tensor | None) -> tuple[str, str | None]:
    if w.dtype == torch.float8_e4m3fn:
        return "fp8", "fp32" if s is not None and s.dtype == torch.float32 else "ue8m0"
    if w.dtype in (torch.uint8, torch.int8):
        return "fp4", "ue8m0"
    return "float", None


def _dequantize(w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    fmt, _ = _source_format(w, s)
    if fmt == "fp8":
        return dequant_fp8_block(w, s)
    if fmt == "fp4":
        return dequant_mxfp4(w.view(torch.uint8), s)
    return w.float()


def _as_e8m0(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.uint8).view(torch.float8_e8m0fnu)


class _Encoded:
    """A weight's encoded (weight, scale) pair, made once for its two tensors and dropped after both
    were taken, so a write holds at most a shard's worth of encoded tensors."""

    def __init__(self, make: Callable[[], tuple[torch.Tensor, torch.Tensor | None]], parts: int):
        self._make, self._parts, self._value, self._taken = make, parts, None, 0

    def part(self, i: int) -> torch.Tensor:
        if self._value is None:
            self._value = self._make()
        out = self._value[i]
        self._taken += 1
        if self._taken == self._parts:
            self._value = None
        return out


def _weight_outs(name: str, w: torch.Tensor, s: torch.Tensor | None, fmt: str,
                 scale_fmt: str) -> list[_Out]:
    """Checkpoint tensors for one weight in target format fmt ('fp8', 'fp4' or 'bf16')."""
    src = _source_format(w, s)
    n, k = w.shape[0], (w.shape[1] * 2 if src[0] == "fp4" else w.shape[1])
    sname = name[: -len("weight")] + "scale"
    target = {"fp8": ("fp8", scale_fmt), "fp4": ("fp4", "ue8m0"), "bf16": ("float", None)}[fmt]

    def encode() -> tuple[torch.Tensor, torch.Tensor | None]:
        if src == target and fmt != "bf16":  # already in the checkpoint format: byte for byte
            return w, s
        v = _dequantize(w, s)
        if fmt == "fp8":
            return quantize_fp8_block(v, scale_fmt)
        if fmt == "fp4":
            return quantize_mxfp4(v)
        return v.to(torch.bfloat16), None

    if fmt == "bf16":
        enc = _Encoded(encode, 1)
        return [_Out(name, torch.bfloat16, (n, k), lambda: enc.part(0))]
    enc = _Encoded(encode, 2)
    if fmt == "fp8":
        sshape = (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
        sdt = torch.float32 if scale_fmt == "fp32" else torch.float8_e8m0fnu
        return [_Out(name, E4M3FN, (n, k), lambda: enc.part(0)),
                _Out(sname, sdt, sshape, lambda: enc.part(1) if sdt == torch.float32 else _as_e8m0(enc.part(1)))]
    return [_Out(name, torch.int8, (n, k // 2), lambda: enc.part(0).view(torch.int8)),
            _Out(sname, torch.float8_e8m0fnu, (n, k // MXFP4_BLOCK), lambda: _as_e8m0(enc.part(1)))]


def _official_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> list[_Out]:
    """The official checkpoint inventory for a model state dict, in the model's order."""
    lin_fmt = "fp8" if cfg.quantization_config else "bf16"
    scale_fmt = (cfg.quantization_config or {}).get("scale_fmt") or "ue8m0"
    exp_fmt = cfg.expert_dtype if cfg.expert_dtype in ("fp4", "fp8") else "bf16"
    outs: list[_Out] = []
    unknown = []
    for name, t in state.items():
        m = _EXPERTS.match(name)
        if m:
            if m.group(3):
                continue
            prefix, w = m.group(1), m.group(2)
            sc = state.get(f"{name}_scale")
            for e in range(t.shape[0]):
                outs += _weight_outs(f"{prefix}.{e}.{w}.weight", t[e], None if sc is None else sc[e],
                                     exp_fmt, scale_fmt)
        elif name.endswith(".scale") and name[:-6] + ".weight" in state:
            continue
        elif _FP8_LINEAR.search(name):
            outs += _weight_outs(name, t, state.get(name[:-7] + ".scale"), lin_fmt, scale_fmt)
        elif _BF16.search(name):
            if t.dtype in (torch.float8_e4m3fn, torch.uint8):
                unknown.append(f"{name} ({t.dtype}: expected a float tensor)")
            outs.append(_Out(name, torch.bfloat16, tuple(t.shape), lambda t=t: t.to(torch.bfloat16)))
        elif _F32.search(name):
            outs.append(_Out(name, torch.float32, tuple(t.shape), lambda t=t: t.to(torch.float32)))
        elif _I64.search(name):
            outs.append(_Out(name, torch.int64, tuple(t.shape), lambda t=t: t.to(torch.int64)))
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"write_checkpoint: no checkpoint format is known for {unknown}")
    return outs


def _transformers_tensors(outs: list[_Out]) -> list[_Out]:
    """Rename to the transformers layout and stack the routed experts (gate_up = cat(w1, w3))."""
    by_name = {o.name: o for o in outs}
    result: list[_Out] = []
    done: set[str] = set()
    rx = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")
    n_experts: dict[str, int] = {}
    for o in outs:
        m = rx.match(o.name)
        if m:
            n_experts[m.group(1)] = max(n_experts.get(m.group(1), 0), int(m.group(2)) + 1)
    for o in outs:
        m = rx.match(o.name)
        if m is None:
            result.append(_Out(transformers_name(o.name), o.dtype, o.shape, o.make))
            continue
        prefix, leaf = m.group(1), m.group(4)
        for kind, parts in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
            key = f"{prefix}.{kind}.{leaf}"
            if m.group(3) not in parts or key in done:
                continue
            done.add(key)
            E = n_experts[prefix]
            members = [[by_name[f"{prefix}.{e}.{p}.{leaf}"] for p in parts] for e in range(E)]
            rows = sum(x.shape[0] for x in members[0])

            def make(members: list[list[_Out]] = members) -> torch.Tensor:
                return torch.stack([torch.cat([x.make() for x in row], 0) for row in members])

            base = transformers_name(f"{prefix}.{kind}")
            name = base if leaf == "weight" else f"{base}_scale_inv"
            result.append(_Out(name, o.dtype, (E, rows, o.shape[1]), make))
    return result


def transformers_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """config.json in the form transformers' DeepseekV4Config writes (layer_types, compress_rates,
    mlp_layer_types, rope_parameters; expert_dtype inside quantization_config). ModelConfig.from_dict
    reads it back to the same config."""
    n = cfg.n_layers
    ratios = cfg.compress_ratios[:n]
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise ConfigError(f"compress_ratios {list(ratios)}: transformers has one HCA rate, got {hca}")
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0] if hca else 128}
    kind = {0: "sliding_attention", 4: "compressed_sparse_attention"}
    prf = cfg.qk_rope_head_dim / cfg.head_dim
    compress: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta,
                                "partial_rotary_factor": prf}
    if cfg.rope_scaling:
        rs = cfg.rope_scaling
        compress.update(rope_type="yarn", factor=rs["factor"],
                        original_max_position_embeddings=rs["original_max_position_embeddings"],
                        beta_fast=rs.get("beta_fast", 32), beta_slow=rs.get("beta_slow", 1),
                        attention_factor=1.0)  # the reference applies no YaRN mscale (spec §2.2)
    d = cfg.to_dict()
    for k in ("compress_ratios", "num_hash_layers", "rope_scaling", "expert_dtype", "quantization_config"):
        d.pop(k)
    d.update(
        layer_types=[kind.get(r, "heavily_compressed_attention") for r in ratios],
        compress_rates=rates,
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(n)],
        partial_rotary_factor=prf,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": prf},
                         "compress": compress},
    )
    if cfg.quantization_config:
        d["quantization_config"] = {**cfg.quantization_config, "expert_dtype": cfg.expert_dtype}
    elif cfg.expert_dtype in ("fp4", "fp8"):
        d["expert_dtype"] = cfg.expert_dtype
    return d


@functools.lru_cache(maxsize=4)
def _default_tokenizer(vocab_size: int):
    from .corpus import build_corpus
    from .tokenizer import train_tokenizer

    return train_tokenizer(build_corpus().train_docs, vocab_size=vocab_size)


def _write_tokenizer(tokenizer: Any, out: Path, cfg: ModelConfig) -> None:
    from .tokenizer import RECOMMENDED_VOCAB_SIZE, SPECIAL_TOKENS, save_tokenizer

    if tokenizer is False:
        return
    if isinstance(tokenizer, (str, os.PathLike)):
        src = Path(tokenizer)
        files = [src] if src.is_file() else [p for p in src.iterdir() if p.name.startswith("tokenizer")
                                              or p.name == "special_tokens_map.json"]
        if not files:
            raise FileNotFoundError(f"no tokenizer files in {src}")
        for p in files:
            shutil.copyfile(p, out / p.name)
        return
    if tokenizer is None:
        vocab = min(cfg.vocab_size, RECOMMENDED_VOCAB_SIZE)
        if vocab < 256 + len(SPECIAL_TOKENS):
            warnings.warn(f"vocab_size {cfg.vocab_size} is too small for a byte-level tokenizer; none written",
                          stacklevel=3)
            return
        tokenizer = _default_tokenizer(vocab)
    save_tokenizer(tokenizer, out, model_max_length=cfg.max_seq_len)


def write_checkpoint(model_or_state: nn.Module | dict[str, torch.Tensor], cfg: ModelConfig,
                     directory: str | os.PathLike, layout: str = "official", *,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer: Any = None,
                     overwrite: bool = False, progress: bool | None = None) -> Path:
    """Write a checkpoint directory in the official (or transformers) layout and dtypes.

    The target formats come from `cfg`: FP8 linears if cfg.quantization_config (E8M0 scales, or
    float32 with scale_fmt 'fp32'), experts as cfg.expert_dtype ('fp4' MXFP4, 'fp8', else bf16).
    Float weights are quantized; weights already in the target format are copied byte for byte.
    More than `max_shard_bytes` in all gives `model-0000i-of-0000n.safetensors` shards plus
    `model.safetensors.index.json`. tokenizer: None trains the small corpus tokenizer, a path copies
    tokenizer files from there, a `tokenizers.Tokenizer` is saved, False writes none.
    """
    if layout not in ("official", "transformers"):
        raise ValueError(f"layout must be 'official' or 'transformers', got {layout!r}")
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else dict(model_or_state)
    outs = _official_tensors(state, cfg)
    if layout == "transformers":
        outs = _transformers_tensors(outs)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    old = [p for p in out.iterdir() if p.name.endswith(".safetensors") or p.name == INDEX_FILE]
    if old and not overwrite:
        raise FileExistsError(f"{out} already holds a checkpoint ({old[0].name}); pass overwrite=True")
    for p in old:
        p.unlink()

    shards: list[list[_Out]] = [[]]
    size = 0
    for o in outs:
        if shards[-1] and size + o.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(o)
        size += o.nbytes
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = sum(o.nbytes for o in outs)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}",
               disable=None if progress is None else not progress, leave=False)
    weight_map = {}
    for fname, shard in zip(names, shards):
        tensors = {}
        for o in shard:
            t = o.make().contiguous()
            if t.dtype != o.dtype or tuple(t.shape) != o.shape:
                raise AssertionError(f"{o.name}: made {t.dtype} {tuple(t.shape)}, planned {o.dtype} {o.shape}")
            tensors[o.name] = t
            weight_map[o.name] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        bar.update(sum(o.nbytes for o in shard))
        del tensors
    bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    config = cfg.to_dict() if layout == "official" else transformers_config_dict(cfg)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": True,
           "temperature": 1.0, "top_p": 1.0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    _write_tokenizer(tokenizer, out, cfg)
    return out


# =============================================================================================
# CLI


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500MB, 4GB)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def checkpoint_make_main(argv: Sequence[str] | None = None) -> int:
    """`dsv4 checkpoint make`: write a random checkpoint in the released format (tests, defaults)."""
    ap = argparse.ArgumentParser(prog="dsv4 checkpoint make",
                                 description="Write a randomly initialized DeepSeek-V4 checkpoint directory in the "
                                             "released format (config.json, safetensors, tokenizer).")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size (default tiny)")
    ap.add_argument("--seed", type=int, default=0, help="random init seed")
    ap.add_argument("-o", "--output", required=True, help="output directory")
    ap.add_argument("--layout", choices=("official", "transformers"), default="official")
    ap.add_argument("--expert-dtype", choices=("fp4", "fp8", "bf16"), default=None,
                    help="routed expert format (default: the preset's, fp4)")
    ap.add_argument("--scale-fmt", choices=("ue8m0", "fp32"), default="ue8m0",
                    help="FP8 block scale format (fp32 = -Base style)")
    ap.add_argument("--unquantized", action="store_true", help="bf16 linears and experts, no quantization_config")
    ap.add_argument("--std", type=float, default=0.02, help="init std of the float weights")
    ap.add_argument("--max-shard-size", type=_bytes, default=DEFAULT_MAX_SHARD_BYTES, help="e.g. 500MB, 4GB")
    ap.add_argument("--force", action="store_true", help="replace a checkpoint already in the output directory")
    args = ap.parse_args(argv)

    cfg = ModelConfig.preset(args.preset)
    if args.unquantized:
        cfg = cfg.replace(quantization_config=None, expert_dtype=None)
    else:
        qc = {**(cfg.quantization_config or {}), "scale_fmt": args.scale_fmt}
        cfg = cfg.replace(quantization_config=qc, expert_dtype=args.expert_dtype or cfg.expert_dtype)
    if cfg.expert_dtype == "bf16":
        cfg = cfg.replace(expert_dtype=None)
    model = init_random(Transformer(cfg, dtype=torch.float32), seed=args.seed, std=args.std)
    out = write_checkpoint(model, cfg, args.output, args.layout, max_shard_bytes=args.max_shard_size,
                           overwrite=args.force)
    n = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {out} ({args.preset}, {args.layout} layout, {n / 2**20:.1f} MiB of safetensors)")
    return 0
