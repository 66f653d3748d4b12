"""The reference's quantization simulations (quantize -> dequantize in the value domain).

DeepSeek-V4 was trained with these in the loop (QAT), so the released model runs them at inference:
FP8 e4m3 on the nope dims of window/compressed KV (block 64) and Hadamard + FP4 e2m1 on the
indexer's queries and keys (block 32), both with power-of-two (E8M0) block scales (spec §6).

Rounding is written with arithmetic (floor/log2/round) instead of dtype casts: it is bit-identical
to torch's round-to-nearest-even casts (tests/test_quant_sim.py sweeps every code), and unlike
an f32->f8 cast it lowers the same way on every IREE target (llvm-cpu flushes part of the e4m3
subnormal band to zero and gfx942 has no native OCP e4m3; see iree-notes §5).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0


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
    """The reference's E8M0 activation scale: 2^ceil(log2(amax / fmt_max))."""
    return torch.exp2(torch.ceil(torch.log2(amax / fmt_max)))


def fp8_qdq(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Per-`block` FP8 e4m3 quantize->dequantize of the last dim with pow2 scales (amax floor 1e-4)."""
    if _STE and x.requires_grad:
        return _StraightThrough.apply(x, functools.partial(_fp8_qdq, block=block))
    return _fp8_qdq(x, block)


def _fp8_qdq(x: torch.Tensor, block: int) -> torch.Tensor:
    shape, dtype = x.shape, x.dtype
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = pow2_block_scale(amax, E4M3_MAX)
    return (round_to_e4m3(xb / s) * s).reshape(shape).to(dtype)


def fp4_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Per-`block` FP4 e2m1 quantize->dequantize of the last dim with pow2 scales (amax floor 6*2^-126)."""
    if _STE and x.requires_grad:
        return _StraightThrough.apply(x, functools.partial(_fp4_qdq, block=block))
    return _fp4_qdq(x, block)


def _fp4_qdq(x: torch.Tensor, block: int) -> torch.Tensor:
    shape, dtype = x.shape, x.dtype
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0**-126)
    s = pow2_block_scale(amax, E2M1_MAX)
    return (round_to_e2m1(xb / s) * s).reshape(shape).to(dtype)


# ---- straight-through estimator (training only) -------------------------------------------------
# The roundings above have zero gradient almost everywhere, so a model trained with the simulations
# in the loop (QAT, as DeepSeek-V4 was) would get no gradient through the quantized KV / indexer
# tensors. Inside `straight_through()` fp8_qdq/fp4_qdq return the same values but pass the
# gradient through unchanged (d qdq(x)/dx := 1). Off by default: outside the context nothing changes.

_STE = False


@contextlib.contextmanager
def straight_through(enabled: bool = True) -> Iterator[None]:
    """Within the block, fp8_qdq/fp4_qdq backpropagate as the identity (forward values unchanged)."""
    global _STE
    prev, _STE = _STE, enabled
    try:
        yield
    finally:
        _STE = prev


class _StraightThrough(torch.autograd.Function):
    """Forward: qdq(x) exactly (bit-identical to the plain call). Backward: identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, qdq: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return qdq(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@functools.lru_cache(maxsize=8)
def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester (Walsh) ordered Hadamard matrix of size n (a power of two), float32, unnormalized."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


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
