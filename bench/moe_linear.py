"""The routed experts' MXFP4 linear at Flash size, each way the export can compute it (issue 15;
numbers in docs/performance.md "The routed-MoE kernel choice").

    python bench/moe_linear.py OUT --target cuda|gfx942|llvm-cpu [--flag]

writes OUT/moe_linear[.flag].mlir and .<target>.vmfb with entry points (rows dynamic; weights are
arguments, so no .irpa: a GPU host makes them with numpy):
  ref(x f32 [G, M, 4096], packed u8 [256, 2048, 2048], scale u8 [256, 2048, 128], sel i64 [G]) -> f32 [G, M, 2048]
      the GPU default: index_select the selected experts' bytes, then mxfp4_linear_stacked (f32 GEMM)
  ref_bf16(same) -> same   the same with mxfp4_linear_stacked's kernel_bf16 form (matrix cores)
  gathered(same) -> same   mxfp4_linear_gathered, the bytes read in place (only with --flag: the
      compile then adds export/compile.py's GPU_REDUCTION_FLAG, which every reduction of the module gets)
Row blocks as the MoE makes them (model/kernels/moe.py): prefill G = 256 + P/4 blocks of M = 4 rows,
decode one block of M = 16 rows per used expert. `bench/moe_linear_run.py` times them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

E, N, K = 256, 2048, 4096  # Flash: 256 experts, w1/w3 [2048, 4096]


class _Moe(nn.Module):
    def forward(self, x, packed, scale, sel, gathered: bool):
        from dsv4.model.kernels.linear import mxfp4_linear_gathered, mxfp4_linear_stacked

        xb = x.to(torch.bfloat16)
        if gathered:
            return mxfp4_linear_gathered(xb, packed, scale, sel).float()
        return mxfp4_linear_stacked(xb, packed.index_select(0, sel), scale.index_select(0, sel)).float()


def build(out: Path, target: str, flag: bool) -> Path:
    from iree.turbine import aot

    import dsv4.export  # noqa: F401
    from dsv4.export.compile import GPU_REDUCTION_FLAG, compile_mlir
    from dsv4.export.kernel_op import use_kernels

    fxb = aot.FxProgramsBuilder(_Moe())
    G, M = torch.export.Dim("G", min=2, max=4096), torch.export.Dim("M", min=1, max=64)
    args = (torch.zeros(8, 4, K), torch.zeros(E, N, K // 2, dtype=torch.uint8),
            torch.zeros(E, N, K // 32, dtype=torch.uint8), torch.zeros(8, dtype=torch.int64))
    dyn = {"x": {0: G, 1: M}, "packed": None, "scale": None, "sel": {0: G}}
    forms = {"ref": "kernel", "ref_bf16": "kernel_bf16"}
    if flag:
        forms["gathered"] = "kernel"
    for name, form in forms.items():
        gathered = name == "gathered"
        choice = {"mxfp4_linear_gathered": form if gathered else "kernel",
                  "mxfp4_linear_stacked": "kernel" if gathered else form}
        with torch.no_grad(), use_kernels(choice):
            fxb.export_program(lambda m, x, packed, scale, sel, g=gathered: m(x, packed, scale, sel, g),
                               name=name, args=args, dynamic_shapes=dyn, strict=False)
    out.mkdir(parents=True, exist_ok=True)
    tag = ".flag" if flag else ""
    mlir = out / f"moe_linear{tag}.mlir"
    aot.export(fxb, import_symbolic_shape_expressions=False).save_mlir(str(mlir))
    res = compile_mlir(mlir, target, out / f"moe_linear{tag}.{target.split(':')[0]}.vmfb",
                       [GPU_REDUCTION_FLAG] if flag and not target.startswith("llvm-cpu") else [])
    print(f"{res.path} compiled in {res.seconds:.1f} s ({res.target})")
    return res.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--flag", action="store_true", help="add the gathered kernel (and the reduction flag)")
    a = ap.parse_args()
    build(a.out, a.target, a.flag)


if __name__ == "__main__":
    main()
