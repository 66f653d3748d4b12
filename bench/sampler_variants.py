"""The device sampler (model/device_sampling.py) alone, under settings of its two knobs: the threshold
search bit by bit (RADIX_BITS 1, session 14's form) or by digits of 2-4 bits, and its vocabulary-long
reductions in one level (PIECES 1: one GPU workgroup per row) or two (32 or 128 pieces).

  prepare (here, torch + compiler):  python bench/sampler_variants.py prepare --target cuda -o OUT
      one vmfb per variant, each with sample_bs{1,8,64} over Flash's vocabulary (129,280)
  run (iree-base-runtime + numpy):   python bench/sampler_variants.py run OUT --driver cuda
      median ms per call (ids read back) per variant and batch, and whether every variant picks the
      same ids as the first on the same inputs (temperature 1.0, top_p 0.9, top_k 0 / 50 by row)

Background: docs/performance.md ("Sampling on the device"): at batch 1 the module's sampler cost
4.9 ms over greedy, ~65 full-vocabulary reductions one after another.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

VOCAB = 129_280
SIZES = (1, 8, 64)
VARIANTS = ("r1p1", "r1p128", "r2p128", "r4p1", "r4p32", "r4p128")  # r{RADIX_BITS}p{PIECES}


def _settings(name: str) -> tuple[int, int]:
    """(RADIX_BITS, PIECES) of model/device_sampling.py for a variant name r{bits}p{pieces}."""
    bits, pieces = name[1:].split("p")
    return int(bits), int(pieces)


def prepare(args: argparse.Namespace) -> None:
    import torch

    import dsv4.export  # noqa: F401
    from iree.turbine import aot

    from dsv4.export.compile import CompileError, compile_mlir
    from dsv4.model import device_sampling

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3000, generator=g) * 3
    inputs = (torch.full((8,), 1.0), torch.tensor([0, 50] * 4), torch.full((8,), 0.9), torch.arange(8))
    want = None
    for name in args.variants.split(","):
        device_sampling.RADIX_BITS, device_sampling.PIECES = _settings(name)
        ids = device_sampling.sample(x, *inputs)  # eager, small vocabulary: variants must agree
        want = ids if want is None else want
        print(f"{name}: eager ids {'equal' if torch.equal(ids, want) else 'DIFFER'}", flush=True)

        class M(torch.nn.Module):
            pass

        fxb = aot.FxProgramsBuilder(M())
        for n in SIZES:
            a = (torch.zeros(n, VOCAB), torch.ones(n), torch.zeros(n, dtype=torch.long), torch.ones(n),
                 torch.zeros(n, dtype=torch.long))
            fxb.export_program(lambda m, *t: device_sampling.sample(*t), name=f"sample_bs{n}", args=a, strict=False)
        mlir = out / f"{name}.mlir"
        aot.export(fxb).save_mlir(str(mlir))
        t0 = time.perf_counter()
        try:
            compile_mlir(mlir, args.target, out / f"{name}.vmfb")
        except CompileError as e:
            print(f"{name}: does not compile for {args.target}: {str(e).splitlines()[1].strip()[:300]}", flush=True)
            continue
        print(f"{name}: compiled for {args.target} in {time.perf_counter() - t0:.1f} s", flush=True)


def run(args: argparse.Namespace) -> None:
    import iree.runtime as rt

    d = Path(args.dir)
    config = rt.Config(args.driver)
    dev, inst = config.device, config.vm_instance
    rng = np.random.default_rng(0)
    cases = {}
    for n in SIZES:
        x = (rng.standard_normal((n, VOCAB)) * 3).astype(np.float32)
        top_k = np.where(np.arange(n) % 2 == 0, 0, 50).astype(np.int64)
        cases[n] = [rt.asdevicearray(dev, a) for a in (x, np.ones(n, np.float32), top_k, np.full(n, 0.9, np.float32),
                                                         np.arange(n, dtype=np.int64))]
    print("| variant | " + " | ".join(f"batch {n} ms" for n in SIZES) + " | ids equal the first |\n|---|"
          + "---|" * (len(SIZES) + 1), flush=True)
    first = {}
    for name in VARIANTS:
        vmfb = d / f"{name}.vmfb"
        if not vmfb.exists():
            continue
        vm = rt.VmModule.mmap(inst, str(vmfb))
        ctx = rt.VmContext(inst, modules=[rt.create_hal_module(inst, dev), vm])
        cells, same = [], True
        for n in SIZES:
            fn = rt.FunctionInvoker(ctx, dev, vm.lookup_function(f"sample_bs{n}"))
            ids = np.asarray(fn(*cases[n]).to_host()).copy()
            ts = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                np.asarray(fn(*cases[n]).to_host())
                ts.append(time.perf_counter() - t0)
            cells.append(f"{np.median(ts) * 1e3:.3f}")
            same &= bool(np.array_equal(first.setdefault(n, ids), ids))
        print(f"| {name} | " + " | ".join(cells) + f" | {same} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--target", default="cuda")
    a.add_argument("-o", "--out", required=True)
    a.add_argument("--variants", default=",".join(VARIANTS))
    b = sub.add_parser("run")
    b.add_argument("dir")
    b.add_argument("--driver", default="cuda")
    b.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    (prepare if args.cmd == "prepare" else run)(args)


if __name__ == "__main__":
    main()
