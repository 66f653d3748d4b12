"""ExportSpec (export/spec.py): validated once, with an error naming the option; and the lowering
policy (export/lowering.py plan_lowering): per target and option, each op's implementation and the
compile flags, checked against tables written out here."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from dsv4.export import spec as spec_mod
from dsv4.export.compile import GPU_REDUCTION_FLAG
from dsv4.export.lowering import GATHER_COPY_LIMIT, plan_lowering, routed_f32_bytes
from dsv4.export.spec import ExportError, ExportSpec
from dsv4.model.config import ModelConfig

TINY = ModelConfig.preset("tiny")
FLASH = ModelConfig.preset("flash")  # routed experts over GATHER_COPY_LIMIT a layer in f32

# ---- validation: each a clear error, before any model is loaded ----------------------------------


@pytest.mark.parametrize("targets, msg", [
    (("gfx9000",), r"unknown compile target 'gfx9000'.*valid targets"),
    (("cuda:sm_90",), r"cuda arch 'sm_90' is not supported by iree-compile 3\.13"),
    (("llvm-cpu:no-such-cpu",), r"target 'llvm-cpu:no-such-cpu' is refused by iree-compile"),
    (("llvm-cpu", "llvm-cpu:generic"), "a target is listed twice"),
    ("llvm-cpu", "targets must be a non-empty list"),
    ((), "targets must be a non-empty list"),
])
def test_bad_targets(targets, msg):
    with pytest.raises(ExportError, match=f"stage 'validate' failed: {msg}"):
        ExportSpec(targets=targets)


@pytest.mark.parametrize("kw, msg", [
    ({"batch_sizes": (0,)}, r"batch sizes must be integers >= 1, got \[0\]"),
    ({"batch_sizes": (1, -4)}, "batch sizes must be integers >= 1"),
    ({"batch_sizes": ()}, "batch sizes must be integers >= 1"),
    ({"batch_sizes": (1.5,)}, "batch sizes must be integers >= 1"),
    ({"batch_sizes": ("2",)}, "batch sizes must be integers >= 1"),
    ({"decode_batch_sizes": (0, 4)}, r"decode batch sizes must be integers >= 1, got \[0, 4\]"),
    ({"n_slots": 2}, "n_slots 2 is smaller than the largest batch size 4"),
    ({"decode_batch_sizes": (1, 8), "n_slots": 4}, "n_slots 4 is smaller than the largest batch size 8"),
    ({"devices": 0}, "devices must be an integer >= 1"),
    ({"max_chunk": 0}, "max_chunk must be a positive integer"),
    ({"static_prefill": "yes"}, "static_prefill must be True or False"),
    ({"dtype": "fp16"}, "dtype must be one of float32, bfloat16, float16"),
    ({"layers": -1}, "layers must be a positive integer"),
])
def test_bad_sizes(kw, msg):
    with pytest.raises(ExportError, match=msg):
        ExportSpec(targets=("llvm-cpu",), **kw)


@pytest.mark.parametrize("kw, msg", [
    ({"targets": ("llvm-cpu", "cuda"), "batch_invariant": True}, "--batch-invariant cannot serve llvm-cpu and a GPU"),
    ({"pipeline": True}, "--pipeline needs --devices N with N >= 2"),
    ({"pipeline": True, "devices": 2, "probe_topk": True}, "top-k probe is not exported for pipeline stages"),
    ({"draft_tokens": -1}, "draft_tokens must be an integer >= 0, got -1"),
    ({"draft_tokens": 2, "devices": 2}, r"--draft-tokens \(MTP speculative decoding\) is exported for one device only"),
    ({"kernels": {"nope": "kernel"}}, "--kernel: unknown kernel op 'nope'"),
    ({"kernels": {"moe_experts": "kernel"}}, r"--kernel: kernel op 'moe_experts' has no implementation 'kernel'; "
                                             r"choose from \['reference', 'routed', 'routed_blocks'\]"),
    ({"kernels": {"*": "triton"}}, r"no kernel op offers implementation 'triton'"),
])
def test_conflicting_options(kw, msg):
    with pytest.raises(ExportError, match=msg):
        ExportSpec(**{"targets": ("llvm-cpu",), **kw})


def test_defaults_are_filled_in_and_the_spec_is_frozen():
    s = ExportSpec(targets=("llvm-cpu",), batch_sizes=[4, 1, 4], kernels={"topk": "reference"})
    assert s.batch_sizes == (1, 4) and s.decode_batch_sizes == (1, 4) and s.n_slots == 4
    assert [t.name for t in s.targets] == ["llvm-cpu"] and s.kernels == (("topk", "reference"),)
    assert ExportSpec(targets=("llvm-cpu",), batch_sizes=(2,), decode_batch_sizes=(8,)).n_slots == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.n_slots = 9
    assert s.replace(batch_sizes=(2,)).batch_sizes == (2,) and s.batch_sizes == (1, 4)


def test_the_target_preflight_runs_once(monkeypatch, tmp_path):
    """`dsv4 export` preflights each target once, in the spec: neither the CLI nor the exporter again."""
    import dsv4.export.exporter as exporter
    from dsv4.cli import main

    real, calls = spec_mod.check_target, []
    monkeypatch.setattr(spec_mod, "check_target", lambda t: calls.append(t) or real(t))

    def fake_export(model, spec, out, **kw):  # stop before tracing, with the spec the exporter got
        seen.append(spec.replace(batch_sizes=(1,)))  # a changed copy keeps the checked targets
        raise ExportError("trace:test", "stopped by the test")

    seen: list[ExportSpec] = []
    monkeypatch.setattr(exporter, "export_model", fake_export)
    assert main(["export", "--preset", "tiny", "--target", "llvm-cpu", "--target", "gfx942", "-o",
                 str(tmp_path / "o")]) == 1
    assert calls == ["llvm-cpu", "gfx942"] and [t.name for t in seen[0].targets] == ["llvm-cpu", "gfx942"]


def _cli(argv: list[str]) -> argparse.Namespace:
    from dsv4.cli.export import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["export", *argv])


def test_from_args_maps_every_cli_option():
    s = ExportSpec.from_args(_cli(["--target", "cuda", "--batch-sizes", "4,1", "--decode-batch-sizes", "8",
                                   "--n-slots", "9", "--max-chunk", "64", "--no-score", "--kernel", "topk=reference",
                                   "--kernel", "*=weight_only", "--batch-invariant", "--dtype", "fp32",
                                   "--max-seq-len", "512", "--quant-sim", "off", "--layers", "2", "--keep-mlir",
                                   "--draft-tokens", "3", "--static-prefill", "-o", "x"]))
    assert s.draft_tokens == 3 and ExportSpec.from_args(_cli(["-o", "x"])).draft_tokens == 0
    assert s.static_prefill and not ExportSpec.from_args(_cli(["-o", "x"])).static_prefill
    assert (s.batch_sizes, s.decode_batch_sizes, s.n_slots, s.max_chunk) == ((1, 4), (8,), 9, 64)
    assert s.kernels == (("topk", "reference"), ("*", "weight_only")) and s.batch_invariant
    assert (s.score, s.dtype, s.max_seq_len, s.quant_sim, s.layers, s.keep_mlir) == (False, "float32", 512, False,
                                                                                      2, True)
    assert [t.label for t in s.targets] == ["cuda"]
    assert [t.name for t in ExportSpec.from_args(_cli(["-o", "x"])).targets] == ["gfx942"]
    with pytest.raises(SystemExit):  # the command line refuses it while parsing
        _cli(["--kernel", "topk", "-o", "x"])
    args = _cli(["-o", "x"])
    args.kernel = ["topk"]  # a namespace built by other code
    with pytest.raises(ExportError, match="--kernel expects OP=IMPL, got 'topk'"):
        ExportSpec.from_args(args)


def test_check_model_compares_the_model_with_the_spec():
    s = ExportSpec(targets=("llvm-cpu",), dtype="bfloat16", max_seq_len=TINY.max_seq_len, layers=TINY.n_layers)
    s.check_model(TINY, "bfloat16")
    s.replace(draft_tokens=2).check_model(TINY, "bfloat16")
    no_mtp = TINY.replace(num_nextn_predict_layers=0, compress_ratios=TINY.compress_ratios[:TINY.n_layers])
    with pytest.raises(ExportError, match=r"--draft-tokens needs a model with an MTP block"):
        s.replace(draft_tokens=2).check_model(no_mtp, "bfloat16")
    with pytest.raises(ExportError, match=r"not the one the spec describes: dtype 'bfloat16' \(the model has "
                                          r"'float32'\)"):
        s.check_model(TINY, "float32")
    with pytest.raises(ExportError, match=r"layers 2 \(the model has 4\)"):
        s.replace(layers=2).check_model(TINY, "bfloat16")
    with pytest.raises(ExportError, match=r"max_chunk 8 must be in \[16"):
        s.replace(max_chunk=8).check_model(TINY, "bfloat16")
    with pytest.raises(ExportError, match="3 does not divide attention heads"):
        s.replace(devices=3).check_model(TINY, "bfloat16")
    with pytest.raises(ExportError, match="cannot split 4 layers into 5 pipeline stages"):
        s.replace(devices=5, pipeline=True).check_model(TINY, "bfloat16")
    assert s.chunk_range(TINY) == (16, min(TINY.max_seq_len, 512))
    # --static-prefill: one chunk size, max_chunk's
    assert s.replace(static_prefill=True, max_chunk=32).chunk_range(TINY) == (32, 32)
    with pytest.raises(ExportError, match=r"max_chunk 8 must be in \[16"):
        s.replace(static_prefill=True, max_chunk=8).chunk_range(TINY)


# ---- the lowering policy --------------------------------------------------------------------------

# each op's implementation with no condition applying (what config.json recorded before the policy moved)
DEFAULT = {"radix_threshold": "kernel", "pair_rank": "kernel", "fusion_barrier": "kernel", "rms_norm": "kernel",
           "topk": "select", "indexer_scores": "kernel", "fp8_qdq": "kernel",
           "fp4_qdq": "kernel", "hadamard": "kernel", "fp8_block_linear": "kernel", "mxfp4_linear": "kernel",
           "f32_linear": "kernel", "grouped_linear": "kernel", "fp8_block_linear_stacked": "kernel",
           "fp8_block_linear_shared": "reference", "mxfp4_linear_stacked": "kernel", "mxfp4_linear_gathered": "reference",
           "mxfp4_swiglu_gathered": "reference", "hc_sinkhorn": "kernel",
           "moe_experts": "routed", "sparse_attention": "kernel", "sparse_attention_rows": "kernel"}
GPU_BI = {"fp8_block_linear": "kernel_rows16", "fp8_block_linear_stacked": "kernel_rows16",
          "f32_linear": "kernel_rows16", "mxfp4_linear_stacked": "kernel_f32", "grouped_linear": "reference"}
CPU_BIG = {"mxfp4_linear_gathered": "kernel"}
GPU_ONLY = {"fp8_block_linear": "kernel_prefill_bf16", "f32_linear": "kernel_small_rows",
            "grouped_linear": "kernel_small_rows", "mxfp4_linear_gathered": "kernel_gemm",
            "mxfp4_swiglu_gathered": "kernel", "fp8_block_linear_shared": "kernel",
            "moe_experts": "routed_blocks"}

# (targets, model, batch_invariant, --kernel choices) -> (changes to DEFAULT, {target: extra flags})
CASES = [
    (("llvm-cpu",), TINY, False, {}, {}, {"llvm-cpu": ()}),
    (("llvm-cpu", "gfx942"), TINY, False, {}, {}, {"llvm-cpu": (), "gfx942": ()}),
    (("llvm-cpu",), FLASH, False, {}, CPU_BIG, {"llvm-cpu": ()}),
    (("llvm-cpu", "cuda"), FLASH, False, {}, {}, {"llvm-cpu": (), "cuda": ()}),
    (("gfx942",), FLASH, False, {}, GPU_ONLY, {"gfx942": ()}),
    (("gfx942", "cuda"), TINY, False, {"f32_linear": "kernel"}, {**GPU_ONLY, "f32_linear": "kernel"},
     {"gfx942": (), "cuda": ()}),
    (("cuda",), FLASH, True, {}, GPU_BI, {"cuda": ()}),
    (("gfx942", "cuda"), TINY, True, {}, GPU_BI, {"gfx942": (), "cuda": ()}),
    (("llvm-cpu",), FLASH, True, {}, CPU_BIG, {"llvm-cpu": ()}),  # llvm-cpu alone ignores --batch-invariant
    (("cuda",), FLASH, True, {"f32_linear": "reference"}, {**GPU_BI, "f32_linear": "reference"}, {"cuda": ()}),
    (("llvm-cpu",), FLASH, False, {"mxfp4_linear_gathered": "reference"}, {}, {"llvm-cpu": ()}),
    (("llvm-cpu", "cuda"), TINY, False, {"mxfp4_linear_gathered": "kernel"}, CPU_BIG,
     {"llvm-cpu": (), "cuda": (GPU_REDUCTION_FLAG,)}),
    (("cuda",), TINY, False, {"*": "reference"}, {n: "reference" for n in DEFAULT}, {"cuda": ()}),
    (("cuda",), TINY, True, {"*": "reference", "topk": "radix"}, {**{n: "reference" for n in DEFAULT}, "topk": "radix"},
     {"cuda": ()}),
    (("llvm-cpu",), TINY, False, {"*": "weight_only"},
     {n: "weight_only" for n in ("fp8_block_linear", "mxfp4_linear", "fp8_block_linear_stacked",
                                 "fp8_block_linear_shared", "mxfp4_linear_stacked")}, {"llvm-cpu": ()}),
]


@pytest.mark.parametrize("targets, cfg, bi, choices, changes, flags", CASES)
def test_plan_per_target(targets, cfg, bi, choices, changes, flags):
    plan = plan_lowering(ExportSpec(targets=targets, batch_invariant=bi, kernels=choices), cfg)
    assert dict(plan.kernels) == {**DEFAULT, **changes}
    assert dict(plan.flags) == flags


@pytest.mark.parametrize("targets", [("llvm-cpu",), ("llvm-cpu", "cuda")])
@pytest.mark.parametrize("choice", [{"mxfp4_linear_gathered": "kernel_gemm"}, {"mxfp4_swiglu_gathered": "kernel"},
                                    {"fp8_block_linear": "kernel_fp8_gemv"}])
def test_plan_refuses_the_subnormal_decodes_beside_llvm_cpu(targets, choice):
    """The gathered GEMMs' MXFP4 decode and the FP8 GEMV's e4m3fn decode pass through f32 subnormals, which
    IREE's CPU runtime flushes: an export with an llvm-cpu target refuses them, by name, instead of reading
    MXFP4 codes +-0.5 or e4m3fn subnormals as 0."""
    op, impl = next(iter(choice.items()))
    with pytest.raises(ValueError, match=f"{op}={impl}: decodes MXFP4 or FP8 through f32 subnormals.*GPU targets only"):
        plan_lowering(ExportSpec(targets=targets, kernels=choice), TINY)


def test_plan_flags_keep_the_extra_flags_first():
    spec = ExportSpec(targets=("llvm-cpu", "gfx942"), extra_flags=("--x",), kernels={"mxfp4_linear_gathered": "kernel"})
    assert dict(plan_lowering(spec, TINY).flags) == {"llvm-cpu": ("--x",), "gfx942": ("--x", GPU_REDUCTION_FLAG)}


def test_the_expert_size_threshold():
    assert routed_f32_bytes(FLASH) == 4 * 3 * 256 * 2048 * 4096  # 25.8 GB a layer
    assert routed_f32_bytes(TINY) < GATHER_COPY_LIMIT < routed_f32_bytes(FLASH)


def test_export_records_the_plan(monkeypatch, tmp_path):
    """config.json gets the plan (each target's kernels and flags) and its inputs, with tracing and
    compiling replaced (what they are given is recorded instead)."""
    from dsv4.export import exporter
    from dsv4.export.compile import CompileResult
    from dsv4.model.model import empty_model

    traced, compiled = [], {}

    def fake_build(run, model, state_spec, mlir_path, tag):
        traced.append(dict(run.plan.kernels))
        mlir_path.write_text("module {}\n")

    def fake_compile(mlir, target, vmfb, extra_flags=(), log_path=None):
        compiled[target.name] = list(extra_flags)
        vmfb.write_bytes(b"vmfb")
        return CompileResult(vmfb, 0.0, (*target.flags, *extra_flags), target.name)

    monkeypatch.setattr(exporter, "_build_mlir", fake_build)
    monkeypatch.setattr(exporter, "compile_mlir", fake_compile)
    spec = ExportSpec(targets=("cuda",), batch_sizes=(1,), batch_invariant=True, score=False,
                      kernels={"mxfp4_linear_gathered": "kernel"})
    cfg = TINY
    res = exporter.export_model(empty_model(cfg, torch.float32), spec, tmp_path / "out", weights=None)
    want = {**DEFAULT, **GPU_BI, "mxfp4_linear_gathered": "kernel"}
    assert traced == [want] and compiled == {"cuda": [GPU_REDUCTION_FLAG]}
    t = res.config["targets"]["cuda"]
    assert t["kernels"] == want and t["flags"][-1] == GPU_REDUCTION_FLAG
    assert res.config["lowering"] == {"batch_invariant": True, "overrides": {"mxfp4_linear_gathered": "kernel"}}
