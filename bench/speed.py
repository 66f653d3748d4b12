"""`dsv4 bench OUT`: how fast an export runs, and how that compares with the same weights in PyTorch.

    dsv4 bench OUT --device cuda [--batch 1,8,32,64] [--context 1024] [--prefill 2048]
                   [--compare torch-eager,torch-compile,transformers] [--json] [--plot ms_per_step.png]

Reports decode ms/step and tokens/s per batch and context length, prefill tokens/s, time to first
token, the distinct routed experts a step touches per layer, the bytes a decode step moves (as this
implementation reads them and as the release format needs, bench/traffic.py) and the roofline against
the device's measured copy bandwidth and its datasheet peak, whole and for the layers alone, and,
where the driver allows, the top dispatches by time of a decode call and of a prefill call (IREE's
HAL profiling; Nsight Compute on cuda).
This module imports only numpy and iree.runtime; the torch backends (`dsv4.bench.torch_backends`) load
only when --compare names them.

One protocol for every backend (`measure`), so the numbers are comparable:
* inputs: every row gets its own prompt of random token ids (`row_prompts`, from --seed, the batch and
  the length), so rows route to different experts as real traffic does; every backend gets the
  same prompts, and each row decodes its own greedy (argmax) token;
* context C at batch B: rows 0..B-1 are prefilled with F = C - W - N tokens in chunks of the
  export's prefill.max_tokens (every chunk padded to one T, so torch.compile sees one shape), rows
  grouped by the exported prefill batch sizes (transformers, which has no slots: all B rows in
  one call per chunk): that time gives prefill tokens/s;
* W warm-up decode steps, then N timed steps ending at position C - 1; every step feeds back the
  previous step's argmax read to the host, as a generation loop does: ms/step, tokens/s = B*1000/ms;
  a backend that can report its router's choices (torch-eager) records them over the W warm-up
  steps: the distinct experts per layer per step, measured;
* TTFT: one P-token prompt at batch 1 until its first token is on the host (best of 3 after a warm-up).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from dsv4.bench.traffic import datasheet_peak, expected_distinct, reads_in_place, step_bytes
from dsv4.contract.artifact import TensorSpec, verify_name, whole_inventory

__all__ = ["Backend", "IreeBackend", "measure", "measure_ttft", "row_prompts", "copy_bandwidth", "main",
           "TORCH_BACKENDS", "BenchError", "dispatch_profile", "kernel_table", "profile_lines", "device_name"]

TORCH_BACKENDS = ("torch-eager", "torch-compile", "transformers")


class BenchError(ValueError):
    """A bad argument or an export this command cannot measure; the message names the problem."""


class Backend(Protocol):
    """What the timing protocol needs from a backend: blocking calls that return each row's argmax
    on the host. Rows are state slots; `lengths[k] == 0` rows leave their slot untouched."""

    name: str

    def prefill(self, tokens: np.ndarray, start: np.ndarray, lengths: np.ndarray, slots: np.ndarray) -> np.ndarray: ...

    def decode(self, tokens: np.ndarray, start: np.ndarray, slots: np.ndarray) -> np.ndarray: ...


# --------------------------------------------------------------------------------------------
# the timing protocol (shared by every backend)
@dataclass
class Plan:
    """What one `dsv4 bench` run measures (validated against the export by `make_plan`)."""

    batches: list[int]
    contexts: list[int]
    prefill_tokens: int
    steps: int
    warmup: int
    chunk: int  # prefill T: every prefill call gets T tokens per row (padded)
    prefill_batch_sizes: tuple[int, ...]
    n_slots: int
    notes: list[str]
    seed: int = 0


def row_prompts(seed: int, rows: int, n_tokens: int, vocab: int) -> np.ndarray:
    """[rows, n_tokens] random token ids, one prompt per row, a function of (seed, rows, n_tokens) only:
    every backend measuring the same batch and length gets the same prompts."""
    return np.random.default_rng([seed, rows, n_tokens]).integers(0, vocab, (rows, n_tokens), dtype=np.int64)


def _prefill_rows(be: Backend, plan: Plan, prompts: np.ndarray, warm_up: bool = False) -> np.ndarray:
    """Prefill rows 0..rows-1 with their prompts ([rows, n_tokens]; same calls for every backend);
    returns the argmax at each row's last token. `warm_up`: only the first call of each prefill batch size that
    filling the rows uses (loads / compiles each function once; every call is padded to plan.chunk
    tokens, so a full untimed fill would cost as much as the timed one)."""
    from dsv4.runtime.batching import pad_rows, pick_batch_size

    rows, n_tokens = prompts.shape
    last = np.zeros(rows, np.int64)
    T = plan.chunk
    r0, warmed = 0, set()
    while r0 < rows:
        # a backend without fixed batch sizes (transformers) takes all rows at once
        bs = rows - r0 if getattr(be, "any_prefill_batch", False) else \
            pick_batch_size(rows - r0, plan.prefill_batch_sizes, plan.n_slots)
        if warm_up and bs in warmed:
            r0 += bs
            continue
        warmed.add(bs)
        n_real = min(bs, rows - r0)
        slots = np.asarray(pad_rows(list(range(r0, r0 + n_real)), bs, plan.n_slots), np.int64)
        for s in range(0, min(n_tokens, T) if warm_up else n_tokens, T):
            n = min(T, n_tokens - s)
            tokens = np.zeros((bs, T), np.int64)
            tokens[:n_real, :n] = prompts[r0:r0 + n_real, s:s + n]
            lengths = np.zeros(bs, np.int64)
            lengths[:n_real] = n
            out = be.prefill(tokens, np.full(bs, s, np.int64), lengths, slots)
        last[r0:r0 + n_real] = out[:n_real]
        r0 += n_real
    return last


def measure(be: Backend, plan: Plan, batch: int, context: int, vocab: int) -> dict[str, Any]:
    """Prefill B rows (each its own prompt) to context - W - N tokens, then W warm-up and N timed decode
    steps. `experts_distinct`: the distinct routed experts per layer per step over the warm-up steps
    (mean over layers and steps, and per layer) when the backend reports its routing, else None."""
    fill = context - plan.warmup - plan.steps
    prompts = row_prompts(plan.seed, batch, fill, vocab)
    _prefill_rows(be, plan, prompts, warm_up=True)  # first calls load/compile; not timed
    t0 = time.perf_counter()
    tok = _prefill_rows(be, plan, prompts)
    t_fill = time.perf_counter() - t0
    slots = np.arange(batch, dtype=np.int64)

    def step(i: int, tok: np.ndarray) -> np.ndarray:
        return be.decode(tok.reshape(batch, 1), np.full(batch, fill + i, np.int64), slots)

    per_layer = None
    record = getattr(be, "record_routing", None)
    if record is not None and plan.warmup > 0:
        with record() as routed:  # untimed: the hooks cost time
            for i in range(plan.warmup):
                tok = step(i, tok)
        per_layer = [float(np.mean(c)) for c in routed.distinct_per_layer()]
    else:
        for i in range(plan.warmup):
            tok = step(i, tok)
    t0 = time.perf_counter()
    for i in range(plan.warmup, plan.warmup + plan.steps):
        tok = step(i, tok)
    elapsed = time.perf_counter() - t0
    ms = 1e3 * elapsed / plan.steps
    return {"backend": be.name, "batch": batch, "context": context, "ms_per_step": ms,
            "tokens_per_s": batch * 1e3 / ms, "prefill_tokens": batch * fill, "prefill_s": t_fill,
            "prefill_tokens_per_s": batch * fill / t_fill,
            "experts_distinct": None if per_layer is None else float(np.mean(per_layer)),
            "experts_distinct_per_layer": per_layer}


def measure_ttft(be: Backend, plan: Plan, vocab: int, repeats: int = 3) -> dict[str, Any]:
    """Time to first token of one prefill_tokens-token random prompt at batch 1 (best of `repeats`)."""
    prompt = row_prompts(plan.seed, 1, plan.prefill_tokens, vocab)
    _prefill_rows(be, plan, prompt)  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        _prefill_rows(be, plan, prompt)
        best = min(best, time.perf_counter() - t0)
    return {"backend": be.name, "prompt_tokens": plan.prefill_tokens, "ttft_ms": 1e3 * best,
            "prefill_tokens_per_s": plan.prefill_tokens / best}


# --------------------------------------------------------------------------------------------
# the IREE backend
class IreeBackend:
    """The export's prefill_bs{N}/decode_bs{N} functions through the Engine's loaded module and state."""

    def __init__(self, export_dir: str | Path, device: str):
        from dsv4.runtime.engine import Engine

        self.engine = Engine(export_dir, device=device)
        self.name = f"iree {device}"
        self.nonfinite_rows = 0  # rows the module marked non-finite (argmax -1): a broken build

    def _run(self, fname: str, tokens, start, lengths, slots) -> np.ndarray:
        _, argmax = self.engine.invoke(fname, tokens, start, lengths, slots)
        out = np.asarray(argmax.to_host()).reshape(-1)
        bad = out < 0
        if bad.any():  # counted and reported; fed back as token 0 so the timing run goes on
            self.nonfinite_rows += int(bad.sum())
            out = np.where(bad, 0, out)
        return out

    def prefill(self, tokens, start, lengths, slots) -> np.ndarray:
        return self._run(f"prefill_bs{tokens.shape[0]}", tokens, start, lengths, slots)

    def decode(self, tokens, start, slots) -> np.ndarray:
        return self._run(f"decode_bs{tokens.shape[0]}", tokens, start, np.ones(len(slots), np.int64), slots)


def copy_bandwidth(hal_device: Any, nbytes: int, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s, counting the bytes read and written (2 x size), from
    `repeats` queued copies of one `nbytes` buffer into another."""
    import iree.runtime as rt

    alloc = hal_device.allocator
    bufs = [alloc.allocate_buffer(memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT,
                                  allocation_size=nbytes) for _ in range(2)]
    sem = hal_device.create_semaphore(0)
    hal_device.queue_copy(bufs[0], bufs[1], [(sem, 0)], [(sem, 1)])  # warm-up
    sem.wait(1)
    t0 = time.perf_counter()
    for i in range(1, repeats + 1):
        hal_device.queue_copy(bufs[i % 2], bufs[(i + 1) % 2], [(sem, i)], [(sem, i + 1)])
    sem.wait(repeats + 1)
    return 2 * nbytes * repeats / (time.perf_counter() - t0) / 1e9


# --------------------------------------------------------------------------------------------
# roofline: the bytes of a decode step (bench/traffic.py) against the device's bandwidth
def inventory(cfg: Any, irpa: Sequence[Path]) -> list[TensorSpec]:
    """The export's whole tensors (config.json's inventory; the .irpa files' for an export made before
    it had one); a multi-device export's parts count as their whole tensor."""
    if cfg.weights is not None:
        return whole_inventory(cfg.weights, cfg.n_devices)
    from dsv4.contract.weights import open_weights

    w = open_weights(irpa)
    return whole_inventory([TensorSpec(k, tuple(w.spec(k)[0]), w.spec(k)[1]) for k in w], cfg.n_devices)


def device_name(driver: str) -> str | None:
    """The GPU's product name as its driver tools report it (nvidia-smi, rocminfo), or None (a CPU
    driver, or no tool)."""
    import subprocess

    cmd = {"cuda": ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], "hip": ["rocminfo"]}.get(driver)
    if cmd is None or shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    if driver == "cuda":
        return out.strip().splitlines()[0].strip() if out.strip() else None
    names = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Marketing Name" in ln]
    return next((n for n in names if "MI" in n.upper()), None)


def traffic_rows(cfg: Any, tensors: Sequence[TensorSpec], decode: Sequence[dict], copy_gbps: float,
                 peak_tbps: float | None) -> list[dict[str, Any]]:
    """One entry per measured (batch, context): the bytes of a step in both accounts and their roofline
    times; adds each decode row's roofline percentages (whole and layers alone, copy bandwidth and
    datasheet peak, both accounts; the implementation account only on the IREE rows: it is what this
    export's lowering reads, not what a torch backend reads). Distinct experts: measured (the first backend that reported its
    routing for that batch and context: every backend gets the same inputs) or, when none did, the
    uniform-routing expectation."""
    m = cfg.model
    E, k = m.get("n_routed_experts", 1), m.get("num_experts_per_tok", 1)
    out = []
    for batch, context in dict.fromkeys((r["batch"], r["context"]) for r in decode):
        rows = [r for r in decode if (r["batch"], r["context"]) == (batch, context)]
        measured = next((r for r in rows if r.get("experts_distinct") is not None), None)
        reads = reads_in_place(cfg.raw, batch)
        b = step_bytes(m, tensors, cfg.state, batch, context, cfg.max_seq_len, cfg.raw.get("activation_dtype", ""),
                       **reads, distinct_experts=None if measured is None else measured["experts_distinct"])
        t: dict[str, Any] = {"batch": batch, "context": context,
                             "experts_distinct_uniform": expected_distinct(E, k, batch),
                             "experts_distinct_measured": None if measured is None else measured["experts_distinct"],
                             "experts_measured_by": None if measured is None else measured["backend"],
                             "experts_gathered": b["experts_gathered"], **reads}
        for acct in ("implementation", "release"):
            a = b[acct]
            t[acct] = {**a, "copy_ms": 1e3 * a["total"] / (copy_gbps * 1e9),
                       "peak_ms": None if peak_tbps is None else 1e3 * a["total"] / (peak_tbps * 1e12)}
        out.append(t)
        for r in rows:
            r["roofline"] = {}
            for acct in ("implementation", "release"):
                a = b[acct]
                if acct == "implementation" and not r["backend"].startswith("iree"):
                    r["roofline"][acct] = None
                    continue
                pct = lambda nbytes, gbps: 100 * 1e3 * nbytes / (gbps * 1e9) / r["ms_per_step"]  # noqa: E731
                r["roofline"][acct] = {
                    "copy_pct": pct(a["total"], copy_gbps), "copy_pct_layers": pct(a["layers"], copy_gbps),
                    "peak_pct": None if peak_tbps is None else pct(a["total"], peak_tbps * 1e3),
                    "peak_pct_layers": None if peak_tbps is None else pct(a["layers"], peak_tbps * 1e3)}
            # the release format's bytes at the measured copy bandwidth: what a step must read
            r["roofline_bytes"] = b["release"]["total"]
            r["roofline_ms"] = 1e3 * r["roofline_bytes"] / (copy_gbps * 1e9)
            r["roofline_pct"] = 100 * r["roofline_ms"] / r["ms_per_step"]
    return out


# --------------------------------------------------------------------------------------------
# per-dispatch profile: IREE's HAL-native profiling (3.13), through the runtime wheel's own tools
# (the Python bindings do not expose a profile sink): iree-benchmark-module runs decode_bs{B} with
# --device_profiling_mode, iree-profile reads the bundle back. The CUDA HAL has none, so on cuda the
# same run goes under Nsight Compute when `ncu` is installed.
PROFILE_MODES = {"cuda": "dispatch-events", "hip": "dispatch-events", "local-task": "host-execution",
                 "local-sync": "host-execution"}
# Under ncu every kernel launch is serialized and timed (~700 per Flash decode step): 64 calls took
# over 150 s on the H200, so the profile runs a few calls, with a time limit
PROFILE_CALLS = 4
PROFILE_TIMEOUT_S = 180
_SPLAT_TYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int64": "i64", "int32": "i32",
                "float8_e4m3fn": "f8E4M3FN", "float8_e4m3fnuz": "f8E4M3FNUZ", "uint8": "i8", "int8": "i8"}


def _run_limited(cmd: list[str]) -> Any:
    """subprocess.run with PROFILE_TIMEOUT_S; None when it ran past that (the child is killed)."""
    import subprocess

    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=PROFILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None


def _last_line(run: Any) -> str:
    """The last line a finished subprocess printed (stderr first), for a one-line error."""
    return (run.stderr.strip() or run.stdout.strip() or "?").splitlines()[-1]


def _tool(name: str) -> Path:
    import iree._runtime_libs as libs

    return Path(libs.__file__).parent / name


def dispatch_profile(eng: Any, device: str, kind: str, batch: int, tokens: int, position: int, steps: int,
                     workdir: Path) -> dict[str, Any]:
    """Top 10 dispatches by time of `steps` (at most PROFILE_CALLS) calls of {kind}_bs{batch} ("decode"
    or "prefill"; "verify": verify_bs{batch}_k{K} with greedy rows, `tokens` = 1 + K) with `tokens`
    tokens per row written at `position` (zero state: every read is masked by position, the work is the
    same), or why that is unavailable."""
    steps = min(steps, PROFILE_CALLS)
    mode = PROFILE_MODES.get(device)
    cfg = eng.config
    bad = [s.dtype for s in cfg.state if s.dtype not in _SPLAT_TYPES]
    if mode is None or bad:
        return {"available": False, "why": f"no HAL profiling mode for {device}" if mode is None
                else f"state dtype(s) {bad} have no iree-benchmark-module splat type"}
    if cfg.pipeline:
        return {"available": False, "why": "a pipeline export is one module per stage; profile a one-module export"}
    workdir.mkdir(parents=True, exist_ok=True)
    np.save(workdir / "slots.npy", np.arange(batch, dtype=np.int64))
    prof = workdir / f"{kind}.ireeprof"
    inputs = [f"--input={batch}x{tokens}xi64=3", f"--input={batch}xi64={position}", f"--input={batch}xi64={tokens}",
              f"--input=@{workdir / 'slots.npy'}"]
    function = f"{kind}_bs{batch}"
    if kind == "verify":  # greedy rows: temperature 0, top_k 0, top_p 1, key 0
        function = verify_name(batch, tokens - 1)
        inputs += [f"--input={batch}xf32=0", f"--input={batch}xi64=0", f"--input={batch}xf32=1",
                   f"--input={batch}xi64=0"]
    inputs += [f"--input={'x'.join(map(str, s.shape))}x{_SPLAT_TYPES[s.dtype]}=0" for s in cfg.state]
    n_dev = len(eng.module.devices)  # a multi-device export: one --device per device, in order
    uris = [device] * n_dev if device.startswith("local") else [f"{device}://{i}" for i in range(n_dev)]
    cmd = [str(_tool("iree-benchmark-module")), f"--module={eng.vmfb_path}",
           *(f"--parameters=model={p}" for p in eng.parameters_paths), *(f"--device={u}" for u in uris),
           f"--function={function}",
           *inputs, f"--benchmark_min_time={steps}x", f"--device_profiling_mode={mode}",
           f"--device_profiling_output={prof}"]
    if eng.target == "llvm-cpu":
        cmd.append("--task_worker_stack_size=1048576")
    run = _run_limited(cmd)
    if run is None:
        return {"available": False, "why": f"iree-benchmark-module ran past {PROFILE_TIMEOUT_S} s"}
    if run.returncode != 0:
        last = _last_line(run)
        if device == "cuda" and "UNIMPLEMENTED" in last and shutil.which("ncu"):
            # IREE 3.13's CUDA HAL has no native profiling: time every kernel with Nsight Compute instead
            prof_ncu = _ncu_profile([c for c in cmd if not c.startswith("--device_profiling")], batch, steps, workdir)
            return {**prof_ncu, "function": function, "tokens": tokens}
        return {"available": False, "why": f"iree-benchmark-module failed: {last[:300]}"}
    rep = _run_limited([str(_tool("iree-profile")), "dispatch", "--format=jsonl", str(prof)])
    if rep is None:
        return {"available": False, "why": f"iree-profile ran past {PROFILE_TIMEOUT_S} s"}
    groups = [json.loads(line) for line in rep.stdout.splitlines() if line.startswith("{")]
    groups = [g for g in groups if g.get("type") in ("dispatch_group", "host_dispatch_group")]
    if rep.returncode != 0 or not groups:
        return {"available": False, "why": f"{device} recorded no dispatch timings in {mode} mode"}
    calls = min(g["count"] for g in groups)  # every dispatch of the function runs at least once a call
    total = sum(g["total_ns"] for g in groups)
    top = sorted(groups, key=lambda g: -g["total_ns"])[:10]
    return {"available": True, "via": f"IREE HAL profiling ({mode})", "function": function,
            "batch": batch, "tokens": tokens, "calls": calls,
            "dispatches_per_step": sum(g["count"] for g in groups) / calls, "device_ms_per_step": total / calls / 1e6,
            "top": [{"name": g["key"], "ms_per_step": g["total_ns"] / calls / 1e6,
                     "calls_per_step": g["count"] / calls, "share": g["total_ns"] / total} for g in top]}


def _ncu_profile(cmd: list[str], batch: int, steps: int, workdir: Path) -> dict[str, Any]:
    """dispatch_profile through Nsight Compute: `cmd` (iree-benchmark-module running `steps` decode
    calls) under `ncu`, one kernel-duration metric (one pass, no replay); the clocks left alone."""
    log = workdir / "ncu.csv"
    ncu = ["ncu", "--csv", "--metrics", "gpu__time_duration.sum", "--clock-control", "none",
           "--log-file", str(log)]
    run = _run_limited(ncu + cmd)
    if run is None:
        return {"available": False, "why": f"ncu ran past {PROFILE_TIMEOUT_S} s"}
    if run.returncode != 0 or not log.exists():
        return {"available": False, "why": f"ncu failed: {_last_line(run)[:300]}"}
    return kernel_table(log.read_text(), batch, steps, "Nsight Compute (gpu__time_duration)")


_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9}


def kernel_table(csv_text: str, batch: int, steps: int, via: str) -> dict[str, Any]:
    """dispatch_profile's summary from ncu's CSV (one row per kernel launch): the module initializers'
    kernels and any launched fewer than `steps` times are left out; the rest is per decode call."""
    import csv
    import io

    lines = csv_text.splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if head is None:
        return {"available": False, "why": "ncu recorded no kernels"}
    total_ns: dict[str, float] = {}
    count: dict[str, int] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[head:]))):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"]
        ns = float(row["Metric Value"].replace(",", "")) * _NS[row["Metric Unit"]]
        total_ns[name] = total_ns.get(name, 0.0) + ns
        count[name] = count.get(name, 0) + 1
    # module initializers (IREE names them _initializer_N) run at load, several times when weights share a shape
    keep = [k for k in total_ns if count[k] >= steps and "_initializer_" not in k]
    if not keep:
        return {"available": False, "why": f"no kernel ran {steps} times"}
    total = sum(total_ns[k] for k in keep)
    kernels = [{"name": k, "ms_per_step": total_ns[k] / steps / 1e6, "calls_per_step": count[k] / steps}
               for k in sorted(keep, key=lambda k: -total_ns[k])]
    return {"available": True, "via": via, "batch": batch, "calls": steps,
            "dispatches_per_step": sum(count[k] for k in keep) / steps, "device_ms_per_step": total / steps / 1e6,
            "top": [{**k, "share": total_ns[k["name"]] / total} for k in kernels[:10]], "kernels": kernels}


# --------------------------------------------------------------------------------------------
# the command
def _int_list(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def _backends(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in TORCH_BACKENDS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {', '.join(bad)}; choose from {', '.join(TORCH_BACKENDS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4 bench", description=__doc__.split("\n\n")[0],
                                epilog="`dsv4 bench serve URL ...` benchmarks a running server instead.")
    p.add_argument("export_dir", metavar="OUT", help="export directory (config.json, model.irpa, vmfb)")
    p.add_argument("--device", default="local-task", help="IREE driver: local-task, cuda, hip (default local-task)")
    p.add_argument("--batch", type=_int_list, default=None,
                   help="decode batch sizes, each exported (default: the export's decode batch sizes)")
    p.add_argument("--context", type=_int_list, default=None,
                   help="positions in the state when decode is timed (default: the export's max_seq_len)")
    p.add_argument("--prefill", type=int, default=2048, help="prompt tokens for TTFT (capped at max_seq_len)")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps (default 64)")
    p.add_argument("--warmup", type=int, default=4, help="untimed decode steps before them (default 4; "
                   "torch-eager records its routing over them)")
    p.add_argument("--seed", type=int, default=0, help="seed of the rows' random prompts (default 0)")
    p.add_argument("--compare", type=_backends, default=[],
                   help="torch backends: torch-eager, torch-compile (mode default, one static graph per shape), "
                        "transformers (its DeepseekV4ForCausalLM on the same weights, dequantized)")
    p.add_argument("--no-iree", action="store_true",
                   help="time only the --compare backends (to split a long comparison over two runs)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="buffer size of the bandwidth copy (default 1024 on a GPU, 64 on local-*)")
    p.add_argument("--no-profile", action="store_true", help="skip the per-dispatch profiles (decode and prefill)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="write ms/step vs batch, one line per backend (matplotlib)")
    return p


def make_plan(args: argparse.Namespace, cfg: Any) -> Plan:
    """Check the arguments against the export (BenchError names the problem) and fix what to run."""
    notes: list[str] = []
    if args.steps <= 0 or args.warmup < 0:
        raise BenchError(f"--steps must be > 0 and --warmup >= 0, got {args.steps}/{args.warmup}")
    if args.no_iree and not args.compare:
        raise BenchError("--no-iree needs --compare: nothing else to time")
    if args.prefill <= 0:
        raise BenchError(f"--prefill must be > 0, got {args.prefill}")
    batches = args.batch or list(cfg.decode_batch_sizes)
    bad = [b for b in batches if b not in cfg.decode_batch_sizes]
    if bad:
        raise BenchError(f"batch size(s) {', '.join(map(str, bad))} not exported by {cfg.directory} "
                         f"(decode batch sizes: {', '.join(map(str, cfg.decode_batch_sizes))}); "
                         "re-export with --decode-batch-sizes")
    over_slots = [b for b in batches if b > cfg.n_slots]
    if over_slots:
        raise BenchError(f"batch size(s) {over_slots} exceed the export's n_slots {cfg.n_slots}")
    contexts = []
    need = args.warmup + args.steps + 1
    for c in args.context or [cfg.max_seq_len]:
        if c > cfg.max_seq_len:
            notes.append(f"context {c} skipped: over this export's max_seq_len {cfg.max_seq_len} "
                         "(re-export with --max-seq-len to measure it)")
        elif c < need:
            raise BenchError(f"context {c} leaves no prefill before {args.warmup}+{args.steps} decode steps "
                             f"(need at least {need})")
        else:
            contexts.append(c)
    if not contexts:
        raise BenchError(f"no context to measure: every --context is over max_seq_len {cfg.max_seq_len}")
    prefill = args.prefill
    if prefill > cfg.max_seq_len:
        notes.append(f"TTFT prompt capped at max_seq_len {cfg.max_seq_len} (asked {prefill})")
        prefill = cfg.max_seq_len
    chunk = max(cfg.prefill_min_tokens, min(cfg.prefill_max_tokens, prefill))
    return Plan(batches, contexts, prefill, args.steps, args.warmup, chunk, cfg.prefill_batch_sizes,
                cfg.n_slots, notes, args.seed)


def _stderr(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _free_torch_memory() -> None:
    """Give a finished torch backend's device memory back before the next one loads its weights."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_bench(args: argparse.Namespace, progress: Callable[[str], None] = _stderr) -> dict[str, Any]:
    """Measure everything the arguments ask for (one line per result to `progress`); returns the report."""
    from dsv4.contract.artifact import ExportConfig

    cfg = ExportConfig.load(args.export_dir)
    plan = make_plan(args, cfg)
    vocab = cfg.vocab_size
    iree_be = IreeBackend(args.export_dir, args.device)
    eng = iree_be.engine
    gpu = not args.device.startswith("local")
    mib = args.copy_mib or (1024 if gpu else 64)
    bw = copy_bandwidth(eng.module.device, mib << 20)
    progress(f"copy bandwidth {bw:.1f} GB/s ({mib} MiB device-to-device)")
    tensors = inventory(cfg, eng.parameters_paths)
    gpu_name = device_name(args.device)
    peak = datasheet_peak(gpu_name)

    def torch_backend(name: str) -> Backend:
        from dsv4.bench.torch_backends import TorchBackend, TransformersBackend

        try:
            if name == "transformers":
                return TransformersBackend(args.export_dir, args.device)
            return TorchBackend(args.export_dir, name, args.device, cfg.n_slots)
        except ValueError as e:  # no GPU for torch, a transformers without the model, ...
            raise BenchError(f"--compare {name}: {e}") from e

    # one torch backend in memory at a time (each holds its own copy of the weights: at Flash
    # dimensions 20 GB, transformers' dequantized one ~50 GB, beside the IREE module's)
    decode, ttft = [], []
    for name in ([] if args.no_iree else [None]) + list(args.compare):
        be = iree_be if name is None else torch_backend(name)
        ttft.append(measure_ttft(be, plan, vocab))
        progress(f"{be.name} TTFT {ttft[-1]['ttft_ms']:.2f} ms ({plan.prefill_tokens} tokens)")
        for c in plan.contexts:
            for b in plan.batches:
                row = measure(be, plan, b, c, vocab)
                decode.append(row)
                progress(f"{be.name} batch {b} context {c}: {row['ms_per_step']:.3f} ms/step, "
                         f"prefill {row['prefill_tokens_per_s']:.0f} tok/s")
        if name is None and iree_be.nonfinite_rows:
            progress(f"WARNING: the module returned non-finite logits in {iree_be.nonfinite_rows} row(s): "
                     "its timings are of a broken build")
        if name is not None:
            del be
            _free_torch_memory()

    if args.no_profile:
        profile: dict[str, Any] = {"available": False, "why": "--no-profile"}
        prefill_profile: dict[str, Any] = profile
    else:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="dsv4_bench_") as tmp:
            profile = dispatch_profile(eng, args.device, "decode", max(plan.batches), 1, plan.contexts[-1] - 1,
                                       plan.steps, Path(tmp))
            progress("per-dispatch profile of decode: " + ("done" if profile["available"] else profile["why"]))
            # prefill: one chunk of the TTFT prompt in every row of the widest exported prefill
            prefill_profile = dispatch_profile(eng, args.device, "prefill", max(plan.prefill_batch_sizes),
                                               plan.chunk, 0, plan.steps, Path(tmp))
            progress("per-dispatch profile of prefill: " + ("done" if prefill_profile["available"]
                                                             else prefill_profile["why"]))
    traffic = traffic_rows(cfg, tensors, decode, bw, peak)
    m = cfg.model
    return {
        "export": str(cfg.directory), "device": args.device, "export_id": cfg.export_id,
        "model": {"layers": m.get("num_hidden_layers"), "hidden": m.get("hidden_size"), "vocab": vocab,
                  "parameter_bytes": sum(t.nbytes for t in tensors), "activation_dtype": cfg.raw.get("activation_dtype"),
                  "routed_experts": m.get("n_routed_experts"), "experts_per_token": m.get("num_experts_per_tok"),
                  "max_seq_len": cfg.max_seq_len, "n_slots": cfg.n_slots},
        "settings": {k: v for k, v in asdict(plan).items() if k != "notes"},
        "copy_bandwidth_gbps": bw, "copy_mib": mib, "notes": plan.notes,
        "device_name": gpu_name, "datasheet_peak_tbps": peak,
        "decode": decode, "traffic": traffic, "ttft": ttft, "profile": profile, "prefill_profile": prefill_profile,
        "iree_nonfinite_rows": iree_be.nonfinite_rows,
    }


def print_table(rep: dict[str, Any], out: Any = None) -> None:
    m, s = rep["model"], rep["settings"]
    w = lambda *a: print(*a, file=out)  # noqa: E731
    w(f"export {rep['export']}  device {rep['device']}  {m['layers']} layers, hidden {m['hidden']}, "
      f"vocab {m['vocab']}, {m['parameter_bytes'] / 1e6:.1f} MB parameters, {m['activation_dtype']}")
    w(f"decode: {s['steps']} timed steps after {s['warmup']} warm-up, each row its own random prompt (seed "
      f"{s['seed']}) and its own argmax fed back; copy bandwidth {rep['copy_bandwidth_gbps']:.1f} GB/s "
      f"({rep['copy_mib']} MiB device-to-device, read+write)")
    peak = rep.get("datasheet_peak_tbps")
    w(f"datasheet peak: {peak} TB/s ({rep['device_name']})" if peak else
      f"datasheet peak: unknown for {rep.get('device_name') or 'this device (' + rep['device'] + ')'}; "
      "the % peak columns are empty")
    if rep.get("iree_nonfinite_rows"):
        w(f"WARNING: {rep['iree_nonfinite_rows']} row(s) of the IREE module's logits were not finite (a broken build)")
    w("")
    pc = lambda v: f"{v:>7.2f}%" if v is not None else f"{'-':>8}"  # noqa: E731
    opt = lambda v, f=".4f": "-" if v is None else format(v, f)  # noqa: E731
    w("% roofline: a step's bytes / bandwidth / measured ms; impl = as this export's lowering reads them (IREE "
      "rows only), rel = as the release format needs; layers = without the head")
    w(f"{'backend':<20} {'batch':>5} {'context':>7} {'ms/step':>9} {'tok/s':>10} {'prefill tok/s':>13} "
      f"{'copy impl':>8} {'copy rel':>8} {'peak impl':>9} {'peak rel':>8} {'peak rel layers':>15}")
    for r in rep["decode"]:
        x = r["roofline"]["release"]
        i = r["roofline"]["implementation"] or {"copy_pct": None, "peak_pct": None}
        w(f"{r['backend']:<20} {r['batch']:>5} {r['context']:>7} {r['ms_per_step']:>9.3f} {r['tokens_per_s']:>10.1f} "
          f"{r['prefill_tokens_per_s']:>13.0f} {pc(i['copy_pct'])} {pc(x['copy_pct'])} {pc(i['peak_pct']):>9} "
          f"{pc(x['peak_pct'])} {pc(x['peak_pct_layers']):>15}")
    w("")
    w(f"bytes per decode step ({m['routed_experts']} routed experts, top-{m['experts_per_token']}; experts = distinct "
      "routed experts per layer per step, measured by the named backend over its warm-up steps, and "
      "E(1-(1-k/E)^B) for uniform routing; gathered = the expert reads the lowering issues per layer)")
    w(f"{'batch':>5} {'context':>7} {'experts':>7} {'uniform':>7} {'gathered':>8} {'impl MB':>9} {'impl MB/layer':>13} "
      f"{'release MB':>10} {'rel MB/layer':>12} {'rel ms copy':>11} {'rel ms peak':>11}  measured by")
    for t in rep.get("traffic", []):
        i, x = t["implementation"], t["release"]
        w(f"{t['batch']:>5} {t['context']:>7} {opt(t['experts_distinct_measured'], '.1f'):>7} "
          f"{t['experts_distinct_uniform']:>7.1f} {t['experts_gathered']:>8} {i['total'] / 1e6:>9.3f} "
          f"{i['per_layer'] / 1e6:>13.3f} {x['total'] / 1e6:>10.3f} {x['per_layer'] / 1e6:>12.3f} "
          f"{x['copy_ms']:>11.4f} {opt(x['peak_ms']):>11}  "
          f"{t['experts_measured_by'] or '- (uniform expectation used)'}")
    w("")
    w(f"{'backend':<20} {'prompt':>6} {'TTFT ms':>9} {'prefill tok/s':>13}")
    for r in rep["ttft"]:
        w(f"{r['backend']:<20} {r['prompt_tokens']:>6} {r['ttft_ms']:>9.2f} {r['prefill_tokens_per_s']:>13.0f}")
    for kind, p in (("decode", rep["profile"]), ("prefill", rep.get("prefill_profile"))):
        if p is None:
            continue
        w("")
        for line in profile_lines(kind, p):
            w(line)
    for n in rep["notes"]:
        w(f"note: {n}")


def profile_lines(kind: str, p: dict[str, Any]) -> list[str]:
    """A dispatch_profile result as text: a heading line and its top dispatches."""
    if not p["available"]:
        return [f"per-dispatch profile of {kind}: unavailable ({p['why']})"]
    rows = f"batch {p['batch']}" + (f" x {p['tokens']} tokens" if kind != "decode" else "")
    out = [f"per-dispatch profile, {kind} {rows}, via {p['via']}, {p['calls']} calls: "
           f"{p['dispatches_per_step']:.0f} dispatches and {p['device_ms_per_step']:.3f} ms of dispatch time per call; top 10:"]
    out += [f"  {k['ms_per_step']:8.4f} ms {100 * k['share']:5.1f}% x{k['calls_per_step']:<4.0f} {k['name'][:100]}"
            for k in p["top"]]
    return out


def write_plot(rep: dict[str, Any], path: str) -> None:
    """ms/step vs batch, one line per backend (and context, when several were measured)."""
    try:
        import matplotlib
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'dsv4-iree[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rep["decode"]})
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=100)
    for be in dict.fromkeys(r["backend"] for r in rep["decode"]):
        for c in contexts:
            rows = sorted((r for r in rep["decode"] if r["backend"] == be and r["context"] == c), key=lambda r: r["batch"])
            label = be if len(contexts) == 1 else f"{be}, context {c}"
            ax.plot([r["batch"] for r in rows], [r["ms_per_step"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("decode ms/step")
    ax.set_title(f"{Path(rep['export']).name}: decode step time ({rep['device']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from dsv4.runtime.engine import EngineError

    try:
        rep = run_bench(args)
        if args.plot:
            write_plot(rep, args.plot)
    except (BenchError, EngineError) as e:
        print(f"dsv4 bench: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # --compare on a runtime-only install
        if (e.name or "").split(".")[0] not in ("torch", "matplotlib", "transformers"):
            raise
        print(f"dsv4 bench: error: {e.name} is not installed (--compare needs the 'export' extra, "
              "--plot and --compare transformers the 'bench' extra)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rep, indent=1))
    else:
        print_table(rep)
        if args.plot:
            print(f"plot: {args.plot}")
    return 0



if __name__ == "__main__":  # python -m dsv4.bench.speed OUT ... = dsv4 bench OUT ...
    sys.exit(main())
