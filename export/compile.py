"""Compile exported MLIR to IREE vmfb modules for our three targets.

Targets are plain data (``TARGETS``) so CI, benchmarks and the exporter CLI all agree on one set
of flags; the choices are measured in ``docs/export.md`` (Targets and flags; IREE 3.13 traps):

* ``gfx942`` (default, MI300): ``--iree-hal-target-device=hip --iree-rocm-target=gfx942``.
  ``--iree-hip-target`` no longer exists in compiler 3.13. We deliberately do NOT pass
  ``--iree-llvmgpu-enable-small-float-emulation``: our gfx942 FP8 weights are e4m3fnuz, for which
  the flag changes nothing (byte-identical ISA, hardware ``v_cvt_pk_f32_fp8``), while an OCP
  e4m3fn graph compiled with it silently becomes software conversion (~4x the VALU ops). Without
  the flag an accidental OCP FP8 graph fails loudly; add ``SMALL_FLOAT_EMULATION`` to
  ``extra_flags`` if you really mean it (``CompileError`` hints at it).
* ``llvm-cpu``: ``--iree-llvmcpu-target-cpu=host`` because CI builds and runs the artifact on the
  same machine; ``llvm-cpu:generic`` (or ``llvm-cpu:x86-64-v3``, any LLVM CPU name) builds a
  portable one. The 1 MiB stack limit is needed by top-k over bounded dynamic dims; pair it
  with the runtime flag ``--task_worker_stack_size=1048576`` (``dsv4.runtime.module``).
* ``cuda``: ``sm_89`` PTX (3.13 cannot target ``sm_90``: "missing GPU target"); the driver JITs it
  on Hopper. Override with ``cuda:sm_80``.
* ``--kernel mxfp4_linear_gathered=kernel`` (opt-in) makes GPU compiles add
  ``--iree-codegen-llvmgpu-use-reduction-vector-distribution=false``: that kernel is a reduction that
  reads the selected expert's bytes with ``tensor.extract``, which the ReductionVectorDistribution
  pipeline fails to distribute. The flag changes every reduction of the module, and with it the
  cuda shared-memory screen (tests/test_topk.py) flags 33 reduction kernels of the k512 graph that
  store and load shared memory without a barrier, so it is not a default. The default gathers the
  selected experts first (an f32 copy of every routed block's expert weight: 27 GB per Flash layer for a
  100-token prefill; docs/kernels.md, The lowering plan).

`check_target` rejects what cannot work before any tracing: unknown names, CUDA archs compiler
3.13 lacks (a table, with the advice to use sm_89), and anything else iree-compile refuses on a
four-line function (about 1 s: bad LLVM CPU names, unknown ROCm archs).

``name:arch`` replaces the target's architecture flag instead of appending a duplicate (duplicate
``cl`` flags are accepted and the last one wins, which is easy to misread in logs).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from dsv4.contract.artifact import TARGET_DRIVERS

__all__ = [
    "DEFAULT_TARGET",
    "SMALL_FLOAT_EMULATION",
    "TARGETS",
    "CompileError",
    "CompileResult",
    "Target",
    "compile_mlir",
    "resolve_target",
    "check_target",
    "target_names",
    "VmfbExecutable",
    "vmfb_executables",
]

SMALL_FLOAT_EMULATION = "--iree-llvmgpu-enable-small-float-emulation"
# GPU targets: reductions that gather (mxfp4_linear_gathered) fail in ReductionVectorDistribution; only
# added when that kernel is chosen (exporter.py)
GPU_REDUCTION_FLAG = "--iree-codegen-llvmgpu-use-reduction-vector-distribution=false"
# Every target: computations on the weights alone (the FP8 linears' decode for the decode entry
# points, transposes) run once in the module's initializer and stay resident, instead of once per
# call. IREE's default limit (per hoisted value) left Flash's FP8 decodes in the step: the decode of
# wq_b [32768, 1024] wrote a 134 MB f32 copy every decode step (2.3 of 26 ms on the H200). 512 MiB
# takes every dense FP8 linear of Flash and Pro but not an f32 copy of the head or a stack of experts.
HOIST_FLAG = "--iree-opt-const-expr-max-size-increase-threshold=536870912"
# GPU targets: IREE's stream scheduler with `debug` partitioning (commands in program order, no
# concurrent regions). With its default (min-peak-memory) and with max-concurrency, a Flash decode on
# cuda got layer 3's sparse attention output NaN in 2 of its 512 columns (every head) from the first
# HCA entry on (with max-concurrency not on every step). The same dispatches on the same inputs, run
# alone, are exact. Issuing the commands in order on one CUDA stream did not help, and a static screen
# finds no overlapping accesses inside a concurrent region, so the culprit is the other schedule's
# command order or transient layout; not pinned down. With `debug` the step is eager-close, and it
# was not slower on the H200 (docs/performance.md, GPU faults found and fixed). The CPU target keeps IREE's default:
# the llvm-cpu runs never showed it.
PARTITIONING_FLAG = "--iree-stream-partitioning-favor=debug"
# GPU targets: IREE's aggressive fusion (part of --iree-opt-level=O3) fuses producers into reductions,
# and its multi-use fusion puts a producer whose result is also stored into its consumers' dispatches:
# Flash-4 decode_bs1 499 -> 442 dispatches with the first (and the rms_norm kernel), 359 -> 325 with the
# second (docs/performance.md, Dispatches per step). gfx942's and cuda's code generation failed on some
# multi-use fusions ("failed to distribute"): the device sampler's x / T stored and fused into its row
# maximum, the MoE's shared masks and pairwise counts (which also hung); those sit behind fusion barriers
# or are the pair_rank kernel. llvm-cpu keeps IREE's default fusion: with these flags its decode entry
# points stopped agreeing bit for bit across batch sizes (tests/test_batch_invariance.py). Not here:
# `--iree-opt-outer-dim-concat` (decode_bs64 375 -> 335 dispatches, its strided `slow_memcpy` copies
# gone) made the H100 abort Flash-4's prefill_bs8 (`hal.device.queue.dealloca` ABORTED; docs/performance.md).
FUSION_FLAGS = ("--iree-dispatch-creation-enable-aggressive-fusion=true",
                "--iree-dispatch-creation-fuse-multi-use=true")
# GPU targets with measured tile choices: a transform-dialect library (export/tuning/<target>.mlir) whose
# `__kernel_config` sets the compilation_info of the kernels it matches before IREE picks its own. IREE
# 3.13's --iree-codegen-tuning-spec-path reaches the ROCm pipeline only (on cuda the pass runs with an
# empty path); this flag reaches every GPU pipeline. The cuda library's configs need mma.sync on bf16
# (sm_80 and later), hence `tuned_archs`; gfx942's holds the one-row gathered GEMV's config at the CDNA
# 64-lane wavefront. docs/kernels.md, Tuned tiles on cuda.
TUNING_FLAG = "--iree-codegen-transform-dialect-library"
TUNING_LIBRARIES = {name: str(Path(__file__).parent / "tuning" / f"{name}.mlir") for name in ("cuda", "gfx942")}


@dataclass(frozen=True)
class Target:
    """One compile target: the flags, and the runtime HAL driver that runs its vmfb."""

    name: str
    driver: str  # iree.runtime driver for the vmfb: "hip", "local-task", "cuda"
    base_flags: tuple[str, ...]
    arch_flag: str  # the flag `name:arch` overrides
    arch: str
    description: str = ""
    tuned_archs: tuple[str, ...] = ()  # archs that take the target's tuning library (TUNING_LIBRARIES)

    @property
    def flags(self) -> tuple[str, ...]:
        tuning = (f"{TUNING_FLAG}={TUNING_LIBRARIES[self.name]}",) if self.arch in self.tuned_archs else ()
        return (*self.base_flags, *tuning, f"{self.arch_flag}={self.arch}")

    @property
    def label(self) -> str:
        """'gfx942', or 'cuda:sm_80' when the arch differs from the registry default."""
        base = TARGETS.get(self.name)
        return self.name if base is not None and base.arch == self.arch else f"{self.name}:{self.arch}"

    def with_arch(self, arch: str) -> "Target":
        return replace(self, arch=arch)

    def with_devices(self, n: int) -> "Target":
        """This target for a module over n devices of its kind: ``--iree-hal-target-device=X`` becomes
        ``X[0]`` ... ``X[n-1]`` (devices ``__device_0`` ..., what iree-turbine's affinities name; runtime
        ordinal i), plus sharktank's raised affinity-solver bound (iree#21068: long chains of tied ops
        need more iterations than the default). n = 1 keeps the single-device flags."""
        if n == 1:
            return self
        dev = "--iree-hal-target-device="
        flags = []
        for f in self.base_flags:
            flags += [f"{f}[{i}]" for i in range(n)] if f.startswith(dev) else [f]
        return replace(self, base_flags=(*flags, "--iree-stream-affinity-solver-max-iterations=1024"))


TARGETS: dict[str, Target] = {
    "gfx942": Target(
        name="gfx942",
        driver=TARGET_DRIVERS["gfx942"],
        base_flags=("--iree-hal-target-device=hip", HOIST_FLAG, PARTITIONING_FLAG, *FUSION_FLAGS),
        arch_flag="--iree-rocm-target",
        arch="gfx942",
        description="AMD MI300 (ROCm/HIP); native FP8 is e4m3fnuz",
        tuned_archs=("gfx90a", "gfx942", "gfx950"),
    ),
    "llvm-cpu": Target(
        name="llvm-cpu",
        driver=TARGET_DRIVERS["llvm-cpu"],
        base_flags=(
            "--iree-hal-target-device=local",
            "--iree-hal-local-target-device-backends=llvm-cpu",
            "--iree-llvmcpu-stack-allocation-limit=1048576",
            HOIST_FLAG,
        ),
        arch_flag="--iree-llvmcpu-target-cpu",
        arch="host",
        description="this machine's CPU; use llvm-cpu:generic for a portable artifact",
    ),
    "cuda": Target(
        name="cuda",
        driver=TARGET_DRIVERS["cuda"],
        base_flags=("--iree-hal-target-device=cuda", HOIST_FLAG, PARTITIONING_FLAG, *FUSION_FLAGS),
        arch_flag="--iree-cuda-target",
        arch="sm_89",
        description="NVIDIA PTX; sm_90/sm_100 unsupported by compiler 3.13, sm_89 JITs on Hopper",
        tuned_archs=("sm_80", "sm_86", "sm_87", "sm_89", "sm_120", "a100", "ampere", "ada", "rtx4090"),
    ),
}

DEFAULT_TARGET = "gfx942"


def target_names() -> list[str]:
    return sorted(TARGETS)


def resolve_target(spec: "str | Target | None" = None) -> Target:
    """``"gfx942"``, ``"llvm-cpu:generic"``, ``"cuda:sm_80"`` or a Target -> Target.

    Raises ValueError naming the valid targets, so a typo in a CLI flag is self-explaining."""
    if isinstance(spec, Target):
        return spec
    spec = DEFAULT_TARGET if spec is None else spec
    name, _, arch = spec.partition(":")
    try:
        target = TARGETS[name]
    except KeyError:
        raise ValueError(
            f"unknown compile target {spec!r}; valid targets: {', '.join(target_names())} "
            f"(optionally with ':arch', e.g. 'cuda:sm_80', 'llvm-cpu:generic')"
        ) from None
    if _ and not arch:
        raise ValueError(f"empty architecture in target {spec!r}")
    return target.with_arch(arch) if arch else target


# CUDA archs compiler 3.13 accepts (docs/export.md, IREE 3.13 traps: sm_90/sm_100 give "missing GPU target" after the
# whole compile; hopper/h100 are unknown names)
CUDA_ARCHS = ("sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_120",
              "a100", "ampere", "ada", "turing", "rtx4090")
_PREFLIGHT_MLIR = """func.func @preflight(%a: tensor<4xf32>) -> tensor<4xf32> {
  %0 = arith.mulf %a, %a : tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""
_checked: set[tuple[str, str]] = set()


def check_target(spec: "str | Target") -> Target:
    """Resolve ``spec`` and prove iree-compile accepts it (a four-line function, ~1 s, once per
    process); ValueError naming what works otherwise. Call it before tracing."""
    import tempfile

    tgt = resolve_target(spec)
    if tgt.name == "cuda" and tgt.arch not in CUDA_ARCHS:
        raise ValueError(f"cuda arch {tgt.arch!r} is not supported by iree-compile 3.13 (sm_90/sm_100 fail "
                         f"with 'missing GPU target'); use one of {', '.join(CUDA_ARCHS)}: sm_89 PTX runs on "
                         "Hopper (H100/H200), the driver JIT-compiles it (the default: --target cuda)")
    if (tgt.name, tgt.arch) in _checked:
        return tgt
    with tempfile.TemporaryDirectory(prefix="dsv4_preflight_") as d:
        try:
            compile_mlir(_PREFLIGHT_MLIR, tgt, Path(d) / "preflight.vmfb")
        except CompileError as e:
            first = e.summary.splitlines()[1].strip() if len(e.summary.splitlines()) > 1 else e.summary
            hint = {"llvm-cpu": "an LLVM CPU name such as host, generic, x86-64-v3, znver4, skylake-avx512",
                    "gfx942": "an AMD GPU arch such as gfx942, gfx90a, gfx950, gfx1100",
                    "cuda": ", ".join(CUDA_ARCHS)}[tgt.name]
            raise ValueError(f"target {tgt.label!r} is refused by iree-compile: {first}; the arch must be "
                             f"{hint}") from None
    _checked.add((tgt.name, tgt.arch))
    return tgt


@dataclass(frozen=True)
class CompileResult:
    path: Path
    seconds: float
    flags: tuple[str, ...]
    target: str = ""


class CompileError(RuntimeError):
    """iree-compile failed. The message is short (target, first error diagnostics, offending ops);
    the complete compiler output is in ``log_path``."""

    def __init__(
        self,
        target: str,
        summary: str,
        *,
        log_path: Path | None,
        ops: Sequence[str] = (),
        returncode: int | None = None,
    ):
        self.target = target
        self.summary = summary
        self.log_path = log_path
        self.ops = tuple(ops)
        self.returncode = returncode
        super().__init__(summary)


_OP_PATTERNS = (
    re.compile(r"'([A-Za-z_][\w$]*(?:\.[\w$]+)+)' op\b"),  # verifier: 'arith.addf' op ...
    re.compile(r"operation '([\w$.]+)'"),  # failed to legalize operation 'torch.operator'
    re.compile(r"for operation: ([\w$.]+)"),  # LLVM Translation failed for operation: x.y
    re.compile(r"custom op '([\w$.]+)'"),  # parser: custom op 'foo.bar' is unknown
    re.compile(r"\"([A-Za-z_]\w*(?:\.\w+)+)\"\("),  # printed generic op: "torch.operator"(...)
    re.compile(r"<\{name = \"([\w.]+)\"\}>"),  # torch.operator's payload name
)
_MAX_LINE = 240


def _diagnostics_of(raw: str) -> str:
    """The 'Diagnostics:' section of a CompilerToolError message (or everything)."""
    start = raw.find("Diagnostics:\n")
    end = raw.find("\nInvoked with:")
    if start >= 0:
        return raw[start + len("Diagnostics:\n") : end if end > start else None]
    return raw


_DIAG_LINE = re.compile(r"^(?:.*?:\d+:\d+:\s*|<unknown>:0:\s*)?(error|warning|note|remark):")


def _summarize(diags: str, *, max_errors: int = 3) -> tuple[list[str], list[str]]:
    """First error diagnostics (each with its source-snippet lines) and the op names they name."""
    lines = diags.splitlines()
    picked: list[str] = []
    ops: list[str] = []
    n_err = total_err = 0
    for i, line in enumerate(lines):
        m = _DIAG_LINE.match(line)
        if not m or m.group(1) != "error":
            continue
        total_err += 1
        if n_err >= max_errors:
            continue
        n_err += 1
        picked.append(_clip(line.strip()))
        for pat in _OP_PATTERNS:
            for om in pat.finditer(line):
                if om.group(1) not in ops:
                    ops.append(om.group(1))
        for nxt in lines[i + 1 : i + 3]:  # the source line and the caret under it
            if not nxt.strip() or _DIAG_LINE.match(nxt):
                break
            picked.append("    " + _clip(nxt.rstrip()))
    if total_err > n_err:
        picked.append(f"(+{total_err - n_err} more errors)")
    return picked, ops


_FRAME = re.compile(r"^\s*#\d+ 0x[0-9a-fA-F]+ (.*)$")
_HANDLER_FRAME = re.compile(r"PrintStackTrace|RunSignalHandlers|SignalHandler|libc\.so|^\(")


def _crash_frames(raw: str, n: int = 2) -> list[str]:
    """The first ``n`` stack frames below LLVM's signal handler in a crash dump."""
    frames = [m.group(1) for m in map(_FRAME.match, raw.splitlines()) if m]
    return [_clip(f) for f in frames if not _HANDLER_FRAME.search(f)][:n]


def _first_lines(diags: str, n: int = 2) -> list[str]:
    """The first ``n`` distinct non-empty lines, plus an ``LLVM ERROR`` line when there is one."""
    out: list[str] = []
    for line in diags.splitlines():
        line = line.strip()
        if line and line not in out and (len(out) < n or line.startswith("LLVM ERROR")):
            out.append(_clip(line))
    return out


def _clip(s: str) -> str:
    return s if len(s) <= _MAX_LINE else s[: _MAX_LINE - 5] + " ..."


def _as_input(mlir: Any) -> tuple[str, str | bytes, str]:
    """Normalize the input: ('file', path, label) or ('text', text, label)."""
    if isinstance(mlir, Path):
        return "file", str(mlir), str(mlir)
    if isinstance(mlir, bytes):
        return "text", mlir, "<bytes>"
    if isinstance(mlir, str):
        if "\n" not in mlir and len(mlir) < 4096 and os.path.isfile(mlir):
            return "file", mlir, mlir
        return "text", mlir, "<text>"
    if hasattr(mlir, "mlir_module"):  # iree.turbine.aot.ExportOutput
        return "text", str(mlir.mlir_module), "<ExportOutput>"
    raise TypeError(f"compile_mlir: expected a path, MLIR text/bytes or ExportOutput, got {type(mlir)}")


def compile_mlir(
    mlir_path_or_text: "str | Path | bytes | Any",
    target: "str | Target | None" = DEFAULT_TARGET,
    output_path: "str | Path | None" = None,
    extra_flags: Sequence[str] = (),
    log_path: "str | Path | None" = None,
) -> CompileResult:
    """Compile MLIR (a path, text/bytecode, or a turbine ExportOutput) to ``output_path`` (.vmfb).

    Raises ``CompileError`` (short message, full log in ``log_path``, default ``<output>.log``)
    or ValueError for an unknown target. ``extra_flags`` come last, so they override same-named
    target flags."""
    from iree.compiler import compile_file, compile_str
    from iree.compiler.tools.binaries import CompilerToolError

    tgt = resolve_target(target)
    kind, src, label = _as_input(mlir_path_or_text)
    if output_path is None:
        if kind != "file":
            raise ValueError("compile_mlir: output_path is required when compiling MLIR text")
        output_path = Path(src).with_suffix(f".{tgt.name}.vmfb")
    out = Path(output_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path) if log_path is not None else out.with_name(out.name + ".log")
    flags = (*tgt.flags, *extra_flags)
    t0 = time.perf_counter()
    try:
        if kind == "file":
            compile_file(src, output_file=str(out), extra_args=list(flags))
        else:
            compile_str(src, output_file=str(out), extra_args=list(flags))
    except CompilerToolError as e:
        raw = str(e)
        m = re.search(r"Error code: (-?\d+)", raw)
        rc = int(m.group(1)) if m else None
        log_path.write_text(raw)
        if kind == "text":
            # Keep the input beside the log; diagnostics refer to it as <stdin>/-.
            in_path = out.with_name(out.name + ".input.mlir")
            in_path.write_bytes(src if isinstance(src, bytes) else src.encode())
            label = f"{label} (saved as {in_path})"
        picked, ops = _summarize(_diagnostics_of(raw))
        if rc is not None and (rc < 0 or rc > 128):
            sig = -rc if rc < 0 else rc - 128
            head = f"iree-compile crashed (signal {sig}) for target '{tgt.label}' on {label}"
        else:
            head = f"iree-compile failed for target '{tgt.label}' on {label}"
        if not picked and rc is not None and (rc < 0 or rc > 128):
            picked = [f"crashed in: {f}" for f in _crash_frames(raw)]
        if not picked:  # no MLIR diagnostic (e.g. an LLVM option error): its first lines
            picked = _first_lines(_diagnostics_of(raw))
        parts = [head + ":"]
        parts += ["  " + p for p in (picked or ["(the compiler printed nothing)"])]
        if ops:
            parts.append(f"  offending op(s): {', '.join(ops)}")
        if SMALL_FLOAT_EMULATION in raw and SMALL_FLOAT_EMULATION not in flags:
            parts.append(
                "  hint: OCP fp8 (e4m3fn/e5m2) is not native on gfx942; convert weights to "
                f"e4m3fnuz, or pass extra_flags=[{SMALL_FLOAT_EMULATION!r}] (slow software path)"
            )
        if tgt.name == "cuda" and "unrealized_conversion_cast" in raw:
            parts.append(
                "  hint: compiler 3.13's CUDA backend cannot lower fp8/e8m0 -> f32 conversions "
                "(e4m3fn, e4m3fnuz, e8m0fnu; the emulation flag does not help); keep such tensors "
                "as uint8 and decode with a 256-entry LUT gather or bit ops"
            )
        parts.append(f"  flags: {' '.join(flags)}")
        parts.append(f"  full compiler log: {log_path}")
        raise CompileError(tgt.name, "\n".join(parts), log_path=log_path, ops=ops, returncode=rc) from None
    seconds = time.perf_counter() - t0
    if log_path.exists():
        log_path.unlink()
    return CompileResult(path=out, seconds=seconds, flags=flags, target=tgt.label)


# ------------------------------------------------------------------------------------------------
# vmfb inspection: which device code is really inside (CI checks without the hardware)
# ------------------------------------------------------------------------------------------------

# ELF e_flags & 0xff (EF_AMDGPU_MACH) -> arch; each value read back from a 3.13 compile.
_AMDGPU_MACH = {
    0x030: "gfx908",
    0x03F: "gfx90a",
    0x04C: "gfx942",
    0x04F: "gfx950",
    0x041: "gfx1100",
    0x046: "gfx1101",
    0x048: "gfx1200",
    0x04E: "gfx1201",
}
EM_AMDGPU = 224
EM_X86_64 = 62
EM_AARCH64 = 183


@dataclass(frozen=True)
class VmfbExecutable:
    """One executable in a vmfb (a zip whose members are module.fb + one file per executable)."""

    entry: str  # e.g. "module_linked_rocm_hsaco_fb.fb", "..._embedded_elf_x86_64.so"
    format: str  # "rocm-hsaco-fb" | "embedded-elf" | "cuda-nvptx-fb" | "other"
    size: int
    elf_machine: int | None = None  # e_machine of the embedded ELF (224 = AMDGPU)
    gpu_arch: str | None = None  # "gfx942" (from the HSACO's e_flags) or "sm_89" (PTX .target)


def vmfb_executables(path: "str | Path") -> list[VmfbExecutable]:
    """List the device executables in a vmfb by opening its zip container and the embedded
    ELF/PTX, so a test can prove a gfx942 artifact holds AMDGPU code for gfx942 (not just
    that the compiler exited 0)."""
    import struct
    import zipfile

    out: list[VmfbExecutable] = []
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if info.filename == "module.fb":
                continue
            data = z.read(info)
            name = info.filename
            fmt = (
                "rocm-hsaco-fb" if "rocm_hsaco_fb" in name
                else "embedded-elf" if "embedded_elf" in name
                else "cuda-nvptx-fb" if "cuda_nvptx_fb" in name
                else "other"
            )
            machine = arch = None
            at = data.find(b"\x7fELF")
            if at >= 0 and len(data) >= at + 52 and data[at + 4] == 2:  # ELFCLASS64
                machine = struct.unpack_from("<H", data, at + 18)[0]
                if machine == EM_AMDGPU:
                    flags = struct.unpack_from("<I", data, at + 48)[0]
                    arch = _AMDGPU_MACH.get(flags & 0xFF, f"amdgpu-mach-0x{flags & 0xFF:x}")
            m = re.search(rb"\.target (sm_\d+)", data)
            if m and arch is None:
                arch = m.group(1).decode()
            out.append(VmfbExecutable(name, fmt, info.file_size, machine, arch))
    return out
