"""The one place that opens the IREE runtime: a vmfb (+ .irpa parameters) on one device.

Torch-free (numpy + iree.runtime). Two runtime traps handled here (docs/export.md, IREE 3.13 traps/§6):

* local-task worker threads have 128 KiB stacks; kernels compiled with the 1 MiB
  ``--iree-llvmcpu-stack-allocation-limit`` (top-k over bounded dynamic dims) crash the process
  (rc 139, no Python trace) unless ``--task_worker_stack_size`` is raised. The flag is read when
  the local-task driver is created and iree.runtime caches drivers per process, so it must be
  parsed before the first local-task device in the process (including turbine's eager CustomOp
  path): `ensure_runtime_flags()` does that once, and `IreeModule` calls it.
* State (KV caches) must be passed as device arrays (`IreeModule.device_array` / `zeros`): a
  numpy argument is copied in, so in-place updates made by the module would be invisible.

Both files are checked structurally first (`artifact.check_vmfb` / `weights.check_irpa`), so a truncated
or corrupt artifact is reported by name rather than failing inside IREE; given the inventory
(config.json's ``weights``), the loaded parameters are checked against it too (a missing, extra or
mis-sized tensor is named instead of failing at the first call that reads it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dsv4.contract.artifact import DTYPES, PARAM_SCOPE, StateSpec, TensorSpec, check_vmfb, state_stage
from dsv4.contract.errors import ArtifactError, EngineError
from dsv4.contract.weights import check_irpa

__all__ = ["IreeModule", "PipelineModule", "ensure_runtime_flags", "TASK_WORKER_STACK_SIZE"]

TASK_WORKER_STACK_SIZE = 1 << 20
_flags_parsed = False
# extra local devices of multi-device modules, kept for the process's life like iree.runtime's own
# device cache (freed at interpreter exit in arbitrary order, a context could outlive its devices)
_LOCAL_DEVICES: dict[tuple[str, int], Any] = {}


def ensure_runtime_flags(stack_size: int = TASK_WORKER_STACK_SIZE) -> None:
    """Parse the process-wide runtime flags once (must precede the first local-task device)."""
    global _flags_parsed
    if not _flags_parsed:
        import iree.runtime as rt

        rt.flags.parse_flags(f"--task_worker_stack_size={int(stack_size)}")
        _flags_parsed = True


_cuda_opened = False  # a cuda device was opened in this process (its driver now exists, flags fixed)
_cuda_several = False  # the cuda driver was made for several GPUs (stream-ordered allocations off)


def _cuda_for_several_gpus(driver: str) -> None:
    """IREE 3.13's cuda driver uses stream-ordered (async) allocations; once one process drives two
    GPUs, a module on the second fails in its initializer (hal.device.queue.dealloca ABORTED) or
    hangs (measured on two H200s; docs/scale.md). With ``--cuda_async_allocations=false`` both the
    two-device module and pipeline stages run. The flag is read when the driver is made (once per
    process), so it is parsed before the first cuda device; EngineError when a one-GPU cuda module was
    opened first in this process."""
    global _cuda_several
    if driver != "cuda" or _cuda_several:
        return
    if _cuda_opened:
        raise EngineError("this process opened a cuda device for one GPU before this multi-GPU export; IREE's cuda "
                          "driver is then set up for one GPU: open the multi-GPU engine first (or in its own process)")
    import iree.runtime as rt

    rt.flags.parse_flags("--cuda_async_allocations=false")
    _cuda_several = True


class IreeModule:
    """A vmfb loaded in its own VmContext on one device, with optional parameter archives (all
    shards of the weights; `expect` = their inventory, checked on load).

    ``m("decode_bs1", tokens, ..., *state)`` returns numpy arrays (a tuple for several results);
    device-array arguments are used in place. `function(name)` gives the raw invoker (device-array
    results, no host copy). Raises EngineError when the device is unavailable and ArtifactError
    when a file is missing, truncated or not loadable.

    ``devices`` > 1 opens a multi-device module (`dsv4 export --devices N`): N devices of the driver
    in one HAL module, in order (GPUs device_index, device_index + 1, ...; local drivers: N
    separate local devices of this process, local device k for device_index k); arguments, results
    and state live on the first."""

    def __init__(self, vmfb: str | Path, parameters: str | Path | Sequence[str | Path] | None = None, *,
                 driver: str = "local-task", device_index: int = 0, param_scope: str = PARAM_SCOPE,
                 expect: Sequence[TensorSpec] | None = None, devices: int = 1):
        import iree.runtime as rt

        self._rt = rt
        vmfb = Path(vmfb)
        paths = [] if parameters is None else (
            [Path(parameters)] if isinstance(parameters, (str, Path)) else [Path(p) for p in parameters])
        check_vmfb(vmfb)
        for p in paths:
            check_irpa(p)
        if driver.startswith("local"):
            ensure_runtime_flags()
        if int(devices) > 1:
            _cuda_for_several_gpus(driver)
        self.devices = _open_devices(rt, driver, int(device_index), int(devices))
        self.device = self.devices[0]
        self.config = rt.Config(device=self.device)
        inst = self.config.vm_instance
        try:
            hal = (rt.create_hal_module(inst, self.device) if len(self.devices) == 1
                   else rt.create_hal_module(inst, devices=self.devices))
            modules = [hal]
            if paths:
                self.param_index = rt.ParameterIndex()
                for p in paths:
                    self.param_index.load(str(p))  # mmap; never read into Python memory
                if expect is not None:
                    _check_parameters(self.param_index, expect, paths)
                modules.append(rt.create_io_parameters_module(
                    inst, self.param_index.create_provider(scope=param_scope)))
            self.vm_module = rt.VmModule.mmap(inst, str(vmfb))
            modules.append(self.vm_module)
            self.context = rt.VmContext(inst, modules=modules)
        except ArtifactError:
            raise
        except (RuntimeError, ValueError, OSError) as e:
            names = " with ".join([vmfb.name, *(p.name for p in paths)])
            raise ArtifactError(f"cannot load {names}: {e}") from None
        self.vmfb_path = vmfb
        self._invokers: dict[str, Any] = {}

    @property
    def function_names(self) -> list[str]:
        return [n for n in self.vm_module.function_names if not n.endswith("$async") and n != "__init"]

    def function(self, name: str) -> Any:
        """The invoker of `name` (results stay device arrays)."""
        inv = self._invokers.get(name)
        if inv is None:
            fn = self.vm_module.lookup_function(name)
            if fn is None:
                raise ArtifactError(f"{self.vmfb_path.name} has no function {name} (have {self.function_names})")
            inv = self._invokers[name] = self._rt.FunctionInvoker(self.context, self.device, fn)
        return inv

    def device_array(self, host: np.ndarray) -> Any:
        """Copy ``host`` to the device once; pass the result as mutable state (e.g. a KV cache)."""
        return self._rt.asdevicearray(self.device, np.ascontiguousarray(host))

    def zeros(self, spec: StateSpec) -> Any:
        """A zero-filled device array for one state tensor, with its exact element type (bf16/fp8
        included, which ``asdevicearray`` cannot express)."""
        storage, et = DTYPES[spec.dtype]
        host = np.zeros(spec.shape, dtype=storage)
        rt = self._rt
        bv = self.device.allocator.allocate_buffer_copy(
            memory_type=rt.MemoryType.DEVICE_LOCAL, allowed_usage=rt.BufferUsage.DEFAULT,
            device=self.device, buffer=host, element_type=getattr(rt.HalElementType, et))
        return rt.DeviceArray(self.device, bv, override_dtype=host.dtype)

    def call(self, name: str, *args: Any) -> Any:
        """Invoke ``name``; numpy results (a tuple when the function returns several)."""
        return _host_results(self.function(name)(*args))

    __call__ = call

    def read_export_id(self) -> str | None:
        """The id the exporter baked into the vmfb (``export_id()``: the bytes of a string), or None."""
        if "export_id" not in self.vm_module.function_names:
            return None
        res = self.call("export_id")
        a = np.asarray(res[0] if isinstance(res, tuple) else res)
        if a.dtype.kind in "iu" and a.ndim == 1 and a.size > 1 and a.min() >= 0 and a.max() < 256:
            return bytes(a.astype(np.uint8)).rstrip(b"\0").decode("utf-8", "replace")
        if a.size == 1:
            return str(a.reshape(()).item())
        return ",".join(str(int(x)) for x in a.reshape(-1))


class PipelineModule:
    """A pipeline export (`dsv4 export --devices N --pipeline`): stage k's vmfb in its own context on
    device device_index + k (GPUs: that GPU; local drivers: a local device of its own per stage), or
    on `stage_devices[k]` (e.g. [0, 0]: every stage on one GPU, when its memory suffices), all reading
    the same parameter archives. ``function(name)`` runs the stages in order, each on its own state
    tensors, moving the float32 streams between them through host memory (a device-to-host copy,
    then host-to-device; no peer access needed); results and the call signature are those of a
    one-module export. State specs are named ``stage<k>.<name>`` (config.json), which is how
    `zeros` knows each tensor's device."""

    def __init__(self, vmfbs: Sequence[str | Path], parameters: str | Path | Sequence[str | Path] | None = None, *,
                 driver: str = "local-task", device_index: int = 0, param_scope: str = PARAM_SCOPE,
                 expect: Sequence[TensorSpec] | None = None, state: Sequence[StateSpec] = (),
                 stage_devices: Sequence[int] | None = None):
        where = [device_index + k for k in range(len(vmfbs))] if stage_devices is None else [int(i) for i in stage_devices]
        if len(where) != len(vmfbs) or min(where) < 0:
            raise EngineError(f"stage_devices must give a device index >= 0 for each of the {len(vmfbs)} stages, "
                              f"got {list(stage_devices or [])}")
        if len(set(where)) > 1:
            _cuda_for_several_gpus(driver)
        self.stages = [IreeModule(v, parameters, driver=driver, device_index=i, param_scope=param_scope, expect=expect)
                       for v, i in zip(vmfbs, where)]
        self.devices = [m.device for m in self.stages]
        self.device = self.devices[0]
        self.vmfb_path = self.stages[0].vmfb_path
        # which state arguments (in config.json order) each stage takes
        self._owner = [state_stage(s.name)[0] for s in state]
        self._calls: dict[str, Any] = {}

    @property
    def function_names(self) -> list[str]:
        names = set(self.stages[0].function_names)
        for m in self.stages[1:]:
            names &= set(m.function_names)
        return sorted(names)

    def function(self, name: str) -> Any:
        """A callable (tokens, start_pos, lengths, slots, *state) -> the last stage's results (device arrays)."""
        call = self._calls.get(name)
        if call is None:
            fns = [m.function(name) for m in self.stages]
            stages, owner = self.stages, self._owner

            def call(tokens: Any, start_pos: Any, lengths: Any, slots: Any, *state: Any) -> Any:
                if len(state) != len(owner):
                    raise EngineError(f"{name}: {len(state)} state tensors given, the pipeline takes {len(owner)}")
                h = None
                for k, fn in enumerate(fns):
                    mine = [s for s, o in zip(state, owner) if o == k]
                    if h is None:
                        h = fn(tokens, start_pos, lengths, slots, *mine)
                    else:  # the streams: device k-1 -> host -> device k
                        h = fn(stages[k].device_array(np.asarray(h.to_host())), tokens, start_pos, lengths,
                               slots, *mine)
                return h

            self._calls[name] = call
        return call

    def zeros(self, spec: StateSpec) -> Any:
        return self.stages[state_stage(spec.name)[0]].zeros(spec)

    def device_array(self, host: np.ndarray) -> Any:
        return self.stages[0].device_array(host)

    def call(self, name: str, *args: Any) -> Any:
        """Run ``name`` through every stage; numpy results as `IreeModule.call`."""
        return _host_results(self.function(name)(*args))

    __call__ = call

    def read_export_id(self) -> str | None:
        """The export id baked into the stages' vmfbs; ArtifactError when two stages disagree."""
        ids = [m.read_export_id() for m in self.stages]
        if len(set(ids)) > 1:
            raise ArtifactError(f"the pipeline stages come from different exports: "
                                f"{', '.join(f'{m.vmfb_path.name}={i}' for m, i in zip(self.stages, ids))}")
        return ids[0]


def _open_devices(rt: Any, driver: str, index: int, n: int) -> list[Any]:
    """The n devices a module runs on; EngineError naming the one that is not available."""
    global _cuda_opened
    _cuda_opened = _cuda_opened or driver == "cuda"
    if n < 1:
        raise EngineError(f"devices must be >= 1, got {n}")
    out = []
    for i in range(n):
        uri = driver if driver.startswith("local") else f"{driver}://{index + i}"
        try:
            if driver.startswith("local") and index + i > 0:  # local device 0 is iree.runtime's own
                key = (driver, index + i)
                if key not in _LOCAL_DEVICES:
                    _LOCAL_DEVICES[key] = rt.get_driver(driver).create_default_device()
                out.append(_LOCAL_DEVICES[key])
            else:
                out.append(rt.get_device(uri))
        except (RuntimeError, ValueError, OSError) as e:
            what = f"device {uri!r}" + (f" (device {i + 1} of {n})" if n > 1 else "")
            raise EngineError(f"{what} is not available: {e}") from None
    return out


def _check_parameters(index: Any, expect: Sequence[TensorSpec], paths: Sequence[Path]) -> None:
    from dsv4.contract.weights import check_weights

    problems = check_weights({k: int(e.length) for k, e in index.items()}, expect)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        files = ", ".join(p.name for p in paths)
        raise ArtifactError(f"the weights in {files} do not match config.json's inventory: "
                            f"{'; '.join(problems[:5])}{more}")


def _host_results(res: Any) -> Any:
    """An invoker's results on the host: numpy arrays (a tuple when the function returns several)."""
    if isinstance(res, (tuple, list)):
        return tuple(_to_host(r) for r in res)
    return _to_host(res)


def _to_host(x: Any) -> Any:
    return x.to_host() if hasattr(x, "to_host") else x
