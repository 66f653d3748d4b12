"""One routed-expert MXFP4 linear at Flash size: the decode fused into the GEMM's dispatch, or not
(issue 15; numbers in docs/kernels.md "The routed experts' MXFP4 decode inside the GEMM").

    python bench/mxfp4_fused.py build OUT [--target cuda] [--flag F ...]   # writes OUT/mxfp4_fused.mlir + .vmfb
    python bench/mxfp4_fused.py run VMFB --device cuda [--g1 6,48,192] [--g16 48,264]

y[g, m, :] = x[g, m, :] @ W[sel[g]].T for G row blocks of M rows (M = 1: decode's one block per
(token, expert) pair; M = 16: the grouped blocks of big batches and prefill), W one of 256 experts
[2048, 4096] in MXFP4 (packed u8 [256, 2048, 2048], E8M0 scales u8 [256, 2048, 128]), x bf16, f32 out.
The selected experts' bytes are gathered first, as the export does (index_select), then:
  fused_m{M}:  the bytes viewed as i4 and decoded elementwise, a named batch_matmul (what
               quant.mlir.jinja emits): IREE clones the decode into the GEMM's dispatch;
  copy_m{M}:   the nibble picked from a [.., 16, 2] view of the bytes (the form before session 11):
               its own dispatch, writing a bf16 copy of every selected expert.
`run` checks every entry point against float64 numpy on the first block and prints ms per call.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
E, N, K = 256, 2048, 4096
KP, KS = K // 2, K // 32

@functools.cache
def _decode() -> str:
    """e2m1 code %c (i32) times the E8M0 scale byte %b (i8) -> bf16 %r, with quant.mlir.jinja's own
    macros (the decode the export's MXFP4 kernels run), rendered from the template's macro blocks."""
    import jinja2

    src = (REPO / "model" / "kernels" / "quant.mlir.jinja").read_text()
    macros = jinja2.Environment(undefined=jinja2.StrictUndefined, comment_start_string="{##",
                                comment_end_string="##}").from_string(
        "".join(re.findall(r"\{% macro .*?\{%- endmacro %\}", src, re.S))).module
    consts = "".join(f"\n    %i{v} = arith.constant {v} : i32" for v in (0, 1, 3, 22, 23, 126, 255, 4194304))
    return (consts + "\n    %half = arith.constant 0.5 : f32\n    %nan = arith.constant 0x7FC00000 : f32\n"
            + macros.e2m1_value("%v", "%c") + macros.scale_value("%sf", "%b", "i8")
            + "\n    %wv = arith.mulf %v, %sf : f32\n    %r = arith.truncf %wv : f32 to bf16")


def _gather(name: str, src: str, tail: tuple[int, ...]) -> str:
    t = "x".join(map(str, tail))
    return f"""
  %{name}0 = tensor.empty(%G) : tensor<?x{t}xi8>
  %{name} = linalg.generic {{indexing_maps = [affine_map<(g, n, k) -> (g)>, affine_map<(g, n, k) -> (g, n, k)>],
      iterator_types = ["parallel", "parallel", "parallel"]}} ins(%sel : tensor<?xi64>) outs(%{name}0 : tensor<?x{t}xi8>) {{
  ^bb0(%ei: i64, %o: i8):
    %ix = arith.index_cast %ei : i64 to index
    %n = linalg.index 1 : index
    %k = linalg.index 2 : index
    %a = tensor.extract {src}[%ix, %n, %k] : tensor<{E}x{t}xi8>
    linalg.yield %a : i8
  }} -> tensor<?x{t}xi8>"""


def entry_point(form: str, M: int) -> str:
    w4 = f"tensor<?x{N}x{KS}x32xbf16>"
    head = f"""
util.func public @{form}_m{M}(%x: tensor<?x{M}x{K}xbf16>, %p: tensor<{E}x{N}x{KP}xi8>, %s: tensor<{E}x{N}x{KS}xi8>,
                             %sel: tensor<?xi64>) -> tensor<?x{M}x{N}xf32> {{
  %c0 = arith.constant 0 : index
  %G = tensor.dim %sel, %c0 : tensor<?xi64>""" + _gather("pg", "%p", (N, KP)) + _gather("sc", "%s", (N, KS))
    if form == "fused":
        decode = f"""
  %c4 = flow.tensor.bitcast %pg : tensor<?x{N}x{KP}xi8>{{%G}} -> tensor<?x{N}x{KS}x32xi4>{{%G}}
  %w0 = tensor.empty(%G) : {w4}
  %w = linalg.generic {{indexing_maps = [affine_map<(g, n, b, j) -> (g, n, b, j)>, affine_map<(g, n, b, j) -> (g, n, b)>,
      affine_map<(g, n, b, j) -> (g, n, b, j)>], iterator_types = ["parallel", "parallel", "parallel", "parallel"]}}
      ins(%c4, %sc : tensor<?x{N}x{KS}x32xi4>, tensor<?x{N}x{KS}xi8>) outs(%w0 : {w4}) {{
  ^bb0(%a: i4, %b: i8, %o: bf16):
    %c = arith.extui %a : i4 to i32{_decode()}
    linalg.yield %r : bf16
  }} -> {w4}"""
    else:
        decode = f"""
  %pe = tensor.expand_shape %pg [[0], [1], [2, 3]] output_shape [%G, {N}, {KS}, 16] : tensor<?x{N}x{KP}xi8> into tensor<?x{N}x{KS}x16xi8>
  %w0 = tensor.empty(%G) : tensor<?x{N}x{KS}x16x2xbf16>
  %w2 = linalg.generic {{indexing_maps = [affine_map<(g, n, b, p, j) -> (g, n, b, p)>, affine_map<(g, n, b, p, j) -> (g, n, b)>,
      affine_map<(g, n, b, p, j) -> (g, n, b, p, j)>], iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]}}
      ins(%pe, %sc : tensor<?x{N}x{KS}x16xi8>, tensor<?x{N}x{KS}xi8>) outs(%w0 : tensor<?x{N}x{KS}x16x2xbf16>) {{
  ^bb0(%pv: i8, %b: i8, %o: bf16):
    %i4 = arith.constant 4 : i32
    %i15 = arith.constant 15 : i32
    %j = linalg.index 4 : index
    %pb = arith.extui %pv : i8 to i32
    %hi0 = arith.shrui %pb, %i4 : i32
    %hi = arith.andi %hi0, %i15 : i32
    %lo = arith.andi %pb, %i15 : i32
    %first = arith.cmpi eq, %j, %c0 : index
    %c = arith.select %first, %lo, %hi : i32{_decode()}
    linalg.yield %r : bf16
  }} -> tensor<?x{N}x{KS}x16x2xbf16>
  %w = tensor.collapse_shape %w2 [[0], [1], [2], [3, 4]] : tensor<?x{N}x{KS}x16x2xbf16> into {w4}"""
    return head + decode + f"""
  %wn = tensor.collapse_shape %w [[0], [1], [2, 3]] : {w4} into tensor<?x{N}x{K}xbf16>
  %z = arith.constant 0.0 : f32
  %y0 = tensor.empty(%G) : tensor<?x{M}x{N}xf32>
  %yz = linalg.fill ins(%z : f32) outs(%y0 : tensor<?x{M}x{N}xf32>) -> tensor<?x{M}x{N}xf32>
  %y = linalg.batch_matmul indexing_maps = [affine_map<(g, m, n, k) -> (g, m, k)>, affine_map<(g, m, n, k) -> (g, n, k)>,
      affine_map<(g, m, n, k) -> (g, m, n)>] ins(%x, %wn : tensor<?x{M}x{K}xbf16>, tensor<?x{N}x{K}xbf16>)
      outs(%yz : tensor<?x{M}x{N}xf32>) -> tensor<?x{M}x{N}xf32>
  util.return %y : tensor<?x{M}x{N}xf32>
}}
"""


def build(out: Path, target: str, flags: list[str]) -> Path:
    from dsv4.export.compile import compile_mlir

    out.mkdir(parents=True, exist_ok=True)
    mlir = out / "mxfp4_fused.mlir"
    mlir.write_text("".join(entry_point(f, M) for M in (1, 16) for f in ("fused", "copy")))
    res = compile_mlir(mlir, target, out / f"mxfp4_fused.{target.split(':')[0]}.vmfb", flags)
    print(f"{res.path} compiled in {res.seconds:.1f} s ({res.target})")
    return res.path


_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def run(vmfb: Path, device: str, g1: list[int], g16: list[int]) -> None:
    import iree.runtime as rt

    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, size=(E, N, KP), dtype=np.uint8)
    scale = rng.integers(120, 128, size=(E, N, KS), dtype=np.uint8)
    cfg = rt.Config(device)
    ctx = rt.SystemContext(config=cfg)
    ctx.add_vm_module(rt.VmModule.mmap(cfg.vm_instance, str(vmfb)))
    dev, mod = cfg.device, ctx.modules.module
    dp, ds = rt.asdevicearray(dev, packed.view(np.int8)), rt.asdevicearray(dev, scale.view(np.int8))
    print(f"{'form':8s} {'M':>3s} {'G':>5s} {'ms/call':>9s} {'GB/s of MXFP4':>14s} {'rel err':>9s}")
    for M, gs in ((1, g1), (16, g16)):
        for G in gs:
            sel = rng.integers(0, E, size=G).astype(np.int64)
            bits = (rng.standard_normal((G, M, K)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            x = (bits.astype(np.uint32) << 16).view(np.float32)  # the bf16 values, exactly
            dx = dev.allocator.allocate_buffer_copy(memory_type=rt.MemoryType.DEVICE_LOCAL,
                                                    allowed_usage=rt.BufferUsage.DEFAULT, device=dev, buffer=bits,
                                                    element_type=rt.HalElementType.BFLOAT_16)
            dsel = rt.asdevicearray(dev, sel)
            codes = np.stack([packed[sel[0]] & 15, packed[sel[0]] >> 4], -1).reshape(N, K)
            w = _E2M1[codes] * np.exp2(scale[sel[0]].astype(np.float64) - 127).repeat(32, 1)
            ref = x[0].astype(np.float64) @ w.T
            for form in ("fused", "copy"):
                f = mod[f"{form}_m{M}"]
                y = np.asarray(f(dx, dp, ds, dsel).to_host())
                err = np.abs(y[0] - ref).max() / np.abs(ref).max()
                n = 10 if device != "local-task" else 1
                for _ in range(2):
                    f(dx, dp, ds, dsel).to_host()
                t0 = time.perf_counter()
                outs = [f(dx, dp, ds, dsel) for _ in range(n)]
                outs[-1].to_host()
                ms = (time.perf_counter() - t0) / n * 1e3
                print(f"{form:8s} {M:3d} {G:5d} {ms:9.3f} {G * N * K * 0.53125 / ms / 1e6:14.1f} {err:9.2e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--target", default="cuda")
    b.add_argument("--flag", action="append", default=[], help="extra iree-compile flag")
    r = sub.add_parser("run")
    r.add_argument("vmfb", type=Path)
    r.add_argument("--device", default="cuda")
    r.add_argument("--g1", default="6,48,192", help="row blocks of 1 row")
    r.add_argument("--g16", default="48,264", help="row blocks of 16 rows")
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.out, a.target, a.flag)
    else:
        run(a.vmfb, a.device, [int(g) for g in a.g1.split(",")], [int(g) for g in a.g16.split(",")])


if __name__ == "__main__":
    main()
