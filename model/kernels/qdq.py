"""In-graph quantize->dequantize (value domain) with power-of-two block scales (docs/model.md, Reference numerics).

The roundings the reference simulates: e4m3 (FP8) for the linears' activations and the KV nope
dims, e2m1 (FP4) for the indexer's queries and keys, and the Walsh-Hadamard transform in front of
the FP4 one. `quant_sim` is the model-facing API (the straight-through estimator for training);
the torch references live here so the kernels can be declared beside them (`fp8_qdq`, `fp4_qdq`,
`hadamard`; MLIR in quant.mlir.jinja, shared with the quantized linears).

Rounding is written with arithmetic (floor/log2/round) instead of dtype casts: it is bit-identical
to torch's round-to-nearest-even casts (tests/test_model_modules.py sweeps every code), and unlike
an f32->f8 cast it lowers the same way on every IREE target (llvm-cpu flushes part of the e4m3
subnormal band to zero and gfx942 has no native OCP e4m3; see docs/export.md, IREE 3.13 traps). The MLIR kernels run
the same float ops (amax, the divisions, round-half-even, the products) but take the powers of two
from exponent bits: IREE's llvm-cpu exp2 is a polynomial, so the traced reference, compiled, missed
eager in 25 % of fp32 fp8_qdq outputs; the kernels equal eager bitwise, in one graph node instead
of ~25 (tests/test_quant_kernels.py).
"""

from __future__ import annotations

import torch

from ..quant.formats import E2M1_MAX, E4M3_MAX
from . import kernel

__all__ = ["FP8_AMAX_FLOOR", "FP4_AMAX_FLOOR", "round_to_e4m3", "round_to_e2m1",
           "pow2_block_scale", "block_qdq", "fp8_qdq", "fp4_qdq", "hadamard"]

FP8_AMAX_FLOOR = 1e-4  # the reference act_quant's amax floor (also the KV simulation's)
FP4_AMAX_FLOOR = E2M1_MAX * 2.0**-126

_F = (torch.float32, torch.bfloat16)
_MLIR = "quant.mlir.jinja"
# The three hooks below work on the last dim of any tensor; their kernels take x as [B, S, H, D]
# (quant_sim.py adapts the rank): flattening the leading dims in torch would merge symbolic sizes
# such as a compressor's T // m + 1 entries, which makes torch.export emit guards it cannot prove.


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest OCP e4m3fn value (ties to even), saturating at +-448."""
    x = x.clamp(-E4M3_MAX, E4M3_MAX)
    a = x.abs()
    # exponent of the binade (e4m3: 3 mantissa bits, min normal 2^-6, subnormal step 2^-9)
    e = torch.floor(torch.log2(a.clamp_min(2.0**-6)))
    step = torch.exp2(e - 3)
    return torch.round(x / step) * step


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest e2m1 value {0,.5,1,1.5,2,3,4,6} (ties to even), saturating at +-6."""
    x = x.clamp(-E2M1_MAX, E2M1_MAX)
    a = x.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    return torch.round(x / step) * step


def pow2_block_scale(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """The reference's E8M0 activation scale: 2^ceil(log2(amax / fmt_max)), exactly (the reference reads
    the exponent bits: fast_log2_ceil). A float32 log2 rounds a ratio within an ulp above a power of two
    down onto it, so the candidate is corrected with exact comparisons against the ratio."""
    r = amax / fmt_max
    s = torch.exp2(torch.ceil(torch.log2(r)))
    s = torch.where(s < r, s * 2, s)
    return torch.where(s * 0.5 >= r, s * 0.5, s)


def block_qdq(xb: torch.Tensor, fp4: bool) -> torch.Tensor:
    """fp32 blocks [..., nblk, block] -> quantize->dequantize per block (last dim), fp32:
    s = pow2_block_scale(max(amax, floor)), round(x / s) * s in e4m3 (fp4=False) or e2m1."""
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR if fp4 else FP8_AMAX_FLOOR)
    s = pow2_block_scale(amax, E2M1_MAX if fp4 else E4M3_MAX)
    return (round_to_e2m1(xb / s) if fp4 else round_to_e4m3(xb / s)) * s


@kernel("fp8_qdq", args={"x": "B, S, H, D", "block": int}, results={"y": "B, S, H, D"}, static=("D",),
        dtypes={"x": _F}, mlir=_MLIR)
def fp8_qdq(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-`block` FP8 e4m3 quantize->dequantize of the last dim with pow2 scales (amax floor 1e-4), x.dtype out."""
    return block_qdq(x.float().unflatten(-1, (-1, block)), fp4=False).reshape(x.shape).to(x.dtype)


@kernel("fp4_qdq", args={"x": "B, S, H, D", "block": int}, results={"y": "B, S, H, D"}, static=("D",),
        dtypes={"x": _F}, mlir=_MLIR)
def fp4_qdq(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-`block` FP4 e2m1 quantize->dequantize of the last dim with pow2 scales (amax floor 6*2^-126), x.dtype out."""
    return block_qdq(x.float().unflatten(-1, (-1, block)), fp4=True).reshape(x.shape).to(x.dtype)


@kernel("hadamard", args={"x": "B, S, H, D"}, results={"y": "B, S, H, D"}, static=("D",), dtypes={"x": _F},
        mlir=_MLIR)
def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalized Walsh-Hadamard transform of the last dim (scale n^-0.5), fp32 math, input dtype out."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    # log2(n) butterflies (fast Walsh-Hadamard, Sylvester order): only the static last dim is
    # reshaped, which keeps torch.export free of guards on the symbolic leading dims
    y, h = x.float(), 1
    while h < n:
        y = y.unflatten(-1, (n // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], -2).flatten(-3)
        h *= 2
    return (y * n**-0.5).to(x.dtype)
