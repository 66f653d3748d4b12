"""Export the DeepSeek-V4 model to IREE: MLIR (iree-turbine), vmfb per target, .irpa, config.json.

`export_model` builds one module with these entry points (all integers int64):

* ``prefill_bs{N}(tokens[N,T], start_pos[N], lengths[N], slots[N], *state) -> (logits f32[N,V], argmax i64[N])``
  (argmax -1: that row's logits are not all finite)
  with T dynamic in [min_tokens, max_tokens] (min = the largest compression ratio: below it
  torch.export specializes the chunk-size arithmetic);
* ``decode_bs{N}(tokens[N,1], ...same...) -> (logits, argmax)``;
* ``score_bs1(tokens[1,T], ...) -> logprobs f32[1,T]``, logprobs[t] = log p(tokens[t+1] | tokens[<=t])
  for t < lengths-1, 0 elsewhere (the runtime overlaps chunks by one token);
* ``sample_bs{N}(logits f32[N,V], temperature f32[N], top_k i64[N], top_p f32[N], key i64[N]) -> ids i64[N]``
  for every prefill and decode N of a one-device export: the token choice on the device
  (model/device_sampling.py), called on the logits the step left there (-1: non-finite logits);
* ``export_id() -> i64[32]``: the bytes of config.json's ``export_id`` (a uuid hex string), so a
  runtime can tell that a vmfb belongs to another export.

The state is passed as separate arguments in `state_spec` order and updated in place (whole-tensor
``index_put_``; the runtime must pass device arrays to see the update). Rows with lengths 0 only
write scratch rows, so they pad batches; slots within one call must be distinct.

The directory's contract (config.json fields, entry-point ABI, target -> driver) is defined once
in the torch-free ``dsv4.contract.artifact``, which the engine reads with. The export is built in a
temporary directory beside ``out_dir`` and moved into place only when complete, so a failed
re-export leaves a working export as it was; a non-empty directory that is not a dsv4 export is
refused unless ``force``.

Why these choices (measured in docs/export-notes.md): FxProgramsBuilder with externalized
parameters (one parameter scope shared by all entry points; tracing needs shapes only, so the model
may be an `empty_model`), strict=False tracing with the state writes functionalized in place
(export/functionalize.py) instead of turbine's whole-graph decomposition retrace, each hot spot's
declared export implementation (model/kernels: the exact radix top-k, the routed MoE reading only
the selected experts' weights), and ``import_symbolic_shape_expressions=False`` because the
compressor's ``T // ratio`` is a FloorDiv the importer cannot translate.
FP8 weights are e4m3fn for llvm-cpu/cuda and e4m3fnuz (formats.fp8_fn_to_fnuz) for gfx942; when
both kinds of targets are asked for, the fnuz targets get their own MLIR and .irpa.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    import numpy as np

from dsv4.contract.artifact import (FORMAT, PARAM_PREFIX, PARAM_SCOPE, VERSION, build_config, check_out_dir,
                                   SAMPLE_ARGS, function_abi, new_export_id, shard_inventory, staged_export, stage_state_name,
                                   write_config)

from . import compat as _compat
from .compile import GPU_REDUCTION_FLAG, CompileError, Target, check_target, compile_mlir
from .sharding import check_devices, layout, shard_tensors, sharded

__all__ = ["ExportError", "ExportResult", "export_model", "FORMAT", "VERSION",
           "function_abi", "score_logprobs"]

STATE_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
FNUZ_TARGETS = ("gfx942",)  # targets whose native FP8 is e4m3fnuz


class ExportError(RuntimeError):
    """An export stage failed; ``stage`` names it ("validate", "trace:prefill_bs4", "import",
    "compile:gfx942", ...) and ``ops`` the offending op(s) when known."""

    def __init__(self, stage: str, message: str, ops: Sequence[str] = ()):
        self.stage, self.ops = stage, tuple(ops)
        extra = f" (offending op(s): {', '.join(self.ops)})" if self.ops else ""
        super().__init__(f"export stage '{stage}' failed: {message}{extra}")


@dataclass
class ExportResult:
    out_dir: Path
    config: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def config_path(self) -> Path:
        return self.out_dir / "config.json"


# ---------------------------------------------------------------------------------------------
# the traced entry points


def score_logprobs(logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """logits [B,T,V] (all positions), tokens [B,T] -> [B,T]: log p(tokens[t+1]) for t < lengths-1, else 0."""
    lp = logits.float().log_softmax(-1)
    t = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    # the next token by a gather, not tokens[:, 1:]: a T-1 slice makes torch.export guard T >= 3
    # (size-1 contiguity), which an export whose chunks start at 2 tokens (Flash --layers 2) violates
    nxt = tokens.gather(1, ((t + 1) % tokens.shape[1]).expand(tokens.shape[0], -1))
    got = lp.gather(-1, nxt[..., None])[..., 0]
    return torch.where(t < (lengths - 1)[:, None], got, torch.zeros((), dtype=got.dtype))


class _Entry(nn.Module):
    """Wraps the Transformer (or a pipeline `Stage`) so the state is a flat tuple of arguments in
    state_spec order. A stage that is not the last returns its streams from every entry point."""

    def __init__(self, model: nn.Module, names: Sequence[str]):
        super().__init__()
        self.model = model
        self.names = tuple(names)
        self.is_last = getattr(model, "is_last", True)

    def _run(self, tokens, start_pos, lengths, slots, state, h, all_logits=False):
        streams = {} if h is None else {"h": h}
        return self.model(tokens, start_pos, lengths, slots, dict(zip(self.names, state)), all_logits=all_logits,
                          **streams)

    def step(self, tokens, start_pos, lengths, slots, state, h=None):
        from dsv4.model.device_sampling import all_finite, first_argmax

        logits = self._run(tokens, start_pos, lengths, slots, state, h)
        if not self.is_last:
            return logits
        # = argmax(-1) (aten.argmax fails on gfx942); -1 marks a row whose logits are not all finite
        # (their sum is not), so a broken build or weights is an error in the runtime, not a token.
        # One-level reductions: the decode graph measured clean on the H200 (a session-19 build that
        # changed it returned a non-finite row at decode_bs8, cause not isolated)
        return logits, torch.where(all_finite(logits), first_argmax(logits, two_level=False)[:, 0], -1)

    def topk_probe(self, tokens, start_pos, lengths, slots, state):
        """prefill + the indices of every top-k in the graph, then the scores each one ranked (parity
        tests of iree-notes §6 bug 6: indices must be the exact top-k of the graph's own scores)."""
        from dsv4.model.kernels.topk import record_topk

        with record_topk() as rec:
            logits = self.model(tokens, start_pos, lengths, slots, dict(zip(self.names, state)))
        return (logits, *[idx for _, idx in rec], *[s for s, _ in rec])

    def score(self, tokens, start_pos, lengths, slots, state, h=None):
        logits = self._run(tokens, start_pos, lengths, slots, state, h, all_logits=True)
        return score_logprobs(logits, tokens, lengths) if self.is_last else logits


# ---------------------------------------------------------------------------------------------
# helpers


def _has_fp8(model: nn.Module) -> bool:
    return any(p.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) for p in model.parameters())


def _fp8_pairs(mod: nn.Module) -> Iterator[tuple[str, str]]:
    """(weight name, scale name) of each e4m3fn parameter of `mod` (not recursive)."""
    for pname, p in mod.named_parameters(recurse=False):
        if p is not None and p.dtype == torch.float8_e4m3fn:
            sname = "scale" if pname == "weight" else f"{pname}_scale"
            if getattr(mod, sname, None) is None:
                raise ExportError("convert:fnuz", f"{type(mod).__name__}.{pname} is FP8 but has no {sname}")
            yield pname, sname


@contextlib.contextmanager
def _fp8_dtype(model: nn.Module, flavour: str) -> Iterator[None]:
    """Trace the `flavour` ("fnuz": gfx942) graph: every e4m3fn parameter is swapped for an unwritten
    e4m3fnuz one of the same shape while the block runs (the graph needs dtypes, not values; the fnuz
    weights are written by `_model_tensors`)."""
    if flavour != "fnuz":
        yield
        return
    saved = []
    for mod in model.modules():
        for pname, _ in list(_fp8_pairs(mod)):
            p = getattr(mod, pname)
            saved.append((mod, pname, p))
            setattr(mod, pname, nn.Parameter(torch.empty(p.shape, dtype=torch.float8_e4m3fnuz), requires_grad=False))
    try:
        yield
    finally:
        for mod, pname, p in saved:
            setattr(mod, pname, p)


def _model_tensors(model: nn.Module, flavour: str, prefix: str = PARAM_PREFIX) -> Iterator[tuple[str, "np.ndarray", str]]:
    """The model's own weights, one tensor at a time, as (parameter key, array in the dtype's storage
    type, dtype name), in state-dict order; for "fnuz" each e4m3fn weight and its block scale are
    converted together (checkpoint.irpa.archive_tensors)."""
    from dsv4.model.checkpoint.irpa import archive_tensors

    fp8 = "float8_e4m3fnuz" if flavour == "fnuz" else "float8_e4m3fn"
    for mname, mod in model.named_modules():
        if flavour == "fnuz":
            list(_fp8_pairs(mod))  # every FP8 weight has its scale (ExportError otherwise)
        own = {k: v.data for k, v in mod.named_parameters(recurse=False)}
        yield from archive_tensors(own, fp8, f"{prefix}{mname}." if mname else prefix)


# the GEMM kernels' form that pads rows to a 16-row tile (--batch-invariant picks it wherever an op offers it)
ROW_TILED = "kernel_rows16"


# an llvm-cpu-only export reads the routed experts in place when one layer's routed experts would take
# more than this in f32 (the gather's copy is about that large per prefill call); below it the gather
# is faster (docs/performance.md, session 17: 2x llvm-cpu prefill on the embedded default)
GATHER_COPY_LIMIT = 1 << 30


def routed_f32_bytes(cfg) -> int:
    """One layer's routed expert weights (w1, w3, w2) in f32: what gathering them before the GEMM copies."""
    return 4 * 3 * cfg.n_routed_experts * cfg.moe_intermediate_size * cfg.hidden_size


def _default_kernels(kernels: dict[str, str] | None, tgts: Sequence[Target], routed_bytes: int,
                     batch_invariant: bool = False) -> dict[str, str]:
    """The user's --kernel choices, plus: an export for llvm-cpu only reads the routed experts in place
    (mxfp4_linear_gathered=kernel) when `routed_bytes` (routed_f32_bytes) exceeds GATHER_COPY_LIMIT:
    gathering first makes IREE write an f32 copy of every routed block's weights, 27 GB per Flash
    layer for a 100-token prefill, while at the embedded default's size the gather is 2x faster. GPU
    targets keep the gather: their compile of that kernel needs a flag that changes every reduction
    (export/compile.py).
    `batch_invariant`: the GEMMs pad their rows to a 16-row tile (kernel_rows16), so a GPU runs one
    GEMM schedule for every decode batch size (docs/batch-invariance.md). llvm-cpu is batch-invariant
    without them and not with them (its decode_bs16 then rounds differently from decode_bs1), so an
    llvm-cpu-only export ignores the flag and one mixing llvm-cpu with a GPU target is refused.
    Sparse attention lowers as its kernel everywhere (the op's declared export default, model/kernels/
    sparse_attention.py; with `batch_invariant` too: bitwise across cuda batch sizes, session 18)."""
    out = dict(kernels or {})
    cpu_only = all(t.name == "llvm-cpu" for t in tgts)
    serves_cpu = any(t.name == "llvm-cpu" for t in tgts)
    if "*" not in out and cpu_only and routed_bytes > GATHER_COPY_LIMIT:
        out.setdefault("mxfp4_linear_gathered", "kernel")
    if batch_invariant and not cpu_only:
        if serves_cpu:
            raise ExportError("validate", "--batch-invariant cannot serve llvm-cpu and a GPU target in one export: "
                              "the row-tiled GEMMs that make a GPU's decode batch-invariant make llvm-cpu's "
                              "batch-dependent (docs/batch-invariance.md). Export llvm-cpu without the flag (it is "
                              "batch-invariant by default) and the GPU target(s) separately with it")
        from .model_kernels import MODEL_OPS

        for name, op in MODEL_OPS.items():
            if ROW_TILED in op.impl_names:
                out.setdefault(name, ROW_TILED)
        # the routed experts' f32 form: its one-row (bs1: a slot per pair) and 16-row-block (bs8+) forms
        # were measured to agree bit for bit; the bf16 GEMM takes a matvec for one and a tiled GEMM for the other
        out.setdefault("mxfp4_linear_stacked", "kernel_f32")
        # wo_a as the einsum: the form cuda's bitwise check ran with (session 18); the kernel, the default
        # since session 23, has not been through that check
        out.setdefault("grouped_linear", "reference")
    return out


def _validate(model: nn.Module, cfg, targets: Sequence[str], batch_sizes: Sequence[int],
              decode_batch_sizes: Sequence[int] | None, max_chunk: int | None,
              n_slots: int | None) -> tuple[list[Target], list[int], list[int], int, int, int]:
    from dsv4.model.model import Transformer

    if not isinstance(model, Transformer):
        raise ExportError("validate", f"expected a dsv4 Transformer, got {type(model).__name__}")
    if model.cfg != cfg:
        diff = [k for k, v in cfg.to_dict().items() if model.cfg.to_dict().get(k) != v]
        raise ExportError("validate", f"the model was built for a different config than the one given "
                                      f"(fields differ: {', '.join(diff) or '?'}); checkpoint/config mismatch")
    if not targets:
        raise ExportError("validate", "no compile target given")
    try:
        tgts = [check_target(t) for t in targets]
    except ValueError as e:
        raise ExportError("validate", str(e)) from None
    if len({t.name for t in tgts}) != len(tgts):
        raise ExportError("validate", f"a target is listed twice: {list(targets)}")
    bs = sorted(set(int(b) for b in batch_sizes))
    if not bs or any(b < 1 for b in bs) or any(int(b) != b for b in batch_sizes):
        raise ExportError("validate", f"batch sizes must be integers >= 1, got {list(batch_sizes)}")
    min_tokens = max([r for r in cfg.compress_ratios if r] + [2])
    max_chunk = int(max_chunk if max_chunk is not None else min(cfg.max_seq_len, 512))
    if not min_tokens <= max_chunk <= cfg.max_seq_len:
        raise ExportError("validate", f"max_chunk {max_chunk} must be in [{min_tokens} (largest compression "
                                      f"ratio), max_seq_len {cfg.max_seq_len}]")
    dec_bs = sorted(set(int(b) for b in (decode_batch_sizes or bs)))
    if any(b < 1 for b in dec_bs):
        raise ExportError("validate", f"decode batch sizes must be integers >= 1, got {dec_bs}")
    # default: enough slots for the largest call of either kind (decode often runs wider than prefill)
    n_slots = int(n_slots if n_slots is not None else max(bs + dec_bs))
    if n_slots < max(bs + dec_bs):
        raise ExportError("validate", f"n_slots {n_slots} is smaller than the largest batch size {max(bs + dec_bs)} "
                                      "(slots within one call must be distinct)")
    for name, p in model.named_parameters():
        if p.is_meta:
            raise ExportError("validate", f"parameter {name} has no data (meta tensor); load weights first")
    return tgts, bs, dec_bs, min_tokens, max_chunk, n_slots


def _short(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    msg = lines[0] if lines else ""
    if len(lines) > 1:
        msg += " ... " + lines[-1]
    return f"{type(e).__name__}: {msg[:600]}"


def _ops_of(e: BaseException) -> list[str]:
    """Best guess of the torch op a tracing/import error is about."""
    import re

    text = str(e)
    found = re.findall(r"(aten\.\w+(?:\.\w+)?|torch\.ops\.\w+\.\w+|target=[\w.]+)", text)
    return list(dict.fromkeys(found))[:3]


# ---------------------------------------------------------------------------------------------
# the exporter


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Skip fx's per-node Python stack capture while tracing: about 25 % of torch.export time
    for this model on 2 cores (measured); MLIR locations then name the op, not the source line."""
    import torch.fx.config as fxc

    if not hasattr(fxc, "do_not_emit_stack_traces"):  # torch 2.11 (the GPU host) has no such switch
        yield
        return
    saved = fxc.do_not_emit_stack_traces
    fxc.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fxc.do_not_emit_stack_traces = saved


@contextlib.contextmanager
def _heartbeat(log: Callable[[str], None], what: str, every: float = 30.0) -> Iterator[None]:
    """Log "<what>: N s" every `every` seconds while the block runs (tracing and iree-compile take
    minutes with no output of their own)."""
    done = threading.Event()
    t0 = time.perf_counter()

    def beat() -> None:
        while not done.wait(every):
            log(f"  ... {what}: {time.perf_counter() - t0:.0f} s")

    th = threading.Thread(target=beat, daemon=True)
    th.start()
    try:
        yield
    finally:
        done.set()
        th.join()


def _program(fn: Callable, streams: bool = False) -> Callable:
    """A function with the exact signature torch.export matches dynamic_shapes against; with
    `streams` it takes the previous pipeline stage's streams `h` first."""

    def traced(m, tokens, start_pos, lengths, slots, state):
        return fn(m, tokens, start_pos, lengths, slots, state)

    def traced_h(m, h, tokens, start_pos, lengths, slots, state):
        return fn(m, tokens, start_pos, lengths, slots, state, h)

    return traced_h if streams else traced


def _sample_program(m, logits, temperature, top_k, top_p, key):
    from dsv4.model.device_sampling import sample

    return sample(logits, temperature, top_k, top_p, key)


def _trace(fxb: Any, name: str, fn: Callable, args: tuple, dshapes: Any) -> None:
    """torch.export one entry point into `fxb`, its state writes functionalized directly
    (export/functionalize.py) instead of turbine's whole-graph decomposition retrace; a graph that
    pass cannot handle safely is retraced the usual way."""
    from iree.turbine.aot.decompositions import extend_aot_decompositions

    from .functionalize import functionalize_state_writes, positive_unflatten_dims

    with extend_aot_decompositions(from_current=False):  # an empty table: turbine skips the retrace
        ep = fxb.export_program(fn, name=name, args=args, dynamic_shapes=dshapes, strict=False)
    try:
        functionalize_state_writes(ep)
        positive_unflatten_dims(ep)
    except NotImplementedError:  # the pass may have rewritten part of ep: trace again, the usual way
        del fxb.programs[name]
        fxb.export_program(fn, name=name, args=args, dynamic_shapes=dshapes, strict=False)


def _build_mlir(model: nn.Module, state_spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]], cfg,
                bs: list[int], dec_bs: list[int], score_bs: list[int], min_tokens: int, max_chunk: int,
                export_id: str, mlir_path: Path, log: Callable[[str], None], timings: dict[str, float],
                tag: str, probe_topk: bool, kernels: dict[str, str], sample_bs: Sequence[int] = ()) -> None:
    """Trace every entry point and import them into one MLIR module (the graph reads parameters by
    name from the .irpa, so tracing never touches weight values). `model` is the Transformer or a
    pipeline `Stage` (a later stage's entry points take the streams `h` [N,T,hc,d] f32 first).
    `sample_bs`: the batch sizes that get a ``sample_bs{N}`` (model/device_sampling.py)."""
    from iree.turbine import aot

    entry = _Entry(model, list(state_spec)).eval()
    aot.externalize_module_parameters(entry, external_scope=PARAM_SCOPE)

    fxb = aot.FxProgramsBuilder(entry)
    state = [torch.zeros(shape, dtype=dt) for shape, dt in state_spec.values()]
    T = torch.export.Dim("T", min=min_tokens, max=max_chunk)
    i64 = torch.int64
    ex_T = min(max(min_tokens, 2 * min_tokens), max_chunk)
    streams = not getattr(model, "is_first", True)

    def example(n: int, t: int) -> tuple:
        args = (torch.zeros(n, t, dtype=i64), torch.zeros(n, dtype=i64), torch.full((n,), t, dtype=i64),
                torch.arange(n, dtype=i64), state)
        return (torch.zeros(n, t, cfg.hc_mult, cfg.hidden_size), *args) if streams else args

    dyn = {"tokens": {1: T}, "start_pos": None, "lengths": None, "slots": None, "state": [None] * len(state)}
    if streams:
        dyn = {"h": {1: T}, **dyn}
    programs: list[tuple[str, Callable, tuple, Any]] = []
    for n in bs:
        programs.append((f"prefill_bs{n}", _Entry.step, example(n, ex_T), dyn))
    for n in dec_bs:
        programs.append((f"decode_bs{n}", _Entry.step, example(n, 1), None))
    for n in score_bs:
        programs.append((f"score_bs{n}", _Entry.score, example(n, ex_T), dyn))
    if probe_topk:
        programs.append(("topk_probe_bs1", _Entry.topk_probe, example(1, ex_T), dyn))

    from .model_kernels import use_kernels

    with torch.no_grad(), use_kernels(kernels), _no_stack_traces():
        for name, fn, args, dshapes in programs:
            t0 = time.perf_counter()
            try:
                with _heartbeat(log, f"tracing {name}"):
                    _trace(fxb, name, _program(fn, streams), args, dshapes)
            except Exception as e:  # torch.export raises many types; report the stage and op
                raise ExportError(f"trace:{name}", _short(e), _ops_of(e)) from e
            timings[f"trace:{name}{tag}"] = time.perf_counter() - t0
            log(f"traced {name} ({timings[f'trace:{name}{tag}']:.1f} s)")
        for n in sample_bs:
            args = (torch.zeros(n, cfg.vocab_size), torch.ones(n), torch.zeros(n, dtype=i64), torch.ones(n),
                    torch.zeros(n, dtype=i64))
            fxb.export_program(_sample_program, name=f"sample_bs{n}", args=args, strict=False)
        code = torch.tensor(list(export_id.encode()), dtype=i64)
        fxb.export_program(lambda m: code.clone(), name="export_id", args=(), strict=False)

    t0 = time.perf_counter()
    try:
        with _heartbeat(log, "importing to MLIR"):
            eo = aot.export(fxb, import_symbolic_shape_expressions=False)
            eo.save_mlir(str(mlir_path))
    except Exception as e:
        raise ExportError("import", _short(e), _ops_of(e)) from e
    timings[f"import{tag}"] = time.perf_counter() - t0
    log(f"imported -> {mlir_path.name} ({mlir_path.stat().st_size / 1e6:.1f} MB, {timings[f'import{tag}']:.1f} s)")


def export_model(model: nn.Module, cfg, out_dir: "str | os.PathLike", targets: Sequence[str] = ("gfx942",),
                 batch_sizes: Sequence[int] = (1, 4), max_chunk: int | None = None, n_slots: int | None = None,
                 keep_mlir: bool = False, *, decode_batch_sizes: Sequence[int] | None = None,
                 score: bool = True, tokenizer: "str | os.PathLike | None" = None,
                 progress: Callable[[str], None] | None = None, extra_flags: Sequence[str] = (),
                 probe_topk: bool = False, kernels: Mapping[str, str] | None = None,
                 force: bool = False, weights: "WeightSource | str | None" = "model",
                 devices: int = 1, pipeline: bool = False, batch_invariant: bool = False) -> ExportResult:
    """Export `model` (a dsv4 Transformer for `cfg`, weights loaded) into `out_dir`; see module docstring.

    `probe_topk` adds ``topk_probe_bs1`` (prefill returning (logits, *indices, *scores of every top-k)) for
    parity tests. `kernels` picks a lowering per hot spot, e.g. {"sparse_attention": "kernel"}
    (export/model_kernels.py; default: each op's declared export implementation). `force` replaces a non-empty `out_dir`
    that is not a dsv4 export. `weights` says what goes into the .irpa: "model" (the model's own
    parameters), None (none: `--no-weights`, config.json still names the files, see `dsv4 weights`), or
    a WeightSource called with (inventory, flavour) that yields (key, bytes) one tensor at a time (random
    weights, a release checkpoint streamed shard by shard); with None or a source, `model` may be an
    `empty_model` whose memory is never touched. Raises ExportError naming the failing stage (and op, when known);
    `out_dir` is then unchanged (a compile log is kept beside it as ``<out_dir>.<target>.log``).
    `devices` > 1 builds one module over that many devices (export/sharding.py: the layout, recorded
    in config.json's "devices"); the weights are then stored per device. With `pipeline` the layers
    are split into `devices` consecutive stages instead, one module per device (export/pipeline.py;
    files model.stage<k>.<target>.vmfb, one .irpa for all). `batch_invariant` pads the GEMMs' rows to
    a 16-row tile so GPU decode functions agree bit for bit (docs/batch-invariance.md; llvm-cpu is
    invariant without it and not with it: ignored for llvm-cpu alone, refused beside a GPU target). Returns the config.json dict and per-stage timings (seconds)."""
    _compat.apply()
    log = progress or (lambda s: None)
    t_all = time.perf_counter()
    tgts, bs, dec_bs, min_tokens, max_chunk, n_slots = _validate(model, cfg, targets, batch_sizes,
                                                                 decode_batch_sizes, max_chunk, n_slots)
    try:
        if pipeline:
            from .pipeline import check_pipeline

            check_pipeline(cfg, devices)
            if probe_topk:
                raise ValueError("the top-k probe is not exported for pipeline stages")
        else:
            check_devices(cfg, devices)
    except ValueError as e:
        raise ExportError("validate", str(e)) from None
    score_bs = [1] if score else []
    if kernels:
        from .model_kernels import kernel_help, resolve_choices

        try:
            resolve_choices(kernels)
        except ValueError as e:
            raise ExportError("validate", f"{e}. {kernel_help()}") from None
    tok_src = None
    if tokenizer is not None:
        tok_src = Path(tokenizer)
        if tok_src.is_dir():
            tok_src = tok_src / "tokenizer.json"
        if not tok_src.is_file():
            raise ExportError("validate", f"no tokenizer.json at {tok_src}")
    model = model.eval()
    act = model.dtype
    if act not in STATE_DTYPE_NAMES:
        raise ExportError("validate", f"unsupported activation dtype {act}")
    picked = _default_kernels(kernels, tgts, routed_f32_bytes(cfg), batch_invariant)
    out = Path(out_dir)
    try:
        check_out_dir(out, force=force)
    except ValueError as e:
        raise ExportError("validate", str(e)) from None
    with staged_export(out, force=True) as stage:
        config = _export_into(stage, out, model, cfg, act, tgts, bs, dec_bs, score_bs, min_tokens, max_chunk,
                              n_slots, keep_mlir, tok_src, log, extra_flags, probe_topk, picked,
                              weights, devices, pipeline)
    timings = config.pop("_timings")
    timings["total"] = time.perf_counter() - t_all
    log(f"done in {timings['total']:.1f} s -> {out / 'config.json'}")
    return ExportResult(out, config, timings)


def _export_into(stage: Path, out: Path, model: nn.Module, cfg, act: torch.dtype, tgts: list[Target],
                 bs: list[int], dec_bs: list[int], score_bs: list[int], min_tokens: int, max_chunk: int,
                 n_slots: int, keep_mlir: bool, tok_src: Path | None, log: Callable[[str], None],
                 extra_flags: Sequence[str], probe_topk: bool, kernels: dict[str, str],
                 weights: "WeightSource | str | None", devices: int, pipeline: bool) -> dict[str, Any]:
    """Build every file of the export in `stage` (the temporary directory); returns config.json's dict
    (with the stage timings under "_timings", removed by the caller)."""
    from dsv4.model.checkpoint.irpa import param_inventory
    from dsv4.model.state import StateLayout, state_spec
    from dsv4.contract.weights import SHARD_BYTES

    from .pipeline import Stage, pipeline_layout, stage_bounds

    from .model_kernels import resolve_choices

    export_id = new_export_id()
    timings: dict[str, float] = {}
    choices = resolve_choices(kernels)  # each hot spot's lowering, recorded per target in config.json
    gathered_kernel = choices["mxfp4_linear_gathered"] == "kernel"
    # the modules to build: the whole model (over `devices` HAL devices), or one per pipeline stage,
    # each as (model or Stage, its state spec, its name in the files, its name in config.json's state)
    if pipeline:
        layout_ = StateLayout(cfg)
        parts = [(Stage(model, a, b), layout_.stage_spec(n_slots, act, a, b), f".stage{k}", k)
                 for k, (a, b) in enumerate(stage_bounds(cfg.n_layers, devices))]
    else:
        parts = [(model, state_spec(cfg, n_slots, act), "", None)]
    state_list = [{"name": n if k is None else stage_state_name(k, n), "shape": list(shape),
                   "dtype": STATE_DTYPE_NAMES[dt]} for _, spec, _, k in parts for n, (shape, dt) in spec.items()]
    # HAL devices each module drives, and the devices the weights are cut for: a pipeline's stages are
    # one-device modules sharing the whole model's weights
    per_module = 1 if pipeline else devices
    # sampling inside the module for every batch size whose logits it returns (one-device exports; a
    # pipeline or multi-device export samples on the host)
    sample_bs = sorted(set(bs) | set(dec_bs)) if devices == 1 and not pipeline else []

    # one MLIR + irpa per FP8 flavour the targets need (only when the weights are FP8)
    groups: dict[str, list[Target]] = {}
    fp8 = _has_fp8(model)
    for t in tgts:
        groups.setdefault("fnuz" if (fp8 and t.name in FNUZ_TARGETS) else "default", []).append(t)
    # the e4m3fn group first, whatever the targets' order: config.json's shared weights (and inventory)
    # are then always e4m3fn, and a second group's own files always e4m3fnuz (labelled below)
    groups = dict(sorted(groups.items(), key=lambda kv: kv[0] != "default"))
    target_info: dict[str, dict[str, Any]] = {}
    first_files: list[str] = []
    first_specs: list[Any] = []
    digests: dict[str, str] = {}  # weight file -> sha256, recorded in config.json
    for gi, (flavour, gtargets) in enumerate(groups.items()):
        suffix = "" if gi == 0 else f".{flavour}"
        tag = "" if len(groups) == 1 else f"[{flavour}]"
        log(f"exporting {'+'.join(t.label for t in gtargets)}: prefill bs {bs} (T in [{min_tokens}, {max_chunk}]), "
            f"decode bs {dec_bs}, score bs {score_bs}, {n_slots} slots, {STATE_DTYPE_NAMES[act]}"
            + (f", {devices} devices" if devices > 1 else "") + (" (pipeline stages)" if pipeline else ""))
        with _fp8_dtype(model, flavour):
            whole = param_inventory(model)  # what a weight source is asked for
            specs = shard_inventory(whole, per_module)  # the vmfb's keys: per device when devices > 1
            mlirs = []
            for part, spec, name, k in parts:
                mlir_path = stage / f"model{suffix}{name}.mlir"
                if k is not None:
                    log(f"pipeline stage {k}: layers [{part.first}, {part.last})")
                with sharded(model, per_module):
                    if k is None:
                        _check_shards(param_inventory(model), specs)
                    _build_mlir(part, spec, cfg, bs, dec_bs, score_bs, min_tokens, max_chunk, export_id, mlir_path,
                                log, timings, tag + name, probe_topk, kernels, sample_bs)
                mlirs.append((mlir_path, name))
        files = _weights_stage(stage, f"model{suffix}", model, flavour, whole, specs, per_module, weights, out,
                               log, timings, tag, digests)
        if gi == 0:
            first_files, first_specs = files, specs
        for t in gtargets:
            flags = list(extra_flags)
            if t.name != "llvm-cpu" and gathered_kernel:
                flags.append(GPU_REDUCTION_FLAG)  # the only pipeline that compiles it (compile.py)
            vmfbs, flags_used, seconds = [], (), 0.0
            for mlir_path, name in mlirs:
                vmfb = stage / f"model{name}.{t.name}.vmfb"
                log(f"compiling {t.label}{name} ...")
                try:
                    with _heartbeat(log, f"compiling {t.label}{name}"):
                        res = compile_mlir(mlir_path, t.with_devices(per_module), vmfb, flags,
                                           log_path=out.parent / f"{out.name}.{t.name}.log")
                except CompileError as e:
                    raise ExportError(f"compile:{t.label}{name}", str(e), e.ops) from None
                timings[f"compile:{t.label}{name}"] = res.seconds
                log(f"compiled {t.label}{name} -> {vmfb.name} ({vmfb.stat().st_size / 1e6:.2f} MB, {res.seconds:.1f} s)")
                vmfbs.append(vmfb.name)
                flags_used, seconds = res.flags, seconds + res.seconds
            info = {"vmfb": vmfbs[0], "flags": list(flags_used), "compile_s": round(seconds, 2), "driver": t.driver,
                    "kernels": choices}
            if pipeline:
                info["stages"] = vmfbs
            if suffix:  # this group's own weight files: the inventory with its FP8 dtype
                info["parameters"] = files
                info["fp8_dtype"] = "float8_e4m3fnuz" if flavour == "fnuz" else "float8_e4m3fn"
            target_info[t.name] = info
        if not keep_mlir:
            for mlir_path, _ in mlirs:
                mlir_path.unlink(missing_ok=True)

    tok_name = None
    if tok_src is not None:
        shutil.copyfile(tok_src, stage / "tokenizer.json")
        tc = tok_src.with_name("tokenizer_config.json")
        if tc.is_file():
            shutil.copyfile(tc, stage / "tokenizer_config.json")
        tok_name = "tokenizer.json"

    extra: dict[str, Any] = {f"sample_bs{n}": {"args": list(SAMPLE_ARGS), "results": ["ids"]} for n in sample_bs}
    if probe_topk:
        extra["topk_probe_bs1"] = {**function_abi("prefill", [e["name"] for e in state_list]), "results": ["logits", "topk...", "topk_scores..."]}
    config = build_config(
        model=cfg.to_dict(), activation_dtype=STATE_DTYPE_NAMES[act], n_slots=n_slots, max_seq_len=cfg.max_seq_len,
        prefill_batch_sizes=bs, min_tokens=min_tokens, max_tokens=max_chunk, decode_batch_sizes=dec_bs,
        score_batch_sizes=score_bs, state=state_list, targets=target_info,
        parameters=first_files, tokenizer=tok_name, bos_token_id=cfg.bos_token_id,
        eos_token_ids=list(cfg.eos_ids), export_id=export_id, extra_functions=extra,
        weights={"tensors": [t.to_json() for t in first_specs], "shard_bytes": SHARD_BYTES},
        devices=pipeline_layout(cfg, devices) if pipeline else layout(cfg, devices) if devices > 1 else None,
        sha256=digests)
    write_config(stage, config)
    return {**config, "_timings": timings}


def _check_shards(traced: list[Any], specs: list[Any]) -> None:
    """The sharded model's parameters must be the contract's per-device inventory (artifact.SHARD_SPLITS)."""
    if sorted(traced, key=str) != sorted(specs, key=str):
        diff = sorted({s.name for s in traced} ^ {s.name for s in specs})[:4]
        raise ExportError("validate", f"export/sharding.py and artifact.SHARD_SPLITS disagree on the per-device "
                                      f"tensors (e.g. {diff or 'shapes'})")


# (key, array in the dtype's storage type, dtype name) one tensor at a time, given the inventory
# (with this group's FP8 dtype) and that FP8 dtype name
WeightSource = Callable[[list[Any], str], Iterable[tuple[str, "np.ndarray", str]]]


def _weights_stage(stage: Path, prefix: str, model: nn.Module, flavour: str, whole: list[Any], specs: list[Any],
                   devices: int, weights: "WeightSource | str | None", out: Path, log: Callable[[str], None],
                   timings: dict[str, float], tag: str, digests: dict[str, str]) -> list[str]:
    """Write one group's weight files (sharded, one tensor in memory at a time, each checked against
    the inventory `specs`) or, without weights, name the files `dsv4 weights random` will write. The
    model or a WeightSource gives the `whole` tensors, cut per device here (artifact.shard_tensors).
    Each file's sha256 goes into `digests`."""
    from dsv4.contract.weights import SHARD_BYTES, checked, planned_names, write_shards

    if weights is None:
        files = planned_names(specs, prefix, SHARD_BYTES)
        log(f"no weights written (--no-weights): `dsv4 weights random {out}` writes {len(files)} file(s)")
        return files
    fp8 = "float8_e4m3fnuz" if flavour == "fnuz" else "float8_e4m3fn"
    t0 = time.perf_counter()
    source = shard_tensors(_model_tensors(model, flavour) if weights == "model" else weights(whole, fp8), devices)
    total = sum(s.nbytes for s in specs)
    try:
        files = write_shards(stage, checked(source, specs), prefix, SHARD_BYTES, progress=log, total_bytes=total,
                             inventory=specs, digests=digests)
    except ValueError as e:
        raise ExportError("weights", str(e)) from None
    timings[f"weights{tag}"] = time.perf_counter() - t0
    log(f"weights -> {len(files)} file(s), {total / 1e6:.1f} MB, {timings[f'weights{tag}']:.1f} s")
    return files
