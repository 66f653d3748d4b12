"""Compatibility shim: iree-turbine 3.9.0 on top of iree-base-compiler 3.13.

Why this exists
---------------
iree-turbine 3.9.0 is the newest turbine on PyPI, but we pin compiler/runtime 3.13 (the 3.10 set
lacks `--iree-rocm-target`, and newer codegen matters for gfx942). Two gaps between them:

1. The MLIR Python bindings dropped the static ``XType.isinstance(x)`` helpers in compiler 3.11
   (upstream iree-org/iree-turbine#1267, fixed on turbine main, never released). Turbine 3.9.0 still
   calls them, so every CustomOp expansion during ``aot.export`` and the procedural
   ``aot.CompiledModule`` path die with ``AttributeError: type object 'IntegerType' has no attribute
   'isinstance'``. The classes below are exactly the ones that turbine 3.9.0's sources call
   ``.isinstance`` on (``grep -rn '\\.isinstance(' iree/turbine``): OpResult, BlockArgument,
   RankedTensorType, IntegerType, IndexType, F16/F32/F64Type, ShapedType, MemRefType, VectorType.
   (The runtime's ``VmRef.isinstance`` is a different, still-existing method.) We restore each as a
   staticmethod that accepts what the old C++ helper accepted: a Python ``isinstance`` check, and,
   for an un-downcast generic ``Type``/``Value``, the binding's checked cast constructor.

2. Turbine's dtype tables lack ``torch.float8_e8m0fnu`` (DeepSeek's UE8M0 block scales), so an
   externalized e8m0 parameter fails with ``Could not map Torch dtype torch.float8_e8m0fnu to an
   IREE type``. We add it to the global-creation table, the ASM table (custom-op kernel signatures),
   the HAL element-type table, the host numpy view table and the .irpa metadata name table. The
   fx importer itself already knows ``f8E8M0FNU``.

``apply()`` is idempotent and is called where turbine is used (``exporter.export_model``, the
custom-op registration in ``kernel_op``; importing ``dsv4.export`` does nothing). Code that drives
turbine directly (tests) calls it first. Delete this module once a
turbine release with the fix is pinned (``needs_isinstance_shim()`` then returns False and
``apply`` becomes a no-op for part 1).
"""

from __future__ import annotations

from typing import Any

__all__ = ["apply", "is_applied", "needs_isinstance_shim", "PATCHED_IR_CLASSES"]

# The ir classes on which turbine 3.9.0 calls the removed static `isinstance`.
PATCHED_IR_CLASSES: tuple[str, ...] = (
    "OpResult",
    "BlockArgument",
    "RankedTensorType",
    "IntegerType",
    "IndexType",
    "F16Type",
    "F32Type",
    "F64Type",
    "ShapedType",
    "MemRefType",
    "VectorType",
)

_applied = False


def _make_isinstance(cls: type) -> Any:
    def _isinstance(x: Any) -> bool:
        if isinstance(x, cls):
            return True
        try:  # generic Type/Value that was not auto-downcast: use the checked cast
            cls(x)
        except Exception:
            return False
        return True

    _isinstance._dsv4_compat = True  # type: ignore[attr-defined]
    _isinstance.__doc__ = f"dsv4 compat: restored static {cls.__name__}.isinstance (dropped in MLIR bindings 3.11)."
    return staticmethod(_isinstance)


def _is_ours(cls: type) -> bool:
    return getattr(getattr(cls, "isinstance", None), "_dsv4_compat", False)


def needs_isinstance_shim() -> bool:
    """True when the MLIR bindings lack (natively) a static helper turbine 3.9.0 calls."""
    from iree.compiler import ir

    classes = [getattr(ir, n) for n in PATCHED_IR_CLASSES if hasattr(ir, n)]
    return any(not hasattr(c, "isinstance") or _is_ours(c) for c in classes)


def _patch_isinstance() -> None:
    from iree.compiler import ir

    for name in PATCHED_IR_CLASSES:
        cls = getattr(ir, name, None)
        if cls is not None and not hasattr(cls, "isinstance"):
            setattr(cls, "isinstance", _make_isinstance(cls))


def _patch_e8m0() -> None:
    import numpy as np
    import torch
    from iree.compiler import ir
    from iree.runtime import HalElementType
    from iree.turbine.aot import params
    from iree.turbine.support import conversions as conv

    dt = getattr(torch, "float8_e8m0fnu", None)
    if dt is None or not hasattr(ir, "Float8E8M0FNUType"):
        return
    conv.TORCH_DTYPE_TO_IREE_TYPE.setdefault(dt, lambda: ir.Float8E8M0FNUType.get())
    conv.TORCH_DTYPE_TO_IREE_TYPE_ASM.setdefault(dt, "f8E8M0FNU")
    conv.IREE_TYPE_ASM_TO_TORCH_DTYPE.setdefault("f8E8M0FNU", dt)
    conv.MLIR_TYPE_ASM_TO_TORCH_DTYPE.setdefault("f8E8M0FNU", dt)
    if hasattr(HalElementType, "FLOAT_8_E8M0_FNU"):
        conv.DTYPE_TO_ELEMENT_TYPE.setdefault(dt, HalElementType.FLOAT_8_E8M0_FNU)
    conv.TORCH_DTYPE_TO_NUMPY.setdefault(dt, np.dtype("u1"))
    params._dtype_to_name.setdefault(dt, "float8_e8m0fnu")
    params._name_to_dtype.setdefault("float8_e8m0fnu", dt)


def apply() -> None:
    """Install both patches once; later calls do nothing. Must run before turbine exports."""
    global _applied
    if _applied:
        return
    _patch_isinstance()
    _patch_e8m0()
    _applied = True


def is_applied() -> bool:
    return _applied
