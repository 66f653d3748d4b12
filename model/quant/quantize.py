"""Quantizers: float weights into the official checkpoint's low-bit formats (FP8 e4m3 with 128x128
block scales, MXFP4 with per-32 E8M0 scales), built on the codecs of `formats.py`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .formats import E2M1_MAX, E4M3_MAX, E4M3FN, FP8_BLOCK, MXFP4_BLOCK, e2m1_encode, e8m0_decode, e8m0_encode, fp8_encode, pack_e2m1

__all__ = ["quantize_fp8_block", "quantize_mxfp4"]


def _pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes of the smallest power of two >= x (x floored at 2^-127, E8M0's smallest)."""
    return e8m0_encode(x.double().clamp_min(2.0 ** -127), round_up=True)


def quantize_fp8_block(w: torch.Tensor, scale_fmt: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """Float [N, K] -> (float8_e4m3fn [N, K], scales [ceil(N/128), ceil(K/128)]).

    ue8m0: scale = smallest power of two >= amax/448 per 128x128 block (uint8 E8M0 bytes), so w/scale
    is exact and only the e4m3 rounding (RNE) loses bits. fp32 (-Base style): scale = amax/448."""
    n, k = w.shape
    wf = w.float()
    nb, kb = math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)
    padded = F.pad(wf.abs(), (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    amax = padded.view(nb, FP8_BLOCK, kb, FP8_BLOCK).amax((1, 3))
    if scale_fmt == "fp32":
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        sf = scale
    elif scale_fmt == "ue8m0":
        scale = _pow2_at_least(amax.double() / E4M3_MAX)
        sf = e8m0_decode(scale)
    else:
        raise ValueError(f"unknown scale_fmt {scale_fmt!r}")
    full = sf.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return fp8_encode(wf / full, E4M3FN), scale


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [N, K] -> (packed uint8 [N, K/2], low nibble = element 2i; E8M0 uint8 [N, K/32]) with
    scale = smallest power of two >= amax/6 per 32 consecutive K elements."""
    n, k = w.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"quantize_mxfp4: K={k} is not a multiple of {MXFP4_BLOCK}")
    wf = w.float().view(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    scale = _pow2_at_least(wf.abs().amax(-1).double() / E2M1_MAX)
    codes = e2m1_encode(wf / e8m0_decode(scale)[..., None])
    return pack_e2m1(codes.view(n, k)), scale
