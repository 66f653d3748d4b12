"""One Flash-size FP8 linear and one FP8 expert stack, each GEMM form of the FP8 linear kernel as its own
entry point (issue 15 item 5; numbers in docs/performance.md "FP8 on the matrix cores").

    python bench/fp8_linear.py OUT --target gfx942|cuda|llvm-cpu [--experts 2]

writes OUT/fp8_linear.mlir, OUT/fp8_linear.irpa (random weights: e4m3fnuz for gfx942, else e4m3fn, E8M0
block scales) and OUT/fp8_linear.<target>.vmfb, then prints the iree-benchmark-module commands that time
each entry point. Entry points (rows dynamic, bf16 in and out):
  lin_<impl>(x [T, 4096]) -> [T, 1024]           fp8_block_linear, weight [1024, 4096] (Flash wq_a-sized)
  exp_<impl>(x [E, T, 4096]) -> [E, T, 2048]     fp8_block_linear_stacked, weight [E, 2048, 4096] (an expert's w1)
for impl in kernel_f32 (f32 GEMM), kernel_fp8 (FP8 x FP8 block GEMM), kernel (auto: f32 below 16 rows).
For gfx942, `python bench/gfx942_isa.py OUT/fp8_linear.gfx942.vmfb` counts the instructions.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

IMPLS = ("kernel_f32", "kernel_fp8", "kernel")


class _Lin(nn.Module):
    def __init__(self, fn, w: torch.Tensor, s: torch.Tensor):
        super().__init__()
        self.fn = fn
        self.weight = nn.Parameter(w, requires_grad=False)
        self.scale = nn.Parameter(s, requires_grad=False)

    def forward(self, x):
        return self.fn(x, self.weight, self.scale)


def build(out: Path, target: str, experts: int) -> Path:
    from iree.turbine import aot

    import dsv4.export  # noqa: F401
    from dsv4.export.compile import compile_mlir
    from dsv4.export.kernel_op import use_kernels
    from dsv4.model.quant.formats import fp8_fn_to_fnuz
    from dsv4.model.kernels.linear import fp8_block_linear, fp8_block_linear_stacked

    g = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = (torch.randn(*shape, generator=g) * 0.05).to(torch.float8_e4m3fn)
        s = torch.randint(118, 124, (*shape[:-2], shape[-2] // 128, shape[-1] // 128), generator=g, dtype=torch.uint8)
        if target == "gfx942":
            w, s = fp8_fn_to_fnuz(w.flatten(0, -2), s.flatten(0, -2))
            w, s = w.view(*shape), s.view(*shape[:-2], shape[-2] // 128, shape[-1] // 128)
        return w, s

    mods = nn.ModuleDict({"lin": _Lin(fp8_block_linear, *weight(1024, 4096)),
                          "exp": _Lin(fp8_block_linear_stacked, *weight(experts, 2048, 4096))})
    aot.externalize_module_parameters(mods, external_scope="model")
    out.mkdir(parents=True, exist_ok=True)
    aot.save_module_parameters(out / "fp8_linear.irpa", mods)
    fxb = aot.FxProgramsBuilder(mods)
    T = torch.export.Dim("T", min=2, max=4096)
    x2 = torch.zeros(32, 4096, dtype=torch.bfloat16)
    x3 = torch.zeros(experts, 32, 4096, dtype=torch.bfloat16)
    for impl in IMPLS:
        with torch.no_grad(), use_kernels({"fp8_block_linear": impl, "fp8_block_linear_stacked": impl}):
            fxb.export_program(lambda m, x: m["lin"](x), name=f"lin_{impl}", args=(x2,),
                               dynamic_shapes={"x": {0: T}}, strict=False)
            fxb.export_program(lambda m, x: m["exp"](x), name=f"exp_{impl}", args=(x3,),
                               dynamic_shapes={"x": {1: T}}, strict=False)
    mlir = out / "fp8_linear.mlir"
    aot.export(fxb, import_symbolic_shape_expressions=False).save_mlir(str(mlir))
    res = compile_mlir(mlir, target, out / f"fp8_linear.{target.split(':')[0]}.vmfb")
    print(f"{res.path} compiled in {res.seconds:.1f} s ({res.target})")
    return res.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--target", default="gfx942")
    ap.add_argument("--experts", type=int, default=2)
    a = ap.parse_args()
    vmfb = build(a.out, a.target, a.experts)
    device = {"gfx942": "hip", "cuda": "cuda"}.get(a.target.split(":")[0], "local-task")
    for t in (1, 16, 512, 2048):
        for impl in IMPLS:
            for fn, shape in (("lin", f"{t}x4096"), ("exp", f"{a.experts}x{t}x4096")):
                print(f"iree-benchmark-module --device={device} --module={vmfb.name} --parameters=model=fp8_linear.irpa "
                      f"--function={fn}_{impl} --input={shape}xbf16=0.5 --benchmark_repetitions=3")


if __name__ == "__main__":
    main()
