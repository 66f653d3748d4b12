"""Every MLIR kernel template (model/kernels/*.mlir.jinja) compiled for llvm-cpu at a small shape and
run through iree.runtime against a float64 reference written here from the formats' definitions
(numpy, and torch's own float8 casts), not from the code under test. Fast: one small module per
template, compiled through conftest's `kernel_compile` (the slow rule's one allowance: a few
seconds each, cached under .cache/kernels/ by the rendered MLIR and the compiler version).

The weights have 2-D, asymmetric power-of-two scale grids (FP8: 256x256 in 128x128 blocks, MXFP4:
one scale per 32) with random exponents, so a wrong constant in a decode (e.g. the E8M0 bias, the
E2M1 exponent bias, a nibble order, a transposed block grid) moves results by factors of two."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import dsv4.export  # noqa: F401  (the compat shim turbine needs)
from dsv4.export.kernel_op import use_kernels
from dsv4.model.kernels.indexer import indexer_scores
from dsv4.model.kernels.linear import (
    f32_linear,
    fp8_block_linear,
    fp8_block_linear_shared,
    fp8_block_linear_stacked,
    grouped_linear,
    mxfp4_linear,
    mxfp4_linear_gathered,
    mxfp4_linear_stacked,
)
from dsv4.model.kernels.mhc import hc_sinkhorn
from dsv4.model.kernels.moe import mxfp4_swiglu_gathered
from dsv4.model.kernels.norm import rms_norm
from dsv4.model.kernels.qdq import fp4_qdq, fp8_qdq, hadamard
from dsv4.model.kernels.sparse_attention import sparse_attention, sparse_attention_rows
from dsv4.model.kernels.topk import pair_rank, radix_threshold
from dsv4.runtime.module import IreeModule, ensure_runtime_flags

ensure_runtime_flags()
RNG = np.random.default_rng(47)
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # E2M1 magnitudes by code (OCP MX spec)


# ---- the independent float64 references ----------------------------------------------------------

def pow2_ceil(r: np.ndarray) -> np.ndarray:
    """2^ceil(log2(r)) exactly, for positive float32 ratios (frexp: r = m 2^e, m in [0.5, 1))."""
    m, e = np.frexp(r.astype(np.float64))
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e))


def e4m3(v: np.ndarray) -> np.ndarray:
    """Round to the e4m3fn grid (RNE) with torch's cast; v is exact in float32 and within +-448."""
    return torch.from_numpy(v.astype(np.float32)).to(torch.float8_e4m3fn).double().numpy()


def e2m1(v: np.ndarray) -> np.ndarray:
    """Round to the E2M1 grid, ties to the even code, saturating at 6."""
    a = np.minimum(np.abs(v), 6.0)
    d = np.abs(a[..., None] - GRID)
    tie_rank = np.where(d == d.min(-1, keepdims=True), np.arange(8) % 2, 2)  # nearest, even code first
    return np.copysign(GRID[tie_rank.argmin(-1)], v)


def block_qdq(x: np.ndarray, block: int, fp4: bool) -> np.ndarray:
    """Per-`block` quantize->dequantize of the last dim: s = 2^ceil(log2(max(amax, floor) / fmax)) with the
    ratio in float32, round(x / s) on the grid, times s (docs/model.md, Reference numerics's act_quant)."""
    fmax, floor = (6.0, 6.0 * 2.0**-126) if fp4 else (448.0, 1e-4)
    xb = x.reshape(*x.shape[:-1], -1, block).astype(np.float64)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), np.float32(floor))
    s = pow2_ceil(amax.astype(np.float32) / np.float32(fmax))
    q = e2m1(xb / s) if fp4 else e4m3(xb / s)
    return (q * s).reshape(x.shape)


def fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """An e4m3fn weight [n, k] (no NaN codes), its 128x128 E8M0 scale grid with distinct random exponents,
    and the dequantized float64 weight: code value x 2^(scale - 127) per block."""
    w = torch.from_numpy(np.clip(RNG.standard_normal((n, k)) * 60, -448, 448).astype(np.float32)).to(torch.float8_e4m3fn)
    nb, kb = math.ceil(n / 128), math.ceil(k / 128)
    sc = RNG.permutation(np.arange(114, 114 + nb * kb)).reshape(nb, kb).astype(np.uint8)
    full = np.kron(np.ldexp(1.0, sc.astype(np.int64) - 127), np.ones((128, 128)))[:n, :k]
    return w, torch.from_numpy(sc), w.double().numpy() * full


def mxfp4_weight(n: int, k: int, skip: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Packed MXFP4 [n, k/2] (element 2i in the low nibble; every code but `skip`), E8M0 scales [n, k/32]
    (random exponents, one of them 0 = 2^-127), and the dequantized float64 weight."""
    codes = RNG.choice(np.setdiff1d(np.arange(16), skip), (n, k))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    sc = RNG.integers(116, 136, (n, k // 32)).astype(np.uint8)
    sc[0, 0] = 0
    vals = np.where(codes & 8, -1.0, 1.0) * GRID[codes & 7]
    return (torch.from_numpy(packed), torch.from_numpy(sc),
            vals * np.repeat(np.ldexp(1.0, sc.astype(np.int64) - 127), 32, axis=1))


def sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def assert_sum_close(got: np.ndarray, want: np.ndarray, mag: np.ndarray, what: str, rtol: float = 4e-5) -> None:
    """Within fp32 summation error: |got - want| <= rtol * sum |products| (mag), elementwise."""
    err = np.abs(got.astype(np.float64) - want)
    bad = err > rtol * mag + 1e-30
    assert not bad.any(), f"{what}: {int(bad.sum())}/{bad.size} off, worst {float((err / (mag + 1e-30)).max()):.3g} x |sum|"


# ---- one small module per template -----------------------------------------------------------------

class _Case(nn.Module):
    def __init__(self, fn, params: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.fn = fn
        self.params = nn.ParameterList([nn.Parameter(p, requires_grad=False) for p in params])

    def forward(self, *inputs):
        return self.fn(*inputs, *self.params)


def build(cases: dict, kernel_compile, tmp_path, tag: str):
    """cases: name -> (fn(*inputs, *params), params, inputs, {op: impl}). Traces one entry point per
    case with static shapes, compiles the module (cached) and returns name -> outputs as numpy."""
    from iree.turbine import aot

    holder = nn.ModuleDict({k: _Case(fn, params) for k, (fn, params, _, _) in cases.items()})
    aot.externalize_module_parameters(holder, external_scope="model")
    irpa = tmp_path / f"{tag}.irpa"
    aot.save_module_parameters(irpa, holder)
    fxb = aot.FxProgramsBuilder(holder)

    def entry(k):
        return lambda m, *xs: m[k](*xs)

    with torch.no_grad():
        for k, (_, _, inputs, choice) in cases.items():
            with use_kernels(choice):
                ep = fxb.export_program(entry(k), name=k, args=tuple(inputs), strict=False)
            ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
            assert any(o.startswith("dsv4k.") for o in ops), (k, sorted(ops))  # the kernel, not the reference
    mlir = str(aot.export(fxb, import_symbolic_shape_expressions=False).mlir_module)
    mod = IreeModule(kernel_compile(mlir, tag), irpa)
    return {k: [np.asarray(r) for r in (lambda o: o if isinstance(o, (list, tuple)) else [o])(
        mod(k, *[t.numpy() for t in inputs]))] for k, (_, _, inputs, _) in cases.items()}


def test_divide_macro_is_division_bitwise(kernel_compile, tmp_path) -> None:
    """rows.mlir.jinja's reciprocal + divide (hc_sinkhorn's divisions) equal f32 division bit for bit: quotients
    of every magnitude from 2^-62 to 2^62, divisors with all-ones and all-zeros significands, Sinkhorn-like
    sums of four values in [0, 1] plus eps."""
    from pathlib import Path

    from dsv4.export.kernel_op import _render_jinja
    from dsv4.model import kernels

    n = 1 << 20
    macros = (Path(kernels.__file__).parent / "rows.mlir.jinja").read_text()
    body = """{{ reciprocal("%r", "%b") }}{{ divide("%q", "%a", "%r") }}"""
    fn = f"""
func.func @main(%x: tensor<{n}xf32>, %d: tensor<{n}xf32>) -> tensor<{n}xf32> {{
  %one = arith.constant 1.0 : f32
  %e = tensor.empty() : tensor<{n}xf32>
  %y = linalg.generic {{indexing_maps = [affine_map<(i) -> (i)>, affine_map<(i) -> (i)>, affine_map<(i) -> (i)>],
      iterator_types = ["parallel"]}} ins(%x, %d : tensor<{n}xf32>, tensor<{n}xf32>) outs(%e : tensor<{n}xf32>) {{
    ^bb0(%a: f32, %b: f32, %o: f32):{body}
      linalg.yield %q : f32
  }} -> tensor<{n}xf32>
  return %y : tensor<{n}xf32>
}}"""
    mod = IreeModule(kernel_compile(_render_jinja(macros + fn, {}), "divide-macro"))
    q = n // 4
    bits = lambda lo, hi: RNG.integers(lo, hi, q, dtype=np.uint32).view(np.float32)  # noqa: E731
    ones = np.float32(1) + RNG.integers(-64, 64, q).astype(np.float32) * np.float32(2**-24)  # 1 +- a few ulps
    x = np.concatenate([bits(0x30000000, 0x4F000000), RNG.random(q, dtype=np.float32),
                        RNG.random(q, dtype=np.float32), RNG.random(q, dtype=np.float32) + np.float32(1e-6)])
    d = np.concatenate([bits(0x30000000, 0x4F000000), ones * np.ldexp(np.float32(1), RNG.integers(-3, 4, q)).astype(np.float32),
                        np.float32(0.999999940) - RNG.integers(0, 8, q).astype(np.float32) * np.float32(2**-24),
                        RNG.random((q, 4), dtype=np.float32).sum(-1, dtype=np.float32) + np.float32(1e-6)])
    got = np.asarray(mod("main", x, d))
    want = x / d  # numpy's float32 division: IEEE, correctly rounded
    bad = got.view(np.uint32) != want.view(np.uint32)
    assert not bad.any(), f"{int(bad.sum())} of {n} quotients differ, e.g. {x[bad][:3]} / {d[bad][:3]}"


def test_quant_template_qdq_and_hadamard(kernel_compile, tmp_path) -> None:
    x = torch.from_numpy((RNG.standard_normal((1, 2, 3, 128)) * np.logspace(-5, 2, 128)).astype(np.float32))
    x[0, 0, 0, :64] = 0.0  # an all-zero block: the amax floor
    x[0, 1, 1, :] = torch.from_numpy(np.ldexp(1.0, RNG.integers(-12, 6, 128)).astype(np.float32))  # powers of two
    out = build({
        "fp8": (lambda x: fp8_qdq(x, 64), (), [x], {"fp8_qdq": "kernel"}),
        "fp4": (lambda x: fp4_qdq(x, 32), (), [x], {"fp4_qdq": "kernel"}),
        "had": (hadamard, (), [x], {"hadamard": "kernel"}),
    }, kernel_compile, tmp_path, "quant-qdq")
    xn = x.double().numpy()
    np.testing.assert_array_equal(out["fp8"][0], block_qdq(xn, 64, fp4=False), err_msg="fp8_qdq")
    np.testing.assert_array_equal(out["fp4"][0], block_qdq(xn, 32, fp4=True), err_msg="fp4_qdq")
    h = sylvester(128)
    assert_sum_close(out["had"][0], xn @ h, np.abs(xn) @ np.abs(h), "hadamard")
    # the kernel adds in the butterflies' order: the eager reference's values bit for bit
    np.testing.assert_array_equal(out["had"][0], hadamard(x).numpy(), err_msg="hadamard vs eager")


@pytest.mark.parametrize("D", [2, 128, 512])
def test_hadamard_template_generics_stay_small(D: int) -> None:
    """The Hadamard kernel runs at most 4 butterfly stages per generic (reading 16 values an element):
    one generic for all 7 stages of D = 128 (128 gathers and 381 ops an element) cost llvm-cpu ~10 s of
    compile per dispatch (docs/export.md). Rendered only, no compile."""
    from dsv4.export.kernel_op import render_mlir
    from dsv4.model.kernels import KERNELS

    t = f"tensor<?x?x?x{D}xbf16>"
    text = render_mlir(KERNELS["hadamard"], dict(x_type=t, x_dtype="bf16", y_type=t, y_dtype="bf16", D=D,
                                                 kernel_name="h", op="hadamard"))
    bodies = [g.split("} ->")[0] for g in text.split("linalg.generic")[1:]]
    stages = D.bit_length() - 1
    n = -(-stages // 4)
    sizes = [stages * (i + 1) // n - stages * i // n for i in range(n)]  # stages per generic, at most 4
    assert len(bodies) == n
    # 2^a values read and 2^a - 1 butterfly pairs (an add, a subtract, a select each) an element
    assert [b.count("tensor.extract ") for b in bodies] == [2**a for a in sizes]
    assert [b.count("arith.subf") for b in bodies] == [2**a - 1 for a in sizes]


@pytest.mark.parametrize("form", ["kernel", "kernel_f32", "kernel_bf16", "kernel_fp8", "kernel_rows16",
                                  "kernel_small_rows", "kernel_fp8_gemv", "kernel_prefill_bf16"])
def test_quant_template_fp8_linear(kernel_compile, tmp_path, form: str) -> None:
    w, s, wd = fp8_weight(256, 256)
    ws, ss, wsd = zip(*[fp8_weight(256, 256) for _ in range(2)])
    x = torch.from_numpy(RNG.standard_normal((3, 256)).astype(np.float32))
    xs = torch.from_numpy(RNG.standard_normal((2, 3, 256)).astype(np.float32))
    # every code but NaN, each in rows 0..127; rows 128..255 hold only subnormals and zeros (+-0 .. +-7 x 2^-9),
    # so a wrong decode of them is not lost in the rounding of a sum over the large codes
    c = RNG.permuted(np.tile(np.r_[0:127, 128:255, 0, 128], (128, 1)), axis=1)
    c = np.concatenate([c, RNG.choice(np.r_[0:8, 128:136], (128, 256))]).astype(np.uint8)
    if form == "kernel_fp8_gemv":  # it decodes e4m3fn subnormals through f32 ones, which llvm-cpu flushes: here
        # they become the smallest normals (+-8 .. +-15 x 2^-9); test_e4m3fn_f32_subnormal_is_exact_with_subnormals
        c = np.where(((c & 0x78) == 0) & ((c & 7) != 0), c | 8, c).astype(np.uint8)
    wc = torch.from_numpy(c).view(torch.float8_e4m3fn)
    wcd = wc.double().numpy() * np.kron(np.ldexp(1.0, s.numpy().astype(np.int64) - 127), np.ones((128, 128)))
    cases = {"lin": (fp8_block_linear, (w, s), [x], {"fp8_block_linear": form}),
             # one row: the decode GEMV (a matvec in the "kernel" form)
             "lin1": (fp8_block_linear, (w, s), [x[:1]], {"fp8_block_linear": form}),
             "codes1": (fp8_block_linear, (wc, s), [x[:1]], {"fp8_block_linear": form})}
    if form in ("kernel", "kernel_fp8"):
        cases["stacked"] = (fp8_block_linear_stacked, (torch.stack(ws), torch.stack(ss)), [xs],
                            {"fp8_block_linear_stacked": form})
    if form in ("kernel", "kernel_fp8_gemv"):  # one x for both weights (the shared expert's w1 and w3 at decode)
        for name, rows in (("shared", x), ("shared1", x[:1])):
            cases[name] = (fp8_block_linear_shared, (torch.stack(ws), torch.stack(ss)), [rows],
                           {"fp8_block_linear_shared": form})
    out = build(cases, kernel_compile, tmp_path, f"quant-fp8-{form}")
    xq = block_qdq(x.double().numpy(), 128, fp4=False)
    assert_sum_close(out["lin"][0], xq @ wd.T, np.abs(xq) @ np.abs(wd).T, f"fp8_block_linear[{form}]")
    assert out["lin1"][0].shape == (1, 256)
    assert_sum_close(out["lin1"][0], xq[:1] @ wd.T, np.abs(xq[:1]) @ np.abs(wd).T, f"fp8_block_linear[{form}], one row")
    assert_sum_close(out["codes1"][0], xq[:1] @ wcd.T, np.abs(xq[:1]) @ np.abs(wcd).T, f"fp8_block_linear[{form}], every code")
    if "stacked" in out:
        for e in range(2):
            xq = block_qdq(xs[e].double().numpy(), 128, fp4=False)
            assert_sum_close(out["stacked"][0][e], xq @ wsd[e].T, np.abs(xq) @ np.abs(wsd[e]).T,
                             f"fp8_block_linear_stacked[{form}][{e}]")
    xq = block_qdq(x.double().numpy(), 128, fp4=False)
    for name, n in (("shared", 3), ("shared1", 1)):
        if name in out:
            assert out[name][0].shape == (2, n, 256)
            for e in range(2):
                assert_sum_close(out[name][0][e], xq[:n] @ wsd[e].T, np.abs(xq[:n]) @ np.abs(wsd[e]).T,
                                 f"fp8_block_linear_shared[{e}], {n} rows")


def test_e2m1_f32_subnormal_is_exact_with_subnormals() -> None:
    """quant.mlir.jinja's e2m1_scaled_f32 (kernel_gemm's one-row decode) and e2m1_scaled_bf16 (its row blocks'):
    code x (2^22 + 2^28) & 0x81C00000 read as f32 (e2m1_f32_subnormal), times 2^126, is every E2M1 code's value
    where subnormals are kept (numpy; the GPUs); times every E8M0 scale it is the exact float64 product (f32),
    and that cut to bf16 by its top 16 bits is the product rounded to bf16."""
    import re

    import ml_dtypes

    from dsv4.model.kernels import KERNELS

    text = KERNELS["mxfp4_linear_gathered"].mlir_template()
    macro = re.search(r"macro e2m1_f32_subnormal.*?endmacro", text, re.S).group(0)
    k, mask = (np.int64(re.search(rf"_{n} = arith.constant (-?\d+) : i32", macro).group(1)).astype(np.uint32)
               for n in ("k", "mask"))
    assert (k, mask) == (0x10400000, 0x81C00000)  # the sign to bit 31, the magnitude to bits 22..24
    scaled = re.search(r"macro e2m1_scaled_f32.*?endmacro", text, re.S).group(0)
    assert "_two126 = arith.constant 0x7E800000 : f32" in scaled
    cut = re.search(r"macro e2m1_scaled_bf16.*?endmacro", text, re.S).group(0)
    assert "e2m1_scaled_f32(" in cut and "_k16 = arith.constant 16 : i32" in cut
    codes = np.arange(16, dtype=np.uint32)
    v = ((codes * k) & mask).view(np.float32) * np.float32(2.0 ** 126)
    want = np.where(codes & 8, -1.0, 1.0) * GRID[codes & 7]
    assert (v.astype(np.float64) == want).all() and (np.signbit(v) == (codes >= 8)).all()
    s = np.arange(255)
    scale = np.ldexp(np.float32(1.0), s - 127).astype(np.float32)  # 2^-127 is an f32 subnormal
    with np.errstate(over="ignore"):
        prod = v[:, None] * scale[None, :]
        exact = want[:, None] * np.ldexp(1.0, s - 127)[None, :]
        finite = np.isfinite(exact.astype(np.float32))  # inf past f32's range, as the f32 product
    assert (prod.astype(np.float64)[finite] == exact[finite]).all() and np.isinf(prod[~finite]).all()
    got = (prod.view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)
    with np.errstate(over="ignore"):  # inf past bf16's range, as the f32 product
        ref = (want[:, None] * np.ldexp(1.0, s - 127)[None, :]).astype(ml_dtypes.bfloat16)
    assert (got.view(np.uint16) == ref.view(np.uint16)).all()


def test_e4m3fn_f32_subnormal_is_exact_with_subnormals() -> None:
    """quant.mlir.jinja's e4m3fn_f32_subnormal (kernel_fp8_gemv's decode): the sign-extended byte shifted by 20
    and masked with 0x87F00000, read as f32, times 2^120, is every finite e4m3fn code's value where subnormals
    are kept (numpy; the GPUs), subnormals and -0 included; the NaN codes (0x7F, 0xFF) read +-480, which the
    GEMV replaces by NaN; times every E8M0 scale it is the exact float64 product (f32)."""
    import re

    import ml_dtypes

    from dsv4.model.kernels import KERNELS

    text = KERNELS["fp8_block_linear"].mlir_template()
    macro = re.search(r"macro e4m3fn_f32_subnormal.*?endmacro", text, re.S).group(0)
    shift, mask = (int(re.search(rf"_{n} = arith.constant (-?\d+) : i32", macro).group(1)) for n in ("k20", "mask"))
    assert (shift, mask & 0xFFFFFFFF) == (20, 0x87F00000) and "arith.extsi" in macro
    assert "%_two120 = arith.constant 0x7B800000 : f32" in text and "%_w480 = arith.constant 480.0 : f32" in text
    codes = np.arange(256, dtype=np.uint8)
    bits = (codes.view(np.int8).astype(np.int32) << shift) & np.int32(mask)
    v = bits.view(np.float32) * np.float32(2.0 ** 120)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    nan = (codes & 0x7F) == 0x7F
    assert np.isnan(want[nan]).all() and (np.abs(v[nan]) == 480).all() and (np.abs(v[~nan]) != 480).all()
    assert (v[~nan].astype(np.float64) == want[~nan]).all() and (np.signbit(v) == (codes >= 128)).all()
    assert (v[(codes & 0x78) == 0] != 0).sum() == 14  # the subnormals, read as such
    s = np.arange(255)
    scale = np.ldexp(np.float32(1.0), s - 127).astype(np.float32)  # 2^-127 is an f32 subnormal
    with np.errstate(over="ignore"):
        prod = v[~nan][:, None] * scale[None, :]
        exact = want[~nan][:, None] * np.ldexp(1.0, s - 127)[None, :]
        finite = np.isfinite(exact.astype(np.float32))  # inf past f32's range, as the f32 product
    assert (prod.astype(np.float64)[finite] == exact[finite]).all() and np.isinf(prod[~finite]).all()


@pytest.mark.parametrize("form", ["kernel", "kernel_f32"])
def test_quant_template_mxfp4_linear(kernel_compile, tmp_path, form: str) -> None:
    p, s, wd = mxfp4_weight(64, 256)
    ps, ss, wsd = zip(*[mxfp4_weight(64, 256) for _ in range(2)])
    x = torch.from_numpy(RNG.standard_normal((3, 256)).astype(np.float32))
    xs = torch.from_numpy(RNG.standard_normal((2, 3, 256)).astype(np.float32))
    xg = torch.from_numpy(RNG.standard_normal((3, 2, 256)).astype(np.float32))
    gate = torch.from_numpy(2 * RNG.standard_normal((3, 2, 64)).astype(np.float32))
    rw = torch.from_numpy(RNG.random((3, 2)).astype(np.float32))
    sel = torch.tensor([1, 0, 1])
    cases = {"lin": (mxfp4_linear, (p, s), [x], {"mxfp4_linear": form}),
             "stacked": (mxfp4_linear_stacked, (torch.stack(ps), torch.stack(ss)), [xs], {"mxfp4_linear_stacked": form}),
             # one row per expert (decode's gathered pairs: a batch matvec in the bf16 form)
             "stacked1": (mxfp4_linear_stacked, (torch.stack(ps), torch.stack(ss)), [xs[:, :1]],
                          {"mxfp4_linear_stacked": form})}
    # kernel_gemm's decode (GPU exports only, export/lowering.py gpu_only) passes each code through an f32
    # subnormal, which IREE's llvm-cpu runtime flushes: its weights here skip codes +-0.5 (1, 9), which the
    # construction's own test covers (test_e2m1_f32_subnormal_is_exact_with_subnormals)
    gps, gss, gwsd = zip(*[mxfp4_weight(64, 256, skip=(1, 9)) for _ in range(2)])
    if form == "kernel":
        gathered = lambda x, sel, p, s: mxfp4_linear_gathered(x, p, s, sel, 0)  # noqa: E731
        ws, wg = (torch.stack(ps), torch.stack(ss)), (torch.stack(gps), torch.stack(gss))
        cases["gathered"] = (gathered, ws, [xg, sel], {"mxfp4_linear_gathered": "kernel"})
        # the gather inside the GEMM's dispatch: row blocks (a batch matmul) and one row a block (a batch matvec)
        cases["gathered_gemm"] = (gathered, wg, [xg, sel], {"mxfp4_linear_gathered": "kernel_gemm"})
        cases["gathered_gemm1"] = (gathered, wg, [xg[:, :1], sel], {"mxfp4_linear_gathered": "kernel_gemm"})
        # x_quantized: x handed over on the FP8 grid (the routed MoE's tokens, quantized once), both GEMM
        # forms; the kernel uses it as it is
        quantized = lambda x, sel, p, s: mxfp4_linear_gathered(x, p, s, sel, 1)  # noqa: E731
        xgq = torch.from_numpy(block_qdq(xg.double().numpy(), 128, fp4=False)).float()
        cases["quantized"] = (quantized, ws, [xgq, sel], {"mxfp4_linear_gathered": "kernel"})
        cases["quantized_gemm"] = (quantized, wg, [xgq, sel], {"mxfp4_linear_gathered": "kernel_gemm"})
        # off the grid, to show that the kernel takes x as it is (the attribute's promise is the caller's)
        cases["unquantized_gemm"] = (quantized, wg, [xg, sel], {"mxfp4_linear_gathered": "kernel_gemm"})
        # the up projection with the routed SwiGLU as its epilogue (both clamps bind at 1.5)
        swiglu = lambda x, gt, rw, sel, p, s: mxfp4_swiglu_gathered(x, gt, rw, p, s, sel, 1.5, 0)  # noqa: E731
        cases["swiglu"] = (swiglu, wg, [xg, gate, rw, sel], {"mxfp4_swiglu_gathered": "kernel"})
        # one row a block: the decode's GEMV reads the experts in place
        cases["swiglu1"] = (swiglu, wg, [xg[:, :1], gate[:, :1], rw[:, :1], sel], {"mxfp4_swiglu_gathered": "kernel"})
    out = build(cases, kernel_compile, tmp_path, f"quant-mxfp4-{form}")

    def check(got, xin, w, what):
        xq = block_qdq(xin.double().numpy(), 128, fp4=False)
        assert_sum_close(got, xq @ w.T, np.abs(xq) @ np.abs(w).T, what)

    check(out["lin"][0], x, wd, f"mxfp4_linear[{form}]")
    for e in range(2):
        check(out["stacked"][0][e], xs[e], wsd[e], f"mxfp4_linear_stacked[{form}][{e}]")
        assert out["stacked1"][0][e].shape == (1, 64)
        check(out["stacked1"][0][e], xs[e, :1], wsd[e], f"mxfp4_linear_stacked[{form}][{e}], one row")
    if "gathered" in out:
        for g in range(3):
            w, wg1 = wsd[int(sel[g])], gwsd[int(sel[g])]
            check(out["gathered"][0][g], xg[g], w, f"mxfp4_linear_gathered[{g}]")
            check(out["gathered_gemm"][0][g], xg[g], wg1, f"mxfp4_linear_gathered[kernel_gemm][{g}]")
            assert out["gathered_gemm1"][0][g].shape == (1, 64)
            check(out["gathered_gemm1"][0][g], xg[g, :1], wg1, f"mxfp4_linear_gathered[kernel_gemm][{g}], one row")
            # x on the grid: the same float64 reference (block_qdq of block_qdq(x) is block_qdq(x))
            check(out["quantized"][0][g], xg[g], w, f"mxfp4_linear_gathered[{g}], x_quantized")
            check(out["quantized_gemm"][0][g], xg[g], wg1, f"mxfp4_linear_gathered[kernel_gemm][{g}], x_quantized")
            xr = xg[g].double().numpy()
            assert_sum_close(out["unquantized_gemm"][0][g], xr @ wg1.T, np.abs(xr) @ np.abs(wg1).T,
                             f"mxfp4_linear_gathered[kernel_gemm][{g}], x_quantized, x off the grid",
                             rtol=2 ** -8)  # x rounded to the GEMM's bf16 operands; e4m3's grid is 16x coarser
            for name, rows in (("swiglu", 2), ("swiglu1", 1)):
                # float64 SwiGLU of the float64 product: u's fp32 sum error times |silu(g) w|, plus the epilogue's roundings
                xq = block_qdq(xg[g, :rows].double().numpy(), 128, fp4=False)
                u, gt, lim = xq @ wg1.T, gate[g, :rows].double().numpy(), 1.5
                sg = np.minimum(gt, lim)
                silu_w = sg / (1 + np.exp(-sg)) * rw[g, :rows].double().numpy()[:, None]
                want = silu_w * np.clip(u, -lim, lim)
                got = out[name][0][g]
                assert got.shape == (rows, 64)
                err = np.abs(got.astype(np.float64) - want)
                assert (err <= 4e-5 * np.abs(silu_w) * (np.abs(xq) @ np.abs(wg1).T) + 2e-6 * np.abs(want) + 1e-30).all(), \
                    f"mxfp4_swiglu_gathered[{g}], {rows} rows: worst {float(err.max()):.3g}"


def test_dense_grouped_indexer_templates(kernel_compile, tmp_path) -> None:
    x = torch.from_numpy(RNG.standard_normal((3, 64)).astype(np.float32))
    w = torch.from_numpy(RNG.standard_normal((32, 64)).astype(np.float32))
    ws = torch.from_numpy(RNG.standard_normal((24, 64)).astype(np.float32))  # full 24-bit significands
    xg = torch.from_numpy(RNG.standard_normal((3, 2, 64)).astype(np.float32))
    wg = torch.from_numpy(RNG.standard_normal((2, 16, 64)).astype(np.float32))
    q = torch.from_numpy(RNG.standard_normal((1, 3, 4, 32)).astype(np.float32))
    iw = torch.from_numpy(RNG.standard_normal((1, 3, 4)).astype(np.float32))
    keys = torch.from_numpy(RNG.standard_normal((1, 16, 32)).astype(np.float32))
    xk = torch.from_numpy(RNG.standard_normal((3, 8192)).astype(np.float32))
    wk = torch.from_numpy(RNG.standard_normal((24, 8192)).astype(np.float32))
    out = build({
        "dense": (f32_linear, (w,), [x], {"f32_linear": "kernel"}),
        "dense16": (f32_linear, (w,), [x], {"f32_linear": "kernel_rows16"}),
        # 3 static rows: padded to 8 (the GPU-only form)
        "dense_small": (f32_linear, (w,), [x], {"f32_linear": "kernel_small_rows"}),
        # one row (a GEMV): the plain GEMM and the three-term split
        "dense1": (f32_linear, (w,), [x[:1]], {"f32_linear": "kernel"}),
        "split1": (lambda x, w: f32_linear(x.bfloat16(), w), (ws,), [x[:1]], {"f32_linear": "kernel"}),
        "grouped_small": (grouped_linear, (wg,), [xg], {"grouped_linear": "kernel_small_rows"}),
        "grouped1": (grouped_linear, (wg,), [xg[:1]], {"grouped_linear": "kernel"}),  # one row: a batch matvec
        # a bf16 activation and an f32 weight: the three-bf16-term split, its 3 x 24 = 72 rows padded to 80
        "split": (lambda x, w: f32_linear(x.bfloat16(), w), (ws,), [x], {"f32_linear": "kernel"}),
        "grouped": (grouped_linear, (wg,), [xg], {"grouped_linear": "kernel"}),
        # K = 8192 (the mHC mixes' 16384): the split GEMM in 8 chunks of 1024, summed in order; 3 rows and one
        "split_k": (lambda x, w: f32_linear(x.bfloat16(), w), (wk,), [xk], {"f32_linear": "kernel"}),
        "split_k1": (lambda x, w: f32_linear(x.bfloat16(), w), (wk,), [xk[:1]], {"f32_linear": "kernel"}),
        "indexer": (indexer_scores, (), [q, iw, keys], {"indexer_scores": "kernel"}),
        # a decode's one query row: its 4 head rows padded to 8 (mma_rows)
        "indexer1": (indexer_scores, (), [q[:, :1], iw[:, :1], keys], {"indexer_scores": "kernel"}),
    }, kernel_compile, tmp_path, "dense-grouped-indexer")
    xd, wd = x.double().numpy(), w.double().numpy()
    for k in ("dense", "dense16", "dense_small"):
        assert_sum_close(out[k][0], xd @ wd.T, np.abs(xd) @ np.abs(wd).T, k)
    xb, wsd = x.bfloat16().double().numpy(), ws.double().numpy()  # the split is exact: f32 sums of exact products
    assert out["split"][0].shape == (3, 24)
    assert_sum_close(out["split"][0], xb @ wsd.T, np.abs(xb) @ np.abs(wsd).T, "split")
    assert out["dense1"][0].shape == (1, 32) and out["split1"][0].shape == (1, 24)
    assert_sum_close(out["dense1"][0], xd[:1] @ wd.T, np.abs(xd[:1]) @ np.abs(wd).T, "dense1")
    assert_sum_close(out["split1"][0], xb[:1] @ wsd.T, np.abs(xb[:1]) @ np.abs(wsd).T, "split1")
    xkb, wkd = xk.bfloat16().double().numpy(), wk.double().numpy()
    for k, n in (("split_k", 3), ("split_k1", 1)):
        assert out[k][0].shape == (n, 24)
        assert_sum_close(out[k][0], xkb[:n] @ wkd.T, np.abs(xkb[:n]) @ np.abs(wkd).T, k)
    xgd, wgd = xg.double().numpy(), wg.double().numpy()
    want = np.einsum("tgk,gnk->tgn", xgd, wgd)
    mag = np.einsum("tgk,gnk->tgn", np.abs(xgd), np.abs(wgd))
    for k in ("grouped", "grouped_small"):
        assert out[k][0].shape == want.shape
        assert_sum_close(out[k][0], want, mag, k)
    assert out["grouped1"][0].shape == want[:1].shape
    assert_sum_close(out["grouped1"][0], want[:1], mag[:1], "grouped1")
    qd, iwd, kd = q.double().numpy(), iw.double().numpy(), keys.double().numpy()
    dots = np.einsum("bthd,brd->bthr", qd, kd)
    want = (np.maximum(dots, 0) * iwd[..., None]).sum(2)
    mag = (np.einsum("bthd,brd->bthr", np.abs(qd), np.abs(kd)) * np.abs(iwd)[..., None]).sum(2)
    assert_sum_close(out["indexer"][0], want, mag, "indexer_scores")
    assert out["indexer1"][0].shape == want[:, :1].shape
    assert_sum_close(out["indexer1"][0], want[:, :1], mag[:, :1], "indexer_scores, one row")


def test_mhc_sparse_attention_topk_templates(kernel_compile, tmp_path) -> None:
    # mHC mixing logits [B, T, (2+n)n] with n = 4, rows of large logits (the softmax's max shift) among them
    mix = torch.from_numpy(RNG.standard_normal((2, 3, 24)).astype(np.float32) * 2)
    mix[1, 2, 8:] += 80.0
    scale = torch.tensor([0.7, 1.3, 0.9])
    base = torch.from_numpy(RNG.standard_normal(24).astype(np.float32))
    q = torch.from_numpy(RNG.standard_normal((1, 2, 4, 32)).astype(np.float32))
    kv = torch.from_numpy(RNG.standard_normal((1, 16, 32)).astype(np.float32))
    idx = torch.tensor([[[3, 0, 15, -1, 7, 7], [-1, -1, 2, 9, 11, 4]]])
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    key = torch.from_numpy(RNG.integers(0, 2**32, (3, 40)))
    key[1, :10] = key[1, 10]  # ties at the threshold
    key32 = torch.from_numpy(RNG.integers(-2**31, 2**31, (3, 40)).astype(np.int32))
    key32[0, ::3] = key32[0, 1]  # a run of equal keys
    # int64 keys: low halves alike and high halves apart (and the reverse), both signs, the extremes
    key64 = torch.from_numpy(RNG.integers(-2**62, 2**62, (3, 40)))
    key64[0, :8] = torch.tensor([5, 5 + 2**32, 5 - 2**32, -5, 2**33, 2**33 + 7, -2**63, 2**63 - 1])
    key64[1, ::4] = key64[1, 3]  # a run of equal keys
    key64[2, :20] = key64[2, :20] % 7 + (torch.arange(20) % 3 - 1) * 2**32  # equal low halves, three high halves
    key32[2, :5] = torch.tensor([-2**31, 2**31 - 1, 0, -1, 2**31 - 1], dtype=torch.int32)  # the int32 extremes
    xn = torch.from_numpy((RNG.standard_normal((2, 3, 96)) * np.logspace(-3, 2, 96)).astype(np.float32))
    xn[0, 0] = 0.0  # an all-zero row: eps alone under the root
    wn = torch.from_numpy(RNG.uniform(0.5, 2.0, 96).astype(np.float32))
    out = build({
        "norm": (lambda x, w: rms_norm(x, w, 1e-6), (wn,), [xn], {"rms_norm": "kernel"}),
        "norm_bf16": (lambda x, w: rms_norm(x.bfloat16(), w, 1e-6).float(), (wn,), [xn], {"rms_norm": "kernel"}),
        "mhc": (lambda m, s, b: hc_sinkhorn(m, s, b, 4, 20, 1e-6), (), [mix, scale, base], {"hc_sinkhorn": "kernel"}),
        "attn": (lambda q, kv, idx, sink: sparse_attention(q, kv, idx, sink, 0.17), (), [q, kv, idx, sink],
                 {"sparse_attention": "kernel"}),
        # the same rows from two tables (rows 0-9 and 10-15 of kv), read in place
        "attn_rows": (lambda q, a, b, idx, sink: sparse_attention_rows(q, a, b, idx, sink, 0.17), (),
                      [q, kv[0, :10], kv[0, 10:], idx, sink], {"sparse_attention_rows": "kernel"}),
        "radix": (lambda k: radix_threshold(k, 5), (), [key], {"radix_threshold": "kernel"}),
        "rank": (lambda k: pair_rank(k, 1), (), [key32], {"pair_rank": "kernel"}),
        "group_rank": (lambda k: pair_rank(k, 0), (), [key32 % 5], {"pair_rank": "kernel"}),
        "rank64": (lambda k: pair_rank(k, 1), (), [key64], {"pair_rank": "kernel"}),
        "group_rank64": (lambda k: pair_rank(k, 0), (), [key64], {"pair_rank": "kernel"}),
    }, kernel_compile, tmp_path, "mhc-attn-topk")
    for name, x in (("norm", xn), ("norm_bf16", xn.bfloat16())):
        xd = x.double().numpy()
        want = wn.double().numpy() * xd / np.sqrt((xd**2).mean(-1, keepdims=True) + 1e-6)
        got = out[name][0].astype(np.float64)
        # f32: a few roundings of the sum and the root; bf16: one rounding of the result (2^-8 relative)
        rtol = 1e-5 if name == "norm" else 2.0**-8
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-30, err_msg=name)
    logits = (mix.double().numpy()[..., 8:] * scale.double().numpy()[2] + base.double().numpy()[8:]).reshape(*mix.shape[:-1], 4, 4)
    c = np.exp(logits - logits.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + 1e-6
    c = c / (c.sum(-2, keepdims=True) + 1e-6)
    for _ in range(19):
        c = c / (c.sum(-1, keepdims=True) + 1e-6)
        c = c / (c.sum(-2, keepdims=True) + 1e-6)
    np.testing.assert_allclose(out["mhc"][0], c, rtol=2e-5, atol=1e-7, err_msg="hc_sinkhorn")
    qd, kvd, sd = q.double().numpy()[0], kv.double().numpy()[0], sink.double().numpy()
    want = np.zeros_like(qd)
    for t in range(2):
        ids = [int(i) for i in idx[0, t] if i >= 0]
        for h in range(4):
            logits = np.array([qd[t, h] @ kvd[i] * 0.17 for i in ids] + [sd[h]])
            p = np.exp(logits - logits.max())
            p /= p.sum()
            want[t, h] = sum(pi * kvd[i] for pi, i in zip(p[:-1], ids))  # the sink takes weight, adds nothing
    np.testing.assert_allclose(out["attn"][0][0], want, rtol=1e-5, atol=1e-6, err_msg="sparse_attention")
    np.testing.assert_allclose(out["attn_rows"][0][0], want, rtol=1e-5, atol=1e-6, err_msg="sparse_attention_rows")
    kth = np.sort(key.numpy(), -1)[:, -5:-4]  # the 5th largest key: the largest t with count(key >= t) >= 5
    np.testing.assert_array_equal(out["radix"][0], kth, err_msg="radix_threshold")
    # entry i's place in the stable descending order: the inverse of a stable argsort of -key
    order = np.argsort(-key32.numpy().astype(np.int64), axis=-1, kind="stable")
    want_rank = np.argsort(order, axis=-1)
    np.testing.assert_array_equal(out["rank"][0], want_rank.astype(np.float32), err_msg="pair_rank")
    groups = (key32 % 5).numpy()  # 5 groups of equal keys: each entry's count of earlier equal ones
    want_group = [[(row[:i] == row[i]).sum() for i in range(row.size)] for row in groups]
    np.testing.assert_array_equal(out["group_rank"][0], np.array(want_group, np.float32), err_msg="pair_rank by_value=0")
    k64 = key64.numpy()
    order = np.argsort(-k64.astype(object), axis=-1, kind="stable")  # exact: no int64 overflow negating -2^63
    np.testing.assert_array_equal(out["rank64"][0], np.argsort(order, axis=-1).astype(np.float32), err_msg="pair_rank int64")
    want_group = [[(row[:i] == row[i]).sum() for i in range(row.size)] for row in k64]
    np.testing.assert_array_equal(out["group_rank64"][0], np.array(want_group, np.float32), err_msg="pair_rank int64 by_value=0")
