"""The export side of a hot spot (``dsv4.model.kernels.Kernel``): its implementations as callables,
the MLIR ones as iree-turbine custom ops, and ``use_kernels``, which routes the model's hooks to the
implementations an export's lowering plan chose (export/lowering.py) while it traces.

Implementations of a kernel:

* ``"reference"``: the plain torch reference, called directly, so torch.export traces it as-is
  (ordinary decomposition into aten ops). Tests trust this one.
* any named torch *alternative* (e.g. the radix-select top-k that dodges an IREE miscompile):
  also called directly and traced.
* ``"kernel"``: an iree-turbine ``CustomOp`` whose ``generate`` inlines the kernel's MLIR template (a
  ``util.func`` with linalg/IREE ops) into the exported module. Eagerly, turbine JIT-compiles the
  same MLIR through IREE local-task, so the kernel can be checked against the reference without
  exporting.
* any named *MLIR variant* (``mlir_variants={"kernel_f32": {"gemm": "f32"}}``): the same template
  rendered with extra variables, as its own turbine op (``dsv4k.<name>_<variant>``).

The MLIR lands verbatim as ``util.func private @dsv4k_<op>_<spec>`` (one per specialization, shared
by all entry points; a static-shape entry point reuses the dynamic kernel, except that the sizes of
the dims a kernel names in ``trace_sizes`` reach its template as ``<dim>_size`` when the trace knows
them, one specialization each), with no ``torch.operator`` left, and IREE inlines and fuses it like
any other code. It needs ``compat.apply()`` on compiler 3.13 and relies on turbine's op_reg internals
(``KernelSelection``/``KernelBuilder``); eager calls JIT-compile each specialization (first call
~0.6 s, then ~0.3 ms). Templates are Jinja2 over MLIR: ``{{kernel_name}}``, ``{{op}}`` (the kernel's
name), ``{{<arg>_type}}``, ``{{<arg>_dtype}}``, static dim sizes and scalar attributes by name.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
from typing import Any, Callable, Iterator, Mapping, Sequence

from dsv4.model import kernels as mk
from dsv4.model.kernels import LEAD, Kernel

__all__ = ["LIBRARY_NS", "implementation", "turbine_op", "use_kernels"]

LIBRARY_NS = "dsv4k"  # turbine CustomOps: torch.ops.dsv4k.<name>

_TURBINE_OPS: dict[tuple[str, str], Any] = {}  # (kernel, impl) -> torch.ops.dsv4k.<name>[_<variant>]
_LOCK = threading.Lock()
_turbine_lib: Any = None


def implementation(k: Kernel, impl: str) -> Callable[..., Any]:
    """The callable of `k`'s implementation `impl` (ValueError naming the choices if it has none)."""
    k.check_impl(impl)
    if impl == "reference":
        return k.reference
    if impl in k.alternatives:
        return k.alternatives[impl]
    turbine_op(k, impl)  # registered before any tracing sees the op
    return lambda *args: _call_kernel(k, impl, *args)


@contextlib.contextmanager
def use_kernels(choices: Mapping[str, str] | None = None,
                registry: Mapping[str, Kernel] | None = None) -> Iterator[None]:
    """Route every hook of `registry` (default: the model's) to its implementation while the block runs
    (wrap the tracing): the default plan with `choices` ({op: impl}, '*' = every op offering impl) on
    top (export/lowering.py resolve_kernels; an exporter passes its complete plan)."""
    from .lowering import resolve_kernels

    reg = mk.KERNELS if registry is None else registry
    plan = resolve_kernels(choices, reg)
    # every op, the references too: an outer `overrides` must not leak into the plan
    with mk.overrides({n: implementation(reg[n], i) for n, i in plan.items()}, reg):
        yield


def turbine_op(k: Kernel, impl: str = "kernel") -> Any:
    """The turbine custom op of MLIR implementation `impl` ('kernel' or a variant), registered on first
    use: ``torch.ops.dsv4k.<name>`` for 'kernel', ``.<name>_<variant>`` for a variant."""
    if not k.is_mlir(impl):
        raise ValueError(f"kernel {k.name!r} has no MLIR implementation {impl!r}")
    key = (k.name, impl)
    if key not in _TURBINE_OPS:
        with _LOCK:
            if key not in _TURBINE_OPS:
                _TURBINE_OPS[key] = _register_turbine_op(k, impl)
    return _TURBINE_OPS[key]


def _call_kernel(k: Kernel, impl: str, *args: Any) -> Any:
    """The turbine op on the hook's arguments: attributes cast to int/float, '...' dims flattened."""
    lead = None
    flat = []
    for a, v in zip(k.args, args):
        if a.kind == "int":
            v = int(v)
        elif a.kind == "float":
            v = float(v)
        elif a.dims and a.dims[0] == LEAD:
            n_tail = len(a.dims) - 1
            lead = tuple(v.shape[: v.dim() - n_tail])
            v = v.reshape(-1, *v.shape[v.dim() - n_tail:])
        flat.append(v)
    out = turbine_op(k, impl)(*flat)
    if lead is None:
        return out
    outs = (out,) if len(k.results) == 1 else tuple(out)
    outs = tuple(o.reshape(*lead, *o.shape[1:]) if r.dims and r.dims[0] == LEAD else o
                 for r, o in zip(k.results, outs))
    return outs[0] if len(k.results) == 1 else outs


def render_mlir(k: Kernel, env: Mapping[str, Any]) -> str:
    """The kernel's MLIR module text for one specialization (``env`` from the selection)."""
    return _as_module(_render_jinja(k.mlir_template(), env))


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


def _register_turbine_op(kop: Kernel, impl: str) -> Any:
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
        for r, (shape, dtype) in zip(kop.results, kop.result_shapes(tensors, attrs)):
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
            func = loader.inline_template_function(kb, kop.name, fn_name, text=render_mlir(kop, env))
        operands = [kb.arg_value(i) for i in tensor_idx]
        kb.yield_results(*call_function(func, *operands))

    schema = kop.schema.replace(kop.name, op_name, 1)
    cls = type(op_name, (CustomOp,), {"signature": schema, "select": select, "generate": generate})
    return CustomOp.register(library=_turbine_lib)(cls)
