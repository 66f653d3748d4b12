"""Linear layers over the checkpoint's weight formats (the FP8 block GEMM hook, docs/model.md, Reference numerics).

`linear(x, weight, scale)` dispatches on the weight's storage dtype:
  - bf16/fp32 weight, scale None: a plain matmul in x's dtype;
  - FP8 (float8_e4m3fn / float8_e4m3fnuz) [N, K] with 128x128 block scales: fp8_block_linear;
  - uint8 (or the checkpoint's int8) [N, K/2] packed MXFP4 with per-32 E8M0 scales: mxfp4_linear.

These are the torch references that eager runs and export lowers. They follow the reference
kernels' numerics: the activation is quantized per token per 128-K block to e4m3 with a power-of-two
scale, the weight is dequantized exactly (FP8/FP4 value x power-of-two scale is exact in fp32), and
the GEMM accumulates in fp32. Applying the scales before the dot product instead of per 128-K
partial sum (the reference's "2x accumulation") is the same math; only fp32 summation order differs.

Export-friendly by construction: weight bytes are decoded with integer ops and a float32 bitcast
(formats.fp8_decode / e2m1_decode), never a float8 -> float cast (which gfx942 cannot compile without
the emulation flag, docs/export.md, IREE 3.13 traps); no `.item()`, no branches on tensor values; shape checks use
static shapes only. Export does not trace these references by default: each quantized linear is
one kernel op (quant.mlir.jinja, docs/kernels.md), so `linear` / `stacked_linear` validate formats
and shapes before calling the hook (the kernel itself checks nothing).

The FP8 linears' kernel runs the reference's own arithmetic on the matrix cores (implementation
"kernel": when the rows are dynamic (prefill); the static-shape decode entry points get the
dequantized form with bf16 operands, which hold the decoded weight and the quantized activation
exactly (the decode hoisted to load time by the compiler); "kernel_fp8": always; "kernel_bf16" /
"kernel_f32": never, the latter with f32 operands): the activation as
e4m3 codes + power-of-two scales, FP8 x FP8 products summed in f32 per 128-K block, the block sums
times (activation scale x weight scale) added up in f32. Every FP8 product is exact and the scales
are powers of two, so this equals the dequantized form above up to fp32 summation order. The
activation is quantized whenever the weight is FP8, with or without `quant_sim` (which only
switches the KV / indexer simulations): FP8 activations are part of the reference's FP8 linear.
"""

from __future__ import annotations

import math
from typing import ContextManager

import torch
import torch.nn.functional as F

from ..quant.formats import (
    FP8_BLOCK,
    FP8_FORMATS,
    MXFP4_BLOCK,
    FormatError,
    dequant_fp8_block,
    dequant_mxfp4,
)
from . import KERNELS, kernel, overrides
from .qdq import block_qdq

__all__ = ["linear", "stacked_linear", "gathered_linear", "is_packed_mxfp4_stack", "f32_linear", "grouped_linear",
           "fp8_block_linear", "mxfp4_linear", "fp8_block_linear_stacked", "fp8_block_linear_shared",
           "mxfp4_linear_stacked", "mxfp4_linear_gathered", "fp8_act_qdq", "weight_only_linears"]

_PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_F = (torch.float32, torch.bfloat16)
_FP8 = tuple(FP8_FORMATS)
_BYTES = (torch.uint8, torch.int8)
_SCALES = (torch.uint8, torch.float8_e8m0fnu, torch.float32)
_MLIR = "quant.mlir.jinja"  # one template for the quantized linears (and the qdq kernels)
# The FP8 linears' MLIR GEMMs: "kernel_fp8" is the FP8 x FP8 block GEMM (matrix cores), "kernel_bf16" dequantizes
# the weight into a bf16 GEMM with f32 sums (exact operands; decode's form), "kernel_f32" into an f32 GEMM
# (the form before it; also what ragged N/K shapes always get)
# "kernel_rows16" (the FP8 linears and f32_linear): the dequantized GEMM's rows zero-padded to the next multiple
# of 16 above the row count (16 rows -> 32: a pad of none folds away and changes the fusion around the GEMM),
# so every row count runs one GPU GEMM schedule and a row's sums do not depend on the batch
# (`dsv4 export --batch-invariant`; docs/numerics.md)
_ROWS16 = {"kernel_rows16": {"row_tile": 16}}
# "kernel_small_rows" (the FP8 linears, f32_linear, grouped_linear; a GPU-only export's default, export/lowering.py):
# 2 to 4 static rows (a verify call's 1 + K tokens of one request, decode at batch 2-4) zero-padded to 8. IREE
# 3.13 compiles such a GEMM for cuda and gfx942 as one K-reduction per output element, which on the H100 made
# a one-row Flash-4 verify call (2 rows) 114 ms against 15.6 ms padded (docs/performance.md); 5 rows and more
# take the matrix cores, one row is a GEMV. llvm-cpu keeps the unpadded form: padded, its decode_bs4 no
# longer agreed bit for bit with decode_bs1 (tests/test_batch_invariance.py, the embedded default)
SMALL_ROWS = {"kernel_small_rows": {"small_row_tile": 8}}
# "kernel_fp8_gemv" (the FP8 linears, by `--kernel`, GPU targets only): kernel_small_rows, and a one-row GEMV (decode
# at batch 1) decodes the FP8 weight inside its own dispatch, reading 1 byte a weight plus the block scales, where
# the other forms read the bf16 copy the compiler hoists to load time (2 bytes a weight). Exact f32 products (the
# copy rounds those below 2^-126 to bf16); e4m3fn decodes through f32 subnormals (docs/kernels.md)
FP8_GEMV = {"kernel_fp8_gemv": {**SMALL_ROWS["kernel_small_rows"], "fp8_gemv": True}}
# "kernel_prefill_bf16" (the FP8 linear): kernel_small_rows, and a prefill (dynamic rows) takes the dequantized
# bf16 GEMM with its rows padded to 64 (matrix cores) instead of FP8 x FP8, the weight's bf16 decode hoisted
# to load time as decode's is. The same exact products, f32 sums in one K order
PREFILL_BF16 = {"kernel_prefill_bf16": {**SMALL_ROWS["kernel_small_rows"], "prefill_bf16": True}}
_GEMMS = {"kernel_f32": {"gemm": "f32"}, "kernel_bf16": {"gemm": "bf16"}, "kernel_fp8": {"gemm": "fp8"}, **_ROWS16}
# MXFP4: "kernel" (= "kernel_bf16") decodes to bf16 [N, K] for a bf16 GEMM with f32 sums (exact operands), "kernel_f32"
# an f32 multi-reduction (the form before; --batch-invariant keeps it: its decode rows agree at every batch size)
_MXFP4_GEMMS = {"kernel_bf16": {"gemm": "bf16"}, "kernel_f32": {"gemm": "f32"}}


def fp8_act_qdq(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Activation quantize->dequantize as the reference's act_quant (docs/model.md, Reference numerics), float32 out.

    Per token, per `block` of the last dim: s = 2^ceil(log2(max(amax, 1e-4) / 448)), q = e4m3(x / s)
    (RNE, saturating), returns q * s. A ragged last block is quantized over its own elements (zero
    padding changes neither amax nor the result). The dequantized values are the same whether a
    kernel stores q as e4m3fn or as e4m3fnuz with scale 2s (fnuz values are exactly fn values / 2).
    """
    k = x.shape[-1]
    nblk = math.ceil(k / block)
    xf = x.float()
    if nblk * block != k:
        xf = F.pad(xf, (0, nblk * block - k))
    return block_qdq(xf.unflatten(-1, (nblk, block)), fp4=False).flatten(-2)[..., :k]


# "weight_only": the quantized linears with the activation left in its float dtype (no FP8 activation
# quantization), the weight decoded exactly as in the references. Not the release's numerics: a
# verification mode. Activation quantization rounds ~10^5 values per token to e4m3, so one fp32
# summation-order difference that moves a value across a rounding boundary changes its code by 1/8
# and spreads through the next layers' roundings; on a random-weight Flash two correct paths (eager
# prefilled in one chunk or two) end up percents apart. Without it (and with --quant-sim off) the model
# is a continuous function and two implementations agree to their summation order, which is what
# `dsv4 export --kernel '*=weight_only'` + `dsv4 audit` checks (docs/numerics.md).


# One function per format serves both the [N, K] and the stacked [E, N, K] hooks (matmul broadcasts).
def _fp8_weight_only(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x.float(), dequant_fp8_block(weight, scale, FP8_BLOCK).transpose(-1, -2)).to(x.dtype)


def _mxfp4_weight_only(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x.float(), dequant_mxfp4(packed, scale).transpose(-1, -2)).to(x.dtype)


def weight_only_linears() -> ContextManager[None]:
    """Context: every quantized linear hook runs its `weight_only` alternative (eager's side of an export
    made with `--kernel '*=weight_only'`)."""
    return overrides({name: k.alternatives["weight_only"] for name, k in KERNELS.items()
                      if "weight_only" in k.alternatives})


def _check_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    """FP8 weight [..., N, K] with block scale [..., ceil(N/128), ceil(K/128)] for x [..., K]; raises."""
    if weight.dtype not in FP8_FORMATS:
        raise FormatError(f"{what}: weight must be float8_e4m3fn/fnuz, got {weight.dtype}")
    if scale.dtype not in _SCALES:
        raise FormatError(f"{what}: scale must be E8M0 (uint8 / float8_e8m0fnu) or float32, got {scale.dtype}")
    *lead, n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"{what}: x has K={x.shape[-1]}, weight is {tuple(weight.shape)}")
    want = (*lead, math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"{what}: scale shape {tuple(scale.shape)} != {want} for weight {tuple(weight.shape)}")


def _check_mxfp4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    """Packed MXFP4 [..., N, K/2] with E8M0 scale [..., N, K/32] for x [..., K]; raises."""
    if packed.dtype not in _BYTES:
        raise FormatError(f"{what}: packed weight must be uint8/int8, got {packed.dtype}")
    if scale.dtype not in _SCALES[:2]:
        raise FormatError(f"{what}: MXFP4 scales must be E8M0 (uint8 / float8_e8m0fnu), got {scale.dtype}")
    k = packed.shape[-1] * 2
    if x.shape[-1] != k:
        raise ValueError(f"{what}: x has K={x.shape[-1]}, packed weight {tuple(packed.shape)} holds K={k}")
    if k % MXFP4_BLOCK:
        raise ValueError(f"{what}: K={k} is not a multiple of {MXFP4_BLOCK}")
    want = (*packed.shape[:-1], k // MXFP4_BLOCK)
    if tuple(scale.shape) != want:
        raise ValueError(f"{what}: scale shape {tuple(scale.shape)} != {want} for packed weight {tuple(packed.shape)}")


@kernel("fp8_block_linear", args={"x": "..., K", "weight": "N, K", "scale": "NB, KB"}, results={"y": "..., N"},
        static=("N", "K", "NB", "KB"), dtypes={"x": _F, "weight": _FP8, "scale": _SCALES}, mlir=_MLIR,
        mlir_variants={**_GEMMS, **SMALL_ROWS, **FP8_GEMV, **PREFILL_BF16}, trace_sizes=("...",),
        alternatives={"weight_only": _fp8_weight_only})
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T for an FP8 block-quantized weight, reference numerics (docs/model.md, Reference numerics).

    x [..., K] bf16/fp32; weight [N, K] float8_e4m3fn or float8_e4m3fnuz (decoded per its dtype);
    scale [ceil(N/128), ceil(K/128)] E8M0 uint8 (or float8_e8m0fnu) or float32. fp32 GEMM, x.dtype out.
    """
    _check_fp8(x, weight, scale, "fp8_block_linear")
    w = dequant_fp8_block(weight, scale, FP8_BLOCK)
    return F.linear(fp8_act_qdq(x, FP8_BLOCK), w).to(x.dtype)


@kernel("mxfp4_linear", args={"x": "..., K", "packed": "N, KP", "scale": "N, KS"}, results={"y": "..., N"},
        static=("N", "K", "KP", "KS"), dtypes={"x": _F, "packed": _BYTES, "scale": _SCALES[:2]}, mlir=_MLIR,
        mlir_variants=_MXFP4_GEMMS, alternatives={"weight_only": _mxfp4_weight_only})
def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T for an MXFP4 expert weight, as the reference fp4_gemm (docs/model.md, Reference numerics).

    x [..., K]; packed uint8/int8 [N, K/2] (low nibble = element 2i); scale E8M0 uint8 [N, K/32].
    The activation is FP8-quantized per 128-K block; the FP4 weight is decoded in-kernel with bit ops
    and scaled per 32 (exact in fp32); fp32 accumulate; x.dtype out.
    """
    _check_mxfp4(x, packed, scale, "mxfp4_linear")
    w = dequant_mxfp4(packed, scale)
    return F.linear(fp8_act_qdq(x, FP8_BLOCK), w).to(x.dtype)


@kernel("f32_linear", args={"x": "..., K", "weight": "N, K"}, results={"y": "..., N"}, static=("N", "K"),
        dtypes={"x": _F, "weight": _F}, result_dtypes={"y": torch.float32}, mlir="dense.mlir.jinja",
        mlir_variants={**_ROWS16, **SMALL_ROWS}, trace_sizes=("...",))
def f32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T in float32 for a float weight: the router gate, the compressors' projections and the
    mHC mixes, which the reference runs in fp32 on a bf16 activation. The kernel keeps the operands
    bf16 where that is exact (an fp32 weight as three bf16 terms; dense.mlir.jinja), so GPUs run it
    on the matrix cores; every product is exact and the sums are f32."""
    return F.linear(x.float(), weight.float())


@kernel("grouped_linear", args={"x": "..., G, K", "weight": "G, N, K"}, results={"y": "..., G, N"},
        static=("G", "N", "K"), dtypes={"x": _F, "weight": _F}, mlir="grouped.mlir.jinja", mlir_variants=SMALL_ROWS,
        trace_sizes=("...",))
def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y[..., g, :] = x[..., g, :] @ weight[g]^T in x's dtype (the attention's grouped output projection
    wo_a, docs/model.md, Forward pass): x [..., G, K], weight [G, N, K] of x's dtype. The kernel sums in
    f32 and pads a prefill's rows so GPUs run it on the matrix cores (grouped.mlir.jinja): on the H200 a
    Flash-4 prefill of 8 rows fills 1.6x faster with it, decode the same (docs/performance.md). A non-finite
    decode row once blamed on it was sparse attention's (K not a multiple of 16)."""
    if weight.dtype != x.dtype or weight.dim() != 3 or x.shape[-2:] != (weight.shape[0], weight.shape[2]):
        raise ValueError(f"grouped_linear: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} "
                         f"{weight.dtype} ([..., G, K] and [G, N, K] of one dtype)")
    return torch.einsum("...gk,gnk->...gn", x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch on the weight's storage dtype (see the module docstring); unknown combos raise TypeError."""
    if weight.dtype in FP8_FORMATS:
        if scale is None:
            raise TypeError(f"linear: {weight.dtype} weight needs its block scale")
        _check_fp8(x, weight, scale, "linear")
        return fp8_block_linear(x, weight, scale)
    if weight.dtype in (torch.uint8, torch.int8):
        if scale is None:
            raise TypeError("linear: packed MXFP4 (uint8/int8) weight needs its E8M0 scale")
        _check_mxfp4(x, weight, scale, "linear")
        return mxfp4_linear(x, weight, scale)
    if weight.dtype in _PLAIN_DTYPES:
        if scale is not None:
            raise TypeError(f"linear: a scale was given for an unquantized {weight.dtype} weight")
        return F.linear(x, weight.to(x.dtype))
    raise TypeError(f"linear: unsupported weight dtype {weight.dtype} (scale {None if scale is None else scale.dtype})")


@kernel("fp8_block_linear_stacked", args={"x": "E, M, K", "weight": "E, N, K", "scale": "E, NB, KB"},
        results={"y": "E, M, N"}, static=("N", "K", "NB", "KB"), dtypes={"x": _F, "weight": _FP8, "scale": _SCALES},
        mlir=_MLIR, mlir_variants=_GEMMS, trace_sizes=("E", "M"), alternatives={"weight_only": _fp8_weight_only})
def fp8_block_linear_stacked(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8_block_linear per expert: x [E, M, K], weight [E, N, K] FP8, scale [E, ceil(N/128), ceil(K/128)]
    -> [E, M, N] in x.dtype; out[e] == fp8_block_linear(x[e], weight[e], scale[e]) up to fp32 summation order."""
    _check_fp8(x, weight, scale, "fp8_block_linear_stacked")
    w = dequant_fp8_block(weight, scale, FP8_BLOCK)
    return torch.matmul(fp8_act_qdq(x, FP8_BLOCK), w.transpose(1, 2)).to(x.dtype)


@kernel("fp8_block_linear_shared", args={"x": "M, K", "weight": "E, N, K", "scale": "E, NB, KB"},
        results={"y": "E, M, N"}, static=("N", "K", "NB", "KB"), dtypes={"x": _F, "weight": _FP8, "scale": _SCALES},
        mlir=_MLIR, mlir_variants={"kernel_fp8_gemv": {"fp8_gemv": True}}, trace_sizes=("M",),
        alternatives={"weight_only": _fp8_weight_only})
def fp8_block_linear_shared(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8_block_linear_stacked of one x [M, K] for every weight of the stack [E, N, K] -> [E, M, N] in x.dtype
    (the shared expert's w1 and w3 at decode, layers.stacked_pair). The kernel quantizes x once and its
    GEMM reads it for every e: as an [E, M, K] broadcast the copy was a dispatch a layer at batch 64."""
    return fp8_block_linear_stacked(x.expand(weight.shape[0], *x.shape), weight, scale)


@kernel("mxfp4_linear_stacked", args={"x": "E, M, K", "packed": "E, N, KP", "scale": "E, N, KS"},
        results={"y": "E, M, N"}, static=("N", "K", "KP", "KS"), dtypes={"x": _F, "packed": _BYTES, "scale": _SCALES[:2]},
        mlir=_MLIR, mlir_variants=_MXFP4_GEMMS, trace_sizes=("M",), alternatives={"weight_only": _mxfp4_weight_only})
def mxfp4_linear_stacked(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """mxfp4_linear per expert: x [E, M, K], packed [E, N, K/2], scale [E, N, K/32] -> [E, M, N] in x.dtype."""
    _check_mxfp4(x, packed, scale, "mxfp4_linear_stacked")
    w = dequant_mxfp4(packed, scale)
    return torch.matmul(fp8_act_qdq(x, FP8_BLOCK), w.transpose(1, 2)).to(x.dtype)


_EAGER_DECODE_BYTES = 2 << 30
# "kernel" reads the selected experts in place inside one sequential f32 reduction; "kernel_gemm" gathers,
# decodes and runs the stacked kernel's bf16 GEMM in one dispatch (quant.mlir.jinja), on the matrix cores;
# its row blocks decode through f32 subnormals, exact on the GPUs only (export/lowering.py, Rule.gpu_only)
_GATHERED_GEMMS = {"kernel_gemm": {"gathered_gemm": True}}


@kernel("mxfp4_linear_gathered", args={"x": "G, M, K", "packed": "E, N, KP", "scale": "E, N, KS", "sel": "G",
                                        "x_quantized": int},
        results={"y": "G, M, N"}, static=("E", "N", "K", "KP", "KS"),
        dtypes={"x": _F, "packed": _BYTES, "scale": _SCALES[:2], "sel": (torch.int64,)}, mlir=_MLIR,
        mlir_variants=_GATHERED_GEMMS, trace_sizes=("M",))
def mxfp4_linear_gathered(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, sel: torch.Tensor,
                          x_quantized: int) -> torch.Tensor:
    """mxfp4_linear_stacked on the experts `sel` names: x [G, M, K], packed [E, N, K/2], scale [E, N, K/32],
    sel [G] int64 in [0, E) -> [G, M, N] in x.dtype; out[g] == mxfp4_linear(x[g], packed[sel[g]], scale[sel[g]]).
    The kernel reads the selected experts' bytes in place (no gathered or decoded copy of the weights).
    x_quantized 1: the caller promises x is fp8_act_qdq's values already (it quantized each token once,
    before copying its rows into the blocks), and the MLIR kernels use x as it is. This reference quantizes
    either way, which returns such an x unchanged, so every lowering without the kernels (llvm-cpu's) runs
    the GEMM it ran before."""
    _check_mxfp4(x, packed, scale, "mxfp4_linear_gathered")
    G, per = sel.shape[0], packed.shape[1] * packed.shape[2] * 8  # f32 bytes of one decoded expert
    step = max(1, _EAGER_DECODE_BYTES // per)
    if isinstance(G, int) and G > step and not torch.compiler.is_exporting():
        # eager / torch.compile: bound the decoded copies (a 512-token Flash prefill gathers ~570 experts,
        # 19 GB of f32); each expert's product is independent, so the chunks give the same result
        return torch.cat([mxfp4_linear_gathered(x[g:g + step], packed, scale, sel[g:g + step], x_quantized)
                          for g in range(0, G, step)])
    return mxfp4_linear_stacked(x, packed.index_select(0, sel), scale.index_select(0, sel))


def is_packed_mxfp4_stack(weight: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """A stack of packed MXFP4 experts ([E, N, K/2] bytes with their scales): what the gathered kernels take."""
    return weight.dtype in _BYTES and scale is not None and weight.dim() == 3


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, sel: torch.Tensor,
                    x_quantized: bool = False) -> torch.Tensor:
    """`stacked_linear(x, weight[sel], scale[sel])`: x [G, M, K], weight [E, O, K(/2)] in any format
    `linear` takes, sel [G] int64 -> [G, M, O] in x.dtype. Packed MXFP4 (the released experts) goes
    through `mxfp4_linear_gathered`, which never materializes the selected weights (and, with
    `x_quantized`, takes x as fp8_act_qdq's values already); other formats gather first (FP8 bytes move
    as uint8: a gather is data movement only)."""
    if x.dim() != 3 or sel.dim() != 1 or sel.shape[0] != x.shape[0]:
        raise ValueError(f"gathered_linear: x {tuple(x.shape)} must be [G, M, K] with sel [G], got sel {tuple(sel.shape)}")
    if is_packed_mxfp4_stack(weight, scale):
        _check_mxfp4(x, weight, scale, "gathered_linear")
        return mxfp4_linear_gathered(x, weight, scale, sel, int(x_quantized))
    if weight.dtype in FP8_FORMATS:
        weight = weight.view(torch.uint8).index_select(0, sel).view(weight.dtype)
    else:
        weight = weight.index_select(0, sel)
    return stacked_linear(x, weight, None if scale is None else scale.index_select(0, sel))


def stacked_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` for a stack of weights at once: x [N, K] or [E, N, K], weight [E, O, K(/2)] in any format
    `linear` takes (scales stacked [E, ...]) -> [E, N, O] in x.dtype; out[e] == linear(x or x[e], weight[e],
    scale[e]) up to fp32 summation order. One dequantize for all E (the MoE reference: a per-expert loop
    traces E times as many graph nodes). A 3-D x goes through the stacked kernel hooks (one graph node
    each in export); a shared 2-D x (the eager all-experts reference, the shared expert's decode pair)
    goes through `fp8_block_linear_shared` for FP8 weights, whose reference is the stacked hook on the
    [E, N, K] broadcast, and is broadcast (a view) for MXFP4, so both forms run the same hooks."""
    if weight.dim() != 3:
        raise ValueError(f"stacked_linear: weight must be [E, O, K], got {tuple(weight.shape)}")
    if weight.dtype in FP8_FORMATS or weight.dtype in (torch.uint8, torch.int8):
        if scale is None:
            raise TypeError(f"stacked_linear: {weight.dtype} weight needs its scale")
        fp8 = weight.dtype in FP8_FORMATS
        (_check_fp8 if fp8 else _check_mxfp4)(x, weight, scale, "stacked_linear")
        if x.dim() == 3 and x.shape[0] != weight.shape[0]:
            raise ValueError(f"stacked_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} differ in E")
        if x.dim() == 2 and fp8:
            return fp8_block_linear_shared(x, weight, scale)
        if x.dim() == 2:  # a view: the hook quantizes E copies, a few MB beside the E decoded weights
            x = x.expand(weight.shape[0], *x.shape)
        return (fp8_block_linear_stacked if fp8 else mxfp4_linear_stacked)(x, weight, scale)
    if weight.dtype in _PLAIN_DTYPES:
        if scale is not None:
            raise TypeError(f"stacked_linear: a scale was given for an unquantized {weight.dtype} weight")
        return torch.matmul(x, weight.to(x.dtype).transpose(1, 2))
    raise TypeError(f"stacked_linear: unsupported weight dtype {weight.dtype}")
