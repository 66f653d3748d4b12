"""The kernel registry: the model's hot spots, each declared once beside its torch reference.

A hot spot is a plain torch function (the reference: what eager runs and the tests trust) declared
with ``@kernel(name, ...)``. The declaration is the one place that says everything the export side
needs to replace it:

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
* ``alternatives``: other torch implementations (traced as written), by name;
* ``export``: the implementation export uses unless told otherwise (``dsv4 export --kernel OP=IMPL``).

Eager always runs the reference (bit-identical results); the model never imports the export side
(turbine). ``export/model_kernels.py`` builds the op table, the CLI help and the turbine ops from
``KERNELS``; while tracing it routes hooks to the chosen implementations through ``overrides``.

Adding a kernel: decorate the reference with ``@kernel(...)`` in its module under model/kernels/
(imported at the bottom of this file), put its template beside it, done.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

__all__ = ["Kernel", "KERNELS", "HOOKS", "kernel", "overrides"]


@dataclass(frozen=True)
class Kernel:
    """One hot spot's declaration (see the module docstring)."""

    name: str
    reference: Callable[..., Any]
    args: Mapping[str, Any] | None = None
    results: Mapping[str, str] | None = None
    static: tuple[str, ...] = ()
    dtypes: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    result_dtypes: Mapping[str, Any] = field(default_factory=dict)
    mlir: Path | None = None
    alternatives: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    export: str = "reference"
    mlir_variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    trace_sizes: tuple[str, ...] = ()

    @property
    def impls(self) -> list[str]:
        """Implementation names: 'reference', the torch alternatives, 'kernel' when there is MLIR,
        then the MLIR variants."""
        return ["reference", *self.alternatives, *(["kernel", *self.mlir_variants] if self.mlir else [])]

    def mlir_template(self) -> str:
        if self.mlir is None:
            raise ValueError(f"kernel {self.name!r} has no MLIR template")
        # the shared macros first (rows.mlir.jinja), so every template can call them
        return self.mlir.with_name("rows.mlir.jinja").read_text() + self.mlir.read_text()

    @property
    def summary(self) -> str:
        return (self.reference.__doc__ or "").strip().splitlines()[0] if self.reference.__doc__ else ""


KERNELS: dict[str, Kernel] = {}
_OVERRIDES: dict[str, Callable[..., Any]] = {}


def kernel(name: str, *, args: Mapping[str, Any] | None = None, results: Mapping[str, str] | None = None,
           static: Sequence[str] = (), dtypes: Mapping[str, Sequence[Any]] | None = None,
           result_dtypes: Mapping[str, Any] | None = None, mlir: str | None = None,
           alternatives: Mapping[str, Callable[..., Any]] | None = None,
           export: str = "reference",
           mlir_variants: Mapping[str, Mapping[str, Any]] | None = None,
           trace_sizes: Sequence[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare `ref` as the hot spot `name` (see the module docstring); returns the hook to call."""

    def wrap(ref: Callable[..., Any]) -> Callable[..., Any]:
        if name in KERNELS:
            raise ValueError(f"kernel {name!r} is declared twice")
        if (args is None) != (results is None) or (mlir and args is None):
            raise ValueError(f"kernel {name!r}: args and results go together, and an MLIR kernel needs them")
        if mlir_variants and not mlir:
            raise ValueError(f"kernel {name!r}: MLIR variants need an MLIR template")
        path = None
        if mlir is not None:
            import sys

            path = Path(sys.modules[ref.__module__].__file__).with_name(mlir)
            if not path.is_file():
                raise FileNotFoundError(f"kernel {name!r}: MLIR template {path} is missing")
        spec = Kernel(name, ref, dict(args) if args else None, dict(results) if results else None, tuple(static),
                      {k: tuple(v) for k, v in (dtypes or {}).items()}, dict(result_dtypes or {}), path,
                      dict(alternatives or {}), export, {k: dict(v) for k, v in (mlir_variants or {}).items()},
                      tuple(trace_sizes))
        if export not in spec.impls:
            raise ValueError(f"kernel {name!r}: export implementation {export!r} is not one of {spec.impls}")
        KERNELS[name] = spec

        @functools.wraps(ref)
        def call(*a: Any, **kw: Any) -> Any:
            impl = _OVERRIDES.get(name)
            return ref(*a, **kw) if impl is None else impl(*a, **kw)

        return call

    return wrap


class _Hooks(Mapping[str, Callable[..., Any]]):
    """hook name -> its torch reference (a live view of KERNELS)."""

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return KERNELS[name].reference

    def __iter__(self) -> Iterator[str]:
        return iter(KERNELS)

    def __len__(self) -> int:
        return len(KERNELS)


HOOKS: Mapping[str, Callable[..., Any]] = _Hooks()


@contextlib.contextmanager
def overrides(impls: Mapping[str, Callable[..., Any]]) -> Iterator[None]:
    """Temporarily route hooks to other implementations ({hook name: callable})."""
    unknown = set(impls) - set(KERNELS)
    if unknown:
        raise KeyError(f"unknown kernel hook(s) {sorted(unknown)}; defined: {sorted(KERNELS)}")
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(impls)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


# Every kernel module registers its declarations on import (eagerly, so the registry is complete
# whichever part of the model is imported first).
from . import indexer, linear, mhc, moe, qdq, sparse_attention, topk  # noqa: E402,F401
