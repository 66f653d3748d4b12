"""The export directory's contract, written by the exporter and read by the engine (torch-free).

An export directory holds::

    config.json               this contract (FORMAT/VERSION, model config, state, entry points, targets)
    model-00001-of-0000N.irpa the weights, in shards (IREE parameter archives, scope PARAM_SCOPE)
    model.<target>.vmfb       one compiled module per target (gfx942, llvm-cpu, cuda)
    model.fnuz-0000i-of-0000N.irpa   (only when FP8 weights need a second flavour for gfx942)
    tokenizer.json [+ tokenizer_config.json]   (checkpoints that have one)

Entry points (all integers int64; the state tensors follow as arguments in ``state`` order and are
updated in place): ``prefill_bs{N}``/``decode_bs{N}`` -> (logits f32[N,V], argmax i64[N], -1 where a row's
logits are not all finite);
``score_bs1`` -> logprobs f32[1,T]; ``sample_bs{N}(logits, temperature, top_k, top_p, key)`` -> ids
i64[N] (one-device exports: the token choice on the device); ``export_id()`` -> the bytes of config.json's ``export_id``.
With MTP speculative decoding (``dsv4 export --draft-tokens K``; config.json ``speculative``:
{"method": "mtp", "draft_tokens": K, "prefill_batch_sizes", "verify_batch_sizes"}):
``mtp_prefill_bs{N}(tokens[N,T], start_pos, lengths, slots, next_tokens[N], temperature f32[N],
top_k[N], top_p f32[N], key[N], *state)`` -> (logits f32[N,V], argmax i64[N] (the chosen token: argmax,
or sampled where temperature > 0), drafts i64[N,K]) and ``verify_bs{N}_k{K}(tokens[N,1+K], start_pos,
lengths, slots, temperature, top_k, top_p, key, *state)`` -> (logits f32[N,1+K,V], chosen i64[N,1+K],
accepted i64[N], drafts i64[N,K]) (model/speculative.py; docs/runtime.md, Speculative decoding).

Weights (fields of config.json; `contract/weights.py` reads and writes the files)::

    "parameters": ["model-00001-of-00002.irpa", "model-00002-of-00002.irpa"]
    "weights": {"tensors": [["model.embed.weight", [129280, 4096], "bfloat16"], ...],
                "shard_bytes": 2147483648}
    "targets": {"gfx942": {"vmfb": ..., "parameters": ["model.fnuz-00001-of-00002.irpa", ...],
                           "fp8_dtype": "float8_e4m3fnuz"}, "llvm-cpu": {"vmfb": ...}}

* ``parameters``: the weight files every target reads unless it names its own (a list; the old
  form, one file name as a string, still loads). Names follow ``<prefix>-<i>-of-<n>.irpa`` (5
  digits, from 1); the files together hold each parameter exactly once, in any split.
* ``weights.tensors``: the inventory of those files: every parameter under its key in the vmfb
  (PARAM_PREFIX + the Transformer's state-dict name), its shape and dtype (a DTYPES name:
  bfloat16, float32, float8_e4m3fn, float8_e4m3fnuz, uint8, int64, ...); the bytes are the
  row-major array in the dtype's storage type. ``shard_bytes``: the shard size the files were
  (or are to be) cut at. Optional (exports made before it have none): without it a config loads,
  but the weights cannot be checked or generated (`dsv4 weights random` needs it).
* a weight *flavour* per file group: a target that needs other FP8 bytes (gfx942 reads
  e4m3fnuz) has its own ``parameters`` and ``fp8_dtype``; its tensors are ``weights.tensors``
  with every FP8 dtype replaced by ``fp8_dtype``, holding the same values (same bits, block scale
  x2 or /2: formats.fp8_fn_to_fnuz). `ExportConfig.weight_groups()` lists the groups.
* ``devices`` (only in a multi-device export, `dsv4 export --devices N`): {"count": N, the shares
  per device, "layout": what is split how (export/sharding.py)}. The vmfb then drives N HAL devices
  of its target's driver, opened in order in one context (runtime/module.py); the state lives on
  device 0, the weights are split per device under ``...shards.<d>...`` keys (in the same files).
* ``sha256``: {weight file name: hex digest}, optional; contract/weights.py makes and checks them.
* an export made without weights has config.json and the vmfbs only; `ExportConfig.load` then
  raises one ArtifactError naming the missing file and the command that writes weights
  (`load(..., weights=False)` reads it anyway, for that command).

The exporter builds the dict with `build_config` and writes it with `write_config`; the engine reads
it with `ExportConfig.load`. `staged_export` builds a new export beside the output directory and
moves it into place only when it is complete. `check_vmfb` (and weights.check_irpa) look at a file's
structure before IREE sees it, so a truncated download is named instead of crashing inside the runtime.
The names of the contract (weight files, per-device keys, pipeline stages' state) are defined here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import threading
import uuid
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ArtifactError, EngineError

__all__ = [
    "FORMAT", "VERSION", "PARAM_SCOPE", "PARAM_PREFIX", "TARGET_DRIVERS", "DEVICE_TARGETS", "DTYPES",
    "FP8_DTYPES", "ENTRY_RESULTS", "SAMPLE_ARGS", "MTP_PREFILL_ARGS", "VERIFY_ARGS", "SPEC_SAMPLING_ARGS", "mtp_prefill_name", "verify_name",
    "speculative_functions", "StateSpec", "TensorSpec", "WeightGroup", "ExportConfig", "with_fp8", "target_for_device", "function_abi", "build_config", "write_config",
    "new_export_id", "is_export_dir", "check_out_dir", "staged_export", "check_vmfb",
    "shard_names", "SHARD_SPLITS", "shard_key", "shard_tensors", "shard_inventory", "whole_key", "whole_inventory",
    "stage_state_name", "state_stage",
]

FORMAT = "dsv4-iree-export"
VERSION = 1
PARAM_SCOPE = "model"  # the scope the exporter externalizes parameters under
PARAM_PREFIX = "model."  # parameter keys: the exporter's wrapper module holds the Transformer as `.model`

# compile target -> the IREE driver that runs its vmfb
TARGET_DRIVERS: dict[str, str] = {"gfx942": "hip", "llvm-cpu": "local-task", "cuda": "cuda"}
# device (IREE driver) -> the compile target whose vmfb it runs
DEVICE_TARGETS: dict[str, str] = {"local-task": "llvm-cpu", "local-sync": "llvm-cpu", "cuda": "cuda", "hip": "gfx942"}

# state dtype name -> (numpy storage dtype, HalElementType attribute name); bf16/fp8 are stored as
# same-width integers on the host
DTYPES: dict[str, tuple[str, str]] = {
    "float32": ("float32", "FLOAT_32"),
    "float16": ("float16", "FLOAT_16"),
    "bfloat16": ("uint16", "BFLOAT_16"),
    "float8_e4m3fn": ("uint8", "FLOAT_8_E4M3_FN"),
    "float8_e4m3fnuz": ("uint8", "FLOAT_8_E4M3_FNUZ"),
    "float64": ("float64", "FLOAT_64"),
    "int64": ("int64", "SINT_64"),
    "int32": ("int32", "SINT_32"),
    "int8": ("int8", "SINT_8"),
    "uint8": ("uint8", "UINT_8"),
}
FP8_DTYPES = ("float8_e4m3fn", "float8_e4m3fnuz")
_DTYPE_ALIASES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "fp32": "float32",
                  "fp16": "float16", "i64": "int64", "i32": "int32", "long": "int64",
                  "float": "float32", "half": "float16", "fp8": "float8_e4m3fn"}

STEP_ARGS = ("tokens", "start_pos", "lengths", "slots")
# the speculative entry points sample on the device (the sampled acceptance rule decides the state
# commit inside the call): per row temperature (0: greedy), top_k, top_p and a 32-bit key
SPEC_SAMPLING_ARGS = ("temperature", "top_k", "top_p", "key")
# next_tokens: the token after the chunk, -1 if it ends the prompt
MTP_PREFILL_ARGS = (*STEP_ARGS, "next_tokens", *SPEC_SAMPLING_ARGS)
VERIFY_ARGS = (*STEP_ARGS, *SPEC_SAMPLING_ARGS)
SAMPLE_ARGS = ("logits", "temperature", "top_k", "top_p", "key")  # sample_bs{N}: model/device_sampling.py
ENTRY_RESULTS = {"prefill": ["logits", "argmax"], "decode": ["logits", "argmax"], "score": ["logprobs"],
                 "mtp_prefill": ["logits", "argmax", "drafts"], "verify": ["logits", "chosen", "accepted", "drafts"]}


def mtp_prefill_name(n: int) -> str:
    """The speculative prefill entry point of batch size n."""
    return f"mtp_prefill_bs{n}"


def verify_name(n: int, k: int) -> str:
    """The speculative verify entry point of batch size n with k draft tokens."""
    return f"verify_bs{n}_k{k}"


def _dtype_name(s: str) -> str:
    s = str(s).lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(s, s)


def target_for_device(device: str) -> str:
    """IREE driver name -> compile target; EngineError for a device this runtime does not know."""
    try:
        return DEVICE_TARGETS[device]
    except KeyError:
        raise EngineError(f"unknown device {device!r}; choose one of {', '.join(DEVICE_TARGETS)}") from None


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------

def function_abi(kind: str, state_names: Sequence[str]) -> dict[str, list[str]]:
    """config.json's description of one entry point of `kind` (prefill, decode, score, mtp_prefill, verify)."""
    args = {"mtp_prefill": MTP_PREFILL_ARGS, "verify": VERIFY_ARGS}.get(kind, STEP_ARGS)
    return {"args": [*args, *state_names], "results": list(ENTRY_RESULTS[kind])}


def speculative_functions(draft_tokens: int, prefill_batch_sizes: Sequence[int], verify_batch_sizes: Sequence[int],
                          state_names: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json's ``speculative`` field, its entry points) of an export with MTP speculative decoding."""
    fns = {mtp_prefill_name(n): function_abi("mtp_prefill", state_names) for n in prefill_batch_sizes}
    fns.update({verify_name(n, draft_tokens): function_abi("verify", state_names) for n in verify_batch_sizes})
    return ({"method": "mtp", "draft_tokens": int(draft_tokens), "prefill_batch_sizes": list(prefill_batch_sizes),
             "verify_batch_sizes": list(verify_batch_sizes)}, fns)


def new_export_id() -> str:
    return uuid.uuid4().hex


def build_config(*, model: Mapping[str, Any], activation_dtype: str, n_slots: int, max_seq_len: int,
                 prefill_batch_sizes: Sequence[int], min_tokens: int, max_tokens: int,
                 decode_batch_sizes: Sequence[int], score_batch_sizes: Sequence[int],
                 state: Sequence[Mapping[str, Any]], targets: Mapping[str, Mapping[str, Any]],
                 parameters: str | Sequence[str], tokenizer: str | None, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], export_id: str,
                 extra_functions: Mapping[str, Any] | None = None,
                 weights: Mapping[str, Any] | None = None,
                 devices: Mapping[str, Any] | None = None,
                 sha256: Mapping[str, str] | None = None,
                 lowering: Mapping[str, Any] | None = None,
                 speculative: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config.json dict of an export; `state` is [{"name", "shape", "dtype"}] in argument order,
    `parameters` the weight file names, `weights` {"tensors": [[name, shape, dtype], ...],
    "shard_bytes": N} (see the module docstring; a target's own files go in its `targets` entry),
    `devices` the layout of a multi-device export ({"count": N, ...}; None: one device, no field),
    `sha256` each weight file's digest, `lowering` the lowering plan's inputs (the plan: each target's
    "kernels" and "flags"; the runtime ignores both), `speculative` the MTP speculative entry points'
    description (`speculative_functions`; their functions go in `extra_functions`)."""
    names = [s["name"] for s in state]
    functions: dict[str, Any] = {}
    for kind, sizes in (("prefill", prefill_batch_sizes), ("decode", decode_batch_sizes),
                        ("score", score_batch_sizes)):
        for n in sizes:
            functions[f"{kind}_bs{n}"] = function_abi(kind, names)
    functions.update(extra_functions or {})
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": dict(model),
        "activation_dtype": activation_dtype,
        "n_slots": int(n_slots),
        "max_seq_len": int(max_seq_len),
        "prefill": {"batch_sizes": list(prefill_batch_sizes), "min_tokens": int(min_tokens),
                    "max_tokens": int(max_tokens)},
        "decode": {"batch_sizes": list(decode_batch_sizes)},
        "state": [dict(s) for s in state],
        "functions": functions,
        "targets": {k: dict(v) for k, v in targets.items()},
        "parameters": [parameters] if isinstance(parameters, str) else list(parameters),
        **({"weights": {"tensors": [[str(n), [int(x) for x in shape], str(dt)] for n, shape, dt in weights["tensors"]],
                        "shard_bytes": int(weights["shard_bytes"])}} if weights is not None else {}),
        "tokenizer": tokenizer,
        "bos_token_id": bos_token_id,
        "eos_token_ids": list(eos_token_ids),
        "export_id": export_id,
        **({"devices": dict(devices)} if devices is not None else {}),
        **({"sha256": dict(sorted(sha256.items()))} if sha256 else {}),
        **({"lowering": dict(lowering)} if lowering is not None else {}),
        **({"speculative": dict(speculative)} if speculative is not None else {}),
    }


def write_config(export_dir: str | Path, config: Mapping[str, Any]) -> Path:
    """Validate `config` as the engine would read it, then write export_dir/config.json."""
    d = Path(export_dir)
    ExportConfig.from_dict(dict(config), d)
    path = d / "config.json"
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


def is_export_dir(path: str | Path) -> bool:
    """True when `path` holds a config.json of this format (any version): safe to replace."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_out_dir(out_dir: str | Path, *, force: bool = False) -> None:
    """ValueError when an export must not be written to `out_dir`: it is a file, or a non-empty
    directory that is not a dsv4 export (unless `force`: then its contents will be replaced)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not is_export_dir(out) and not force:
        raise ValueError(f"output directory {out} is not empty and is not a dsv4 export (no config.json of "
                         f"format {FORMAT!r}); choose another -o, or pass --force to replace its contents")


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def staged_export(out_dir: str | Path, *, force: bool = False) -> Iterator[Path]:
    """Yield an empty directory beside `out_dir` to build an export in; when the block succeeds,
    it replaces `out_dir` (files made readable as the umask allows, e.g. 0644); when it raises,
    it is deleted and `out_dir` stays as it was (SIGTERM too). Checks `out_dir` first (`check_out_dir`)."""
    check_out_dir(out_dir, force=force)
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    stage = out.parent / f".{out.name}.building-{tag}"
    stage.mkdir()
    # SIGTERM (kill, a scheduler's timeout) then cleans up like Ctrl-C, where it has its default action
    term = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    prev = signal.signal(signal.SIGTERM, _raise_interrupt) if term else None
    try:
        try:
            yield stage
        finally:
            if prev is not None:
                signal.signal(signal.SIGTERM, prev)
        mask = _umask()
        stage.chmod(0o777 & ~mask)
        for f in stage.iterdir():
            if f.is_file():
                f.chmod(0o666 & ~mask)
        old = out.parent / f".{out.name}.old-{tag}"
        if out.exists():
            out.rename(old)
        try:
            stage.rename(out)
        except OSError:
            if old.exists():
                old.rename(out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# structural check of a vmfb (the .irpa archives: weights.check_irpa)
# --------------------------------------------------------------------------------------------

def check_vmfb(path: str | Path) -> None:
    """Check that `path` is a complete vmfb container (a zip whose members all lie inside the file)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size == 0:
            raise ArtifactError(f"{p}: empty file (re-export or re-download it)")
        with zipfile.ZipFile(p) as z:
            names = z.namelist()
            ends = [i.header_offset + i.compress_size for i in z.infolist()]
    except zipfile.BadZipFile:
        raise ArtifactError(f"{p}: not a complete IREE module (vmfb); truncated or corrupt "
                            "(re-export or re-download it)") from None
    except OSError as e:
        raise ArtifactError(f"{p}: cannot read: {e.strerror or e}") from None
    if "module.fb" not in names or (ends and max(ends) > size):
        raise ArtifactError(f"{p}: not a complete IREE module (vmfb) (re-export or re-download it)")


# --------------------------------------------------------------------------------------------
# names: the weight files, the per-device keys of cut tensors, the pipeline stages' state
# --------------------------------------------------------------------------------------------

def shard_names(prefix: str, n: int) -> list[str]:
    """The weight files of n shards: ``prefix-00001-of-0000n.irpa`` ... (5 digits, from 1)."""
    return [f"{prefix}-{i + 1:05d}-of-{n:05d}.irpa" for i in range(n)]


# (regex on a whole tensor's key, its shard keys with {d}); every cut is along dim 0 in N equal parts
SHARD_SPLITS: tuple[tuple[str, str], ...] = (
    (r"^(.*\.ffn\.experts)\.(w[123](?:_scale)?)$", r"\1.shards.{d}.\2"),
    (r"^(.*\.attn)\.(wq_b\.weight|wq_b\.scale|attn_sink|wo_a\.weight)$", r"\1.head_shards.shards.{d}.\2"),
    (r"^(.*\.embed)\.weight$", r"\1.shards.{d}.weight"),
    (r"^(.*\.head)\.weight$", r"\1.shards.{d}.weight"),
)
_SHARD_OF = re.compile(r"^(.*?)(?:\.head_shards)?\.shards\.(\d+)\.(.+)$")


def shard_key(key: str, n: int) -> list[str] | None:
    """The n per-device keys of a whole tensor's key (`SHARD_SPLITS`), or None when it is not cut."""
    for pat, rep in SHARD_SPLITS:
        if re.match(pat, key):
            return [re.sub(pat, rep.replace("{d}", str(d)), key) for d in range(n)]
    return None


def shard_tensors(tensors: Iterable[tuple[str, Any, str]], n: int) -> Iterator[tuple[str, Any, str]]:
    """A stream of whole tensors (key, array, dtype name) as an n-device export stores them."""
    for key, arr, dt in tensors:
        keys = shard_key(key, n) if n > 1 else None
        if keys is None:
            yield key, arr, dt
            continue
        rows = arr.shape[0] // n
        for d, k in enumerate(keys):
            yield k, arr[d * rows:(d + 1) * rows], dt


def shard_inventory(specs: Sequence["TensorSpec"], n: int) -> list["TensorSpec"]:
    """The inventory of an n-device export, from the whole tensors' (each cut one in place, in order)."""
    out: list[TensorSpec] = []
    for s in specs:
        keys = shard_key(s.name, n) if n > 1 else None
        out += [s] if keys is None else [TensorSpec(k, (s.shape[0] // n, *s.shape[1:]), s.dtype) for k in keys]
    return out


def whole_key(key: str) -> tuple[str, int] | None:
    """(whole tensor's key, device) of a per-device key, or None for a tensor that is not cut."""
    m = _SHARD_OF.match(key)
    return None if m is None else (f"{m.group(1)}.{m.group(3)}", int(m.group(2)))


def stage_state_name(k: int, name: str) -> str:
    """config.json's name of pipeline stage k's state tensor `name` (the stage's module calls it `name`)."""
    return f"stage{k}.{name}"


def state_stage(name: str) -> tuple[int | None, str]:
    """(pipeline stage, the stage module's own name) of a config.json state name; (None, name) for
    a one-module export's tensor."""
    m = re.fullmatch(r"stage(\d+)\.(.+)", name)
    return (None, name) if m is None else (int(m.group(1)), m.group(2))


def whole_inventory(specs: Sequence["TensorSpec"], n: int) -> list["TensorSpec"]:
    """The inventory of whole tensors an n-device inventory was cut from (shard 0 keeps the place)."""
    out: list[TensorSpec] = []
    for s in specs:
        wk = whole_key(s.name) if n > 1 else None
        if wk is None:
            out.append(s)
        elif wk[1] == 0:
            out.append(TensorSpec(wk[0], (s.shape[0] * n, *s.shape[1:]), s.dtype))
    return out


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """One parameter of the inventory (config.json ``weights.tensors``): its key in the vmfb."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # canonical name, a key of DTYPES

    @property
    def nbytes(self) -> int:
        import numpy as np

        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(DTYPES[self.dtype][0]).itemsize

    def to_json(self) -> list:
        return [self.name, list(self.shape), self.dtype]


@dataclass(frozen=True)
class StateSpec(TensorSpec):
    """One state tensor (config.json ``state``): dim 0 is the slot."""


def with_fp8(specs: Sequence[TensorSpec], fp8_dtype: str | None) -> tuple[TensorSpec, ...]:
    """The inventory of a weight flavour: every FP8 dtype replaced by `fp8_dtype` (None: unchanged)."""
    if fp8_dtype is None:
        return tuple(specs)
    return tuple(TensorSpec(s.name, s.shape, fp8_dtype) if s.dtype in FP8_DTYPES else s for s in specs)


@dataclass(frozen=True)
class WeightGroup:
    """Weight files read together by some targets, with their inventory (`ExportConfig.weight_groups`)."""

    files: tuple[Path, ...]
    fp8_dtype: str | None  # the flavour: None = weights.tensors as listed
    specs: tuple[TensorSpec, ...] | None  # None when config.json has no inventory
    targets: tuple[str, ...]


def _need(cond: bool, path: Path, msg: str) -> None:
    if not cond:
        raise ArtifactError(f"{path}: {msg}")


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@dataclass(frozen=True)
class ExportConfig:
    """config.json of an export directory, validated (every failure names the file and field)."""

    directory: Path
    raw: dict
    model: dict
    vocab_size: int
    max_seq_len: int
    n_slots: int
    prefill_batch_sizes: tuple[int, ...]
    prefill_min_tokens: int
    prefill_max_tokens: int
    decode_batch_sizes: tuple[int, ...]
    state: tuple[StateSpec, ...]
    functions: dict
    targets: dict
    parameters: tuple[Path, ...]
    weights: tuple[TensorSpec, ...] | None  # the inventory (None: an export made before it existed)
    shard_bytes: int | None
    tokenizer: Path | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    export_id: str | None
    n_devices: int = 1  # config.json "devices.count": HAL devices the export drives
    # config.json "devices.stages" of a pipeline export ("split": "pipeline"): [first, last) layers of
    # each stage, stage k a module of its own on device k; () for a one-module export
    pipeline: tuple[tuple[int, int], ...] = ()
    sha256: Mapping[str, str] = dataclasses.field(default_factory=dict)  # weight file name -> hex digest
    # config.json "speculative" ({"method": "mtp", "draft_tokens", "prefill_batch_sizes",
    # "verify_batch_sizes"}): the MTP speculative entry points; None when the export has none
    speculative: Mapping[str, Any] | None = None

    @classmethod
    def load(cls, export_dir: str | Path, *, weights: bool = True) -> "ExportConfig":
        """Read and validate ``export_dir/config.json`` (files it names must exist; the weight files
        only with `weights`: an export made without weights is read with weights=False)."""
        d = Path(export_dir)
        if not d.is_dir():
            raise ArtifactError(f"export directory {d} does not exist")
        p = d / "config.json"
        try:
            raw = json.loads(p.read_text())
        except FileNotFoundError:
            raise ArtifactError(f"{d} has no config.json (not a dsv4 export directory)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArtifactError(f"{p} is not valid JSON ({e}); re-export it") from None
        cfg = cls.from_dict(raw, d)
        if cfg.tokenizer is not None:
            _need(cfg.tokenizer.is_file(), p, f"{cfg.tokenizer.name} is missing from {d}")
        missing = cfg.missing_weights()
        if weights and missing:
            more = f" (and {len(missing) - 1} more weight file(s))" if len(missing) > 1 else ""
            raise ArtifactError(f"{p}: {missing[0].name} is missing from {d}{more}. An export made with "
                                f"--no-weights has none yet: write random ones with `dsv4 weights random {d}`, "
                                "or re-export with weights")
        return cfg

    @classmethod
    def from_dict(cls, raw: dict, directory: str | Path) -> "ExportConfig":
        """Validate a config dict (no file checks: the writer validates before its files exist)."""
        d = Path(directory)
        p = d / "config.json"
        _need(isinstance(raw, dict), p, "top level must be an object")
        _need(raw.get("format") == FORMAT, p, f"format: expected {FORMAT!r}, got {raw.get('format')!r}")
        _need(raw.get("version") == VERSION, p,
              f"version: this runtime reads version {VERSION}, got {raw.get('version')!r}")
        missing = [k for k in ("model", "n_slots", "max_seq_len", "prefill", "decode", "state",
                               "functions", "targets", "parameters") if k not in raw]
        _need(not missing, p, f"missing field(s): {', '.join(missing)}")
        model = raw["model"]
        _need(isinstance(model, dict), p, "model: must be an object")
        vocab = model.get("vocab_size")
        _need(_pos_int(vocab), p, f"model.vocab_size: must be a positive integer, got {vocab!r}")
        for k in ("n_slots", "max_seq_len"):
            _need(_pos_int(raw[k]), p, f"{k}: must be a positive integer, got {raw[k]!r}")

        pre, dec = raw["prefill"], raw["decode"]
        _need(isinstance(pre, dict) and isinstance(dec, dict), p, "prefill/decode: must be objects")
        pbs, dbs = pre.get("batch_sizes"), dec.get("batch_sizes")
        for name, bs in (("prefill", pbs), ("decode", dbs)):
            _need(isinstance(bs, list) and bs and all(_pos_int(b) for b in bs), p,
                  f"{name}.batch_sizes: must be a non-empty list of positive integers, got {bs!r}")
            _need(min(bs) <= raw["n_slots"], p,
                  f"{name}.batch_sizes: smallest ({min(bs)}) exceeds n_slots ({raw['n_slots']})")
        tmin, tmax = pre.get("min_tokens"), pre.get("max_tokens")
        _need(_pos_int(tmin) and _pos_int(tmax) and tmin <= tmax, p,
              f"prefill.min_tokens/max_tokens: need 0 < min <= max, got {tmin!r}/{tmax!r}")

        st = raw["state"]
        _need(isinstance(st, list) and st, p, "state: must be a non-empty list")
        specs = []
        for i, s in enumerate(st):
            _need(isinstance(s, dict) and {"name", "shape", "dtype"} <= set(s), p,
                  f"state[{i}]: needs name, shape, dtype")
            dt = _dtype_name(s["dtype"])
            _need(dt in DTYPES, p, f"state[{i}] ({s['name']}): unsupported dtype {s['dtype']!r}")
            shape = s["shape"]
            _need(isinstance(shape, list) and shape and all(_pos_int(x) for x in shape), p,
                  f"state[{i}] ({s['name']}): shape must be a list of positive integers, got {shape!r}")
            _need(shape[0] == raw["n_slots"], p,
                  f"state[{i}] ({s['name']}): dim 0 is {shape[0]}, expected n_slots = {raw['n_slots']}")
            specs.append(StateSpec(str(s["name"]), tuple(int(x) for x in shape), dt))

        fns = raw["functions"]
        _need(isinstance(fns, dict), p, "functions: must be an object")
        want = [f"prefill_bs{b}" for b in pbs] + [f"decode_bs{b}" for b in dbs]
        absent = [f for f in want if f not in fns]
        _need(not absent, p, f"functions: batch sizes listed but functions missing: {', '.join(absent)}")
        for name, f in fns.items():
            _need(isinstance(f, dict) and isinstance(f.get("args", []), list), p,
                  f"functions.{name}: must be an object with an args list")
            args = f.get("args")
            if name.startswith("sample_bs"):
                _need(args == list(SAMPLE_ARGS), p, f"functions.{name}: args must be {list(SAMPLE_ARGS)}")
            elif name.startswith(("mtp_prefill_bs", "verify_bs")):
                want_args = MTP_PREFILL_ARGS if name.startswith("mtp_prefill_bs") else VERIFY_ARGS
                _need(args == [*want_args, *(s.name for s in specs)], p,
                      f"functions.{name}: args must be {list(want_args)} + the state tensors (an export "
                      "from before sampled speculation: re-export with --draft-tokens K)")
            elif args is not None:
                _need(len(args) == len(STEP_ARGS) + len(specs), p,
                      f"functions.{name}: {len(args)} args, expected {len(STEP_ARGS)} + {len(specs)} state tensors")

        targets = raw["targets"]
        _need(isinstance(targets, dict) and targets, p, "targets: must be a non-empty object")
        for t, info in targets.items():
            _need(isinstance(info, dict) and isinstance(info.get("vmfb"), str), p,
                  f"targets.{t}: needs a vmfb file name")
            if "parameters" in info:
                _file_list(info["parameters"], p, f"targets.{t}.parameters")
            fp8 = info.get("fp8_dtype")
            _need(fp8 is None or (fp8 in FP8_DTYPES and "parameters" in info), p,
                  f"targets.{t}.fp8_dtype: must be one of {', '.join(FP8_DTYPES)}, with the target's own "
                  f"parameters, got {fp8!r}")
        params = _file_list(raw["parameters"], p, "parameters")
        inventory, shard_bytes = _weights(raw.get("weights"), p)

        tok = raw.get("tokenizer")
        eos = raw.get("eos_token_ids", model.get("eos_token_id"))
        if eos is None:
            eos = []
        eos = [eos] if isinstance(eos, int) else list(eos)
        _need(all(isinstance(e, int) and 0 <= e < vocab for e in eos), p,
              f"eos_token_ids: must be token ids below vocab_size {vocab}, got {eos!r}")
        bos = raw.get("bos_token_id", model.get("bos_token_id"))
        _need(bos is None or (isinstance(bos, int) and 0 <= bos < vocab), p,
              f"bos_token_id: must be a token id below vocab_size {vocab}, got {bos!r}")
        eid = raw.get("export_id")
        dev = raw.get("devices", {"count": 1})
        _need(isinstance(dev, dict) and _pos_int(dev.get("count")), p,
              f"devices: must be an object with a positive integer count, got {dev!r}")
        stages: list = []
        if dev.get("split") == "pipeline":
            stages = dev.get("stages")
            ok = (isinstance(stages, list) and len(stages) == dev["count"]
                  and all(isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) for x in b) for b in stages))
            _need(ok and stages[0][0] == 0 and all(a < b for a, b in stages)
                  and all(stages[k][1] == stages[k + 1][0] for k in range(len(stages) - 1)), p,
                  f"devices.stages: must be {dev['count']} consecutive [first, last) layer ranges from 0, got {stages!r}")
            for t, info in targets.items():
                vm = info.get("stages")
                _need(isinstance(vm, list) and len(vm) == len(stages) and all(isinstance(v, str) for v in vm), p,
                      f"targets.{t}.stages: a pipeline export needs one vmfb per stage ({len(stages)}), got {vm!r}")
            owners = {state_stage(s.name)[0] for s in specs}
            _need(owners == set(range(len(stages))), p,
                  "state: a pipeline export names each state tensor stage<k>.<name>, every stage at least one")
        else:
            _need(dev.get("split") in (None, "module"), p, f"devices.split: unknown split {dev.get('split')!r}")
        spec = raw.get("speculative")
        if spec is not None:
            k = spec.get("draft_tokens") if isinstance(spec, dict) else None
            _need(isinstance(spec, dict) and spec.get("method") == "mtp" and _pos_int(k), p,
                  f"speculative: must be {{\"method\": \"mtp\", \"draft_tokens\": K >= 1, ...}}, got {spec!r}")
            names = {"prefill_batch_sizes": mtp_prefill_name, "verify_batch_sizes": lambda n: verify_name(n, k)}
            for key, name in names.items():
                bs = spec.get(key)
                _need(isinstance(bs, list) and bs and all(_pos_int(b) and b <= raw["n_slots"] for b in bs), p,
                      f"speculative.{key}: must be a non-empty list of batch sizes <= n_slots, got {bs!r}")
                absent = [name(b) for b in bs if name(b) not in fns]
                _need(not absent, p, f"speculative: functions missing: {', '.join(absent)}")
        sums = raw.get("sha256", {})
        _need(isinstance(sums, dict) and all(re.fullmatch(r"[0-9a-f]{64}", str(v)) for v in sums.values()), p,
              "sha256: must be an object of file name -> 64 hex digits")
        return cls(
            directory=d, raw=raw, model=model, vocab_size=int(vocab), max_seq_len=int(raw["max_seq_len"]),
            n_slots=int(raw["n_slots"]), prefill_batch_sizes=tuple(sorted(set(pbs))),
            prefill_min_tokens=int(tmin), prefill_max_tokens=int(tmax),
            decode_batch_sizes=tuple(sorted(set(dbs))), state=tuple(specs), functions=fns,
            targets=targets, parameters=tuple(d / f for f in params), weights=inventory, shard_bytes=shard_bytes,
            tokenizer=d / str(tok) if tok else None,
            bos_token_id=bos, eos_token_ids=tuple(eos), export_id=None if eid is None else str(eid),
            n_devices=int(dev["count"]), pipeline=tuple((int(a), int(b)) for a, b in stages),
            sha256=dict(sums), speculative=None if spec is None else dict(spec),
        )

    def parameters_for(self, target: str) -> tuple[Path, ...]:
        """The weight files a target's vmfb reads: its own (e.g. e4m3fnuz FP8 for gfx942) or the shared ones."""
        own = (self.targets.get(target) or {}).get("parameters")
        if own is None:
            return self.parameters
        return tuple(self.directory / f for f in _file_list(own, self.directory / "config.json", target))

    def weight_groups(self) -> list[WeightGroup]:
        """The groups of weight files the targets read (the shared one first), each with its
        inventory in its FP8 flavour (None without an inventory)."""
        groups: dict[tuple[Path, ...], tuple[str | None, list[str]]] = {}
        for t, info in self.targets.items():
            fp8 = info.get("fp8_dtype") if "parameters" in info else None
            groups.setdefault(self.parameters_for(t), (fp8, []))[1].append(t)
        return sorted((WeightGroup(files, fp8, None if self.weights is None else with_fp8(self.weights, fp8),
                                   tuple(ts)) for files, (fp8, ts) in groups.items()),
                      key=lambda g: g.files != self.parameters)

    def missing_weights(self) -> list[Path]:
        """Weight files named in config.json (any target's) that are not in the directory."""
        files = dict.fromkeys(f for g in self.weight_groups() for f in g.files)
        return [f for f in files if not f.is_file()]

    def vmfb_path(self, target: str) -> Path:
        """The vmfb compiled for ``target``; ArtifactError when that target was not exported."""
        info = self.targets.get(target)
        if info is None:
            raise ArtifactError(f"{self.directory}: no {target} module in this export "
                                f"(exported targets: {', '.join(sorted(self.targets))})")
        path = self.directory / info["vmfb"]
        if not path.is_file():
            raise ArtifactError(f"{self.directory}: {info['vmfb']} (target {target}) is missing")
        return path

    def stage_vmfb_paths(self, target: str) -> list[Path]:
        """A pipeline export's vmfb of each stage for ``target``, in order (ArtifactError when one is missing)."""
        first = self.vmfb_path(target)
        paths = [self.directory / v for v in self.targets[target].get("stages", [first.name])]
        gone = [q.name for q in paths if not q.is_file()]
        if gone:
            raise ArtifactError(f"{self.directory}: {', '.join(gone)} (target {target}) missing")
        return paths

    @property
    def weight_devices(self) -> int:
        """How many devices the weights are cut for (artifact.shard_inventory): the pipeline's
        stages share the whole model's tensors."""
        return 1 if self.pipeline else self.n_devices

    def has_function(self, name: str) -> bool:
        return name in self.functions

    @property
    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.state)


def _file_list(v: Any, p: Path, what: str) -> list[str]:
    """A weight-file field: a non-empty list of plain file names (or, the old form, one name)."""
    files = [v] if isinstance(v, str) else v
    _need(isinstance(files, list) and files and all(isinstance(f, str) and f and Path(f).name == f for f in files),
          p, f"{what}: must be a file name or a non-empty list of file names in the export directory, got {v!r}")
    _need(len(set(files)) == len(files), p, f"{what}: a file is listed twice")
    return files


def _weights(w: Any, p: Path) -> tuple[tuple[TensorSpec, ...] | None, int | None]:
    """config.json's optional `weights` field -> (inventory, shard_bytes)."""
    if w is None:
        return None, None
    _need(isinstance(w, dict) and isinstance(w.get("tensors"), list), p,
          "weights: must be an object with a tensors list")
    sb = w.get("shard_bytes")
    _need(_pos_int(sb), p, f"weights.shard_bytes: must be a positive integer, got {sb!r}")
    specs, seen = [], set()
    for i, t in enumerate(w["tensors"]):
        ok = isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and isinstance(t[1], list)
        _need(ok and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in t[1]), p,
              f"weights.tensors[{i}]: must be [name, shape (non-negative integers), dtype], got {t!r}")
        _need(t[2] in DTYPES, p, f"weights.tensors[{i}] ({t[0]}): unknown dtype {t[2]!r}")
        _need(t[0] not in seen, p, f"weights.tensors: {t[0]} is listed twice")
        seen.add(t[0])
        specs.append(TensorSpec(t[0], tuple(t[1]), t[2]))
    return tuple(specs), sb
