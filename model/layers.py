"""The weight-holding layers shared by attention, the experts and the head: RMSNorm, the Linear in
the checkpoint's formats (bf16, or FP8 + block scales, dequantized at use by kernels.linear), Head."""

from __future__ import annotations

import math

import torch
from torch import nn

from .kernels.linear import f32_linear, linear, stacked_linear
from .kernels.norm import rms_norm
from .quant.formats import FP8_BLOCK

__all__ = ["RMSNorm", "Linear", "Head", "linear_pair", "fused_pair"]


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w in fp32, returned in x's dtype (weight kept fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            return rms_norm(x, self.weight, self.eps)
        # the kernel takes [B, T, D]: other ranks (the MTP block's streams [B, T, n, D]) fold into T
        return rms_norm(x.flatten(1, -2), self.weight, self.eps).view(x.shape)


class Linear(nn.Module):
    """y = x W^T with W in the checkpoint's format.

    quant=None: W in `dtype`. quant="fp8": W float8_e4m3fn [out, in] + `scale` [ceil(out/128),
    ceil(in/128)] (uint8 E8M0, or float32 for -Base checkpoints). Low-bit weights stay low-bit;
    kernels.linear dequantizes at use.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, quant: str | None = None,
                 scale_dtype: torch.dtype = torch.uint8):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if quant is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
            self.register_parameter("scale", None)
        elif quant == "fp8":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                       requires_grad=False)
            sshape = (math.ceil(out_features / FP8_BLOCK), math.ceil(in_features / FP8_BLOCK))
            self.scale = nn.Parameter(torch.empty(sshape, dtype=scale_dtype), requires_grad=False)
        else:
            raise ValueError(f"unknown linear quantization {quant!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.scale)


def linear_pair(x: torch.Tensor, a: Linear, b: Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(a(x), b(x)) as one GEMM over the two weights side by side, split after: one dispatch and one
    activation quantization where the two linears of one input were two each (IREE computes the
    concatenated weight once, at load). Each output column is the dot product it was. Only for a
    symbolic row count (a prefill), whose column slices IREE fuses into their consumers: a static count
    of more rows (a decode batch) got each slice copied apart (a strided copy, a dispatch each: Flash-4
    decode_bs64 went 318 -> 326 dispatches), and fusing only one-row decodes would give decode_bs1 other
    GEMMs than the batched decodes, which --batch-invariant exports must match bit for bit. Two
    linears whose formats differ, or whose FP8 scale blocks would straddle the seam, stay two GEMMs."""
    fp8 = a.scale is not None
    if a.weight.dtype != b.weight.dtype or fp8 != (b.scale is not None):
        return a(x), b(x)
    if all(isinstance(n, int) for n in x.shape):
        if torch.compiler.is_exporting() and a.out_features == b.out_features:
            return stacked_pair(x, a, b)
        return a(x), b(x)
    if fp8 and a.out_features % FP8_BLOCK:
        return a(x), b(x)
    return fused_pair(x, a, b)


def _paired_weights(a: Linear, b: Linear, join) -> tuple[torch.Tensor, torch.Tensor | None]:
    """a's and b's weights (and FP8 scales) joined by `join` (torch.cat or torch.stack); FP8 bytes move as
    uint8 (a copy is data movement only)."""
    if a.scale is None:
        return join([a.weight, b.weight]), None
    w = join([a.weight.view(torch.uint8), b.weight.view(torch.uint8)]).view(a.weight.dtype)
    return w, join([a.scale, b.scale])


def fused_pair(x: torch.Tensor, a: Linear, b: Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """linear_pair's one GEMM (for two linears of one format, a's FP8 scale blocks ending at its last row)."""
    y = linear(x, *_paired_weights(a, b, torch.cat))
    return y[..., :a.out_features], y[..., a.out_features:]


def stacked_pair(x: torch.Tensor, a: Linear, b: Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """linear_pair for a decode's static rows and two weights of one shape: one stacked GEMM [2, rows, out]
    whose halves are contiguous (no column slices to copy). Exports only: eager keeps the two linears,
    whose values the stacked form equals up to the fp32 summation order."""
    y = stacked_linear(x.reshape(-1, x.shape[-1]), *_paired_weights(a, b, torch.stack))
    return y[0].view(*x.shape[:-1], -1), y[1].view(*x.shape[:-1], -1)


class Head(nn.Linear):
    """The output head: fp32 logits = x W^T through f32_linear (fp32 products and sums). W [vocab, d] is
    held in the model's dtype: checkpoints store it bf16 (docs/model.md, Checkpoint format; the reference upcasts it to fp32,
    which changes no value), and with the normed x bf16 too the GPU kernel is one bf16 GEMM on the
    matrix cores with exact products, reading half the bytes of an fp32 copy."""

    def __init__(self, d: int, vocab: int, dtype: torch.dtype):
        super().__init__(d, vocab, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return f32_linear(x, self.weight)
