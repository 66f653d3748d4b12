"""Plumbing shared by the bench scripts that compile one piece of the decode step alone, one entry
point per batch size, with the weights as arguments (moe_decode_check.py, head_check.py): the
`build OUT` / `run OUT` command line, the tracing and compiling, and loading the vmfb to run."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Sequence


def build(fn: Callable, prefix: str, args_for: Callable[[int], Sequence[Any]], batches: list[int],
          out: Path, stem: str, target: str) -> None:
    """Trace `fn` as `{prefix}_bs{n}` with `args_for(n)` for every batch n (kernels as export picks
    them), save OUT/{stem}.mlir and compile it to OUT/{stem}.<target>.vmfb."""
    import torch
    from iree.turbine import aot

    import dsv4.export  # noqa: F401  (compat shim)
    from dsv4.export.compile import compile_mlir
    from dsv4.export.kernel_op import use_kernels

    class M(torch.nn.Module):
        def forward(self, *a):
            return fn(*a)

    fxb = aot.FxProgramsBuilder(M())
    for n in batches:
        with torch.no_grad(), use_kernels(None):
            fxb.export_program(lambda m, *a: m(*a), name=f"{prefix}_bs{n}", args=tuple(args_for(n)), strict=False)
    out.mkdir(parents=True, exist_ok=True)
    mlir = out / f"{stem}.mlir"
    aot.export(fxb, import_symbolic_shape_expressions=False).save_mlir(str(mlir))
    res = compile_mlir(mlir, target, out / f"{stem}.{target.split(':')[0]}.vmfb")
    print(f"{res.path} compiled in {res.seconds:.1f} s ({res.target})")


def load(out: Path, stem: str, prefix: str, device: str) -> tuple[Any, dict[int, Any]]:
    """(iree.runtime Config, {batch: function}) of the vmfb `build` wrote into OUT."""
    import iree.runtime as rt

    config = rt.Config(device)
    vm = rt.VmModule.copy_buffer(config.vm_instance, next(out.glob(f"{stem}.*.vmfb")).read_bytes())
    ctx = rt.SystemContext(vm_modules=[vm], config=config)
    names = [f for f in vm.function_names if f.startswith(f"{prefix}_bs") and "$" not in f]
    return config, {int(f.split("_bs")[1]): ctx.modules.module[f] for f in sorted(names, key=lambda f: int(f.split("_bs")[1]))}


def cli(doc: str, build_fn: Callable[[Path, str, list[int]], None], run_fn: Callable[[Path, str, int, int], None],
        batches: str, argv: list[str] | None = None) -> int:
    """`build OUT [--target T] [--batch N,..]` or `run OUT [--device D] [--repeats R] [--seed S]`."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("build", "run"))
    ap.add_argument("out", type=Path)
    ap.add_argument("--target", default="cuda")
    ap.add_argument("--batch", default=batches)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.what == "build":
        build_fn(a.out, a.target, [int(b) for b in a.batch.split(",")])
    else:
        run_fn(a.out, a.device, a.repeats, a.seed)
    return 0
