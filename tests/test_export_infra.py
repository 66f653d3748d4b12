"""Export/compile infrastructure: compat shim, targets, CompileError, kernel hooks, the runtime module.

One tiny model is exported once per session with two entry points, one per kernel-hook
implementation (reference tracing, inline-MLIR kernel),
and compiled once for llvm-cpu and once for gfx942; the tests share those artifacts.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from dsv4.export import compat
from dsv4.export import kernel_op as ko
from dsv4.export.compile import (
    TARGETS,
    CompileError,
    compile_mlir,
    resolve_target,
    vmfb_executables,
)
from dsv4.model import kernels as mk
from kernel_examples import EXAMPLES, gather_rows, silu_mul  # tests/kernel_examples.py
from dsv4.runtime.module import IreeModule, ensure_runtime_flags

ensure_runtime_flags()  # before turbine's eager kernels create the local-task driver
compat.apply()  # this file drives turbine directly (e8m0 parameters, custom ops)

N, D, S = 48, 16, 64  # table rows, width, cache slots
LIMIT = 1.5
IMPLS = ("reference", "kernel")


class Tiny(nn.Module):
    """gather (hook) -> matmul -> clamped SiLU*mul (hook) * e8m0 scale -> index_put_ into state."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(N, D))
        self.w = nn.Parameter(torch.randn(D, 2 * D) / D**0.5)
        exps = torch.randint(-3, 4, (D,)).float()
        self.scale = nn.Parameter((2.0**exps).to(torch.float8_e8m0fnu), requires_grad=False)

    def forward(self, idx: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        rows = gather_rows(self.table, idx)
        gu = rows @ self.w.to(rows.dtype)
        h = silu_mul(gu[:, :D], gu[:, D:], LIMIT) * self.scale.to(rows.dtype)
        cache.index_put_((slots,), h)
        return h


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from iree.turbine import aot

    out = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    model = Tiny().eval()
    aot.externalize_module_parameters(model, external_scope="model")
    aot.save_module_parameters(out / "tiny.irpa", model)
    fxb = aot.FxProgramsBuilder(model)
    K = torch.export.Dim("K", min=1, max=1024)
    idx, slots, cache = torch.randint(0, N, (5,)), torch.arange(5), torch.zeros(S, D)
    dyn = {"idx": {0: K}, "cache": None, "slots": {0: K}}
    for impl in IMPLS:
        with ko.use_kernels({"*": impl}, EXAMPLES):
            fxb.export_program(
                lambda m, idx, cache, slots: m(idx, cache, slots),
                name=f"step_{impl}", args=(idx, cache, slots), dynamic_shapes=dyn, strict=False,
            )
    # A static-shape entry point reusing the same (dynamic-dim) kernel specialization.
    with ko.use_kernels({"*": "kernel"}, EXAMPLES):
        fxb.export_program(
            lambda m, idx, cache, slots: m(idx, cache, slots),
            name="decode_kernel", args=(idx[:1], cache, slots[:1]), strict=False,
        )
    eo = aot.export(fxb, import_symbolic_shape_expressions=True)
    mlir = out / "tiny.mlir"
    eo.save_mlir(mlir)
    return {"dir": out, "model": model, "mlir": mlir, "irpa": out / "tiny.irpa"}


@pytest.fixture(scope="module")
def cpu_vmfb(exported: dict) -> Path:
    res = compile_mlir(exported["mlir"], "llvm-cpu", exported["dir"] / "tiny.cpu.vmfb")
    print(f"llvm-cpu compile {res.seconds:.2f}s")
    return res.path


@pytest.fixture(scope="module")
def cpu_module(exported: dict, cpu_vmfb: Path) -> IreeModule:
    return IreeModule(cpu_vmfb, exported["irpa"])


# ------------------------------------------------------------------------------------------------
# compat shim
# ------------------------------------------------------------------------------------------------


def test_compat_shim_restores_isinstance_and_is_idempotent() -> None:
    from iree.compiler import ir

    compat.apply()
    compat.apply()
    assert compat.is_applied()
    with ir.Context():
        i32, f32 = ir.Type.parse("i32"), ir.Type.parse("f32")
        rtt = ir.Type.parse("tensor<2x?xf32>")
        assert ir.IntegerType.isinstance(i32) and not ir.IntegerType.isinstance(f32)
        assert ir.F32Type.isinstance(f32) and not ir.F64Type.isinstance(f32)
        assert ir.RankedTensorType.isinstance(rtt) and ir.ShapedType.isinstance(rtt)
        assert not ir.RankedTensorType.isinstance(i32)
        m = ir.Module.parse("func.func @f(%a: i32) -> i32 { return %a : i32 }")
        arg = m.body.operations[0].regions[0].blocks[0].arguments[0]
        assert ir.BlockArgument.isinstance(arg) and not ir.OpResult.isinstance(arg)


def test_compat_maps_e8m0() -> None:
    from iree.turbine.support import conversions

    assert torch.float8_e8m0fnu in conversions.TORCH_DTYPE_TO_IREE_TYPE
    assert conversions.TORCH_DTYPE_TO_IREE_TYPE_ASM[torch.float8_e8m0fnu] == "f8E8M0FNU"


@pytest.mark.slow  # compiles (tests/conftest.py)
def test_customop_exports_inline_mlir(exported: dict) -> None:
    """Style A needs the shim (turbine's expansion calls XType.isinstance); its MLIR is inlined
    once per specialization and nothing opaque is left; the e8m0 parameter is a typed global."""
    text = exported["mlir"].read_text()
    kernels = sorted(set(re.findall(r"util\.func private @(dsv4k_\w+)", text)))
    assert kernels == ["dsv4k_gather_rows_f32_i64_D16", "dsv4k_silu_mul_f32_f32_limit1p5"]
    assert "torch.operator" not in text
    assert '#flow.parameter.named<"model"::"scale"> : tensor<16xf8E8M0FNU>' in text


# ------------------------------------------------------------------------------------------------
# targets and compile errors
# ------------------------------------------------------------------------------------------------


def test_unknown_target_lists_valid_ones() -> None:
    with pytest.raises(ValueError) as ei:
        resolve_target("rocm")
    msg = str(ei.value)
    for name in TARGETS:
        assert name in msg
    with pytest.raises(ValueError):
        compile_mlir("module {}", "gfx90a", "/nonexistent/x.vmfb")


def test_target_arch_override() -> None:
    assert resolve_target("cuda:sm_80").flags[-1] == "--iree-cuda-target=sm_80"
    assert resolve_target("cuda").flags[-1] == "--iree-cuda-target=sm_89"
    gen = resolve_target("llvm-cpu:generic")
    assert "--iree-llvmcpu-target-cpu=generic" in gen.flags and "--iree-llvmcpu-target-cpu=host" not in gen.flags
    assert resolve_target(None).name == "gfx942"
    assert "--iree-llvmgpu-enable-small-float-emulation" not in resolve_target("gfx942").flags
    # the default stream partitioning corrupted a Flash decode on cuda (export/compile.py PARTITIONING_FLAG);
    # an arch override must keep the flag
    for t in ("gfx942", "cuda", "cuda:sm_80"):
        assert "--iree-stream-partitioning-favor=debug" in resolve_target(t).flags


BAD_MLIR = """func.func @f(%a: tensor<4xi32>) -> tensor<4xi32> {
  %0 = arith.addf %a, %a : tensor<4xi32>
  return %0 : tensor<4xi32>
}
"""


@pytest.mark.small_compile  # a few-line function that fails to compile (under a second)
def test_invalid_mlir_raises_short_compile_error(tmp_path: Path) -> None:
    with pytest.raises(CompileError) as ei:
        compile_mlir(BAD_MLIR, "llvm-cpu", tmp_path / "bad.vmfb")
    e = ei.value
    msg = str(e)
    assert "llvm-cpu" in msg and "arith.addf" in msg and "floating-point-like" in msg
    assert e.ops[0] == "arith.addf"
    assert e.log_path is not None and e.log_path.exists() and str(e.log_path) in msg
    assert "Invoked with" in e.log_path.read_text()  # the full log is kept, the message is short
    assert len(msg.splitlines()) < 12
    assert (tmp_path / "bad.vmfb.input.mlir").read_text() == BAD_MLIR


@pytest.mark.slow  # compiles (tests/conftest.py)
def test_cuda_compile_produces_ptx(tmp_path: Path) -> None:
    ok = BAD_MLIR.replace("i32", "f32")
    res = compile_mlir(ok, "cuda", tmp_path / "ok.cuda.vmfb")
    (exe,) = vmfb_executables(res.path)
    assert exe.format == "cuda-nvptx-fb" and exe.gpu_arch == "sm_89"


def _extf_mlir(dtype: str) -> str:
    return (
        f"func.func @f(%a: tensor<8x{dtype}>) -> tensor<8xf32> {{\n"
        f"  %0 = arith.extf %a : tensor<8x{dtype}> to tensor<8xf32>\n"
        f"  return %0 : tensor<8xf32>\n}}\n"
    )


@pytest.mark.slow  # compiles (tests/conftest.py)
def test_fp8_conversion_per_target(tmp_path: Path) -> None:
    """Regression markers for compiler 3.13 (update the hints/notes when these change):
    e4m3fnuz is native on gfx942 without the emulation flag; OCP e4m3fn fails there with a hint;
    the CUDA backend cannot lower any fp8 -> f32 extf."""
    compile_mlir(_extf_mlir("f8E4M3FNUZ"), "gfx942", tmp_path / "fnuz.vmfb")
    with pytest.raises(CompileError, match="small-float-emulation") as ei:
        compile_mlir(_extf_mlir("f8E4M3FN"), "gfx942", tmp_path / "fn.vmfb")
    assert "arith.extf" in ei.value.ops
    with pytest.raises(CompileError, match="LUT") as ei:
        compile_mlir(_extf_mlir("f8E4M3FNUZ"), "cuda", tmp_path / "fnuz_cuda.vmfb")
    assert "builtin.unrealized_conversion_cast" in ei.value.ops


# ------------------------------------------------------------------------------------------------
# compiled llvm-cpu vs eager torch; gfx942 artifact
# ------------------------------------------------------------------------------------------------


def _reference64(model: Tiny, idx: torch.Tensor, slots: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Eager reference in float64 (weights widened exactly), cache state after the call."""
    m64 = Tiny().double()
    m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    cache = torch.zeros(S, D, dtype=torch.float64)
    with torch.no_grad(), ko.use_kernels({"*": "reference"}, EXAMPLES):
        h = m64(idx, cache, slots)
    return h.numpy(), cache.numpy()


@pytest.mark.slow  # compiles (tests/conftest.py)
@pytest.mark.parametrize("k", [1, 7, 40])
def test_cpu_reference_program_matches_eager_float64(exported: dict, cpu_module: IreeModule, k: int) -> None:
    torch.manual_seed(k)
    idx, slots = torch.randint(0, N, (k,)), torch.randperm(S)[:k]
    h64, c64 = _reference64(exported["model"], idx, slots)
    cache = cpu_module.device_array(np.zeros((S, D), np.float32))
    h = cpu_module("step_reference", idx.numpy(), cache, slots.numpy())
    assert h.shape == (k, D) and h.dtype == np.float32
    scale = np.abs(h64).max()
    assert scale > 0.1
    np.testing.assert_allclose(h, h64, rtol=0, atol=2e-6 * scale)
    # eager float32 is in the same error band, so the tolerance is a real one
    with torch.no_grad(), ko.use_kernels({"*": "reference"}, EXAMPLES):
        h32 = exported["model"](idx, torch.zeros(S, D), slots).numpy()
    assert np.abs(h32 - h64).max() <= 2e-6 * scale


@pytest.mark.slow  # compiles (tests/conftest.py)
@pytest.mark.parametrize("impl", ["kernel"])
def test_kernel_styles_match_reference(exported: dict, cpu_module: IreeModule, impl: str) -> None:
    for k in (3, 29):
        torch.manual_seed(100 + k)
        idx, slots = torch.randint(0, N, (k,)), torch.randperm(S)[:k]
        h64, c64 = _reference64(exported["model"], idx, slots)
        cache = cpu_module.device_array(np.zeros((S, D), np.float32))
        h = cpu_module(f"step_{impl}", idx.numpy(), cache, slots.numpy())
        scale = np.abs(h64).max()
        np.testing.assert_allclose(h, h64, rtol=0, atol=2e-6 * scale)
        np.testing.assert_allclose(cache.to_host(), c64, rtol=0, atol=2e-6 * scale)


@pytest.mark.slow  # compiles (tests/conftest.py)
def test_static_entry_point_reuses_kernel(exported: dict, cpu_module: IreeModule) -> None:
    idx, slots = torch.tensor([7]), torch.tensor([3])
    h64, _ = _reference64(exported["model"], idx, slots)
    cache = cpu_module.device_array(np.zeros((S, D), np.float32))
    h = cpu_module("decode_kernel", idx.numpy(), cache, slots.numpy())
    np.testing.assert_allclose(h, h64, rtol=0, atol=2e-6 * np.abs(h64).max())


@pytest.mark.slow  # compiles (tests/conftest.py)
def test_state_updated_in_place_via_index_put(exported: dict, cpu_module: IreeModule) -> None:
    torch.manual_seed(5)
    idx, slots = torch.randint(0, N, (6,)), torch.tensor([0, 9, 10, 33, 62, 63])
    h64, c64 = _reference64(exported["model"], idx, slots)
    init = np.full((S, D), -7.0, np.float32)
    cache = cpu_module.device_array(init)
    cpu_module("step_kernel", idx.numpy(), cache, slots.numpy())
    after = cache.to_host()
    untouched = np.setdiff1d(np.arange(S), slots.numpy())
    assert np.all(after[untouched] == -7.0)
    np.testing.assert_allclose(after[slots.numpy()], h64, rtol=0, atol=2e-6 * np.abs(h64).max())
    # A second call sees the state the first one left (slot 63 rewritten, the rest kept).
    cpu_module("step_kernel", idx[:1].numpy(), cache, np.array([63]))
    again = cache.to_host()
    np.testing.assert_array_equal(again[:63], after[:63])
    # Plain numpy state is copied in: the caller's array is not updated (documented trap).
    host = np.zeros((S, D), np.float32)
    cpu_module("step_kernel", idx.numpy(), host, slots.numpy())
    assert not host.any()


@pytest.mark.slow  # compiles (tests/conftest.py)
def test_gfx942_vmfb_contains_gfx942_hsaco(exported: dict) -> None:
    res = compile_mlir(exported["mlir"], "gfx942", exported["dir"] / "tiny.gfx942.vmfb")
    print(f"gfx942 compile {res.seconds:.2f}s")
    exes = vmfb_executables(res.path)
    assert exes and all(e.format == "rocm-hsaco-fb" for e in exes)
    assert all(e.elf_machine == 224 and e.gpu_arch == "gfx942" for e in exes)  # EM_AMDGPU, mach 0x4c
    import zipfile

    with zipfile.ZipFile(res.path) as z:
        blob = b"".join(z.read(e.entry) for e in exes)
    assert b"gfx942" in blob[blob.find(b"\x7fELF") :]


# ------------------------------------------------------------------------------------------------
# kernel hooks: eager, switch
# ------------------------------------------------------------------------------------------------


@pytest.mark.small_compile  # eager kernels: turbine compiles each small op in-process (~0.6 s)
def test_kernel_eager_matches_reference() -> None:
    """Eagerly, the "kernel" impl JIT-runs the same MLIR through IREE local-task."""
    torch.manual_seed(1)
    table, idx = torch.randn(30, D), torch.randint(0, 30, (9,))
    gate, up = torch.randn(11, 24) * 3, torch.randn(11, 24) * 3
    with ko.use_kernels({"gather_rows": "kernel", "silu_mul": "kernel"}, EXAMPLES):
        assert torch.equal(gather_rows(table, idx), table[idx])
        got = silu_mul(gate, up, LIMIT)
        got_bf16 = silu_mul(gate.bfloat16(), up.bfloat16(), LIMIT)
    ref64 = EXAMPLES["silu_mul"].reference(gate.double(), up.double(), LIMIT)
    torch.testing.assert_close(got.double(), ref64, rtol=0, atol=2e-6)
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16, EXAMPLES["silu_mul"].reference(gate.bfloat16(), up.bfloat16(), LIMIT), rtol=1e-2, atol=1e-3)


def test_impl_switch() -> None:
    """One switch (model/kernels `overrides`, which use_kernels drives): a hook runs what it is routed
    to inside the block and its reference again after; a bad choice fails before anything runs."""
    table, idx = torch.randn(4, D), torch.tensor([1, 3])
    with mk.overrides({"gather_rows": lambda t, i: "routed"}, EXAMPLES):
        assert gather_rows(table, idx) == "routed"
        assert torch.equal(silu_mul(table, table, 0.0), EXAMPLES["silu_mul"].reference(table, table, 0.0))
        with ko.use_kernels({"gather_rows": "reference"}, EXAMPLES):  # nested: the inner choice wins
            assert torch.equal(gather_rows(table, idx), table[idx])
        assert gather_rows(table, idx) == "routed"
    assert torch.equal(gather_rows(table, idx), table[idx])
    with pytest.raises(ValueError, match="no implementation 'triton'"):
        with ko.use_kernels({"gather_rows": "triton"}, EXAMPLES):
            pass
    with pytest.raises(ValueError, match="unknown kernel op 'no_such_op'"):
        with ko.use_kernels({"no_such_op": "kernel"}, EXAMPLES):
            pass
    with pytest.raises(KeyError, match="gather_rows"):  # not a model hook
        with mk.overrides({"gather_rows": lambda t, i: t}):
            pass
    kernel = ko.implementation(EXAMPLES["gather_rows"], "kernel")
    with pytest.raises(ValueError, match="rank 1"):
        kernel(torch.randn(4, D), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="dtype"):
        kernel(torch.randn(4, D), torch.zeros(2))


def test_kernel_spec_validation() -> None:
    with pytest.raises(ValueError, match="no argument defines"):
        mk.Kernel.declare("bad_op_1", lambda x: x, args={"x": "T"}, results={"y": "T, Q"})
    with pytest.raises(ValueError, match="static dims"):
        mk.Kernel.declare("bad_op_2", lambda x: x, args={"x": "T"}, results={"y": "T"}, static=("Z",))
    with pytest.raises(ValueError, match="reuse 'reference'"):
        mk.Kernel.declare("bad_op_3", lambda x: x, alternatives={"kernel": lambda x: x})


def test_export_package_import_has_no_side_effects() -> None:
    """`import dsv4.export` (and its CLI module) loads neither torch nor turbine and patches nothing:
    the compat shim is applied where turbine is used."""
    code = (
        "import sys\n"
        "import dsv4.export, dsv4.export.command, dsv4.runtime.module\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('iree.turbine')]\n"
        "assert not bad, bad\n"
        "from iree.compiler import ir\n"
        "assert not hasattr(ir.IntegerType, 'isinstance') or not getattr(ir.IntegerType.isinstance, '_dsv4_compat', False)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_score_logprobs_traces_from_two_tokens() -> None:
    """score_bs1 traces with chunks from 2 tokens (Flash --layers 2 exports T in [2, 512]; the
    earlier tokens[:, 1:] made torch.export guard T >= 3 and the whole export fail) and gives
    log p(tokens[t+1]) at t < lengths - 1, else 0, per the formula."""
    from dsv4.export.exporter import score_logprobs

    class Score(nn.Module):
        def forward(self, logits, tokens, lengths):
            return score_logprobs(logits, tokens, lengths)

    T = torch.export.Dim("T", min=2, max=64)
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 5, 11, generator=g), torch.randint(0, 11, (2, 5), generator=g), torch.tensor([5, 3]))
    ep = torch.export.export(Score(), args, dynamic_shapes=({1: T}, {1: T}, None), strict=False)
    for n in (2, 5):
        logits, tokens, lengths = torch.randn(2, n, 11, generator=g), torch.randint(0, 11, (2, n), generator=g), torch.tensor([n, 1])
        got = ep.module()(logits, tokens, lengths)
        lp = logits.double().log_softmax(-1)
        want = torch.zeros(2, n, dtype=torch.float64)
        for b in range(2):
            for t in range(int(lengths[b]) - 1):
                want[b, t] = lp[b, t, tokens[b, t + 1]]
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
