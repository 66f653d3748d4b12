"""The radix top-k at decode's static shapes, checked against the tie rule on a device (session 11's
lead for the Flash-4 cuda decode NaN, docs/real-size.md).

    python bench/topk_decode_shapes.py prepare -o OUT [--target cuda]   # here (torch + compiler)
    python bench/topk_decode_shapes.py run OUT [--driver cuda]          # there (iree-base-runtime + numpy)

Shapes: the MoE gate of one decode row ([1, 256] scores, k = 6) and the CSA indexer at position 128
of a 256-position export ([1, 1, 64] entries, 32 of them -inf because not yet visible, k = 64).
Each of REPS random rows is compared with numpy's stable descending sort (the contract of
model/kernels/topk.py); prints the rows that differ and a count.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

GATE, INDEXER = (1, 256), (1, 1, 64)


def prepare(out: Path, target: str) -> None:
    import torch
    from iree.turbine import aot

    import dsv4.export  # noqa: F401
    from dsv4.export.compile import compile_mlir
    from dsv4.export.model_kernels import use_kernels
    from dsv4.model.kernels.topk import topk_indices

    class TopK(torch.nn.Module):
        def forward(self, gate, entries):
            return topk_indices(gate, 6), topk_indices(entries, 64)

    fxb = aot.FxProgramsBuilder(TopK())
    with torch.no_grad(), use_kernels({}):
        fxb.export_program(lambda m, g, s: m(g, s), name="topk", args=(torch.zeros(GATE), torch.zeros(INDEXER)),
                           strict=False)
    out.mkdir(parents=True, exist_ok=True)
    mlir = out / "topk_decode.mlir"
    aot.export(fxb, import_symbolic_shape_expressions=False).save_mlir(str(mlir))
    print(compile_mlir(mlir, target, out / f"topk_decode.{target.split(':')[0]}.vmfb", []).path)


def run(out: Path, driver: str, reps: int) -> int:
    import iree.runtime as rt

    vmfb = next(out.glob("topk_decode.*.vmfb"))
    cfg = rt.Config(driver)
    ctx = rt.SystemContext(config=cfg)
    ctx.add_vm_module(rt.VmModule.mmap(cfg.vm_instance, str(vmfb)))
    fn = ctx.modules.module["topk"]
    rng = np.random.default_rng(0)
    wrong = {"gate": 0, "indexer": 0}
    for r in range(reps):
        gate = rng.standard_normal(GATE).astype(np.float32)
        entries = rng.standard_normal(INDEXER).astype(np.float32)
        entries[..., 32:] = -np.inf
        got = [np.asarray(x.to_host()) for x in fn(gate, entries)]
        want = [np.argsort(-gate, -1, kind="stable")[..., :6], np.argsort(-entries, -1, kind="stable")[..., :64]]
        for name, g, w in zip(wrong, got, want):
            if not np.array_equal(g, w):
                wrong[name] += 1
                if wrong[name] <= 3:
                    print(f"row {r} {name}: got {g.ravel().tolist()} want {w.ravel().tolist()}")
    print(f"{vmfb.name} on {driver}: rows that break the tie rule, of {reps}: {wrong}")
    return int(any(wrong.values()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("-o", "--out", type=Path, required=True)
    p.add_argument("--target", default="cuda")
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--driver", default="cuda")
    r.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a.out, a.target)
        return 0
    return run(a.out, a.driver, a.reps)


if __name__ == "__main__":
    raise SystemExit(main())
