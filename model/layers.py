"""The weight-holding layers shared by attention, the experts and the head: RMSNorm, the Linear in
the checkpoint's formats (bf16, or FP8 + block scales, dequantized at use by kernels.linear), Head."""

from __future__ import annotations

import math

import torch
from torch import nn

from .kernels.linear import f32_linear, linear
from .kernels.norm import rms_norm
from .quant.formats import FP8_BLOCK

__all__ = ["RMSNorm", "Linear", "Head"]


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


class Head(nn.Linear):
    """The output head: fp32 logits = x W^T through f32_linear (fp32 products and sums). W [vocab, d] is
    held in the model's dtype: checkpoints store it bf16 (docs/model.md, Checkpoint format; the reference upcasts it to fp32,
    which changes no value), and with the normed x bf16 too the GPU kernel is one bf16 GEMM on the
    matrix cores with exact products, reading half the bytes of an fp32 copy."""

    def __init__(self, d: int, vocab: int, dtype: torch.dtype):
        super().__init__(d, vocab, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return f32_linear(x, self.weight)
