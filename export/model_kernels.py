"""The model's kernel table, derived from the registry (``dsv4.model.kernels.KERNELS``).

Every hot spot declared in model/kernels (``@kernel``) gets a ``KernelOp`` here, with its torch
reference, its torch alternatives and, where it has an MLIR template, the inlined kernel. Nothing
is listed by hand: a new declaration shows up in ``MODEL_OPS``, in ``dsv4 export --kernel`` (its
help is ``kernel_help()``) and in the exporter's validation.

Use while tracing: ``with use_kernels({"sparse_attention": "kernel"}): fxb.export_program(...)``
(the exporter's ``kernels=`` argument does this). Each op traces the implementation chosen for it,
else its declared export default (``export=`` in the declaration, e.g. topk -> "radix"), else
the reference, which is traced as the model calls it (no KernelOp in between).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

from dsv4.model import kernels as mk

from .kernel_op import KernelOp, impls

__all__ = ["MODEL_OPS", "use_kernels", "resolve_choices", "kernel_help"]

MODEL_OPS: dict[str, KernelOp] = {name: KernelOp.from_kernel(spec) for name, spec in mk.KERNELS.items()}


def resolve_choices(choices: Mapping[str, str] | None = None) -> dict[str, str]:
    """{op: implementation} for every op: the declared export defaults, then `choices` on top
    ('*' = every op that offers the implementation). Unknown ops or implementations raise ValueError."""
    out = {name: mk.KERNELS[name].export for name in MODEL_OPS}
    for name, impl in (choices or {}).items():
        if name == "*":
            out.update({n: impl for n, op in MODEL_OPS.items() if impl in op.impl_names})
            continue
        if name not in MODEL_OPS:
            raise ValueError(f"unknown kernel op {name!r}; model ops: {sorted(MODEL_OPS)}")
        MODEL_OPS[name].implementation(impl)  # validates, raises ValueError listing the choices
        out[name] = impl
    return out


def kernel_help() -> str:
    """One line per op for `dsv4 export --kernel`: name, implementations, the export default."""
    lines = []
    for name, op in MODEL_OPS.items():
        default = mk.KERNELS[name].export
        lines.append(f"{name}={'|'.join(op.impl_names)} (export: {default})")
    return ("lowering of a hot spot; repeatable, '*=kernel' for every op that has one. "
            "Ops: " + "; ".join(lines) + ". Per target (export/exporter.py _default_kernels): an llvm-cpu-only "
            "export of a model whose routed experts pass 1 GiB a layer in f32 (Flash, Pro) takes "
            "mxfp4_linear_gathered=kernel; a GPU export with --batch-invariant takes the GEMMs' "
            "kernel_rows16")


@contextlib.contextmanager
def use_kernels(choices: Mapping[str, str] | None = None) -> Iterator[None]:
    """Trace every hot spot with its chosen implementation (see `resolve_choices`)."""
    routed = {n: i for n, i in resolve_choices(choices).items() if i != "reference"}
    with impls(**routed), mk.overrides({n: MODEL_OPS[n] for n in routed}):
        yield
