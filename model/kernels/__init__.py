"""Custom-kernel hooks: the model's hot spots, each a plain torch reference (what eager runs and
the tests trust) that export can replace by a kernel IREE compiles."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Mapping

__all__ = ["hookable", "overrides", "HOOKS"]

# hook name -> the undecorated torch reference (what `hookable` wrapped)
HOOKS: dict[str, Callable[..., Any]] = {}
_OVERRIDES: dict[str, Callable[..., Any]] = {}


def hookable(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make a reference function replaceable under `name` (export installs kernels through this).

    With no override installed the reference runs unchanged, so eager results are bit-identical;
    the model never imports the export side (turbine), which installs overrides while tracing."""

    def wrap(ref: Callable[..., Any]) -> Callable[..., Any]:
        HOOKS[name] = ref

        @functools.wraps(ref)
        def call(*args: Any, **kwargs: Any) -> Any:
            impl = _OVERRIDES.get(name)
            return ref(*args, **kwargs) if impl is None else impl(*args, **kwargs)

        return call

    return wrap


@contextlib.contextmanager
def overrides(impls: Mapping[str, Callable[..., Any]]) -> Iterator[None]:
    """Temporarily route hooks to other implementations ({hook name: callable})."""
    unknown = set(impls) - set(HOOKS)
    if unknown:
        raise KeyError(f"unknown kernel hook(s) {sorted(unknown)}; defined: {sorted(HOOKS)}")
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(impls)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)
