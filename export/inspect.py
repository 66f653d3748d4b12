"""What an export's entry points dispatch, read from the compiler's IR and the compiled code objects
(`dsv4 inspect OUT`): no GPU needed, and no torch.

For one target of an export made with ``--keep-mlir``:

1. ``iree-compile model.mlir <the flags config.json records for the target> --compile-to=executable-sources``
   gives one module holding every dispatch's source (a ``hal.executable`` per dispatch, its linalg ops on
   tensors) and the host program, whose ``stream.cmd.dispatch`` ops are the calls: counted per function,
   they are the dispatches per call (the same count as ``--compile-to=stream``: the host program does not
   change between the two phases).
2. ``iree-opt`` rewrites the named linalg ops (matmul, batch_matmul, fill, transpose, ...) as
   ``linalg.generic``, so every op carries its indexing maps and iterator types: the iteration space
   comes from the operand shapes, and a contraction (a reduction with two operands indexed by the
   reduced dimension and a multiply-add body) counts 2 FLOPs per point of its iteration space; every
   other op counts its body's arithmetic ops per point. Bytes are the tensors each dispatch loads from
   and stores to its bindings (what the IR moves; a gather, ``tensor.extract`` in a body, counts its
   whole table, so its bytes are an upper bound). A dynamic size (``?``, the prefill's token count) is
   taken as ``rows``.
3. The code objects in the export's vmfb (compiled from the same MLIR with the same flags) say whether
   each kernel uses the matrix instructions: ``v_mfma``/``v_smfmac``/``v_wmma`` in the AMDGPU
   disassembly (``llvm-objdump-19``, Debian's llvm-19), ``mma``/``wgmma`` in the PTX of cuda. Kernels
   are matched to dispatches by name (the dispatch's ``hal.executable.export`` symbol).

IREE names a dispatch by its most expensive op: ``<fn>_dispatch_<n>_<kind>_<loop ranges>_<types>``, e.g.
``prefill_bs1$async_dispatch_12_matmul_like_Dx4096x512_bf16xbf16xf32`` (``D``: dynamic); the kind
and the shape in the report are those.
"""

from __future__ import annotations

import collections
import math
import re
import shutil
import struct
import subprocess
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

__all__ = [
    "DispatchInfo",
    "Dispatch",
    "EntryReport",
    "InspectReport",
    "MATRIX_KINDS",
    "parse_sources",
    "build_report",
    "kernel_matrix_ops",
    "disassembler",
    "amdgpu_code_objects",
    "gfx942_disassembly",
    "ptx_kernels",
    "inspect_export",
    "format_report",
]

# IREE's dispatch kinds whose root op is a contraction (the report's "matmul" rows)
MATRIX_KINDS = ("matmul", "matmul_like", "batch_matmul", "batch_matmul_like", "matmul_transpose_b",
                "batch_matmul_transpose_b", "matvec", "matvec_like", "vecmat", "vecmat_like", "contract",
                "conv", "attention")

# bytes per element of the element types our modules use (i1 is stored as a byte)
_ELEM_BYTES = {
    "i1": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "index": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
    "i4": 0.5, "f4E2M1FN": 0.5, "f6E2M3FN": 0.75, "f6E3M2FN": 0.75,
    "f8E4M3FN": 1, "f8E4M3FNUZ": 1, "f8E5M2": 1, "f8E5M2FNUZ": 1, "f8E4M3B11FNUZ": 1, "f8E8M0FNU": 1,
}
# ops of a linalg body that count as arithmetic, besides every math.* op (casts, constants, selects and
# index ops do not)
_FLOP_OPS = {
    "arith.addf", "arith.subf", "arith.mulf", "arith.divf", "arith.remf", "arith.negf", "arith.maximumf",
    "arith.minimumf", "arith.maxnumf", "arith.minnumf", "arith.addi", "arith.subi", "arith.muli",
    "arith.divsi", "arith.divui", "arith.remsi", "arith.remui", "arith.maxsi", "arith.minsi", "arith.maxui",
    "arith.minui", "arith.cmpf", "arith.cmpi",
}
_FMA_OPS = {"math.fma"}  # 2 FLOPs each

_NAME_DIMS = re.compile(r"^[0-9D]+(?:x[0-9D]+)*$")
_DISPATCH_NAME = re.compile(r"_dispatch_\d+(?:_(.*))?$")
_MAP_ALIAS = re.compile(r"^(#map\d*) = affine_map<(.*)>\s*$")
_GENERIC = re.compile(r"^(\s*)(?:%[\w:#]+ = )?linalg\.generic \{(.*)\}\s+(?:ins\((.*?)\)\s+)?outs\((.*?)\)\s*(?:attrs = .*)?\{\s*$")
_OTHER_OP = re.compile(r"=\s+\"?((?:linalg|iree_linalg_ext|iree_codegen|iree_gpu|iree_encoding)\.[\w.]+)")
_BODY_OP = re.compile(r"=\s+\"?([a-z_]+\.[\w.]+)")
_LOAD = re.compile(r"iree_tensor_ext\.dispatch\.tensor\.load\b.*->\s*(tensor<[^>]*>)\s*$")
_STORE = re.compile(r"iree_tensor_ext\.dispatch\.tensor\.store\b.*?:\s*(tensor<[^>]*>)\s*->")
_DISPATCH_OP = re.compile(r"\bstream\.cmd\.dispatch\s+(?:\{\s*)?@([\w$.-]+)::@([\w$.-]+)::@([\w$.-]+)")
_EXPORT = re.compile(r"\bhal\.executable\.export\s+(?:public\s+|private\s+)?@([\w$.-]+)")
_DEV_FUNC = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([\w$.-]+)\(")
_HOST_FUNC = re.compile(r"^\s*util\.func\s+(?:public\s+|private\s+)?@([\w$.\"-]+)")
_INITIALIZER = re.compile(r"^\s*util\.initializer\b")


# ------------------------------------------------------------------------------------------------
# MLIR text: types, affine maps, linalg ops
# ------------------------------------------------------------------------------------------------

def tensor_type(text: str) -> tuple[tuple[int | None, ...], str]:
    """``tensor<?x256xbf16>`` -> ((None, 256), "bf16"); a scalar type -> ((), type). An encoding after
    the element type (``tensor<4xf32, #enc>``) is dropped."""
    text = text.strip()
    if not text.startswith("tensor<"):
        return (), text
    body = text[len("tensor<"):-1].split(",")[0].strip()
    *dims, elem = body.split("x") if body else [""]
    if elem.startswith("complex<") or not elem:
        raise ValueError(f"unsupported tensor type {text!r}")
    return tuple(None if d == "?" else int(d) for d in dims), elem


def elem_bytes(elem: str) -> float:
    try:
        return _ELEM_BYTES[elem]
    except KeyError:
        raise ValueError(f"unknown element type {elem!r} (its size is not known to dsv4 inspect)") from None


def tensor_bytes(text: str, rows: int) -> tuple[float, bool]:
    """Bytes of a tensor type with every dynamic size taken as ``rows``; and whether one was dynamic."""
    shape, elem = tensor_type(text)
    n = math.prod(rows if d is None else d for d in shape)
    return n * elem_bytes(elem), any(d is None for d in shape)


def split_top(text: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` outside of (), [], <>."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([<{":
            depth += 1
        elif ch in ")]>}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


@dataclass(frozen=True)
class AffineMap:
    n_dims: int
    results: tuple[str, ...]  # each result expression as printed: "d0", "0", "d0 + d1"

    @classmethod
    def parse(cls, text: str) -> "AffineMap":
        """``(d0, d1, d2)[s0] -> (d0, d2)`` (the inside of ``affine_map<...>``)."""
        m = re.match(r"^\s*\(([^)]*)\)\s*(?:\[[^\]]*\])?\s*->\s*\((.*)\)\s*$", text)
        if m is None:
            raise ValueError(f"cannot read affine map {text!r}")
        dims = [d.strip() for d in m.group(1).split(",") if d.strip()]
        return cls(len(dims), tuple(split_top(m.group(2))))

    def dim(self, i: int) -> int | None:
        """The loop index result i is, when it is a plain ``dK``."""
        m = re.fullmatch(r"d(\d+)", self.results[i])
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class LinalgOp:
    """A ``linalg.generic``: its maps, iterator types, operand types and its body's op names."""

    maps: tuple[AffineMap, ...]
    iterators: tuple[str, ...]  # "parallel" | "reduction"
    inputs: tuple[str, ...]  # operand types as printed
    outputs: tuple[str, ...]
    body: tuple[str, ...]  # op names in the body, e.g. ("arith.extf", "arith.mulf", "arith.addf")

    def ranges(self, rows: int) -> tuple[list[int], bool]:
        """The loop ranges (a dynamic size as ``rows``) and whether any was dynamic. A loop that no
        operand indexes directly (only through an expression) is an error."""
        ranges: list[int | None] = [None] * len(self.iterators)
        dynamic = [False] * len(self.iterators)
        for typ, amap in zip((*self.inputs, *self.outputs), self.maps):
            shape, _ = tensor_type(typ)
            for j, size in enumerate(shape):
                k = amap.dim(j)
                if k is None:
                    continue
                if size is not None:
                    ranges[k], dynamic[k] = size, False
                elif ranges[k] is None:
                    ranges[k], dynamic[k] = rows, True
        if any(r is None for r in ranges):
            raise ValueError(f"a loop of a linalg.generic is not a plain dimension of any operand: {self.maps}")
        return [int(r) for r in ranges], any(dynamic)

    def operands_of_reduction(self) -> list[int]:
        """Inputs whose map reads a reduction loop."""
        red = {k for k, it in enumerate(self.iterators) if it == "reduction"}
        out = []
        for i in range(len(self.inputs)):
            amap = self.maps[i]
            if any(amap.dim(j) in red for j in range(len(amap.results))):
                out.append(i)
        return out

    @property
    def is_contraction(self) -> bool:
        """A reduction over two operands with a multiply-add body: a matmul in any layout."""
        if "reduction" not in self.iterators or len(self.operands_of_reduction()) < 2:
            return False
        ops = set(self.body)
        return bool(ops & {"arith.mulf", "arith.muli"}) and bool(ops & {"arith.addf", "arith.addi"}) \
            or bool(ops & _FMA_OPS)

    def flops(self, rows: int) -> int:
        ranges, _ = self.ranges(rows)
        points = math.prod(ranges)
        if self.is_contraction:
            return 2 * points
        per_point = sum(2 if o in _FMA_OPS else 1 for o in self.body if o in _FLOP_OPS or o.startswith("math."))
        return per_point * points

    def rows_cols(self, rows: int) -> tuple[int | None, int | None]:
        """A contraction's M and N: the parallel loops that only the first / only the second operand
        (and the result) index; batch loops are in all three. None: a dynamic size."""
        a, b = self.operands_of_reduction()[:2]
        ranges, _ = self.ranges(rows)

        def dims(i: int) -> set[int]:
            amap = self.maps[i]
            return {k for j in range(len(amap.results)) if (k := amap.dim(j)) is not None}

        par = {k for k, it in enumerate(self.iterators) if it == "parallel"}
        out = dims(len(self.inputs))
        da, db = dims(a), dims(b)
        m_dims, n_dims = (par & da & out) - db, (par & db & out) - da
        dyn_loops = self._dynamic_loops()
        m = None if m_dims & dyn_loops else math.prod(ranges[k] for k in m_dims)
        n = None if n_dims & dyn_loops else math.prod(ranges[k] for k in n_dims)
        return m, n

    def _dynamic_loops(self) -> set[int]:
        static, dyn = set(), set()
        for typ, amap in zip((*self.inputs, *self.outputs), self.maps):
            shape, _ = tensor_type(typ)
            for j, size in enumerate(shape):
                k = amap.dim(j)
                if k is not None:
                    (dyn if size is None else static).add(k)
        return dyn - static


def _parse_generic(header: re.Match, body: list[str], aliases: Mapping[str, AffineMap]) -> LinalgOp:
    attrs, ins, outs = header.group(2), header.group(3), header.group(4)
    m = re.search(r"indexing_maps = \[(.*?)\]\s*,\s*iterator_types", attrs)
    if m is None:
        raise ValueError(f"linalg.generic without indexing_maps: {attrs[:200]}")
    maps = []
    for item in split_top(m.group(1)):
        if item.startswith("affine_map<"):
            maps.append(AffineMap.parse(item[len("affine_map<"):-1]))
        elif item in aliases:
            maps.append(aliases[item])
        else:
            raise ValueError(f"unknown affine map {item!r}")
    it = re.search(r"iterator_types = \[(.*?)\]", attrs)
    iterators = tuple(re.findall(r"(parallel|reduction)", it.group(1))) if it else ()

    def types(operands: str | None) -> tuple[str, ...]:
        if not operands or " : " not in operands:
            return ()
        return tuple(split_top(operands.split(" : ", 1)[1]))

    body_ops = tuple(b.group(1) for b in map(_BODY_OP.search, body) if b)
    return LinalgOp(tuple(maps), iterators, types(ins), types(outs), body_ops)


# ------------------------------------------------------------------------------------------------
# The executable-sources module: dispatches and the host program's calls
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DispatchInfo:
    """One dispatch (a ``hal.executable.export``), from its source and its name."""

    name: str
    kind: str  # IREE's name for its root op: matmul_like, contract, elementwise, reduction, ...
    shape: str  # the root op's loop ranges as named ("D": dynamic)
    types: str
    flops: int  # every op (a dynamic size taken as rows)
    matmul_flops: int  # the contractions' share of flops
    bytes: int  # tensors loaded from and stored to its bindings
    dynamic: bool  # a size in its IR is dynamic (taken as rows)
    contraction: bool  # it holds a contraction
    multi_row: bool  # its largest contraction has more than one row and column (M > 1 and N > 1)
    gather: bool  # a body reads with tensor.extract: bytes count the whole table
    other_ops: tuple[str, ...] = ()  # ops whose FLOPs are not counted (not a linalg.generic)

    @property
    def is_matmul(self) -> bool:
        return self.contraction or self.kind in MATRIX_KINDS


def name_parts(name: str) -> tuple[str, str, str]:
    """``main$async_dispatch_12_matmul_like_16x4096x512_bf16`` -> ("matmul_like", "16x4096x512", "bf16")."""
    m = _DISPATCH_NAME.search(name)
    if m is None or not m.group(1):
        return "", "", ""
    tokens = m.group(1).split("_")
    for i, tok in enumerate(tokens):
        if _NAME_DIMS.match(tok):
            return "_".join(tokens[:i]), tok, "_".join(tokens[i + 1:])
    return "_".join(tokens), "", ""


@dataclass
class SourcesIR:
    """What parse_sources reads: each dispatch's ops and the calls of each host function in order."""

    ops: dict[str, list[LinalgOp]]  # export name -> its linalg.generic ops
    other_ops: dict[str, list[str]]  # export name -> other linalg-family ops (not counted as FLOPs)
    tensors: dict[str, list[tuple[str, str]]]  # export name -> [("load" | "store", tensor type)]
    calls: dict[str, list[str]]  # host function -> export names of its stream.cmd.dispatch ops

    def dispatch(self, name: str, rows: int) -> DispatchInfo:
        kind, shape, types = name_parts(name)
        ops = self.ops.get(name, [])
        flops = mm = 0
        dynamic = gather = False
        best: tuple[int, bool] = (-1, False)
        for op in ops:
            f = op.flops(rows)
            flops += f
            dynamic |= op.ranges(rows)[1]
            gather |= "tensor.extract" in op.body
            if op.is_contraction:
                mm += f
                if f > best[0]:
                    m, n = op.rows_cols(rows)
                    best = (f, (m is None or m > 1) and (n is None or n > 1))
        nbytes = 0.0
        for _, typ in self.tensors.get(name, []):
            b, dyn = tensor_bytes(typ, rows)
            nbytes += b
            dynamic |= dyn
        return DispatchInfo(name=name, kind=kind, shape=shape, types=types, flops=flops, matmul_flops=mm,
                            bytes=int(nbytes), dynamic=dynamic, contraction=best[0] >= 0, multi_row=best[1],
                            gather=gather, other_ops=tuple(sorted(set(self.other_ops.get(name, [])))))


def parse_sources(text: str) -> SourcesIR:
    """Read an ``--compile-to=executable-sources`` module whose named linalg ops were generalized."""
    aliases: dict[str, AffineMap] = {}
    ops: dict[str, list[LinalgOp]] = collections.defaultdict(list)
    other: dict[str, list[str]] = collections.defaultdict(list)
    tensors: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    calls: dict[str, list[str]] = {}
    dev_func: str | None = None
    host_func: str | None = None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("#map"):
            m = _MAP_ALIAS.match(line)
            if m:
                aliases[m.group(1)] = AffineMap.parse(m.group(2))
            continue
        if (m := _DEV_FUNC.match(line)) is not None:
            dev_func, host_func = m.group(1), None
            continue
        if (m := _HOST_FUNC.match(line)) is not None:
            host_func, dev_func = m.group(1).strip('"'), None
            calls.setdefault(host_func, [])
            continue
        if _INITIALIZER.match(line):
            host_func, dev_func = "<initializer>", None
            calls.setdefault(host_func, [])
            continue
        if host_func is not None:
            if (m := _DISPATCH_OP.search(line)) is not None:
                calls[host_func].append(m.group(3))
            continue
        if dev_func is None:
            continue
        if (m := _GENERIC.match(line)) is not None:
            indent = m.group(1)
            body = []
            while i < len(lines) and not (lines[i].startswith(indent + "}") and not lines[i].startswith(indent + " ")):
                body.append(lines[i])
                i += 1
            ops[dev_func].append(_parse_generic(m, body, aliases))
            continue
        if (m := _LOAD.search(line)) is not None:
            tensors[dev_func].append(("load", m.group(1)))
        elif (m := _STORE.search(line)) is not None:
            tensors[dev_func].append(("store", m.group(1)))
        elif (m := _OTHER_OP.search(line)) is not None and m.group(1) != "linalg.yield":
            other[dev_func].append(m.group(1))
    return SourcesIR(dict(ops), dict(other), dict(tensors), calls)


# ------------------------------------------------------------------------------------------------
# Code objects: which kernels use the matrix instructions
# ------------------------------------------------------------------------------------------------

_AMDGPU_MATRIX = re.compile(r"\b(v_mfma_\w+|v_smfmac_\w+|v_wmma_\w+|v_swmmac_\w+)")
_PTX_MATRIX = re.compile(r"\b(wgmma\.[\w.]+|mma\.[\w.]+)")
_OBJDUMP_LABEL = re.compile(r"^[0-9a-fA-F]+ <(.+)>:\s*$")
_OBJDUMP_NAMES = ("llvm-objdump-19", "llvm-objdump-20", "llvm-objdump-21", "llvm-objdump-18")


def disassembler() -> str:
    """The llvm-objdump that reads gfx942 code objects; an error naming the package otherwise."""
    for name in _OBJDUMP_NAMES:
        tool = shutil.which(name)
        if tool is not None:
            return tool
    raise ValueError("llvm-objdump-19 is not installed; the gfx942 code objects are disassembled with it "
                     "(Debian/Ubuntu: apt-get install llvm-19; .ci/run installs it)")


def amdgpu_code_objects(data: bytes) -> Iterator[bytes]:
    """Every ELF64 image inside a vmfb member (its end: the section header table, which the linker
    puts last)."""
    at = data.find(b"\x7fELF")
    while at >= 0:
        if len(data) < at + 64 or data[at + 4] != 2:  # not ELFCLASS64: not a code object
            at = data.find(b"\x7fELF", at + 4)
            continue
        shoff = struct.unpack_from("<Q", data, at + 0x28)[0]
        shentsize, shnum = struct.unpack_from("<HH", data, at + 0x3A)
        end = at + shoff + shentsize * shnum
        if shoff == 0 or end > len(data):
            end = len(data)
        yield data[at:end]
        at = data.find(b"\x7fELF", end)


def _vmfb_members(vmfb: Path, fmt: str) -> Iterator[bytes]:
    with zipfile.ZipFile(vmfb) as z:
        for name in z.namelist():
            if fmt in name:
                yield z.read(name)


def gfx942_disassembly(vmfb: "str | Path", arch: str = "gfx942") -> str:
    """The disassembly of every AMDGPU code object in a vmfb (``llvm-objdump -d``), kernel labels
    included."""
    tool = disassembler()
    out = []
    with tempfile.TemporaryDirectory(prefix="dsv4_inspect_") as tmp:
        for i, obj in enumerate(o for data in _vmfb_members(Path(vmfb), "rocm_hsaco") for o in
                                amdgpu_code_objects(data)):
            elf = Path(tmp) / f"{i}.hsaco"
            elf.write_bytes(obj)
            res = subprocess.run([tool, "-d", "--triple=amdgcn-amd-amdhsa", f"--mcpu={arch}", str(elf)],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise ValueError(f"{tool} could not disassemble a code object of {vmfb}: {res.stderr.strip()[:300]}")
            out.append(res.stdout)
    return "\n".join(out)


def amdgpu_kernels(disassembly: str) -> dict[str, collections.Counter]:
    """Kernel symbol -> its matrix instructions (mnemonic -> count), from ``llvm-objdump -d`` text."""
    kernels: dict[str, collections.Counter] = {}
    cur: collections.Counter | None = None
    for line in disassembly.splitlines():
        m = _OBJDUMP_LABEL.match(line)
        if m:
            cur = kernels.setdefault(m.group(1), collections.Counter())
            continue
        if cur is not None and "v_" in line:
            for mm in _AMDGPU_MATRIX.finditer(line.split("//")[0]):
                cur[mm.group(1)] += 1
    return kernels


def ptx_kernels(ptx: str) -> dict[str, collections.Counter]:
    """Kernel (``.entry``) -> its matrix instructions in PTX text (several modules may be concatenated;
    a kernel's text runs to the next ``.entry``, ``.func`` or ``.version``)."""
    kernels: dict[str, collections.Counter] = {}
    marks = list(re.finditer(r"\.(entry|func)\s+(?:\([^)]*\)\s*)?([\w$.]+)|\.version\b", ptx))
    for k, m in enumerate(marks):
        if m.group(1) != "entry":
            continue
        end = marks[k + 1].start() if k + 1 < len(marks) else len(ptx)
        body = ptx[m.end():end]
        kernels[m.group(2)] = collections.Counter(x.group(1) for x in _PTX_MATRIX.finditer(body))
    return kernels


def kernel_matrix_ops(vmfb: "str | Path", target_kind: str, arch: str) -> dict[str, collections.Counter] | None:
    """Kernel name -> matrix instructions in a vmfb's code: "rocm" (AMDGPU disassembly) or "cuda" (PTX);
    None for a target without matrix-instruction detection (llvm-cpu)."""
    if target_kind == "rocm":
        return amdgpu_kernels(gfx942_disassembly(vmfb, arch))
    if target_kind == "cuda":
        out: dict[str, collections.Counter] = {}
        for data in _vmfb_members(Path(vmfb), "cuda_nvptx"):
            out.update(ptx_kernels(data.decode("latin-1")))
        return out
    return None


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dispatch:
    """A dispatch with what its code uses."""

    info: DispatchInfo
    matrix: bool | None  # its kernel has matrix instructions (None: not detected for this target)
    matrix_ops: Mapping[str, int] = field(default_factory=dict)


@dataclass
class EntryReport:
    function: str
    calls: list[Dispatch]  # one per stream.cmd.dispatch, in program order

    def kernels(self) -> list[tuple[Dispatch, int]]:
        """Distinct dispatches with how often one call runs each, by FLOPs (then bytes) per call."""
        count = collections.Counter(d.info.name for d in self.calls)
        first = {d.info.name: d for d in reversed(self.calls)}
        return sorted(((first[n], c) for n, c in count.items()),
                      key=lambda dc: (-dc[0].info.flops * dc[1], -dc[0].info.bytes * dc[1], dc[0].info.name))

    def totals(self) -> dict[str, Any]:
        mm = sum(d.info.matmul_flops for d in self.calls)
        on = sum(d.info.matmul_flops for d in self.calls if d.matrix)
        detect = all(d.matrix is not None for d in self.calls)
        mm_kernels = [d for d, _ in self.kernels() if d.info.contraction]
        multi = [d for d in mm_kernels if d.info.multi_row]
        return {
            "dispatches": len(self.calls),
            "kernels": len({d.info.name for d in self.calls}),
            "flops": sum(d.info.flops for d in self.calls),
            "matmul_flops": mm,
            "matmul_flops_on_matrix": on if detect else None,
            "matrix_share": (on / mm if mm else None) if detect else None,
            "bytes": sum(d.info.bytes for d in self.calls),
            "dynamic": any(d.info.dynamic for d in self.calls),
            "matmul_kernels": len(mm_kernels),
            "matmul_kernels_on_matrix": sum(1 for d in mm_kernels if d.matrix) if detect else None,
            "multi_row_matmul_kernels": len(multi),
            "multi_row_matmul_kernels_on_matrix": sum(1 for d in multi if d.matrix) if detect else None,
        }


@dataclass
class InspectReport:
    export_dir: str
    target: str
    rows: int  # what a dynamic size was taken as
    entries: list[EntryReport]
    mlir: str
    seconds: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        def disp(d: Dispatch) -> dict[str, Any]:
            return {**asdict(d.info), "matrix": d.matrix, "matrix_ops": dict(d.matrix_ops)}

        return {"export": self.export_dir, "target": self.target, "rows": self.rows, "mlir": self.mlir,
                "seconds": self.seconds,
                "entries": {e.function: {"totals": e.totals(), "dispatches": [disp(d) for d in e.calls]}
                            for e in self.entries}}


def _entry_name(host_func: str) -> str:
    return host_func[:-len("$async")] if host_func.endswith("$async") else host_func


def build_report(ir: SourcesIR, matrix: Mapping[str, Mapping[str, int]] | None, rows: int,
                 entries: Sequence[str] | None = None) -> list[EntryReport]:
    """Entry reports from parsed sources and the kernels' matrix instructions (None: not detected).
    A dispatch with no kernel of its name in the code is an error (the vmfb is not this MLIR's)."""
    infos: dict[str, DispatchInfo] = {}
    out = []
    for func, names in ir.calls.items():
        if not names:
            continue
        entry = _entry_name(func)
        if entries and entry not in entries:
            continue
        calls = []
        for n in names:
            info = infos.get(n) or infos.setdefault(n, ir.dispatch(n, rows))
            if matrix is None:
                calls.append(Dispatch(info, None))
                continue
            if n not in matrix:
                raise ValueError(f"kernel {n} is not in the vmfb's code: was the vmfb compiled from this "
                                 "model.mlir with config.json's flags? (re-export with --keep-mlir)")
            calls.append(Dispatch(info, bool(matrix[n]), dict(matrix[n])))
        out.append(EntryReport(entry, calls))
    if entries:
        missing = sorted(set(entries) - {e.function for e in out})
        if missing:
            raise ValueError(f"no entry point {', '.join(missing)}; the export has "
                             f"{', '.join(sorted(_entry_name(f) for f, n in ir.calls.items() if n))}")
    return out


def _tool(name: str) -> str:
    try:
        from iree.compiler.tools.binaries import find_tool
    except ModuleNotFoundError:
        raise ValueError("dsv4 inspect compiles the export's model.mlir: it needs iree-base-compiler "
                         "(pip install iree-base-compiler==3.13.0, or the export extra)") from None
    return find_tool(name)


def _run(cmd: Sequence[str], what: str) -> None:
    res = subprocess.run(list(cmd), capture_output=True, text=True)
    if res.returncode != 0:
        err = "\n".join(res.stderr.strip().splitlines()[:6])
        raise ValueError(f"{what} failed (exit {res.returncode}): {err}")


def executable_sources(mlir: Path, flags: Sequence[str], out: Path) -> None:
    """``iree-compile --compile-to=executable-sources`` of ``mlir`` with ``flags``, then the named linalg
    ops generalized (iree-opt), into ``out``."""
    raw = out.with_suffix(".raw.mlir")
    _run([_tool("iree-compile"), str(mlir), *flags, "--compile-to=executable-sources", "-o", str(raw)],
         f"iree-compile --compile-to=executable-sources of {mlir}")
    pipeline = ("builtin.module(hal.executable(hal.executable.variant(builtin.module("
                "func.func(linalg-generalize-named-ops)))))")
    _run([_tool("iree-opt"), str(raw), f"--pass-pipeline={pipeline}", "-o", str(out)],
         "iree-opt linalg-generalize-named-ops")
    raw.unlink()


def _target_of(cfg: Any, target: str | None) -> str:
    names = sorted(cfg.targets)
    if target is None:
        if len(names) == 1:
            return names[0]
        raise ValueError(f"the export has several targets ({', '.join(names)}): pick one with --target")
    name = target.split(":")[0]
    if name not in cfg.targets:
        raise ValueError(f"the export has no target {target!r}; it has {', '.join(names)}")
    return name


def mlir_for(out_dir: Path, vmfb: str, target: str, info: Mapping[str, Any]) -> Path:
    """The MLIR a vmfb was compiled from: model[.fnuz]<stage>.mlir (a target with FP8 weights of its own
    was traced apart: export/exporter.py's FP8 groups)."""
    stem = vmfb[: -len(f".{target}.vmfb")] if vmfb.endswith(f".{target}.vmfb") else Path(vmfb).stem
    stage = stem[len("model"):]
    suffix = ".fnuz" if info.get("fp8_dtype") == "float8_e4m3fnuz" else ""
    return out_dir / f"model{suffix}{stage}.mlir"


def _flag_value(flags: Sequence[str], name: str) -> str | None:
    for f in flags:
        if f.startswith(name + "="):
            return f.split("=", 1)[1]
    return None


def inspect_export(export_dir: "str | Path", target: str | None = None, *, rows: int | None = None,
                   entries: Sequence[str] | None = None, progress: Any = None) -> InspectReport:
    """Inspect one target of an export (see the module docstring); ``rows``: what a dynamic size is
    taken as (default: config.json's prefill.min_tokens, the shortest prefill call)."""
    import time

    from dsv4.contract.artifact import ExportConfig

    d = Path(export_dir)
    cfg = ExportConfig.load(d, weights=False)
    name = _target_of(cfg, target)
    info = cfg.targets[name]
    flags = list(info.get("flags") or [])
    if not flags:
        raise ValueError(f"{d}/config.json records no compile flags for {name}")
    if rows is None:
        rows = cfg.prefill_min_tokens
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if "--iree-hal-target-device=hip" in flags or _flag_value(flags, "--iree-rocm-target"):
        kind, arch = "rocm", _flag_value(flags, "--iree-rocm-target") or "gfx942"
        disassembler()  # before the compile: a missing tool is named first
    elif any(f.startswith("--iree-hal-target-device=cuda") for f in flags):
        kind, arch = "cuda", _flag_value(flags, "--iree-cuda-target") or ""
    else:
        kind, arch = "cpu", ""
    vmfbs = list(info.get("stages") or [info["vmfb"]])
    say = progress or (lambda s: None)
    seconds: dict[str, float] = {}
    reports: list[EntryReport] = []
    mlirs = []
    with tempfile.TemporaryDirectory(prefix="dsv4_inspect_") as tmp:
        for vmfb in vmfbs:
            mlir = mlir_for(d, vmfb, name, info)
            if not mlir.is_file():
                raise ValueError(f"{d} has no {mlir.name}: dsv4 inspect compiles the MLIR the vmfb was made from; "
                                 f"re-export with --keep-mlir (the same options otherwise)")
            mlirs.append(mlir.name)
            src = Path(tmp) / (mlir.stem + ".sources.mlir")
            say(f"compiling {mlir.name} for {name} to executable sources ...")
            t0 = time.perf_counter()
            executable_sources(mlir, flags, src)
            seconds[f"sources:{mlir.name}"] = round(time.perf_counter() - t0, 1)
            t0 = time.perf_counter()
            ir = parse_sources(src.read_text())
            say(f"reading the code objects of {vmfb} ...")
            matrix = kernel_matrix_ops(d / vmfb, kind, arch)
            reports += build_report(ir, matrix, rows, entries)
            seconds[f"read:{vmfb}"] = round(time.perf_counter() - t0, 1)
    return InspectReport(str(d), name, rows, reports, ", ".join(mlirs), seconds)


# ------------------------------------------------------------------------------------------------
# Text
# ------------------------------------------------------------------------------------------------

def _si(x: float, unit: str) -> str:
    for scale, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {p}{unit}"
    return f"{x:.0f} {unit}"


def totals_line(t: Mapping[str, Any]) -> str:
    share = t["matrix_share"]
    on = t["multi_row_matmul_kernels_on_matrix"]
    parts = [f"{t['dispatches']} dispatches ({t['kernels']} kernels)", _si(t["flops"], "FLOP"),
             f"matmul {_si(t['matmul_flops'], 'FLOP')}"
             + (f", {100 * share:.1f} % on the matrix cores" if share is not None else ""),
             _si(t["bytes"], "B"),
             f"multi-row matmul kernels on the matrix cores: {on}/{t['multi_row_matmul_kernels']}"
             if on is not None else f"multi-row matmul kernels: {t['multi_row_matmul_kernels']}"]
    return "; ".join(parts)


def format_report(rep: InspectReport, *, top: int | None = None, matmul_only: bool = False) -> str:
    """The report as text: per entry point its totals, then its kernels by FLOPs per call."""
    lines = [f"{rep.export_dir}: target {rep.target} ({rep.mlir}); dynamic sizes taken as {rep.rows}"]
    for e in rep.entries:
        t = e.totals()
        lines.append("")
        lines.append(f"{e.function}: {totals_line(t)}")
        rows = [(d, c) for d, c in e.kernels() if not matmul_only or d.info.is_matmul]
        if top is not None:
            rows = rows[:top]
        if not rows:
            continue
        lines.append(f"  {'calls':>5} {'kind':<18} {'shape':<22} {'FLOP/call':>12} {'bytes/call':>11} "
                     f"{'matrix':<7} types / name")
        for d, c in rows:
            i = d.info
            mx = "-" if d.matrix is None else ("yes" if d.matrix else "no")
            extra = " (gather: bytes of the whole table)" if i.gather else ""
            extra += f" (uncounted: {', '.join(i.other_ops)})" if i.other_ops else ""
            lines.append(f"  {c:>5} {i.kind[:18]:<18} {i.shape[:22]:<22} {_si(i.flops, ''):>12} "
                         f"{_si(i.bytes, 'B'):>11} {mx:<7} {i.types}{extra}  [{i.name.split('$')[-1]}]")
    lines.append("")
    lines.append(" ".join(f"{k} {v:.1f} s" for k, v in rep.seconds.items()))
    return "\n".join(lines)
