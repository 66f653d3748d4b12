"""What an export's entry points dispatch, read from the compiler's IR and the compiled code objects
(`dsv4 inspect OUT`): no GPU needed, and no torch.

For one target of an export made with ``--keep-mlir``:

1. ``iree-compile model.mlir <the flags config.json records for the target> --compile-to=executable-sources``
   gives one module holding every dispatch's source (a ``hal.executable`` per dispatch, its linalg ops on
   tensors) and the host program, whose ``stream.cmd.dispatch`` ops are the calls: counted per function,
   they are the dispatches per call (the same count as ``--compile-to=stream``: the host program does not
   change between the two phases); its ``stream.timepoint.await`` ops, counted the same way, are the
   host waits: where a call's host program stops issuing work until the device has drained its queue.
2. ``iree-opt`` rewrites the named linalg ops (matmul, batch_matmul, fill, transpose, ...) as
   ``linalg.generic``, so every op carries its indexing maps and iterator types: the iteration space
   comes from the operand shapes, and a contraction (a reduction with two operands indexed by the
   reduced dimension and a multiply-add body) counts 2 FLOPs per point of its iteration space and per
   product its body accumulates (the one-row gathered GEMV sums two); every
   other op counts its body's arithmetic ops per point. Bytes are the tensors each dispatch loads from
   and stores to its bindings; a table read only by ``tensor.extract`` in a body (a gather) counts the
   distinct elements its indices can reach (the loops they follow, each divided by the constant it is
   divided by: byte k / 2 of a row counts K / 2), at most one a point and at most the table; the source of an
   ``iree_linalg_ext.gather`` counts the slices it selects (its result's elements). A dynamic size is what the host program
   computes for the call (push constants and workload, evaluated from the entry point's dynamic input
   size, the prefill's token count, taken as ``rows``).
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
from typing import Any, Iterator, Mapping, Sequence

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
_DISPATCH_OP = re.compile(r"\bstream\.cmd\.dispatch\s+(?:\{\s*)?@([\w$.-]+)::@([\w$.-]+)::@([\w$.-]+)")
_DEV_FUNC = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([\w$.-]+)\(")
_HOST_FUNC = re.compile(r"^\s*util\.func\s+(?:public\s+|private\s+)?@([\w$.\"-]+)")
_INITIALIZER = re.compile(r"^\s*util\.initializer\b")
_AWAIT_OP = re.compile(r"\bstream\.timepoint\.await\b")


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


def split_top(text: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` outside of (), [], <>."""
    out, depth, cur = [], 0, []
    for k, ch in enumerate(text):
        if ch in "([<{":
            depth += 1
        elif ch in ")]}" or (ch == ">" and text[k - 1:k] != "-"):  # "->" closes nothing
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
    """A ``linalg.generic`` of one call: its maps, iterator types, its operands' shapes (every size known)
    and element types, and its body's op names."""

    maps: tuple[AffineMap, ...]
    iterators: tuple[str, ...]  # "parallel" | "reduction"
    shapes: tuple[tuple[int, ...], ...]  # the inputs', then the outputs' ((): a scalar)
    n_inputs: int
    body: tuple[str, ...]  # op names in the body, e.g. ("arith.extf", "arith.mulf", "arith.addf")
    # the tensors its body reads with tensor.extract (SSA names), each with the loops its indices follow as
    # (loop, divisor) pairs (a divisor: the index is the loop's value divided by a constant), None if unknown
    extracts: tuple[tuple[str, tuple[tuple[int, int], ...] | None], ...] = ()

    def ranges(self) -> list[int]:
        """The loop ranges. A loop that no operand indexes directly (only through an expression) is an
        error."""
        ranges: list[int | None] = [None] * len(self.iterators)
        for shape, amap in zip(self.shapes, self.maps):
            for j, size in enumerate(shape):
                k = amap.dim(j)
                if k is not None and ranges[k] is None:
                    ranges[k] = size
        if any(r is None for r in ranges):
            raise ValueError(f"a loop of a linalg.generic is not a plain dimension of any operand: {self.maps}")
        return [int(r) for r in ranges]

    def _dims(self, i: int) -> set[int]:
        amap = self.maps[i]
        return {k for j in range(len(amap.results)) if (k := amap.dim(j)) is not None}

    def operands_of_reduction(self) -> list[int]:
        """Inputs whose map reads a reduction loop."""
        red = {k for k, it in enumerate(self.iterators) if it == "reduction"}
        return [i for i in range(self.n_inputs) if self._dims(i) & red]

    @property
    def is_contraction(self) -> bool:
        """A reduction over two operands with a multiply-add body: a matmul in any layout."""
        if "reduction" not in self.iterators or len(self.operands_of_reduction()) < 2:
            return False
        ops = set(self.body)
        return (bool(ops & {"arith.mulf", "arith.muli"}) and bool(ops & {"arith.addf", "arith.addi"})) \
            or bool(ops & _FMA_OPS)

    @property
    def points(self) -> int:
        return math.prod(self.ranges())

    def extracted_elements(self, loops: tuple[tuple[int, int], ...] | None) -> int:
        """The distinct elements an extract can read: the product of its loops' ranges, each divided by its
        divisor (every point when its indices are not understood)."""
        if loops is None:
            return self.points
        ranges = self.ranges()
        return min(self.points, math.prod(-(-ranges[k] // d) for k, d in loops))

    def flops(self) -> int:
        if self.is_contraction:  # a multiply-add per product the body accumulates (the gathered GEMV sums two)
            return 2 * self.points * max(1, sum(o in ("arith.addf", "arith.addi") for o in self.body))
        per_point = sum(2 if o in _FMA_OPS else 1 for o in self.body if o in _FLOP_OPS or o.startswith("math."))
        return per_point * self.points

    def rows_cols(self) -> tuple[int, int]:
        """A contraction's M and N: the parallel loops that only the first / only the second operand
        (and the result) index; batch loops are in all three."""
        red = self.operands_of_reduction()
        a = red[0]  # and the first operand indexed differently (two weight operands read alike are one side)
        b = next((i for i in red[1:] if self._dims(i) != self._dims(a)), red[1])
        ranges = self.ranges()
        par = {k for k, it in enumerate(self.iterators) if it == "parallel"}
        out, da, db = self._dims(self.n_inputs), self._dims(a), self._dims(b)
        return (math.prod(ranges[k] for k in (par & da & out) - db),
                math.prod(ranges[k] for k in (par & db & out) - da))


# ------------------------------------------------------------------------------------------------
# Integer values: the host program's sizes and a dispatch's push constants (what a dynamic size is)
# ------------------------------------------------------------------------------------------------

_ASSIGN = re.compile(r"^\s*(%[\w$.-]+)(?::(\d+))?\s*=\s*\"?([\w.]+)\"?\s*(.*)$")
_SSA = re.compile(r"%[\w$.-]+(?:#\d+)?")
_BINARY = {
    "arith.addi": lambda a, b: a + b, "arith.subi": lambda a, b: a - b, "arith.muli": lambda a, b: a * b,
    "arith.divui": lambda a, b: a // b, "arith.divsi": lambda a, b: int(a / b) if b else None,
    "arith.floordivsi": lambda a, b: a // b, "arith.ceildivui": lambda a, b: -(-a // b),
    "arith.ceildivsi": lambda a, b: -(-a // b), "arith.remui": lambda a, b: a % b,
    "arith.remsi": lambda a, b: int(math.fmod(a, b)), "arith.andi": lambda a, b: a & b,
    "arith.ori": lambda a, b: a | b, "arith.xori": lambda a, b: a ^ b, "arith.shli": lambda a, b: a << b,
    "arith.shrui": lambda a, b: a >> b, "arith.shrsi": lambda a, b: a >> b, "arith.maxui": max,
    "arith.maxsi": max, "arith.minui": min, "arith.minsi": min,
    "util.align": lambda a, b: -(-a // b) * b,
}
_UNARY = ("arith.index_cast", "arith.index_castui", "arith.extui", "arith.extsi", "arith.trunci")
_CMP = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "slt": lambda a, b: a < b,
        "sle": lambda a, b: a <= b, "sgt": lambda a, b: a > b, "sge": lambda a, b: a >= b,
        "ult": lambda a, b: a < b, "ule": lambda a, b: a <= b, "ugt": lambda a, b: a > b,
        "uge": lambda a, b: a >= b}


def eval_int(name: str, count: int, op: str, rest: str, env: dict[str, int]) -> None:
    """Evaluate one integer op of the host or a dispatch into ``env`` (an op whose operands are unknown,
    or one not listed here, leaves its result unknown)."""
    args = _SSA.findall(rest.split(" : ")[0]) if op != "arith.constant" else []
    if op == "arith.constant":
        m = re.match(r"^(-?\d+|true|false)\s*:\s*(index|i\d+)\s*$", rest.strip())
        if m:
            env[name] = {"true": 1, "false": 0}.get(m.group(1), None) if m.group(1) in ("true", "false") \
                else int(m.group(1))
        return
    if op == "util.assume.int":
        for i, a in enumerate(args[:count or 1]):
            if a in env:
                env[f"{name}#{i}" if count else name] = env[a]
        return
    vals = [env.get(a) for a in args]
    if any(v is None for v in vals) or not vals:
        return
    if op in _UNARY or op == "iree_tensor_ext.dispatch.workload.ordinal":
        v = vals[0]
        if op == "arith.trunci":
            m = re.search(r"to i(\d+)", rest)
            v = v & ((1 << int(m.group(1))) - 1) if m else v
        env[name] = v
    elif op in _BINARY and len(vals) >= 2:
        try:
            r = _BINARY[op](vals[0], vals[1])
        except ZeroDivisionError:
            r = None
        if r is not None:
            env[name] = r
    elif op == "arith.select" and len(vals) == 3:
        env[name] = vals[1] if vals[0] else vals[2]
    elif op == "arith.cmpi":
        m = re.match(r"^\s*(\w+),", rest)
        if m and m.group(1) in _CMP:
            env[name] = int(_CMP[m.group(1)](vals[0], vals[1]))


# ------------------------------------------------------------------------------------------------
# The executable-sources module: dispatches and the host program's calls
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DispatchInfo:
    """One dispatch call's numbers, from its source (a ``hal.executable.export``) and its name."""

    name: str
    kind: str  # IREE's name for its root op: matmul_like, contract, elementwise, reduction, ...
    shape: str  # the root op's loop ranges as named ("D": dynamic)
    types: str
    flops: int  # every op
    matmul_flops: int  # the contractions' share of flops
    bytes: int  # tensors loaded from and stored to its bindings (a gathered table: what is extracted)
    contraction: bool  # it holds a contraction
    multi_row: bool  # its largest contraction has more than one row and column (M > 1 and N > 1)
    mnk: tuple[int, int, int] = (0, 0, 0)  # the largest contraction's M, N and K (batch loops apart)
    gather: bool = False  # a body reads a loaded tensor with tensor.extract
    guessed: bool = False  # a dynamic size was not known from the host program and was taken as rows
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


def _fill(typ: str, sizes: Sequence[str], env: Mapping[str, int], rows: int) -> tuple[tuple[int, ...], str, bool]:
    """A tensor type's shape with its ``?`` sizes taken, in order, from the SSA values ``sizes``
    (a size whose value is unknown: rows, and guessed=True)."""
    shape, elem = tensor_type(typ)
    dyn = iter(sizes)
    out, guessed = [], False
    for d in shape:
        if d is not None:
            out.append(d)
            continue
        v = env.get(next(dyn, ""))
        if v is None:
            v, guessed = rows, True
        out.append(int(v))
    return tuple(out), elem, guessed


def _operands(text: str | None) -> tuple[list[str], list[str]]:
    """``%a, %b : tensor<..>, f32`` -> (["%a", "%b"], ["tensor<..>", "f32"])."""
    if not text or " : " not in text:
        return [], []
    names, types = text.split(" : ", 1)
    return [n.strip() for n in names.split(",")], split_top(types)


@dataclass
class SourcesIR:
    """What parse_sources reads: each dispatch function's lines, and for each host function its
    dispatch calls in order with their push constants and workload (None: not known statically)."""

    funcs: dict[str, list[str]]  # export name -> the lines of its func.func
    aliases: dict[str, AffineMap]
    calls: dict[str, list[tuple[str, tuple[int | None, ...], tuple[int | None, ...]]]]
    # host function -> its `stream.timepoint.await` ops: where the host waits for the device before it
    # issues more work (the queue drains there)
    waits: dict[str, int] = field(default_factory=dict)
    _cache: dict = field(default_factory=dict)

    def dispatch(self, name: str, rows: int, push: Sequence[int | None] = (),
                 workload: Sequence[int | None] = ()) -> DispatchInfo:
        key = (name, rows, tuple(push), tuple(workload))
        if key not in self._cache:
            self._cache[key] = self._evaluate(name, rows, push)
        return self._cache[key]

    def _evaluate(self, name: str, rows: int, push: Sequence[int | None]) -> DispatchInfo:
        kind, shape_name, types = name_parts(name)
        env: dict[str, int] = {}
        shapes: dict[str, tuple[tuple[int, ...], str]] = {}  # tensor SSA value -> (shape, element type)
        loads: dict[str, tuple[float, str]] = {}  # loaded tensor -> (bytes, how it is used: "" | "whole")
        extracted: dict[str, float] = collections.defaultdict(float)  # loaded tensor -> bytes extracted
        nbytes = 0.0
        flops = mm = 0
        best: tuple[int, bool, tuple[int, int, int]] = (-1, False, (0, 0, 0))
        guessed = gather = False
        other: set[str] = set()
        lines = self.funcs.get(name, [])
        consts = {m.group(1): int(m.group(2)) for line in lines if (m := _INDEX_CONST.match(line))}
        i = 0
        while i < len(lines):
            line = lines[i]
            i += 1
            g = _GENERIC.match(line)
            if g is not None:
                indent = g.group(1)
                body = []
                while i < len(lines) and not (lines[i].startswith(indent + "}") and not lines[i].startswith(indent + " ")):
                    body.append(lines[i])
                    i += 1
                res = _ASSIGN.match(line)
                op, op_guessed = self._generic(g, body, shapes, rows, consts)
                guessed |= op_guessed
                if res is not None:
                    _, _, outs = g.group(2), g.group(3), g.group(4)
                    out_names, _ = _operands(outs)
                    for k, o in enumerate(out_names):
                        if o in shapes:
                            shapes[f"{res.group(1)}#{k}" if res.group(2) else res.group(1)] = shapes[o]
                f = op.flops()
                flops += f
                for t, loops in op.extracts:
                    if t in loads:
                        gather = True
                        extracted[t] += op.extracted_elements(loops) * elem_bytes(shapes[t][1])
                ins_names, _ = _operands(g.group(3))
                out_names, _ = _operands(g.group(4))
                for n in (*ins_names, *out_names):
                    if n in loads:
                        loads[n] = (loads[n][0], "whole")
                if op.is_contraction:
                    mm += f
                    if f > best[0]:
                        m_, n_ = op.rows_cols()
                        k_ = math.prod(r for r, it in zip(op.ranges(), op.iterators) if it == "reduction")
                        best = (f, m_ > 1 and n_ > 1, (m_, n_, k_))
                continue
            a = _ASSIGN.match(line)
            if a is None:
                if "iree_tensor_ext.dispatch.tensor.store" in line:
                    m = re.search(r":\s*(tensor<[^>]*>)\s*->.*?(?:\{([^}]*)\})?\s*$", line)
                    src = _SSA.search(line.split("store", 1)[1])
                    if m and src and src.group(0) in shapes:
                        shp, elem = shapes[src.group(0)]
                        nbytes += math.prod(shp) * elem_bytes(elem)
                    elif m:
                        shp, elem, gu = _fill(m.group(1), [], env, rows)
                        nbytes += math.prod(shp) * elem_bytes(elem)
                        guessed |= gu
                continue
            res, count, op, rest = a.group(1), int(a.group(2) or 0), a.group(3), a.group(4)
            if op == "util.assume.int" and count:
                while i < len(lines) and not rest.rstrip().endswith(":") and " : " not in rest:
                    nxt = lines[i].strip()
                    i += 1
                    if nxt.startswith(":"):  # the result types close the op
                        rest += " : " + nxt[1:].strip()
                        break
                    rest += " " + nxt
                rest = " ".join(split_top(rest.split(" : ")[0]))  # operands only (their bounds dropped)
                rest = ", ".join(m.group(0) for m in re.finditer(r"(?:^|\s)(%[\w$.-]+)", rest)) + " : index"
                eval_int(res, count, op, rest, env)
            elif op == "hal.interface.constant.load":
                m = re.search(r"ordinal\((\d+)\)", rest)
                k = int(m.group(1)) if m else -1
                if 0 <= k < len(push) and push[k] is not None:
                    env[res] = int(push[k])
            elif op == "iree_tensor_ext.dispatch.tensor.load":
                m = re.search(r"sizes = \[([^\]]*)\].*->\s*(tensor<[^>]*>)\s*$", rest)
                if m:
                    dyn = [s.strip() for s in m.group(1).split(",") if s.strip().startswith("%")]
                    shp, elem, gu = _fill(m.group(2), dyn, env, rows)
                    guessed |= gu
                    shapes[res] = (shp, elem)
                    loads[res] = (math.prod(shp) * elem_bytes(elem), "")
            elif op == "tensor.empty":
                m = re.match(r"^\(([^)]*)\)\s*:\s*(tensor<[^>]*>)", rest)
                if m:
                    shp, elem, gu = _fill(m.group(2), _SSA.findall(m.group(1)), env, rows)
                    guessed |= gu
                    shapes[res] = (shp, elem)
            elif op.startswith(("linalg.", "iree_linalg_ext.", "iree_codegen.", "iree_gpu.", "iree_encoding.")):
                other.add(op)
                outs = re.search(r"outs\(([^)]*)\)", rest)
                out_names, _ = _operands(outs.group(1) if outs else None)
                in_names, _ = _operands(re.search(r"ins\(([^)]*)\)", rest).group(1) if "ins(" in rest else None)
                if op == "iree_linalg_ext.gather" and in_names and in_names[0] in loads and out_names \
                        and out_names[0] in shapes:
                    # a gathered table: the slices its indices select (the output's elements), not the table
                    gather = True
                    extracted[in_names[0]] += math.prod(shapes[out_names[0]][0]) * elem_bytes(shapes[in_names[0]][1])
                    in_names = in_names[1:]
                for n in in_names + out_names:
                    if n in loads:
                        loads[n] = (loads[n][0], "whole")
                for k, o in enumerate(out_names):
                    if o in shapes:
                        shapes[f"{res}#{k}" if count else res] = shapes[o]
            else:
                eval_int(res, count, op, rest, env)
        for t, (b, use) in loads.items():
            nbytes += b if use == "whole" or t not in extracted else min(b, extracted[t])
        return DispatchInfo(name=name, kind=kind, shape=shape_name, types=types, flops=flops, matmul_flops=mm,
                            bytes=int(nbytes), contraction=best[0] >= 0, multi_row=best[1], mnk=best[2],
                            gather=gather, guessed=guessed, other_ops=tuple(sorted(other)))

    def _generic(self, g: re.Match, body: list[str], shapes: Mapping[str, tuple[tuple[int, ...], str]],
                 rows: int, consts: Mapping[str, int]) -> tuple[LinalgOp, bool]:
        attrs = g.group(2)
        m = re.search(r"indexing_maps = \[(.*?)\]\s*,\s*iterator_types", attrs)
        if m is None:
            raise ValueError(f"linalg.generic without indexing_maps: {attrs[:200]}")
        maps = []
        for item in split_top(m.group(1)):
            if item.startswith("affine_map<"):
                maps.append(AffineMap.parse(item[len("affine_map<"):-1]))
            elif item in self.aliases:
                maps.append(self.aliases[item])
            else:
                raise ValueError(f"unknown affine map {item!r}")
        it = re.search(r"iterator_types = \[(.*?)\]", attrs)
        iterators = tuple(re.findall(r"(parallel|reduction)", it.group(1))) if it else ()
        op_shapes, guessed = [], False
        ins, in_types = _operands(g.group(3))
        outs, out_types = _operands(g.group(4))
        for n, t in zip((*ins, *outs), (*in_types, *out_types)):
            if n in shapes:
                op_shapes.append(shapes[n][0])
            else:
                shp, _, gu = _fill(t, [], {}, rows)
                guessed |= gu and "?" in t
                op_shapes.append(shp)
        body_ops = tuple(b.group(3) for b in map(_ASSIGN.match, body) if b)
        extracts = _extract_loops(body, consts)
        return LinalgOp(tuple(maps), iterators, tuple(op_shapes), len(ins), body_ops, extracts), guessed


_INDEX_CONST = re.compile(r"^\s*(%[\w$.-]+)\s*=\s*arith\.constant (\d+) : (?:index|i32|i64)\s*$")
_EXTRACT = re.compile(r"tensor\.extract (%[\w$.-]+)\[([^\]]*)\]")
# index arithmetic whose result follows the loops of its operands
_INDEX_OPS = {"arith.index_cast", "arith.index_castui", "arith.extui", "arith.extsi", "arith.trunci", "arith.fptosi",
              "arith.fptoui", "arith.addi", "arith.subi", "arith.muli", "arith.remui", "arith.remsi", "arith.andi",
              "arith.ori", "arith.shli", "arith.minui", "arith.maxui", "arith.minsi", "arith.maxsi", "arith.select",
              "arith.cmpi"}


def _extract_loops(body: Sequence[str], consts: Mapping[str, int]) -> tuple[tuple[str, tuple[tuple[int, int], ...] | None], ...]:
    """Each `tensor.extract` of a generic's body with the loops its indices follow: a loop through
    `linalg.index`, divided by a constant through `arith.divui` / `arith.shrui` (k / 2: half the loop's
    values), a data-dependent index (an extract of its own) by the loops of that extract's indices.
    None for an index computed any other way."""
    defs: dict[str, tuple[str, str]] = {}
    for line in body:
        a = _ASSIGN.match(line)
        if a is not None:
            defs[a.group(1)] = (a.group(3), a.group(4))

    def merged(values: Sequence[str], depth: int) -> dict[int, int] | None:
        """The loops of several indices together (a loop divided in one and not in another: undivided)."""
        out: dict[int, int] = {}
        for v in values:
            sub = loops(v, depth)
            if sub is None:
                return None
            for k, d in sub.items():
                out[k] = min(out.get(k, d), d)
        return out

    def loops(v: str, depth: int = 0) -> dict[int, int] | None:
        if v in consts:
            return {}
        if v not in defs or depth > 32:
            return None
        op, rest = defs[v]
        if op == "arith.constant":
            return {}
        if op == "linalg.index":
            return {int(rest.split()[0]): 1}
        if op == "tensor.extract":
            m = _EXTRACT.search("tensor.extract " + rest)
            operands = _SSA.findall(m.group(2)) if m else None
        else:
            operands = _SSA.findall(rest.split(" : ")[0])
        if op in ("arith.divui", "arith.shrui") and len(operands) == 2 and operands[1] in consts:
            inner = loops(operands[0], depth + 1)
            c = consts[operands[1]]
            div = c if op == "arith.divui" else 1 << c
            return None if inner is None else {k: d * div for k, d in inner.items()}
        if op not in _INDEX_OPS and op != "tensor.extract" or operands is None:
            return None
        return merged(operands, depth + 1)

    found = []
    for line in body:
        m = _EXTRACT.search(line)
        if m is not None:
            idx = merged(_SSA.findall(m.group(2)), 0)
            found.append((m.group(1), None if idx is None else tuple(sorted(idx.items()))))
    return tuple(found)


def parse_sources(text: str, rows: int) -> SourcesIR:
    """Read an ``--compile-to=executable-sources`` module whose named linalg ops were generalized; the
    host's integer sizes are evaluated with each dynamic input size (``hal.buffer_view.dim``: the
    prefill's token count) taken as ``rows``."""
    aliases: dict[str, AffineMap] = {}
    funcs: dict[str, list[str]] = {}
    calls: dict[str, list[tuple[str, tuple[int | None, ...], tuple[int | None, ...]]]] = {}
    waits: collections.Counter = collections.Counter()
    dev: list[str] | None = None
    host: str | None = None
    env: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("#map"):
            m = _MAP_ALIAS.match(line)
            if m:
                aliases[m.group(1)] = AffineMap.parse(m.group(2))
            continue
        if (m := _DEV_FUNC.match(line)) is not None:
            dev, host = funcs.setdefault(m.group(1), []), None
            continue
        if (m := _HOST_FUNC.match(line)) is not None or _INITIALIZER.match(line):
            host, dev, env = (m.group(1).strip('"') if m else "<initializer>"), None, {}
            calls.setdefault(host, [])
            continue
        if dev is not None:
            dev.append(line)
            continue
        if host is None:
            continue
        if (m := _DISPATCH_OP.search(line)) is not None:
            tail = line[m.end():]
            wl = re.match(r"^\[([^\]]*)\]", tail)
            pc = re.search(r"\(([^)]*?)\s*:\s*[^)]*\)", tail[wl.end() if wl else 0:]) if "(" in tail else None
            work = tuple(env.get(x) for x in _SSA.findall(wl.group(1))) if wl else ()
            push = tuple(env.get(x) for x in _SSA.findall(pc.group(1))) if pc else ()
            calls[host].append((m.group(3), push, work))
            continue
        if _AWAIT_OP.search(line):
            waits[host] += 1
        a = _ASSIGN.match(line)
        if a is None:
            continue
        if a.group(3) == "hal.buffer_view.dim":
            env[a.group(1)] = rows
        else:
            eval_int(a.group(1), int(a.group(2) or 0), a.group(3), a.group(4), env)
    return SourcesIR(funcs, aliases, calls, dict(waits))


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
    host_waits: int = 0  # times a call's host program waits for the device mid-call (stream.timepoint.await)

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
            "host_waits": self.host_waits,
            "kernels": len({d.info.name for d in self.calls}),
            "flops": sum(d.info.flops for d in self.calls),
            "matmul_flops": mm,
            "matmul_flops_on_matrix": on if detect else None,
            "matrix_share": (on / mm if mm else None) if detect else None,
            "bytes": sum(d.info.bytes for d in self.calls),
            "guessed": sum(1 for d in self.calls if d.info.guessed),
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
    out = []
    for func, names in ir.calls.items():
        if not names:
            continue
        entry = _entry_name(func)
        if entries and entry not in entries:
            continue
        calls = []
        for n, push, work in names:
            info = ir.dispatch(n, rows, push, work)
            if matrix is None:
                calls.append(Dispatch(info, None))
                continue
            ops = matrix.get(n, matrix.get(re.sub(r"[^\w]", "_", n)))  # PTX symbols spell $ as _
            if ops is None:
                raise ValueError(f"kernel {n} is not in the vmfb's code: was the vmfb compiled from this "
                                 "model.mlir with config.json's flags? (re-export with --keep-mlir)")
            calls.append(Dispatch(info, bool(ops), dict(ops)))
        out.append(EntryReport(entry, calls, ir.waits.get(func, 0)))
    if entries:
        missing = sorted(set(entries) - {e.function for e in out})
        if missing:
            raise ValueError(f"no entry point {', '.join(missing)}; the export has "
                             f"{', '.join(sorted(_entry_name(f) for f, n in ir.calls.items() if n and not f.startswith('<')))}")
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
            ir = parse_sources(src.read_text(), rows)
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
    waits = f"{t['host_waits']} host wait{'' if t['host_waits'] == 1 else 's'}"
    parts = [f"{t['dispatches']} dispatches ({t['kernels']} kernels), {waits}", _si(t["flops"], "FLOP"),
             f"matmul {_si(t['matmul_flops'], 'FLOP')}"
             + (f", {100 * share:.1f} % on the matrix cores" if share is not None else ""),
             _si(t["bytes"], "B"),
             f"multi-row matmul kernels on the matrix cores: {on}/{t['multi_row_matmul_kernels']}"
             if on is not None else f"multi-row matmul kernels: {t['multi_row_matmul_kernels']}"]
    if t["guessed"]:
        parts.append(f"{t['guessed']} calls with a dynamic size the host program does not give, taken as rows")
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
        lines.append(f"  {'calls':>5} {'kind':<18} {'shape':<22} {'M x N x K':<20} {'FLOP/call':>12} "
                     f"{'bytes/call':>11} {'matrix':<7} types / name")
        for d, c in rows:
            i = d.info
            mx = "-" if d.matrix is None else ("yes" if d.matrix else "no")
            extra = " (gather)" if i.gather else ""
            extra += f" (uncounted: {', '.join(i.other_ops)})" if i.other_ops else ""
            mnk = "x".join(map(str, i.mnk)) if i.contraction else ""
            lines.append(f"  {c:>5} {i.kind[:18]:<18} {i.shape[:22]:<22} {mnk:<20} {_si(i.flops, ''):>12} "
                         f"{_si(i.bytes, 'B'):>11} {mx:<7} {i.types}{extra}  [{i.name.split('$')[-1]}]")
    lines.append("")
    lines.append(" ".join(f"{k} {v:.1f} s" for k, v in rep.seconds.items()))
    return "\n".join(lines)
