"""Export side of dsv4: torch model -> MLIR (iree-turbine) -> vmfb (iree-compile).

Importing this package has no side effects (and needs no torch): the turbine compatibility
patches (`compat.apply()`) are applied by the code that uses turbine (`exporter.export_model`,
`kernel_op`'s custom ops), so `dsv4.export.command` imports without torch (the torch-free `dsv4 export --help`).
"""
