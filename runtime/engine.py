"""The inference engine: drives an exported DeepSeek-V4 (config.json + model.irpa + model.<target>.vmfb).

Torch-free on purpose: this module imports only numpy, iree.runtime and (lazily) tokenizers /
jinja2, so it runs where only the iree-base-runtime wheel is installed (the GPU hosts).

Shape of the runtime (iree-notes §3, anchors §5):
* the vmfb is mmapped (``VmModule.mmap``) and the weights come from the .irpa through a
  ``ParameterIndex`` (mmap, never read into Python memory: that made shortfin start in hours);
* the decode state is a handful of device arrays allocated once (zeros) and updated in place by
  every call; each sequence owns one *slot* (dim 0 of every state tensor) while it runs;
* calls are padded to the exported batch sizes with ``lengths == 0`` rows on slots that are not in
  the call (such rows leave the state untouched);
* sampling happens on the host with one numpy Generator per request, so a request's tokens do
  not depend on what else is in the batch.

Scheduling: ``submit()`` queues a request; each ``step()`` first admits queued requests while
slots are free (the requests admitted together are prefilled together, several per
``prefill_bs{N}`` call, each prompt in chunks of at most ``prefill.max_tokens`` tokens, and
each yields its first token), then runs one decode step for every request that was already
running, several requests per ``decode_bs{N}`` call. Requests join and leave between
steps, which is the base of continuous batching. ``generate``/``generate_batch``/``stream`` are
loops over ``step()``.

Not thread-safe: one thread drives an Engine.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .sampling import SamplingParams, make_rng, sample_token, token_logprobs

__all__ = [
    "Engine",
    "EngineError",
    "ArtifactError",
    "RequestError",
    "ExportConfig",
    "StateSpec",
    "SlotAllocator",
    "GenerationResult",
    "StreamChunk",
    "ScoreResult",
    "SamplingParams",
    "DEVICE_TARGETS",
    "target_for_device",
    "pick_batch_size",
    "pad_rows",
    "StopMatcher",
]

FORMAT = "dsv4-iree-export"
VERSION = 1
PARAM_SCOPE = "model"
TASK_WORKER_STACK_SIZE = 1 << 20

# device (IREE driver) -> compile target whose vmfb it runs
DEVICE_TARGETS: dict[str, str] = {
    "local-task": "llvm-cpu",
    "local-sync": "llvm-cpu",
    "cuda": "cuda",
    "hip": "gfx942",
}


class EngineError(RuntimeError):
    """Anything the engine refuses to do; the message names the problem."""


class ArtifactError(EngineError):
    """The export directory is incomplete, malformed, or mixes files of different exports."""


class RequestError(EngineError):
    """A request the model cannot serve (empty/too long prompt, bad token ids, bad sampling params)."""


# --------------------------------------------------------------------------------------------
# export config
# --------------------------------------------------------------------------------------------

# state dtype name -> (numpy storage dtype, HalElementType attribute name)
_DTYPES: dict[str, tuple[str, str]] = {
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
_DTYPE_ALIASES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "fp32": "float32",
                  "fp16": "float16", "i64": "int64", "i32": "int32", "long": "int64",
                  "float": "float32", "half": "float16", "fp8": "float8_e4m3fn"}


def _dtype_name(s: str) -> str:
    s = str(s).lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(s, s)


@dataclass(frozen=True)
class StateSpec:
    """One state tensor: dim 0 is the slot."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # canonical name, a key of _DTYPES

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(_DTYPES[self.dtype][0]).itemsize


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
    parameters: Path
    tokenizer: Path | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    export_id: str | None

    @classmethod
    def load(cls, export_dir: str | Path) -> "ExportConfig":
        """Read and validate ``export_dir/config.json`` (files it names must exist)."""
        d = Path(export_dir)
        if not d.is_dir():
            raise ArtifactError(f"export directory {d} does not exist")
        p = d / "config.json"
        try:
            raw = json.loads(p.read_text())
        except FileNotFoundError:
            raise ArtifactError(f"{d} has no config.json (not a dsv4 export directory)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArtifactError(f"{p} is not valid JSON: {e}") from None
        return cls.from_dict(raw, d)

    @classmethod
    def from_dict(cls, raw: dict, directory: str | Path) -> "ExportConfig":
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
            _need(dt in _DTYPES, p, f"state[{i}] ({s['name']}): unsupported dtype {s['dtype']!r}")
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
            if args is not None:
                _need(len(args) == 4 + len(specs), p,
                      f"functions.{name}: {len(args)} args, expected 4 + {len(specs)} state tensors")

        targets = raw["targets"]
        _need(isinstance(targets, dict) and targets, p, "targets: must be a non-empty object")
        for t, info in targets.items():
            _need(isinstance(info, dict) and isinstance(info.get("vmfb"), str), p,
                  f"targets.{t}: needs a vmfb file name")

        params = d / str(raw["parameters"])
        _need(params.is_file(), p, f"parameters: {params.name} is missing from {d}")
        tok = raw.get("tokenizer")
        tok_path = None
        if tok:
            tok_path = d / str(tok)
            _need(tok_path.is_file(), p, f"tokenizer: {tok_path.name} is missing from {d}")

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
        return cls(
            directory=d, raw=raw, model=model, vocab_size=int(vocab), max_seq_len=int(raw["max_seq_len"]),
            n_slots=int(raw["n_slots"]), prefill_batch_sizes=tuple(sorted(set(pbs))),
            prefill_min_tokens=int(tmin), prefill_max_tokens=int(tmax),
            decode_batch_sizes=tuple(sorted(set(dbs))), state=tuple(specs), functions=fns,
            targets=targets, parameters=params, tokenizer=tok_path, bos_token_id=bos,
            eos_token_ids=tuple(eos), export_id=None if eid is None else str(eid),
        )

    def parameters_for(self, target: str) -> Path:
        """The .irpa a target's vmfb reads: its own (e.g. fnuz FP8 weights for gfx942) or the shared one."""
        own = (self.targets.get(target) or {}).get("parameters")
        if own is None:
            return self.parameters
        path = self.directory / str(own)
        if not path.is_file():
            raise ArtifactError(f"{self.directory}: {own} (parameters of target {target}) is missing")
        return path

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

    @property
    def state_bytes(self) -> int:
        return sum(s.nbytes for s in self.state)


def target_for_device(device: str) -> str:
    """IREE driver name -> compile target; EngineError for a device this runtime does not know."""
    try:
        return DEVICE_TARGETS[device]
    except KeyError:
        raise EngineError(f"unknown device {device!r}; choose one of {', '.join(DEVICE_TARGETS)}") from None


# --------------------------------------------------------------------------------------------
# slots, batching, stop strings (pure logic, tested without a device)
# --------------------------------------------------------------------------------------------

class SlotAllocator:
    """Owns the state slots. Hands out the lowest free slot so runs are reproducible."""

    def __init__(self, n_slots: int):
        if n_slots < 1:
            raise ValueError("n_slots must be positive")
        self.n_slots = n_slots
        self._free = set(range(n_slots))

    def allocate(self) -> int:
        if not self._free:
            raise EngineError(f"all {self.n_slots} slots are in use")
        s = min(self._free)
        self._free.remove(s)
        return s

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.n_slots})")
        if slot in self._free:
            raise ValueError(f"slot {slot} is already free")
        self._free.add(slot)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> list[int]:
        return sorted(self._free)

    @property
    def used_slots(self) -> list[int]:
        return sorted(set(range(self.n_slots)) - self._free)


def pick_batch_size(n: int, sizes: Sequence[int], n_slots: int) -> int:
    """Smallest exported batch size >= n that fits in n_slots (padding rows need distinct slots).

    When n exceeds every usable size, the largest usable one is returned (the caller splits).
    """
    usable = sorted(b for b in sizes if b <= n_slots)
    if not usable:
        raise EngineError(f"no exported batch size fits in {n_slots} slots (sizes {list(sizes)})")
    for b in usable:
        if b >= n:
            return b
    return usable[-1]


def pad_rows(slots: Sequence[int], batch_size: int, n_slots: int) -> list[int]:
    """Slots for a call of ``batch_size`` rows: ``slots`` first, then distinct unused ones as padding.

    Padding rows get lengths 0 and so leave their slot's state alone; any slot not in the call
    works (free slots first, lowest id first, for reproducibility).
    """
    if len(set(slots)) != len(slots):
        raise EngineError(f"slots within one call must be distinct, got {list(slots)}")
    if len(slots) > batch_size:
        raise EngineError(f"{len(slots)} rows do not fit in batch size {batch_size}")
    others = [s for s in range(n_slots) if s not in set(slots)]
    need = batch_size - len(slots)
    if need > len(others):
        raise EngineError(f"batch size {batch_size} needs more than the {n_slots} slots")
    return list(slots) + others[:need]


class StopMatcher:
    """Finds stop strings in a growing text and says how much of it is safe to emit so far.

    Text that could still turn into a stop string (a suffix that is a prefix of one) and a
    trailing U+FFFD (an incomplete UTF-8 sequence) are held back.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)

    def find(self, text: str) -> int | None:
        """Index where the earliest stop string starts, or None."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def safe_len(self, text: str) -> int:
        """Length of the prefix of ``text`` that can be emitted without risking a stop string."""
        n = len(text)
        while n > 0 and text[n - 1] == "\ufffd":
            n -= 1
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, n), 0, -1):
                if text[n - k:n] == s[:k]:
                    hold = max(hold, k)
                    break
        return n - hold


# --------------------------------------------------------------------------------------------
# requests and results
# --------------------------------------------------------------------------------------------

@dataclass
class GenerationResult:
    """A finished request. ``tokens`` include the eos/stop token that ended it; ``text`` does not
    (special tokens are skipped and the text is cut before a stop string)."""

    request_id: int
    prompt_tokens: list[int]
    tokens: list[int]
    text: str | None
    stop_reason: str  # "eos" | "stop_token" | "stop_string" | "length" | "max_seq_len"
    seed: int
    ttft_s: float
    tpot_s: float | None

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
                "stop_reason": self.stop_reason, "seed": self.seed, "prompt_tokens": len(self.prompt_tokens)}


@dataclass
class StreamChunk:
    """One generated token of one request, and the text that became safe to show with it."""

    request_id: int
    token: int
    text: str
    finished: bool = False
    stop_reason: str | None = None
    logprob: float | None = None  # with SamplingParams.logprobs: log p(token) and the top alternatives
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class ScoreResult:
    """``logprobs[i] = log p(tokens[i] | tokens[:i])``; logprobs[0] is None (nothing predicts it)."""

    tokens: list[int]
    logprobs: list[float | None]
    perplexity: float

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "logprobs": self.logprobs, "perplexity": self.perplexity}


@dataclass
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    rng: np.random.Generator
    seed: int
    stop_ids: frozenset
    eos_ids: frozenset
    matcher: StopMatcher
    t_submit: float
    slot: int | None = None
    pos: int = 0  # tokens written into the state
    tokens: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of text already handed out
    text: str = ""
    stop_reason: str | None = None
    t_first: float | None = None
    t_last: float | None = None

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None


# --------------------------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------------------------

_flags_parsed = False


def _ensure_runtime_flags() -> None:
    """local-task workers need 1 MiB stacks (top-k kernels); must precede the first CPU device."""
    global _flags_parsed
    if not _flags_parsed:
        import iree.runtime as rt

        rt.flags.parse_flags(f"--task_worker_stack_size={TASK_WORKER_STACK_SIZE}")
        _flags_parsed = True


class Engine:
    """A loaded export on one device: slots, state, tokenizer, and the generation loop."""

    def __init__(self, export_dir: str | Path, device: str = "local-task", device_index: int = 0,
                 *, check_export_id: bool = True):
        self.config = cfg = ExportConfig.load(export_dir)
        self.device_name = device
        self.target = target_for_device(device)
        vmfb = cfg.vmfb_path(self.target)
        self.parameters_path = params = cfg.parameters_for(self.target)
        import iree.runtime as rt

        self._rt = rt
        if self.target == "llvm-cpu":
            _ensure_runtime_flags()
        uri = device if device.startswith("local") else f"{device}://{int(device_index)}"
        try:
            self.hal_device = rt.get_device(uri)
            self._rt_config = rt.Config(device=self.hal_device)
        except (RuntimeError, ValueError, OSError) as e:
            raise EngineError(f"device {uri!r} is not available: {e}") from None
        inst = self._rt_config.vm_instance
        try:
            self._params = rt.ParameterIndex()
            self._params.load(str(params))  # mmap; never read into Python memory
            modules = [rt.create_hal_module(inst, self.hal_device),
                       rt.create_io_parameters_module(inst, self._params.create_provider(scope=PARAM_SCOPE))]
            self.vm_module = rt.VmModule.mmap(inst, str(vmfb))
            modules.append(self.vm_module)
            self._context = rt.VmContext(inst, modules=modules)
        except (RuntimeError, ValueError, OSError) as e:
            raise ArtifactError(f"cannot load {vmfb.name} with {params.name}: {e}") from None
        self.vmfb_path = vmfb
        self._invokers: dict[str, Any] = {}
        names = set(self.vm_module.function_names)
        missing = [f for f in cfg.functions if f not in names]
        if missing:
            raise ArtifactError(f"{vmfb.name} lacks function(s) {', '.join(missing)} named in config.json "
                                "(vmfb from a different export?)")
        self.module_export_id = self._read_export_id() if "export_id" in names else None
        if check_export_id and self.module_export_id is not None and cfg.export_id is not None \
                and self.module_export_id != cfg.export_id:
            raise ArtifactError(f"{vmfb.name} was built by export {self.module_export_id} but config.json is "
                                f"from export {cfg.export_id}: the directory mixes artifacts of two exports")

        self.slots = SlotAllocator(cfg.n_slots)
        self._state = [self._zeros(s) for s in cfg.state]
        self.tokenizer = None
        self.chat_template: str | None = None
        self._tok_cfg: dict = {}
        if cfg.tokenizer is not None:
            self._load_tokenizer(cfg.tokenizer)
        self._queue: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._done: dict[int, GenerationResult] = {}
        self._next_id = 0
        self.stats = {"prefill_calls": 0, "prefill_rows": 0, "decode_calls": 0, "decode_rows": 0, "decode_padded_rows": 0}

    # ---- loading helpers -------------------------------------------------------------------
    def _zeros(self, s: StateSpec):
        storage, et = _DTYPES[s.dtype]
        host = np.zeros(s.shape, dtype=storage)  # bf16/fp8 are stored as same-width integers
        # asdevicearray ignores element_type (it maps the numpy dtype), so build the view here
        bv = self.hal_device.allocator.allocate_buffer_copy(
            memory_type=self._rt.MemoryType.DEVICE_LOCAL, allowed_usage=self._rt.BufferUsage.DEFAULT,
            device=self.hal_device, buffer=host, element_type=getattr(self._rt.HalElementType, et))
        return self._rt.DeviceArray(self.hal_device, bv, override_dtype=host.dtype)

    def _fn(self, name: str):
        inv = self._invokers.get(name)
        if inv is None:
            fn = self.vm_module.lookup_function(name)
            if fn is None:
                raise ArtifactError(f"{self.vmfb_path.name} has no function {name}")
            inv = self._invokers[name] = self._rt.FunctionInvoker(self._context, self.hal_device, fn)
        return inv

    def _read_export_id(self) -> str:
        """The id baked into the vmfb by the exporter (an exported no-argument function)."""
        res = self._fn("export_id")()
        if isinstance(res, (tuple, list)):
            res = res[0]
        if hasattr(res, "to_host"):
            res = res.to_host()
        a = np.asarray(res)
        if a.dtype.kind in "iu" and a.ndim == 1 and a.size > 1 and a.min() >= 0 and a.max() < 256:
            return bytes(a.astype(np.uint8)).rstrip(b"\0").decode("utf-8", "replace")  # a string's bytes
        if a.size == 1:
            v = a.reshape(()).item()
            return str(int(v)) if isinstance(v, (int, np.integer)) else str(v)
        return ",".join(str(int(x)) for x in a.reshape(-1))

    def _load_tokenizer(self, path: Path) -> None:
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type
            raise ArtifactError(f"cannot load tokenizer {path}: {e}") from None
        tc = path.with_name("tokenizer_config.json")
        if tc.is_file():
            try:
                self._tok_cfg = json.loads(tc.read_text())
            except json.JSONDecodeError as e:
                raise ArtifactError(f"{tc} is not valid JSON: {e}") from None
            self.chat_template = self._tok_cfg.get("chat_template")

    # ---- tokenizer -------------------------------------------------------------------------
    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise RequestError(f"export {self.config.directory} has no tokenizer; pass token ids")
        return self.tokenizer

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text`` taken literally (special-token strings inside it stay plain text)."""
        tok = self._need_tokenizer()
        tok.encode_special_tokens = True
        ids = tok.encode(text, add_special_tokens=False).ids
        bos = self.config.bos_token_id
        return ([bos] if add_bos and bos is not None else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens dropped."""
        return self._need_tokenizer().decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render the export's chat template (tokenizer_config.json) and encode it.

        The template's own special tokens (bos) are recognised; message contents are inserted
        as given, so this trusts the caller's messages. Needs jinja2.
        """
        tok = self._need_tokenizer()
        if not self.chat_template:
            raise RequestError("this export's tokenizer has no chat template")
        try:
            import jinja2
        except ImportError:
            raise EngineError("rendering the chat template needs jinja2 (pip install jinja2)") from None
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        text = env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self._tok_cfg.get("bos_token") or "", eos_token=self._tok_cfg.get("eos_token") or "")
        tok.encode_special_tokens = False
        try:
            return tok.encode(text, add_special_tokens=False).ids
        finally:
            tok.encode_special_tokens = True

    # ---- requests --------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int], add_bos: bool) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            ids = self.encode(prompt, add_bos=add_bos)
        else:
            ids = list(prompt)
        self.check_ids(ids)
        return ids

    def check_ids(self, ids: Sequence[Any]) -> None:
        """RequestError unless ``ids`` is a non-empty list of in-range token ids that fits the state."""
        if len(ids) == 0:
            raise RequestError("prompt is empty")
        v = self.config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < v]
        if bad:
            raise RequestError(f"invalid token id(s) {bad[:5]}: ids must be integers in [0, {v})")
        if len(ids) > self.config.max_seq_len:
            raise RequestError(f"prompt has {len(ids)} tokens, longer than max_seq_len "
                               f"{self.config.max_seq_len} of this export")

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               add_bos: bool = True, **kw: Any) -> int:
        """Queue a request (text or token ids); returns its id. Sampling fields may be given as kwargs."""
        try:
            params = replace(params or SamplingParams(), **kw) if kw else (params or SamplingParams())
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from None
        ids = self._prompt_ids(prompt, add_bos)
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this export has none")
        for t in params.stop_token_ids:
            if not 0 <= t < self.config.vocab_size:
                raise RequestError(f"stop token id {t} out of range [0, {self.config.vocab_size})")
        rng, seed = make_rng(params.seed)
        req = _Request(id=self._next_id, prompt=ids, params=params, rng=rng, seed=seed,
                       stop_ids=frozenset(params.stop_token_ids),
                       eos_ids=frozenset(() if params.ignore_eos else self.config.eos_token_ids),
                       matcher=StopMatcher(params.stop), t_submit=time.perf_counter())
        self._next_id += 1
        self._queue.append(req)
        return req.id

    @property
    def has_work(self) -> bool:
        return bool(self._queue or self._running)

    def result(self, request_id: int) -> GenerationResult | None:
        """The finished request's result (kept until taken)."""
        return self._done.pop(request_id, None)

    def cancel(self, request_id: int) -> None:
        """Drop a queued or running request and release its slot."""
        for r in list(self._queue):
            if r.id == request_id:
                self._queue.remove(r)
                return
        for r in list(self._running):
            if r.id == request_id:
                self._running.remove(r)
                if r.slot is not None:
                    self.slots.free(r.slot)
                return

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[StreamChunk]:
        """Admit queued requests (prefill + first token), then one decode step for the others."""
        events: list[StreamChunk] = []
        decoding = [r for r in self._running if not r.finished]
        admitted = []
        while self._queue and self.slots.n_free:
            r = self._queue.popleft()
            r.slot = self.slots.allocate()
            self._running.append(r)
            admitted.append(r)
        for r, (logits, argmax) in zip(admitted, self._prefill(admitted)):
            r.pos = len(r.prompt)
            events.append(self._accept(r, logits, argmax))
        if decoding:
            events.extend(self._decode(decoding))
        for r in [r for r in self._running if r.finished]:
            self._running.remove(r)
            self.slots.free(r.slot)
            self._done[r.id] = self._result(r)
        return events

    def _call(self, fname: str, tokens: np.ndarray, start: np.ndarray, lengths: np.ndarray,
              slots: np.ndarray) -> tuple[Any, Any]:
        res = self._fn(fname)(tokens, start, lengths, slots, *self._state)
        return res[0], res[1]

    def _groups(self, reqs: list[_Request], sizes: Sequence[int]) -> Iterator[tuple[list[_Request], int, np.ndarray]]:
        """The calls that serve ``reqs``: (requests, exported batch size, slot of every row incl.
        the padding rows), largest usable batch size first."""
        i = 0
        while i < len(reqs):
            bs = pick_batch_size(len(reqs) - i, sizes, self.config.n_slots)
            group = reqs[i:i + bs]
            i += len(group)
            yield group, bs, np.asarray(pad_rows([r.slot for r in group], bs, self.config.n_slots), dtype=np.int64)

    def _call_rows(self, fname: str, bs: int, rows: np.ndarray, pieces: Sequence[Sequence[int]],
                   starts: Sequence[int], T: int) -> tuple[Any, Any]:
        """``fname`` on row k = pieces[k] at position starts[k]; rows past the pieces (and empty
        pieces) have length 0."""
        tokens = np.zeros((bs, T), dtype=np.int64)
        sp = np.zeros(bs, np.int64)
        ln = np.zeros(bs, np.int64)
        for k, (p, st) in enumerate(zip(pieces, starts)):
            tokens[k, :len(p)] = p
            sp[k] = st
            ln[k] = len(p)
        return self._call(fname, tokens, sp, ln, rows)

    def _prefill(self, reqs: list[_Request]) -> list[tuple[np.ndarray | None, int]]:
        """Write each request's prompt into its slot, several requests per call (padding to an
        exported prefill batch size), each prompt in chunks of at most ``prefill.max_tokens``; a row
        whose prompt is done rides along with length 0 (its state untouched). Returns (logits or
        None, argmax) at each prompt's last token."""
        cfg = self.config
        step = cfg.prefill_max_tokens
        out: list[tuple[np.ndarray | None, int]] = []
        for group, bs, rows in self._groups(reqs, cfg.prefill_batch_sizes):
            last: list[tuple[np.ndarray | None, int]] = [(None, -1)] * len(group)
            for s in range(0, max(len(r.prompt) for r in group), step):
                pieces = [r.prompt[s:s + step] for r in group]
                T = max(max(len(p) for p in pieces), cfg.prefill_min_tokens)
                logits_d, argmax_d = self._call_rows(f"prefill_bs{bs}", bs, rows, pieces, [s] * len(group), T)
                self.stats["prefill_calls"] += 1
                self.stats["prefill_rows"] += sum(1 for p in pieces if p)
                ending = [k for k, r in enumerate(group) if s < len(r.prompt) <= s + step]
                if ending:
                    argmax = np.asarray(argmax_d.to_host()).reshape(-1)
                    logits = (np.asarray(logits_d.to_host())
                              if any(group[k].params.needs_logits for k in ending) else None)
                    for k in ending:
                        last[k] = (None if logits is None else logits[k], int(argmax[k]))
            out.extend(last)
        return out

    def _decode(self, reqs: list[_Request]) -> list[StreamChunk]:
        events = []
        for group, bs, rows in self._groups(reqs, self.config.decode_batch_sizes):
            n = len(group)
            logits_d, argmax_d = self._call_rows(f"decode_bs{bs}", bs, rows, [[r.tokens[-1]] for r in group],
                                                 [r.pos for r in group], 1)
            self.stats["decode_calls"] += 1
            self.stats["decode_rows"] += n
            self.stats["decode_padded_rows"] += bs - n
            argmax = np.asarray(argmax_d.to_host()).reshape(-1)
            logits = np.asarray(logits_d.to_host()) if any(r.params.needs_logits for r in group) else None
            for k, r in enumerate(group):
                r.pos += 1
                events.append(self._accept(r, None if logits is None else logits[k], int(argmax[k])))
        return events

    def _accept(self, r: _Request, logits: np.ndarray | None, argmax: int) -> StreamChunk:
        """Sample a token for ``r``, update its text and stop state, and make its stream chunk."""
        tok = sample_token(logits, r.params, r.rng, argmax=argmax)
        now = time.perf_counter()
        if r.t_first is None:
            r.t_first = now
        r.t_last = now
        r.tokens.append(tok)
        if tok in r.eos_ids:
            r.stop_reason = "eos"
        elif tok in r.stop_ids:
            r.stop_reason = "stop_token"
        if self.tokenizer is not None:
            full = self.decode(r.tokens)
            cut = r.matcher.find(full) if r.matcher.stops else None
            if cut is not None:
                full = full[:cut]
                r.stop_reason = "stop_string"
            r.text = full
        if not r.finished:
            if len(r.tokens) >= r.params.max_new_tokens:
                r.stop_reason = "length"
            elif r.pos >= self.config.max_seq_len:
                r.stop_reason = "max_seq_len"  # the next token would have no position to go to
        delta = ""
        if self.tokenizer is not None:
            upto = len(r.text) if r.finished else r.matcher.safe_len(r.text)
            if upto > r.emitted:
                delta = r.text[r.emitted:upto]
                r.emitted = upto
        chunk = StreamChunk(r.id, tok, delta, r.finished, r.stop_reason)
        if r.params.logprobs is not None:
            chunk.logprob, chunk.top_logprobs = token_logprobs(logits, tok, r.params.logprobs)
        return chunk

    def _result(self, r: _Request) -> GenerationResult:
        n = len(r.tokens)
        tpot = (r.t_last - r.t_first) / (n - 1) if n > 1 else None
        return GenerationResult(r.id, r.prompt, list(r.tokens), r.text if self.tokenizer else None,
                                r.stop_reason, r.seed, r.t_first - r.t_submit, tpot)

    # ---- one-shot and streaming front ends -------------------------------------------------
    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               add_bos: bool = True, **kw: Any) -> Iterator[StreamChunk]:
        """Tokens of one request as they are produced (other queued requests advance too).

        The final GenerationResult is available afterwards from ``result(chunk.request_id)``.
        """
        rid = self.submit(prompt, params, add_bos=add_bos, **kw)
        done = False
        try:
            while not done:
                for ev in self.step():
                    if ev.request_id == rid:
                        done = ev.finished
                        yield ev
        finally:
            if not done:  # the consumer stopped early: release the slot
                self.cancel(rid)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 add_bos: bool = True, **kw: Any) -> GenerationResult:
        """Run one request to completion."""
        rid = self.submit(prompt, params, add_bos=add_bos, **kw)
        while rid not in self._done:
            self.step()
        return self._done.pop(rid)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]],
                       params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                       add_bos: bool = True) -> list[GenerationResult]:
        """Run several requests together (decoded in shared batches); results in input order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.submit(p, sp, add_bos=add_bos) for p, sp in zip(prompts, params)]
        while not all(i in self._done for i in ids):
            self.step()
        return [self._done.pop(i) for i in ids]

    # ---- scoring ---------------------------------------------------------------------------
    def score(self, ids: Sequence[int] | str, *, add_bos: bool = True, max_chunk: int | None = None) -> ScoreResult:
        """Per-token log-probabilities and perplexity of ``ids`` via ``score_bs1``.

        Sequences longer than one call (``prefill.max_tokens``, or ``max_chunk``) are scored in
        chunks that overlap by one token: chunk k covers ids[s:e] and yields log p(ids[t+1]) for
        s <= t < e-1, and the next chunk starts at e-1. Re-writing position e-1 is safe for the
        same reason slot reuse is: reads of the state are masked by position, so what a position
        held before it is written again is never seen.
        """
        if "score_bs1" not in self.config.functions:
            raise ArtifactError("this export has no score_bs1 function")
        if isinstance(ids, str):
            ids = self._prompt_ids(ids, add_bos)
        ids = list(ids)
        self.check_ids(ids)
        if len(ids) < 2:
            raise RequestError("scoring needs at least 2 tokens (the first one is not predicted)")
        cfg = self.config
        L = min(cfg.prefill_max_tokens, max_chunk or cfg.prefill_max_tokens)
        if L < 2:
            raise RequestError("max_chunk must be at least 2")
        if not self.slots.n_free:
            raise EngineError(f"all {cfg.n_slots} slots are in use; cannot score now")
        slot = self.slots.allocate()
        lps: list[float | None] = [None]
        try:
            s = 0
            while s < len(ids) - 1:
                piece = ids[s:s + L]
                T = max(len(piece), cfg.prefill_min_tokens)
                tokens = np.zeros((1, T), np.int64)
                tokens[0, :len(piece)] = piece
                out = self._fn("score_bs1")(tokens, np.array([s], np.int64), np.array([len(piece)], np.int64),
                                            np.array([slot], np.int64), *self._state)
                if isinstance(out, (tuple, list)):
                    out = out[0]
                lp = np.asarray(out.to_host() if hasattr(out, "to_host") else out, dtype=np.float64).reshape(-1)
                lps.extend(float(x) for x in lp[:len(piece) - 1])
                s += len(piece) - 1
        finally:
            self.slots.free(slot)
        vals = np.asarray(lps[1:], dtype=np.float64)
        return ScoreResult(ids, lps, float(math.exp(-vals.mean())))
