"""The kernel registry: the model's hot spots, each declared once beside its torch reference.

A hot spot is a plain torch function (the reference: what eager runs and the tests trust) declared
with ``@kernel(name, ...)``. The declaration says everything the export side needs to replace it:

* ``args`` / ``results``: the argument spec, dims by name (``"B, T, H, D"``; a leading ``...`` =
  any leading dims, flattened into one for the MLIR kernel), ``int`` / ``float`` for attributes
  (a result dim may name an int attribute); ``static`` dims are baked into the kernel; ``dtypes``
  restricts argument dtypes, ``result_dtypes`` sets result dtypes (default: the first tensor's);
* ``mlir``: a Jinja2 MLIR template file next to the module (e.g. ``sparse_attention.mlir.jinja``),
  inlined into the exported module as the implementation ``"kernel"``;
* ``mlir_variants``: further MLIR implementations by name, each the same template rendered with
  extra variables (``{"kernel_f32": {"gemm": "f32"}}``: the FP8 linear's f32-GEMM form);
* ``trace_sizes``: dims (``"..."`` for the leading ones) whose size the template receives as
  ``<dim>_size`` (``lead_size`` for ``"..."``) when the trace has it as a number (a static-shape entry
  point), else None; each known size is its own specialization (the FP8 linear picks its GEMM form
  by the row count);
* ``alternatives``: other torch implementations (traced as written), by name.

Which implementation an export traces is the export's lowering plan (export/lowering.py, one table
for every op and target). Eager always runs the reference unless a caller routes a hook elsewhere
with ``overrides`` (the one switch: the exporter's plan, training's routed MoE and the
``weight_only`` comparisons all go through it). The model never imports the export side (turbine):
``export/kernel_op.py`` turns a ``Kernel``'s MLIR into a turbine op.

Adding a kernel: decorate the reference with ``@kernel(...)`` in its module under model/kernels/
(imported at the bottom of this file), put its template beside it, give it a row in
export/lowering.py's table.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

__all__ = ["Arg", "Kernel", "KERNELS", "HOOKS", "LEAD", "hook", "kernel", "overrides", "runs_reference"]

LEAD = "_lead"  # the dim a leading "..." becomes (all leading dims, flattened)
_SCHEMA_TYPE = {"tensor": "Tensor", "int": "int", "float": "float"}


@dataclass(frozen=True)
class Arg:
    """One argument or result of a kernel: a tensor with named dims, or an int/float attribute."""

    name: str
    kind: str  # "tensor" | "int" | "float"
    dims: tuple["str | int", ...] = ()


def _parse_dims(spec: str) -> tuple["str | int", ...]:
    dims: list[str | int] = []
    for i, tok in enumerate(t.strip() for t in spec.split(",")):
        if not tok:
            continue
        if tok == "...":
            if i:
                raise ValueError(f"'...' must come first in shape spec {spec!r}")
            dims.append(LEAD)
        elif tok.isdigit():
            dims.append(int(tok))
        elif re.fullmatch(r"[A-Za-z_]\w*", tok):
            dims.append(tok)
        else:
            raise ValueError(f"bad dim {tok!r} in shape spec {spec!r}")
    return tuple(dims)


def _parse_args(args: Mapping[str, "str | type"]) -> tuple[Arg, ...]:
    out = []
    for name, spec in args.items():
        if spec is int or spec is float:
            out.append(Arg(name, spec.__name__))
        elif isinstance(spec, str):
            out.append(Arg(name, "tensor", _parse_dims(spec)))
        else:
            raise TypeError(f"arg {name!r}: spec must be a dims string like 'K, D', int or float")
    return tuple(out)


@dataclass(frozen=True)
class Kernel:
    """One hot spot (see the module docstring). Build it with `Kernel.declare` (validates) or `@kernel`
    (declares and registers). `mlir` is a template file (Path) or the template text itself."""

    name: str
    reference: Callable[..., Any]
    args: tuple[Arg, ...] = ()
    results: tuple[Arg, ...] = ()
    static: frozenset[str] = frozenset()
    dtypes: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    result_dtypes: Mapping[str, Any] = field(default_factory=dict)
    mlir: "Path | str | None" = None
    alternatives: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    mlir_variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    trace_sizes: frozenset[str] = frozenset()

    @classmethod
    def declare(cls, name: str, reference: Callable[..., Any], *, args: Mapping[str, Any] | None = None,
                results: Mapping[str, str] | None = None, static: Sequence[str] = (),
                dtypes: Mapping[str, Sequence[Any]] | None = None, result_dtypes: Mapping[str, Any] | None = None,
                mlir: "Path | str | None" = None, alternatives: Mapping[str, Callable[..., Any]] | None = None,
                mlir_variants: Mapping[str, Mapping[str, Any]] | None = None,
                trace_sizes: Sequence[str] = ()) -> "Kernel":
        if not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise ValueError(f"kernel name must be an identifier, got {name!r}")
        if (args is None) != (results is None) or (mlir is not None and args is None):
            raise ValueError(f"kernel {name!r}: args and results go together, and an MLIR kernel needs them")
        k = cls(name, reference, _parse_args(args or {}),
                tuple(Arg(n, "tensor", _parse_dims(s)) for n, s in (results or {}).items()), frozenset(static),
                {a: tuple(v) for a, v in (dtypes or {}).items()}, dict(result_dtypes or {}), mlir,
                dict(alternatives or {}), {v: dict(e) for v, e in (mlir_variants or {}).items()},
                frozenset(LEAD if d == "..." else d for d in trace_sizes))
        k._check()
        return k

    def _check(self) -> None:
        named = [*self.alternatives, *self.mlir_variants]
        if {"reference", "kernel"} & set(named) or len(set(named)) != len(named):
            raise ValueError(f"{self.name}: implementation names {named} repeat or reuse 'reference'/'kernel'")
        if self.mlir_variants and self.mlir is None:
            raise ValueError(f"{self.name}: MLIR variants need an MLIR template")
        known = {d for a in self.args for d in a.dims if isinstance(d, str)}
        if self.trace_sizes - known:
            raise ValueError(f"{self.name}: trace_sizes {sorted(self.trace_sizes - known)} are not argument dims")
        if not self.args:  # a reference-only hook: nothing to check, nothing to lower
            return
        if self.static - known:
            raise ValueError(f"{self.name}: static dims {sorted(self.static - known)} are not argument dims")
        known |= {a.name for a in self.args if a.kind == "int"}
        if any(LEAD in r.dims for r in self.results) and LEAD not in known:
            raise ValueError(f"{self.name}: a result starts with '...' but no argument does")
        for r in self.results:
            missing = [d for d in r.dims if isinstance(d, str) and d not in known]
            if missing:
                raise ValueError(f"{self.name}: result {r.name!r} uses dims {missing} no argument defines")
        if not any(a.kind == "tensor" for a in self.args):
            raise ValueError(f"{self.name}: needs at least one tensor argument")

    @property
    def impls(self) -> list[str]:
        """Implementation names: 'reference', the torch alternatives, 'kernel' when there is MLIR,
        then the MLIR variants."""
        return ["reference", *self.alternatives, *(["kernel", *self.mlir_variants] if self.mlir is not None else [])]

    def is_mlir(self, impl: str) -> bool:
        """True for the implementations that are MLIR (lowered by export/kernel_op.py)."""
        return self.mlir is not None and (impl == "kernel" or impl in self.mlir_variants)

    def check_impl(self, impl: str) -> None:
        if impl not in self.impls:
            raise ValueError(f"kernel op {self.name!r} has no implementation {impl!r}; choose from {self.impls}")

    def mlir_template(self) -> str:
        if self.mlir is None:
            raise ValueError(f"kernel {self.name!r} has no MLIR template")
        if isinstance(self.mlir, str):
            return self.mlir
        # the shared macros first (rows.mlir.jinja), so every template can call them
        return self.mlir.with_name("rows.mlir.jinja").read_text() + self.mlir.read_text()

    @property
    def summary(self) -> str:
        return (self.reference.__doc__ or "").strip().splitlines()[0] if self.reference.__doc__ else ""

    @property
    def schema(self) -> str:
        """The torch op schema of the MLIR kernel."""
        a = ", ".join(f"{_SCHEMA_TYPE[x.kind]} {x.name}" for x in self.args)
        return f"{self.name}({a}) -> ({', '.join('Tensor' for _ in self.results)})"

    def bind_dims(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """dim name -> size (int or SymInt) from the tensor arguments; validates ranks/dtypes."""
        sizes: dict[str, Any] = {}
        for a in self.args:
            if a.kind != "tensor":
                continue
            t = tensors[a.name]
            if t.dim() != len(a.dims):
                raise ValueError(f"{self.name}: argument {a.name!r} must have rank {len(a.dims)} "
                                 f"({', '.join(map(str, a.dims))}), got shape {tuple(t.shape)}")
            allowed = self.dtypes.get(a.name)
            if allowed and t.dtype not in allowed:
                raise TypeError(f"{self.name}: argument {a.name!r} has dtype {t.dtype}, expected one of {allowed}")
            for ax, d in enumerate(a.dims):
                size = t.shape[ax]
                if isinstance(d, int):
                    if isinstance(size, int) and size != d:
                        raise ValueError(f"{self.name}: {a.name}.shape[{ax}] must be {d}, got {size}")
                elif d not in sizes:
                    sizes[d] = size
                elif isinstance(size, int) and isinstance(sizes[d], int) and size != sizes[d]:
                    raise ValueError(f"{self.name}: dim {d} is {sizes[d]} elsewhere but {a.name}.shape[{ax}] = {size}")
        return sizes

    def result_shapes(self, tensors: Mapping[str, Any], attrs: Mapping[str, Any] | None = None) -> list[tuple[list[Any], Any]]:
        """[(shape, dtype)] of the results for these arguments (attributes may size a result dim)."""
        sizes = {**(attrs or {}), **self.bind_dims(tensors)}
        first = next(tensors[a.name].dtype for a in self.args if a.kind == "tensor")
        out = []
        for r in self.results:
            spec = self.result_dtypes.get(r.name)
            dtype = first if spec is None else tensors[spec].dtype if isinstance(spec, str) else spec
            out.append(([d if isinstance(d, int) else sizes[d] for d in r.dims], dtype))
        return out


KERNELS: dict[str, Kernel] = {}
_ROUTED: dict[str, Callable[..., Any]] = {}  # hook name -> what it runs instead of its reference (`overrides`)


def kernel(name: str, *, mlir: str | None = None, **spec: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare `ref` as the model's hot spot `name` (see the module docstring; `mlir` names a template
    file beside the module); returns the hook to call."""

    def wrap(ref: Callable[..., Any]) -> Callable[..., Any]:
        if name in KERNELS:
            raise ValueError(f"kernel {name!r} is declared twice")
        path = None
        if mlir is not None:
            path = Path(sys.modules[ref.__module__].__file__).with_name(mlir)
            if not path.is_file():
                raise FileNotFoundError(f"kernel {name!r}: MLIR template {path} is missing")
        KERNELS[name] = Kernel.declare(name, ref, mlir=path, **spec)
        return hook(name, ref)

    return wrap


def hook(name: str, ref: Callable[..., Any]) -> Callable[..., Any]:
    """The function the model calls for hot spot `name`: `ref`, unless `overrides` routes it elsewhere."""

    @functools.wraps(ref)
    def call(*a: Any, **kw: Any) -> Any:
        impl = _ROUTED.get(name)
        return ref(*a, **kw) if impl is None else impl(*a, **kw)

    return call


class _Hooks(Mapping[str, Callable[..., Any]]):
    """hook name -> its torch reference (a live view of KERNELS)."""

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return KERNELS[name].reference

    def __iter__(self) -> Iterator[str]:
        return iter(KERNELS)

    def __len__(self) -> int:
        return len(KERNELS)


HOOKS: Mapping[str, Callable[..., Any]] = _Hooks()


def runs_reference(name: str) -> bool:
    """Whether hook `name` runs its torch reference now: no override, or the reference itself chosen."""
    impl = _ROUTED.get(name)
    return impl is None or impl is KERNELS[name].reference


@contextlib.contextmanager
def overrides(impls: Mapping[str, Callable[..., Any]], registry: Mapping[str, Kernel] | None = None) -> Iterator[None]:
    """Route hooks to other implementations ({hook name: callable}) while the block runs: the one way
    an implementation is chosen (export's plan: export/kernel_op.use_kernels)."""
    reg = KERNELS if registry is None else registry
    unknown = set(impls) - set(reg)
    if unknown:
        raise KeyError(f"unknown kernel hook(s) {sorted(unknown)}; defined: {sorted(reg)}")
    saved = dict(_ROUTED)
    _ROUTED.update(impls)
    try:
        yield
    finally:
        _ROUTED.clear()
        _ROUTED.update(saved)


# Every kernel module registers its declarations on import (eagerly, so the registry is complete
# whichever part of the model is imported first).
from . import barrier, indexer, linear, mhc, moe, norm, qdq, sparse_attention, topk  # noqa: E402,F401
