"""What an export is made from, in one frozen object validated once: `ExportSpec`.

The exporter (``export_model(model, spec, out_dir)``) and everything it calls read the spec instead
of a chain of arguments. The constructor normalizes and checks everything that does not need the
model (the compile targets, each proven by iree-compile's preflight here and nowhere else, batch
sizes, slots, devices, conflicting options, --kernel choices); `check_model` checks the rest against
the model's config before any tracing. Both raise ExportError("validate", ...), which names the
offending option. `from_args` builds a spec from `dsv4 export`'s command line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .compile import Target, check_target

__all__ = ["ExportError", "ExportSpec", "DTYPES"]

DTYPES = ("float32", "bfloat16", "float16")  # activation/state dtypes (config.json's names, torch's attributes)
_CLI_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


class ExportError(RuntimeError):
    """An export stage failed; ``stage`` names it ("validate", "trace:prefill_bs4", "import",
    "compile:gfx942", ...) and ``ops`` the offending op(s) when known."""

    def __init__(self, stage: str, message: str, ops: Sequence[str] = ()):
        self.stage, self.ops = stage, tuple(ops)
        extra = f" (offending op(s): {', '.join(self.ops)})" if self.ops else ""
        super().__init__(f"export stage '{stage}' failed: {message}{extra}")


def _fail(message: str) -> None:
    raise ExportError("validate", message)


def _sizes(what: str, sizes: Sequence[Any]) -> tuple[int, ...]:
    try:
        ok = bool(sizes) and all(int(b) == b and b >= 1 for b in sizes)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        _fail(f"{what} must be integers >= 1, got {list(sizes)}")
    return tuple(sorted(set(int(b) for b in sizes)))


@dataclass(frozen=True)
class ExportSpec:
    """One export's options (see the module docstring). Sequences become sorted tuples, target names
    `Target`s (preflighted), `kernels` a tuple of (op, implementation); None fields take the defaults
    the constructor fills in (decode batch sizes: the prefill ones; n_slots: the largest batch size) or
    the model's (max_chunk: min(max_seq_len, 512); the model-shaping fields: whatever the model has)."""

    targets: tuple[Target, ...] = ("gfx942",)  # type: ignore[assignment]  # names are resolved
    batch_sizes: tuple[int, ...] = (1, 4)
    decode_batch_sizes: tuple[int, ...] | None = None
    n_slots: int | None = None
    max_chunk: int | None = None  # the largest prefill chunk
    # prefill entry points of exactly max_chunk tokens a row (the runtime pads every chunk to it) instead of a
    # dynamic count: static shapes let IREE tile every prefill kernel for its size (docs/performance.md)
    static_prefill: bool = False
    score: bool = True  # the score_bs1 entry point
    probe_topk: bool = False  # topk_probe_bs1, for parity tests
    kernels: tuple[tuple[str, str], ...] = ()  # --kernel OP=IMPL, on top of the lowering plan
    batch_invariant: bool = False
    devices: int = 1
    pipeline: bool = False  # devices as consecutive layer stages, one module each
    extra_flags: tuple[str, ...] = ()  # more iree-compile flags for every target
    keep_mlir: bool = False
    # what the model must be (None: whatever it is); `dsv4 export` builds it from these
    dtype: str | None = None  # activation/state dtype, a DTYPES name
    max_seq_len: int | None = None
    quant_sim: bool | None = None
    expert_dtype: str | None = None
    layers: int | None = None
    # MTP speculative decoding: mtp_prefill_bs{N} (prefill batch sizes) and verify_bs{N}_k{K} (decode
    # batch sizes) with K = draft_tokens (model/speculative.py); 0: none
    draft_tokens: int = 0

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen: normalize once, here)
        # plain values first: they need neither the compiler (the targets' preflight) nor torch (the kernels)
        set_("batch_sizes", _sizes("batch sizes", self.batch_sizes))
        set_("decode_batch_sizes", _sizes("decode batch sizes", self.decode_batch_sizes or self.batch_sizes))
        widest = max(self.batch_sizes + self.decode_batch_sizes)
        set_("n_slots", widest if self.n_slots is None else int(self.n_slots))
        if self.n_slots < widest:
            _fail(f"n_slots {self.n_slots} is smaller than the largest batch size {widest} "
                  "(slots within one call must be distinct)")
        self._check_options()
        set_("targets", self._checked_targets())
        if self.batch_invariant and "llvm-cpu" in (names := {t.name for t in self.targets}) and len(names) > 1:
            _fail("--batch-invariant cannot serve llvm-cpu and a GPU target in one export: the row-tiled GEMMs "
                  "that make a GPU's decode batch-invariant make llvm-cpu's batch-dependent "
                  "(docs/numerics.md). Export llvm-cpu without the flag (it is batch-invariant by "
                  "default) and the GPU target(s) separately with it")
        set_("kernels", self._checked_kernels())
        set_("extra_flags", tuple(self.extra_flags))

    def _checked_targets(self) -> tuple[Target, ...]:
        if isinstance(self.targets, (str, Target)) or not self.targets:
            _fail(f"targets must be a non-empty list of compile targets, got {self.targets!r}")
        try:  # a Target was preflighted when its spec was first made (dataclasses.replace keeps it)
            tgts = tuple(t if isinstance(t, Target) else check_target(t) for t in self.targets)
        except ValueError as e:
            _fail(str(e))
        if len({t.name for t in tgts}) != len(tgts):
            _fail(f"a target is listed twice: {[t.label for t in tgts]}")
        return tgts

    def _checked_kernels(self) -> tuple[tuple[str, str], ...]:
        from .lowering import resolve_kernels

        pairs = tuple((str(k), str(v)) for k, v in (self.kernels.items() if isinstance(self.kernels, Mapping)
                                                    else self.kernels))
        try:
            resolve_kernels(dict(pairs))
        except ValueError as e:
            _fail(f"--kernel: {e}")  # names the ops or the implementations to choose from
        return pairs

    def _check_options(self) -> None:
        if not isinstance(self.devices, int) or self.devices < 1:
            _fail(f"devices must be an integer >= 1, got {self.devices!r}")
        if self.pipeline and self.devices < 2:
            _fail("--pipeline needs --devices N with N >= 2 (the number of stages)")
        if self.pipeline and self.probe_topk:
            _fail("the top-k probe is not exported for pipeline stages")
        if self.dtype is not None and self.dtype not in DTYPES:
            _fail(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_chunk is not None and (not isinstance(self.max_chunk, int) or self.max_chunk < 1):
            _fail(f"max_chunk must be a positive integer, got {self.max_chunk!r}")
        if not isinstance(self.static_prefill, bool):
            _fail(f"static_prefill must be True or False, got {self.static_prefill!r}")
        if not isinstance(self.draft_tokens, int) or isinstance(self.draft_tokens, bool) or self.draft_tokens < 0:
            _fail(f"draft_tokens must be an integer >= 0, got {self.draft_tokens!r}")
        if self.draft_tokens and (self.devices > 1 or self.pipeline):
            _fail("--draft-tokens (MTP speculative decoding) is exported for one device only")
        for name in ("max_seq_len", "layers"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                _fail(f"{name} must be a positive integer, got {v!r}")

    # -- what needs the model ------------------------------------------------------------------
    def chunk_range(self, cfg: Any) -> tuple[int, int]:
        """(min_tokens, max_chunk) of the prefill entry points: the largest compression ratio (below it
        torch.export specializes the chunk-size arithmetic) up to max_chunk; (max_chunk, max_chunk) with
        static_prefill."""
        min_tokens = max([r for r in cfg.compress_ratios if r] + [2])
        max_chunk = self.max_chunk if self.max_chunk is not None else min(cfg.max_seq_len, 512)
        if not min_tokens <= max_chunk <= cfg.max_seq_len:
            _fail(f"max_chunk {max_chunk} must be in [{min_tokens} (largest compression ratio), "
                  f"max_seq_len {cfg.max_seq_len}]")
        return (max_chunk, max_chunk) if self.static_prefill else (min_tokens, max_chunk)

    def check_model(self, cfg: Any, dtype_name: str | None) -> None:
        """ExportError unless the model (`cfg`, activation dtype name) is what the spec asks for and can
        be split over the spec's devices."""
        from .pipeline import check_pipeline
        from .sharding import check_devices

        if dtype_name not in DTYPES:
            _fail(f"unsupported activation dtype {dtype_name}")
        asked = {"dtype": (self.dtype, dtype_name), "max_seq_len": (self.max_seq_len, cfg.max_seq_len),
                 "quant_sim": (self.quant_sim, cfg.quant_sim), "expert_dtype": (self.expert_dtype, cfg.expert_dtype),
                 "layers": (self.layers, cfg.n_layers)}
        wrong = [f"{k} {want!r} (the model has {got!r})" for k, (want, got) in asked.items()
                 if want is not None and want != got]
        if wrong:
            _fail("the model is not the one the spec describes: " + ", ".join(wrong))
        self.chunk_range(cfg)
        if self.draft_tokens and not cfg.n_mtp:
            _fail("--draft-tokens needs a model with an MTP block (num_nextn_predict_layers >= 1)")
        try:
            check_pipeline(cfg, self.devices) if self.pipeline else check_devices(cfg, self.devices)
        except ValueError as e:
            _fail(str(e))

    def replace(self, **changes: Any) -> "ExportSpec":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_args(cls, args: Any) -> "ExportSpec":
        """The spec of `dsv4 export`'s parsed command line (dsv4.cli.export)."""
        kernels = []
        for item in args.kernel:
            op, sep, impl = item.partition("=")
            if not sep:
                _fail(f"--kernel expects OP=IMPL, got {item!r}")
            kernels.append((op.strip(), impl.strip()))
        return cls(targets=tuple(args.targets or ["gfx942"]), batch_sizes=tuple(args.batch_sizes),
                   decode_batch_sizes=args.decode_batch_sizes, n_slots=args.n_slots, max_chunk=args.max_chunk,
                   static_prefill=getattr(args, "static_prefill", False), score=not args.no_score,
                   kernels=tuple(kernels), batch_invariant=args.batch_invariant,
                   devices=args.devices, pipeline=args.pipeline, keep_mlir=args.keep_mlir,
                   dtype=_CLI_DTYPES[args.dtype], max_seq_len=args.max_seq_len,
                   quant_sim=None if args.quant_sim is None else args.quant_sim == "on",
                   expert_dtype=args.expert_dtype, layers=args.layers, draft_tokens=getattr(args, "draft_tokens", 0))
