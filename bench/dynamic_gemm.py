"""Prefill's GEMMs under three shape contracts for the token dim T: dynamic (what `dsv4 export` traces,
T in [16, 512]), dynamic but a multiple of 16 or 64 (T = 16 k: the compiler can prove the divisibility),
and static (T = 256).

  prepare (here, torch + compiler):  python bench/dynamic_gemm.py prepare --target cuda -o OUT
      one vmfb per shape contract, each with two functions at Flash's dimensions and 8 rows:
      `dense` (x [8,T,4096] @ W^T, W [3072,4096], the FP8 linears' bf16 GEMM) and `grouped` (wo_a:
      einsum btgk,grk->btgr, 8 groups of 4096 -> 1024); prints whether the GPU code uses the matrix
      cores (mma in the PTX / mfma in the gfx942 ISA)
  run (iree-base-runtime + numpy):   python bench/dynamic_gemm.py run OUT --driver cuda
      median ms per call at T = 256 and the TFLOP/s that makes

Background: docs/performance.md (session 19): in a Flash --layers 4 prefill of 8 x 256 tokens on the
H200, every GEMM with a dynamic row count ran at 2-3 TFLOP/s, the grouped wo_a alone 36 % of the call.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


ROWS, D, N, G, R = 8, 4096, 3072, 8, 1024
T_RUN = 256
CONTRACTS = ("dyn", "k16", "k64", "blk64", "pad16", "pad64", "padblk16", "padblk64", "static")


def _flops(fn: str, t: int) -> float:
    return 2.0 * ROWS * t * (D * N if fn == "dense" else G * D * R)


def prepare(args: argparse.Namespace) -> None:
    import torch

    import dsv4.export  # noqa: F401
    from iree.turbine import aot

    from dsv4.export.compile import compile_mlir

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    class M(torch.nn.Module):
        pass

    def dense0(m, x, w):  # the weights are arguments: constants would be folded
        return torch.matmul(x, w.t())

    def grouped0(m, o, wo):
        return torch.einsum("btgk,grk->btgr", o, wo)

    def pad_rows(x, tile):  # [8, T, ...] -> [rows padded to the multiple of `tile` above them, ...] (pad_rows' rule)
        rows = x.shape[0] * x.shape[1]
        flat = x.reshape(rows, *x.shape[2:])
        return torch.nn.functional.pad(flat, [0, 0] * (x.dim() - 2) + [0, (rows // tile + 1) * tile - rows]), rows

    def pad_blocks(x, tile):  # [8, T, ...] -> [nb, tile, ...]: the rows zero-padded to nb * tile, nb = rows // tile + 1
        rows = x.shape[0] * x.shape[1]
        nb = rows // tile + 1
        flat = torch.nn.functional.pad(x.reshape(rows, *x.shape[2:]), [0, 0] * (x.dim() - 2) + [0, nb * tile - rows])
        return flat.reshape(nb, tile, *x.shape[2:]), rows

    def blocked(tile):
        def dense(m, x, w):
            xb, rows = pad_blocks(x, tile)
            keep = torch.arange(rows, device=x.device)
            return torch.matmul(xb, w.t()).flatten(0, 1).index_select(0, keep).reshape(ROWS, -1, N)

        def grouped(m, o, wo):
            ob, rows = pad_blocks(o, tile)
            keep = torch.arange(rows, device=o.device)
            return torch.einsum("bmgk,grk->bmgr", ob, wo).flatten(0, 1).index_select(0, keep).reshape(ROWS, -1, G, R)
        return dense, grouped

    def padded(tile):
        def dense(m, x, w):
            xp, rows = pad_rows(x, tile)
            keep = torch.arange(rows, device=x.device)  # an index, not a slice: a slice guards on the symbolic sizes
            return torch.matmul(xp, w.t()).index_select(0, keep).reshape(ROWS, -1, N)

        def grouped(m, o, wo):
            op, rows = pad_rows(o, tile)
            keep = torch.arange(rows, device=o.device)
            return torch.einsum("mgk,grk->mgr", op, wo).index_select(0, keep).reshape(ROWS, -1, G, R)
        return dense, grouped

    def dense_blocked(m, x, w):  # rows in blocks of 64: a static M inside a dynamic batch of blocks
        return torch.matmul(x.reshape(-1, 64, D), w.t()).reshape(ROWS, -1, N)

    def grouped_blocked(m, o, wo):
        return torch.einsum("bmgk,grk->bmgr", o.reshape(-1, 64, G, D), wo).reshape(ROWS, -1, G, R)

    bf16 = torch.bfloat16
    for name in args.contracts.split(","):
        if name == "static":
            dims = None
        else:
            step = {"dyn": 1, "k16": 16, "k64": 64, "blk64": 64}.get(name, 1)
            k = torch.export.Dim("k", min=max(1, 16 // step), max=512 // step)
            dims = k if step == 1 else step * k
        t = T_RUN if dims is None else 128
        fxb = aot.FxProgramsBuilder(M())
        if name == "blk64":
            dense, grouped = dense_blocked, grouped_blocked
        elif name.startswith("padblk"):
            dense, grouped = blocked(int(name[6:]))
        elif name.startswith("pad"):
            dense, grouped = padded(int(name[3:]))
        else:
            dense, grouped = dense0, grouped0
        fxb.export_program(dense, name="dense", args=(torch.zeros(ROWS, t, D, dtype=bf16), torch.zeros(N, D, dtype=bf16)),
                           dynamic_shapes=None if dims is None else {"x": {1: dims}, "w": None}, strict=False)
        fxb.export_program(grouped, name="grouped",
                           args=(torch.zeros(ROWS, t, G, D, dtype=bf16), torch.zeros(G, R, D, dtype=bf16)),
                           dynamic_shapes=None if dims is None else {"o": {1: dims}, "wo": None}, strict=False)
        mlir = out / f"{name}.mlir"
        aot.export(fxb).save_mlir(str(mlir))
        dump = out / f"{name}.binaries"
        compile_mlir(mlir, args.target, out / f"{name}.{args.target}.vmfb",
                     extra_flags=[f"--iree-hal-dump-executable-binaries-to={dump}"])
        texts = [p.read_text(errors="replace") for p in dump.glob("*.ptx")]
        mma = sum(t.count("mma.sync") for t in texts)
        print(f"{name}: compiled; {len(texts)} PTX files, {mma} mma.sync instructions", flush=True)


def run(args: argparse.Namespace) -> None:
    import subprocess

    import iree._runtime_libs as libs

    tool = Path(libs.__file__).parent / "iree-benchmark-module"
    out = Path(args.out)
    inputs = {"dense": [f"--input={ROWS}x{T_RUN}x{D}xbf16=1", f"--input={N}x{D}xbf16=1"],
              "grouped": [f"--input={ROWS}x{T_RUN}x{G}x{D}xbf16=1", f"--input={G}x{R}x{D}xbf16=1"]}
    print(f"{'contract':<8} {'function':<8} {'ms/call':>8} {'TFLOP/s':>8}")
    for name in args.contracts.split(","):
        vmfb = out / f"{name}.{args.target}.vmfb"
        for fn in ("dense", "grouped"):
            cmd = [str(tool), f"--module={vmfb}", f"--device={args.driver}", f"--function={fn}", *inputs[fn],
                   f"--benchmark_min_time={args.calls}x", "--benchmark_format=json"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                print(f"{name:<8} {fn:<8} failed: {(res.stderr or res.stdout).strip().splitlines()[-1][:200]}")
                continue
            rows = json.loads(res.stdout[res.stdout.index("{"):])["benchmarks"]
            ms = min(r["real_time"] for r in rows if r.get("run_type") == "iteration")
            unit = rows[0].get("time_unit", "ms")
            ms *= {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
            print(f"{name:<8} {fn:<8} {ms:8.3f} {_flops(fn, T_RUN) / ms / 1e9:8.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--target", default="cuda")
    a.add_argument("--contracts", default=",".join(CONTRACTS))
    a.add_argument("-o", "--out", required=True)
    b = sub.add_parser("run")
    b.add_argument("out")
    b.add_argument("--driver", default="cuda")
    b.add_argument("--target", default="cuda")
    b.add_argument("--contracts", default=",".join(CONTRACTS))
    b.add_argument("--calls", type=int, default=20, help="calls per measurement")
    args = p.parse_args()
    prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    main()
