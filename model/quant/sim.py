"""The reference's quantization simulations (quantize -> dequantize in the value domain).

DeepSeek-V4 was trained with these in the loop (QAT), so the released model runs them at inference:
FP8 e4m3 on the nope dims of window/compressed KV (block 64) and Hadamard + FP4 e2m1 on the
indexer's queries and keys (block 32), both with power-of-two (E8M0) block scales (docs/model.md, Reference numerics).

The simulations themselves (rounding, block scales, the Walsh-Hadamard transform) are kernel hooks
declared in model/kernels/qdq.py (`fp8_qdq`, `fp4_qdq`, `hadamard`: eager runs their torch
references, export inlines one MLIR kernel each); this module is what the model calls, plus the
straight-through estimator for training. The rounding helpers are re-exported from there.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from ..kernels import qdq
from ..kernels.qdq import round_to_e2m1, round_to_e4m3  # noqa: F401


def _on_rank4(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: int) -> torch.Tensor:
    """fn (a last-dim op whose kernel takes [B, S, H, D]) on x of any rank >= 1, by unsqueezing
    leading dims (or flattening the first ones above rank 4); views only, no data movement."""
    if x.dim() > 4:
        return fn(x.flatten(0, -4), *args).unflatten(0, x.shape[:-3])
    pad = 4 - x.dim()
    y = fn(x[(None,) * pad], *args)
    return y[(0,) * pad] if pad else y


def _check_block(x: torch.Tensor, block: int, what: str) -> None:
    if block < 1 or x.shape[-1] % block:
        raise ValueError(f"{what}: last dim {x.shape[-1]} is not a multiple of the block {block}")


def fp8_qdq(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Per-`block` FP8 e4m3 quantize->dequantize of the last dim with pow2 scales (amax floor 1e-4)."""
    _check_block(x, block, "fp8_qdq")
    if _STE and x.requires_grad:
        return _StraightThrough.apply(x, lambda t: qdq.fp8_qdq(t, block))
    return _on_rank4(qdq.fp8_qdq, x, block)


def fp4_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Per-`block` FP4 e2m1 quantize->dequantize of the last dim with pow2 scales (amax floor 6*2^-126)."""
    _check_block(x, block, "fp4_qdq")
    if _STE and x.requires_grad:
        return _StraightThrough.apply(x, lambda t: qdq.fp4_qdq(t, block))
    return _on_rank4(qdq.fp4_qdq, x, block)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalized Walsh-Hadamard transform of the last dim (scale n^-0.5), fp32 math, input dtype out."""
    return _on_rank4(qdq.hadamard, x)


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
    def forward(ctx, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return fn(x)

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
