"""Tiny runtime helper for tests: load a vmfb (+ .irpa parameters) and call a function by name.

Torch-free on purpose (imports only numpy and iree.runtime): the real runtime will live in
``runtime/`` and must not need torch, and this file is the seed of it. Note that importing it as
``dsv4.export.iree_run`` still runs the ``dsv4.export`` package init (turbine + torch); load it by
path if you need a torch-free process.

Two runtime traps handled here (iree-notes §3/§6):
* local-task worker threads have 128 KiB stacks; kernels compiled with the 1 MiB
  ``--iree-llvmcpu-stack-allocation-limit`` (top-k over bounded dynamic dims) segfault the process
  (rc 139, no Python trace) unless ``--task_worker_stack_size`` is raised. The flag is read when
  the local-task *driver* is created, and iree.runtime caches drivers/devices per process, so it
  must be parsed before the first local-task ``Config`` in the process (including turbine's eager
  CustomOp path). ``ensure_runtime_flags()`` does that once; ``IreeModule`` calls it.
* State (KV caches) must be passed as device arrays (``IreeModule.device_array``): a numpy
  argument is copied in, so in-place updates made by the module are invisible to the caller.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import iree.runtime as rt

__all__ = ["IreeModule", "ensure_runtime_flags", "TASK_WORKER_STACK_SIZE"]

TASK_WORKER_STACK_SIZE = 1 << 20
_flags_parsed = False


def ensure_runtime_flags(stack_size: int = TASK_WORKER_STACK_SIZE) -> None:
    """Parse the process-wide runtime flags once (must precede the first local-task device)."""
    global _flags_parsed
    if not _flags_parsed:
        rt.flags.parse_flags(f"--task_worker_stack_size={int(stack_size)}")
        _flags_parsed = True


class IreeModule:
    """A vmfb loaded in its own VmContext with optional parameter archives.

    ``m("decode", x, cache_dev, pos)`` returns numpy arrays (one array, or a tuple for several
    results); device-array arguments are used in place."""

    def __init__(
        self,
        vmfb: "str | Path",
        irpa: "str | Path | Sequence[str | Path] | None" = None,
        *,
        driver: str = "local-task",
        param_scope: str = "model",
    ):
        ensure_runtime_flags()
        self.config = rt.Config(driver)
        self.device = self.config.device
        inst = self.config.vm_instance
        modules = [rt.create_hal_module(inst, self.device)]
        if irpa is not None:
            paths = [irpa] if isinstance(irpa, (str, Path)) else list(irpa)
            self.param_index = rt.ParameterIndex()
            for p in paths:
                self.param_index.load(str(p))  # mmap, no copy
            modules.append(
                rt.create_io_parameters_module(inst, self.param_index.create_provider(scope=param_scope))
            )
        self.vm_module = rt.VmModule.mmap(inst, str(vmfb))
        modules.append(self.vm_module)
        self.context = rt.VmContext(inst, modules=modules)
        self._invokers: dict[str, rt.FunctionInvoker] = {}

    @property
    def function_names(self) -> list[str]:
        return [n for n in self.vm_module.function_names if not n.endswith("$async") and n != "__init"]

    def function(self, name: str) -> rt.FunctionInvoker:
        inv = self._invokers.get(name)
        if inv is None:
            fn = self.vm_module.lookup_function(name)
            if fn is None:
                raise KeyError(f"no function {name!r} in {self.vm_module.name}; have {self.function_names}")
            inv = self._invokers[name] = rt.FunctionInvoker(self.context, self.device, fn)
        return inv

    def device_array(self, host: np.ndarray) -> rt.DeviceArray:
        """Copy ``host`` to the device once; pass the result as mutable state (e.g. a KV cache)."""
        return rt.asdevicearray(self.device, np.ascontiguousarray(host))

    def call(self, name: str, *args: Any) -> Any:
        """Invoke ``name``; numpy results (a tuple when the function returns several)."""
        res = self.function(name)(*args)
        if isinstance(res, (tuple, list)):
            return tuple(_to_host(r) for r in res)
        return _to_host(res)

    __call__ = call


def _to_host(x: Any) -> Any:
    return x.to_host() if isinstance(x, rt.DeviceArray) else x
