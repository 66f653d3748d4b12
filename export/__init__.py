"""Export side of dsv4: torch model -> MLIR (iree-turbine) -> vmfb (iree-compile).

Importing this package applies the turbine 3.9 / compiler 3.13 compatibility shim
(`compat.apply()`), so every exporter and test gets a working CustomOp path without remembering to.
"""

from . import compat as _compat

_compat.apply()
