"""Time the routed experts' gathered MXFP4 GEMM (`mxfp4_linear_gathered=kernel_gemm`) under IREE's own
tile choice, the project's tuning library (export/tuning/<target>.mlir) and candidate tiles.

    python -m dsv4.bench.tile_sweep build DIR [--target cuda]   # export + compile every variant (seconds each)
    python -m dsv4.bench.tile_sweep run DIR [--device cuda]     # on the GPU host: iree-benchmark-module, a table

`build` needs the export extra (torch, iree-turbine, the compiler); `run` only the runtime, so a GPU host
without a compiler can time what this machine built. Each case is one GEMM at Flash's expert shapes
(w1: N 2048, K 4096; w2: N 4096, K 2048) over a decode's blocks (batch 64: 264 blocks of 16 rows, 171
distinct experts) or a 1,024-token prefill's (353 blocks of 64 rows, every expert), inputs splat. A
candidate is the library with its matcher for that row count given another config (a row count the
library leaves to IREE gets a copy of the 64-row matcher), so the timed kernel is the export's own
(same IR, same matcher); "iree" compiles without the library.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

E = 256
SHAPES = {"w1": (2048, 4096), "w2": (4096, 2048)}  # (N, K) of one Flash expert projection
BLOCKS = {16: 264, 64: 353}  # rows per block -> blocks: decode batch 64 (static bound), 1,024-token prefill
# candidate configs per rows per block: (workgroup tile N, subgroup tile N in mma tiles, K tiles of 32, threads);
# the M tile is the block, one subgroup spans 16 (decode) or 32 (prefill) of its rows
CANDIDATES = {16: [(32, 2, 4, 64), (64, 4, 4, 64), (128, 4, 4, 128), (128, 8, 4, 64), (128, 4, 2, 128), (256, 8, 4, 128)],
              64: [(32, 2, 4, 128), (64, 4, 4, 128), (128, 8, 4, 128), (128, 4, 4, 256), (128, 8, 2, 128), (256, 16, 4, 128)]}


def _sel(rows: int) -> np.ndarray:
    if rows == 64:  # a prefill's blocks: experts in order, the spare blocks on the last one
        return np.minimum(np.arange(BLOCKS[64]), E - 1).astype(np.int64)
    return np.sort(np.random.default_rng(0).integers(0, E, BLOCKS[16])).astype(np.int64)


def _library_variant(text: str, rows: int, cand: tuple[int, int, int, int]) -> str:
    """The tuning library with the rows-per-block matcher's config replaced by `cand`; a row count the
    library leaves to IREE gets a copy of the 64-row matcher for its own rows."""
    n, sn, kq, threads = cand
    if f"@match_gathered_mxfp4_rows{rows}(" not in text:
        start = text.index("  transform.named_sequence @match_gathered_mxfp4_rows64(")
        end = text.index("\n  }\n", start) + 4
        matcher = text[start:end].replace("rows64", f"rows{rows}").replace("x64x", f"x{rows}x")
        text = text[:end] + "\n" + matcher + text[end:]
        text = text.replace("@match_gathered_mxfp4_rows64 -> @apply_op_config",
                            f"@match_gathered_mxfp4_rows64 -> @apply_op_config,\n        @match_gathered_mxfp4_rows{rows} -> @apply_op_config")
    start = text.index(f"@match_gathered_mxfp4_rows{rows}(")
    end = text.index("transform.yield", start)
    body = text[start:end]
    sm = 1 if rows == 16 else 2
    body = re.sub(r"workgroup = \[[^\]]*\]", f"workgroup = [1, {rows}, {n}, 0, 0]", body)
    body = re.sub(r"subgroup = \[[^\]]*\]", f"subgroup = [0, {sm}, {sn}, 0, 0]", body)
    body = re.sub(r"reduction = \[[^\]]*\]", f"reduction = [0, 0, 0, {kq}, 2]", body)
    body = re.sub(r"workgroup_size = \[[^\]]*\]", f"workgroup_size = [{threads}, 1, 1]", body)
    return text[:start] + body + text[end:]


def build(out: Path, target: str) -> None:
    import torch
    from iree.turbine import aot

    from dsv4.export.compile import TUNING_FLAG, TUNING_LIBRARIES, compile_mlir, resolve_target
    from dsv4.export.kernel_op import use_kernels
    from dsv4.model.kernels.linear import mxfp4_linear_gathered

    tgt = resolve_target(target)
    library = Path(TUNING_LIBRARIES[tgt.name]).read_text() if any(f.startswith(TUNING_FLAG) for f in tgt.flags) else ""
    if "@match_gathered_mxfp4_rows64" not in library:  # the block GEMM's matcher the candidates replace
        raise SystemExit(f"target {target!r} has no tuning library for the gathered block GEMM (export/compile.py "
                         f"TUNING_LIBRARIES: {', '.join(TUNING_LIBRARIES)} at archs {', '.join(tgt.tuned_archs) or 'none'}; "
                         f"only cuda's holds its matcher)")
    plain = replace(tgt, tuned_archs=())  # the same target without the library

    class Gathered(torch.nn.Module):
        def forward(self, x, packed, scales, sel):
            return mxfp4_linear_gathered(x, packed, scales, sel, 0)
    out.mkdir(parents=True, exist_ok=True)
    cases = []
    for shape, (N, K) in SHAPES.items():
        for rows, G in BLOCKS.items():
            sel = _sel(rows)
            np.save(out / f"sel{rows}.npy", sel)
            args = (torch.zeros(G, rows, K, dtype=torch.bfloat16), torch.zeros(E, N, K // 2, dtype=torch.uint8),
                    torch.zeros(E, N, K // 32, dtype=torch.uint8), torch.from_numpy(sel))
            with torch.no_grad(), use_kernels({"mxfp4_linear_gathered": "kernel_gemm"}):
                exported = aot.export(Gathered(), args=args)
            mlir = out / f"{shape}_r{rows}.mlir"
            exported.save_mlir(str(mlir))
            inputs = [f"{G}x{rows}x{K}xbf16=0.5", f"{E}x{N}x{K // 2}xi8=17", f"{E}x{N}x{K // 32}xi8=127", f"@sel{rows}.npy"]
            variants = {"iree": (plain, []), "library": (tgt, [])}
            for cand in CANDIDATES[rows]:
                lib = out / f"{shape}_r{rows}_n{cand[0]}s{cand[1]}k{cand[2]}t{cand[3]}.mlir"
                lib.write_text(_library_variant(library, rows, cand))
                variants[f"N {cand[0]}, subgroup N {cand[1]}, K {32 * cand[2]}, {cand[3]} threads"] = (plain, [f"{TUNING_FLAG}={lib}"])
            for name, (t, flags) in variants.items():
                vmfb = out / f"{shape}_r{rows}_{len(cases)}.vmfb"
                compile_mlir(mlir, t, vmfb, extra_flags=flags)
                cases.append({"shape": shape, "rows": rows, "blocks": G, "variant": name, "vmfb": vmfb.name,
                              "inputs": inputs, "bytes": G * N * K // 2 + G * N * K // 32})
                print(f"built {shape} {rows}-row blocks: {name}", flush=True)
    (out / "cases.json").write_text(json.dumps(cases, indent=1))


def _benchmark_tool() -> str:
    from dsv4.bench.speed import _tool

    tool = _tool("iree-benchmark-module")
    if not tool.exists():
        raise SystemExit(f"iree-benchmark-module not found at {tool} (iree-base-runtime installs it)")
    return str(tool)


def run(out: Path, device: str, repetitions: int) -> None:
    tool = _benchmark_tool()
    cases = json.loads((out / "cases.json").read_text())
    print(f"{'GEMM':<4} {'blocks':>9} {'variant':<42} {'ms':>7} {'GB/s of expert bytes':>20}")
    for c in cases:
        cmd = [tool, f"--device={device}", f"--module={c['vmfb']}", "--function=main",
               *[f"--input={i}" for i in c["inputs"]], f"--benchmark_repetitions={repetitions}", "--benchmark_min_time=0.2s"]
        res = subprocess.run(cmd, cwd=out, capture_output=True, text=True)
        m = re.search(r"real_time_median\s+([0-9.]+) ms", res.stdout)
        if not m:
            print(f"{c['shape']:<4} {c['blocks']:>4} x {c['rows']:<2} {c['variant']:<42} failed: {res.stderr.strip()[-200:]}")
            continue
        ms = float(m.group(1))
        print(f"{c['shape']:<4} {c['blocks']:>4} x {c['rows']:<2} {c['variant']:<42} {ms:>7.3f} {c['bytes'] / ms / 1e6:>20.0f}",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4.bench.tile_sweep", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="export and compile every variant into DIR")
    b.add_argument("dir", type=Path)
    b.add_argument("--target", default="cuda", help="a GPU target with a tuning library (default cuda)")
    r = sub.add_parser("run", help="time DIR's variants")
    r.add_argument("dir", type=Path)
    r.add_argument("--device", default="cuda", help="IREE device (default cuda)")
    r.add_argument("--repetitions", type=int, default=3)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(args.dir, args.target)
    else:
        run(args.dir, args.device, args.repetitions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
