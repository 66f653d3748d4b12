"""Custom-kernel hooks: a hot spot is a torch reference plus optional substitutes, chosen per op.

The model's hot spots are declared once in the model (``dsv4.model.kernels.kernel``: reference,
argument spec, MLIR template file, torch alternatives); ``KernelOp.from_kernel`` turns such a
declaration into an op here (export/model_kernels.py builds the table). ``kernel_op`` declares an op
directly (the small examples in example_kernels.py and tests).

A ``KernelOp`` is called like a function. What runs (eager) or gets traced (export) is its
*selected implementation*:

* ``"reference"`` (the default): the plain torch reference, called directly, so torch.export traces
  it as-is (ordinary decomposition into aten ops). Tests trust this one.
* any named torch *alternative* (e.g. the radix-select top-k that dodges an IREE miscompile):
  also called directly and traced.
* ``"kernel"``: an iree-turbine ``CustomOp`` whose ``generate`` inlines hand-written MLIR (a
  ``util.func`` with linalg/IREE ops) into the exported module. Eagerly, turbine JIT-compiles the
  same MLIR through IREE local-task, so the kernel can be checked against the reference without
  exporting.
* any named *MLIR variant* (``mlir_variants={"kernel_f32": {"gemm": "f32"}}``): the same template
  rendered with extra variables, as its own turbine op (``dsv4k.<name>_<variant>``).

The MLIR lands verbatim as ``util.func private @dsv4k_<op>_<spec>`` (one per specialization, shared
by all entry points; a static-shape entry point reuses the dynamic kernel, except that the sizes of
the dims an op names in ``trace_sizes`` reach its template as ``<dim>_size`` when the trace knows
them, one specialization each), with no
``torch.operator`` left, and IREE inlines and fuses it like any other code. It needs
``compat.apply()`` on compiler 3.13 and relies on turbine's op_reg internals
(``KernelSelection``/``KernelBuilder``); eager calls JIT-compile each specialization (first call
~0.6 s, then ~0.3 ms). Measured (2026-11-29, tests/test_export_infra.py): export_program 0.25-0.9 s,
llvm-cpu and gfx942 compiles ~1 s, every program within 2e-6 x max|ref| of a float64 reference.
(An opaque ``torch.library`` op lowered by decomposition was measured too and dropped: it can only
substitute torch code, which calling an alternative already does; docs/export-notes.md.)

Defining an op (the template is Jinja2 over MLIR; ``{{kernel_name}}``, ``{{op}}`` (the op's name),
``{{<arg>_type}}``, ``{{<arg>_dtype}}``, static dim sizes and scalar attributes by name)::

    @kernel_op(args={"table": "N, D", "idx": "K"}, results={"out": "K, D"}, static=("D",),
               dtypes={"idx": (torch.int64,)}, mlir=GATHER_ROWS_MLIR)
    def gather_rows(table, idx):
        return table[idx]

Dims named in ``static`` are baked into the kernel (one kernel per value); all other dims stay
dynamic. A leading ``...`` (e.g. ``"..., K"``) takes any leading dims: the kernel sees them
flattened into one dynamic dim, and results that start with ``...`` get them back. A result dim
may name an ``int`` attribute (``"..., k"``). Result shapes and dtypes follow from the dim names (and
``result_dtypes``). The kernel function takes the tensor arguments in declaration order and returns
the results in declaration order.

Selecting implementations: ``set_impl("gather_rows", "kernel")``, ``with impls(gather_rows=
"kernel"):`` (wrap ``fxb.export_program``: the choice is read while tracing), or the environment
``DSV4_KERNEL_IMPLS="gather_rows=kernel,*=reference"`` (``*`` applies to every op offering that
implementation).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

__all__ = [
    "KernelOp",
    "KERNEL_OPS",
    "LIBRARY_NS",
    "current_impl",
    "impls",
    "kernel_op",
    "set_impl",
]

LIBRARY_NS = "dsv4k"  # turbine CustomOps: torch.ops.dsv4k.<name>
ENV_VAR = "DSV4_KERNEL_IMPLS"

KERNEL_OPS: dict[str, "KernelOp"] = {}
_SELECTED: dict[str, str] = {}  # explicit choices (set_impl / impls); beat the env var
_LOCK = threading.Lock()
_turbine_lib: Any = None


# ------------------------------------------------------------------------------------------------
# Declarative shape spec
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Arg:
    name: str
    kind: str  # "tensor" | "int" | "float"
    dims: tuple["str | int", ...] = ()


LEAD = "_lead"  # the dim a leading "..." becomes (all leading dims, flattened)


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


def _parse_args(args: Mapping[str, "str | type"]) -> tuple[_Arg, ...]:
    out = []
    for name, spec in args.items():
        if spec is int:
            out.append(_Arg(name, "int"))
        elif spec is float:
            out.append(_Arg(name, "float"))
        elif isinstance(spec, str):
            out.append(_Arg(name, "tensor", _parse_dims(spec)))
        else:
            raise TypeError(f"arg {name!r}: spec must be a dims string like 'K, D', int or float")
    return tuple(out)


_SCHEMA_TYPE = {"tensor": "Tensor", "int": "int", "float": "float"}


# ------------------------------------------------------------------------------------------------
# KernelOp
# ------------------------------------------------------------------------------------------------


class KernelOp:
    """A hot spot: torch reference + optional torch alternatives + optional MLIR kernel."""

    def __init__(
        self,
        name: str,
        reference: Callable[..., Any],
        *,
        args: Mapping[str, "str | type"],
        results: Mapping[str, str],
        mlir: "str | Callable[..., str] | None" = None,
        static: Sequence[str] = (),
        result_dtypes: Mapping[str, "torch.dtype | str"] | None = None,
        dtypes: Mapping[str, Sequence[torch.dtype]] | None = None,
        alternatives: Mapping[str, Callable[..., Any]] | None = None,
        default: str = "reference",
        mlir_variants: Mapping[str, Mapping[str, Any]] | None = None,
        trace_sizes: Sequence[str] = (),
    ):
        if not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise ValueError(f"kernel op name must be an identifier, got {name!r}")
        if name in KERNEL_OPS:
            raise ValueError(f"kernel op {name!r} is already defined")
        self.name = name
        self.reference = reference
        self.args = _parse_args(args)
        self.results = tuple(_Arg(n, "tensor", _parse_dims(s)) for n, s in results.items())
        self.mlir = mlir
        self.static = frozenset(static)
        self.result_dtypes = dict(result_dtypes or {})
        self.dtypes = {k: tuple(v) for k, v in (dtypes or {}).items()}
        self.alternatives = dict(alternatives or {})
        self.mlir_variants = {k: dict(v) for k, v in (mlir_variants or {}).items()}
        for reserved in ("reference", "kernel"):
            if reserved in self.alternatives or reserved in self.mlir_variants:
                raise ValueError(f"{name}: implementation name {reserved!r} is reserved")
        if set(self.alternatives) & set(self.mlir_variants):
            raise ValueError(f"{name}: {sorted(set(self.alternatives) & set(self.mlir_variants))} named twice")
        if self.mlir_variants and mlir is None:
            raise ValueError(f"{name}: MLIR variants need an MLIR template")
        self.trace_sizes = frozenset(LEAD if d == "..." else d for d in trace_sizes)
        self._check_spec()
        unknown = self.trace_sizes - {d for a in self.args for d in a.dims if isinstance(d, str)}
        if unknown:
            raise ValueError(f"{name}: trace_sizes {sorted(unknown)} are not argument dims")
        self.default = default
        if default not in self.impl_names:
            raise ValueError(f"{name}: default impl {default!r} not in {self.impl_names}")
        self._kernel_ops: dict[str, Any] = {}  # impl -> torch.ops.dsv4k.<name>[_<variant>], registered lazily
        self.__doc__ = reference.__doc__
        self.__wrapped__ = reference
        KERNEL_OPS[name] = self

    @classmethod
    def from_kernel(cls, spec: Any) -> "KernelOp":
        """The op of a model kernel declaration (``dsv4.model.kernels.Kernel``)."""
        return cls(spec.name, spec.reference, args=spec.args or {}, results=spec.results or {},
                   mlir=spec.mlir_template() if spec.mlir else None, static=spec.static,
                   result_dtypes=spec.result_dtypes, dtypes=spec.dtypes, alternatives=spec.alternatives,
                   mlir_variants=spec.mlir_variants, trace_sizes=spec.trace_sizes)

    def _check_spec(self) -> None:
        if not self.args:  # a reference-only hook: nothing to check, nothing to lower
            if self.mlir is not None:
                raise ValueError(f"{self.name}: an MLIR kernel needs an argument spec")
            return
        known = {d for a in self.args for d in a.dims if isinstance(d, str)}
        known |= {a.name for a in self.args if a.kind == "int"}
        if any(LEAD in r.dims for r in self.results) and LEAD not in known:
            raise ValueError(f"{self.name}: a result starts with '...' but no argument does")
        for r in self.results:
            missing = [d for d in r.dims if isinstance(d, str) and d not in known]
            if missing:
                raise ValueError(f"{self.name}: result {r.name!r} uses dims {missing} no argument defines")
        unknown_static = self.static - known
        if unknown_static:
            raise ValueError(f"{self.name}: static dims {sorted(unknown_static)} are not argument dims")
        if not any(a.kind == "tensor" for a in self.args):
            raise ValueError(f"{self.name}: needs at least one tensor argument")

    # -- selection ---------------------------------------------------------------------------
    @property
    def impl_names(self) -> list[str]:
        names = ["reference", *self.alternatives]
        if self.mlir is not None:
            names += ["kernel", *self.mlir_variants]
        return names

    def implementation(self, impl: str) -> Callable[..., Any]:
        if impl == "reference":
            return self.reference
        if impl in self.alternatives:
            return self.alternatives[impl]
        if impl == "kernel" and self.mlir is not None:
            return self._call_kernel
        if impl in self.mlir_variants:
            return lambda *args: self._call_kernel(*args, impl=impl)
        raise ValueError(f"kernel op {self.name!r} has no implementation {impl!r}; choose from {self.impl_names}")

    def __call__(self, *args: Any) -> Any:
        return self.implementation(current_impl(self.name))(*args)

    def _call_kernel(self, *args: Any, impl: str = "kernel") -> Any:
        """The turbine op on the hook's arguments: attributes cast to int/float, '...' dims flattened."""
        lead = None
        flat = []
        for a, v in zip(self.args, args):
            if a.kind == "int":
                v = int(v)
            elif a.kind == "float":
                v = float(v)
            elif a.dims and a.dims[0] == LEAD:
                n_tail = len(a.dims) - 1
                lead = tuple(v.shape[: v.dim() - n_tail])
                v = v.reshape(-1, *v.shape[v.dim() - n_tail:])
            flat.append(v)
        out = self.turbine_op(impl)(*flat)
        if lead is None:
            return out
        outs = (out,) if len(self.results) == 1 else tuple(out)
        outs = tuple(o.reshape(*lead, *o.shape[1:]) if r.dims and r.dims[0] == LEAD else o
                     for r, o in zip(self.results, outs))
        return outs[0] if len(self.results) == 1 else outs

    def __repr__(self) -> str:
        return f"KernelOp({self.name!r}, impl={current_impl(self.name)!r}, impls={self.impl_names})"

    # -- schema / shapes ---------------------------------------------------------------------
    @property
    def schema(self) -> str:
        a = ", ".join(f"{_SCHEMA_TYPE[x.kind]} {x.name}" for x in self.args)
        r = ", ".join("Tensor" for _ in self.results)
        return f"{self.name}({a}) -> ({r})"

    def _bind_dims(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """dim name -> size (int or SymInt) from the tensor arguments; validates ranks/dtypes."""
        sizes: dict[str, Any] = {}
        for a in self.args:
            if a.kind != "tensor":
                continue
            t = tensors[a.name]
            if t.dim() != len(a.dims):
                raise ValueError(
                    f"{self.name}: argument {a.name!r} must have rank {len(a.dims)} "
                    f"({', '.join(map(str, a.dims))}), got shape {tuple(t.shape)}"
                )
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

    def _result_dtype(self, r: _Arg, tensors: Mapping[str, Any]) -> torch.dtype:
        spec = self.result_dtypes.get(r.name)
        if spec is None:
            return next(tensors[a.name].dtype for a in self.args if a.kind == "tensor")
        if isinstance(spec, str):
            return tensors[spec].dtype
        return spec

    def _result_shapes(self, tensors: Mapping[str, Any], attrs: Mapping[str, Any] | None = None
                       ) -> list[tuple[list[Any], torch.dtype]]:
        sizes = {**(attrs or {}), **self._bind_dims(tensors)}
        return [
            ([d if isinstance(d, int) else sizes[d] for d in r.dims], self._result_dtype(r, tensors))
            for r in self.results
        ]

    # -- the turbine CustomOp with inline MLIR -------------------------------------------
    @property
    def kernel(self) -> Any:
        """The turbine custom op (``torch.ops.dsv4k.<name>``), registered on first use."""
        return self.turbine_op("kernel")

    def turbine_op(self, impl: str = "kernel") -> Any:
        """The turbine custom op of MLIR implementation `impl` ('kernel' or a variant), registered
        on first use: ``torch.ops.dsv4k.<name>`` for 'kernel', ``.<name>_<variant>`` for a variant."""
        if self.mlir is None:
            raise ValueError(f"kernel op {self.name!r} has no MLIR kernel")
        if impl != "kernel" and impl not in self.mlir_variants:
            raise ValueError(f"kernel op {self.name!r} has no MLIR implementation {impl!r}")
        if impl not in self._kernel_ops:
            with _LOCK:
                if impl not in self._kernel_ops:
                    self._kernel_ops[impl] = _register_turbine_op(self, impl)
        return self._kernel_ops[impl]

    def render_mlir(self, env: Mapping[str, Any]) -> str:
        """The kernel's MLIR module text for one specialization (``env`` from the selection)."""
        if callable(self.mlir):
            text = self.mlir(**env)
        else:
            text = _render_jinja(self.mlir, env)
        return _as_module(text)


def kernel_op(
    *,
    args: Mapping[str, "str | type"],
    results: Mapping[str, str],
    mlir: "str | Callable[..., str] | None" = None,
    static: Sequence[str] = (),
    result_dtypes: Mapping[str, "torch.dtype | str"] | None = None,
    dtypes: Mapping[str, Sequence[torch.dtype]] | None = None,
    alternatives: Mapping[str, Callable[..., Any]] | None = None,
    default: str = "reference",
    name: str | None = None,
) -> Callable[[Callable[..., Any]], KernelOp]:
    """Decorator: turn a torch reference function into a ``KernelOp`` (see module docstring)."""

    def wrap(reference: Callable[..., Any]) -> KernelOp:
        return KernelOp(
            name or reference.__name__,
            reference,
            args=args,
            results=results,
            mlir=mlir,
            static=static,
            result_dtypes=result_dtypes,
            dtypes=dtypes,
            alternatives=alternatives,
            default=default,
        )

    return wrap


# ------------------------------------------------------------------------------------------------
# Implementation switch
# ------------------------------------------------------------------------------------------------


def _env_choices() -> dict[str, str]:
    raw = os.environ.get(ENV_VAR, "").strip()
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in raw.split(","))):
        op, sep, impl = item.partition("=")
        if not sep or not op.strip() or not impl.strip():
            raise ValueError(f"{ENV_VAR}: expected 'op=impl[,op=impl]' (op may be '*'), got {item!r}")
        out[op.strip()] = impl.strip()
    return out


def current_impl(name: str) -> str:
    """The implementation ``name`` uses now: explicit choice > env var (op, then '*') > default."""
    op = KERNEL_OPS[name]
    if name in _SELECTED:
        return _SELECTED[name]
    env = _env_choices()
    if name in env:
        op.implementation(env[name])  # validate: a typo should fail loudly
        return env[name]
    if "*" in env and env["*"] in op.impl_names:
        return env["*"]
    return op.default


def _normalize(choices: Mapping[str, str]) -> dict[str, str]:
    resolved: dict[str, str] = {}
    for name, impl in choices.items():
        targets = list(KERNEL_OPS) if name == "*" else [name]
        if name != "*" and name not in KERNEL_OPS:
            raise KeyError(f"unknown kernel op {name!r}; defined: {sorted(KERNEL_OPS)}")
        for t in targets:
            op = KERNEL_OPS[t]
            if name == "*" and impl not in op.impl_names:
                continue
            op.implementation(impl)  # validates
            resolved[t] = impl
    return resolved


def set_impl(name: str, impl: "str | None") -> None:
    """Globally choose ``impl`` for op ``name`` ('*' = every op that has it); None = back to default."""
    if impl is None:
        for t in (list(KERNEL_OPS) if name == "*" else [name]):
            _SELECTED.pop(t, None)
        return
    resolved = _normalize({name: impl})
    for t, i in resolved.items():
        if i == "kernel" or i in KERNEL_OPS[t].mlir_variants:
            KERNEL_OPS[t].turbine_op(i)  # register before any (strict/dynamo) tracing sees the op
    _SELECTED.update(resolved)


@contextlib.contextmanager
def impls(**choices: str) -> Iterator[None]:
    """Temporarily select implementations, e.g. ``with impls(gather_rows="kernel"):``.

    Use ``impls(**{"*": "kernel"})`` for every op that has a kernel. Wrap the
    ``fxb.export_program`` calls: the choice is read while torch.export traces."""
    saved = dict(_SELECTED)
    try:
        for name, impl in choices.items():
            set_impl(name, impl)
        yield
    finally:
        _SELECTED.clear()
        _SELECTED.update(saved)


# ------------------------------------------------------------------------------------------------
# Registration internals
# ------------------------------------------------------------------------------------------------


def _render_jinja(template: str, env: Mapping[str, Any]) -> str:
    import jinja2

    # `{#` occurs in MLIR attribute dictionaries ({#map...}); move Jinja comments out of the way.
    jenv = jinja2.Environment(
        undefined=jinja2.StrictUndefined,
        comment_start_string="{##",
        comment_end_string="##}",
        keep_trailing_newline=True,
    )
    return jenv.from_string(template).render(**env)


_ALIAS_LINE = re.compile(r"^[#!][\w.$-]+\s*=")


def _as_module(text: str) -> str:
    """Wrap bare functions in ``module { }``; hoist top-level ``#map =`` / ``!t =`` aliases."""
    if re.match(r"\s*module\b", text):
        return text
    lines = text.splitlines()
    aliases = [ln for ln in lines if _ALIAS_LINE.match(ln)]
    body = [ln for ln in lines if not _ALIAS_LINE.match(ln)]
    return "\n".join([*aliases, "module {", *body, "}"]) + "\n"


def _mangle(parts: Sequence[Any]) -> str:
    """A readable MLIR symbol for one specialization (floats: 1.5 -> 1p5, -2.0 -> m2p0)."""
    clean = []
    for p in parts:
        s = str(p).replace(".", "p").replace("-", "m")
        clean.append(re.sub(r"[^A-Za-z0-9_]", "", s))
    s = "_".join(c for c in clean if c)
    return s if len(s) <= 120 else s[:100] + "_" + hashlib.sha1(s.encode()).hexdigest()[:10]


def _register_turbine_op(kop: KernelOp, impl: str = "kernel") -> Any:
    global _turbine_lib
    from . import compat

    compat.apply()
    from iree.turbine.runtime.op_reg import CustomOp, def_library
    from iree.turbine.runtime.op_reg.impl_helper import TemplateLoader, call_function
    from iree.turbine.support.conversions import TORCH_DTYPE_TO_IREE_TYPE_ASM

    if _turbine_lib is None:
        _turbine_lib = def_library(LIBRARY_NS)

    class _InlineLoader(TemplateLoader):
        def load_template(self, kb: Any, name: str, **kwargs: Any) -> Any:
            return self._parse_module_asm(kb, kwargs["text"])

    loader = _InlineLoader()
    op_name = kop.name if impl == "kernel" else f"{kop.name}_{impl}"
    extra = kop.mlir_variants.get(impl, {})
    tensor_idx = [i for i, a in enumerate(kop.args) if a.kind == "tensor"]

    def select(self: Any, ksel: Any) -> None:
        descs: dict[str, Any] = {}
        tensors: dict[str, Any] = {}
        attrs: dict[str, Any] = {}
        for i, a in enumerate(kop.args):
            if a.kind == "tensor":
                descs[a.name] = ksel.arg_tensor(i)
                tensors[a.name] = descs[a.name].t
            elif a.kind == "int":
                attrs[a.name] = ksel.attr_int(i).v
            else:
                attrs[a.name] = ksel.attr_float(i).v
        for a in kop.args:
            if a.kind == "tensor":
                axes = [ax for ax, d in enumerate(a.dims) if isinstance(d, int) or d in kop.static]
                if axes:
                    descs[a.name].specialize_dims(*axes)
        for r, (shape, dtype) in zip(kop.results, kop._result_shapes(tensors, attrs)):
            rd = ksel.return_new_tensor(shape, dtype)
            axes = [ax for ax, d in enumerate(r.dims) if isinstance(d, int) or d in kop.static or d in attrs]
            if axes:
                rd.specialize_dims(*axes)

    def generate(self: Any, ksel: Any, kb: Any) -> None:
        env: dict[str, Any] = dict(extra)
        parts = [LIBRARY_NS, op_name]
        for i, a in enumerate(kop.args):
            d = ksel.arg_descs[i]
            if a.kind == "tensor":
                env[f"{a.name}_type"] = d.mlir_type_asm
                env[f"{a.name}_dtype"] = TORCH_DTYPE_TO_IREE_TYPE_ASM[d.t.dtype]
                parts.append(env[f"{a.name}_dtype"])
                for ax, dn in enumerate(a.dims):
                    if isinstance(dn, str) and dn in kop.static and dn not in env:
                        env[dn] = int(d.spec_dims[ax])
                    if dn in kop.trace_sizes:
                        key = "lead_size" if dn == LEAD else f"{dn}_size"
                        size = d.t.shape[ax]  # an int in a static-shape entry point, else a SymInt
                        if env.get(key) is None:
                            env[key] = int(size) if isinstance(size, int) else None
            else:
                env[a.name] = d.v
        parts += [f"{dn}{env[dn]}" for dn in sorted(kop.static)]
        parts += [f"{k}{env[k]}" for k in sorted(k for k in env if k.endswith("_size") and env[k] is not None)]
        parts += [f"{a.name}{env[a.name]}" for a in kop.args if a.kind != "tensor"]
        for r, d in zip(kop.results, ksel.result_descs):
            env[f"{r.name}_type"] = d.mlir_type_asm
            env[f"{r.name}_dtype"] = TORCH_DTYPE_TO_IREE_TYPE_ASM[d.t.dtype]
        fn_name = _mangle(parts)
        env["kernel_name"] = fn_name
        env["op"] = kop.name  # one template may serve several ops (model/kernels/quant.mlir.jinja)
        # Render only when this specialization is not in the module yet.
        try:
            func = kb.symbol_table[fn_name]
        except KeyError:
            func = loader.inline_template_function(kb, kop.name, fn_name, text=kop.render_mlir(env))
        operands = [kb.arg_value(i) for i in tensor_idx]
        kb.yield_results(*call_function(func, *operands))

    schema = kop.schema.replace(kop.name, op_name, 1)
    cls = type(op_name, (CustomOp,), {"signature": schema, "select": select, "generate": generate})
    return CustomOp.register(library=_turbine_lib)(cls)
