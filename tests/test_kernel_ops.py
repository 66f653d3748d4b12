"""The model's hot spots (the registry in model/kernels, their lowering table export/lowering.py),
each compiled alone vs its torch reference.

For every op: the per-op switch (use_kernels) routes the model hook to an implementation; each available
implementation is exported (dynamic token dim), compiled for llvm-cpu and gfx942, and the
llvm-cpu module is run on random inputs against the eager reference. The eager reference itself is
checked to be untouched when no override is installed. One module per op holds one entry point
per implementation, so each op costs two compiles. The top-k has its own tests (test_topk.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import dsv4.export  # noqa: F401
from dsv4.export.compile import GPU_REDUCTION_FLAG, compile_mlir, vmfb_executables
from dsv4.runtime.module import IreeModule, ensure_runtime_flags
from dsv4.export.kernel_op import use_kernels
from dsv4.model import kernels as mk
from dsv4.model.quant.formats import fp8_fn_to_fnuz, pack_e2m1
from dsv4.model.kernels.indexer import indexer_scores
from dsv4.model.kernels.linear import (f32_linear, fp8_act_qdq, fp8_block_linear, fp8_block_linear_shared,
                                       fp8_block_linear_stacked, grouped_linear, mxfp4_linear, mxfp4_linear_gathered, mxfp4_linear_stacked)
from dsv4.model.kernels.mhc import hc_sinkhorn
from dsv4.model.kernels.moe import moe_experts, mxfp4_swiglu_gathered
from dsv4.model.kernels.qdq import fp4_qdq, fp8_qdq, hadamard
from dsv4.model.kernels.sparse_attention import sparse_attention, sparse_attention_rows
from dsv4.model.kernels.barrier import fusion_barrier
from dsv4.model.kernels.norm import rms_norm
from dsv4.model.kernels.topk import _order_key, _order_key32, pair_rank, radix_threshold, topk

ensure_runtime_flags()
G = torch.Generator().manual_seed(0)


def _r(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=G).to(dtype)


class SparseAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.sink = nn.Parameter(_r(4))

    def forward(self, q, kv, idx):
        return sparse_attention(q, kv, idx, self.sink, 0.125)


class SparseAttnRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.sink = nn.Parameter(_r(4))

    def forward(self, q, kv_a, kv_b, idx):
        return sparse_attention_rows(q, kv_a, kv_b, idx, self.sink, 0.125)


class IndexerScores(nn.Module):
    def forward(self, q, w, keys):
        return indexer_scores(q, w, keys)


class Fp8Linear(nn.Module):
    def __init__(self, fnuz: bool):
        super().__init__()
        w = (_r(256, 128) * 0.05).to(torch.float8_e4m3fn)
        s = torch.tensor([[120], [121]], dtype=torch.uint8)  # E8M0 2^-7, 2^-6
        if fnuz:
            w, s = fp8_fn_to_fnuz(w, s)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.scale = nn.Parameter(s, requires_grad=False)

    def forward(self, x):
        return fp8_block_linear(x, self.weight, self.scale)


class F32Linear(nn.Module):
    """f32_linear on a bf16 activation and an fp32 weight (the three-bf16-term split, the mHC case)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(_r(24, 128) * 0.1, requires_grad=False)

    def forward(self, x):
        return f32_linear(x.bfloat16(), self.weight)


class GroupedLinear(nn.Module):
    """grouped_linear: 4 groups of 64 -> 24 (wo_a's form), in f32 (the bf16 form rounds its f32 sums once)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(_r(4, 24, 64) * 0.1, requires_grad=False)

    def forward(self, x):
        return grouped_linear(x, self.weight)


class Mxfp4Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.packed = nn.Parameter(torch.randint(0, 256, (64, 64), generator=G, dtype=torch.uint8), requires_grad=False)
        self.scale = nn.Parameter(torch.randint(120, 130, (64, 4), generator=G, dtype=torch.uint8), requires_grad=False)

    def forward(self, x):
        return mxfp4_linear(x, self.packed, self.scale)


class StackedLinear(nn.Module):
    def __init__(self, fp8: bool):
        super().__init__()
        if fp8:
            w = (_r(3, 256, 128) * 0.05).to(torch.float8_e4m3fn)
            s = torch.randint(118, 124, (3, 2, 1), generator=G, dtype=torch.uint8)
        else:
            w = torch.randint(0, 256, (3, 64, 64), generator=G, dtype=torch.uint8)
            s = torch.randint(120, 130, (3, 64, 4), generator=G, dtype=torch.uint8)
        self.fn = fp8_block_linear_stacked if fp8 else mxfp4_linear_stacked
        self.weight = nn.Parameter(w, requires_grad=False)
        self.scale = nn.Parameter(s, requires_grad=False)

    def forward(self, x):
        return self.fn(x, self.weight, self.scale)


class SharedLinear(StackedLinear):
    """fp8_block_linear_shared: one x [M, K] for the 3 FP8 weights of the stack."""

    def __init__(self):
        super().__init__(fp8=True)
        self.fn = fp8_block_linear_shared


class GatheredLinear(nn.Module):
    """mxfp4_linear_gathered: row block g times expert sel[g] of 4. The codes skip +-0.5 (1, 9): kernel_gemm
    decodes through f32 subnormals, which llvm-cpu flushes (GPU exports only; test_kernel_templates.py)."""

    def __init__(self):
        super().__init__()
        kept = torch.tensor([c for c in range(16) if c not in (1, 9)])
        codes = kept[torch.randint(0, len(kept), (4, 64, 128), generator=G)]
        self.packed = nn.Parameter(pack_e2m1(codes), requires_grad=False)
        self.scale = nn.Parameter(torch.randint(120, 130, (4, 64, 4), generator=G, dtype=torch.uint8), requires_grad=False)

    def forward(self, x, sel):
        return mxfp4_linear_gathered(x, self.packed, self.scale, sel, 0)


class SwigluGathered(GatheredLinear):
    """mxfp4_swiglu_gathered: row block g's up projection by expert sel[g] of 4, SwiGLU with the gate rows
    (clamped at 1.5: both clamps bind) and the rows' routing weights; x quantized by the caller (x_quantized)."""

    def forward(self, x, gate, rweights, sel):
        return mxfp4_swiglu_gathered(fp8_act_qdq(x), gate, rweights, self.packed, self.scale, sel, 1.5, 1)


class Qdq(nn.Module):
    def __init__(self, fn, *extra):
        super().__init__()
        self.fn, self.extra = fn, extra

    def forward(self, x):
        return self.fn(x, *self.extra)


class Sinkhorn(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale, self.base = nn.Parameter(_r(3) + 1), nn.Parameter(_r(24))

    def forward(self, mix):
        return hc_sinkhorn(mix, self.scale, self.base, 4, 20, 1e-6)


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(_r(64) + 1)

    def forward(self, x):
        return rms_norm(x, self.weight, 1e-6)


class Barrier(nn.Module):
    """Work before the barrier, so the module has a dispatch to compile."""

    def forward(self, x):
        return fusion_barrier(x.exp())


class TopK(nn.Module):
    def forward(self, x):
        return topk(x, 5)


class Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Parameter(_r(*s) * 0.1) for s in ((4, 32, 16), (4, 16, 32), (4, 32, 16)))

    def forward(self, x, weights, indices):
        return moe_experts(x, weights, indices, self.w1, None, self.w2, None, self.w3, None, 10.0)


def _cases() -> dict:
    """name -> (module factory, example args, dynamic token axis per arg (None = static))."""
    T = 7
    idx = torch.randint(-1, 20, (2, T, 6), generator=G)
    return {
        "sparse_attention": (SparseAttn, (_r(2, T, 4, 32), _r(2, 20, 32), idx), (1, None, 1)),
        # rows of two tables (30 + 12), one query a row as decode calls it: rows at the tables' seam, masked ones
        "sparse_attention_rows": (SparseAttnRows, (_r(2, 1, 4, 32), _r(30, 32), _r(12, 32),
                                                   torch.tensor([[[0, 29, 30, 41, -1, 7]], [[41, 40, -1, 3, 29, 35]]])),
                                  (None, None, None, None)),
        "indexer_scores": (IndexerScores, (_r(2, T, 4, 32), _r(2, T, 4), _r(2, 11, 32)), (1, 1, None)),
        "fp8_block_linear": (lambda: Fp8Linear(False), (_r(2, T, 128),), (1,)),
        "mxfp4_linear": (Mxfp4Linear, (_r(2, T, 128),), (1,)),
        "f32_linear": (F32Linear, (_r(2, T, 128),), (1,)),
        "grouped_linear": (GroupedLinear, (_r(2, T, 4, 64),), (1,)),
        "fp8_block_linear_stacked": (lambda: StackedLinear(True), (_r(3, T, 128),), (1,)),
        "fp8_block_linear_shared": (SharedLinear, (_r(T, 128),), (0,)),
        "mxfp4_linear_stacked": (lambda: StackedLinear(False), (_r(3, T, 128),), (1,)),
        "mxfp4_linear_gathered": (GatheredLinear, (_r(T, 3, 128), torch.randint(0, 4, (T,), generator=G)), (0, 0)),
        # 16-row blocks, as a decode's grouped experts
        "mxfp4_swiglu_gathered": (SwigluGathered, (_r(T, 16, 128), _r(T, 16, 64) * 2, torch.rand(T, 16, generator=G),
                                                   torch.randint(0, 4, (T,), generator=G)), (0, 0, 0, 0)),
        "fp8_qdq": (lambda: Qdq(fp8_qdq, 64), (_r(2, T, 4, 128) * 10,), (1,)),
        "fp4_qdq": (lambda: Qdq(fp4_qdq, 32), (_r(2, T, 4, 128) * 10,), (1,)),
        "hadamard": (lambda: Qdq(hadamard), (_r(2, T, 4, 128),), (1,)),
        "hc_sinkhorn": (Sinkhorn, (_r(2, T, 24) * 3,), (1,)),
        # order keys with many exact ties (rounded scores), rows dynamic
        "radix_threshold": (lambda: Qdq(radix_threshold, 5), (_order_key(_r(T, 40).round()),), (0,)),
        "fusion_barrier": (Barrier, (_r(2, T, 40),), (1,)),
        "rms_norm": (Norm, (_r(2, T, 64) * 3,), (1,)),
        "pair_rank": (lambda: Qdq(pair_rank, 1), (_order_key32(_r(T, 40).round()),), (0,)),
        "topk": (TopK, (_r(2, T, 40).round(),), (1,)),  # rounded: many exact ties
        "moe_experts": (Moe, (_r(T, 16), torch.rand(T, 2, generator=G),
                              torch.stack([torch.randperm(4, generator=G)[:2] for _ in range(T)])), (0, 0, 0)),
    }


CASES = _cases()


def test_every_hot_spot_has_an_op():
    """Every declared kernel has a case here and a row in the lowering table, which the CLI help is made from."""
    from dsv4.export.lowering import RULES, kernel_help

    assert set(RULES) == set(mk.KERNELS) == set(mk.HOOKS) == set(CASES)
    help_text = kernel_help()
    for name, rule in RULES.items():
        assert rule.default == "kernel" or f"{name}={rule.default}" in help_text
        assert rule.batch_invariant is None or f"{name}={rule.batch_invariant}" in help_text
    sa = mk.KERNELS["sparse_attention"]
    assert sa.mlir is not None and sa.mlir.name == "sparse_attention.mlir.jinja"
    assert "util.func private @{{kernel_name}}" in sa.mlir_template()


def test_model_does_not_import_turbine():
    """Kernels register eagerly with the model; only the export side builds turbine ops."""
    import subprocess
    import sys

    code = ("import sys, dsv4.model.model, dsv4.model.kernels as k\n"
            "assert 'topk' in k.KERNELS and 'sparse_attention' in k.KERNELS\n"
            "bad = [m for m in sys.modules if m.startswith(('iree.turbine', 'dsv4.export'))]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_eager_reference_untouched_without_override():
    """Without an override a hook is its torch reference (the undecorated function in HOOKS, called
    with the module's own arguments); with one installed the call goes to it, and leaves no trace."""
    for name, (make, args, _) in CASES.items():
        m = make().eval()
        seen = []

        def spy(*a, **kw):
            seen.append((a, kw))
            return mk.HOOKS[name](*a, **kw)

        with torch.no_grad():
            a = m(*args)
            with mk.overrides({name: spy}):
                b = m(*args)
            assert len(seen) == 1, name  # the hook dispatches to an installed override
            ref = mk.HOOKS[name](*seen[0][0], **seen[0][1])
            with mk.overrides({name: lambda *a, **kw: torch.zeros(())}):
                assert torch.equal(m(*args), torch.zeros(())), name
            c = m(*args)
        assert torch.equal(a, ref) and torch.equal(b, ref) and torch.equal(c, ref), name


@pytest.mark.slow  # compiles (tests/conftest.py)
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_compiled_vs_reference(name, tmp_path):
    from iree.turbine import aot

    make, args, axes = CASES[name]
    model = make().eval()
    with torch.no_grad():
        want = model(*args)
        wants = {}  # weight_only is another function on purpose (no activation quantization): eager runs it too
        if "weight_only" in mk.KERNELS[name].alternatives:
            with mk.overrides({name: mk.KERNELS[name].alternatives["weight_only"]}):
                wants["weight_only"] = model(*args)
            assert (wants["weight_only"] - want).abs().max() > 1e-4, f"{name}: weight_only equals the reference"
    aot.externalize_module_parameters(model, external_scope="model")
    aot.save_module_parameters(tmp_path / "p.irpa", model)
    fxb = aot.FxProgramsBuilder(model)
    T = torch.export.Dim("T", min=2, max=64)
    # topk's reference is a stable sort, which IREE 3.13 does not lower (aten.sort.stable): eager only
    impls = [i for i in mk.KERNELS[name].impls if (name, i) != ("topk", "reference")]
    dyn = {f"a{i}": None if ax is None else {ax: T} for i, ax in enumerate(axes)}
    for impl in impls:
        with torch.no_grad(), use_kernels({name: impl}):
            fxb.export_program(_fwd(len(args)), name=f"run_{impl}", args=args, dynamic_shapes=dyn, strict=False)
    # the routed MoE's block count (pairs // block) is a FloorDiv the importer cannot translate: the
    # exporter imports without symbolic expressions for the same reason (export/exporter.py)
    eo = aot.export(fxb, import_symbolic_shape_expressions=name != "moe_experts")
    mlir = tmp_path / "op.mlir"
    eo.save_mlir(str(mlir))
    text = mlir.read_text()
    if "kernel" in impls:
        assert f"dsv4k_{name}" in text, "the hand-written kernel is not in the module"
    cpu = compile_mlir(mlir, "llvm-cpu", tmp_path / "op.cpu.vmfb")
    m = IreeModule(cpu.path, tmp_path / "p.irpa")
    for impl in impls:
        got = m(f"run_{impl}", *[a.numpy() for a in args])
        np.testing.assert_allclose(got, wants.get(impl, want).numpy(), atol=2e-5, rtol=2e-5, err_msg=f"{name}/{impl}")
    if not name.startswith("fp8_block_linear"):  # gfx942 takes fnuz weights: test_quant_kernels.py
        flags = [GPU_REDUCTION_FLAG] if name == "mxfp4_linear_gathered" else []  # as the exporter adds it
        gpu = compile_mlir(mlir, "gfx942", tmp_path / "op.gfx942.vmfb", extra_flags=flags)
        assert {e.gpu_arch for e in vmfb_executables(gpu.path)} == {"gfx942"}


def _fwd(n: int):
    names = ", ".join(f"a{i}" for i in range(n))
    ns: dict = {}
    exec(f"def f(m, {names}):\n    return m({names})\n", ns)  # explicit arity for dynamic_shapes
    return ns["f"]


@pytest.mark.slow  # compiles (tests/conftest.py)
def test_fp8_block_linear_fnuz_for_gfx942_and_cuda(tmp_path):
    """gfx942 gets e4m3fnuz weights (fp8_fn_to_fnuz), cuda keeps e4m3fn; both compile: the f32 GEMM
    form decodes e4m3fn bytes with integer ops (cuda cannot lower an fp8 -> f32 extf outside an mma),
    the FP8 x FP8 form's extf feeds the matrix-core contraction on both."""
    from iree.turbine import aot

    x = _r(2, 5, 128)
    ref = Fp8Linear(False).eval()
    for target, fnuz in (("gfx942", True), ("cuda", False)):
        m = Fp8Linear(False).eval()
        m.load_state_dict(ref.state_dict())
        if fnuz:
            w, s = fp8_fn_to_fnuz(ref.weight.data, ref.scale.data)
            m.weight, m.scale = nn.Parameter(w, requires_grad=False), nn.Parameter(s, requires_grad=False)
        with torch.no_grad():
            torch.testing.assert_close(m(x), ref(x), atol=0, rtol=0)  # same values in both formats
        aot.externalize_module_parameters(m, external_scope="model")
        eo = aot.export(m, args=(x,), dynamic_shapes={"x": {1: torch.export.Dim("T", min=2, max=64)}},
                        strict_export=False, import_symbolic_shape_expressions=True)
        mlir = tmp_path / f"fp8_{target}.mlir"
        eo.save_mlir(str(mlir))
        res = compile_mlir(mlir, target, tmp_path / f"fp8.{target}.vmfb")
        arch = {e.gpu_arch for e in vmfb_executables(res.path)}
        assert arch == ({"gfx942"} if target == "gfx942" else {"sm_89"})


def test_unknown_choice_is_rejected():
    with pytest.raises(ValueError, match="unknown kernel op 'nope'"):
        with use_kernels({"nope": "kernel"}):
            pass
    with pytest.raises(ValueError, match="no implementation 'kernel'"):
        with use_kernels({"moe_experts": "kernel"}):
            pass
    with pytest.raises(ValueError, match="declared twice"):
        mk.kernel("topk")(lambda x, k: x)


@pytest.mark.slow  # compiles (tests/conftest.py)
def test_export_argmax_compiles_for_every_target(tmp_path):
    """The greedy argmax (max + float min-index) compiles for llvm-cpu, gfx942 and cuda (aten.argmax
    and int64 min reductions fail to distribute on the GPU backends) and matches torch.argmax."""
    from iree.turbine import aot

    from dsv4.model.device_sampling import first_argmax

    class M(nn.Module):
        def forward(self, x):
            return torch.stack([first_argmax(x)[:, 0], first_argmax(x, two_level=False)[:, 0]])

    x = _r(4, 1000)  # 15 pieces of 67, the last one padded
    x[1, [3, 700]] = 10.0  # a tie: the first index wins
    x[2, 999] = 10.0  # the maximum in the padded piece
    fxb = aot.FxProgramsBuilder(M())
    fxb.export_program(lambda m, x: m(x), name="f", args=(x,), strict=False)
    mlir = tmp_path / "argmax.mlir"
    aot.export(fxb).save_mlir(str(mlir))
    for target in ("llvm-cpu", "gfx942", "cuda"):
        compile_mlir(mlir, target, tmp_path / f"argmax.{target}.vmfb")
    got = IreeModule(tmp_path / "argmax.llvm-cpu.vmfb")("f", x.numpy())
    assert np.array_equal(got, np.stack([x.argmax(-1).numpy()] * 2))
