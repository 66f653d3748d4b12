"""The quantization kernels (model/kernels/quant.mlir.jinja, mhc.mlir.jinja) against eager torch.

What export traces for each FP8/MXFP4 linear, quantize->dequantize, Hadamard and mHC Sinkhorn is
one kernel op (a few fx nodes instead of ~25-117); these tests pin down that the kernels compute
the eager references' values:

* qdq / Hadamard / Sinkhorn compiled for llvm-cpu equal eager **bitwise** (NaN positions equal),
  on inputs with every special case the rounding meets: exact powers of two and rounding ties,
  e4m3/e2m1 subnormal bands, +-0, NaN, +-inf, overflow, float32 subnormals, all-zero blocks;
* the linears equal a float64 product of the eager-quantized activation and the eager-dequantized
  weight within fp32 summation error (the summation order is the compiler's), NaN positions equal,
  for each GEMM form of the FP8 linear (kernel = auto, kernel_fp8 = FP8 x FP8 block GEMM, kernel_f32, kernel_bf16);
* the FP8 x FP8 form's activation codes decode to exactly the eager quantized values (every e4m3
  grid value through an identity weight, both FP8 formats, bitwise);
* everything compiles for cuda and gfx942: the FP8 x FP8 GEMM runs on the matrix cores of both
  (v_mfma_f32_16x16x32_fp8_fp8, mma.sync m16n8k32 e4m3), the f32 form converts e4m3fnuz weights with
  the hardware's v_cvt_pk_f32_fp8 on gfx942 and decodes e4m3fn with integer ops for cuda;
* a quantized model's traced decode graph holds the kernels and none of the math they replace.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

import dsv4.export  # noqa: F401
from dsv4.export.compile import GPU_REDUCTION_FLAG, compile_mlir, vmfb_executables
from dsv4.export.kernel_op import use_kernels
from dsv4.model.quant import sim as quant_sim
from dsv4.model.quant.formats import dequant_fp8_block, dequant_mxfp4, fp8_fn_to_fnuz
from dsv4.model.kernels.linear import (
    fp8_act_qdq,
    fp8_block_linear,
    fp8_block_linear_stacked,
    gathered_linear,
    mxfp4_linear,
    mxfp4_linear_gathered,
    mxfp4_linear_stacked,
)
from dsv4.model.kernels.mhc import hc_sinkhorn
from dsv4.runtime.module import IreeModule, ensure_runtime_flags

ensure_runtime_flags()
G = torch.Generator().manual_seed(11)


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G)


def _special_rows(d: int) -> torch.Tensor:
    """Rows of width d (a multiple of 64) that exercise every branch of the block roundings."""
    rows = [
        _r(d) * torch.logspace(-6, 3, d),  # every binade from e4m3 subnormals to saturation
        torch.exp2(torch.randint(-20, 10, (d,), generator=G).float()) * torch.sign(_r(d)),  # powers of two
        (torch.randint(-64, 64, (d,), generator=G).float() + 0.5) / 16,  # ties on the e4m3 / e2m1 grids
        torch.zeros(d),  # an all-zero block: amax floor
        torch.full((d,), -0.0),
        _r(d) * 1e-41,  # float32 subnormals
        _r(d) * 3e38,  # near overflow: x / s and the scale itself at the edge
    ]
    odd = _r(d)
    odd[::7] = float("nan")
    odd[3::11] = float("inf")
    odd[5::13] = float("-inf")
    rows.append(odd)
    amax_edge = _r(d)
    amax_edge[::64] = 448.0 * 2.0**-5  # amax / 448 exactly a power of two
    amax_edge[1::64] = 448.0 * 2.0**-5 * (1 + 2.0**-23)  # ... and one ulp above it
    rows.append(amax_edge)
    return torch.stack(rows)


class _Fn(nn.Module):
    def __init__(self, fn, *params: torch.Tensor, extra: tuple = ()):
        super().__init__()
        self.fn, self.extra = fn, extra
        self.params = nn.ParameterList([nn.Parameter(p, requires_grad=False) for p in params])

    def forward(self, x):
        return self.fn(x, *self.params, *self.extra)


def _export(mods: dict[str, tuple[nn.Module, torch.Tensor]], path, impl: str = "kernel", static: tuple = ()):
    """One module, one entry point per case (dynamic dim 1, static shapes for the cases in `static`),
    every kernel op that offers `impl` set to it (the others keep their export default)."""
    from iree.turbine import aot

    holder = nn.ModuleDict({k: m for k, (m, _) in mods.items()})
    aot.externalize_module_parameters(holder, external_scope="model")
    aot.save_module_parameters(path.with_suffix(".irpa"), holder)
    fxb = aot.FxProgramsBuilder(holder)
    T = torch.export.Dim("T", min=2, max=64)
    def entry(k: str):
        return lambda m, x: m[k](x)

    with torch.no_grad(), use_kernels({"*": impl}):
        for k, (_, x) in mods.items():
            ep = fxb.export_program(entry(k), name=k, args=(x,), strict=False,
                                    dynamic_shapes=None if k in static else {"x": {1: T}})
            ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
            assert any(o.startswith("dsv4k.") for o in ops), (k, sorted(ops))
    aot.export(fxb, import_symbolic_shape_expressions=False).save_mlir(str(path))
    return path


def _np(x: torch.Tensor) -> np.ndarray:
    import ml_dtypes

    return x.numpy() if x.dtype == torch.float32 else x.float().numpy().astype(ml_dtypes.bfloat16)


def _run(m: IreeModule, name: str, x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.asarray(m(name, _np(x))).astype(np.float32))


def _bitwise(got: torch.Tensor, want: torch.Tensor) -> bool:
    want = want.float()
    nan = got.isnan()
    return bool(torch.equal(nan, want.isnan()) and torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)))


@pytest.mark.slow  # compiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qdq_and_hadamard_kernels_equal_eager_bitwise(dtype, tmp_path):
    rows = _special_rows(256)  # [9, 256]
    x3 = rows[None].repeat(2, 1, 1).to(dtype)  # [B, T, D]: fp8_qdq on the KV
    x4 = torch.cat([rows, _r(3, 256)])[None, :, None].to(dtype).unflatten(-1, (2, 128))  # [B, T, H, D]
    finite = _r(2, 9, 2, 128).to(dtype)
    cases = {
        "fp8_qdq": (_Fn(quant_sim.fp8_qdq, extra=(64,)), x3),
        "fp8_qdq_4d": (_Fn(quant_sim.fp8_qdq, extra=(64,)), x4),
        "fp4_qdq": (_Fn(quant_sim.fp4_qdq, extra=(32,)), x4),
        "fp4_qdq_3d": (_Fn(quant_sim.fp4_qdq, extra=(32,)), x3),
        "hadamard": (_Fn(quant_sim.hadamard), finite),
        "hadamard_3d": (_Fn(quant_sim.hadamard), finite.flatten(2, 3)[..., :128]),
    }
    mlir = _export(cases, tmp_path / "qdq.mlir")
    m = IreeModule(compile_mlir(mlir, "llvm-cpu", tmp_path / "qdq.vmfb").path, tmp_path / "qdq.irpa")
    for name, (mod, x) in cases.items():
        with torch.no_grad():
            want = mod(x)
        got = _run(m, name, x)
        assert _bitwise(got, want), f"{name}: {int((got != want.float()).sum())} elements differ"


def _fp8_weight(n: int, k: int, nan: bool = True) -> torch.Tensor:
    w = (_r(n, k) * 0.05).to(torch.float8_e4m3fn)
    codes = [0x7F if nan else 0x7E, 0xFF if nan else 0xFE, 0x80, 0x01, 0x08, 0x77]  # NaN/max, -0, subnormals
    w.view(torch.uint8)[0, :len(codes)] = torch.tensor(codes, dtype=torch.uint8)
    return w


def _normal_codes(mod: _Fn) -> _Fn:
    """`mod` (an FP8 linear) with its e4m3fn weight's subnormal codes (exponent 0, mantissa m) made the normals
    of exponent 1 (+-(8 + m) x 2^-9); an e4m3fnuz weight as it is."""
    w, *rest = mod.params
    if w.dtype != torch.float8_e4m3fn:
        return mod
    c = w.detach().view(torch.uint8)
    sub = ((c & 0x78) == 0) & ((c & 7) != 0)
    return _Fn(mod.fn, torch.where(sub, c | 8, c).view(torch.float8_e4m3fn), *[p.detach() for p in rest], extra=mod.extra)


def _linear_cases() -> dict:
    e8 = lambda *s: torch.randint(116, 130, s, generator=G, dtype=torch.uint8)  # noqa: E731
    x = lambda *s: (_r(*s) * torch.logspace(-2, 1, s[-1])).to(torch.bfloat16)  # noqa: E731
    w_fn, s_fn = _fp8_weight(256, 384, nan=False), e8(2, 3)
    w_nz, s_nz = fp8_fn_to_fnuz(w_fn, s_fn)
    return {
        "fp8": (_Fn(fp8_block_linear, _fp8_weight(256, 384), e8(2, 3)), x(2, 5, 384)),
        "fp8_ragged_f32": (_Fn(fp8_block_linear, _fp8_weight(200, 300), torch.exp2(torch.randint(-9, 2, (2, 3), generator=G).float())),
                           x(2, 5, 300).float()),
        "fp8_e8m0fnu": (_Fn(fp8_block_linear, _fp8_weight(256, 128), e8(2, 1).view(torch.float8_e8m0fnu)), x(1, 5, 128)),
        "fp8_fnuz": (_Fn(fp8_block_linear, w_nz, s_nz), x(2, 5, 384)),
        "mxfp4": (_Fn(mxfp4_linear, torch.randint(0, 256, (96, 96), generator=G, dtype=torch.uint8), e8(96, 6)), x(2, 5, 192)),
        "fp8_stacked": (_Fn(fp8_block_linear_stacked, torch.stack([_fp8_weight(128, 256) for _ in range(3)]), e8(3, 1, 2)),
                        x(3, 5, 256)),
        "mxfp4_stacked": (_Fn(mxfp4_linear_stacked, torch.randint(0, 256, (3, 64, 64), generator=G, dtype=torch.uint8),
                              e8(3, 64, 4)), x(3, 5, 128).float()),
        # 20 rows (more than one 16-row matrix-core tile: kernel_fp8 pads to 32), f32 in and out
        "fp8_fnuz_m20": (_Fn(fp8_block_linear, w_nz, s_nz), x(4, 5, 384).float()),
        "fp8_stacked_m20": (_Fn(fp8_block_linear_stacked, torch.stack([_fp8_weight(128, 256) for _ in range(2)]),
                                e8(2, 1, 2)), x(2, 20, 256).float()),
        # 3 rows: static, kernel_small_rows pads them to 8
        "fp8_m3": (_Fn(fp8_block_linear, _fp8_weight(256, 384), e8(2, 3)), x(1, 3, 384)),
        # exactly 16 rows: kernel_rows16 still pads (to 32), so its pad never folds away
        "fp8_m16": (_Fn(fp8_block_linear, _fp8_weight(256, 384), e8(2, 3)), x(4, 4, 384)),
        # 4 experts, blocks naming 2, 0, 2 (a repeat, two never read) as the routed MoE's sel does
        "mxfp4_gathered": (_Fn(mxfp4_linear_gathered, torch.randint(0, 256, (4, 64, 64), generator=G, dtype=torch.uint8),
                               e8(4, 64, 4), extra=(torch.tensor([2, 0, 2]), 0)), x(3, 5, 128)),
    }


def _float64_linear(mod: _Fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, bound): the exact product of the eager-quantized operands and an fp32 summation bound."""
    w, s = mod.params
    if mod.extra:  # gathered: block g reads expert sel[g]
        w, s = w[mod.extra[0]], s[mod.extra[0]]
    if w.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        wf = dequant_fp8_block(w, s)
    else:
        wf = dequant_mxfp4(w, s)
    xq = fp8_act_qdq(x).double()
    wt = wf.double().transpose(-1, -2)
    y = xq @ wt
    k = x.shape[-1]
    bound = k * 2.0**-23 * (xq.abs() @ wt.abs()) + (y.abs() * 2.0**-8 if x.dtype == torch.bfloat16 else 0)
    return y, bound


@pytest.mark.slow  # compiles
@pytest.mark.parametrize("impl", ["kernel", "kernel_fp8", "kernel_f32", "kernel_bf16", "kernel_rows16",
                                  "kernel_small_rows", "kernel_fp8_gemv", "kernel_prefill_bf16"])
def test_quant_linear_kernels_vs_float64(impl, tmp_path):
    cases = _linear_cases()
    if impl in ("kernel_fp8", "kernel_rows16"):  # FP8-only GEMM forms (rows16: padded rows)
        cases = {k: v for k, v in cases.items() if k.startswith("fp8")}
    elif impl == "kernel_small_rows":  # fp8_block_linear only: 3 static rows padded to 8, 10 rows as "kernel"
        cases = {k: cases[k] for k in ("fp8", "fp8_m3")}
    elif impl == "kernel_fp8_gemv":  # one static row reads the FP8 bytes (both formats, both scale dtypes), 3 rows padded
        # e4m3fn's subnormals decode through f32 ones, which llvm-cpu flushes (GPU exports only): here they are
        # the smallest normals; tests/test_kernel_templates.py checks the decode of every code with subnormals
        cases = {**{f"{k}_row": (_normal_codes(cases[k][0]), cases[k][1][:1, :1]) for k in ("fp8", "fp8_fnuz", "fp8_e8m0fnu")},
                 "fp8_m3": cases["fp8_m3"]}
    elif impl == "kernel_prefill_bf16":  # dynamic rows (5, 20) padded to 64 for the bf16 GEMM, both formats and scale dtypes
        cases = {k: cases[k] for k in ("fp8", "fp8_fnuz", "fp8_e8m0fnu", "fp8_fnuz_m20", "fp8_ragged_f32")}
    elif impl in ("kernel_bf16", "kernel_f32"):  # FP8 and MXFP4 forms (the gathered MXFP4 one has neither)
        cases = {k: v for k, v in cases.items() if k in ("mxfp4", "mxfp4_stacked") or k.startswith("fp8")}
    # rows16 pads the rows of the static-row (decode) form: static shapes (10 rows -> 16, 16 and 20 -> 32)
    padded = impl in ("kernel_rows16", "kernel_small_rows", "kernel_fp8_gemv")
    mlir = _export(cases, tmp_path / "lin.mlir", impl, static=tuple(cases) if padded else ())
    if padded or impl == "kernel_prefill_bf16":
        assert "tensor.pad" in mlir.read_text()
    m = IreeModule(compile_mlir(mlir, "llvm-cpu", tmp_path / "lin.vmfb").path, tmp_path / "lin.irpa")
    for name, (mod, x) in cases.items():
        with torch.no_grad():
            want = mod(x).float()
        got = _run(m, name, x)
        y64, bound = _float64_linear(mod, x)
        assert torch.equal(got.isnan(), want.isnan()), name
        ok = ~want.isnan()
        assert ok.float().mean() > 0.5, name  # the planted NaN codes poison only some outputs
        err = (got.double() - y64).abs()[ok]
        assert bool((err <= bound[ok] + 1e-30).all()), f"{name}: max err {float(err.max()):.3g}"


def _grid_rows() -> torch.Tensor:
    """[2, 256] f32: every finite e4m3fn value once (the NaN codes 0x7F/0xFF replaced by +-448), so
    each 128-block's amax is 448 (scale 1); the second row is the first times 2^-10 (scale 2^-10)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[0x7F], codes[0xFF] = 0x7E, 0xFE
    row = codes.view(torch.float8_e4m3fn).float()
    return torch.stack([row, row * 2.0**-10])


@pytest.mark.slow  # compiles
def test_fp8_block_gemm_codes_decode_to_eager_values(tmp_path):
    """The FP8 x FP8 GEMM's activation encoder, both formats: through an identity weight each output is
    one code x its scales, so the kernel's y must equal eager's quantized activation bitwise, for every
    e4m3 grid value (encode -> decode on the matrix-core path is the identity on the grid) and for
    the rounding specials (ties, subnormal bands, +-0, NaN, +-inf, all-zero blocks, near overflow)."""
    eye = torch.eye(256).to(torch.float8_e4m3fn)
    one = torch.full((2, 2), 127, dtype=torch.uint8)  # E8M0 1.0
    eye_nz, one_nz = fp8_fn_to_fnuz(eye, one)
    x = torch.cat([_grid_rows(), _special_rows(256)])[None]  # [1, 11, 256]
    cases = {"fn": (_Fn(fp8_block_linear, eye, one), x), "fnuz": (_Fn(fp8_block_linear, eye_nz, one_nz), x)}
    mlir = _export(cases, tmp_path / "grid.mlir", "kernel_fp8")
    m = IreeModule(compile_mlir(mlir, "llvm-cpu", tmp_path / "grid.vmfb").path, tmp_path / "grid.irpa")
    q = fp8_act_qdq(x)
    assert torch.equal(q[0, :2], x[0, :2])  # the grid rows are their own quantization
    for name, (mod, xx) in cases.items():
        with torch.no_grad():
            want = mod(xx)
        got = _run(m, name, xx)
        assert torch.equal(got[0, :2], x[0, :2]), name  # every grid value comes back (-0 as +0: a sum)
        assert _bitwise(got, want), f"{name}: {int((got != want).sum())} elements differ"
        finite = ~want.isnan().any(-1)  # a NaN poisons its row (NaN x 0 in the other columns)
        assert torch.equal(got[finite], q[finite]), name


def _gfx942_disassembly(vmfb) -> str | None:
    """The vmfb's AMDGPU disassembly (dsv4 inspect's reader); None without llvm-objdump-19."""
    from dsv4.export.inspect import gfx942_disassembly

    try:
        return gfx942_disassembly(vmfb)
    except ValueError as err:
        if "is not installed" in str(err):
            return None
        raise


@pytest.mark.slow  # compiles for two GPU targets
def test_quant_kernels_compile_for_cuda_and_gfx942(tmp_path):
    """cuda gets e4m3fn, gfx942 e4m3fnuz. The FP8 x FP8 GEMM lands on the matrix cores of both (the
    PTX's mma.sync e4m3; gfx942's FP8 MFMA, checked in the ISA when llvm-objdump-19 is installed);
    the f32 GEMM form decodes e4m3fn with integer ops (cuda lowers an f8 extf only where it feeds an
    mma) and converts e4m3fnuz with the hardware instruction; the qdq, Hadamard and Sinkhorn kernels
    compile for both."""
    lin = _linear_cases()
    x3 = _r(2, 5, 256).to(torch.bfloat16)
    common = {
        "fp8_qdq": (_Fn(quant_sim.fp8_qdq, extra=(64,)), x3),
        "fp4_qdq": (_Fn(quant_sim.fp4_qdq, extra=(32,)), x3),
        "hadamard": (_Fn(quant_sim.hadamard), x3[..., :128]),
        "hc_sinkhorn": (_Fn(hc_sinkhorn, torch.ones(3), _r(24), extra=(4, 20, 1e-6)), _r(2, 5, 24)),
        "mxfp4_stacked": lin["mxfp4_stacked"],
        "mxfp4_gathered": lin["mxfp4_gathered"],
    }
    cuda = _export({**common, "fp8": lin["fp8"], "fp8_stacked": lin["fp8_stacked"]}, tmp_path / "cuda.mlir")
    gathered = [GPU_REDUCTION_FLAG]  # what the exporter adds when mxfp4_linear_gathered=kernel is chosen
    res = compile_mlir(cuda, "cuda", tmp_path / "cuda.vmfb", extra_flags=gathered)
    assert {e.gpu_arch for e in vmfb_executables(res.path)} == {"sm_89"}
    ptx = " ".join(t.decode(errors="replace") for t in re.findall(rb"\.version[^\x00]*", res.path.read_bytes()))
    assert "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32" in ptx, "cuda: the FP8 GEMM is not on the tensor cores"
    decode = (lin["fp8_fnuz"][0], lin["fp8_fnuz"][1][:1, :1])  # one static row: the f32 GEMM
    gfx = _export({**common, "fp8_fnuz": lin["fp8_fnuz"], "fp8_fnuz_decode": decode}, tmp_path / "gfx.mlir",
                  static=("fp8_fnuz_decode",))
    res = compile_mlir(gfx, "gfx942", tmp_path / "gfx.vmfb", extra_flags=gathered)
    assert {e.gpu_arch for e in vmfb_executables(res.path)} == {"gfx942"}
    isa = _gfx942_disassembly(res.path)
    if isa is None:  # everything above passed; say what was not checked (-ra lists the reason)
        pytest.skip("the gfx942 ISA checks (hardware fp8 conversion, FP8 MFMA) did not run: llvm-objdump-19 is "
                    "not installed (apt-get install llvm-19; .ci/run installs it)")
    # the f32 GEMM (decode) converts fnuz in hardware; the FP8 GEMM (dynamic rows) is on MFMA
    assert re.search(r"v_cvt_pk_f32_fp8", isa), "gfx942 lost the hardware fp8 conversion"
    assert re.search(r"v_mfma_f32_(16x16x32|32x32x16)_fp8_fp8", isa), "gfx942: the FP8 GEMM is not on the matrix cores"


@pytest.mark.slow  # compiles for two GPU targets
def test_fp8_gemv_reads_the_fp8_bytes_on_both_gpus(tmp_path):
    """kernel_fp8_gemv (a GPU export's decode at batch 1): the one-row GEMV's dispatch reads the FP8 weight,
    1 byte a weight, and nothing writes or reads a decoded copy of it (the other forms' bf16 copy, made at
    load time, is 2 bytes a weight). gfx942 (e4m3fnuz) converts with the hardware instruction and keeps
    nothing in scratch memory; cuda gets e4m3fn. The numerics: test_quant_linear_kernels_vs_float64."""
    from dsv4.export.compile import resolve_target
    from dsv4.export.inspect import executable_sources

    cases = _linear_cases()
    N, K = cases["fp8"][0].params[0].shape
    binding = re.compile(r"dispatch\.tensor<(readonly|writeonly|readwrite):tensor<([0-9x]+)x(\w+)>>")
    for target, case, fp8 in (("gfx942", "fp8_fnuz", "f8E4M3FNUZ"), ("cuda", "fp8", "f8E4M3FN")):
        mod, x = cases[case]
        mlir = _export({"decode": (mod, x[:1, :1])}, tmp_path / f"{target}.mlir", "kernel_fp8_gemv", static=("decode",))
        src = tmp_path / f"{target}.sources.mlir"
        executable_sources(mlir, resolve_target(target).flags, src)
        types = [(acc, int(np.prod([int(d) for d in shape.split("x")])), elem)
                 for acc, shape, elem in binding.findall(src.read_text())]
        assert ("readonly", N * K, fp8) in types, f"{target}: no dispatch reads the FP8 weight: {types}"
        assert not [t for t in types if t[1] == N * K and t[2] in ("bf16", "f32")], f"{target}: a decoded weight copy: {types}"
        res = compile_mlir(mlir, target, tmp_path / f"{target}.vmfb")
        if target == "gfx942" and (isa := _gfx942_disassembly(res.path)) is not None:
            assert "v_cvt_pk_f32_fp8" in isa and "scratch_" not in isa, "gfx942: no hardware fp8 conversion, or scratch"


def test_fp8_linear_gemm_form_follows_the_traced_rows(tmp_path):
    """The default FP8 kernel picks its GEMM by whether the trace knows the rows: any static row count
    (a decode entry point, at every batch size: decode must stay batch-invariant) gets the dequantized
    GEMM (bf16 operands) in its own specialization, a dynamic row count (prefill) the FP8 x FP8 GEMM;
    the stacked kernel's rows count as known only when its E is too (routed blocks have 16 static rows
    each, but a prefill's block count is dynamic); kernel_f32 / kernel_fp8 force one form."""
    from iree.turbine import aot

    w, s = _fp8_weight(256, 256, nan=False), torch.full((2, 2), 120, dtype=torch.uint8)
    ws, ss = torch.stack([w, w]), torch.stack([s, s])
    # "gat": a routed prefill's expert blocks (gathered_linear): 16 static rows per block, the blocks dynamic
    gat = _Fn(lambda x, w, s: gathered_linear(x, w, s, torch.zeros(x.shape[0], dtype=torch.int64)), ws, ss)
    mods = nn.ModuleDict({"lin": _Fn(fp8_block_linear, w, s), "st": _Fn(fp8_block_linear_stacked, ws, ss), "gat": gat})
    aot.externalize_module_parameters(mods, external_scope="model")
    fxb = aot.FxProgramsBuilder(mods)
    T = torch.export.Dim("T", min=2, max=64)
    progs = {  # name -> (module, x, dynamic axis, impl, FP8 form expected)
        "static1": ("lin", torch.zeros(1, 1, 256), None, "kernel", False),
        "static32": ("lin", torch.zeros(4, 8, 256), None, "kernel", False),
        "dynamic": ("lin", torch.zeros(1, 5, 256), 1, "kernel", True),
        "stacked3": ("st", torch.zeros(2, 3, 256), None, "kernel", False),
        "stacked_dyn": ("st", torch.zeros(2, 5, 256), 1, "kernel", True),
        "blocks16": ("gat", torch.zeros(3, 16, 256), None, "kernel", False),  # decode: the block count is static
        "blocks_dyn": ("gat", torch.zeros(3, 16, 256), 0, "kernel", True),  # prefill: it is not
        "forced_fp8": ("lin", torch.zeros(1, 1, 256), None, "kernel_fp8", True),
        "forced_f32": ("lin", torch.zeros(1, 5, 256), 1, "kernel_f32", False),
    }
    for name, (key, x, ax, impl, _) in progs.items():
        with torch.no_grad(), use_kernels({"fp8_block_linear": impl, "fp8_block_linear_stacked": impl}):
            fxb.export_program(lambda m, x, key=key: m[key](x), name=name, args=(x,),
                               dynamic_shapes=None if ax is None else {"x": {ax: T}}, strict=False)
    mlir = tmp_path / "forms.mlir"
    aot.export(fxb, import_symbolic_shape_expressions=False).save_mlir(str(mlir))
    text = mlir.read_text()
    kernels = dict(re.findall(r"util\.func private @(dsv4k_\w+)\((.*?)\n  }\n", text, re.S))
    for name, (*_, fp8) in progs.items():
        public = re.search(rf"func\.func @{name}\(.*?\n  }}\n", text, re.S).group(0)
        called = re.findall(r"call @(dsv4k_\w+)", public)
        assert len(called) == 1, (name, called)
        # the FP8 form's contraction reads f8 codes (extf into it); the f32 form decodes fn bytes by bit ops
        assert bool(re.search(r"arith\.extf %\w+ : f8E4M3FN to f32", kernels[called[0]])) == fp8, (name, called[0])


def test_quantized_decode_graph_holds_kernels_not_their_math():
    """A quantized tiny model's traced decode step: every quantized linear, simulation, Hadamard,
    Sinkhorn is one kernel op; none of the bit decoding or rounding math is left."""
    from collections import Counter

    from iree.turbine import aot

    from dsv4.export.exporter import _Entry, _no_stack_traces, _program
    from dsv4.model.config import ModelConfig
    from dsv4.model.model import Transformer
    from dsv4.model.state import state_spec

    cfg = ModelConfig.preset("tiny")
    model = Transformer(cfg, dtype=torch.bfloat16, quantized=True)
    names = list(state_spec(cfg, 1, torch.bfloat16))
    entry = _Entry(model, names).eval()
    fxb = aot.FxProgramsBuilder(entry)
    state = [torch.zeros(s, dtype=dt) for s, dt in state_spec(cfg, 1, torch.bfloat16).values()]
    i64 = torch.int64
    args = (torch.zeros(1, 1, dtype=i64), torch.zeros(1, dtype=i64), torch.ones(1, dtype=i64),
            torch.zeros(1, dtype=i64), state)
    # the kernels of a Flash-size llvm-cpu export (export/lowering.py: experts read in place)
    with torch.no_grad(), use_kernels({"mxfp4_linear_gathered": "kernel"}), _no_stack_traces():
        ep = fxb.export_program(_program(_Entry.step), name="decode_bs1", args=args, strict=False)
    ops = Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")
    kernels = {k: v for k, v in ops.items() if k.startswith("dsv4k.")}
    n_layers = cfg.n_layers  # the step does not run the MTP block
    csa = sum(cfg.ratio(i) == 4 for i in range(n_layers))
    # wq_b, wo_b, the shared expert's w2 and each CSA layer's indexer wq_b; wq_a + wkv and the shared w1 + w3
    # (each pair one input and one weight shape in tiny) as one stacked GEMM each (layers.linear_pair)
    assert cfg.q_lora_rank == cfg.head_dim
    assert kernels["dsv4k.fp8_block_linear.default"] == 3 * n_layers + csa
    assert kernels["dsv4k.fp8_block_linear_stacked.default"] == 2 * n_layers
    assert kernels["dsv4k.mxfp4_linear_gathered.default"] == 3 * n_layers  # routed experts, read in place
    assert kernels["dsv4k.hc_sinkhorn.default"] == 2 * n_layers
    for op in ("fp8_qdq", "fp4_qdq", "hadamard"):
        assert kernels[f"dsv4k.{op}.default"] >= 1, op
    # tiny's top-ks have at most RANK_MAX_N entries: ranked (topk_rank), no radix_threshold kernel
    assert "dsv4k.radix_threshold.default" not in kernels
    math = [k for k in ops if re.search(r"\.(log2|exp2|round|__rshift__|__lshift__|__and__|__or__)\b", k)]
    assert not math, math


def test_dispatch_validates_before_the_kernel():
    """With the kernels routed (what export traces), a bad scale or K still fails with a message
    naming the problem: the dispatchers check before the hook, the kernel checks nothing."""
    from dsv4.model.kernels.linear import linear, stacked_linear

    x = torch.zeros(1, 3, 256)
    w = torch.zeros(128, 256).to(torch.float8_e4m3fn)
    packed = torch.zeros(2, 64, 128, dtype=torch.uint8)
    with use_kernels({}):
        with pytest.raises(ValueError, match=r"scale shape \(1, 1\) != \(1, 2\)"):
            linear(x, w, torch.zeros(1, 1, dtype=torch.uint8))
        with pytest.raises(ValueError, match="x has K=128"):
            linear(x[..., :128], w, torch.zeros(1, 2, dtype=torch.uint8))
        with pytest.raises(ValueError, match=r"scale shape \(2, 64, 4\) != \(2, 64, 8\)"):
            stacked_linear(torch.zeros(2, 3, 256), packed, torch.zeros(2, 64, 4, dtype=torch.uint8))
        with pytest.raises(ValueError, match="differ in E"):
            stacked_linear(torch.zeros(3, 3, 256), packed, torch.zeros(2, 64, 8, dtype=torch.uint8))
        with pytest.raises(ValueError, match="not a multiple of the block 64"):
            quant_sim.fp8_qdq(torch.zeros(2, 96), 64)


@pytest.mark.slow  # compiles for cuda
def test_cuda_tuning_library_tiles_the_gathered_expert_gemms(tmp_path):
    """export/tuning/cuda.mlir (in every sm_80+ cuda compile's flags) reaches the gathered MXFP4 GEMM of
    `kernel_gemm` over a prefill's 64-row blocks: it gets the library's workgroup tile, not IREE's own
    choice (32 columns: its cuda heuristic); a decode's 16-row blocks keep IREE's. A template change that the
    library's matcher no longer recognises fails here instead of silently losing the measured tile
    (docs/kernels.md)."""
    from dsv4.export.compile import TUNING_FLAG, TUNING_LIBRARIES, resolve_target

    cuda = resolve_target("cuda")
    assert f"{TUNING_FLAG}={TUNING_LIBRARIES['cuda']}" in cuda.flags
    assert not [f for f in resolve_target("cuda:sm_75").flags if f.startswith(TUNING_FLAG)]  # no bf16 mma.sync
    assert not [f for f in resolve_target("llvm-cpu").flags if f.startswith(TUNING_FLAG)]
    library = open(TUNING_LIBRARIES["cuda"]).read()
    E, N, K = 4, 256, 512
    packed = torch.randint(0, 256, (E, N, K // 2), generator=G, dtype=torch.uint8)
    scales = torch.full((E, N, K // 32), 127, dtype=torch.uint8)
    sel = torch.tensor([2, 0, 3])
    mods = {f"rows{m}": (_Fn(lambda x, p, s: mxfp4_linear_gathered(x, p, s, sel, 0), packed, scales),
                         torch.randn(3, m, K, generator=G).to(torch.bfloat16)) for m in (16, 64)}
    mlir = _export(mods, tmp_path / "gathered.mlir", "kernel_gemm", static=tuple(mods))
    dump = tmp_path / "configs"
    compile_mlir(mlir, cuda, tmp_path / "gathered.vmfb", extra_flags=[f"--iree-hal-dump-executable-configurations-to={dump}"])
    tiles = {re.search(r"workgroup = \[([^\]]*)\]", f.read_text()).group(1)
             for f in dump.iterdir() if "NV_MMA_SYNC" in f.read_text()}
    tile = re.search(r"@match_gathered_mxfp4_rows64\(.*?workgroup = \[([^\]]*)\]", library, re.S).group(1)
    assert tile.startswith("1, 64, ") and tile in tiles, f"64-row blocks: library tile {tile}, compiled {tiles}"
    assert [t for t in tiles if t.startswith("1, 16, ")], f"16-row blocks (IREE's tile) not compiled: {tiles}"


@pytest.mark.slow  # compiles for two GPU targets
@pytest.mark.parametrize("target", ["cuda", "gfx942"])
def test_tuning_libraries_tile_the_one_row_gathered_gemv(tmp_path, target):
    """The one-row gathered MXFP4 GEMV (`kernel_gemm` at M = 1: decode at batch 1 to 4) gets its tuning
    library's config on both GPU targets: without it IREE roots the dispatch at the fused gather and gives
    it one thread a row (docs/kernels.md, The routed MoE). Checked in the compiled configuration: the
    library's workgroup size and subgroup size, and the expert bytes read 16 to a lane (one 16-byte vector
    load in the lowered code)."""
    from dsv4.export.compile import TUNING_FLAG, TUNING_LIBRARIES, resolve_target

    tgt = resolve_target(target)
    assert f"{TUNING_FLAG}={TUNING_LIBRARIES[target]}" in tgt.flags
    library = open(TUNING_LIBRARIES[target]).read()
    want = re.search(r"@match_gathered_mxfp4_gemv\(.*?workgroup_size = \[([^\]]*)\] subgroup_size = (\d+)", library, re.S)
    E, N, K = 4, 64, 256
    packed = torch.randint(0, 256, (E, N, K // 2), generator=G, dtype=torch.uint8)
    scales = torch.full((E, N, K // 32), 127, dtype=torch.uint8)
    # sel computed from the input (always [2, 0, 3]): a constant sel over constant weights is a gather IREE
    # evaluates once at load time
    sel = lambda x: torch.tensor([2, 0, 3]) + (x[:, 0, 0] > 1e30).to(torch.int64)  # noqa: E731
    mods = {"one_row": (_Fn(lambda x, p, s: mxfp4_linear_gathered(x, p, s, sel(x), 0), packed, scales),
                        torch.randn(3, 1, K, generator=G).to(torch.bfloat16))}
    mlir = _export(mods, tmp_path / "gemv.mlir", "kernel_gemm", static=tuple(mods))
    dump, code = tmp_path / "configs", tmp_path / "code"
    code_flag = "binaries" if target == "cuda" else "intermediates"  # the PTX; gfx942's assembly
    compile_mlir(mlir, tgt, tmp_path / "gemv.vmfb", extra_flags=[f"--iree-hal-dump-executable-configurations-to={dump}",
                                                                  f"--iree-hal-dump-executable-{code_flag}-to={code}"])
    gathers = [f.read_text() for f in dump.iterdir() if "iree_linalg_ext.gather" in f.read_text()]
    assert len(gathers) == 1, f"{len(gathers)} dispatches hold the gather"
    got = re.search(r"VectorDistribute> workgroup_size = \[([^\]]*)\] subgroup_size = (\d+)", gathers[0])
    assert got and got.groups() == want.groups(), f"library config {want.groups()}, compiled {got and got.groups()}"
    asm = "".join(f.read_text() for f in code.iterdir() if f.suffix in (".ptx", ".rocmasm") and "gather" in f.read_text())
    assert re.search(r"ld\.global\.nc\.v4\.b32|buffer_load_dwordx4|global_load_dwordx4", asm), "no 16-byte loads"
