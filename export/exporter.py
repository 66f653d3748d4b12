"""Export the DeepSeek-V4 model to IREE: MLIR (iree-turbine), vmfb per target, .irpa, config.json.

`export_model(model, spec, out_dir)` builds, from the model and an `ExportSpec` (export/spec.py: every
option, validated once), one module with these entry points (all integers int64):

* ``prefill_bs{N}(tokens[N,T], start_pos[N], lengths[N], slots[N], *state) -> (logits f32[N,V], argmax i64[N])``
  (argmax -1: that row's logits are not all finite)
  with T dynamic in [min_tokens, max_tokens] (min = the largest compression ratio: below it
  torch.export specializes the chunk-size arithmetic), or T = max_tokens = min_tokens with
  ``spec.static_prefill`` (the runtime pads every chunk to it);
* ``decode_bs{N}(tokens[N,1], ...same...) -> (logits, argmax)``;
* ``score_bs1(tokens[1,T], ...) -> logprobs f32[1,T]``, logprobs[t] = log p(tokens[t+1] | tokens[<=t])
  for t < lengths-1, 0 elsewhere (the runtime overlaps chunks by one token);
* ``sample_bs{N}(logits f32[N,V], temperature f32[N], top_k i64[N], top_p f32[N], key i64[N]) -> ids i64[N]``
  for every prefill and decode N of a one-device export: the token choice on the device
  (model/device_sampling.py), called on the logits the step left there (-1: non-finite logits);
* with ``spec.draft_tokens = K`` (MTP speculative decoding, model/speculative.py):
  ``mtp_prefill_bs{N}(tokens[N,T], start_pos[N], lengths[N], slots[N], next_tokens[N], temperature f32[N],
  top_k[N], top_p f32[N], key[N], *state) -> (logits f32[N,V], argmax i64[N], drafts i64[N,K])`` for
  every prefill N and ``verify_bs{N}_k{K}(tokens[N,1+K], start_pos, lengths, slots, temperature, top_k,
  top_p, key, *state) -> (logits f32[N,1+K,V], chosen i64[N,1+K], accepted i64[N], drafts i64[N,K])``
  for every decode N (temperature 0: greedy; else the sampled acceptance rule, on the device);
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

Why these choices (measured in docs/export.md): FxProgramsBuilder with externalized
parameters (one parameter scope shared by all entry points; tracing needs shapes only, so the model
may be an `empty_model`), strict=False tracing with the state writes functionalized in place
(export/functionalize.py) instead of turbine's whole-graph decomposition retrace, each hot spot's
lowering chosen by export/lowering.py (the exact radix top-k, the routed MoE reading only the
selected experts' weights, ...), and ``import_symbolic_shape_expressions=False`` because the
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    import numpy as np

from dsv4.contract.artifact import (FORMAT, PARAM_PREFIX, PARAM_SCOPE, VERSION, build_config, check_out_dir,
                                   SAMPLE_ARGS, function_abi, new_export_id, shard_inventory, speculative_functions,
                                   staged_export, stage_state_name, write_config)

from . import compat as _compat
from .compile import CompileError, CompileResult, Target, compile_mlir
from .lowering import LoweringPlan, plan_lowering
from .sharding import layout, shard_tensors, sharded
from .spec import ExportError, ExportSpec

__all__ = ["ExportError", "ExportResult", "ExportSpec", "export_model", "probe_module", "PROBE_PREFILL",
           "PROBE_DECODE", "FORMAT", "VERSION", "function_abi", "score_logprobs"]

STATE_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
FNUZ_TARGETS = ("gfx942",)  # targets whose native FP8 is e4m3fnuz


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
        tests of docs/export.md, IREE 3.13 traps: indices must be the exact top-k of the graph's own scores)."""
        from dsv4.model.kernels.topk import record_topk

        with record_topk() as rec:
            logits = self.model(tokens, start_pos, lengths, slots, dict(zip(self.names, state)))
        return (logits, *[idx for _, idx in rec], *[s for s, _ in rec])

    def probe(self, tokens, start_pos, lengths, slots, state):
        """prefill or decode + every block's intermediate values (model/taps.py, `dsv4 audit`)."""
        from dsv4.model.taps import record_taps

        with record_taps(self.model) as taps:
            logits = self.model(tokens, start_pos, lengths, slots, dict(zip(self.names, state)))
        return (logits, *taps.values())

    def mtp_prefill(self, tokens, start_pos, lengths, slots, next_tokens, temperature, top_k, top_p, key, state):
        """prefill + the MTP block over the chunk + n_draft drafts (model/speculative.py)."""
        from dsv4.model.speculative import mtp_prefill

        return mtp_prefill(self.model, tokens, start_pos, lengths, slots, dict(zip(self.names, state)), next_tokens,
                           self.n_draft, (temperature, top_k, top_p, key))

    def verify(self, tokens, start_pos, lengths, slots, temperature, top_k, top_p, key, state):
        """score 1 + K tokens per row, keep the accepted ones (greedy or the sampled rule), draft again
        (model/speculative.py)."""
        from dsv4.model.speculative import verify

        return verify(self.model, tokens, start_pos, lengths, slots, dict(zip(self.names, state)),
                      sampling=(temperature, top_k, top_p, key))

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


def _program_next(fn: Callable) -> Callable:
    """`_program` for mtp_prefill's signature (next_tokens and the sampling inputs after slots)."""

    def traced(m, tokens, start_pos, lengths, slots, next_tokens, temperature, top_k, top_p, key, state):
        return fn(m, tokens, start_pos, lengths, slots, next_tokens, temperature, top_k, top_p, key, state)

    return traced


def _program_verify(fn: Callable) -> Callable:
    """`_program` for verify's signature (the sampling inputs after slots)."""

    def traced(m, tokens, start_pos, lengths, slots, temperature, top_k, top_p, key, state):
        return fn(m, tokens, start_pos, lengths, slots, temperature, top_k, top_p, key, state)

    return traced


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


def _build_mlir(run: "_Run", model: nn.Module, state_spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                mlir_path: Path, tag: str, probe: bool = False) -> None:
    """Trace every entry point and import them into one MLIR module (the graph reads parameters by
    name from the .irpa, so tracing never touches weight values). `model` is the Transformer or a
    pipeline `Stage` (a later stage's entry points take the streams `h` [N,T,hc,d] f32 first); every
    hot spot traces the implementation of the run's lowering plan."""
    from iree.turbine import aot

    entry = _Entry(model, list(state_spec)).eval()
    aot.externalize_module_parameters(entry, external_scope=PARAM_SCOPE)

    fxb = aot.FxProgramsBuilder(entry)
    state = [torch.zeros(shape, dtype=dt) for shape, dt in state_spec.values()]
    spec, cfg, min_tokens, max_chunk = run.spec, run.cfg, run.min_tokens, run.max_chunk
    static = min_tokens == max_chunk  # --static-prefill (or a range of one): exactly max_chunk tokens a row
    T = None if static else torch.export.Dim("T", min=min_tokens, max=max_chunk)
    i64 = torch.int64
    ex_T = max_chunk if static else min(max(min_tokens, 2 * min_tokens), max_chunk)
    streams = not getattr(model, "is_first", True)

    def example(n: int, t: int) -> tuple:
        args = (torch.zeros(n, t, dtype=i64), torch.zeros(n, dtype=i64), torch.full((n,), t, dtype=i64),
                torch.arange(n, dtype=i64), state)
        return (torch.zeros(n, t, cfg.hc_mult, cfg.hidden_size), *args) if streams else args

    dyn = None if static else {"tokens": {1: T}, "start_pos": None, "lengths": None, "slots": None,
                               "state": [None] * len(state)}
    if streams and not static:
        dyn = {"h": {1: T}, **dyn}
    programs: list[tuple[str, Callable, tuple, Any]] = [
        *[(f"prefill_bs{n}", _Entry.step, example(n, ex_T), dyn) for n in spec.batch_sizes],
        *[(f"decode_bs{n}", _Entry.step, example(n, 1), None) for n in spec.decode_batch_sizes],
        *[(f"score_bs{n}", _Entry.score, example(n, ex_T), dyn) for n in run.score_bs],
        *([("topk_probe_bs1", _Entry.topk_probe, example(1, ex_T), dyn)] if spec.probe_topk else [])]
    if spec.draft_tokens and not probe:
        from dsv4.contract.artifact import mtp_prefill_name, verify_name

        entry.n_draft = spec.draft_tokens

        def sampling(n: int) -> tuple:  # temperature, top_k, top_p, key (the values do not matter to the trace)
            return torch.ones(n), torch.zeros(n, dtype=i64), torch.ones(n), torch.zeros(n, dtype=i64)

        dyn_next = None if static else {**dyn, "next_tokens": None, "temperature": None, "top_k": None, "top_p": None,
                                        "key": None}
        programs += [(mtp_prefill_name(n), _Entry.mtp_prefill, (*example(n, ex_T)[:4], torch.full((n,), -1, dtype=i64),
                                                               *sampling(n), state), dyn_next) for n in spec.batch_sizes]
        programs += [(verify_name(n, spec.draft_tokens), _Entry.verify,
                      (*example(n, 1 + spec.draft_tokens)[:4], *sampling(n), state), None)
                     for n in spec.decode_batch_sizes]
    if probe:  # probe_module: the two probe entry points only
        programs = [(PROBE_PREFILL, _Entry.probe, example(1, ex_T), dyn),
                    (PROBE_DECODE, _Entry.probe, example(1, 1), None)]
    _trace_all(run, fxb, programs, streams, tag, extras=not probe)
    _import(run, fxb, mlir_path, tag)


def _trace_all(run: "_Run", fxb: Any, programs: list[tuple[str, Callable, tuple, Any]], streams: bool,
               tag: str, extras: bool = True) -> None:
    """Trace `programs` (name, entry, example args, dynamic shapes), the device samplers and export_id."""
    from .kernel_op import use_kernels

    log, timings, i64 = run.log, run.timings, torch.int64
    with torch.no_grad(), use_kernels(run.plan.kernels), _no_stack_traces():
        for name, fn, args, dshapes in programs:
            t0 = time.perf_counter()
            try:
                with _heartbeat(log, f"tracing {name}"):
                    prog = (_program_next(fn) if fn is _Entry.mtp_prefill else
                            _program_verify(fn) if fn is _Entry.verify else _program(fn, streams))
                    _trace(fxb, name, prog, args, dshapes)
            except Exception as e:  # torch.export raises many types; report the stage and op
                raise ExportError(f"trace:{name}", _short(e), _ops_of(e)) from e
            timings[f"trace:{name}{tag}"] = time.perf_counter() - t0
            log(f"traced {name} ({timings[f'trace:{name}{tag}']:.1f} s)")
        if not extras:
            return
        for n in run.sample_bs:
            args = (torch.zeros(n, run.cfg.vocab_size), torch.ones(n), torch.zeros(n, dtype=i64), torch.ones(n),
                    torch.zeros(n, dtype=i64))
            fxb.export_program(_sample_program, name=f"sample_bs{n}", args=args, strict=False)
        code = torch.tensor(list(run.export_id.encode()), dtype=i64)
        fxb.export_program(lambda m: code.clone(), name="export_id", args=(), strict=False)


def _import(run: "_Run", fxb: Any, mlir_path: Path, tag: str) -> None:
    from iree.turbine import aot

    log, timings = run.log, run.timings
    t0 = time.perf_counter()
    try:
        with _heartbeat(log, "importing to MLIR"):
            eo = aot.export(fxb, import_symbolic_shape_expressions=False)
            eo.save_mlir(str(mlir_path))
    except Exception as e:
        raise ExportError("import", _short(e), _ops_of(e)) from e
    timings[f"import{tag}"] = time.perf_counter() - t0
    log(f"imported -> {mlir_path.name} ({mlir_path.stat().st_size / 1e6:.1f} MB, {timings[f'import{tag}']:.1f} s)")


PROBE_PREFILL, PROBE_DECODE = "probe_prefill_bs1", "probe_decode_bs1"


def probe_module(model: nn.Module, spec: ExportSpec, out_dir: "str | os.PathLike", *,
                 kernels: Mapping[str, str] | None = None,
                 progress: Callable[[str], None] | None = None) -> Path:
    """Compile `model`'s probe for `spec.targets[0]` into `out_dir` and return the vmfb: PROBE_PREFILL
    (T in the spec's chunk range) and PROBE_DECODE, each ``(tokens[1,T], start_pos, lengths, slots,
    *state) -> (logits, *taps)`` with the taps in model/taps.py `tap_names` order. The graph is the
    export's (the same tracing, lowering plan and flags, FP8 flavour of the target), with every
    block's intermediate values as extra results; it reads the weights by the export's keys, so it
    runs on an export's .irpa files (`dsv4 audit`). `kernels` {op: implementation} replace the
    plan's choices (a test's deliberately wrong lowering). `model` may be an `empty_model`."""
    _compat.apply()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = _prepare(model, spec, out, None, progress or (lambda s: None))
    if kernels:
        run.plan = LoweringPlan({**run.plan.kernels, **kernels}, run.plan.flags)
    t = spec.targets[0]
    flavour = "fnuz" if _has_fp8(run.model) and t.name in FNUZ_TARGETS else "default"
    from dsv4.model.state import state_spec

    mlir_path, vmfb = out / "probe.mlir", out / f"probe.{t.name}.vmfb"
    with _fp8_dtype(run.model, flavour):
        _build_mlir(run, run.model, state_spec(run.cfg, spec.n_slots, run.act), mlir_path, ":probe", probe=True)
    run.log(f"compiling the probe for {t.label} ...")
    try:
        with _heartbeat(run.log, f"compiling the probe for {t.label}"):
            res = compile_mlir(mlir_path, t, vmfb, list(run.plan.flags[t.name]), log_path=out / f"probe.{t.name}.log")
    except CompileError as e:
        raise ExportError(f"compile:{t.label}:probe", str(e), e.ops) from None
    run.log(f"compiled the probe ({res.seconds:.1f} s)")
    mlir_path.unlink(missing_ok=True)
    return vmfb


@dataclass
class _Run:
    """One export in progress: the model, its spec and lowering plan, where the files go, the timings."""

    model: nn.Module
    spec: ExportSpec
    plan: LoweringPlan
    out: Path
    log: Callable[[str], None]
    weights: "WeightSource | str | None"
    min_tokens: int
    max_chunk: int
    export_id: str = field(default_factory=new_export_id)
    timings: dict[str, float] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # weight file -> sha256, recorded in config.json
    stage: Path = Path()  # the temporary directory the files are built in
    source: dict[str, Any] | None = None  # where the weights came from (config.json's "source")
    compile_jobs: int = 1  # iree-compile processes at once

    @property
    def cfg(self) -> Any:
        return self.model.cfg

    @property
    def act(self) -> torch.dtype:
        return self.model.dtype

    @property
    def per_module(self) -> int:
        """HAL devices each module drives: a pipeline's stages are one-device modules."""
        return 1 if self.spec.pipeline else self.spec.devices

    @property
    def score_bs(self) -> list[int]:
        return [1] if self.spec.score else []

    @property
    def sample_bs(self) -> list[int]:
        """Sampling inside the module for every batch size whose logits it returns (one-device exports;
        a pipeline or multi-device export samples on the host)."""
        one = self.spec.devices == 1 and not self.spec.pipeline
        return sorted(set(self.spec.batch_sizes) | set(self.spec.decode_batch_sizes)) if one else []


def export_model(model: nn.Module, spec: ExportSpec, out_dir: "str | os.PathLike", *,
                 weights: "WeightSource | str | None" = "model", tokenizer: "str | os.PathLike | None" = None,
                 progress: Callable[[str], None] | None = None, force: bool = False,
                 source: Mapping[str, Any] | None = None, compile_jobs: int | None = None) -> ExportResult:
    """Export `model` (a dsv4 Transformer, for `spec`) into `out_dir`; see the module docstring.

    `weights` says what goes into the .irpa: "model" (the model's own parameters), None (none:
    `--no-weights`, config.json still names the files, see `dsv4 weights`), or a WeightSource called
    with (inventory, FP8 dtype name) that yields (key, array, dtype name) one tensor at a time (random
    weights, a release checkpoint streamed shard by shard); with None or a source, `model` may be an
    `empty_model` whose memory is never touched. `tokenizer`: a tokenizer.json (or its directory) to
    copy in. `force` replaces a non-empty `out_dir` that is not a dsv4 export. `source` says where the
    weights came from (config.json's ``source``: {"checkpoint": path} or {"preset", "seed"}; what
    `dsv4 audit` compares the export with). `compile_jobs`: how many iree-compile processes run at
    once (one per target and pipeline stage; default: as many as there are, up to the CPU count; each
    holds its module's compile in memory, so 1 where memory is short). Raises ExportError
    naming the failing stage (and op, when known); `out_dir` is then unchanged (a compile log is kept
    beside it as ``<out_dir>.<target>.log``). Returns the config.json dict and per-stage timings (s)."""
    _compat.apply()
    t_all = time.perf_counter()
    run = _prepare(model, spec, Path(out_dir), weights, progress or (lambda s: None))
    run.source = dict(source) if source else None
    n_compiles = len(spec.targets) * (spec.devices if spec.pipeline else 1)
    if compile_jobs is not None and compile_jobs < 1:
        raise ExportError("validate", f"compile_jobs must be at least 1, got {compile_jobs}")
    run.compile_jobs = compile_jobs or max(1, min(n_compiles, os.cpu_count() or 1))
    tok_src = _tokenizer_source(tokenizer)
    try:
        check_out_dir(run.out, force=force)
    except ValueError as e:
        raise ExportError("validate", str(e)) from None
    with staged_export(run.out, force=True) as stage:
        run.stage = stage
        config = _export_into(run, tok_src)
    run.timings["total"] = time.perf_counter() - t_all
    run.log(f"done in {run.timings['total']:.1f} s -> {run.out / 'config.json'}")
    return ExportResult(run.out, config, run.timings)


def _prepare(model: nn.Module, spec: ExportSpec, out: Path, weights: "WeightSource | str | None",
             log: Callable[[str], None]) -> _Run:
    """Check the model against the spec (ExportError "validate") and plan the lowering."""
    from dsv4.model.model import Transformer

    if not isinstance(model, Transformer):
        raise ExportError("validate", f"expected a dsv4 Transformer, got {type(model).__name__}")
    if not isinstance(spec, ExportSpec):
        raise ExportError("validate", f"expected an ExportSpec, got {type(spec).__name__}")
    model = model.eval()
    spec.check_model(model.cfg, STATE_DTYPE_NAMES.get(model.dtype))
    for name, p in model.named_parameters():
        if p.is_meta:
            raise ExportError("validate", f"parameter {name} has no data (meta tensor); load weights first")
    min_tokens, max_chunk = spec.chunk_range(model.cfg)
    return _Run(model, spec, plan_lowering(spec, model.cfg), out, log, weights, min_tokens, max_chunk)


def _tokenizer_source(tokenizer: "str | os.PathLike | None") -> Path | None:
    if tokenizer is None:
        return None
    src = Path(tokenizer)
    src = src / "tokenizer.json" if src.is_dir() else src
    if not src.is_file():
        raise ExportError("validate", f"no tokenizer.json at {src}")
    return src


def _parts(run: _Run) -> list[tuple[nn.Module, Mapping[str, Any], str, int | None]]:
    """The modules to build: the whole model (over the spec's devices), or one per pipeline stage, each
    as (model or Stage, its state spec, its name in the files, its stage index in config.json's state)."""
    from dsv4.model.state import StateLayout, state_spec

    from .pipeline import Stage, stage_bounds

    cfg, n_slots = run.cfg, run.spec.n_slots
    if not run.spec.pipeline:
        return [(run.model, state_spec(cfg, n_slots, run.act), "", None)]
    lay = StateLayout(cfg)
    return [(Stage(run.model, a, b), lay.stage_spec(n_slots, run.act, a, b), f".stage{k}", k)
            for k, (a, b) in enumerate(stage_bounds(cfg.n_layers, run.spec.devices))]


def _fp8_groups(run: _Run) -> dict[str, list[Target]]:
    """One MLIR + irpa per FP8 flavour the targets need (only when the weights are FP8), the e4m3fn
    group first whatever the targets' order: config.json's shared weights (and inventory) are then
    always e4m3fn, and a second group's own files always e4m3fnuz."""
    groups: dict[str, list[Target]] = {}
    fp8 = _has_fp8(run.model)
    for t in run.spec.targets:
        groups.setdefault("fnuz" if (fp8 and t.name in FNUZ_TARGETS) else "default", []).append(t)
    return dict(sorted(groups.items(), key=lambda kv: kv[0] != "default"))


def _export_into(run: _Run, tok_src: Path | None) -> dict[str, Any]:
    """Build every file of the export in `run.stage` (the temporary directory); returns config.json's dict."""
    parts = _parts(run)
    state_list = [{"name": n if k is None else stage_state_name(k, n), "shape": list(shape),
                   "dtype": STATE_DTYPE_NAMES[dt]} for _, spec, _, k in parts for n, (shape, dt) in spec.items()]
    target_info: dict[str, dict[str, Any]] = {}
    first: tuple[list[str], list[Any]] = ([], [])
    groups = _fp8_groups(run)
    # Every (target, module) compile is its own iree-compile process doing mostly one core's work: they
    # run side by side, up to run.compile_jobs at once, while the next FP8 group traces.
    compiles: list[tuple[Target, str | None, list[str], list[Future]]] = []
    mlirs_made: list[Path] = []
    with ThreadPoolExecutor(max_workers=run.compile_jobs, thread_name_prefix="iree-compile") as pool:
        try:
            for gi, (flavour, gtargets) in enumerate(groups.items()):
                suffix = "" if gi == 0 else f".{flavour}"
                tag = "" if len(groups) == 1 else f"[{flavour}]"
                _log_group(run, gtargets)
                mlirs, whole, specs = _trace_group(run, parts, flavour, suffix, tag)
                mlirs_made += [m for m, _ in mlirs]
                files = _weights_stage(run, f"model{suffix}", flavour, whole, specs, tag)
                if gi == 0:
                    first = (files, specs)
                for t in gtargets:
                    jobs = [pool.submit(_compile_module, run, t, m, name) for m, name in mlirs]
                    # a second group's targets read its own weight files, the inventory with its FP8 dtype
                    compiles.append((t, flavour if suffix else None, files, jobs))
        except BaseException:
            for *_, jobs in compiles:
                for j in jobs:
                    j.cancel()
            raise
        for t, own_flavour, files, jobs in compiles:
            target_info[t.name] = _target_info(run, t, [j.result() for j in jobs])
            if own_flavour is not None:
                target_info[t.name].update(parameters=files, fp8_dtype=_fp8_name(own_flavour))
    if not run.spec.keep_mlir:
        for mlir_path in mlirs_made:
            mlir_path.unlink(missing_ok=True)
    config = _config(run, state_list, target_info, first, _copy_tokenizer(run.stage, tok_src))
    write_config(run.stage, config)
    return config


def _log_group(run: _Run, gtargets: list[Target]) -> None:
    s = run.spec
    run.log(f"exporting {'+'.join(t.label for t in gtargets)}: prefill bs {list(s.batch_sizes)} (T in "
            f"[{run.min_tokens}, {run.max_chunk}]), decode bs {list(s.decode_batch_sizes)}, score bs {run.score_bs}, "
            f"{s.n_slots} slots, {STATE_DTYPE_NAMES[run.act]}" + (f", {s.devices} devices" if s.devices > 1 else "")
            + (" (pipeline stages)" if s.pipeline else ""))


def _trace_group(run: _Run, parts: list[Any], flavour: str, suffix: str, tag: str
                 ) -> tuple[list[tuple[Path, str]], list[Any], list[Any]]:
    """Trace and import every module of one FP8 flavour; returns ([(mlir path, module name)], the whole
    model's inventory (what a weight source is asked for), the vmfb's keys (per device when devices > 1))."""
    from dsv4.model.checkpoint.irpa import param_inventory

    with _fp8_dtype(run.model, flavour):
        whole = param_inventory(run.model)
        specs = shard_inventory(whole, run.per_module)
        mlirs = []
        for part, state, name, k in parts:
            mlir_path = run.stage / f"model{suffix}{name}.mlir"
            if k is not None:
                run.log(f"pipeline stage {k}: layers [{part.first}, {part.last})")
            with sharded(run.model, run.per_module):
                if k is None:
                    _check_shards(param_inventory(run.model), specs)
                _build_mlir(run, part, state, mlir_path, tag + name)
            mlirs.append((mlir_path, name))
    return mlirs, whole, specs


def _compile_module(run: _Run, t: Target, mlir_path: Path, name: str) -> tuple[str, CompileResult]:
    """Compile one module (the model, or a pipeline stage `name`) for target `t` with the plan's flags."""
    vmfb = run.stage / f"model{name}.{t.name}.vmfb"
    run.log(f"compiling {t.label}{name} ...")
    try:
        with _heartbeat(run.log, f"compiling {t.label}{name}"):
            res = compile_mlir(mlir_path, t.with_devices(run.per_module), vmfb, list(run.plan.flags[t.name]),
                               log_path=run.out.parent / f"{run.out.name}.{t.name}{name}.log")
    except CompileError as e:
        raise ExportError(f"compile:{t.label}{name}", str(e), e.ops) from None
    run.timings[f"compile:{t.label}{name}"] = res.seconds
    run.log(f"compiled {t.label}{name} -> {vmfb.name} ({vmfb.stat().st_size / 1e6:.2f} MB, {res.seconds:.1f} s)")
    return vmfb.name, res


def _target_info(run: _Run, t: Target, compiled: list[tuple[str, CompileResult]]) -> dict[str, Any]:
    """Target `t`'s config.json entry from its modules' compiles (one, or one per pipeline stage)."""
    vmfbs = [name for name, _ in compiled]
    info = {"vmfb": vmfbs[0], "flags": list(compiled[-1][1].flags),
            "compile_s": round(sum(res.seconds for _, res in compiled), 2), "driver": t.driver,
            "kernels": dict(run.plan.kernels)}
    if run.spec.pipeline:
        info["stages"] = vmfbs
    return info


def _copy_tokenizer(stage: Path, tok_src: Path | None) -> str | None:
    if tok_src is None:
        return None
    shutil.copyfile(tok_src, stage / "tokenizer.json")
    tc = tok_src.with_name("tokenizer_config.json")
    if tc.is_file():
        shutil.copyfile(tc, stage / "tokenizer_config.json")
    return "tokenizer.json"


def _config(run: _Run, state_list: list[dict[str, Any]], target_info: dict[str, dict[str, Any]],
            first: tuple[list[str], list[Any]], tok_name: str | None) -> dict[str, Any]:
    """config.json's dict (artifact.build_config); `first` = the first FP8 group's (files, inventory)."""
    from dsv4.contract.weights import SHARD_BYTES

    from .pipeline import pipeline_layout

    cfg, spec = run.cfg, run.spec
    extra: dict[str, Any] = {f"sample_bs{n}": {"args": list(SAMPLE_ARGS), "results": ["ids"]} for n in run.sample_bs}
    if spec.probe_topk:
        extra["topk_probe_bs1"] = {**function_abi("prefill", [e["name"] for e in state_list]),
                                   "results": ["logits", "topk...", "topk_scores..."]}
    speculative = None
    if spec.draft_tokens:
        speculative, fns = speculative_functions(spec.draft_tokens, spec.batch_sizes, spec.decode_batch_sizes,
                                                 [e["name"] for e in state_list])
        extra.update(fns)
    devices = (pipeline_layout(cfg, spec.devices) if spec.pipeline else
               layout(cfg, spec.devices) if spec.devices > 1 else None)
    config = build_config(
        model=cfg.to_dict(), activation_dtype=STATE_DTYPE_NAMES[run.act], n_slots=spec.n_slots,
        max_seq_len=cfg.max_seq_len, prefill_batch_sizes=list(spec.batch_sizes), min_tokens=run.min_tokens,
        max_tokens=run.max_chunk, decode_batch_sizes=list(spec.decode_batch_sizes), score_batch_sizes=run.score_bs,
        state=state_list, targets=target_info, parameters=first[0], tokenizer=tok_name,
        bos_token_id=cfg.bos_token_id, eos_token_ids=list(cfg.eos_ids), export_id=run.export_id,
        extra_functions=extra, weights={"tensors": [t.to_json() for t in first[1]], "shard_bytes": SHARD_BYTES},
        devices=devices, sha256=run.digests,
        lowering={"batch_invariant": spec.batch_invariant, "overrides": dict(spec.kernels)}, speculative=speculative)
    if run.source:
        config["source"] = run.source
    return config


def _fp8_name(flavour: str) -> str:
    return "float8_e4m3fnuz" if flavour == "fnuz" else "float8_e4m3fn"


def _check_shards(traced: list[Any], specs: list[Any]) -> None:
    """The sharded model's parameters must be the contract's per-device inventory (artifact.SHARD_SPLITS)."""
    if sorted(traced, key=str) != sorted(specs, key=str):
        diff = sorted({s.name for s in traced} ^ {s.name for s in specs})[:4]
        raise ExportError("validate", f"export/sharding.py and artifact.SHARD_SPLITS disagree on the per-device "
                                      f"tensors (e.g. {diff or 'shapes'})")


# (key, array in the dtype's storage type, dtype name) one tensor at a time, given the inventory
# (with this group's FP8 dtype) and that FP8 dtype name
WeightSource = Callable[[list[Any], str], Iterable[tuple[str, "np.ndarray", str]]]


def _weights_stage(run: _Run, prefix: str, flavour: str, whole: list[Any], specs: list[Any], tag: str) -> list[str]:
    """Write one group's weight files (sharded, one tensor in memory at a time, each checked against
    the inventory `specs`) or, without weights, name the files `dsv4 weights random` will write. The
    model or a WeightSource gives the `whole` tensors, cut per device here (artifact.shard_tensors).
    Each file's sha256 goes into `run.digests`."""
    from dsv4.contract.weights import SHARD_BYTES, checked, planned_names, write_shards

    if run.weights is None:
        files = planned_names(specs, prefix, SHARD_BYTES)
        run.log(f"no weights written (--no-weights): `dsv4 weights random {run.out}` writes {len(files)} file(s)")
        return files
    t0 = time.perf_counter()
    tensors = (_model_tensors(run.model, flavour) if run.weights == "model"
               else run.weights(whole, _fp8_name(flavour)))
    source = shard_tensors(tensors, run.per_module)
    total = sum(s.nbytes for s in specs)
    try:
        files = write_shards(run.stage, checked(source, specs), prefix, SHARD_BYTES, progress=run.log,
                             total_bytes=total, inventory=specs, digests=run.digests)
    except ValueError as e:
        raise ExportError("weights", str(e)) from None
    run.timings[f"weights{tag}"] = time.perf_counter() - t0
    run.log(f"weights -> {len(files)} file(s), {total / 1e6:.1f} MB, {run.timings[f'weights{tag}']:.1f} s")
    return files
