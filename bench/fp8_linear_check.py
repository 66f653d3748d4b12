"""Compare the GEMM forms of bench/fp8_linear.py's module on one device (random bf16 activations), torch-free:

    python bench/fp8_linear_check.py OUT/fp8_linear.cuda.vmfb OUT/fp8_linear.irpa cuda   (or local-task, hip)

prints, per entry point and shape, the max abs difference of each form's output from kernel_f32's.
"""
import sys
import numpy as np
import ml_dtypes
import iree.runtime as rt

vmfb, irpa, driver = sys.argv[1], sys.argv[2], sys.argv[3]
dev = rt.get_device(driver if driver.startswith("local") else f"{driver}://0")
cfg = rt.Config(device=dev)
inst = cfg.vm_instance
idx = rt.ParameterIndex()
idx.load(irpa)
mods = [rt.create_hal_module(inst, dev), rt.create_io_parameters_module(inst, idx.create_provider(scope="model"))]
vm = rt.VmModule.mmap(inst, vmfb)
ctx = rt.VmContext(inst, modules=[*mods, vm])
rng = np.random.default_rng(0)
for fn, shape in (("lin", (40, 4096)), ("exp", (2, 40, 4096)), ("lin", (5, 4096))):
    x = (rng.standard_normal(shape) * np.logspace(-2, 1, 4096)).astype(ml_dtypes.bfloat16)
    out = {}
    for impl in ("kernel_f32", "kernel_fp8", "kernel"):
        inv = rt.FunctionInvoker(ctx, dev, vm.lookup_function(f"{fn}_{impl}"))
        out[impl] = np.asarray(inv(x).to_host()).astype(np.float32)
    ref = out["kernel_f32"]
    scale = float(np.abs(ref).max())
    print(fn, shape, {k: "max|d| %.3g (max|y| %.3g)" % (float(np.abs(v - ref).max()), scale) for k, v in out.items()})
