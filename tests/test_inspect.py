"""`dsv4 inspect` (dsv4.export.inspect): the reading of executable sources (FLOPs, bytes, dynamic sizes
from the host program), of AMDGPU disassembly and PTX (which kernels use the matrix instructions), and
one real export: its dispatch count against `iree-compile --compile-to=stream`, a named matmul's FLOPs
against 2*M*N*K."""

from __future__ import annotations

import collections
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4.export import inspect as I

REPO = Path(__file__).resolve().parents[1]

# A generalized executable-sources module as iree-compile + iree-opt print it, cut to what is read: a
# matmul whose rows are dynamic (the host computes them from the token count: ceil(T / 16) * 16, passed as
# two i32 push constants), a gather from a 1000x64 f32 table with exp and mulf per element, and the host
# program (two calls of the matmul, one of the gather; the initializer one gather).
SOURCES = """\
#map = affine_map<(d0, d1, d2) -> (d0, d2)>
#map1 = affine_map<(d0, d1, d2) -> (d2, d1)>
#map2 = affine_map<(d0, d1, d2) -> (d0, d1)>
#map3 = affine_map<(d0, d1) -> (d0, d1)>
module {
  hal.executable private @f_dispatch_0 {
    hal.executable.variant public @rocm_hsaco_fb target(#t) {
      hal.executable.export public @f$async_dispatch_0_matmul_Dx512x256_bf16xbf16xf32 ordinal(0) layout(#l) count(%arg0: !hal.device, %arg1: index) -> (index, index, index) {
        %x, %y, %z = iree_tensor_ext.dispatch.workgroup_count_from_slice(%arg1)
        hal.return %x, %y, %z : index, index, index
      }
      builtin.module {
        func.func @f$async_dispatch_0_matmul_Dx512x256_bf16xbf16xf32() {
          %c32_i64 = arith.constant 32 : i64
          %0 = hal.interface.constant.load layout(#l) ordinal(0) : i32
          %1 = hal.interface.constant.load layout(#l) ordinal(1) : i32
          %2 = arith.extui %0 : i32 to i64
          %3 = arith.extui %1 : i32 to i64
          %4 = arith.shli %3, %c32_i64 : i64
          %5 = arith.ori %2, %4 : i64
          %6 = arith.index_castui %5 : i64 to index
          %7:2 = util.assume.int 
              %6<umin = 0, umax = 9007199254740991>, 
              %6[<umin = 16, umax = 4096>, <umin = 16, umax = 4096>]
            : index, index
          %8 = iree_tensor_ext.dispatch.workload.ordinal %7#1, 0 : index
          %9 = hal.interface.binding.subspan layout(#l) binding(0) : !iree_tensor_ext.dispatch.tensor<readonly:tensor<?x256xbf16>>{%8}
          %10 = iree_tensor_ext.dispatch.tensor.load %9, offsets = [0, 0], sizes = [%8, 256], strides = [1, 1] : !iree_tensor_ext.dispatch.tensor<readonly:tensor<?x256xbf16>>{%8} -> tensor<?x256xbf16>
          %11 = iree_tensor_ext.dispatch.tensor.load %b, offsets = [0, 0], sizes = [256, 512], strides = [1, 1] : !iree_tensor_ext.dispatch.tensor<readonly:tensor<256x512xbf16>> -> tensor<256x512xbf16>
          %12 = tensor.empty(%8) : tensor<?x512xf32>
          %13 = linalg.generic {indexing_maps = [#map, #map1, #map2], iterator_types = ["parallel", "parallel", "reduction"]} ins(%10, %11 : tensor<?x256xbf16>, tensor<256x512xbf16>) outs(%12 : tensor<?x512xf32>) {
          ^bb0(%in: bf16, %in_0: bf16, %out: f32):
            %14 = arith.extf %in : bf16 to f32
            %15 = arith.extf %in_0 : bf16 to f32
            %16 = arith.mulf %14, %15 : f32
            %17 = arith.addf %out, %16 : f32
            linalg.yield %17 : f32
          } -> tensor<?x512xf32>
          iree_tensor_ext.dispatch.tensor.store %13, %c, offsets = [0, 0], sizes = [%8, 512], strides = [1, 1] : tensor<?x512xf32> -> !iree_tensor_ext.dispatch.tensor<writeonly:tensor<?x512xf32>>{%8}
          return
        }
      }
    }
  }
  hal.executable private @f_dispatch_1 {
    hal.executable.variant public @rocm_hsaco_fb target(#t) {
      builtin.module {
        func.func @f$async_dispatch_1_elementwise_4x64_f32() {
          %0 = iree_tensor_ext.dispatch.tensor.load %t, offsets = [0, 0], sizes = [1000, 64], strides = [1, 1] : !iree_tensor_ext.dispatch.tensor<readonly:tensor<1000x64xf32>> -> tensor<1000x64xf32>
          %1 = iree_tensor_ext.dispatch.tensor.load %i, offsets = [0], sizes = [4], strides = [1] : !iree_tensor_ext.dispatch.tensor<readonly:tensor<4xi64>> -> tensor<4xi64>
          %2 = tensor.empty() : tensor<4x64xf32>
          %3 = linalg.generic {indexing_maps = [affine_map<(d0, d1) -> (d0)>, #map3], iterator_types = ["parallel", "parallel"]} ins(%1 : tensor<4xi64>) outs(%2 : tensor<4x64xf32>) {
          ^bb0(%in: i64, %out: f32):
            %4 = linalg.index 1 : index
            %5 = arith.index_cast %in : i64 to index
            %extracted = tensor.extract %0[%5, %4] : tensor<1000x64xf32>
            %6 = math.exp %extracted : f32
            %7 = arith.mulf %6, %6 : f32
            linalg.yield %7 : f32
          } -> tensor<4x64xf32>
          iree_tensor_ext.dispatch.tensor.store %3, %o, offsets = [0, 0], sizes = [4, 64], strides = [1, 1] : tensor<4x64xf32> -> !iree_tensor_ext.dispatch.tensor<writeonly:tensor<4x64xf32>>
          return
        }
      }
    }
  }
  util.initializer {
    %0 = stream.cmd.execute {
      stream.cmd.dispatch @f_dispatch_1::@rocm_hsaco_fb::@f$async_dispatch_1_elementwise_4x64_f32 {
      }
    } => !stream.timepoint
    util.return
  }
  util.func public @f$async(%arg0: !hal.buffer_view) -> !hal.buffer_view {
    %c16 = arith.constant 16 : index
    %c32_i64 = arith.constant 32 : i64
    %0 = hal.buffer_view.dim<%arg0 : !hal.buffer_view>[1] : index
    %1 = arith.ceildivui %0, %c16 : index
    %2 = arith.muli %1, %c16 : index
    %3 = arith.index_castui %2 : index to i64
    %4 = arith.trunci %3 : i64 to i32
    %5 = arith.shrui %3, %c32_i64 : i64
    %6 = arith.trunci %5 : i64 to i32
    %7 = stream.cmd.execute on(#hal.device.affinity<@__device_0>) with(%r as %arg1: !stream.resource<external>{%c16}) {
      stream.cmd.dispatch @f_dispatch_0::@rocm_hsaco_fb::@f$async_dispatch_0_matmul_Dx512x256_bf16xbf16xf32[%2](%4, %6 : i32, i32) {
        ro %arg1[%c0 for %c16] : !stream.resource<external>{%c16}
      }
      stream.cmd.dispatch @f_dispatch_1::@rocm_hsaco_fb::@f$async_dispatch_1_elementwise_4x64_f32 {
      }
    } => !stream.timepoint
    %8 = stream.timepoint.await %7 => %r : !stream.resource<external>{%c16}
    %9 = util.optimization_barrier %8 : !stream.resource<external>
    %10 = stream.cmd.execute on(#hal.device.affinity<@__device_0>) with(%9 as %arg2: !stream.resource<external>{%c16}) {
      stream.cmd.dispatch @f_dispatch_0::@rocm_hsaco_fb::@f$async_dispatch_0_matmul_Dx512x256_bf16xbf16xf32[%2](%4, %6 : i32, i32) {
      }
    } => !stream.timepoint
    util.return %arg0 : !hal.buffer_view
  }
  util.func public @f(%arg0: !hal.buffer_view) -> !hal.buffer_view {
    %0 = util.call @f$async(%arg0) : (!hal.buffer_view) -> !hal.buffer_view
    util.return %0 : !hal.buffer_view
  }
}
"""
MATMUL = "f$async_dispatch_0_matmul_Dx512x256_bf16xbf16xf32"
GATHER = "f$async_dispatch_1_elementwise_4x64_f32"


def test_sources_give_each_call_its_flops_bytes_and_dynamic_rows_from_the_host() -> None:
    rows = 100
    d = 112  # ceil(100 / 16) * 16, what the host passes
    ir = I.parse_sources(SOURCES, rows)
    assert ir.calls["f$async"] == [(MATMUL, (d, 0), (d,)), (GATHER, (), ()), (MATMUL, (d, 0), (d,))]
    assert ir.calls["<initializer>"] == [(GATHER, (), ())] and ir.calls["f"] == []
    mm = ir.dispatch(MATMUL, rows, (d, 0), (d,))
    assert (mm.kind, mm.shape, mm.types) == ("matmul", "Dx512x256", "bf16xbf16xf32")
    assert mm.flops == mm.matmul_flops == 2 * d * 512 * 256
    assert mm.bytes == d * 256 * 2 + 256 * 512 * 2 + d * 512 * 4
    assert mm.contraction and mm.multi_row and mm.mnk == (d, 512, 256) and not mm.guessed
    g = ir.dispatch(GATHER, rows)
    # exp and mulf per point (casts and index ops are not arithmetic); the table counts what is extracted
    assert g.flops == 2 * 4 * 64 and g.matmul_flops == 0 and not g.contraction and g.gather
    assert g.bytes == 4 * 64 * 4 + 4 * 8 + 4 * 64 * 4
    # without the push constants the dynamic size falls back to rows, and says so
    guess = ir.dispatch(MATMUL, rows)
    assert guess.guessed and guess.flops == 2 * rows * 512 * 256


def test_report_totals_and_the_share_of_matmul_flops_on_the_matrix_cores() -> None:
    ir = I.parse_sources(SOURCES, 100)
    matrix = {MATMUL: collections.Counter({"v_mfma_f32_16x16x16_bf16": 16}), GATHER: collections.Counter()}
    entries = {e.function: e for e in I.build_report(ir, matrix, 100)}
    assert set(entries) == {"f", "<initializer>"}  # "$async" dropped; a function without dispatches left out
    t = entries["f"].totals()
    mm = 2 * 112 * 512 * 256
    assert (t["dispatches"], t["kernels"], t["matmul_flops"], t["flops"]) == (3, 2, 2 * mm, 2 * mm + 512)
    # the host waits for the device once mid-call (the await before the barrier); the initializer never
    assert t["host_waits"] == 1 and entries["<initializer>"].totals()["host_waits"] == 0
    assert t["matrix_share"] == 1.0 and (t["multi_row_matmul_kernels"], t["multi_row_matmul_kernels_on_matrix"]) == (1, 1)
    assert [k.info.name for k, _ in entries["f"].kernels()] == [MATMUL, GATHER]
    no_mfma = {MATMUL: collections.Counter(), GATHER: collections.Counter()}
    t = I.build_report(ir, no_mfma, 100, ["f"])[0].totals()
    assert t["matrix_share"] == 0.0 and t["multi_row_matmul_kernels_on_matrix"] == 0
    # cuda's PTX spells $ as _; a kernel missing from the code is an error naming it
    ptx_names = {re.sub(r"\W", "_", k): v for k, v in matrix.items()}
    assert I.build_report(ir, ptx_names, 100, ["f"])[0].totals()["matrix_share"] == 1.0
    with pytest.raises(ValueError, match="is not in the vmfb's code"):
        I.build_report(ir, {GATHER: collections.Counter()}, 100, ["f"])
    with pytest.raises(ValueError, match="no entry point g; the export has f"):
        I.build_report(ir, matrix, 100, ["g"])
    text = I.format_report(I.InspectReport("OUT", "gfx942", 100, entries=I.build_report(ir, matrix, 100),
                                           mlir="model.mlir", seconds={}))
    assert "f: 3 dispatches (2 kernels), 1 host wait" in text and "100.0 % on the matrix cores" in text


def test_a_matvec_has_one_row_and_a_batched_matmul_keeps_its_batch_apart() -> None:
    mv = I.LinalgOp(maps=(I.AffineMap.parse("(d0, d1) -> (d1)"), I.AffineMap.parse("(d0, d1) -> (d0, d1)"),
                          I.AffineMap.parse("(d0, d1) -> (d0)")),
                    iterators=("parallel", "reduction"), shapes=((256,), (512, 256), (512,)), n_inputs=2,
                    body=("arith.mulf", "arith.addf"))
    assert mv.is_contraction and mv.flops() == 2 * 512 * 256 and 1 in mv.rows_cols()
    bmm = I.LinalgOp(maps=tuple(I.AffineMap.parse(m) for m in ("(d0, d1, d2, d3) -> (d0, d1, d3)",
                                                               "(d0, d1, d2, d3) -> (d0, d3, d2)",
                                                               "(d0, d1, d2, d3) -> (d0, d1, d2)")),
                     iterators=("parallel", "parallel", "parallel", "reduction"),
                     shapes=((6, 16, 64), (6, 64, 32), (6, 16, 32)), n_inputs=2, body=("math.fma",))
    assert bmm.is_contraction and bmm.flops() == 2 * 6 * 16 * 32 * 64 and bmm.rows_cols() == (16, 32)
    red = I.LinalgOp(maps=(I.AffineMap.parse("(d0, d1) -> (d0, d1)"), I.AffineMap.parse("(d0, d1) -> (d0)")),
                     iterators=("parallel", "reduction"), shapes=((8, 128), (8,)), n_inputs=1,
                     body=("arith.mulf", "arith.addf"))
    assert not red.is_contraction and red.flops() == 2 * 8 * 128  # a sum of squares: one operand


@pytest.mark.parametrize("name,parts", [
    ("main$async_dispatch_12_matmul_like_16x4096x512_bf16", ("matmul_like", "16x4096x512", "bf16")),
    ("prefill_bs1$async_dispatch_421_batch_matmul_1xDx64x4096_bf16xbf16xf32",
     ("batch_matmul", "1xDx64x4096", "bf16xbf16xf32")),
    ("f$async_dispatch_3_slow_memcpy", ("slow_memcpy", "", "")),
    ("__builtin_fill_i64", ("", "", "")),
])
def test_dispatch_names(name: str, parts: tuple[str, str, str]) -> None:
    assert I.name_parts(name) == parts


OBJDUMP = """
/tmp/x.hsaco:\tfile format elf64-amdgpu

Disassembly of section .text:

0000000000001e00 <f$async_dispatch_0_matmul_Dx512x256_bf16xbf16xf32>:
\ts_load_dwordx4 s[0:3], s[0:1], 0x0                        // 000000001E00: C00A0000 00000000
\tv_fmac_f32_e32 v1, v2, v3                                  // 000000001E08: 76020702
\ts_endpgm                                                   // 000000001E0C: BF810000

0000000000002100 <f$async_dispatch_1_matmul_16x512x256_bf16xbf16xf32>:
\tv_mfma_f32_16x16x16_bf16 v[4:7], v[42:43], v[58:59], v[4:7]// 000000002718: D3E10004 0412752A
\tv_mfma_f32_16x16x16_bf16 v[0:3], v[42:43], v[58:59], v[0:3]// 000000002738: D3E10000 0402752A
\tv_mfma_f32_16x16x32_fp8_fp8 v[0:3], v[4:5], v[6:7], v[0:3] // 000000002740: D3F30000 04020D04
\ts_endpgm                                                   // 000000002750: BF810000
"""

PTX = """//
.version 8.4
.target sm_89
.address_size 64
.func helper(.param .b32 a) { mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f1}; }
.visible .entry f_async_dispatch_0_matmul_Dx512x256(
\t.param .u64 p0
)
{
\tfma.rn.f32 \t%f1, %f2, %f3, %f1;
\tret;
}
.visible .entry f_async_dispatch_1_matmul_16x512x256(
\t.param .u64 p0
)
{
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2, %r3, %r4}, {%r5, %r6}, {%f1, %f2, %f3, %f4};
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2, %r3, %r4}, {%r5, %r6}, {%f1, %f2, %f3, %f4};
\tret;
}
//
.version 8.4
.target sm_89
.visible .entry g_dispatch_0(
)
{
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 0;
}
"""


def test_matrix_instructions_per_kernel_in_amdgpu_disassembly_and_ptx() -> None:
    amd = I.amdgpu_kernels(OBJDUMP)
    assert amd == {"f$async_dispatch_0_matmul_Dx512x256_bf16xbf16xf32": {},
                   "f$async_dispatch_1_matmul_16x512x256_bf16xbf16xf32":
                       {"v_mfma_f32_16x16x16_bf16": 2, "v_mfma_f32_16x16x32_fp8_fp8": 1}}
    ptx = I.ptx_kernels(PTX)
    assert ptx == {"f_async_dispatch_0_matmul_Dx512x256": {},  # the helper .func's mma is not its own
                   "f_async_dispatch_1_matmul_16x512x256": {"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32": 2},
                   "g_dispatch_0": {"wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16": 1}}


def _elf(payload: bytes) -> bytes:
    """A minimal ELF64 image: the header, `payload`, then a section header table of 2 entries."""
    shoff = 64 + len(payload)
    head = bytearray(64)
    head[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", head, 0x28, shoff)
    struct.pack_into("<HH", head, 0x3A, 64, 2)
    return bytes(head) + payload + b"\x01" * 128


def test_code_objects_are_cut_out_of_a_member_whole() -> None:
    a, b = _elf(b"kernel-a" * 5), _elf(b"kernel-b \x7fELF inside" * 3)
    data = b"flatbuffer head" + a + b"padding\x00\x00" + b + b"tail"
    assert list(I.amdgpu_code_objects(data)) == [a, b]


def test_missing_disassembler_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(I.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match=r"llvm-objdump-19 is not installed.*apt-get install llvm-19"):
        I.disassembler()


def test_inspect_imports_without_torch() -> None:
    code = ("import sys\nimport dsv4.export.inspect, dsv4.cli.inspect\n"
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def _stream_counts(mlir: Path, flags: list[str]) -> dict[str, int]:
    from iree.compiler.tools.binaries import find_tool

    text = subprocess.run([find_tool("iree-compile"), str(mlir), *flags, "--compile-to=stream", "-o", "-"],
                          capture_output=True, text=True, check=True).stdout
    counts: dict[str, int] = collections.Counter()
    func = None
    for line in text.splitlines():
        m = re.match(r"\s*util\.func\s+(?:public\s+|private\s+)?@\"?([\w$.]+)", line)
        if m:
            func = m.group(1).removesuffix("$async")
        elif re.match(r"\s*util\.initializer", line):
            func = "<initializer>"
        elif "stream.cmd.dispatch" in line and func is not None:
            counts[func] += 1
    return dict(counts)


@pytest.mark.slow  # reads the shared tiny export (gfx942 and llvm-cpu, its MLIR kept) and compiles it once more
def test_tiny_export_dispatch_counts_and_a_matmuls_flops(tiny_fp32_export: Path, tmp_path: Path) -> None:
    """The dispatches per call are --compile-to=stream's count; a static matmul's FLOPs are 2*M*N*K of the
    sizes IREE names it with; an export without model.mlir is refused naming --keep-mlir."""
    import json

    out = tiny_fp32_export
    rep = I.inspect_export(out, "gfx942")
    flags = json.loads((out / "config.json").read_text())["targets"]["gfx942"]["flags"]
    want = _stream_counts(out / "model.mlir", flags)
    got = {e.function: e.totals()["dispatches"] for e in rep.entries}
    assert got == want and {"prefill_bs1", "decode_bs1", "decode_bs4"} <= set(got)
    # a decode call never makes the host wait for the GPU mid-call (the fusion barriers are compute barriers,
    # not optimization barriers, each of which was a wait: docs/performance.md, Host waits)
    waits = {e.function: e.host_waits for e in rep.entries if e.function.startswith("decode")}
    assert waits and set(waits.values()) == {0}, waits
    checked = 0
    for e in rep.entries:
        for d in e.calls:
            i = d.info
            if i.kind == "matmul" and "D" not in i.shape and i.contraction:
                m, n, k = map(int, i.shape.split("x"))
                assert i.mnk == (m, n, k) and i.matmul_flops == 2 * m * n * k, i.name
                checked += 1
    assert checked > 0
    assert rep.entries and all(d.matrix is not None for e in rep.entries for d in e.calls)
    bare = tmp_path / "bare"
    shutil.copytree(out, bare)
    (bare / "model.mlir").unlink()
    with pytest.raises(ValueError, match="has no model.mlir.*--keep-mlir"):
        I.inspect_export(bare, "gfx942")


def test_a_gather_counts_the_elements_its_indices_can_reach() -> None:
    """The one-row expert GEMV's decode (quant.mlir.jinja): byte k / 2 and scale k / 32 of expert sel[g], over
    (g, n, k) = 6 x 2048 x 4096 points. Each packed byte is read for two points and each scale for 32, so the
    distinct elements are 6 x 2048 x 2048 and 6 x 2048 x 128, not one a point; an index computed another way
    (a float's bits) keeps one a point."""
    body = """\
            %20 = linalg.index 0 : index
            %21 = linalg.index 1 : index
            %22 = linalg.index 2 : index
            %extracted = tensor.extract %7[%20] : tensor<6xf32>
            %23 = arith.fptosi %extracted : f32 to i64
            %24 = arith.index_cast %23 : i64 to index
            %25 = arith.divui %22, %c2 : index
            %26 = arith.divui %22, %c32 : index
            %extracted_4 = tensor.extract %8[%24, %21, %25] : tensor<256x2048x2048xi8>
            %extracted_5 = tensor.extract %9[%24, %21, %26] : tensor<256x2048x128xi8>
            %27 = arith.bitcast %extracted_5 : i8 to f8E8M0FNU
            %28 = arith.extf %27 : f8E8M0FNU to f32
            %29 = arith.fptoui %28 : f32 to i64
            %30 = arith.index_cast %29 : i64 to index
            %extracted_6 = tensor.extract %10[%30] : tensor<4096xf32>""".splitlines()
    found = dict(I._extract_loops(body, {"%c2": 2, "%c32": 32}))
    assert found == {"%7": ((0, 1),), "%8": ((0, 1), (1, 1), (2, 2)), "%9": ((0, 1), (1, 1), (2, 32)), "%10": None}
    op = I.LinalgOp(maps=(I.AffineMap.parse("(d0, d1, d2) -> (d0, d1, d2)"),), iterators=("parallel",) * 3,
                    shapes=((6, 2048, 4096),), n_inputs=0, body=())
    assert [op.extracted_elements(found[t]) for t in ("%7", "%8", "%9", "%10")] == \
        [6, 6 * 2048 * 2048, 6 * 2048 * 128, 6 * 2048 * 4096]


# The one-row gathered expert GEMV as IREE 3.13 prints its dispatch (quant.mlir.jinja, kernel_gemm at M = 1),
# cut to what is read: 3 pairs gather their expert's 16-byte scale blocks and scales out of 8 experts, decode
# them into low and high codes (two results) and sum both against x's even and odd elements.
GATHERED_GEMV = "g$async_dispatch_0_gather_8x64x4x16xi8_generic"
GATHERED_SOURCES = """\
module {
  hal.executable private @g_dispatch_0 {
    hal.executable.variant public @rocm_hsaco_fb target(#t) {
      builtin.module {
        func.func @g$async_dispatch_0_gather_8x64x4x16xi8_generic() {
          %0 = iree_tensor_ext.dispatch.tensor.load %a, offsets = [0], sizes = [3], strides = [1] : !iree_tensor_ext.dispatch.tensor<readonly:tensor<3xi64>> -> tensor<3xi64>
          %1 = iree_tensor_ext.dispatch.tensor.load %b, offsets = [0, 0, 0, 0], sizes = [8, 64, 4, 16], strides = [1, 1, 1, 1] : !iree_tensor_ext.dispatch.tensor<readonly:tensor<8x64x4x16xi8>> -> tensor<8x64x4x16xi8>
          %2 = iree_tensor_ext.dispatch.tensor.load %c, offsets = [0, 0, 0], sizes = [8, 64, 4], strides = [1, 1, 1] : !iree_tensor_ext.dispatch.tensor<readonly:tensor<8x64x4xi8>> -> tensor<8x64x4xi8>
          %3 = iree_tensor_ext.dispatch.tensor.load %d, offsets = [0, 0, 0], sizes = [3, 4, 16], strides = [1, 1, 1] : !iree_tensor_ext.dispatch.tensor<readonly:tensor<3x4x16xbf16>> -> tensor<3x4x16xbf16>
          %4 = iree_tensor_ext.dispatch.tensor.load %e, offsets = [0, 0, 0], sizes = [3, 4, 16], strides = [1, 1, 1] : !iree_tensor_ext.dispatch.tensor<readonly:tensor<3x4x16xbf16>> -> tensor<3x4x16xbf16>
          %5 = tensor.empty() : tensor<3x64x4x16xi8>
          %6 = tensor.empty() : tensor<3x64x4xi8>
          %7 = tensor.empty() : tensor<3x64x4x16xf32>
          %8 = tensor.empty() : tensor<3x64xf32>
          %9 = iree_linalg_ext.gather dimension_map = [0] ins(%1, %0 : tensor<8x64x4x16xi8>, tensor<3xi64>) outs(%5 : tensor<3x64x4x16xi8>) -> tensor<3x64x4x16xi8>
          %10 = iree_linalg_ext.gather dimension_map = [0] ins(%2, %0 : tensor<8x64x4xi8>, tensor<3xi64>) outs(%6 : tensor<3x64x4xi8>) -> tensor<3x64x4xi8>
          %11:2 = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>, affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>], iterator_types = ["parallel", "parallel", "parallel", "parallel"]} ins(%9, %10 : tensor<3x64x4x16xi8>, tensor<3x64x4xi8>) outs(%7, %7 : tensor<3x64x4x16xf32>, tensor<3x64x4x16xf32>) {
          ^bb0(%in: i8, %in_0: i8, %out: f32, %out_1: f32):
            %20 = arith.extui %in : i8 to i32
            %21 = arith.extui %in_0 : i8 to i32
            %22 = arith.bitcast %20 : i32 to f32
            %23 = arith.bitcast %21 : i32 to f32
            %24 = arith.mulf %22, %23 : f32
            %25 = arith.mulf %23, %22 : f32
            linalg.yield %24, %25 : f32, f32
          } -> (tensor<3x64x4x16xf32>, tensor<3x64x4x16xf32>)
          %12 = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d1)>], iterator_types = ["parallel", "parallel", "reduction", "reduction"]} ins(%11#0, %11#1, %3, %4 : tensor<3x64x4x16xf32>, tensor<3x64x4x16xf32>, tensor<3x4x16xbf16>, tensor<3x4x16xbf16>) outs(%8 : tensor<3x64xf32>) {
          ^bb0(%in: f32, %in_0: f32, %in_1: bf16, %in_2: bf16, %out: f32):
            %20 = arith.extf %in_1 : bf16 to f32
            %21 = arith.mulf %in, %20 : f32
            %22 = arith.extf %in_2 : bf16 to f32
            %23 = arith.mulf %in_0, %22 : f32
            %24 = arith.addf %21, %23 : f32
            %25 = arith.addf %out, %24 : f32
            linalg.yield %25 : f32
          } -> tensor<3x64xf32>
          iree_tensor_ext.dispatch.tensor.store %12, %o, offsets = [0, 0], sizes = [3, 64], strides = [1, 1] : tensor<3x64xf32> -> !iree_tensor_ext.dispatch.tensor<writeonly:tensor<3x64xf32>>
          return
        }
      }
    }
  }
  util.func public @g$async(%arg0: !hal.buffer_view) -> !hal.buffer_view {
    %0 = stream.cmd.execute with() {
      stream.cmd.dispatch @g_dispatch_0::@rocm_hsaco_fb::@g$async_dispatch_0_gather_8x64x4x16xi8_generic {
      }
    } => !stream.timepoint
    util.return %arg0 : !hal.buffer_view
  }
}
"""


def test_a_gather_op_counts_the_slices_it_selects_and_the_gemv_its_two_products() -> None:
    """An iree_linalg_ext.gather reads the slices its indices select (3 of the 8 experts' bytes and scales),
    not the table; the GEMV summing a low and a high product per point counts 2 multiply-adds a point."""
    ir = I.parse_sources(GATHERED_SOURCES, 1)
    assert ir.calls["g$async"] == [(GATHERED_GEMV, (), ())]
    d = ir.dispatch(GATHERED_GEMV, 1)
    points = 3 * 64 * 4 * 16
    assert d.gather and d.contraction and not d.multi_row and d.mnk == (64, 1, 64)
    assert d.matmul_flops == 2 * 2 * points
    assert d.flops == d.matmul_flops + 2 * points  # the decode's two mulf a point
    assert d.bytes == 3 * 8 + 3 * 64 * 64 + 3 * 64 * 4 + 2 * 3 * 64 * 2 + 3 * 64 * 4
