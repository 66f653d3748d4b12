"""The lowering policy: which implementation every hot spot gets in an export, and the compile flags
that choice implies, decided in one place (`plan_lowering`) from one table (`RULES`).

A hot spot (model/kernels, ``Kernel``) offers implementations: its torch reference, torch alternatives,
its MLIR kernel and the kernel's variants. An export traces one of them per op:

1. the op's ``default`` (why each is what it is: the comment on its row);
2. on a GPU export with ``--batch-invariant``, the op's ``batch_invariant`` form: the GEMMs pad their
   rows to a 16-row tile (kernel_rows16) so a GPU runs one GEMM schedule for every decode batch size
   (docs/numerics.md). llvm-cpu is batch-invariant without them and not with them, so an
   llvm-cpu-only export ignores the flag (and ExportSpec refuses llvm-cpu beside a GPU target with it);
3. on an export whose targets are all GPUs, the op's ``gpu`` form: the GEMMs pad 2 to 4 static rows to 8
   (kernel_small_rows), which IREE otherwise compiles off the matrix cores (a one-row verify call of
   Flash-4 on the H100: 114 ms unpadded, 15.6 ms padded). llvm-cpu's decode is bitwise the same at every
   batch size only unpadded, so an export with llvm-cpu beside a GPU keeps the unpadded GEMMs for both;
4. on an llvm-cpu-only export whose routed experts pass GATHER_COPY_LIMIT a layer in f32, the op's
   ``cpu_big_experts`` form: reading the experts in place instead of gathering them first (the gather
   makes IREE write an f32 copy of every routed block's weights, 27 GB per Flash layer for a 100-token
   prefill; at the embedded default's size the gather is 2x faster). GPU targets keep the gather:
   their compile of the in-place kernel needs a flag that changes every reduction (``gpu_flags``);
5. the user's ``--kernel OP=IMPL`` choices on top ('*=IMPL' first, for every op offering IMPL, then
   the named ops): an explicit choice always wins, except that an export with an llvm-cpu target
   refuses the ``gpu_only`` implementations: they decode MXFP4 through f32 subnormals, which IREE's
   CPU runtime flushes to zero (the GPUs keep them).

config.json records the result per target ("kernels", and the flags in "flags"); ``--kernel``'s help
is generated from the same table.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from dsv4.model import kernels as mk

from .compile import GPU_REDUCTION_FLAG

if TYPE_CHECKING:
    from .spec import ExportSpec

__all__ = ["GATHER_COPY_LIMIT", "LoweringPlan", "RULES", "Rule", "kernel_help", "plan_lowering",
           "resolve_kernels", "routed_f32_bytes"]

# an llvm-cpu-only export reads the routed experts in place when one layer's routed experts would take
# more than this in f32 (the gather's copy is about that large per prefill call); below it the gather
# is faster (docs/performance.md: 2x llvm-cpu prefill on the embedded default)
GATHER_COPY_LIMIT = 1 << 30


def routed_f32_bytes(cfg: Any) -> int:
    """One layer's routed expert weights (w1, w3, w2) in f32: what gathering them before the GEMM copies."""
    return 4 * 3 * cfg.n_routed_experts * cfg.moe_intermediate_size * cfg.hidden_size


@dataclass(frozen=True)
class Rule:
    """One op's lowering: `default` everywhere, unless a condition below names another implementation."""

    default: str
    batch_invariant: str | None = None  # a GPU export with --batch-invariant
    gpu: str | None = None  # an export whose targets are all GPUs (without --batch-invariant)
    cpu_big_experts: str | None = None  # an llvm-cpu-only export with routed experts over GATHER_COPY_LIMIT
    gpu_flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # impl -> flags a GPU compile needs
    gpu_only: tuple[str, ...] = ()  # implementations exact only on targets that keep subnormal floats


RULES: dict[str, Rule] = {
    "radix_threshold": Rule("kernel"),
    # the top-k's and the routed MoE's N x N compare-and-counts in the form aggressive fusion compiles for the GPUs
    "pair_rank": Rule("kernel"),
    # keeps producers out of two counts whose fused GPU code IREE 3.13 fails to generate
    "fusion_barrier": Rule("kernel"),
    "topk": Rule("select"),  # exact rank/radix select: dodges an IREE miscompile of the reference's lowering
    "indexer_scores": Rule("kernel"),
    "fp8_qdq": Rule("kernel"),
    "fp4_qdq": Rule("kernel"),
    "hadamard": Rule("kernel"),
    # GPUs: 2 to 4 rows padded to 8; decode's one-row GEMVs read the bf16 copy made at load time, and so does
    # a prefill's GEMM, its rows padded to 64 (kernel_prefill_bf16: Flash-4 on the H200 fills 8 rows at 11.4k
    # instead of 8.2k tokens/s against FP8 x FP8). kernel_fp8_gemv (the GEMV reading the FP8 bytes: 0.4 GB
    # less a Flash-4 step) made batch 1 18-25 % slower on two H100s (docs/performance.md, Timed on one H100), with
    # the decode it had then; it now decodes e4m3fn through f32 subnormals, hence GPU targets only (the shared
    # pair's form, fp8_block_linear_shared=kernel_fp8_gemv, keeps the bit-by-bit decode, exact on llvm-cpu too)
    "fp8_block_linear": Rule("kernel", batch_invariant="kernel_rows16", gpu="kernel_prefill_bf16",
                             gpu_only=("kernel_fp8_gemv",)),
    "mxfp4_linear": Rule("kernel"),
    "f32_linear": Rule("kernel", batch_invariant="kernel_rows16", gpu="kernel_small_rows"),
    # wo_a: the kernel is 1.6x a Flash-4 prefill on the H200; batch-invariant exports keep the einsum,
    # the form cuda's bitwise check ran with
    "grouped_linear": Rule("kernel", batch_invariant="reference", gpu="kernel_small_rows"),
    "fp8_block_linear_stacked": Rule("kernel", batch_invariant="kernel_rows16"),
    # GPUs: x quantized once, read for every e. Elsewhere the reference, the stacked kernel on an [E, M, K]
    # broadcast: the form llvm-cpu's and --batch-invariant's bitwise decode checks ran with
    "fp8_block_linear_shared": Rule("reference", batch_invariant="reference", gpu="kernel"),
    # the f32 form's one-row (bs1) and 16-row-block (bs8+) GEMMs agree bit for bit; the bf16 GEMM's do not
    "mxfp4_linear_stacked": Rule("kernel", batch_invariant="kernel_f32"),
    # GPUs: the gather inside the GEMM's dispatch, no copy of the routed experts (batch-invariant exports
    # keep the gather and the stacked kernel's f32 form). The sequential "kernel" needs a flag on GPU
    # targets: reductions that gather fail in ReductionVectorDistribution
    "mxfp4_linear_gathered": Rule("reference", batch_invariant="reference", gpu="kernel_gemm",
                                  cpu_big_experts="kernel", gpu_flags={"kernel": (GPU_REDUCTION_FLAG,)},
                                  gpu_only=("kernel_gemm",)),
    # the gathered GEMM's form with the SwiGLU epilogue: where mxfp4_linear_gathered takes kernel_gemm
    "mxfp4_swiglu_gathered": Rule("reference", batch_invariant="reference", gpu="kernel", gpu_only=("kernel",)),
    "hc_sinkhorn": Rule("kernel"),
    "rms_norm": Rule("kernel"),
    # reads only the selected experts' weights; GPUs: decode batches over 24 pairs in 16-row blocks read in place
    "moe_experts": Rule("routed", batch_invariant="routed", gpu="routed_blocks"),
    # the reference's cuda lowering made NaN rows at Flash dimensions; bitwise across cuda batch sizes
    "sparse_attention": Rule("kernel"),
    "sparse_attention_rows": Rule("kernel"),  # the same kernel over two tables read in place (decode)
}


def _check_rules() -> None:
    """Every declared kernel has a row, and every row names implementations its kernel offers."""
    if set(RULES) != set(mk.KERNELS):
        raise RuntimeError(f"export/lowering.py RULES and the declared kernels differ: "
                           f"{sorted(set(RULES) ^ set(mk.KERNELS))}")
    for name, rule in RULES.items():
        for impl in (rule.default, rule.batch_invariant, rule.gpu, rule.cpu_big_experts, *rule.gpu_flags, *rule.gpu_only):
            if impl is not None:
                mk.KERNELS[name].check_impl(impl)


_check_rules()


def resolve_kernels(choices: Mapping[str, str] | None = None, registry: Mapping[str, mk.Kernel] | None = None,
                    base: Mapping[str, str] | None = None) -> dict[str, str]:
    """{op: implementation} for every op of `registry` (default: the model's): `base` (default: the
    table's defaults; 'reference' for another registry), then `choices` ('*' first, for every op that
    offers the implementation, then the named ops). Unknown ops or implementations raise ValueError."""
    reg = mk.KERNELS if registry is None else registry
    if base is None:
        base = {n: r.default for n, r in RULES.items()} if reg is mk.KERNELS else {}
    out = {n: base.get(n, "reference") for n in reg}
    choices = dict(choices or {})
    star = choices.pop("*", None)
    if star is not None:
        offering = [n for n, k in reg.items() if star in k.impls]
        if not offering:
            raise ValueError(f"no kernel op offers implementation {star!r} ('*={star}')")
        out.update({n: star for n in offering})
    for name, impl in choices.items():
        if name not in reg:
            raise ValueError(f"unknown kernel op {name!r}; ops: {', '.join(reg)}")
        reg[name].check_impl(impl)
        out[name] = impl
    return out


@dataclass(frozen=True)
class LoweringPlan:
    """What an export traces and compiles with: `kernels` {op: implementation} (every op) and `flags`
    {target name: the compile flags beyond the target's own: the spec's extra flags, then those the
    chosen implementations need}."""

    kernels: Mapping[str, str]
    flags: Mapping[str, tuple[str, ...]]


def plan_lowering(spec: "ExportSpec", cfg: Any) -> LoweringPlan:
    """The lowering of every op for `spec`'s targets and options on the model `cfg` (module docstring)."""
    gpu = any(t.name != "llvm-cpu" for t in spec.targets)
    gpu_only = all(t.name != "llvm-cpu" for t in spec.targets)
    big = not gpu and routed_f32_bytes(cfg) > GATHER_COPY_LIMIT
    base = {}
    for name, rule in RULES.items():
        picked = rule.batch_invariant if gpu and spec.batch_invariant else None
        picked = picked or (rule.gpu if gpu_only else None)
        picked = picked or (rule.cpu_big_experts if big else None)
        base[name] = picked or rule.default
    kernels = resolve_kernels(dict(spec.kernels), base=base)
    if not gpu_only:
        cpu_bad = [f"{n}={i}" for n, i in kernels.items() if i in RULES[n].gpu_only]
        if cpu_bad:
            raise ValueError(f"--kernel {', '.join(cpu_bad)}: decodes MXFP4 or FP8 through f32 subnormals, which IREE's "
                             f"llvm-cpu runtime flushes to zero (MXFP4 codes +-0.5 and e4m3fn subnormals would read as 0); "
                             f"GPU targets only")
    flags = {}
    for t in spec.targets:
        implied = [f for n, i in kernels.items() for f in RULES[n].gpu_flags.get(i, ())] if t.name != "llvm-cpu" else []
        flags[t.name] = tuple(dict.fromkeys([*spec.extra_flags, *implied]))
    return LoweringPlan(kernels, flags)


def kernel_help() -> str:
    """`dsv4 export --kernel`'s help, from RULES: the usual implementation, the exceptions, the conditions."""
    usual = Counter(r.default for r in RULES.values()).most_common(1)[0][0]
    odd = ", ".join(f"{n}={r.default}" for n, r in RULES.items() if r.default != usual)

    def when(attr: str) -> str:
        picks = ((n, getattr(r, attr)) for n, r in RULES.items())
        return ", ".join(f"{n}={'/'.join(v) if isinstance(v, tuple) else v}" for n, v in picks if v)

    return (f"lower hot spot OP with IMPL, repeatable; '*=IMPL' for every op offering it (a wrong OP or IMPL "
            f"lists the choices). Plan (export/lowering.py): {usual} for every op but {odd}; on a GPU with "
            f"--batch-invariant {when('batch_invariant')}; on GPUs only (no llvm-cpu target) {when('gpu')}; on llvm-cpu alone with routed experts over 1 GiB a "
            f"layer in f32 {when('cpu_big_experts')}; never with an llvm-cpu target {when('gpu_only')}")
